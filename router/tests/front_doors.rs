//! What clients see on both front doors (gRPC `Generate`, OpenAI HTTP) against scripted decode
//! workers over real gRPC on 127.0.0.1:0:
//!
//! - failures by cause, one mapping: no healthy decode worker → UNAVAILABLE / 503, a worker's
//!   own code kept by class (UNAVAILABLE → 503, INTERNAL → 500), overload →
//!   RESOURCE_EXHAUSTED / 429, bad input → INVALID_ARGUMENT / 400; every HTTP failure an
//!   OpenAI-shaped body naming the cause;
//! - the response shapes of `/v1/completions` and `/v1/chat/completions`, whole and streamed,
//!   with and without usage, and an error in the middle of a stream;
//! - `n` samples as one `Decode` call on both front doors (gRPC: streams told apart by
//!   `index`), tool calls on gRPC (per sample) and on `/v1/responses` (function-call items and
//!   their events);
//! - `echo` on `/v1/completions` and gRPC `prompt_logprobs`: the prompt and its
//!   log-probabilities first, whole and streamed, and `max_tokens: 0` for the prompt alone.
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use ferry_modelcard::tokenizer::Tokenizer;
use ferry_proto::internal;
use ferry_proto::internal::registry_client::RegistryClient;
use ferry_proto::v1;
use ferry_proto::v1::inference_client::InferenceClient;
use ferry_router::config::PolicyKind;
use ferry_router::state::AppState;
use ferry_router::{Router, RouterConfig};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tower::ServiceExt;

use common::{start_worker, Scripted, CACHED};

/// A running router and clients of both its front doors.
struct Harness {
    state: Arc<AppState>,
    grpc: InferenceClient<Channel>,
    registry: RegistryClient<Channel>,
    shutdown: CancellationToken,
    running: JoinHandle<Result<(), ferry_router::RouterError>>,
}

impl Harness {
    async fn start(config: RouterConfig) -> Self {
        let bound = Router::load(RouterConfig {
            page_size: 4,
            ..config
        })
        .await
        .expect("load")
        .bind()
        .await
        .expect("bind");
        let state = bound.state().clone();
        let connect = |addr| async move {
            Channel::from_shared(format!("http://{addr}"))
                .expect("uri")
                .connect()
                .await
                .expect("connect")
        };
        let public = connect(bound.grpc_addr()).await;
        let internal = connect(bound.internal_addr()).await;
        let shutdown = CancellationToken::new();
        let running = tokio::spawn(bound.run(shutdown.clone()));
        Self {
            state,
            grpc: InferenceClient::new(public),
            registry: RegistryClient::new(internal),
            shutdown,
            running,
        }
    }

    /// A router with one decode worker `d0` behaving as `worker`.
    async fn with_worker(config: RouterConfig, worker: Scripted) -> Self {
        let mut h = Self::start(config).await;
        let addr = start_worker(worker).await;
        h.register("d0", internal::WorkerRole::Decode, &addr).await;
        h
    }

    async fn register(&mut self, id: &str, role: internal::WorkerRole, address: &str) {
        self.registry
            .register(internal::RegisterRequest {
                worker_id: id.into(),
                role: role as i32,
                grpc_address: address.into(),
                page_size: 4,
                total_blocks: 256,
                cached_block_hashes: vec![],
                last_event_id: 0,
                instance_id: 1,
                transports: vec![],
            })
            .await
            .expect("register");
    }

    /// The gRPC error of a `Generate` that must fail (before or during the stream).
    async fn grpc_error(&mut self, req: v1::GenerateRequest) -> Status {
        match self.grpc.generate(req).await {
            Err(status) => status,
            Ok(response) => {
                let mut stream = response.into_inner();
                loop {
                    match stream.message().await {
                        Ok(Some(_)) => continue,
                        Ok(None) => panic!("the request succeeded"),
                        Err(status) => break status,
                    }
                }
            }
        }
    }

    /// One HTTP request through the app over the same state: status and body bytes.
    async fn http(&self, method: &str, uri: &str, body: Value) -> (u16, String) {
        let request = axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .expect("request");
        let response = ferry_router::http::app(self.state.clone())
            .oneshot(request)
            .await
            .expect("infallible");
        let status = response.status().as_u16();
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        (status, String::from_utf8(bytes.to_vec()).expect("utf-8"))
    }

    async fn post(&self, uri: &str, body: Value) -> (u16, Value) {
        let (status, text) = self.http("POST", uri, body).await;
        let value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{uri}: not JSON ({e}): {text}"));
        (status, value)
    }

    /// Waits until no request holds an admission permit.
    async fn wait_released(&self) {
        common::wait_released(&self.state).await;
    }

    async fn stop(self) {
        common::stop_router(&self.state, self.shutdown, self.running).await;
    }
}

fn generate(max_tokens: u32) -> v1::GenerateRequest {
    common::greedy_hello(max_tokens)
}

/// The four generation requests of the HTTP API: both endpoints, whole and streamed.
fn http_requests(max_tokens: u32) -> Vec<(&'static str, Value)> {
    let completion = json!({"prompt": "hello", "max_tokens": max_tokens, "temperature": 0});
    let chat = json!({
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    });
    let streamed = |mut body: Value| {
        body["stream"] = json!(true);
        body
    };
    vec![
        ("/v1/completions", completion.clone()),
        ("/v1/completions", streamed(completion)),
        ("/v1/chat/completions", chat.clone()),
        ("/v1/chat/completions", streamed(chat)),
    ]
}

