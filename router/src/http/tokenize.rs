//! `POST /tokenize` and `POST /detokenize`: vLLM's extensions of the OpenAI API, with vLLM's
//! shapes, so clients written for vLLM count and inspect tokens against ferry unchanged.
//!
//! `/tokenize` takes a text `prompt` (special tokens added unless `add_special_tokens` is
//! false) or chat `messages` (rendered with the model's template, the assistant generation
//! prompt added unless `add_generation_prompt` is false) and answers `{count, max_model_len,
//! tokens}`; `/detokenize` takes `tokens` and answers `{prompt}`. Both sit behind the API keys
//! like `/v1/*`, check `model` like the generation endpoints, bound their input before doing
//! the work (text by bytes, ids by the context length) and refuse unknown fields.
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use super::error::{ApiError, ApiJson};
use super::openai::{chat_messages, ChatMessageIn};
use crate::state::AppState;
use crate::validate::ValidationError;

/// `POST /tokenize`: a text prompt or chat messages (exactly one).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    /// Model name; empty or absent = the served one.
    #[serde(default)]
    pub model: String,
    /// Text to tokenize.
    pub prompt: Option<String>,
    /// Chat turns to render and tokenize.
    pub messages: Option<Vec<ChatMessageIn>>,
    /// Text: add the tokenizer's special tokens (BOS). Default true.
    pub add_special_tokens: Option<bool>,
    /// Chat: end with the assistant generation prompt. Default true.
    pub add_generation_prompt: Option<bool>,
}

/// The answer to `/tokenize`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TokenizeResponse {
    /// `tokens.len()`.
    pub count: usize,
    /// The served model's context length.
    pub max_model_len: usize,
    /// Token ids.
    pub tokens: Vec<u32>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    /// Model name; empty or absent = the served one.
    #[serde(default)]
    pub model: String,
    /// Token ids.
    pub tokens: Vec<u32>,
}

/// The answer to `/detokenize`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DetokenizeResponse {
    /// The text of the ids (special tokens kept).
    pub prompt: String,
}

/// The `/tokenize` handler.
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<TokenizeRequest>,
) -> Response {
    let v = &state.validator;
    let tokens = match (req.prompt, req.messages) {
        (Some(text), None) => {
            v.tokenize(&req.model, text, req.add_special_tokens.unwrap_or(true))
                .await
        }
        (None, Some(messages)) => match chat_messages(messages) {
            Ok(m) => {
                v.tokenize_chat(&req.model, m, req.add_generation_prompt.unwrap_or(true))
                    .await
            }
            Err(e) => Err(e.into()),
        },
        (prompt, _) => Err(ValidationError::new(
            if prompt.is_some() {
                "messages"
            } else {
                "prompt"
            },
            "exactly one of `prompt` and `messages` must be given",
        )
        .into()),
    };
    match tokens {
        Ok(tokens) => Json(TokenizeResponse {
            count: tokens.len(),
            max_model_len: state.model.context_length,
            tokens,
        })
        .into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// The `/detokenize` handler.
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Response {
    match state.validator.detokenize(&req.model, req.tokens).await {
        Ok(prompt) => Json(DetokenizeResponse { prompt }).into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}
