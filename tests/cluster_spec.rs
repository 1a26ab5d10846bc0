//! Speculative decoding through a real cluster (router + 1 prefill + 1 decode process, the
//! embedded model and its embedded DSpark drafter): greedy output equals plain single-process
//! `ferry generate --speculative off`, whether the prompt is prefilled on the decode worker or
//! on the prefill worker (which then ships the drafter's context with the KV so the decode
//! worker speculates from its first step), and whatever side has speculation off — for the
//! whole worker (`--speculative off`) or for one request (`GenerateRequest.speculative`, the
//! HTTP body's `"speculative"`).
//!
//! Speculation is observed on the decode worker's Prometheus series
//! (`ferry_spec_decode_num_drafts_total`, one per drafting sequence per step, and
//! `ferry_spec_decode_num_draft_tokens_total`); the decode worker verifies a fixed 4 drafts per
//! step so that every step of a speculating request drafts.
mod cluster;

use std::net::{SocketAddr, TcpListener};

use cluster::{Cluster, Spec, MODEL};
use serde_json::json;

const MAX_TOKENS: u32 = 32;
/// Rounds a speculating request must show at least: the decode worker computes the 31 tokens
/// after the first, and a round emits at most 5 (4 accepted drafts + the bonus token), so at
/// least 6 rounds, whatever the drafter's acceptance (1 token per round when nothing is
/// accepted, ~2 with the embedded trained drafter).
const MIN_ROUNDS: u64 = (MAX_TOKENS as u64 - 1).div_ceil(5);

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
    spec_counter(metrics, "ferry_spec_decode_num_drafts_total").await
}

