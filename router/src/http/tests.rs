//! The HTTP API through `app().oneshot(..)`: every validation error is a 400 naming the
//! field, in OpenAI's error shape; `/v1/models`; `/health` without workers.
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::app;
use crate::config::RouterConfig;
use crate::state::AppState;

async fn state() -> Arc<AppState> {
    AppState::load(&RouterConfig::ephemeral())
        .await
        .expect("the embedded model loads")
}

async fn send(state: &Arc<AppState>, method: &str, uri: &str, body: &str) -> (StatusCode, Value) {
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    let response = app(state.clone())
        .oneshot(request)
        .await
        .expect("infallible");
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{uri}: body is not JSON ({e}): {bytes:?}"));
    (status, value)
}

/// Asserts an OpenAI-shaped 400 whose `param` (or message) names `field`.
fn assert_invalid(case: &str, (status, body): (StatusCode, Value), field: &str) {
    assert_eq!(status, StatusCode::BAD_REQUEST, "{case}: {body}");
    let error = &body["error"];
    assert_eq!(error["type"], "invalid_request_error", "{case}: {body}");
    let message = error["message"].as_str().unwrap_or_default();
    let named = error["param"] == field || message.contains(&format!("`{field}`"));
    assert!(named, "{case}: `{field}` not named in {body}");
}