/// Asserts an OpenAI error body `{"error": {message, type, param, code}}`; returns `error`.
fn openai_error<'a>(what: &str, body: &'a Value, kind: &str, code: &str) -> &'a Value {
    let e = &body["error"];
    assert_eq!(e["type"], kind, "{what}: {body}");
    assert_eq!(e["code"], code, "{what}: {body}");
    assert!(e.get("param").is_some(), "{what}: error.param: {body}");
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: error.message: {body}"
    );
    e
}

/// Every HTTP generation request answers `status` with an OpenAI error of `kind` and `code`
/// whose message contains `cause`.
async fn assert_http_failure(h: &Harness, status: u16, kind: &str, code: &str, cause: &str) {
    for (uri, body) in http_requests(4) {
        let what = format!("{uri} stream={}", body["stream"]);
        let (got, body) = h.post(uri, body).await;
        assert_eq!(got, status, "{what}: {body}");
        let e = openai_error(&what, &body, kind, code);
        let message = e["message"].as_str().unwrap_or_default();
        assert!(message.contains(cause), "{what}: `{cause}` not in {body}");
    }
}

fn script() -> (Tokenizer, Vec<u32>) {
    let tok =
        Tokenizer::from_dir(&ferry_modelcard::embedded::default_model_dir()).expect("tokenizer");
    let tokens = tok
        .encode(
            "In the beginning God created the heaven and the earth, and the earth was without form.",
            false,
        )
        .expect("encode");
    (tok, tokens)
}

fn streaming(tokens: Vec<u32>) -> Scripted {
    Scripted::streaming(tokens)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_healthy_decode_worker_both_front_doors_answer_unavailable_503() {
    let mut h = Harness::start(RouterConfig {
        heartbeat_timeout_ms: 1000,
        ..RouterConfig::ephemeral()
    })
    .await;
    let cause = "no healthy decode worker";

    // Nothing registered.
    let status = h.grpc_error(generate(4)).await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains(cause), "{status:?}");
    assert_http_failure(
        &h,
        503,
        "service_unavailable_error",
        "no_decode_worker",
        cause,
    )
    .await;

    // Only a prefill worker: still no decode worker to serve.
    h.register("p0", internal::WorkerRole::Prefill, "127.0.0.1:9")
        .await;
    let status = h.grpc_error(generate(4)).await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_http_failure(
        &h,
        503,
        "service_unavailable_error",
        "no_decode_worker",
        cause,
    )
    .await;

    // A decode worker that serves, then stops heartbeating: once the router stops routing to
    // it (heartbeat timeout), the same answer.
    let (_, tokens) = script();
    let addr = start_worker(streaming(tokens)).await;
    h.register("d0", internal::WorkerRole::Decode, &addr).await;
    let (status, body) = h
        .post("/v1/completions", http_requests(2)[0].1.clone())
        .await;
    assert_eq!(status, 200, "{body}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _) = h.http("GET", "/health", Value::Null).await;
        if status == 503 {
            break;
        }
        assert!(Instant::now() < deadline, "d0 never timed out");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = h.grpc_error(generate(4)).await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains(cause), "{status:?}");
    assert_http_failure(
        &h,
        503,
        "service_unavailable_error",
        "no_decode_worker",
        cause,
    )
    .await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_refusal_keeps_its_class_on_both_front_doors() {
    // (worker's code, client's gRPC code, HTTP status, OpenAI type).
    let cases = [
        (
            Code::Unavailable,
            Code::Unavailable,
            503,
            "service_unavailable_error",
        ),
        (
            Code::ResourceExhausted,
            Code::ResourceExhausted,
            429,
            "rate_limit_error",
        ),
        (
            Code::InvalidArgument,
            Code::InvalidArgument,
            400,
            "invalid_request_error",
        ),
        // The router cannot tell what an INTERNAL from a worker means, so it stays one. (A
        // failed prefill peer under `--on-prefill-failure fail` is reported by the decode
        // worker as INTERNAL today.)
        (Code::Internal, Code::Internal, 500, "internal_error"),
        // A worker answering a code that is no request's fault is unavailable to it.
        (
            Code::Unknown,
            Code::Unavailable,
            503,
            "service_unavailable_error",
        ),
    ];
    for (worker, grpc, http, kind) in cases {
        let cause = "scripted refusal";
        let mut h =
            Harness::with_worker(RouterConfig::ephemeral(), Scripted::refusing(worker, cause))
                .await;
        let status = h.grpc_error(generate(4)).await;
        assert_eq!(status.code(), grpc, "worker {worker:?}: {status:?}");
        assert!(
            status.message().contains(cause) && status.message().contains("`d0`"),
            "the message names the worker and its cause: {status:?}"
        );
        assert_http_failure(&h, http, kind, "worker_failed", cause).await;
        h.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_is_resource_exhausted_429_and_bad_input_invalid_argument_400() {
    let (_, tokens) = script();
    let slow = Scripted::streaming(tokens).paced(Duration::from_millis(100));
    let mut h = Harness::with_worker(
        RouterConfig {
            max_concurrent_requests: 1,
            ..RouterConfig::ephemeral()
        },
        slow,
    )
    .await;

    // Bad input, whatever the load: INVALID_ARGUMENT / 400 naming the field.
    let status = h.grpc_error(generate(0)).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("`max_tokens`"), "{status:?}");
    for (uri, mut body) in http_requests(4) {
        body["max_tokens"] = json!(0);
        let (status, body) = h.post(uri, body).await;
        assert_eq!(status, 400, "{uri}: {body}");
        let e = openai_error(uri, &body, "invalid_request_error", "invalid_value");
        assert_eq!(e["param"], "max_tokens", "{uri}: {body}");
    }

    // The one admission permit held by an open stream: the next request is refused.
    let mut open = h
        .grpc
        .generate(generate(40))
        .await
        .expect("generate")
        .into_inner();
    open.message()
        .await
        .expect("stream")
        .expect("a first token");
    let status = h.grpc_error(generate(4)).await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_http_failure(&h, 429, "rate_limit_error", "overloaded", "limit of 1").await;
    drop(open);
    h.wait_released().await;
    let (status, body) = h
        .post("/v1/completions", http_requests(2)[0].1.clone())
        .await;
    assert_eq!(
        status, 200,
        "admitted again once the stream is gone: {body}"
    );
    h.stop().await;
}

/// Mooncake's early rejection: a request the `mooncake` policy estimates to miss the TTFT SLO
/// is refused at once on both front doors (RESOURCE_EXHAUSTED / 429 naming the estimate and the
/// SLO) before any worker sees it; a generous SLO admits the same request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_estimated_to_miss_the_ttft_slo_is_rejected_early() {
    let (_, tokens) = script();
    let worker = Scripted::streaming(tokens.clone());
    let config = |slo_ms| RouterConfig {
        policy: PolicyKind::Mooncake,
        ttft_slo_ms: Some(slo_ms),
        ..RouterConfig::ephemeral()
    };
    let mut h = Harness::with_worker(config(0), worker.clone()).await;
    let status = h.grpc_error(generate(4)).await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("exceeds the 0 ms SLO"),
        "{status:?}"
    );
    assert_http_failure(&h, 429, "rate_limit_error", "ttft_slo", "0 ms SLO").await;
    assert_eq!(worker.call_count(), 0, "rejected before any worker saw it");
    h.stop().await;

    let h = Harness::with_worker(config(60_000), Scripted::streaming(tokens)).await;
    let (status, body) = h
        .post("/v1/completions", http_requests(2)[0].1.clone())
        .await;
    assert_eq!(status, 200, "within the SLO: {body}");
    h.stop().await;
}

