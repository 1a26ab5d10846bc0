//! The statistics of the losslessness tests (`tests/verify.rs` for the CPU verifier,
//! `tests/backend_sample.rs` for the backend's): a float64 reference of the sampler's
//! distribution written from the definitions, Pearson chi-square with pooling, the per-position
//! tallies of a run and the accepted-length law `Π α_i (1 − α_k)`.
//!
//! Statistics: Pearson chi-square per output position (cells with an expected count below 5 are
//! pooled) and on the accepted-length histogram. The threshold [`CHI2_LIMIT`] = 45 at ≤ 8
//! degrees of freedom is exceeded by a correct verifier with probability below 1e-6.

use ferry_kernels::cpu::sample::SamplingParams;

pub const VOCAB: usize = 8;
pub const GAMMA: usize = 3;
pub const ROUNDS: usize = 40_000;
/// Exceeded by a correct verifier with probability below 1e-6 at ≤ 8 degrees of freedom.
pub const CHI2_LIMIT: f64 = 45.0;

/// Float64 reference of the sampler's distribution, written from the definitions: softmax at
/// temperature, top-k keeping entries with fewer than k strictly larger, top-p keeping entries
/// whose strictly-larger mass is below p, min-p; a point mass at the (lowest) argmax for greedy.
pub fn reference_probs(logits: &[f32], params: &SamplingParams) -> Vec<f64> {
    let n = logits.len();
    if params.is_greedy() {
        let mut best = 0;
        for (i, &v) in logits.iter().enumerate() {
            if v > logits[best] {
                best = i;
            }
        }
        let mut p = vec![0.0; n];
        p[best] = 1.0;
        return p;
    }
    let t = f64::from(params.temperature);
    let max = logits
        .iter()
        .map(|&v| f64::from(v) / t)
        .fold(f64::MIN, f64::max);
    let mut p: Vec<f64> = logits
        .iter()
        .map(|&v| (f64::from(v) / t - max).exp())
        .collect();
    normalise(&mut p);
    let k = params.top_k as usize;
    if k > 0 && k < n {
        let keep: Vec<bool> = p
            .iter()
            .map(|&v| p.iter().filter(|&&u| u > v).count() < k)
            .collect();
        filter(&mut p, &keep);
    }
    if params.top_p < 1.0 {
        let target = f64::from(params.top_p);
        let keep: Vec<bool> = p
            .iter()
            .map(|&v| p.iter().filter(|&&u| u > v).sum::<f64>() < target)
            .collect();
        filter(&mut p, &keep);
    }
    if params.min_p > 0.0 {
        let m = p.iter().copied().fold(0.0, f64::max) * f64::from(params.min_p);
        let keep: Vec<bool> = p.iter().map(|&v| v >= m).collect();
        filter(&mut p, &keep);
    }
    p
}

pub fn normalise(p: &mut [f64]) {
    let s: f64 = p.iter().sum();
    p.iter_mut().for_each(|v| *v /= s);
}

pub fn filter(p: &mut [f64], keep: &[bool]) {
    for (v, &k) in p.iter_mut().zip(keep) {
        if !k {
            *v = 0.0;
        }
    }
    normalise(p);
}

/// Pearson chi-square of `counts` against `probs` (cells with expected < 5 pooled); returns
/// (statistic, degrees of freedom). A count in a zero-probability cell is an infinite statistic.
pub fn chi2(counts: &[u64], probs: &[f64]) -> (f64, usize) {
    let n: u64 = counts.iter().sum();
    let mut stat = 0.0;
    let mut cells = 0usize;
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        if p == 0.0 {
            if c > 0 {
                return (f64::INFINITY, cells);
            }
            continue;
        }
        let e = n as f64 * p;
        if e < 5.0 {
            pooled_obs += c as f64;
            pooled_exp += e;
            continue;
        }
        stat += (c as f64 - e).powi(2) / e;
        cells += 1;
    }
    if pooled_exp > 0.0 {
        stat += (pooled_obs - pooled_exp).powi(2) / pooled_exp.max(1e-12);
        cells += 1;
    }
    (stat, cells.saturating_sub(1))
}

/// Per-position emitted-token counts and the accepted-length histogram of a run.
#[derive(Debug)]
pub struct Tally {
    /// Per output position, the count of each emitted token.
    pub at: Vec<[u64; VOCAB]>,
    /// How many rounds accepted 0, 1, … γ drafts.
    pub accepted: [u64; GAMMA + 1],
}

impl Tally {
    /// Zero counts.
    pub fn new() -> Self {
        Self {
            at: vec![[0; VOCAB]; GAMMA + 1],
            accepted: [0; GAMMA + 1],
        }
    }
}

/// The chi-square statistics of a tally against the reference: one per output position, then
/// the accepted-length histogram against `Π α_i (1 − α_k)`.
pub fn statistics(tally: &Tally, p_ref: &[Vec<f64>], alpha: &[f64]) -> Vec<(f64, usize)> {
    let mut out: Vec<(f64, usize)> = tally
        .at
        .iter()
        .zip(p_ref)
        .map(|(counts, p)| chi2(counts, p))
        .collect();
    let mut lengths = Vec::with_capacity(GAMMA + 1);
    let mut reach = 1.0;
    for &a in alpha {
        lengths.push(reach * (1.0 - a));
        reach *= a;
    }
    lengths.push(reach);
    out.push(chi2(&tally.accepted, &lengths));
    out
}

pub fn passes(stats: &[(f64, usize)]) -> bool {
    stats.iter().all(|&(s, _)| s < CHI2_LIMIT)
}

/// Expected acceptance per position, `Σ_v min(p, q)`.
pub fn alpha(p_ref: &[Vec<f64>], q: &[f64]) -> Vec<f64> {
    (0..GAMMA)
        .map(|k| {
            p_ref[k]
                .iter()
                .zip(&q[k * VOCAB..(k + 1) * VOCAB])
                .map(|(a, b)| a.min(*b))
                .sum()
        })
        .collect()
}

/// The sampled configurations every losslessness test runs.
pub fn sampled_params() -> Vec<SamplingParams> {
    vec![
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.8,
            top_k: 5,
            top_p: 0.9,
            min_p: 0.02,
            seed: None,
        },
        SamplingParams {
            temperature: 1.3,
            top_p: 0.6,
            ..SamplingParams::default()
        },
    ]
}
