//! Bounded input through a real `ferry router` process: a 30 MB prompt (under the 32 MiB HTTP
//! body limit) once took the router from 41 MB to a 3.46 GB peak RSS and 13–18 s of CPU
//! before it was refused for exceeding the context. Now it is refused before tokenizing, by
//! its size in bytes (`context × longest token`), quickly, and the router's peak RSS
//! (`VmHWM`) stays under [`PEAK_RSS_BOUND`]. The same on gRPC `Tokenize`.
mod cluster;

use std::time::{Duration, Instant};

use cluster::{Cluster, Spec, CONTEXT};
use ferry_proto::v1::TokenizeRequest;
use serde_json::json;
use tonic::Code;

/// The router's peak resident set may not exceed this (it idles around 40–60 MB with the
/// embedded model; a 30 MB body is held at most a few times over while parsed and refused).
const PEAK_RSS_BOUND_MB: u64 = 200;
/// A refusal by size must not wait for tokenization (which took 13–18 s).
const QUICK: Duration = Duration::from_secs(3);
/// The longest token of the embedded vocabulary (`Ġrighteousness`), in bytes.
const LONGEST_TOKEN: usize = 15;
const BIG: usize = 30 * 1000 * 1000;

/// `VmHWM` (peak RSS) of `pid`, in MB.
fn peak_rss_mb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("a VmHWM line");
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmHWM in kB");
    kb / 1024
}

fn assert_names(body: &serde_json::Value, field: &str, limit: usize, value: usize) {
    let error = &body["error"];
    assert_eq!(error["param"], field, "{body}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&limit.to_string()) && message.contains(&value.to_string()),
        "the message names the limit {limit} and the value {value}: {message}"
    );
}

#[tokio::test]
async fn a_30_mb_prompt_is_refused_quickly_in_bounded_memory() {
    let cluster = Cluster::start(Spec::new(0, 1)).await;
    let pid = cluster.router_pid();
    let before = peak_rss_mb(pid);
    let limit = CONTEXT * LONGEST_TOKEN;

    let prompt = "a".repeat(BIG);
    let started = Instant::now();
    let (status, body) = cluster
        .post_json(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
    let took = started.elapsed();
    assert_eq!(status, 400, "{body}");
    assert_names(&body, "prompt", limit, BIG);
    assert!(took < QUICK, "refused after {took:?}");

    let messages = json!([
        {"role": "system", "content": "a".repeat(BIG / 2)},
        {"role": "user", "content": "b".repeat(BIG / 2)},
    ]);
    let started = Instant::now();
    let (status, body) = cluster
        .post_json("/v1/chat/completions", &json!({"messages": messages}))
        .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "messages", "{body}");
    assert!(
        started.elapsed() < QUICK,
        "refused after {:?}",
        started.elapsed()
    );

    // gRPC: messages over tonic's 4 MiB default are refused unread (OUT_OF_RANGE); under
    // it, the byte limit refuses the text before tokenizing, naming `text`.
    let mut grpc = cluster.grpc().await;
    let started = Instant::now();
    let refused = grpc
        .tokenize(TokenizeRequest {
            model: String::new(),
            text: "a".repeat(BIG),
            add_special_tokens: false,
        })
        .await
        .expect_err("30 MB is over the gRPC message limit");
    assert_eq!(refused.code(), Code::OutOfRange, "{refused:?}");
    assert!(
        started.elapsed() < QUICK,
        "refused after {:?}",
        started.elapsed()
    );
    let mut grpc = cluster.grpc().await;
    let three_mb = 3 * 1000 * 1000;
    let started = Instant::now();
    let refused = grpc
        .tokenize(TokenizeRequest {
            model: String::new(),
            text: "a".repeat(three_mb),
            add_special_tokens: false,
        })
        .await
        .expect_err("3 MB of text cannot fit the context");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    let message = refused.message();
    assert!(
        message.contains("`text`")
            && message.contains(&limit.to_string())
            && message.contains(&three_mb.to_string()),
        "{message}"
    );
    assert!(
        started.elapsed() < QUICK,
        "refused after {:?}",
        started.elapsed()
    );

    let peak = peak_rss_mb(pid);
    eprintln!("router peak RSS: {before} MB before, {peak} MB after the 30 MB requests");
    assert!(
        peak < PEAK_RSS_BOUND_MB,
        "router peak RSS {peak} MB (was {before} MB before the requests), bound {PEAK_RSS_BOUND_MB} MB"
    );

    // And the router still serves.
    let (status, body) = cluster
        .post_json(
            "/v1/completions",
            &json!({"prompt": "hello", "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    cluster.assert_kv_blocks_released().await;
}
