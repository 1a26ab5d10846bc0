//! `ferry bench-engine`: prefill and decode throughput of the in-process CPU engine.
//!
//! For each batch size it prefills `batch` prompts of `--prompt-len` tokens in one forward
//! (a fresh-prompt batch, MHA form), then runs `--decode-steps` batched decode steps (absorbed
//! form), and prints tokens/s for each phase as a Markdown table row. Timing covers the forward
//! only: tokenization, sampling and allocation are outside the measured region.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::bail;
use clap::Args;
use ferry_kernels::cpu::sample::argmax;
use ferry_model::deepseek::{BatchInputs, DeepseekModel, LogitsWanted, SeqInput};
use ferry_model::kv::layout::DEFAULT_PAGE_SIZE;
use ferry_model::kv::BlockTable;

/// Options of `ferry bench-engine`.
#[derive(Debug, Args)]
pub struct BenchEngineArgs {
    /// Model directory; the embedded tiny-k3 model when omitted.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub batch: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    /// Decode steps per measurement.
    #[arg(long, default_value_t = 64)]
    pub decode_steps: usize,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    #[command(flatten)]
    pub device: super::device::DeviceArgs,
}

/// Runs the benchmark.
pub fn run(args: BenchEngineArgs) -> anyhow::Result<()> {
    let dir = crate::embedded::model_dir(args.model.as_deref())?;
    let model = DeepseekModel::load(&dir)?;
    let cfg = model.config();
    if args.prompt_len == 0 || args.prompt_len + args.decode_steps > cfg.max_position_embeddings {
        bail!(
            "`--prompt-len` + `--decode-steps` must be in 1..={}",
            cfg.max_position_embeddings
        );
    }
    let gpu = args.device.gpu_model(&model)?;
    println!(
        "| batch | prompt | prefill tok/s | decode steps | decode tok/s | threads |\n|---|---|---|---|---|---|"
    );
    for &batch in &args.batch {
        let mut prefill = Vec::new();
        let mut decode = Vec::new();
        for rep in 0..args.repeat.max(1) {
            let (p, d) = match &gpu {
                Some(g) => super::device::bench_engine_gpu(g, super::device::EngineBench {
                    batch,
                    prompt_len: args.prompt_len,
                    decode_steps: args.decode_steps,
                    salt: rep as u32,
                })?,
                None => measure(&model, batch, &args, rep as u32)?,
            };
            prefill.push(p);
            decode.push(d);
        }
        println!(
            "| {batch} | {} | {:.0} | {} | {:.1} | {} |",
            args.prompt_len,
            median(&mut prefill),
            args.decode_steps,
            median(&mut decode),
            rayon::current_num_threads()
        );
    }
    Ok(())
}

/// One prefill + decode run; returns (prefill tok/s, decode tok/s).
fn measure(
    model: &DeepseekModel,
    batch: usize,
    args: &BenchEngineArgs,
    salt: u32,
) -> anyhow::Result<(f64, f64)> {
    let vocab = model.config().vocab_size as u32;
    let per_seq = (args.prompt_len + args.decode_steps).div_ceil(DEFAULT_PAGE_SIZE);
    let mut pool = model.new_kv_pool(per_seq * batch, DEFAULT_PAGE_SIZE)?;
    // Deterministic, distinct prompts (a simple LCG over the vocabulary, skipping specials).
    let prompts: Vec<Vec<u32>> = (0..batch as u32)
        .map(|b| {
            let mut x = 0x9e37_79b9u32 ^ (b.wrapping_mul(7919) + salt);
            (0..args.prompt_len)
                .map(|_| {
                    x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    16 + (x >> 8) % (vocab - 16)
                })
                .collect()
        })
        .collect();
    let mut tables = Vec::with_capacity(batch);
    for _ in 0..batch {
        let mut t = BlockTable::new();
        t.reserve(&mut pool, args.prompt_len + args.decode_steps)?;
        tables.push(t);
    }

    let inputs = BatchInputs {
        seqs: prompts
            .iter()
            .zip(&tables)
            .map(|(p, t)| SeqInput {
                tokens: p,
                start_pos: 0,
                block_table: t.blocks(),
                logits: LogitsWanted::Last,
            })
            .collect(),
    };
    let start = Instant::now();
    let out = model.forward(&inputs, &mut pool)?;
    let prefill_s = start.elapsed().as_secs_f64();

    let mut next: Vec<[u32; 1]> = (0..batch)
        .map(|i| [out.last_row(i).map(argmax).unwrap_or(0)])
        .collect();
    let mut decode_s = 0.0;
    for step in 0..args.decode_steps {
        let inputs = BatchInputs {
            seqs: next
                .iter()
                .zip(&tables)
                .map(|(tok, t)| SeqInput {
                    tokens: tok,
                    start_pos: args.prompt_len + step,
                    block_table: t.blocks(),
                    logits: LogitsWanted::Last,
                })
                .collect(),
        };
        let start = Instant::now();
        let out = model.forward(&inputs, &mut pool)?;
        decode_s += start.elapsed().as_secs_f64();
        for (i, n) in next.iter_mut().enumerate() {
            n[0] = out.last_row(i).map(argmax).unwrap_or(0);
        }
    }
    for mut t in tables {
        t.free(&mut pool)?;
    }
    let prefill_tps = (batch * args.prompt_len) as f64 / prefill_s;
    let decode_tps = (batch * args.decode_steps) as f64 / decode_s.max(f64::MIN_POSITIVE);
    Ok((prefill_tps, decode_tps))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
