//! Sampling and speculative verification as backend ops (`backend::sample`, `backend::verify`),
//! on every backend this machine has (the CPU always; a CUDA device when one opens; with
//! `--features rocm`, a ROCm device when one opens — the same kernels and tolerances, never run
//! on an AMD GPU yet), against the CPU sampler called directly row by row / sequence by
//! sequence.
//!
//! - `probs`: bit-identical on the CPU (its arm calls the same function). On a GPU max |Δ| ≤
//!   1e-6 with the kept set identical: the kernel's `expf` is within 2 ulp of the CPU's `exp`
//!   and it sums in per-thread partials and a tree instead of one sequential f32 sum. The rows
//!   are built so that this stays far below 1e-6 and away from every pivot: logits are
//!   multiples of 1/256 (distinct values differ by far more than rounding), unfiltered rows are
//!   flat (every probability is small, so the CPU's √n-growing summation error is tiny in
//!   absolute terms), filtered rows are renormalised over a short head, and top-p targets sit
//!   in the middle of a tie group's cumulative mass (see [`top_p_between`]).
//! - `draw`: identical ids for uniforms away from CDF boundaries (the GPU cumulates in f64 in
//!   another order; the uniforms here keep u·total 1e-9 of the total away from any boundary);
//!   a degenerate row gives -1 without touching the others.
//! - `probs` and `draw` at DeepSeek's vocabulary run as a batch and row by row: a GPU splits a
//!   few long rows over several blocks each (softmax and draw in parts), so both paths are
//!   held to the same bounds; degenerate rows too.
//! - `argmax`: identical, ties to the lowest index, NaN never chosen; a batch and each row
//!   alone (a GPU splits a few long rows over several blocks, then merges).
//! - `apply_controls` (penalties, `logit_bias`, the `min_tokens` mask): bit-identical to
//!   `cpu::logits::apply_controls` row by row on every backend (the GPU arm runs that very
//!   function on the host and writes the rows back), untouched rows unchanged, and the greedy
//!   token it leads to is the biased one.
//! - `verify`: identical results to `cpu::verify::verify_probs` for greedy and sampled
//!   sequences in one batch (accept tests are the same f64 arithmetic; a draw could differ only
//!   within f64 rounding of a CDF boundary, which random uniforms do not hit); a bad sequence
//!   fails alone. At DeepSeek's vocabulary too, as a batch and sequence by sequence (a GPU
//!   splits a few sequences' draws over several blocks each).
//! - Losslessness of the backend verifier: chi-square of the emitted tokens per position and of
//!   the accepted lengths against a float64 reference of the target distribution, over 40,000
//!   sequences of one `verify_logits` call per parameter set, with negative controls that must
//!   fail the same test (method and limits of `tests/verify.rs`, whose helpers are copied here).

mod common;
mod lossless;

use ferry_kernels::backend::sample::{
    apply_controls, argmax, draw, draw_at, probs, sample, Draw, Probs, RowParams, Sample, Uniforms,
};
use ferry_kernels::backend::verify::{verify, verify_logits, VerifyBatch, VerifyLogits, VerifyOut};
use ferry_kernels::backend::{Backend, Ints};
use ferry_kernels::cpu::logits::{LogitsControls, RowControls, TokenHistory};
use ferry_kernels::cpu::sample::{
    self as cpu, probs_from_logits, sample_from_probs, SamplingParams,
};
use ferry_kernels::cpu::verify::{verify_probs, DraftProbs};
use ferry_kernels::KernelError;
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use lossless::{
    alpha, chi2, passes, reference_probs, sampled_params, statistics, Tally, CHI2_LIMIT, GAMMA,
    ROUNDS, VOCAB,
};

/// DeepSeek-V3's vocabulary.
const DEEPSEEK_VOCAB: usize = 129_280;

/// Every backend this machine can run.
fn backends() -> Vec<Backend> {
    #[cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(unused_mut))]
    let mut all = vec![Backend::Cpu];
    #[cfg(feature = "cuda")]
    match ferry_kernels::cuda::CudaDevice::open(0) {
        Ok(d) => all.push(Backend::Cuda(d)),
        Err(e) => eprintln!("no CUDA backend: {e}"),
    }
    #[cfg(feature = "rocm")]
    match ferry_kernels::rocm::RocmDevice::open(0) {
        Ok(d) => all.push(Backend::Rocm(d)),
        Err(e) => eprintln!("no ROCm backend: {e}"),
    }
    all
}

fn is_cpu(b: &Backend) -> bool {
    matches!(b, Backend::Cpu)
}

fn host_ints(i: &Ints) -> Vec<i32> {
    i.to_host().expect("download ids")
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    }
}

/// `vocab` logits, multiples of 1/256 uniform in `[-4, 4)`.
fn flat(rng: &mut ChaCha8Rng, vocab: usize) -> Vec<f32> {
    (0..vocab)
        .map(|_| rng.random_range(-1024..1024) as f32 / 256.0)
        .collect()
}

/// A tail of multiples of 1/256 in `[-4, 0)` with `head` placed at random distinct positions.
fn headed(rng: &mut ChaCha8Rng, vocab: usize, head: &[f32]) -> Vec<f32> {
    let mut x: Vec<f32> = (0..vocab)
        .map(|_| rng.random_range(-1024..0) as f32 / 256.0)
        .collect();
    let mut at: Vec<usize> = (0..vocab).collect();
    at.shuffle(rng);
    for (&i, &v) in at.iter().zip(head) {
        x[i] = v;
    }
    x
}

/// A top-p value whose target lands in the middle of a tie group's cumulative mass near
/// `want`: the top-p step's input is the CPU's distribution with the earlier steps only, its
/// distinct values sorted descending with cumulative masses `c_0 < c_1 < …` (f64); the group
/// whose range first reaches `want` is the pivot with half its mass as margin on either side.
fn top_p_between(logits: &[f32], params: &SamplingParams, want: f64) -> f32 {
    let before = SamplingParams {
        top_p: 1.0,
        min_p: 0.0,
        ..params.clone()
    };
    let mut p = probs_from_logits(logits, &before).expect("valid row");
    p.sort_unstable_by(|a, b| b.total_cmp(a));
    let total: f64 = p.iter().map(|&v| f64::from(v)).sum();
    let (mut start, mut cum) = (0.0f64, 0.0f64);
    let mut i = 0;
    while i < p.len() {
        let v = p[i];
        while i < p.len() && p[i] == v {
            cum += f64::from(p[i]);
            i += 1;
        }
        if cum / total >= want {
            return ((start + cum) / 2.0 / total) as f32;
        }
        start = cum;
    }
    panic!("no group reaches {want}")
}

