//! Launchers for `gpu/sample.cu`: sampling distributions, inverse-CDF draws, argmax and
//! speculative verification, one block per row (or per verified sequence); a few long rows
//! are split over several blocks each ([`row_parts`]).
//!
//! Every launcher checks that each buffer holds what its kernel will index before launching.
//! The semantics are the CPU sampler's ([`crate::cpu::sample`], [`crate::cpu::verify`]); the
//! kernels' numerics against it are stated on each function.

use super::launch::{DeviceMem, Gpu, KernelArgs, LaunchDims};
use super::ops::{need, Dv};
use crate::cpu::sample::SamplingParams;
use crate::error::{c_int as int, KernelError};
use crate::gpu::{Defines, Source};

/// Threads per block of every kernel in `sample.cu` (`SAMPLE_THREADS` there).
const THREADS: u32 = 512;

/// `u32` words per row of packed sampling parameters (`SAMPLE_PARAM_WORDS` in `sample.cu`):
/// temperature (f32 bits), top-k, top-p (f32 bits), min-p (f32 bits), greedy flag.
pub const PARAM_WORDS: usize = 5;

/// Largest vocabulary the distribution kernel takes: its top-k search counts entries in f32,
/// exact below 2^24.
pub const MAX_VOCAB: usize = 1 << 24;

/// Result words per verified sequence beyond its drafts: the accepted count (or an error code),
/// the correction / bonus token, and room for an error's details.
pub const VERIFY_EXTRA_WORDS: usize = 3;

/// `spec_verify`'s error codes (slot 0 of a sequence's result row).
pub mod code {
    /// No draw possible: `[code, position, f32 bits of the sum]`.
    pub const DEGENERATE: i32 = -1;
    /// `q(draft) <= 0`: `[code, position, token, f32 bits of q]`.
    pub const ZERO_Q: i32 = -2;
    /// A draft id outside `0..vocab`: `[code, position, token]`.
    pub const BAD_ID: i32 = -3;
}

/// Rows of [`PARAM_WORDS`] words as the distribution kernel reads them (parameters are not
/// validated here; the backend's `RowParams` does that).
pub fn pack_params(params: &[SamplingParams]) -> Vec<u32> {
    params
        .iter()
        .flat_map(|p| {
            [
                p.temperature.to_bits(),
                p.top_k,
                p.top_p.to_bits(),
                p.min_p.to_bits(),
                u32::from(p.is_greedy()),
            ]
        })
        .collect()
}

/// `vocab` in `1..=limit`.
fn check_vocab(op: &'static str, vocab: usize, limit: usize) -> Result<i32, KernelError> {
    if vocab == 0 || vocab > limit {
        return Err(KernelError::InvalidParam {
            op,
            field: "vocab",
            limit: "in 1..=2^24 on a GPU (the top-k search counts in f32)",
            value: vocab.to_string(),
        });
    }
    int(op, "vocab", vocab)
}

fn kernel<D: Gpu>(dev: &D, name: &'static str) -> Result<D::Function, KernelError> {
    dev.function(Source::Sample, &Defines::new(), name)
}