/// The `data:` payloads of an SSE body, which must end with `[DONE]`, as JSON.
fn sse_chunks(what: &str, body: &str) -> Vec<Value> {
    let data: Vec<&str> = body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{what}: {body}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{what}: {e}: {d}")))
        .collect()
}

/// Asserts `usage` is `n` completion tokens with the worker's cached count.
fn assert_usage(what: &str, usage: &Value, n: u64) {
    assert_eq!(usage["completion_tokens"], n, "{what}: {usage}");
    let prompt = usage["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert!(prompt > 0, "{what}: {usage}");
    assert_eq!(usage["total_tokens"], prompt + n, "{what}: {usage}");
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], CACHED,
        "{what}: {usage}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_endpoints_answer_in_openai_shapes_whole_and_streamed() {
    let (tok, tokens) = script();
    const N: u32 = 6;
    let want = tok.decode(&tokens[..N as usize], true).expect("decode");
    let h = Harness::with_worker(RouterConfig::ephemeral(), streaming(tokens.clone())).await;
    let [completion, completion_stream, chat, chat_stream]: [(&str, Value); 4] =
        http_requests(N).try_into().expect("four requests");

    // Whole completion.
    let (status, body) = h.post(completion.0, completion.1).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert!(body["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("cmpl-")));
    assert!(body["created"].as_u64().is_some_and(|t| t > 0), "{body}");
    assert_eq!(body["model"], h.state.model.name.as_str());
    assert_eq!(body["choices"].as_array().map(Vec::len), Some(1), "{body}");
    assert_eq!(body["choices"][0]["index"], 0);
    assert_eq!(body["choices"][0]["text"], want.as_str());
    assert_eq!(body["choices"][0]["logprobs"], Value::Null);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_usage("whole completion", &body["usage"], u64::from(N));

    // Whole chat.
    let (status, body) = h.post(chat.0, chat.1).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("chatcmpl-")));
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_usage("whole chat", &body["usage"], u64::from(N));

    // Streamed, with and without usage.
    for include_usage in [false, true] {
        for (uri, mut request) in [completion_stream.clone(), chat_stream.clone()] {
            let chat = uri.contains("chat");
            let what = format!("{uri} include_usage={include_usage}");
            if include_usage {
                request["stream_options"] = json!({"include_usage": true});
            }
            let (status, text) = h.http("POST", uri, request).await;
            assert_eq!(status, 200, "{what}: {text}");
            let chunks = sse_chunks(&what, &text);
            let object = if chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            let id = chunks[0]["id"].clone();
            assert!(
                chunks
                    .iter()
                    .all(|c| c["object"] == object && c["id"] == id),
                "{what}: {text}"
            );
            let content = if include_usage {
                let (last, rest) = chunks.split_last().expect("chunks");
                assert_eq!(last["choices"], json!([]), "{what}: {text}");
                assert_usage(&what, &last["usage"], u64::from(N));
                assert!(
                    rest.iter().all(|c| c["usage"] == Value::Null),
                    "{what}: null usage before the last chunk: {text}"
                );
                rest
            } else {
                assert!(
                    chunks.iter().all(|c| c.get("usage").is_none()),
                    "{what}: no usage key: {text}"
                );
                &chunks[..]
            };
            if chat {
                assert_eq!(
                    content[0]["choices"][0]["delta"],
                    json!({"role": "assistant", "content": ""}),
                    "{what}: the opening chunk: {text}"
                );
            }
            let field = |c: &Value| {
                let choice = &c["choices"][0];
                if chat {
                    choice["delta"]["content"].as_str().map(str::to_string)
                } else {
                    choice["text"].as_str().map(str::to_string)
                }
            };
            let streamed: String = content.iter().filter_map(field).collect();
            assert_eq!(streamed, want, "{what}: {text}");
            let finishes: Vec<&Value> = content
                .iter()
                .map(|c| &c["choices"][0]["finish_reason"])
                .filter(|f| !f.is_null())
                .collect();
            assert_eq!(finishes, vec![&json!("length")], "{what}: {text}");
            assert_eq!(
                content.last().map(|c| &c["choices"][0]["finish_reason"]),
                Some(&json!("length")),
                "{what}: the finish is on the last content chunk: {text}"
            );
        }
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_failing_mid_stream_ends_the_response_with_an_openai_error() {
    let (_, tokens) = script();
    let worker = Scripted::streaming(tokens).failing_after(3);
    let mut h = Harness::with_worker(RouterConfig::ephemeral(), worker).await;
    let cause = "scripted mid-stream failure";

    let status = h.grpc_error(generate(10)).await;
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    assert!(status.message().contains(cause), "{status:?}");

    for (uri, body) in http_requests(10) {
        let streamed = body["stream"] == json!(true);
        let what = format!("{uri} stream={streamed}");
        if !streamed {
            let (status, body) = h.post(uri, body).await;
            assert_eq!(status, 500, "{what}: {body}");
            openai_error(&what, &body, "internal_error", "worker_failed");
            continue;
        }
        // Streamed: the headers (200) went out with the first token; the error is the last
        // chunk before `[DONE]`.
        let (status, text) = h.http("POST", uri, body).await;
        assert_eq!(status, 200, "{what}: {text}");
        let chunks = sse_chunks(&what, &text);
        let (last, tokens) = chunks.split_last().expect("chunks");
        let e = openai_error(&what, last, "internal_error", "worker_failed");
        assert!(
            e["message"].as_str().is_some_and(|m| m.contains(cause)),
            "{what}: {text}"
        );
        assert!(
            tokens.iter().all(|c| c.get("error").is_none()),
            "{what}: {text}"
        );
        assert!(
            !tokens.is_empty(),
            "{what}: tokens before the error: {text}"
        );
    }
    h.stop().await;
}

/// `n` = 3: the router sends the worker ONE `Decode` call carrying `n` (one prefill there) and
/// answers with `choices[0..3]`, whole and streamed (every index, one finish each, usage of all
/// samples).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_samples_are_one_decode_call_and_n_choices() {
    let (tok, tokens) = script();
    const N: u32 = 5;
    let want = tok.decode(&tokens[..N as usize], true).expect("decode");
    let worker = streaming(tokens);
    let (calls, seen) = (worker.calls.clone(), worker.seen.clone());
    let h = Harness::with_worker(RouterConfig::ephemeral(), worker).await;
    let request = json!({"prompt": "hi", "max_tokens": N, "n": 3, "temperature": 0});
    let (status, body) = h.post("/v1/completions", request).await;
    assert_eq!(status, 200, "{body}");
    let choices = body["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{body}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{body}");
        assert_eq!(c["text"], want.as_str(), "{body}");
        assert_eq!(c["finish_reason"], "length", "{body}");
    }
    assert_eq!(body["usage"]["completion_tokens"], 3 * N, "{body}");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(seen.lock().expect("test mutex")[0].n, 3);

    let (status, text) = h
        .http(
            "POST",
            "/v1/chat/completions",
            json!({
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": N, "n": 3,
                "stream": true, "stream_options": {"include_usage": true},
            }),
        )
        .await;
    assert_eq!(status, 200, "{text}");
    let chunks = sse_chunks("chat n=3", &text);
    let mut texts = vec![String::new(); 3];
    let mut finishes = [0; 3];
    for c in &chunks {
        for choice in c["choices"].as_array().into_iter().flatten() {
            let i = choice["index"].as_u64().expect("index") as usize;
            texts[i].push_str(choice["delta"]["content"].as_str().unwrap_or_default());
            if !choice["finish_reason"].is_null() {
                finishes[i] += 1;
            }
        }
    }
    assert_eq!(finishes, [1, 1, 1], "{text}");
    assert!(texts.iter().all(|t| t == &want), "{texts:?} != {want:?}");
    let last = chunks.last().expect("chunks");
    assert_eq!(last["usage"]["completion_tokens"], 3 * N, "{text}");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    h.stop().await;
}

