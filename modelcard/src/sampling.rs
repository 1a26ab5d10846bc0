//! A request's sampling controls, and the range check every entry point runs on them.
//!
//! The router validates with the same [`SamplingParams::validate`] the decode worker runs, so a
//! request refused at one is refused at the other with the same message. The distribution these
//! parameters define is `ferry_kernels::cpu::sample::probs_from_logits`.
//!
//! [`LogitsControls`] (penalties and `logit_bias`) change the logits *before* that
//! distribution is formed; `ferry_kernels::cpu::logits` applies them, with the order and the
//! formulas stated there (vLLM's).

/// A sampling parameter outside its range: names the field, the value and the limit.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("sampling: `{field}` must be {limit}, got {value}")]
pub struct SamplingError {
    /// The parameter, as the API spells it (`temperature`, `top_p`, `min_p`,
    /// `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`).
    pub field: &'static str,
    /// The value given.
    pub value: f64,
    /// The accepted range.
    pub limit: &'static str,
}

/// Per-request sampling controls.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (plus ties); 0 = off.
    pub top_k: u32,
    /// Keep the smallest head of the distribution with mass `>= top_p` (plus ties); 1 = off.
    pub top_p: f32,
    /// Drop tokens with probability `< min_p · max`; 0 = off.
    pub min_p: f32,
    /// Seed of the request's random stream; `None` draws one from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    /// Plain sampling at temperature 1 with every filter off.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Checks ranges: `temperature` finite and `>= 0`, `top_p` in `(0, 1]`, `min_p` in `[0, 1]`.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(invalid("temperature", t, "finite and >= 0"));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(invalid("top_p", p, "in (0, 1]"));
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            return Err(invalid("min_p", m, "in [0, 1]"));
        }
        Ok(())
    }

    /// Whether the request always takes the argmax (`temperature == 0` or `top_k == 1`).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

fn invalid(field: &'static str, value: f32, limit: &'static str) -> SamplingError {
    SamplingError {
        field,
        value: f64::from(value),
        limit,
    }
}

/// `logit_bias` entries per request, at most (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;

/// Largest `|bias|` of a `logit_bias` entry (OpenAI's range, [-100, 100]).
pub const MAX_BIAS: f32 = 100.0;

/// Largest `|presence_penalty|` and `|frequency_penalty|` (OpenAI's range, [-2, 2]).
pub const MAX_PENALTY: f32 = 2.0;

/// A `logit_bias` entry outside its limits: names the limit and the offending entry.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LogitBiasError {
    /// More entries than [`MAX_LOGIT_BIAS`].
    #[error("`logit_bias` must have at most {MAX_LOGIT_BIAS} entries, got {0}")]
    TooMany(usize),
    /// A token id at or past the vocabulary.
    #[error("`logit_bias` token ids must be < {vocab} (the vocabulary size), got {token}")]
    Token {
        /// The id given.
        token: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A bias outside [-100, 100] (or not finite).
    #[error("`logit_bias` values must be in [-100, 100], got {bias} for token {token}")]
    Bias {
        /// The token it was given for.
        token: u32,
        /// The value.
        bias: f32,
    },
    /// The same token twice.
    #[error("`logit_bias` must name each token once, got {0} twice")]
    Duplicate(u32),
}

