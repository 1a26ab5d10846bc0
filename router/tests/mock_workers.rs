//! The router against scripted decode workers over real gRPC on 127.0.0.1:0: registration,
//! heartbeats and KV events through the Registry service; Generate through the Inference
//! service; the HTTP app over the same state; stop strings cancelling the worker (the whole
//! stream, or with `n` > 1 one sample through `CancelSample`); the retry on another decode
//! worker; an `n` > 1 request migrated sample by sample; health; shutdown. (Whole-cluster tests with real workers live in the
//! workspace's `tests/`.)
mod common;

use std::time::Duration;

use axum::body::Body;
use ferry_modelcard::tokenizer::Tokenizer;
use ferry_proto::internal;
use ferry_proto::internal::registry_client::RegistryClient;
use ferry_proto::v1::inference_client::InferenceClient;
use ferry_proto::v1::{self, generate_request::Input};
use ferry_router::{Router, RouterConfig};
use http_body_util::BodyExt;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tower::ServiceExt;

use common::{start_worker, Scripted};

fn register(id: &str, role: internal::WorkerRole, address: &str) -> internal::RegisterRequest {
    internal::RegisterRequest {
        worker_id: id.into(),
        role: role as i32,
        grpc_address: address.into(),
        page_size: 4,
        total_blocks: 256,
        cached_block_hashes: vec![],
        last_event_id: 0,
        instance_id: 1,
        transports: vec![],
    }
}

fn generate(text: &str, max_tokens: u32, stop: &[&str]) -> v1::GenerateRequest {
    v1::GenerateRequest {
        model: String::new(),
        input: Some(Input::Text(text.into())),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stop: Some(v1::StopConditions {
            max_tokens,
            stop: stop.iter().map(|s| s.to_string()).collect(),
            ignore_eos: false,
            ..Default::default()
        }),
        request_id: "t-1".into(),
        ..Default::default()
    }
}

