//! The OpenAI-compatible HTTP API.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`app`]: routes, `/v1/models`, `/health`, the shared validate-then-dispatch step |
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
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use tracing::Instrument;

use crate::dispatch::GenerationStream;
use crate::error::RequestError;
use crate::registry::Role;
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

/// Validates and dispatches in the request's span; logs a failure once.
pub(crate) async fn start(
    state: &AppState,
    params: GenerateParams,
    span: tracing::Span,
) -> Result<GenerationStream, ApiError> {
    async {
        let valid = state.validator.validate(params).await?;
        state.dispatcher.generate(valid).await
    }
    .instrument(span.clone())
    .await
    .map_err(|e: RequestError| {
        span.in_scope(|| crate::error::log_failure(&e));
        ApiError::from(e)
    })
}

/// Logs a conversion failure (before validation) once and turns it into a response.
pub(crate) fn reject(e: crate::validate::ValidationError, span: &tracing::Span) -> Response {
    let e = RequestError::Invalid(e);
    span.in_scope(|| crate::error::log_failure(&e));
    ApiError::from(e).into_response()
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
