//! `ferry`: a disaggregated prefill/decode serving cluster for MLA + MoE models.
//!
//! This binary is the only place that uses `anyhow`; every library crate returns typed errors.
#![forbid(unsafe_code)]

mod cmd;
mod embedded;

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
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FERRY_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,ferry=info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Up(args) => cmd::up::run(args),
        Command::Router(args) => cmd::serve::router(args),
        Command::Prefill(args) => cmd::serve::prefill(args),
        Command::Decode(args) => cmd::serve::decode(args),
        Command::Generate(args) => cmd::generate::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::BenchEngine(args) => cmd::bench_engine::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
