//! Typed launchers for `gpu/draft.cu`: the speculative drafter's row scatter, block attention
//! (with its split-K merge), tap concatenation, confidence head and Markov-head step.
//!
//! Every launcher checks that each buffer holds what the kernel will index before launching.
//! Indices that live on the device (slots, block ids, row ids, context lengths) cannot be
//! checked here without a download; the kernels never go outside their buffers for them (a bad
//! slot is skipped, a bad row or block id gives NaN rows), and the backend's CPU arm checks
//! them all.

use super::launch::{DeviceMem, Gpu, KernelArgs, KernelParam, LaunchDims};
use super::ops::{need, Dv, GpuMatrix, PagesView};
use crate::cpu::draft::BlockAttnDims;
use crate::error::{c_int as int, KernelError};
use crate::gpu::{Defines, Source};

/// Warps per block-attention block (`DA_WARPS` in `draft.cu`).
const ATTN_WARPS: usize = 4;
/// Keys one block-attention block walks per step: a 32-key tile per warp.
const ATTN_STEP: usize = ATTN_WARPS * 32;
/// Fewest keys a split takes (shorter splits cost more in the merge than they save).
const MIN_SPLIT_KEYS: usize = 256;
/// Largest head dimension of the block-attention kernels.
pub const MAX_HEAD_DIM: usize = 128;

fn kernel<D: Gpu>(dev: &D, name: &'static str) -> Result<D::Function, KernelError> {
    dev.function(Source::Draft, &Defines::new(), name)
}

/// `pages[slots[r]] = rows[r]` for `[R][pages.width]` rows and `R = slots.len` slots (f32
/// rows, stored as the pages' element type). Slots outside the pool are skipped on the device.
pub fn scatter_rows<D: Gpu>(
    dev: &D,
    rows: Dv<f32>,
    slots: Dv<i64>,
    pages: PagesView,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_scatter_rows";
    need(OP, "rows", slots.len * pages.width, rows.len)?;
    if slots.len == 0 || pages.width == 0 {
        return Ok(());
    }
    let f = kernel(
        dev,
        if pages.bf16 {
            "draft_scatter_bf16"
        } else {
            "draft_scatter_f32"
        },
    )?;
    let mut a = KernelArgs::new();
    a.push(rows.ptr)
        .push(slots.ptr)
        .push(pages.ptr)
        .push(int(OP, "width", pages.width)?)
        .push(pages.slots() as i64);
    dev.launch(&f, LaunchDims::linear(slots.len, 128), &mut a)
}

/// One block-attention launch: `seqs` sequences of `dims.block` query rows each.
#[derive(Debug, Clone, Copy)]
pub struct BlockAttnBatch {
    /// `[S·B][H·d]` queries.
    pub q: Dv<f32>,
    /// `[S·B][KV·d]` the block rows' keys.
    pub k: Dv<f32>,
    /// `[S·B][KV·d]` the block rows' values.
    pub v: Dv<f32>,
    /// The layer's context rows, `width = 2·KV·d` (f32 or bf16).
    pub pages: PagesView,
    /// `[S][stride]` block tables.
    pub tables: Dv<i32>,
    /// Entries per block-table row.
    pub stride: usize,
    /// `[S]` context lengths.
    pub ctx: Dv<i32>,
    /// Sequences `S`.
    pub seqs: usize,
    /// The longest context (≥ every entry of `ctx`; keys past `max_ctx + B` are never
    /// visited, so a longer device context poisons its rows with NaN instead).
    pub max_ctx: usize,
    /// Head geometry.
    pub dims: BlockAttnDims,
}

/// `DraftAttnArgs` in `draft.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DraftAttnArgs {
    q: u64,
    k: u64,
    v: u64,
    pages: u64,
    tables: u64,
    ctx: u64,
    out: u64,
    o_part: u64,
    ml_part: u64,
    stride: i32,
    page: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    block: i32,
    splits: i32,
    keys_per_split: i32,
    max_ctx: i32,
    num_blocks: i32,
    scale: f32,
    pad: i32,
}
// SAFETY: repr(C): nine u64 then twelve 4-byte fields: 120 bytes, no padding; matches
// `struct DraftAttnArgs` in draft.cu field for field.
unsafe impl KernelParam for DraftAttnArgs {}

