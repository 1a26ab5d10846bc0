//! The speculative drafter's own ops (DSpark / DFlash block drafter): context rows scattered
//! into the drafter's pages, block attention over them (GQA), the concatenation of tapped
//! hidden states, the confidence head, and one step of the Markov head with it.
//!
//! The drafter's context cache has a natural paged layout per drafter layer:
//! `[block][page][width]` f32 (or bf16 on a GPU) with `width = 2 · kv_heads · head_dim`, each
//! row K (`kv_heads · head_dim` floats) then V. Position `p` of a sequence is row `p % page` of
//! block `table[p / page]`.
//!
//! CPU arms call [`crate::cpu::draft`], the math the host-only drafter runs, so the two give
//! the same bits. GPU arms (CUDA and ROCm, one launcher each) call `crate::gpu::draft`; its
//! block attention is f32 with an online softmax and a split-K merge, so it matches the CPU
//! within summation order (1e-5 of max |out|, `tests/backend_draft.rs`).

use super::linear::{linear, Linear};
use super::norm::{add_norm, AddNorm};
use super::rows::{embed, gather, Embed, Gather};
use super::{mismatch, Backend, Ints, Pages, PagesMut, Precision, Slots, Tensor, Weight};
use crate::cpu::draft::{BlockAttnDims, BlockRows, ConfidenceRows, PagedContext};
use crate::KernelError;

/// Writes rows into a paged layer at flat slots (the drafter's new context rows).
#[derive(Debug)]
pub struct ScatterRows<'a> {
    /// `[R][width]` rows, `width` the pages' row width.
    pub rows: &'a Tensor,
    /// The layer's pages.
    pub pages: PagesMut<'a>,
    /// `[R]` flat slots (`block · page + offset`), one per row.
    pub slots: &'a Slots,
}