/// The mixed batch of `probs_match_the_cpu_sampler_row_by_row` for one vocabulary size.
fn mixed_batch(vocab: usize, seed: u64) -> Vec<(Vec<f32>, SamplingParams)> {
    let mut rng = common::rng(seed);
    // 12, 11.5, … : a head holding most of the mass, distinct values half a logit apart.
    let head: Vec<f32> = (0..10.min(vocab - 1))
        .map(|i| 12.0 - 0.5 * i as f32)
        .collect();
    // Ties at the top-k boundary: the 5th largest value is shared by three entries.
    let tied = [12.0, 11.5, 11.0, 10.5, 10.0, 10.0, 10.0];
    let mut greedy_row = flat(&mut rng, vocab);
    let (a, b) = (vocab / 3, vocab - 1);
    greedy_row[a] = 5.0;
    greedy_row[b] = 5.0;

    let mut rows = vec![
        (greedy_row, greedy()),
        (
            headed(&mut rng, vocab, &head),
            SamplingParams {
                top_k: 1,
                ..SamplingParams::default()
            },
        ),
        (
            flat(&mut rng, vocab),
            SamplingParams {
                temperature: 0.7,
                ..SamplingParams::default()
            },
        ),
        (
            headed(&mut rng, vocab, &tied),
            SamplingParams {
                top_k: 5,
                ..SamplingParams::default()
            },
        ),
        (
            headed(&mut rng, vocab, &head),
            SamplingParams {
                temperature: 1.2,
                min_p: 0.05,
                ..SamplingParams::default()
            },
        ),
    ];
    let top_p_row = headed(&mut rng, vocab, &head);
    let top_p = SamplingParams::default();
    let p = top_p_between(&top_p_row, &top_p, 0.8);
    rows.push((top_p_row, SamplingParams { top_p: p, ..top_p }));
    // Deep pivots on a flat row: many kept entries, tie groups of equal logits at the boundary.
    let flat_k = SamplingParams {
        top_k: (vocab as u32 / 4).max(2),
        ..SamplingParams::default()
    };
    rows.push((flat(&mut rng, vocab), flat_k));
    let flat_p_row = flat(&mut rng, vocab);
    let flat_p = SamplingParams {
        temperature: 1.5,
        ..SamplingParams::default()
    };
    let p = top_p_between(&flat_p_row, &flat_p, 0.5);
    rows.push((flat_p_row, SamplingParams { top_p: p, ..flat_p }));
    let flat_min_p = SamplingParams {
        min_p: 0.3,
        ..SamplingParams::default()
    };
    rows.push((flat(&mut rng, vocab), flat_min_p));
    let all_row = headed(&mut rng, vocab, &tied);
    let all = SamplingParams {
        temperature: 0.8,
        top_k: 6,
        min_p: 0.02,
        ..SamplingParams::default()
    };
    let p = top_p_between(&all_row, &all, 0.7);
    rows.push((all_row, SamplingParams { top_p: p, ..all }));
    rows
}

/// `probs` of `logits` (rows of `vocab`) under `params` on `b`, downloaded.
fn probs_on(b: &Backend, logits: &[f32], params: &[SamplingParams], vocab: usize) -> Vec<f32> {
    let rp = RowParams::new(b, params).expect("valid params");
    let x = b.upload(logits).expect("upload");
    probs(
        b,
        Probs {
            logits: &x,
            vocab,
            params: &rp,
        },
    )
    .expect("probs")
    .to_host()
    .expect("download")
}

#[test]
fn probs_match_the_cpu_sampler_row_by_row() {
    for b in backends() {
        for (i, vocab) in [8, 1000, DEEPSEEK_VOCAB].into_iter().enumerate() {
            let batch = mixed_batch(vocab, 10 + i as u64);
            let logits: Vec<f32> = batch.iter().flat_map(|(x, _)| x.clone()).collect();
            let params: Vec<SamplingParams> = batch.iter().map(|(_, p)| p.clone()).collect();
            let got = probs_on(&b, &logits, &params, vocab);
            let mut worst = 0.0f32;
            for (r, ((row, prm), got)) in batch.iter().zip(got.chunks_exact(vocab)).enumerate() {
                let want = probs_from_logits(row, prm).expect("valid row");
                let kept = |v: &[f32]| v.iter().filter(|&&p| p > 0.0).count();
                if is_cpu(&b) {
                    let bits = |v: &[f32]| v.iter().map(|p| p.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(got), bits(&want), "row {r} ({prm:?}), vocab {vocab}");
                    continue;
                }
                let same_set = got.iter().zip(&want).all(|(g, w)| (*g > 0.0) == (*w > 0.0));
                assert!(
                    same_set,
                    "row {r} ({prm:?}), vocab {vocab}: kept {} on the {}, {} on the CPU",
                    kept(got),
                    b.name(),
                    kept(&want)
                );
                let d = common::max_abs_diff(got, &want);
                assert!(
                    d <= 1e-6,
                    "row {r} ({prm:?}), vocab {vocab}: max |Δ| {d:.2e}"
                );
                worst = worst.max(d);
            }
            eprintln!(
                "probs, vocab {vocab}, on the {}: max |Δ| {worst:.2e}",
                b.name()
            );
            if vocab != DEEPSEEK_VOCAB || is_cpu(&b) {
                continue;
            }
            // Each row alone: a GPU splits one long row over the most blocks.
            for (r, (row, prm)) in batch.iter().enumerate() {
                let got = probs_on(&b, row, std::slice::from_ref(prm), vocab);
                let want = probs_from_logits(row, prm).expect("valid row");
                let same_set = got.iter().zip(&want).all(|(g, w)| (*g > 0.0) == (*w > 0.0));
                let d = common::max_abs_diff(&got, &want);
                assert!(
                    same_set && d <= 1e-6,
                    "row {r} alone ({prm:?}): max |Δ| {d:.2e}"
                );
            }
        }
    }
}

