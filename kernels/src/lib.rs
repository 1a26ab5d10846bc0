//! Compute backends for ferry.
//!
//! The CPU reference backend holds plain, f32-accumulating implementations
//! of every operation a DeepSeek-V3-family (MLA + MoE) forward pass needs, written to match
//! Hugging Face transformers' float32 `DeepseekV3ForCausalLM` to about 1e-5 relative. GPU
//! backends are tested against it.
//!
//! | module | owns |
//! |---|---|
//! | [`backend`] | the op-level device backend the one forward is written over: [`backend::Backend`], buffers, weights, one module per coarse op |
//! | [`error`] | [`KernelError`], the one error type |
//! | [`ops`] | backend-independent planning (the MLA head-pad plan) |
//! | [`cpu::gemm`] | weights ([`cpu::Matrix`]) and `x · Wᵀ` |
//! | [`cpu::norm`] | RMSNorm |
//! | [`cpu::rope`] | RoPE / YaRN tables and rotation |
//! | [`cpu::mlp`] | SwiGLU MLP |
//! | [`cpu::moe`] | grouped sigmoid routing and the MoE layer |
//! | [`cpu::softmax`] | row softmax |
//! | [`cpu::mla`] | MLA attention over a paged latent cache (MHA form, absorbed form, tiled kernel) |
//! | [`cpu::sample`] | sampling parameters, filters and the seeded sampler |
//! | [`device`] | [`Device`] (`cpu`, `cuda[:N]`, `rocm[:N]`) and probing without panics |
//! | [`gpu`] | the CUDA/HIP kernel sources (`*.cu`, `compat.cuh`) and, with a GPU feature, their typed launchers, generic over the runtime (`gpu::launch::Gpu`) |
//! | `cuda` | the CUDA runtime (feature `cuda`, default): context, NVRTC, cuBLAS, staging; the launchers with CUDA's types |
//! | `rocm` | the ROCm runtime (feature `rocm`): HIP through hip-sys, hipRTC, `RocmDevice` (`backend::Backend::Rocm`; never executed on an AMD GPU) |

#![warn(missing_docs)]

pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod error;
pub mod gpu;
pub mod ops;
#[cfg(feature = "rocm")]
pub mod rocm;

pub use device::Device;
pub use error::KernelError;
