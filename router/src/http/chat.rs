//! `POST /v1/chat/completions`: chat turns rendered with the model's template, streamed or
//! whole. The shapes of its chunks and response; the plumbing is [`super::generate`].
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::error::ApiJson;
use super::generate::{self, End, Endpoint, Meta};
use super::logprobs::{ChatLogprobs, LogprobOut};
use super::openai::{
    finish_str, ChatChoice, ChatChunk, ChatMessageOut, ChatRequest, ChatResponse, ChunkChoice,
    Delta, UsageOut,
};
use super::sse::Chunk;
use crate::auth::Caller;
use crate::output::FinishReason;
use crate::spans::Operation;
use crate::state::AppState;
use crate::validate::{GenerateParams, ValidationError};

/// The handler.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    caller: Caller,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Response {
    generate::handle::<Chat>(state, headers, caller, req).await
}

/// `/v1/chat/completions` as an [`Endpoint`].
struct Chat;

impl Endpoint for Chat {
    type Request = ChatRequest;
    const ROUTE: &'static str = "/v1/chat/completions";
    const OPERATION: Operation = Operation::Chat;
    const ID_PREFIX: &'static str = "chatcmpl";

    fn stream_options(req: &ChatRequest) -> (bool, bool) {
        (req.stream, req.include_usage())
    }

    fn into_params(req: ChatRequest, request_id: &str) -> Result<GenerateParams, ValidationError> {
        req.into_params(request_id)
    }

    /// The assistant role with empty content, as OpenAI opens every chat stream.
    fn opening(meta: &Meta, usage: Option<Option<UsageOut>>) -> Option<Chunk> {
        let opening = ChunkChoice {
            index: 0,
            delta: Delta {
                role: Some("assistant"),
                content: Some(String::new()),
            },
            logprobs: None,
            finish_reason: None,
        };
        Some(chunk(meta, Some(opening), usage))
    }

    fn delta(meta: &Meta, text: String, logprobs: Option<&[LogprobOut]>, end: End) -> Chunk {
        let choice = ChunkChoice {
            index: 0,
            delta: Delta {
                role: None,
                content: Some(text).filter(|t| !t.is_empty()),
            },
            logprobs: logprobs.map(ChatLogprobs::from),
            finish_reason: finish_str(end.finish),
        };
        chunk(meta, Some(choice), end.usage)
    }

    fn usage(meta: &Meta, usage: UsageOut) -> Chunk {
        chunk(meta, None, Some(Some(usage)))
    }

    fn whole(
        meta: Meta,
        text: String,
        logprobs: Option<&[LogprobOut]>,
        finish: FinishReason,
        usage: UsageOut,
    ) -> Response {
        Json(ChatResponse {
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
                logprobs: logprobs.map(ChatLogprobs::from),
                finish_reason: Some(finish.as_str()),
            }],
            usage,
        })
        .into_response()
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
