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

use ferry_kernels::backend::mlp::Dense;
use ferry_kernels::backend::moe::Moe;
use ferry_kernels::backend::{AbsorbedKernel, AttnKernels, Backend, Precision, Tensor, Weight};
use ferry_kernels::cpu::mla::MlaDims;
use ferry_kernels::cpu::rope::Rope;

pub use attention::{AttentionForm, FormPolicy};
pub use batch::{
    BatchInputs, BatchLogits, BatchOutput, LogitsWanted, PromptRows, SeqInput,
    PROMPT_LOGITS_CHUNK_FLOATS,
};
pub use forward::{ForwardHooks, Hooks, LayerHook};

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
        a: Weight,
        /// `q_a_layernorm` weight.
        norm: Tensor,
        /// `q_b_proj`: q_lora_rank → heads · qk_head_dim.
        b: Weight,
    },
    /// A full-rank `q_proj` (DeepSeek-V2-Lite).
    Full(Weight),
}

/// One layer's MLA weights.
#[derive(Debug)]
pub struct MlaWeights {
    /// Query projection.
    pub q: QueryProj,
    /// `kv_a_proj_with_mqa`: hidden → kv_lora_rank + qk_rope_head_dim.
    pub kv_a: Weight,
    /// `kv_a_layernorm` weight (kv_lora_rank).
    pub kv_a_norm: Tensor,
    /// `kv_b_proj`: kv_lora_rank → heads · (qk_nope + v); holds W_UK and W_UV.
    pub kv_b: Weight,
    /// `o_proj`: heads · v → hidden.
    pub o: Weight,
}

/// The feed-forward half of a layer.
#[derive(Debug)]
pub enum Ffn {
    /// A dense SiLU-gated MLP (the first `first_k_dense_replace` layers).
    Dense(Box<Dense>),
    /// Routed + shared experts.
    Moe(Box<Moe>),
}

/// One decoder layer.
#[derive(Debug)]
pub struct Layer {
    /// `input_layernorm` weight.
    pub input_norm: Tensor,
    /// Attention weights.
    pub attn: MlaWeights,
    /// `post_attention_layernorm` weight.
    pub post_norm: Tensor,
    /// MLP or MoE.
    pub ffn: Ffn,
}

/// A loaded model on one [`Backend`], ready to run batches against its KV rows.
///
/// There is one forward for every device ([`forward`]): the weights live on the model's
/// backend and every op dispatches on it. [`Self::load`] reads a checkpoint onto the CPU;
/// [`Self::to_backend`] copies it onto a GPU.
#[derive(Debug)]
pub struct DeepseekModel {
    pub(crate) backend: Backend,
    pub(crate) config: ModelConfig,
    pub(crate) embed: Weight,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Tensor,
    /// `None` when tied to the embedding.
    pub(crate) lm_head: Option<Weight>,
    pub(crate) rope: Rope,
    pub(crate) dims: MlaDims,
    pub(crate) scale: f32,
    pub(crate) kernels: AttnKernels,
    pub(crate) policy: FormPolicy,
    /// Logits floats one chunk of prompt log-probability rows may hold
    /// ([`batch::PROMPT_LOGITS_CHUNK_FLOATS`] unless set).
    pub(crate) prompt_chunk_floats: usize,
}

impl DeepseekModel {
    /// The validated configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Where the weights live and the ops run.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// MLA dimensions of every layer.
    pub fn mla_dims(&self) -> &MlaDims {
        &self.dims
    }

    /// The numerics of the device kernels (always exact on the CPU).
    pub fn precision(&self) -> Precision {
        self.kernels.precision
    }

    /// How each chunk's attention form is chosen.
    pub fn policy(&self) -> FormPolicy {
        self.policy
    }

    /// Overrides how each chunk's attention form is chosen (tests, benchmarks).
    pub fn set_policy(&mut self, policy: FormPolicy) {
        self.policy = policy;
    }

    /// Overrides how many logits floats one chunk of prompt log-probability rows may hold
    /// ([`PromptRows`]; default [`PROMPT_LOGITS_CHUNK_FLOATS`]); at least one row per chunk.
    /// Tests use it to split a short prompt's rows over several chunks.
    pub fn set_prompt_logits_chunk(&mut self, floats: usize) {
        self.prompt_chunk_floats = floats;
    }

