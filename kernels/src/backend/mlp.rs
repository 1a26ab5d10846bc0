//! The dense SwiGLU MLP of the first layers, added into the residual stream:
//! `h += down(silu(gate(x)) · up(x))`.

use super::{Backend, Precision, Tensor};
use crate::cpu::mlp::GatedMlp;
use crate::KernelError;

/// A dense MLP's weights on one backend.
#[derive(Debug)]
pub enum Dense {
    /// Host weights.
    Host(GatedMlp),
    /// Device weights.
    #[cfg(feature = "cuda")]
    Cuda {
        /// `[inter][hidden]`.
        gate: crate::cuda::ops::GpuMatrix,
        /// `[inter][hidden]`.
        up: crate::cuda::ops::GpuMatrix,
        /// `[hidden][inter]`.
        down: crate::cuda::ops::GpuMatrix,
    },
    /// ROCm device weights.
    #[cfg(feature = "rocm")]
    Rocm {
        /// `[inter][hidden]`.
        gate: RocmMatrix,
        /// `[inter][hidden]`.
        up: RocmMatrix,
        /// `[hidden][inter]`.
        down: RocmMatrix,
    },
}

#[cfg(feature = "rocm")]
type RocmMatrix = crate::gpu::ops::GpuMatrix<crate::rocm::RocmDevice>;

impl Dense {
    /// `m` on `b`.
    pub fn to_backend(m: &GatedMlp, b: &Backend) -> Result<Self, KernelError> {
        Ok(match b {
            Backend::Cpu => Dense::Host(m.clone()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(dev) => {
                let up = |w| crate::cuda::ops::GpuMatrix::upload(dev, w);
                Dense::Cuda {
                    gate: up(&m.gate)?,
                    up: up(&m.up)?,
                    down: up(&m.down)?,
                }
            }
            #[cfg(feature = "rocm")]
            Backend::Rocm(dev) => {
                let up = |w| RocmMatrix::upload(dev, w);
                Dense::Rocm {
                    gate: up(&m.gate)?,
                    up: up(&m.up)?,
                    down: up(&m.down)?,
                }
            }
        })
    }

    /// The host weights, or a mismatch error.
    pub fn host(&self) -> Result<&GatedMlp, KernelError> {
        match self {
            Dense::Host(m) => Ok(m),
            #[cfg(feature = "cuda")]
            Dense::Cuda { .. } => Err(super::mismatch(
                "dense_mlp",
                "weights",
                &Backend::Cpu,
                "CUDA device",
            )),
            #[cfg(feature = "rocm")]
            Dense::Rocm { .. } => Err(super::mismatch(
                "dense_mlp",
                "weights",
                &Backend::Cpu,
                "ROCm device",
            )),
        }
    }

    /// Bytes of weights read per token.
    pub fn bytes(&self) -> usize {
        match self {
            Dense::Host(m) => m.gate.bytes() + m.up.bytes() + m.down.bytes(),
            #[cfg(feature = "cuda")]
            Dense::Cuda { gate, up, down } => gate.bytes() + up.bytes() + down.bytes(),
            #[cfg(feature = "rocm")]
            Dense::Rocm { gate, up, down } => gate.bytes() + up.bytes() + down.bytes(),
        }
    }
}

/// `h += mlp(x)`.
#[derive(Debug)]
pub struct DenseFfn<'a> {
    /// The weights.
    pub w: &'a Dense,
    /// `[T][hidden]` normalised inputs.
    pub x: &'a Tensor,
    /// `[T][hidden]` residual stream.
    pub h: &'a mut Tensor,
    /// GEMM input precision on a GPU.
    pub precision: Precision,
}

/// Runs [`DenseFfn`].
pub fn dense(b: &Backend, p: DenseFfn<'_>) -> Result<(), KernelError> {
    const OP: &str = "dense_mlp";
    match (b, p.w) {
        (Backend::Cpu, Dense::Host(m)) => {
            super::add_residual_host(OP, p.x, p.h, |x, y| m.forward(x, y))
        }
        #[cfg(feature = "cuda")]
        (Backend::Cuda(dev), Dense::Cuda { gate, up, down }) => dense_on(dev, [gate, up, down], p),
        #[cfg(feature = "rocm")]
        (Backend::Rocm(dev), Dense::Rocm { gate, up, down }) => dense_on(dev, [gate, up, down], p),
        #[cfg(any(feature = "cuda", feature = "rocm"))]
        (b, _) => Err(KernelError::DeviceMismatch {
            op: OP,
            what: "weights",
            expected: b.name(),
            got: "another backend",
        }),
    }
}

/// The GPU arm: gate and up projections, `silu(g) · u`, the down projection, the residual add.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn dense_on<D: super::OnDevice>(
    dev: &D,
    [gate, up, down]: [&crate::gpu::ops::GpuMatrix<D>; 3],
    p: DenseFfn<'_>,
) -> Result<(), KernelError> {
    use crate::gpu::launch::DeviceMem;
    use crate::gpu::ops;
    const OP: &str = "dense_mlp";
    let gemm = p.precision.gemm();
    let x = super::tv::<D>(p.x, OP, "x")?;
    let t = x.len / gate.cols().max(1);
    let g = dev.alloc::<f32>(t * gate.rows())?;
    let u = dev.alloc::<f32>(t * up.rows())?;
    ops::linear(dev, x, gate, g.v(), gemm)?;
    ops::linear(dev, x, up, u.v(), gemm)?;
    ops::silu_mul(dev, g.v(), u.v())?;
    let y = dev.alloc::<f32>(t * down.rows())?;
    ops::linear(dev, g.v(), down, y.v(), gemm)?;
    let rows = ops::NormRows {
        h: super::tv::<D>(p.h, OP, "h")?,
        delta: Some(y.v()),
        weight: y.v(),
        out: None,
        width: down.rows(),
    };
    ops::add_rms_norm(dev, rows, 0.0)
}
