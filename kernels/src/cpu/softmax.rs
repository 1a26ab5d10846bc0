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
