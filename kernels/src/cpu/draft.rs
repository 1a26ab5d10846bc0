//! The speculative drafter's reference math (DSpark / DFlash block drafter): block attention
//! over a sequence's context rows and its own block, tap concatenation, the confidence head.
//!
//! These functions are the drafter's CPU path: `backend::draft` calls them for its CPU arm,
//! and the model's host-only drafter calls them directly, so both compute the same bits.
//!
//! Context rows are stored in the drafter's natural row layout: `[K | V]`, `width = 2 · kv_heads
//! · head_dim` floats, K (`kv_heads · head_dim`) first.

use rayon::prelude::*;

use super::gemm::{matmul_f32, MatmulDims};
use super::mla::LatentPages;
use super::softmax::attention_softmax;
use crate::backend::host_index;
use crate::KernelError;

const OP: &str = "block_attention";

/// The block attention's head geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockAttnDims {
    /// Query heads `H`.
    pub heads: usize,
    /// Key / value heads `KV` (`H` a multiple of it; query head `h` reads KV head
    /// `h / (H / KV)`).
    pub kv_heads: usize,
    /// Floats per head `d`; the softmax scale is `1 / sqrt(d)`.
    pub head_dim: usize,
    /// Block rows `B` per sequence (the queries, and the last `B` keys).
    pub block: usize,
}

impl BlockAttnDims {
    /// Floats of one K (or V) row of every KV head: `KV · d`.
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Floats of one context row: `[K | V]`, `2 · KV · d`.
    pub fn ctx_width(&self) -> usize {
        2 * self.kv_width()
    }

    /// Floats of one query (or output) row: `H · d`.
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// `heads`, `kv_heads`, `head_dim` and `block` non-zero, `heads` a multiple of `kv_heads`.
    pub fn check(&self, op: &'static str) -> Result<(), KernelError> {
        let bad = |field, limit, value: usize| KernelError::InvalidParam {
            op,
            field,
            limit,
            value: value.to_string(),
        };
        if self.kv_heads == 0 {
            return Err(bad("kv_heads", "> 0", 0));
        }
        if self.heads == 0 || self.heads % self.kv_heads != 0 {
            return Err(bad("heads", "a non-zero multiple of kv_heads", self.heads));
        }
        if self.head_dim == 0 {
            return Err(bad("head_dim", "> 0", 0));
        }
        if self.block == 0 {
            return Err(bad("block", "> 0", 0));
        }
        Ok(())
    }
}

/// The block rows' queries, keys and values (of one sequence for [`attend_block`], of the
/// whole batch for [`block_attention`]).
#[derive(Debug, Clone, Copy)]
pub struct BlockRows<'a> {
    /// `[rows][H][d]` queries.
    pub q: &'a [f32],
    /// `[rows][KV][d]` keys.
    pub k: &'a [f32],
    /// `[rows][KV][d]` values.
    pub v: &'a [f32],
}

