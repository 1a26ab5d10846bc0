//! `POST /v1/responses`: OpenAI's Responses API (what current OpenAI clients default to), for
//! text in and text out, whole or streamed as its typed events.
//!
//! The request becomes a chat conversation: `instructions` as a system turn, then `input` (a
//! string is one user turn; a list holds messages whose content is a string or `input_text` /
//! `output_text` parts, role `developer` read as `system`), rendered with the model's chat
//! template like `/v1/chat/completions`. The answer is one `message` output item with one
//! `output_text` part. A stream sends `response.created`, `response.in_progress`, the item and
//! part openings, one `response.output_text.delta` per decoded chunk, their closings and
//! `response.completed` (or `response.incomplete` when `max_output_tokens` cut it), each as an
//! SSE event named by its `type` with a `sequence_number`, and no `[DONE]` (the Responses API
//! has none). ferry keeps no responses: `store` has no effect (the object says `"store":
//! false`) and `previous_response_id` is a 400, as is every field that would change the output
//! and is not implemented (tools, reasoning, …). Structured output: `text.format` `{"type":
//! "json_object"}` or `{"type": "json_schema", "name", "schema", "strict"}`, as on the chat
//! endpoint ([`crate::structured`]), echoed in the response's `text`. Log-probabilities
//! (`include: ["message.output_text.logprobs"]` and/or `top_logprobs` 1–20) are the chat
//! endpoint's: the raw log-softmax, on the text part and on every delta.
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferry_modelcard::tokenizer::ChatMessage;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tracing::Instrument;

use super::error::{ApiError, ApiJson};
use super::generate::{self, Meta};
use super::logprobs::{LogprobOut, Namer, TopOut};
use super::openai::MAX_CHAT_TOP_LOGPROBS;
use super::sse;
use crate::auth::Caller;
use crate::dispatch::GenerationStream;
use crate::error::{log_failure, RequestError};
use crate::output::{FinishReason, Usage};
use crate::spans::Operation;
use crate::state::AppState;
use crate::structured::{parse_format, FormatApi, FormatInput};
use crate::tokenize::PromptInput;
use crate::validate::{GenerateParams, SamplingInput, ValidationError};

const ROUTE: &str = "/v1/responses";

/// `POST /v1/responses`. Unknown fields are refused; fields ferry does not implement are a
/// 400 naming them unless their value changes nothing ([`ResponsesRequest::check_unsupported`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponsesRequest {
    /// Model name; empty or absent = the served one.
    #[serde(default)]
    pub model: String,
    /// The input: a string (one user turn) or a list of messages.
    pub input: ResponseInput,
    /// A system turn put before the input.
    pub instructions: Option<String>,
    /// New tokens at most; default: what the context leaves.
    pub max_output_tokens: Option<i64>,
    /// Softmax temperature.
    pub temperature: Option<f64>,
    /// Nucleus threshold.
    pub top_p: Option<f64>,
    /// Extension (as on the other endpoints): keep the k most likely tokens.
    pub top_k: Option<i64>,
    /// Extension: drop tokens below min_p × the top probability.
    pub min_p: Option<f64>,
    /// Extension: seed for reproducible sampling.
    pub seed: Option<u64>,
    /// Extension: speculative decoding for this request; absent = the worker's setting.
    pub speculative: Option<bool>,
    /// Extension: keep generating past end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Stream the typed events.
    #[serde(default)]
    pub stream: bool,
    /// No effect: ferry keeps no responses (the object says `"store": false`).
    pub store: Option<Value>,
    /// No effect on the output; echoed back.
    pub metadata: Option<Value>,
    /// No effect on the output.
    pub user: Option<Value>,
    /// No effect on the output.
    pub safety_identifier: Option<Value>,
    /// No effect on the output.
    pub prompt_cache_key: Option<Value>,
    /// No effect on the output (ferry's prefix cache keeps what fits, by content).
    pub prompt_cache_retention: Option<Value>,
    /// No effect on the output.
    pub prompt_cache_options: Option<Value>,
    /// No effect on the output.
    pub service_tier: Option<Value>,
    /// No effect on the output.
    pub stream_options: Option<Value>,
    /// No effect without tools.
    pub parallel_tool_calls: Option<Value>,
    /// Not implemented: null only (ferry keeps no responses to continue from).
    pub previous_response_id: Option<Value>,
    /// Not implemented: null only.
    pub conversation: Option<Value>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", …}}`.
    pub text: Option<Value>,
    /// Not implemented: empty only.
    pub tools: Option<Value>,
    /// Not implemented: `"none"` or `"auto"` (with no tools, the same).
    pub tool_choice: Option<Value>,
    /// Extra output: only `"message.output_text.logprobs"` (the tokens' log-probabilities).
    pub include: Option<Value>,
    /// Not implemented: null only.
    pub reasoning: Option<Value>,
    /// Only `"disabled"` (a prompt longer than the context is a 400, never cut).
    pub truncation: Option<Value>,
    /// Alternatives per token, in [0, 20]; above 0 (or with `include`'s
    /// `message.output_text.logprobs`) the text part carries its tokens' log-probabilities.
    pub top_logprobs: Option<i64>,
    /// Not implemented: null only.
    pub max_tool_calls: Option<Value>,
    /// Not implemented: false only.
    pub background: Option<Value>,
    /// Not implemented (stored prompt templates): null only.
    pub prompt: Option<Value>,
}

