//! The absorbed (MQA) form of MLA and its pieces.
//!
//! Per head `h`, rows `h·(nope+v) .. h·(nope+v)+nope` of `kv_b_proj` are `W_UK_h`
//! (`[nope][kv_lora]`) and the next `v` rows are `W_UV_h` (`[v][kv_lora]`). Because
//! `q_nope · k_nope = q_nope · (W_UK · c) = (q_nope · W_UK) · c`, the query can be folded into
//! latent space once ([`absorb_queries`]) and every head then attends directly against the one
//! shared latent row `[c | k_pe]`; the latent output is mapped back with `W_UV`
//! ([`unabsorb_outputs`]). The algebra is exact; only f32 rounding differs from the MHA form.
//!
//! | function | role |
//! |---|---|
//! | [`mla_absorbed_form`] | absorb → dispatch → unabsorb; same contract as `mla_mha_attention` |
//! | [`mla_absorbed_attention`] | dispatcher: any head count, zero-pads to the tiled kernel's counts |
//! | [`mla_absorbed_reference`] | per-head, per-key loop with no tiling or padding, for tests |

use rayon::prelude::*;

use super::tiled::{mla_absorbed_tiled, tiled, value_width};
use super::{check_len, KeyRows, LatentContext, MlaDims};
use crate::cpu::gemm::{
    matmul_f32, row_axpy, row_dot, MatmulDims, Matrix, GEMV_MAX_TOKENS, GEMV_PAR_MIN_MACS,
};
use crate::cpu::softmax::softmax_inplace;
use crate::error::KernelError;
use crate::ops::mla_plan::HeadPadPlan;

/// `out[i][h] = [q_nope(i,h) · W_UK_h | q_pe(i,h)]`: `[S][H][nope+rope]` → `[S][H][kv_lora+rope]`.
pub fn absorb_queries(
    q: &[f32],
    dims: &MlaDims,
    kv_b_proj: &Matrix,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "absorb_queries";
    dims.check(OP, kv_b_proj.rows(), kv_b_proj.cols())?;
    let (h, qk, lw) = (dims.heads, dims.qk_head_dim(), dims.latent_width());
    let (nope, r) = (dims.qk_nope_head_dim, dims.kv_lora_rank);
    let s = tokens(OP, "q", q.len(), h * qk)?;
    check_len(OP, "out", s * h * lw, out.len())?;
    if s <= GEMV_MAX_TOKENS {
        // Decode: each output row `q_nope · W_UK_h` straight from the weight rows (no copy of
        // the head's rows, no GEMM set up for a row or four).
        let rows_per_head = dims.kv_b_rows_per_head();
        let row = |(ih, dst): (usize, &mut [f32])| {
            let head = ih % h;
            let q_row = &q[ih * qk..(ih + 1) * qk];
            let (lat, pe) = dst.split_at_mut(r);
            lat.fill(0.0);
            for (j, &v) in q_row[..nope].iter().enumerate() {
                row_axpy(kv_b_proj, head * rows_per_head + j, v, lat);
            }
            pe.copy_from_slice(&q_row[nope..]);
        };
        if s * h * nope * r >= GEMV_PAR_MIN_MACS {
            out.par_chunks_mut(lw).enumerate().for_each(row);
        } else {
            out.chunks_mut(lw).enumerate().for_each(row);
        }
        return Ok(());
    }

    let per_head = per_head_product(h, |head| {
        let w_uk = kv_b_proj
            .slice_rows(head * dims.kv_b_rows_per_head(), nope)?
            .to_f32_vec();
        let q_nope = gather_head(
            q,
            HeadLayout {
                heads: h,
                width: qk,
            },
            head,
            0..nope,
        );
        let mut res = vec![0.0f32; s * r];
        matmul_f32(
            &q_nope,
            &w_uk,
            MatmulDims {
                m: s,
                k: nope,
                n: r,
                b_transposed: false,
            },
            &mut res,
        )?;
        Ok(res)
    })?;
    for (head, res) in per_head.iter().enumerate() {
        for i in 0..s {
            let dst = &mut out[(i * h + head) * lw..(i * h + head + 1) * lw];
            dst[..r].copy_from_slice(&res[i * r..(i + 1) * r]);
            dst[r..].copy_from_slice(&q[(i * h + head) * qk + nope..(i * h + head + 1) * qk]);
        }
    }
    Ok(())
}