/// What a request does to the logits before [`SamplingParams`] turn them into a distribution:
/// OpenAI's penalties, vLLM's `repetition_penalty` and `logit_bias`. The defaults change
/// nothing ([`LogitsControls::is_noop`]), and a request that leaves them there keeps every
/// device's fast sampling path.
#[derive(Debug, Clone, PartialEq)]
pub struct LogitsControls {
    /// Subtracted once from the logit of every token generated at least once; in [-2, 2].
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of every generated token; in [-2, 2].
    pub frequency_penalty: f32,
    /// For tokens of the prompt or the output: positive logits divided by it, the others
    /// multiplied; > 0, 1 = off.
    pub repetition_penalty: f32,
    /// `(token, bias)` pairs added to the logits, sorted by token, each token once.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for LogitsControls {
    /// No penalty, no bias.
    fn default() -> Self {
        Self {
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

impl LogitsControls {
    /// Whether these controls leave every logit as it is.
    pub fn is_noop(&self) -> bool {
        self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.repetition_penalty == 1.0
            && self.logit_bias.is_empty()
    }

    /// Checks the penalties' ranges: `presence_penalty` and `frequency_penalty` in [-2, 2],
    /// `repetition_penalty` finite and > 0. (`logit_bias` is checked when it is built,
    /// [`LogitsControls::logit_bias_from`], which needs the vocabulary.)
    pub fn validate(&self) -> Result<(), SamplingError> {
        for (field, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-MAX_PENALTY..=MAX_PENALTY).contains(&v) {
                return Err(invalid(field, v, "in [-2, 2]"));
            }
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(invalid("repetition_penalty", r, "finite and > 0"));
        }
        Ok(())
    }

    /// A checked `logit_bias`: at most [`MAX_LOGIT_BIAS`] entries, token ids below `vocab`,
    /// biases in [-100, 100], no token twice; sorted by token.
    pub fn logit_bias_from(
        entries: impl IntoIterator<Item = (u32, f32)>,
        vocab: usize,
    ) -> Result<Vec<(u32, f32)>, LogitBiasError> {
        let mut bias: Vec<(u32, f32)> = entries.into_iter().collect();
        if bias.len() > MAX_LOGIT_BIAS {
            return Err(LogitBiasError::TooMany(bias.len()));
        }
        bias.sort_by_key(|&(t, _)| t);
        for (i, &(token, b)) in bias.iter().enumerate() {
            if token as usize >= vocab {
                return Err(LogitBiasError::Token { token, vocab });
            }
            if !(-MAX_BIAS..=MAX_BIAS).contains(&b) {
                return Err(LogitBiasError::Bias { token, bias: b });
            }
            if i > 0 && bias.get(i - 1).is_some_and(|&(prev, _)| prev == token) {
                return Err(LogitBiasError::Duplicate(token));
            }
        }
        Ok(bias)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn penalty_ranges_name_the_field() {
        assert!(LogitsControls::default().validate().is_ok());
        assert!(LogitsControls::default().is_noop());
        let bad = [
            (
                "presence_penalty",
                LogitsControls {
                    presence_penalty: 2.5,
                    ..Default::default()
                },
            ),
            (
                "frequency_penalty",
                LogitsControls {
                    frequency_penalty: -2.01,
                    ..Default::default()
                },
            ),
            (
                "frequency_penalty",
                LogitsControls {
                    frequency_penalty: f32::NAN,
                    ..Default::default()
                },
            ),
            (
                "repetition_penalty",
                LogitsControls {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
            ),
            (
                "repetition_penalty",
                LogitsControls {
                    repetition_penalty: f32::INFINITY,
                    ..Default::default()
                },
            ),
        ];
        for (field, c) in bad {
            assert!(!c.is_noop());
            let e = c.validate().expect_err(field);
            assert_eq!(e.field, field, "{e}");
        }
        let edge = LogitsControls {
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            repetition_penalty: 1e-3,
            ..Default::default()
        };
        assert!(edge.validate().is_ok());
    }

    #[test]
    fn logit_bias_is_checked_and_sorted() {
        let ok = LogitsControls::logit_bias_from([(7, 1.0), (3, -100.0), (9, 100.0)], 10)
            .expect("valid");
        assert_eq!(ok, vec![(3, -100.0), (7, 1.0), (9, 100.0)]);
        assert_eq!(
            LogitsControls::logit_bias_from([(10, 1.0)], 10),
            Err(LogitBiasError::Token {
                token: 10,
                vocab: 10
            })
        );
        assert_eq!(
            LogitsControls::logit_bias_from([(1, 100.5)], 10),
            Err(LogitBiasError::Bias {
                token: 1,
                bias: 100.5
            })
        );
        assert!(matches!(
            LogitsControls::logit_bias_from([(1, f32::NAN)], 10),
            Err(LogitBiasError::Bias { .. })
        ));
        assert_eq!(
            LogitsControls::logit_bias_from([(1, 1.0), (1, 2.0)], 10),
            Err(LogitBiasError::Duplicate(1))
        );
        let many = (0..301u32).map(|t| (t, 0.0));
        let e = LogitsControls::logit_bias_from(many, 1000).expect_err("301 entries");
        assert_eq!(
            e.to_string(),
            "`logit_bias` must have at most 300 entries, got 301"
        );
    }
}
