//! MLA in the MHA form for a run of sequences: decompress each one's whole context of latents
//! into per-head K and V with `kv_b_proj`, then causal attention (fresh prompts and long
//! chunks, where it costs fewer FLOPs than the absorbed form).
//!
//! CPU: [`crate::cpu::mla::mla_mha_attention`] per sequence. GPU: gather each sequence's
//! latents into one buffer, then for the whole run one GEMM, one K/V build and one attention
//! launch over the variable-length batch — on CUDA the tensor-core kernel on bf16 (fast mode,
//! where the shape fits) or the f32 kernel; on ROCm the f32 kernel in both modes
//! ([`super::dispatch::mha`]). Several prompts of one step in one launch fill the card: one
//! 1,024-token prompt of 12 heads is 96 tiles of 128 queries, fewer than an H100's 132 SMs.

use super::{Backend, Ints, Pages, Precision, Tensor, Weight};
use crate::cpu::mla::{LatentContext, MlaDims, SeqAttn};
use crate::KernelError;

const OP: &str = "mla_mha";

/// One sequence of an [`MhaRun`] (host facts; its rows follow the previous sequence's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MhaSeq {
    /// Its new tokens (queries).
    pub sq: usize,
    /// Positions cached before them.
    pub start: usize,
}

impl MhaSeq {
    /// Keys its last query sees: the cached positions and its own.
    pub fn keys(&self) -> usize {
        self.start + self.sq
    }
}

/// A run of consecutive sequences' MHA-form attention.
#[derive(Debug)]
pub struct MhaRun<'a> {
    /// `[T][heads][qk_nope + qk_rope]` roped queries of the whole batch.
    pub q: &'a Tensor,
    /// The run's first row in `q` / `out`; its sequences' rows follow one another from there.
    pub first_row: usize,
    /// The run's sequences, in row order.
    pub seqs: &'a [MhaSeq],
    /// `[seqs][stride]` block tables.
    pub tables: &'a Ints,
    /// Entries per block-table row (at least the longest sequence's blocks).
    pub stride: usize,
    /// `[seqs + 1]` cumulative query counts (the kernels' varlen layout).
    pub cu_q: &'a Ints,
    /// `[seqs + 1]` cumulative key counts ([`MhaSeq::keys`]).
    pub cu_k: &'a Ints,
    /// `[Σ sq]` the sequence of each query row (the f32 kernel's row → sequence map).
    pub q_seq: &'a Ints,
    /// `kv_b_proj`.
    pub kv_b: &'a Weight,
    /// The layer's latent pages.
    pub pages: Pages<'a>,
    /// Head dimensions.
    pub dims: MlaDims,
    /// Softmax scale.
    pub scale: f32,
    /// Exact (f32 kernel) or fast (bf16 flash kernel).
    pub precision: Precision,
    /// `[T][heads][v]` output of the whole batch; the run writes its rows.
    pub out: &'a mut Tensor,
}

impl MhaRun<'_> {
    /// Query rows of the run.
    fn rows(&self) -> usize {
        self.seqs.iter().map(|s| s.sq).sum()
    }

    /// Keys of the run: every sequence's whole context.
    fn keys(&self) -> usize {
        self.seqs.iter().map(MhaSeq::keys).sum()
    }
}

