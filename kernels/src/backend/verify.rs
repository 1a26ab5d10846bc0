//! Lossless speculative verification of a batch of drafted blocks, where the target's
//! probabilities live.
//!
//! The rule is the CPU verifier's ([`crate::cpu::verify`]), sequence by sequence: accept draft
//! `x_k` when `u_k · q_k(x_k) < p_k(x_k)`; on the first rejection emit the correction drawn from
//! `norm(max(0, p_k − q_k))` with `uniforms[γ]` (from `p_k` if that residual has no mass);
//! when every draft is accepted emit the bonus drawn from `p_γ` with `uniforms[γ]`.
//!
//! Both kinds of drafter: `q` holds the rows sampled drafts were drawn from; a sequence marked
//! `greedy` has argmax drafts, whose `q` is a point mass at each draft and needs no rows — its
//! correction is drawn from `p` with the draft's entry zeroed, the CPU's
//! [`DraftProbs::Greedy`](crate::cpu::verify::DraftProbs::Greedy) rule (a one-hot `q` row would
//! give the same; at a 129k vocabulary it would also cost half a megabyte per draft).
//!
//! Layout of a batch of `S` sequences with `γ_s` drafts each (rows concatenated in sequence
//! order): `p` `[Σ(γ_s + 1)][vocab]`, `q` `[Σ γ_s of the sampled sequences][vocab]`, `drafts`
//! `[Σγ_s]`, `uniforms` `[Σ(γ_s + 1)]` (γ_s per draft, then the correction / bonus draw). A sequence with γ = 0 is a
//! plain draw from its one `p` row.
//!
//! **Failure isolation.** Shapes are checked for the whole call (a bad length is a caller bug);
//! a draft id outside the vocabulary, a draft its own `q` gives no probability, or a reached row
//! with no distribution fails that sequence alone.
//!
//! On a GPU the whole batch is one kernel (one block per sequence) and one download of a
//! `[S][γ_max + 3]` int array; [`verify_logits`] runs `probs` first, so logits that are already
//! on the device never leave it.

use super::sample::{check_len, check_vocab, probs, Probs, RowParams, Uniforms};
use super::{Backend, Ints, Tensor};
use crate::cpu::verify::{verify_probs, DraftProbs, Verified};
use crate::KernelError;

const OP: &str = "verify";

/// One result per sequence, in order.
pub type VerifyOut = Vec<Result<Verified, KernelError>>;

/// A batch of drafted blocks and the distributions to verify them against.
#[derive(Debug, Clone, Copy)]
pub struct VerifyBatch<'a> {
    /// `[Σ(γ_s + 1)][vocab]` target probabilities (from [`super::sample::probs`]).
    pub p: &'a Tensor,
    /// The rows the sampled drafts were drawn from: `[Σ γ_s over sequences not greedy][vocab]`,
    /// in sequence order; `None` when every sequence is greedy.
    pub q: Option<&'a Tensor>,
    /// Per sequence: its drafts are argmax drafts (`q` a point mass at each draft, no rows).
    pub greedy: &'a [bool],
    /// `[Σγ_s]` draft ids.
    pub drafts: &'a Ints,
    /// γ of each sequence.
    pub gammas: &'a [usize],
    /// `[Σ(γ_s + 1)]` uniforms in `[0, 1)`.
    pub uniforms: &'a Uniforms,
    /// Entries per row.
    pub vocab: usize,
}

/// Verifies every sequence: per sequence exactly `cpu::verify::verify_probs(p_s,
/// DraftProbs::Sampled(q_s), drafts_s, uniforms_s)` (the CPU arm calls it; the GPU arm agrees
/// with it in every accept decision and draws as `sample::draw` does).
pub fn verify(b: &Backend, v: VerifyBatch<'_>) -> Result<VerifyOut, KernelError> {
    check_vocab(OP, v.vocab)?;
    let drafts: usize = v.gammas.iter().sum();
    let rows = drafts + v.gammas.len();
    check_len(OP, "p", rows * v.vocab, v.p.len())?;
    check_len(OP, "greedy", v.gammas.len(), v.greedy.len())?;
    let sampled: usize = v
        .gammas
        .iter()
        .zip(v.greedy)
        .filter(|(_, &g)| !g)
        .map(|(&n, _)| n)
        .sum();
    check_len(OP, "q", sampled * v.vocab, v.q.map_or(0, Tensor::len))?;
    check_len(OP, "drafts", drafts, v.drafts.len())?;
    check_len(OP, "uniforms", rows, v.uniforms.len())?;
    match b {
        Backend::Cpu => verify_host(&v),
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => verify_on(dev, &v),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => verify_on(dev, &v),
    }
}

/// The CPU arm: [`verify_probs`] per sequence.
fn verify_host(v: &VerifyBatch<'_>) -> Result<VerifyOut, KernelError> {
    let p = v.p.host(OP, "p")?;
    let q = match v.q {
        Some(q) => q.host(OP, "q")?,
        None => &[],
    };
    let (drafts, u) = (v.drafts.host(OP, "drafts")?, v.uniforms.host(OP)?);
    let n = v.vocab;
    let (mut d0, mut p0, mut q0) = (0usize, 0usize, 0usize);
    let mut out = Vec::with_capacity(v.gammas.len());
    for (&g, &greedy) in v.gammas.iter().zip(v.greedy) {
        let q_s = if greedy {
            DraftProbs::Greedy
        } else {
            q0 += g;
            DraftProbs::Sampled(&q[(q0 - g) * n..q0 * n])
        };
        let ids = draft_ids(&drafts[d0..d0 + g], n);
        out.push(ids.and_then(|ids| {
            verify_probs(&p[p0 * n..(p0 + g + 1) * n], q_s, &ids, &u[p0..p0 + g + 1])
        }));
        d0 += g;
        p0 += g + 1;
    }
    Ok(out)
}

