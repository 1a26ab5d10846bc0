//! The GPU benchmark report of BENCHMARKS.md in one run, as Markdown text (`ferry bench-gpu`,
//! and `cargo run --release -p ferry-model --example bench_gpu` where the CLI is not built).
//!
//! 1. Device-to-device copy bandwidth (the roofline's denominator).
//! 2. MHA-form causal prefill (qk 192 / v 128), 12 and 16 heads, 4k / 16k / 64k tokens:
//!    TFLOP/s of the tensor-core flash kernel (PyTorch SDPA runs beside it from
//!    `scripts/bench_sdpa.py`).
//! 3. Absorbed decode over the bf16 latent cache (576-wide rows), 16 heads, batch 1–128 ×
//!    context 1k–128k: achieved GB/s of latent read against the copy bandwidth.
//! 4. Padded 12 → 16 vs head-packed vs per-head generic, same shapes.
//! 5. End to end: single-stream decode of a random-weight DeepSeek-V2-Lite-like model against
//!    the roofline.

use std::fmt::Write;

use ferry_kernels::cuda::bench::{
    absorbed_decode, copy_bandwidth, mha_prefill, AbsorbedImpl, DecodeShape, LatentPool, MhaImpl,
};
use ferry_kernels::cuda::mla::MlaShape;
use ferry_kernels::cuda::CudaDevice;

use super::bench::{decode_throughput, prefill_seconds, v2_lite_like_config};
use super::GpuMode;
use crate::deepseek::DeepseekModel;
use crate::ModelError;

/// What to measure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportOptions {
    /// Prefill lengths (tokens) for the MHA-form benchmark.
    pub prefill_tokens: Vec<usize>,
    /// Decode batch sizes for the absorbed benchmark.
    pub batch: Vec<usize>,
    /// Decode contexts for the absorbed benchmark.
    pub context: Vec<usize>,
    /// Cached tokens before the end-to-end decode run.
    pub e2e_context: usize,
    /// Decode steps timed end to end.
    pub e2e_steps: usize,
    /// Batch sizes of the end-to-end batched decode table (empty: skipped).
    pub e2e_batch: Vec<usize>,
    /// Prompt lengths of the end-to-end prefill table (empty: skipped).
    pub e2e_prefill: Vec<usize>,
    /// Run the kernel benchmarks.
    pub kernels: bool,
    /// Within the kernel benchmarks, run the absorbed-decode ones (else prefill only).
    pub absorbed: bool,
    /// Run the end-to-end model benchmark.
    pub e2e: bool,
    /// Rope elements the kernel benchmarks' bf16 rows keep as pairs (64: fast mode's split
    /// rows, what the model runs; 0: plain bf16 rows, the comparison).
    pub split: usize,
}

impl Default for ReportOptions {
    fn default() -> Self {
        Self {
            prefill_tokens: vec![4096, 16384, 65536],
            batch: vec![1, 8, 32, 128],
            context: vec![1024, 8192, 32768, 131072],
            e2e_context: 1024,
            e2e_steps: 64,
            e2e_batch: vec![1, 4, 16, 32, 64, 128, 256],
            e2e_prefill: vec![1024, 8192],
            kernels: true,
            absorbed: true,
            e2e: true,
            split: 64,
        }
    }
}

/// Runs the benchmarks on `dev` and returns the Markdown report. Failing cells are reported
/// in place; only failures to start (allocation, the copy baseline) are errors.
pub fn report(dev: &CudaDevice, opts: &ReportOptions) -> Result<String, ModelError> {
    let mut out = String::new();
    let _ = writeln!(out, "device: {} ({} SMs)\n", dev.name(), dev.sm_count());
    let bw = copy_bandwidth(dev, 2 << 30)?;
    let _ = writeln!(out, "device-to-device copy (read + write): {bw:.0} GB/s\n");
    if opts.kernels {
        kernels(dev, opts, bw, &mut out)?;
    }
    if opts.e2e {
        let model = DeepseekModel::random(dev, v2_lite_like_config()?, GpuMode::Fast)?;
        let _ = writeln!(out, "### End to end: single-stream decode, random DeepSeek-V2-Lite-like model (fast mode)\n");
        let _ = writeln!(out, "| launches | context | steps | tok/s | ms/token | weight MB/token | KV MB/token | roofline tok/s | % of roofline |\n|---|---|---|---|---|---|---|---|---|");
        match decode_throughput(&model, 1, opts.e2e_context, opts.e2e_steps, bw) {
            Ok(r) => {
                let graph = r.graph_steps_per_s.clone();
                for (name, tps) in [("eager", Ok(r.steps_per_s)), ("CUDA graph", graph)] {
                    match tps {
                        Ok(tps) => {
                            let _ = writeln!(
                                out,
                                "| {name} | {} | {} | {:.1} | {:.3} | {:.1} | {:.1} | {:.0} | {:.0}% |",
                                r.context,
                                r.steps,
                                tps,
                                1e3 / tps,
                                r.weight_bytes as f64 / 1e6,
                                r.kv_bytes as f64 / 1e6,
                                r.roofline_steps_per_s,
                                100.0 * tps / r.roofline_steps_per_s
                            );
                        }
                        Err(e) => {
                            let _ = writeln!(
                                out,
                                "| {name} | {} | {} | error: {e} | | | | | |",
                                r.context, r.steps
                            );
                        }
                    }
                }
                let _ = writeln!(out);
            }
            Err(e) => {
                let _ = writeln!(
                    out,
                    "| eager | {} | {} | error: {e} | | | | | | |\n",
                    opts.e2e_context, opts.e2e_steps
                );
            }
        }
        if !opts.e2e_batch.is_empty() {
            batched(&model, opts, bw, &mut out);
        }
        if !opts.e2e_prefill.is_empty() {
            let _ = writeln!(out, "### End to end: prefill of one sequence, same model (median of 3)\n\n| tokens | ms | tok/s |\n|---|---|---|");
            for &n in &opts.e2e_prefill {
                match prefill_seconds(&model, n, 3) {
                    Ok(s) => {
                        let _ = writeln!(out, "| {n} | {:.1} | {:.0} |", s * 1e3, n as f64 / s);
                    }
                    Err(e) => {
                        let _ = writeln!(out, "| {n} | error: {e} | |");
                    }
                }
            }
            let _ = writeln!(out);
        }
    }
    Ok(out)
}