/// A field ferry does not implement: accepted only with a value for which `ok` holds (the
/// values that change nothing), else a 400 naming it and what it accepts.
struct Unsupported<'a> {
    field: &'static str,
    value: &'a Option<Value>,
    ok: fn(&Value) -> bool,
    accepted: &'static str,
}

impl<'a> Unsupported<'a> {
    fn new(
        field: &'static str,
        value: &'a Option<Value>,
        ok: fn(&Value) -> bool,
        accepted: &'static str,
    ) -> Self {
        Self {
            field,
            value,
            ok,
            accepted,
        }
    }
}

/// `input`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum ResponseInput {
    /// One user turn.
    Text(String),
    /// Messages.
    Items(Vec<InputItem>),
}

/// One input item: a message (`type` absent or `"message"`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct InputItem {
    /// `message` (other item types, e.g. function call outputs, are a 400).
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    /// `user`, `assistant`, `system` or `developer`.
    #[serde(default)]
    pub role: Option<String>,
    /// A string or parts.
    #[serde(default)]
    pub content: Option<InputContent>,
}

/// A message's content.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum InputContent {
    /// Plain text.
    Text(String),
    /// Content parts (`input_text`, or `output_text` in assistant turns).
    Parts(Vec<InputPart>),
}

/// One content part.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct InputPart {
    /// `input_text` or `output_text` (others, e.g. images, are a 400).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text.
    #[serde(default)]
    pub text: String,
}

impl ResponsesRequest {
    /// A 400 naming the first field that would change the output and is not implemented.
    fn check_unsupported(&self) -> Result<(), ValidationError> {
        fn null(v: &Value) -> bool {
            v.is_null()
        }
        fn empty(v: &Value) -> bool {
            v.is_null() || v.as_array().is_some_and(Vec::is_empty)
        }
        let checks = [
            Unsupported::new(
                "previous_response_id",
                &self.previous_response_id,
                null,
                "null",
            ),
            Unsupported::new("conversation", &self.conversation, null, "null"),
            Unsupported::new("tools", &self.tools, empty, "[]"),
            Unsupported::new(
                "tool_choice",
                &self.tool_choice,
                |v| v.is_null() || matches!(v.as_str(), Some("none" | "auto")),
                "\"none\" or \"auto\"",
            ),
            Unsupported::new("reasoning", &self.reasoning, null, "null"),
            Unsupported::new(
                "truncation",
                &self.truncation,
                |v| v.is_null() || v.as_str() == Some("disabled"),
                "\"disabled\"",
            ),
            Unsupported::new("max_tool_calls", &self.max_tool_calls, null, "null"),
            Unsupported::new(
                "background",
                &self.background,
                |v| v.is_null() || v == &Value::Bool(false),
                "false",
            ),
        ];
        for c in checks {
            if let Some(v) = c.value.as_ref().filter(|v| !(c.ok)(v)) {
                return Err(ValidationError::new(
                    c.field,
                    format!(
                        "is not supported by ferry yet; omit it or send {}, got {v}",
                        c.accepted
                    ),
                ));
            }
        }
        if let Some(v) = self.prompt.as_ref().filter(|v| !v.is_null()) {
            return Err(ValidationError::new(
                "prompt",
                format!("stored prompt templates are not supported; got {v}"),
            ));
        }
        Ok(())
    }

