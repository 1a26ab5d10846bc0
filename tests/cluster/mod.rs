//! A real ferry cluster for whole-system tests: a router and N prefill + M decode workers, each
//! a child process of the `ferry` binary under test, on loopback ports chosen here so the test
//! knows every address.
//!
//! ```text
//!  test ──gRPC ferry.v1.Inference / HTTP OpenAI──► router (grpc_addr, http_addr)
//!       ──GetStats──► prefill-i / decode-j (their grpc addresses)
//! ```
//!
//! Readiness is polled, never slept for: the router's ports accept connections, then `/health`
//! reports exactly the expected number of workers of each role and every worker answers
//! `GetStats`. Every child is SIGKILLed and reaped when its [`Cluster`] drops (also on panic),
//! and each child's stdin is a pipe held here with `--exit-on-stdin-close`, so even a test
//! process killed outright leaves no worker behind. Child logs go to a temporary directory; a
//! failing test prints their tails.
//!
//! Each `tests/cluster_*.rs` uses part of this module, so unused items are expected there.
#![allow(dead_code)]

use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use ferry_proto::internal::decode_worker_client::DecodeWorkerClient;
use ferry_proto::internal::prefill_worker_client::PrefillWorkerClient;
use ferry_proto::internal::{GetStatsRequest, WorkerStats};
use ferry_proto::v1::inference_client::InferenceClient;
use ferry_proto::v1::{
    generate_request, FinishReason, GenerateRequest, SamplingParams, StopConditions, Usage,
};
use futures::StreamExt;
use tonic::transport::Channel;

/// The embedded model's served name.
pub const MODEL: &str = "tiny-k3";
/// The embedded model's context length, in tokens.
pub const CONTEXT: usize = 1024;
/// The embedded model's KV page size, in tokens.
pub const PAGE: usize = 64;
/// KV blocks per worker: small, and enough for every test here.
pub const KV_BLOCKS: usize = 256;
/// Workers' heartbeat and KV-event period: short, so the router's view follows quickly.
pub const HEARTBEAT_MS: u64 = 50;
/// How long a cluster may take to start (the binary loads the embedded model per process).
pub const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long KV blocks may take to come back after the last response.
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);
/// Poll period for every readiness and state wait.
const POLL: Duration = Duration::from_millis(20);
/// Whole-cluster start attempts (a chosen port can be taken before the child binds it).
const START_ATTEMPTS: usize = 3;

/// A worker's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// What to start: worker counts, extra flags per role, and environment for every child.
#[derive(Debug, Clone, Default)]
pub struct Spec {
    prefill: usize,
    decode: usize,
    router_args: Vec<String>,
    prefill_args: Vec<String>,
    decode_args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Spec {
    /// `prefill` prefill workers and `decode` decode workers, default flags.
    pub fn new(prefill: usize, decode: usize) -> Self {
        Self {
            prefill,
            decode,
            ..Self::default()
        }
    }

    /// Extra `ferry router` flags.
    pub fn router(mut self, args: &[&str]) -> Self {
        self.router_args.extend(args.iter().map(|s| s.to_string()));
        self
    }

    /// Extra `ferry prefill` flags (every prefill worker).
    pub fn prefill(mut self, args: &[&str]) -> Self {
        self.prefill_args.extend(args.iter().map(|s| s.to_string()));
        self
    }

    /// Extra `ferry decode` flags (every decode worker).
    pub fn decode(mut self, args: &[&str]) -> Self {
        self.decode_args.extend(args.iter().map(|s| s.to_string()));
        self
    }

    /// Environment variables set in every process of this cluster alone (tests running at
    /// the same time in one test binary must not share settings through the process
    /// environment: a cluster whose workers read different values can fail).
    pub fn env(mut self, vars: &[(&str, &str)]) -> Self {
        self.env
            .extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        self
    }
}

/// Token ids of `text` as the cluster's `Tokenize` gives them.
pub async fn tokens(cluster: &Cluster, text: &str) -> Vec<u32> {
    cluster
        .grpc()
        .await
        .tokenize(ferry_proto::v1::TokenizeRequest {
            model: String::new(),
            text: text.into(),
            add_special_tokens: true,
        })
        .await
        .expect("Tokenize")
        .into_inner()
        .ids
}

/// The cluster token every child of a test cluster gets (in `FERRY_CLUSTER_TOKEN`); the
/// harness signs its own internal calls (`GetStats`) with it.
pub const CLUSTER_TOKEN: &str = "ferry-test-cluster-token";

/// [`CLUSTER_TOKEN`], parsed.
pub fn cluster_token() -> ferry_proto::auth::ClusterToken {
    CLUSTER_TOKEN.parse().expect("a valid token")
}

/// Clears `FERRY_*` (except `FERRY_LOG`) from a child's environment: the tests run the
/// embedded model with the flags and addresses given here, whatever the test run's environment.
/// Clears the caller's `FERRY_*` settings (except `FERRY_LOG`) and pins the CPU: the default
/// `--device auto` would put a GPU machine's workers on its GPU, and the reference text is the
/// CPU's. A test that passes `--device` overrides it.
fn remove_ferry_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        let name = key.to_string_lossy();
        if name.starts_with("FERRY_") && name != "FERRY_LOG" {
            cmd.env_remove(&key);
        }
    }
    cmd.env("FERRY_DEVICE", "cpu");
}

