//! RMSNorm: fused with the residual add between sub-layers, and strided for the latent norms.

use super::{Backend, Tensor};
use crate::KernelError;

/// `h += delta` (when given), then `out = RMSNorm(h) · weight` (when given), row by row.
#[derive(Debug)]
pub struct AddNorm<'a> {
    /// `[rows][width]` residual stream, updated in place.
    pub h: &'a mut Tensor,
    /// `[rows][width]` sub-layer output to add first.
    pub delta: Option<&'a Tensor>,
    /// `[width]` norm weight (unused without `out`).
    pub weight: &'a Tensor,
    /// `[rows][width]` normalised rows; `None` for a bare residual add.
    pub out: Option<&'a mut Tensor>,
    /// Floats per row.
    pub width: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
}

/// Runs [`AddNorm`].
pub fn add_norm(b: &Backend, p: AddNorm<'_>) -> Result<(), KernelError> {
    const OP: &str = "add_rms_norm";
    match b {
        Backend::Cpu => {
            let h = p.h.host_mut(OP, "h")?;
            if let Some(d) = p.delta {
                let d = d.host(OP, "delta")?;
                crate::cpu::gemm::check_len(OP, "delta", h.len(), d.len())?;
                for (a, x) in h.iter_mut().zip(d) {
                    *a += x;
                }
            }
            if let Some(out) = p.out {
                let w = p.weight.host(OP, "weight")?;
                crate::cpu::norm::rms_norm(h, w, p.eps, out.host_mut(OP, "out")?)?;
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => add_norm_on(dev, p),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => add_norm_on(dev, p),
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn add_norm_on<D: super::OnDevice>(dev: &D, p: AddNorm<'_>) -> Result<(), KernelError> {
    use super::tv;
    const OP: &str = "add_rms_norm";
    let delta = p.delta.map(|d| tv::<D>(d, OP, "delta")).transpose()?;
    let out = p.out.map(|o| tv::<D>(o, OP, "out")).transpose()?;
    let h = tv::<D>(p.h, OP, "h")?;
    // A bare add passes `delta` as a stand-in weight; the kernel does not read it.
    let weight = match out {
        Some(_) => tv::<D>(p.weight, OP, "weight")?,
        None => delta.unwrap_or(h),
    };
    let rows = crate::gpu::ops::NormRows {
        h,
        delta,
        weight,
        out,
        width: p.width,
    };
    crate::gpu::ops::add_rms_norm(dev, rows, p.eps)
}

/// RMSNorm in place over the first `weight.len()` floats of every `stride`-wide row.
#[derive(Debug)]
pub struct NormStrided<'a> {
    /// `[rows][stride]`.
    pub x: &'a mut Tensor,
    /// Floats per row.
    pub stride: usize,
    /// Norm weight; its length is the normalised prefix of each row.
    pub weight: &'a Tensor,
    /// RMSNorm epsilon.
    pub eps: f32,
}

/// Runs [`NormStrided`].
pub fn norm_strided(b: &Backend, p: NormStrided<'_>) -> Result<(), KernelError> {
    const OP: &str = "rms_norm_strided";
    match b {
        Backend::Cpu => {
            let w = p.weight.host(OP, "weight")?;
            let x = p.x.host_mut(OP, "x")?;
            if p.stride == w.len() {
                return crate::cpu::norm::rms_norm_inplace(x, w, p.eps);
            }
            for row in x.chunks_exact_mut(p.stride.max(1)) {
                crate::cpu::norm::rms_norm_inplace(&mut row[..w.len()], w, p.eps)?;
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => norm_strided_on(dev, p),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => norm_strided_on(dev, p),
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn norm_strided_on<D: super::OnDevice>(dev: &D, p: NormStrided<'_>) -> Result<(), KernelError> {
    const OP: &str = "rms_norm_strided";
    let (x, w) = (
        super::tv::<D>(p.x, OP, "x")?,
        super::tv::<D>(p.weight, OP, "weight")?,
    );
    crate::gpu::ops::rms_norm_strided(dev, x, p.stride, w, p.eps)
}

/// An RMSNorm, `RMSNorm(h) · weight` ([`rms_norm_into`]).
#[derive(Debug, Clone, Copy)]
pub struct RowNorm<'a> {
    /// `[width]` norm weight.
    pub weight: &'a Tensor,
    /// RMSNorm epsilon.
    pub eps: f32,
}

/// `out = RMSNorm(h) · norm.weight`, row by row (`h` is not written).
pub fn rms_norm_into(
    b: &Backend,
    h: &Tensor,
    norm: RowNorm<'_>,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "rms_norm";
    match b {
        Backend::Cpu => {
            let w = norm.weight.host(OP, "weight")?;
            crate::cpu::norm::rms_norm(h.host(OP, "h")?, w, norm.eps, out.host_mut(OP, "out")?)
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => rms_norm_into_on(dev, h, norm, out),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => rms_norm_into_on(dev, h, norm, out),
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn rms_norm_into_on<D: super::OnDevice>(
    dev: &D,
    h: &Tensor,
    norm: RowNorm<'_>,
    out: &mut Tensor,
) -> Result<(), KernelError> {
    use super::tv;
    const OP: &str = "rms_norm";
    let weight = tv::<D>(norm.weight, OP, "weight")?;
    let rows = crate::gpu::ops::NormRows {
        h: tv::<D>(h, OP, "h")?,
        delta: None,
        weight,
        out: Some(tv::<D>(out, OP, "out")?),
        width: weight.len,
    };
    crate::gpu::ops::add_rms_norm(dev, rows, norm.eps)
}
