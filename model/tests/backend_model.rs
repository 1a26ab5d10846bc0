//! The one model on a backend, seen from outside: copying it to a backend keeps its outputs,
//! its KV rows must live where its weights do, and the per-token byte count a roofline uses is
//! the sum of what a decode step reads.

use ferry_kernels::backend::{Backend, Precision};
use ferry_model::deepseek::{
    AttentionForm, BatchInputs, DeepseekModel, FormPolicy, LogitsWanted, SeqInput,
};
use ferry_model::kv::{BlockId, BlockTable, KvRows};

fn load() -> DeepseekModel {
    DeepseekModel::load(&ferry_model::embedded::default_model_dir()).expect("embedded model")
}

fn logits(model: &DeepseekModel, prompt: &[u32]) -> Vec<f32> {
    let mut pool = model.new_kv_pool(8, 16).expect("pool");
    let mut table = BlockTable::new();
    table.reserve(&mut pool, prompt.len()).expect("blocks");
    let batch = BatchInputs {
        prompt_logprobs: Vec::new(),
        drafts_on_device: None,
        seqs: vec![SeqInput {
            tokens: prompt,
            start_pos: 0,
            block_table: table.blocks(),
            logits: LogitsWanted::All,
        }],
    };
    let out = model.forward(&batch, &mut pool).expect("forward");
    out.logits.into_iter().flatten().collect()
}

/// `to_backend(Cpu)` is a copy of every weight: the copy's logits are the original's, bit for
/// bit (same kernels, same order), on every row of a prompt.
#[test]
fn a_model_copied_to_the_cpu_backend_gives_the_same_logits() {
    let model = load();
    let copy = model
        .to_backend(&Backend::Cpu, Precision::Exact)
        .expect("copy");
    assert!(matches!(copy.backend(), Backend::Cpu));
    let prompt: Vec<u32> = (0..37).map(|i| 20 + (i * 37) % 400).collect();
    let (a, b) = (logits(&model, &prompt), logits(&copy, &prompt));
    assert_eq!(a.len(), 37 * model.config().vocab_size);
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
}

/// Golden case `i` of the embedded target: its prompt ids (transformers' golden data).
fn golden_prompt(i: usize) -> Vec<u32> {
    let path = ferry_model::embedded::default_model_dir().join("golden/cases.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("golden cases"))
            .expect("golden json");
    v["cases"][i]["prompt_ids"]
        .as_array()
        .expect("prompt ids")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect()
}

/// Every backend this machine has, each with the model copied onto it and KV rows where it
/// runs: the CPU always, a CUDA device and a ROCm device where one opens (the ROCm one only
/// in a `--features rocm` build; no AMD GPU has run this yet).
fn backends(
    model: &DeepseekModel,
    blocks: usize,
    page: usize,
) -> Vec<(DeepseekModel, Box<dyn KvRows>)> {
    let mut all: Vec<(DeepseekModel, Box<dyn KvRows>)> = Vec::new();
    let cpu = model
        .to_backend(&Backend::Cpu, Precision::Exact)
        .expect("cpu copy");
    let pool = cpu.new_kv_pool(blocks, page).expect("pool");
    all.push((cpu, Box::new(pool)));
    #[cfg(feature = "cuda")]
    match ferry_kernels::cuda::CudaDevice::open(0) {
        Ok(dev) => {
            let gpu = model
                .to_backend(&Backend::Cuda(dev), Precision::Exact)
                .expect("cuda copy");
            let cache = gpu.new_kv_cache(blocks, page).expect("cuda cache");
            all.push((gpu, Box::new(cache)));
        }
        Err(e) => eprintln!("no CUDA backend: {e}"),
    }
    #[cfg(feature = "rocm")]
    match ferry_kernels::rocm::RocmDevice::open(0) {
        Ok(dev) => {
            let gpu = model.to_rocm(&dev, Precision::Exact).expect("rocm copy");
            let cache = gpu.new_rocm_kv_cache(blocks, page).expect("rocm cache");
            all.push((gpu, Box::new(cache)));
        }
        Err(e) => eprintln!("no ROCm backend: {e}"),
    }
    all
}

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    d / b.iter().map(|x| x.abs()).fold(0.0f32, f32::max).max(1e-30)
}

