//! The cluster with `--transport ucx`: prefill workers put the prompt's KV into the decode
//! worker's registered pool with one-sided UCX puts, between real processes, over shared
//! memory (`UCX_TLS=posix,sysv,cma`) and TCP on loopback (`UCX_TLS=tcp`). Greedy output equals
//! `ferry generate`, both sides agree on the bytes moved, a prompt sharing a prefix the decode
//! worker holds ships only the blocks past it, a SIGKILLed prefill worker's requests are
//! recomputed, every block comes back (also from a writer of three lanes, `FERRY_UCX_LANES`),
//! and a decode worker with no prefill worker speaking its transport prefills itself instead of
//! hanging.
mod cluster;

use std::time::Duration;

use cluster::{Cluster, Role, Spec};
use ferry_proto::v1::FinishReason;

const MAX_TOKENS: u32 = 16;

/// UCX over shared memory (`UCX_TLS`).
const SHM: &str = "posix,sysv,cma";

/// One prefill and one decode worker speaking UCX over the transports `tls`, set in that
/// cluster's processes alone: the tests here run at the same time, and a prefill worker on
/// `tcp` cannot reach a decode worker on shared memory ("Destination is unreachable"), which
/// is what a shared process environment used to let happen.
fn ucx_spec(tls: &str) -> Spec {
    ucx_spec_lanes(tls, Some(1))
}

/// As [`ucx_spec`], the prefill worker's writer spreading each transfer over `lanes` UCX
/// progress threads (`FERRY_UCX_LANES`; `None`: unset, the transport's default).
fn ucx_spec_lanes(tls: &str, lanes: Option<usize>) -> Spec {
    let devices = if tls == "tcp" { "lo" } else { "all" };
    let spec = Spec::new(1, 1)
        .prefill(&["--transport", "ucx"])
        .decode(&["--transport", "ucx"]);
    match lanes {
        Some(n) => spec.env(&[
            ("UCX_TLS", tls),
            ("UCX_NET_DEVICES", devices),
            ("FERRY_UCX_LANES", &n.to_string()),
        ]),
        None => spec.env(&[("UCX_TLS", tls), ("UCX_NET_DEVICES", devices)]),
    }
}

async fn greedy_over(tls: &str, lanes: Option<usize>) {
    let prompt = cluster::long_prompt();
    let want = cluster::reference_generate(&prompt, MAX_TOKENS).await;
    let cluster = Cluster::start(ucx_spec_lanes(tls, lanes)).await;
    let lanes = lanes.unwrap_or(ferry_kvtransfer::ucx::DEFAULT_LANES);
    let (prefill, decode) = (
        cluster.live(Role::Prefill)[0].clone(),
        cluster.live(Role::Decode)[0].clone(),
    );
    let mut client = cluster.grpc().await;
    let out = cluster::generate(&mut client, cluster::greedy_request(&prompt, MAX_TOKENS))
        .await
        .expect("Generate succeeds");
    assert_eq!(out.text, want, "UCX_TLS={tls}: cluster vs ferry generate");
    let d = cluster.stats(&decode).await;
    let p = cluster.stats(&prefill).await;
    assert_eq!(d.remote_prefills, 1, "UCX_TLS={tls}: {d:?}");
    assert_eq!(d.recomputed_prefills, 0, "UCX_TLS={tls}: {d:?}");
    assert!(p.kv_transfer_bytes > 0, "{p:?}");
    assert_eq!(
        d.kv_transfer_bytes, p.kv_transfer_bytes,
        "UCX_TLS={tls}: the decode worker counts what the prefill worker put"
    );
    // The prefill worker's transport thread, and each further lane started by its first
    // transfer: one UCX worker each.
    assert_eq!(
        cluster
            .log(&prefill)
            .matches("kvtransfer: UCX worker started")
            .count(),
        lanes,
        "{}",
        cluster.log(&prefill)
    );
    if tls != "tcp" {
        // The decode worker's pool is UCX shared memory, which the prefill worker maps and
        // copies into (only the shared-memory cluster has one).
        assert!(
            cluster
                .log(&decode)
                .contains("KV pool in UCX shared memory"),
            "{}",
            cluster.log(&decode)
        );
        assert!(
            cluster.log(&prefill).contains("mapped here"),
            "{}",
            cluster.log(&prefill)
        );
    }
    cluster.assert_kv_blocks_released().await;
}

#[tokio::test]
async fn greedy_output_over_ucx_equals_ferry_generate() {
    // The default writer (two lanes), one lane over TCP, and three lanes: the prompt's layers
    // over that many connections, the bytes summed.
    greedy_over(SHM, None).await;
    greedy_over("tcp", Some(1)).await;
    greedy_over(SHM, Some(3)).await;
}

#[tokio::test]
async fn killing_the_prefill_worker_mid_transfer_recomputes_and_frees_every_block() {
    kill_mid_transfer(1).await;
}

/// The same with a writer of three lanes: the killed process held three connections per
/// transfer, and every block still comes back.
#[tokio::test]
async fn killing_a_prefill_worker_with_three_lanes_recomputes_and_frees_every_block() {
    kill_mid_transfer(3).await;
}

