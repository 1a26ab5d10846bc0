//! The CPU reference backend: f32 compute, bf16 or f32 weights, rayon for threads.
//!
//! Every GPU backend is tested against these functions, and they in turn follow Hugging Face
//! transformers' `DeepseekV3ForCausalLM` (float32) operation by operation.
//!
//! | module | owns |
//! |---|---|
//! | [`draft`] | the speculative drafter's math: block attention over paged context rows, tap concatenation, the confidence head |
//! | [`logits`] | a request's penalties, `logit_bias` and `min_tokens` mask, applied to its logits before sampling |
//! | [`gemm`] | [`Matrix`] (torch `nn.Linear.weight` layout) and `linear` / `matmul_f32` |
//! | [`norm`] | RMSNorm |
//! | [`rope`] | rotary tables (plain, YaRN) and their application, interleaved or not |
//! | [`mlp`] | the SwiGLU block used by dense layers and experts |
//! | [`moe`] | DeepSeek-V3 grouped sigmoid routing and the expert sum |
//! | [`softmax`] | row softmax / log-softmax (the sampler's), and attention's vectorised softmax |
//! | [`mla`] | MLA attention over the paged latent cache: MHA form, absorbed form, tiled kernel |
//! | [`sample`] | sampling parameters, the filters and the seeded sampler |
//! | `scratch` | per-thread reusable buffers for kernels' intermediates |
//! | [`verify`] | lossless speculative verification: accept / correct / bonus per request |

pub mod draft;
pub mod gemm;
pub mod logits;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod rope;
pub mod sample;
mod scratch;
pub mod softmax;
pub mod verify;

pub use gemm::{linear, matmul_f32, MatmulDims, Matrix, MatrixData};
pub use mlp::GatedMlp;
pub use moe::{MoeLayer, MoeRouting};
pub use rope::{Rope, RopeParams, RopeScaling, RotaryLayout, YarnParams};
pub use sample::{Sampler, SamplingParams};
pub use verify::{verify, verify_batch, verify_probs, DraftProbs, Verified, VerifyRequest};