/// Runs [`ScatterRows`]: row `r` goes to slot `slots[r]`. On the CPU a slot outside the pool
/// is an error (nothing is written past the first bad slot's row); on a GPU the lengths are
/// checked before the launch and a slot outside the pool is skipped by the kernel.
pub fn scatter_rows(b: &Backend, p: ScatterRows<'_>) -> Result<(), KernelError> {
    const OP: &str = "scatter_rows";
    let n_slots = p.slots.len();
    let width = p.pages.width();
    crate::cpu::gemm::check_len(OP, "rows", n_slots * width, p.rows.len())?;
    match b {
        Backend::Cpu => {
            let got = p.pages.place();
            // (Irrefutable in a build without a GPU backend.)
            #[allow(irrefutable_let_patterns)]
            let PagesMut::Host { data, width } = p.pages
            else {
                return Err(mismatch(OP, "pages", b, got));
            };
            let rows = p.rows.host(OP, "rows")?;
            let slots = p.slots.host(OP, "slots")?;
            let n = data.len().checked_div(width).unwrap_or(0);
            for (row, &slot) in rows.chunks_exact(width.max(1)).zip(slots) {
                let s = super::host_index(OP, "slot", slot, n)?;
                data[s * width..(s + 1) * width].copy_from_slice(row);
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => scatter_on(dev, &p),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => scatter_on(dev, &p),
    }
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn scatter_on<D: super::OnDevice>(dev: &D, p: &ScatterRows<'_>) -> Result<(), KernelError> {
    const OP: &str = "scatter_rows";
    let pages = super::pmv::<D>(&p.pages, OP)?;
    let (rows, slots) = (
        super::tv::<D>(p.rows, OP, "rows")?,
        super::sv::<D>(p.slots, OP, "slots")?,
    );
    crate::gpu::draft::scatter_rows(dev, rows, slots, pages)
}

/// The drafter's block attention for a batch of `S` sequences, one drafter layer.
#[derive(Debug, Clone, Copy)]
pub struct BlockAttention<'a> {
    /// `[S·B][H·d]` the block rows' queries (normed, rotated).
    pub q: &'a Tensor,
    /// `[S·B][KV·d]` the block rows' keys (normed, rotated).
    pub k: &'a Tensor,
    /// `[S·B][KV·d]` the block rows' values.
    pub v: &'a Tensor,
    /// The layer's context rows, natural layout (`width = 2·KV·d`).
    pub pages: Pages<'a>,
    /// `[S][stride]` flat block tables (at least `S · stride` entries).
    pub tables: &'a Ints,
    /// Entries per block-table row.
    pub stride: usize,
    /// `[S]` context lengths `n_s` on the backend (read by the device kernel).
    pub ctx: &'a Ints,
    /// The same lengths on the host: `S = ctx_host.len()`; they plan the launch and are
    /// checked against the tables (on the CPU also against `ctx`).
    pub ctx_host: &'a [usize],
    /// Query heads `H`.
    pub heads: usize,
    /// KV heads (`H` a multiple of it).
    pub kv_heads: usize,
    /// Head dimension `d` (≤ 128 on a GPU); scale `1/sqrt(d)`.
    pub head_dim: usize,
    /// Block rows `B` per sequence.
    pub block: usize,
}

/// Runs [`BlockAttention`]: `[S·B][H·d]`, a new tensor. Block row `i` of sequence `s`, head
/// `h` attends (softmax of `q·key / sqrt(d)`) to the `n_s` context rows in position order,
/// then to the sequence's `B` block rows, with no mask inside the block; query head `h`
/// reads KV head `h / (H / KV)`.
pub fn block_attention(b: &Backend, p: BlockAttention<'_>) -> Result<Tensor, KernelError> {
    const OP: &str = "block_attention";
    let d = BlockAttnDims {
        heads: p.heads,
        kv_heads: p.kv_heads,
        head_dim: p.head_dim,
        block: p.block,
    };
    d.check(OP)?;
    let s_n = p.ctx_host.len();
    let (rows, qw, kvw) = (s_n * p.block, d.q_width(), d.kv_width());
    crate::cpu::gemm::check_len(OP, "q", rows * qw, p.q.len())?;
    crate::cpu::gemm::check_len(OP, "k", rows * kvw, p.k.len())?;
    crate::cpu::gemm::check_len(OP, "v", rows * kvw, p.v.len())?;
    if p.tables.len() < s_n * p.stride {
        return Err(KernelError::ShapeMismatch {
            op: OP,
            what: "tables",
            expected: s_n * p.stride,
            got: p.tables.len(),
        });
    }
    if p.ctx.len() < s_n {
        return Err(KernelError::ShapeMismatch {
            op: OP,
            what: "ctx",
            expected: s_n,
            got: p.ctx.len(),
        });
    }
    let (page, width) = p.pages.geometry();
    crate::cpu::gemm::check_len(OP, "pages.width", d.ctx_width(), width)?;
    if page == 0 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "page_size",
            limit: "> 0",
            value: "0".into(),
        });
    }
    if let Some(&n) = p.ctx_host.iter().find(|&&n| n > p.stride * page) {
        return Err(KernelError::BlockTableTooShort {
            op: OP,
            blocks: p.stride,
            page_size: page,
            needed_tokens: n,
        });
    }
    let mut out = b.scratch(rows * qw)?;
    match b {
        Backend::Cpu => {
            let pages = p.pages.host(OP)?;
            let ctx = p.ctx.host(OP, "ctx")?;
            for (s, (&dev_n, &host_n)) in ctx.iter().zip(p.ctx_host).enumerate() {
                if usize::try_from(dev_n).ok() != Some(host_n) {
                    return Err(KernelError::InvalidParam {
                        op: OP,
                        field: "ctx",
                        limit: "equal to ctx_host",
                        value: format!("sequence {s}: {dev_n} vs {host_n}"),
                    });
                }
            }
            let cx = PagedContext {
                pages,
                tables: p.tables.host(OP, "tables")?,
                stride: p.stride,
                lens: p.ctx_host,
            };
            let x = BlockRows {
                q: p.q.host(OP, "q")?,
                k: p.k.host(OP, "k")?,
                v: p.v.host(OP, "v")?,
            };
            crate::cpu::draft::block_attention(&d, x, cx, out.host_mut(OP, "out")?)?;
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => attention_on(dev, &p, d, &out)?,
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => attention_on(dev, &p, d, &out)?,
    }
    Ok(out)
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn attention_on<D: super::OnDevice>(
    dev: &D,
    p: &BlockAttention<'_>,
    d: BlockAttnDims,
    out: &Tensor,
) -> Result<(), KernelError> {
    use super::{iv, pv, tv};
    const OP: &str = "block_attention";
    let batch = crate::gpu::draft::BlockAttnBatch {
        q: tv::<D>(p.q, OP, "q")?,
        k: tv::<D>(p.k, OP, "k")?,
        v: tv::<D>(p.v, OP, "v")?,
        pages: pv::<D>(&p.pages, OP)?,
        tables: iv::<D>(p.tables, OP, "tables")?,
        stride: p.stride,
        ctx: iv::<D>(p.ctx, OP, "ctx")?,
        seqs: p.ctx_host.len(),
        max_ctx: p.ctx_host.iter().copied().max().unwrap_or(0),
        dims: d,
    };
    crate::gpu::draft::block_attention(dev, &batch, tv::<D>(out, OP, "out")?)
}

/// The concatenation of tapped hidden states: out row `r` is `srcs[0][rows[r]]`, then
/// `srcs[1][rows[r]]`, … (the drafter's context feature input).
#[derive(Debug, Clone, Copy)]
pub struct GatherConcat<'a> {
    /// Sources, each `[n_t][width]`.
    pub srcs: &'a [&'a Tensor],
    /// Row indices into every source.
    pub rows: &'a Ints,
    /// Floats per source row.
    pub width: usize,
}

