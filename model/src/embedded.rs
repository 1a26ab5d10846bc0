//! The embedded default model, `models/tiny-k3/` at the repository root.
//!
//! A ~3.8M-parameter `DeepseekV3ForCausalLM` with Kimi K3's proportions (12 heads, low-rank q
//! and kv, a dense first layer, 16 routed experts top-4 in 4 groups + 2 shared, YaRN RoPE) and
//! a 2,048-token byte-level BPE, both made by `scripts/make_tiny_k3.py`. Commands that take
//! `--model` fall back to it, so ferry runs on a fresh checkout with nothing downloaded.

use std::path::PathBuf;

/// Directory of the embedded model as built into this binary (the source checkout's
/// `models/tiny-k3`); `FERRY_MODELS_DIR` is not consulted here — callers pass `--model`.
pub fn default_model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("models")
        .join("tiny-k3")
}
