//! The public plane's protections, through real sockets on 127.0.0.1:0 (the router's own
//! accept loops, not `oneshot`), as clients see them:
//!
//! - API keys: missing / wrong → HTTP 401 with an OpenAI-shaped body, gRPC UNAUTHENTICATED;
//!   the right key works on both; `/health`, `/metrics` and gRPC health stay open;
//! - per-key limits: `max_concurrent` and `tokens_per_minute` → 429 with `Retry-After` /
//!   RESOURCE_EXHAUSTED with `retry-after`, another key unaffected; a request above the whole
//!   budget → 400; the router's own overload 429 carries `Retry-After` too;
//! - HTTP timeouts: half a request head, silence, and an idle keep-alive connection are closed;
//! - TLS: HTTPS and gRPC over TLS with a self-signed certificate; plain-text clients fail.
mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, Request};
use ferry_proto::internal;
use ferry_proto::internal::registry_client::RegistryClient;
use ferry_proto::v1;
use ferry_proto::v1::inference_client::InferenceClient;
use ferry_router::state::AppState;
use ferry_router::{Router, RouterConfig};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};
use tonic::Code;

use common::{start_worker, Scripted};

const ALICE: &str = "alice-key-0123456789abcdef";
const BOB: &str = "bob-key-0123456789abcdef";
const CAROL: &str = "carol-key-0123456789abcdef";
const WRONG: &str = "alice-key-0123456789abcdeF";

/// alice: one request at a time; bob: unlimited; carol: 100 tokens per minute.
const KEYS: &str = "\
# test keys
alice-key-0123456789abcdef name=alice max_concurrent=1
bob-key-0123456789abcdef   name=bob
carol-key-0123456789abcdef name=carol tokens_per_minute=100
";

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "ferry-auth-{what}-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Self(dir)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write");
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running router (over real listeners), with a decode worker when one is given.
struct Harness {
    state: Arc<AppState>,
    http: SocketAddr,
    grpc: SocketAddr,
    shutdown: CancellationToken,
    running: JoinHandle<Result<(), ferry_router::RouterError>>,
    _scratch: Scratch,
}

impl Harness {
    /// The keys of [`KEYS`], `config` for the rest.
    async fn start(config: RouterConfig, worker: Option<Scripted>) -> Self {
        let scratch = Scratch::new("keys");
        let keys = scratch.write("keys.txt", KEYS);
        Self::start_in(
            RouterConfig {
                api_keys_file: Some(keys),
                ..config
            },
            worker,
            scratch,
        )
        .await
    }

    async fn start_in(config: RouterConfig, worker: Option<Scripted>, scratch: Scratch) -> Self {
        let bound = Router::load(RouterConfig {
            page_size: 4,
            ..config
        })
        .await
        .expect("load")
        .bind()
        .await
        .expect("bind");
        let (state, http, grpc) = (bound.state().clone(), bound.http_addr(), bound.grpc_addr());
        let internal = bound.internal_addr();
        let shutdown = CancellationToken::new();
        let running = tokio::spawn(bound.run(shutdown.clone()));
        if let Some(worker) = worker {
            let addr = start_worker(worker).await;
            register(&state, internal, &addr).await;
        }
        Self {
            state,
            http,
            grpc,
            shutdown,
            running,
            _scratch: scratch,
        }
    }

    /// A plain-text gRPC client.
    async fn grpc(&self) -> InferenceClient<Channel> {
        let channel = Channel::from_shared(format!("http://{}", self.grpc))
            .expect("uri")
            .connect()
            .await
            .expect("connect");
        InferenceClient::new(channel)
    }

    /// One plain-text HTTP request on a new connection.
    async fn http(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: Option<Value>,
    ) -> Reply {
        let tcp = TcpStream::connect(self.http).await.expect("connect");
        send(tcp, request(method, path, key, body))
            .await
            .expect("HTTP exchange")
    }

    /// Waits until no request holds an admission permit.
    async fn wait_released(&self) {
        common::wait_released(&self.state).await;
    }

    async fn stop(self) {
        common::stop_router(&self.state, self.shutdown, self.running).await;
    }
}

/// Registers decode worker `d0` at `addr` on the internal plane (the Registry takes no API
/// key).
async fn register(state: &AppState, internal: SocketAddr, addr: &str) {
    let mut registry = RegistryClient::connect(format!("http://{internal}"))
        .await
        .expect("connect");
    registry
        .register(internal::RegisterRequest {
            worker_id: "d0".into(),
            role: internal::WorkerRole::Decode as i32,
            grpc_address: addr.into(),
            page_size: 4,
            total_blocks: 256,
            cached_block_hashes: vec![],
            last_event_id: 0,
            instance_id: 1,
            transports: vec![],
        })
        .await
        .expect("register without a key");
    assert_eq!(state.decode_workers(), 1);
}