async fn collect(
    client: &mut InferenceClient<tonic::transport::Channel>,
    req: v1::GenerateRequest,
) -> (String, Vec<v1::GenerateResponse>) {
    let mut stream = client.generate(req).await.expect("generate").into_inner();
    let mut text = String::new();
    let mut all = Vec::new();
    while let Some(m) = stream.message().await.expect("stream") {
        text.push_str(&m.text);
        all.push(m);
    }
    (text, all)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_serves_through_scripted_workers() {
    let tok =
        Tokenizer::from_dir(&ferry_modelcard::embedded::default_model_dir()).expect("tokenizer");
    let script = tok
        .encode(
            "The quick brown fox jumps over the lazy dog, again and again and again.",
            false,
        )
        .expect("encode");
    let good = Scripted::streaming(script.clone());
    let bad = Scripted::refusing(Code::Unavailable, "scripted failure");
    let good_addr = start_worker(good.clone()).await;
    let bad_addr = start_worker(bad.clone()).await;

    let config = RouterConfig {
        page_size: 4,
        ..RouterConfig::ephemeral()
    };
    let bound = bind(config).await;
    let (grpc_addr, state) = (bound.grpc_addr(), bound.state().clone());
    let internal_addr = bound.internal_addr();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(bound.run(shutdown.clone()));
    let endpoint = format!("http://{grpc_addr}");

    // Registry (internal plane): register, heartbeat, events.
    let mut registry = RegistryClient::connect(format!("http://{internal_addr}"))
        .await
        .expect("connect");
    let reply = registry
        .register(register("d1", internal::WorkerRole::Decode, &good_addr))
        .await
        .expect("register")
        .into_inner();
    assert!(reply.heartbeat_interval_ms > 0);
    let heartbeat = |id: &str| internal::HeartbeatRequest {
        worker_id: id.into(),
        load: Some(internal::WorkerLoad::default()),
        instance_id: 1,
    };
    assert!(
        registry
            .heartbeat(heartbeat("d1"))
            .await
            .expect("hb")
            .into_inner()
            .known
    );
    assert!(
        !registry
            .heartbeat(heartbeat("ghost"))
            .await
            .expect("hb")
            .into_inner()
            .known
    );
    let events = |id: u64| internal::KvEventBatch {
        worker_id: "d1".into(),
        instance_id: 1,
        events: vec![internal::KvEvent {
            event_id: id,
            data: Some(internal::kv_event::Data::Stored(internal::BlocksStored {
                block_hashes: vec![7],
                parent_hash: None,
            })),
        }],
    };
    assert!(
        registry
            .publish_kv_events(events(1))
            .await
            .expect("events")
            .into_inner()
            .in_sync
    );
    assert!(
        !registry
            .publish_kv_events(events(3))
            .await
            .expect("events")
            .into_inner()
            .in_sync
    );
    let err = registry
        .register(internal::RegisterRequest {
            page_size: 64,
            ..register("d9", internal::WorkerRole::Decode, &good_addr)
        })
        .await
        .expect_err("page size mismatch");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    registry
        .register(register("d1", internal::WorkerRole::Decode, &good_addr))
        .await
        .expect("re-register with a snapshot");

    // Health.
    let channel = tonic::transport::Channel::from_shared(endpoint.clone())
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let health = tonic_health::pb::health_client::HealthClient::new(channel.clone())
        .check(tonic_health::pb::HealthCheckRequest {
            service: "ferry.v1.Inference".into(),
        })
        .await
        .expect("health")
        .into_inner();
    assert_eq!(
        health.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    // Generate: text, finish, usage, what the worker was sent.
    let mut client = InferenceClient::new(channel);
    let (text, messages) = collect(&mut client, generate("hello", 10, &[])).await;
    assert_eq!(text, tok.decode(&script[..10], true).expect("decode"));
    let last = messages.last().expect("messages");
    assert_eq!(last.finish_reason, v1::FinishReason::Length as i32);
    assert_eq!(last.request_id, "t-1");
    let prompt = tok.encode("hello", true).expect("encode");
    let usage = last.usage.expect("usage on the last message");
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_prompt_tokens
        ),
        (prompt.len() as u32, 10, 5)
    );
    {
        let seen = good.seen.lock().expect("test mutex");
        let sent = seen.last().expect("the worker got the request");
        assert_eq!(sent.prompt_tokens, prompt);
        assert_eq!(sent.request_id, "t-1");
        assert_eq!(sent.sampling.as_ref().map(|s| s.temperature), Some(0.0));
        assert_eq!(sent.stop.as_ref().map(|s| s.max_tokens), Some(10));
        assert!(sent.prefill_peer.is_none(), "no prefill worker registered");
        assert_eq!(sent.speculative, None, "unset: the decode worker decides");
    }

    // The client's speculation choice reaches the decode worker as given.
    for choice in [Some(false), Some(true)] {
        let req = v1::GenerateRequest {
            speculative: choice,
            ..generate("hello", 2, &[])
        };
        collect(&mut client, req).await;
        let seen = good.seen.lock().expect("test mutex");
        assert_eq!(seen.last().map(|r| r.speculative), Some(choice));
    }

    // A prefill worker is named as the decode worker's peer.
    registry
        .register(register("p0", internal::WorkerRole::Prefill, "127.0.0.1:9"))
        .await
        .expect("register prefill");
    collect(&mut client, generate("hello", 3, &[])).await;
    {
        let seen = good.seen.lock().expect("test mutex");
        let peer = seen
            .last()
            .and_then(|r| r.prefill_peer.clone())
            .expect("peer");
        assert_eq!(
            (peer.worker_id.as_str(), peer.grpc_address.as_str()),
            ("p0", "127.0.0.1:9")
        );
    }

    // A stop string truncates, finishes with STOP and cancels the worker's stream.
    let (text, messages) = collect(&mut client, generate("hello", 40, &[" fox"])).await;
    assert_eq!(text, "The quick brown");
    assert_eq!(
        messages.last().map(|m| m.finish_reason),
        Some(v1::FinishReason::Stop as i32)
    );
    tokio::time::timeout(Duration::from_secs(10), good.cancelled.notified())
        .await
        .expect("the worker saw the cancellation");

    // A decode worker failing before the first token: retried on the other one.
    registry
        .register(register("d0", internal::WorkerRole::Decode, &bad_addr))
        .await
        .expect("register d0");
    let (text, _) = collect(&mut client, generate("hello", 4, &[])).await;
    assert_eq!(text, tok.decode(&script[..4], true).expect("decode"));
    assert!(bad.call_count() >= 1, "d0 was tried first");

    // Validation through gRPC.
    let err = client
        .generate(generate("hello", 0, &[]))
        .await
        .expect_err("max_tokens 0");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("`max_tokens`"), "{}", err.message());

    // HTTP over the same state: whole and streamed.
    let app = ferry_router::http::app(state.clone());
    let body = serde_json::json!({
        "prompt": "hello", "max_tokens": 5, "temperature": 0, "speculative": false,
    })
    .to_string();
    let response = app
        .clone()
        .oneshot(
            axum::http::Request::post("/v1/completions")
                .header("content-type", "application/json")
                .body(Body::from(body))
                .expect("request"),
        )
        .await
        .expect("response");
    assert_eq!(response.status(), 200);
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
    assert_eq!(json["object"], "text_completion");
    assert!(json["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("cmpl-")));
    assert_eq!(
        json["choices"][0]["text"],
        tok.decode(&script[..5], true).expect("decode")
    );
    assert_eq!(json["choices"][0]["finish_reason"], "length");
    assert_eq!(json["usage"]["completion_tokens"], 5);
    {
        let seen = good.seen.lock().expect("test mutex");
        assert_eq!(seen.last().map(|r| r.speculative), Some(Some(false)));
    }
    assert_eq!(
        json["usage"]["total_tokens"],
        json["usage"]["prompt_tokens"].as_u64().expect("n") + 5
    );

    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string();
    let response = app
        .clone()
        .oneshot(
            axum::http::Request::post("/v1/chat/completions")
                .body(Body::from(body))
                .expect("request"),
        )
        .await
        .expect("response");
    assert_eq!(response.status(), 200);
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let sse = String::from_utf8(bytes.to_vec()).expect("utf-8");
    let data: Vec<&str> = sse
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{sse}");
    let chunks: Vec<serde_json::Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("chunk json"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, tok.decode(&script[..3], true).expect("decode"));
    let usage_chunk = chunks.last().expect("usage chunk");
    assert_eq!(usage_chunk["choices"].as_array().map(Vec::len), Some(0));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], 3);
    assert!(chunks
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "length"));

    let response = app
        .oneshot(
            axum::http::Request::get("/health")
                .body(Body::empty())
                .expect("request"),
        )
        .await
        .expect("response");
    assert_eq!(response.status(), 200);

    // Every request's predictive load was released.
    assert_eq!(state.dispatcher.in_flight(), 0);

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(15), running)
        .await
        .expect("shuts down in time")
        .expect("task")
        .expect("clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_open_streams_after_the_drain_deadline() {
    let slow = Scripted::streaming(vec![10; 50]).paced(Duration::from_millis(200));
    let slow_addr = start_worker(slow).await;
    let config = RouterConfig {
        page_size: 4,
        drain_timeout_ms: 300,
        ..RouterConfig::ephemeral()
    };
    let bound = bind(config).await;
    let endpoint = format!("http://{}", bound.grpc_addr());
    let internal = format!("http://{}", bound.internal_addr());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(bound.run(shutdown.clone()));
    let mut registry = RegistryClient::connect(internal).await.expect("connect");
    registry
        .register(register("d0", internal::WorkerRole::Decode, &slow_addr))
        .await
        .expect("register");

    let mut client = InferenceClient::connect(endpoint).await.expect("connect");
    let mut stream = client
        .generate(generate("hello", 50, &[]))
        .await
        .expect("generate")
        .into_inner();
    stream
        .message()
        .await
        .expect("first")
        .expect("a first message");

    shutdown.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => break None,
                Err(status) => break Some(status),
            }
        }
    })
    .await
    .expect("the open stream ends after the drain deadline");
    let status = ended.expect("ended with an error, not a finish");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    tokio::time::timeout(Duration::from_secs(10), running)
        .await
        .expect("shuts down in time")
        .expect("task")
        .expect("clean shutdown");
}

