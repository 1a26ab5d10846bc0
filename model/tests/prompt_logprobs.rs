//! Prompt log-probabilities through the engine (`GenerateOptions::prompt_logprobs`,
//! `PrefillWork::prompt_logprobs`: what `echo` with `logprobs` needs). Each prompt token after
//! the first must get the model's raw log-softmax at the position before it — checked against
//! a direct forward of the whole prompt on every path that prefills: a local prefill in many
//! chunks with the LM head's rows split over several logits chunks, a prefill job (the
//! prefill worker's), a speculating engine, a prompt whose prefix an earlier request left in
//! the prefix cache (not reused then: cached positions have no logits), and sample 0 of an
//! `n` > 1 request. Every test ends with all KV blocks back in the pool.

mod common;

use ferry_kernels::cpu::logits::TokenLogprobs;
use ferry_model::deepseek::{DeepseekModel, LogitsWanted};
use ferry_model::drafter::DsparkDrafter;
use ferry_model::engine::{
    EngineConfig, EngineEvent, EngineHandle, GenerateOptions, Generation, PrefillSource,
    PrefillWork, SpecConfig, StopParams, VerifyLen,
};
use ferry_model::kv::KvPool;
use ferry_model::session::Session;

use common::{collect, golden_case, greedy, job, wait_idle};

/// Alternatives asked for per prompt token.
const TOP: usize = 3;

fn target() -> DeepseekModel {
    DeepseekModel::load(&ferry_model::embedded::default_model_dir()).expect("model")
}

/// Small prefill chunks (many `Work::Chunk`s per prompt), pages of 16.
fn config() -> EngineConfig {
    EngineConfig {
        num_blocks: 128,
        page_size: 16,
        max_batch_tokens: 40,
        spec: SpecConfig {
            verify_len: VerifyLen::Fixed(3),
            max_verify_tokens: 64,
            ..SpecConfig::default()
        },
        ..EngineConfig::default()
    }
}

fn asking() -> GenerateOptions {
    GenerateOptions {
        prompt_logprobs: Some(TOP),
        ..GenerateOptions::default()
    }
}

/// The log-softmax of a direct forward at every prompt position but the last (row `i`
/// predicts prompt token `i + 1`).
fn direct(model: &DeepseekModel, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut pool: KvPool = model.new_kv_pool(32, 16).expect("pool");
    let mut s = Session::new();
    let all = s
        .extend(model, &mut pool, prompt, LogitsWanted::All)
        .unwrap();
    s.free(&mut pool).unwrap();
    let vocab = model.config().vocab_size;
    all.chunks_exact(vocab)
        .take(prompt.len() - 1)
        .map(|row| {
            let mut row = row.to_vec();
            ferry_kernels::cpu::softmax::log_softmax_inplace(&mut row).unwrap();
            row
        })
        .collect()
}

fn assert_matches(got: &[TokenLogprobs], prompt: &[u32], want: &[Vec<f32>], case: &str) {
    assert_eq!(
        got.len(),
        prompt.len() - 1,
        "{case}: one per token after the first"
    );
    for (i, (lp, row)) in got.iter().zip(want).enumerate() {
        let t = prompt[i + 1];
        assert_eq!(lp.token, t, "{case} entry {i} names prompt token {}", i + 1);
        common::assert_entry_matches(lp, t, row, TOP, &format!("{case} entry {i}"));
    }
}

/// What one request got: its prompt log-probabilities (exactly one event, before any token),
/// its tokens, and the cached prompt tokens its prefill reported.
async fn run(mut g: Generation) -> (Option<Vec<TokenLogprobs>>, Vec<u32>, Option<usize>) {
    let (mut prompt, mut toks, mut cached) = (None, Vec::new(), None);
    while let Some(e) = g.events.recv().await {
        match e {
            EngineEvent::PromptLogprobs(lps) => {
                assert!(prompt.is_none(), "prompt log-probabilities sent twice");
                assert!(toks.is_empty(), "prompt log-probabilities after a token");
                prompt = Some(lps);
            }
            EngineEvent::LocalPrefill { cached_tokens } => cached = Some(cached_tokens),
            EngineEvent::Token(t) => toks.push(t),
            EngineEvent::Finished(_) => break,
            EngineEvent::Failed(f) => panic!("request failed: {f}"),
            _ => {}
        }
    }
    (prompt, toks, cached)
}

/// A 211-token prompt computed in chunks of at most 40 tokens, its LM-head rows reduced five
/// at a time: complete and equal to the direct forward; the generated tokens are the plain
/// request's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_local_prefill_gives_the_direct_forwards_log_softmax() {
    let reference = target();
    let (prompt, _) = golden_case(2);
    assert!(prompt.len() > 200);
    let want = direct(&reference, &prompt);
    let mut model = target();
    model.set_prompt_logits_chunk(5 * model.config().vocab_size);
    let e = EngineHandle::spawn(model, config()).unwrap();
    let (lps, toks, cached) = run(e
        .generate_with(job(prompt.clone(), 4, PrefillSource::Local), asking())
        .unwrap())
    .await;
    assert_eq!(cached, Some(0));
    assert_matches(&lps.expect("asked for"), &prompt, &want, "chunked");
    let (plain, _) = collect(
        e.generate(job(prompt.clone(), 4, PrefillSource::Local))
            .unwrap(),
    )
    .await;
    assert_eq!(toks, plain, "asking changes nothing about the tokens");
    wait_idle(&e).await;
}

