//! Helpers the engine test files share (`mod common;` in each). Not every file uses every
//! helper, hence the `dead_code` allowance.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferry_kernels::cpu::sample::SamplingParams;
use ferry_model::engine::{
    EngineEvent, EngineHandle, FinishReason, GenerateJob, Generation, LayerSinkFn, PrefillSource,
    PrefillWork, SpecCounts, StopParams, TokenLogprobs,
};
use ferry_model::kv::{BlockId, LayerRows};
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
    let head = first_token(&mut first, "request 0").await;
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

/// The first token `g` streams (`what` names the request if it ends before one).
pub async fn first_token(g: &mut Generation, what: &str) -> u32 {
    loop {
        match g.events.recv().await {
            Some(EngineEvent::Token(t)) => return t,
            Some(EngineEvent::Finished(_) | EngineEvent::Failed(_)) | None => {
                panic!("{what} ended before its first token")
            }
            Some(_) => {}
        }
    }
}

/// Adds block `data` for destination block `at` to `runs`: onto the last run when `at`
/// follows it, else as a new run (what a transport sends as one write).
pub fn push_block(runs: &mut Vec<(BlockId, Vec<u8>)>, at: BlockId, data: &[u8]) {
    match runs.last_mut() {
        Some((first, run)) if first.0 as usize + run.len() / data.len() == at.0 as usize => {
            run.extend_from_slice(data)
        }
        _ => runs.push((at, data.to_vec())),
    }
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

/// A greedy request of `max_tokens` on `d` whose prompt a peer prefills: its generation and
/// what the engine reserved for the peer (the blocks and how many prompt tokens were cached).
pub async fn awaiting_remote(
    d: &EngineHandle,
    prompt: Vec<u32>,
    max_tokens: usize,
) -> (Generation, (Vec<BlockId>, usize)) {
    let mut g = d
        .generate(job(
            prompt,
            max_tokens,
            PrefillSource::Remote { local_threshold: 0 },
        ))
        .unwrap();
    let Some(EngineEvent::Reserved {
        blocks,
        cached_tokens,
    }) = g.events.recv().await
    else {
        panic!("expected a reservation");
    };
    (g, (blocks, cached_tokens))
}

/// How a test's prefill peer sends the drafter's context layers ([`remote_prefill`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ship {
    /// Not at all: the decode engine gets only the target's layers.
    Nothing,
    /// Through the engine thread (`EngineHandle::write_kv`, the layers after the target's).
    EngineThread,
    /// Landed from the sink's thread (`EngineHandle::draft_landing`), as a decode worker's
    /// receiving thread does.
    Landing,
}

/// Plays the prefill peer: a prefill job on `p` whose target layers are copied into the
/// decode engine `d` through its engine thread, and whose drafter pool layers go as `ship`
/// says (the in-process equivalent of a transport that sends the drafter layers as transfer
/// layers after the target's), as runs of consecutive destination blocks, one write each.
/// Returns the first token and the bytes sent.
pub async fn remote_prefill(
    p: &EngineHandle,
    d: &EngineHandle,
    prompt: Vec<u32>,
    (dest, skip_tokens): (Vec<BlockId>, usize),
    ship: Ship,
) -> (u32, u64) {
    let first_dest = skip_tokens / p.kv_layout().page_size;
    let landed = Arc::new(AtomicU64::new(0));
    let landing = (ship == Ship::Landing).then(|| d.draft_landing().expect("a drafter landing"));
    let target_layers = p.kv_layout().num_layers;
    let copy = |drafter: bool| {
        let (counted, d, dest, landing) =
            (landed.clone(), d.clone(), dest.clone(), landing.clone());
        Box::new(
            move |layer: usize, blocks: &[BlockId], rows: &LayerRows<'_>| -> Result<(), String> {
                let mut runs: Vec<(BlockId, Vec<u8>)> = Vec::new();
                for (j, b) in blocks.iter().enumerate() {
                    let data = rows.block(*b).map_err(|e| e.to_string())?;
                    counted.fetch_add(data.len() as u64, Ordering::Relaxed);
                    push_block(&mut runs, dest[first_dest + j], data);
                }
                for (first, run) in runs {
                    match (&landing, drafter) {
                        (Some(l), true) => {
                            // SAFETY: the destination blocks are reserved for this remote
                            // prefill (the engine's `Reserved` event), which has not completed;
                            // `d` is alive.
                            unsafe { l.write(layer, first, &run) }.map_err(|e| e.to_string())?
                        }
                        _ => d
                            .write_kv(layer + if drafter { target_layers } else { 0 }, first, run)
                            .map_err(|e| e.to_string())?,
                    }
                }
                Ok(())
            },
        ) as LayerSinkFn
    };
    let out = p
        .prefill_work(PrefillWork {
            prompt,
            sampling: greedy(),
            controls: Default::default(),
            stop: StopParams::max_tokens(1),
            logprobs: None,
            prompt_logprobs: None,
            skip_tokens,
            on_layer: copy(false),
            on_draft_layer: (ship != Ship::Nothing).then(|| copy(true)),
            grammar: None,
            rows_on_device: false,
        })
        .await
        .unwrap();
    (out.first_token, landed.load(Ordering::Relaxed))
}

/// A decode engine `d` speculates from its first step on a prompt prefilled by `p` with the
/// drafter's context shipped (through the engine thread or landed from the sink's thread),
/// exactly as `local` does with the prompt prefilled itself (same rounds, drafts, acceptances,
/// tokens); without the context it does not speculate. The three engines are DSpark engines
/// of one config and device.
pub async fn drafter_context_lands_as_a_local_prefill(
    p: &EngineHandle,
    d: &EngineHandle,
    local: &EngineHandle,
) {
    let (prompt, expected) = golden_case(2);
    // The same request prefilled where it decodes: the shipped context must be that one, so
    // the rounds, drafts and acceptances are the same, not just "some".
    let (toks, _, want) = collect_spec(
        local
            .generate(job(prompt.clone(), 32, PrefillSource::Local))
            .unwrap(),
    )
    .await;
    assert_eq!(toks, expected, "a local prefill");
    let want = want.expect("a local prefill speculates");
    wait_idle(local).await;
    // The first run lands the whole prompt's context from this thread; the later ones reuse
    // its cached whole blocks (valid drafter rows) and get the tail from the peer, with its
    // drafter rows through the engine thread, then without them (no speculation).
    for ship in [Ship::Landing, Ship::EngineThread, Ship::Nothing] {
        let before = d.stats().await.unwrap();
        let (g, reserved) = awaiting_remote(d, prompt.clone(), 32).await;
        let (first, bytes) = remote_prefill(p, d, prompt.clone(), reserved, ship).await;
        d.remote_done(g.id, first, bytes).unwrap();
        let (toks, end, spec) = collect_spec(g).await;
        assert_eq!(end, Ok(FinishReason::Length));
        assert_eq!(toks, expected, "drafter context: {ship:?}");
        let after = d.stats().await.unwrap();
        let rounds = after.spec_rounds - before.spec_rounds;
        // Allowed to speculate either way, so the counts come (zero rounds without context).
        assert_eq!(spec.map(|c| c.rounds), Some(rounds));
        if ship == Ship::Nothing {
            assert_eq!(rounds, 0, "no drafter context, no speculation: {after:?}");
        } else {
            // 31 tokens after the peer's first one; every step drafts.
            assert!(
                rounds >= 8,
                "{ship:?}: decode speculated from its first step: {after:?}"
            );
            assert_eq!(spec, Some(want), "{ship:?}: as if prefilled here");
        }
        wait_idle(d).await;
    }
    wait_idle(p).await;
}
