//! The OpenAI-compatible HTTP API.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`app`]: routes, `/v1/models`, `/health`, `/metrics`, the request span (parent from `traceparent`), the shared validate-then-dispatch step |
//! | [`openai`] | request and response shapes |
//! | [`completions`] | `POST /v1/completions` |
//! | [`chat`] | `POST /v1/chat/completions` |
//! | [`sse`] | server-sent-event framing |
//! | [`error`] | OpenAI-shaped error bodies, status mapping, the [`error::ApiJson`] extractor |
pub mod chat;
pub mod completions;
pub mod error;
pub mod openai;
pub mod sse;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use tracing::Instrument;

use crate::dispatch::GenerationStream;
use crate::error::RequestError;
use crate::registry::Role;
use crate::spans::{self, FrontDoor, Operation};
use crate::state::AppState;
use crate::validate::GenerateParams;
use error::ApiError;
use openai::{ModelEntry, ModelList};

/// Largest request body: a 1M-token prompt as a JSON token array is about 7 MiB.
pub const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// The HTTP app over `state`.
pub fn app(state: Arc<AppState>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// What every generation handler needs besides the events.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Meta {
    pub fn new(prefix: &str, state: &AppState) -> Self {
        Self {
            id: format!("{prefix}-{:032x}", rand::random::<u128>()),
            created: unix_now(),
            model: state.model.name.clone(),
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The `request` span of an HTTP generation request on `route`, a child of the client's
/// `traceparent` if it sent one.
pub(crate) fn request_span(
    state: &AppState,
    headers: &HeaderMap,
    operation: Operation,
    route: &'static str,
    request_id: &str,
) -> tracing::Span {
    let span = spans::request_span(FrontDoor::Http(route), operation, &state.model.name);
    ferry_proto::trace_ctx::set_parent_from_headers(&span, headers);
    span.record("request_id", request_id);
    span
}

/// Validates and dispatches in the request's span; logs and counts a failure once.
pub(crate) async fn start(
    state: &AppState,
    params: GenerateParams,
    span: tracing::Span,
) -> Result<GenerationStream, ApiError> {
    let requested = if params.model.is_empty() {
        state.model.name.clone()
    } else {
        params.model.clone()
    };
    ferry_proto::trace_ctx::set_attribute(&span, "gen_ai.request.model", requested);
    let started = async {
        let valid = state.validator.validate(params).await?;
        state.dispatcher.generate(valid).await
    }
    .instrument(span.clone())
    .await
    .map_err(|e: RequestError| {
        spans::request_failed(&state.metrics, &span, &e);
        ApiError::from(e)
    });
    let status = match &started {
        Ok(_) => StatusCode::OK,
        Err(e) => e.status,
    };
    ferry_proto::trace_ctx::set_attribute(
        &span,
        "http.response.status_code",
        i64::from(status.as_u16()),
    );
    started
}

/// Logs and counts a conversion failure (before validation) once and turns it into a response.
pub(crate) fn reject(
    state: &AppState,
    e: crate::validate::ValidationError,
    span: &tracing::Span,
) -> Response {
    let e = RequestError::Invalid(e);
    spans::request_failed(&state.metrics, span, &e);
    let e = ApiError::from(e);
    ferry_proto::trace_ctx::set_attribute(
        span,
        "http.response.status_code",
        i64::from(e.status.as_u16()),
    );
    e.into_response()
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
    }
    .into_response()
}

#[cfg(test)]
mod tests;
