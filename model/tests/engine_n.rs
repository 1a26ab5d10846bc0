//! `n` > 1 samples of one prompt ([`EngineHandle::generate_n`]): one prefill, the other samples
//! forked off its KV blocks (shared full blocks, only the tail computed), independent seeded
//! streams, every block back in the pool.

mod common;

use ferry_kernels::cpu::sample::SamplingParams;
use ferry_model::deepseek::DeepseekModel;
use ferry_model::engine::{
    sample_seed, EngineConfig, EngineEvent, EngineHandle, EngineStats, FinishReason,
    GenerateOptions, PrefillSource, MAX_SAMPLES,
};

use common::{collect, golden_case, greedy, job, wait_idle};

fn engine(blocks: usize) -> EngineHandle {
    let dir = ferry_model::embedded::default_model_dir();
    let model = DeepseekModel::load(&dir).expect("model");
    EngineHandle::spawn(
        model,
        EngineConfig {
            num_blocks: blocks,
            max_batch_tokens: 256,
            ..EngineConfig::default()
        },
    )
    .expect("engine")
}

/// Prompt tokens a fork computes itself: everything after the prompt's full blocks, and at
/// least the last token (whose logits it samples from).
fn tail(prompt: usize, page: usize) -> u64 {
    (prompt - (prompt - 1) / page * page) as u64
}

fn delta(after: &EngineStats, before: &EngineStats) -> [u64; 5] {
    [
        after.local_prefills - before.local_prefills,
        after.remote_prefills - before.remote_prefills,
        after.forked_samples - before.forked_samples,
        after.prefill_computed_tokens - before.prefill_computed_tokens,
        after.fork_tail_tokens - before.fork_tail_tokens,
    ]
}

