//! Numerically stable softmax over one row, in f32 (torch `softmax(dim=-1, dtype=float32)`).

use crate::error::KernelError;

/// `x = exp(x - max) / Σ exp(x - max)` in place.
///
/// `-inf` entries (masked) get probability 0. A row with no finite maximum (empty, all `-inf`,
/// or containing `+inf`/NaN) is an error rather than a row of NaNs, since torch would produce
/// NaNs that poison everything downstream.
pub fn softmax_inplace(x: &mut [f32]) -> Result<(), KernelError> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() || x.iter().any(|v| v.is_nan()) {
        return Err(KernelError::DegenerateDistribution {
            op: "softmax",
            sum: f64::from(max),
        });
    }
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
    Ok(())
}

/// Lanes of the attention softmax's running max and sum: independent accumulators the compiler
/// keeps in one SIMD register each (a single running sum is a chain of dependent adds).
const LANES: usize = 8;

/// `e^x` in f32 within 2 ulp (tested), written so that a loop over it vectorises: Cody–Waite range
/// reduction `x = n·ln 2 + r` with `n` rounded by the 1.5·2²³ trick, Cephes' degree-6
/// polynomial for `e^r`, and `2^n` built in the exponent bits. No branches, no float→int
/// conversion, no libm call. `x` below −87.33 (where `e^x` leaves f32's normal range) gives 0;
/// NaN gives NaN. Meant for `x ≤ 0` (`score − max`); above 88.37 the result is not defined.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that `n · LN2_HI` is exact for |n| < 2⁹.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding then subtracting 1.5·2²³ rounds to the nearest integer, whose value sits in the
    // sum's low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const MIN_X: f32 = -87.336_55;
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n: n (two's complement, |n| < 2²²) is t's bit pattern minus ROUND's.
    let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits());
    let pow2 = f32::from_bits(n_bits.wrapping_add(127) << 23);
    // Below MIN_X: 0 (all bits cleared), without a branch.
    let keep = 0u32.wrapping_sub(u32::from(x >= MIN_X || x.is_nan()));
    f32::from_bits((y * pow2).to_bits() & keep)
}

/// Attention's softmax over one row of raw scores: `x = softmax(x · scale)` in place, with
/// [`exp_f32`] and [`LANES`] running maxima and sums (so the row is a few vector passes; the
/// sum's order differs from a left-to-right one by rounding only). Same error cases as
/// [`softmax_inplace`]: an empty row, or one with no finite maximum, `+inf` or NaN. The
/// sampler keeps [`softmax_inplace`] (libm's `exp`, left-to-right sum): its distribution is
/// the one the GPU samplers and the verifier are held to.
pub fn attention_softmax(x: &mut [f32], scale: f32) -> Result<(), KernelError> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: this CPU has AVX2, checked just above.
        return unsafe { attention_softmax_avx2(x, scale) };
    }
    softmax_scaled(x, scale)
}

/// [`softmax_scaled`] compiled for AVX2: the same operations in the same order, eight lanes a
/// vector instead of SSE2's four (the binary's baseline).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attention_softmax_avx2(x: &mut [f32], scale: f32) -> Result<(), KernelError> {
    softmax_scaled(x, scale)
}

/// The body of [`attention_softmax`], inlined into each instruction-set variant.
#[inline(always)]
fn softmax_scaled(x: &mut [f32], scale: f32) -> Result<(), KernelError> {
    for v in x.iter_mut() {
        *v *= scale;
    }
    let max = lane_max(x);
    if !max.is_finite() {
        return Err(KernelError::DegenerateDistribution {
            op: "attention_softmax",
            sum: f64::from(max),
        });
    }
    for v in x.iter_mut() {
        *v = exp_f32(*v - max);
    }
    let sum = lane_sum(x);
    // A NaN anywhere made the sum NaN (the max compares skip it).
    if !(sum.is_finite() && sum > 0.0) {
        return Err(KernelError::DegenerateDistribution {
            op: "attention_softmax",
            sum: f64::from(sum),
        });
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
    Ok(())
}

/// The largest of `x` (NaNs skipped), over [`LANES`] running maxima.
#[inline(always)]
fn lane_max(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            m[j] = if c[j] > m[j] { c[j] } else { m[j] };
        }
    }
    rest.iter()
        .chain(&m)
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
}

/// The sum of `x` over [`LANES`] running sums.
#[inline(always)]
pub(crate) fn lane_sum(x: &[f32]) -> f32 {
    let mut s = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            s[j] += c[j];
        }
    }
    s.iter().chain(rest).sum()
}

