//! The decompressed (MHA) form of MLA: expand every cached latent with `kv_b_proj` into
//! per-head keys and values, then run ordinary causal attention.
//!
//! This is how transformers' `DeepseekV3Attention` computes attention, so it is the form the
//! absorbed kernels are checked against. Cost: `640·H·L` FLOP per query token plus
//! `262,144·H` per key to decompress (`shared/reference/mla.md`).

use rayon::prelude::*;

use super::{check_len, KeyRows, LatentContext, MlaDims};
use crate::cpu::gemm::{linear, matmul_f32, MatmulDims, Matrix};
use crate::cpu::softmax::softmax_inplace;
use crate::error::KernelError;

const OP: &str = "mla_mha_attention";

/// Causal MLA attention in the MHA form, for any head count.
///
/// `q` is `[num_queries][heads][qk_nope + qk_rope]` with RoPE already applied to the rope
/// part; `kv_b_proj` is `[heads·(qk_nope + v)][kv_lora]`; `out` is `[num_queries][heads][v]`.
/// Key `p` of head `h` is `[k_nope_h(p) | k_pe(p)]`, with `[k_nope_h | v_h] = kv_b_proj_h ·
/// c_kv(p)` and `k_pe(p)` the row's (shared) rotary part; scores are `(q · k) · scale`, then an
/// f32 softmax over keys `0..=start_pos + i`.
pub fn mla_mha_attention(
    q: &[f32],
    dims: &MlaDims,
    kv_b_proj: &Matrix,
    ctx: &LatentContext<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    dims.check(OP, kv_b_proj.rows(), kv_b_proj.cols())?;
    let keys = KeyRows::new(OP, ctx)?;
    check_len(OP, "pages.width", dims.latent_width(), keys.width())?;
    let (s, h) = (ctx.seq.num_queries, dims.heads);
    let (qk, nope, rope, v, r) = (
        dims.qk_head_dim(),
        dims.qk_nope_head_dim,
        dims.qk_rope_head_dim,
        dims.v_head_dim,
        dims.kv_lora_rank,
    );
    check_len(OP, "q", s * h * qk, q.len())?;
    check_len(OP, "out", s * h * v, out.len())?;
    if s == 0 {
        return Ok(());
    }
    let l = ctx.seq.context_len();

    // Gather the sequence's latents and shared rotary keys, then decompress all keys at once.
    let mut latent = vec![0.0f32; l * r];
    let mut k_pe = vec![0.0f32; l * rope];
    for p in 0..l {
        let row = keys.row(p);
        latent[p * r..(p + 1) * r].copy_from_slice(&row[..r]);
        k_pe[p * rope..(p + 1) * rope].copy_from_slice(&row[r..]);
    }
    let kv_stride = h * dims.kv_b_rows_per_head();
    let mut kv = vec![0.0f32; l * kv_stride];
    linear(&latent, kv_b_proj, &mut kv)?;

    let per_head: Vec<Vec<f32>> = (0..h)
        .into_par_iter()
        .map(|head| {
            let base = head * dims.kv_b_rows_per_head();
            let mut k_h = vec![0.0f32; l * qk];
            let mut v_h = vec![0.0f32; l * v];
            for p in 0..l {
                let src = &kv[p * kv_stride + base..p * kv_stride + base + nope + v];
                k_h[p * qk..p * qk + nope].copy_from_slice(&src[..nope]);
                k_h[p * qk + nope..(p + 1) * qk].copy_from_slice(&k_pe[p * rope..(p + 1) * rope]);
                v_h[p * v..(p + 1) * v].copy_from_slice(&src[nope..]);
            }
            let mut q_h = vec![0.0f32; s * qk];
            for i in 0..s {
                q_h[i * qk..(i + 1) * qk]
                    .copy_from_slice(&q[(i * h + head) * qk..(i * h + head + 1) * qk]);
            }
            let mut scores = vec![0.0f32; s * l];
            matmul_f32(
                &q_h,
                &k_h,
                MatmulDims {
                    m: s,
                    k: qk,
                    n: l,
                    b_transposed: true,
                },
                &mut scores,
            )?;
            for (i, row) in scores.chunks_exact_mut(l).enumerate() {
                let visible = ctx.seq.start_pos + i + 1;
                let (live, masked) = row.split_at_mut(visible);
                for x in live.iter_mut() {
                    *x *= ctx.scale;
                }
                softmax_inplace(live)?;
                masked.fill(0.0);
            }
            let mut o_h = vec![0.0f32; s * v];
            matmul_f32(
                &scores,
                &v_h,
                MatmulDims {
                    m: s,
                    k: l,
                    n: v,
                    b_transposed: false,
                },
                &mut o_h,
            )?;
            Ok(o_h)
        })
        .collect::<Result<_, KernelError>>()?;

    for (head, o_h) in per_head.iter().enumerate() {
        for i in 0..s {
            out[(i * h + head) * v..(i * h + head + 1) * v]
                .copy_from_slice(&o_h[i * v..(i + 1) * v]);
        }
    }
    Ok(())
}
