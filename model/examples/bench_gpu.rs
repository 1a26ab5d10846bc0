//! The GPU benchmark report without the `ferry` CLI: `bench_gpu [e2e_context] [e2e_steps]`.
//! Environment: `FERRY_BENCH_SKIP_KERNELS`, `FERRY_BENCH_PREFILL_ONLY`,
//! `FERRY_BENCH_PREFILL_TOKENS=4096,16384` (the prefill lengths), `FERRY_BENCH_SPLIT=0` (the
//! kernel tables on plain bf16 rows instead of fast mode's split rows), `FERRY_BENCH_BATCH=1,32`
//! (the batched decode table's batch sizes; empty skips it), `FERRY_BENCH_PREFILL=1024,8192`
//! (the end-to-end prefill lengths; empty skips it).
//! Same measurements as `ferry bench-gpu` (see `ferry_model::gpu::report`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut opts = ferry_model::gpu::report::ReportOptions::default();
    if let Some(c) = args.next() {
        opts.e2e_context = c.parse()?;
    }
    if let Some(s) = args.next() {
        opts.e2e_steps = s.parse()?;
    }
    if std::env::var("FERRY_BENCH_SKIP_KERNELS").is_ok() {
        opts.kernels = false;
    }
    if std::env::var("FERRY_BENCH_PREFILL_ONLY").is_ok() {
        opts.absorbed = false;
        opts.e2e = false;
    }
    if let Ok(t) = std::env::var("FERRY_BENCH_PREFILL_TOKENS") {
        opts.prefill_tokens = t
            .split(',')
            .map(|x| x.trim().parse())
            .collect::<Result<_, _>>()?;
    }
    if let Ok(b) = std::env::var("FERRY_BENCH_BATCH") {
        opts.e2e_batch = b
            .split(',')
            .filter(|x| !x.trim().is_empty())
            .map(|x| x.trim().parse())
            .collect::<Result<_, _>>()?;
    }
    if let Ok(p) = std::env::var("FERRY_BENCH_PREFILL") {
        opts.e2e_prefill = p
            .split(',')
            .filter(|x| !x.trim().is_empty())
            .map(|x| x.trim().parse())
            .collect::<Result<_, _>>()?;
    }
    if let Ok(s) = std::env::var("FERRY_BENCH_SPLIT") {
        opts.split = s.trim().parse()?;
    }
    let dev = ferry_kernels::cuda::CudaDevice::open(0)?;
    print!("{}", ferry_model::gpu::report::report(&dev, &opts)?);
    Ok(())
}
