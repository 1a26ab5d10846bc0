//! RoPE / YaRN: per-batch rotation tables, and the rotation of heads' rope parts.

use super::{Backend, Tensor};
use crate::cpu::rope::{Rope, RotaryLayout};
use crate::KernelError;

/// The rotation of one batch's positions, ready for [`rope`] and the latent write.
#[derive(Debug)]
pub enum RopeTable {
    /// The CPU rotates from the parameters and positions.
    Host {
        /// The model's rotary parameters.
        rope: Rope,
        /// One position per token.
        positions: Vec<usize>,
    },
    /// cos/sin tables per token in CUDA device memory.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::ops::RopeTables),
    /// cos/sin tables per token in ROCm device memory.
    #[cfg(feature = "rocm")]
    Rocm(crate::gpu::ops::RopeTables<crate::rocm::RocmDevice>),
}

impl RopeTable {
    /// The tables for `positions` on `b`.
    pub fn new(b: &Backend, rope: &Rope, positions: &[usize]) -> Result<Self, KernelError> {
        Ok(match b {
            Backend::Cpu => RopeTable::Host {
                rope: rope.clone(),
                positions: positions.to_vec(),
            },
            #[cfg(feature = "cuda")]
            Backend::Cuda(dev) => {
                RopeTable::Cuda(crate::cuda::ops::RopeTables::new(dev, rope, positions)?)
            }
            #[cfg(feature = "rocm")]
            Backend::Rocm(dev) => {
                RopeTable::Rocm(crate::gpu::ops::RopeTables::new(dev, rope, positions)?)
            }
        })
    }

    /// Rewrites the tables in place for new `positions` (same count), so a captured graph
    /// reads them.
    pub fn refresh(&mut self, rope: &Rope, positions: &[usize]) -> Result<(), KernelError> {
        match self {
            RopeTable::Host { positions: p, .. } => {
                crate::cpu::gemm::check_len("rope_refresh", "positions", p.len(), positions.len())?;
                p.copy_from_slice(positions);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            RopeTable::Cuda(t) => {
                let dev = t.cos.device().clone();
                t.refresh(&dev, rope, positions)
            }
            #[cfg(feature = "rocm")]
            RopeTable::Rocm(t) => {
                let dev = t.cos.device().clone();
                t.refresh(&dev, rope, positions)
            }
        }
    }

    /// The device tables of the runtime `D`, or a mismatch error naming `op`.
    #[cfg(any(feature = "cuda", feature = "rocm"))]
    pub(crate) fn on<D: super::OnDevice>(
        &self,
        op: &'static str,
    ) -> Result<&crate::gpu::ops::RopeTables<D>, KernelError> {
        D::rope(self).ok_or_else(|| super::mismatch_on::<D>(op, "rope table", self.place()))
    }

    fn place(&self) -> &'static str {
        match self {
            RopeTable::Host { .. } => "CPU",
            #[cfg(feature = "cuda")]
            RopeTable::Cuda(_) => "CUDA device",
            #[cfg(feature = "rocm")]
            RopeTable::Rocm(_) => "ROCm device",
        }
    }
}

/// Rotates the rope part of every head of every token.
#[derive(Debug)]
pub struct ApplyRope<'a> {
    /// `[tokens][heads · head_stride]`, rotated in place.
    pub x: &'a mut Tensor,
    /// The batch's rotation.
    pub table: &'a RopeTable,
    /// Where the rope part sits in each head.
    pub layout: RotaryLayout,
}

/// Runs [`ApplyRope`].
pub fn rope(b: &Backend, p: ApplyRope<'_>) -> Result<(), KernelError> {
    const OP: &str = "rope";
    match (b, p.table) {
        (Backend::Cpu, RopeTable::Host { rope, positions }) => {
            rope.apply(p.x.host_mut(OP, "x")?, positions, p.layout)
        }
        #[cfg(feature = "cuda")]
        (Backend::Cuda(dev), RopeTable::Cuda(t)) => crate::gpu::ops::rope(
            dev,
            super::tv::<crate::cuda::CudaDevice>(p.x, OP, "x")?,
            t,
            p.layout,
        ),
        #[cfg(feature = "rocm")]
        (Backend::Rocm(dev), RopeTable::Rocm(t)) => crate::gpu::ops::rope(
            dev,
            super::tv::<crate::rocm::RocmDevice>(p.x, OP, "x")?,
            t,
            p.layout,
        ),
        #[cfg(any(feature = "cuda", feature = "rocm"))]
        (b, t) => Err(KernelError::DeviceMismatch {
            op: OP,
            what: "table",
            expected: b.name(),
            got: t.place(),
        }),
    }
}