/// Runs [`MhaRun`].
pub fn mla_mha(b: &Backend, p: MhaRun<'_>) -> Result<(), KernelError> {
    let d = p.dims;
    let (qk, hv) = (d.heads * d.qk_head_dim(), d.heads * d.v_head_dim);
    match b {
        Backend::Cpu => {
            let tables = p.tables.host(OP, "tables")?;
            let pages = p.pages.host(OP)?;
            let kv_b = p.kv_b.host(OP, "kv_b")?;
            let q = p.q.host(OP, "q")?;
            let out = p.out.host_mut(OP, "out")?;
            let out_len = out.len() / hv.max(1);
            let mut row = p.first_row;
            for (i, s) in p.seqs.iter().enumerate() {
                let table: Vec<u32> = tables
                    .get(i * p.stride..(i + 1) * p.stride)
                    .ok_or(super::out_of_range(OP, "tables row", i + 1, p.seqs.len()))?
                    .iter()
                    .map(|&b| b as u32)
                    .collect();
                let lc = LatentContext {
                    pages,
                    seq: SeqAttn {
                        block_table: &table,
                        start_pos: s.start,
                        num_queries: s.sq,
                    },
                    scale: p.scale,
                };
                let q_s = super::rows_of(OP, q, row..row + s.sq, qk, "q row")?;
                let out_s = out
                    .get_mut(row * hv..(row + s.sq) * hv)
                    .ok_or(super::out_of_range(OP, "out row", row + s.sq, out_len))?;
                crate::cpu::mla::mla_mha_attention(q_s, &d, kv_b, &lc, out_s)?;
                row += s.sq;
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => mha_on(dev, p),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => mha_on(dev, p),
    }
}

/// The GPU arm: gather the latents, one GEMM, build K/V, then the kernel
/// [`super::dispatch::mha`] picks for the runtime.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn mha_on<D: super::OnDevice>(dev: &D, p: MhaRun<'_>) -> Result<(), KernelError> {
    use super::{iv, pv, tv, wv};
    use crate::gpu::launch::DeviceMem;
    use crate::gpu::mla::{mha_prefill, Elems, MhaBatch, MhaKernel};
    use crate::gpu::ops::{self, KvOut, LatentRows};
    let d = p.dims;
    let (qk, hv) = (d.heads * d.qk_head_dim(), d.heads * d.v_head_dim);
    let (sq, row, l) = (p.rows(), p.first_row, p.keys());
    let pages = pv::<D>(&p.pages, OP)?;
    let shape = super::mla_absorbed::shape_for(&d, dev, pages.split);
    let hs = super::mla_absorbed::head_shape(&d, pages.split);
    let (h, v, lw, kv_lora) = (d.heads, d.v_head_dim, d.latent_width(), d.kv_lora_rank);
    let kv_b = wv::<D>(p.kv_b, OP, "kv_b")?;
    let tables = iv::<D>(p.tables, OP, "tables")?;
    // Each sequence's context, one after another: the row layout `cu_k` describes.
    let lat = dev.alloc::<f32>(l * lw)?;
    let ckv = dev.alloc::<f32>(l * kv_lora)?;
    let mut key = 0;
    for (i, s) in p.seqs.iter().enumerate() {
        let n = s.keys();
        let rows = LatentRows {
            rows: lat.v().sub(key * lw, n * lw)?,
            ckv: ckv.v().sub(key * kv_lora, n * kv_lora)?,
            kv_lora,
        };
        let table = tables.sub(i * p.stride, p.stride)?;
        ops::gather_latent(dev, pages, table, n, rows)?;
        key += n;
    }
    let kvx = dev.alloc::<f32>(l * kv_b.rows())?;
    let gemm = p.precision.gemm();
    ops::linear(dev, ckv.v(), kv_b, kvx.v(), gemm)?;
    let q = tv::<D>(p.q, OP, "q")?.sub(row * qk, sq * qk)?;
    let out = tv::<D>(p.out, OP, "out")?.sub(row * hv, sq * hv)?;
    let (cu_q, cu_k) = (iv::<D>(p.cu_q, OP, "cu_q")?, iv::<D>(p.cu_k, OP, "cu_k")?);
    let q_seq = iv::<D>(p.q_seq, OP, "q_seq")?;
    let mk = |q, k, vv| MhaBatch {
        q,
        k,
        v: vv,
        cu_q,
        cu_k,
        q_seq,
        batch: p.seqs.len(),
        max_q: p.seqs.iter().map(|s| s.sq).max().unwrap_or(0),
        heads: h,
        scale: p.scale,
    };
    let qkh = d.qk_head_dim();
    match super::dispatch::mha::<D>(p.precision, &shape, dev.compute_capability()) {
        MhaKernel::F32 => {
            let kf = dev.alloc::<f32>(l * h * qkh)?;
            let vf = dev.alloc::<f32>(l * h * v)?;
            ops::mha_build_kv(dev, kvx.v(), lat.v(), hs, KvOut::F32(kf.v(), vf.v()))?;
            let batch = mk(Elems::F32(q), Elems::F32(kf.v()), Elems::F32(vf.v()));
            mha_prefill(dev, shape, MhaKernel::F32, &batch, out)
        }
        kernel => {
            // Split rows: Q [q_nope | hi | hi | lo] against K [k_nope | hi | lo | hi].
            let qkb = shape.mha_qkb();
            let kb = dev.alloc::<u16>(l * h * qkb)?;
            let vb = dev.alloc::<u16>(l * h * v)?;
            ops::mha_build_kv(dev, kvx.v(), lat.v(), hs, KvOut::Bf16(kb.v(), vb.v()))?;
            let qb = dev.alloc::<u16>(sq * h * qkb)?;
            ops::split_pe_bf16(dev, q, qkh, shape.split, qb.v())?;
            let batch = mk(
                Elems::Bf16(qb.v()),
                Elems::Bf16(kb.v()),
                Elems::Bf16(vb.v()),
            );
            mha_prefill(dev, shape, kernel, &batch, out)
        }
    }
}
