//! `ferry`: a disaggregated prefill/decode serving cluster for MLA + MoE models.
//!
//! This binary is the only place that uses `anyhow`; every library crate returns typed errors.
#![forbid(unsafe_code)]

mod cmd;
mod embedded;
mod telemetry;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// ferry: serve DeepSeek-V3 / Kimi K2 / Kimi K3-family models.
#[derive(Debug, Parser)]
#[command(name = "ferry", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a whole cluster (router + prefill + decode workers) on this machine.
    Up(cmd::up::UpArgs),
    /// Run the router: public gRPC + OpenAI HTTP API, worker registry, routing.
    Router(cmd::serve::RouterArgs),
    /// Run a prefill worker.
    Prefill(ferry_prefill::PrefillArgs),
    /// Run a decode worker.
    Decode(ferry_decode::DecodeArgs),
    /// Generate a continuation of a prompt in this process and stream it to stdout.
    Generate(cmd::generate::GenerateArgs),
    /// Load-test a running cluster over gRPC: TTFT, inter-token latency, throughput.
    Bench(cmd::bench::BenchArgs),
    /// Measure prefill and decode tokens/s of the in-process engine.
    BenchEngine(cmd::bench_engine::BenchEngineArgs),
    /// Run the GPU kernel and end-to-end benchmarks (CUDA).
    BenchGpu(cmd::bench_gpu::BenchGpuArgs),
    /// Measure KV transfer between two processes per transport (TCP, UCX), next to memcpy.
    BenchTransfer(cmd::bench_transfer::BenchTransferArgs),
    /// Ask a ferry gRPC server's health service; exit 0 only if it is SERVING.
    Health(cmd::health::HealthArgs),
}

impl Command {
    /// Logging and trace export for this subcommand's process.
    fn telemetry(&self) -> telemetry::TelemetryConfig {
        let (service_name, instance_id, queue_metrics) = match self {
            Command::Router(_) => ("ferry-router", None, false),
            Command::Prefill(a) => ("ferry-prefill", a.worker.worker_id.clone(), true),
            Command::Decode(a) => ("ferry-decode", a.worker.worker_id.clone(), true),
            _ => ("ferry", None, false),
        };
        telemetry::TelemetryConfig {
            service_name,
            instance_id,
            // `ferry up` serves nothing itself; its children export.
            export: !matches!(self, Command::Up(_)),
            queue_metrics,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let telemetry = telemetry::init(cli.command.telemetry());
    let result = match cli.command {
        Command::Up(args) => cmd::up::run(args),
        Command::Router(args) => cmd::serve::router(args),
        Command::Prefill(args) => cmd::serve::prefill(args),
        Command::Decode(args) => cmd::serve::decode(args),
        Command::Generate(args) => cmd::generate::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::BenchEngine(args) => cmd::bench_engine::run(args),
        Command::BenchGpu(args) => cmd::bench_gpu::run(args),
        Command::BenchTransfer(args) => cmd::bench_transfer::run(args),
        Command::Health(args) => cmd::health::run(args),
    };
    telemetry.shutdown();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
