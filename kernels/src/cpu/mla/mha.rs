//! The decompressed (MHA) form of MLA: expand every cached latent with `kv_b_proj` into
//! per-head keys and values, then run ordinary causal attention.
//!
//! This is how transformers' `DeepseekV3Attention` computes attention, so it is the form the
//! absorbed kernels are checked against. Cost: `640·H·L` FLOP per query token plus
//! `262,144·H` per key to decompress (`shared/reference/mla.md`).

use rayon::prelude::*;

use super::{check_len, KeyRows, LatentContext, MlaDims};
use crate::cpu::gemm::{linear, matmul_f32, MatmulDims, Matrix};
use crate::cpu::scratch::with_scratch;
use crate::cpu::softmax::attention_softmax;
use crate::error::KernelError;

const OP: &str = "mla_mha_attention";

/// Query rows attended together: one block's scores are `[QUERY_BLOCK][keys its last row
/// sees]`, so blocks skip the keys no row of theirs sees (and the scores stay small).
const QUERY_BLOCK: usize = 64;

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

    let kv_stride = h * dims.kv_b_rows_per_head();
    let block = QUERY_BLOCK.min(s);
    with_scratch(l * (r + rope + kv_stride) + h * s * v, |buf| {
        let (latent, buf) = buf.split_at_mut(l * r);
        let (k_pe, buf) = buf.split_at_mut(l * rope);
        let (kv, o_all) = buf.split_at_mut(l * kv_stride);
        // Gather the sequence's latents and shared rotary keys, then decompress all keys at
        // once.
        for p in 0..l {
            let row = keys.row(p);
            latent[p * r..(p + 1) * r].copy_from_slice(&row[..r]);
            k_pe[p * rope..(p + 1) * rope].copy_from_slice(&row[r..]);
        }
        linear(latent, kv_b_proj, kv)?;

        // Each head's output, `[heads][s][v]`.
        o_all
            .par_chunks_mut(s * v)
            .enumerate()
            .try_for_each(|(head, o_h)| {
                with_scratch(l * (qk + v) + s * qk + block * l, |hb| {
                    let (k_h, hb) = hb.split_at_mut(l * qk);
                    let (v_h, hb) = hb.split_at_mut(l * v);
                    let (q_h, scores) = hb.split_at_mut(s * qk);
                    let base = head * dims.kv_b_rows_per_head();
                    for p in 0..l {
                        let src = &kv[p * kv_stride + base..p * kv_stride + base + nope + v];
                        k_h[p * qk..p * qk + nope].copy_from_slice(&src[..nope]);
                        k_h[p * qk + nope..(p + 1) * qk]
                            .copy_from_slice(&k_pe[p * rope..(p + 1) * rope]);
                        v_h[p * v..(p + 1) * v].copy_from_slice(&src[nope..]);
                    }
                    for i in 0..s {
                        q_h[i * qk..(i + 1) * qk]
                            .copy_from_slice(&q[(i * h + head) * qk..(i * h + head + 1) * qk]);
                    }
                    let head = HeadRows {
                        q: q_h,
                        k: k_h,
                        v: v_h,
                        qk,
                        v_dim: v,
                    };
                    head.attend(ctx, scores, o_h)
                })
            })?;

        for (head, o_h) in o_all.chunks_exact(s * v).enumerate() {
            for i in 0..s {
                out[(i * h + head) * v..(i * h + head + 1) * v]
                    .copy_from_slice(&o_h[i * v..(i + 1) * v]);
            }
        }
        Ok(())
    })
}

/// One head's queries, keys and values, row-major: `[s][qk]`, `[keys][qk]`, `[keys][v_dim]`.
struct HeadRows<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    qk: usize,
    v_dim: usize,
}

impl HeadRows<'_> {
    /// Causal attention, `o = softmax(q·kᵀ · scale) · v`, into `o` (`[s][v_dim]`). Queries go
    /// in blocks of [`QUERY_BLOCK`] rows, each block against only the keys its last row sees,
    /// so a prompt's attention costs about half the full rectangle; `scores` holds one
    /// block's `[rows][keys]`.
    fn attend(
        &self,
        ctx: &LatentContext<'_>,
        scores: &mut [f32],
        o: &mut [f32],
    ) -> Result<(), KernelError> {
        let (qk, v) = (self.qk, self.v_dim);
        let s = self.q.len() / qk;
        for i0 in (0..s).step_by(QUERY_BLOCK) {
            let rows = QUERY_BLOCK.min(s - i0);
            let keys = ctx.seq.start_pos + i0 + rows;
            let scores = &mut scores[..rows * keys];
            matmul_f32(
                &self.q[i0 * qk..(i0 + rows) * qk],
                &self.k[..keys * qk],
                MatmulDims {
                    m: rows,
                    k: qk,
                    n: keys,
                    b_transposed: true,
                },
                scores,
            )?;
            for (i, row) in scores.chunks_exact_mut(keys).enumerate() {
                let visible = ctx.seq.start_pos + i0 + i + 1;
                let (live, masked) = row.split_at_mut(visible);
                attention_softmax(live, ctx.scale)?;
                masked.fill(0.0);
            }
            matmul_f32(
                scores,
                &self.v[..keys * v],
                MatmulDims {
                    m: rows,
                    k: keys,
                    n: v,
                    b_transposed: false,
                },
                &mut o[i0 * v..(i0 + rows) * v],
            )?;
        }
        Ok(())
    }
}
