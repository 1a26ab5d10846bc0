//! Speculative decoding through a real cluster (router + 1 prefill + 1 decode process, the
//! embedded model and its embedded DSpark drafter): greedy output equals plain single-process
//! `ferry generate --speculative off`, whether the prompt is prefilled on the decode worker or
//! on the prefill worker (which then ships the drafter's context with the KV so the decode
//! worker speculates from its first step), and whatever side has speculation off.
//!
//! Speculation is observed on the decode worker's Prometheus series
//! (`ferry_spec_decode_num_drafts_total`, one per drafting sequence per step); the decode worker
//! verifies a fixed 4 drafts per step so that every step of a speculating request drafts.
mod cluster;

use std::net::{SocketAddr, TcpListener};

use cluster::{Cluster, Spec};

const MAX_TOKENS: u32 = 32;

/// `ferry generate --speculative off` (plain token-by-token decoding), greedy, EOS ignored.
async fn plain_generate(prompt: &str) -> String {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["generate", "--speculative", "off", "--prompt", prompt])
        .args(["--max-tokens", &MAX_TOKENS.to_string(), "--ignore-eos"])
        .env_remove("FERRY_MODEL")
        .env_remove("FERRY_SPECULATIVE")
        .env_remove("FERRY_DRAFTER")
        .kill_on_drop(true)
        .output()
        .await
        .expect("ferry generate runs");
    assert!(
        out.status.success(),
        "ferry generate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8 output");
    text.strip_suffix('\n')
        .expect("a final newline")
        .to_string()
}

fn free_addr() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    l.local_addr().expect("bound address")
}

/// The decode worker's speculative rounds so far, from its `/metrics`.
async fn spec_rounds(metrics: SocketAddr) -> u64 {
    let body = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("an HTTP client")
        .get(format!("http://{metrics}/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("a metrics body");
    body.lines()
        .find(|l| l.starts_with("ferry_spec_decode_num_drafts_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Greedy `Generate` through the router; the generated text.
async fn generate(cluster: &Cluster, prompt: &str) -> String {
    let mut client = cluster.grpc().await;
    let out = cluster::generate(&mut client, cluster::greedy_request(prompt, MAX_TOKENS))
        .await
        .expect("Generate succeeds");
    assert_eq!(out.token_ids.len(), MAX_TOKENS as usize);
    out.text
}

#[tokio::test]
async fn speculative_greedy_output_through_the_cluster_equals_plain_decoding() {
    let (short, long) = (cluster::short_prompt(), cluster::long_prompt());
    let short_ref = plain_generate(&short).await;
    let long_ref = plain_generate(&long).await;

    // Speculation on everywhere (the default with the embedded drafter).
    let metrics = free_addr();
    let m = metrics.to_string();
    let cluster = Cluster::start(Spec::new(1, 1).decode(&[
        "--verify-len",
        "fixed:4",
        "--metrics-addr",
        m.as_str(),
    ]))
    .await;
    let r0 = spec_rounds(metrics).await;
    // 9 prompt tokens: prefilled on the decode worker, which computes the drafter context.
    assert_eq!(generate(&cluster, &short).await, short_ref, "short prompt");
    let r1 = spec_rounds(metrics).await;
    // 211 tokens: prefilled on the prefill worker, drafter context shipped with the KV. With
    // 4 drafts verified per step, each of the 31 decode steps but the last is a round.
    assert_eq!(
        generate(&cluster, &long).await,
        long_ref,
        "long prompt, remote prefill"
    );
    let r2 = spec_rounds(metrics).await;
    assert!(r1 - r0 >= 25, "local prefill: {} rounds", r1 - r0);
    assert!(
        r2 - r1 >= 25,
        "remote prefill: {} rounds; the drafter context did not arrive with the KV",
        r2 - r1
    );
    cluster.assert_kv_blocks_released().await;
}

#[tokio::test]
async fn speculation_off_on_either_side_keeps_the_output() {
    let (short, long) = (cluster::short_prompt(), cluster::long_prompt());
    let short_ref = plain_generate(&short).await;
    let long_ref = plain_generate(&long).await;

    // The prefill worker ships no drafter context: the decode worker still speculates on what
    // it prefills itself, and decodes remotely prefilled prompts without speculation.
    let metrics = free_addr();
    let m = metrics.to_string();
    let cluster = Cluster::start(Spec::new(1, 1).prefill(&["--speculative", "off"]).decode(&[
        "--verify-len",
        "fixed:4",
        "--metrics-addr",
        m.as_str(),
    ]))
    .await;
    let r0 = spec_rounds(metrics).await;
    assert_eq!(generate(&cluster, &long).await, long_ref, "long prompt");
    let r1 = spec_rounds(metrics).await;
    assert_eq!(r1 - r0, 0, "no drafter context, no speculation");
    assert_eq!(generate(&cluster, &short).await, short_ref, "short prompt");
    assert!(spec_rounds(metrics).await - r1 >= 25);
    cluster.assert_kv_blocks_released().await;
    drop(cluster);

    // The decode worker does not speculate: plain decoding in the cluster.
    let metrics = free_addr();
    let m = metrics.to_string();
    let cluster = Cluster::start(Spec::new(1, 1).decode(&[
        "--speculative",
        "off",
        "--metrics-addr",
        m.as_str(),
    ]))
    .await;
    assert_eq!(generate(&cluster, &short).await, short_ref);
    assert_eq!(generate(&cluster, &long).await, long_ref);
    assert_eq!(spec_rounds(metrics).await, 0);
    cluster.assert_kv_blocks_released().await;
}