/// An earlier request left the prompt's blocks in the prefix cache: a request asking for the
/// prompt's log-probabilities does not reuse them (it computes every row) and gets complete,
/// equal values; a plain request after it still reuses the cache, and a prefill job asking for
/// them reuses nothing either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_prefix_is_recomputed_for_them() {
    let model = target();
    let (prompt, _) = golden_case(1);
    let prompt: Vec<u32> = prompt.iter().chain(&golden_case(0).0).copied().collect();
    let want = direct(&model, &prompt);
    let e = EngineHandle::spawn(model, config()).unwrap();
    let (_, first, _) = run(e
        .generate_with(
            job(prompt.clone(), 3, PrefillSource::Local),
            GenerateOptions::default(),
        )
        .unwrap())
    .await;
    let (_, again, cached) = run(e
        .generate_with(
            job(prompt.clone(), 3, PrefillSource::Local),
            GenerateOptions::default(),
        )
        .unwrap())
    .await;
    let cached = cached.expect("local prefill");
    assert!(
        cached >= 16,
        "the plain request reuses the cached prefix ({cached})"
    );
    assert_eq!(again, first);
    let before = e.stats().await.unwrap();
    let (lps, toks, cached) = run(e
        .generate_with(job(prompt.clone(), 3, PrefillSource::Local), asking())
        .unwrap())
    .await;
    assert_eq!(cached, Some(0), "no cached position is reused");
    assert_eq!(toks, first);
    assert_matches(&lps.expect("asked for"), &prompt, &want, "cached prefix");
    let after = e.stats().await.unwrap();
    assert_eq!(after.prefill_reused_tokens, before.prefill_reused_tokens);
    assert_eq!(
        after.prefill_computed_tokens - before.prefill_computed_tokens,
        prompt.len() as u64
    );

    let job = e
        .prefill_work(PrefillWork {
            prompt: prompt.clone(),
            sampling: greedy(),
            controls: Default::default(),
            stop: StopParams::max_tokens(1),
            logprobs: None,
            prompt_logprobs: Some(TOP),
            skip_tokens: 0,
            on_layer: Box::new(|_, _, _| Ok(())),
            on_draft_layer: None,
            grammar: None,
            rows_on_device: false,
        })
        .await
        .unwrap();
    assert_eq!(job.reused_tokens, 0);
    assert_eq!(job.computed_tokens, prompt.len());
    assert_eq!(job.first_token, first[0]);
    assert_matches(&job.prompt_logprobs, &prompt, &want, "prefill job");
    // Without the option a prefill job returns none (and reuses the cache).
    let plain = e
        .prefill(prompt.clone(), greedy(), 0, Box::new(|_, _, _| Ok(())))
        .await
        .unwrap();
    assert!(plain.prompt_logprobs.is_empty());
    assert!(plain.reused_tokens > 0);
    wait_idle(&e).await;
}

/// Speculative decoding changes nothing: the prompt's log-probabilities come from the
/// target's prefill, equal to the direct forward's, and the tokens are the plain engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_speculating_engine_gives_the_same_values() {
    let model = target();
    let (prompt, _) = golden_case(1);
    let want = direct(&model, &prompt);
    let drafter = DsparkDrafter::load(&ferry_model::drafter::embedded_dir(), model.config())
        .expect("drafter");
    let e = EngineHandle::spawn_with(model, Some(Box::new(drafter)), config()).unwrap();
    let (lps, toks, _) = run(e
        .generate_with(job(prompt.clone(), 12, PrefillSource::Local), asking())
        .unwrap())
    .await;
    assert_matches(&lps.expect("asked for"), &prompt, &want, "speculative");
    assert!(e.stats().await.unwrap().spec_rounds > 0, "it speculated");
    let plain = EngineHandle::spawn(target(), config()).unwrap();
    let (plain_toks, _) = collect(
        plain
            .generate(job(prompt.clone(), 12, PrefillSource::Local))
            .unwrap(),
    )
    .await;
    assert_eq!(toks, plain_toks);
    wait_idle(&e).await;
    wait_idle(&plain).await;
}

/// With `n` > 1, sample 0 reports the prompt's log-probabilities (once) and the other samples,
/// forked off its prompt blocks, report none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sample_zero_of_n_reports_them_once() {
    let model = target();
    let (prompt, _) = golden_case(1);
    let want = direct(&model, &prompt);
    let e = EngineHandle::spawn(model, config()).unwrap();
    let samples = e
        .generate_n(job(prompt.clone(), 3, PrefillSource::Local), 3, asking())
        .unwrap();
    let mut got = Vec::new();
    for g in samples {
        got.push(run(g).await);
    }
    assert_matches(
        got[0].0.as_ref().expect("sample 0"),
        &prompt,
        &want,
        "sample 0",
    );
    assert!(got[1..].iter().all(|(lps, _, _)| lps.is_none()));
    assert_eq!(e.stats().await.unwrap().forked_samples, 2);
    wait_idle(&e).await;
}