/// How many splits share one work item's `keys`, and how many keys each takes: as many as
/// keep `work_items · splits` within `target_blocks`, each at least [`MIN_SPLIT_KEYS`] keys
/// and a whole number of 128-key block steps.
pub fn plan_splits(target_blocks: usize, work_items: usize, keys: usize) -> (usize, usize) {
    let keys = keys.max(1);
    let want = (target_blocks / work_items.max(1)).max(1);
    let splits = want.min(keys.div_ceil(MIN_SPLIT_KEYS)).max(1);
    let kps = keys.div_ceil(splits).div_ceil(ATTN_STEP) * ATTN_STEP;
    (keys.div_ceil(kps), kps)
}

/// The kernel for `(page element type, rows per block, head dim)`.
fn attn_kernel(bf16: bool, qb: usize, dpl: usize) -> &'static str {
    match (bf16, qb, dpl) {
        (false, 4, 1) => "draft_attn_f32_q4_d32",
        (false, 4, 2) => "draft_attn_f32_q4_d64",
        (false, 4, _) => "draft_attn_f32_q4_d128",
        (false, 8, 1) => "draft_attn_f32_q8_d32",
        (false, 8, 2) => "draft_attn_f32_q8_d64",
        (false, 8, _) => "draft_attn_f32_q8_d128",
        (false, _, 1) => "draft_attn_f32_q16_d32",
        (false, _, 2) => "draft_attn_f32_q16_d64",
        (false, _, _) => "draft_attn_f32_q16_d128",
        (true, 4, 1) => "draft_attn_bf16_q4_d32",
        (true, 4, 2) => "draft_attn_bf16_q4_d64",
        (true, 4, _) => "draft_attn_bf16_q4_d128",
        (true, 8, 1) => "draft_attn_bf16_q8_d32",
        (true, 8, 2) => "draft_attn_bf16_q8_d64",
        (true, 8, _) => "draft_attn_bf16_q8_d128",
        (true, _, 1) => "draft_attn_bf16_q16_d32",
        (true, _, 2) => "draft_attn_bf16_q16_d64",
        (true, _, _) => "draft_attn_bf16_q16_d128",
    }
}

/// Every block-attention kernel [`block_attention`] may launch (f32 and bf16 pages, 4 / 8 / 16
/// rows per block, head dims up to 32 / 64 / 128).
pub fn attn_kernels() -> Vec<&'static str> {
    let mut all = Vec::new();
    for bf16 in [false, true] {
        for qb in [4, 8, 16] {
            for dpl in [1, 2, 4] {
                all.push(attn_kernel(bf16, qb, dpl));
            }
        }
    }
    all
}