/// `out[i][h] = W_UV_h · o_lat(i,h)`: `[S][H][kv_lora]` → `[S][H][v]`.
pub fn unabsorb_outputs(
    o_lat: &[f32],
    dims: &MlaDims,
    kv_b_proj: &Matrix,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "unabsorb_outputs";
    dims.check(OP, kv_b_proj.rows(), kv_b_proj.cols())?;
    let (h, r, v, nope) = (
        dims.heads,
        dims.kv_lora_rank,
        dims.v_head_dim,
        dims.qk_nope_head_dim,
    );
    let s = tokens(OP, "o_lat", o_lat.len(), h * r)?;
    check_len(OP, "out", s * h * v, out.len())?;
    if s <= GEMV_MAX_TOKENS {
        // Decode: each output element a dot of the latent row with one `W_UV_h` row.
        let rows_per_head = dims.kv_b_rows_per_head();
        let row = |(ih, dst): (usize, &mut [f32])| {
            let head = ih % h;
            let o_row = &o_lat[ih * r..(ih + 1) * r];
            for (c, d) in dst.iter_mut().enumerate() {
                *d = row_dot(kv_b_proj, head * rows_per_head + nope + c, o_row);
            }
        };
        if s * h * v * r >= GEMV_PAR_MIN_MACS {
            out.par_chunks_mut(v).enumerate().for_each(row);
        } else {
            out.chunks_mut(v).enumerate().for_each(row);
        }
        return Ok(());
    }

    let per_head = per_head_product(h, |head| {
        let w_uv = kv_b_proj
            .slice_rows(head * dims.kv_b_rows_per_head() + nope, v)?
            .to_f32_vec();
        let o_h = gather_head(o_lat, HeadLayout { heads: h, width: r }, head, 0..r);
        let mut res = vec![0.0f32; s * v];
        matmul_f32(
            &o_h,
            &w_uv,
            MatmulDims {
                m: s,
                k: r,
                n: v,
                b_transposed: true,
            },
            &mut res,
        )?;
        Ok(res)
    })?;
    for (head, res) in per_head.iter().enumerate() {
        for i in 0..s {
            out[(i * h + head) * v..(i * h + head + 1) * v]
                .copy_from_slice(&res[i * v..(i + 1) * v]);
        }
    }
    Ok(())
}

/// Causal MLA in the absorbed form: same inputs, outputs and contract as
/// [`super::mla_mha_attention`] (`q` `[S][H][nope+rope]` → `out` `[S][H][v]`).
pub fn mla_absorbed_form(
    q: &[f32],
    dims: &MlaDims,
    kv_b_proj: &Matrix,
    ctx: &LatentContext<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "mla_absorbed_form";
    dims.check(OP, kv_b_proj.rows(), kv_b_proj.cols())?;
    check_len(OP, "pages.width", dims.latent_width(), ctx.pages.width)?;
    let (s, h) = (ctx.seq.num_queries, dims.heads);
    check_len(OP, "q", s * h * dims.qk_head_dim(), q.len())?;
    check_len(OP, "out", s * h * dims.v_head_dim, out.len())?;
    if s == 0 {
        return Ok(());
    }
    let mut q_abs = vec![0.0f32; s * h * dims.latent_width()];
    absorb_queries(q, dims, kv_b_proj, &mut q_abs)?;
    let mut o_lat = vec![0.0f32; s * h * dims.kv_lora_rank];
    mla_absorbed_attention(&q_abs, h, ctx, &mut o_lat)?;
    unabsorb_outputs(&o_lat, dims, kv_b_proj, out)
}

