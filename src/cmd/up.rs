//! `ferry up`: a whole cluster on this machine — a router, prefill workers and decode workers
//! as separate processes on loopback, serving the embedded model unless `--model` says otherwise.
//!
//! Children are this same binary. Each child's stdin is a pipe held by `ferry up`: closing it
//! (on Ctrl-C or SIGTERM, or because `ferry up` died) makes the child shut down cleanly, so no
//! process outlives the cluster.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use ferry_decode::spec::SpecArgs;
use ferry_proto::auth::ClusterToken;
use ferry_router::config::PolicyKind;
use ferry_worker::args::DeviceArgs;
use ferry_worker::shutdown::shutdown_token;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

use crate::embedded;

/// Flags of `ferry up`.
#[derive(Debug, Args)]
pub struct UpArgs {
    /// Model directory; the embedded tiny-k3 model when omitted.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// OpenAI-compatible HTTP address.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub http_addr: SocketAddr,
    /// Public gRPC address (ferry.v1.Inference).
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub grpc_addr: SocketAddr,
    /// The router's internal address (the Registry its workers register with); a free
    /// loopback port when omitted. Every child gets a fresh cluster token, so nothing outside
    /// this cluster can register there.
    #[arg(long)]
    pub internal_addr: Option<SocketAddr>,
    /// Prefill workers to start.
    #[arg(long, default_value_t = 1)]
    pub prefill_workers: usize,
    /// Decode workers to start.
    #[arg(long, default_value_t = 1)]
    pub decode_workers: usize,
    /// Routing policy.
    #[arg(long, value_enum, default_value_t = PolicyKind::CacheAware)]
    pub policy: PolicyKind,
    /// With `--policy mooncake`: reject requests whose estimated time to first token exceeds
    /// this many ms (RESOURCE_EXHAUSTED / 429) instead of queueing them.
    #[arg(long)]
    pub ttft_slo_ms: Option<u64>,
    /// API keys for the router's public plane (docs/security.md); off when omitted.
    #[arg(long)]
    pub api_keys_file: Option<PathBuf>,
    /// KV blocks per worker.
    #[arg(long, default_value_t = 1024)]
    pub kv_blocks: usize,
    /// Decode workers prefill locally when at most this many prompt tokens are uncached.
    #[arg(long, default_value_t = 32)]
    pub local_prefill_threshold: usize,
    /// Seconds to wait for the cluster to become ready.
    #[arg(long, default_value_t = 60)]
    pub ready_timeout_s: u64,
    /// Speculative decoding on the decode workers (the prefill workers then ship the drafter's
    /// context with the KV).
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Where every worker runs the model (`--device cuda` puts them all on GPU 0); each worker
    /// falls back to the CPU with a warning if it cannot open the GPU. Speculative decoding
    /// is CPU-only: workers on a GPU decode without it.
    #[command(flatten)]
    pub device: DeviceArgs,
}

struct Proc {
    name: String,
    child: Child,
}

/// Runs the cluster until Ctrl-C / SIGTERM.
pub fn run(args: UpArgs) -> anyhow::Result<()> {
    let model = embedded::model_dir(args.model.as_deref())?;
    let served = match &args.model {
        Some(dir) => dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into()),
        None => embedded::EMBEDDED_MODEL_NAME.into(),
    };
    let exe = std::env::current_exe().context("locating the ferry binary")?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(up(args, exe, model, served))
}

fn spawn(exe: &PathBuf, name: &str, argv: &[String], token: &ClusterToken) -> anyhow::Result<Proc> {
    let child = Command::new(exe)
        .args(argv)
        .arg("--exit-on-stdin-close")
        // In the environment, not argv: other local users can read a process's arguments.
        .env("FERRY_CLUSTER_TOKEN", token.expose())
        .env_remove("FERRY_CLUSTER_TOKEN_FILE")
        .stdin(Stdio::piped())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    Ok(Proc {
        name: name.into(),
        child,
    })
}