/// One child process of the `ferry` binary; SIGKILLed and reaped on drop.
pub struct Proc {
    name: String,
    child: Child,
    /// Held open: the child exits when it closes (`--exit-on-stdin-close`).
    stdin: Option<ChildStdin>,
    log: PathBuf,
}

impl Proc {
    /// Starts `ferry <args>` with the test environment, logging to `log_dir/<name>.log`.
    pub fn spawn(name: &str, args: &[String], log_dir: &Path) -> Self {
        Self::spawn_with_env(name, args, &[], log_dir)
    }

    /// [`Proc::spawn`] with `env` set in the child's environment.
    pub fn spawn_with_env(
        name: &str,
        args: &[String],
        env: &[(String, String)],
        log_dir: &Path,
    ) -> Self {
        let log = log_dir.join(format!("{name}.log"));
        let out = File::create(&log).expect("create a log file");
        let err = out.try_clone().expect("clone the log file handle");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferry"));
        cmd.args(args)
            .arg("--exit-on-stdin-close")
            .stdin(Stdio::piped())
            .stdout(out)
            .stderr(err);
        remove_ferry_env(&mut cmd);
        cmd.env("FERRY_CLUSTER_TOKEN", CLUSTER_TOKEN);
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let stdin = child.stdin.take();
        Self {
            name: name.into(),
            child,
            stdin,
            log,
        }
    }

    /// The name it was started under (its log file's stem).
    #[allow(dead_code)] // not every test binary that includes this module names its children
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Exit status, if the child has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stdin.take();
    }

    /// The child's threads, one line each: `tid name state wait-channel`, from `/proc` (Linux;
    /// empty elsewhere or once it exited). What a hung child is doing — parked on a futex,
    /// waiting in epoll, running — for a start-up timeout's report.
    pub fn threads(&self) -> String {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.child.id())) else {
            return String::new();
        };
        let mut lines: Vec<String> = tasks
            .flatten()
            .map(|task| {
                let dir = task.path();
                let read = |f: &str| {
                    std::fs::read_to_string(dir.join(f))
                        .unwrap_or_default()
                        .trim()
                        .to_string()
                };
                // `stat` is "tid (comm) state ...": the state follows the last ')'.
                let stat = read("stat");
                let state = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().next())
                    .unwrap_or("?")
                    .to_string();
                format!(
                    "{} {} {state} {}",
                    task.file_name().to_string_lossy(),
                    read("comm"),
                    read("wchan")
                )
            })
            .collect();
        lines.sort();
        lines.join("\n")
    }

    /// Every busy thread's backtrace (at most `frames` frames each) by `gdb -p` when `gdb` is
    /// on the path (`.ci/run` installs it), cut to `max_lines` lines; empty otherwise. Where in
    /// the code a child that stopped making progress is waiting, for a timeout's report.
    ///
    /// Compact, because CI shows only the head of a long failure message: a frame is its
    /// function's name alone, and threads parked idle in tokio's scheduler (the runtime's
    /// workers, its blocking pool, its I/O driver) are counted, not listed.
    #[allow(dead_code)] // not every test binary that includes this module reports stacks
    pub fn stacks(&self, frames: usize, max_lines: usize) -> String {
        let out = Command::new("timeout")
            .arg("30")
            .arg("gdb")
            .args(["-p", &self.child.id().to_string(), "-batch", "-nx", "-q"])
            .args(["-ex", "set pagination off"])
            .args(["-ex", &format!("thread apply all bt {frames}")])
            .stdin(Stdio::null())
            .output();
        let Ok(out) = out else {
            return String::new();
        };
        compact_stacks(&String::from_utf8_lossy(&out.stdout), max_lines)
    }

    /// The last `lines` lines of the child's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `gdb`'s `thread apply all bt` output cut down for a failure message: each thread a header
