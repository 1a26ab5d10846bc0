//! RMSNorm with Hugging Face `DeepseekV3RMSNorm` semantics.
//!
//! `y = weight * (x * rsqrt(mean(x²) + eps))`, evaluated in that order in f32. The sum of
//! squares is accumulated in f64 and rounded once, which gives the correctly rounded f32 mean
//! that torch's cascaded f32 reduction approximates to within an ulp or two.

use rayon::prelude::*;

use super::gemm::check_len;
use crate::error::KernelError;

/// Rows below which the norm runs on the calling thread (rayon overhead dominates).
const PAR_MIN_ROWS: usize = 8;

/// Normalises each `weight.len()`-wide row of `x` into `out`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<(), KernelError> {
    let width = row_width("rms_norm", x.len(), weight.len())?;
    check_len("rms_norm", "out", x.len(), out.len())?;
    let rows = x.len() / width;
    let body = |(src, dst): (&[f32], &mut [f32])| {
        let r = inv_rms(src, eps);
        for ((d, s), w) in dst.iter_mut().zip(src).zip(weight) {
            *d = w * (s * r);
        }
    };
    if rows >= PAR_MIN_ROWS {
        x.par_chunks(width)
            .zip(out.par_chunks_mut(width))
            .for_each(body);
    } else {
        x.chunks(width).zip(out.chunks_mut(width)).for_each(body);
    }
    Ok(())
}

/// In-place [`rms_norm`].
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) -> Result<(), KernelError> {
    let width = row_width("rms_norm_inplace", x.len(), weight.len())?;
    let rows = x.len() / width;
    let body = |row: &mut [f32]| {
        let r = inv_rms(row, eps);
        for (v, w) in row.iter_mut().zip(weight) {
            *v = w * (*v * r);
        }
    };
    if rows >= PAR_MIN_ROWS {
        x.par_chunks_mut(width).for_each(body);
    } else {
        x.chunks_mut(width).for_each(body);
    }
    Ok(())
}

/// `1 / sqrt(mean(x²) + eps)` in f32 (torch's CPU `rsqrt` is `1 / sqrt`).
fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let sum_sq: f64 = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let mean = (sum_sq / row.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

fn row_width(op: &'static str, len: usize, width: usize) -> Result<usize, KernelError> {
    if width == 0 {
        return Err(KernelError::InvalidParam {
            op,
            field: "weight.len()",
            limit: "> 0",
            value: "0".into(),
        });
    }
    if len % width != 0 {
        return Err(KernelError::NotDivisible {
            op,
            what: "x",
            len,
            width,
        });
    }
    Ok(width)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_formula() {
        let x = [1.0f32, -2.0, 3.0, 0.5, 0.0, 4.0];
        let w = [0.5f32, 1.0, 2.0];
        let mut out = [0.0f32; 6];
        rms_norm(&x, &w, 1e-6, &mut out).expect("shapes match");
        for (row, o) in x.chunks(3).zip(out.chunks(3)) {
            let ms = row.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / 3.0;
            let r = 1.0 / (ms + 1e-6).sqrt();
            for i in 0..3 {
                let want = f64::from(w[i]) * f64::from(row[i]) * r;
                // One f32 rounding per operation: a few ulp.
                assert!((f64::from(o[i]) - want).abs() <= 1e-6 * want.abs().max(1.0));
            }
        }
        let mut inplace = x;
        rms_norm_inplace(&mut inplace, &w, 1e-6).expect("shapes match");
        assert_eq!(inplace, out);
    }

    #[test]
    fn rejects_ragged_rows() {
        let mut out = [0.0f32; 5];
        assert!(matches!(
            rms_norm(&[0.0; 5], &[1.0; 3], 1e-6, &mut out),
            Err(KernelError::NotDivisible { .. })
        ));
    }
}