    /// `text.format`, parsed (its schema is compiled by the validator); `text` may hold
    /// nothing but `format`.
    fn text_format(&self) -> Result<Option<FormatInput>, ValidationError> {
        let Some(text) = self.text.as_ref().filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let obj = text.as_object().ok_or_else(|| {
            ValidationError::new("text", format!("must be an object, got {text}"))
        })?;
        if let Some(k) = obj.keys().find(|k| k.as_str() != "format") {
            return Err(ValidationError::new(
                "text",
                format!("only `format` is supported, got {k:?}"),
            ));
        }
        match obj.get("format") {
            Some(f) => parse_format(f, FormatApi::Responses),
            None => Ok(None),
        }
    }

    /// Alternatives per token when log-probabilities are asked for (`include` names
    /// `message.output_text.logprobs`, or `top_logprobs` > 0), else `None`.
    fn logprobs(&self) -> Result<Option<i64>, ValidationError> {
        const LOGPROBS: &str = "message.output_text.logprobs";
        let mut included = false;
        if let Some(v) = self.include.as_ref().filter(|v| !v.is_null()) {
            let bad = || {
                ValidationError::new(
                    "include",
                    format!("only [\"{LOGPROBS}\"] is supported, got {v}"),
                )
            };
            for item in v.as_array().ok_or_else(bad)? {
                match item.as_str() {
                    Some(LOGPROBS) => included = true,
                    _ => return Err(bad()),
                }
            }
        }
        match self.top_logprobs {
            Some(n) if !(0..=MAX_CHAT_TOP_LOGPROBS).contains(&n) => Err(ValidationError::new(
                "top_logprobs",
                format!("must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {n}"),
            )),
            Some(n) if n > 0 || included => Ok(Some(n)),
            _ => Ok(included.then_some(0)),
        }
    }

    /// The conversation to render: `instructions` first, then the input's turns.
    fn messages(&self) -> Result<Vec<ChatMessage>, ValidationError> {
        let mut messages = Vec::new();
        if let Some(i) = &self.instructions {
            messages.push(ChatMessage::new("system", i.clone()));
        }
        let items = match &self.input {
            ResponseInput::Text(t) => {
                messages.push(ChatMessage::new("user", t.clone()));
                return Ok(messages);
            }
            ResponseInput::Items(items) => items,
        };
        if items.is_empty() {
            return Err(ValidationError::new(
                "input",
                "must hold at least one message",
            ));
        }
        for (i, item) in items.iter().enumerate() {
            let bad = |what: String| ValidationError::new("input", format!("item {i}: {what}"));
            if let Some(kind) = item.kind.as_deref().filter(|k| *k != "message") {
                return Err(bad(format!(
                    "only \"message\" items are supported, got type {kind:?}"
                )));
            }
            let role = match item.role.as_deref() {
                Some("developer" | "system") => "system",
                Some(r @ ("user" | "assistant")) => r,
                Some(r) => {
                    return Err(bad(format!(
                        "role must be user, assistant, system or developer, got {r:?}"
                    )))
                }
                None => return Err(bad("role is missing".into())),
            };
            let content = match &item.content {
                None => String::new(),
                Some(InputContent::Text(t)) => t.clone(),
                Some(InputContent::Parts(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        if !matches!(p.kind.as_str(), "input_text" | "output_text") {
                            return Err(bad(format!(
                                "content parts must be input_text or output_text, got {:?}",
                                p.kind
                            )));
                        }
                        text.push_str(&p.text);
                    }
                    text
                }
            };
            messages.push(ChatMessage::new(role, content));
        }
        Ok(messages)
    }

    /// The request in the router's terms (the rest is checked by the validator).
    pub fn into_params(&self, request_id: &str) -> Result<GenerateParams, ValidationError> {
        self.check_unsupported()?;
        if let Some(n) = self.max_output_tokens.filter(|&n| n < 1) {
            return Err(ValidationError::new(
                "max_output_tokens",
                format!("must be >= 1, got {n}"),
            ));
        }
        Ok(GenerateParams {
            model: self.model.clone(),
            prompt: PromptInput::Chat(self.messages()?),
            sampling: SamplingInput {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                seed: self.seed,
                presence_penalty: None,
                frequency_penalty: None,
                repetition_penalty: None,
                logit_bias: Vec::new(),
            },
            max_tokens: self.max_output_tokens,
            stop: Vec::new(),
            ignore_eos: self.ignore_eos,
            min_tokens: None,
            stop_token_ids: Vec::new(),
            logprobs: self.logprobs()?,
            request_id: Some(request_id.to_string()),
            speculative: self.speculative,
            response_format: self.text_format()?,
            n: None,
        })
    }
}