/// line and its frames' function names; threads idle in tokio's scheduler (parked workers,
/// the blocking pool waiting for work, the I/O driver in `epoll_wait`), in rayon's, and the
/// stdin watch only counted.
#[allow(dead_code)] // only the binaries that report stacks call it
fn compact_stacks(gdb: &str, max_lines: usize) -> String {
    // A thread is idle when the innermost frame past the waiting itself (syscalls, futexes,
    // condvars, epoll) is a scheduler's; a blocking-pool thread running a task, or a worker
    // stuck on a lock in our code, has our code there instead. The stdin watch of
    // `--exit-on-stdin-close` (`ferry_worker::shutdown`) always waits.
    const WAITING: [&str; 9] = [
        "syscall",
        "std::sys::",
        "std::sync::",
        "std::thread::",
        "parking_lot",
        "__",
        "epoll_wait",
        "pthread_",
        "mio::",
    ];
    // Schedulers whose threads wait there for work: tokio's, and rayon's (the CPU forward).
    const IDLE_IN: [&str; 2] = ["tokio::runtime::", "rayon_core::sleep::"];
    let is_idle = |(header, frames): &(String, Vec<String>)| {
        header.ends_with(" stdin-watch")
            || frames
                .iter()
                .find(|f| !WAITING.iter().any(|w| f.starts_with(w)))
                .is_some_and(|f| IDLE_IN.iter().any(|i| f.starts_with(i)))
    };
    let mut threads: Vec<(String, Vec<String>)> = Vec::new();
    for line in gdb.lines() {
        if line.starts_with("Thread ") {
            // "Thread 4 (Thread 0x… (LWP 20902) \"tokio-rt-worker\"):" → "Thread 4 tokio-rt-worker"
            let name = line.split('"').nth(1).unwrap_or("");
            let number = line.split_whitespace().nth(1).unwrap_or("?");
            threads.push((format!("Thread {number} {name}"), Vec::new()));
        } else if let (Some(rest), Some((_, frames))) = (line.strip_prefix('#'), threads.last_mut())
        {
            // "#3  0x… in foo::bar<T> () at src/x.rs:12" or "#0  foo () at …"
            let body = rest.split_once(' ').map_or(rest, |(_, b)| b).trim_start();
            let body = body.split_once(" in ").map_or(body, |(_, f)| f);
            let function = body.split(" (").next().unwrap_or(body);
            frames.push(function.to_string());
        }
    }
    let (idle, busy): (Vec<_>, Vec<_>) = threads.into_iter().partition(is_idle);
    let mut lines = vec![format!(
        "{} threads idle in tokio, rayon or the stdin watch (not listed)",
        idle.len()
    )];
    for (header, frames) in busy {
        lines.push(header);
        lines.extend(frames.into_iter().map(|f| format!("  {f}")));
    }
    lines.truncate(max_lines);
    lines.join("\n")
}

/// A worker process and its addresses.
struct Worker {
    id: String,
    role: Role,
    addr: SocketAddr,
    /// `None` once killed.
    proc: Option<Proc>,
}

/// Why a start attempt failed.
enum StartError {
    /// A child exited during start-up (perhaps its port was taken): try again on new ports.
    Exited(String),
    /// Nothing exited but the cluster did not become ready in time.
    Timeout(String),
}

/// A running cluster. Dropping it kills every process.
pub struct Cluster {
    grpc_addr: SocketAddr,
    http_addr: SocketAddr,
    internal_addr: SocketAddr,
    router: Option<Proc>,
    workers: Vec<Worker>,
    spec: Spec,
    http: reqwest::Client,
    // Declared last: dropped after the processes, whose logs it holds.
    logs: tempfile::TempDir,
}

