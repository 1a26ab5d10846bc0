//! Fuzzing the gRPC front door's input: arbitrary bytes (and mutated encodings of real
//! requests) → prost decode of `GenerateRequest` / `TokenizeRequest` → the router's
//! validation. Every input must decode-fail or come out `Ok` or INVALID_ARGUMENT; never a
//! panic, never another code. And through a real router on 127.0.0.1:0 with a raw-bytes
//! client, undecodable requests are INVALID_ARGUMENT naming the message type (tonic's prost
//! codec said INTERNAL).
//!
//! Bounded: a fixed number of proptest cases per target, plus every file of
//! `tests/fuzz_corpus/proto/{generate,tokenize}/` (hex text; `ok-*` must validate, `bad-*`
//! must be refused) replayed on each run, in process and against the real server. Failing
//! cases proptest finds are saved under `tests/fuzz_corpus/regressions/`: commit them.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_proto::v1;
use ferry_router::state::AppState;
use ferry_router::validate::GenerateParams;
use ferry_router::{RequestError, Router, RouterConfig};
use futures::future::BoxFuture;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestRunner};
use prost::bytes::{Buf, BufMut};
use prost::Message;
use tokio_util::sync::CancellationToken;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::{Code, Status};

const CASES: u32 = 256;

fn corpus(dir: &str) -> Vec<(String, Vec<u8>)> {
    let dir: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz_corpus/proto")
        .join(dir);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a corpus entry").path())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|f| {
            let text = std::fs::read_to_string(&f).expect("a corpus file");
            let hex: String = text.split_whitespace().collect();
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                .collect();
            let name = f
                .file_stem()
                .expect("a name")
                .to_string_lossy()
                .into_owned();
            (name, bytes)
        })
        .collect()
}

fn runner(name: &'static str) -> TestRunner {
    TestRunner::new(Config {
        cases: CASES,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(name))),
        ..Config::default()
    })
}

async fn state() -> Arc<AppState> {
    AppState::load(&RouterConfig::ephemeral())
        .await
        .expect("the embedded model loads")
}

/// Decode + validate one `GenerateRequest`: `Ok(true)` valid, `Ok(false)` refused (a decode
/// error or INVALID_ARGUMENT), `Err` anything else.
async fn generate(state: &AppState, bytes: &[u8]) -> Result<bool, String> {
    let Ok(request) = v1::GenerateRequest::decode(bytes) else {
        return Ok(false);
    };
    // A `response_format` whose schema is not JSON is refused before validation.
    let Ok(params) = GenerateParams::try_from(request) else {
        return Ok(false);
    };
    match state.validator.validate(params).await {
        Ok(_) => Ok(true),
        Err(e @ RequestError::Invalid(_)) if e.code() == Code::InvalidArgument => Ok(false),
        Err(e) => Err(format!("{:02x?}: {e} ({:?})", bytes, e.code())),
    }
}

/// The same for `TokenizeRequest`.
async fn tokenize(state: &AppState, bytes: &[u8]) -> Result<bool, String> {
    let Ok(r) = v1::TokenizeRequest::decode(bytes) else {
        return Ok(false);
    };
    match state
        .validator
        .tokenize(&r.model, r.text, r.add_special_tokens)
        .await
    {
        Ok(_) => Ok(true),
        Err(e) if e.code() == Code::InvalidArgument => Ok(false),
        Err(e) => Err(format!("{:02x?}: {e} ({:?})", bytes, e.code())),
    }
}

