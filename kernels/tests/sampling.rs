//! The sampler's filters against brute-force references, determinism, and its frequencies.

mod common;

use ferry_kernels::cpu::sample::{
    argmax, min_p_filter, probs_from_logits, sample_from_probs, top_k_renorm_prob,
    top_p_renorm_prob, Sampler, SamplingParams,
};
use ferry_kernels::KernelError;
use rand::Rng;

/// Brute-force top-k, written from the definition rather than the implementation's sort: an
/// entry survives iff fewer than `k` entries are strictly larger (so boundary ties survive).
fn reference_top_k(probs: &[f32], k: usize) -> Vec<f32> {
    let keep: Vec<bool> = probs
        .iter()
        .map(|&v| probs.iter().filter(|&&u| u > v).count() < k)
        .collect();
    renormalised(probs, &keep)
}

/// Brute-force top-p: an entry survives iff the mass strictly above it is below `p · total`
/// (f64 sums), i.e. it is needed to reach `p` or tied with the last entry that is.
fn reference_top_p(probs: &[f32], p: f32) -> Vec<f32> {
    let total: f64 = probs.iter().map(|&v| f64::from(v)).sum();
    let target = f64::from(p) * total;
    let keep: Vec<bool> = probs
        .iter()
        .map(|&v| {
            probs
                .iter()
                .filter(|&&u| u > v)
                .map(|&u| f64::from(u))
                .sum::<f64>()
                < target
        })
        .collect();
    renormalised(probs, &keep)
}

fn renormalised(probs: &[f32], keep: &[bool]) -> Vec<f32> {
    let kept: f64 = probs
        .iter()
        .zip(keep)
        .filter(|(_, &k)| k)
        .map(|(&v, _)| f64::from(v))
        .sum();
    probs
        .iter()
        .zip(keep)
        .map(|(&v, &k)| if k { (f64::from(v) / kept) as f32 } else { 0.0 })
        .collect()
}

/// Compares filtered vectors: identical support, values within 1e-6 (f32 vs f64 normaliser).
fn assert_same_dist(got: &[f32], want: &[f32], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            *g == 0.0,
            *w == 0.0,
            "{what}: support differs at {i} ({g} vs {w})"
        );
        assert!((g - w).abs() <= 1e-6, "{what}: {i}: {g} vs {w}");
    }
}

fn random_probs(rng: &mut rand_chacha::ChaCha8Rng, n: usize) -> Vec<f32> {
    let mut logits = common::uniform(rng, n, 4.0);
    ferry_kernels::cpu::softmax::softmax_inplace(&mut logits).expect("finite");
    logits
}

/// Normalised vector with a tie straddling every interesting boundary (exact binary values).
fn tied_probs() -> Vec<f32> {
    vec![0.25, 0.125, 0.125, 0.125, 0.0625, 0.0625, 0.125, 0.125]
}

#[test]
fn top_k_matches_brute_force() {
    let mut rng = common::rng(10);
    for n in [2, 7, 50, 1000] {
        let probs = random_probs(&mut rng, n);
        for k in [1, 2, 5, n / 2, n - 1] {
            let mut got = probs.clone();
            top_k_renorm_prob(&mut got, k as u32).expect("positive mass");
            assert_same_dist(
                &got,
                &reference_top_k(&probs, k.max(1)),
                &format!("n={n} k={k}"),
            );
        }
    }
}

#[test]
fn top_k_keeps_boundary_ties_and_no_ops() {
    let probs = tied_probs();
    for k in 1..probs.len() {
        let mut got = probs.clone();
        top_k_renorm_prob(&mut got, k as u32).expect("positive mass");
        assert_same_dist(&got, &reference_top_k(&probs, k), &format!("k={k}"));
    }
    // k = 2: the second largest value 0.125 is shared by five entries; all of them stay.
    let mut got = probs.clone();
    top_k_renorm_prob(&mut got, 2).expect("positive mass");
    assert_eq!(got.iter().filter(|&&v| v > 0.0).count(), 6);
    // k = 1 on a vector with a unique max keeps only it.
    let mut got = vec![0.1f32, 0.6, 0.3];
    top_k_renorm_prob(&mut got, 1).expect("positive mass");
    assert_eq!(got, vec![0.0, 1.0, 0.0]);
    // k = 0 and k >= vocab leave the input bit-for-bit unchanged.
    for k in [0u32, 8, 9, u32::MAX] {
        let mut got = probs.clone();
        top_k_renorm_prob(&mut got, k).expect("no-op");
        assert_eq!(got, probs, "k={k}");
    }
}

