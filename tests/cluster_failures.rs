//! Failures through real processes: a prefill worker SIGKILLed under load (recompute and fail
//! policies), the only decode worker SIGKILLed (UNAVAILABLE / 503), and invalid requests on
//! both front doors. After each, the cluster still serves (while it has a decode worker) and
//! every live worker's KV blocks are back.
mod cluster;

use std::time::Duration;

use cluster::{Cluster, Role, Spec, MODEL};
use ferry_proto::v1::{
    generate_request, FinishReason, GenerateRequest, SamplingParams, StopConditions,
};
use serde_json::json;
use tonic::Code;

const MAX_TOKENS: u32 = 16;

/// A long (about 640-token) prompt, distinct from every other `i` from its first block on, so
/// no two share cached KV.
fn long_prompt(i: usize) -> String {
    let base = cluster::long_prompt();
    format!("Chapter {i}. {base} {base} {base}")
}

#[tokio::test]
async fn killing_the_prefill_worker_mid_flight_recomputes_on_the_decode_worker() {
    // Every prompt goes to the prefill worker (threshold 0); the router keeps routing to the
    // dead worker for a minute (heartbeat timeout), so later requests meet it dead too.
    let mut cluster = Cluster::start(
        Spec::new(1, 1)
            .router(&["--heartbeat-timeout-ms", "60000"])
            .decode(&["--local-prefill-threshold", "0"]),
    )
    .await;
    let (prefill, decode) = (
        cluster.live(Role::Prefill)[0].clone(),
        cluster.live(Role::Decode)[0].clone(),
    );
    let client = cluster.grpc().await;

    let in_flight: Vec<_> = (0..8)
        .map(|i| {
            let mut client = client.clone();
            let req = cluster::greedy_request(&long_prompt(i), MAX_TOKENS);
            tokio::spawn(async move { cluster::generate(&mut client, req).await })
        })
        .collect();
    // Kill as soon as the prefill worker has started on them.
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

    // A later request is sent to the dead peer, recomputed locally, and is still exact.
    let later = long_prompt(100);
    let want = cluster::reference_generate(&later, MAX_TOKENS).await;
    let before = cluster.stats(&decode).await;
    let out = cluster::generate(
        &mut client.clone(),
        cluster::greedy_request(&later, MAX_TOKENS),
    )
    .await
    .expect("a request after the kill");
    assert_eq!(out.text, want, "recomputed output vs ferry generate");
    let after = cluster.stats(&decode).await;
    assert_eq!(
        after.recomputed_prefills,
        before.recomputed_prefills + 1,
        "the later request was recomputed on the decode worker: {after:?}"
    );
    assert_eq!(
        after.remote_prefills + after.local_prefills + after.recomputed_prefills,
        9,
        "{after:?}"
    );
    assert!(after.recomputed_prefills >= 1, "{after:?}");

    cluster.assert_kv_blocks_released().await;
}