/// The error of a draft id outside the vocabulary, worded as the CPU verifier words it.
fn bad_id(id: i64, vocab: usize) -> KernelError {
    KernelError::InvalidParam {
        op: OP,
        field: "drafts",
        limit: "token ids below the vocabulary size",
        value: format!("{id} with vocab {vocab}"),
    }
}

/// The drafts as token ids (a negative id is out of the vocabulary; ids at or above it are
/// refused by [`verify_probs`] itself).
fn draft_ids(d: &[i32], vocab: usize) -> Result<Vec<u32>, KernelError> {
    d.iter()
        .map(|&x| u32::try_from(x).map_err(|_| bad_id(x.into(), vocab)))
        .collect()
}

/// The GPU arm: one kernel, one download.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn verify_on<D: super::sample::OnSample>(
    dev: &D,
    v: &VerifyBatch<'_>,
) -> Result<VerifyOut, KernelError> {
    use super::{iv, tv};
    use crate::gpu::launch::DeviceMem;
    use crate::gpu::sample::{self as k, VerifyArgs, VERIFY_EXTRA_WORDS};
    if v.gammas.is_empty() {
        return Ok(Vec::new());
    }
    let width = v.gammas.iter().copied().max().unwrap_or(0) + VERIFY_EXTRA_WORDS;
    let out = dev.zeros::<i32>(v.gammas.len() * width)?;
    k::verify(
        dev,
        VerifyArgs {
            p: tv::<D>(v.p, OP, "p")?,
            q: v.q.map(|q| tv::<D>(q, OP, "q")).transpose()?,
            greedy: v.greedy,
            drafts: iv::<D>(v.drafts, OP, "drafts")?,
            uniforms: v.uniforms.view::<D>(OP)?,
            gammas: v.gammas,
            vocab: v.vocab,
            out: out.v(),
            width,
        },
    )?;
    let words = dev.download(&out)?;
    Ok(words
        .chunks_exact(width)
        .zip(v.gammas)
        .map(|(row, &g)| decode(row, g, v.vocab))
        .collect())
}

/// One sequence's result row from `spec_verify` (layout in `gpu/sample.cu`).
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn decode(row: &[i32], gamma: usize, vocab: usize) -> Result<Verified, KernelError> {
    use crate::gpu::sample::code;
    let word = |i: usize| row.get(i).copied().unwrap_or(0);
    let malformed = || KernelError::Gpu {
        op: OP,
        message: format!("malformed result row {row:?} for γ = {gamma}"),
    };
    match word(0) {
        c if c >= 0 => {
            let accepted = c as usize;
            let tokens = row
                .get(1..accepted + 2)
                .filter(|_| accepted <= gamma)
                .ok_or_else(malformed)?
                .iter()
                .map(|&t| u32::try_from(t).ok().filter(|&t| (t as usize) < vocab))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(malformed)?;
            Ok(Verified { accepted, tokens })
        }
        code::BAD_ID => Err(bad_id(word(2).into(), vocab)),
        code::ZERO_Q => Err(KernelError::InvalidParam {
            op: OP,
            field: "q[k][draft]",
            limit: "> 0 (the drafter cannot have drawn a token it gave no probability)",
            value: format!(
                "{} at position {}, token {}",
                f64::from(f32::from_bits(word(3) as u32)),
                word(1),
                word(2)
            ),
        }),
        code::DEGENERATE => Err(KernelError::DegenerateDistribution {
            op: "sample_from_probs",
            sum: f64::from(f32::from_bits(word(2) as u32)),
        }),
        _ => Err(malformed()),
    }
}

/// Verification straight from the target's logits.
#[derive(Debug, Clone, Copy)]
pub struct VerifyLogits<'a> {
    /// `[Σ(γ_s + 1)][vocab]` target logits.
    pub logits: &'a Tensor,
    /// One row of parameters per logits row ([`RowParams::for_blocks`]).
    pub params: &'a RowParams,
    /// The rows the sampled drafts were drawn from (see [`VerifyBatch::q`]).
    pub q: Option<&'a Tensor>,
    /// Per sequence: argmax drafts (see [`VerifyBatch::greedy`]).
    pub greedy: &'a [bool],
    /// `[Σγ_s]` draft ids.
    pub drafts: &'a Ints,
    /// γ of each sequence.
    pub gammas: &'a [usize],
    /// `[Σ(γ_s + 1)]` uniforms in `[0, 1)`.
    pub uniforms: &'a Uniforms,
    /// Entries per row.
    pub vocab: usize,
}

/// [`super::sample::probs`] then [`verify`], where the logits live: on a GPU nothing but the
/// small result comes back to the host.
pub fn verify_logits(b: &Backend, v: VerifyLogits<'_>) -> Result<VerifyOut, KernelError> {
    let rows = v.gammas.iter().sum::<usize>() + v.gammas.len();
    check_len(OP, "params", rows, v.params.len())?;
    let p = probs(
        b,
        Probs {
            logits: v.logits,
            vocab: v.vocab,
            params: v.params,
        },
    )?;
    verify(
        b,
        VerifyBatch {
            p: &p,
            q: v.q,
            greedy: v.greedy,
            drafts: v.drafts,
            gammas: v.gammas,
            uniforms: v.uniforms,
            vocab: v.vocab,
        },
    )
}
