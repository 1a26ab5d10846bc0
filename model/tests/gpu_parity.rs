//! The GPU forward against the CPU forward on the embedded model (tiny-k3: 12 heads, low-rank
//! q, YaRN, a dense layer then MoE with 16 experts top-4 + 2 shared, f32 and bf16 tensors).
//!
//! Runs only where a CUDA device opens; elsewhere each test prints why it skipped and passes
//! (CPU-only CI). On the device machine: docs/gpu.md.
//!
//! Tolerance ([`GpuMode::Exact`]): the CPU-vs-Hugging-Face bound, max |Δlogit| ≤ 1e-3 ·
//! max|logit|, and identical greedy tokens. Both sides compute in f32 from the same weights;
//! the GPU differs in summation order and in the bf16 weight GEMMs, which keep ~16 mantissa
//! bits of each activation (split hi + lo), so errors stay ~1e-5 relative. [`GpuMode::Fast`]
//! (bf16 cache and attention inputs with the RoPE parts as bf16 pairs, bf16 probabilities)
//! is held to `FAST_TOLERANCE` (2e-2) on the golden prompts, greedy tokens identical.

mod common;

use ferry_kernels::cuda::CudaDevice;
use ferry_model::deepseek::{
    AttentionForm, BatchInputs, DeepseekModel, FormPolicy, LogitsWanted, SeqInput,
};
use ferry_model::gpu::GpuMode;
use ferry_model::kv::BlockId;

fn setup(test: &str) -> Option<(CudaDevice, DeepseekModel)> {
    let dev = match CudaDevice::open(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping {test}: {e}");
            return None;
        }
    };
    let model = DeepseekModel::load(&ferry_model::embedded::default_model_dir())
        .expect("the embedded model loads");
    Some((dev, model))
}

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    d / b.iter().map(|x| x.abs()).fold(0.0f32, f32::max).max(1e-30)
}

fn argmax(x: &[f32]) -> u32 {
    ferry_kernels::cpu::sample::argmax(x)
}

/// Prefill a prompt (all logits), then greedy decode; returns (max rel err, tokens cpu, tokens gpu).
fn run(
    model: &DeepseekModel,
    gpu: &DeepseekModel,
    prompt: &[u32],
    steps: usize,
    policy: FormPolicy,
) -> (f32, Vec<u32>, Vec<u32>) {
    let page = 16;
    let blocks = (prompt.len() + steps + 1).div_ceil(page) + 2;
    let mut pool = model.new_kv_pool(blocks + 3, page).expect("pool");
    let mut cache = gpu.new_kv_cache(blocks + 3, page).expect("cache");
    // A scrambled table: blocks in reverse order, skipping the first three.
    let table: Vec<BlockId> = (3..blocks as u32 + 3).rev().map(BlockId).collect();
    let mut worst = 0.0f32;
    let mut step = |tokens: &[u32], start: usize, wanted| {
        let batch = BatchInputs {
            prompt_logprobs: Vec::new(),
            drafts_on_device: None,
            seqs: vec![SeqInput {
                tokens,
                start_pos: start,
                block_table: &table,
                logits: wanted,
            }],
        };
        let c = model
            .forward_with(&batch, &mut pool, policy)
            .expect("cpu forward");
        let g = gpu.forward(&batch, &mut cache).expect("gpu forward");
        let e = rel(&g.logits[0], &c.logits[0]);
        worst = worst.max(e);
        (
            argmax(c.last_row(0).expect("row")),
            argmax(g.last_row(0).expect("row")),
        )
    };
    let (mut tc, mut tg) = step(prompt, 0, LogitsWanted::All);
    let (mut cpu_toks, mut gpu_toks) = (vec![tc], vec![tg]);
    for i in 0..steps {
        // Both sides continue from the CPU's token so one divergence cannot cascade.
        let (c, g) = step(&[tc], prompt.len() + i, LogitsWanted::Last);
        tc = c;
        tg = g;
        cpu_toks.push(tc);
        gpu_toks.push(tg);
    }
    (worst, cpu_toks, gpu_toks)
}