/// Block attention of every sequence of `b` into `out` (`[S·B][H·d]`): each block row's query
/// heads attend to the sequence's context rows (from the pages, in position order) and to all
/// `B` block rows, softmax scale `1/sqrt(d)`. Split-K over the keys (merged by a second launch)
/// when the sequences and heads alone would not fill the card.
pub fn block_attention<D: Gpu>(
    dev: &D,
    b: &BlockAttnBatch,
    out: Dv<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_block_attention";
    let d = b.dims;
    d.check(OP)?;
    let (s_n, blk, hd) = (b.seqs, d.block, d.head_dim);
    if hd > MAX_HEAD_DIM {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "head_dim",
            limit: "<= 128",
            value: hd.to_string(),
        });
    }
    if b.pages.width != d.ctx_width() || b.pages.page_size == 0 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "pages",
            limit: "rows of 2·kv_heads·head_dim and a non-zero page",
            value: format!("width {}, page {}", b.pages.width, b.pages.page_size),
        });
    }
    need(OP, "q", s_n * blk * d.q_width(), b.q.len)?;
    need(OP, "k", s_n * blk * d.kv_width(), b.k.len)?;
    need(OP, "v", s_n * blk * d.kv_width(), b.v.len)?;
    need(OP, "out", s_n * blk * d.q_width(), out.len)?;
    need(OP, "tables", s_n * b.stride, b.tables.len)?;
    need(OP, "ctx", s_n, b.ctx.len)?;
    if s_n == 0 {
        return Ok(());
    }
    if s_n > 65_535 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "sequences",
            limit: "<= 65535",
            value: s_n.to_string(),
        });
    }
    let qb = match blk {
        0..=4 => 4,
        5..=8 => 8,
        _ => 16,
    };
    let dpl = hd.div_ceil(32).next_power_of_two();
    let items = d.heads * blk.div_ceil(qb);
    let rows = s_n * blk * d.heads;
    let target = 4 * dev.sm_count() as usize;
    let (splits, kps) = plan_splits(target, s_n * items, b.max_ctx + blk);
    let parts = if splits > 1 {
        Some((
            dev.alloc::<f32>(splits * rows * hd)?,
            dev.alloc::<f32>(splits * rows * 2)?,
        ))
    } else {
        None
    };
    let args = DraftAttnArgs {
        q: b.q.ptr,
        k: b.k.ptr,
        v: b.v.ptr,
        pages: b.pages.ptr,
        tables: b.tables.ptr,
        ctx: b.ctx.ptr,
        out: out.ptr,
        o_part: parts.as_ref().map_or(0, |p| p.0.ptr()),
        ml_part: parts.as_ref().map_or(0, |p| p.1.ptr()),
        stride: int(OP, "stride", b.stride)?,
        page: int(OP, "page", b.pages.page_size)?,
        heads: int(OP, "heads", d.heads)?,
        kv_heads: int(OP, "kv_heads", d.kv_heads)?,
        head_dim: int(OP, "head_dim", hd)?,
        block: int(OP, "block", blk)?,
        splits: int(OP, "splits", splits)?,
        keys_per_split: int(OP, "keys_per_split", kps)?,
        max_ctx: int(OP, "max_ctx", b.max_ctx)?,
        num_blocks: int(OP, "num_blocks", b.pages.num_blocks)?,
        scale: 1.0 / (hd as f32).sqrt(),
        pad: 0,
    };
    int(OP, "rows", rows)?;
    let f = kernel(dev, attn_kernel(b.pages.bf16, qb, dpl))?;
    let mut a = KernelArgs::new();
    a.push(args);
    let dims = LaunchDims {
        grid: (splits as u32, items as u32, s_n as u32),
        block: ((ATTN_WARPS * 32) as u32, 1, 1),
        smem: 0,
    };
    dev.launch(&f, dims, &mut a)?;
    let Some((o_part, ml_part)) = parts else {
        return Ok(());
    };
    let f = kernel(dev, "draft_attn_combine")?;
    let mut a = KernelArgs::new();
    a.push(o_part.ptr())
        .push(ml_part.ptr())
        .push(int(OP, "splits", splits)?)
        .push(int(OP, "rows", rows)?)
        .push(int(OP, "head_dim", hd)?)
        .push(out.ptr);
    let dims = LaunchDims {
        grid: (rows as u32, 1, 1),
        block: (128, 1, 1),
        smem: (splits * 4) as u32,
    };
    dev.launch(&f, dims, &mut a)
}

/// `out[r] = concat_t srcs[t][rows[r]]`: sources of `[n_t][width]`, `out` `[R][width·T]`. One
/// launch per source; a row id outside a source gives NaN in its columns.
pub fn concat_rows<D: Gpu>(
    dev: &D,
    srcs: &[Dv<f32>],
    rows: Dv<i32>,
    width: usize,
    out: Dv<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_gather_concat";
    let stride = width * srcs.len();
    need(OP, "out", rows.len * stride, out.len)?;
    if rows.len == 0 || stride == 0 {
        return Ok(());
    }
    let f = kernel(dev, "draft_concat")?;
    for (t, src) in srcs.iter().enumerate() {
        let mut a = KernelArgs::new();
        a.push(src.ptr)
            .push(int(OP, "src rows", src.len / width)?)
            .push(rows.ptr)
            .push(int(OP, "width", width)?)
            .push(out.ptr)
            .push(int(OP, "out width", stride)?)
            .push(int(OP, "column", t * width)?);
        dev.launch(&f, LaunchDims::linear(rows.len, 128), &mut a)?;
    }
    Ok(())
}

