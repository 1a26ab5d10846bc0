//! Row lookups: the embedding of the batch's tokens, and the rows whose logits are wanted.

use super::{Backend, Ints, Tensor, Weight};
use crate::KernelError;

/// Embedding rows of `ids`.
#[derive(Debug, Clone, Copy)]
pub struct Embed<'a> {
    /// `[vocab][hidden]` table.
    pub table: &'a Weight,
    /// Token ids, one per output row.
    pub ids: &'a Ints,
}

/// `[ids][hidden]` rows of the table (f32), a new tensor.
pub fn embed(b: &Backend, p: Embed<'_>) -> Result<Tensor, KernelError> {
    const OP: &str = "embed";
    let hidden = p.table.cols();
    let mut out = b.scratch(p.ids.len() * hidden)?;
    match b {
        Backend::Cpu => {
            let table = p.table.host(OP, "table")?;
            let dst = out.host_mut(OP, "out")?;
            for (row, &id) in dst.chunks_exact_mut(hidden).zip(p.ids.host(OP, "ids")?) {
                let id = super::host_index(OP, "token id", id.into(), table.rows())?;
                table.row_f32(id, row)?;
            }
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => embed_on(dev, p, &out)?,
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => embed_on(dev, p, &out)?,
    }
    Ok(out)
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn embed_on<D: super::OnDevice>(dev: &D, p: Embed<'_>, out: &Tensor) -> Result<(), KernelError> {
    const OP: &str = "embed";
    let (ids, dst) = (
        super::iv::<D>(p.ids, OP, "ids")?,
        super::tv::<D>(out, OP, "out")?,
    );
    crate::gpu::ops::embed(dev, super::wv::<D>(p.table, OP, "table")?, ids, dst)
}

/// A verify round's drafts, left on the backend by the drafter's pass: block position `k`'s
/// ids for every sequence of the pass at `drafts[k·width ..]` (step-major).
#[derive(Debug, Clone, Copy)]
pub struct DraftIds<'a> {
    /// `[block][width]` draft ids.
    pub drafts: &'a Ints,
    /// Sequences of the drafter's pass (its output's row stride).
    pub width: usize,
    /// Sequences of the verify batch: the pass's first `seqs`, in order.
    pub seqs: usize,
    /// Drafts each sequence verifies.
    pub gamma: usize,
}

/// Puts `p`'s drafts into a uniform verify batch's token ids (`ids[s·(γ+1) + 1 + k]`, after
/// each sequence's anchor), where they are: the host never reads them before the forward.
pub fn scatter_drafts(b: &Backend, p: DraftIds<'_>, ids: &mut Ints) -> Result<(), KernelError> {
    const OP: &str = "scatter_drafts";
    let DraftIds {
        drafts,
        width,
        seqs: n,
        gamma: g,
    } = p;
    match b {
        Backend::Cpu => {
            let src = drafts.host(OP, "drafts")?;
            let dst = ids.host_mut(OP, "ids")?;
            if width < n || src.len() < g * width || dst.len() < n * (g + 1) {
                return Err(KernelError::InvalidParam {
                    op: OP,
                    field: "ids",
                    limit: "n·(γ+1) ids from γ·width drafts, width ≥ n",
                    value: format!(
                        "{} ids, {} drafts (n {n}, γ {g}, width {width})",
                        dst.len(),
                        src.len()
                    ),
                });
            }
            for s in 0..n {
                for k in 0..g {
                    dst[s * (g + 1) + 1 + k] = src[k * width + s];
                }
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => scatter_drafts_on(dev, p, ids),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => scatter_drafts_on(dev, p, ids),
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn scatter_drafts_on<D: super::OnDevice>(
    dev: &D,
    p: DraftIds<'_>,
    ids: &Ints,
) -> Result<(), KernelError> {
    const OP: &str = "scatter_drafts";
    let (src, dst) = (
        super::iv::<D>(p.drafts, OP, "drafts")?,
        super::iv::<D>(ids, OP, "ids")?,
    );
    crate::gpu::ops::scatter_drafts(dev, src, dst, (p.seqs, p.gamma, p.width))
}

/// Rows `rows` of `src`.
#[derive(Debug, Clone, Copy)]
pub struct Gather<'a> {
    /// `[n][width]` source rows.
    pub src: &'a Tensor,
    /// Row indices into `src`.
    pub rows: &'a Ints,
    /// Floats per row.
    pub width: usize,
}

/// `[rows][width]`, a new tensor.
pub fn gather(b: &Backend, p: Gather<'_>) -> Result<Tensor, KernelError> {
    const OP: &str = "gather_rows";
    let mut out = b.scratch(p.rows.len() * p.width)?;
    match b {
        Backend::Cpu => {
            let src = p.src.host(OP, "src")?;
            let n = src.len() / p.width.max(1);
            let dst = out.host_mut(OP, "out")?;
            for (row, &r) in dst.chunks_exact_mut(p.width).zip(p.rows.host(OP, "rows")?) {
                let r = super::host_index(OP, "row", r.into(), n)?;
                row.copy_from_slice(&src[r * p.width..(r + 1) * p.width]);
            }
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => gather_on(dev, p, &out)?,
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => gather_on(dev, p, &out)?,
    }
    Ok(out)
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn gather_on<D: super::OnDevice>(dev: &D, p: Gather<'_>, out: &Tensor) -> Result<(), KernelError> {
    const OP: &str = "gather_rows";
    let (src, rows, dst) = (
        super::tv::<D>(p.src, OP, "src")?,
        super::iv::<D>(p.rows, OP, "rows")?,
        super::tv::<D>(out, OP, "out")?,
    );
    crate::gpu::ops::gather_rows(dev, src, rows, dst, p.width)
}