#[test]
fn a_degenerate_row_is_marked_and_does_not_touch_the_others() {
    // 1,000 entries: one block a row on a GPU; DeepSeek's vocabulary: five rows split.
    for vocab in [1000, DEEPSEEK_VOCAB] {
        degenerate_rows(vocab);
    }
}

fn degenerate_rows(vocab: usize) {
    let mut rng = common::rng(20);
    let good = flat(&mut rng, vocab);
    let mut nan = flat(&mut rng, vocab);
    nan[17] = f32::NAN;
    let masked = vec![f32::NEG_INFINITY; vocab];
    let logits: Vec<f32> = [&good[..], &nan, &good, &masked, &good].concat();
    let params = vec![SamplingParams::default(); 5];
    let want = probs_from_logits(&good, &params[0]).expect("valid");
    for b in backends() {
        let rp = RowParams::new(&b, &params).expect("valid");
        let x = b.upload(&logits).expect("upload");
        let p = probs(
            &b,
            Probs {
                logits: &x,
                vocab,
                params: &rp,
            },
        )
        .expect("probs");
        let host = p.to_host().expect("download");
        for r in [1, 3] {
            let row = &host[r * vocab..(r + 1) * vocab];
            assert!(
                row.iter().all(|v| v.is_nan()),
                "row {r} on the {}",
                b.name()
            );
        }
        for r in [0, 2, 4] {
            let d = common::max_abs_diff(&host[r * vocab..(r + 1) * vocab], &want);
            assert!(d <= 1e-6, "row {r} on the {}: {d:.2e}", b.name());
        }
        let u = Uniforms::new(&b, &[0.3; 5]).expect("uniforms");
        let ids = host_ints(
            &draw(
                &b,
                Draw {
                    probs: &p,
                    vocab,
                    uniforms: &u,
                },
            )
            .expect("draw"),
        );
        let healthy = sample_from_probs(&want, 0.3).expect("valid") as i32;
        assert_eq!(ids, vec![healthy, -1, healthy, -1, healthy], "{}", b.name());
        // End to end: one error per degenerate row, the others sampled.
        let out = sample(
            &b,
            Sample {
                logits: &x,
                vocab,
                params: &rp,
                uniforms: &u,
            },
        )
        .expect("sample");
        assert_eq!(out[0], Ok(healthy as u32));
        assert!(matches!(
            out[1],
            Err(KernelError::DegenerateDistribution { .. })
        ));
        assert!(out[3].is_err() && out[4].is_ok());
    }
}

/// A uniform whose target `u · total` stays `1e-9 · total` away from every CDF boundary of `p`.
fn uniform_off_boundaries(rng: &mut ChaCha8Rng, p: &[f32]) -> f64 {
    let total: f64 = p.iter().map(|&v| f64::from(v)).sum();
    'draw: loop {
        let u: f64 = rng.random();
        let target = u * total;
        let mut cum = 0.0f64;
        for &v in p {
            cum += f64::from(v);
            if (cum - target).abs() < 1e-9 * total {
                continue 'draw;
            }
        }
        return u;
    }
}

#[test]
fn draw_matches_the_cpu_draw_and_degenerate_rows_give_minus_one() {
    for vocab in [8, 1000, DEEPSEEK_VOCAB] {
        let mut rng = common::rng(30 + vocab as u64);
        let mut rows: Vec<Vec<f32>> = Vec::new();
        let mut us: Vec<f64> = Vec::new();
        // Softmax rows, with and without zeroed entries (zeros are never drawn).
        for r in 0..12 {
            let mut p = probs_from_logits(&flat(&mut rng, vocab), &SamplingParams::default())
                .expect("valid");
            if r % 2 == 1 {
                for v in p.iter_mut().step_by(3) {
                    *v = 0.0;
                }
            }
            us.push(uniform_off_boundaries(&mut rng, &p));
            rows.push(p);
        }
        // u = 0 draws the first positive entry; a sparse row drawn near its end.
        let mut sparse = vec![0.0f32; vocab];
        sparse[vocab / 2] = 0.25;
        sparse[vocab - 1] = 0.75;
        rows.push(sparse.clone());
        us.push(0.0);
        rows.push(sparse);
        us.push(0.999_999);
        // Degenerate: all zero, a NaN, a negative entry, an infinity.
        let bad = rows.len();
        let mut nan = rows[0].clone();
        nan[vocab / 2] = f32::NAN;
        let mut negative = rows[0].clone();
        negative[1] = -1e-3;
        let mut inf = rows[0].clone();
        inf[0] = f32::INFINITY;
        for p in [vec![0.0; vocab], nan, negative, inf] {
            rows.push(p);
            us.push(0.5);
        }
        let want: Vec<i32> = rows
            .iter()
            .zip(&us)
            .map(|(p, &u)| sample_from_probs(p, u).map_or(-1, |t| t as i32))
            .collect();
        assert!(want[bad..].iter().all(|&t| t == -1));
        assert!(want[..bad].iter().all(|&t| t >= 0));
        let flat_rows: Vec<f32> = rows.concat();
        for b in backends() {
            let p = b.upload(&flat_rows).expect("upload");
            let u = Uniforms::new(&b, &us).expect("uniforms");
            let got = draw(
                &b,
                Draw {
                    probs: &p,
                    vocab,
                    uniforms: &u,
                },
            )
            .expect("draw");
            assert_eq!(host_ints(&got), want, "vocab {vocab} on the {}", b.name());
            if vocab != DEEPSEEK_VOCAB || is_cpu(&b) {
                continue;
            }
            // Each row alone: a GPU splits one long row over the most blocks.
            for (r, (row, &u)) in rows.iter().zip(&us).enumerate() {
                let p = b.upload(row).expect("upload");
                let u = Uniforms::new(&b, &[u]).expect("uniforms");
                let got = draw(
                    &b,
                    Draw {
                        probs: &p,
                        vocab,
                        uniforms: &u,
                    },
                )
                .expect("draw");
                assert_eq!(
                    host_ints(&got),
                    [want[r]],
                    "row {r} alone on the {}",
                    b.name()
                );
            }
        }
    }
}

