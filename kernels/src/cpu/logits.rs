//! Logits processing: the one step that applies a request's penalties, `logit_bias` and
//! `min_tokens` mask to its logits before they become a distribution
//! ([`crate::cpu::sample::probs_from_logits`]) or an argmax.
//!
//! Every sampler path runs it: plain draws and speculative verification, on every backend
//! (`crate::backend::sample::apply_controls` calls [`apply_controls`] row by row; see there for
//! the GPU). Verification must give each verified position exactly the distribution plain
//! decoding would use there, so a row's history is the request's [`TokenHistory`] plus the
//! drafts accepted before that position ([`RowControls::drafted`]).
//!
//! Order and formulas, vLLM's (V1 sampler: `LogitBiasLogitsProcessor`,
//! `MinTokensLogitsProcessor`, then `apply_penalties`), for a logit `x` of token `t`:
//!
//! 1. `logit_bias`: `x += bias[t]`;
//! 2. `min_tokens`: `x = -inf` for each [`RowControls::masked`] token (the engine passes the
//!    request's stop tokens while fewer than `min_tokens` tokens have been generated);
//!    the grammar mask (structured output): `x = -inf` for each token outside
//!    [`RowControls::allowed`];
//! 3. `repetition_penalty` `r` (HF/vLLM), for `t` in the prompt or the output:
//!    `x = x / r` if `x > 0`, else `x = x · r`;
//! 4. `frequency_penalty` `f`: `x -= f · count(t)`, count over the *generated* tokens;
//! 5. `presence_penalty` `p`: `x -= p` if `count(t) > 0`.
//!
//! Cost: proportional to the distinct tokens of prompt and output plus the bias and mask
//! entries; a grammar mask adds one pass over the row.
//!
//! [`RowLogprobs`] is the other thing a request can ask of its logits: the model's raw
//! log-probabilities (`log_softmax` of the logits *before* any of the above and before
//! temperature, vLLM's default `raw_logprobs`), for the chosen token and the top alternatives.

use std::collections::{HashMap, HashSet};

pub use ferry_modelcard::sampling::LogitsControls;

use crate::error::KernelError;

/// What a request has seen: its prompt's distinct tokens (for `repetition_penalty`) and how
/// often it generated each token (all three penalties).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenHistory {
    prompt: HashSet<u32>,
    output: HashMap<u32, u32>,
    generated: usize,
}

impl TokenHistory {
    /// A history of `prompt` followed by the already generated `output` (a migrated request's
    /// resumed tokens, for instance).
    pub fn new(prompt: &[u32], output: &[u32]) -> Self {
        let mut h = Self {
            prompt: prompt.iter().copied().collect(),
            ..Self::default()
        };
        for &t in output {
            h.push(t);
        }
        h
    }

    /// Records one generated token.
    pub fn push(&mut self, token: u32) {
        *self.output.entry(token).or_insert(0) += 1;
        self.generated += 1;
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// How often `token` was generated.
    pub fn count(&self, token: u32) -> u32 {
        self.output.get(&token).copied().unwrap_or(0)
    }
}

/// One row's processing.
#[derive(Debug, Clone, Copy)]
pub struct RowControls<'a> {
    /// The request's penalties and bias.
    pub controls: &'a LogitsControls,
    /// What the request had generated before this step.
    pub history: &'a TokenHistory,
    /// Tokens generated after `history` and before this row's position: the drafts a
    /// speculative round verifies ahead of it (empty for a plain draw).
    pub drafted: &'a [u32],
    /// Tokens whose logit becomes `-inf` (`min_tokens` holding back the stop tokens).
    pub masked: &'a [u32],
    /// The request's grammar mask at this position (structured output), a bit set over the
    /// vocabulary: bit `t % 32` of word `t / 32` set ⇔ token `t` allowed; every other
    /// token's logit becomes `-inf` (tokens past the words too). `None`: no grammar.
    pub allowed: Option<&'a [u32]>,
}

impl RowControls<'_> {
    /// Whether the row would be left unchanged.
    pub fn is_noop(&self) -> bool {
        self.controls.is_noop() && self.masked.is_empty() && self.allowed.is_none()
    }
}

/// Sets every logit of `logits` whose token is not in `allowed` (a bit set, see
/// [`RowControls::allowed`]) to `-inf`.
pub fn apply_allowed(logits: &mut [f32], allowed: &[u32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = allowed.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, x) in chunk.iter_mut().enumerate() {
            if bits & (1 << b) == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// `token`'s logit in `logits`, or an error naming `what` for an id past the vocabulary.
fn at<'a>(
    logits: &'a mut [f32],
    token: u32,
    what: &'static str,
) -> Result<&'a mut f32, KernelError> {
    let vocab = logits.len();
    logits
        .get_mut(token as usize)
        .ok_or_else(|| KernelError::InvalidParam {
            op: "apply_controls",
            field: what,
            limit: "token ids < vocab",
            value: format!("{token} (vocab {vocab})"),
        })
}

