//! Seeded random data shared by the integration tests.

#![allow(dead_code)] // each test binary uses a different subset

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A deterministic stream for one test.
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` values uniform in `[-scale, scale)`.
pub fn uniform(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale)
        .collect()
}

/// `n` bf16 values uniform in `[-scale, scale)`.
pub fn uniform_bf16(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<bf16> {
    uniform(rng, n, scale)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

/// Largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "compared slices differ in length");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Largest absolute value.
pub fn max_abs(a: &[f32]) -> f32 {
    a.iter().map(|x| x.abs()).fold(0.0, f32::max)
}