/// `x = x - max - ln Σ exp(x - max)` in place; same error cases as [`softmax_inplace`].
pub fn log_softmax_inplace(x: &mut [f32]) -> Result<(), KernelError> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() || x.iter().any(|v| v.is_nan()) {
        return Err(KernelError::DegenerateDistribution {
            op: "log_softmax",
            sum: f64::from(max),
        });
    }
    let sum: f32 = x.iter().map(|v| (v - max).exp()).sum();
    let log_sum = sum.ln();
    for v in x.iter_mut() {
        *v = *v - max - log_sum;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_sums_to_one_and_masks() {
        let mut x = [1.0f32, f32::NEG_INFINITY, 3.0, 2.0];
        softmax_inplace(&mut x).expect("finite max");
        assert_eq!(x[1], 0.0);
        // f32 sum of 4 terms: a few ulp.
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[3] && x[3] > x[0]);
    }

    #[test]
    fn exp_f32_is_within_two_ulp_of_exp() {
        // Every 1/1000 from −87.3 to 0, and the edges: relative error against f64's exp. Two
        // ulp (2⁻²² relative) is what Cephes' expf promises; libm's is under one.
        let mut worst = 0.0f64;
        for i in 0..=87_300 {
            let x = -(i as f32) / 1000.0;
            let want = f64::from(x).exp();
            let got = f64::from(exp_f32(x));
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(
            worst < 2.0 * f64::from(f32::EPSILON),
            "worst relative error {worst:e}"
        );
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        // Positive arguments short of overflow still work (not used by the softmax).
        assert!((f64::from(exp_f32(10.0)) / 10f64.exp() - 1.0).abs() < 4e-7);
    }

    #[test]
    fn attention_softmax_matches_the_reference_softmax() {
        // Rows of every length around the lane width, with a spread of scores, a masked
        // (−inf) entry and a scale. Tolerance, relative to each probability: 2 ulp for each
        // exp, plus the worst-case rounding of two differently ordered f32 sums of `len`
        // terms (`len · ε / 2` each).
        for len in [1usize, 2, 7, 8, 9, 16, 63, 517] {
            let raw: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
                .collect();
            let scale = 0.125f32;
            let mut want: Vec<f32> = raw.iter().map(|v| v * scale).collect();
            let mut got = raw.clone();
            if len > 3 {
                want[2] = f32::NEG_INFINITY;
                got[2] = f32::NEG_INFINITY;
            }
            softmax_inplace(&mut want).expect("finite");
            attention_softmax(&mut got, scale).expect("finite");
            let rel = (4.0 + len as f32) * f32::EPSILON;
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= rel * w, "len {len}: {g} vs {w}");
            }
            assert!((got.iter().sum::<f32>() - 1.0).abs() < 1e-5, "len {len}");
        }
    }

    #[test]
    fn every_instruction_set_variant_gives_the_same_bits() {
        // The dispatched function (AVX2 where the CPU has it) and the baseline body run the
        // same operations in the same order: lanes are arrays, not vector widths.
        for len in [5usize, 64, 999] {
            let raw: Vec<f32> = (0..len).map(|i| ((i * 7919 % 211) as f32) * 0.05).collect();
            let mut a = raw.clone();
            let mut b = raw;
            attention_softmax(&mut a, 0.3).expect("finite");
            softmax_scaled(&mut b, 0.3).expect("finite");
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "len {len}"
            );
        }
    }

    #[test]
    fn attention_softmax_refuses_what_softmax_refuses() {
        assert!(attention_softmax(&mut [], 1.0).is_err());
        assert!(attention_softmax(&mut [f32::NEG_INFINITY; 9], 1.0).is_err());
        for bad in [f32::NAN, f32::INFINITY] {
            for at in [0usize, 8, 10] {
                let mut x = [0.5f32; 11];
                x[at] = bad;
                assert!(attention_softmax(&mut x, 1.0).is_err(), "{bad} at {at}");
            }
        }
    }

    #[test]
    fn all_masked_is_an_error() {
        let mut x = [f32::NEG_INFINITY; 3];
        assert!(softmax_inplace(&mut x).is_err());
        assert!(softmax_inplace(&mut []).is_err());
    }

    #[test]
    fn log_softmax_matches_softmax() {
        let mut a = [0.5f32, -1.0, 2.0];
        let mut b = a;
        softmax_inplace(&mut a).expect("finite");
        log_softmax_inplace(&mut b).expect("finite");
        for (p, l) in a.iter().zip(&b) {
            // exp/ln round trip in f32.
            assert!((p.ln() - l).abs() < 1e-6);
        }
    }
}
