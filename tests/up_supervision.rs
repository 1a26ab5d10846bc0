//! `ferry up` supervises its children, through the real binary: a decode worker, the prefill
//! worker and the router are each SIGKILLed (the workers under load) and each is restarted
//! with the same id and addresses while the cluster keeps serving; no request fails. SIGTERM
//! then stops everything.
mod cluster;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry_proto::auth::AttachToken;
use ferry_proto::internal::decode_worker_client::DecodeWorkerClient;
use ferry_proto::internal::GetStatsRequest;
use ferry_proto::v1::FinishReason;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

const START_TIMEOUT: Duration = Duration::from_secs(90);
/// A restarted child must be back in the router's `/health` within this.
const RESTART_TIMEOUT: Duration = Duration::from_secs(30);

/// A child of `ferry up`, read from `/proc`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Kid {
    pid: u32,
    /// `router`, `prefill` or `decode`.
    role: String,
    /// `--worker-id`, for workers.
    worker_id: Option<String>,
    /// `--grpc-addr`.
    grpc_addr: Option<String>,
}

/// A running `ferry up`; SIGKILLed with its children on drop.
struct Up {
    child: Child,
    http: SocketAddr,
    grpc: SocketAddr,
    log: PathBuf,
    _dir: tempfile::TempDir,
    client: reqwest::Client,
}

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
}

/// The parent pid field of `/proc/PID/stat` (after the parenthesised command name).
fn ppid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

fn cmdline(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn flag(argv: &[String], name: &str) -> Option<String> {
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1).cloned())
}

impl Up {
    fn start() -> Self {
        Self::start_with(&[])
    }

