//! Fuzzing the HTTP front door: `/v1/completions` and `/v1/chat/completions` bodies (arbitrary
//! bytes, and arbitrary JSON shaped like real bodies) through the real axum app
//! (`ferry_router::http::app(..).oneshot(..)`), its body parser and the router's validation,
//! with a decode worker registered so valid requests succeed. Every outcome must be a success
//! or a 4xx with an OpenAI-shaped error body: never a 5xx, never a panic.
//!
//! Bounded: a fixed number of proptest cases per target (well under a minute on 2 cores), plus
//! every file of `tests/fuzz_corpus/http/{completions,chat}/` replayed on each run (the bodies
//! of past defects among them). A failing case proptest finds is saved under
//! `tests/fuzz_corpus/regressions/` and replayed first on later runs: commit it.
mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use ferry_proto::internal;
use ferry_router::registry::Registration;
use ferry_router::state::AppState;
use ferry_router::RouterConfig;
use http_body_util::BodyExt;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestRunner};
use serde_json::{json, Map, Value};
use tower::ServiceExt;

use common::{start_worker, Scripted};

/// Cases per generated target.
const CASES: u32 = 192;
const ROUTES: [&str; 2] = ["/v1/completions", "/v1/chat/completions"];

fn corpus(dir: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz_corpus/http")
        .join(dir)
}

fn config(name: &'static str) -> Config {
    Config {
        cases: CASES,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(name))),
        ..Config::default()
    }
}

/// A router state with a scripted decode worker registered (heartbeats never expire here).
fn served(rt: &tokio::runtime::Runtime) -> Arc<AppState> {
    rt.block_on(async {
        let state = AppState::load(&RouterConfig {
            page_size: 4,
            heartbeat_timeout_ms: 3_600_000,
            ..RouterConfig::ephemeral()
        })
        .await
        .expect("the embedded model loads");
        let addr = start_worker(Scripted::streaming(vec![17, 18])).await;
        let registration = Registration::try_from(internal::RegisterRequest {
            worker_id: "d0".into(),
            role: internal::WorkerRole::Decode as i32,
            grpc_address: addr,
            page_size: 4,
            total_blocks: 256,
            cached_block_hashes: vec![],
            last_event_id: 0,
            instance_id: 1,
            transports: vec![],
        })
        .expect("a valid registration");
        state
            .registry
            .register(registration, Instant::now())
            .expect("registers");
        state
    })
}

/// Posts `body` to `route`; fails on a 5xx, or on a 4xx without an OpenAI-shaped error.
async fn check(state: &Arc<AppState>, route: &str, body: Vec<u8>) -> Result<u16, String> {
    let shown = String::from_utf8_lossy(&body)
        .chars()
        .take(300)
        .collect::<String>();
    let request = axum::http::Request::builder()
        .method("POST")
        .uri(route)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .map_err(|e| e.to_string())?;
    let response = ferry_router::http::app(state.clone())
        .oneshot(request)
        .await
        .map_err(|e| format!("{e:?}"))?;
    let status = response.status().as_u16();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("{route} {shown}: body failed: {e}"))?
        .to_bytes();
    if status >= 500 {
        return Err(format!(
            "{route} {shown}: {status} {}",
            String::from_utf8_lossy(&bytes)
        ));
    }
    if status >= 400 {
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| format!("{route} {shown}: {status} body is not JSON: {e}"))?;
        let error = &v["error"];
        if !(error["message"].is_string() && error["type"].is_string()) {
            return Err(format!("{route} {shown}: {status} not OpenAI-shaped: {v}"));
        }
    }
    Ok(status)
}

/// Numbers at the edges: the f32 and integer limits, NaN-like extremes JSON allows.
fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        prop::sample::select(vec![
            json!(0),
            json!(1),
            json!(-1),
            json!(16),
            json!(1024),
            json!(1e39),
            json!(-1e39),
            json!(1e-50),
            json!(3.4028235e38),
            json!(f64::MAX),
            json!(f64::MIN_POSITIVE),
            json!(0.5),
            json!(u32::MAX),
            json!(i64::MIN),
        ]),
    ]
}