/// `draw_at` reads its rows' draws from an offset of a longer buffer (a drafter pass's block
/// positions share one), exactly as `draw` with those draws alone; past the end is an error.
#[test]
fn draw_at_reads_its_draws_at_an_offset() {
    for vocab in [1000, DEEPSEEK_VOCAB] {
        let mut rng = common::rng(31);
        let rows: Vec<Vec<f32>> = (0..3)
            .map(|_| {
                probs_from_logits(&flat(&mut rng, vocab), &SamplingParams::default())
                    .expect("valid")
            })
            .collect();
        // Six draws: the rows take 2, 3 and 4 (offset 2).
        let mut us = vec![0.5, 0.5];
        for p in &rows {
            us.push(uniform_off_boundaries(&mut rng, p));
        }
        us.push(0.5);
        let want: Vec<i32> = rows
            .iter()
            .zip(&us[2..])
            .map(|(p, &u)| sample_from_probs(p, u).expect("valid") as i32)
            .collect();
        for b in backends() {
            let p = b.upload(&rows.concat()).expect("upload");
            let u = Uniforms::new(&b, &us).expect("uniforms");
            let d = Draw {
                probs: &p,
                vocab,
                uniforms: &u,
            };
            let got = host_ints(&draw_at(&b, d, 2).expect("draw_at"));
            assert_eq!(got, want, "vocab {vocab} on the {}", b.name());
            let e = draw_at(&b, d, 4).expect_err("draws 4..7 of 6");
            assert!(e.to_string().contains("uniforms"), "{e}");
        }
    }
}

#[test]
fn apply_controls_matches_the_cpu_row_by_row_on_every_backend() {
    let mut rng = <ChaCha8Rng as rand::SeedableRng>::seed_from_u64(16);
    let (rows, vocab) = (5usize, DEEPSEEK_VOCAB);
    let logits: Vec<f32> = (0..rows * vocab)
        .map(|_| rng.random_range(-8.0f32..8.0))
        .collect();
    let history = TokenHistory::new(&[1, 2, 3, 70_000], &[5, 5, 9, 128_000]);
    let penalties = LogitsControls {
        presence_penalty: 0.5,
        frequency_penalty: -0.25,
        repetition_penalty: 1.7,
        logit_bias: vec![(11, -100.0), (42, 100.0)],
    };
    let masked = [7u32, 129_279];
    // A grammar mask allowing tokens 3, 40..72 and 129_000: everything else -inf.
    let mut allowed = vec![0u32; vocab.div_ceil(32)];
    for t in [3usize, 129_000].into_iter().chain(40..72) {
        allowed[t / 32] |= 1 << (t % 32);
    }
    // Row 0 untouched; row 1 penalties and bias; row 2 a grammar mask; row 3 the mask only,
    // with drafts ahead.
    let list = [
        (
            2,
            RowControls {
                controls: &LogitsControls::default(),
                history: &history,
                drafted: &[],
                masked: &[],
                allowed: Some(&allowed),
            },
        ),
        (
            1,
            RowControls {
                controls: &penalties,
                history: &history,
                drafted: &[],
                masked: &[],
                allowed: None,
            },
        ),
        (
            3,
            RowControls {
                controls: &LogitsControls::default(),
                history: &history,
                drafted: &[9, 9],
                masked: &masked,
                allowed: None,
            },
        ),
        (
            4,
            RowControls {
                controls: &penalties,
                history: &history,
                drafted: &[128_000, 42],
                masked: &masked,
                allowed: None,
            },
        ),
    ];
    let mut want = logits.clone();
    for (r, c) in &list {
        ferry_kernels::cpu::logits::apply_controls(&mut want[r * vocab..(r + 1) * vocab], c)
            .expect("in range");
    }
    for b in backends() {
        let mut x = b.upload(&logits).expect("upload");
        apply_controls(&b, &mut x, vocab, &list).expect("apply");
        let got = x.to_host().expect("download");
        for r in 0..rows {
            let row = r * vocab..(r + 1) * vocab;
            assert!(got[row.clone()] == want[row], "{}: row {r}", b.name());
        }
        let ids = host_ints(&argmax(&b, &x, vocab).expect("argmax"));
        assert_eq!(
            (ids[1], ids[4]),
            (42, 42),
            "{}: the +100 bias wins",
            b.name()
        );
        let row2 = &got[2 * vocab..3 * vocab];
        let finite: Vec<usize> = (0..vocab).filter(|&t| row2[t].is_finite()).collect();
        let want_finite: Vec<usize> = [3usize]
            .into_iter()
            .chain(40..72)
            .chain([129_000])
            .collect();
        assert_eq!(
            finite,
            want_finite,
            "{}: only the grammar's tokens remain",
            b.name()
        );
    }
    // A row past the logits is an error, not a write elsewhere.
    let mut x = Backend::Cpu.upload(&logits).expect("upload");
    let past = [(rows, list[1].1)];
    assert!(apply_controls(&Backend::Cpu, &mut x, vocab, &past).is_err());
}

#[test]
fn argmax_matches_the_cpu_with_ties_to_the_lowest_index() {
    for vocab in [8, 1000, DEEPSEEK_VOCAB] {
        let mut rng = common::rng(40);
        let mut rows: Vec<Vec<f32>> = Vec::new();
        let mut tie = flat(&mut rng, vocab);
        tie[vocab - 1] = 9.0;
        tie[vocab / 2] = 9.0;
        tie[3] = 9.0;
        rows.push(tie);
        let mut nan = flat(&mut rng, vocab);
        nan[0] = f32::NAN;
        nan[vocab - 2] = 7.0;
        rows.push(nan);
        rows.push(vec![f32::NEG_INFINITY; vocab]);
        rows.push(vec![f32::NAN; vocab]);
        let mut inf = flat(&mut rng, vocab);
        inf[vocab - 1] = f32::INFINITY;
        rows.push(inf);
        rows.push(flat(&mut rng, vocab));
        if vocab > 8192 {
            // Ties in different 2,048-entry parts of a GPU's split argmax, the first of them
            // last in its part; the winner alone in the row's last, partial part.
            let mut split = flat(&mut rng, vocab);
            split[4095] = 9.0;
            split[4096] = 9.0;
            split[vocab - 5] = 9.0;
            rows.push(split);
            let mut last = vec![f32::NEG_INFINITY; vocab];
            last[vocab - 1] = -3.0;
            rows.push(last);
        }
        let want: Vec<i32> = rows.iter().map(|r| cpu::argmax(r) as i32).collect();
        assert_eq!(want[0], 3);
        assert_eq!(want[2..4], [0, 0]);
        for b in backends() {
            let x = b.upload(&rows.concat()).expect("upload");
            let got = host_ints(&argmax(&b, &x, vocab).expect("argmax"));
            assert_eq!(got, want, "vocab {vocab} on the {}", b.name());
            // Each row alone: on a GPU, one row is split over the most blocks.
            for (r, row) in rows.iter().enumerate() {
                let x = b.upload(row).expect("upload");
                let got = host_ints(&argmax(&b, &x, vocab).expect("argmax"));
                assert_eq!(
                    got,
                    [want[r]],
                    "vocab {vocab}, row {r} alone on the {}",
                    b.name()
                );
            }
        }
    }
}