/// The confidence head's inputs.
#[derive(Debug, Clone, Copy)]
pub struct ConfidenceBatch {
    /// `[R][hidden]` final hidden states.
    pub h: Dv<f32>,
    /// `[R][rank]` Markov embeddings, `rank = w.len − hidden`.
    pub e: Dv<f32>,
    /// `[hidden + rank]` head weight.
    pub w: Dv<f32>,
    /// Floats per `h` row.
    pub hidden: usize,
    /// Head bias.
    pub bias: f32,
}

/// `out[r] = σ(w · [h[r] ; e[r]] + bias)` for `R = out.len` rows.
pub fn confidence<D: Gpu>(dev: &D, b: &ConfidenceBatch, out: Dv<f32>) -> Result<(), KernelError> {
    const OP: &str = "gpu_confidence";
    let ConfidenceBatch {
        h,
        e,
        w,
        hidden,
        bias,
    } = *b;
    let r = out.len;
    need(OP, "w", hidden, w.len)?;
    let rank = w.len - hidden;
    need(OP, "h", r * hidden, h.len)?;
    need(OP, "e", r * rank, e.len)?;
    if r == 0 {
        return Ok(());
    }
    let f = kernel(dev, "draft_confidence")?;
    let mut a = KernelArgs::new();
    a.push(h.ptr)
        .push(e.ptr)
        .push(w.ptr)
        .push(int(OP, "rows", r)?)
        .push(int(OP, "hidden", hidden)?)
        .push(int(OP, "rank", rank)?)
        .push(bias)
        .push(out.ptr);
    dev.launch(&f, LaunchDims::linear(r.div_ceil(8), 256), &mut a)
}

/// Inputs a Markov-step block takes together (`MK_ROWS` in `draft.cu`).
const MARKOV_ROWS: usize = 8;
/// Threads (vocabulary entries) per Markov-step block (`MK_THREADS` in `draft.cu`).
const MARKOV_THREADS: usize = 256;
/// Largest Markov rank: the group's W1 rows fit 32 KB of shared memory.
pub const MAX_MARKOV_RANK: usize = 1024;

/// One Markov-head step's operands (`backend::draft::MarkovStep`, on the device).
#[derive(Debug, Clone, Copy)]
pub struct MarkovBatch<'a, D: Gpu> {
    /// `[rows][vocab]` the backbone's logits.
    pub logits: Dv<f32>,
    /// `[rows][hidden]` its final hidden states.
    pub hidden: Dv<f32>,
    /// `[n]` each input's row at this block position.
    pub at: Dv<i32>,
    /// `[n]` each input's previous token.
    pub prev: Dv<i32>,
    /// `[vocab][rank]` the bigram embedding.
    pub w1: &'a GpuMatrix<D>,
    /// `[vocab][rank]` the bigram projection.
    pub w2: &'a GpuMatrix<D>,
    /// `[hidden + rank]` the confidence head's weight.
    pub conf_w: Dv<f32>,
    /// The confidence head's bias.
    pub conf_bias: f32,
}

/// `MarkovArgs` in `draft.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MarkovArgs {
    logits: u64,
    hidden: u64,
    at: u64,
    prev: u64,
    w1: u64,
    w2: u64,
    cw: u64,
    out: u64,
    conf: u64,
    cb: f32,
    n: i32,
    rows: i32,
    vocab: i32,
    rank: i32,
    hid: i32,
}
// SAFETY: repr(C): nine u64 then six 4-byte fields: 96 bytes, no padding; matches
// `struct MarkovArgs` in draft.cu field for field.
unsafe impl KernelParam for MarkovArgs {}