/// One sequence's block attention for one layer.
///
/// `x.q` is `[B][H][d]` (the block rows' queries), `x.k` and `x.v` are `[B][KV][d]` (the block
/// rows' own keys and values), `ctx_row(j)` is context row `j < n` (`[K | V]`, at least
/// [`BlockAttnDims::ctx_width`] floats), `out` is `[B][H][d]`. For block row `i` and head `h`
/// (KV head `g = h / (H / KV)`), the keys are the `n` context rows in position order, then the
/// `B` block rows (bidirectional: no causal mask inside the block):
/// `out = Σ_j softmax_j(q · key_j / sqrt(d)) · value_j`.
///
/// Per KV head, the group's keys and values are gathered into contiguous rows (context rows
/// first, then the block's), and its `B · H / KV` query rows attend as two products — scores
/// `Q · Kᵀ`, [`attention_softmax`] per row, then `P · V` — on the same SGEMM and softmax as the
/// target's MHA prefill ([`crate::cpu::mla`]). Sums run in the SGEMM's order, so the result
/// matches a left-to-right definition to f32 rounding (`backend_draft.rs` holds it to an f64
/// reference). Any caller that computes the drafter's attention through this function gets the
/// same bits.
pub fn attend_block<'c>(
    d: &BlockAttnDims,
    x: BlockRows<'_>,
    n: usize,
    ctx_row: impl Fn(usize) -> &'c [f32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    d.check(OP)?;
    let BlockRows { q, k, v } = x;
    let (b, hd, heads) = (d.block, d.head_dim, d.heads);
    let kvw = d.kv_width();
    crate::cpu::gemm::check_len(OP, "q", b * d.q_width(), q.len())?;
    crate::cpu::gemm::check_len(OP, "k", b * kvw, k.len())?;
    crate::cpu::gemm::check_len(OP, "v", b * kvw, v.len())?;
    crate::cpu::gemm::check_len(OP, "out", b * d.q_width(), out.len())?;
    // Every context row is resolved (and its width checked) before any arithmetic.
    let rows: Vec<&[f32]> = (0..n).map(&ctx_row).collect();
    if let Some(r) = rows.iter().find(|r| r.len() < 2 * kvw) {
        return Err(KernelError::ShapeMismatch {
            op: OP,
            what: "context row",
            expected: 2 * kvw,
            got: r.len(),
        });
    }
    let group = heads / d.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let keys = n + b;
    // One KV head's query rows, keys, values, scores and outputs.
    let r = b * group;
    let (mut qg, mut og) = (vec![0.0f32; r * hd], vec![0.0f32; r * hd]);
    let (mut kg, mut vg) = (vec![0.0f32; keys * hd], vec![0.0f32; keys * hd]);
    let mut scores = vec![0.0f32; r * keys];
    for g in 0..d.kv_heads {
        let head = g * hd..(g + 1) * hd;
        for (j, (kd, vd)) in kg
            .chunks_exact_mut(hd)
            .zip(vg.chunks_exact_mut(hd))
            .enumerate()
        {
            let (kr, vr) = if j < n {
                (&rows[j][..kvw], &rows[j][kvw..2 * kvw])
            } else {
                let row = (j - n) * kvw..(j - n + 1) * kvw;
                (&k[row.clone()], &v[row])
            };
            kd.copy_from_slice(&kr[head.clone()]);
            vd.copy_from_slice(&vr[head.clone()]);
        }
        // Row `row` of the group's queries / outputs: block row `row / group`, head
        // `g · group + row % group` of `q` and `out`.
        let at = |row: usize| {
            let h = (row / group) * heads + g * group + row % group;
            h * hd..(h + 1) * hd
        };
        for (row, qd) in qg.chunks_exact_mut(hd).enumerate() {
            qd.copy_from_slice(&q[at(row)]);
        }
        let scores_of = MatmulDims {
            m: r,
            k: hd,
            n: keys,
            b_transposed: true,
        };
        matmul_f32(&qg, &kg, scores_of, &mut scores)?;
        for row in scores.chunks_exact_mut(keys) {
            attention_softmax(row, scale)?;
        }
        let out_of = MatmulDims {
            m: r,
            k: keys,
            n: hd,
            b_transposed: false,
        };
        matmul_f32(&scores, &vg, out_of, &mut og)?;
        for (row, od) in og.chunks_exact(hd).enumerate() {
            out[at(row)].copy_from_slice(od);
        }
    }
    Ok(())
}

/// A batch of sequences' context rows in a paged layer.
#[derive(Debug, Clone, Copy)]
pub struct PagedContext<'a> {
    /// The layer's pages: `[block][page][width]`, `width` = [`BlockAttnDims::ctx_width`].
    pub pages: LatentPages<'a>,
    /// `[S][stride]` flat block tables; position `p` of sequence `s` is row `p % page` of
    /// block `tables[s · stride + p / page]`.
    pub tables: &'a [i32],
    /// Entries per block-table row.
    pub stride: usize,
    /// `[S]` context lengths `n_s`.
    pub lens: &'a [usize],
}