/// `[rows][vocab]` logits → `[rows][vocab]` probabilities, one row per [`PARAM_WORDS`] words
/// of `params` (as [`pack_params`] lays them out), per row exactly the steps of
/// `cpu::sample::probs_from_logits` (a one-hot at the argmax for greedy rows; softmax at the
/// temperature, top-k, top-p, min-p with pivot ties kept). A row whose softmax or kept mass is
/// degenerate is written as all NaN (the CPU errors on it); other rows are unaffected.
///
/// Numerics: the kernel's `expf` is within 2 ulp of the CPU's `exp`, and its sums are
/// per-thread partials combined in a fixed tree instead of one sequential f32 sum (a few long
/// rows, split over several blocks each: the blocks' sums, then a tree over them). So values
/// differ from the CPU's by rounding only, and a filter's kept set differs only where an entry
/// lies within that rounding of its pivot (top-p: where `p · total` is within rounding of a
/// cumulative boundary; top-k and min-p compare exact values of the kernel's own row).
pub fn probs<D: Gpu>(
    dev: &D,
    logits: Dv<f32>,
    out: Dv<f32>,
    params: Dv<u32>,
    vocab: usize,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_sample_probs";
    let v = check_vocab(OP, vocab, MAX_VOCAB)?;
    let rows = params.len / PARAM_WORDS;
    need(OP, "logits", rows * vocab, logits.len)?;
    need(OP, "out", rows * vocab, out.len)?;
    int(OP, "rows", rows)?;
    if rows == 0 {
        return Ok(());
    }
    let (parts, chunk) = plan_rows(dev, rows, vocab);
    if parts == 1 || rows > 65_535 {
        let f = kernel(dev, "sample_probs")?;
        let mut a = KernelArgs::new();
        a.push(logits.ptr).push(out.ptr).push(params.ptr).push(v);
        return dev.launch(&f, LaunchDims::linear(rows, THREADS), &mut a);
    }
    // A few long rows: the softmax (greedy rows: the argmax) split over `parts` blocks a row,
    // then one block a row for greedy rows' one-hots and filters (`sample.cu`'s split section).
    let chunk = int(OP, "chunk", chunk)?;
    let part_m = dev.alloc::<f32>(rows * parts)?;
    let part_nan = dev.alloc::<f32>(rows * parts)?;
    let part_s = dev.alloc::<f32>(rows * parts)?;
    let part_i = dev.alloc::<i32>(rows * parts)?;
    let split = split_dims(parts, rows);
    let mut a = KernelArgs::new();
    a.push(logits.ptr)
        .push(params.ptr)
        .push(v)
        .push(chunk)
        .push(part_m.ptr())
        .push(part_nan.ptr())
        .push(part_i.ptr());
    dev.launch(&kernel(dev, "sample_softmax_max")?, split, &mut a)?;
    let mut a = KernelArgs::new();
    a.push(logits.ptr)
        .push(params.ptr)
        .push(v)
        .push(chunk)
        .push(part_m.ptr())
        .push(part_nan.ptr())
        .push(out.ptr)
        .push(part_s.ptr());
    dev.launch(&kernel(dev, "sample_softmax_exp")?, split, &mut a)?;
    let mut a = KernelArgs::new();
    a.push(params.ptr)
        .push(v)
        .push(chunk)
        .push(part_s.ptr())
        .push(out.ptr);
    dev.launch(&kernel(dev, "sample_softmax_norm")?, split, &mut a)?;
    let mut a = KernelArgs::new();
    a.push(out.ptr)
        .push(params.ptr)
        .push(v)
        .push(int(OP, "parts", parts)?)
        .push(part_m.ptr())
        .push(part_i.ptr());
    dev.launch(
        &kernel(dev, "sample_probs_finish")?,
        LaunchDims::linear(rows, THREADS),
        &mut a,
    )
}

/// One inverse-CDF draw per `[vocab]` row of `probs` with `uniforms[row]`:
/// `cpu::sample::sample_from_probs` (the first index whose cumulative mass exceeds `u · total`;
/// zero-probability entries never drawn), or -1 where that errors (total not finite and
/// positive, or a negative entry).
///
/// Numerics: cumulation is in f64 like the CPU's but in another order (per-warp chunk totals,
/// then 32-wide scans; a few long rows: part totals, then block-wide scans), so a draw can
/// differ from the CPU's only when `u · total` lies within a few f64 ulps of a CDF boundary.
pub fn draw<D: Gpu>(
    dev: &D,
    probs: Dv<f32>,
    uniforms: Dv<f64>,
    out: Dv<i32>,
    vocab: usize,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_sample_draw";
    let rows = uniforms.len;
    let v = check_vocab(OP, vocab, i32::MAX as usize)?;
    need(OP, "probs", rows * vocab, probs.len)?;
    need(OP, "out", rows, out.len)?;
    int(OP, "rows", rows)?;
    if rows == 0 {
        return Ok(());
    }
    let (parts, chunk) = plan_rows(dev, rows, vocab);
    if parts == 1 || rows > 65_535 || vocab > MAX_VOCAB {
        let f = kernel(dev, "sample_draw")?;
        let mut a = KernelArgs::new();
        a.push(probs.ptr).push(uniforms.ptr).push(v).push(out.ptr);
        return dev.launch(&f, LaunchDims::linear(rows, THREADS), &mut a);
    }
    // A few long rows: part totals over `parts` blocks a row, then one block a row finds the
    // part holding the target and scans it.
    let chunk = int(OP, "chunk", chunk)?;
    let part_mass = dev.alloc::<f64>(rows * parts)?;
    let part_last = dev.alloc::<i32>(rows * parts)?;
    let part_bad = dev.alloc::<i32>(rows * parts)?;
    let mut a = KernelArgs::new();
    a.push(probs.ptr)
        .push(v)
        .push(chunk)
        .push(part_mass.ptr())
        .push(part_last.ptr())
        .push(part_bad.ptr());
    let split = split_dims(parts, rows);
    dev.launch(&kernel(dev, "sample_draw_part")?, split, &mut a)?;
    let mut a = KernelArgs::new();
    a.push(probs.ptr)
        .push(uniforms.ptr)
        .push(v)
        .push(chunk)
        .push(int(OP, "parts", parts)?)
        .push(part_mass.ptr())
        .push(part_last.ptr())
        .push(part_bad.ptr())
        .push(out.ptr);
    dev.launch(
        &kernel(dev, "sample_draw_pick")?,
        LaunchDims::linear(rows, THREADS),
        &mut a,
    )
}

