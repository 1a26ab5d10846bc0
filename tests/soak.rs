//! A bounded soak through real processes: a router, a prefill worker and two decode workers
//! under 16 concurrent clients for `FERRY_SOAK_SECS` (default 60) seconds, every fifth client
//! request dropped mid-stream. Afterwards: no request failed, every KV block is back, and
//! every process's resident set plateaued: it grew by at most [`RSS_GROWTH_LIMIT_KIB`] from
//! the end of the warm-up to the end, and by at most [`RSS_PLATEAU_LIMIT_KIB`] over the
//! second half of the run.
mod cluster;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster::{Cluster, Role, Spec};
use ferry_proto::v1::FinishReason;

const CONCURRENCY: usize = 16;
/// Per-process VmRSS growth allowed after the warm-up. The workers' KV pools are allocated
/// at start but become resident as blocks are first written, so a worker grows by up to its
/// pool (256 blocks × 4 layers × 64 rows × 80 f32 here, 20 MiB) while the prefix cache fills; the rest is the
/// allocator's working set for requests, spans and buffers.
const RSS_GROWTH_LIMIT_KIB: u64 = 48 * 1024;
/// Per-process VmRSS growth allowed over the second half of the run, once the pools are
/// resident: a leak proportional to the requests served would show here.
const RSS_PLATEAU_LIMIT_KIB: u64 = 12 * 1024;
/// Warm-up before the baseline RSS is read (caches, pools and allocator arenas fill up).
const WARMUP: Duration = Duration::from_secs(10);

fn soak_duration() -> Duration {
    let secs = std::env::var("FERRY_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    Duration::from_secs(secs)
}

#[derive(Default)]
struct Counts {
    completed: AtomicU64,
    cancelled: AtomicU64,
}

/// One client: requests back to back until `end`; every fifth is dropped after two messages.
async fn client_loop(
    mut client: ferry_proto::v1::inference_client::InferenceClient<tonic::transport::Channel>,
    who: usize,
    end: Instant,
    counts: Arc<Counts>,
) {
    let prompts = [
        cluster::short_prompt(),
        cluster::golden_prompt(1),
        cluster::long_prompt(),
    ];
    let mut n = 0usize;
    while Instant::now() < end {
        n += 1;
        let base = &prompts[(who + n) % prompts.len()];
        // Some requests share a prefix with earlier ones, some are new.
        let prompt = if n % 3 == 0 {
            base.clone()
        } else {
            format!("Client {who}, request {n}. {base}")
        };
        let max = 8 + ((who * 7 + n * 5) % 40) as u32;
        let req = cluster::greedy_request(&prompt, max);
        if n % 5 == 0 {
            let mut stream = client
                .generate(req)
                .await
                .unwrap_or_else(|e| panic!("client {who} request {n}: {e:?}"))
                .into_inner();
            for _ in 0..2 {
                stream
                    .message()
                    .await
                    .unwrap_or_else(|e| panic!("client {who} request {n}: {e:?}"));
            }
            drop(stream);
            counts.cancelled.fetch_add(1, Ordering::Relaxed);
        } else {
            let out = cluster::generate(&mut client, req)
                .await
                .unwrap_or_else(|e| panic!("client {who} request {n}: {e:?}"));
            assert_eq!(
                out.token_ids.len(),
                max as usize,
                "client {who} request {n}"
            );
            assert_eq!(out.finish_reason, Some(FinishReason::Length));
            counts.completed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[tokio::test]
async fn sixteen_clients_for_a_minute_fail_nothing_leak_no_blocks_and_plateau_in_memory() {
    let cluster = Cluster::start(Spec::new(1, 2)).await;
    let mut pids = vec![("router".to_string(), cluster.router_pid())];
    for role in [Role::Prefill, Role::Decode] {
        for id in cluster.live(role) {
            pids.push((id.clone(), cluster.pid(&id)));
        }
    }
    let client = cluster.grpc().await;
    let counts = Arc::new(Counts::default());
    let started = Instant::now();
    let end = started + WARMUP + soak_duration();
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|who| tokio::spawn(client_loop(client.clone(), who, end, counts.clone())))
        .collect();
    tokio::time::sleep(WARMUP).await;
    let rss = || -> Vec<u64> { pids.iter().map(|(_, pid)| cluster::rss_kib(*pid)).collect() };
    let baseline = rss();
    let served_at_baseline = counts.completed.load(Ordering::Relaxed);
    tokio::time::sleep(soak_duration() / 2).await;
    let mid = rss();
    for task in tasks {
        task.await.expect("a client task");
    }
    let after = rss();
    let completed = counts.completed.load(Ordering::Relaxed);
    let cancelled = counts.cancelled.load(Ordering::Relaxed);
    eprintln!(
        "soak: {completed} requests completed ({} after the warm-up), {cancelled} dropped \
         mid-stream, in {:?}",
        completed - served_at_baseline,
        started.elapsed()
    );
    let metrics = cluster.router_metrics().await;
    for line in metrics
        .lines()
        .filter(|l| l.starts_with("ferry_request_failure_total{"))
    {
        let value: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        if !line.contains("kind=\"cancelled\"") {
            assert_eq!(value, 0.0, "the router counted failures: {line}");
        }
    }
    cluster.assert_kv_blocks_released().await;
    for (i, (name, _)) in pids.iter().enumerate() {
        let (before, mid, after) = (baseline[i], mid[i], after[i]);
        let growth = after.saturating_sub(before);
        let second_half = after.saturating_sub(mid);
        eprintln!(
            "soak: {name} VmRSS {before} → {mid} → {after} KiB (+{growth} KiB, +{second_half} KiB \
             in the second half)"
        );
        assert!(
            growth <= RSS_GROWTH_LIMIT_KIB,
            "{name} grew by {growth} KiB (limit {RSS_GROWTH_LIMIT_KIB} KiB): {before} → {after}"
        );
        assert!(
            second_half <= RSS_PLATEAU_LIMIT_KIB,
            "{name} grew by {second_half} KiB in the second half (limit \
             {RSS_PLATEAU_LIMIT_KIB} KiB): {mid} → {after}"
        );
    }
    assert!(
        completed > 0 && cancelled > 0,
        "the soak ran requests of both kinds"
    );
}
