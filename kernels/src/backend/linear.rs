//! `y = x · Wᵀ`: the one linear op of every projection.
//!
//! CPU: the `gemm` crate over bf16 or f32 weights ([`crate::cpu::gemm::linear`]). CUDA: a GEMV
//! kernel for one row (decode), a tensor-core skinny GEMM for 2–16 rows of bf16 weights (small
//! decode batches, a speculative round's verify forward; `crate::gpu::ops::gemv_mma`), else
//! the GEMV for ≤ 8 rows and cuBLAS above, with the activations split into two bf16 halves
//! ([`Precision::Exact`]) or rounded to bf16 ([`Precision::Fast`]) against bf16 weights. ROCm:
//! the same GEMV, and above it the portable tiled GEMM (`gemm_tiled_*`, f32 activations in
//! both precisions).
//!
//! [`linear_pair`]: two projections of the same input (an attention layer's first query
//! projection and `kv_a`), one GEMV launch on a GPU for decode-sized inputs. [`linear_add`]: a
//! projection added into the residual stream (`o_proj`), accumulated in place on a GPU.

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

/// `h += x · Wᵀ` (a sub-layer's output projection added into the residual stream): on a GPU
/// the GEMV, the skinny GEMM (2–16 rows) or the large GEMM adds into `h` itself — for the
/// first two bitwise `h + linear(x)` — with no separate add (unless fusion is off,
/// [`super::fuse`]); on the CPU [`linear`] then the add.
pub fn linear_add(b: &Backend, p: Linear<'_>, h: &mut Tensor) -> Result<(), KernelError> {
    match b {
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) if super::fuse() => return add_on_gpu(dev, p, h),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) if super::fuse() => return add_on_gpu(dev, p, h),
        _ => {}
    }
    let y = linear(b, p)?;
    let add = super::norm::AddNorm {
        h,
        delta: Some(&y),
        weight: &y,
        out: None,
        width: p.w.rows(),
        eps: 0.0,
    };
    super::norm::add_norm(b, add)
}

/// The accumulating GPU projection.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn add_on_gpu<D: super::OnDevice>(
    dev: &D,
    p: Linear<'_>,
    h: &mut Tensor,
) -> Result<(), KernelError> {
    use super::{tv, wv};
    let (x, w, y) = (
        tv::<D>(p.x, OP, "x")?,
        wv::<D>(p.w, OP, "w")?,
        tv::<D>(h, OP, "h")?,
    );
    crate::gpu::ops::linear_add(dev, x, w, y, p.precision.gemm())
}

/// Two projections of the same input, `x · Wfirstᵀ` and `x · Wsecondᵀ`.
#[derive(Debug, Clone, Copy)]
pub struct LinearPair<'a> {
    /// `[rows][k]` inputs.
    pub x: &'a Tensor,
    /// `[n1][k]` weight of the first output.
    pub first: &'a Weight,
    /// `[n2][k]` weight of the second output.
    pub second: &'a Weight,
    /// GEMM input precision on a GPU.
    pub precision: Precision,
}

/// `([rows][n1], [rows][n2])`, new tensors on `b`. On a GPU, unless fusion is off
/// ([`super::fuse`]), both projections go through one launch where a kernel takes them: 2–16
/// rows of bf16 weights by the tensor-core skinny GEMM
/// ([`crate::gpu::ops::gemv_mma_fits`], the first weight's rows a multiple of 8), else up to 8
/// rows with both weights of one element type by `gemv_pair` — in both cases bitwise what two
/// [`linear`] calls give. More rows on CUDA: both on cuBLAS from one conversion of `x` to bf16
/// (a cast, or a hi/lo split in exact mode), also bitwise the two calls. Everything else is two
/// [`linear`] calls.
pub fn linear_pair(b: &Backend, p: LinearPair<'_>) -> Result<(Tensor, Tensor), KernelError> {
    let one = |w| Linear {
        x: p.x,
        w,
        precision: p.precision,
    };
    #[cfg(any(feature = "cuda", feature = "rocm"))]
    {
        let k = p.first.cols();
        let rows = p.x.len() / k.max(1);
        let fits = k > 0 && p.second.cols() == k && rows * k == p.x.len() && super::fuse();
        if fits {
            let fused = match b {
                Backend::Cpu => None,
                #[cfg(feature = "cuda")]
                Backend::Cuda(dev) => pair_on_gpu(b, dev, p, rows)?,
                #[cfg(feature = "rocm")]
                Backend::Rocm(dev) => pair_on_gpu(b, dev, p, rows)?,
            };
            if let Some(pair) = fused {
                return Ok(pair);
            }
        }
    }
    Ok((linear(b, one(p.first))?, linear(b, one(p.second))?))
}

/// The fused GPU arm: `None` (nothing launched) where no fused path takes the pair.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn pair_on_gpu<D: super::OnDevice>(
    b: &Backend,
    dev: &D,
    p: LinearPair<'_>,
    rows: usize,
) -> Result<Option<(Tensor, Tensor)>, KernelError> {
    use super::{tv, wv};
    use crate::gpu::launch::DeviceMem;
    use crate::gpu::ops;
    let (w1, w2) = (
        wv::<D>(p.first, OP, "first")?,
        wv::<D>(p.second, OP, "second")?,
    );
    let x = tv::<D>(p.x, OP, "x")?;
    // Fused only where both projections alone would take the same kernel, so the pair is
    // bitwise the two calls.
    let (m1, m2) = (
        ops::gemv_mma_fits(dev, rows, x, w1),
        ops::gemv_mma_fits(dev, rows, x, w2),
    );
    let mma = m1 && m2 && w1.rows() % 8 == 0;
    let gemv = !m1 && !m2 && rows <= ops::GEMV_MAX_M && w1.is_bf16() == w2.is_bf16();
    // Past the skinny GEMM both go to the vendor GEMM: convert x for it once.
    let large =
        rows > ops::GEMV_MMA_MAX_M && D::VENDOR_GEMM.is_some() && w1.is_bf16() && w2.is_bf16();
    if !mma && !gemv && !large {
        return Ok(None);
    }
    let a = b.scratch(rows * p.first.rows())?;
    let c = b.scratch(rows * p.second.rows())?;
    let (o1, o2) = (tv::<D>(&a, OP, "out")?, tv::<D>(&c, OP, "out")?);
    if mma {
        ops::gemv_mma(dev, x, (w1, o1), Some((w2, o2)), false)?;
    } else if gemv {
        ops::gemv_pair(dev, x, (w1, o1), (w2, o2))?;
    } else {
        let gemm = p.precision.gemm();
        let xs = ops::bf16_rows(dev, x, gemm)?;
        for (w, out) in [(w1, o1), (w2, o2)] {
            let out = ops::GemmOut {
                out,
                accumulate: false,
            };
            if !dev.gemm_split((xs.v(), rows), w, out, gemm)? {
                return Err(KernelError::InvalidParam {
                    op: OP,
                    field: "w",
                    limit: "bf16 weights on a runtime with a vendor GEMM",
                    value: "refused by gemm_split".into(),
                });
            }
        }
    }
    Ok(Some((a, c)))
}