/// One sequence of a verify batch, as host data.
struct Seq {
    /// `[(γ + 1)][vocab]`.
    p: Vec<f32>,
    /// `[γ][vocab]`.
    q: Vec<f32>,
    drafts: Vec<i32>,
    uniforms: Vec<f64>,
}

/// The batch on a backend, verified in one call.
fn verify_on(b: &Backend, seqs: &[Seq], vocab: usize) -> VerifyOut {
    let p: Vec<f32> = seqs.iter().flat_map(|s| s.p.clone()).collect();
    let q: Vec<f32> = seqs.iter().flat_map(|s| s.q.clone()).collect();
    let d: Vec<i32> = seqs.iter().flat_map(|s| s.drafts.clone()).collect();
    let u: Vec<f64> = seqs.iter().flat_map(|s| s.uniforms.clone()).collect();
    let gammas: Vec<usize> = seqs.iter().map(|s| s.drafts.len()).collect();
    let (p, q) = (b.upload(&p).expect("p"), b.upload(&q).expect("q"));
    let drafts = b.ints(d).expect("drafts");
    let uniforms = Uniforms::new(b, &u).expect("uniforms");
    verify(
        b,
        VerifyBatch {
            p: &p,
            q: Some(&q),
            greedy: &vec![false; seqs.len()],
            drafts: &drafts,
            gammas: &gammas,
            uniforms: &uniforms,
            vocab,
        },
    )
    .expect("shapes are valid")
}

/// The CPU verifier on one sequence.
fn verify_cpu(s: &Seq) -> Result<ferry_kernels::cpu::verify::Verified, KernelError> {
    let ids: Vec<u32> = s.drafts.iter().map(|&x| x as u32).collect();
    verify_probs(&s.p, DraftProbs::Sampled(&s.q), &ids, &s.uniforms)
}

fn one_hot(vocab: usize, at: usize) -> Vec<f32> {
    let mut v = vec![0.0; vocab];
    v[at] = 1.0;
    v
}

#[test]
fn verify_matches_the_cpu_verifier_and_a_bad_sequence_fails_alone() {
    // 1,000 entries: one block a sequence on a GPU; DeepSeek's vocabulary: each sequence's draw
    // split over several blocks (and over the most, for a sequence alone).
    for vocab in [1000, DEEPSEEK_VOCAB] {
        verify_against_the_cpu(vocab);
    }
}

fn verify_against_the_cpu(vocab: usize) {
    let mut rng = common::rng(50);
    let soft = SamplingParams {
        temperature: 0.9,
        top_k: 40,
        ..SamplingParams::default()
    };
    let mut seqs = Vec::new();
    for s in 0..24 {
        let gamma = s % 5;
        let greedy_seq = s % 2 == 0;
        let params = if greedy_seq { greedy() } else { soft.clone() };
        let target: Vec<Vec<f32>> = (0..=gamma)
            .map(|_| {
                let x = flat(&mut rng, vocab);
                probs_from_logits(&x, &params).expect("valid")
            })
            .collect();
        // Greedy drafts: the target's argmax for a random prefix, then a wrong token, with a
        // one-hot q. Sampled drafts: drawn from a soft q of their own.
        let right = rng.random_range(0..=gamma);
        let mut drafts = Vec::new();
        let mut q = Vec::new();
        for (k, t) in target.iter().take(gamma).enumerate() {
            if greedy_seq {
                let best = cpu::argmax(t) as usize;
                let x = if k < right { best } else { (best + 1) % vocab };
                drafts.push(x as i32);
                q.extend(one_hot(vocab, x));
            } else {
                let qk = probs_from_logits(&flat(&mut rng, vocab), &soft).expect("valid");
                drafts.push(sample_from_probs(&qk, rng.random()).expect("valid") as i32);
                q.extend(qk);
            }
        }
        let uniforms = (0..=gamma).map(|_| rng.random()).collect();
        seqs.push(Seq {
            p: target.concat(),
            q,
            drafts,
            uniforms,
        });
    }
    // Bad sequences next to good ones: q = 0 at the draft, an id past the vocabulary, a
    // negative id, a degenerate (NaN) target row that the verifier reaches.
    let template = |s: &Seq| Seq {
        p: s.p.clone(),
        q: s.q.clone(),
        drafts: s.drafts.clone(),
        uniforms: s.uniforms.clone(),
    };
    let mut zero_q = template(&seqs[3]);
    let x = zero_q.drafts[0] as usize;
    zero_q.q[x] = 0.0;
    let mut past = template(&seqs[3]);
    past.drafts[1] = vocab as i32;
    let mut negative = template(&seqs[3]);
    negative.drafts[0] = -5;
    let mut nan = template(&seqs[4]);
    nan.p[..vocab].fill(f32::NAN);
    for (at, s) in [(2, zero_q), (7, past), (11, negative), (15, nan)] {
        seqs.insert(at, s);
    }
    let want: Vec<_> = seqs.iter().map(verify_cpu).collect();
    assert!(want[2]
        .as_ref()
        .is_err_and(|e| e.to_string().contains("q[k][draft]")));
    assert!(want[7]
        .as_ref()
        .is_err_and(|e| e.to_string().contains("drafts")));
    assert!(matches!(
        want[15],
        Err(KernelError::DegenerateDistribution { .. })
    ));
    assert_eq!(want.iter().filter(|r| r.is_err()).count(), 4);
    for b in backends() {
        let got = verify_on(&b, &seqs, vocab);
        assert_eq!(got.len(), seqs.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            match (g, w) {
                (Ok(g), Ok(w)) => assert_eq!(g, w, "sequence {i} on the {}", b.name()),
                (Err(KernelError::DegenerateDistribution { .. }), Err(_)) => assert_eq!(i, 15),
                // The CPU reference saw -5 as a u32; the backend reports the id as given.
                (Err(g), Err(_)) if i == 11 => {
                    assert!(g.to_string().contains("-5 with vocab"), "{g}");
                }
                (Err(g), Err(w)) => assert_eq!(g.to_string(), w.to_string(), "sequence {i}"),
                _ => panic!("sequence {i} on the {}: {g:?}, CPU {w:?}", b.name()),
            }
        }
        // Greedy sequences: exact argmax matching.
        for (i, s) in seqs
            .iter()
            .enumerate()
            .filter(|(i, _)| ![2, 7, 11, 15].contains(i))
        {
            let Ok(v) = &got[i] else {
                panic!("sequence {i} failed on the {}", b.name())
            };
            assert_eq!(v.tokens.len(), v.accepted + 1);
            assert!(v.accepted <= s.drafts.len());
        }
        if vocab != DEEPSEEK_VOCAB || is_cpu(&b) {
            continue;
        }
        // Each sequence alone, bad ones included.
        for (i, (s, w)) in seqs.iter().zip(&want).enumerate() {
            let got = verify_on(&b, std::slice::from_ref(s), vocab);
            match (&got[0], w) {
                (Ok(g), Ok(w)) => assert_eq!(g, w, "sequence {i} alone on the {}", b.name()),
                (Err(_), Err(_)) => {}
                (g, w) => panic!("sequence {i} alone on the {}: {g:?}, CPU {w:?}", b.name()),
            }
        }
    }
}

