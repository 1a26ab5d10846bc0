//! A request's sampling controls, and the range check every entry point runs on them.
//!
//! The router validates with the same [`SamplingParams::validate`] the decode worker runs, so a
//! request refused at one is refused at the other with the same message. The distribution these
//! parameters define is `ferry_kernels::cpu::sample::probs_from_logits`.

/// A sampling parameter outside its range: names the field, the value and the limit.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("sampling: `{field}` must be {limit}, got {value}")]
pub struct SamplingError {
    /// The parameter, as the API spells it (`temperature`, `top_p`, `min_p`).
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
