//! The one model on a backend, seen from outside: copying it to a backend keeps its outputs,
//! its KV rows must live where its weights do, and the per-token byte count a roofline uses is
//! the sum of what a decode step reads.

use ferry_kernels::backend::{Backend, Precision};
use ferry_model::deepseek::{BatchInputs, DeepseekModel, LogitsWanted, SeqInput};
use ferry_model::kv::BlockTable;

fn load() -> DeepseekModel {
    DeepseekModel::load(&ferry_model::embedded::default_model_dir()).expect("embedded model")
}

fn logits(model: &DeepseekModel, prompt: &[u32]) -> Vec<f32> {
    let mut pool = model.new_kv_pool(8, 16).expect("pool");
    let mut table = BlockTable::new();
    table.reserve(&mut pool, prompt.len()).expect("blocks");
    let batch = BatchInputs {
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