/// A verify batch where the sequences marked in `greedy` pass no q rows (argmax drafts).
fn verify_flagged(b: &Backend, seqs: &[Seq], greedy: &[bool], vocab: usize) -> VerifyOut {
    let p: Vec<f32> = seqs.iter().flat_map(|s| s.p.clone()).collect();
    let q: Vec<f32> = seqs
        .iter()
        .zip(greedy)
        .filter(|(_, &g)| !g)
        .flat_map(|(s, _)| s.q.clone())
        .collect();
    let d: Vec<i32> = seqs.iter().flat_map(|s| s.drafts.clone()).collect();
    let u: Vec<f64> = seqs.iter().flat_map(|s| s.uniforms.clone()).collect();
    let gammas: Vec<usize> = seqs.iter().map(|s| s.drafts.len()).collect();
    let p = b.upload(&p).expect("p");
    let q = (!q.is_empty()).then(|| b.upload(&q).expect("q"));
    verify(
        b,
        VerifyBatch {
            p: &p,
            q: q.as_ref(),
            greedy,
            drafts: &b.ints(d).expect("drafts"),
            gammas: &gammas,
            uniforms: &Uniforms::new(b, &u).expect("uniforms"),
            vocab,
        },
    )
    .expect("shapes are valid")
}

#[test]
fn greedy_drafts_need_no_q_rows_and_verify_as_their_one_hot_rows() {
    // Argmax drafts declared greedy (no q rows; the correction from p with the draft's entry
    // zeroed) must verify exactly as the same drafts with one-hot q rows, and as the CPU's
    // `DraftProbs::Greedy`; sampled sequences in the same batch keep their own rows. At 1,000
    // entries and at DeepSeek's vocabulary (a GPU splits each sequence's draw there).
    for vocab in [1000, DEEPSEEK_VOCAB] {
        greedy_flags(vocab);
    }
}

