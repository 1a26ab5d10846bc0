//! The drafter's launchers on CUDA: the shared launchers of [`crate::gpu::draft`], which take a
//! [`super::CudaDevice`] as their runtime.

pub use crate::gpu::draft::*;