/// Applies `c` to one row of logits in place, in the order of the module doc. Errors (with
/// `logits` possibly half processed) on a token id past the row.
pub fn apply_controls(logits: &mut [f32], c: &RowControls<'_>) -> Result<(), KernelError> {
    let k = c.controls;
    for &(t, bias) in &k.logit_bias {
        *at(logits, t, "logit_bias")? += bias;
    }
    for &t in c.masked {
        *at(logits, t, "masked")? = f32::NEG_INFINITY;
    }
    if let Some(allowed) = c.allowed {
        apply_allowed(logits, allowed);
    }
    let penalised =
        k.repetition_penalty != 1.0 || k.frequency_penalty != 0.0 || k.presence_penalty != 0.0;
    if !penalised {
        return Ok(());
    }
    // Output counts: the history's plus the drafts ahead of this row.
    let mut drafted: HashMap<u32, u32> = HashMap::new();
    for &t in c.drafted {
        *drafted.entry(t).or_insert(0) += 1;
    }
    let h = c.history;
    let count = |t: u32| h.count(t) + drafted.get(&t).copied().unwrap_or(0);
    let r = k.repetition_penalty;
    if r != 1.0 {
        // Each distinct token of prompt ∪ output once.
        let seen = h
            .prompt
            .iter()
            .copied()
            .chain(h.output.keys().copied().filter(|t| !h.prompt.contains(t)))
            .chain(
                drafted
                    .keys()
                    .copied()
                    .filter(|t| !h.prompt.contains(t) && !h.output.contains_key(t)),
            );
        for t in seen {
            let x = at(logits, t, "history")?;
            *x = if *x > 0.0 { *x / r } else { *x * r };
        }
    }
    if k.frequency_penalty != 0.0 || k.presence_penalty != 0.0 {
        let output = h.output.keys().copied().chain(
            drafted
                .keys()
                .copied()
                .filter(|t| !h.output.contains_key(t)),
        );
        for t in output {
            let n = count(t);
            let x = at(logits, t, "history")?;
            *x -= k.frequency_penalty * n as f32;
            if n > 0 {
                *x -= k.presence_penalty;
            }
        }
    }
    Ok(())
}

/// Most alternatives a request may ask for per token (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A generated token's log-probability under the model's raw distribution, and the `n` most
/// likely tokens there with theirs (most likely first, ties to the lower id).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The generated token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The top alternatives, `(token, logprob)`.
    pub top: Vec<(u32, f32)>,
}

/// One row's raw log-softmax, kept until the row's token is known: the logits, their
/// log-sum-exp and the top `n`.
#[derive(Debug, Clone, PartialEq)]
pub struct RowLogprobs {
    logits: Vec<f32>,
    lse: f64,
    top: Vec<(u32, f32)>,
}

