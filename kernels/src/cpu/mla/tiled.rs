//! The tiled absorbed-MLA kernel: the CPU model of what the GPU kernels do.
//!
//! The query heads of one token are the rows of 16-row tiles (`min(heads, 16)` rows). For each
//! (token, tile) the kernel streams the sequence's pages once: every key row is loaded once,
//! scored against all rows of the tile, and folded into per-row running `(max, sum, acc)`
//! state with an online, max-rescaled f32 softmax. Latent traffic is therefore one read per
//! tile, not one per head — the property that makes the absorbed form memory-efficient.
//!
//! Like the production kernels it only takes 4, 8 or multiples of 16 heads; other counts go
//! through [`super::mla_absorbed_attention`], which pads.

use rayon::prelude::*;

use super::{check_len, KeyRows, LatentContext};
use crate::cpu::softmax::{exp_f32, lane_sum};
use crate::error::KernelError;
use crate::ops::mla_plan::{is_supported_tile_heads, TILE_ROWS};

const OP: &str = "mla_absorbed_tiled";

/// Absorbed attention for a supported head count.
///
/// `q_abs` is `[num_queries][heads][width]` (absorbed queries, `width = pages.width`);
/// `out_latent` is `[num_queries][heads][kv_lora]`, and its length fixes `kv_lora` (the
/// leading part of each row that serves as the value; `kv_lora <= width`). Score of key `p`
/// for a head is `(q̃ · row(p)) · scale` over the full row; the output is the softmax-weighted
/// sum of `row(p)[..kv_lora]` over keys `0..=start_pos + i`.
///
/// Errors with [`KernelError::UnsupportedHeadCount`] unless `heads` is 4, 8 or a multiple of 16.
pub fn mla_absorbed_tiled(
    q_abs: &[f32],
    heads: usize,
    ctx: &LatentContext<'_>,
    out_latent: &mut [f32],
) -> Result<(), KernelError> {
    if !is_supported_tile_heads(heads) {
        return Err(KernelError::UnsupportedHeadCount { op: OP, heads });
    }
    let keys = KeyRows::new(OP, ctx)?;
    let (s, width) = (ctx.seq.num_queries, keys.width());
    check_len(OP, "q_abs", s * heads * width, q_abs.len())?;
    if s == 0 {
        return check_len(OP, "out_latent", 0, out_latent.len());
    }
    let kv_lora = value_width(OP, out_latent.len(), s * heads, width)?;
    let tile_rows = heads.min(TILE_ROWS);
    let tiles = heads / tile_rows;

    out_latent
        .par_chunks_mut(tile_rows * kv_lora)
        .enumerate()
        .for_each(|(chunk, out)| {
            let (i, tile) = (chunk / tiles, chunk % tiles);
            let first_row = (i * heads + tile * tile_rows) * width;
            let q_tile = &q_abs[first_row..first_row + tile_rows * width];
            let tile = Tile {
                q: q_tile,
                rows: tile_rows,
                kv_lora,
                scale: ctx.scale,
            };
            tile.attend(&keys, ctx.seq.start_pos + i + 1, out);
        });
    Ok(())
}

/// The value width implied by an output of `len` floats over `rows` query rows.
pub(crate) fn value_width(
    op: &'static str,
    len: usize,
    rows: usize,
    width: usize,
) -> Result<usize, KernelError> {
    if len % rows != 0 {
        return Err(KernelError::NotDivisible {
            op,
            what: "out_latent",
            len,
            width: rows,
        });
    }
    let kv_lora = len / rows;
    if kv_lora == 0 || kv_lora > width {
        return Err(KernelError::InvalidParam {
            op,
            field: "out_latent.len() / (num_queries * heads)",
            limit: "in 1..=pages.width",
            value: kv_lora.to_string(),
        });
    }
    Ok(kv_lora)
}

/// One tile of query rows and what they need to attend.
struct Tile<'q> {
    /// `[rows][width]` absorbed queries.
    q: &'q [f32],
    rows: usize,
    kv_lora: usize,
    scale: f32,
}

impl Tile<'_> {
    /// Streams keys `0..n_keys` page by page and writes `[rows][kv_lora]` into `out`.
    fn attend(&self, keys: &KeyRows<'_>, n_keys: usize, out: &mut [f32]) {
        let (rows, kv_lora, width, page_size) =
            (self.rows, self.kv_lora, keys.width(), keys.page_size());
        let mut max = vec![f32::NEG_INFINITY; rows];
        let mut sum = vec![0.0f32; rows];
        out.fill(0.0); // the running, unnormalised accumulators `[rows][kv_lora]`
        let mut scores = vec![0.0f32; rows * page_size]; // `[rows][page keys]`

        // The tile's queries transposed, `[width][TILE_ROWS]` (rows past `rows` zero): a key's
        // scores against every row are then TILE_ROWS-wide multiply-adds over its elements, no
        // horizontal sum per (key, row).
        let mut q_t = vec![0.0f32; width * TILE_ROWS];
        for (r, q) in self.q.chunks_exact(width).enumerate() {
            for (d, v) in q.iter().enumerate() {
                q_t[d * TILE_ROWS + r] = *v;
            }
        }

        for page in 0..n_keys.div_ceil(page_size) {
            let count = page_size.min(n_keys - page * page_size);
            let page_rows = &keys.page(page)[..count * width];

            // Scores: each key row is loaded once and scored against every query row of the tile.
            for (j, key) in page_rows.chunks_exact(width).enumerate() {
                let mut acc = [0.0f32; TILE_ROWS];
                for (k, q_d) in key.iter().zip(q_t.chunks_exact(TILE_ROWS)) {
                    for (a, q) in acc.iter_mut().zip(q_d) {
                        *a += q * k;
                    }
                }
                for (r, a) in acc.iter().take(rows).enumerate() {
                    scores[r * page_size + j] = a * self.scale;
                }
            }
            // Online softmax: rescale the running state to the new max, turn scores into weights.
            for r in 0..rows {
                let s_r = &mut scores[r * page_size..r * page_size + count];
                let page_max = s_r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let new_max = max[r].max(page_max);
                let alpha = if max[r] == f32::NEG_INFINITY {
                    0.0
                } else {
                    exp_f32(max[r] - new_max)
                };
                for x in s_r.iter_mut() {
                    *x = exp_f32(*x - new_max);
                }
                sum[r] = sum[r] * alpha + lane_sum(s_r);
                max[r] = new_max;
                if alpha != 1.0 {
                    for a in &mut out[r * kv_lora..(r + 1) * kv_lora] {
                        *a *= alpha;
                    }
                }
            }
            // Values: again one load of each key row for the whole tile.
            for (j, key) in page_rows.chunks_exact(width).enumerate() {
                let value = &key[..kv_lora];
                for (r, acc) in out.chunks_exact_mut(kv_lora).enumerate() {
                    let p = scores[r * page_size + j];
                    for (a, v) in acc.iter_mut().zip(value) {
                        *a += p * v;
                    }
                }
            }
        }
        for (acc, &l) in out.chunks_exact_mut(kv_lora).zip(&sum) {
            for a in acc {
                *a /= l;
            }
        }
    }
}