#[test]
fn top_p_matches_brute_force() {
    let mut rng = common::rng(11);
    for n in [2, 7, 50, 1000] {
        let probs = random_probs(&mut rng, n);
        for p in [0.01f32, 0.3, 0.5, 0.9, 0.99] {
            let mut got = probs.clone();
            top_p_renorm_prob(&mut got, p).expect("positive mass");
            assert_same_dist(&got, &reference_top_p(&probs, p), &format!("n={n} p={p}"));
        }
    }
}

#[test]
fn top_p_keeps_boundary_ties_and_no_ops() {
    let probs = tied_probs();
    // 0.25 alone is short of 0.3; reaching it takes one 0.125, and all five 0.125s are kept.
    let mut got = probs.clone();
    top_p_renorm_prob(&mut got, 0.3).expect("positive mass");
    assert_eq!(got.iter().filter(|&&v| v > 0.0).count(), 6);
    assert_same_dist(&got, &reference_top_p(&probs, 0.3), "p=0.3");
    // Exactly reaching the target stops there: 0.25 + 0.125 = 0.375.
    for p in [0.25f32, 0.375, 0.5, 0.875, 0.9] {
        let mut got = probs.clone();
        top_p_renorm_prob(&mut got, p).expect("positive mass");
        assert_same_dist(&got, &reference_top_p(&probs, p), &format!("p={p}"));
    }
    let mut got = probs.clone();
    top_p_renorm_prob(&mut got, 1.0).expect("no-op");
    assert_eq!(got, probs);
}

/// Weights that are multiples of 1/16, left unnormalised (the filters work on `p × total`):
/// many exact ties at every boundary — where pivot and rank semantics disagree — and sums that
/// are exact in f32 and f64 alike, so the f64 reference cannot disagree by rounding at an
/// exactly-reached top-p target.
fn quantised_probs(rng: &mut rand_chacha::ChaCha8Rng, n: usize) -> Vec<f32> {
    let mut p: Vec<f32> = (0..n)
        .map(|_| (rng.random_range(0..5u32) as f32) / 16.0)
        .collect();
    if p.iter().all(|&v| v == 0.0) {
        p[0] = 1.0 / 16.0;
    }
    p
}

#[test]
fn renorm_matches_brute_force_on_quantised_ties() {
    let mut rng = common::rng(14);
    for n in [3usize, 8, 33] {
        for _ in 0..20 {
            let probs = quantised_probs(&mut rng, n);
            // Every k, including k = 1 (with a tied maximum), k = vocab and k > vocab.
            for k in 1..=n + 2 {
                let mut got = probs.clone();
                top_k_renorm_prob(&mut got, k as u32).expect("positive mass");
                let want = if k >= n {
                    probs.clone()
                } else {
                    reference_top_k(&probs, k)
                };
                assert_same_dist(&got, &want, &format!("n={n} k={k} {probs:?}"));
            }
            for p in [0.1f32, 0.25, 0.5, 0.75, 0.9, 1.0] {
                let mut got = probs.clone();
                top_p_renorm_prob(&mut got, p).expect("positive mass");
                let want = if p >= 1.0 {
                    probs.clone()
                } else {
                    reference_top_p(&probs, p)
                };
                assert_same_dist(&got, &want, &format!("n={n} p={p} {probs:?}"));
            }
        }
    }
}

