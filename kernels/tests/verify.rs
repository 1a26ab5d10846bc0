//! Speculative verification is lossless: over many verify rounds on synthetic target and draft
//! distributions, the token emitted at every output position follows the target distribution
//! (a float64 reference built independently of the sampler), for sampled and for greedy drafts,
//! in mixed batches of requests with different parameters. Negative controls run the very same
//! test on proposals that do not come from the declared `q` and must fail it, so the test keeps
//! its power.
//!
//! Statistics: Pearson chi-square per output position (cells with an expected count below 5 are
//! pooled) and on the accepted-length histogram. The streams are seeded, so nothing can flake;
//! the threshold [`CHI2_LIMIT`] = 45 at ≤ 8 degrees of freedom is exceeded by a correct
//! verifier with probability below 1e-6, while the controls' biases give hundreds to thousands.

mod common;
mod lossless;

use ferry_kernels::cpu::sample::{probs_from_logits, sample_from_probs, SamplingParams};
use ferry_kernels::cpu::verify::{verify, verify_batch, verify_probs, DraftProbs, VerifyRequest};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use lossless::{
    alpha, chi2, passes, reference_probs, sampled_params, statistics, Tally, CHI2_LIMIT, GAMMA,
    ROUNDS, VOCAB,
};

/// Random logits with a spread that makes p and q clearly different.
fn logits(rng: &mut ChaCha8Rng) -> Vec<f32> {
    common::uniform(rng, VOCAB, 2.5)
}

