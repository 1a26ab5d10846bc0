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
    tiled(q_abs, heads, heads, ctx, out_latent)
}

/// [`mla_absorbed_tiled`] over `heads` rows per token of which only the first `live` are
/// wanted (the rest zero padding, [`super::mla_absorbed_attention`]): rows past `live` are
/// neither softmaxed nor accumulated, and their outputs are left zero.
pub(crate) fn tiled(
    q_abs: &[f32],
    heads: usize,
    live: usize,
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
            let live = live.saturating_sub(tile * tile_rows).min(tile_rows);
            let (live_out, padding) = out.split_at_mut(live * kv_lora);
            padding.fill(0.0);
            if live == 0 {
                return;
            }
            let first_row = (i * heads + tile * tile_rows) * width;
            let q_tile = &q_abs[first_row..first_row + tile_rows * width];
            let tile = Tile {
                q: q_tile,
                rows: live,
                kv_lora,
                scale: ctx.scale,
            };
            tile.attend_dispatch(&keys, ctx.seq.start_pos + i + 1, live_out);
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

/// Keys scored together (independent accumulators: 4 keys × 16 rows are 8 AVX2 registers).
const KEY_STEP: usize = 4;

/// Value columns accumulated together in registers (4 AVX2 registers).
const VALUE_STEP: usize = 32;

/// One tile of query rows and what they need to attend.
struct Tile<'q> {
    /// `[rows or more][width]` absorbed queries (rows past `rows` are not read).
    q: &'q [f32],
    /// Query rows to attend (≤ [`TILE_ROWS`]).
    rows: usize,
    kv_lora: usize,
    scale: f32,
}

