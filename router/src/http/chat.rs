//! `POST /v1/chat/completions`: chat turns rendered with the model's template, streamed or
//! whole. The shapes of its chunks and response, tool calls included ([`super::tools`]); the
//! plumbing is [`super::generate`].
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::error::ApiJson;
use super::generate::{self, End, Endpoint, Meta, WholeChoice};
use super::logprobs::{ChatLogprobs, LogprobOut};
use super::openai::{
    finish_str, ChatChoice, ChatChunk, ChatMessageOut, ChatRequest, ChatResponse, ChunkChoice,
    Delta, UsageOut,
};
use super::sse::Chunk;
use super::tools::ToolCallOut;
use crate::auth::Caller;
use crate::spans::Operation;
use crate::state::AppState;
use crate::tools::Tools;
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

    fn into_params(req: ChatRequest, meta: &mut Meta) -> Result<GenerateParams, ValidationError> {
        let (params, tools) = req.into_params_with_tools(&meta.id)?;
        meta.tools = tools.filter(Tools::parses).map(Arc::new);
        Ok(params)
    }

    /// The assistant role with empty content, as OpenAI opens every chat stream.
    fn opening(meta: &Meta, index: u32, usage: Option<Option<UsageOut>>) -> Option<Chunk> {
        let opening = ChunkChoice {
            index,
            delta: Delta {
                role: Some("assistant"),
                content: Some(String::new()),
                tool_calls: None,
            },
            logprobs: None,
            finish_reason: None,
        };
        Some(chunk(meta, Some(opening), usage))
    }

    fn delta(
        meta: &Meta,
        index: u32,
        text: String,
        logprobs: Option<&[LogprobOut]>,
        end: End,
    ) -> Chunk {
        let choice = ChunkChoice {
            index,
            delta: Delta {
                role: None,
                content: Some(text).filter(|t| !t.is_empty()),
                tool_calls: None,
            },
            logprobs: logprobs.map(ChatLogprobs::from),
            finish_reason: finish_str(end.finish),
        };
        chunk(meta, Some(choice), end.usage)
    }

    fn usage(meta: &Meta, usage: UsageOut) -> Chunk {
        chunk(meta, None, Some(Some(usage)))
    }

    /// Each sample's message: its text, or `content: null` and its calls (finish reason
    /// `tool_calls`).
    fn whole(meta: Meta, choices: Vec<WholeChoice>, usage: UsageOut) -> Response {
        let choices = choices
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let finish = match c.calls {
                    Some(_) => TOOL_CALLS,
                    None => c.finish.as_str(),
                };
                let (content, tool_calls) = match c.calls {
                    Some(calls) => (None, Some(calls)),
                    None => (Some(c.text), None),
                };
                ChatChoice {
                    index: u32::try_from(i).unwrap_or(u32::MAX),
                    message: ChatMessageOut {
                        role: "assistant",
                        content,
                        tool_calls,
                    },
                    logprobs: c.logprobs.as_deref().map(ChatLogprobs::from),
                    finish_reason: Some(finish),
                }
            })
            .collect();
        Json(ChatResponse {
            id: meta.id,
            object: "chat.completion",
            created: meta.created,
            model: meta.model,
            choices,
            usage,
        })
        .into_response()
    }

    /// The calls in one chunk (each with its whole `arguments` and its `index`), finish reason
    /// `tool_calls`.
    fn tool_calls(
        meta: &Meta,
        index: u32,
        calls: Vec<ToolCallOut>,
        logprobs: Option<&[LogprobOut]>,
        end: End,
    ) -> Chunk {
        let calls = calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| ToolCallOut {
                index: Some(i as u32),
                ..c
            })
            .collect();
        let choice = ChunkChoice {
            index,
            delta: Delta {
                role: None,
                content: None,
                tool_calls: Some(calls),
            },
            logprobs: logprobs.map(ChatLogprobs::from),
            finish_reason: Some(TOOL_CALLS),
        };
        chunk(meta, Some(choice), end.usage)
    }
}

/// The finish reason of a reply that is tool calls.
const TOOL_CALLS: &str = "tool_calls";

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