/// The response object, whole or as the events carry it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResponseObject {
    /// `resp_…`.
    pub id: String,
    /// Always `response`.
    pub object: &'static str,
    /// Unix seconds.
    pub created_at: u64,
    /// `in_progress`, `completed` or `incomplete`.
    pub status: &'static str,
    /// Always null (a failure is an error response or event).
    pub error: Option<Value>,
    /// Why it is incomplete: `{"reason": "max_output_tokens"}`.
    pub incomplete_details: Option<Value>,
    /// As sent.
    pub instructions: Option<String>,
    /// As sent.
    pub max_output_tokens: Option<i64>,
    /// The served model.
    pub model: String,
    /// The message item (once it exists).
    pub output: Vec<OutputMessage>,
    /// Always true (no tools run).
    pub parallel_tool_calls: bool,
    /// Always null.
    pub previous_response_id: Option<String>,
    /// `{"effort": null, "summary": null}`: no reasoning.
    pub reasoning: Value,
    /// Always false: ferry keeps no responses.
    pub store: bool,
    /// As sent (default 1).
    pub temperature: f64,
    /// `{"format": {"type": "text"}}`.
    pub text: Value,
    /// `none`.
    pub tool_choice: &'static str,
    /// Always empty.
    pub tools: Vec<Value>,
    /// As sent (default 1).
    pub top_p: f64,
    /// `disabled`.
    pub truncation: &'static str,
    /// Token counts, once finished.
    pub usage: Option<ResponseUsage>,
    /// As sent.
    pub metadata: Value,
}

/// The output message item.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutputMessage {
    /// Always `message`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// `msg_…`.
    pub id: String,
    /// `in_progress`, `completed` or `incomplete`.
    pub status: &'static str,
    /// Always `assistant`.
    pub role: &'static str,
    /// The text part (once it exists).
    pub content: Vec<OutputText>,
}

/// An `output_text` part.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutputText {
    /// Always `output_text`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The text.
    pub text: String,
    /// Always empty.
    pub annotations: Vec<Value>,
    /// The text's tokens with their log-probabilities when asked for, else empty.
    pub logprobs: Vec<TokenLogprob>,
}

/// One token of the text with its log-probability and the most likely alternatives.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f64,
    /// The text's UTF-8 bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at its position (`top_logprobs` of them).
    pub top_logprobs: Vec<TopLogprob>,
}

/// An alternative at a position.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f64,
    /// The text's UTF-8 bytes.
    pub bytes: Vec<u8>,
}

impl From<&TopOut> for TopLogprob {
    fn from(t: &TopOut) -> Self {
        Self {
            token: t.token.clone(),
            logprob: shortest_f64(t.logprob),
            bytes: t.bytes.clone(),
        }
    }
}

/// The f64 whose shortest decimal is `x`'s (the engine computes f32 values): the stream's
/// events are built as JSON values, where an f32 would otherwise print all of its f64 digits
/// and differ in the last places from the same value in the whole response.
fn shortest_f64(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

impl OutputText {
    fn new(text: String, logprobs: &[LogprobOut]) -> Self {
        Self {
            kind: "output_text",
            text,
            annotations: Vec::new(),
            logprobs: entries(logprobs),
        }
    }
}

/// Named tokens in this API's shape (the chat completion entries').
fn entries(logprobs: &[LogprobOut]) -> Vec<TokenLogprob> {
    logprobs
        .iter()
        .map(|t| {
            let chosen = TopLogprob::from(&t.chosen);
            TokenLogprob {
                token: chosen.token,
                logprob: chosen.logprob,
                bytes: chosen.bytes,
                top_logprobs: t.top.iter().map(TopLogprob::from).collect(),
            }
        })
        .collect()
}

/// `usage` in the Responses API's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ResponseUsage {
    /// Prompt tokens.
    pub input_tokens: u32,
    /// `{"cached_tokens": n}`: prompt tokens served from a KV cache.
    pub input_tokens_details: CachedTokens,
    /// Generated tokens.
    pub output_tokens: u32,
    /// `{"reasoning_tokens": 0}`.
    pub output_tokens_details: ReasoningTokens,
    /// Their sum.
    pub total_tokens: u32,
}