impl RowLogprobs {
    /// The log-softmax facts of `logits` (one row), with the `n` most likely tokens (at most
    /// [`MAX_TOP_LOGPROBS`]). The log-sum-exp is accumulated in f64 after subtracting the
    /// maximum, so a log-probability is the f32 rounding of `x - max - ln Σ exp(x - max)`.
    /// Errors on an empty row or one without a finite maximum.
    pub fn new(logits: Vec<f32>, n: usize) -> Result<Self, KernelError> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() || logits.iter().any(|v| v.is_nan()) {
            return Err(KernelError::DegenerateDistribution {
                op: "logprobs",
                sum: f64::from(max),
            });
        }
        let sum: f64 = logits
            .iter()
            .map(|&v| (f64::from(v) - f64::from(max)).exp())
            .sum();
        let lse = f64::from(max) + sum.ln();
        let n = n.min(MAX_TOP_LOGPROBS).min(logits.len());
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let order = |a: &u32, b: &u32| {
            let (x, y) = (logits[*a as usize], logits[*b as usize]);
            y.total_cmp(&x).then(a.cmp(b))
        };
        if n > 0 && n < ids.len() {
            ids.select_nth_unstable_by(n - 1, order);
        }
        ids.truncate(n);
        ids.sort_unstable_by(order);
        let mut row = Self {
            logits,
            lse,
            top: Vec::new(),
        };
        row.top = ids.into_iter().map(|t| (t, row.logprob(t))).collect();
        Ok(row)
    }

    /// `token`'s log-probability (`-inf` for an id past the row).
    pub fn logprob(&self, token: u32) -> f32 {
        self.logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&x| (f64::from(x) - self.lse) as f32)
    }

    /// What a client gets for `token` chosen from this row.
    pub fn of(&self, token: u32) -> TokenLogprobs {
        TokenLogprobs {
            token,
            logprob: self.logprob(token),
            top: self.top.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn controls(presence: f32, frequency: f32, repetition: f32) -> LogitsControls {
        LogitsControls {
            presence_penalty: presence,
            frequency_penalty: frequency,
            repetition_penalty: repetition,
            logit_bias: Vec::new(),
        }
    }

    fn run(
        logits: &[f32],
        c: &LogitsControls,
        h: &TokenHistory,
        drafted: &[u32],
        masked: &[u32],
    ) -> Vec<f32> {
        let mut x = logits.to_vec();
        apply_controls(
            &mut x,
            &RowControls {
                controls: c,
                history: h,
                drafted,
                masked,
                allowed: None,
            },
        )
        .expect("in range");
        x
    }

    /// The module doc's formulas, written out per token over the whole vocabulary: the
    /// reference the sparse implementation must equal.
    fn reference(
        logits: &[f32],
        c: &LogitsControls,
        prompt: &[u32],
        output: &[u32],
        masked: &[u32],
    ) -> Vec<f32> {
        (0..logits.len() as u32)
            .map(|t| {
                let mut x = logits[t as usize];
                x += c
                    .logit_bias
                    .iter()
                    .filter(|b| b.0 == t)
                    .map(|b| b.1)
                    .sum::<f32>();
                if masked.contains(&t) {
                    x = f32::NEG_INFINITY;
                }
                if prompt.contains(&t) || output.contains(&t) {
                    x = if x > 0.0 {
                        x / c.repetition_penalty
                    } else {
                        x * c.repetition_penalty
                    };
                }
                let n = output.iter().filter(|&&o| o == t).count() as f32;
                x -= c.frequency_penalty * n;
                if n > 0.0 {
                    x -= c.presence_penalty;
                }
                x
            })
            .collect()
    }

    #[test]
    fn penalties_match_hand_computed_logits() {
        // Prompt [0, 1], generated [2, 2, 3]; presence 0.5, frequency 0.25, repetition 2.
        let logits = [4.0, -1.0, 3.0, 0.5, 2.0, -3.0];
        let h = TokenHistory::new(&[0, 1], &[2, 2, 3]);
        let got = run(&logits, &controls(0.5, 0.25, 2.0), &h, &[], &[]);
        let want = [
            2.0,  // prompt, positive: 4 / 2
            -2.0, // prompt, negative: -1 · 2
            0.5,  // output twice: 3 / 2 - 0.25 · 2 - 0.5
            -0.5, // output once: 0.5 / 2 - 0.25 - 0.5
            2.0,  // unseen
            -3.0, // unseen
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn bias_then_mask_then_penalties() {
        // The bias flips token 1's sign before the repetition penalty sees it.
        let c = LogitsControls {
            logit_bias: vec![(1, 5.0), (2, 100.0), (4, -100.0)],
            ..controls(0.0, 0.0, 2.0)
        };
        let h = TokenHistory::new(&[1], &[]);
        let got = run(&[0.0, -1.0, 0.0, 0.0, 7.0], &c, &h, &[], &[2]);
        assert_eq!(got, vec![0.0, 4.0 / 2.0, f32::NEG_INFINITY, 0.0, -93.0]);
    }

    #[test]
    fn drafted_tokens_count_as_generated() {
        // A verified row after drafts [5, 2] sees what plain decoding would after emitting them.
        let c = controls(0.3, 0.7, 1.5);
        let logits: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
        let h = TokenHistory::new(&[1, 6], &[2, 3]);
        let ahead = run(&logits, &c, &h, &[5, 2], &[]);
        let mut pushed = h.clone();
        pushed.push(5);
        pushed.push(2);
        assert_eq!(ahead, run(&logits, &c, &pushed, &[], &[]));
        assert_eq!(ahead, reference(&logits, &c, &[1, 6], &[2, 3, 5, 2], &[]));
    }

    #[test]
    fn matches_the_dense_reference_on_random_rows() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
        for _ in 0..200 {
            let vocab = rng.random_range(1..40usize);
            let logits: Vec<f32> = (0..vocab).map(|_| rng.random_range(-5.0f32..5.0)).collect();
            let tok = |rng: &mut rand_chacha::ChaCha8Rng| rng.random_range(0..vocab as u32);
            let prompt: Vec<u32> = (0..rng.random_range(0..10))
                .map(|_| tok(&mut rng))
                .collect();
            let output: Vec<u32> = (0..rng.random_range(0..10))
                .map(|_| tok(&mut rng))
                .collect();
            let split = rng.random_range(0..=output.len());
            let masked: Vec<u32> = (0..rng.random_range(0..3)).map(|_| tok(&mut rng)).collect();
            let bias = LogitsControls::logit_bias_from(
                (0..rng.random_range(0..4))
                    .map(|_| (tok(&mut rng), rng.random_range(-100.0f32..100.0))),
                vocab,
            )
            .unwrap_or_default();
            let c = LogitsControls {
                logit_bias: bias,
                ..controls(
                    rng.random_range(-2.0..2.0),
                    rng.random_range(-2.0..2.0),
                    rng.random_range(0.1..3.0),
                )
            };
            let h = TokenHistory::new(&prompt, &output[..split]);
            let got = run(&logits, &c, &h, &output[split..], &masked);
            let want = reference(&logits, &c, &prompt, &output, &masked);
            // Same operations in the same order per token: bit-identical.
            assert_eq!(
                got, want,
                "vocab {vocab} prompt {prompt:?} output {output:?}"
            );
        }
    }

    #[test]
    fn row_logprobs_are_the_log_softmax_with_the_top_n() {
        let logits = vec![1.0f32, 3.0, 3.0, -2.0, 0.5];
        let row = RowLogprobs::new(logits.clone(), 3).expect("finite");
        let mut want = logits.clone();
        crate::cpu::softmax::log_softmax_inplace(&mut want).expect("finite");
        for (t, w) in want.iter().enumerate() {
            // f32 log_softmax vs the f64-accumulated one: a few ulp of values near 1.
            assert!((row.logprob(t as u32) - w).abs() < 1e-6, "{t}");
        }
        let got = row.of(3);
        assert_eq!(got.token, 3);
        assert_eq!(got.logprob, row.logprob(3));
        let top: Vec<u32> = got.top.iter().map(|p| p.0).collect();
        assert_eq!(
            top,
            vec![1, 2, 0],
            "most likely first, ties to the lower id"
        );
        let total: f64 = (0..5).map(|t| f64::from(row.logprob(t)).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert!(RowLogprobs::new(vec![f32::NEG_INFINITY; 2], 1).is_err());
        assert_eq!(
            RowLogprobs::new(vec![0.0; 50], 99)
                .expect("finite")
                .top
                .len(),
            20
        );
        assert!(RowLogprobs::new(vec![0.0; 4], 0)
            .expect("finite")
            .top
            .is_empty());
    }

    #[test]
    fn the_grammar_mask_keeps_only_allowed_tokens_after_the_bias() {
        let c = LogitsControls {
            logit_bias: vec![(1, 50.0)],
            ..Default::default()
        };
        let h = TokenHistory::default();
        // Tokens 2 and 33 allowed; the vocabulary (40) runs past the mask's words (32 bits
        // and one more word), and token 1's +50 bias does not bring it back.
        let allowed = [1u32 << 2, 1 << 1];
        let mut x: Vec<f32> = (0..70).map(|t| t as f32).collect();
        let row = RowControls {
            controls: &c,
            history: &h,
            drafted: &[],
            masked: &[],
            allowed: Some(&allowed),
        };
        assert!(!row.is_noop());
        apply_controls(&mut x, &row).expect("in range");
        let finite: Vec<usize> = (0..70).filter(|&t| x[t].is_finite()).collect();
        assert_eq!(finite, vec![2, 33]);
        assert_eq!((x[2], x[33]), (2.0, 33.0));
    }

    #[test]
    fn ids_past_the_row_are_errors_and_noops_change_nothing() {
        let c = LogitsControls {
            logit_bias: vec![(9, 1.0)],
            ..Default::default()
        };
        let h = TokenHistory::default();
        let mut x = vec![0.0; 4];
        let e = apply_controls(
            &mut x,
            &RowControls {
                controls: &c,
                history: &h,
                drafted: &[],
                masked: &[],
                allowed: None,
            },
        )
        .expect_err("id 9 of 4");
        assert!(e.to_string().contains("logit_bias"), "{e}");
        let none = LogitsControls::default();
        let row = RowControls {
            controls: &none,
            history: &TokenHistory::new(&[1], &[2]),
            drafted: &[3],
            masked: &[],
            allowed: None,
        };
        assert!(row.is_noop());
        let mut x = vec![1.0, -2.0, 3.0, 4.0];
        apply_controls(&mut x, &row).expect("in range");
        assert_eq!(x, vec![1.0, -2.0, 3.0, 4.0]);
    }
}