#[test]
fn top_k_one_keeps_a_tied_maximum_but_the_sampler_treats_it_as_greedy() {
    // The renorm function has pivot semantics even at k = 1 ...
    let mut got = vec![0.4f32, 0.2, 0.4];
    top_k_renorm_prob(&mut got, 1).expect("positive mass");
    assert_eq!(got, vec![0.5, 0.0, 0.5]);
    // ... while `top_k == 1` requests are greedy: a point mass at the lowest tied argmax. The
    // sampler and the speculative verifier both build p with `probs_from_logits`, so they agree.
    let params = SamplingParams {
        top_k: 1,
        ..SamplingParams::default()
    };
    let logits = [1.0f32, 0.0, 1.0];
    assert_eq!(
        probs_from_logits(&logits, &params).expect("valid"),
        vec![1.0, 0.0, 0.0]
    );
}

#[test]
fn zero_mass_is_an_error_and_leaves_the_input_untouched() {
    let zeros = vec![0.0f32; 5];
    let mut got = zeros.clone();
    assert!(matches!(
        top_k_renorm_prob(&mut got, 2),
        Err(KernelError::DegenerateDistribution { .. })
    ));
    assert_eq!(got, zeros);
    assert!(matches!(
        top_p_renorm_prob(&mut got, 0.5),
        Err(KernelError::DegenerateDistribution { .. })
    ));
    assert_eq!(got, zeros);
    // No-ops never inspect the mass.
    top_k_renorm_prob(&mut got, 5).expect("k >= vocab is a no-op");
    top_p_renorm_prob(&mut got, 1.0).expect("top_p = 1 is a no-op");
    // A NaN-poisoned vector is refused the same way.
}

#[test]
fn top_p_one_is_a_no_op_even_unnormalised() {
    let mut rng = common::rng(15);
    let probs: Vec<f32> = random_probs(&mut rng, 40).iter().map(|v| v * 3.0).collect();
    let mut got = probs.clone();
    top_p_renorm_prob(&mut got, 1.0).expect("no-op");
    assert_eq!(got, probs);
    // Below 1 on an unnormalised vector, the target is p × total (same as normalised).
    let mut got = probs.clone();
    top_p_renorm_prob(&mut got, 0.5).expect("positive mass");
    assert_same_dist(&got, &reference_top_p(&probs, 0.5), "unnormalised p=0.5");
}

#[test]
fn min_p_drops_small_entries() {
    let mut got = vec![0.5f32, 0.3, 0.1, 0.1];
    min_p_filter(&mut got, 0.5).expect("positive mass");
    assert_same_dist(&got, &[0.625, 0.375, 0.0, 0.0], "min_p=0.5");
    let mut got = vec![0.5f32, 0.3, 0.2];
    min_p_filter(&mut got, 0.0).expect("no-op");
    assert_eq!(got, vec![0.5, 0.3, 0.2]);
}

#[test]
fn probs_from_logits_applies_filters_in_order() {
    let logits = [2.0f32, 1.0, 0.5, 0.0, -1.0];
    let params = SamplingParams {
        temperature: 0.7,
        top_k: 4,
        top_p: 0.8,
        min_p: 0.2,
        seed: None,
    };
    let mut want: Vec<f32> = logits.iter().map(|v| v / 0.7).collect();
    ferry_kernels::cpu::softmax::softmax_inplace(&mut want).expect("finite");
    want = reference_top_k(&want, 4);
    want = reference_top_p(&want, 0.8);
    let max = want.iter().copied().fold(0.0f32, f32::max);
    let keep: Vec<bool> = want.iter().map(|&v| v >= 0.2 * max).collect();
    want = renormalised(&want, &keep);
    assert_same_dist(
        &probs_from_logits(&logits, &params).expect("valid"),
        &want,
        "pipeline",
    );

    let greedy = SamplingParams {
        temperature: 0.0,
        ..params
    };
    assert_eq!(
        probs_from_logits(&logits, &greedy).expect("valid"),
        vec![1.0, 0.0, 0.0, 0.0, 0.0]
    );
}

#[test]
fn greedy_is_argmax_with_lowest_index_ties() {
    let logits = [0.5f32, 3.0, -1.0, 3.0];
    assert_eq!(argmax(&logits), 1);
    let mut sampler = Sampler::new(Some(1));
    for params in [
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        SamplingParams {
            top_k: 1,
            ..SamplingParams::default()
        },
    ] {
        assert!(params.is_greedy());
        assert_eq!(sampler.sample(&logits, &params).expect("valid"), 1);
    }
}

