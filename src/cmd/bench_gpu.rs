//! `ferry bench-gpu`: the GPU benchmarks of BENCHMARKS.md in one run, printed as Markdown
//! (the measurements live in `ferry_model::gpu::report`).

use anyhow::Context;
use clap::Args;
use ferry_kernels::cuda::CudaDevice;
use ferry_model::gpu::report::{report, ReportOptions};

/// Options of `ferry bench-gpu`.
#[derive(Debug, Args)]
pub struct BenchGpuArgs {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub ordinal: usize,
    /// Prefill lengths (tokens) for the MHA-form benchmark.
    #[arg(long, value_delimiter = ',', default_value = "4096,16384,65536")]
    pub prefill_tokens: Vec<usize>,
    /// Decode batch sizes for the absorbed benchmark.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
    pub batch: Vec<usize>,
    /// Decode contexts for the absorbed benchmark.
    #[arg(long, value_delimiter = ',', default_value = "1024,8192,32768,131072")]
    pub context: Vec<usize>,
    /// Cached tokens before the end-to-end decode run.
    #[arg(long, default_value_t = 1024)]
    pub e2e_context: usize,
    /// Decode steps timed end to end.
    #[arg(long, default_value_t = 64)]
    pub e2e_steps: usize,
    /// Batch sizes of the end-to-end batched decode table (one token per sequence per step,
    /// each sequence at `--e2e-context`); empty skips it.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,32,64,128,256")]
    pub e2e_batch: Vec<usize>,
    /// Prompt lengths of the end-to-end prefill table; empty skips it.
    #[arg(long, value_delimiter = ',', default_value = "1024,8192")]
    pub e2e_prefill: Vec<usize>,
    /// Skip the kernel benchmarks.
    #[arg(long)]
    pub skip_kernels: bool,
    /// Skip the end-to-end model benchmark.
    #[arg(long)]
    pub skip_e2e: bool,
    /// Of the kernel benchmarks, run only the MHA-form prefill ones.
    #[arg(long)]
    pub prefill_only: bool,
    /// Rope elements the kernel benchmarks' bf16 rows keep as hi/lo pairs: 64 is fast mode's
    /// split rows (what the model runs), 0 plain bf16 rows (the comparison).
    #[arg(long, default_value_t = 64)]
    pub split: usize,
}

/// Runs the benchmarks.
pub fn run(args: BenchGpuArgs) -> anyhow::Result<()> {
    let dev = CudaDevice::open(args.ordinal).context("opening the CUDA device")?;
    let opts = ReportOptions {
        prefill_tokens: args.prefill_tokens,
        batch: args.batch,
        context: args.context,
        e2e_context: args.e2e_context,
        e2e_steps: args.e2e_steps,
        e2e_batch: args.e2e_batch,
        e2e_prefill: args.e2e_prefill,
        kernels: !args.skip_kernels,
        absorbed: !args.prefill_only,
        e2e: !args.skip_e2e,
        split: args.split,
    };
    print!("{}", report(&dev, &opts)?);
    Ok(())
}