async fn kill_mid_transfer(lanes: usize) {
    let mut cluster = Cluster::start(
        ucx_spec_lanes(SHM, Some(lanes))
            .router(&["--heartbeat-timeout-ms", "60000"])
            .decode(&["--local-prefill-threshold", "0"]),
    )
    .await;
    let prefill = cluster.live(Role::Prefill)[0].clone();
    let client = cluster.grpc().await;
    let base = cluster::long_prompt();
    let in_flight: Vec<_> = (0..8)
        .map(|i| {
            let mut client = client.clone();
            let prompt = format!("Chapter {i}. {base} {base}");
            let req = cluster::greedy_request(&prompt, MAX_TOKENS);
            tokio::spawn(async move { cluster::generate(&mut client, req).await })
        })
        .collect();
    cluster
        .wait_stats(&prefill, Duration::from_secs(30), "busy", |s| {
            s.running_requests + s.waiting_requests > 0 || s.prefill_computed_tokens > 0
        })
        .await;
    cluster.kill(&prefill);
    for (i, task) in in_flight.into_iter().enumerate() {
        let out = task
            .await
            .expect("the request task")
            .unwrap_or_else(|e| panic!("in-flight request {i} failed: {e:?}"));
        assert_eq!(out.token_ids.len(), MAX_TOKENS as usize, "request {i}");
        assert_eq!(out.finish_reason, Some(FinishReason::Length), "request {i}");
    }
    cluster.assert_kv_blocks_released().await;
}

#[tokio::test]
async fn a_decode_worker_no_prefill_worker_can_reach_prefills_itself() {
    let prompt = cluster::long_prompt();
    let want = cluster::reference_generate(&prompt, MAX_TOKENS).await;
    // The prefill worker speaks TCP only; the decode worker receives over UCX.
    let spec = Spec::new(1, 1)
        .decode(&["--transport", "ucx"])
        .env(&[("UCX_TLS", SHM), ("UCX_NET_DEVICES", "all")]);
    let cluster = Cluster::start(spec).await;
    let decode = cluster.live(Role::Decode)[0].clone();
    let mut client = cluster.grpc().await;
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        cluster::generate(&mut client, cluster::greedy_request(&prompt, MAX_TOKENS)),
    )
    .await
    .expect("an answer, not a hang")
    .expect("Generate succeeds");
    assert_eq!(out.text, want);
    let d = cluster.stats(&decode).await;
    assert_eq!(
        (d.remote_prefills, d.local_prefills),
        (0, 1),
        "re-paired to a local prefill: {d:?}"
    );
    cluster.assert_kv_blocks_released().await;
}

#[tokio::test]
async fn prefix_reuse_ships_only_the_missing_blocks() {
    let a_text = cluster::long_prompt();
    let b_text = format!("{a_text} Blessed are they that mourn: for they shall be comforted.");
    let b_ref = cluster::reference_generate(&b_text, MAX_TOKENS).await;
    // Every prompt goes to the prefill worker (threshold 0).
    let cluster = Cluster::start(ucx_spec(SHM).decode(&["--local-prefill-threshold", "0"])).await;
    let (prefill, decode) = (
        cluster.live(Role::Prefill)[0].clone(),
        cluster.live(Role::Decode)[0].clone(),
    );
    let (a_ids, b_ids) = (
        cluster::tokens(&cluster, &a_text).await,
        cluster::tokens(&cluster, &b_text).await,
    );
    let page = cluster::PAGE;
    let shared = a_ids.iter().zip(&b_ids).take_while(|(x, y)| x == y).count();
    let held = shared / page;
    assert!(held >= 3, "A and B share {shared} tokens");

    let mut client = cluster.grpc().await;
    cluster::generate(&mut client, cluster::greedy_request(&a_text, MAX_TOKENS))
        .await
        .expect("request A");
    let p_a = cluster.stats(&prefill).await.kv_transfer_bytes;
    let a_blocks = a_ids.len().div_ceil(page) as u64;
    assert_eq!(p_a % a_blocks, 0, "{p_a} bytes for {a_blocks} blocks");
    let per_block = p_a / a_blocks;

    // B: the decode worker holds A's whole blocks, so the peer ships only B's blocks past them.
    let b = cluster::generate(&mut client, cluster::greedy_request(&b_text, MAX_TOKENS))
        .await
        .expect("request B");
    assert_eq!(b.text, b_ref, "B through UCX vs ferry generate");
    let (p, d) = (cluster.stats(&prefill).await, cluster.stats(&decode).await);
    let missing = b_ids.len().div_ceil(page) as u64 - held as u64;
    assert_eq!(
        p.kv_transfer_bytes - p_a,
        missing * per_block,
        "B shipped {missing} of {} blocks",
        b_ids.len().div_ceil(page)
    );
    assert_eq!(d.kv_transfer_bytes, p.kv_transfer_bytes, "{d:?}");
    assert_eq!(d.remote_prefills, 2, "{d:?}");
    cluster.assert_kv_blocks_released().await;
}