#[test]
fn seeded_sampling_is_deterministic() {
    let mut rng = common::rng(12);
    let logits = common::uniform(&mut rng, 100, 2.0);
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 50,
        top_p: 0.95,
        min_p: 0.0,
        seed: Some(42),
    };
    let draw = |seed| {
        let mut s = Sampler::new(Some(seed));
        (0..200)
            .map(|_| s.sample(&logits, &params).expect("valid"))
            .collect::<Vec<u32>>()
    };
    assert_eq!(draw(42), draw(42));
    assert_ne!(draw(42), draw(43));
    assert_eq!(
        Sampler::for_params(&params).next_uniform(),
        Sampler::new(Some(42)).next_uniform()
    );
}

#[test]
fn sample_frequencies_match_probs() {
    let logits = [1.0f32, 0.2, -0.5, 2.0, 0.0, -3.0, 1.5, 0.7];
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 6,
        top_p: 0.95,
        min_p: 0.02,
        seed: Some(7),
    };
    let probs = probs_from_logits(&logits, &params).expect("valid");
    let mut sampler = Sampler::for_params(&params);
    let draws = 20_000usize;
    let mut counts = [0usize; 8];
    for _ in 0..draws {
        counts[sampler.sample(&logits, &params).expect("valid") as usize] += 1;
    }
    let mut chi2 = 0.0f64;
    let mut dof = 0usize;
    for (c, p) in counts.iter().zip(&probs) {
        if *p == 0.0 {
            assert_eq!(*c, 0, "a filtered-out token was sampled");
            continue;
        }
        let expected = draws as f64 * f64::from(*p);
        chi2 += (*c as f64 - expected).powi(2) / expected;
        dof += 1;
    }
    // At most 7 degrees of freedom. A correct sampler exceeds chi² = 35 with probability
    // below 1e-5, and the stream is seeded, so this cannot flake; a biased inversion (off by
    // one entry, or ignoring the filters) gives chi² in the thousands.
    assert!(dof >= 3, "the filters should leave several tokens");
    assert!(
        chi2 < 35.0,
        "chi2 {chi2} over {dof} categories; counts {counts:?}, probs {probs:?}"
    );
}

#[test]
fn inverse_cdf_edges() {
    let probs = [0.0f32, 0.25, 0.0, 0.75];
    assert_eq!(sample_from_probs(&probs, 0.0).expect("valid"), 1);
    assert_eq!(sample_from_probs(&probs, 0.2499).expect("valid"), 1);
    assert_eq!(sample_from_probs(&probs, 0.25).expect("valid"), 3);
    assert_eq!(sample_from_probs(&probs, 0.999_999_999).expect("valid"), 3);
    assert!(sample_from_probs(&[0.0, 0.0], 0.5).is_err());
    let mut rng = common::rng(13);
    for _ in 0..1000 {
        let i = sample_from_probs(&probs, rng.random::<f64>()).expect("valid");
        assert!(i == 1 || i == 3);
    }
}

#[test]
fn invalid_params_name_the_field() {
    let cases = [
        (
            SamplingParams {
                temperature: -0.5,
                ..SamplingParams::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                temperature: f32::NAN,
                ..SamplingParams::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                temperature: f32::INFINITY,
                ..SamplingParams::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                top_p: 0.0,
                ..SamplingParams::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                top_p: 1.5,
                ..SamplingParams::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                min_p: -0.1,
                ..SamplingParams::default()
            },
            "min_p",
        ),
        (
            SamplingParams {
                min_p: 2.0,
                ..SamplingParams::default()
            },
            "min_p",
        ),
    ];
    for (params, name) in cases {
        let err = KernelError::from(params.validate().expect_err("invalid"));
        assert!(
            matches!(err, KernelError::InvalidSamplingParam { field, .. } if field == name),
            "{err}"
        );
        assert!(err.to_string().contains(&format!("`{name}`")), "{err}");
        assert!(Sampler::new(Some(0)).sample(&[0.0, 1.0], &params).is_err());
    }
    assert!(SamplingParams::default().validate().is_ok());
    assert!(probs_from_logits(&[], &SamplingParams::default()).is_err());
}
