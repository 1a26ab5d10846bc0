//! MLA in the absorbed form for a run of sequences with the same query count: `W_UK` folded
//! into the queries, attention over the shared latent, `W_UV` folded into the output.
//!
//! CPU: [`crate::cpu::mla::mla_absorbed_form`] per sequence, the sequences spread over rayon's
//! threads. GPU: one absorb launch, one
//! attention launch for the whole run (split-K planned for `max_ctx`), one unabsorb. On CUDA in
//! fast mode the attention runs on tensor cores in 16-row head tiles, head counts the tile does
//! not take zero-padded (12 → 16, `mla_absorbed_padded`), or with several queries' heads packed
//! into one tile. On ROCm (no tensor-core kernels) it is the per-head kernel in both modes,
//! f32 or bf16 ([`super::dispatch::absorbed`]).

use super::{AttnKernels, Backend, Ints, Pages, Tensor, Weight};
use crate::cpu::mla::{LatentContext, MlaDims, SeqAttn};
use crate::KernelError;

const OP: &str = "mla_absorbed";

/// One absorbed-form launch group.
#[derive(Debug)]
pub struct AbsorbedRun<'a> {
    /// `[T][heads][qk_nope + qk_rope]` roped queries of the whole batch.
    pub q: &'a Tensor,
    /// The run's first row in `q` / `out`.
    pub first_row: usize,
    /// Sequences in the run.
    pub seqs: usize,
    /// Queries per sequence.
    pub sq: usize,
    /// `[seqs][stride]` block tables.
    pub tables: &'a Ints,
    /// Entries per block-table row.
    pub stride: usize,
    /// `[seqs]` context length after this step (keys the last query sees).
    pub ctx: &'a Ints,
    /// The longest context the launch is planned for (≥ every `ctx`).
    pub max_ctx: usize,
    /// `kv_b_proj` (holds `W_UK` and `W_UV`).
    pub kv_b: &'a Weight,
    /// The layer's latent pages.
    pub pages: Pages<'a>,
    /// Head dimensions.
    pub dims: MlaDims,
    /// Softmax scale.
    pub scale: f32,
    /// Kernel choices.
    pub kernels: AttnKernels,
    /// `[T][heads][v]` output of the whole batch; the run writes its rows.
    pub out: &'a mut Tensor,
}

