//! The CUDA side of the one forward: the device KV cache, graph replay and the GPU benchmarks.
//!
//! The forward itself is [`DeepseekModel`]'s, the same code on every device
//! ([`crate::deepseek::forward`]); what is here is only what a GPU adds around it.
//!
//! | file | owns |
//! |---|---|
//! | this file | [`DeepseekModel::upload`] (a loaded model onto one CUDA device in a [`GpuMode`]) and [`DeepseekModel::new_kv_cache`] |
//! | [`graph`] | [`graph::DecodeGraph`]: one decode step captured as a CUDA graph and replayed, so the host issues one launch per step |
//! | [`kv`] | [`GpuKvCache`]: the paged latent cache of every layer in device memory |
//! | [`bench`] | single-stream decode tokens/s of a random-weight model against the bandwidth roofline |
//! | [`report`] | every GPU benchmark of BENCHMARKS.md as one Markdown report |
//!
//! Two modes: [`GpuMode::Exact`] keeps f32 activations, an f32 latent cache and f32 attention
//! (the parity target: same tolerance as CPU vs Hugging Face); [`GpuMode::Fast`] uses a bf16
//! latent cache whose RoPE key is a bf16 hi/lo pair (the RoPE half of every score needs ~16
//! bits), the tensor-core absorbed tile kernel (with the 12 → 16 pad dispatcher) for decode,
//! the tensor-core MHA kernels for prefill and bf16 GEMM inputs — the serving configuration,
//! within 2e-2 · max|logit| of exact mode on the golden prompts.

pub mod bench;
pub mod graph;
pub mod kv;
pub mod report;

use ferry_kernels::backend::Backend;
use ferry_kernels::cuda::CudaDevice;

pub use kv::GpuKvCache;

use crate::deepseek::DeepseekModel;
use crate::ModelError;

/// Numerics of the GPU forward. Defined with the engine's configuration (which names it
/// whether or not the `cuda` feature is built) and re-exported here.
pub use crate::engine::GpuMode;

impl DeepseekModel {
    /// This (host) model's weights uploaded to `dev`, each tensor keeping its element type.
    pub fn upload(&self, dev: &CudaDevice, mode: GpuMode) -> Result<Self, ModelError> {
        self.to_backend(&Backend::Cuda(dev.clone()), mode.precision())
    }

    /// The CUDA device the model lives on, or an error naming where it is.
    pub fn cuda_device(&self) -> Result<&CudaDevice, ModelError> {
        self.backend.cuda().ok_or_else(|| {
            ModelError::Invalid(format!(
                "the model is on the {}, not a CUDA device",
                self.backend.name()
            ))
        })
    }

    /// A zeroed device latent cache for this model: `num_blocks` blocks of `page_size` tokens
    /// per layer, stored as [`DeepseekModel::kv_dtype`].
    pub fn new_kv_cache(
        &self,
        num_blocks: usize,
        page_size: usize,
    ) -> Result<GpuKvCache, ModelError> {
        GpuKvCache::new(
            self.cuda_device()?,
            self.kv_layout(num_blocks, page_size),
            self.kv_dtype(),
        )
    }
}