/// `n` distinct free loopback ports (all bound at once, then released for the children).
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a loopback port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("bound address").port())
        .collect()
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

impl Cluster {
    /// Starts the cluster and waits until every worker is registered and answering.
    pub async fn start(spec: Spec) -> Self {
        let mut last = String::new();
        for _ in 0..START_ATTEMPTS {
            match Self::try_start(spec.clone()).await {
                Ok(cluster) => return cluster,
                Err(StartError::Exited(why)) => last = why,
                Err(StartError::Timeout(why)) => panic!("{why}"),
            }
        }
        panic!("the cluster did not start in {START_ATTEMPTS} attempts; last: {last}");
    }

    async fn try_start(spec: Spec) -> Result<Self, StartError> {
        let ports = free_ports(3 + spec.prefill + spec.decode);
        let logs = tempfile::tempdir().expect("a temporary log directory");
        let (grpc_addr, http_addr) = (loopback(ports[0]), loopback(ports[1]));
        let internal_addr = loopback(ports[2]);
        let mut router_args: Vec<String> = vec![
            "router".into(),
            "--grpc-addr".into(),
            grpc_addr.to_string(),
            "--http-addr".into(),
            http_addr.to_string(),
            "--internal-addr".into(),
            internal_addr.to_string(),
        ];
        router_args.extend(spec.router_args.iter().cloned());
        let router = Proc::spawn_with_env("router", &router_args, &spec.env, logs.path());
        let mut cluster = Self {
            grpc_addr,
            http_addr,
            internal_addr,
            router: Some(router),
            workers: Vec::new(),
            spec,
            http: reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("an HTTP client"),
            logs,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        // Workers retry registration with backoff; starting them once the router listens
        // keeps that backoff short.
        cluster.wait_for_port(internal_addr, deadline).await?;
        let mut next_port = ports[3..].iter().copied();
        for role in [Role::Prefill, Role::Decode] {
            let n = match role {
                Role::Prefill => cluster.spec.prefill,
                Role::Decode => cluster.spec.decode,
            };
            for i in 0..n {
                let port = next_port.next().expect("a port per worker");
                cluster.spawn_worker(role, format!("{}-{i}", role.as_str()), port);
            }
        }
        cluster.wait_ready(deadline).await?;
        Ok(cluster)
    }

    fn spawn_worker(&mut self, role: Role, id: String, port: u16) {
        let addr = loopback(port);
        let mut args: Vec<String> = vec![
            role.as_str().into(),
            "--router".into(),
            self.internal_addr.to_string(),
            "--worker-id".into(),
            id.clone(),
            "--grpc-addr".into(),
            addr.to_string(),
            "--kv-blocks".into(),
            KV_BLOCKS.to_string(),
            "--heartbeat-ms".into(),
            HEARTBEAT_MS.to_string(),
        ];
        args.extend(
            match role {
                Role::Prefill => &self.spec.prefill_args,
                Role::Decode => &self.spec.decode_args,
            }
            .iter()
            .cloned(),
        );
        let proc = Proc::spawn_with_env(&id, &args, &self.spec.env, self.logs.path());
        self.workers.push(Worker {
            id,
            role,
            addr,
            proc: Some(proc),
        });
    }

    /// Starts one more worker of `role` named `id` and waits until the router counts it.
    /// (The routing policies break ties by worker id, so a test can choose who wins a tie.)
    /// After a [`Cluster::kill`], first [`Cluster::wait_health`] until the router dropped the
    /// dead worker: readiness means `/health` counts exactly the live workers.
    pub async fn add_worker(&mut self, role: Role, id: &str) {
        assert!(
            self.workers.iter().all(|w| w.id != id),
            "worker id `{id}` is taken"
        );
        let id = id.to_string();
        for _ in 0..START_ATTEMPTS {
            let port = free_ports(1)[0];
            self.spawn_worker(role, id.clone(), port);
            match self.wait_ready(Instant::now() + START_TIMEOUT).await {
                Ok(()) => return,
                Err(StartError::Exited(_)) => {
                    self.workers.pop();
                }
                Err(StartError::Timeout(why)) => panic!("{why}"),
            }
        }
        panic!(
            "{id} did not start in {START_ATTEMPTS} attempts\n{}",
            self.logs_report()
        );
    }

    /// Fails when a child that should be running has exited.
    fn check_alive(&mut self) -> Result<(), StartError> {
        let mut dead = Vec::new();
        if let Some(p) = self.router.as_mut() {
            if let Some(status) = p.exited() {
                dead.push(format!("router exited ({status}):\n{}", p.log_tail(20)));
            }
        }
        for w in &mut self.workers {
            if let Some(p) = w.proc.as_mut() {
                if let Some(status) = p.exited() {
                    dead.push(format!("{} exited ({status}):\n{}", w.id, p.log_tail(20)));
                }
            }
        }
        if dead.is_empty() {
            Ok(())
        } else {
            Err(StartError::Exited(dead.join("\n")))
        }
    }

    async fn wait_for_port(
        &mut self,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<(), StartError> {
        loop {
            self.check_alive()?;
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(StartError::Timeout(format!(
                    "nothing listens on {addr} after {START_TIMEOUT:?}\n{}",
                    self.logs_report()
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until `/health` counts exactly the live workers of each role and every live
    /// worker answers `GetStats`.
    async fn wait_ready(&mut self, deadline: Instant) -> Result<(), StartError> {
        let want = (
            self.live(Role::Prefill).len(),
            self.live(Role::Decode).len(),
        );
        loop {
            self.check_alive()?;
            if self.health_counts().await == Some(want) && self.all_answer_stats().await {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(StartError::Timeout(format!(
                    "the cluster was not ready after {START_TIMEOUT:?} (want {want:?} prefill/decode \
                     workers registered, /health says {:?})\n{}{}",
                    self.health_counts().await,
                    self.logs_report(),
                    self.threads_report()
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }

    async fn all_answer_stats(&self) -> bool {
        for w in self.workers.iter().filter(|w| w.proc.is_some()) {
            if self.try_stats(&w.id).await.is_err() {
                return false;
            }
        }
        true
    }

    /// `(prefill, decode)` workers the router counts as healthy, or `None` while `/health`
    /// does not answer 200.
    pub async fn health_counts(&self) -> Option<(usize, usize)> {
        let resp = self.http.get(self.url("/health")).send().await.ok()?;
        if resp.status() != reqwest::StatusCode::OK {
            return None;
        }
        let body: serde_json::Value = resp.json().await.ok()?;
        let count = |k: &str| body[k].as_u64().map(|n| n as usize);
        Some((count("prefill_workers")?, count("decode_workers")?))
    }

    /// Waits until `/health` reports exactly `(prefill, decode)` workers (e.g. until the
    /// router has dropped a killed worker after its heartbeat timeout).
    pub async fn wait_health(&self, prefill: usize, decode: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let now = self.health_counts().await;
            if now == Some((prefill, decode)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "/health still reports {now:?} (prefill, decode) workers after {timeout:?}, \
                 want ({prefill}, {decode})"
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Ids of the live workers of `role`, in start order.
    pub fn live(&self, role: Role) -> Vec<String> {
        self.workers
            .iter()
            .filter(|w| w.role == role && w.proc.is_some())
            .map(|w| w.id.clone())
            .collect()
    }

    fn worker(&self, id: &str) -> &Worker {
        self.workers
            .iter()
            .find(|w| w.id == id)
            .unwrap_or_else(|| panic!("no worker `{id}`"))
    }

    /// The router process's id (for reading its `/proc/<pid>/status`).
    pub fn router_pid(&self) -> u32 {
        self.router
            .as_ref()
            .map(|p| p.child.id())
            .expect("the router is running")
    }

    /// The router's public gRPC address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// A worker's gRPC address.
    pub fn worker_addr(&self, id: &str) -> SocketAddr {
        self.worker(id).addr
    }

    /// `http://<router http addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http_addr)
    }

    /// `http://<router http addr>/v1`, for OpenAI clients.
    pub fn openai_base_url(&self) -> String {
        self.url("/v1")
    }

    /// A client of the public `ferry.v1.Inference` service.
    pub async fn grpc(&self) -> InferenceClient<Channel> {
        InferenceClient::connect(format!("http://{}", self.grpc_addr))
            .await
            .expect("connect to the router's gRPC address")
    }

    /// The router's internal address (Registry), where workers register.
    pub fn internal_addr(&self) -> SocketAddr {
        self.internal_addr
    }

    async fn try_stats(&self, id: &str) -> Result<WorkerStats, String> {
        let w = self.worker(id);
        worker_stats(w.role, w.addr).await
    }

    /// A live worker's `GetStats`.
    pub async fn stats(&self, id: &str) -> WorkerStats {
        self.try_stats(id)
            .await
            .unwrap_or_else(|e| panic!("GetStats on {id}: {e}"))
    }

    /// Polls `id`'s stats until `pred` holds; panics with the last stats after `timeout`.
    pub async fn wait_stats(
        &self,
        id: &str,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&WorkerStats) -> bool,
    ) -> WorkerStats {
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.stats(id).await;
            if pred(&s) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "{id}: still not {what} after {timeout:?}: {s:?}"
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// SIGKILLs a worker (no clean shutdown: no deregistration, open connections reset).
    pub fn kill(&mut self, id: &str) {
        let w = self
            .workers
            .iter_mut()
            .find(|w| w.id == id)
            .unwrap_or_else(|| panic!("no worker `{id}`"));
        let mut proc = w
            .proc
            .take()
            .unwrap_or_else(|| panic!("{id} is already dead"));
        proc.kill();
    }

    /// A live worker's process id.
    pub fn pid(&self, id: &str) -> u32 {
        self.worker(id)
            .proc
            .as_ref()
            .unwrap_or_else(|| panic!("{id} is dead"))
            .child
            .id()
    }

    /// Everything a live worker has logged so far.
    #[allow(dead_code)] // not every test binary reads logs
    pub fn log(&self, id: &str) -> String {
        let p = self
            .worker(id)
            .proc
            .as_ref()
            .unwrap_or_else(|| panic!("{id} is dead"));
        std::fs::read_to_string(&p.log).unwrap_or_default()
    }

    /// SIGSTOPs a live worker (a stalled process: its sockets stay open, nothing answers).
    /// [`Cluster::resume`] continues it; a paused worker is still killed on drop.
    pub fn pause(&self, id: &str) {
        signal(self.pid(id), "STOP");
    }

    /// SIGCONTs a worker paused by [`Cluster::pause`].
    pub fn resume(&self, id: &str) {
        signal(self.pid(id), "CONT");
    }

    /// The router's `/metrics` text.
    pub async fn router_metrics(&self) -> String {
        self.http
            .get(self.url("/metrics"))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("the /metrics body")
    }

    /// Every live worker's KV blocks are all back in its pool (`kv_blocks_used == 0`), polled
    /// for a short while since a worker frees a request's blocks as its stream ends.
    pub async fn assert_kv_blocks_released(&self) {
        for id in self
            .workers
            .iter()
            .filter(|w| w.proc.is_some())
            .map(|w| w.id.clone())
        {
            self.wait_stats(&id, RELEASE_TIMEOUT, "back to 0 KV blocks used", |s| {
                s.kv_blocks_used == 0
            })
            .await;
        }
    }

    /// POSTs `body` as JSON; returns the status and the body parsed as JSON (panics when it
    /// is not JSON).
    pub async fn post_json(
        &self,
        path: &str,
        body: &serde_json::Value,
    ) -> (u16, serde_json::Value) {
        let resp = self
            .http
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        read_json(path, resp).await
    }

    /// POSTs raw bytes with a JSON content type (for malformed bodies).
    pub async fn post_raw(&self, path: &str, body: &'static str) -> (u16, serde_json::Value) {
        let resp = self
            .http
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        read_json(path, resp).await
    }

    /// GETs `path`; status and JSON body.
    pub async fn get_json(&self, path: &str) -> (u16, serde_json::Value) {
        let resp = self
            .http
            .get(self.url(path))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        read_json(path, resp).await
    }

    /// POSTs a `stream: true` request and returns the SSE `data:` payloads before `[DONE]`,
    /// parsed as JSON. Panics unless the answer is 200 `text/event-stream` ending in `[DONE]`.
    pub async fn post_sse(&self, path: &str, body: &serde_json::Value) -> Vec<serde_json::Value> {
        let resp = self
            .http
            .post(self.url(path))
            .json(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        let status = resp.status();
        let ctype = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let text = resp.text().await.expect("the SSE body");
        assert_eq!(status, 200, "POST {path} (stream): {text}");
        assert!(
            ctype.starts_with("text/event-stream"),
            "POST {path} (stream): content-type {ctype:?}"
        );
        parse_sse(&text)
    }

    /// The tails of every child's log, for failure messages.
    /// Every child's threads ([`Proc::threads`]).
    fn threads_report(&self) -> String {
        let procs = self
            .router
            .iter()
            .chain(self.workers.iter().filter_map(|w| w.proc.as_ref()));
        procs
            .map(|p| {
                format!(
                    "---- {} threads (tid name state wait-channel) ----\n{}\n",
                    p.name,
                    p.threads()
                )
            })
            .collect()
    }

    pub fn logs_report(&self) -> String {
        let mut out = String::new();
        let procs = self
            .router
            .iter()
            .chain(self.workers.iter().filter_map(|w| w.proc.as_ref()));
        for p in procs {
            out.push_str(&format!(
                "---- {} log (tail) ----\n{}\n",
                p.name,
                p.log_tail(30)
            ));
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.logs_report());
        }
        // Workers first, then the router.
        for w in &mut self.workers {
            w.proc.take();
        }
        self.router.take();
    }
}

/// `GetStats` of the worker of `role` at `addr`, signed with the cluster token.
pub async fn worker_stats(role: Role, addr: SocketAddr) -> Result<WorkerStats, String> {
    let channel = Channel::from_shared(format!("http://{}", addr))
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    let auth = ferry_proto::auth::AttachToken::new(Some(cluster_token()));
    let stats = match role {
        Role::Prefill => {
            PrefillWorkerClient::with_interceptor(channel, auth)
                .get_stats(GetStatsRequest {})
                .await
        }
        Role::Decode => {
            DecodeWorkerClient::with_interceptor(channel, auth)
                .get_stats(GetStatsRequest {})
                .await
        }
    };
    stats.map(|r| r.into_inner()).map_err(|e| e.to_string())
}

/// Sends `SIG{name}` to `pid` with `kill(1)`.
pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .expect("kill(1) runs");
    assert!(status.success(), "kill -{name} {pid}: {status}");
}

/// A process's resident set size in KiB (`VmRSS` in `/proc/PID/status`).
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"))
}

/// The value of the counter `name` (no labels other than `role`) in a `/metrics` text, 0 when
/// absent.
pub fn counter_value(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

async fn read_json(what: &str, resp: reqwest::Response) -> (u16, serde_json::Value) {
    let status = resp.status().as_u16();
    let text = resp
        .text()
        .await
        .unwrap_or_else(|e| panic!("{what}: body: {e}"));
    let body = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{what}: the body is not JSON ({e}): {text:?}"));
    (status, body)
}

/// SSE `data:` payloads before `[DONE]`, as JSON. Panics when `[DONE]` is missing or is not last.
pub fn parse_sse(text: &str) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    let mut done = false;
    for event in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
        assert!(!done, "an event after [DONE]: {event:?}");
        let data: String = event
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect::<Vec<_>>()
            .join("\n");
        if data == "[DONE]" {
            done = true;
            continue;
        }
        out.push(
            serde_json::from_str(&data)
                .unwrap_or_else(|e| panic!("an SSE payload that is not JSON ({e}): {data:?}")),
        );
    }
    assert!(done, "the stream did not end with [DONE]:\n{text}");
    out
}

/// Concatenated `choices[0].text` of `/v1/completions` SSE chunks, and the last finish reason.
pub fn sse_completion_text(chunks: &[serde_json::Value]) -> (String, Option<String>) {
    let mut text = String::new();
    let mut finish = None;
    for c in chunks {
        assert!(c.get("error").is_none(), "an error chunk: {c}");
        for choice in c["choices"].as_array().into_iter().flatten() {
            text.push_str(choice["text"].as_str().unwrap_or_default());
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (text, finish)
}

/// A whole `Generate` stream.
#[derive(Debug, Clone, Default)]
pub struct Generated {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<ferry_proto::v1::TokenLogprob>,
    /// The prompt's log-probabilities, when the request asked (`prompt_logprobs`).
    pub prompt_logprobs: Vec<ferry_proto::v1::TokenLogprob>,
    pub finish_reason: Option<FinishReason>,
    pub usage: Option<Usage>,
    pub messages: usize,
}

/// Runs `Generate` to its end; the first error (at the start or mid-stream) is returned.
pub async fn generate(
    client: &mut InferenceClient<Channel>,
    req: GenerateRequest,
) -> Result<Generated, tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = Generated::default();
    while let Some(msg) = stream.next().await {
        let msg = msg?;
        out.messages += 1;
        out.text.push_str(&msg.text);
        out.token_ids.extend(&msg.token_ids);
        out.logprobs.extend(msg.logprobs);
        out.prompt_logprobs.extend(msg.prompt_logprobs);
        if msg.finish_reason != FinishReason::Unspecified as i32 {
            out.finish_reason = FinishReason::try_from(msg.finish_reason).ok();
            out.usage = msg.usage;
        }
    }
    Ok(out)
}

/// A text `GenerateRequest` with the given sampling and `max_tokens`.
pub fn request(
    prompt: &str,
    max_tokens: u32,
    sampling: SamplingParams,
    ignore_eos: bool,
) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::Text(prompt.into())),
        sampling: Some(sampling),
        stop: Some(StopConditions {
            max_tokens,
            ignore_eos,
            ..StopConditions::default()
        }),
        ..GenerateRequest::default()
    }
}

/// Greedy sampling (temperature 0).
pub fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: Some(0.0),
        ..SamplingParams::default()
    }
}

/// A greedy, EOS-ignoring text request: its output is exactly `ferry generate --ignore-eos`.
pub fn greedy_request(prompt: &str, max_tokens: u32) -> GenerateRequest {
    request(prompt, max_tokens, greedy(), true)
}

/// The golden cases (`models/tiny-k3/golden/cases.json`).
pub fn golden_cases() -> Vec<serde_json::Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny-k3/golden/cases.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let meta: serde_json::Value = serde_json::from_str(&text).expect("cases.json is JSON");
    meta["cases"].as_array().expect("a `cases` array").clone()
}

/// The prompt of golden case `i`.
pub fn golden_prompt(i: usize) -> String {
    golden_cases()[i]["prompt"]
        .as_str()
        .expect("a `prompt` string")
        .to_string()
}

/// Golden case 0: 9 tokens, under the decode workers' default local-prefill threshold (32).
pub fn short_prompt() -> String {
    golden_prompt(0)
}

/// Golden case 2: 211 tokens (3 full 64-token blocks), prefilled remotely.
pub fn long_prompt() -> String {
    golden_prompt(2)
}

/// `ferry generate --prompt P --max-tokens N --ignore-eos` (greedy), single process: the
/// reference output, without the trailing newline it prints.
pub async fn reference_generate(prompt: &str, max_tokens: u32) -> String {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_ferry"));
    cmd.args(["generate", "--prompt", prompt, "--max-tokens"])
        .arg(max_tokens.to_string())
        .arg("--ignore-eos")
        .kill_on_drop(true);
    remove_ferry_env(cmd.as_std_mut());
    let out = cmd.output().await.expect("ferry generate runs");
    assert!(
        out.status.success(),
        "ferry generate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8 output");
    text.strip_suffix('\n')
        .unwrap_or_else(|| panic!("ferry generate's output lacks its final newline: {text:?}"))
        .to_string()
}

/// How to install what the Python-driven tests run (`scripts/test.sh` does it).
pub const PYTHON_INSTALL: &str = "python3 -m pip install -r tests/python/requirements.txt";

/// Runs `program args…` in the repository root without proxies (every address a test uses is
/// loopback), killed after `timeout`; panics, naming the install command, if it cannot start.
pub async fn run_local(
    program: &std::path::Path,
    args: &[&str],
    timeout: Duration,
) -> std::process::Output {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .kill_on_drop(true);
    for var in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "GRPC_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "grpc_proxy",
    ] {
        cmd.env_remove(var);
    }
    match tokio::time::timeout(timeout, cmd.output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => panic!(
            "cannot run {} ({e}); install it: `{PYTHON_INSTALL}`",
            program.display()
        ),
        Err(_) => panic!(
            "`{} {}` ran longer than {timeout:?}",
            program.display(),
            args.join(" ")
        ),
    }
}