/// A router loaded from `config` and bound to its ports, not yet serving.
async fn bind(config: RouterConfig) -> ferry_router::BoundRouter {
    Router::load(config)
        .await
        .expect("load")
        .bind()
        .await
        .expect("bind")
}

/// A router (`max_migrations` as given) with decode workers `d0`, `d1`, … serving `workers`.
async fn router_with(
    max_migrations: u32,
    workers: &[Scripted],
) -> (
    std::sync::Arc<ferry_router::state::AppState>,
    InferenceClient<tonic::transport::Channel>,
    CancellationToken,
    tokio::task::JoinHandle<Result<(), ferry_router::RouterError>>,
) {
    let config = RouterConfig {
        page_size: 4,
        max_migrations,
        ..RouterConfig::ephemeral()
    };
    let bound = bind(config).await;
    let state = bound.state().clone();
    let (grpc, internal_addr) = (bound.grpc_addr(), bound.internal_addr());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(bound.run(shutdown.clone()));
    let mut registry = RegistryClient::connect(format!("http://{internal_addr}"))
        .await
        .expect("connect");
    for (i, w) in workers.iter().enumerate() {
        let addr = start_worker(w.clone()).await;
        registry
            .register(register(
                &format!("d{i}"),
                internal::WorkerRole::Decode,
                &addr,
            ))
            .await
            .expect("register");
    }
    let client = InferenceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    (state, client, shutdown, running)
}