/// Every message of a gRPC `Generate` stream.
async fn grpc_messages(h: &mut Harness, req: v1::GenerateRequest) -> Vec<v1::GenerateResponse> {
    let mut stream = h.grpc.generate(req).await.expect("generate").into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await.expect("the stream") {
        out.push(m);
    }
    out
}

/// gRPC `n` = 3 (the HTTP path's validation and dispatch): ONE `Decode` call carrying `n`, and
/// three samples told apart by `index`, each with its text and exactly one finish, the usage
/// (every sample's tokens) on the stream's last message only; `n` out of [1, 16] is
/// INVALID_ARGUMENT naming `n`, before any worker sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_n_samples_are_one_decode_call_and_indexed_streams() {
    let (tok, tokens) = script();
    const N: u32 = 5;
    let want = tok.decode(&tokens[..N as usize], true).expect("decode");
    let worker = streaming(tokens);
    let (calls, seen) = (worker.calls.clone(), worker.seen.clone());
    let mut h = Harness::with_worker(RouterConfig::ephemeral(), worker).await;
    let messages = grpc_messages(
        &mut h,
        v1::GenerateRequest {
            n: Some(3),
            ..generate(N)
        },
    )
    .await;
    let mut texts = vec![String::new(); 3];
    let mut finishes = [0; 3];
    for m in &messages {
        let i = m.index as usize;
        assert!(i < 3, "{m:?}");
        texts[i].push_str(&m.text);
        if m.finish_reason != v1::FinishReason::Unspecified as i32 {
            assert_eq!(m.finish_reason, v1::FinishReason::Length as i32, "{m:?}");
            finishes[i] += 1;
        }
    }
    assert_eq!(finishes, [1, 1, 1], "{messages:?}");
    assert!(texts.iter().all(|t| t == &want), "{texts:?} != {want:?}");
    let (last, rest) = messages.split_last().expect("messages");
    assert!(rest.iter().all(|m| m.usage.is_none()), "{messages:?}");
    let usage = last.usage.expect("usage on the last message");
    assert_eq!(usage.completion_tokens, 3 * N, "{usage:?}");
    assert_eq!(usage.cached_prompt_tokens, CACHED, "{usage:?}");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(seen.lock().expect("test mutex")[0].n, 3);

    for bad in [0, 17] {
        let status = h
            .grpc_error(v1::GenerateRequest {
                n: Some(bad),
                ..generate(4)
            })
            .await;
        assert_eq!(status.code(), Code::InvalidArgument, "n={bad}: {status:?}");
        assert!(
            status.message().starts_with("`n` must be in [1, 16]"),
            "{status:?}"
        );
    }
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    h.stop().await;
}

