//! Helpers the engine test files share (`mod common;` in each). Not every file uses every
//! helper, hence the `dead_code` allowance.
#![allow(dead_code)]

use std::time::Duration;

use ferry_kernels::cpu::sample::SamplingParams;
use ferry_model::engine::{
    EngineEvent, EngineHandle, FinishReason, GenerateJob, Generation, PrefillSource, SpecCounts,
    StopParams, TokenLogprobs,
};
use ferry_model::tokenizer::Tokenizer;

/// Greedy sampling.
pub fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    }
}

/// A greedy job of `max_tokens` new tokens that ignores end-of-sequence tokens.
pub fn job(prompt: Vec<u32>, max_tokens: usize, prefill: PrefillSource) -> GenerateJob {
    GenerateJob {
        prompt,
        sampling: greedy(),
        controls: Default::default(),
        stop: StopParams {
            ignore_eos: true,
            ..StopParams::max_tokens(max_tokens)
        },
        prefill,
        grammar: None,
    }
}

/// `text` tokenized by the embedded model's tokenizer (`bos`: with the BOS token).
pub fn tokens(text: &str, bos: bool) -> Vec<u32> {
    let tok = Tokenizer::from_dir(&ferry_model::embedded::default_model_dir()).unwrap();
    tok.encode(text, bos).unwrap()
}