impl Tile<'_> {
    /// [`Self::attend`], compiled for AVX2 when the CPU has it (the same operations in the same
    /// order: the results are bitwise those of the baseline build).
    fn attend_dispatch(&self, keys: &KeyRows<'_>, n_keys: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: this CPU has AVX2, checked just above.
            return unsafe { self.attend_avx2(keys, n_keys, out) };
        }
        self.attend(keys, n_keys, out)
    }

    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn attend_avx2(&self, keys: &KeyRows<'_>, n_keys: usize, out: &mut [f32]) {
        self.attend(keys, n_keys, out)
    }

    /// The scores (unscaled) of `U` consecutive key rows (`keys`, `[U][width]`) against the
    /// tile's transposed queries `q_t` (`[width][TILE_ROWS]`), each summed over the key's
    /// elements in order.
    #[inline(always)]
    fn scores<const U: usize>(
        &self,
        q_t: &[f32],
        keys: &[f32],
        width: usize,
    ) -> [[f32; TILE_ROWS]; U] {
        let mut acc = [[0.0f32; TILE_ROWS]; U];
        for (d, q_d) in q_t.chunks_exact(TILE_ROWS).enumerate() {
            for (u, acc) in acc.iter_mut().enumerate() {
                let k = keys[u * width + d];
                for (a, q) in acc.iter_mut().zip(q_d) {
                    *a += q * k;
                }
            }
        }
        acc
    }

    /// Streams keys `0..n_keys` page by page and writes `[rows][kv_lora]` into `out`.
    #[inline(always)]
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
        for (r, q) in self.q.chunks_exact(width).take(rows).enumerate() {
            for (d, v) in q.iter().enumerate() {
                q_t[d * TILE_ROWS + r] = *v;
            }
        }

        for page in 0..n_keys.div_ceil(page_size) {
            let count = page_size.min(n_keys - page * page_size);
            let page_rows = &keys.page(page)[..count * width];

            // Scores: each key row is loaded once and scored against every query row of the
            // tile, KEY_STEP keys at a time so that as many independent accumulators are in
            // flight (one key's 16 sums are a chain of dependent adds over its elements).
            let mut j = 0;
            for group in page_rows.chunks_exact(KEY_STEP * width) {
                let acc = self.scores::<KEY_STEP>(&q_t, group, width);
                for (u, acc) in acc.iter().enumerate() {
                    for (r, a) in acc.iter().take(rows).enumerate() {
                        scores[r * page_size + j + u] = a * self.scale;
                    }
                }
                j += KEY_STEP;
            }
            for key in page_rows[j * width..].chunks_exact(width) {
                let [acc] = self.scores::<1>(&q_t, key, width);
                for (r, a) in acc.iter().take(rows).enumerate() {
                    scores[r * page_size + j] = a * self.scale;
                }
                j += 1;
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
            // Values: per row and VALUE_STEP-wide column block, the accumulators stay in
            // registers while the page's keys stream by (the same sums in the same key order).
            for (r, acc) in out.chunks_exact_mut(kv_lora).enumerate() {
                let p_r = &scores[r * page_size..r * page_size + count];
                let mut c0 = 0;
                for block in acc.chunks_exact_mut(VALUE_STEP) {
                    let mut a = [0.0f32; VALUE_STEP];
                    a.copy_from_slice(block);
                    for (p, key) in p_r.iter().zip(page_rows.chunks_exact(width)) {
                        for (a, v) in a.iter_mut().zip(&key[c0..c0 + VALUE_STEP]) {
                            *a += p * v;
                        }
                    }
                    block.copy_from_slice(&a);
                    c0 += VALUE_STEP;
                }
                for (p, key) in p_r.iter().zip(page_rows.chunks_exact(width)) {
                    for (a, v) in acc[c0..].iter_mut().zip(&key[c0..kv_lora]) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::mla::{LatentPages, SeqAttn};

    /// A deterministic spread of values in about [-1, 1].
    fn values(n: usize, salt: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.0) - 1.0)
            .collect()
    }

    #[test]
    fn skipped_padding_rows_and_the_avx2_build_change_no_live_output() {
        // 12 real heads padded to 16 (the embedded model's shape), 3 queries over a cached
        // prefix spanning pages: the live rows are bitwise those of the full 16-row tile
        // (heads never mix), the padded ones are zero, and the baseline build of a tile gives
        // the same bits as the dispatched one.
        let (width, kv_lora, page, heads, live, s, start) = (80, 64, 16, 16, 12, 3, 37);
        let table: Vec<u32> = vec![2, 0, 3];
        let data = values(4 * page * width, 1);
        let ctx = LatentContext {
            pages: LatentPages {
                data: &data,
                page_size: page,
                width,
            },
            seq: SeqAttn {
                block_table: &table,
                start_pos: start,
                num_queries: s,
            },
            scale: 0.2,
        };
        let mut q = values(s * heads * width, 2);
        for t in 0..s {
            q[(t * heads + live) * width..(t + 1) * heads * width].fill(0.0);
        }
        let mut full = vec![0.0f32; s * heads * kv_lora];
        let mut skipped = vec![1.0f32; full.len()];
        mla_absorbed_tiled(&q, heads, &ctx, &mut full).unwrap();
        tiled(&q, heads, live, &ctx, &mut skipped).unwrap();
        for (row, (a, b)) in full
            .chunks_exact(kv_lora)
            .zip(skipped.chunks_exact(kv_lora))
            .enumerate()
        {
            if row % heads < live {
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "row {row}"
                );
            } else {
                assert!(b.iter().all(|&y| y == 0.0), "padded row {row}");
            }
        }
        let keys = KeyRows::new(OP, &ctx).unwrap();
        let tile = Tile {
            q: &q[..heads * width],
            rows: live,
            kv_lora,
            scale: ctx.scale,
        };
        let (mut base, mut dispatched) = (vec![0.0f32; live * kv_lora], vec![0.0; live * kv_lora]);
        tile.attend(&keys, start + 1, &mut base);
        tile.attend_dispatch(&keys, start + 1, &mut dispatched);
        assert!(base
            .iter()
            .zip(&dispatched)
            .all(|(x, y)| x.to_bits() == y.to_bits()));
        assert!(base.iter().any(|&v| v != 0.0));
    }
}