#[tokio::test]
async fn with_the_fail_policy_a_dead_prefill_peer_fails_the_request_and_decode_keeps_serving() {
    let mut cluster = Cluster::start(
        Spec::new(1, 1)
            .router(&["--heartbeat-timeout-ms", "2000"])
            .decode(&[
                "--local-prefill-threshold",
                "0",
                "--on-prefill-failure",
                "fail",
            ]),
    )
    .await;
    let (prefill, decode) = (
        cluster.live(Role::Prefill)[0].clone(),
        cluster.live(Role::Decode)[0].clone(),
    );
    let mut client = cluster.grpc().await;

    let ok = cluster::generate(
        &mut client,
        cluster::greedy_request(&long_prompt(0), MAX_TOKENS),
    )
    .await
    .expect("a remote prefill while the peer is up");
    assert_eq!(ok.token_ids.len(), MAX_TOKENS as usize);

    // The router still routes to the peer until its heartbeat timeout (2 s).
    cluster.kill(&prefill);
    let err = cluster::generate(
        &mut client,
        cluster::greedy_request(&long_prompt(1), MAX_TOKENS),
    )
    .await
    .expect_err("the prefill peer is dead and the policy is `fail`");
    // An availability failure, not a fault: the engine types it (`FailureKind::PeerUnavailable`),
    // the decode worker answers UNAVAILABLE and the router passes it on (503 over HTTP), with a
    // message naming the cause.
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("prefill"), "{err:?}");
    let (status, body) = cluster
        .post_json(
            "/v1/completions",
            &json!({"prompt": long_prompt(2), "max_tokens": MAX_TOKENS, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 503, "{body}");
    let e = assert_openai_error(&body);
    assert!(
        e["message"].as_str().is_some_and(|m| m.contains("prefill")),
        "the body names the cause: {body}"
    );
    let failed = cluster.stats(&decode).await;
    assert_eq!(
        failed.recomputed_prefills, 0,
        "`fail` never recomputes: {failed:?}"
    );

    // Once the router drops the dead worker, the decode worker prefills locally and serves.
    cluster.wait_health(0, 1, Duration::from_secs(20)).await;
    let prompt = cluster::short_prompt();
    let want = cluster::reference_generate(&prompt, MAX_TOKENS).await;
    let out = cluster::generate(&mut client, cluster::greedy_request(&prompt, MAX_TOKENS))
        .await
        .expect("the decode worker still serves");
    assert_eq!(out.text, want);
    let (status, body) = cluster
        .post_json(
            "/v1/completions",
            &json!({"prompt": long_prompt(3), "max_tokens": MAX_TOKENS, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let after = cluster.stats(&decode).await;
    assert!(
        after.local_prefills >= failed.local_prefills + 2,
        "{after:?}"
    );

    cluster.assert_kv_blocks_released().await;
}

#[tokio::test]
async fn without_a_healthy_decode_worker_requests_are_unavailable_503_naming_the_cause() {
    let mut cluster =
        Cluster::start(Spec::new(0, 1).router(&["--heartbeat-timeout-ms", "2000"])).await;
    let decode = cluster.live(Role::Decode)[0].clone();
    let mut client = cluster.grpc().await;
    let prompt = cluster::short_prompt();
    cluster::generate(&mut client, cluster::greedy_request(&prompt, 4))
        .await
        .expect("served while the decode worker is up");
    cluster.assert_kv_blocks_released().await;

    // Once the router drops the dead worker (heartbeat timeout), `/health` is a 503 too.
    cluster.kill(&decode);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while cluster.health_counts().await.is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "the router never dropped the killed decode worker"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let err = cluster::generate(&mut client, cluster::greedy_request(&prompt, 4))
        .await
        .expect_err("no decode worker");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(
        err.message().contains("no healthy decode worker"),
        "{err:?}"
    );
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 4}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": true}),
        ),
    ] {
        let (status, resp) = cluster.post_json(path, &body).await;
        assert_eq!(status, 503, "{path}: {resp}");
        let e = assert_openai_error(&resp);
        assert_eq!(e["type"], "service_unavailable_error", "{path}: {resp}");
        assert_eq!(e["code"], "no_decode_worker", "{path}: {resp}");
        assert!(
            e["message"]
                .as_str()
                .is_some_and(|m| m.contains("no healthy decode worker")),
            "{path}: {resp}"
        );
    }
}

/// `{"error": {"message": "...", "type": "...", "param": ..., "code": ...}}`.
fn assert_openai_error(body: &serde_json::Value) -> &serde_json::Value {
    let e = &body["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "error.message: {body}"
    );
    assert!(e["type"].is_string(), "error.type: {body}");
    assert!(e.get("param").is_some(), "error.param: {body}");
    assert!(e.get("code").is_some(), "error.code: {body}");
    e
}

fn grpc_request(prompt: &str, sampling: SamplingParams, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::Text(prompt.into())),
        sampling: Some(sampling),
        stop: Some(StopConditions {
            max_tokens,
            ..StopConditions::default()
        }),
        ..GenerateRequest::default()
    }
}

