//! The one sampler ferry uses, for plain decoding and (later) speculative verification.
//!
//! [`probs_from_logits`] defines the exact distribution a request samples from, in this order:
//!
//! 1. `softmax(logits / temperature)` in f32 (max subtracted);
//! 2. top-k renormalisation ([`top_k_renorm_prob`]);
//! 3. top-p renormalisation ([`top_p_renorm_prob`]);
//! 4. min-p filtering ([`min_p_filter`]).
//!
//! Greedy requests (`temperature == 0` or `top_k == 1`) get a point mass at [`argmax`].
//! Speculative decoding needs the same distribution on both sides of the accept test, which
//! is why there is one function for it and the filters' tie rule is spelled out:
//! **pivot semantics** — a filter finds a threshold value and keeps *every* entry at or above
//! it, so entries tied with the boundary are all kept (FlashInfer's `*_renorm_prob` rule).
//!
//! [`Sampler`] owns a seeded ChaCha8 stream; [`sample_from_probs`] is the pure inverse-CDF
//! step with the uniform draw passed in, for tests and for verification code.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::softmax::softmax_inplace;
use crate::error::KernelError;

pub use ferry_modelcard::sampling::{SamplingError, SamplingParams};

/// Index of the largest logit; ties go to the lowest index (like `torch.argmax`). NaNs are
/// never chosen; an empty or all-NaN slice gives 0.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, &v) in logits.iter().enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0 as u32
}

/// Keeps the `k` largest probabilities — every entry `>=` the k-th largest value, so ties at
/// the boundary are all kept — zeroes the rest and renormalises. `k == 0` or `k >= len` leaves
/// `probs` untouched. Errors (leaving `probs` untouched) when the kept mass is not positive.
pub fn top_k_renorm_prob(probs: &mut [f32], k: u32) -> Result<(), KernelError> {
    let k = k as usize;
    if k == 0 || k >= probs.len() {
        return Ok(());
    }
    let mut sorted = probs.to_vec();
    let (_, &mut pivot, _) = sorted.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    keep_at_least(probs, pivot, "top_k_renorm_prob")
}

/// Keeps the smallest set of largest probabilities whose cumulative sum reaches `p` times the
/// total (the total is 1 for a normalised input), plus every entry tied with the smallest kept
/// value; zeroes the rest and renormalises. `p >= 1` leaves `probs` untouched, as does a
/// cumulative sum that never reaches the target through rounding. Errors (leaving `probs`
/// untouched) when the mass is not positive.
pub fn top_p_renorm_prob(probs: &mut [f32], p: f32) -> Result<(), KernelError> {
    if p >= 1.0 || probs.is_empty() {
        return Ok(());
    }
    let mut sorted = probs.to_vec();
    sorted.sort_unstable_by(|a, b| b.total_cmp(a));
    let total: f32 = sorted.iter().sum();
    let target = p * total;
    let mut cum = 0.0f32;
    let mut pivot = None;
    for &v in &sorted {
        cum += v;
        if cum >= target {
            pivot = Some(v);
            break;
        }
    }
    match pivot {
        Some(v) => keep_at_least(probs, v, "top_p_renorm_prob"),
        None => Ok(()),
    }
}

/// Zeroes entries below `min_p · max(probs)` and renormalises; `min_p <= 0` leaves `probs`
/// untouched. The largest entry always survives, so this only errors on a zero-mass input.
pub fn min_p_filter(probs: &mut [f32], min_p: f32) -> Result<(), KernelError> {
    if min_p <= 0.0 || probs.is_empty() {
        return Ok(());
    }
    let max = probs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    keep_at_least(probs, min_p * max, "min_p_filter")
}

