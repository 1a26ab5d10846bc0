//! The engine on either backend (`EngineConfig::device`): one contract, CPU and CUDA.
//!
//! Runs everywhere: an engine asked for a GPU that cannot be opened refuses to start, naming it;
//! one on `auto` runs on the GPU when one opens, else on the CPU, keeps its drafter either way,
//! and serves the golden continuation.
//!
//! `#[ignore]`d (need an NVIDIA GPU; run on the GPU machine with `--include-ignored`, see
//! docs/gpu.md; without a GPU they print why they skip and pass): the CUDA engine in exact mode
//! against the CPU engine on the embedded model —
//!
//! - greedy outputs of concurrent requests and of a prefix-cache hit are identical;
//! - a prefill job ships the same blocks in the same order as the CPU engine, with the same
//!   first token, fresh and with blocks reused from the prefill engine's prefix cache, and
//!   layer by layer: some layer reaches the sink before the last layer is computed.
//!   Tolerance per shipped row: max |Δ| ≤ 1e-4 · max|row|. Both backends compute the latent in
//!   f32 from the same weights; the GPU differs in summation order and in its bf16-weight
//!   GEMMs (activations split into bf16 hi + lo, ~16 mantissa bits), which model/tests/
//!   gpu_parity.rs measured at ~5e-6 relative on logits and within this bound on cache rows;
//! - KV crosses between backends both ways (CPU prefill → CUDA decode exercises peers' writes
//!   copied straight into the device cache, CUDA prefill → CPU decode the staging ring for
//!   shipping) with the CPU-only greedy tokens;
//! - a CUDA engine keeps no KV rows on the host (its pool is ids-only, `kv_host_row_bytes` 0);
//!   shipping stages through a page-locked ring of 4 layers of the job's blocks;
//! - fast mode (bf16 device cache) ships exactly its device cache's bf16 rows (bit for bit
//!   against the same forward run directly on a GPU-resident `DeepseekModel`), layer 0 within 1e-2 · max|row| of
//!   the CPU's (deeper layers drift with fast mode's numerics and are reported, not bounded),
//!   and decodes from a CPU peer's KV (converted to bf16 on the way, as a prefill worker does);
//! - a fast-mode prefill job's rows leave as bf16 bytes (half of f32's), equal bit for bit to
//!   its device cache, and a fast-mode decode engine fed those bytes untouched decodes what a
//!   plain fast-mode run does;
//! - decode steps replayed from CUDA graphs give the eager engine's tokens;
//! - penalties, `logit_bias` and `min_tokens` (processed on the host for the rows that use
//!   them) give the CPU engine's greedy tokens on the CUDA engine, graph-replayed and
//!   speculating, and in a prefill job's first token; log-probabilities agree with the CPU
//!   engine's to 1e-3;
//! - prompt log-probabilities (`echo`: the prompt rows reduced in the forward, in chunks) of a
//!   local prefill and of a prefill job agree with the CPU engine's to 1e-3, with the same
//!   tokens named;
//! - a JSON-schema grammar's token mask gives the CPU engine's greedy tokens on the CUDA
//!   engine, graph-replayed and speculating;
//! - speculative decoding on the CUDA engine (the drafter on the device, from the forward's
//!   tapped hidden states copied there; sampling and verification on the device) gives the
//!   plain CUDA engine's and the CPU's greedy tokens, with drafts accepted.
//!
//! Every test ends with every KV block back in the pool.

mod common;

use std::sync::{Arc, Mutex};

use ferry_kernels::cpu::logits::LogitsControls;
use ferry_kernels::Device;
use ferry_model::deepseek::DeepseekModel;
use ferry_model::drafter::{Drafter, DsparkDrafter};
use ferry_model::engine::{
    EngineConfig, EngineEvent, EngineHandle, EngineStats, FinishReason, GenerateJob, Generation,
    GpuMode, LayerSinkFn, PrefillSource, PrefillWork, PromptSteps, SpecConfig, StopParams,
    VerifyLen,
};
use ferry_model::kv::{BlockId, KvDtype, LayerRows};

use common::{collect, collect_spec, golden_case, greedy, job, late_arrivals, tokens, wait_idle};

fn model() -> DeepseekModel {
    DeepseekModel::load(&ferry_model::embedded::default_model_dir()).expect("model")
}

fn config(device: Device, gpu_mode: GpuMode) -> EngineConfig {
    EngineConfig {
        num_blocks: 64,
        max_batch_tokens: 256,
        device,
        gpu_mode,
        ..EngineConfig::default()
    }
}

fn engine(device: Device, gpu_mode: GpuMode) -> EngineHandle {
    EngineHandle::spawn(model(), config(device, gpu_mode)).expect("engine")
}

/// The embedded target with the embedded DSpark drafter, under `config`.
fn dspark_engine(config: EngineConfig) -> EngineHandle {
    let m = model();
    let drafter =
        DsparkDrafter::load(&ferry_model::drafter::embedded_dir(), m.config()).expect("drafter");
    EngineHandle::spawn_with(m, Some(Box::new(drafter) as Box<dyn Drafter>), config)
        .expect("a speculating engine starts")
}

/// A CUDA engine, or `None` (with the reason printed) when no GPU opens here.
fn cuda_engine(test: &str, mode: GpuMode) -> Option<EngineHandle> {
    if let Err(e) = Device::Cuda(0).probe() {
        eprintln!("skipping {test}: {e}");
        return None;
    }
    Some(engine(Device::Cuda(0), mode))
}

/// The first GPU that opens — cuda:0, else rocm:0 (in a `rocm` build; without an AMD GPU, the
/// CPU HIP of scripts/hip_emu.sh) — or `None` after saying why `test` skips.
fn first_gpu(test: &str) -> Option<Device> {
    let device = [Device::Cuda(0), Device::Rocm(0)]
        .into_iter()
        .find(|d| d.probe().is_ok());
    if device.is_none() {
        eprintln!("skipping {test}: no GPU opens");
    }
    device
}