/// Fewest entries one block of a split row takes: one unrolled trip of the argmax's threads
/// (`ARGMAX_UNROLL` · `SAMPLE_THREADS` in `sample.cu`).
const SPLIT_MIN_CHUNK: usize = 4 * THREADS as usize;

/// How the argmax, the distribution and the draw split each of `rows` rows of `vocab` entries
/// over a card of `sms` multiprocessors (from the shape only, so a captured graph's launches
/// stay right whatever parameters its rows get): `(parts, chunk)`, `parts` blocks a row of
/// `chunk` entries each (a multiple of [`SPLIT_MIN_CHUNK`]), as many as keep `rows · parts`
/// near two blocks an SM. `parts == 1` is the one-block-a-row kernel (a large batch already
/// fills the card).
pub fn row_parts(sms: usize, rows: usize, vocab: usize) -> (usize, usize) {
    let want = (2 * sms.max(1)).div_ceil(rows.max(1));
    let parts = want.min(vocab.div_ceil(SPLIT_MIN_CHUNK)).max(1);
    let chunk = vocab.div_ceil(parts).next_multiple_of(SPLIT_MIN_CHUNK);
    (vocab.div_ceil(chunk).max(1), chunk)
}

/// A split kernel's launch: `parts` blocks a row (x), one row per y.
fn split_dims(parts: usize, rows: usize) -> LaunchDims {
    LaunchDims {
        grid: (parts as u32, rows as u32, 1),
        block: (THREADS, 1, 1),
        smem: 0,
    }
}

/// [`row_parts`] on `dev`, or one block a row under `FERRY_SPLIT_ROWS=0`.
fn plan_rows<D: Gpu>(dev: &D, rows: usize, vocab: usize) -> (usize, usize) {
    if crate::backend::split_rows() {
        row_parts(dev.sm_count() as usize, rows, vocab)
    } else {
        (1, vocab)
    }
}

/// `cpu::sample::argmax` of each `[vocab]` row of `logits` (ties to the lowest index, NaN never
/// chosen, 0 for a row with nothing above -inf) into `out[row]`. Exact: the winner does not
/// depend on how a row is split ([`row_parts`]: a few long rows take several blocks each,
/// then a merge launch).
pub fn argmax<D: Gpu>(
    dev: &D,
    logits: Dv<f32>,
    out: Dv<i32>,
    rows: usize,
    vocab: usize,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_sample_argmax";
    // Indices stay below i32::MAX through the kernel's last unrolled trip.
    let v = check_vocab(OP, vocab, i32::MAX as usize - SPLIT_MIN_CHUNK)?;
    need(OP, "logits", rows * vocab, logits.len)?;
    need(OP, "out", rows, out.len)?;
    int(OP, "rows", rows)?;
    if rows == 0 {
        return Ok(());
    }
    let (parts, chunk) = plan_rows(dev, rows, vocab);
    if parts == 1 || rows > 65_535 {
        let f = kernel(dev, "sample_argmax")?;
        let mut a = KernelArgs::new();
        a.push(logits.ptr).push(v).push(out.ptr);
        return dev.launch(&f, LaunchDims::linear(rows, THREADS), &mut a);
    }
    let part_v = dev.alloc::<f32>(rows * parts)?;
    let part_i = dev.alloc::<i32>(rows * parts)?;
    let f = kernel(dev, "sample_argmax_part")?;
    let mut a = KernelArgs::new();
    a.push(logits.ptr)
        .push(v)
        .push(int(OP, "chunk", chunk)?)
        .push(part_v.ptr())
        .push(part_i.ptr());
    let dims = split_dims(parts, rows);
    dev.launch(&f, dims, &mut a)?;
    let f = kernel(dev, "sample_argmax_merge")?;
    let mut a = KernelArgs::new();
    a.push(part_v.ptr())
        .push(part_i.ptr())
        .push(int(OP, "parts", parts)?)
        .push(out.ptr);
    dev.launch(&f, LaunchDims::linear(rows, 32), &mut a)
}