#[tokio::test]
async fn invalid_requests_are_rejected_naming_the_field_and_the_servers_keep_serving() {
    let cluster = Cluster::start(Spec::new(0, 1)).await;
    let mut client = cluster.grpc().await;
    let ok_prompt = cluster::short_prompt();
    // About 1,270 tokens: beyond the 1,024-token context.
    let too_long = vec![cluster::long_prompt(); 6].join(" ");
    let temp = |t: f32| SamplingParams {
        temperature: Some(t),
        ..SamplingParams::default()
    };

    let grpc_cases: Vec<(&str, GenerateRequest, &str)> = vec![
        ("empty prompt", grpc_request("", temp(0.0), 4), "prompt"),
        (
            "no prompt",
            GenerateRequest {
                input: None,
                ..grpc_request("", temp(0.0), 4)
            },
            "prompt",
        ),
        (
            "max_tokens 0",
            grpc_request(&ok_prompt, temp(0.0), 0),
            "max_tokens",
        ),
        (
            "max_tokens beyond the context",
            grpc_request(&ok_prompt, temp(0.0), 1024),
            "max_tokens",
        ),
        (
            "negative temperature",
            grpc_request(&ok_prompt, temp(-0.5), 4),
            "temperature",
        ),
        (
            "top_p > 1",
            grpc_request(
                &ok_prompt,
                SamplingParams {
                    top_p: Some(1.5),
                    ..SamplingParams::default()
                },
                4,
            ),
            "top_p",
        ),
        (
            "unknown model",
            GenerateRequest {
                model: "no-such-model".into(),
                ..grpc_request(&ok_prompt, temp(0.0), 4)
            },
            "model",
        ),
        (
            "prompt beyond the context",
            grpc_request(&too_long, temp(0.0), 4),
            "prompt",
        ),
    ];
    for (what, req, field) in grpc_cases {
        let err = cluster::generate(&mut client, req).await.expect_err(what);
        assert_eq!(err.code(), Code::InvalidArgument, "{what}: {err:?}");
        assert!(
            err.message().contains(&format!("`{field}`")),
            "{what}: the message must name `{field}`: {:?}",
            err.message()
        );
    }

    let http_cases: Vec<(&str, &str, serde_json::Value, &str)> = vec![
        (
            "empty prompt",
            "/v1/completions",
            json!({"prompt": "", "max_tokens": 4}),
            "prompt",
        ),
        (
            "max_tokens 0",
            "/v1/completions",
            json!({"prompt": ok_prompt, "max_tokens": 0}),
            "max_tokens",
        ),
        (
            "max_tokens beyond the context",
            "/v1/completions",
            json!({"prompt": ok_prompt, "max_tokens": 5000}),
            "max_tokens",
        ),
        (
            "negative temperature",
            "/v1/completions",
            json!({"prompt": ok_prompt, "max_tokens": 4, "temperature": -1}),
            "temperature",
        ),
        (
            "top_p > 1",
            "/v1/completions",
            json!({"prompt": ok_prompt, "max_tokens": 4, "top_p": 1.5}),
            "top_p",
        ),
        (
            "unknown model",
            "/v1/completions",
            json!({"model": "no-such-model", "prompt": ok_prompt, "max_tokens": 4}),
            "model",
        ),
        (
            "prompt beyond the context",
            "/v1/completions",
            json!({"prompt": too_long, "max_tokens": 4}),
            "prompt",
        ),
        (
            "empty messages",
            "/v1/chat/completions",
            json!({"messages": [], "max_tokens": 4}),
            "messages",
        ),
        (
            "streamed, max_tokens 0",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0, "stream": true}),
            "max_tokens",
        ),
    ];
    for (what, path, body, field) in http_cases {
        let (status, resp) = cluster.post_json(path, &body).await;
        assert_eq!(status, 400, "{what}: {resp}");
        let e = assert_openai_error(&resp);
        assert_eq!(e["type"], "invalid_request_error", "{what}: {resp}");
        assert_eq!(e["param"], field, "{what}: {resp}");
        assert!(
            e["message"].as_str().is_some_and(|m| m.contains(field)),
            "{what}: the message must name `{field}`: {resp}"
        );
    }

    for (what, raw) in [
        (
            "malformed JSON",
            r#"{"prompt": "In the beginning", "max_tokens": "#,
        ),
        ("not an object", "[1, 2, 3]"),
    ] {
        let (status, resp) = cluster.post_raw("/v1/completions", raw).await;
        assert_eq!(status, 400, "{what}: {resp}");
        let e = assert_openai_error(&resp);
        assert_eq!(e["type"], "invalid_request_error", "{what}: {resp}");
    }
    let (status, resp) = cluster
        .post_json(
            "/v1/completions",
            &json!({"prompt": ok_prompt, "max_tokens": "four"}),
        )
        .await;
    assert_eq!(status, 400, "a mistyped field: {resp}");
    assert_eq!(assert_openai_error(&resp)["param"], "max_tokens", "{resp}");

    // Still serving, on both front doors.
    let out = cluster::generate(&mut client, cluster::greedy_request(&ok_prompt, 4))
        .await
        .expect("a valid gRPC request after the rejections");
    assert_eq!(out.token_ids.len(), 4);
    let (status, resp) = cluster
        .post_json(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": ok_prompt, "max_tokens": 4, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["choices"][0]["text"].as_str(), Some(out.text.as_str()));

    cluster.assert_kv_blocks_released().await;
}