fn greedy_flags(vocab: usize) {
    let mut rng = common::rng(51);
    let soft = SamplingParams {
        temperature: 0.8,
        ..SamplingParams::default()
    };
    let mut seqs = Vec::new();
    let mut flags = Vec::new();
    for s in 0..20 {
        let gamma = 1 + s % 4;
        let greedy_seq = s % 3 != 0;
        let target: Vec<Vec<f32>> = (0..=gamma)
            .map(|_| probs_from_logits(&flat(&mut rng, vocab), &soft).expect("valid"))
            .collect();
        let (mut drafts, mut q) = (Vec::new(), Vec::new());
        for t in target.iter().take(gamma) {
            if greedy_seq {
                // A plausible draft that the soft target may or may not accept.
                let x = if rng.random::<bool>() {
                    cpu::argmax(t) as usize
                } else {
                    rng.random_range(0..vocab)
                };
                drafts.push(x as i32);
                q.extend(one_hot(vocab, x));
            } else {
                let qk = probs_from_logits(&flat(&mut rng, vocab), &soft).expect("valid");
                drafts.push(sample_from_probs(&qk, rng.random()).expect("valid") as i32);
                q.extend(qk);
            }
        }
        let uniforms = (0..=gamma).map(|_| rng.random()).collect();
        seqs.push(Seq {
            p: target.concat(),
            q,
            drafts,
            uniforms,
        });
        flags.push(greedy_seq);
    }
    let want: Vec<_> = seqs
        .iter()
        .zip(&flags)
        .map(|(s, &g)| {
            let ids: Vec<u32> = s.drafts.iter().map(|&x| x as u32).collect();
            let q = if g {
                DraftProbs::Greedy
            } else {
                DraftProbs::Sampled(&s.q)
            };
            verify_probs(&s.p, q, &ids, &s.uniforms).expect("valid")
        })
        .collect();
    assert!(
        want.iter().any(|v| v.accepted > 0) && want.iter().any(|v| v.accepted < 4),
        "the batch accepts and rejects"
    );
    for b in backends() {
        let rows = verify_on(&b, &seqs, vocab);
        let flagged = verify_flagged(&b, &seqs, &flags, vocab);
        for (i, ((r, f), w)) in rows.iter().zip(&flagged).zip(&want).enumerate() {
            let (r, f) = (r.as_ref().expect("valid"), f.as_ref().expect("valid"));
            assert_eq!(f, w, "sequence {i} (greedy flag) on the {}", b.name());
            assert_eq!(r, w, "sequence {i} (one-hot rows) on the {}", b.name());
        }
        // A batch of greedy sequences only passes no q at all.
        let only: Vec<Seq> = seqs
            .iter()
            .zip(&flags)
            .filter(|(_, &g)| g)
            .map(|(s, _)| Seq {
                p: s.p.clone(),
                q: Vec::new(),
                drafts: s.drafts.clone(),
                uniforms: s.uniforms.clone(),
            })
            .collect();
        let got = verify_flagged(&b, &only, &vec![true; only.len()], vocab);
        let want_only: Vec<_> = want
            .iter()
            .zip(&flags)
            .filter(|(_, &g)| g)
            .map(|(w, _)| w)
            .collect();
        for (g, w) in got.iter().zip(want_only) {
            assert_eq!(g.as_ref().expect("valid"), w);
        }
        if vocab != DEEPSEEK_VOCAB || is_cpu(&b) {
            continue;
        }
        // Each sequence alone, greedy-flagged where it is.
        for (i, ((s, &g), w)) in seqs.iter().zip(&flags).zip(&want).enumerate() {
            let got = verify_flagged(&b, std::slice::from_ref(s), &[g], vocab);
            assert_eq!(got[0].as_ref().expect("valid"), w, "sequence {i} alone");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Losslessness (the method of tests/verify.rs, run through the backend ops).

/// A synthetic request (as in `tests/verify.rs`): target logits `[(γ+1)][V]` and a drafter's
/// logits `[γ][V]` = the target's plus noise.
struct Case {
    target: Vec<f32>,
    draft_logits: Vec<f32>,
}

fn case(seed: u64) -> Case {
    let mut rng = common::rng(seed);
    let target = common::uniform(&mut rng, (GAMMA + 1) * VOCAB, 2.5);
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

fn rows_of(flat: &[f32]) -> Vec<Vec<f32>> {
    flat.chunks(VOCAB).map(<[f32]>::to_vec).collect()
}

/// The drafter's q rows (softmax at temperature 1, by the sampler's code).
fn q_rows(c: &Case) -> Vec<f32> {
    rows_of(&c.draft_logits)
        .iter()
        .flat_map(|l| probs_from_logits(l, &SamplingParams::default()).expect("valid"))
        .collect()
}

/// How the test's drafter proposes.
#[derive(Clone, Copy)]
enum Proposer<'a> {
    /// Draws `x_k` from these rows `[γ][vocab]`.
    Sample(&'a [f32]),
    /// Always proposes these tokens.
    Fixed(&'a [u32]),
}

/// One request kind of a lossless run: a case, its parameters, how drafts are proposed and the
/// q rows declared to the verifier.
#[derive(Clone)]
struct Kind<'a> {
    case: &'a Case,
    params: SamplingParams,
    proposer: Proposer<'a>,
    declared: &'a [f32],
    /// Declared as argmax drafts: no q rows are passed (`declared` is not used).
    greedy: bool,
}

/// `ROUNDS` sequences of every kind, interleaved, verified by ONE `verify_logits` call on `b`
/// (target logits → probs on the backend → verify → one download); one tally per kind.
fn run(b: &Backend, kinds: &[Kind<'_>], seed: u64) -> Vec<Tally> {
    let mut rng = common::rng(seed);
    let n = ROUNDS * kinds.len();
    let (mut logits, mut q, mut drafts, mut uniforms) = (vec![], vec![], vec![], vec![]);
    let mut greedy = Vec::with_capacity(n);
    let mut per_seq = Vec::with_capacity(n);
    for _ in 0..ROUNDS {
        for k in kinds {
            for j in 0..GAMMA {
                drafts.push(match k.proposer {
                    Proposer::Sample(rows) => {
                        sample_from_probs(&rows[j * VOCAB..(j + 1) * VOCAB], rng.random())
                            .expect("valid q") as i32
                    }
                    Proposer::Fixed(t) => t[j] as i32,
                });
            }
            uniforms.extend((0..=GAMMA).map(|_| rng.random::<f64>()));
            logits.extend_from_slice(&k.case.target);
            if !k.greedy {
                q.extend_from_slice(k.declared);
            }
            greedy.push(k.greedy);
            per_seq.push(k.params.clone());
        }
    }
    let gammas = vec![GAMMA; n];
    let params = RowParams::for_blocks(b, &per_seq, &gammas).expect("valid params");
    let logits = b.take(logits).expect("logits");
    let q = (!q.is_empty()).then(|| b.take(q).expect("q"));
    let drafts = b.ints(drafts).expect("drafts");
    let uniforms = Uniforms::new(b, &uniforms).expect("uniforms");
    let out = verify_logits(
        b,
        VerifyLogits {
            logits: &logits,
            params: &params,
            q: q.as_ref(),
            greedy: &greedy,
            drafts: &drafts,
            gammas: &gammas,
            uniforms: &uniforms,
            vocab: VOCAB,
        },
    )
    .expect("valid batch");
    let mut tallies: Vec<Tally> = kinds.iter().map(|_| Tally::new()).collect();
    for (i, r) in out.into_iter().enumerate() {
        let v = r.expect("valid sequence");
        assert_eq!(v.tokens.len(), v.accepted + 1);
        let t = &mut tallies[i % kinds.len()];
        t.accepted[v.accepted] += 1;
        for (j, &tok) in v.tokens.iter().enumerate() {
            t.at[j][tok as usize] += 1;
        }
    }
    tallies
}

/// The reference p rows for a case under `params`.
fn p_ref(c: &Case, params: &SamplingParams) -> Vec<Vec<f64>> {
    rows_of(&c.target)
        .iter()
        .map(|l| reference_probs(l, params))
        .collect()
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// The drafter's argmax tokens per position, and their one-hot q rows.
fn argmax_drafts(c: &Case) -> (Vec<u32>, Vec<f32>) {
    let d: Vec<u32> = rows_of(&c.draft_logits)
        .iter()
        .map(|l| cpu::argmax(l))
        .collect();
    let q = d.iter().flat_map(|&x| one_hot(VOCAB, x as usize)).collect();
    (d, q)
}

#[test]
fn the_backend_verifier_is_lossless_for_sampled_drafts_and_the_control_fails() {
    let params = sampled_params();
    let cases: Vec<Case> = (0..params.len()).map(|i| case(100 + i as u64)).collect();
    let qs: Vec<Vec<f32>> = cases.iter().map(q_rows).collect();
    // The control's drafter really draws from another distribution (the target's logits
    // negated and shifted by one token) but declares q.
    let others: Vec<Vec<f32>> = cases
        .iter()
        .map(|c| {
            rows_of(&c.target)[..GAMMA]
                .iter()
                .flat_map(|l| {
                    let mut flipped: Vec<f32> = l.iter().map(|v| -v).collect();
                    flipped.rotate_left(1);
                    probs_from_logits(&flipped, &SamplingParams::default()).expect("valid")
                })
                .collect()
        })
        .collect();
    for b in backends() {
        let honest: Vec<Kind<'_>> = (0..params.len())
            .map(|i| Kind {
                case: &cases[i],
                params: params[i].clone(),
                proposer: Proposer::Sample(&qs[i]),
                declared: &qs[i],
                greedy: false,
            })
            .collect();
        let control: Vec<Kind<'_>> = (0..params.len())
            .map(|i| Kind {
                proposer: Proposer::Sample(&others[i]),
                ..honest[i].clone()
            })
            .collect();
        let tallies = run(&b, &honest, 7);
        let controls = run(&b, &control, 7);
        for i in 0..params.len() {
            let p = p_ref(&cases[i], &params[i]);
            let a = alpha(&p, &widen(&qs[i]));
            let stats = statistics(&tallies[i], &p, &a);
            assert!(
                passes(&stats),
                "{}, params {:?}: chi2 {stats:?}",
                b.name(),
                params[i]
            );
            assert!(
                tallies[i].accepted[GAMMA] > 100,
                "{:?}",
                tallies[i].accepted
            );
            let stats = statistics(&controls[i], &p, &a);
            assert!(
                !passes(&stats),
                "{}, params {:?}: the control passed (chi2 {stats:?}); the test has no power",
                b.name(),
                params[i]
            );
        }
        // Each sequence got its own parameters: kind 1's law fails against kind 2's.
        let wrong = p_ref(&cases[1], &params[2]);
        assert!(chi2(&tallies[1].at[0], &wrong[0]).0 > CHI2_LIMIT);
    }
}

#[test]
fn greedy_drafts_with_one_hot_q_are_lossless_and_the_soft_q_control_fails() {
    let params = sampled_params();
    let cases: Vec<Case> = (0..params.len()).map(|i| case(200 + i as u64)).collect();
    let greedy_drafts: Vec<(Vec<u32>, Vec<f32>)> = cases.iter().map(argmax_drafts).collect();
    let soft: Vec<Vec<f32>> = cases.iter().map(q_rows).collect();
    for b in backends() {
        let honest: Vec<Kind<'_>> = (0..params.len())
            .map(|i| Kind {
                case: &cases[i],
                params: params[i].clone(),
                proposer: Proposer::Fixed(&greedy_drafts[i].0),
                declared: &greedy_drafts[i].1,
                greedy: false,
            })
            .collect();
        // Proposing argmax while declaring the soft distribution over-accepts the argmax token.
        let control: Vec<Kind<'_>> = (0..params.len())
            .map(|i| Kind {
                declared: &soft[i],
                ..honest[i].clone()
            })
            .collect();
        // The same drafts declared greedy: no q rows at all, the point mass implied.
        let flagged: Vec<Kind<'_>> = honest
            .iter()
            .map(|k| Kind {
                greedy: true,
                ..k.clone()
            })
            .collect();
        let tallies = run(&b, &honest, 11);
        let tallies_flagged = run(&b, &flagged, 11);
        let controls = run(&b, &control, 11);
        for i in 0..params.len() {
            let p = p_ref(&cases[i], &params[i]);
            let a = alpha(&p, &widen(&greedy_drafts[i].1));
            let stats = statistics(&tallies[i], &p, &a);
            assert!(passes(&stats), "{}: chi2 {stats:?}", b.name());
            let stats = statistics(&tallies_flagged[i], &p, &a);
            assert!(passes(&stats), "{} (greedy flag): chi2 {stats:?}", b.name());
            let stats = statistics(&controls[i], &p, &a);
            assert!(
                !passes(&stats),
                "{}: the control passed (chi2 {stats:?})",
                b.name()
            );
        }
    }
}

#[test]
fn lengths_params_and_devices_are_checked_before_anything_runs() {
    let b = Backend::Cpu;
    let bad_p = SamplingParams {
        top_p: 0.0,
        ..SamplingParams::default()
    };
    let e = RowParams::new(&b, &[SamplingParams::default(), bad_p]).unwrap_err();
    assert!(e.to_string().contains("top_p"), "{e}");
    assert!(Uniforms::new(&b, &[0.5, 1.0]).is_err());
    assert!(Uniforms::new(&b, &[f64::NAN]).is_err());
    let params = RowParams::new(&b, &vec![SamplingParams::default(); 2]).expect("valid");
    let x = b.upload(&[0.0; 7]).expect("upload");
    let e = probs(
        &b,
        Probs {
            logits: &x,
            vocab: 4,
            params: &params,
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::ShapeMismatch {
                what: "logits",
                expected: 8,
                got: 7,
                ..
            }
        ),
        "{e}"
    );
    assert!(argmax(&b, &x, 0).is_err());
    let p = b.upload(&[0.25; 8]).expect("upload");
    let q = b.upload(&[0.25; 4]).expect("upload");
    let drafts = b.ints(vec![1]).expect("ints");
    let u = Uniforms::new(&b, &[0.5]).expect("uniforms");
    let e = verify(
        &b,
        VerifyBatch {
            p: &p,
            q: Some(&q),
            greedy: &[false],
            drafts: &drafts,
            gammas: &[1],
            uniforms: &u,
            vocab: 4,
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("uniforms"), "{e}");
    #[cfg(any(feature = "cuda", feature = "rocm"))]
    for gpu in backends().iter().filter(|b| !is_cpu(b)) {
        // Operands made for the CPU are refused by the GPU arm, naming them.
        let e = probs(
            gpu,
            Probs {
                logits: &b.upload(&[0.0; 8]).expect("upload"),
                vocab: 4,
                params: &params,
            },
        )
        .unwrap_err();
        assert!(matches!(e, KernelError::DeviceMismatch { .. }), "{e}");
    }
}