/// The status `req` ends with, reading its stream to the end (panics if it succeeds).
async fn failure(
    client: &mut InferenceClient<tonic::transport::Channel>,
    req: v1::GenerateRequest,
) -> tonic::Status {
    let mut stream = client.generate(req).await.expect("generate").into_inner();
    loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the request succeeded"),
            Err(status) => return status,
        }
    }
}

/// Per sample: token ids, text and finishes, as a client reads them from a gRPC stream.
#[derive(Debug, Default, Clone, PartialEq)]
struct Sample {
    tokens: Vec<u32>,
    text: String,
    finishes: Vec<i32>,
}

fn samples(n: usize, messages: &[v1::GenerateResponse]) -> Vec<Sample> {
    let mut out = vec![Sample::default(); n];
    for m in messages {
        let s = &mut out[m.index as usize];
        s.tokens.extend(&m.token_ids);
        s.text.push_str(&m.text);
        if m.finish_reason != v1::FinishReason::Unspecified as i32 {
            s.finishes.push(m.finish_reason);
        }
    }
    out
}

/// Three samples, scripted apart: sample 2 finishes (STOP, 3 tokens) before the worker
/// serving the request goes away (UNAVAILABLE after its 10th message: samples 0 and 1 then
/// have 4 and 3 tokens). Each unfinished sample is resumed on the other worker as its own call
/// naming its index, with the prompt + its own tokens; the client sees every sample's whole
/// output once, with one finish each and the usage of all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_n_request_whose_worker_dies_resumes_each_unfinished_sample_on_another() {
    let tok =
        Tokenizer::from_dir(&ferry_modelcard::embedded::default_model_dir()).expect("tokenizer");
    let mut scripts: Vec<Vec<u32>> = [
        "The quick brown fox jumps over the lazy dog.",
        "One two three four five six seven eight nine ten.",
        "Hi there, friend.",
    ]
    .iter()
    .map(|t| tok.encode(t, false).expect("encode"))
    .collect();
    scripts[2].truncate(3);
    const MAX: usize = 8;
    assert!(scripts[0].len() > MAX && scripts[1].len() > MAX && scripts[2].len() == 3);
    let workers = [
        Scripted::per_sample(scripts.clone()).dying_after(10),
        Scripted::per_sample(scripts.clone()).dying_after(10),
    ];
    let (state, mut client, shutdown, running) = router_with(3, &workers).await;
    let req = v1::GenerateRequest {
        n: Some(3),
        ..generate("hello", MAX as u32, &[])
    };
    let (_, messages) = collect(&mut client, req).await;

    let got = samples(3, &messages);
    let (length, stop) = (
        v1::FinishReason::Length as i32,
        v1::FinishReason::Stop as i32,
    );
    for (i, (s, finish)) in got.iter().zip([length, length, stop]).enumerate() {
        let want: Vec<u32> = scripts[i].iter().copied().take(MAX).collect();
        assert_eq!(s.tokens, want, "sample {i}: every token once, in order");
        assert_eq!(
            s.text,
            tok.decode(&want, true).expect("decode"),
            "sample {i}"
        );
        assert_eq!(s.finishes, vec![finish], "sample {i}: one finish");
    }
    let (last, rest) = messages.split_last().expect("messages");
    assert!(rest.iter().all(|m| m.usage.is_none()), "{messages:?}");
    let prompt = tok.encode("hello", true).expect("encode");
    let usage = last.usage.expect("usage on the last message");
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_prompt_tokens
        ),
        (prompt.len() as u32, (MAX + MAX + 3) as u32, common::CACHED)
    );

    // One worker got the request (n = 3) and died; the other resumed samples 0 and 1.
    let (died, resumed) = if workers[0].requests().first().is_some_and(|r| r.n == 3) {
        (&workers[0], &workers[1])
    } else {
        (&workers[1], &workers[0])
    };
    let first = died.requests();
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!((first[0].n, first[0].generated_tokens), (3, 0));
    let mut calls = resumed.requests();
    calls.sort_by_key(|r| r.sample_index);
    let sent: Vec<(u32, u32, u32, Vec<u32>)> = calls
        .iter()
        .map(|r| {
            (
                r.sample_index,
                r.n,
                r.generated_tokens,
                r.prompt_tokens.clone(),
            )
        })
        .collect();
    let with = |i: usize, k: usize| [prompt.clone(), scripts[i][..k].to_vec()].concat();
    assert_eq!(
        sent,
        vec![(0, 1, 4, with(0, 4)), (1, 1, 3, with(1, 3))],
        "one call per unfinished sample: its index, prompt + its own tokens"
    );
    assert!(calls.iter().all(|r| r.prompt_logprobs.is_none()));
    assert_eq!(state.metrics.migrations.get(), 1, "one migration counted");
    assert!(
        died.cancel_calls().is_empty() && resumed.cancel_calls().is_empty(),
        "samples the workers finished need no cancel"
    );
    common::stop_router(&state, shutdown, running).await;
}