/// Golden case `i` of the embedded target: prompt ids and 32 greedy tokens (transformers).
pub fn golden_case(i: usize) -> (Vec<u32>, Vec<u32>) {
    let dir = ferry_model::embedded::default_model_dir().join("golden/cases.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir).unwrap()).unwrap();
    let ids = |x: &serde_json::Value| -> Vec<u32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    (
        ids(&v["cases"][i]["prompt_ids"]),
        ids(&v["cases"][i]["greedy_ids"]),
    )
}

/// Collects tokens until the end; returns (tokens, finish or failure message).
pub async fn collect(mut g: Generation) -> (Vec<u32>, Result<FinishReason, String>) {
    let mut toks = Vec::new();
    while let Some(e) = g.events.recv().await {
        match e {
            EngineEvent::Token(t) => toks.push(t),
            EngineEvent::Finished(r) => return (toks, Ok(r)),
            EngineEvent::Failed(e) => return (toks, Err(e.message)),
            _ => {}
        }
    }
    (toks, Err("stream ended".into()))
}

/// Golden case 0, then, once its first token is out (so it is decoding), golden cases 1 and
/// 2 arriving late: `max_tokens` greedy tokens each. Returns each request's tokens and end.
pub async fn late_arrivals(
    e: &EngineHandle,
    max_tokens: usize,
) -> Vec<(Vec<u32>, Result<FinishReason, String>)> {
    let mut first = e
        .generate(job(golden_case(0).0, max_tokens, PrefillSource::Local))
        .expect("request 0 admitted");
    let head = loop {
        match first.events.recv().await {
            Some(EngineEvent::Token(t)) => break t,
            Some(EngineEvent::Finished(_) | EngineEvent::Failed(_)) | None => {
                panic!("request 0 ended before its first token")
            }
            Some(_) => {}
        }
    };
    let late: Vec<_> = (1..3)
        .map(|i| {
            e.generate(job(golden_case(i).0, max_tokens, PrefillSource::Local))
                .expect("a late request admitted")
        })
        .collect();
    let (rest, end) = collect(first).await;
    let mut out = vec![(std::iter::once(head).chain(rest).collect(), end)];
    for g in late {
        out.push(collect(g).await);
    }
    out
}

/// Waits (up to 5 s) until the engine holds no blocks and runs or queues nothing.
pub async fn wait_idle(e: &EngineHandle) {
    for _ in 0..500 {
        let s = e.stats().await.unwrap();
        if s.kv_blocks_used == 0 && s.running == 0 && s.waiting == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("engine did not go idle: {:?}", e.stats().await.unwrap());
}

/// Log-probabilities agree with a direct forward's log-softmax to 2e-4: the engine's rows come
/// from batched and multi-row forwards whose logits differ from the one-row forward's in float
/// rounding (~1e-5 relative on logits of magnitude ~10), and the reduction is f64 against the
/// reference's f32.
pub const LOGPROB_TOL: f32 = 2e-4;

/// One log-probability entry against `row`, the reference log-softmax of its position: the
/// chosen `token`'s value, `n` alternatives, each equal to its row value and the j-th largest.
pub fn assert_entry_matches(lp: &TokenLogprobs, token: u32, row: &[f32], n: usize, what: &str) {
    let d = (lp.logprob - row[token as usize]).abs();
    assert!(
        d <= LOGPROB_TOL,
        "{what}: {} vs {}",
        lp.logprob,
        row[token as usize]
    );
    assert_eq!(lp.top.len(), n, "{what}");
    let mut sorted = row.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    for (j, &(id, l)) in lp.top.iter().enumerate() {
        assert!(
            (l - row[id as usize]).abs() <= LOGPROB_TOL,
            "{what} top {j}"
        );
        assert!(
            (l - sorted[j]).abs() <= LOGPROB_TOL,
            "{what}: top {j} is the {j}-th largest"
        );
    }
}

/// One whole greedy generation the reference walked under `fixed:4` (`scripts/spec_replay.py`,
/// `models/tiny-k3-dspark/golden/replay.json`): the prompt, the target's greedy tokens, and the
/// rounds, drafts verified and drafts accepted the reference drafter gave on that text.
#[derive(Debug, serde::Deserialize)]
pub struct ReplayCase {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub tokens: Vec<u32>,
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
}

/// The embedded pair's replay golden.
pub fn replay_cases() -> Vec<ReplayCase> {
    let path = ferry_model::drafter::embedded_dir().join("golden/replay.json");
    let text = std::fs::read_to_string(&path).expect("models/tiny-k3-dspark/golden/replay.json");
    serde_json::from_str(&text).expect("replay.json parses")
}

/// Tokens, the end, and the request's speculative counts, which must come at most once and
/// right before the end.
pub async fn collect_spec(
    mut g: Generation,
) -> (Vec<u32>, Result<FinishReason, String>, Option<SpecCounts>) {
    let mut toks = Vec::new();
    let mut spec = None;
    while let Some(e) = g.events.recv().await {
        match e {
            EngineEvent::Token(t) => {
                assert!(spec.is_none(), "a token after the speculative counts");
                toks.push(t);
            }
            EngineEvent::Speculation(c) => {
                assert!(spec.is_none(), "speculative counts sent twice");
                spec = Some(c);
            }
            EngineEvent::Finished(r) => return (toks, Ok(r), spec),
            EngineEvent::Failed(e) => return (toks, Err(e.message), spec),
            other => assert!(spec.is_none(), "{other:?} after the speculative counts"),
        }
    }
    (toks, Err("stream ended".into()), spec)
}

/// The first GPU backend that opens: CUDA device 0, then (in a `rocm` build) ROCm device 0 —
/// on a machine without an AMD GPU, the CPU HIP of `scripts/hip_emu.sh`. `Err` says why none
/// did.
pub fn first_gpu() -> Result<ferry_kernels::backend::Backend, String> {
    use ferry_kernels::backend::Backend;
    #[cfg_attr(not(feature = "rocm"), allow(unused_mut))]
    let mut why = match ferry_kernels::cuda::CudaDevice::open(0) {
        Ok(d) => return Ok(Backend::Cuda(d)),
        Err(e) => e.to_string(),
    };
    #[cfg(feature = "rocm")]
    match ferry_kernels::rocm::RocmDevice::open(0) {
        Ok(d) => return Ok(Backend::Rocm(d)),
        Err(e) => why = format!("{why}; {e}"),
    }
    Err(why)
}
