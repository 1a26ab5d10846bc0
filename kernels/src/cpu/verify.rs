//! Lossless verification of drafted tokens (speculative decoding).
//!
//! The rule (Leviathan et al. 2023, Chen et al. 2023), per drafted position `k = 1..=γ`, with `p_k`
//! the distribution the plain sampler would use there and `q_k` the distribution the drafter
//! actually drew `x_k` from:
//!
//! 1. accept `x_k` when `u_k · q_k(x_k) < p_k(x_k)` (probability `min(1, p_k(x_k) / q_k(x_k))`),
//!    with a fresh uniform `u_k` per position;
//! 2. on the first rejection emit `y ~ norm(max(0, p_k − q_k))` and stop;
//! 3. when every draft is accepted emit a bonus `y ~ p_{γ+1}`.
//!
//! Each round thus emits `accepted + 1` tokens whose joint law is exactly that of sampling from
//! `p` token by token. The correction / bonus draw uses one more uniform, `uniforms[γ]`.
//!
//! | what the drafter did | `q_k` passed here |
//! |---|---|
//! | sampled from a (Markov-corrected) distribution | [`DraftProbs::Sampled`]: those rows |
//! | took the argmax | [`DraftProbs::Greedy`]: a point mass `δ(x_k)` |
//!
//! Passing the soft distribution for an argmax draft over-accepts (the distribution tests in
//! `kernels/tests/verify.rs` catch exactly that). `p` is built by [`probs_from_logits`] — the
//! sampler's own code, with its pivot tie rule for top-k / top-p — so both sides of the accept
//! test see the same distribution. A greedy request's `p` is a point mass at the argmax, which
//! makes verification exact argmax matching.
//!
//! Failure isolation: every request is verified on its own ([`verify_batch`] returns one
//! `Result` per request), so a bad request — inconsistent lengths, a draft its own `q` gives
//! zero probability, degenerate logits — fails alone.
//!
//! Randomness is passed in (`uniforms`), so tests drive the exact draws and callers decide how
//! streams are seeded.

use super::sample::{probs_from_logits, sample_from_probs, SamplingParams};
use crate::error::KernelError;

/// What the drafter sampled each draft from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DraftProbs<'a> {
    /// `x_k ~ q_k`: row-major `[γ][vocab]`, each row the exact distribution used.
    Sampled(&'a [f32]),
    /// `x_k = argmax`: `q_k = δ(x_k)`.
    Greedy,
}

/// One request's verification input.
#[derive(Debug, Clone, Copy)]
pub struct VerifyRequest<'a> {
    /// Target logits `[(γ + 1)][vocab]`: row `k` scores the token after the anchor and the first
    /// `k` drafts; the last row is the bonus position.
    pub target_logits: &'a [f32],
    /// The γ drafted tokens.
    pub drafts: &'a [u32],
    /// The distributions the drafts were drawn from.
    pub q: DraftProbs<'a>,
    /// The request's sampling parameters (they define `p`).
    pub params: &'a SamplingParams,
    /// γ + 1 independent uniforms in `[0, 1)`: one per draft, then one for the correction or bonus.
    pub uniforms: &'a [f64],
}

/// The outcome of one round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Drafts accepted (a prefix of the drafts).
    pub accepted: usize,
    /// The tokens to emit: the accepted drafts, then the correction (on a rejection) or the bonus.
    pub tokens: Vec<u32>,
}

impl Verified {
    /// Whether every draft was accepted (the last token is a bonus, not a correction).
    pub fn all_accepted(&self, gamma: usize) -> bool {
        self.accepted == gamma
    }
}

fn invalid(field: &'static str, limit: &'static str, value: String) -> KernelError {
    KernelError::InvalidParam {
        op: "verify",
        field,
        limit,
        value,
    }
}

/// Verifies one request: builds `p` from the target logits with the sampler's code, then applies
/// [`verify_probs`].
pub fn verify(req: &VerifyRequest<'_>) -> Result<Verified, KernelError> {
    let rows = req.drafts.len() + 1;
    if req.target_logits.is_empty() || req.target_logits.len() % rows != 0 {
        return Err(invalid(
            "target_logits.len()",
            "a positive multiple of drafts.len() + 1",
            format!(
                "{} for {} drafts",
                req.target_logits.len(),
                req.drafts.len()
            ),
        ));
    }
    let vocab = req.target_logits.len() / rows;
    let mut p = Vec::with_capacity(req.target_logits.len());
    for row in req.target_logits.chunks_exact(vocab) {
        p.extend(probs_from_logits(row, req.params)?);
    }
    verify_probs(&p, req.q, req.drafts, req.uniforms)
}