/// With `max_migrations` 0 an `n` > 1 request whose worker goes away fails, as before: the
/// client gets the worker's UNAVAILABLE and no other worker is asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_n_request_is_not_resumed_with_max_migrations_0() {
    let script = vec![10; 12];
    let workers = [
        Scripted::streaming(script.clone()).dying_after(4),
        Scripted::streaming(script).dying_after(4),
    ];
    let (state, mut client, shutdown, running) = router_with(0, &workers).await;
    let req = v1::GenerateRequest {
        n: Some(2),
        ..generate("hello", 8, &[])
    };
    let status = failure(&mut client, req).await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(workers[0].call_count() + workers[1].call_count(), 1);
    assert_eq!(state.metrics.migrations.get(), 0);
    common::stop_router(&state, shutdown, running).await;
}

/// A stop string that matches in one sample of two finishes it at the router, which asks the
/// worker to stop exactly that sample of that call (`CancelSample`); the other sample runs to
/// its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sample_finished_by_a_stop_string_is_stopped_on_the_worker() {
    let tok =
        Tokenizer::from_dir(&ferry_modelcard::embedded::default_model_dir()).expect("tokenizer");
    let scripts: Vec<Vec<u32>> = [
        "One two three four five six seven eight nine ten eleven twelve.",
        "The quick brown fox jumps over the lazy dog.",
    ]
    .iter()
    .map(|t| tok.encode(t, false).expect("encode"))
    .collect();
    let worker = Scripted::per_sample(scripts.clone()).paced(Duration::from_millis(5));
    let (state, mut client, shutdown, running) =
        router_with(3, std::slice::from_ref(&worker)).await;
    let req = v1::GenerateRequest {
        n: Some(2),
        ..generate("hello", 40, &[" fox"])
    };
    let (_, messages) = collect(&mut client, req).await;
    let got = samples(2, &messages);
    assert_eq!(got[1].text, "The quick brown");
    assert_eq!(got[1].finishes, vec![v1::FinishReason::Stop as i32]);
    assert_eq!(
        got[0].tokens, scripts[0],
        "the other sample runs to its end"
    );
    assert_eq!(got[0].finishes, vec![v1::FinishReason::Stop as i32]);

    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while worker.cancel_calls().is_empty() {
        assert!(std::time::Instant::now() < deadline, "no CancelSample came");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let cancels = worker.cancel_calls();
    assert_eq!(cancels.len(), 1, "{cancels:?}");
    assert_eq!(
        (
            cancels[0].request_id.as_str(),
            cancels[0].call_id,
            cancels[0].index
        ),
        ("t-1", 1, 1),
        "the request, its call (the id the worker gave) and the sample"
    );
    common::stop_router(&state, shutdown, running).await;
}