/// Runs [`GatherConcat`]: `[rows][width · srcs.len()]`, a new tensor (a copy: exact on every
/// backend). On the CPU a row outside a source is an error; on a GPU it gives NaN columns.
pub fn gather_concat(b: &Backend, p: GatherConcat<'_>) -> Result<Tensor, KernelError> {
    const OP: &str = "gather_concat";
    if p.width == 0 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "width",
            limit: "> 0",
            value: "0".into(),
        });
    }
    for src in p.srcs {
        if src.len() % p.width != 0 {
            return Err(KernelError::NotDivisible {
                op: OP,
                what: "src",
                len: src.len(),
                width: p.width,
            });
        }
    }
    let mut out = b.scratch(p.rows.len() * p.width * p.srcs.len())?;
    match b {
        Backend::Cpu => {
            let srcs = p
                .srcs
                .iter()
                .map(|t| t.host(OP, "src"))
                .collect::<Result<Vec<_>, _>>()?;
            let rows = p.rows.host(OP, "rows")?;
            crate::cpu::draft::concat_rows(&srcs, rows, p.width, out.host_mut(OP, "out")?)?;
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => concat_on(dev, p, &out)?,
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => concat_on(dev, p, &out)?,
    }
    Ok(out)
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn concat_on<D: super::OnDevice>(
    dev: &D,
    p: GatherConcat<'_>,
    out: &Tensor,
) -> Result<(), KernelError> {
    const OP: &str = "gather_concat";
    let srcs = p
        .srcs
        .iter()
        .map(|t| super::tv::<D>(t, OP, "src"))
        .collect::<Result<Vec<_>, _>>()?;
    let rows = super::iv::<D>(p.rows, OP, "rows")?;
    crate::gpu::draft::concat_rows(dev, &srcs, rows, p.width, super::tv::<D>(out, OP, "out")?)
}

/// DSpark's confidence head over `R` block positions: `σ(wᵀ[h_r ; e_r] + bias)`.
#[derive(Debug, Clone, Copy)]
pub struct Confidence<'a> {
    /// `[R][hidden]` final hidden states.
    pub h: &'a Tensor,
    /// `[R][rank]` the previous tokens' Markov embeddings.
    pub e: &'a Tensor,
    /// `[hidden + rank]` head weight.
    pub w: &'a Tensor,
    /// Head bias.
    pub bias: f32,
}