async fn up(args: UpArgs, exe: PathBuf, model: PathBuf, served: String) -> anyhow::Result<()> {
    let shutdown = shutdown_token(false);
    let model_s = model.to_string_lossy().into_owned();
    let token = ClusterToken::generate();
    let internal_addr = match args.internal_addr {
        Some(addr) => addr,
        None => free_loopback_addr()?,
    };
    let mut router_argv: Vec<String> = vec![
        "router".into(),
        "--grpc-addr".into(),
        args.grpc_addr.to_string(),
        "--http-addr".into(),
        args.http_addr.to_string(),
        "--internal-addr".into(),
        internal_addr.to_string(),
        "--model".into(),
        model_s.clone(),
        "--served-model-name".into(),
        served.clone(),
        "--policy".into(),
        args.policy.as_str().into(),
    ];
    if let Some(ms) = args.ttft_slo_ms {
        router_argv.extend(["--ttft-slo-ms".to_string(), ms.to_string()]);
    }
    if let Some(file) = &args.api_keys_file {
        router_argv.extend([
            "--api-keys-file".into(),
            file.to_string_lossy().into_owned(),
        ]);
    }
    let mut procs = vec![spawn(&exe, "router", &router_argv, &token)?];
    let deadline = Instant::now() + Duration::from_secs(args.ready_timeout_s);
    wait_for_port(internal_addr, deadline, &mut procs).await?;
    let common = |role: &str, i: usize| -> Vec<String> {
        let mut argv: Vec<String> = vec![
            role.into(),
            "--model".into(),
            model_s.clone(),
            "--router".into(),
            internal_addr.to_string(),
            "--worker-id".into(),
            format!("{role}-{i}"),
            "--kv-blocks".into(),
            args.kv_blocks.to_string(),
        ];
        argv.extend(args.device.to_args());
        argv
    };
    // Each worker's `/metrics` listens on a port picked here, so it can be printed.
    let mut metrics = vec![("router".to_string(), args.http_addr)];
    for i in 0..args.prefill_workers {
        let name = format!("prefill-{i}");
        let addr = free_loopback_addr()?;
        let mut argv = common("prefill", i);
        argv.extend(["--metrics-addr".into(), addr.to_string()]);
        argv.extend(["--speculative".into(), args.spec.speculative.to_string()]);
        if let Some(d) = &args.spec.drafter {
            argv.extend(["--drafter".into(), d.to_string_lossy().into_owned()]);
        }
        procs.push(spawn(&exe, &name, &argv, &token)?);
        metrics.push((name, addr));
    }
    for i in 0..args.decode_workers {
        let name = format!("decode-{i}");
        let addr = free_loopback_addr()?;
        let mut argv = common("decode", i);
        argv.extend(args.spec.to_args());
        argv.extend([
            "--local-prefill-threshold".into(),
            args.local_prefill_threshold.to_string(),
            "--metrics-addr".into(),
            addr.to_string(),
        ]);
        procs.push(spawn(&exe, &name, &argv, &token)?);
        metrics.push((name, addr));
    }
    wait_for_health(args.http_addr, deadline, &mut procs).await?;

    println!(
        "ferry is up: {served} on {} prefill + {} decode worker(s), routing policy {}",
        args.prefill_workers,
        args.decode_workers,
        args.policy.as_str()
    );
    if args.device.device.is_gpu() {
        println!(
            "  Device: {} ({} mode); a worker that cannot open it warns and runs on the CPU",
            args.device.device,
            args.device.gpu_mode.as_str()
        );
    }
    println!("  HTTP (OpenAI API):         http://{}/v1", args.http_addr);
    println!("  gRPC (ferry.v1.Inference): {}", args.grpc_addr);
    println!("  Prometheus metrics:");
    for (name, addr) in &metrics {
        println!("    {name:<24}http://{addr}/metrics");
    }
    if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_some()
        || std::env::var_os("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
    {
        println!("  Traces: every process exports OTLP/gRPC (OTEL_EXPORTER_OTLP_ENDPOINT)");
    }
    println!("Try:");
    println!(
        "  curl http://{}/v1/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{served}\", \"prompt\": \"In the beginning God created\", \"max_tokens\": 32, \"temperature\": 0}}'",
        args.http_addr
    );
    println!("Ctrl-C stops the cluster.");

    // Run until a signal, or until a child dies (then stop the rest).
    let died = tokio::select! {
        _ = shutdown.cancelled() => None,
        name = first_exit(&mut procs) => Some(name),
    };
    if let Some(name) = &died {
        eprintln!("ferry up: {name} exited; stopping the cluster");
    }
    stop_all(procs).await;
    match died {
        Some(name) => bail!("{name} exited unexpectedly"),
        None => Ok(()),
    }
}

/// A loopback address with a port free right now (the child binds it moments later).
fn free_loopback_addr() -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("picking a free port")?;
    Ok(listener.local_addr()?)
}

/// Resolves with the name of the first child that exits.
async fn first_exit(procs: &mut [Proc]) -> String {
    loop {
        for p in procs.iter_mut() {
            if let Ok(Some(_)) = p.child.try_wait() {
                return p.name.clone();
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Closes every child's stdin (workers first, the router last), waits for clean exits, and
/// kills whatever is still running after the grace period.
async fn stop_all(mut procs: Vec<Proc>) {
    procs.reverse();
    for p in procs.iter_mut() {
        if let Some(mut stdin) = p.child.stdin.take() {
            let _ = stdin.shutdown().await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for p in procs.iter_mut() {
        let left = deadline.saturating_duration_since(Instant::now());
        if tokio::time::timeout(left, p.child.wait()).await.is_err() {
            eprintln!("ferry up: {} did not stop in time; killing it", p.name);
            let _ = p.child.kill().await;
        }
    }
}

fn check_alive(procs: &mut [Proc]) -> anyhow::Result<()> {
    for p in procs.iter_mut() {
        if let Ok(Some(status)) = p.child.try_wait() {
            bail!("{} exited during start-up ({status})", p.name);
        }
    }
    Ok(())
}

async fn wait_for_port(
    addr: SocketAddr,
    deadline: Instant,
    procs: &mut [Proc],
) -> anyhow::Result<()> {
    while Instant::now() < deadline {
        check_alive(procs)?;
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("nothing listens on {addr} after the start-up timeout")
}

/// Waits until the router's `/health` answers 200 (a decode worker has registered).
async fn wait_for_health(
    addr: SocketAddr,
    deadline: Instant,
    procs: &mut [Proc],
) -> anyhow::Result<()> {
    while Instant::now() < deadline {
        check_alive(procs)?;
        if health_ok(addr).await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the cluster did not become healthy at http://{addr}/health in time")
}

async fn health_ok(addr: SocketAddr) -> bool {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let req = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return false;
    }
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut buf)).await;
    buf.starts_with(b"HTTP/1.1 200") || buf.starts_with(b"HTTP/1.0 200")
}