/// Zeroes entries `< threshold` and divides the rest by their sum (computed before any write,
/// so an error leaves `probs` untouched).
fn keep_at_least(probs: &mut [f32], threshold: f32, op: &'static str) -> Result<(), KernelError> {
    let kept: f32 = probs.iter().filter(|&&v| v >= threshold).sum();
    if !(kept.is_finite() && kept > 0.0) {
        return Err(KernelError::DegenerateDistribution {
            op,
            sum: f64::from(kept),
        });
    }
    for v in probs.iter_mut() {
        *v = if *v >= threshold { *v / kept } else { 0.0 };
    }
    Ok(())
}

/// The exact distribution [`Sampler::sample`] draws from: softmax at `temperature`, then top-k,
/// top-p and min-p in that order; a point mass at [`argmax`] for greedy params.
pub fn probs_from_logits(logits: &[f32], params: &SamplingParams) -> Result<Vec<f32>, KernelError> {
    params.validate()?;
    if logits.is_empty() || u32::try_from(logits.len() - 1).is_err() {
        return Err(KernelError::InvalidParam {
            op: "probs_from_logits",
            field: "logits.len()",
            limit: "in 1..=2^32",
            value: logits.len().to_string(),
        });
    }
    if params.is_greedy() {
        let mut probs = vec![0.0f32; logits.len()];
        probs[argmax(logits) as usize] = 1.0;
        return Ok(probs);
    }
    let mut probs: Vec<f32> = logits.iter().map(|&v| v / params.temperature).collect();
    softmax_inplace(&mut probs)?;
    top_k_renorm_prob(&mut probs, params.top_k)?;
    top_p_renorm_prob(&mut probs, params.top_p)?;
    min_p_filter(&mut probs, params.min_p)?;
    Ok(probs)
}

/// Inverse-CDF draw: the first index whose cumulative probability exceeds `u · total`, for a
/// uniform `u` in `[0, 1)`. Zero-probability entries are never returned. Cumulation is in f64.
pub fn sample_from_probs(probs: &[f32], u: f64) -> Result<u32, KernelError> {
    let total: f64 = probs.iter().map(|&v| f64::from(v)).sum();
    if !(total.is_finite() && total > 0.0) || probs.iter().any(|&v| v < 0.0) {
        return Err(KernelError::DegenerateDistribution {
            op: "sample_from_probs",
            sum: total,
        });
    }
    let target = u.clamp(0.0, 1.0) * total;
    let mut cum = 0.0f64;
    let mut last_positive = 0usize;
    for (i, &v) in probs.iter().enumerate() {
        if v > 0.0 {
            cum += f64::from(v);
            last_positive = i;
            if cum > target {
                return Ok(i as u32);
            }
        }
    }
    // Only reachable when rounding leaves `cum` a hair below `target` at the end.
    Ok(last_positive as u32)
}

/// A request's sampler: a ChaCha8 stream seeded once, so a seeded request is reproducible.
#[derive(Debug, Clone)]
pub struct Sampler {
    rng: ChaCha8Rng,
}

impl Sampler {
    /// A stream from `seed`, or from OS entropy when `None`.
    pub fn new(seed: Option<u64>) -> Self {
        let rng = match seed {
            Some(s) => ChaCha8Rng::seed_from_u64(s),
            None => ChaCha8Rng::from_rng(&mut rand::rng()),
        };
        Self { rng }
    }

    /// A stream seeded from `params.seed`.
    pub fn for_params(params: &SamplingParams) -> Self {
        Self::new(params.seed)
    }

    /// Next uniform draw in `[0, 1)` (exposed for speculative accept/reject tests).
    pub fn next_uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// Samples a token: [`argmax`] for greedy params (no draw consumed), otherwise one uniform
    /// draw through [`sample_from_probs`] on [`probs_from_logits`].
    pub fn sample(&mut self, logits: &[f32], params: &SamplingParams) -> Result<u32, KernelError> {
        let probs = probs_from_logits(logits, params)?;
        if params.is_greedy() {
            return Ok(argmax(logits));
        }
        let u = self.next_uniform();
        sample_from_probs(&probs, u)
    }
}
