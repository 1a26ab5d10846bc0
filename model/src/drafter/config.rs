//! The drafter's `config.json` → a validated [`DrafterConfig`].
//!
//! ```json
//! {
//!   "architectures": ["DSparkDrafter"],
//!   "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
//!   "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 512,
//!   "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 2048,
//!   "target_layer_ids": [1, 2], "block_size": 4, "mask_token_id": 4, "markov_rank": 32
//! }
//! ```
//!
//! `hidden_size` and `vocab_size` must equal the target's (the drafter shares the target's
//! embedding and LM head); `target_layer_ids` name target decoder layers (0-based) whose output
//! residual stream is tapped.

use std::path::Path;

use serde::Deserialize;

use crate::config::ModelConfig;
use crate::ModelError;

/// The architecture name a drafter `config.json` declares.
pub const DSPARK_ARCHITECTURE: &str = "DSparkDrafter";

#[derive(Debug, Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
    intermediate_size: usize,
    #[serde(default = "default_eps")]
    rms_norm_eps: f32,
    #[serde(default = "default_theta")]
    rope_theta: f64,
    vocab_size: usize,
    target_layer_ids: Vec<usize>,
    block_size: usize,
    mask_token_id: u32,
    markov_rank: usize,
}

fn default_eps() -> f32 {
    1e-6
}

fn default_theta() -> f64 {
    10_000.0
}

/// A validated drafter configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterConfig {
    /// Width of the residual stream (the target's `hidden_size`).
    pub hidden_size: usize,
    /// Drafter decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_kv_heads: usize,
    /// Width of each head.
    pub head_dim: usize,
    /// Width of each layer's SwiGLU MLP.
    pub intermediate_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base (plain RoPE over the whole head, `rotate_half` layout).
    pub rope_theta: f64,
    /// Vocabulary (the target's).
    pub vocab_size: usize,
    /// Target decoder layers whose outputs form the context feature, in concatenation order.
    pub target_layer_ids: Vec<usize>,
    /// Block length B: one drafter pass over `[anchor, MASK × (B − 1)]` yields B drafts.
    pub block_size: usize,
    /// The token fed at the masked block positions.
    pub mask_token_id: u32,
    /// Rank of the Markov head's `W1 · W2` factorisation.
    pub markov_rank: usize,
}

fn field(name: &str, message: impl Into<String>) -> ModelError {
    ModelError::config(name, message)
}

impl DrafterConfig {
    /// Reads and validates `config.json` (self-consistency only; see [`Self::check_target`]).
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::io(path, source))?;
        Self::from_json(&text)
    }

    /// Parses and validates a drafter `config.json` body.
    pub fn from_json(text: &str) -> Result<Self, ModelError> {
        let raw: RawConfig = serde_json::from_str(text)
            .map_err(|e| field("<drafter config.json>", e.to_string()))?;
        if let Some(archs) = &raw.architectures {
            if !archs.iter().any(|a| a == DSPARK_ARCHITECTURE) {
                return Err(field(
                    "architectures",
                    format!("must contain \"{DSPARK_ARCHITECTURE}\", got {archs:?}"),
                ));
            }
        }
        for (name, v) in [
            ("hidden_size", raw.hidden_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", raw.num_attention_heads),
            ("num_key_value_heads", raw.num_key_value_heads),
            ("head_dim", raw.head_dim),
            ("intermediate_size", raw.intermediate_size),
            ("vocab_size", raw.vocab_size),
            ("block_size", raw.block_size),
            ("markov_rank", raw.markov_rank),
        ] {
            if v == 0 {
                return Err(field(name, "must be > 0, got 0"));
            }
        }
        if raw.num_attention_heads % raw.num_key_value_heads != 0 {
            return Err(field(
                "num_attention_heads",
                format!(
                    "must be a multiple of num_key_value_heads ({}), got {}",
                    raw.num_key_value_heads, raw.num_attention_heads
                ),
            ));
        }
        if raw.head_dim % 2 != 0 {
            return Err(field(
                "head_dim",
                format!("must be even (RoPE), got {}", raw.head_dim),
            ));
        }
        if raw.target_layer_ids.is_empty() {
            return Err(field("target_layer_ids", "must name at least one layer"));
        }
        if raw.mask_token_id as usize >= raw.vocab_size {
            return Err(field(
                "mask_token_id",
                format!(
                    "must be < vocab_size {}, got {}",
                    raw.vocab_size, raw.mask_token_id
                ),
            ));
        }
        if !(raw.rms_norm_eps.is_finite() && raw.rms_norm_eps > 0.0) {
            return Err(field(
                "rms_norm_eps",
                format!("must be finite and > 0, got {}", raw.rms_norm_eps),
            ));
        }
        Ok(Self {
            hidden_size: raw.hidden_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads: raw.num_key_value_heads,
            head_dim: raw.head_dim,
            intermediate_size: raw.intermediate_size,
            rms_norm_eps: raw.rms_norm_eps,
            rope_theta: raw.rope_theta,
            vocab_size: raw.vocab_size,
            target_layer_ids: raw.target_layer_ids,
            block_size: raw.block_size,
            mask_token_id: raw.mask_token_id,
            markov_rank: raw.markov_rank,
        })
    }

    /// Checks the drafter fits `target`: same hidden size and vocabulary (shared embedding and
    /// LM head), taps at existing layers.
    pub fn check_target(&self, target: &ModelConfig) -> Result<(), ModelError> {
        if self.hidden_size != target.hidden_size {
            return Err(field(
                "hidden_size",
                format!(
                    "must equal the target's hidden_size {}, got {}",
                    target.hidden_size, self.hidden_size
                ),
            ));
        }
        if self.vocab_size != target.vocab_size {
            return Err(field(
                "vocab_size",
                format!(
                    "must equal the target's vocab_size {}, got {}",
                    target.vocab_size, self.vocab_size
                ),
            ));
        }
        if let Some(bad) = self
            .target_layer_ids
            .iter()
            .find(|&&l| l >= target.num_hidden_layers)
        {
            return Err(field(
                "target_layer_ids",
                format!(
                    "must be < the target's {} layers, got {bad}",
                    target.num_hidden_layers
                ),
            ));
        }
        Ok(())
    }

    /// Floats of one context row per drafter layer: K then V, `2 × kv_heads × head_dim`.
    pub fn kv_width(&self) -> usize {
        2 * self.num_kv_heads * self.head_dim
    }

    /// Width of the concatenated tapped hidden states (`fc` input).
    pub fn feature_width(&self) -> usize {
        self.hidden_size * self.target_layer_ids.len()
    }
}