/// A counter of the decode worker's `/metrics` (0 when absent).
async fn spec_counter(metrics: SocketAddr, name: &str) -> u64 {
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
        .find(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(['{', ' ']))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Speculative rounds and draft tokens verified so far on the decode worker.
async fn spec_counters(metrics: SocketAddr) -> (u64, u64) {
    (
        spec_rounds(metrics).await,
        spec_counter(metrics, "ferry_spec_decode_num_draft_tokens_total").await,
    )
}

/// Greedy `Generate` through the router; the generated text.
async fn generate(cluster: &Cluster, prompt: &str) -> String {
    generate_with(cluster, prompt, None).await
}

/// Greedy `Generate` with the request's `speculative` field set to `speculative`.
async fn generate_with(cluster: &Cluster, prompt: &str, speculative: Option<bool>) -> String {
    let mut client = cluster.grpc().await;
    let req = ferry_proto::v1::GenerateRequest {
        speculative,
        ..cluster::greedy_request(prompt, MAX_TOKENS)
    };
    let out = cluster::generate(&mut client, req)
        .await
        .expect("Generate succeeds");
    assert_eq!(out.token_ids.len(), MAX_TOKENS as usize);
    out.text
}

#[tokio::test]
async fn speculative_greedy_output_through_the_cluster_equals_plain_decoding() {
    speculative_cluster_equals_plain(&[]).await;
}

/// The same on `--device auto --speculative on`: the CPU here, on a GPU machine the CUDA
/// engine on both workers (the drafter on the CPU beside each, its context shipped from the
/// GPU prefill worker with the KV).
#[tokio::test]
async fn speculative_on_device_auto_equals_plain_decoding() {
    speculative_cluster_equals_plain(&["--device", "auto", "--speculative", "on"]).await;
}

/// Speculation on everywhere (the default with the embedded drafter), workers started with
/// `extra` as well: greedy output equals plain decoding, prefilled locally or remotely, and
/// both ways speculate every step.
async fn speculative_cluster_equals_plain(extra: &[&str]) {
    let (short, long) = (cluster::short_prompt(), cluster::long_prompt());
    let short_ref = plain_generate(&short).await;
    let long_ref = plain_generate(&long).await;

    let metrics = free_addr();
    let m = metrics.to_string();
    let mut decode = vec!["--verify-len", "fixed:4", "--metrics-addr", m.as_str()];
    decode.extend_from_slice(extra);
    let cluster = Cluster::start(Spec::new(1, 1).prefill(extra).decode(&decode)).await;
    let r0 = spec_rounds(metrics).await;
    // 9 prompt tokens: prefilled on the decode worker, which computes the drafter context.
    assert_eq!(generate(&cluster, &short).await, short_ref, "short prompt");
    let r1 = spec_rounds(metrics).await;
    // 211 tokens: prefilled on the prefill worker, drafter context shipped with the KV. With
    // 4 drafts verified per step, every decode step but possibly the last is a round.
    assert_eq!(
        generate(&cluster, &long).await,
        long_ref,
        "long prompt, remote prefill"
    );
    let r2 = spec_rounds(metrics).await;
    assert!(r1 - r0 >= MIN_ROUNDS, "local prefill: {} rounds", r1 - r0);
    assert!(
        r2 - r1 >= MIN_ROUNDS,
        "remote prefill: {} rounds; the drafter context did not arrive with the KV",
        r2 - r1
    );
    cluster.assert_kv_blocks_released().await;
}

/// One prefill and one speculating decode worker (`--verify-len verify_len`), and the decode
/// worker's metrics address.
async fn speculating_cluster(verify_len: &str) -> (Cluster, SocketAddr) {
    let metrics = free_addr();
    let m = metrics.to_string();
    let decode = ["--verify-len", verify_len, "--metrics-addr", m.as_str()];
    (
        Cluster::start(Spec::new(1, 1).decode(&decode)).await,
        metrics,
    )
}

/// `--verify-len goodput` through `ferry up`'s decode worker: the flag reaches the engine, the
/// output is plain decoding's, prefilled locally or remotely (the remote prompt's drafter
/// context arrives with its KV; later plain steps defer theirs), and the worker speculates —
/// goodput's first rounds measure what a round costs, whatever this machine's speed.
#[tokio::test]
async fn goodput_verify_length_through_the_cluster_keeps_the_output() {
    let (short, long) = (cluster::short_prompt(), cluster::long_prompt());
    let short_ref = plain_generate(&short).await;
    let long_ref = plain_generate(&long).await;
    let (cluster, metrics) = speculating_cluster("goodput").await;
    let r0 = spec_rounds(metrics).await;
    assert_eq!(generate(&cluster, &short).await, short_ref, "short prompt");
    assert_eq!(
        generate(&cluster, &long).await,
        long_ref,
        "long prompt, remote prefill"
    );
    assert!(spec_rounds(metrics).await > r0, "goodput verified no round");
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
    assert!(spec_rounds(metrics).await - r1 >= MIN_ROUNDS);
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

#[tokio::test]
async fn speculation_off_for_one_request_on_a_speculating_cluster() {
    let (short, long) = (cluster::short_prompt(), cluster::long_prompt());
    let short_ref = plain_generate(&short).await;
    let long_ref = plain_generate(&long).await;

    let (cluster, metrics) = speculating_cluster("fixed:4").await;
    // gRPC, local prefill (short) and remote prefill with the drafter context shipped (long).
    // The `speculative = false` request goes first: it still builds drafter context for the
    // prefix it leaves cached, so the requests after it speculate on the reused prefix.
    for (what, prompt, reference) in [("short", &short, &short_ref), ("long", &long, &long_ref)] {
        let c0 = spec_counters(metrics).await;
        let off = generate_with(&cluster, prompt, Some(false)).await;
        let c1 = spec_counters(metrics).await;
        assert_eq!(off, *reference, "{what}: speculative = false");
        assert_eq!(
            c1, c0,
            "{what}: speculative = false drafted (rounds, draft tokens)"
        );

        // No field: as before this field existed, the worker's setting (on) applies.
        let default = generate_with(&cluster, prompt, None).await;
        let c2 = spec_counters(metrics).await;
        assert_eq!(default, off, "{what}: speculative unset vs false");
        assert!(
            c2.0 - c1.0 >= MIN_ROUNDS,
            "{what}: unset: {} rounds",
            c2.0 - c1.0
        );
        assert!(
            c2.1 - c1.1 >= 4 * MIN_ROUNDS,
            "{what}: unset: {} drafts",
            c2.1 - c1.1
        );

        let on = generate_with(&cluster, prompt, Some(true)).await;
        let c3 = spec_counters(metrics).await;
        assert_eq!(on, off, "{what}: speculative true vs false");
        assert!(
            c3.0 - c2.0 >= MIN_ROUNDS,
            "{what}: true: {} rounds",
            c3.0 - c2.0
        );
    }

    // HTTP: the non-standard body field, on both endpoints (OpenAI clients: `extra_body`).
    let body = |speculative: Option<bool>| {
        let mut b = json!({
            "model": MODEL,
            "prompt": short,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": true,
        });
        if let Some(on) = speculative {
            b["speculative"] = json!(on);
        }
        b
    };
    let c0 = spec_counters(metrics).await;
    let (status, off) = cluster
        .post_json("/v1/completions", &body(Some(false)))
        .await;
    assert_eq!(status, 200, "{off}");
    assert_eq!(off["choices"][0]["text"], short_ref.as_str());
    assert_eq!(
        spec_counters(metrics).await,
        c0,
        "HTTP speculative = false drafted"
    );
    let (status, on) = cluster.post_json("/v1/completions", &body(None)).await;
    assert_eq!(status, 200, "{on}");
    assert_eq!(on["choices"][0]["text"], short_ref.as_str());
    let c1 = spec_counters(metrics).await;
    assert!(
        c1.0 - c0.0 >= MIN_ROUNDS,
        "HTTP unset: {} rounds",
        c1.0 - c0.0
    );

    let chat = |speculative: bool| {
        json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "Who made the heaven and the earth?"}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": true,
            "speculative": speculative,
        })
    };
    let (status, off) = cluster
        .post_json("/v1/chat/completions", &chat(false))
        .await;
    assert_eq!(status, 200, "{off}");
    let c2 = spec_counters(metrics).await;
    assert_eq!(c2, c1, "chat speculative = false drafted");
    let (status, on) = cluster.post_json("/v1/chat/completions", &chat(true)).await;
    assert_eq!(status, 200, "{on}");
    assert_eq!(
        on["choices"][0]["message"]["content"],
        off["choices"][0]["message"]["content"]
    );
    assert!(
        spec_counters(metrics).await.0 > c2.0,
        "chat speculative = true"
    );

    // A wrong type is refused at the router, naming the field.
    let mut bad = body(None);
    bad["speculative"] = json!("yes");
    let (status, err) = cluster.post_json("/v1/completions", &bad).await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["param"], "speculative", "{err}");
    cluster.assert_kv_blocks_released().await;
}