/// A worker that reports one sample failed with UNAVAILABLE (its `error_code`; what a worker
/// sends when that sample's prefill peer was unreachable) while the call's other sample goes
/// on: that sample alone is resumed on the other worker with its own tokens, the first worker
/// finishes the other, and the client sees both samples whole. A sample failed with another
/// code ends the request, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sample_failed_unavailable_in_band_is_resumed_alone() {
    let scripts = vec![(10..22).collect::<Vec<u32>>(), (30..42).collect()];
    const MAX: usize = 10;
    let workers = [
        Scripted::per_sample(scripts.clone()).sample_failing(1, 3, Code::Unavailable),
        Scripted::per_sample(scripts.clone()).sample_failing(1, 3, Code::Unavailable),
    ];
    let (state, mut client, shutdown, running) = router_with(3, &workers).await;
    let req = v1::GenerateRequest {
        n: Some(2),
        ..generate("hello", MAX as u32, &[])
    };
    let (_, messages) = collect(&mut client, req).await;
    let got = samples(2, &messages);
    for (i, s) in got.iter().enumerate() {
        let want: Vec<u32> = scripts[i].iter().copied().take(MAX).collect();
        assert_eq!(s.tokens, want, "sample {i}: every token once, in order");
        assert_eq!(
            s.finishes,
            vec![v1::FinishReason::Length as i32],
            "sample {i}"
        );
    }
    let usage = messages.last().and_then(|m| m.usage).expect("usage");
    assert_eq!(usage.completion_tokens, 2 * MAX as u32);

    let (first, other) = if workers[0].requests().first().is_some_and(|r| r.n == 2) {
        (&workers[0], &workers[1])
    } else {
        (&workers[1], &workers[0])
    };
    assert_eq!(first.requests().len(), 1, "the first worker kept sample 0");
    let resumed = other.requests();
    assert_eq!(resumed.len(), 1, "{resumed:?}");
    let prompt = Tokenizer::from_dir(&ferry_modelcard::embedded::default_model_dir())
        .expect("tokenizer")
        .encode("hello", true)
        .expect("encode");
    assert_eq!(
        (
            resumed[0].sample_index,
            resumed[0].n,
            resumed[0].generated_tokens,
            resumed[0].prompt_tokens.clone()
        ),
        (1, 1, 3, [prompt, scripts[1][..3].to_vec()].concat()),
        "sample 1 alone, with the prompt + its own 3 tokens"
    );
    assert_eq!(state.metrics.migrations.get(), 1);
    common::stop_router(&state, shutdown, running).await;

    // INTERNAL: not resumable; the request ends with the sample's failure.
    let workers = [
        Scripted::per_sample(scripts.clone()).sample_failing(1, 3, Code::Internal),
        Scripted::per_sample(scripts.clone()).sample_failing(1, 3, Code::Internal),
    ];
    let (state, mut client, shutdown, running) = router_with(3, &workers).await;
    let req = v1::GenerateRequest {
        n: Some(2),
        ..generate("hello", MAX as u32, &[])
    };
    let status = failure(&mut client, req).await;
    assert!(status.message().contains("sample 1 failed"), "{status:?}");
    assert_eq!(workers[0].call_count() + workers[1].call_count(), 1);
    assert_eq!(state.metrics.migrations.get(), 0);
    common::stop_router(&state, shutdown, running).await;
}
