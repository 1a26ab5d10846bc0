//! `POST /v1/chat/completions`: chat turns rendered with the model's template, streamed or
//! whole.
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use tracing::Instrument;

use super::error::{ApiError, ApiJson};
use super::openai::{
    finish_str, ChatChoice, ChatChunk, ChatMessageOut, ChatRequest, ChatResponse, ChunkChoice,
    Delta, UsageOut,
};
use super::sse::{self, Chunk};
use super::{reject, request_span, start, Meta};
use crate::dispatch::GenerationStream;
use crate::error::log_failure;
use crate::spans::{InSpan, Operation};
use crate::state::AppState;

/// The handler.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Response {
    let meta = Meta::new("chatcmpl", &state);
    let span = request_span(
        &state,
        &headers,
        Operation::Chat,
        "/v1/chat/completions",
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

fn chunk(meta: &Meta, choice: Option<ChunkChoice>, usage: Option<Option<UsageOut>>) -> Chunk {
    Chunk::json(&ChatChunk {
        id: meta.id.clone(),
        object: "chat.completion.chunk",
        created: meta.created,
        model: meta.model.clone(),
        choices: choice.into_iter().collect(),
        usage,
    })
}

fn chunks(
    meta: Meta,
    mut events: GenerationStream,
    include_usage: bool,
    span: tracing::Span,
) -> impl futures::Stream<Item = Chunk> + Send {
    let null_usage = include_usage.then_some(None);
    async_stream::stream! {
        let opening = ChunkChoice {
            index: 0,
            delta: Delta { role: Some("assistant"), content: Some(String::new()) },
            logprobs: None,
            finish_reason: None,
        };
        yield chunk(&meta, Some(opening), null_usage);
        while let Some(item) = events.next().await {
            match item {
                Ok(event) => {
                    if event.text.is_empty() && event.finish.is_none() {
                        continue;
                    }
                    let choice = ChunkChoice {
                        index: 0,
                        delta: Delta {
                            role: None,
                            content: Some(event.text).filter(|t| !t.is_empty()),
                        },
                        logprobs: None,
                        finish_reason: finish_str(event.finish),
                    };
                    yield chunk(&meta, Some(choice), null_usage);
                    if let (true, Some(usage)) = (include_usage, event.usage) {
                        yield chunk(&meta, None, Some(Some(usage.into())));
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
                    return Json(ChatResponse {
                        id: meta.id,
                        object: "chat.completion",
                        created: meta.created,
                        model: meta.model,
                        choices: vec![ChatChoice {
                            index: 0,
                            message: ChatMessageOut {
                                role: "assistant",
                                content: text,
                            },
                            logprobs: None,
                            finish_reason: Some(finish.as_str()),
                        }],
                        usage: usage.into(),
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