/// A gRPC chat request with `tools`.
fn tools_request(choice: Option<v1::tool_choice::Choice>, n: u32) -> v1::GenerateRequest {
    let weather =
        r#"{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}"#;
    v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Chat(v1::ChatMessages {
            messages: vec![v1::ChatMessage {
                role: "user".into(),
                content: "Weather in Ur?".into(),
                ..Default::default()
            }],
        })),
        tools: vec![
            v1::Tool {
                name: "get_weather".into(),
                description: "The sky over a city.".into(),
                parameters: weather.into(),
            },
            v1::Tool {
                name: "noop".into(),
                ..Default::default()
            },
        ],
        tool_choice: choice.map(|c| v1::ToolChoice { choice: Some(c) }),
        n: Some(n),
        ..generate(64)
    }
}

/// Tools on gRPC, through the code HTTP chat uses: the template gets the definitions, a
/// `required` choice sends the decode worker the tool-call grammar, and each sample's last
/// message carries the call parsed from its output (FINISH_REASON_TOOL_CALLS); `auto` parses
/// too, `none` does not; an earlier call and its result go back as chat turns; bad tools,
/// choices, tools without chat input and tools with `response_format` are INVALID_ARGUMENT
/// naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_tool_calls_are_parsed_per_sample() {
    use v1::tool_choice::{Choice, Mode};
    let (tok, _) = script();
    let call = r#"{"name":"get_weather","arguments":{"city":"Ur"}}"#;
    let worker = streaming(tok.encode(call, false).expect("encode"));
    let seen = worker.seen.clone();
    let mut h = Harness::with_worker(RouterConfig::ephemeral(), worker).await;

    let required = Some(Choice::Mode(Mode::Required as i32));
    let messages = grpc_messages(&mut h, tools_request(required.clone(), 2)).await;
    for index in 0..2 {
        let of: Vec<_> = messages.iter().filter(|m| m.index == index).collect();
        let text: String = of.iter().map(|m| m.text.as_str()).collect();
        assert_eq!(text, call, "the raw output streams as generated");
        let (last, rest) = of.split_last().expect("messages");
        assert!(rest.iter().all(|m| m.tool_calls.is_empty()), "{of:?}");
        assert_eq!(
            last.finish_reason,
            v1::FinishReason::ToolCalls as i32,
            "{last:?}"
        );
        let [c] = last.tool_calls.as_slice() else {
            panic!("one call: {last:?}")
        };
        assert_eq!(
            (c.name.as_str(), c.arguments.as_str()),
            ("get_weather", r#"{"city":"Ur"}"#)
        );
        assert!(c.id.starts_with("call_"), "{c:?}");
    }
    {
        let seen = seen.lock().expect("test mutex");
        let sent = seen.last().expect("a decode call");
        let grammar = match sent.response_format.as_ref().and_then(|f| f.format.clone()) {
            Some(v1::response_format::Format::JsonSchema(s)) => s,
            other => panic!("no tool-call grammar: {other:?}"),
        };
        assert!(
            grammar.contains("anyOf") && grammar.contains("get_weather"),
            "{grammar}"
        );
        let prompt = tok.decode(&sent.prompt_tokens, false).expect("decode");
        assert!(prompt.contains("The sky over a city."), "{prompt}");
    }

    // auto parses the same output; none leaves it text.
    for (choice, finish, parsed) in [
        (None, v1::FinishReason::ToolCalls, true),
        (
            Some(Choice::Mode(Mode::Auto as i32)),
            v1::FinishReason::ToolCalls,
            true,
        ),
        (
            Some(Choice::Mode(Mode::None as i32)),
            v1::FinishReason::Stop,
            false,
        ),
    ] {
        let messages = grpc_messages(&mut h, tools_request(choice.clone(), 1)).await;
        let last = messages.last().expect("messages");
        assert_eq!(last.finish_reason, finish as i32, "{choice:?}: {last:?}");
        assert_eq!(!last.tool_calls.is_empty(), parsed, "{choice:?}: {last:?}");
        let sent = seen
            .lock()
            .expect("test mutex")
            .last()
            .cloned()
            .expect("sent");
        assert!(sent.response_format.is_none(), "{choice:?}: unconstrained");
    }

    // The call and its result go back into the conversation.
    let mut back = tools_request(Some(Choice::Function("noop".into())), 1);
    if let Some(v1::generate_request::Input::Chat(chat)) = back.input.as_mut() {
        chat.messages.push(v1::ChatMessage {
            role: "assistant".into(),
            tool_calls: vec![v1::ToolCall {
                id: "call_1".into(),
                name: "get_weather".into(),
                arguments: r#"{"city":"Ur"}"#.into(),
            }],
            ..Default::default()
        });
        chat.messages.push(v1::ChatMessage {
            role: "tool".into(),
            content: "Sunny over Ur.".into(),
            tool_call_id: "call_1".into(),
            ..Default::default()
        });
    }
    grpc_messages(&mut h, back).await;
    {
        let seen = seen.lock().expect("test mutex");
        let sent = seen.last().expect("sent");
        let prompt = tok.decode(&sent.prompt_tokens, false).expect("decode");
        assert!(
            prompt.contains(r#"{"name":"get_weather","arguments":{"city":"Ur"}}"#)
                && prompt.contains("Sunny over Ur."),
            "{prompt}"
        );
        let grammar = format!("{:?}", sent.response_format);
        assert!(
            grammar.contains("noop") && !grammar.contains("get_weather"),
            "{grammar}"
        );
    }

    let text_input = v1::GenerateRequest {
        tools: tools_request(None, 1).tools,
        ..generate(4)
    };
    let bad_params = {
        let mut r = tools_request(None, 1);
        r.tools[0].parameters = "{not json".into();
        r
    };
    let with_format = v1::GenerateRequest {
        response_format: Some(v1::ResponseFormat {
            format: Some(v1::response_format::Format::JsonObject(v1::JsonObject {})),
        }),
        ..tools_request(required.clone(), 1)
    };
    for (what, req, field) in [
        ("text input", text_input, "`tools`"),
        ("parameters not JSON", bad_params, "`tools`"),
        (
            "an unknown function",
            tools_request(Some(Choice::Function("smite".into())), 1),
            "`tool_choice`",
        ),
        (
            "an unknown mode",
            tools_request(Some(Choice::Mode(9)), 1),
            "`tool_choice`",
        ),
        ("response_format too", with_format, "`response_format`"),
    ] {
        let status = h.grpc_error(req).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
        assert!(status.message().starts_with(field), "{what}: {status:?}");
    }
    h.stop().await;
}

/// A Responses API stream's events: `(event name, data)`, the name checked against `type` and
/// the sequence numbers against their order.
fn named_events(body: &str) -> Vec<(String, Value)> {
    let events: Vec<(String, Value)> = body
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let name = e
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap_or_else(|| panic!("an event without a name: {e}"));
            let data = e
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .unwrap_or_else(|| panic!("an event without data: {e}"));
            let data: Value = serde_json::from_str(data).expect("JSON data");
            assert_eq!(data["type"], name, "{e}");
            (name.to_string(), data)
        })
        .collect();
    for (i, (_, data)) in events.iter().enumerate() {
        assert_eq!(data["sequence_number"], i, "{body}");
    }
    events
}