    /// Which absorbed-form kernel fast mode uses on a GPU: [`AbsorbedKernel::Tile`] (the
    /// default: 16-row head tiles, other head counts zero-padded), `Packed` or `Generic`.
    pub fn set_absorbed_kernel(&mut self, kernel: AbsorbedKernel) {
        self.kernels.absorbed = kernel;
    }

    /// A pool geometry that fits this model, with `num_blocks` blocks of `page_size` tokens.
    pub fn kv_layout(&self, num_blocks: usize, page_size: usize) -> KvLayout {
        KvLayout::for_model(&self.config, num_blocks, page_size)
    }

    /// How a device cache of this model stores its rows: f32 in exact precision; in fast
    /// precision bf16 with the RoPE key as a bf16 pair ([`crate::kv::KvDtype::Bf16Split`]:
    /// the RoPE half of the score needs ~16 bits, docs/gpu.md). The host pool is always f32.
    pub fn kv_dtype(&self) -> crate::kv::KvDtype {
        match self.precision() {
            Precision::Exact => crate::kv::KvDtype::F32,
            Precision::Fast => crate::kv::KvDtype::Bf16Split {
                rope: self.config.qk_rope_head_dim,
            },
        }
    }

    /// A new zeroed host pool for this model.
    pub fn new_kv_pool(&self, num_blocks: usize, page_size: usize) -> Result<KvPool, ModelError> {
        KvPool::new(self.kv_layout(num_blocks, page_size))
    }

    pub(crate) fn lm_head(&self) -> &Weight {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// This model's weights copied onto `backend` with `precision` (host weights must be on the
    /// CPU: a GPU-resident model is not copied again). Routed experts are stacked for the
    /// device kernels, the shared expert as extra expert slots.
    pub fn to_backend(&self, backend: &Backend, precision: Precision) -> Result<Self, ModelError> {
        let host = |w: &Weight| -> Result<Weight, ModelError> {
            Ok(backend.weight(w.host("to_backend", "weight")?)?)
        };
        let vec = |t: &Tensor| -> Result<Tensor, ModelError> {
            Ok(backend.upload(t.host("to_backend", "vector")?)?)
        };
        let mut layers = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let w = &layer.attn;
            let q = match &w.q {
                QueryProj::LowRank { a, norm, b } => QueryProj::LowRank {
                    a: host(a)?,
                    norm: vec(norm)?,
                    b: host(b)?,
                },
                QueryProj::Full(m) => QueryProj::Full(host(m)?),
            };
            let attn = MlaWeights {
                q,
                kv_a: host(&w.kv_a)?,
                kv_a_norm: vec(&w.kv_a_norm)?,
                kv_b: host(&w.kv_b)?,
                o: host(&w.o)?,
            };
            let ffn = match &layer.ffn {
                Ffn::Dense(d) => Ffn::Dense(Box::new(Dense::to_backend(d.host()?, backend)?)),
                Ffn::Moe(m) => Ffn::Moe(Box::new(Moe::to_backend(
                    m.host()?,
                    self.config.n_shared_experts,
                    backend,
                )?)),
            };
            layers.push(Layer {
                input_norm: vec(&layer.input_norm)?,
                attn,
                post_norm: vec(&layer.post_norm)?,
                ffn,
            });
        }
        Ok(Self {
            backend: backend.clone(),
            config: self.config.clone(),
            embed: host(&self.embed)?,
            layers,
            norm: vec(&self.norm)?,
            lm_head: self.lm_head.as_ref().map(host).transpose()?,
            rope: self.rope.clone(),
            dims: self.dims,
            scale: self.scale,
            kernels: AttnKernels {
                precision,
                ..self.kernels
            },
            policy: self.policy,
            prompt_chunk_floats: self.prompt_chunk_floats,
        })
    }

    /// Bytes of weights read per decoded token (dense weights, `top_k` routed + shared
    /// experts per MoE layer, one embedding row and the LM head), for the roofline.
    pub fn active_weight_bytes(&self) -> usize {
        let mut total = self.embed.bytes() / self.config.vocab_size.max(1);
        total += self.lm_head().bytes();
        for l in &self.layers {
            let a = &l.attn;
            total += match &a.q {
                QueryProj::LowRank { a, b, .. } => a.bytes() + b.bytes(),
                QueryProj::Full(m) => m.bytes(),
            };
            total += a.kv_a.bytes() + a.kv_b.bytes() + a.o.bytes();
            total += match &l.ffn {
                Ffn::Dense(d) => d.bytes(),
                Ffn::Moe(m) => m.active_bytes(),
            };
        }
        total
    }
}