#[tokio::test]
async fn a_client_that_disconnects_mid_stream_cancels_its_request_and_frees_its_blocks() {
    let cluster = Cluster::start(Spec::new(0, 1)).await;
    let decode = cluster.live(Role::Decode)[0].clone();
    // Long enough that finishing instead of cancelling would leave about 14 whole blocks of
    // prompt + completion in the prefix cache; cancelled after a few tokens, it leaves at most
    // a few.
    const LONG: u32 = 900;
    let unfinished = |cached_before: u32, s: &ferry_proto::internal::WorkerStats| {
        s.kv_blocks_cached - cached_before <= 7
    };

    let before = cluster.stats(&decode).await;
    let mut client = cluster.grpc().await;
    let mut stream = client
        .generate(cluster::greedy_request(&cluster::golden_prompt(0), LONG))
        .await
        .expect("Generate starts")
        .into_inner();
    for _ in 0..2 {
        stream
            .message()
            .await
            .expect("a streamed message")
            .expect("not the end yet");
    }
    drop(stream);
    let after = cluster
        .wait_stats(
            &decode,
            cluster::RELEASE_TIMEOUT,
            "done with the dropped gRPC stream",
            |s| {
                s.kv_blocks_used == 0
                    && s.running_requests == 0
                    && s.requests_finished > before.requests_finished
            },
        )
        .await;
    assert!(
        unfinished(before.kv_blocks_cached, &after),
        "the request ran to its end: {after:?}"
    );

    let before = after;
    let mut resp = reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("an HTTP client")
        .post(cluster.url("/v1/completions"))
        .json(&json!({
            "prompt": cluster::golden_prompt(1),
            "max_tokens": LONG,
            "temperature": 0,
            "ignore_eos": true,
            "stream": true,
        }))
        .send()
        .await
        .expect("POST /v1/completions");
    assert_eq!(resp.status(), 200);
    let first = resp
        .chunk()
        .await
        .expect("a first SSE chunk")
        .expect("not the end yet");
    assert!(first.starts_with(b"data:"), "{first:?}");
    drop(resp);
    let after = cluster
        .wait_stats(
            &decode,
            cluster::RELEASE_TIMEOUT,
            "done with the dropped SSE stream",
            |s| {
                s.kv_blocks_used == 0
                    && s.running_requests == 0
                    && s.requests_finished > before.requests_finished
            },
        )
        .await;
    assert!(
        unfinished(before.kv_blocks_cached, &after),
        "the request ran to its end: {after:?}"
    );

    cluster.assert_kv_blocks_released().await;
}

/// A role whose port is taken exits at once, naming the address, though its parent still holds
/// its stdin open as `ferry up` does (`--exit-on-stdin-close`). It used to hang there without a
/// word: the stdin watch read on tokio's blocking pool, and dropping the runtime waited for
/// that read (the "start-up stall" the events tests met when a picked port was taken).
#[tokio::test]
async fn a_role_whose_port_is_taken_exits_naming_the_address_while_its_stdin_stays_open() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let addr = taken.local_addr().expect("its address").to_string();
    let logs = tempfile::tempdir().expect("a log directory");
    let roles: [(&str, Vec<&str>); 3] = [
        (
            "router",
            vec!["--grpc-addr", &addr, "--http-addr", "127.0.0.1:0"],
        ),
        ("prefill", vec!["--grpc-addr", &addr]),
        ("decode", vec!["--grpc-addr", &addr]),
    ];
    for (role, flags) in roles {
        let mut args = vec![role.to_string(), "--internal-addr".into()];
        if role == "router" {
            args.push("127.0.0.1:0".into());
        } else {
            // Workers take `--router`; nothing listens there, and nothing needs to.
            args.pop();
            args.extend(["--router".into(), "127.0.0.1:1".into()]);
        }
        args.extend(flags.iter().map(|f| f.to_string()));
        let mut proc = cluster::Proc::spawn(role, &args, logs.path());
        let deadline = std::time::Instant::now() + cluster::START_TIMEOUT;
        let status = loop {
            if let Some(status) = proc.exited() {
                break status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "`ferry {role}` on a taken port still running after {:?}\n{}\n{}",
                cluster::START_TIMEOUT,
                proc.log_tail(20),
                proc.threads()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let log = proc.log_tail(20);
        assert!(!status.success(), "`ferry {role}` exited with {status}");
        assert!(
            log.contains(&addr) && log.contains("Address already in use"),
            "`ferry {role}` says which address it could not bind and why:\n{log}"
        );
    }
    drop(taken);
}