/// An engine on [`first_gpu`], or `None` after saying why `test` skips.
fn gpu_engine(test: &str, mode: GpuMode) -> Option<EngineHandle> {
    first_gpu(test).map(|device| engine(device, mode))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unopenable_gpu_is_an_error_and_auto_picks_a_device_that_serves() {
    // A named GPU that cannot be opened fails the engine's start, naming it: never the CPU in
    // its place (GPU 99 exists nowhere, CUDA or ROCm; a binary without the `rocm` feature
    // cannot open any ROCm device, and scripts/hip_emu.sh's CPU HIP has only ordinal 0).
    for device in [Device::Cuda(99), Device::Rocm(99)] {
        let err = EngineHandle::spawn(model(), config(device, GpuMode::Exact))
            .err()
            .unwrap_or_else(|| panic!("an engine on {device} started"));
        assert!(
            err.to_string().contains(&device.to_string()),
            "the error names {device}: {err}"
        );
    }
    // `auto`: the first GPU that opens (CUDA, then ROCm), else the CPU; either way it serves
    // the golden tokens.
    let e = dspark_engine(config(Device::Auto, GpuMode::Exact));
    let want = [Device::Cuda(0), Device::Rocm(0)]
        .into_iter()
        .find(|d| d.probe().is_ok())
        .unwrap_or(Device::Cpu);
    assert_eq!(e.device(), want, "auto resolves to the GPU iff one opens");
    // The drafter is kept on every device.
    assert!(e.draft_kv_layers() > 0, "drafter kept on {}", e.device());
    let (prompt, expected) = golden_case(0);
    let (toks, end) = collect(e.generate(job(prompt, 32, PrefillSource::Local)).unwrap()).await;
    assert_eq!(end, Ok(FinishReason::Length));
    assert_eq!(toks, expected, "served on {}", e.device());
    wait_idle(&e).await;
}

/// Runs `prompts` concurrently, then a prompt sharing the first 150 tokens of `prompts[2]`
/// (two cached blocks); returns every continuation and the reused-token count of the last.
async fn greedy_runs(e: &EngineHandle, prompts: &[Vec<u32>]) -> (Vec<Vec<u32>>, u64) {
    let gens: Vec<Generation> = prompts
        .iter()
        .map(|p| {
            e.generate(job(p.clone(), 32, PrefillSource::Local))
                .unwrap()
        })
        .collect();
    let mut out = Vec::new();
    for g in gens {
        let (toks, end) = collect(g).await;
        assert_eq!(end, Ok(FinishReason::Length), "on {}", e.device());
        out.push(toks);
    }
    let before = e.stats().await.unwrap().prefill_reused_tokens;
    let mut hit = prompts[2][..150].to_vec();
    hit.extend(tokens(" and the LORD said unto Moses", false));
    let (toks, end) = collect(e.generate(job(hit, 32, PrefillSource::Local)).unwrap()).await;
    assert_eq!(end, Ok(FinishReason::Length));
    out.push(toks);
    let reused = e.stats().await.unwrap().prefill_reused_tokens - before;
    (out, reused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU: run on the GPU machine with --include-ignored (docs/gpu.md), or on the CPU HIP (scripts/hip_emu.sh)"]
async fn gpu_engine_greedy_equals_the_cpu_engine() {
    let Some(gpu) = gpu_engine("gpu_engine_greedy_equals_the_cpu_engine", GpuMode::Exact) else {
        return;
    };
    let cpu = engine(Device::Cpu, GpuMode::Exact);
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| golden_case(i).0).collect();
    let (want, want_reused) = greedy_runs(&cpu, &prompts).await;
    let (got, got_reused) = greedy_runs(&gpu, &prompts).await;
    assert_eq!(want_reused, 128, "the CPU engine reuses two cached blocks");
    assert_eq!(
        got_reused,
        want_reused,
        "the same prefix-cache hit on {}",
        gpu.device()
    );
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i}: {} engine vs CPU engine", gpu.device());
    }
    for (i, g) in got.iter().take(3).enumerate() {
        assert_eq!(
            *g,
            golden_case(i).1,
            "request {i} vs the golden continuation"
        );
    }
    eprintln!(
        "{} engine (exact): {} requests identical to the CPU engine, prefix hit reused {got_reused} tokens",
        gpu.device(),
        got.len()
    );
    wait_idle(&gpu).await;
    wait_idle(&cpu).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
async fn graph_replayed_decode_steps_equal_eager_ones() {
    let Some(graphs) = cuda_engine(
        "graph_replayed_decode_steps_equal_eager_ones",
        GpuMode::Exact,
    ) else {
        return;
    };
    let eager = EngineHandle::spawn(
        model(),
        EngineConfig {
            cuda_graphs: false,
            ..config(Device::Cuda(0), GpuMode::Exact)
        },
    )
    .expect("eager engine");
    // Three concurrent prompts of different lengths: the batch goes 3 → 2 → 1 sequences as
    // they finish (buckets 4, 2, 1, with padding), and a prefix hit follows.
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| golden_case(i).0).collect();
    let (want, _) = greedy_runs(&eager, &prompts).await;
    let (got, _) = greedy_runs(&graphs, &prompts).await;
    assert_eq!(got, want, "graph-replayed steps vs eager steps");
    let replayed = graphs.stats().await.unwrap().graph_steps;
    assert!(replayed > 0, "the graph engine replayed no step");
    assert_eq!(eager.stats().await.unwrap().graph_steps, 0);
    eprintln!("graphs: {replayed} decode steps replayed, tokens identical to the eager engine");
    wait_idle(&graphs).await;
    wait_idle(&eager).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
async fn a_batch_past_64_sequences_gives_the_eager_tokens_graphed_or_not() {
    let wide = |cuda_graphs| EngineConfig {
        num_blocks: 256,
        max_batch_tokens: 4096,
        max_running: 128,
        cuda_graphs,
        ..config(Device::Cuda(0), GpuMode::Exact)
    };
    if let Err(e) = Device::Cuda(0).probe() {
        eprintln!("skipping a_batch_past_64_sequences_gives_the_eager_tokens_graphed_or_not: {e}");
        return;
    }
    let graphs = EngineHandle::spawn(model(), wide(true)).expect("graph engine");
    let eager = EngineHandle::spawn(model(), wide(false)).expect("eager engine");
    // 70 sequences decoding together: with `FERRY_GRAPH_MAX_BATCH` >= 70, bucket 96 (a multiple
    // of 32, not a power of two) and 26 padding sequences.
    let prompts: Vec<Vec<u32>> = (0..70)
        .map(|i| tokens(&format!("{i}: and the LORD spake unto Moses, saying"), true))
        .collect();
    let run = |e: &EngineHandle| {
        let gens: Vec<Generation> = prompts
            .iter()
            .map(|p| {
                e.generate(job(p.clone(), 16, PrefillSource::Local))
                    .unwrap()
            })
            .collect();
        async move {
            let mut out = Vec::new();
            for g in gens {
                let (toks, end) = collect(g).await;
                assert_eq!(end, Ok(FinishReason::Length));
                out.push(toks);
            }
            out
        }
    };
    let want = run(&eager).await;
    let got = run(&graphs).await;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i}: graph-replayed (70 sequences) vs eager");
    }
    // Graphs go past 64 sequences by default (256; `FERRY_GRAPH_MAX_BATCH` lowers it, docs/gpu.md):
    // under a limit below 70 every step here runs eagerly and only the tokens are compared.
    let replayed = graphs.stats().await.unwrap().graph_steps;
    let limit = ferry_model::gpu::graph::graph_max_seqs(1);
    if limit >= 70 {
        assert!(
            replayed >= 10,
            "70 sequences decoded 15 steps together; {replayed} were replayed"
        );
    }
    eprintln!("70 sequences: {replayed} decode steps replayed (graph limit {limit} sequences), tokens identical to the eager engine");
    wait_idle(&graphs).await;
    wait_idle(&eager).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU: run on the GPU machine with --include-ignored (docs/gpu.md), or on the CPU HIP (scripts/hip_emu.sh)"]
async fn speculative_greedy_on_a_gpu_equals_plain_and_the_cpu() {
    let Some(device) = first_gpu("speculative_greedy_on_a_gpu_equals_plain_and_the_cpu") else {
        return;
    };
    let spec = dspark_engine(config(device, GpuMode::Exact));
    assert!(
        spec.draft_kv_layers() > 0,
        "the {device} engine kept its drafter"
    );
    let plain = engine(device, GpuMode::Exact);
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| golden_case(i).0).collect();
    let (want, _) = greedy_runs(&plain, &prompts).await;
    let (got, _) = greedy_runs(&spec, &prompts).await;
    assert_eq!(got, want, "speculative vs plain on {device}");
    for (i, g) in got.iter().take(3).enumerate() {
        assert_eq!(
            *g,
            golden_case(i).1,
            "request {i} vs the CPU's golden tokens"
        );
    }
    let st = spec.stats().await.unwrap();
    assert!(st.spec_rounds > 0, "no speculative round ran: {st:?}");
    assert!(st.spec_accepted_tokens > 0, "no draft accepted: {st:?}");
    // Rounds whose sequences all drafted a whole block replay the verify forward's graph
    // (CUDA graphs; a ROCm engine runs its rounds eagerly).
    if matches!(device, Device::Cuda(_)) {
        assert!(st.graph_steps > 0, "no round replayed from a graph: {st:?}");
        assert!(
            st.step_times.round.graphed > 0,
            "no round counted as graphed: {:?}",
            st.step_times
        );
    } else {
        assert_eq!(st.step_times.round.graphed, 0, "{:?}", st.step_times);
    }
    eprintln!(
        "speculative on {device}: {} rounds ({} steps from graphs), acceptance length {:.2}, tokens identical to plain decoding on the same device and the CPU",
        st.spec_rounds,
        st.graph_steps,
        (st.spec_accepted_tokens + st.spec_rounds) as f64 / st.spec_rounds as f64
    );
    wait_idle(&spec).await;
    wait_idle(&plain).await;
}