/// One left-to-right Markov-head step for `n = at.len` inputs, in one launch:
/// `out[s] = logits[at[s]] + W2 · W1[prev[s]]` (`[n][vocab]`) and
/// `conf[s] = σ(w · [hidden[at[s]] ; W1[prev[s]]] + bias)`. f32 sums (the bias in 8-wide
/// steps of the rank, the confidence a warp per input), so it matches the CPU's composition
/// within summation order. On the device a `prev` outside the vocabulary reads a zero W1 row
/// and an `at` outside the rows gives NaN (neither can be checked without a download).
pub fn markov_step<D: Gpu>(
    dev: &D,
    b: &MarkovBatch<'_, D>,
    out: Dv<f32>,
    conf: Dv<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_markov_step";
    let (vocab, rank) = (b.w1.rows(), b.w1.cols());
    if b.w2.rows() != vocab || b.w2.cols() != rank || b.w2.is_bf16() != b.w1.is_bf16() {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "w2",
            limit: "the shape and element type of w1",
            value: format!("[{}][{}]", b.w2.rows(), b.w2.cols()),
        });
    }
    if rank == 0 || rank > MAX_MARKOV_RANK {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "rank",
            limit: "in 1..=1024",
            value: rank.to_string(),
        });
    }
    need(OP, "conf_w", rank + 1, b.conf_w.len)?;
    let hid = b.conf_w.len - rank;
    let n = b.at.len;
    let rows = b.logits.len / vocab.max(1);
    need(OP, "logits", rows * vocab, b.logits.len)?;
    need(OP, "hidden", rows * hid, b.hidden.len)?;
    need(OP, "prev", n, b.prev.len)?;
    need(OP, "out", n * vocab, out.len)?;
    need(OP, "conf", n, conf.len)?;
    if n == 0 {
        return Ok(());
    }
    let groups = n.div_ceil(MARKOV_ROWS);
    if groups > 65_535 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "inputs",
            limit: "<= 524280",
            value: n.to_string(),
        });
    }
    let args = MarkovArgs {
        logits: b.logits.ptr,
        hidden: b.hidden.ptr,
        at: b.at.ptr,
        prev: b.prev.ptr,
        w1: b.w1.ptr(),
        w2: b.w2.ptr(),
        cw: b.conf_w.ptr,
        out: out.ptr,
        conf: conf.ptr,
        cb: b.conf_bias,
        n: int(OP, "inputs", n)?,
        rows: int(OP, "rows", rows)?,
        vocab: int(OP, "vocab", vocab)?,
        rank: int(OP, "rank", rank)?,
        hid: int(OP, "hidden", hid)?,
    };
    let f = kernel(
        dev,
        if b.w1.is_bf16() {
            "draft_markov_bf16"
        } else {
            "draft_markov_f32"
        },
    )?;
    let mut a = KernelArgs::new();
    a.push(args);
    let dims = LaunchDims {
        grid: (vocab.div_ceil(MARKOV_THREADS) as u32, groups as u32, 1),
        block: (MARKOV_THREADS as u32, 1, 1),
        smem: (MARKOV_ROWS * rank * 4) as u32,
    };
    dev.launch(&f, dims, &mut a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_fill_the_card_in_whole_steps() {
        // One sequence, 8 heads, 32k keys, 528 blocks wanted: 66 splits of 512 keys.
        let (s, kps) = plan_splits(528, 8, 32_768 + 4);
        assert!(s > 1 && kps % ATTN_STEP == 0 && s * kps >= 32_772);
        assert!((s - 1) * kps < 32_772, "no empty split");
        // Enough work items already: one split.
        assert_eq!(plan_splits(528, 1024, 4096).0, 1);
        // Short contexts are never split below the minimum.
        assert_eq!(plan_splits(528, 1, 200).0, 1);
        assert_eq!(plan_splits(528, 1, 0), (1, ATTN_STEP));
    }

    #[test]
    fn kernel_names_cover_every_shape() {
        for bf in [false, true] {
            for qb in [4, 8, 16] {
                for dpl in [1, 2, 4] {
                    let n = attn_kernel(bf, qb, dpl);
                    assert!(n.contains(&format!("_q{qb}_d{}", dpl * 32)), "{n}");
                    assert_eq!(n.contains("bf16"), bf);
                }
            }
        }
    }
}
