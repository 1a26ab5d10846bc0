//! MLA in the MHA form for one sequence: decompress the whole context's latents into per-head
//! K and V with `kv_b_proj`, then causal attention (fresh prompts and long chunks, where it
//! costs fewer FLOPs than the absorbed form).
//!
//! CPU: [`crate::cpu::mla::mla_mha_attention`]. GPU: gather the latents, one GEMM, build K/V,
//! then on CUDA the tensor-core kernel on bf16 (fast mode, where the shape fits) or the f32
//! kernel; on ROCm the f32 kernel in both modes ([`super::dispatch::mha`]).

use super::{Backend, Ints, Pages, Precision, Tensor, Weight};
use crate::cpu::mla::{LatentContext, MlaDims, SeqAttn};
use crate::KernelError;

const OP: &str = "mla_mha";

/// One sequence's MHA-form attention.
#[derive(Debug)]
pub struct MhaRun<'a> {
    /// `[T][heads][qk_nope + qk_rope]` roped queries of the whole batch.
    pub q: &'a Tensor,
    /// The sequence's first row in `q` / `out`.
    pub first_row: usize,
    /// Its new tokens (queries).
    pub sq: usize,
    /// Positions cached before them.
    pub start: usize,
    /// Its block table.
    pub table: &'a Ints,
    /// `[0, sq]` cumulative query counts (the flash kernel's varlen layout).
    pub cu_q: &'a Ints,
    /// `[0, start + sq]` cumulative key counts.
    pub cu_k: &'a Ints,
    /// `[sq]` zeros: the sequence of each query row.
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
    /// `[T][heads][v]` output of the whole batch; the sequence writes its rows.
    pub out: &'a mut Tensor,
}

/// Runs [`MhaRun`].
pub fn mla_mha(b: &Backend, p: MhaRun<'_>) -> Result<(), KernelError> {
    let d = p.dims;
    let (qk, hv) = (d.heads * d.qk_head_dim(), d.heads * d.v_head_dim);
    let (sq, row) = (p.sq, p.first_row);
    match b {
        Backend::Cpu => {
            let table: Vec<u32> = p
                .table
                .host(OP, "table")?
                .iter()
                .map(|&b| b as u32)
                .collect();
            let lc = LatentContext {
                pages: p.pages.host(OP)?,
                seq: SeqAttn {
                    block_table: &table,
                    start_pos: p.start,
                    num_queries: sq,
                },
                scale: p.scale,
            };
            let q = p.q.host(OP, "q")?;
            let out = p.out.host_mut(OP, "out")?;
            let q_s = super::rows_of(OP, q, row..row + sq, qk, "q row")?;
            let out_len = out.len() / hv.max(1);
            let out_s = out
                .get_mut(row * hv..(row + sq) * hv)
                .ok_or(super::out_of_range(OP, "out row", row + sq, out_len))?;
            crate::cpu::mla::mla_mha_attention(q_s, &d, p.kv_b.host(OP, "kv_b")?, &lc, out_s)
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
    let (sq, row) = (p.sq, p.first_row);
    let pages = pv::<D>(&p.pages, OP)?;
    let shape = super::mla_absorbed::shape_for(&d, dev, pages.split);
    let hs = super::mla_absorbed::head_shape(&d, pages.split);
    let l = p.start + sq;
    let (h, v, lw) = (d.heads, d.v_head_dim, d.latent_width());
    let kv_b = wv::<D>(p.kv_b, OP, "kv_b")?;
    let lat = dev.alloc::<f32>(l * lw)?;
    let ckv = dev.alloc::<f32>(l * d.kv_lora_rank)?;
    let rows = LatentRows {
        rows: lat.v(),
        ckv: ckv.v(),
        kv_lora: d.kv_lora_rank,
    };
    ops::gather_latent(dev, pages, iv::<D>(p.table, OP, "table")?, l, rows)?;
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
        batch: 1,
        max_q: sq,
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