/// Runs [`Confidence`]: `[R]`, a new tensor. `R = (|h| + |e|) / |w|`, then
/// `hidden = |h| / R` (the only split of `w` consistent with the three lengths). The CPU arm
/// is [`crate::cpu::draft::survival`] row by row; a GPU sums in another order (a warp per row).
pub fn confidence(b: &Backend, p: Confidence<'_>) -> Result<Tensor, KernelError> {
    const OP: &str = "confidence";
    let (hl, el, wl) = (p.h.len(), p.e.len(), p.w.len());
    if wl == 0 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "w",
            limit: "non-empty",
            value: "0 entries".into(),
        });
    }
    if (hl + el) % wl != 0 {
        return Err(KernelError::NotDivisible {
            op: OP,
            what: "h + e",
            len: hl + el,
            width: wl,
        });
    }
    let r = (hl + el) / wl;
    let hidden = match r {
        0 => 0,
        r if hl % r == 0 && el % r == 0 => hl / r,
        r => {
            return Err(KernelError::NotDivisible {
                op: OP,
                what: "h",
                len: hl,
                width: r,
            })
        }
    };
    let mut out = b.scratch(r)?;
    if r == 0 {
        return Ok(out);
    }
    match b {
        Backend::Cpu => {
            let x = ConfidenceRows {
                h: p.h.host(OP, "h")?,
                e: p.e.host(OP, "e")?,
                hidden,
            };
            let w = p.w.host(OP, "w")?;
            crate::cpu::draft::confidence(w, p.bias, x, out.host_mut(OP, "out")?)?;
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => confidence_on(dev, p, hidden, &out)?,
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => confidence_on(dev, p, hidden, &out)?,
    }
    Ok(out)
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn confidence_on<D: super::OnDevice>(
    dev: &D,
    p: Confidence<'_>,
    hidden: usize,
    out: &Tensor,
) -> Result<(), KernelError> {
    use super::tv;
    const OP: &str = "confidence";
    let batch = crate::gpu::draft::ConfidenceBatch {
        h: tv::<D>(p.h, OP, "h")?,
        e: tv::<D>(p.e, OP, "e")?,
        w: tv::<D>(p.w, OP, "w")?,
        hidden,
        bias: p.bias,
    };
    crate::gpu::draft::confidence(dev, &batch, tv::<D>(out, OP, "out")?)
}

/// One left-to-right step of DSpark's Markov head (and its confidence head) for `n` inputs:
/// input `s` is at row `at[s]` of the backbone's block pass, its previous token is `prev[s]`.
#[derive(Debug, Clone, Copy)]
pub struct MarkovStep<'a> {
    /// `[R][vocab]` the backbone's LM-head logits, every block position of every input.
    pub logits: &'a Tensor,
    /// `[R][hidden]` the backbone's final hidden states, same rows.
    pub hidden: &'a Tensor,
    /// `[n]` each input's row of `logits` / `hidden` at this block position.
    pub at: &'a Ints,
    /// `[n]` each input's previous token (the anchor, then the last draft).
    pub prev: &'a Ints,
    /// `[vocab][rank]` the bigram embedding `W1`.
    pub w1: &'a Weight,
    /// `[vocab][rank]` the bigram projection `W2`.
    pub w2: &'a Weight,
    /// `[hidden + rank]` the confidence head's weight.
    pub conf_w: &'a Tensor,
    /// The confidence head's bias.
    pub conf_bias: f32,
    /// The bias GEMM's input precision where it runs as backend ops (the CPU, or a GPU under
    /// `FERRY_MARKOV_FUSED=0`); the one-launch kernel sums in f32 whatever this is.
    pub precision: Precision,
}

/// What a [`MarkovStep`] gives each input.
#[derive(Debug)]
pub struct MarkovRows {
    /// `[n][vocab]` the corrected logits `U_k + W2 · W1[prev]`: the distribution the input's
    /// draft is drawn from (after the sampler's controls).
    pub logits: Tensor,
    /// `[n]` the confidence head's survival estimate `σ(w · [h_k ; W1[prev]] + b)`.
    pub confidence: Tensor,
}