/// What an HTTP client saw.
struct Reply {
    status: u16,
    headers: HeaderMap,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    fn retry_after(&self) -> Option<u64> {
        let value = self.headers.get("retry-after")?;
        Some(
            value
                .to_str()
                .expect("ASCII")
                .parse()
                .expect("whole seconds"),
        )
    }
}

fn request(
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<Value>,
) -> Request<Full<Bytes>> {
    let mut builder = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost")
        .header("content-type", "application/json");
    if let Some(key) = key {
        builder = builder.header("authorization", format!("Bearer {key}"));
    }
    let body = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    builder.body(Full::new(body)).expect("request")
}

/// Sends `request` over `io` (HTTP/1.1) and reads the whole response.
async fn send<IO>(io: IO, request: Request<Full<Bytes>>) -> Result<Reply, hyper::Error>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(conn);
    let response = sender.send_request(request).await?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect().await?.to_bytes();
    Ok(Reply {
        status,
        headers,
        body: String::from_utf8(bytes.to_vec()).expect("UTF-8 body"),
    })
}

fn completion(max_tokens: u32) -> Value {
    json!({"prompt": "hello", "max_tokens": max_tokens, "temperature": 0})
}

fn generate(max_tokens: u32, key: Option<&str>) -> tonic::Request<v1::GenerateRequest> {
    with_key(common::greedy_hello(max_tokens), key)
}

fn with_key<T>(message: T, key: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        let value = format!("Bearer {key}").parse().expect("ASCII metadata");
        request.metadata_mut().insert("authorization", value);
    }
    request
}

/// Runs a `Generate` to its end; the status it failed with, if it did.
async fn grpc_outcome(
    client: &mut InferenceClient<Channel>,
    request: tonic::Request<v1::GenerateRequest>,
) -> Result<String, tonic::Status> {
    let mut stream = client.generate(request).await?.into_inner();
    let mut text = String::new();
    while let Some(message) = stream.message().await? {
        text.push_str(&message.text);
    }
    Ok(text)
}

/// Asserts an OpenAI error body and returns its `error` object.
fn openai_error(what: &str, reply: &Reply, status: u16, kind: &str, code: &str) -> Value {
    assert_eq!(reply.status, status, "{what}: {}", reply.body);
    let body = reply.json();
    let e = body["error"].clone();
    assert_eq!(e["type"], kind, "{what}: {body}");
    assert_eq!(e["code"], code, "{what}: {body}");
    assert!(e.get("param").is_some(), "{what}: no param: {body}");
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {body}"
    );
    e
}