/// Short text with special-token text, unicode and JSON-significant characters mixed in.
fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        prop::sample::select(vec![
            "<|bos|>",
            "<|eos|>",
            "<|user|>",
            "<|assistant|>",
            "<|end|>",
            "hello",
            " ",
            "\n",
            "\u{E000}0\u{E001}",
            "é",
            "🙂",
            "\\",
            "\"",
            "\u{0}",
        ])
        .prop_map(str::to_string),
        any::<char>().prop_map(String::from),
    ];
    prop::collection::vec(piece, 0..12).prop_map(|v| v.concat())
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "type",
            "text",
            "role",
            "content",
            "include_usage",
            "x"
        ])
        .prop_map(str::to_string),
        text(),
    ]
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        number(),
        text().prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::vec((key(), inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

fn prompt() -> impl Strategy<Value = Value> {
    prop_oneof![
        text().prop_map(Value::from),
        prop::collection::vec(0u32..2100, 0..40).prop_map(Value::from),
        (0u32..2048, 1000usize..1100).prop_map(|(t, n)| Value::from(vec![t; n])),
        prop::collection::vec(text(), 0..3).prop_map(Value::from),
        prop::collection::vec(prop::collection::vec(0u32..2048, 0..5), 0..3).prop_map(Value::from),
        any_json(),
    ]
}

fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        prop::sample::select(vec!["system", "user", "assistant", "tool", "wizard", ""])
            .prop_map(Value::from),
        text().prop_map(Value::from),
        any_json(),
    ];
    let content = prop_oneof![
        text().prop_map(Value::from),
        Just(Value::Null),
        prop::collection::vec(
            (prop::sample::select(vec!["text", "image_url"]), text())
                .prop_map(|(kind, t)| json!({"type": kind, "text": t})),
            0..3
        )
        .prop_map(Value::from),
        any_json(),
    ];
    (role, content).prop_map(|(role, content)| json!({"role": role, "content": content}))
}

/// A body with any subset of the real fields, each valid-looking or not.
fn body(chat: bool) -> impl Strategy<Value = Value> {
    let fields = (
        prop::option::of(prop_oneof![number(), any_json()]),
        prop::option::of(prop_oneof![number(), any_json()]),
        prop::option::of(number()),
        prop::option::of(number()),
        prop::option::of(number()),
        prop::option::of(number()),
        prop::option::of(prop_oneof![text().prop_map(Value::from), any_json()]),
        prop::option::of(prop_oneof![Just(json!(1)), number()]),
        prop::option::of(any_json()),
        prop::option::of(prop_oneof![
            Just(json!("")),
            Just(json!("tiny-k3")),
            any_json()
        ]),
    );
    let input = if chat {
        prop::collection::vec(message(), 0..4)
            .prop_map(Value::from)
            .boxed()
    } else {
        prompt().boxed()
    };
    (input, fields, any::<bool>()).prop_map(move |(input, f, stream)| {
        let mut m = Map::new();
        m.insert(if chat { "messages" } else { "prompt" }.into(), input);
        let named = [
            ("max_tokens", f.0),
            ("temperature", f.1),
            ("top_p", f.2),
            ("top_k", f.3),
            ("min_p", f.4),
            ("seed", f.5),
            ("stop", f.6),
            ("n", f.7),
            ("stream_options", f.8),
            ("model", f.9),
        ];
        for (k, v) in named {
            if let Some(v) = v {
                m.insert(k.into(), v);
            }
        }
        m.insert("stream".into(), Value::from(stream));
        Value::Object(m)
    })
}

fn run<S: Strategy>(strategy: S, name: &'static str, test: impl Fn(S::Value) -> Result<(), String>)
where
    S::Value: std::fmt::Debug,
{
    let mut runner = TestRunner::new(config(name));
    let result = runner.run(&strategy, |v| test(v).map_err(TestCaseError::fail));
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn arbitrary_bytes_are_refused_cleanly() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let state = served(&rt);
    run(
        (
            prop::sample::select(ROUTES.to_vec()),
            prop::collection::vec(any::<u8>(), 0..256),
        ),
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fuzz_corpus/regressions/http_bytes.txt"
        ),
        |(route, bytes)| rt.block_on(check(&state, route, bytes)).map(drop),
    );
}

#[test]
fn arbitrary_completion_bodies_succeed_or_are_4xx() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let state = served(&rt);
    run(
        body(false),
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fuzz_corpus/regressions/http_completions.txt"
        ),
        |b| {
            rt.block_on(check(&state, ROUTES[0], b.to_string().into_bytes()))
                .map(drop)
        },
    );
}

#[test]
fn arbitrary_chat_bodies_succeed_or_are_4xx() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let state = served(&rt);
    run(
        body(true),
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fuzz_corpus/regressions/http_chat.txt"
        ),
        |b| {
            rt.block_on(check(&state, ROUTES[1], b.to_string().into_bytes()))
                .map(drop)
        },
    );
}

/// Each corpus file, replayed; a file named `ok-*` must succeed, `bad-*` must be a 4xx.
#[test]
fn the_corpus_replays() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let state = served(&rt);
    let mut replayed = 0;
    for (dir, route) in [("completions", ROUTES[0]), ("chat", ROUTES[1])] {
        let mut files: Vec<_> = std::fs::read_dir(corpus(dir))
            .expect("the corpus directory")
            .map(|e| e.expect("a corpus entry").path())
            .collect();
        files.sort();
        for file in files {
            let body = std::fs::read(&file).expect("a corpus file");
            let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
            let name = name.unwrap_or_default();
            let status = rt
                .block_on(check(&state, route, body))
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            if name.starts_with("ok-") {
                assert_eq!(status, 200, "{}", file.display());
            } else if name.starts_with("bad-") {
                assert!((400..500).contains(&status), "{}: {status}", file.display());
            }
            replayed += 1;
        }
    }
    assert!(replayed >= 10, "the corpus went missing: {replayed} files");
}