/// Tools on `/v1/responses`: with `required`, the worker gets the tool-call grammar and the
/// output becomes one `function_call` item, whole and streamed (the item's events in order,
/// the arguments in one delta, the final object holding the same item); with `auto` and
/// prose, the held-back text opens the message item and arrives whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_tool_calls_are_function_call_items_whole_and_streamed() {
    let (tok, prose) = script();
    let call = r#"{"name":"get_weather","arguments":{"city":"Ur"}}"#;
    let worker = streaming(tok.encode(call, false).expect("encode"));
    let seen = worker.seen.clone();
    let h = Harness::with_worker(RouterConfig::ephemeral(), worker).await;
    let tools = json!([{"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}}]);
    let body = json!({"input": "Weather in Ur?", "tools": tools, "tool_choice": "required",
        "max_output_tokens": 64});

    let (status, whole) = h.post("/v1/responses", body.clone()).await;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["status"], "completed", "{whole}");
    assert_eq!(whole["tool_choice"], "required", "{whole}");
    let [item] = whole["output"].as_array().expect("output").as_slice() else {
        panic!("one item: {whole}")
    };
    assert_eq!(item["type"], "function_call", "{whole}");
    assert_eq!(item["name"], "get_weather", "{whole}");
    assert_eq!(item["arguments"], r#"{"city":"Ur"}"#, "{whole}");
    assert_eq!(item["status"], "completed", "{whole}");
    assert!(
        seen.lock().expect("test mutex")[0]
            .response_format
            .is_some(),
        "the tool-call grammar went to the worker"
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, text) = h.http("POST", "/v1/responses", streamed).await;
    assert_eq!(status, 200, "{text}");
    let events = named_events(&text);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ],
        "{text}"
    );
    let added = &events[2].1["item"];
    assert_eq!(
        (&added["type"], &added["status"], &added["arguments"]),
        (&json!("function_call"), &json!("in_progress"), &json!(""))
    );
    let id = added["id"].as_str().expect("item id");
    for (_, e) in &events[3..5] {
        assert_eq!(
            (e["item_id"].as_str(), &e["output_index"]),
            (Some(id), &json!(0))
        );
    }
    assert_eq!(events[3].1["delta"], r#"{"city":"Ur"}"#);
    assert_eq!(events[4].1["arguments"], r#"{"city":"Ur"}"#);
    let done = &events[5].1["item"];
    assert_eq!(
        (&done["id"], &done["status"]),
        (&json!(id), &json!("completed"))
    );
    assert_eq!(events[6].1["response"]["output"][0], *done, "{text}");
    h.stop().await;

    // auto with prose: the message item opens once the text cannot be a call.
    let h = Harness::with_worker(RouterConfig::ephemeral(), streaming(prose.clone())).await;
    const N: usize = 6;
    let want = tok.decode(&prose[..N], true).expect("decode");
    let auto = json!({"input": "hi", "tools": tools, "max_output_tokens": N, "stream": true});
    let (status, text) = h.http("POST", "/v1/responses", auto).await;
    assert_eq!(status, 200, "{text}");
    let events = named_events(&text);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        &names[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ],
        "{text}"
    );
    assert_eq!(names.last(), Some(&"response.incomplete"), "{text}");
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .filter_map(|(_, e)| e["delta"].as_str())
        .collect();
    assert_eq!(deltas, want, "{text}");
    let last = &events.last().expect("events").1["response"];
    assert_eq!(last["output"][0]["type"], "message", "{text}");
    assert_eq!(last["output"][0]["content"][0]["text"], want.as_str());
    h.stop().await;
}

/// Asserts a completions `logprobs` object covers the prompt `prompt` (named by `tok`) and then
/// `generated` tokens: the prompt's first token with `null`s, the others with the scripted
/// worker's values and `top` alternatives, generated tokens with none asked of the script
/// (their entries are the worker's, empty here), offsets over the token texts from 0.
fn assert_echo_logprobs(what: &str, lp: &Value, tok: &Tokenizer, prompt: &[u32], top: usize) {
    let tokens = lp["tokens"].as_array().expect("tokens");
    let logprobs = lp["token_logprobs"].as_array().expect("token_logprobs");
    let tops = lp["top_logprobs"].as_array().expect("top_logprobs");
    let offsets = lp["text_offset"].as_array().expect("text_offset");
    assert!(tokens.len() >= prompt.len(), "{what}: {lp}");
    assert_eq!(logprobs.len(), tokens.len(), "{what}: {lp}");
    assert_eq!(tops.len(), tokens.len(), "{what}: {lp}");
    assert_eq!(offsets.len(), tokens.len(), "{what}: {lp}");
    assert_eq!(
        logprobs[0],
        Value::Null,
        "{what}: the first prompt token has none: {lp}"
    );
    assert_eq!(tops[0], Value::Null, "{what}: {lp}");
    let mut at = 0;
    for (i, &t) in prompt.iter().enumerate() {
        let text = tok.decode(&[t], false).expect("decode");
        assert_eq!(tokens[i], text.as_str(), "{what}: prompt token {i}: {lp}");
        assert_eq!(offsets[i], at, "{what}: offset {i}: {lp}");
        at += text.chars().count();
        if i > 0 {
            let want = common::scripted_prompt_logprob(i);
            assert_eq!(
                logprobs[i].as_f64(),
                Some(f64::from(want)),
                "{what}: {i}: {lp}"
            );
            assert_eq!(
                tops[i].as_object().map(|o| o.len()),
                Some(top),
                "{what}: {lp}"
            );
        }
    }
    // The offsets go on into the generated tokens.
    assert_eq!(
        offsets
            .get(prompt.len())
            .map_or(at, |o| o.as_u64().unwrap_or(0) as usize),
        at
    );
}

/// `echo` on `/v1/completions` (vLLM's behaviour): the prompt starts each choice's text, and
/// with `logprobs` its tokens start the `logprobs` lists (the first with `null`s), whole and
/// streamed (the prompt comes first, in each choice's first chunk); the worker is asked for
/// the prompt's log-probabilities only when `logprobs` is set; `max_tokens: 0` with `echo`
/// returns the prompt alone (`length`, no completion tokens; the worker is asked for one
/// token, which is left out), without `echo` it is a 400 naming `max_tokens`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_echo_returns_the_prompt_and_its_logprobs() {
    let (tok, tokens) = script();
    const N: usize = 4;
    let generated = tok.decode(&tokens[..N], true).expect("decode");
    let worker = streaming(tokens.clone());
    let seen = worker.seen.clone();
    let h = Harness::with_worker(RouterConfig::ephemeral(), worker).await;
    let prompt_text = "And God said";
    let body = json!({"prompt": prompt_text, "max_tokens": N, "temperature": 0, "echo": true, "logprobs": 2});

    // Whole.
    let (status, got) = h.post("/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{got}");
    let asked = seen
        .lock()
        .expect("test mutex")
        .last()
        .cloned()
        .expect("a call");
    assert_eq!(asked.prompt_logprobs, Some(2));
    let prompt = asked.prompt_tokens.clone();
    let choice = &got["choices"][0];
    assert_eq!(choice["text"], format!("{prompt_text}{generated}"), "{got}");
    assert_echo_logprobs("whole", &choice["logprobs"], &tok, &prompt, 2);
    assert_eq!(
        choice["logprobs"]["tokens"].as_array().map(Vec::len),
        Some(prompt.len() + N),
        "{got}"
    );
    assert_eq!(got["usage"]["completion_tokens"], N, "{got}");

    // Streamed: the prompt and its log-probabilities lead the first chunk.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, text) = h.http("POST", "/v1/completions", streamed).await;
    assert_eq!(status, 200, "{text}");
    let chunks = sse_chunks("echo stream", &text);
    let first = &chunks[0]["choices"][0];
    assert!(
        first["text"]
            .as_str()
            .is_some_and(|t| t.starts_with(prompt_text)),
        "{text}"
    );
    assert_echo_logprobs("first chunk", &first["logprobs"], &tok, &prompt, 2);
    let all: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(all, format!("{prompt_text}{generated}"), "{text}");
    let count: usize = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["tokens"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(count, prompt.len() + N, "{text}");

    // Echo without logprobs: the text only, and the worker computes no prompt logprobs.
    let (status, got) = h
        .post(
            "/v1/completions",
            json!({"prompt": prompt_text, "max_tokens": N, "echo": true}),
        )
        .await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        got["choices"][0]["text"],
        format!("{prompt_text}{generated}")
    );
    assert_eq!(got["choices"][0]["logprobs"], Value::Null);
    let asked = seen
        .lock()
        .expect("test mutex")
        .last()
        .cloned()
        .expect("a call");
    assert_eq!(asked.prompt_logprobs, None);

    // Token-id prompts echo their decoded text.
    let (status, got) = h
        .post(
            "/v1/completions",
            json!({"prompt": tokens[..3].to_vec(), "max_tokens": 1, "echo": true}),
        )
        .await;
    assert_eq!(status, 200, "{got}");
    let decoded = tok.decode(&tokens[..3], true).expect("decode");
    let single = tok.decode(&tokens[..1], true).expect("decode");
    assert_eq!(
        got["choices"][0]["text"],
        format!("{decoded}{single}"),
        "{got}"
    );

    // `max_tokens: 0` with echo: the prompt alone, whole and streamed.
    let only = json!({"prompt": prompt_text, "max_tokens": 0, "echo": true, "logprobs": 1});
    let (status, got) = h.post("/v1/completions", only.clone()).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["choices"][0]["text"], prompt_text, "{got}");
    assert_eq!(got["choices"][0]["finish_reason"], "length", "{got}");
    assert_eq!(got["usage"]["completion_tokens"], 0, "{got}");
    assert_eq!(
        got["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .map(Vec::len),
        Some(prompt.len()),
        "{got}"
    );
    assert_echo_logprobs(
        "prompt only",
        &got["choices"][0]["logprobs"],
        &tok,
        &prompt,
        1,
    );
    let asked = seen
        .lock()
        .expect("test mutex")
        .last()
        .cloned()
        .expect("a call");
    assert_eq!(
        asked.stop.map(|s| s.max_tokens),
        Some(1),
        "one token, left out"
    );
    let mut only_streamed = only;
    only_streamed["stream"] = json!(true);
    let (status, text) = h.http("POST", "/v1/completions", only_streamed).await;
    assert_eq!(status, 200, "{text}");
    let chunks = sse_chunks("prompt only stream", &text);
    assert_eq!(chunks.len(), 1, "{text}");
    assert_eq!(chunks[0]["choices"][0]["text"], prompt_text, "{text}");
    assert_eq!(chunks[0]["choices"][0]["finish_reason"], "length", "{text}");

    // n = 2: each choice starts with the prompt and its log-probabilities.
    let (status, got) = h
        .post(
            "/v1/completions",
            json!({"prompt": prompt_text, "max_tokens": N, "n": 2, "echo": true, "logprobs": 2}),
        )
        .await;
    assert_eq!(status, 200, "{got}");
    for c in got["choices"].as_array().expect("choices") {
        assert_eq!(c["text"], format!("{prompt_text}{generated}"), "{got}");
        assert_echo_logprobs("n = 2", &c["logprobs"], &tok, &prompt, 2);
    }

    // Refused by name: max_tokens 0 without echo, a non-boolean echo, logprobs above 5.
    for (bad, field) in [
        (json!({"prompt": "hi", "max_tokens": 0}), "max_tokens"),
        (
            json!({"prompt": "hi", "max_tokens": -1, "echo": true}),
            "max_tokens",
        ),
        (json!({"prompt": "hi", "echo": "yes"}), "echo"),
        (
            json!({"prompt": "hi", "echo": true, "logprobs": 6}),
            "logprobs",
        ),
    ] {
        let (status, got) = h.post("/v1/completions", bad.clone()).await;
        assert_eq!(status, 400, "{bad}: {got}");
        assert_eq!(got["error"]["param"], field, "{bad}: {got}");
    }
    h.stop().await;
}

