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
        Backend::Cuda(dev) => {
            let (ids, dst) = (p.ids.dv(OP, "ids")?, out.dv(OP, "out")?);
            crate::cuda::ops::embed(dev, p.table.gpu(OP, "table")?, ids, dst)?;
        }
    }
    Ok(out)
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
        Backend::Cuda(dev) => {
            let (src, rows, dst) = (
                p.src.dv(OP, "src")?,
                p.rows.dv(OP, "rows")?,
                out.dv(OP, "out")?,
            );
            crate::cuda::ops::gather_rows(dev, src, rows, dst, p.width)?;
        }
    }
    Ok(out)
}
