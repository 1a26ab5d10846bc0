//! The OpenAI-compatible HTTP API.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`app`]: routes, `/v1/models`, `/health`, `/metrics` |
//! | [`auth`] | API keys on `/v1/*` (401 before the handler), the [`crate::auth::Caller`] extractor |
//! | [`serve`] | the accept loop: header-read and idle timeouts, optional TLS, graceful drain |
//! | `generate.rs` | what both generation endpoints share: the request span (parent from `traceparent`), body → params, validate-then-dispatch, streamed and whole response assembly, error bodies |
//! | [`openai`] | request and response shapes |
//! | [`logprobs`] | tokens' log-probabilities named (text, bytes, offsets) for both endpoints' shapes |
//! | [`completions`] | `POST /v1/completions`: its chunk and response shapes |
//! | [`chat`] | `POST /v1/chat/completions`: its chunk and response shapes, tool calls included |
//! | [`tools`] | the JSON shapes of `tools` and `tool_choice` (chat and responses) → [`crate::tools::Tools`], chat's tool-call shapes |
//! | [`responses`] | `POST /v1/responses` (the Responses API): its request (input items, function tools) → params, the whole answer |
//! | [`responses_out`] | the Responses API's response object, output items (message, function calls) and typed stream events |
//! | [`tokenize`] | `POST /tokenize`, `POST /detokenize` (vLLM's extensions, vLLM's shapes) |
//! | [`sse`] | server-sent-event framing |
//! | [`error`] | OpenAI-shaped error bodies, status mapping, the [`error::ApiJson`] extractor |
pub mod auth;
pub mod chat;
pub mod completions;
pub mod error;
mod generate;
pub mod logprobs;
pub mod openai;
pub mod responses;
pub mod responses_out;
pub mod serve;
pub mod sse;
pub mod tokenize;
pub mod tools;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;

use crate::registry::Role;
use crate::state::AppState;
use error::ApiError;
use openai::{ModelEntry, ModelList};

/// Largest request body: a 1M-token prompt as a JSON token array is about 7 MiB.
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// The HTTP app over `state`: `/v1/*`, `/tokenize` and `/detokenize` behind `state.keys`
/// (when on), `/health` and `/metrics` open.
pub fn app(state: Arc<AppState>) -> axum::Router {
    let v1 = axum::Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_key,
        ));
    axum::Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// `GET /metrics`: the Prometheus text format.
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        state.render_metrics(),
    )
        .into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelEntry {
            id: state.model.name.clone(),
            object: "model",
            created: state.model.created,
            owned_by: "ferry",
        }],
    })
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let now = std::time::Instant::now();
    let decode = state.registry.count(Role::Decode, now);
    let prefill = state.registry.count(Role::Prefill, now);
    if decode == 0 {
        return ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!(
                "no decode worker is registered ({prefill} prefill workers); requests cannot be served"
            ),
            param: None,
            code: "no_decode_worker",
            retry_after: None,
        }
        .into_response();
    }
    Json(serde_json::json!({
        "status": "ok",
        "decode_workers": decode,
        "prefill_workers": prefill,
    }))
    .into_response()
}

async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no route for `{}`", uri.path()),
        param: None,
        code: "not_found",
        retry_after: None,
    }
    .into_response()
}

#[cfg(test)]
mod tests;