/// [`attend_block`] for every sequence of a batch (in parallel over sequences), the context
/// rows read from pages: `x.q` and `out` are `[S·B][H·d]`, `x.k` and `x.v` `[S·B][KV·d]`, with
/// `S = ctx.lens.len()`. Block tables, block ids and the page width are checked first.
pub fn block_attention(
    d: &BlockAttnDims,
    x: BlockRows<'_>,
    ctx: PagedContext<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    d.check(OP)?;
    let BlockRows { q, k, v } = x;
    let s_n = ctx.lens.len();
    let (b, qw, kvw) = (d.block, d.q_width(), d.kv_width());
    crate::cpu::gemm::check_len(OP, "q", s_n * b * qw, q.len())?;
    crate::cpu::gemm::check_len(OP, "k", s_n * b * kvw, k.len())?;
    crate::cpu::gemm::check_len(OP, "v", s_n * b * kvw, v.len())?;
    crate::cpu::gemm::check_len(OP, "out", s_n * b * qw, out.len())?;
    let pages = ctx.pages;
    let (page, width) = (pages.page_size, pages.width);
    crate::cpu::gemm::check_len(OP, "pages.width", d.ctx_width(), width)?;
    if page == 0 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "page_size",
            limit: "> 0",
            value: "0".into(),
        });
    }
    if ctx.tables.len() < s_n * ctx.stride {
        return Err(KernelError::ShapeMismatch {
            op: OP,
            what: "tables",
            expected: s_n * ctx.stride,
            got: ctx.tables.len(),
        });
    }
    let blocks = pages.num_blocks();
    // Each sequence's table covers its context and names blocks of the pool.
    for (s, &n) in ctx.lens.iter().enumerate() {
        if n > ctx.stride * page {
            return Err(KernelError::BlockTableTooShort {
                op: OP,
                blocks: ctx.stride,
                page_size: page,
                needed_tokens: n,
            });
        }
        for &blk in &ctx.tables[s * ctx.stride..s * ctx.stride + n.div_ceil(page)] {
            host_index(OP, "block id", blk.into(), blocks)?;
        }
    }
    let data = pages.data;
    out.par_chunks_mut(b * qw)
        .enumerate()
        .try_for_each(|(s, out)| {
            let n = ctx.lens[s];
            let table = &ctx.tables[s * ctx.stride..(s + 1) * ctx.stride];
            let row = |p: usize| -> &[f32] {
                let at = table[p / page] as usize * page + p % page;
                &data[at * width..(at + 1) * width]
            };
            let x = BlockRows {
                q: &q[s * b * qw..(s + 1) * b * qw],
                k: &k[s * b * kvw..(s + 1) * b * kvw],
                v: &v[s * b * kvw..(s + 1) * b * kvw],
            };
            attend_block(d, x, n, row, out)
        })
}

/// `out[r] = concat_t srcs[t][rows[r]]`: each source is `[n_t][width]`, `out` is
/// `[rows][width · srcs.len()]` (the drafter's concatenation of tapped hidden states, tap by
/// tap within a row). Row indices are checked against each source.
pub fn concat_rows(
    srcs: &[&[f32]],
    rows: &[i32],
    width: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "gather_concat";
    let taps = srcs.len();
    crate::cpu::gemm::check_len(OP, "out", rows.len() * width * taps, out.len())?;
    if width == 0 || taps == 0 {
        return Ok(());
    }
    for src in srcs {
        if src.len() % width != 0 {
            return Err(KernelError::NotDivisible {
                op: OP,
                what: "src",
                len: src.len(),
                width,
            });
        }
    }
    for (dst, &r) in out.chunks_exact_mut(width * taps).zip(rows) {
        for (piece, src) in dst.chunks_exact_mut(width).zip(srcs) {
            let r = host_index(OP, "row", r.into(), src.len() / width)?;
            piece.copy_from_slice(&src[r * width..(r + 1) * width]);
        }
    }
    Ok(())
}

