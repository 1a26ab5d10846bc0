//! API keys on the HTTP API: [`require_key`] authenticates every `/v1/*`, `/tokenize` and
//! `/detokenize` request from its `Authorization: Bearer <key>` header and hands the
//! [`Caller`] to the handlers (an extractor); anything else is a 401 with an OpenAI-shaped body
//! before the handler runs.
//! `/health` and `/metrics` are outside the layer and stay open (probes and scrapers).
use std::sync::Arc;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use crate::auth::Caller;
use crate::error::{log_failure, RequestError};
use crate::state::AppState;

/// Middleware: authenticates the request, or answers 401 (`invalid_api_key`).
pub async fn require_key(
    State(state): State<Arc<AppState>>,
    mut request: Request,
    next: Next,
) -> Response {
    let header = request.headers().get(AUTHORIZATION).map(|v| v.as_bytes());
    match state.keys.authenticate(header) {
        Ok(caller) => {
            request.extensions_mut().insert(caller);
            next.run(request).await
        }
        Err(e) => {
            let e = RequestError::from(e);
            log_failure(&e);
            state.metrics.failure.with_label_values(&[e.kind()]).inc();
            ApiError::from(e).into_response()
        }
    }
}

/// The authenticated caller, put there by [`require_key`]. A route outside the layer that
/// asks for it gets a 500, never an unauthenticated pass.
impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Caller>()
            .cloned()
            .ok_or_else(|| ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: "internal error: the route is not behind the API key check".into(),
                param: None,
                code: "internal",
                retry_after: None,
            })
    }
}
