//! `POST /v1/completions`: text (or token-id) prompts, streamed or whole. The shapes of its
//! chunks and response; the plumbing is [`super::generate`]. `echo` puts the prompt (its text
//! as given; a token-id prompt decoded) before each choice's text, and with `logprobs` its
//! tokens before the generated ones ([`super::generate::Echo`]).
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::error::ApiJson;
use super::generate::{self, Echo, End, Endpoint, Meta, WholeChoice};
use super::logprobs::{CompletionLogprobs, LogprobOut};
use super::openai::{
    finish_str, CompletionChoice, CompletionRequest, CompletionResponse, UsageOut,
};
use super::sse::Chunk;
use crate::auth::Caller;
use crate::spans::Operation;
use crate::state::AppState;
use crate::tokenize::PromptInput;
use crate::validate::{GenerateParams, ValidationError};

/// The handler.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    caller: Caller,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Response {
    generate::handle::<Completions>(state, headers, caller, req).await
}

/// `/v1/completions` as an [`Endpoint`].
struct Completions;

impl Endpoint for Completions {
    type Request = CompletionRequest;
    const ROUTE: &'static str = "/v1/completions";
    const OPERATION: Operation = Operation::TextCompletion;
    const ID_PREFIX: &'static str = "cmpl";

    fn stream_options(req: &CompletionRequest) -> (bool, bool) {
        (req.stream, req.include_usage())
    }

    fn into_params(
        req: CompletionRequest,
        meta: &mut Meta,
    ) -> Result<GenerateParams, ValidationError> {
        let params = req.into_params(&meta.id)?;
        if params.echo {
            meta.echo = Some(match &params.prompt {
                PromptInput::Tokens(ids) => Echo::Tokens(ids.clone()),
                PromptInput::Text(t) => Echo::Text(t.clone()),
                PromptInput::Chat(_) | PromptInput::ChatTools(..) => Echo::Text(String::new()),
            });
        }
        Ok(params)
    }

    fn opening(_meta: &Meta, _index: u32, _usage: Option<Option<UsageOut>>) -> Option<Chunk> {
        None
    }

    fn delta(
        meta: &Meta,
        index: u32,
        text: String,
        logprobs: Option<&[LogprobOut]>,
        end: End,
    ) -> Chunk {
        let choice = CompletionChoice {
            index,
            text,
            logprobs: logprobs.map(CompletionLogprobs::from),
            finish_reason: finish_str(end.finish),
        };
        chunk(meta, vec![choice], end.usage)
    }

    fn usage(meta: &Meta, usage: UsageOut) -> Chunk {
        chunk(meta, vec![], Some(Some(usage)))
    }

    fn whole(meta: Meta, choices: Vec<WholeChoice>, usage: UsageOut) -> Response {
        let choices = choices
            .into_iter()
            .enumerate()
            .map(|(i, c)| CompletionChoice {
                index: u32::try_from(i).unwrap_or(u32::MAX),
                text: c.text_or_calls(),
                logprobs: c.logprobs.as_deref().map(CompletionLogprobs::from),
                finish_reason: Some(c.finish.as_str()),
            })
            .collect();
        Json(CompletionResponse {
            id: meta.id,
            object: "text_completion",
            created: meta.created,
            model: meta.model,
            choices,
            usage: Some(Some(usage)),
        })
        .into_response()
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