/// `fixed:2` on the first GPU with a drafter of block 4: every sequence of a round verifies
/// the same 2 drafts (a uniform round, one graph's shape on CUDA: 3 rows per sequence), and the
/// tokens are the CPU's golden ones in exact mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU: run on the GPU machine with --include-ignored (docs/gpu.md), or on the CPU HIP (scripts/hip_emu.sh)"]
async fn drafter_context_landed_off_the_engine_thread_speculates_as_a_local_prefill_on_a_gpu() {
    let test =
        "drafter_context_landed_off_the_engine_thread_speculates_as_a_local_prefill_on_a_gpu";
    let Some(device) = first_gpu(test) else {
        return;
    };
    // A fixed verify length: `goodput` picks by measured time, so two engines could differ.
    let spec = || {
        dspark_engine(EngineConfig {
            spec: SpecConfig {
                verify_len: VerifyLen::Fixed(4),
                ..SpecConfig::default()
            },
            ..config(device, GpuMode::Exact)
        })
    };
    let (p, d, local) = (spec(), spec(), spec());
    // The landing copies whole blocks into the drafter's device KV from the sink's thread;
    // the engine thread then only sees them complete.
    common::drafter_context_lands_as_a_local_prefill(&p, &d, &local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU: run on the GPU machine with --include-ignored (docs/gpu.md), or on the CPU HIP (scripts/hip_emu.sh)"]
async fn narrower_uniform_rounds_on_a_gpu_keep_the_golden_tokens() {
    let Some(device) = first_gpu("narrower_uniform_rounds_on_a_gpu_keep_the_golden_tokens") else {
        return;
    };
    let e = dspark_engine(EngineConfig {
        spec: SpecConfig {
            verify_len: VerifyLen::Fixed(2),
            ..SpecConfig::default()
        },
        ..config(device, GpuMode::Exact)
    });
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| golden_case(i).0).collect();
    let (got, _) = greedy_runs(&e, &prompts).await;
    for (i, g) in got.iter().take(3).enumerate() {
        assert_eq!(*g, golden_case(i).1, "request {i} on {device}");
    }
    let st = e.stats().await.unwrap();
    // Each round verifies 2 drafts of every sequence; a request's last rounds count only the
    // drafts it could use.
    assert!(st.spec_rounds > 0, "{st:?}");
    assert!(
        st.spec_drafted_tokens <= 2 * st.spec_rounds
            && st.spec_drafted_tokens + 8 >= 2 * st.spec_rounds,
        "{} drafts in {} rounds",
        st.spec_drafted_tokens,
        st.spec_rounds
    );
    if matches!(device, Device::Cuda(_)) {
        assert!(
            st.step_times.round.graphed > 0,
            "no uniform round replayed from a graph: {:?}",
            st.step_times
        );
    }
    // Greedy rounds of a fixed width keep their drafts on the device unless switched off.
    if queued_drafts_on() {
        assert!(
            st.spec_queued_steps > 0,
            "no round read its drafts on the device: {st:?}"
        );
    }
    wait_idle(&e).await;
}

/// Requests arriving while another speculates on `device` ([`late_arrivals`]): each must end
/// by length with the CPU's golden tokens. The engine's statistics after them.
async fn late_golden(e: &EngineHandle, device: Device) -> EngineStats {
    for (i, (toks, end)) in late_arrivals(e, 32).await.into_iter().enumerate() {
        assert_eq!(end, Ok(FinishReason::Length));
        assert_eq!(toks, golden_case(i).1, "request {i} on {device}");
    }
    e.stats().await.unwrap()
}

/// Rounds may keep their drafts on the device (`FERRY_QUEUED_DRAFTS` is not `0`).
fn queued_drafts_on() -> bool {
    std::env::var("FERRY_QUEUED_DRAFTS").map_or(true, |v| v.trim() != "0")
}

/// `PromptSteps::Apart` on the first GPU: requests arriving while another speculates get the
/// CPU's golden tokens in exact mode, no step with prompt work carries a decode row, and (on
/// CUDA) the rounds beside the late prompts are replayed from graphs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU: run on the GPU machine with --include-ignored (docs/gpu.md), or on the CPU HIP (scripts/hip_emu.sh)"]
async fn prompts_apart_on_a_gpu_keep_the_golden_tokens() {
    let Some(device) = first_gpu("prompts_apart_on_a_gpu_keep_the_golden_tokens") else {
        return;
    };
    let e = dspark_engine(EngineConfig {
        prompt_steps: PromptSteps::Apart,
        ..config(device, GpuMode::Exact)
    });
    let st = late_golden(&e, device).await;
    let t = st.step_times;
    assert_eq!((t.prompt.sequences, t.prompt.decode_rows), (0, 0), "{t:?}");
    assert!(st.spec_rounds > 0, "{st:?}");
    if matches!(device, Device::Cuda(_)) {
        assert!(t.round.graphed > 0, "no round replayed from a graph: {t:?}");
    }
    wait_idle(&e).await;
}

/// Greedy `fixed:2` rounds with late prompts mixed into their steps on the first GPU: each
/// step's round keeps its drafts on the device, the steps that carry prompt chunks included
/// (their eager forward scatters the drafts before the prompts' rows), and every request gets
/// the CPU's golden tokens in exact mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU: run on the GPU machine with --include-ignored (docs/gpu.md), or on the CPU HIP (scripts/hip_emu.sh)"]
async fn queued_drafts_beside_late_prompts_on_a_gpu_keep_the_golden_tokens() {
    let test = "queued_drafts_beside_late_prompts_on_a_gpu_keep_the_golden_tokens";
    let Some(device) = first_gpu(test) else {
        return;
    };
    let e = dspark_engine(EngineConfig {
        prompt_steps: PromptSteps::Mixed,
        spec: SpecConfig {
            verify_len: VerifyLen::Fixed(2),
            ..SpecConfig::default()
        },
        ..config(device, GpuMode::Exact)
    });
    let st = late_golden(&e, device).await;
    let t = st.step_times;
    assert!(
        t.prompt.decode_rows > 0,
        "no prompt step carried a round: {t:?}"
    );
    // Queued steps beyond the decode-only rounds are steps with prompt work.
    if queued_drafts_on() {
        assert!(
            st.spec_queued_steps > t.round.steps,
            "{} queued steps, {} decode-only rounds: {t:?}",
            st.spec_queued_steps,
            t.round.steps
        );
    }
    wait_idle(&e).await;
}

/// `PromptSteps::Auto` on CUDA: a prompt arriving beside a graphed round whose uncached tail
/// (one token: its three whole blocks are an earlier, finished request's, in the prefix cache)
/// is fewer rows than the round's drafts gets a forward of its own, and the round stays
/// graphed; under `Mixed`, the control, it rides in the round's step. The tokens are the same
/// either way, the running request's the CPU's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
async fn a_cache_hit_beside_a_graphed_round_gets_a_forward_of_its_own_on_cuda() {
    let test = "a_cache_hit_beside_a_graphed_round_gets_a_forward_of_its_own_on_cuda";
    if let Err(e) = Device::Cuda(0).probe() {
        eprintln!("skipping {test}: {e}");
        return;
    }
    let run = |prompt_steps: PromptSteps| async move {
        let e = dspark_engine(EngineConfig {
            prompt_steps,
            spec: SpecConfig {
                verify_len: VerifyLen::Fixed(4),
                ..SpecConfig::default()
            },
            ..config(Device::Cuda(0), GpuMode::Exact)
        });
        // 211 tokens: three whole blocks of 64 and a tail, cached when the request ends.
        let (cached, golden) = golden_case(2);
        let (toks, _) = collect(
            e.generate(job(cached.clone(), 32, PrefillSource::Local))
                .unwrap(),
        )
        .await;
        assert_eq!(
            toks, golden,
            "the request whose blocks are cached ({prompt_steps:?})"
        );
        let page = e.kv_layout().page_size;
        let hit = cached[..(cached.len() - 1) / page * page + 1].to_vec();
        let (prompt, golden) = golden_case(1);
        let mut first = e
            .generate(job(prompt, 32, PrefillSource::Local))
            .expect("the running request");
        let head = common::first_token(&mut first, "the running request").await;
        let late = e
            .generate(job(hit, 8, PrefillSource::Local))
            .expect("the hit");
        let (rest, end) = collect(first).await;
        assert_eq!(end, Ok(FinishReason::Length));
        let toks: Vec<u32> = std::iter::once(head).chain(rest).collect();
        assert_eq!(toks, golden, "the running request ({prompt_steps:?})");
        let (late, end) = collect(late).await;
        assert_eq!(end, Ok(FinishReason::Length));
        let st = e.stats().await.unwrap();
        wait_idle(&e).await;
        (late, st)
    };
    let (auto, st) = run(PromptSteps::Auto).await;
    let t = st.step_times;
    assert!(
        t.prompt.steps >= 3,
        "two requests' prompts, then the hit's: {t:?}"
    );
    assert_eq!(
        (t.prompt.sequences, t.prompt.decode_rows),
        (0, 0),
        "the hit's prompt rode in a round: {t:?}"
    );
    assert!(t.round.graphed > 0, "no round replayed from a graph: {t:?}");
    let (mixed, st) = run(PromptSteps::Mixed).await;
    assert!(
        st.step_times.prompt.sequences > 0,
        "the control: the hit arrived beside the running request's rounds: {:?}",
        st.step_times
    );
    assert_eq!(auto, mixed, "the hit's tokens, apart or mixed");
}

/// The reference's whole generations (`common::replay_cases`, see `spec_engine.rs`) on the
/// first GPU (CUDA, else ROCm: the CPU HIP of `scripts/hip_emu.sh`) in exact mode: the same
/// greedy tokens, and round for round the drafts the reference drafter accepted, so the device
/// engine's drafter context (written by graph-replayed rounds on CUDA) is the one the drafter
/// was trained on. Exact mode computes in f32 like the reference, and no draft of these runs is
/// within 1e-3 of a tie. Each generation's last round has room for fewer drafts than a block:
/// a GPU engine verifies the whole block there (it keeps the batch in the graph's shape) and
/// counts only the drafts the request could use, which must be the reference's counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU (CUDA, or ROCm / the CPU HIP): run on the GPU machine with --include-ignored (docs/gpu.md)"]
async fn whole_generations_on_a_gpu_accept_what_the_reference_drafter_accepts() {
    let Some(device) =
        first_gpu("whole_generations_on_a_gpu_accept_what_the_reference_drafter_accepts")
    else {
        return;
    };
    let e = dspark_engine(EngineConfig {
        spec: SpecConfig {
            verify_len: VerifyLen::Fixed(4),
            ..SpecConfig::default()
        },
        ..config(device, GpuMode::Exact)
    });
    for c in common::replay_cases() {
        let g = e
            .generate(job(
                c.prompt_ids.clone(),
                c.max_tokens,
                PrefillSource::Local,
            ))
            .unwrap();
        let (toks, end, spec) = collect_spec(g).await;
        assert_eq!(end, Ok(FinishReason::Length), "{}", c.prompt);
        assert_eq!(toks, c.tokens, "{}: the target's greedy text", c.prompt);
        assert_eq!(
            spec.map(|s| (s.rounds, s.drafted_tokens, s.accepted_tokens)),
            Some((c.rounds, c.drafted, c.accepted)),
            "{}: rounds, drafted, accepted",
            c.prompt
        );
    }
    if matches!(device, Device::Cuda(_)) {
        assert!(
            e.stats().await.unwrap().graph_steps > 0,
            "rounds replayed from graphs"
        );
    }
    wait_idle(&e).await;
}

/// Penalised greedy runs of the golden prompts (concurrent), and a prefill job's first token
/// with the same controls and a `min_tokens` mask.
async fn controlled_runs(e: &EngineHandle) -> (Vec<Vec<u32>>, u32) {
    let controls = LogitsControls {
        presence_penalty: 1.0,
        frequency_penalty: 0.5,
        repetition_penalty: 1.5,
        logit_bias: vec![(golden_case(0).1[0], -100.0), (golden_case(1).1[5], 4.0)],
    };
    let stop = StopParams {
        ignore_eos: true,
        min_tokens: 4,
        stop_token_ids: vec![golden_case(2).1[1]],
        ..StopParams::max_tokens(24)
    };
    let gens: Vec<Generation> = (0..3)
        .map(|i| {
            e.generate(GenerateJob {
                controls: controls.clone(),
                stop: stop.clone(),
                ..job(golden_case(i).0, 24, PrefillSource::Local)
            })
            .unwrap()
        })
        .collect();
    let mut out = Vec::new();
    for g in gens {
        out.push(collect(g).await.0);
    }
    let first = e
        .prefill_work(PrefillWork {
            prompt: golden_case(0).0,
            sampling: greedy(),
            controls,
            stop,
            logprobs: None,
            prompt_logprobs: None,
            skip_tokens: 0,
            on_layer: Box::new(|_, _, _| Ok(())),
            on_draft_layer: None,
            grammar: None,
            rows_on_device: false,
        })
        .await
        .expect("prefill job")
        .first_token;
    (out, first)
}

/// Each token's log-probabilities (3 alternatives) for golden case 0, greedy.
async fn logprob_run(e: &EngineHandle) -> Vec<ferry_model::engine::TokenLogprobs> {
    let options = ferry_model::engine::GenerateOptions {
        logprobs: Some(3),
        ..Default::default()
    };
    let mut g = e
        .generate_with(job(golden_case(0).0, 16, PrefillSource::Local), options)
        .unwrap();
    let mut out = Vec::new();
    while let Some(ev) = g.events.recv().await {
        match ev {
            EngineEvent::Logprobs(lp) => out.push(lp),
            EngineEvent::Finished(_) | EngineEvent::Failed(_) => break,
            _ => {}
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU: run on the GPU machine with --include-ignored (docs/gpu.md), or on the CPU HIP (scripts/hip_emu.sh)"]
async fn logits_controls_on_a_gpu_equal_the_cpu_engine() {
    let Some(graphs) = gpu_engine(
        "logits_controls_on_a_gpu_equal_the_cpu_engine",
        GpuMode::Exact,
    ) else {
        return;
    };
    let cpu = engine(Device::Cpu, GpuMode::Exact);
    let (want, want_first) = controlled_runs(&cpu).await;
    for (i, w) in want.iter().enumerate() {
        assert_ne!(
            w[..],
            golden_case(i).1[..w.len()],
            "request {i}: the controls matter"
        );
    }
    assert_ne!(
        want_first,
        golden_case(0).1[0],
        "the bias moves the prefill job's token"
    );
    let (got, first) = controlled_runs(&graphs).await;
    assert_eq!(
        got,
        want,
        "graph-replayed {} engine vs CPU engine",
        graphs.device()
    );
    assert_eq!(first, want_first, "prefill job's first token");
    // Log-probabilities (rows copied to the host on the GPU) agree with the CPU engine's to
    // 1e-3: exact mode's logits are within ~5e-6 relative of the CPU's (gpu_parity.rs).
    let (cpu_lp, gpu_lp) = (logprob_run(&cpu).await, logprob_run(&graphs).await);
    assert_eq!(cpu_lp.len(), 16);
    for (k, (c, g)) in cpu_lp.iter().zip(&gpu_lp).enumerate() {
        assert_eq!((c.token, c.top.len()), (g.token, g.top.len()), "token {k}");
        assert!(
            (c.logprob - g.logprob).abs() <= 1e-3,
            "token {k}: {c:?} vs {g:?}"
        );
        for ((ct, cl), (gt, gl)) in c.top.iter().zip(&g.top) {
            assert_eq!(ct, gt, "token {k}");
            assert!((cl - gl).abs() <= 1e-3, "token {k}");
        }
    }
    let spec = dspark_engine(config(graphs.device(), GpuMode::Exact));
    let (got, _) = controlled_runs(&spec).await;
    assert_eq!(
        got,
        want,
        "speculating {} engine vs CPU engine",
        spec.device()
    );
    let st = spec.stats().await.unwrap();
    assert!(st.spec_rounds > 0, "no speculative round ran: {st:?}");
    eprintln!(
        "logits controls on {}: identical to the CPU engine (graphs where CUDA, speculation: {} rounds)",
        graphs.device(),
        st.spec_rounds
    );
    for e in [&graphs, &cpu, &spec] {
        wait_idle(e).await;
    }
}

/// The prompt log-probabilities (3 alternatives) of golden case 2 (211 tokens) from a local
/// prefill and from a prefill job.
async fn prompt_logprob_runs(
    e: &EngineHandle,
) -> (
    Vec<ferry_model::engine::TokenLogprobs>,
    Vec<ferry_model::engine::TokenLogprobs>,
) {
    let prompt = golden_case(2).0;
    let options = ferry_model::engine::GenerateOptions {
        prompt_logprobs: Some(3),
        ..Default::default()
    };
    let mut g = e
        .generate_with(job(prompt.clone(), 2, PrefillSource::Local), options)
        .unwrap();
    let mut local = Vec::new();
    while let Some(ev) = g.events.recv().await {
        match ev {
            EngineEvent::PromptLogprobs(lps) => local = lps,
            EngineEvent::Finished(_) | EngineEvent::Failed(_) => break,
            _ => {}
        }
    }
    let job = e
        .prefill_work(PrefillWork {
            prompt,
            sampling: greedy(),
            controls: LogitsControls::default(),
            stop: StopParams::max_tokens(1),
            logprobs: None,
            prompt_logprobs: Some(3),
            skip_tokens: 0,
            on_layer: Box::new(|_, _, _| Ok(())),
            on_draft_layer: None,
            grammar: None,
            rows_on_device: false,
        })
        .await
        .expect("prefill job");
    (local, job.prompt_logprobs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU: run on the GPU machine with --include-ignored (docs/gpu.md), or on the CPU HIP (scripts/hip_emu.sh)"]
async fn prompt_logprobs_on_a_gpu_equal_the_cpu_engine() {
    let Some(gpu) = gpu_engine(
        "prompt_logprobs_on_a_gpu_equal_the_cpu_engine",
        GpuMode::Exact,
    ) else {
        return;
    };
    let cpu = engine(Device::Cpu, GpuMode::Exact);
    let (cpu_local, cpu_job) = prompt_logprob_runs(&cpu).await;
    let (gpu_local, gpu_job) = prompt_logprob_runs(&gpu).await;
    let n = golden_case(2).0.len() - 1;
    for (what, c, g) in [
        ("local", &cpu_local, &gpu_local),
        ("job", &cpu_job, &gpu_job),
    ] {
        assert_eq!((c.len(), g.len()), (n, n), "{what}");
        for (k, (c, g)) in c.iter().zip(g).enumerate() {
            assert_eq!((c.token, c.top.len()), (g.token, g.top.len()), "{what} {k}");
            assert!(
                (c.logprob - g.logprob).abs() <= 1e-3,
                "{what} {k}: {c:?} vs {g:?}"
            );
            for ((_, cl), (_, gl)) in c.top.iter().zip(&g.top) {
                assert!((cl - gl).abs() <= 1e-3, "{what} {k}");
            }
        }
    }
    eprintln!(
        "prompt logprobs on {}: {n} entries within 1e-3 of the CPU engine's",
        gpu.device()
    );
    wait_idle(&gpu).await;
    wait_idle(&cpu).await;
}

/// Greedy runs of the three golden prompts (concurrent) constrained to a JSON schema, stopping
/// when the grammar closes the object: the tokens and the finish reasons.
async fn grammar_runs(e: &EngineHandle) -> Vec<(Vec<u32>, Result<FinishReason, String>)> {
    let dir = ferry_model::embedded::default_model_dir();
    let tokenizer = Arc::new(ferry_model::tokenizer::Tokenizer::from_dir(&dir).expect("tokenizer"));
    let c = model().config().clone();
    let compiler =
        ferry_model::grammar::GrammarCompiler::new(tokenizer, c.vocab_size, &c.eos_token_ids)
            .expect("grammar compiler");
    let schema = ferry_model::grammar::OutputGrammar::JsonSchema(serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tribe": {"enum": ["Judah", "Levi", "Dan"]}
        },
        "required": ["name", "age", "tribe"],
        "additionalProperties": false
    }));
    let gens: Vec<Generation> = (0..3)
        .map(|i| {
            e.generate(GenerateJob {
                stop: StopParams::max_tokens(64),
                grammar: Some(compiler.compile(&schema).expect("schema compiles")),
                ..job(golden_case(i).0, 64, PrefillSource::Local)
            })
            .unwrap()
        })
        .collect();
    let mut out = Vec::new();
    for g in gens {
        out.push(collect(g).await);
    }
    out
}

/// Structured output's token mask (a host round trip for the constrained rows on a GPU, like
/// the controls): a GPU engine (graph-replayed on CUDA) and a speculating one give the CPU
/// engine's greedy tokens under a JSON schema, and the output is that schema's JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU: run on the GPU machine with --include-ignored (docs/gpu.md), or on the CPU HIP (scripts/hip_emu.sh)"]
async fn json_schema_output_on_a_gpu_equals_the_cpu_engine() {
    let Some(graphs) = gpu_engine(
        "json_schema_output_on_a_gpu_equals_the_cpu_engine",
        GpuMode::Exact,
    ) else {
        return;
    };
    let cpu = engine(Device::Cpu, GpuMode::Exact);
    let want = grammar_runs(&cpu).await;
    let dir = ferry_model::embedded::default_model_dir();
    let tokenizer = ferry_model::tokenizer::Tokenizer::from_dir(&dir).expect("tokenizer");
    for (i, (toks, reason)) in want.iter().enumerate() {
        assert!(reason.is_ok(), "request {i}: {reason:?}");
        let text = tokenizer.decode(toks, false).expect("decode");
        let v: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("request {i}: {text:?} is not JSON: {e}"));
        assert!(
            ["Judah", "Levi", "Dan"].contains(&v["tribe"].as_str().unwrap_or("")),
            "request {i}: {text}"
        );
    }
    assert_eq!(
        grammar_runs(&graphs).await,
        want,
        "{} engine vs CPU engine",
        graphs.device()
    );
    let spec = dspark_engine(config(graphs.device(), GpuMode::Exact));
    assert_eq!(
        grammar_runs(&spec).await,
        want,
        "speculating {} engine vs CPU",
        spec.device()
    );
    let st = spec.stats().await.unwrap();
    eprintln!(
        "json schema on {}: identical to the CPU engine ({} speculative rounds)",
        graphs.device(),
        st.spec_rounds
    );
    for e in [&graphs, &cpu, &spec] {
        wait_idle(e).await;
    }
}

/// What a prefill job shipped, as its sink saw it: `(layer, index of the block among those
/// shipped, the rows' dtype, the block's bytes)` in call order.
type Raw = Vec<(usize, usize, KvDtype, Vec<u8>)>;
type Shipped = Arc<Mutex<Raw>>;

fn recorder(into: Shipped) -> LayerSinkFn {
    Box::new(move |layer, blocks, rows| {
        let mut v = into.lock().map_err(|e| e.to_string())?;
        for (j, b) in blocks.iter().enumerate() {
            let bytes = rows.block(*b).map_err(|e| e.to_string())?.to_vec();
            v.push((layer, j, rows.dtype(), bytes));
        }
        Ok(())
    })
}

/// Runs a prefill job and returns (first token, computed, reused, what it shipped as bytes).
async fn ship_raw(e: &EngineHandle, prompt: &[u32], skip: usize) -> (u32, usize, usize, Raw) {
    let rec: Shipped = Arc::default();
    let out = e
        .prefill(prompt.to_vec(), greedy(), skip, recorder(rec.clone()))
        .await
        .expect("prefill job");
    let shipped = std::mem::take(&mut *rec.lock().unwrap());
    (
        out.first_token,
        out.computed_tokens,
        out.reused_tokens,
        shipped,
    )
}

/// [`ship_raw`] with every block's rows widened to f32 (exact for f32, `hi + lo` for split rows).
async fn ship(
    e: &EngineHandle,
    prompt: &[u32],
    skip: usize,
) -> (u32, usize, usize, Vec<(usize, usize, Vec<f32>)>) {
    let (t, c, r, raw) = ship_raw(e, prompt, skip).await;
    let width = e.kv_layout().width;
    let widened = raw
        .into_iter()
        .map(|(l, j, dtype, bytes)| (l, j, dtype.widen(&bytes, width).expect("whole rows")))
        .collect();
    (t, c, r, widened)
}

/// Block `b` of `rows` as `to`'s bytes, as a prefill worker sends them to a destination of that
/// dtype: unchanged when the dtypes agree, else widened (`hi + lo`) or split as the fast cache
/// stores rows.
fn as_dtype(rows: &LayerRows<'_>, b: BlockId, to: KvDtype) -> Result<Vec<u8>, String> {
    let bytes = rows.block(b).map_err(|e| e.to_string())?;
    if rows.dtype() == to {
        return Ok(bytes.to_vec());
    }
    let f = rows
        .dtype()
        .widen(bytes, rows.width())
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    to.encode_into(&f, rows.width(), &mut out);
    Ok(out)
}

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    d / b.iter().map(|x| x.abs()).fold(0.0f32, f32::max).max(1e-30)
}

/// Compares what two engines shipped for the same job: same (layer, block) sequence, rows within
/// `tol` (relative to each CPU row's largest magnitude), counting the positions of the prompt
/// only (rows past the prompt's last position are not KV). Returns the worst error.
fn compare_shipped(
    got: &[(usize, usize, Vec<f32>)],
    want: &[(usize, usize, Vec<f32>)],
    valid_rows: impl Fn(usize) -> usize,
    width: usize,
    tol: f32,
) -> Vec<f32> {
    assert_eq!(got.len(), want.len(), "blocks shipped");
    let mut worst = Vec::new();
    for ((gl, gj, g), (wl, wj, w)) in got.iter().zip(want) {
        assert_eq!((gl, gj), (wl, wj), "the same layer and block order");
        if worst.len() <= *wl {
            worst.resize(wl + 1, 0.0f32);
        }
        for r in 0..valid_rows(*wj) {
            let (a, b) = (
                &g[r * width..(r + 1) * width],
                &w[r * width..(r + 1) * width],
            );
            let e = rel(a, b);
            assert!(
                e <= tol,
                "layer {wl} block {wj} row {r}: rel err {e} > {tol}"
            );
            worst[*wl] = worst[*wl].max(e);
        }
    }
    worst
}

/// The largest entry.
fn max(v: &[f32]) -> f32 {
    v.iter().copied().fold(0.0f32, f32::max)
}

/// Per-layer errors for a log line.
fn per_layer(v: &[f32]) -> String {
    v.iter()
        .enumerate()
        .map(|(l, e)| format!("L{l} {e:.1e}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
async fn cuda_prefill_job_ships_the_cpu_bytes() {
    let Some(gpu) = cuda_engine("cuda_prefill_job_ships_the_cpu_bytes", GpuMode::Exact) else {
        return;
    };
    let cpu = engine(Device::Cpu, GpuMode::Exact);
    let layout = cpu.kv_layout();
    let (page, width) = (layout.page_size, layout.width);
    let (prompt, _) = golden_case(2); // 211 tokens: 4 blocks, the last one partial
    let valid = |len: usize, skip: usize| move |j: usize| (len - skip - j * page).min(page);
    let mut worst = 0.0f32;
    // Fresh, shipping everything; then the destination already holds one block; then a
    // prompt whose first two blocks come from each prefill engine's own prefix cache.
    let mut hit = prompt[..150].to_vec();
    hit.extend(tokens(" and the LORD said unto Moses", false));
    for (p, skip, reused) in [(&prompt, 0, 0), (&prompt, page, 192), (&hit, 0, 128)] {
        let (wt, wc, wr, want) = ship(&cpu, p, skip).await;
        let (gt, gc, gr, got) = ship(&gpu, p, skip).await;
        assert_eq!((gt, gc, gr), (wt, wc, wr), "first token, computed, reused");
        assert_eq!(wr, reused, "prefix reuse on the prefill engine");
        let blocks = p.len().div_ceil(page) - skip / page;
        assert_eq!(
            want.len(),
            blocks * layout.num_layers,
            "CPU shipped every layer's blocks"
        );
        let e = max(&compare_shipped(
            &got,
            &want,
            valid(p.len(), skip),
            width,
            1e-4,
        ));
        eprintln!(
            "prefill job ({} tokens, skip {skip}, reused {wr}): shipped rows max rel err {e:.2e}",
            p.len()
        );
        worst = worst.max(e);
    }
    eprintln!("cuda prefill job (exact): shipped rows within {worst:.2e} of the CPU's");
    // Layer-wise: some layer's rows reached the sink before the last layer was computed (the
    // sink runs between layers, not after the whole forward).
    let early = gpu.stats().await.unwrap().kv_layers_shipped_early;
    eprintln!(
        "layer-wise shipping: {early} of {} shipped layers reached the sink before the last layer was computed",
        3 * layout.num_layers
    );
    assert!(
        early >= 1,
        "every layer was shipped after the whole forward"
    );
    wait_idle(&gpu).await;
    wait_idle(&cpu).await;
}

/// The prompt's latent rows after a fast-mode forward run directly on a GPU-resident `DeepseekModel`, in the
/// shape a prefill job ships them: `(layer, block, rows)` for blocks `0..` of every layer.
fn direct_fast_cache(prompt: &[u32], page: usize) -> Vec<(usize, usize, Vec<u8>)> {
    use ferry_model::deepseek::{BatchInputs, LogitsWanted, SeqInput};
    let dev = ferry_kernels::cuda::CudaDevice::open(0).expect("cuda:0 opened for the engine");
    let gpu = model().upload(&dev, GpuMode::Fast).expect("upload");
    let blocks = prompt.len().div_ceil(page);
    let mut cache = gpu.new_kv_cache(blocks, page).expect("cache");
    let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
    let batch = BatchInputs {
        prompt_logprobs: Vec::new(),
        drafts_on_device: None,
        seqs: vec![SeqInput {
            tokens: prompt,
            start_pos: 0,
            block_table: &table,
            logits: LogitsWanted::Last,
        }],
    };
    gpu.forward(&batch, &mut cache).expect("forward");
    let block_bytes = cache.dtype().block_bytes(cache.layout());
    let mut out = Vec::new();
    for l in 0..cache.layout().num_layers {
        let layer = cache.download_layer_bytes(l).expect("download");
        for (j, rows) in layer.chunks_exact(block_bytes).enumerate() {
            out.push((l, j, rows.to_vec()));
        }
    }
    out
}

/// Plays the transport: runs a prefill job on `p` and writes each shipped block into `d`, in
/// `d`'s cache dtype: block by block through the engine thread (`EngineHandle::write_kv`), or
/// with `direct` as a decode worker's TCP receiver does: runs of
/// consecutive destination blocks copied into the device cache from this thread
/// (`EngineHandle::device_kv_writer`).
async fn remote_prefill_via(
    p: &EngineHandle,
    d: &EngineHandle,
    prompt: Vec<u32>,
    (dest, skip_tokens): (Vec<BlockId>, usize),
    direct: bool,
) -> (u32, u64) {
    let d2 = d.clone();
    let writer = direct.then(|| d.device_kv_writer().expect("a GPU engine's writer"));
    let landed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = landed.clone();
    let first_dest = skip_tokens / p.kv_layout().page_size;
    // In the destination's dtype, as a prefill worker sends it (the wire's rule).
    let to = d.kv_dtype();
    let sink: LayerSinkFn = Box::new(move |layer, blocks, rows| {
        let mut runs: Vec<(BlockId, Vec<u8>)> = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let data = as_dtype(rows, *b, to)?;
            counted.fetch_add(data.len() as u64, std::sync::atomic::Ordering::Relaxed);
            let at = dest[first_dest + j];
            match writer.as_ref() {
                Some(_) => common::push_block(&mut runs, at, &data),
                None => d2.write_kv(layer, at, data).map_err(|e| e.to_string())?,
            }
        }
        if let Some(w) = writer.as_ref() {
            for (first, bytes) in runs {
                // SAFETY: the destination blocks are reserved for this remote prefill (the
                // engine's `Reserved` event), which has not completed.
                unsafe { w.write_run(layer, first, &bytes) }.map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    });
    let first = p
        .prefill(prompt, greedy(), skip_tokens, sink)
        .await
        .expect("remote prefill")
        .first_token;
    (first, landed.load(std::sync::atomic::Ordering::Relaxed))
}

/// Decodes `prompt` on `d` with its KV prefilled by `p`; returns the tokens.
async fn disaggregated(p: &EngineHandle, d: &EngineHandle, prompt: Vec<u32>) -> Vec<u32> {
    disaggregated_via(p, d, prompt, false).await
}

/// [`disaggregated`], the KV landed as [`remote_prefill_via`] says.
async fn disaggregated_via(
    p: &EngineHandle,
    d: &EngineHandle,
    prompt: Vec<u32>,
    direct: bool,
) -> Vec<u32> {
    let (g, reserved) = common::awaiting_remote(d, prompt.clone(), 32).await;
    let (first, bytes) = remote_prefill_via(p, d, prompt, reserved, direct).await;
    d.remote_done(g.id, first, bytes).unwrap();
    let (toks, end) = collect(g).await;
    assert_eq!(end, Ok(FinishReason::Length));
    assert_eq!(d.stats().await.unwrap().remote_prefills, 1);
    toks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
async fn kv_crosses_between_cpu_and_cuda_engines_both_ways() {
    let test = "kv_crosses_between_cpu_and_cuda_engines_both_ways";
    let (Some(gpu_p), Some(gpu_d)) = (
        cuda_engine(test, GpuMode::Exact),
        cuda_engine(test, GpuMode::Exact),
    ) else {
        return;
    };
    let (cpu_p, cpu_d) = (
        engine(Device::Cpu, GpuMode::Exact),
        engine(Device::Cpu, GpuMode::Exact),
    );
    let (prompt, expected) = golden_case(2);
    let up = disaggregated(&cpu_p, &gpu_d, prompt.clone()).await;
    assert_eq!(
        up, expected,
        "CPU prefill → CUDA decode (peer writes uploaded)"
    );
    let down = disaggregated(&gpu_p, &cpu_d, prompt).await;
    assert_eq!(
        down, expected,
        "CUDA prefill → CPU decode (shipped blocks downloaded)"
    );
    for e in [&gpu_p, &gpu_d, &cpu_p, &cpu_d] {
        wait_idle(e).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
async fn peer_runs_copied_from_the_receiving_thread_decode_like_a_local_prefill() {
    let test = "peer_runs_copied_from_the_receiving_thread_decode_like_a_local_prefill";
    let (Some(fast_d), Some(exact_d)) = (
        cuda_engine(test, GpuMode::Fast),
        cuda_engine(test, GpuMode::Exact),
    ) else {
        return;
    };
    let cpu_p = engine(Device::Cpu, GpuMode::Exact);
    assert!(
        cpu_p.device_kv_writer().is_none(),
        "a CPU engine has no device cache to copy into"
    );
    let (prompt, expected) = golden_case(2);
    // Exact mode: f32 rows from a CPU peer decode the CPU's golden tokens, as through the
    // engine thread (`kv_crosses_between_cpu_and_cuda_engines_both_ways`).
    let toks = disaggregated_via(&cpu_p, &exact_d, prompt.clone(), true).await;
    assert_eq!(
        toks, expected,
        "runs copied off the engine thread (exact mode)"
    );
    // Fast mode (bf16 cache): the same tokens whichever way the same bytes land.
    let fast_p = cuda_engine(test, GpuMode::Fast).expect("a second fast engine");
    let via_engine = disaggregated_via(&cpu_p, &fast_p, prompt.clone(), false).await;
    let direct = disaggregated_via(&cpu_p, &fast_d, prompt, true).await;
    assert_eq!(
        direct, via_engine,
        "fast mode: direct copies == engine-thread writes"
    );
    // A run that is not whole blocks, or reaches the graphs' scratch block past the pool,
    // writes nothing and says why.
    let w = fast_d.device_kv_writer().expect("writer");
    let layout = fast_d.kv_layout();
    let block = fast_d.kv_dtype().block_bytes(&layout);
    let last = BlockId(layout.num_blocks as u32 - 1);
    // SAFETY: both runs are refused before any copy (the bounds checks), so no block is written.
    let past = unsafe { w.write_run(0, last, &vec![0u8; 2 * block]) };
    assert!(
        past.is_err_and(|e| e.to_string().contains("outside")),
        "past the pool"
    );
    // SAFETY: as above.
    let ragged = unsafe { w.write_run(0, BlockId(0), &vec![0u8; block + 1]) };
    assert!(
        ragged.is_err_and(|e| e.to_string().contains("whole blocks")),
        "ragged run"
    );
    for e in [&fast_d, &exact_d, &fast_p, &cpu_p] {
        wait_idle(e).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
async fn fast_mode_engine_ships_bf16_rows_and_decodes_from_a_cpu_peer() {
    let test = "fast_mode_engine_ships_bf16_rows_and_decodes_from_a_cpu_peer";
    let (Some(fast_p), Some(fast_d)) = (
        cuda_engine(test, GpuMode::Fast),
        cuda_engine(test, GpuMode::Fast),
    ) else {
        return;
    };
    let (cpu_p, cpu_d) = (
        engine(Device::Cpu, GpuMode::Exact),
        engine(Device::Cpu, GpuMode::Exact),
    );
    let layout = cpu_p.kv_layout();
    let (page, width) = (layout.page_size, layout.width);
    let (prompt, expected) = golden_case(2);
    let (_, _, _, want) = ship(&cpu_p, &prompt, 0).await;
    let (_, _, _, got) = ship(&fast_p, &prompt, 0).await;
    let rope = model().config().qk_rope_head_dim;
    for (_, _, rows) in &got {
        assert!(
            rows.chunks_exact(width).all(|r| r[..width - rope]
                .iter()
                .all(|&v| half::bf16::from_f32(v).to_f32() == v)),
            "a fast-mode engine ships its bf16 latent rows exactly, widened to f32"
        );
    }
    // The transfer path is exact: what the engine ships is, bit for bit, the device cache of
    // the same forward run directly on a GPU-resident `DeepseekModel` (same kernels, same inputs).
    let len = prompt.len();
    let valid = |j: usize| (len - j * page).min(page);
    let split = KvDtype::Bf16Split { rope };
    let direct: Vec<_> = direct_fast_cache(&prompt, page)
        .into_iter()
        .map(|(l, j, b)| (l, j, split.widen(&b, width).expect("whole rows")))
        .collect();
    let exact = compare_shipped(&got, &direct, valid, width, 0.0);
    assert!(exact.iter().all(|&e| e == 0.0));
    // Against the CPU, fast mode's numerics show: layer 0's latent differs by the bf16
    // rounding of the cache (2⁻⁹ relative) and of the GEMM inputs, later layers compound the
    // bf16 activations and attention of the layers before (measured on one H200: layer 0
    // 4.4e-3, 1 7.5e-3, 2 7.5e-2, 3 4.3e-1 — the same drift as fast mode's logits,
    // docs/gpu.md). Only layer 0 is held to a bound (1e-2); the rest is reported.
    let e = compare_shipped(&got, &want, valid, width, f32::INFINITY);
    eprintln!(
        "fast mode: shipped rows vs the CPU's, worst per layer: {}",
        per_layer(&e)
    );
    assert!(e[0] <= 1e-2, "layer 0 of fast mode vs the CPU: {}", e[0]);
    // A fresh CPU peer and a fresh fast decode engine: every prompt block is uploaded.
    let toks = disaggregated(&cpu_d, &fast_d, prompt).await;
    let same = toks
        .iter()
        .zip(&expected)
        .take_while(|(a, b)| a == b)
        .count();
    eprintln!(
        "fast mode decode from a CPU peer's KV: {same}/{} greedy tokens before the first difference",
        expected.len()
    );
    assert_eq!(toks.len(), expected.len());
    for e in [&fast_p, &fast_d, &cpu_p, &cpu_d] {
        wait_idle(e).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
async fn cuda_engine_keeps_no_host_rows_and_ships_through_the_ring() {
    let test = "cuda_engine_keeps_no_host_rows_and_ships_through_the_ring";
    let Some(gpu) = cuda_engine(test, GpuMode::Exact) else {
        return;
    };
    let cpu = engine(Device::Cpu, GpuMode::Exact);
    let layout = gpu.kv_layout();
    let (page, width, layers) = (layout.page_size, layout.width, layout.num_layers);
    assert_eq!(gpu.kv_dtype(), KvDtype::F32, "exact mode's cache is f32");
    let before = gpu.stats().await.unwrap();
    assert_eq!(
        before.kv_host_row_bytes, 0,
        "the CUDA engine's pool keeps block ids only"
    );
    assert_eq!(
        before.kv_host_staging_bytes, 0,
        "no ring before the first job"
    );
    // The CPU engine's pool is its KV: every layer's blocks in f32.
    assert_eq!(
        cpu.stats().await.unwrap().kv_host_row_bytes,
        (layers * layout.num_blocks * page * width * 4) as u64
    );
    let (prompt, _) = golden_case(2);
    let (_, _, _, raw) = ship_raw(&gpu, &prompt, 0).await;
    let blocks = prompt.len().div_ceil(page);
    assert_eq!(raw.len(), blocks * layers, "every layer's blocks shipped");
    for (l, j, dtype, bytes) in &raw {
        assert_eq!(*dtype, KvDtype::F32, "layer {l} block {j}");
        assert_eq!(bytes.len(), page * width * 4, "layer {l} block {j}");
    }
    let after = gpu.stats().await.unwrap();
    assert_eq!(
        after.kv_host_row_bytes, 0,
        "still no host rows after shipping"
    );
    let ring = (4.min(layers) * blocks * page * width * 4) as u64;
    assert_eq!(
        after.kv_host_staging_bytes, ring,
        "the ring holds 4 layers of the job's blocks"
    );
    eprintln!(
        "cuda engine (exact): no host KV rows (the CPU engine's pool: {} bytes); shipping ring {ring} bytes",
        layers * layout.num_blocks * page * width * 4
    );
    wait_idle(&gpu).await;
    wait_idle(&cpu).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
async fn fast_mode_ships_its_bf16_bytes_and_decodes_a_bf16_peer_like_a_plain_run() {
    let test = "fast_mode_ships_its_bf16_bytes_and_decodes_a_bf16_peer_like_a_plain_run";
    // Fresh engines each: a prompt cached on an engine would have only its tail recomputed.
    let (Some(shipper), Some(fast_p), Some(fast_d), Some(plain)) = (
        cuda_engine(test, GpuMode::Fast),
        cuda_engine(test, GpuMode::Fast),
        cuda_engine(test, GpuMode::Fast),
        cuda_engine(test, GpuMode::Fast),
    ) else {
        return;
    };
    let rope = model().config().qk_rope_head_dim;
    assert_eq!(
        shipper.kv_dtype(),
        KvDtype::Bf16Split { rope },
        "fast mode's cache is bf16 with the RoPE key as a pair"
    );
    let layout = shipper.kv_layout();
    let (page, width, layers) = (layout.page_size, layout.width, layout.num_layers);
    let row_bytes = (width + rope) * 2;
    let (prompt, _) = golden_case(2);
    let len = prompt.len();
    // The job's rows leave as the cache's bf16 bytes, bit for bit those of the same forward run
    // directly on a GPU-resident model, at half of f32's bytes.
    let (_, _, _, raw) = ship_raw(&shipper, &prompt, 0).await;
    let direct = direct_fast_cache(&prompt, page);
    assert_eq!(raw.len(), direct.len(), "blocks shipped");
    for ((l, j, dtype, bytes), (dl, dj, want)) in raw.iter().zip(&direct) {
        assert_eq!((l, j), (dl, dj), "the same layer and block order");
        assert_eq!(*dtype, KvDtype::Bf16Split { rope }, "layer {l} block {j}");
        assert_eq!(bytes.len(), page * row_bytes, "layer {l} block {j}");
        let valid = (len - j * page).min(page) * row_bytes;
        assert!(
            bytes[..valid] == want[..valid],
            "layer {l} block {j}: shipped bytes differ from the device cache's"
        );
    }
    // A fast decode engine fed a fast peer's bf16 bytes as they are decodes what a plain
    // fast-mode run of the same prompt decodes.
    let (want, end) = collect(
        plain
            .generate(job(prompt.clone(), 32, PrefillSource::Local))
            .unwrap(),
    )
    .await;
    assert_eq!(end, Ok(FinishReason::Length));
    let got = disaggregated(&fast_p, &fast_d, prompt).await;
    assert_eq!(
        got, want,
        "fast prefill → fast decode vs a plain fast-mode run"
    );
    let received = fast_d.stats().await.unwrap().kv_bytes_received;
    assert_eq!(
        received,
        (len.div_ceil(page) * layers * page * row_bytes) as u64,
        "split bf16 rows on the wire: (width + rope) bf16 per row"
    );
    eprintln!(
        "fast mode: shipped bf16 bytes equal the device cache's; decode from a bf16 peer ({received} bytes) gives the plain run's {} tokens",
        want.len()
    );
    for e in [&shipper, &fast_p, &fast_d, &plain] {
        wait_idle(e).await;
    }
}

/// The serving engine on a ROCm device (a `rocm` build on a machine with an AMD GPU; never run
/// here, where none exists): exact mode gives the CPU engine's golden tokens, and a prefill job
/// ships rows within the CUDA test's tolerance of the CPU's.
#[cfg(feature = "rocm")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an AMD GPU and the `rocm` feature (docs/gpu.md)"]
async fn rocm_engine_serves_the_cpu_engines_tokens() {
    if let Err(e) = Device::Rocm(0).probe() {
        eprintln!("skipping rocm_engine_serves_the_cpu_engines_tokens: {e}");
        return;
    }
    let e = engine(Device::Rocm(0), GpuMode::Exact);
    assert_eq!(e.device(), Device::Rocm(0));
    for i in 0..3 {
        let (prompt, expected) = golden_case(i);
        let (toks, end) = collect(e.generate(job(prompt, 32, PrefillSource::Local)).unwrap()).await;
        assert_eq!(end, Ok(FinishReason::Length));
        assert_eq!(toks, expected, "golden prompt {i} on rocm:0");
    }
    let cpu = engine(Device::Cpu, GpuMode::Exact);
    let prompt = golden_case(2).0;
    let (page, width) = (cpu.kv_layout().page_size, cpu.kv_layout().width);
    let (gt, _, _, got) = ship(&e, &prompt, 0).await;
    let (wt, _, _, want) = ship(&cpu, &prompt, 0).await;
    assert_eq!(gt, wt, "first token");
    let len = prompt.len();
    let worst = compare_shipped(&got, &want, |j| (len - j * page).min(page), width, 1e-4);
    eprintln!(
        "rocm prefill job: shipped rows within {:.2e} of the CPU's",
        max(&worst)
    );
    // A CPU peer's KV copied into a ROCm cache from this thread, as a decode worker's receiver
    // does (`DeviceKvWriter`), decodes the golden tokens.
    let d = engine(Device::Rocm(0), GpuMode::Exact);
    let (prompt, expected) = golden_case(2);
    let toks = disaggregated_via(&cpu, &d, prompt, true).await;
    assert_eq!(
        toks, expected,
        "CPU prefill → ROCm decode, runs copied off the engine thread"
    );
    wait_idle(&d).await;
    wait_idle(&e).await;
    wait_idle(&cpu).await;
}