fn prompt() -> Vec<u32> {
    (0..45u32).map(|i| 16 + (i * 37 + 11) % 2000).collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn exact_mode_matches_cpu_and_greedy_is_identical() {
    let Some((dev, model)) = setup("exact_mode_matches_cpu_and_greedy_is_identical") else {
        return;
    };
    for policy in [
        FormPolicy::CostModel,
        FormPolicy::Force(AttentionForm::Absorbed),
        FormPolicy::Force(AttentionForm::Mha),
    ] {
        let mut gpu = model.upload(&dev, GpuMode::Exact).expect("upload");
        gpu.set_policy(policy);
        let (e, c, g) = run(&model, &gpu, &prompt(), 24, policy);
        eprintln!("exact {policy:?}: max |Δlogit| / max|logit| = {e:.2e}; greedy cpu {c:?}");
        assert!(e <= 1e-3, "{policy:?}: rel err {e}");
        assert_eq!(c, g, "{policy:?}: greedy tokens differ");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn fast_mode_stays_close() {
    let Some((dev, model)) = setup("fast_mode_stays_close") else {
        return;
    };
    use ferry_kernels::backend::AbsorbedKernel;
    // The golden prompts (transformers' cases) and the synthetic one, each prefilled and
    // decoded 24 steps the way the engine runs them (the cost model: MHA form for fresh
    // prompts, absorbed for decode) with every absorbed kernel, and in the MHA form throughout.
    let mut prompts: Vec<Vec<u32>> = (0..3).map(|i| common::golden_case(i).0).collect();
    prompts.push(prompt());
    let mut worst = 0.0f32;
    let mut differ = Vec::new();
    let kernels = [
        AbsorbedKernel::Tile,
        AbsorbedKernel::Packed,
        AbsorbedKernel::Generic,
    ];
    let configs = kernels
        .iter()
        .map(|&k| (FormPolicy::CostModel, k))
        .chain([(FormPolicy::Force(AttentionForm::Mha), AbsorbedKernel::Tile)]);
    for (policy, kernel) in configs {
        let mut gpu = model.upload(&dev, GpuMode::Fast).expect("upload");
        gpu.set_policy(policy);
        gpu.set_absorbed_kernel(kernel);
        for (i, p) in prompts.iter().enumerate() {
            let (e, c, g) = run(&model, &gpu, p, 24, policy);
            eprintln!("fast {policy:?} {kernel:?} prompt {i}: max |Δlogit| / max|logit| = {e:.2e}");
            if c != g {
                differ.push(format!("{policy:?} {kernel:?} prompt {i}: {c:?} vs {g:?}"));
            }
            worst = worst.max(e);
        }
    }
    eprintln!("fast mode: worst {worst:.2e} of max|logit|");
    assert!(differ.is_empty(), "greedy tokens differ: {differ:#?}");
    assert!(worst <= FAST_TOLERANCE, "fast mode rel err {worst}");
    // Reported, not bounded: the absorbed form forced on whole fresh prompts (the cost model
    // never picks it there; docs/gpu.md has what it shows).
    for kernel in kernels {
        let policy = FormPolicy::Force(AttentionForm::Absorbed);
        let mut gpu = model.upload(&dev, GpuMode::Fast).expect("upload");
        gpu.set_policy(policy);
        gpu.set_absorbed_kernel(kernel);
        for (i, p) in prompts.iter().enumerate() {
            let (e, c, g) = run(&model, &gpu, p, 24, policy);
            let same = c.iter().zip(&g).filter(|(a, b)| a == b).count();
            eprintln!(
                "fast, absorbed prefill forced, {kernel:?} prompt {i} ({} tokens): {e:.2e}, greedy {same}/{}",
                p.len(),
                c.len()
            );
        }
    }
}

/// Fast mode's bound on max |Δlogit| / max|logit| against the exact CPU forward. Fast mode
/// rounds the latent cache, the absorbed queries, the GEMMs' activations and attention
/// probabilities to bf16 (~2⁻⁹ relative each), and keeps the RoPE half of every score to ~16
/// bits as bf16 pairs (without the pairs this model's RoPE scores move attention rows by whole
/// logits: 0.46 · max|logit|, docs/gpu.md). A CPU forward with the same roundings reaches
/// 9.6e-3 on these prompts; the bound leaves 2× for the GPU's other roundings.
const FAST_TOLERANCE: f32 = 2e-2;

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn mixed_batch_matches_cpu() {
    let Some((dev, model)) = setup("mixed_batch_matches_cpu") else {
        return;
    };
    let gpu = model.upload(&dev, GpuMode::Exact).expect("upload");
    let page = 16;
    let mut pool = model.new_kv_pool(40, page).expect("pool");
    let mut cache = gpu.new_kv_cache(40, page).expect("cache");
    let tables: Vec<Vec<BlockId>> = (0..3u32)
        .map(|s| (0..10u32).map(|b| BlockId(39 - (b * 3 + s))).collect())
        .collect();
    let p = prompt();
    // Step 1: three fresh prompts of different lengths.
    let lens = [45usize, 17, 30];
    let seqs: Vec<SeqInput<'_>> = (0..3)
        .map(|i| SeqInput {
            tokens: &p[..lens[i]],
            start_pos: 0,
            block_table: &tables[i],
            logits: LogitsWanted::All,
        })
        .collect();
    let batch = BatchInputs {
        seqs,
        prompt_logprobs: Vec::new(),
        drafts_on_device: None,
    };
    let c = model.forward(&batch, &mut pool).expect("cpu");
    let g = gpu.forward(&batch, &mut cache).expect("gpu");
    for i in 0..3 {
        let e = rel(&g.logits[i], &c.logits[i]);
        assert!(e <= 1e-3, "prefill seq {i}: {e}");
    }
    // Step 2: decode for two sequences and a 5-token chunk for the third, in one batch.
    let (d0, d1, chunk) = ([7u32], [9u32], [3u32, 4, 5, 6, 7]);
    let batch = BatchInputs {
        prompt_logprobs: Vec::new(),
        drafts_on_device: None,
        seqs: vec![
            SeqInput {
                tokens: &d0,
                start_pos: 45,
                block_table: &tables[0],
                logits: LogitsWanted::Last,
            },
            SeqInput {
                tokens: &d1,
                start_pos: 17,
                block_table: &tables[1],
                logits: LogitsWanted::Last,
            },
            SeqInput {
                tokens: &chunk,
                start_pos: 30,
                block_table: &tables[2],
                logits: LogitsWanted::All,
            },
        ],
    };
    let c = model.forward(&batch, &mut pool).expect("cpu");
    let g = gpu.forward(&batch, &mut cache).expect("gpu");
    for i in 0..3 {
        let e = rel(&g.logits[i], &c.logits[i]);
        eprintln!("mixed step seq {i}: rel err {e:.2e}");
        assert!(e <= 1e-3, "mixed seq {i}: {e}");
    }
    // The caches agree row for row on every written position of layer 0.
    let gl = cache.download_layer(0).expect("download");
    let cl = pool.layer(0).expect("layer");
    let width = model.config().latent_width();
    for (s, len) in [(0usize, 46usize), (1, 18), (2, 35)] {
        for pos in 0..len {
            let b = tables[s][pos / page].0 as usize;
            let r = (b * page + pos % page) * width;
            let e = rel(&gl[r..r + width], &cl[r..r + width]);
            assert!(e <= 1e-4, "cache seq {s} pos {pos}: {e}");
        }
    }
}

/// A decode step replayed from a CUDA graph against the same step run eagerly, for a batch of
/// three sequences, in both modes. Tolerance: exact mode 1e-5 · max|logit| — the graph's
/// split-K plan is made for its planned context, so the attention sums in a different order
/// and nothing else differs; fast mode 5e-3, because the split boundaries also move where the
/// bf16 probabilities are rounded against a running maximum.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn graph_replayed_decode_step_equals_the_eager_step() {
    let Some((dev, model)) = setup("graph_replayed_decode_step_equals_the_eager_step") else {
        return;
    };
    for mode in [GpuMode::Exact, GpuMode::Fast] {
        let gpu = model.upload(&dev, mode).expect("upload");
        let page = 16;
        let mut eager = gpu.new_kv_cache(24, page).expect("cache");
        let mut graphed = gpu.new_kv_cache(24, page).expect("cache");
        let prompts: Vec<Vec<u32>> = (0..3u32)
            .map(|s| {
                (0..20 + 7 * s)
                    .map(|i| 16 + (i * 37 + 11 * s) % 2000)
                    .collect()
            })
            .collect();
        let tables: Vec<Vec<BlockId>> = (0..3u32)
            .map(|s| (s * 8..s * 8 + 8).map(BlockId).collect())
            .collect();
        let prefill = BatchInputs {
            prompt_logprobs: Vec::new(),
            drafts_on_device: None,
            seqs: prompts
                .iter()
                .zip(&tables)
                .map(|(p, t)| SeqInput {
                    tokens: p,
                    start_pos: 0,
                    block_table: t,
                    logits: LogitsWanted::Last,
                })
                .collect(),
        };
        gpu.forward(&prefill, &mut eager).expect("prefill");
        gpu.forward(&prefill, &mut graphed).expect("prefill");
        let mut graph = None;
        for step in 0..4usize {
            let toks: Vec<[u32; 1]> = (0..3u32).map(|s| [100 + s + step as u32]).collect();
            let batch = BatchInputs {
                prompt_logprobs: Vec::new(),
                drafts_on_device: None,
                seqs: toks
                    .iter()
                    .zip(&prompts)
                    .zip(&tables)
                    .map(|((t, p), tb)| SeqInput {
                        tokens: t,
                        start_pos: p.len() + step,
                        block_table: tb,
                        logits: LogitsWanted::Last,
                    })
                    .collect(),
            };
            let want = gpu.forward(&batch, &mut eager).expect("eager step");
            let g = match graph.as_mut() {
                Some(g) => g,
                None => graph.insert(
                    gpu.capture_decode(&batch, &mut graphed, 64, &[])
                        .expect("capture"),
                ),
            };
            let got = gpu.replay_decode(g, &batch, &graphed).expect("replay");
            for s in 0..3 {
                let e = rel(&got.logits[s], &want.logits[s]);
                let tol = if mode == GpuMode::Exact { 1e-5 } else { 5e-3 };
                assert!(e <= tol, "{mode:?} step {step} seq {s}: rel err {e}");
            }
        }
        eprintln!("{mode:?}: 4 graph-replayed decode steps of 3 sequences match the eager steps");
    }
}
