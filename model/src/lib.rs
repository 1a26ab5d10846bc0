//! DeepSeek-V3-family models (DeepSeek-V3, Kimi K2, the K3-shaped embedded model) for ferry.
//!
//! | module | owns |
//! |---|---|
//! | [`config`] | Hugging Face `config.json` → validated [`config::ModelConfig`] (re-exported from `ferry-modelcard`) |
//! | [`weights`] | memory-mapped safetensors (bf16, f32, fp8 e4m3 with 128×128 block scales); [`weights::TensorSource`] |
//! | [`dummy`] | `--load-format dummy`: seeded random weights of a config's shapes |
//! | [`tokenizer`] | `tokenizer.json` and chat templates (re-exported from `ferry-modelcard`) |
//! | [`kv`] | the paged latent KV pool, block allocation and per-sequence block tables |
//! | [`deepseek`] | the batched forward: prefill of many sequences, decode steps, cached-prefix reuse |
//! | [`drafter`] | speculative decoding's DSpark drafter and the [`drafter::Drafter`] interface the engine drives |
//! | [`session`] | one sequence over a pool: reserve blocks, run, advance (CLI and tests) |
//! | [`engine`] | the engine thread: continuous batching, local and remote prefill, prefill jobs with per-layer KV streaming |
//! | `gpu` | the whole forward on a CUDA device (feature `cuda`): weights and paged KV in device memory |
//! | `rocm` | the ROCm latent cache (feature `rocm`): the same forward on `Backend::Rocm` over HIP device memory (never run on an AMD GPU) |
//! | [`embedded`] | the embedded default model and drafter, compiled in (re-exported from `ferry-modelcard`) |
pub use ferry_modelcard::config;
pub mod deepseek;
pub mod drafter;
pub mod dummy;
pub use ferry_modelcard::embedded;
pub use ferry_modelcard::grammar;
pub mod engine;
pub mod error;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod kv;
#[cfg(feature = "rocm")]
pub mod rocm;
pub mod session;
pub use ferry_modelcard::tokenizer;
pub mod weights;

pub use error::{CardError, ModelError};