/// Real-looking requests, encoded, then with some bytes overwritten.
fn mutated_generate() -> impl Strategy<Value = Vec<u8>> {
    let input = prop_oneof![
        ".{0,40}".prop_map(v1::generate_request::Input::Text),
        prop::collection::vec(0u32..2100, 0..20)
            .prop_map(|ids| v1::generate_request::Input::Tokens(v1::TokenIds { ids })),
        prop::collection::vec(("(user|system|assistant|.{0,8})", ".{0,20}"), 0..3).prop_map(|m| {
            v1::generate_request::Input::Chat(v1::ChatMessages {
                messages: m
                    .into_iter()
                    .map(|(role, content)| v1::ChatMessage {
                        role,
                        content,
                        ..Default::default()
                    })
                    .collect(),
            })
        }),
    ];
    let f = prop_oneof![any::<f32>(), Just(0.0f32), Just(1.0), Just(f32::INFINITY)];
    let sampling = (
        prop::option::of(f.clone()),
        prop::option::of(any::<u32>()),
        prop::option::of(f.clone()),
        prop::option::of(f.clone()),
        prop::option::of(any::<u64>()),
        prop::option::of(f.clone()),
        prop::option::of(f.clone()),
        prop::option::of(f.clone()),
        prop::collection::hash_map(0u32..4096, f, 0..4),
    )
        .prop_map(
            |(
                temperature,
                top_k,
                top_p,
                min_p,
                seed,
                presence_penalty,
                frequency_penalty,
                repetition_penalty,
                logit_bias,
            )| v1::SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                seed,
                presence_penalty,
                frequency_penalty,
                repetition_penalty,
                logit_bias,
            },
        );
    let stop = (
        any::<u32>(),
        prop::collection::vec(".{0,4}", 0..6),
        any::<bool>(),
        any::<u32>(),
        prop::collection::vec(0u32..4096, 0..3),
    )
        .prop_map(
            |(max_tokens, stop, ignore_eos, min_tokens, stop_token_ids)| v1::StopConditions {
                max_tokens: max_tokens % 2048,
                stop,
                ignore_eos,
                min_tokens: min_tokens % 2048,
                stop_token_ids,
            },
        );
    let tools = prop::collection::vec(
        ("(f|g|a b|.{0,4})", r#"(|\{\}|\{"type":"object"\}|.{0,6})"#).prop_map(
            |(name, parameters)| v1::Tool {
                name,
                description: String::new(),
                parameters,
            },
        ),
        0..3,
    );
    let tool_choice = prop_oneof![
        (0i32..5).prop_map(v1::tool_choice::Choice::Mode),
        "(f|g|.{0,3})".prop_map(v1::tool_choice::Choice::Function),
    ]
    .prop_map(|c| v1::ToolChoice { choice: Some(c) });
    let request = (
        prop::option::of(input),
        prop::option::of(sampling),
        prop::option::of(stop),
        "(tiny-k3)?",
        prop::option::of(0u32..20),
        tools,
        prop::option::of(tool_choice),
    )
        .prop_map(|(input, sampling, stop, model, n, tools, tool_choice)| {
            v1::GenerateRequest {
                model,
                input,
                sampling,
                stop,
                request_id: String::new(),
                speculative: None,
                logprobs: None,
                response_format: None,
                n,
                tools,
                tool_choice,
                prompt_logprobs: None,
            }
        });
    (
        request,
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
    )
        .prop_map(|(r, edits)| {
            let mut bytes = r.encode_to_vec();
            if !bytes.is_empty() {
                for (at, b) in edits {
                    let i = at.index(bytes.len());
                    bytes[i] = b;
                }
            }
            bytes
        })
}

fn check_all(
    rt: &tokio::runtime::Runtime,
    state: &AppState,
    name: &'static str,
    strategy: impl Strategy<Value = Vec<u8>>,
    target: Target,
) {
    let result = runner(name).run(&strategy, |bytes| {
        rt.block_on(target(state, &bytes))
            .map(drop)
            .map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Decode + validate, as a plain function of the bytes.
type Target = for<'a> fn(&'a AppState, &'a [u8]) -> BoxFuture<'a, Result<bool, String>>;

fn generate_boxed<'a>(s: &'a AppState, b: &'a [u8]) -> BoxFuture<'a, Result<bool, String>> {
    Box::pin(generate(s, b))
}

fn tokenize_boxed<'a>(s: &'a AppState, b: &'a [u8]) -> BoxFuture<'a, Result<bool, String>> {
    Box::pin(tokenize(s, b))
}

#[test]
fn arbitrary_bytes_decode_and_validate_without_panics() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let state = rt.block_on(state());
    let bytes = prop::collection::vec(any::<u8>(), 0..256);
    check_all(
        &rt,
        &state,
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fuzz_corpus/regressions/proto_generate.txt"
        ),
        bytes.clone(),
        generate_boxed,
    );
    check_all(
        &rt,
        &state,
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fuzz_corpus/regressions/proto_tokenize.txt"
        ),
        bytes,
        tokenize_boxed,
    );
}