/// Runs [`MarkovStep`]. The CPU arm is the composition the drafter ran before this op existed
/// (embedding, the bias [`linear`], the gathers, the add, [`confidence`]), so its bits are
/// unchanged; there a `prev` or `at` outside its range is an error. A GPU does it in one
/// launch (`gpu::draft::markov_step`: f32 sums in another order; a `prev` outside the
/// vocabulary reads a zero `W1` row, an `at` outside the rows gives NaN), or as the
/// composition under `FERRY_MARKOV_FUSED=0`.
pub fn markov_step(b: &Backend, p: MarkovStep<'_>) -> Result<MarkovRows, KernelError> {
    const OP: &str = "markov_step";
    let (vocab, rank) = (p.w1.rows(), p.w1.cols());
    if p.w2.rows() != vocab || p.w2.cols() != rank {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "w2",
            limit: "the shape of w1",
            value: format!("[{}][{}] vs [{vocab}][{rank}]", p.w2.rows(), p.w2.cols()),
        });
    }
    if vocab == 0 || rank == 0 || p.conf_w.len() <= rank {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "w1 / conf_w",
            limit: "a non-empty [vocab][rank] and hidden + rank confidence weights",
            value: format!("[{vocab}][{rank}], {} weights", p.conf_w.len()),
        });
    }
    let hid = p.conf_w.len() - rank;
    if p.logits.len() % vocab != 0 {
        return Err(KernelError::NotDivisible {
            op: OP,
            what: "logits",
            len: p.logits.len(),
            width: vocab,
        });
    }
    let rows = p.logits.len() / vocab;
    crate::cpu::gemm::check_len(OP, "hidden", rows * hid, p.hidden.len())?;
    crate::cpu::gemm::check_len(OP, "prev", p.at.len(), p.prev.len())?;
    if let Backend::Cpu = b {
        // Named here, not by the inner ops.
        for &a in p.at.host(OP, "at")? {
            super::host_index(OP, "at", a.into(), rows)?;
        }
        for &t in p.prev.host(OP, "prev")? {
            super::host_index(OP, "prev", t.into(), vocab)?;
        }
    }
    match b {
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) if super::markov_fused() => markov_on(dev, b, &p),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) if super::markov_fused() => markov_on(dev, b, &p),
        _ => markov_composed(b, &p, hid),
    }
}

/// [`markov_step`] as backend ops: the embedding of the previous tokens, the bias
/// [`linear`], the logits' rows gathered and the bias added, the hidden rows gathered, the
/// [`confidence`] head. The CPU's arm, and a GPU's under `FERRY_MARKOV_FUSED=0` (seven
/// launches).
fn markov_composed(b: &Backend, p: &MarkovStep<'_>, hid: usize) -> Result<MarkovRows, KernelError> {
    let vocab = p.w1.rows();
    let e = embed(
        b,
        Embed {
            table: p.w1,
            ids: p.prev,
        },
    )?;
    let bias = linear(
        b,
        Linear {
            x: &e,
            w: p.w2,
            precision: p.precision,
        },
    )?;
    let mut logits = gather(
        b,
        Gather {
            src: p.logits,
            rows: p.at,
            width: vocab,
        },
    )?;
    add_norm(
        b,
        AddNorm {
            h: &mut logits,
            delta: Some(&bias),
            weight: &bias,
            out: None,
            width: vocab,
            eps: 0.0,
        },
    )?;
    let h = gather(
        b,
        Gather {
            src: p.hidden,
            rows: p.at,
            width: hid,
        },
    )?;
    let confidence = confidence(
        b,
        Confidence {
            h: &h,
            e: &e,
            w: p.conf_w,
            bias: p.conf_bias,
        },
    )?;
    Ok(MarkovRows { logits, confidence })
}

#[cfg(any(feature = "cuda", feature = "rocm"))]
fn markov_on<D: super::OnDevice>(
    dev: &D,
    b: &Backend,
    p: &MarkovStep<'_>,
) -> Result<MarkovRows, KernelError> {
    use super::{iv, tv, wv};
    const OP: &str = "markov_step";
    let n = p.at.len();
    let logits = b.scratch(n * p.w1.rows())?;
    let confidence = b.scratch(n)?;
    let batch = crate::gpu::draft::MarkovBatch {
        logits: tv::<D>(p.logits, OP, "logits")?,
        hidden: tv::<D>(p.hidden, OP, "hidden")?,
        at: iv::<D>(p.at, OP, "at")?,
        prev: iv::<D>(p.prev, OP, "prev")?,
        w1: wv::<D>(p.w1, OP, "w1")?,
        w2: wv::<D>(p.w2, OP, "w2")?,
        conf_w: tv::<D>(p.conf_w, OP, "conf_w")?,
        conf_bias: p.conf_bias,
    };
    crate::gpu::draft::markov_step(
        dev,
        &batch,
        tv::<D>(&logits, OP, "out")?,
        tv::<D>(&confidence, OP, "confidence")?,
    )?;
    Ok(MarkovRows { logits, confidence })
}