    /// `ferry up` with `extra` flags.
    fn start_with(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let log = dir.path().join("up.log");
        let out = std::fs::File::create(&log).expect("the log file");
        let err = out.try_clone().expect("clone the log handle");
        let (http, grpc) = (free_addr(), free_addr());
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferry"));
        cmd.args(["up", "--prefill-workers", "1", "--decode-workers", "2"])
            .args(["--kv-blocks", "256", "--http-addr", &http.to_string()])
            .args(["--grpc-addr", &grpc.to_string()])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        for (key, _) in std::env::vars_os() {
            let name = key.to_string_lossy();
            if name.starts_with("FERRY_") && name != "FERRY_LOG" {
                cmd.env_remove(&key);
            }
        }
        // A known token, so this test can call the workers' (internal) GetStats.
        cmd.env("FERRY_CLUSTER_TOKEN", cluster::CLUSTER_TOKEN);
        let child = cmd.spawn().expect("ferry up starts");
        Self {
            child,
            http,
            grpc,
            log,
            _dir: dir,
            client: reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("an HTTP client"),
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The live children of `ferry up`.
    fn kids(&self) -> Vec<Kid> {
        let me = self.child.id();
        let mut out = Vec::new();
        for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            if ppid(pid) != Some(me) {
                continue;
            }
            let argv = cmdline(pid);
            // ferry's children: `ferry <role> …`; the local NATS server: `nats-server -c …`.
            let role = match argv.first() {
                Some(exe) if exe.ends_with("nats-server") => "nats-server".to_string(),
                _ => match argv.get(1) {
                    Some(role) => role.clone(),
                    None => continue,
                },
            };
            out.push(Kid {
                pid,
                role,
                worker_id: flag(&argv, "--worker-id"),
                grpc_addr: flag(&argv, "--grpc-addr"),
            });
        }
        out
    }

    fn kid(&self, pred: impl Fn(&Kid) -> bool) -> Option<Kid> {
        self.kids().into_iter().find(pred)
    }

    async fn health(&self) -> Option<(u64, u64)> {
        let resp = self
            .client
            .get(format!("http://{}/health", self.http))
            .send()
            .await
            .ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body: serde_json::Value = resp.json().await.ok()?;
        Some((
            body["prefill_workers"].as_u64()?,
            body["decode_workers"].as_u64()?,
        ))
    }

    async fn wait_health(&mut self, want: (u64, u64), timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            assert!(
                self.child.try_wait().ok().flatten().is_none(),
                "ferry up exited:\n{}",
                self.log_text()
            );
            // Supervision starts once `ferry up` has printed that it is up: before that, a
            // child that exits is a start-up failure.
            if self.health().await == Some(want) && self.log_text().contains("ferry is up") {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "/health is {:?}, want {want:?} after {timeout:?}\n{}",
                self.health().await,
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for a child other than `old` that matches `pred` (the restarted one).
    async fn wait_restarted(&self, old: &Kid, pred: impl Fn(&Kid) -> bool) -> Kid {
        let deadline = Instant::now() + RESTART_TIMEOUT;
        loop {
            if let Some(k) = self.kid(|k| k.pid != old.pid && pred(k)) {
                return k;
            }
            assert!(
                Instant::now() < deadline,
                "{old:?} was not restarted\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn grpc(
        &self,
    ) -> ferry_proto::v1::inference_client::InferenceClient<tonic::transport::Channel> {
        ferry_proto::v1::inference_client::InferenceClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connect to the router")
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log_text();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            eprintln!("---- ferry up log (tail) ----");
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
        }
        for k in self.kids() {
            let _ = Command::new("kill")
                .args(["-KILL", &k.pid.to_string()])
                .status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `n` greedy requests at once (long prompts when `long`, so they need a prefill) and
/// asserts every one completes; `during` runs once they are all in flight.
async fn under_load<F: std::future::Future<Output = ()>>(up: &Up, n: usize, long: bool, during: F) {
    const MAX: u32 = 48;
    let client = up.grpc().await;
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let mut client = client.clone();
            let prompt = if long {
                format!("Part {i}. {}", cluster::long_prompt())
            } else {
                format!("Request {i}: {}", cluster::short_prompt())
            };
            let req = cluster::greedy_request(&prompt, MAX);
            tokio::spawn(async move { cluster::generate(&mut client, req).await })
        })
        .collect();
    during.await;
    for (i, task) in tasks.into_iter().enumerate() {
        let out = task
            .await
            .expect("the request task")
            .unwrap_or_else(|e| panic!("request {i} failed: {e:?}\n{}", up.log_text()));
        assert_eq!(out.token_ids.len(), MAX as usize, "request {i}");
        assert_eq!(out.finish_reason, Some(FinishReason::Length), "request {i}");
    }
}

/// A `DecodeWorker` client of the worker at `addr`, signed with the cluster token.
async fn decode_client(
    addr: &str,
) -> Result<DecodeWorkerClient<InterceptedService<Channel, AttachToken>>, tonic::transport::Error> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("a worker address")
        .connect()
        .await?;
    Ok(DecodeWorkerClient::with_interceptor(
        channel,
        AttachToken::new(Some(cluster::cluster_token())),
    ))
}

async fn decode_running(addr: &str) -> u32 {
    let Ok(mut c) = decode_client(addr).await else {
        return 0;
    };
    c.get_stats(GetStatsRequest {})
        .await
        .map(|r| r.into_inner().running_requests)
        .unwrap_or(0)
}

#[tokio::test]
async fn ferry_up_restarts_a_killed_worker_or_router_and_keeps_serving() {
    let mut up = Up::start();
    up.wait_health((1, 2), START_TIMEOUT).await;
    assert_eq!(up.kids().len(), 4, "{:?}", up.kids());

    // A decode worker, mid-load: its requests migrate; it comes back as itself.
    let victim = up
        .kid(|k| k.worker_id.as_deref() == Some("decode-0"))
        .expect("decode-0 runs");
    let addr = victim.grpc_addr.clone().expect("--grpc-addr is passed");
    let killed_at = std::cell::Cell::new(None);
    under_load(&up, 16, false, async {
        let deadline = Instant::now() + Duration::from_secs(30);
        while decode_running(&addr).await == 0 {
            assert!(Instant::now() < deadline, "decode-0 never got a request");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        cluster::signal(victim.pid, "KILL");
        killed_at.set(Some(Instant::now()));
    })
    .await;
    let back = up
        .wait_restarted(&victim, |k| k.worker_id.as_deref() == Some("decode-0"))
        .await;
    assert_eq!(back.grpc_addr, victim.grpc_addr, "same gRPC address");
    up.wait_health((1, 2), RESTART_TIMEOUT).await;
    let mut stats = decode_client(&addr)
        .await
        .expect("the restarted worker answers at its address");
    let s = stats
        .get_stats(GetStatsRequest {})
        .await
        .expect("GetStats")
        .into_inner();
    assert_eq!(s.worker_id, "decode-0");
    eprintln!(
        "decode-0: SIGKILL → back in /health after {:?}",
        killed_at.get().expect("killed").elapsed()
    );
    // It serves again: round the cluster with requests until it has finished one.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut client = up.grpc().await;
    loop {
        cluster::generate(
            &mut client,
            cluster::greedy_request(&cluster::short_prompt(), 4),
        )
        .await
        .expect("a request after the restart");
        let s = stats
            .get_stats(GetStatsRequest {})
            .await
            .expect("GetStats")
            .into_inner();
        if s.requests_finished > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restarted decode-0 got no request"
        );
    }

    // The prefill worker, while requests need it: they recompute on the decode workers.
    let victim = up
        .kid(|k| k.role == "prefill")
        .expect("the prefill worker runs");
    let started = Instant::now();
    under_load(&up, 8, true, async {
        cluster::signal(victim.pid, "KILL");
    })
    .await;
    up.wait_restarted(&victim, |k| k.role == "prefill").await;
    up.wait_health((1, 2), RESTART_TIMEOUT).await;
    eprintln!(
        "prefill-0: SIGKILL → back in /health after {:?}",
        started.elapsed()
    );

    // The router: workers re-register with the new one, on the same addresses.
    let victim = up.kid(|k| k.role == "router").expect("the router runs");
    cluster::signal(victim.pid, "KILL");
    let killed = Instant::now();
    up.wait_restarted(&victim, |k| k.role == "router").await;
    up.wait_health((1, 2), RESTART_TIMEOUT).await;
    eprintln!(
        "router: SIGKILL → all workers registered again after {:?}",
        killed.elapsed()
    );
    let mut client = up.grpc().await;
    cluster::generate(
        &mut client,
        cluster::greedy_request(&cluster::short_prompt(), 4),
    )
    .await
    .expect("a request through the restarted router");

    let log = up.log_text();
    for name in ["decode-0", "prefill-0", "router"] {
        assert!(
            log.lines()
                .any(|l| l.contains("child exited") && l.contains(name)),
            "ferry up logs {name}'s exit:\n{log}"
        );
    }

    // SIGTERM stops everything, cleanly.
    let kids = up.kids();
    cluster::signal(up.child.id(), "TERM");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = up.child.try_wait().expect("wait on ferry up") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "ferry up did not stop on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        status.success(),
        "ferry up exits 0 on SIGTERM: {status}\n{}",
        up.log_text()
    );
    for k in kids {
        assert!(
            !std::path::Path::new(&format!("/proc/{}", k.pid)).exists()
                || ppid(k.pid) != Some(up.child.id()),
            "{k:?} outlived ferry up"
        );
    }
}

/// `ferry up --events nats`: a local NATS server is started and supervised with the others;
/// the router and the workers use it (no worker registers directly); killed, it is restarted
/// and routing recovers; SIGTERM stops it too.
#[tokio::test]
async fn ferry_up_events_nats_runs_a_supervised_local_nats_server() {
    let mut up = Up::start_with(&["--events", "nats"]);
    up.wait_health((1, 2), START_TIMEOUT).await;
    let nats = up
        .kid(|k| k.role == "nats-server")
        .unwrap_or_else(|| panic!("a nats-server child: {:?}\n{}", up.kids(), up.log_text()));
    let metrics = || async {
        up.client
            .get(format!("http://{}/metrics", up.http))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("the /metrics body")
    };
    let connected = cluster::counter_value(&metrics().await, "ferry_router_events_connected");
    assert_eq!(connected, 1.0, "the router is on the events plane");
    let mut client = up.grpc().await;
    let out = cluster::generate(&mut client, cluster::greedy_request("And God said", 4))
        .await
        .expect("a request through the events plane");
    assert_eq!(out.finish_reason, Some(FinishReason::Length));

    cluster::signal(nats.pid, "KILL");
    let restarted = up.wait_restarted(&nats, |k| k.role == "nats-server").await;
    let deadline = Instant::now() + RESTART_TIMEOUT;
    while cluster::counter_value(&metrics().await, "ferry_router_events_connected") != 1.0 {
        assert!(
            Instant::now() < deadline,
            "the router did not reconnect\n{}",
            up.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = cluster::generate(&mut client, cluster::greedy_request("And God said", 4))
        .await
        .expect("a request after the NATS restart");
    assert_eq!(out.finish_reason, Some(FinishReason::Length));

    cluster::signal(up.child.id(), "TERM");
    let deadline = Instant::now() + Duration::from_secs(20);
    while up.child.try_wait().expect("wait on ferry up").is_none() {
        assert!(
            Instant::now() < deadline,
            "ferry up did not stop on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !std::path::Path::new(&format!("/proc/{}", restarted.pid)).exists()
            || ppid(restarted.pid) != Some(up.child.id()),
        "the NATS server outlived ferry up"
    );
}