/// `input_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CachedTokens {
    /// Prompt tokens served from a KV cache.
    pub cached_tokens: u32,
}

/// `output_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ReasoningTokens {
    /// Always 0.
    pub reasoning_tokens: u32,
}

impl From<Usage> for ResponseUsage {
    fn from(u: Usage) -> Self {
        Self {
            input_tokens: u.prompt_tokens,
            input_tokens_details: CachedTokens {
                cached_tokens: u.cached_prompt_tokens,
            },
            output_tokens: u.completion_tokens,
            output_tokens_details: ReasoningTokens {
                reasoning_tokens: 0,
            },
            total_tokens: u.prompt_tokens.saturating_add(u.completion_tokens),
        }
    }
}

/// What a response's objects share, fixed when the request is accepted.
#[derive(Debug, Clone)]
struct Shape {
    meta: Meta,
    message_id: String,
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    temperature: f64,
    top_p: f64,
    metadata: Value,
    /// The response's `text`: the request's format, or `{"format": {"type": "text"}}`.
    text: Value,
}

impl Shape {
    fn new(meta: Meta, req: &ResponsesRequest) -> Self {
        Self {
            message_id: format!("msg_{:032x}", rand::random::<u128>()),
            meta,
            instructions: req.instructions.clone(),
            max_output_tokens: req.max_output_tokens,
            temperature: req.temperature.unwrap_or(1.0),
            top_p: req.top_p.unwrap_or(1.0),
            metadata: req.metadata.clone().unwrap_or_else(|| json!({})),
            text: req
                .text
                .as_ref()
                .and_then(|t| t.get("format"))
                .filter(|f| !f.is_null())
                .map_or_else(
                    || json!({"format": {"type": "text"}}),
                    |f| json!({"format": f}),
                ),
        }
    }

    /// The message item with `text` so far (`None`: no part yet).
    fn message(
        &self,
        status: &'static str,
        text: Option<(String, &[LogprobOut])>,
    ) -> OutputMessage {
        OutputMessage {
            kind: "message",
            id: self.message_id.clone(),
            status,
            role: "assistant",
            content: text
                .map(|(t, lp)| OutputText::new(t, lp))
                .into_iter()
                .collect(),
        }
    }

    /// The response object: in progress (no `finish`), or finished with its text, its
    /// tokens' log-probabilities (when asked for) and usage.
    fn object(&self, done: Option<Done<'_>>) -> ResponseObject {
        let (status, output, incomplete, usage) = match done {
            None => ("in_progress", Vec::new(), None, None),
            Some(Done {
                text,
                logprobs,
                finish,
                usage,
            }) => {
                let status = status_of(finish);
                let incomplete = (finish == FinishReason::Length)
                    .then(|| json!({"reason": "max_output_tokens"}));
                let item = self.message(status, Some((text.to_string(), logprobs)));
                (status, vec![item], incomplete, Some(usage.into()))
            }
        };
        ResponseObject {
            id: self.meta.id.clone(),
            object: "response",
            created_at: self.meta.created,
            status,
            error: None,
            incomplete_details: incomplete,
            instructions: self.instructions.clone(),
            max_output_tokens: self.max_output_tokens,
            model: self.meta.model.clone(),
            output,
            parallel_tool_calls: true,
            previous_response_id: None,
            reasoning: json!({"effort": null, "summary": null}),
            store: false,
            temperature: self.temperature,
            text: self.text.clone(),
            tool_choice: "none",
            tools: Vec::new(),
            top_p: self.top_p,
            truncation: "disabled",
            usage,
            metadata: self.metadata.clone(),
        }
    }
}

/// A finished generation, as the final object shows it.
#[derive(Debug, Clone, Copy)]
struct Done<'a> {
    text: &'a str,
    logprobs: &'a [LogprobOut],
    finish: FinishReason,
    usage: Usage,
}

/// `completed`, or `incomplete` when the token limit cut the text.
fn status_of(finish: FinishReason) -> &'static str {
    match finish {
        FinishReason::Stop => "completed",
        FinishReason::Length => "incomplete",
    }
}

