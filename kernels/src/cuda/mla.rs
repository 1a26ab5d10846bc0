//! MLA attention launchers on CUDA: the shared launchers of [`crate::gpu::mla`] (absorbed tile /
//! head-packed / per-head kernels, the 12 → 16 pad dispatcher, MHA-form prefill), which take
//! a [`super::CudaDevice`] as their runtime.

pub use crate::gpu::mla::*;