#[tokio::test]
async fn completion_validation_errors_are_400_naming_the_field() {
    let s = state().await;
    let long_prompt: Vec<u32> = vec![5; 1100];
    let cases: Vec<(&str, Value, &str)> = vec![
        ("empty prompt", json!({"prompt": ""}), "prompt"),
        ("empty token prompt", json!({"prompt": []}), "prompt"),
        (
            "max_tokens 0",
            json!({"prompt": "hi", "max_tokens": 0}),
            "max_tokens",
        ),
        (
            "max_tokens negative",
            json!({"prompt": "hi", "max_tokens": -3}),
            "max_tokens",
        ),
        (
            "max_tokens beyond context",
            json!({"prompt": "hi", "max_tokens": 5000}),
            "max_tokens",
        ),
        (
            "temperature < 0",
            json!({"prompt": "hi", "temperature": -0.5}),
            "temperature",
        ),
        ("top_p > 1", json!({"prompt": "hi", "top_p": 1.5}), "top_p"),
        ("top_p 0", json!({"prompt": "hi", "top_p": 0}), "top_p"),
        ("min_p > 1", json!({"prompt": "hi", "min_p": 2}), "min_p"),
        ("top_k < 0", json!({"prompt": "hi", "top_k": -1}), "top_k"),
        (
            "unknown model",
            json!({"prompt": "hi", "model": "gpt-4"}),
            "model",
        ),
        (
            "too many stops",
            json!({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}),
            "stop",
        ),
        ("empty stop", json!({"prompt": "hi", "stop": ""}), "stop"),
        ("n above the cap", json!({"prompt": "hi", "n": 17}), "n"),
        ("n 0", json!({"prompt": "hi", "n": 0}), "n"),
        ("n negative", json!({"prompt": "hi", "n": -1}), "n"),
        ("prompt batch", json!({"prompt": ["a", "b"]}), "prompt"),
        (
            "token out of vocab",
            json!({"prompt": [1, 99999]}),
            "prompt",
        ),
        (
            "wrong type max_tokens",
            json!({"prompt": "hi", "max_tokens": "ten"}),
            "max_tokens",
        ),
        (
            "wrong type temperature",
            json!({"prompt": "hi", "temperature": "hot"}),
            "temperature",
        ),
        ("wrong type prompt", json!({"prompt": 42}), "prompt"),
        ("missing prompt", json!({"max_tokens": 3}), "prompt"),
        (
            "wrong type stream",
            json!({"prompt": "hi", "stream": "yes"}),
            "stream",
        ),
        (
            "presence_penalty > 2",
            json!({"prompt": "hi", "presence_penalty": 2.5}),
            "presence_penalty",
        ),
        (
            "frequency_penalty < -2",
            json!({"prompt": "hi", "frequency_penalty": -2.5}),
            "frequency_penalty",
        ),
        (
            "repetition_penalty 0",
            json!({"prompt": "hi", "repetition_penalty": 0}),
            "repetition_penalty",
        ),
        (
            "logit_bias token out of vocab",
            json!({"prompt": "hi", "logit_bias": {"99999": 1}}),
            "logit_bias",
        ),
        (
            "logit_bias key not a token id",
            json!({"prompt": "hi", "logit_bias": {"hello": 1}}),
            "logit_bias",
        ),
        (
            "logit_bias > 100",
            json!({"prompt": "hi", "logit_bias": {"5": 101}}),
            "logit_bias",
        ),
        (
            "wrong type logit_bias",
            json!({"prompt": "hi", "logit_bias": [5]}),
            "logit_bias",
        ),
        (
            "min_tokens > max_tokens",
            json!({"prompt": "hi", "max_tokens": 4, "min_tokens": 5}),
            "min_tokens",
        ),
        (
            "stop_token_ids out of vocab",
            json!({"prompt": "hi", "stop_token_ids": [2, 99999]}),
            "stop_token_ids",
        ),
        (
            "logprobs > 5",
            json!({"prompt": "hi", "logprobs": 6}),
            "logprobs",
        ),
        (
            "logprobs < 0",
            json!({"prompt": "hi", "logprobs": -1}),
            "logprobs",
        ),
        (
            "top_logprobs is not a completions field",
            json!({"prompt": "hi", "logprobs": 2, "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "wrong type stop_token_ids",
            json!({"prompt": "hi", "stop_token_ids": [-1]}),
            "stop_token_ids[0]",
        ),
    ];
    for (case, body, field) in cases {
        let got = send(&s, "POST", "/v1/completions", &body.to_string()).await;
        assert_invalid(case, got, field);
    }

    let (status, body) = send(
        &s,
        "POST",
        "/v1/completions",
        &json!({"prompt": long_prompt, "max_tokens": 1}).to_string(),
    )
    .await;
    assert_invalid("prompt beyond context", (status, body.clone()), "prompt");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("1100") && message.contains("1024"),
        "{message}"
    );
}

#[tokio::test]
async fn malformed_json_is_an_openai_shaped_400() {
    let s = state().await;
    for (case, raw) in [
        ("truncated", r#"{"prompt": "hi""#),
        ("not json", "prompt=hi"),
        ("empty body", ""),
        ("trailing garbage", r#"{"prompt": "hi"} x"#),
        ("array at top level", r#"["hi"]"#),
    ] {
        let (status, body) = send(&s, "POST", "/v1/completions", raw).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{case}: {body}");
        assert_eq!(
            body["error"]["type"], "invalid_request_error",
            "{case}: {body}"
        );
        assert!(body["error"]["message"].is_string(), "{case}: {body}");
    }
}

#[tokio::test]
async fn chat_validation_errors_are_400_naming_the_field() {
    let s = state().await;
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, Value, &str)> = vec![
        ("empty messages", json!({"messages": []}), "messages"),
        ("missing messages", json!({"max_tokens": 3}), "messages"),
        (
            "unknown role",
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            "messages",
        ),
        (
            "image part",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "messages",
        ),
        (
            "max_tokens 0",
            json!({"messages": user, "max_tokens": 0}),
            "max_tokens",
        ),
        (
            "max_completion_tokens 0",
            json!({"messages": user, "max_completion_tokens": 0}),
            "max_tokens",
        ),
        ("n above the cap", json!({"messages": user, "n": 17}), "n"),
        (
            "max_tokens beyond context",
            json!({"messages": user, "max_tokens": 4096}),
            "max_tokens",
        ),
        (
            "temperature < 0",
            json!({"messages": user, "temperature": -1}),
            "temperature",
        ),
        (
            "top_p > 1",
            json!({"messages": user, "top_p": 1.01}),
            "top_p",
        ),
        (
            "unknown model",
            json!({"messages": user, "model": "other"}),
            "model",
        ),
        ("wrong type messages", json!({"messages": "hi"}), "messages"),
        (
            "top_logprobs > 20",
            json!({"messages": user, "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            "top_logprobs without logprobs",
            json!({"messages": user, "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "wrong type logprobs",
            json!({"messages": user, "logprobs": 3}),
            "logprobs",
        ),
    ];
    for (case, body, field) in cases {
        let got = send(&s, "POST", "/v1/chat/completions", &body.to_string()).await;
        assert_invalid(case, got, field);
    }
    let (status, body) = send(&s, "POST", "/v1/chat/completions", "{").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
}

#[tokio::test]
async fn speculative_must_be_a_bool() {
    let s = state().await;
    let user = json!([{"role": "user", "content": "hi"}]);
    for (uri, mut body) in [
        ("/v1/completions", json!({"prompt": "hi"})),
        ("/v1/chat/completions", json!({"messages": user})),
    ] {
        for bad in [json!("yes"), json!(1), json!([true])] {
            body["speculative"] = bad.clone();
            let (status, got) = send(&s, "POST", uri, &body.to_string()).await;
            let case = format!("{uri} speculative={bad}");
            assert_eq!(status, StatusCode::BAD_REQUEST, "{case}: {got}");
            assert_eq!(got["error"]["param"], "speculative", "{case}: {got}");
            assert_eq!(got["error"]["code"], "invalid_type", "{case}: {got}");
            let message = got["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains("`speculative`"), "{case}: {message}");
        }
        // A bool (or null) passes the body checks: without workers the request is a 503.
        for ok in [json!(false), json!(true), json!(null)] {
            body["speculative"] = ok.clone();
            let (status, got) = send(&s, "POST", uri, &body.to_string()).await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{uri} {ok}: {got}");
        }
    }
}

/// `response_format` on both endpoints: `text`, `json_object` and a valid `json_schema` pass
/// validation (without workers the request is then a 503); a schema the grammar engine
/// refuses, a malformed envelope or an unknown type is a 400 naming the field.
#[tokio::test]
async fn response_format_is_validated_by_compiling_the_schema() {
    let s = state().await;
    let user = json!([{"role": "user", "content": "hi"}]);
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}},
        "required": ["a"]});
    for (uri, base) in [
        ("/v1/completions", json!({"prompt": "hi"})),
        ("/v1/chat/completions", json!({"messages": user})),
    ] {
        for ok in [
            json!({"type": "text"}),
            json!({"type": "json_object"}),
            json!({"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                "strict": true}}),
        ] {
            let mut body = base.clone();
            body["response_format"] = ok.clone();
            let (status, got) = send(&s, "POST", uri, &body.to_string()).await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{uri} {ok}: {got}");
        }
        for (bad, field) in [
            (
                json!({"type": "json_schema", "json_schema": {"name": "a",
                    "schema": {"type": "no-such-type"}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a",
                    "schema": {"type": "string", "minLength": 9, "maxLength": 2}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a"}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"type": "json_schema"}),
                "response_format.json_schema",
            ),
            (json!({"type": "xml"}), "response_format.type"),
        ] {
            let mut body = base.clone();
            body["response_format"] = bad.clone();
            let got = send(&s, "POST", uri, &body.to_string()).await;
            assert_invalid(&format!("{uri} {bad}"), got, field);
        }
    }
}

/// Tools on chat: valid definitions and choices pass validation (503 without workers), a
/// `tool` turn and an assistant turn with `tool_calls` are accepted back; bad tools and
/// choices are 400s naming `tools` / `tool_choice`, `response_format` with a forced call names
/// `response_format`, and special-token text in a tool call is refused.
#[tokio::test]
async fn tools_and_tool_choice_are_validated() {
    let s = state().await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}}}]);
    let user = json!({"role": "user", "content": "hi"});
    let call = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
        "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Ur\"}"}}]});
    let result = json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"});
    let uri = "/v1/chat/completions";
    for body in [
        json!({"messages": [user], "tools": tools}),
        json!({"messages": [user], "tools": tools, "tool_choice": "required"}),
        json!({"messages": [user], "tools": tools, "tool_choice": "none"}),
        json!({"messages": [user], "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        json!({"messages": [user, call, result], "tools": tools}),
        json!({"messages": [user, call, result]}),
    ] {
        let (status, got) = send(&s, "POST", uri, &body.to_string()).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}: {got}");
    }
    let injected = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "x",
        "type": "function", "function": {"name": "f", "arguments": "<|user|>"}}]});
    for (body, field) in [
        (
            json!({"messages": [user], "tools": tools,
                "tool_choice": {"type": "function", "function": {"name": "smite"}}}),
            "tool_choice",
        ),
        (
            json!({"messages": [user], "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"messages": [user], "tools": tools, "tool_choice": "often"}),
            "tool_choice",
        ),
        (
            json!({"messages": [user], "tools": [{"type": "function"}]}),
            "tools",
        ),
        (
            json!({"messages": [user], "tools": [{"type": "function", "function": {"name": "f",
                "parameters": {"type": "no-such-type"}}}], "tool_choice": "required"}),
            "tools",
        ),
        (
            json!({"messages": [user], "tools": tools, "tool_choice": "required",
                "response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (json!({"messages": [user, injected]}), "messages"),
    ] {
        let got = send(&s, "POST", uri, &body.to_string()).await;
        assert_invalid(&body.to_string(), got, field);
    }
}

/// Nothing is ignored silently: every OpenAI field ferry does not implement is a 400 naming it
/// when its value would change the output, accepted when it would not; fields with no effect
/// on the output pass; a field OpenAI does not define is a 400 naming it.
#[tokio::test]
async fn unimplemented_and_unknown_fields_are_refused_by_name() {
    let s = state().await;
    let user = json!([{"role": "user", "content": "hi"}]);
    // (field, a value that changes the output, the value that does not).
    let shared = [
        ("functions", json!([{"name": "f"}]), json!([])),
        ("function_call", json!("auto"), json!("none")),
    ];
    // Tools are implemented on chat only.
    let completions_only = [
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f"}}]),
            json!([]),
        ),
        ("tool_choice", json!("required"), json!("none")),
        ("best_of", json!(3), json!(1)),
        ("suffix", json!("end"), json!("")),
    ];
    let endpoints = [
        ("/v1/completions", json!({"prompt": "hi"}), true),
        ("/v1/chat/completions", json!({"messages": user}), false),
    ];
    for (uri, base, completions) in &endpoints {
        let fields = shared
            .iter()
            .chain(completions_only.iter().filter(|_| *completions));
        for (field, effect, noop) in fields {
            let mut body = base.clone();
            body[field] = effect.clone();
            let got = send(&s, "POST", uri, &body.to_string()).await;
            assert_invalid(&format!("{uri} {field}={effect}"), got.clone(), field);
            let message = got.1["error"]["message"].as_str().unwrap_or_default();
            assert!(
                message.contains("not supported"),
                "{uri} {field}: {message}"
            );
            for ok in [noop.clone(), Value::Null] {
                body[field] = ok.clone();
                let (status, got) = send(&s, "POST", uri, &body.to_string()).await;
                assert_eq!(
                    status,
                    StatusCode::SERVICE_UNAVAILABLE,
                    "{uri} {field}={ok}: {got}"
                );
            }
        }
        // Fields with no effect on the output pass (a 503 here: no workers).
        for field in crate::http::openai::NO_EFFECT {
            let mut body = base.clone();
            body[*field] = json!("x");
            let (status, got) = send(&s, "POST", uri, &body.to_string()).await;
            assert_eq!(
                status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{uri} {field}: {got}"
            );
        }
        // A misspelt or invented field is refused by name, not dropped.
        for field in ["temprature", "max_new_tokens"] {
            let mut body = base.clone();
            body[field] = json!(1);
            let (status, got) = send(&s, "POST", uri, &body.to_string()).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{uri} {field}: {got}");
            assert_eq!(got["error"]["param"], *field, "{got}");
            assert_eq!(got["error"]["code"], "unknown_parameter", "{got}");
        }
    }
    // The completions-only fields are not fields of the chat API.
    let body = json!({"messages": user, "echo": false});
    let (status, got) = send(&s, "POST", "/v1/chat/completions", &body.to_string()).await;
    assert_eq!(
        (status, &got["error"]["param"]),
        (StatusCode::BAD_REQUEST, &json!("echo"))
    );
}

#[tokio::test]
async fn a_valid_request_without_workers_is_503() {
    let s = state().await;
    for (uri, body) in [
        (
            "/v1/completions",
            json!({"prompt": "hello", "model": "tiny-k3"}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}),
        ),
        ("/v1/responses", json!({"input": "hi", "stream": true})),
    ] {
        let (status, body) = send(&s, "POST", uri, &body.to_string()).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{uri}: {body}");
        assert_eq!(body["error"]["code"], "no_decode_worker", "{body}");
    }
}

#[tokio::test]
async fn models_health_and_unknown_routes() {
    let s = state().await;
    let (status, body) = send(&s, "GET", "/v1/models", "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["object"], "list");
    assert_eq!(body["data"][0]["id"], "tiny-k3");
    assert_eq!(body["data"][0]["object"], "model");
    assert_eq!(body["data"][0]["owned_by"], "ferry");
    assert!(body["data"][0]["created"].is_u64());

    let (status, body) = send(&s, "GET", "/health", "").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no decode worker")),
        "{body}"
    );

    let (status, body) = send(&s, "GET", "/v2/nothing", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert_eq!(body["error"]["code"], "not_found");
}

/// vLLM's `/tokenize` and `/detokenize`: the served tokenizer's ids and text, with its special
/// tokens and chat template, and clear 400s for what cannot be answered.
#[tokio::test]
async fn tokenize_and_detokenize_use_the_served_tokenizer() {
    use ferry_modelcard::tokenizer::ChatMessage;
    let s = state().await;
    let tok = s.validator.tokenizer().tokenizer().clone();
    let text = "In the beginning God created the heaven and the earth.";

    let (status, got) = send(
        &s,
        "POST",
        "/tokenize",
        &json!({"prompt": text}).to_string(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{got}");
    let want = tok.encode_text(text, true).expect("encode");
    assert_eq!(got["tokens"], json!(want));
    assert_eq!(got["count"], want.len());
    assert_eq!(got["max_model_len"], s.model.context_length);
    let body = json!({"prompt": text, "add_special_tokens": false, "model": s.model.name});
    let (_, plain) = send(&s, "POST", "/tokenize", &body.to_string()).await;
    let plain_ids = tok.encode_text(text, false).expect("encode");
    assert_eq!(plain["tokens"], json!(plain_ids));
    assert_eq!(
        want.len(),
        plain_ids.len() + 1,
        "the BOS token is the difference"
    );

    // Chat: the template's rendering, with or without the generation prompt.
    let messages = json!([{"role": "user", "content": "Who made the heaven?"}]);
    let turns = [ChatMessage::new("user", "Who made the heaven?")];
    for gen in [true, false] {
        let body = json!({"messages": messages, "add_generation_prompt": gen});
        let (status, got) = send(&s, "POST", "/tokenize", &body.to_string()).await;
        assert_eq!(status, StatusCode::OK, "{got}");
        assert_eq!(
            got["tokens"],
            json!(tok.encode_chat(&turns, gen).expect("chat"))
        );
    }

    // Detokenize gives the text back.
    let body = json!({"tokens": plain_ids});
    let (status, got) = send(&s, "POST", "/detokenize", &body.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{got}");
    assert_eq!(got["prompt"], text);

    // What cannot be answered is a 400 naming the field.
    let vocab = tok.vocab_size() as u64;
    let long = vec![5u32; s.model.context_length + 1];
    let cases: Vec<(&str, &str, Value, &str)> = vec![
        (
            "both",
            "/tokenize",
            json!({"prompt": "a", "messages": messages}),
            "messages",
        ),
        ("neither", "/tokenize", json!({}), "prompt"),
        (
            "other model",
            "/tokenize",
            json!({"prompt": "a", "model": "x"}),
            "model",
        ),
        (
            "unknown field",
            "/tokenize",
            json!({"prompt": "a", "text": "b"}),
            "text",
        ),
        (
            "image part",
            "/tokenize",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "messages",
        ),
        (
            "id past the vocabulary",
            "/detokenize",
            json!({"tokens": [1, vocab]}),
            "tokens",
        ),
        (
            "more ids than the context",
            "/detokenize",
            json!({"tokens": long}),
            "tokens",
        ),
        (
            "ids not a list",
            "/detokenize",
            json!({"tokens": "abc"}),
            "tokens",
        ),
    ];
    for (case, uri, body, field) in cases {
        let got = send(&s, "POST", uri, &body.to_string()).await;
        assert_invalid(case, got, field);
    }
}

/// With API keys on, `/tokenize` and `/detokenize` need one like `/v1/*`; `/health` does not.
#[tokio::test]
async fn tokenize_needs_an_api_key_when_keys_are_on() {
    let dir = tempfile::tempdir().expect("a directory for the keys file");
    let path = dir.path().join("keys.txt");
    std::fs::write(&path, "sk-ferry-test-0123456789abcdef name=t\n").expect("keys file");
    let config = RouterConfig {
        api_keys_file: Some(path),
        ..RouterConfig::ephemeral()
    };
    let s = AppState::load(&config)
        .await
        .expect("the embedded model loads");
    for (uri, body) in [
        ("/tokenize", json!({"prompt": "hi"})),
        ("/detokenize", json!({"tokens": [5]})),
    ] {
        let (status, got) = send(&s, "POST", uri, &body.to_string()).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{uri}: {got}");
        assert_eq!(got["error"]["code"], "invalid_api_key", "{uri}: {got}");
    }
    let (status, _) = send(&s, "GET", "/health", "").await;
    assert_ne!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn responses_validation_errors_are_400_naming_the_field() {
    let s = state().await;
    let item = |v: Value| json!({"input": [v]});
    let cases: Vec<(&str, Value, &str)> = vec![
        ("input missing", json!({"model": "tiny-k3"}), "input"),
        ("input empty list", json!({"input": []}), "input"),
        (
            "function call output without a call id",
            item(json!({"type": "function_call_output", "output": "x"})),
            "input",
        ),
        (
            "function call without a name",
            item(json!({"type": "function_call", "call_id": "c", "arguments": "{}"})),
            "input",
        ),
        (
            "a reasoning item",
            item(json!({"type": "reasoning", "summary": []})),
            "input",
        ),
        (
            "image part",
            item(json!({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]})),
            "input",
        ),
        (
            "unknown role",
            item(json!({"role": "tool", "content": "x"})),
            "input",
        ),
        (
            "max_output_tokens 0",
            json!({"input": "hi", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (
            "max_output_tokens beyond the context",
            json!({"input": "hi", "max_output_tokens": 100000}),
            "max_output_tokens",
        ),
        (
            "temperature < 0",
            json!({"input": "hi", "temperature": -1}),
            "temperature",
        ),
        (
            "previous_response_id",
            json!({"input": "hi", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (
            "a built-in tool",
            json!({"input": "hi", "tools": [{"type": "function", "name": "f"},
                {"type": "file_search", "vector_store_ids": []}]}),
            "tools[1].type",
        ),
        (
            "a chat-shaped tool",
            json!({"input": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
        ),
        (
            "a chat-shaped tool_choice",
            json!({"input": "hi", "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "function": {"name": "f"}}}),
            "tool_choice",
        ),
        (
            "tool_choice naming a function not in tools",
            json!({"input": "hi", "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"}}),
            "tool_choice",
        ),
        (
            "required without tools",
            json!({"input": "hi", "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            "a parameters schema llguidance refuses",
            json!({"input": "hi", "tools": [{"type": "function", "name": "f",
                "parameters": {"type": "integer", "minimum": 5, "maximum": 1}}],
                "tool_choice": "required"}),
            "tools",
        ),
        (
            "a forced call with text.format",
            json!({"input": "hi", "tools": [{"type": "function", "name": "f"}],
                "tool_choice": "required", "text": {"format": {"type": "json_object"}}}),
            "text.format",
        ),
        (
            "max_tool_calls",
            json!({"input": "hi", "max_tool_calls": 2}),
            "max_tool_calls",
        ),
        (
            "an unsatisfiable text.format schema",
            json!({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}),
            "text.format.schema",
        ),
        (
            "an unknown text.format type",
            json!({"input": "hi", "text": {"format": {"type": "yaml"}}}),
            "text.format.type",
        ),
        (
            "text with more than a format",
            json!({"input": "hi", "text": {"verbosity": "low"}}),
            "text",
        ),
        (
            "reasoning",
            json!({"input": "hi", "reasoning": {"effort": "high"}}),
            "reasoning",
        ),
        (
            "truncation auto",
            json!({"input": "hi", "truncation": "auto"}),
            "truncation",
        ),
        (
            "top_logprobs above 20",
            json!({"input": "hi", "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            "include other than logprobs",
            json!({"input": "hi", "include": ["file_search_call.results"]}),
            "include",
        ),
        (
            "background",
            json!({"input": "hi", "background": true}),
            "background",
        ),
        (
            "stored prompt",
            json!({"input": "hi", "prompt": {"id": "pmpt_1"}}),
            "prompt",
        ),
        (
            "unknown field",
            json!({"input": "hi", "frobnicate": 1}),
            "frobnicate",
        ),
        ("n (not in this API)", json!({"input": "hi", "n": 2}), "n"),
    ];
    for (case, body, field) in cases {
        let r = send(&s, "POST", "/v1/responses", &body.to_string()).await;
        assert_invalid(case, r, field);
    }
    // The values that change nothing pass validation (and find no worker here).
    let noop = json!({
        "input": "hi", "store": true, "metadata": {"k": "v"}, "user": "u", "tools": [],
        "tool_choice": "auto", "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "include": [], "top_logprobs": 0, "background": false, "parallel_tool_calls": true,
        "previous_response_id": null, "reasoning": null
    });
    let (status, body) = send(&s, "POST", "/v1/responses", &noop.to_string()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    // So do function tools, every choice, and calls with their outputs sent back.
    let tools = json!([{"type": "function", "name": "get_weather", "description": "Sky.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": true}, {"type": "function", "name": "noop"}]);
    for choice in [
        json!("none"),
        json!("auto"),
        json!("required"),
        json!({"type": "function", "name": "noop"}),
    ] {
        let body = json!({"input": [
            {"role": "user", "content": "Weather in Ur?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": "{\"city\":\"Ur\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."}
        ], "tools": tools, "tool_choice": choice});
        let (status, body) = send(&s, "POST", "/v1/responses", &body.to_string()).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{choice}: {body}");
    }
}