/// The handler.
pub async fn responses(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    caller: Caller,
    ApiJson(req): ApiJson<ResponsesRequest>,
) -> Response {
    let meta = Meta::new("resp", &state);
    let span = generate::request_span(&state, &headers, Operation::Chat, ROUTE, &meta.id);
    let params = match req.into_params(&meta.id) {
        Ok(p) => p,
        Err(e) => return generate::reject(&state, e, &span),
    };
    // Tokens are named only for requests that asked for their log-probabilities.
    let namer = params
        .logprobs
        .is_some()
        .then(|| Namer::new(state.validator.tokenizer().tokenizer().clone()));
    let events = match generate::start(&state, &caller, params, span.clone()).await {
        Ok(events) => events,
        Err(e) => return own_names(e).into_response(),
    };
    let shape = Shape::new(meta, &req);
    if req.stream {
        let stream = Box::pin(stream_events(shape, events, namer, span.clone()));
        sse::named_events(crate::spans::InSpan::new(stream, span))
    } else {
        whole(shape, events, namer).instrument(span).await
    }
}

/// The validator's error in this API's field names (`max_tokens` is `max_output_tokens` here).
fn own_names(mut e: ApiError) -> ApiError {
    if e.param.as_deref() == Some("max_tokens") {
        e.param = Some("max_output_tokens".into());
        e.message = e.message.replace("`max_tokens`", "`max_output_tokens`");
    }
    e
}

/// The non-streamed response, once the generation finished.
async fn whole(shape: Shape, mut events: GenerationStream, mut namer: Option<Namer>) -> Response {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    while let Some(item) = events.next().await {
        match item {
            Ok(event) => {
                text.push_str(&event.text);
                if let Some(n) = namer.as_mut() {
                    logprobs.extend(n.name_all(&event.logprobs));
                }
                if let (Some(finish), Some(usage)) = (event.finish, event.usage) {
                    let done = Done {
                        text: &text,
                        logprobs: &logprobs,
                        finish,
                        usage,
                    };
                    return Json(shape.object(Some(done))).into_response();
                }
            }
            Err(e) => {
                log_failure(&e);
                return ApiError::from(e).into_response();
            }
        }
    }
    let e = RequestError::Internal("the generation ended without a finish".into());
    log_failure(&e);
    ApiError::from(e).into_response()
}

/// Numbers the events of one stream and names them by their `type`.
struct Events {
    next: u64,
}

impl Events {
    fn event(&mut self, kind: &'static str, mut body: Value) -> (&'static str, sse::Chunk) {
        if let Some(o) = body.as_object_mut() {
            o.insert("type".into(), json!(kind));
            o.insert("sequence_number".into(), json!(self.next));
        }
        self.next += 1;
        (kind, sse::Chunk::json(&body))
    }
}