/// How the test's drafter proposes.
#[derive(Clone, Copy)]
enum Proposer<'a> {
    /// Draws `x_k` from these rows `[γ][vocab]`.
    Sample(&'a [f32]),
    /// Always proposes these tokens.
    Fixed(&'a [u32]),
}

/// Runs `ROUNDS` verify rounds of one request: the drafter proposes per `proposer`, the verifier
/// is told the drafts came from `declared`.
fn run(
    target_logits: &[f32],
    params: &SamplingParams,
    proposer: Proposer<'_>,
    declared: DraftProbs<'_>,
    seed: u64,
) -> Tally {
    let mut rng = common::rng(seed);
    let mut tally = Tally::new();
    let mut drafts = [0u32; GAMMA];
    let mut uniforms = [0.0f64; GAMMA + 1];
    for _ in 0..ROUNDS {
        for (k, d) in drafts.iter_mut().enumerate() {
            *d = match proposer {
                Proposer::Sample(rows) => {
                    sample_from_probs(&rows[k * VOCAB..(k + 1) * VOCAB], rng.random::<f64>())
                        .expect("valid q")
                }
                Proposer::Fixed(t) => t[k],
            };
        }
        uniforms.iter_mut().for_each(|u| *u = rng.random::<f64>());
        let out = verify(&VerifyRequest {
            target_logits,
            drafts: &drafts,
            q: declared,
            params,
            uniforms: &uniforms,
        })
        .expect("valid request");
        assert_eq!(out.tokens.len(), out.accepted + 1);
        tally.accepted[out.accepted] += 1;
        for (j, &t) in out.tokens.iter().enumerate() {
            tally.at[j][t as usize] += 1;
        }
    }
    tally
}

/// A synthetic request: target logits `[(γ+1)][V]`, the drafter's logits `[γ][V]`.
struct Case {
    target: Vec<f32>,
    draft_logits: Vec<f32>,
}

fn case(seed: u64) -> Case {
    let mut rng = common::rng(seed);
    let target: Vec<f32> = (0..=GAMMA).flat_map(|_| logits(&mut rng)).collect();
    // A drafter that is decent but not exact: the target's logits plus noise, so every
    // position is reached often and p and q still differ (TV ~ 0.2-0.4).
    let noise = common::uniform(&mut rng, GAMMA * VOCAB, 1.2);
    let draft_logits = target[..GAMMA * VOCAB]
        .iter()
        .zip(noise)
        .map(|(t, n)| t + n)
        .collect();
    Case {
        target,
        draft_logits,
    }
}

fn rows<T: Clone>(flat: &[T]) -> Vec<Vec<T>> {
    flat.chunks(VOCAB).map(<[T]>::to_vec).collect()
}

/// The reference p rows for a case under `params`.
fn p_ref(c: &Case, params: &SamplingParams) -> Vec<Vec<f64>> {
    rows(&c.target)
        .iter()
        .map(|l| reference_probs(l, params))
        .collect()
}

/// The drafter's q rows (softmax at temperature 1, computed by the sampler's code).
fn q_rows(c: &Case) -> Vec<f32> {
    rows(&c.draft_logits)
        .iter()
        .flat_map(|l| probs_from_logits(l, &SamplingParams::default()).expect("valid"))
        .collect()
}

#[test]
fn sampled_drafts_are_lossless_at_every_position() {
    for (i, params) in sampled_params().iter().enumerate() {
        let c = case(100 + i as u64);
        let q = q_rows(&c);
        let p = p_ref(&c, params);
        let q64: Vec<f64> = q.iter().map(|&v| f64::from(v)).collect();
        let tally = run(
            &c.target,
            params,
            Proposer::Sample(&q),
            DraftProbs::Sampled(&q),
            7 + i as u64,
        );
        let stats = statistics(&tally, &p, &alpha(&p, &q64));
        assert!(
            passes(&stats),
            "params {params:?}: chi2 per position {stats:?}"
        );
        // The test sees every position: γ + 1 outputs were reached in a fair share of rounds.
        assert!(tally.accepted[GAMMA] > 100, "{:?}", tally.accepted);
    }
}

#[test]
fn negative_control_proposals_not_from_q_fail_the_same_test() {
    for (i, params) in sampled_params().iter().enumerate() {
        let c = case(100 + i as u64);
        let q = q_rows(&c);
        let p = p_ref(&c, params);
        let q64: Vec<f64> = q.iter().map(|&v| f64::from(v)).collect();
        // The drafter really draws from another distribution (the target's logits negated and
        // shifted by one token) but declares q: a verifier fed the wrong rows.
        let other: Vec<f32> = rows(&c.target)[..GAMMA]
            .iter()
            .flat_map(|l| {
                let mut flipped: Vec<f32> = l.iter().map(|v| -v).collect();
                flipped.rotate_left(1);
                probs_from_logits(&flipped, &SamplingParams::default()).expect("valid")
            })
            .collect();
        let tally = run(
            &c.target,
            params,
            Proposer::Sample(&other),
            DraftProbs::Sampled(&q),
            7 + i as u64,
        );
        let stats = statistics(&tally, &p, &alpha(&p, &q64));
        assert!(
            !passes(&stats),
            "params {params:?}: the control passed (chi2 {stats:?}); the test has no power"
        );
    }
}

/// The drafter's argmax tokens per position.
fn argmax_drafts(c: &Case) -> Vec<u32> {
    rows(&c.draft_logits)
        .iter()
        .map(|l| ferry_kernels::cpu::sample::argmax(l))
        .collect()
}

#[test]
fn greedy_drafts_with_point_mass_q_are_lossless() {
    for (i, params) in sampled_params().iter().enumerate() {
        let c = case(200 + i as u64);
        let drafts = argmax_drafts(&c);
        let p = p_ref(&c, params);
        let q_delta: Vec<f64> = drafts
            .iter()
            .flat_map(|&d| (0..VOCAB).map(move |v| if v == d as usize { 1.0 } else { 0.0 }))
            .collect();
        let tally = run(
            &c.target,
            params,
            Proposer::Fixed(&drafts),
            DraftProbs::Greedy,
            11 + i as u64,
        );
        let stats = statistics(&tally, &p, &alpha(&p, &q_delta));
        assert!(passes(&stats), "params {params:?}: chi2 {stats:?}");
    }
}

#[test]
fn negative_control_argmax_drafts_declared_with_the_soft_q_fail() {
    // Proposing argmax while declaring the soft distribution over-accepts the argmax token.
    for (i, params) in sampled_params().iter().enumerate() {
        let c = case(200 + i as u64);
        let drafts = argmax_drafts(&c);
        let q = q_rows(&c);
        let p = p_ref(&c, params);
        let q_delta: Vec<f64> = drafts
            .iter()
            .flat_map(|&d| (0..VOCAB).map(move |v| if v == d as usize { 1.0 } else { 0.0 }))
            .collect();
        let tally = run(
            &c.target,
            params,
            Proposer::Fixed(&drafts),
            DraftProbs::Sampled(&q),
            11 + i as u64,
        );
        let stats = statistics(&tally, &p, &alpha(&p, &q_delta));
        assert!(
            !passes(&stats),
            "params {params:?}: the control passed (chi2 {stats:?})"
        );
    }
}

#[test]
fn greedy_requests_emit_exactly_the_target_argmax() {
    let params = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let c = case(300);
    let want: Vec<u32> = rows(&c.target)
        .iter()
        .map(|l| ferry_kernels::cpu::sample::argmax(l))
        .collect();
    let q = q_rows(&c);
    // Drafts equal to the target argmax are all accepted, plus the bonus argmax; any other
    // draft is replaced by the argmax, whatever q and the uniforms say.
    let mut rng = common::rng(301);
    for _ in 0..2000 {
        let drafts: Vec<u32> = (0..GAMMA)
            .map(|k| {
                if rng.random::<f64>() < 0.7 {
                    want[k]
                } else {
                    rng.random_range(0..VOCAB as u32)
                }
            })
            .collect();
        let uniforms: Vec<f64> = (0..=GAMMA).map(|_| rng.random::<f64>()).collect();
        for declared in [DraftProbs::Greedy, DraftProbs::Sampled(&q)] {
            let out = verify(&VerifyRequest {
                target_logits: &c.target,
                drafts: &drafts,
                q: declared,
                params: &params,
                uniforms: &uniforms,
            })
            .expect("valid");
            let n = drafts.iter().zip(&want).take_while(|(d, w)| d == w).count();
            assert_eq!(out.accepted, n);
            assert_eq!(out.tokens, want[..=n].to_vec());
        }
    }
}

#[test]
fn mixed_batch_gives_each_request_its_own_distribution_and_a_bad_one_fails_alone() {
    // Greedy, top-k and top-p requests verified together, round after round, next to a broken
    // request whose q gives zero probability to the token it proposes.
    let params = [
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.7,
            top_k: 3,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 1.2,
            top_p: 0.6,
            ..SamplingParams::default()
        },
    ];
    let cases: Vec<Case> = (0..params.len()).map(|i| case(400 + i as u64)).collect();
    let qs: Vec<Vec<f32>> = cases.iter().map(q_rows).collect();
    let broken_case = case(499);
    let mut broken_q = q_rows(&broken_case);
    broken_q[..VOCAB].iter_mut().for_each(|v| *v = 0.0);
    broken_q[1] = 1.0;
    let broken_drafts = [0u32; GAMMA];
    let broken_params = SamplingParams::default();

    let mut rng = common::rng(401);
    let mut tallies: Vec<Tally> = (0..params.len()).map(|_| Tally::new()).collect();
    for _ in 0..ROUNDS {
        let drafts: Vec<Vec<u32>> = qs
            .iter()
            .map(|q| {
                (0..GAMMA)
                    .map(|k| {
                        sample_from_probs(&q[k * VOCAB..(k + 1) * VOCAB], rng.random::<f64>())
                            .expect("valid")
                    })
                    .collect()
            })
            .collect();
        let uniforms: Vec<Vec<f64>> = (0..=params.len())
            .map(|_| (0..=GAMMA).map(|_| rng.random::<f64>()).collect())
            .collect();
        let mut reqs: Vec<VerifyRequest<'_>> = (0..params.len())
            .map(|i| VerifyRequest {
                target_logits: &cases[i].target,
                drafts: &drafts[i],
                q: DraftProbs::Sampled(&qs[i]),
                params: &params[i],
                uniforms: &uniforms[i],
            })
            .collect();
        // The broken request sits in the middle of the batch.
        reqs.insert(
            1,
            VerifyRequest {
                target_logits: &broken_case.target,
                drafts: &broken_drafts,
                q: DraftProbs::Sampled(&broken_q),
                params: &broken_params,
                uniforms: &uniforms[params.len()],
            },
        );
        let mut out = verify_batch(&reqs);
        let broken = out.remove(1);
        assert!(
            broken
                .as_ref()
                .is_err_and(|e| e.to_string().contains("q[k][draft]")),
            "{broken:?}"
        );
        for (t, v) in tallies.iter_mut().zip(out) {
            let v = v.expect("healthy requests are unaffected");
            t.accepted[v.accepted] += 1;
            for (j, &tok) in v.tokens.iter().enumerate() {
                t.at[j][tok as usize] += 1;
            }
        }
    }
    for (i, t) in tallies.iter().enumerate() {
        let p = p_ref(&cases[i], &params[i]);
        let q64: Vec<f64> = qs[i].iter().map(|&v| f64::from(v)).collect();
        let stats = statistics(t, &p, &alpha(&p, &q64));
        assert!(
            passes(&stats),
            "request {i} ({:?}): chi2 {stats:?}",
            params[i]
        );
    }
    // Each request got its *own* distribution: request 1's law fails against request 2's
    // parameters on the same logits.
    let wrong = p_ref(&cases[1], &params[2]);
    assert!(chi2(&tallies[1].at[0], &wrong[0]).0 > CHI2_LIMIT);
}

#[test]
fn verify_probs_checks_shapes() {
    let p = vec![0.25f32; 2 * 4];
    let q = vec![0.25f32; 4];
    assert!(verify_probs(&p, DraftProbs::Sampled(&q), &[1], &[0.5, 0.5]).is_ok());
    assert!(verify_probs(&p, DraftProbs::Sampled(&q), &[1], &[0.5]).is_err());
    assert!(verify_probs(&p, DraftProbs::Sampled(&q[..3]), &[1], &[0.5, 0.5]).is_err());
    assert!(verify_probs(&p, DraftProbs::Greedy, &[9], &[0.5, 0.5]).is_err());
    assert!(verify_probs(&p[..7], DraftProbs::Greedy, &[1], &[0.5, 0.5]).is_err());
}
