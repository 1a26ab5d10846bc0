//! Sampling and verification launchers on CUDA: the shared launchers of [`crate::gpu::sample`],
//! which take a [`super::CudaDevice`] as their runtime.

pub use crate::gpu::sample::*;