/// Absorbed attention for any head count: runs [`mla_absorbed_tiled`] directly when it takes
/// `heads`, otherwise zero-pads the queries to [`HeadPadPlan::padded`] heads, runs the tiled
/// kernel (which skips the padded rows: their outputs are never read), and slices the real
/// heads back. Exact, because heads never mix. Same shapes as
/// [`mla_absorbed_tiled`].
pub fn mla_absorbed_attention(
    q_abs: &[f32],
    heads: usize,
    ctx: &LatentContext<'_>,
    out_latent: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "mla_absorbed_attention";
    let plan = HeadPadPlan::for_heads(heads)?;
    if !plan.needs_padding() {
        return mla_absorbed_tiled(q_abs, heads, ctx, out_latent);
    }
    let (s, width) = (ctx.seq.num_queries, ctx.pages.width);
    check_len(OP, "q_abs", s * heads * width, q_abs.len())?;
    if s == 0 {
        return check_len(OP, "out_latent", 0, out_latent.len());
    }
    let kv_lora = value_width(OP, out_latent.len(), s * heads, width)?;
    let mut q_pad = vec![0.0f32; s * plan.padded * width];
    plan.pad_heads(q_abs, width, &mut q_pad)?;
    let mut o_pad = vec![0.0f32; s * plan.padded * kv_lora];
    // The padded rows' outputs are sliced away: the kernel skips them.
    tiled(&q_pad, plan.padded, heads, ctx, &mut o_pad)?;
    plan.unpad_heads(&o_pad, kv_lora, out_latent)
}

/// The absorbed attention written as plainly as possible: for each query and head, score every
/// visible key, softmax, weighted sum. No tiling, no padding, any head count; same shapes as
/// [`mla_absorbed_tiled`]. Tests hold the fast paths to it.
pub fn mla_absorbed_reference(
    q_abs: &[f32],
    heads: usize,
    ctx: &LatentContext<'_>,
    out_latent: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "mla_absorbed_reference";
    if heads == 0 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "heads",
            limit: "> 0",
            value: "0".into(),
        });
    }
    let keys = KeyRows::new(OP, ctx)?;
    let (s, width) = (ctx.seq.num_queries, keys.width());
    check_len(OP, "q_abs", s * heads * width, q_abs.len())?;
    if s == 0 {
        return check_len(OP, "out_latent", 0, out_latent.len());
    }
    let kv_lora = value_width(OP, out_latent.len(), s * heads, width)?;
    for i in 0..s {
        let visible = ctx.seq.start_pos + i + 1;
        for head in 0..heads {
            let row = i * heads + head;
            let q = &q_abs[row * width..(row + 1) * width];
            let mut p: Vec<f32> = (0..visible)
                .map(|pos| q.iter().zip(keys.row(pos)).map(|(a, b)| a * b).sum::<f32>() * ctx.scale)
                .collect();
            softmax_inplace(&mut p)?;
            let out = &mut out_latent[row * kv_lora..(row + 1) * kv_lora];
            out.fill(0.0);
            for (pos, &w) in p.iter().enumerate() {
                for (o, v) in out.iter_mut().zip(&keys.row(pos)[..kv_lora]) {
                    *o += w * v;
                }
            }
        }
    }
    Ok(())
}

/// Runs `f` for every head in parallel and collects the per-head results in head order.
fn per_head_product<F>(heads: usize, f: F) -> Result<Vec<Vec<f32>>, KernelError>
where
    F: Fn(usize) -> Result<Vec<f32>, KernelError> + Sync + Send,
{
    (0..heads).into_par_iter().map(f).collect()
}

/// Shape of a `[tokens][heads][width]` buffer.
#[derive(Clone, Copy)]
struct HeadLayout {
    heads: usize,
    width: usize,
}

/// Copies columns `cols` of head `head` out of `[tokens][heads][width]` into `[tokens][cols]`.
fn gather_head(
    x: &[f32],
    layout: HeadLayout,
    head: usize,
    cols: std::ops::Range<usize>,
) -> Vec<f32> {
    let mut res = Vec::with_capacity(x.len() / layout.heads / layout.width * cols.len());
    for token in x.chunks_exact(layout.heads * layout.width) {
        let base = head * layout.width;
        res.extend_from_slice(&token[base + cols.start..base + cols.end]);
    }
    res
}

/// Token count of a `[tokens][row]` buffer.
fn tokens(
    op: &'static str,
    what: &'static str,
    len: usize,
    row: usize,
) -> Result<usize, KernelError> {
    if len % row != 0 {
        return Err(KernelError::NotDivisible {
            op,
            what,
            len,
            width: row,
        });
    }
    Ok(len / row)
}