/// The operands of one batched verification (shapes as in `backend::verify::VerifyBatch`).
#[derive(Debug, Clone, Copy)]
pub struct VerifyArgs<'a> {
    /// `[Σ(γ_s + 1)][vocab]` target probabilities.
    pub p: Dv<f32>,
    /// The rows the sampled drafts were drawn from, `[Σ γ_s of sampled sequences][vocab]` in
    /// sequence order; `None` when every sequence's drafts are greedy.
    pub q: Option<Dv<f32>>,
    /// Per sequence: greedy drafts (q a point mass at each draft, no rows in `q`).
    pub greedy: &'a [bool],
    /// `[Σγ_s]` draft ids.
    pub drafts: Dv<i32>,
    /// `[Σ(γ_s + 1)]` uniforms in `[0, 1)`.
    pub uniforms: Dv<f64>,
    /// γ of each sequence.
    pub gammas: &'a [usize],
    /// Vocabulary size.
    pub vocab: usize,
    /// `[S][width]` results, `width >= max γ + VERIFY_EXTRA_WORDS`.
    pub out: Dv<i32>,
    /// Words per sequence in `out`.
    pub width: usize,
}

/// `cpu::verify::verify_probs` with sampled drafts, one block per sequence, into `out` (see
/// `spec_verify` in `sample.cu` for the row layout). Uploads the sequences' draft offsets (one
/// small copy) and queues the kernel. A few sequences ([`row_parts`]) run their accept tests
/// first and split each one's draw over several blocks (`spec_verify_{accept,part,pick}`):
/// the same results.
///
/// Numerics: the accept test `u · q(x) < p(x)` is the CPU's, in f64 on the same f32 inputs, so
/// accept decisions are identical; the correction / bonus draw is [`draw`]'s.
pub fn verify<D: Gpu>(dev: &D, a: VerifyArgs<'_>) -> Result<(), KernelError> {
    const OP: &str = "gpu_spec_verify";
    let v = check_vocab(OP, a.vocab, i32::MAX as usize)?;
    let seqs = a.gammas.len();
    let drafts: usize = a.gammas.iter().sum();
    let rows = drafts + seqs;
    let gamma_max = a.gammas.iter().copied().max().unwrap_or(0);
    if a.width < gamma_max + VERIFY_EXTRA_WORDS {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "width",
            limit: ">= max γ + 3",
            value: format!("{} for max γ {gamma_max}", a.width),
        });
    }
    need(OP, "p", rows * a.vocab, a.p.len)?;
    if a.greedy.len() != seqs {
        return Err(KernelError::ShapeMismatch {
            op: OP,
            what: "greedy",
            expected: seqs,
            got: a.greedy.len(),
        });
    }
    let sampled: usize = a
        .gammas
        .iter()
        .zip(a.greedy)
        .filter(|(_, &g)| !g)
        .map(|(&n, _)| n)
        .sum();
    need(OP, "q", sampled * a.vocab, a.q.map_or(0, |q| q.len))?;
    need(OP, "drafts", drafts, a.drafts.len)?;
    need(OP, "uniforms", rows, a.uniforms.len)?;
    need(OP, "out", seqs * a.width, a.out.len)?;
    int(OP, "rows", rows)?;
    if seqs == 0 {
        return Ok(());
    }
    // One upload: the draft offsets `[S + 1]`, then each sequence's first q row (-1: greedy).
    let mut offsets = Vec::with_capacity(2 * seqs + 1);
    let (mut at, mut q_at) = (0usize, 0usize);
    offsets.push(0i32);
    for &g in a.gammas {
        at += g;
        offsets.push(int(OP, "drafts", at)?);
    }
    for (&g, &greedy) in a.gammas.iter().zip(a.greedy) {
        if greedy {
            offsets.push(-1);
        } else {
            offsets.push(int(OP, "q rows", q_at)?);
            q_at += g;
        }
    }
    let offsets = dev.upload(&offsets)?;
    // Greedy-only batches read no q: any valid address stands in.
    let q = a.q.map_or(a.p.ptr, |q| q.ptr);
    let width = int(OP, "width", a.width)?;
    let (parts, chunk) = plan_rows(dev, seqs, a.vocab);
    if parts == 1 || seqs > 65_535 || a.vocab > MAX_VOCAB {
        let f = kernel(dev, "spec_verify")?;
        let mut k = KernelArgs::new();
        k.push(a.p.ptr)
            .push(q)
            .push(a.drafts.ptr)
            .push(a.uniforms.ptr)
            .push(offsets.ptr())
            .push(offsets.ptr_at(seqs + 1))
            .push(v)
            .push(a.out.ptr)
            .push(width);
        // `offsets` is freed stream-ordered, after the kernel has read it.
        return dev.launch(&f, LaunchDims::linear(seqs, THREADS), &mut k);
    }
    // A few sequences: the accept tests, then each sequence's one draw split over `parts`
    // blocks (`sample.cu`'s split verification).
    let chunk = int(OP, "chunk", chunk)?;
    let jobs = dev.alloc::<i32>(seqs * JOB_WORDS)?;
    let part_mass = dev.alloc::<f64>(seqs * parts)?;
    let part_last = dev.alloc::<i32>(seqs * parts)?;
    let part_bad = dev.alloc::<i32>(seqs * parts)?;
    let mut k = KernelArgs::new();
    k.push(a.p.ptr)
        .push(q)
        .push(a.drafts.ptr)
        .push(a.uniforms.ptr)
        .push(offsets.ptr())
        .push(offsets.ptr_at(seqs + 1))
        .push(v)
        .push(a.out.ptr)
        .push(width)
        .push(jobs.ptr());
    dev.launch(
        &kernel(dev, "spec_verify_accept")?,
        LaunchDims::linear(seqs, 32),
        &mut k,
    )?;
    let mut k = KernelArgs::new();
    k.push(a.p.ptr)
        .push(q)
        .push(jobs.ptr())
        .push(v)
        .push(chunk)
        .push(part_mass.ptr())
        .push(part_last.ptr())
        .push(part_bad.ptr());
    let split = split_dims(parts, seqs);
    dev.launch(&kernel(dev, "spec_verify_part")?, split, &mut k)?;
    let mut k = KernelArgs::new();
    k.push(a.p.ptr)
        .push(q)
        .push(a.uniforms.ptr)
        .push(jobs.ptr())
        .push(v)
        .push(chunk)
        .push(int(OP, "parts", parts)?)
        .push(part_mass.ptr())
        .push(part_last.ptr())
        .push(part_bad.ptr())
        .push(a.out.ptr)
        .push(width);
    dev.launch(
        &kernel(dev, "spec_verify_pick")?,
        LaunchDims::linear(seqs, THREADS),
        &mut k,
    )
}