/// The confidence head of one block position: `σ(wᵀ[h ; e] + bias)`, a sequential f32 sum
/// over `w` against `h` then `e`, then `+ bias`, then `1 / (1 + exp(−z))` (DSpark's estimate
/// that the draft there survives verification). Terms past the shorter of `w` and `h ‖ e` are
/// not summed; [`confidence`] checks the lengths.
pub fn survival(w: &[f32], bias: f32, h: &[f32], e: &[f32]) -> f32 {
    let z: f32 = w
        .iter()
        .zip(h.iter().chain(e))
        .map(|(w, x)| w * x)
        .sum::<f32>()
        + bias;
    1.0 / (1.0 + (-z).exp())
}

/// The confidence head's inputs over `R` rows.
#[derive(Debug, Clone, Copy)]
pub struct ConfidenceRows<'a> {
    /// `[R][hidden]` final hidden states.
    pub h: &'a [f32],
    /// `[R][rank]` the previous tokens' Markov embeddings.
    pub e: &'a [f32],
    /// Floats per `h` row.
    pub hidden: usize,
}

/// [`survival`] of every row: `w` is `[hidden + rank]`, `out` is `[R]`.
pub fn confidence(
    w: &[f32],
    bias: f32,
    x: ConfidenceRows<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    const OP: &str = "confidence";
    let ConfidenceRows { h, e, hidden } = x;
    let r = out.len();
    let rank = w
        .len()
        .checked_sub(hidden)
        .ok_or(KernelError::ShapeMismatch {
            op: OP,
            what: "w",
            expected: hidden,
            got: w.len(),
        })?;
    crate::cpu::gemm::check_len(OP, "h", r * hidden, h.len())?;
    crate::cpu::gemm::check_len(OP, "e", r * rank, e.len())?;
    for (i, o) in out.iter_mut().enumerate() {
        let (h, e) = (
            &h[i * hidden..(i + 1) * hidden],
            &e[i * rank..(i + 1) * rank],
        );
        *o = survival(w, bias, h, e);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_key_attends_to_itself() {
        // n = 0, B = 1: the only key is the block row, softmax weight 1, out = its value.
        let d = BlockAttnDims {
            heads: 2,
            kv_heads: 1,
            head_dim: 2,
            block: 1,
        };
        let mut out = vec![0.0; 4];
        let none = |_: usize| -> &[f32] { &[] };
        let x = BlockRows {
            q: &[1., 2., 3., 4.],
            k: &[5., 6.],
            v: &[7., 8.],
        };
        attend_block(&d, x, 0, none, &mut out).expect("valid");
        assert_eq!(out, vec![7., 8., 7., 8.]);
    }

    #[test]
    fn a_short_context_row_is_an_error() {
        let d = BlockAttnDims {
            heads: 1,
            kv_heads: 1,
            head_dim: 2,
            block: 1,
        };
        let short = [0.0f32; 3];
        let row = |_: usize| -> &[f32] { &short };
        let x = BlockRows {
            q: &[0.; 2],
            k: &[0.; 2],
            v: &[0.; 2],
        };
        let e = attend_block(&d, x, 1, row, &mut [0.; 2]);
        assert!(e.unwrap_err().to_string().contains("context row"));
    }

    #[test]
    fn survival_is_the_sigmoid_of_the_affine_score() {
        let c = survival(&[1., 2., 3.], -1.0, &[1., 1.], &[1.]);
        assert_eq!(c, 1.0 / (1.0 + (-5.0f32).exp()));
        let mut out = [0.0];
        let x = ConfidenceRows {
            h: &[1.],
            e: &[1., 1.],
            hidden: 1,
        };
        assert!(confidence(&[1., 2.], 0.0, x, &mut out).is_err());
    }
}
