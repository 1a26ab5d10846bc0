//! `POST /v1/completions`: text (or token-id) prompts, streamed or whole.
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use tracing::Instrument;

use super::error::{ApiError, ApiJson};
use super::openai::{
    finish_str, CompletionChoice, CompletionRequest, CompletionResponse, UsageOut,
};
use super::sse::{self, Chunk};
use super::{reject, request_span, start, Meta};
use crate::dispatch::GenerationStream;
use crate::error::log_failure;
use crate::spans::{InSpan, Operation};
use crate::state::AppState;

/// The handler.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Response {
    let meta = Meta::new("cmpl", &state);
    let span = request_span(
        &state,
        &headers,
        Operation::TextCompletion,
        "/v1/completions",
        &meta.id,
    );
    let (stream, include_usage) = (req.stream, req.include_usage());
    let params = match req.into_params(&meta.id) {
        Ok(p) => p,
        Err(e) => return reject(&state, e, &span),
    };
    let events = match start(&state, params, span.clone()).await {
        Ok(events) => events,
        Err(e) => return e.into_response(),
    };
    if stream {
        let chunks = Box::pin(chunks(meta, events, include_usage, span.clone()));
        sse::response(InSpan::new(chunks, span))
    } else {
        whole(meta, events, span.clone()).instrument(span).await
    }
}

fn chunk(meta: &Meta, choices: Vec<CompletionChoice>, usage: Option<Option<UsageOut>>) -> Chunk {
    Chunk::json(&CompletionResponse {
        id: meta.id.clone(),
        object: "text_completion",
        created: meta.created,
        model: meta.model.clone(),
        choices,
        usage,
    })
}

fn chunks(
    meta: Meta,
    mut events: GenerationStream,
    include_usage: bool,
    span: tracing::Span,
) -> impl futures::Stream<Item = Chunk> + Send {
    async_stream::stream! {
        while let Some(item) = events.next().await {
            match item {
                Ok(event) => {
                    if event.text.is_empty() && event.finish.is_none() {
                        continue;
                    }
                    let choice = CompletionChoice {
                        index: 0,
                        text: event.text,
                        logprobs: None,
                        finish_reason: finish_str(event.finish),
                    };
                    yield chunk(&meta, vec![choice], include_usage.then_some(None));
                    if let (true, Some(usage)) = (include_usage, event.usage) {
                        yield chunk(&meta, vec![], Some(Some(usage.into())));
                    }
                }
                Err(e) => {
                    span.in_scope(|| log_failure(&e));
                    yield Chunk::json(&ApiError::from(e).body());
                    break;
                }
            }
        }
    }
}

async fn whole(meta: Meta, mut events: GenerationStream, span: tracing::Span) -> Response {
    let mut text = String::new();
    while let Some(item) = events.next().await {
        match item {
            Ok(event) => {
                text.push_str(&event.text);
                if let (Some(finish), Some(usage)) = (event.finish, event.usage) {
                    return Json(CompletionResponse {
                        id: meta.id,
                        object: "text_completion",
                        created: meta.created,
                        model: meta.model,
                        choices: vec![CompletionChoice {
                            index: 0,
                            text,
                            logprobs: None,
                            finish_reason: Some(finish.as_str()),
                        }],
                        usage: Some(Some(usage.into())),
                    })
                    .into_response();
                }
            }
            Err(e) => {
                span.in_scope(|| log_failure(&e));
                return ApiError::from(e).into_response();
            }
        }
    }
    let e = crate::error::RequestError::Internal("the generation ended without a finish".into());
    span.in_scope(|| log_failure(&e));
    ApiError::from(e).into_response()
}
