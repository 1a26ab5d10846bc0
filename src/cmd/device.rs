//! `--device cpu|cuda[:N]|rocm[:N]` for the in-process commands (`generate`, `bench-engine`),
//! and the GPU paths they take outside the engine.
//!
//! A GPU that cannot be opened (no driver, no such ordinal) is reported once as a warning and
//! the command carries on with the CPU backend. The ROCm backend compiles and runs the kernel
//! sources but does not run the whole model yet, so `rocm` also falls back (with that reason).
//! The workers take the same flags and hand them to their engine
//! (`ferry_model::engine::backend`).

use std::time::Instant;

use anyhow::Context;
use ferry_kernels::cpu::sample::argmax;
use ferry_model::deepseek::{BatchInputs, DeepseekModel, LogitsWanted, SeqInput};
use ferry_model::gpu::{GpuKvCache, GpuModel};
use ferry_model::kv::layout::DEFAULT_PAGE_SIZE;
use ferry_model::kv::{BlockId, KvPool};
use ferry_model::session::Session;

/// The flags live with the workers' (`ferry_worker::args`), which take them too.
pub use ferry_worker::args::DeviceArgs;

/// One sequence on either backend: append tokens, get logits.
pub enum Runner<'m> {
    /// The CPU forward over a host pool.
    Cpu {
        /// The model.
        model: &'m DeepseekModel,
        /// Its pool.
        pool: KvPool,
        /// The sequence.
        session: Session,
    },
    /// The GPU forward over a device cache; the sequence owns blocks `0..n` in order.
    Cuda {
        /// The model on the device.
        gpu: Box<GpuModel>,
        /// The device cache.
        cache: GpuKvCache,
        /// Block table.
        table: Vec<BlockId>,
        /// Tokens cached.
        len: usize,
    },
}

impl<'m> Runner<'m> {
    /// A runner for one sequence of at most `max_tokens` positions.
    pub fn new(
        args: &DeviceArgs,
        model: &'m DeepseekModel,
        max_tokens: usize,
    ) -> anyhow::Result<Self> {
        let blocks = max_tokens.div_ceil(DEFAULT_PAGE_SIZE);
        let gpu = args.gpu_model(model).context("uploading the model")?;
        Ok(match gpu {
            Some(gpu) => Runner::Cuda {
                cache: gpu.new_kv_cache(blocks, DEFAULT_PAGE_SIZE)?,
                gpu: Box::new(gpu),
                table: (0..blocks as u32).map(BlockId).collect(),
                len: 0,
            },
            None => Runner::Cpu {
                model,
                pool: model.new_kv_pool(blocks, DEFAULT_PAGE_SIZE)?,
                session: Session::new(),
            },
        })
    }

    /// Computes `new` tokens after the cached ones; returns the last row's logits.
    pub fn extend(&mut self, new: &[u32]) -> anyhow::Result<Vec<f32>> {
        match self {
            Runner::Cpu {
                model,
                pool,
                session,
            } => Ok(session.extend(model, pool, new, LogitsWanted::Last)?),
            Runner::Cuda {
                gpu,
                cache,
                table,
                len,
            } => {
                let batch = BatchInputs {
                    seqs: vec![SeqInput {
                        tokens: new,
                        start_pos: *len,
                        block_table: table,
                        logits: LogitsWanted::Last,
                    }],
                };
                let mut out = gpu.forward(&batch, cache)?;
                *len += new.len();
                Ok(out.logits.pop().unwrap_or_default())
            }
        }
    }

    /// Releases the sequence's blocks.
    pub fn finish(self) -> anyhow::Result<()> {
        if let Runner::Cpu {
            mut pool, session, ..
        } = self
        {
            session.free(&mut pool)?;
        }
        Ok(())
    }
}

/// Shape of one `bench-engine` measurement.
#[derive(Debug, Clone, Copy)]
pub struct EngineBench {
    /// Sequences.
    pub batch: usize,
    /// Prompt tokens per sequence.
    pub prompt_len: usize,
    /// Decode steps.
    pub decode_steps: usize,
    /// Seed for the prompts.
    pub salt: u32,
}

/// `bench-engine` on the GPU: one prefill batch, then batched decode steps; returns
/// (prefill tok/s, decode tok/s), timed around the forward calls (device work included).
pub fn bench_engine_gpu(gpu: &GpuModel, b: EngineBench) -> anyhow::Result<(f64, f64)> {
    let vocab = gpu.config().vocab_size as u32;
    let per_seq = (b.prompt_len + b.decode_steps).div_ceil(DEFAULT_PAGE_SIZE);
    let mut cache = gpu.new_kv_cache(per_seq * b.batch, DEFAULT_PAGE_SIZE)?;
    let tables: Vec<Vec<BlockId>> = (0..b.batch)
        .map(|s| {
            ((s * per_seq) as u32..((s + 1) * per_seq) as u32)
                .map(BlockId)
                .collect()
        })
        .collect();
    let prompts: Vec<Vec<u32>> = (0..b.batch as u32)
        .map(|s| {
            let mut x = 0x9e37_79b9u32 ^ (s.wrapping_mul(7919) + b.salt);
            (0..b.prompt_len)
                .map(|_| {
                    x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    16 + (x >> 8) % (vocab - 16)
                })
                .collect()
        })
        .collect();
    let inputs = BatchInputs {
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
    let start = Instant::now();
    let out = gpu.forward(&inputs, &mut cache)?;
    let prefill_s = start.elapsed().as_secs_f64();
    let mut next: Vec<[u32; 1]> = (0..b.batch)
        .map(|i| [out.last_row(i).map(argmax).unwrap_or(0)])
        .collect();
    let mut decode_s = 0.0;
    for step in 0..b.decode_steps {
        let inputs = BatchInputs {
            seqs: next
                .iter()
                .zip(&tables)
                .map(|(tok, t)| SeqInput {
                    tokens: tok,
                    start_pos: b.prompt_len + step,
                    block_table: t,
                    logits: LogitsWanted::Last,
                })
                .collect(),
        };
        let start = Instant::now();
        let out = gpu.forward(&inputs, &mut cache)?;
        decode_s += start.elapsed().as_secs_f64();
        for (i, n) in next.iter_mut().enumerate() {
            n[0] = out.last_row(i).map(argmax).unwrap_or(0);
        }
    }
    Ok((
        (b.batch * b.prompt_len) as f64 / prefill_s,
        (b.batch * b.decode_steps) as f64 / decode_s.max(f64::MIN_POSITIVE),
    ))
}
