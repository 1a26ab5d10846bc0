//! The DeepSeek-V3-family forward (DeepSeek-V3, Kimi K2, the K3-shaped embedded model).
//!
//! | file | owns |
//! |---|---|
//! | [`load`] | weights → per-layer structs, checked against the config |
//! | [`batch`] | [`BatchInputs`]: the contract between a scheduler and the forward |
//! | [`attention`] | MLA per layer: projections, RoPE, latent cache writes, MHA vs absorbed form |
//! | [`forward`] | the batched forward: any mix of prefill chunks and decode steps |
//!
//! Semantics follow Hugging Face transformers' `DeepseekV3ForCausalLM` exactly (the golden
//! parity tests hold us to it): pre-norm residual blocks, MLA with low-rank q and kv, DeepSeek's
//! interleaved RoPE on the rope part, noaux_tc MoE routing with shared experts.
pub mod attention;
pub mod batch;
pub mod forward;
pub mod load;

use ferry_kernels::cpu::gemm::Matrix;
use ferry_kernels::cpu::mla::MlaDims;
use ferry_kernels::cpu::mlp::GatedMlp;
use ferry_kernels::cpu::moe::MoeLayer;
use ferry_kernels::cpu::rope::Rope;

pub use attention::{AttentionForm, FormPolicy};
pub use batch::{BatchInputs, BatchOutput, LogitsWanted, SeqInput};
pub use forward::LayerHook;

use crate::config::ModelConfig;
use crate::kv::{KvLayout, KvPool};
use crate::ModelError;

/// RMSNorm epsilon transformers uses for `q_a_layernorm` and `kv_a_layernorm` (their
/// constructor default, not `config.rms_norm_eps`).
pub const LATENT_NORM_EPS: f32 = 1e-6;

/// How queries are produced.
#[derive(Debug)]
pub enum QueryProj {
    /// `q_b(norm(q_a(x)))` (DeepSeek-V3, K2, K3).
    LowRank {
        /// `q_a_proj`: hidden → q_lora_rank.
        a: Matrix,
        /// `q_a_layernorm` weight.
        norm: Vec<f32>,
        /// `q_b_proj`: q_lora_rank → heads · qk_head_dim.
        b: Matrix,
    },
    /// A full-rank `q_proj` (DeepSeek-V2-Lite).
    Full(Matrix),
}

/// One layer's MLA weights.
#[derive(Debug)]
pub struct MlaWeights {
    /// Query projection.
    pub q: QueryProj,
    /// `kv_a_proj_with_mqa`: hidden → kv_lora_rank + qk_rope_head_dim.
    pub kv_a: Matrix,
    /// `kv_a_layernorm` weight (kv_lora_rank).
    pub kv_a_norm: Vec<f32>,
    /// `kv_b_proj`: kv_lora_rank → heads · (qk_nope + v); holds W_UK and W_UV.
    pub kv_b: Matrix,
    /// `o_proj`: heads · v → hidden.
    pub o: Matrix,
}

/// The feed-forward half of a layer.
#[derive(Debug)]
pub enum Ffn {
    /// A dense SiLU-gated MLP (the first `first_k_dense_replace` layers).
    Dense(GatedMlp),
    /// Routed + shared experts.
    Moe(Box<MoeLayer>),
}

/// One decoder layer.
#[derive(Debug)]
pub struct Layer {
    /// `input_layernorm` weight.
    pub input_norm: Vec<f32>,
    /// Attention weights.
    pub attn: MlaWeights,
    /// `post_attention_layernorm` weight.
    pub post_norm: Vec<f32>,
    /// MLP or MoE.
    pub ffn: Ffn,
}

/// A loaded model, ready to run batches against a [`KvPool`].
#[derive(Debug)]
pub struct DeepseekModel {
    config: ModelConfig,
    embed: Matrix,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `None` when tied to the embedding.
    lm_head: Option<Matrix>,
    rope: Rope,
    dims: MlaDims,
    scale: f32,
}

impl DeepseekModel {
    /// This model without its decoder layers: the configuration, embedding, final norm and LM
    /// head — what a drafter shares with its target (`embed_tokens`, `lm_head_logits`). Kept on
    /// the host beside a GPU forward whose drafter runs on the CPU; its own forward refuses
    /// every batch (no layers match the KV).
    pub(crate) fn into_shared_layers(mut self) -> Self {
        self.layers = Vec::new();
        self
    }

    /// The validated configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// MLA dimensions of every layer.
    pub fn mla_dims(&self) -> &MlaDims {
        &self.dims
    }

    /// A pool geometry that fits this model, with `num_blocks` blocks of `page_size` tokens.
    pub fn kv_layout(&self, num_blocks: usize, page_size: usize) -> KvLayout {
        KvLayout {
            num_layers: self.layers.len(),
            num_blocks,
            page_size,
            width: self.config.latent_width(),
        }
    }

    /// A new zeroed pool for this model.
    pub fn new_kv_pool(&self, num_blocks: usize, page_size: usize) -> Result<KvPool, ModelError> {
        KvPool::new(self.kv_layout(num_blocks, page_size))
    }

    fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Read-only views of a loaded model's weights, for other backends (the GPU forward uploads
/// them once).
pub(crate) struct ModelParts<'a> {
    pub embed: &'a Matrix,
    pub layers: &'a [Layer],
    pub norm: &'a [f32],
    pub lm_head: &'a Matrix,
    pub rope: &'a Rope,
    pub dims: MlaDims,
    pub scale: f32,
}

impl DeepseekModel {
    pub(crate) fn parts(&self) -> ModelParts<'_> {
        ModelParts {
            embed: &self.embed,
            layers: &self.layers,
            norm: &self.norm,
            lm_head: self.lm_head(),
            rope: &self.rope,
            dims: self.dims,
            scale: self.scale,
        }
    }
}