async fn run_all(gens: Vec<ferry_model::engine::Generation>) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for (i, g) in gens.into_iter().enumerate() {
        let (toks, end) = collect(g).await;
        assert_eq!(end, Ok(FinishReason::Length), "sample {i}");
        out.push(toks);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_samples_share_one_prefill_and_equal_the_single_sample_output() {
    let e = engine(128);
    let page = e.kv_layout().page_size;
    let (prompt, expected) = golden_case(2);
    let before = e.stats().await.unwrap();
    let gens = e
        .generate_n(
            job(prompt.clone(), 32, PrefillSource::Local),
            3,
            GenerateOptions::default(),
        )
        .unwrap();
    assert_eq!(gens.len(), 3);
    let outs = run_all(gens).await;
    for (i, toks) in outs.iter().enumerate() {
        assert_eq!(toks, &expected, "greedy sample {i}");
    }
    let after = e.stats().await.unwrap();
    // [local prefills, remote prefills, forked samples, prefill tokens, fork tail tokens]
    assert_eq!(
        delta(&after, &before),
        [1, 0, 2, prompt.len() as u64, 2 * tail(prompt.len(), page)],
        "one prefill of the whole prompt; each fork computed only the tail"
    );
    assert!(tail(prompt.len(), page) <= page as u64);
    assert_eq!(after.requests_finished - before.requests_finished, 3);
    wait_idle(&e).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_samples_differ_from_each_other_and_are_reproducible() {
    let e = engine(128);
    let (prompt, _) = golden_case(1);
    let seeded = |seed| {
        let mut j = job(prompt.clone(), 16, PrefillSource::Local);
        j.sampling = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        j
    };
    let first = run_all(
        e.generate_n(seeded(7), 4, GenerateOptions::default())
            .unwrap(),
    )
    .await;
    for i in 0..first.len() {
        for j in i + 1..first.len() {
            assert_ne!(
                first[i], first[j],
                "samples {i} and {j} drew the same tokens"
            );
        }
    }
    let again = run_all(
        e.generate_n(seeded(7), 4, GenerateOptions::default())
            .unwrap(),
    )
    .await;
    assert_eq!(first, again, "the same seed gives the same samples");
    // Sample 0 draws with the request's seed, sample i with `sample_seed(seed, i)`: each is
    // what a one-sample request with that seed gives.
    for (i, expected) in first.iter().enumerate() {
        let one = e.generate(seeded(sample_seed(7, i))).expect("one sample");
        let (toks, end) = collect(one).await;
        assert_eq!(end, Ok(FinishReason::Length));
        assert_eq!(
            &toks, expected,
            "sample {i} = one request seeded sample_seed(7, {i})"
        );
    }
    assert_eq!(sample_seed(7, 0), 7);
    wait_idle(&e).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_fork_off_a_remote_prefill() {
    let (p, d) = (engine(64), engine(64));
    let page = d.kv_layout().page_size;
    let (prompt, expected) = golden_case(2);
    let mut gens = d
        .generate_n(
            job(
                prompt.clone(),
                32,
                PrefillSource::Remote { local_threshold: 0 },
            ),
            2,
            GenerateOptions::default(),
        )
        .unwrap();
    let Some(EngineEvent::Reserved {
        blocks,
        cached_tokens,
    }) = gens[0].events.recv().await
    else {
        panic!("expected a reservation for sample 0");
    };
    let d2 = d.clone();
    let out = p
        .prefill(
            prompt.clone(),
            greedy(),
            cached_tokens,
            Box::new(move |layer, bs, rows| {
                for (j, b) in bs.iter().enumerate() {
                    let data = rows.block(*b).map_err(|e| e.to_string())?.to_vec();
                    d2.write_kv(layer, blocks[j], data)
                        .map_err(|e| e.to_string())?;
                }
                Ok(())
            }),
        )
        .await
        .unwrap();
    d.remote_done(gens[0].id, out.first_token, 0).unwrap();
    let outs = run_all(gens).await;
    assert_eq!(outs, vec![expected.clone(), expected]);
    let s = d.stats().await.unwrap();
    assert_eq!(
        [s.remote_prefills, s.local_prefills, s.forked_samples],
        [1, 0, 1]
    );
    assert_eq!(s.prefill_computed_tokens, 0, "the peer computed the prompt");
    assert_eq!(s.fork_tail_tokens, tail(prompt.len(), page));
    wait_idle(&d).await;
    wait_idle(&p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_sample_leaves_the_others_running_and_frees_every_block() {
    let e = engine(128);
    let (prompt, expected) = golden_case(0);
    let mut gens = e
        .generate_n(
            job(prompt, 32, PrefillSource::Local),
            3,
            GenerateOptions::default(),
        )
        .unwrap();
    // Sample 1 goes away after its first token; 0 and 2 go on to the end.
    let mut one = gens.remove(1);
    while !matches!(one.events.recv().await, Some(EngineEvent::Token(_))) {}
    drop(one);
    let outs = run_all(gens).await;
    assert_eq!(outs, vec![expected.clone(), expected]);
    wait_idle(&e).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_fails_fails_every_sample_and_frees_every_block() {
    let e = engine(64);
    let (prompt, _) = golden_case(2);
    let gens = e
        .generate_n(
            job(prompt, 8, PrefillSource::Remote { local_threshold: 0 }),
            3,
            GenerateOptions::default(),
        )
        .unwrap();
    let id = gens[0].id;
    e.remote_failed(id, false, "the peer died".into()).unwrap();
    for (i, g) in gens.into_iter().enumerate() {
        let (toks, end) = collect(g).await;
        assert!(toks.is_empty());
        assert!(end.is_err(), "sample {i} ended {end:?}");
    }
    wait_idle(&e).await;
    // Out of range.
    for n in [0, MAX_SAMPLES + 1] {
        assert!(e
            .generate_n(
                job(vec![1, 2, 3], 4, PrefillSource::Local),
                n,
                GenerateOptions::default()
            )
            .is_err());
    }
}