/// Verifies every request independently: one result per request, in order. An error in one
/// request (bad shapes, a draft with zero `q`, degenerate logits) never affects another.
pub fn verify_batch(reqs: &[VerifyRequest<'_>]) -> Vec<Result<Verified, KernelError>> {
    reqs.iter().map(verify).collect()
}

/// The accept / correct / bonus rule on explicit distributions: `p` is `[(γ + 1)][vocab]`, `q`
/// per [`DraftProbs`], `drafts` the γ tokens, `uniforms` γ + 1 draws in `[0, 1)`.
///
/// Acceptance compares `u · q(x) < p(x)` in f64. The residual `max(0, p − q)` is formed in f32
/// and drawn from with [`sample_from_probs`] (f64 cumulation); if rounding leaves it with no
/// mass (possible only when `p ≈ q`, where a rejection has probability ≈ 0) the draw falls back
/// to `p`.
pub fn verify_probs(
    p: &[f32],
    q: DraftProbs<'_>,
    drafts: &[u32],
    uniforms: &[f64],
) -> Result<Verified, KernelError> {
    let gamma = drafts.len();
    let rows = gamma + 1;
    if p.is_empty() || p.len() % rows != 0 {
        return Err(invalid(
            "p.len()",
            "a positive multiple of drafts.len() + 1",
            format!("{} for {gamma} drafts", p.len()),
        ));
    }
    let vocab = p.len() / rows;
    if uniforms.len() != rows {
        return Err(invalid(
            "uniforms.len()",
            "drafts.len() + 1",
            format!("{} for {gamma} drafts", uniforms.len()),
        ));
    }
    if let DraftProbs::Sampled(q_rows) = q {
        if q_rows.len() != gamma * vocab {
            return Err(invalid(
                "q.len()",
                "drafts.len() × vocab",
                format!("{} for {gamma} drafts of vocab {vocab}", q_rows.len()),
            ));
        }
    }
    if let Some(&bad) = drafts.iter().find(|&&x| x as usize >= vocab) {
        return Err(invalid(
            "drafts",
            "token ids below the vocabulary size",
            format!("{bad} with vocab {vocab}"),
        ));
    }

    let mut tokens = Vec::with_capacity(rows);
    for (k, &x) in drafts.iter().enumerate() {
        let p_k = &p[k * vocab..(k + 1) * vocab];
        let xi = x as usize;
        let q_x = match q {
            DraftProbs::Greedy => 1.0,
            DraftProbs::Sampled(q_rows) => f64::from(q_rows[k * vocab + xi]),
        };
        if !(q_x.is_finite() && q_x > 0.0) {
            return Err(invalid(
                "q[k][draft]",
                "> 0 (the drafter cannot have drawn a token it gave no probability)",
                format!("{q_x} at position {k}, token {x}"),
            ));
        }
        let p_x = f64::from(p_k[xi]);
        if uniforms[k] * q_x < p_x {
            tokens.push(x);
            continue;
        }
        // Rejected: draw the correction from norm(max(0, p − q)).
        let residual: Vec<f32> = match q {
            DraftProbs::Greedy => {
                let mut r = p_k.to_vec();
                r[xi] = 0.0;
                r
            }
            DraftProbs::Sampled(q_rows) => p_k
                .iter()
                .zip(&q_rows[k * vocab..(k + 1) * vocab])
                .map(|(&a, &b)| (a - b).max(0.0))
                .collect(),
        };
        let y = match sample_from_probs(&residual, uniforms[gamma]) {
            Ok(y) => y,
            Err(KernelError::DegenerateDistribution { .. }) => {
                sample_from_probs(p_k, uniforms[gamma])?
            }
            Err(e) => return Err(e),
        };
        tokens.push(y);
        return Ok(Verified {
            accepted: k,
            tokens,
        });
    }
    let bonus = &p[gamma * vocab..];
    tokens.push(sample_from_probs(bonus, uniforms[gamma])?);
    Ok(Verified {
        accepted: gamma,
        tokens,
    })
}

/// [`verify`] for a greedy request with argmax drafts, from the argmaxes of its γ + 1 target
/// rows alone (`best[k]`: row `k`'s argmax, by [`super::sample::argmax`]'s rule; negative where
/// a device found none, every logit NaN). `p_k` is then a point mass at `best[k]` and `q_k` one
/// at the draft, so a draft is accepted exactly when it is that argmax, and the correction or
/// the bonus is the argmax of the row the round stops at: what [`verify`] returns for those
/// logits whatever the uniforms. Rows after the first rejection are not read.
///
/// The engine verifies such rounds this way on every backend (one argmax over the batch's rows
/// and one small download, as a plain greedy step samples) rather than building each row's
/// distribution and running the general rule.
pub fn verify_argmax(drafts: &[u32], best: &[i32], vocab: usize) -> Result<Verified, KernelError> {
    let gamma = drafts.len();
    if best.len() != gamma + 1 {
        return Err(invalid(
            "best.len()",
            "drafts.len() + 1",
            format!("{} for {gamma} drafts", best.len()),
        ));
    }
    if let Some(&bad) = drafts.iter().find(|&&x| x as usize >= vocab) {
        return Err(invalid(
            "drafts",
            "token ids below the vocabulary size",
            format!("{bad} with vocab {vocab}"),
        ));
    }
    let argmax = |k: usize| {
        u32::try_from(best[k])
            .ok()
            .filter(|&y| (y as usize) < vocab)
            .ok_or(KernelError::DegenerateDistribution {
                op: "verify_argmax",
                sum: f64::NAN,
            })
    };
    let mut tokens = Vec::with_capacity(gamma + 1);
    for (k, &x) in drafts.iter().enumerate() {
        let y = argmax(k)?;
        tokens.push(y);
        if x != y {
            return Ok(Verified {
                accepted: k,
                tokens,
            });
        }
    }
    tokens.push(argmax(gamma)?);
    Ok(Verified {
        accepted: gamma,
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_target_accepts_exactly_the_argmax_prefix() {
        // argmaxes: 2, 0, 1 (bonus)
        let logits = [0.0f32, 1.0, 3.0, 5.0, 1.0, 0.0, 0.0, 2.0, 1.0];
        let params = greedy();
        let req = |drafts: &'static [u32]| VerifyRequest {
            target_logits: &logits,
            drafts,
            q: DraftProbs::Greedy,
            params: &params,
            uniforms: &[0.999, 0.999, 0.999],
        };
        let all = verify(&req(&[2, 0])).unwrap();
        assert_eq!((all.accepted, all.tokens.clone()), (2, vec![2, 0, 1]));
        assert!(all.all_accepted(2));
        let one = verify(&req(&[2, 2])).unwrap();
        assert_eq!((one.accepted, one.tokens), (1, vec![2, 0]));
        let none = verify(&req(&[1, 0])).unwrap();
        assert_eq!((none.accepted, none.tokens), (0, vec![2]));
    }

    #[test]
    fn a_bad_request_fails_alone() {
        let logits = [0.0f32, 1.0, 2.0, 0.5, 0.5, 0.5];
        let params = SamplingParams::default();
        let q_zero = [0.5f32, 0.5, 0.0];
        let good = VerifyRequest {
            target_logits: &logits,
            drafts: &[1],
            q: DraftProbs::Sampled(&[0.2, 0.5, 0.3]),
            params: &params,
            uniforms: &[0.1, 0.5],
        };
        let zero_q = VerifyRequest {
            drafts: &[2],
            q: DraftProbs::Sampled(&q_zero),
            ..good
        };
        let short_uniforms = VerifyRequest {
            uniforms: &[0.1],
            ..good
        };
        let out = verify_batch(&[good, zero_q, short_uniforms, good]);
        assert!(out[0].is_ok() && out[3].is_ok());
        assert!(out[1]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("q[k][draft]"));
        assert!(out[2]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("uniforms"));
    }

    /// `verify_argmax` against the general rule (`verify` with a greedy `p` and argmax drafts)
    /// on random rows with many ties and some `-inf`, drafts mostly the argmax so that every
    /// acceptance length occurs, and random uniforms (the result must not depend on them).
    #[test]
    fn argmax_verification_is_the_general_rule_for_greedy_rounds() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let params = greedy();
        let mut by_accepted = [0usize; 9];
        for _ in 0..3000 {
            let vocab = 2 + (next() % 6) as usize;
            let gamma = (next() % 9) as usize;
            let logits: Vec<f32> = (0..(gamma + 1) * vocab)
                .map(|_| match next() % 8 {
                    0 => f32::NEG_INFINITY,
                    v => (v % 4) as f32,
                })
                .collect();
            let best: Vec<i32> = logits
                .chunks_exact(vocab)
                .map(|r| crate::cpu::sample::argmax(r) as i32)
                .collect();
            let drafts: Vec<u32> = (0..gamma)
                .map(|k| match next() % 10 {
                    0..=7 => best[k] as u32,
                    _ => (next() % vocab as u64) as u32,
                })
                .collect();
            let uniforms: Vec<f64> = (0..=gamma)
                .map(|_| (next() >> 11) as f64 / (1u64 << 53) as f64)
                .collect();
            let want = verify(&VerifyRequest {
                target_logits: &logits,
                drafts: &drafts,
                q: DraftProbs::Greedy,
                params: &params,
                uniforms: &uniforms,
            })
            .unwrap();
            let got = verify_argmax(&drafts, &best, vocab).unwrap();
            assert_eq!(got, want, "logits {logits:?} drafts {drafts:?}");
            by_accepted[got.accepted] += 1;
        }
        assert!(by_accepted.iter().all(|&n| n > 0), "{by_accepted:?}");
    }

    #[test]
    fn argmax_verification_refuses_what_the_general_rule_refuses() {
        // A draft outside the vocabulary, and a row without an argmax once it is reached.
        let err = verify_argmax(&[7], &[1, 0], 4).unwrap_err().to_string();
        assert!(err.contains("drafts"), "{err}");
        assert!(verify_argmax(&[1, 2], &[1, -1, 0], 4).is_err());
        // Rows after the first rejection are never read.
        let v = verify_argmax(&[1, 2], &[1, 3, -1], 4).unwrap();
        assert_eq!((v.accepted, v.tokens), (1, vec![1, 3]));
        assert!(verify_argmax(&[1], &[1], 4).is_err(), "one row too few");
    }
}