/// The one forward on every backend the machine has gives the CPU's logits on a golden prompt:
/// the prompt's prefill (every row; above the GEMV's 8 rows, so each backend's large GEMM) then
/// four decode steps fed the CPU's greedy tokens, in the cost model's attention form and each
/// form forced. Exact precision, the CPU copy the reference: within the CPU-vs-Hugging-Face
/// bound, max |Δlogit| ≤ 1e-3 · max|logit|, on a GPU (f32 everywhere, summation order only —
/// `gpu_parity.rs` states the same for CUDA). Only the CPU runs unless a GPU opens.
#[test]
fn every_backend_gives_the_cpus_logits_on_a_golden_prompt() {
    let model = load();
    let prompt = golden_prompt(0);
    let page = 16;
    let blocks = (prompt.len() + 8).div_ceil(page) + 2;
    // A scrambled table: blocks in reverse order, skipping the first one.
    let table: Vec<BlockId> = (1..blocks as u32).rev().map(BlockId).collect();
    for policy in [
        FormPolicy::CostModel,
        FormPolicy::Force(AttentionForm::Absorbed),
        FormPolicy::Force(AttentionForm::Mha),
    ] {
        let mut reference: Vec<Vec<f32>> = Vec::new();
        for (i, (m, mut kv)) in backends(&model, blocks, page).into_iter().enumerate() {
            let mut tokens = prompt.clone();
            let mut start = 0;
            let mut worst = 0.0f32;
            for step in 0..5 {
                let wanted = if step == 0 {
                    LogitsWanted::All
                } else {
                    LogitsWanted::Last
                };
                let batch = BatchInputs {
                    prompt_logprobs: Vec::new(),
                    drafts_on_device: None,
                    seqs: vec![SeqInput {
                        tokens: &tokens[start..],
                        start_pos: start,
                        block_table: &table,
                        logits: wanted,
                    }],
                };
                let out = m
                    .forward_with(&batch, kv.as_mut(), policy)
                    .unwrap_or_else(|e| panic!("{} forward: {e}", m.backend().name()));
                let logits: Vec<f32> = out.logits.into_iter().flatten().collect();
                if i == 0 {
                    reference.push(logits.clone());
                } else {
                    worst = worst.max(rel(&logits, &reference[step]));
                }
                // Every backend continues from the CPU's greedy token.
                let last = &reference[step][reference[step].len() - m.config().vocab_size..];
                start = tokens.len();
                tokens.push(ferry_kernels::cpu::sample::argmax(last));
            }
            let bound = if i == 0 { 0.0 } else { 1e-3 };
            eprintln!(
                "{policy:?} on the {}: max |Δlogit| / max|logit| = {worst:.2e}",
                m.backend().name()
            );
            assert!(
                worst <= bound,
                "{policy:?} on the {}: {worst}",
                m.backend().name()
            );
        }
    }
}

/// A roofline's bytes per token: at least the dense attention weights of every layer plus one
/// LM head, and far less than all the weights (only `top_k` routed experts are read).
#[test]
fn active_weight_bytes_count_what_a_decode_step_reads() {
    let model = load();
    let c = model.config();
    let d = model.mla_dims();
    let lm_head = c.vocab_size * c.hidden_size * 2;
    let kv_b = d.heads * (d.qk_nope_head_dim + d.v_head_dim) * d.kv_lora_rank * 2;
    let bytes = model.active_weight_bytes();
    assert!(
        bytes > lm_head + c.num_hidden_layers * kv_b,
        "{bytes} bytes per token is less than the LM head and kv_b projections"
    );
    let all: u64 =
        std::fs::metadata(ferry_model::embedded::default_model_dir().join("model.safetensors"))
            .expect("checkpoint")
            .len();
    assert!(
        (bytes as u64) < all,
        "{bytes} bytes per token is not below the whole checkpoint ({all} bytes)"
    );
}

/// On a GPU, a host pool handed to a device-resident model is refused before any op runs,
/// naming both places (and a device cache of the wrong dtype likewise).
#[cfg(feature = "cuda")]
#[test]
fn kv_rows_must_live_where_the_weights_do() {
    use ferry_model::gpu::GpuMode;
    let dev = match ferry_kernels::cuda::CudaDevice::open(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipping: {e}");
            return;
        }
    };
    let model = load();
    let gpu = model.upload(&dev, GpuMode::Exact).expect("upload");
    let mut pool = gpu.new_kv_pool(4, 16).expect("pool");
    let mut table = BlockTable::new();
    table.reserve(&mut pool, 3).expect("blocks");
    let batch = BatchInputs {
        prompt_logprobs: Vec::new(),
        drafts_on_device: None,
        seqs: vec![SeqInput {
            tokens: &[1, 2, 3],
            start_pos: 0,
            block_table: table.blocks(),
            logits: LogitsWanted::Last,
        }],
    };
    let e = gpu
        .forward(&batch, &mut pool)
        .expect_err("host rows")
        .to_string();
    assert!(e.contains("host pool") && e.contains("CUDA"), "{e}");
    let fast = model.upload(&dev, GpuMode::Fast).expect("upload");
    let mut f32_cache = gpu.new_kv_cache(4, 16).expect("cache");
    let e = fast
        .forward(&batch, &mut f32_cache)
        .expect_err("an f32 cache for a fast model")
        .to_string();
    assert!(e.contains("f32") && e.contains("Fast"), "{e}");
}