fn script() -> Vec<u32> {
    let dir = ferry_modelcard::embedded::default_model_dir();
    let tok = ferry_modelcard::tokenizer::Tokenizer::from_dir(&dir).expect("tokenizer");
    tok.encode(
        "In the beginning God created the heaven and the earth.",
        false,
    )
    .expect("encode")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_right_key_http_answers_401_and_grpc_unauthenticated() {
    let h = Harness::start(
        RouterConfig::ephemeral(),
        Some(Scripted::streaming(script())),
    )
    .await;

    for (what, key) in [("no key", None), ("a wrong key", Some(WRONG))] {
        for (method, path, body) in [
            ("POST", "/v1/completions", Some(completion(4))),
            (
                "POST",
                "/v1/chat/completions",
                Some(json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})),
            ),
            ("GET", "/v1/models", None),
        ] {
            let reply = h.http(method, path, key, body).await;
            let what = format!("{method} {path} with {what}");
            let e = openai_error(
                &what,
                &reply,
                401,
                "authentication_error",
                "invalid_api_key",
            );
            assert_eq!(
                reply.headers.get("www-authenticate").map(|v| v.as_bytes()),
                Some(&b"Bearer"[..]),
                "{what}"
            );
            assert!(
                !reply.body.contains(WRONG),
                "{what}: echoes the key: {}",
                reply.body
            );
            let want = if key.is_none() {
                "no API key"
            } else {
                "invalid API key"
            };
            assert!(
                e["message"].as_str().is_some_and(|m| m.contains(want)),
                "{what}: {e}"
            );
        }
        let mut grpc = h.grpc().await;
        let status = grpc_outcome(&mut grpc, generate(4, key))
            .await
            .expect_err(what);
        assert_eq!(status.code(), Code::Unauthenticated, "{what}: {status:?}");
        let status = grpc
            .list_models(with_key(v1::ListModelsRequest {}, key))
            .await
            .expect_err(what);
        assert_eq!(status.code(), Code::Unauthenticated, "{what}: {status:?}");
        let status = grpc
            .tokenize(with_key(
                v1::TokenizeRequest {
                    text: "hi".into(),
                    ..Default::default()
                },
                key,
            ))
            .await
            .expect_err(what);
        assert_eq!(status.code(), Code::Unauthenticated, "{what}: {status:?}");
    }
    // Not `Bearer <key>`.
    let tcp = TcpStream::connect(h.http).await.expect("connect");
    let mut basic = request("GET", "/v1/models", None, None);
    basic.headers_mut().insert(
        "authorization",
        format!("Basic {ALICE}").parse().expect("header"),
    );
    let reply = send(tcp, basic).await.expect("exchange");
    let e = openai_error(
        "Basic auth",
        &reply,
        401,
        "authentication_error",
        "invalid_api_key",
    );
    assert!(
        e["message"]
            .as_str()
            .is_some_and(|m| m.contains("malformed")),
        "{e}"
    );

    // The right key works on both front doors.
    let reply = h
        .http("POST", "/v1/completions", Some(BOB), Some(completion(4)))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.json()["object"], "text_completion", "{}", reply.body);
    let reply = h.http("GET", "/v1/models", Some(ALICE), None).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let mut grpc = h.grpc().await;
    let text = grpc_outcome(&mut grpc, generate(4, Some(BOB)))
        .await
        .expect("Generate with bob's key");
    assert!(!text.is_empty());
    let models = grpc
        .list_models(with_key(v1::ListModelsRequest {}, Some(ALICE)))
        .await
        .expect("ListModels with alice's key");
    assert_eq!(models.into_inner().models.len(), 1);

    // Probes and scrapers need no key.
    assert_eq!(h.http("GET", "/health", None, None).await.status, 200);
    let metrics = h.http("GET", "/metrics", None, None).await;
    assert_eq!(metrics.status, 200);
    assert!(
        metrics
            .body
            .contains("ferry_request_failure_total{kind=\"invalid_api_key\""),
        "failures are counted"
    );
    let channel = Channel::from_shared(format!("http://{}", h.grpc))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let health = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: "ferry.v1.Inference".into(),
        })
        .await
        .expect("gRPC health without a key");
    assert_eq!(
        health.into_inner().status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_max_concurrent_is_429_with_retry_after_and_other_keys_are_unaffected() {
    let slow = Scripted::streaming(script().repeat(4)).paced(Duration::from_millis(100));
    let h = Harness::start(RouterConfig::ephemeral(), Some(slow)).await;
    let mut grpc = h.grpc().await;

    // alice's one slot, held by an open stream.
    let mut open = grpc
        .generate(generate(40, Some(ALICE)))
        .await
        .expect("generate")
        .into_inner();
    open.message()
        .await
        .expect("stream")
        .expect("a first token");

    let reply = h
        .http("POST", "/v1/completions", Some(ALICE), Some(completion(4)))
        .await;
    let e = openai_error(
        "alice over max_concurrent",
        &reply,
        429,
        "rate_limit_error",
        "concurrency_limited",
    );
    assert!(
        e["message"]
            .as_str()
            .is_some_and(|m| m.contains("API key `alice`") && m.contains("limit of 1")),
        "{e}"
    );
    assert_eq!(reply.retry_after(), Some(1), "Retry-After");
    let status = grpc_outcome(&mut grpc, generate(4, Some(ALICE)))
        .await
        .expect_err("alice over");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    let retry = status
        .metadata()
        .get("retry-after")
        .and_then(|v| v.to_str().ok());
    assert_eq!(retry, Some("1"), "{status:?}");

    // bob is not held back by alice's limit.
    let reply = h
        .http("POST", "/v1/completions", Some(BOB), Some(completion(4)))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    grpc_outcome(&mut grpc, generate(4, Some(BOB)))
        .await
        .expect("bob on gRPC");

    // The slot comes back when alice's stream goes.
    drop(open);
    h.wait_released().await;
    let reply = h
        .http("POST", "/v1/completions", Some(ALICE), Some(completion(4)))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_tokens_per_minute_is_429_with_a_plausible_retry_after() {
    let h = Harness::start(
        RouterConfig::ephemeral(),
        Some(Scripted::streaming(script())),
    )
    .await;
    let mut grpc = h.grpc().await;

    // carol has 100 tokens a minute; each request is charged its prompt + max_tokens (60).
    let reply = h
        .http("POST", "/v1/completions", Some(CAROL), Some(completion(60)))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let prompt = reply.json()["usage"]["prompt_tokens"]
        .as_u64()
        .expect("usage");
    let reply = h
        .http("POST", "/v1/completions", Some(CAROL), Some(completion(60)))
        .await;
    let e = openai_error(
        "carol over tokens_per_minute",
        &reply,
        429,
        "rate_limit_error",
        "rate_limited",
    );
    assert!(
        e["message"]
            .as_str()
            .is_some_and(|m| m.contains("100 tokens per minute")),
        "{e}"
    );
    // The bucket refills 100 tokens / 60 s and lacks about 2 * (prompt + 60) - 100 of them.
    let lacking = 2 * (prompt + 60) - 100;
    let expected = lacking * 60 / 100;
    let retry = reply.retry_after().expect("Retry-After");
    assert!(
        (expected.saturating_sub(2)..=expected + 1).contains(&retry),
        "Retry-After {retry}, expected about {expected}"
    );
    let status = grpc_outcome(&mut grpc, generate(60, Some(CAROL)))
        .await
        .expect_err("carol over");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    let grpc_retry: u64 = status
        .metadata()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("retry-after");
    assert!((1..=retry).contains(&grpc_retry), "{grpc_retry} vs {retry}");

    // More than the whole budget can never pass: 400, no Retry-After.
    let reply = h
        .http(
            "POST",
            "/v1/completions",
            Some(CAROL),
            Some(completion(200)),
        )
        .await;
    let e = openai_error(
        "carol above the budget",
        &reply,
        400,
        "invalid_request_error",
        "exceeds_key_budget",
    );
    assert_eq!(e["param"], "max_tokens");
    assert!(
        e["message"]
            .as_str()
            .is_some_and(|m| m.contains("can never be admitted")),
        "{e}"
    );
    assert_eq!(reply.retry_after(), None);

    // bob has no token limit.
    for _ in 0..3 {
        let reply = h
            .http("POST", "/v1/completions", Some(BOB), Some(completion(60)))
            .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_own_overload_429_carries_retry_after() {
    let slow = Scripted::streaming(script().repeat(4)).paced(Duration::from_millis(100));
    let h = Harness::start(
        RouterConfig {
            max_concurrent_requests: 1,
            ..RouterConfig::ephemeral()
        },
        Some(slow),
    )
    .await;
    let mut grpc = h.grpc().await;
    let mut open = grpc
        .generate(generate(40, Some(BOB)))
        .await
        .expect("generate")
        .into_inner();
    open.message()
        .await
        .expect("stream")
        .expect("a first token");
    let reply = h
        .http("POST", "/v1/completions", Some(BOB), Some(completion(4)))
        .await;
    openai_error("overloaded", &reply, 429, "rate_limit_error", "overloaded");
    assert_eq!(reply.retry_after(), Some(1));
    let status = grpc_outcome(&mut grpc, generate(4, Some(BOB)))
        .await
        .expect_err("overloaded");
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(
        status
            .metadata()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    drop(open);
    h.stop().await;
}

/// Reads until the peer closes; the bytes read, or `None` if it was still open at `within`.
async fn read_until_closed(tcp: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, tcp.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(seen),
            Ok(Ok(n)) => seen.extend_from_slice(buf.get(..n).unwrap_or_default()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_silent_and_idle_http_connections_are_closed_after_the_header_timeout() {
    const TIMEOUT: Duration = Duration::from_millis(300);
    let h = Harness::start(
        RouterConfig {
            http_header_timeout_ms: TIMEOUT.as_millis() as u64,
            ..RouterConfig::ephemeral()
        },
        None,
    )
    .await;
    let bound = TIMEOUT * 10;

    // Half a request head.
    let started = Instant::now();
    let mut half = TcpStream::connect(h.http).await.expect("connect");
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Le")
        .await
        .expect("write");
    let closed = read_until_closed(&mut half, bound).await;
    assert!(
        closed.is_some(),
        "a half-sent head was still open after {bound:?}"
    );
    assert!(
        started.elapsed() >= TIMEOUT / 2,
        "closed before the timeout: {:?}",
        started.elapsed()
    );

    // Nothing at all.
    let mut silent = TcpStream::connect(h.http).await.expect("connect");
    assert!(
        read_until_closed(&mut silent, bound).await.is_some(),
        "a silent connection was still open after {bound:?}"
    );

    // A served request, then an idle keep-alive connection.
    let mut idle = TcpStream::connect(h.http).await.expect("connect");
    idle.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .expect("write");
    let answered = read_until_closed(&mut idle, bound)
        .await
        .expect("an idle keep-alive connection was still open");
    assert!(
        answered.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answered)
    );

    // A prompt client is served as before.
    assert_eq!(h.http("GET", "/metrics", None, None).await.status, 200);
    h.stop().await;
}

/// A self-signed certificate for `localhost`: (certificate PEM, key PEM).
fn self_signed() -> (String, String) {
    let certified =
        rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("rcgen");
    (certified.cert.pem(), certified.signing_key.serialize_pem())
}

/// A TLS client that trusts only `cert_pem`.
fn tls_connector(cert_pem: &str) -> tokio_rustls::TlsConnector {
    use rustls::pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    let cert = rustls::pki_types::CertificateDer::from_pem_slice(cert_pem.as_bytes()).expect("PEM");
    roots.add(cert).expect("trust the test certificate");
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

fn tls_files(scratch: &Scratch, cert: &str, key: &str) -> (PathBuf, PathBuf) {
    (
        scratch.write("cert.pem", cert),
        scratch.write("key.pem", key),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tls_both_listeners_serve_tls_and_plain_text_clients_fail() {
    let (cert, key) = self_signed();
    let scratch = Scratch::new("tls");
    let (cert_file, key_file) = tls_files(&scratch, &cert, &key);
    let keys = scratch.write("keys.txt", KEYS);
    let h = Harness::start_in(
        RouterConfig {
            api_keys_file: Some(keys),
            tls_cert: Some(cert_file),
            tls_key: Some(key_file),
            ..RouterConfig::ephemeral()
        },
        None,
        scratch,
    )
    .await;

    // HTTPS, trusting the certificate; keys still apply.
    let connector = tls_connector(&cert);
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    for (key, status) in [(Some(ALICE), 200), (None, 401)] {
        let tcp = TcpStream::connect(h.http).await.expect("connect");
        let tls = connector
            .connect(name.clone(), tcp)
            .await
            .expect("TLS handshake");
        let reply = send(tls, request("GET", "/v1/models", key, None))
            .await
            .expect("HTTPS exchange");
        assert_eq!(reply.status, status, "{}", reply.body);
    }
    // Plain HTTP on the TLS port fails.
    let tcp = TcpStream::connect(h.http).await.expect("connect");
    let plain = tokio::time::timeout(
        Duration::from_secs(5),
        send(tcp, request("GET", "/health", None, None)),
    )
    .await
    .expect("answered in time");
    assert!(plain.is_err(), "plain HTTP was served on the TLS port");

    // gRPC over TLS, trusting the certificate.
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&cert))
        .domain_name("localhost");
    let channel = Channel::from_shared(format!("https://localhost:{}", h.grpc.port()))
        .expect("uri")
        .tls_config(tls)
        .expect("TLS config")
        .connect()
        .await
        .expect("connect over TLS");
    let models = InferenceClient::new(channel)
        .list_models(with_key(v1::ListModelsRequest {}, Some(ALICE)))
        .await
        .expect("ListModels over TLS");
    assert_eq!(models.into_inner().models.len(), 1);
    // Plain-text gRPC fails.
    let plain = async {
        let channel = Channel::from_shared(format!("http://{}", h.grpc))
            .expect("uri")
            .connect()
            .await?;
        InferenceClient::new(channel)
            .list_models(with_key(v1::ListModelsRequest {}, Some(ALICE)))
            .await
            .map_err(anyhow::Error::from)
            .map(|_| ())
    };
    let plain: anyhow::Result<()> = tokio::time::timeout(Duration::from_secs(5), plain)
        .await
        .expect("failed in time");
    assert!(plain.is_err(), "plain-text gRPC was served on the TLS port");
    h.stop().await;
}

#[tokio::test]
async fn a_bad_keys_file_or_half_a_tls_pair_stops_the_start_up() {
    let scratch = Scratch::new("bad");
    let keys = scratch.write("keys.txt", &format!("{ALICE} max_concurrent=0\n"));
    let e = Router::load(RouterConfig {
        api_keys_file: Some(keys),
        ..RouterConfig::ephemeral()
    })
    .await
    .expect_err("invalid keys file");
    let message = e.to_string();
    assert!(
        message.contains("keys.txt")
            && message.contains("line 1")
            && message.contains("`max_concurrent`"),
        "{message}"
    );
    assert!(!message.contains(ALICE), "leaks the key: {message}");

    let e = Router::load(RouterConfig {
        tls_cert: Some(Path::new("cert.pem").to_path_buf()),
        ..RouterConfig::ephemeral()
    })
    .await
    .expect_err("cert without key");
    assert!(e.to_string().contains("`tls_key`"), "{e}");
}