/// gRPC `prompt_logprobs`: the prompt's entries on the first message (one per prompt token
/// after the first), checked against the worker's; with `max_tokens` 0, one message with them,
/// no tokens and FINISH_REASON_LENGTH; above 20 is INVALID_ARGUMENT naming the field, before
/// any worker sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_prompt_logprobs_come_on_the_first_message() {
    let (_, tokens) = script();
    let worker = streaming(tokens);
    let (calls, seen) = (worker.calls.clone(), worker.seen.clone());
    let mut h = Harness::with_worker(RouterConfig::ephemeral(), worker).await;
    let messages = grpc_messages(
        &mut h,
        v1::GenerateRequest {
            prompt_logprobs: Some(3),
            ..generate(4)
        },
    )
    .await;
    let prompt = seen.lock().expect("test mutex")[0].prompt_tokens.clone();
    assert_eq!(seen.lock().expect("test mutex")[0].prompt_logprobs, Some(3));
    assert_eq!(
        messages[0].prompt_logprobs,
        common::scripted_prompt_logprobs(&prompt, 3)
    );
    assert!(messages[1..].iter().all(|m| m.prompt_logprobs.is_empty()));
    assert_eq!(messages.iter().map(|m| m.token_ids.len()).sum::<usize>(), 4);

    let only = grpc_messages(
        &mut h,
        v1::GenerateRequest {
            prompt_logprobs: Some(0),
            ..generate(0)
        },
    )
    .await;
    assert_eq!(only.len(), 1, "{only:?}");
    assert!(
        only[0].token_ids.is_empty() && only[0].text.is_empty(),
        "{only:?}"
    );
    assert_eq!(only[0].finish_reason, v1::FinishReason::Length as i32);
    assert_eq!(only[0].prompt_logprobs.len(), prompt.len() - 1);
    assert_eq!(only[0].usage.map(|u| u.completion_tokens), Some(0));

    let before = calls.load(std::sync::atomic::Ordering::SeqCst);
    let status = h
        .grpc_error(v1::GenerateRequest {
            prompt_logprobs: Some(21),
            ..generate(4)
        })
        .await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .starts_with("`prompt_logprobs` must be in [0, 20], got 21"),
        "{status:?}"
    );
    let status = h.grpc_error(generate(0)).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with("`max_tokens`"), "{status:?}");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), before);
    h.stop().await;
}