/// The batched decode table: per batch size, one step of `batch` tokens at `e2e_context`.
fn batched(model: &DeepseekModel, opts: &ReportOptions, bw: f64, out: &mut String) {
    let _ = writeln!(
        out,
        "### End to end: batched decode steps, same model, context {} per sequence

Needed bytes per step: every weight but the routed experts once, the routed experts a batch is expected to touch under uniform routing, and each sequence's latent rows.
",
        opts.e2e_context
    );
    let _ = writeln!(out, "| batch | eager ms/step | graph ms/step | tok/s | needed MB/step | effective GB/s | % of copy |
|---|---|---|---|---|---|---|");
    for &b in &opts.e2e_batch {
        match decode_throughput(model, b, opts.e2e_context, opts.e2e_steps, bw) {
            Ok(r) => {
                let graph = match &r.graph_steps_per_s {
                    Ok(s) => format!("{:.3}", 1e3 / s),
                    Err(e) => format!("error: {e}"),
                };
                let needed = r.distinct_weight_bytes + (r.batch * r.kv_bytes) as f64;
                let _ = writeln!(
                    out,
                    "| {b} | {:.3} | {graph} | {:.0} | {:.0} | {:.0} | {:.0}% |",
                    1e3 / r.steps_per_s,
                    r.best_tokens_per_s(),
                    needed / 1e6,
                    r.effective_gbs(),
                    100.0 * r.effective_gbs() / bw
                );
            }
            Err(e) => {
                let _ = writeln!(out, "| {b} | error: {e} | | | | | |");
            }
        }
    }
    let _ = writeln!(out);
}

fn kernels(
    dev: &CudaDevice,
    args: &ReportOptions,
    bw: f64,
    out: &mut String,
) -> Result<(), ModelError> {
    let shape = MlaShape::DEEPSEEK_V3.with_split(args.split);
    let hopper = dev.compute_capability() == (9, 0) && shape.wgmma_ok();
    let _ = writeln!(
        out,
        "### MHA-form causal prefill (qk 192 / v 128, bf16, batch 1, rows split {}: qk {} in the kernels): TFLOP/s at qk 192\n",
        shape.split,
        shape.mha_qkb()
    );
    let _ = writeln!(
        out,
        "| heads | tokens | flash (mma.sync) ms | TFLOP/s | wgmma ms | TFLOP/s | warp-specialised ms | TFLOP/s |\n|---|---|---|---|---|---|---|---|"
    );
    for heads in [12usize, 16] {
        for &n in &args.prefill_tokens {
            let mut row = format!("| {heads} | {n} |");
            let imps: &[MhaImpl] = if hopper {
                &[MhaImpl::Flash, MhaImpl::Wgmma, MhaImpl::WarpSpecialized]
            } else {
                &[MhaImpl::Flash]
            };
            for &imp in imps {
                match mha_prefill(dev, shape, imp, heads, n) {
                    Ok((t, tf)) => row += &format!(" {:.3} | {tf:.0} |", t.ms),
                    Err(e) => row += &format!(" error: {e} | |"),
                }
            }
            if !hopper {
                row += " n/a (needs sm_90) | |";
            }
            let _ = writeln!(out, "{row}");
        }
    }
    let _ = writeln!(out);
    if !args.absorbed {
        return Ok(());
    }

    let max_tokens = args
        .batch
        .iter()
        .flat_map(|b| args.context.iter().map(move |c| b * c))
        .max()
        .unwrap_or(0)
        .min(128 * 131_072);
    let mut pool = LatentPool::new(dev, shape, max_tokens)?;
    // Pipeline sweep: keys per step × stages in flight; the best goes on to the grids below.
    let _ = writeln!(
        out,
        "### Absorbed tile pipeline sweep (16 heads, ctx 32768): GB/s\n"
    );
    let _ = writeln!(
        out,
        "| warps × keys/step × stages | batch 1 | batch 4 | batch 8 | batch 32 | batch 128 |\n|---|---|---|---|---|---|"
    );
    let mut best = (0.0f64, shape);
    let variants = [
        shape.with_tile(64, 2),
        shape.with_tile(32, 2),
        shape.with_tile(32, 3),
        shape.with_tile(32, 2).with_l2_prefetch(2),
        shape.with_tile(32, 2).with_l2_prefetch(4),
        shape.with_tile(32, 2).with_l2_prefetch(8),
        shape.with_tile8(2),
        shape.with_tile8(4),
        shape.with_tile8(4).with_l2_prefetch(4),
        shape.with_tile_ws(2),
        shape.with_tile_ws(3),
        shape.with_tile_ws(4),
    ];
    let sm90 = dev.compute_capability() >= (9, 0);
    for v in variants
        .into_iter()
        .filter(|v| v.tile_ok() && (sm90 || !v.tile_needs_sm90()))
    {
        let (bk, st) = (v.tile_bk, v.tile_stages);
        pool.set_shape(v);
        let mut cells = Vec::new();
        let mut total = 0.0;
        for b in [1usize, 4, 8, 32, 128] {
            let s = DecodeShape {
                batch: b,
                ctx: 32_768,
                heads: 16,
                sq: 1,
            };
            match absorbed_decode(dev, &pool, AbsorbedImpl::Padded, s) {
                Ok((_, gbs)) => {
                    total += gbs;
                    cells.push(format!("{gbs:.0}"));
                }
                Err(e) => cells.push(format!("error: {e}")),
            }
        }
        if total > best.0 {
            best = (total, v);
        }
        let _ = writeln!(
            out,
            "| {} × {bk} × {st}, L2 prefetch {} | {} |",
            v.tile_warps,
            v.l2_prefetch,
            cells.join(" | ")
        );
    }
    pool.set_shape(best.1);
    let _ = writeln!(
        out,
        "\nusing {} warps × {} keys/step × {} stages, L2 prefetch {} below\n",
        best.1.tile_warps, best.1.tile_bk, best.1.tile_stages, best.1.l2_prefetch
    );
    let _ = writeln!(out, "### Absorbed decode (16 heads, bf16 latent cache, rows split {}: {} B each, tile kernel): GB/s of latent read (copy: {bw:.0} GB/s)\n", shape.split, shape.krow() * 2);
    let head: Vec<String> = args.context.iter().map(|c| format!("ctx {c}")).collect();
    let _ = writeln!(
        out,
        "| batch | {} |\n|---|{}",
        head.join(" | "),
        "---|".repeat(args.context.len())
    );
    for &b in &args.batch {
        let mut cells = Vec::new();
        for &c in &args.context {
            let s = DecodeShape {
                batch: b,
                ctx: c,
                heads: 16,
                sq: 1,
            };
            cells.push(match absorbed_decode(dev, &pool, AbsorbedImpl::Padded, s) {
                Ok((t, gbs)) => format!("{gbs:.0} ({:.0}%, {:.3} ms)", 100.0 * gbs / bw, t.ms),
                Err(e) => format!("error: {e}"),
            });
        }
        let _ = writeln!(out, "| {b} | {} |", cells.join(" | "));
    }
    let _ = writeln!(out);

    let _ = writeln!(
        out,
        "### 12 heads: padded 12→16 vs head-packed vs per-head generic (ms; GB/s of latent read)\n"
    );
    let _ = writeln!(
        out,
        "| batch | ctx | q tokens/seq | padded | packed | generic |\n|---|---|---|---|---|---|"
    );
    for (b, c, sq) in [
        (1, 32_768, 1),
        (32, 8192, 1),
        (128, 4096, 1),
        (32, 8192, 4),
        (8, 32_768, 2),
    ] {
        let mut cells = Vec::new();
        for imp in [
            AbsorbedImpl::Padded,
            AbsorbedImpl::Packed,
            AbsorbedImpl::Generic,
        ] {
            let s = DecodeShape {
                batch: b,
                ctx: c,
                heads: 12,
                sq,
            };
            cells.push(match absorbed_decode(dev, &pool, imp, s) {
                Ok((t, gbs)) => format!("{:.3} ms ({gbs:.0} GB/s)", t.ms),
                Err(e) => format!("error: {e}"),
            });
        }
        let _ = writeln!(out, "| {b} | {c} | {sq} | {} |", cells.join(" | "));
    }
    let _ = writeln!(out);
    Ok(())
}