/// Words per sequence of the split verification's draw jobs (`VERIFY_JOB_WORDS` in
/// `sample.cu`).
const JOB_WORDS: usize = 6;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_long_rows_are_split_and_every_entry_covered() {
        // One row of DeepSeek's vocabulary on 132 SMs: as many 2,048-entry parts as it has.
        assert_eq!(row_parts(132, 1, 102_400), (50, 2048));
        // A batch of 64: five parts a row, 320 blocks.
        let (parts, chunk) = row_parts(132, 64, 102_400);
        assert_eq!(parts, 5);
        assert!(chunk % SPLIT_MIN_CHUNK == 0 && parts * chunk >= 102_400);
        // A batch that fills the card alone, and a short row: one block a row.
        assert_eq!(row_parts(132, 264, 102_400).0, 1);
        assert_eq!(row_parts(132, 1, 1000), (1, SPLIT_MIN_CHUNK));
        for (rows, vocab) in [(1, 129_280), (3, 2049), (7, 32_000), (1, 1)] {
            let (parts, chunk) = row_parts(132, rows, vocab);
            assert!(parts * chunk >= vocab, "{rows} x {vocab}: covered");
            assert!(
                (parts - 1) * chunk < vocab,
                "{rows} x {vocab}: no empty part"
            );
        }
    }
}