#[test]
fn mutated_real_requests_validate_or_are_invalid_argument() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let state = rt.block_on(state());
    check_all(
        &rt,
        &state,
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fuzz_corpus/regressions/proto_mutated.txt"
        ),
        mutated_generate(),
        generate_boxed,
    );
}

#[test]
fn the_corpus_replays_in_process() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let state = rt.block_on(state());
    let mut replayed = 0;
    for (dir, target) in [
        ("generate", generate_boxed as Target),
        ("tokenize", tokenize_boxed as Target),
    ] {
        for (name, bytes) in corpus(dir) {
            let valid = rt
                .block_on(target(&state, &bytes))
                .unwrap_or_else(|e| panic!("{dir}/{name}: {e}"));
            assert_eq!(valid, name.starts_with("ok-"), "{dir}/{name}");
            replayed += 1;
        }
    }
    assert!(replayed >= 15, "the corpus went missing: {replayed} files");
}

/// Sends request bytes as they are and hands response bytes back as they came.
#[derive(Debug, Clone, Copy, Default)]
struct Raw;

impl Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.put_slice(&item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        Ok(Some(buf.copy_to_bytes(buf.remaining()).to_vec()))
    }
}

/// The status a real server answers `bytes` on `path` with (OK when it answered a message).
async fn send_raw(channel: &Channel, path: &'static str, bytes: Vec<u8>) -> Status {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.expect("ready");
    let path = PathAndQuery::from_static(path);
    let request = tonic::Request::new(bytes);
    if path.path().ends_with("/Generate") {
        match grpc.server_streaming(request, path, Raw).await {
            Err(status) => status,
            Ok(response) => match response.into_inner().message().await {
                Err(status) => status,
                Ok(_) => Status::ok(""),
            },
        }
    } else {
        match grpc.unary(request, path, Raw).await {
            Err(status) => status,
            Ok(_) => Status::ok(""),
        }
    }
}

#[tokio::test]
async fn undecodable_requests_to_a_real_server_are_invalid_argument() {
    let bound = Router::load(RouterConfig::ephemeral())
        .await
        .expect("load")
        .bind()
        .await
        .expect("bind");
    let endpoint = format!("http://{}", bound.grpc_addr());
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(bound.run(shutdown.clone()));
    let channel = Channel::from_shared(endpoint)
        .expect("uri")
        .connect()
        .await
        .expect("connect");

    for (path, message) in [
        ("/ferry.v1.Inference/Tokenize", "ferry.v1.TokenizeRequest"),
        ("/ferry.v1.Inference/Generate", "ferry.v1.GenerateRequest"),
    ] {
        for garbage in [vec![0xff, 0xff, 0xff], vec![0x12, 0x02, 0xff, 0xfe]] {
            let status = send_raw(&channel, path, garbage.clone()).await;
            assert_eq!(
                status.code(),
                Code::InvalidArgument,
                "{path} {garbage:02x?}: {status:?}"
            );
            assert!(status.message().contains(message), "{status:?}");
        }
    }
    // The corpus too: every `bad-*` is INVALID_ARGUMENT, decodable or not; `ok-*` Tokenize
    // answers (`ok-*` Generate needs a decode worker, so it is not sent here).
    for (name, bytes) in corpus("tokenize") {
        let status = send_raw(&channel, "/ferry.v1.Inference/Tokenize", bytes).await;
        let want = if name.starts_with("ok-") {
            Code::Ok
        } else {
            Code::InvalidArgument
        };
        assert_eq!(status.code(), want, "tokenize/{name}: {status:?}");
    }
    for (name, bytes) in corpus("generate") {
        if name.starts_with("bad-") {
            let status = send_raw(&channel, "/ferry.v1.Inference/Generate", bytes).await;
            assert_eq!(
                status.code(),
                Code::InvalidArgument,
                "generate/{name}: {status:?}"
            );
        }
    }
    shutdown.cancel();
    running.await.expect("joined").expect("clean shutdown");
}