/// The typed events of a streamed response.
fn stream_events(
    shape: Shape,
    mut events: GenerationStream,
    mut namer: Option<Namer>,
    span: tracing::Span,
) -> impl futures::Stream<Item = (&'static str, sse::Chunk)> + Send {
    async_stream::stream! {
        let mut ev = Events { next: 0 };
        let item_id = shape.message_id.clone();
        let at = |extra: Value| {
            let mut v = json!({"item_id": item_id, "output_index": 0, "content_index": 0});
            if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
                o.extend(e);
            }
            v
        };
        yield ev.event("response.created", json!({"response": shape.object(None)}));
        yield ev.event("response.in_progress", json!({"response": shape.object(None)}));
        yield ev.event(
            "response.output_item.added",
            json!({"output_index": 0, "item": shape.message("in_progress", None)}),
        );
        yield ev.event(
            "response.content_part.added",
            at(json!({"part": OutputText::new(String::new(), &[])})),
        );
        let mut text = String::new();
        // Every token's log-probabilities (for the closing events), and those whose text is not
        // out yet (an incomplete character or a possible stop string), which wait for the delta
        // that carries it.
        let (mut all, mut pending): (Vec<LogprobOut>, Vec<LogprobOut>) = (Vec::new(), Vec::new());
        while let Some(item) = events.next().await {
            match item {
                Ok(event) => {
                    if let Some(n) = namer.as_mut() {
                        pending.extend(n.name_all(&event.logprobs));
                    }
                    if !event.text.is_empty() {
                        text.push_str(&event.text);
                        let lp = entries(&pending);
                        all.append(&mut pending);
                        yield ev.event(
                            "response.output_text.delta",
                            at(json!({"delta": event.text, "logprobs": lp})),
                        );
                    }
                    let (Some(finish), Some(usage)) = (event.finish, event.usage) else {
                        continue;
                    };
                    // Tokens whose text is not out (a stop string cut it, or it ends in an
                    // incomplete character) still count, as on chat: their entries go out in
                    // a last delta without text.
                    if !pending.is_empty() {
                        let lp = entries(&pending);
                        all.append(&mut pending);
                        yield ev.event(
                            "response.output_text.delta",
                            at(json!({"delta": "", "logprobs": lp})),
                        );
                    }
                    let status = status_of(finish);
                    yield ev.event(
                        "response.output_text.done",
                        at(json!({"text": text, "logprobs": entries(&all)})),
                    );
                    yield ev.event(
                        "response.content_part.done",
                        at(json!({"part": OutputText::new(text.clone(), &all)})),
                    );
                    yield ev.event(
                        "response.output_item.done",
                        json!({"output_index": 0, "item": shape.message(status, Some((text.clone(), &all)))}),
                    );
                    let last = if finish == FinishReason::Length {
                        "response.incomplete"
                    } else {
                        "response.completed"
                    };
                    let done = Done { text: &text, logprobs: &all, finish, usage };
                    yield ev.event(last, json!({"response": shape.object(Some(done))}));
                    return;
                }
                Err(e) => {
                    span.in_scope(|| log_failure(&e));
                    let body = ApiError::from(e).body();
                    let err = body.get("error").cloned().unwrap_or(body);
                    yield ev.event("error", json!({
                        "code": err.get("code"),
                        "message": err.get("message"),
                        "param": err.get("param"),
                    }));
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> ResponsesRequest {
        serde_json::from_value(body).expect("a valid body")
    }

    fn turns(m: &[ChatMessage]) -> Vec<(String, String)> {
        m.iter()
            .map(|m| (m.role.clone(), m.content.clone()))
            .collect()
    }

    #[test]
    fn input_becomes_the_chat_turns_after_the_instructions() {
        let r = request(json!({"input": "Who?", "instructions": "Be brief."}));
        let want = [("system", "Be brief."), ("user", "Who?")]
            .map(|(r, c)| (r.to_string(), c.to_string()));
        assert_eq!(turns(&r.messages().unwrap()), want);
        let r = request(json!({"input": [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Who"}, {"type": "input_text", "text": "?"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "God."}]},
            {"role": "user", "content": "When?"}
        ]}));
        let want = [
            ("system", "Be brief."),
            ("user", "Who?"),
            ("assistant", "God."),
            ("user", "When?"),
        ]
        .map(|(r, c)| (r.to_string(), c.to_string()));
        assert_eq!(turns(&r.messages().unwrap()), want);
    }

    #[test]
    fn a_finished_object_says_why_it_stopped() {
        let meta = Meta {
            id: "resp_1".into(),
            created: 7,
            model: "tiny-k3".into(),
            tools: None,
            n: 1,
        };
        let shape = Shape::new(
            meta,
            &request(json!({"input": "x", "max_output_tokens": 3})),
        );
        let usage = Usage {
            prompt_tokens: 5,
            completion_tokens: 3,
            cached_prompt_tokens: 2,
        };
        let done = |finish| Done {
            text: "abc",
            logprobs: &[],
            finish,
            usage,
        };
        let cut = serde_json::to_value(shape.object(Some(done(FinishReason::Length)))).unwrap();
        assert_eq!(cut["status"], "incomplete");
        assert_eq!(cut["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(cut["output"][0]["status"], "incomplete");
        assert_eq!(cut["output"][0]["content"][0]["text"], "abc");
        assert_eq!(cut["usage"]["input_tokens"], 5);
        assert_eq!(cut["usage"]["input_tokens_details"]["cached_tokens"], 2);
        assert_eq!(cut["usage"]["total_tokens"], 8);
        let stop = serde_json::to_value(shape.object(Some(done(FinishReason::Stop)))).unwrap();
        assert_eq!(stop["status"], "completed");
        assert!(stop["incomplete_details"].is_null());
        let open = serde_json::to_value(shape.object(None)).unwrap();
        assert_eq!(open["status"], "in_progress");
        assert_eq!(open["output"], json!([]));
        assert!(open["usage"].is_null());
    }
}
