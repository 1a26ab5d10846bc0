//! `y = x · Wᵀ`: the one linear op of every projection.
//!
//! CPU: the `gemm` crate over bf16 or f32 weights ([`crate::cpu::gemm::linear`]). CUDA: a GEMV
//! kernel for ≤ 8 rows (decode), cuBLAS above, with the activations split into two bf16 halves
//! ([`Precision::Exact`]) or rounded to bf16 ([`Precision::Fast`]) against bf16 weights. ROCm:
//! the same GEMV, and above it the portable tiled GEMM (`gemm_tiled_*`, f32 activations in
//! both precisions).

use super::{Backend, Precision, Tensor, Weight};
use crate::KernelError;

const OP: &str = "linear";

/// One projection.
#[derive(Debug, Clone, Copy)]
pub struct Linear<'a> {
    /// `[rows][w.cols]` inputs.
    pub x: &'a Tensor,
    /// `[out][in]` weight.
    pub w: &'a Weight,
    /// GEMM input precision on a GPU.
    pub precision: Precision,
}

/// `[rows][w.rows]` outputs, a new tensor on `b`.
pub fn linear(b: &Backend, p: Linear<'_>) -> Result<Tensor, KernelError> {
    let rows = p.x.len() / p.w.cols().max(1);
    let mut out = b.scratch(rows * p.w.rows())?;
    linear_into(b, p, &mut out)?;
    Ok(out)
}

/// [`linear`] into an existing `[rows][w.rows]` tensor (a captured graph's logits buffer).
pub fn linear_into(b: &Backend, p: Linear<'_>, out: &mut Tensor) -> Result<(), KernelError> {
    let k = p.w.cols();
    if k == 0 || p.x.len() % k != 0 {
        return Err(KernelError::NotDivisible {
            op: OP,
            what: "x",
            len: p.x.len(),
            width: k,
        });
    }
    match b {
        Backend::Cpu => {
            let x = p.x.host(OP, "x")?;
            let w = p.w.host(OP, "w")?;
            crate::cpu::gemm::linear(x, w, out.host_mut(OP, "out")?)
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => on_gpu(dev, p, out),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => on_gpu(dev, p, out),
    }
}

/// The GPU arm, one for every runtime.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn on_gpu<D: super::OnDevice>(dev: &D, p: Linear<'_>, out: &Tensor) -> Result<(), KernelError> {
    use super::{tv, wv};
    let (x, w, y) = (
        tv::<D>(p.x, OP, "x")?,
        wv::<D>(p.w, OP, "w")?,
        tv::<D>(out, OP, "out")?,
    );
    crate::gpu::ops::linear(dev, x, w, y, p.precision.gemm())
}