/// Runs [`AbsorbedRun`].
pub fn mla_absorbed(b: &Backend, p: AbsorbedRun<'_>) -> Result<(), KernelError> {
    let d = p.dims;
    let (qk, hv) = (d.heads * d.qk_head_dim(), d.heads * d.v_head_dim);
    match b {
        Backend::Cpu => {
            use rayon::prelude::*;
            let pages = p.pages.host(OP)?;
            let (tables, ctx) = (p.tables.host(OP, "tables")?, p.ctx.host(OP, "ctx")?);
            let kv_b = p.kv_b.host(OP, "kv_b")?;
            let q = p.q.host(OP, "q")?;
            let out = p.out.host_mut(OP, "out")?;
            let out_len = out.len() / hv.max(1);
            let rows = p.first_row..p.first_row + p.seqs * p.sq;
            let out_run = out
                .get_mut(rows.start * hv..rows.end * hv)
                .ok_or(super::out_of_range(OP, "out row", rows.end, out_len))?;
            // Sequence i of the run: its queries' rows, its own output rows.
            let one = |(i, out_s): (usize, &mut [f32])| -> Result<(), KernelError> {
                let table: Vec<u32> = tables
                    .get(i * p.stride..(i + 1) * p.stride)
                    .ok_or(super::out_of_range(OP, "tables row", i + 1, p.seqs))?
                    .iter()
                    .map(|&b| b as u32)
                    .collect();
                let len = *ctx
                    .get(i)
                    .ok_or(super::out_of_range(OP, "ctx", i + 1, ctx.len()))?
                    as usize;
                let row = p.first_row + i * p.sq;
                let lc = LatentContext {
                    pages,
                    seq: SeqAttn {
                        block_table: &table,
                        start_pos: len.saturating_sub(p.sq),
                        num_queries: p.sq,
                    },
                    scale: p.scale,
                };
                let q_s = super::rows_of(OP, q, row..row + p.sq, qk, "q row")?;
                crate::cpu::mla::mla_absorbed_form(q_s, &d, kv_b, &lc, out_s)?;
                Ok(())
            };
            // The sequences of a decode batch are independent: spread them over the pool (one
            // sequence's attention is one 16-row tile, a single task on its own).
            let per_seq = (p.sq * hv).max(1);
            if p.seqs > 1 {
                out_run
                    .par_chunks_mut(per_seq)
                    .enumerate()
                    .try_for_each(one)
            } else {
                out_run.chunks_mut(per_seq).enumerate().try_for_each(one)
            }
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => absorbed_on(dev, p),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => absorbed_on(dev, p),
    }
}

/// The GPU arm: one absorb launch, the attention kernel [`super::dispatch::absorbed`] picks for
/// the runtime (split-K planned for `max_ctx`), one unabsorb.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn absorbed_on<D: super::OnDevice>(dev: &D, p: AbsorbedRun<'_>) -> Result<(), KernelError> {
    use super::dispatch::{self, AbsorbedPlan};
    use super::{iv, pv, tv, wv};
    use crate::gpu::launch::DeviceMem;
    use crate::gpu::mla::{self as k, AbsorbedBatch, Elems};
    use crate::gpu::ops::{self, AbsorbedOut};
    let d = p.dims;
    let (qk, hv) = (d.heads * d.qk_head_dim(), d.heads * d.v_head_dim);
    let rows = p.seqs * p.sq;
    let pages = pv::<D>(&p.pages, OP)?;
    let shape = shape_for(&d, dev, pages.split);
    let hs = head_shape(&d, pages.split);
    let lw = d.latent_width();
    let kv_b = wv::<D>(p.kv_b, OP, "kv_b")?;
    let q = tv::<D>(p.q, OP, "q")?.sub(p.first_row * qk, rows * qk)?;
    let out = tv::<D>(p.out, OP, "out")?.sub(p.first_row * hv, rows * hv)?;
    let o_lat = dev.alloc::<f32>(rows * d.heads * d.kv_lora_rank)?;
    // From a few dozen tokens the absorption and un-absorption are per-head GEMMs on tensor
    // cores (the CUDA-core kernels re-read each token's row per output column).
    let heads_gemm = rows >= ops::head_gemm_min_tokens();
    let hw = ops::HeadWeights {
        kv_b,
        shape: hs,
        precision: p.kernels.precision.gemm(),
    };
    let absorb = |out: AbsorbedOut| -> Result<(), KernelError> {
        if !(heads_gemm && ops::absorb_gemm(dev, q, hw, out)?) {
            ops::absorb(dev, q, kv_b, hs, out)?;
        }
        Ok(())
    };
    let unabsorb = |o_lat: crate::gpu::launch::Dv<f32>| -> Result<(), KernelError> {
        if !(heads_gemm && ops::unabsorb_gemm(dev, o_lat, hw, out)?) {
            ops::unabsorb(dev, o_lat, kv_b, hs, out)?;
        }
        Ok(())
    };
    let (table, ctx) = (iv::<D>(p.tables, OP, "tables")?, iv::<D>(p.ctx, OP, "ctx")?);
    let mk = |q: Elems| AbsorbedBatch {
        q,
        pages,
        block_table: table,
        bt_stride: p.stride,
        ctx_len: ctx,
        max_ctx: p.max_ctx,
        batch: p.seqs,
        sq: p.sq,
        heads: d.heads,
        scale: p.scale,
    };
    // The kernel leaves its split-K partials unmerged, and for a token or two the output
    // un-absorption merges them (one launch fewer per layer; bitwise the same).
    // A step of several query tokens a sequence (a verify step: drafts + 1 rows × heads)
    // spans several 16-row tiles; where the tuned kernel groups tiles, the packed kernel runs
    // them in blocks that stream the sequence's keys once instead of once per tile (and needs
    // no padded copy of the queries). `FERRY_MLA_TILE_GROUPS=1` keeps the padded tiles.
    let tiles = (p.sq * d.heads).div_ceil(crate::ops::mla_plan::TILE_ROWS);
    let plan = match dispatch::absorbed::<D>(p.kernels, &shape) {
        AbsorbedPlan::TilePadded if shape.packed_groups(tiles) > 1 => AbsorbedPlan::Packed,
        plan => plan,
    };
    let parts = match plan {
        AbsorbedPlan::GenericF32 => {
            let q_abs = dev.alloc::<f32>(rows * d.heads * lw)?;
            absorb(AbsorbedOut::F32(q_abs.v()))?;
            let batch = mk(Elems::F32(q_abs.v()));
            k::mla_absorbed_parts(dev, shape, k::AbsorbedKernel::Generic, &batch, o_lat.v())?
        }
        plan => {
            let q_abs = dev.alloc::<u16>(rows * d.heads * shape.qrow())?;
            absorb(AbsorbedOut::Bf16(q_abs.v()))?;
            let batch = mk(Elems::Bf16(q_abs.v()));
            match plan {
                AbsorbedPlan::TilePadded
                    if crate::ops::mla_plan::HeadPadPlan::for_heads(d.heads)?.needs_padding() =>
                {
                    k::mla_absorbed_padded(dev, shape, &batch, o_lat.v())?;
                    None
                }
                AbsorbedPlan::TilePadded => {
                    k::mla_absorbed_parts(dev, shape, k::AbsorbedKernel::Tile, &batch, o_lat.v())?
                }
                AbsorbedPlan::Packed => {
                    k::mla_absorbed_parts(dev, shape, k::AbsorbedKernel::Packed, &batch, o_lat.v())?
                }
                _ => k::mla_absorbed_parts(
                    dev,
                    shape,
                    k::AbsorbedKernel::Generic,
                    &batch,
                    o_lat.v(),
                )?,
            }
        }
    };
    match parts {
        Some(parts)
            if super::fuse()
                && rows <= ops::UNABSORB_COMBINE_MAX_TOKENS
                && ops::unabsorb_combine_fits(&parts, &hs) =>
        {
            ops::unabsorb_combine(dev, &parts, kv_b, hs, out)
        }
        Some(parts) => {
            k::mla_combine(dev, shape, &parts, o_lat.v())?;
            unabsorb(o_lat.v())
        }
        None => unabsorb(o_lat.v()),
    }
}

/// The attention kernels' shape for `d` over pages splitting `split` rope elements, with the
/// tile pipeline tuned for `dev`'s card (the untuned shape on a runtime without CUDA's compute
/// capabilities).
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub fn shape_for<D: crate::gpu::launch::Gpu>(
    d: &MlaDims,
    dev: &D,
    split: usize,
) -> crate::gpu::mla::MlaShape {
    super::dispatch::mla_shape(d, dev.compute_capability(), split)
}

/// `d` as the absorb / unabsorb / decompress kernels take it, bf16 outputs splitting `split`
/// rope elements (the cache's).
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn head_shape(d: &MlaDims, split: usize) -> crate::gpu::ops::HeadShape {
    crate::gpu::ops::HeadShape {
        heads: d.heads,
        nope: d.qk_nope_head_dim,
        rope: d.qk_rope_head_dim,
        v: d.v_head_dim,
        kv_lora: d.kv_lora_rank,
        split,
    }
}
