//! The embedded default model, compiled into the binary.
//!
//! `models/tiny-k3/` (made by `scripts/make_tiny_k3.py`) is included with `include_bytes!`, so a
//! `ferry` binary copied anywhere — another machine, a container — runs with no model files
//! around. When the source checkout's copy exists it is used directly; otherwise the files are
//! written once to a cache directory keyed by their content hash.

use std::path::{Path, PathBuf};

use anyhow::Context;

const FILES: &[(&str, &[u8])] = &[
    (
        "config.json",
        include_bytes!("../models/tiny-k3/config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../models/tiny-k3/model.safetensors"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../models/tiny-k3/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../models/tiny-k3/tokenizer_config.json"),
    ),
];

/// Name under which the embedded model is served.
pub const EMBEDDED_MODEL_NAME: &str = "tiny-k3";

/// The model directory to load: `explicit` when given, else the embedded model.
pub fn model_dir(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(dir) = explicit {
        return Ok(dir.to_path_buf());
    }
    let source = ferry_model::embedded::default_model_dir();
    if FILES.iter().all(|(name, bytes)| {
        std::fs::metadata(source.join(name)).is_ok_and(|m| m.len() == bytes.len() as u64)
    }) {
        return Ok(source);
    }
    extract()
}

fn extract() -> anyhow::Result<PathBuf> {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (_, bytes) in FILES {
        for b in bytes.iter() {
            hash = (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join("ferry").join(format!("tiny-k3-{hash:016x}"));
    if FILES.iter().all(|(name, _)| dir.join(name).exists()) {
        return Ok(dir);
    }
    // Write into a private temp dir, then rename, so concurrent processes never see a half model.
    let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    for (name, bytes) in FILES {
        std::fs::write(tmp.join(name), bytes)
            .with_context(|| format!("writing {}", tmp.join(name).display()))?;
    }
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        Err(_) if dir.join("model.safetensors").exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(e).with_context(|| format!("moving the embedded model to {}", dir.display())),
    }
}
