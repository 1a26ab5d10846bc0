//! The request plumbing both generation endpoints share, written once:
//!
//! ```text
//! handle::<E>(body)
//!   Meta (id `{E::ID_PREFIX}-…`), request span (parent from `traceparent`)
//!   E::into_params → 400 naming the field            (reject)
//!   key slot → validate → key tokens → dispatch, in the span → error status   (start)
//!   stream: E::opening per sample, E::delta per event (tagged with its sample's index),
//!           E::usage after the last sample's finish, then `[DONE]`; an error mid-stream is
//!           one error chunk
//!   whole:  text accumulated per sample until every sample finished → E::whole(choices)
//!   tools (chat, `Meta::tools`): each sample's text held back while it may be a tool call; a
//!           parsed call → E::tool_calls (streamed) / the choice's calls instead of the text
//! ```
//!
//! An [`Endpoint`] says only what differs: its body type, its names, and the shapes of its
//! chunks and whole response (`completions.rs`, `chat.rs`). `responses.rs`, whose stream is
//! typed events rather than chunks, uses the span, admission and dispatch steps directly.
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use tracing::Instrument;

use super::error::ApiError;
use super::logprobs::{LogprobOut, Namer};
use super::openai::UsageOut;
use super::sse::{self, Chunk};
use super::tools::ToolCallOut;
use crate::auth::Caller;
use crate::dispatch::GenerationStream;
use crate::error::{log_failure, RequestError};
use crate::output::FinishReason;
use crate::spans::{self, FrontDoor, InSpan, Operation};
use crate::state::AppState;
use crate::tools::Tools;
use crate::validate::{GenerateParams, ValidationError};

/// What one generation endpoint adds to the shared plumbing.
pub(crate) trait Endpoint: 'static {
    /// The JSON body.
    type Request;
    /// The route, for the span's `http.route`.
    const ROUTE: &'static str;
    /// `gen_ai.operation.name`.
    const OPERATION: Operation;
    /// The prefix of response ids: `cmpl`, `chatcmpl`.
    const ID_PREFIX: &'static str;

    /// `(stream, stream_options.include_usage)` of the body.
    fn stream_options(req: &Self::Request) -> (bool, bool);

    /// The body → the parameters to validate (`meta.id` is the request id; an endpoint with
    /// tools sets `meta.tools`); errors name the field.
    fn into_params(req: Self::Request, meta: &mut Meta) -> Result<GenerateParams, ValidationError>;

    /// The chunk sent before any token of sample `index`, if the endpoint has one. `usage` is
    /// what every chunk before the usage chunk carries (absent, or null with `include_usage`).
    fn opening(meta: &Meta, index: u32, usage: Option<Option<UsageOut>>) -> Option<Chunk>;

    /// A chunk with new text of sample `index` (`choices[index]`), its tokens'
    /// log-probabilities (when the request asked) and, on the sample's last one, the finish
    /// reason.
    fn delta(
        meta: &Meta,
        index: u32,
        text: String,
        logprobs: Option<&[LogprobOut]>,
        end: End,
    ) -> Chunk;

    /// The usage-only chunk after the finish (with `include_usage`).
    fn usage(meta: &Meta, usage: UsageOut) -> Chunk;

    /// The non-streamed response: every sample's choice, in index order (with every token's
    /// log-probabilities when the request asked).
    fn whole(meta: Meta, choices: Vec<WholeChoice>, usage: UsageOut) -> Response;

    /// The last chunk of sample `index` when its reply is tool calls (only endpoints whose
    /// [`Meta::tools`] can be set, i.e. chat, override it; by default the calls' JSON text).
    fn tool_calls(
        meta: &Meta,
        index: u32,
        calls: Vec<ToolCallOut>,
        logprobs: Option<&[LogprobOut]>,
        end: End,
    ) -> Chunk {
        let text = serde_json::to_string(&calls).unwrap_or_default();
        Self::delta(meta, index, text, logprobs, end)
    }
}

/// One sample's whole reply.
#[derive(Debug, Clone)]
pub(crate) struct WholeChoice {
    /// Its text (with tool calls, the raw text they were parsed from).
    pub text: String,
    /// Its tokens' log-probabilities, when the request asked.
    pub logprobs: Option<Vec<LogprobOut>>,
    /// Why it ended.
    pub finish: FinishReason,
    /// The tool calls parsed from `text` (chat with tools), instead of content.
    pub calls: Option<Vec<ToolCallOut>>,
}

impl WholeChoice {
    /// `calls` as JSON text when there are calls (for an endpoint without tool calls), else
    /// the text.
    pub fn text_or_calls(&self) -> String {
        match &self.calls {
            Some(calls) => serde_json::to_string(calls).unwrap_or_default(),
            None => self.text.clone(),
        }
    }
}

/// How a chunk relates to the end of the stream: the finish reason on the last content chunk,
/// and the `usage` every chunk before the usage chunk carries (absent, or null with
/// `include_usage`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct End {
    pub finish: Option<FinishReason>,
    pub usage: Option<Option<UsageOut>>,
}

/// What every response of one request carries besides the events.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    /// The request's tools when its output is parsed for tool calls (chat with tools and a
    /// `tool_choice` other than `none`).
    pub tools: Option<Arc<Tools>>,
    /// Samples of the prompt (`n`, clamped to [1, `MAX_SAMPLES`]; validation refuses others
    /// before any response).
    pub n: u32,
    /// The prompt each choice's text starts with (completions' `echo`); set by the endpoint,
    /// resolved to text once the request is validated.
    pub echo: Option<Echo>,
}

/// The prompt a reply repeats (completions' `echo`), as vLLM does: a text prompt as given, a
/// token-id prompt decoded (on the blocking pool, after validation). Streamed, it comes first
/// in each choice's first chunk, with the prompt tokens' log-probabilities when asked; whole,
/// it starts each choice's `text`.
#[derive(Debug, Clone)]
pub(crate) enum Echo {
    /// The prompt's text.
    Text(String),
    /// A token-id prompt, not decoded yet.
    Tokens(Vec<u32>),
}

impl Echo {
    /// The text to repeat.
    fn text(&self) -> &str {
        match self {
            Echo::Text(t) => t,
            Echo::Tokens(_) => "",
        }
    }
}

impl Meta {
    pub(crate) fn new(prefix: &str, state: &AppState) -> Self {
        Self {
            id: format!("{prefix}-{:032x}", rand::random::<u128>()),
            created: unix_now(),
            model: state.model.name.clone(),
            tools: None,
            n: 1,
            echo: None,
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One generation request on endpoint `E`, streamed or whole.
pub(crate) async fn handle<E: Endpoint>(
    state: Arc<AppState>,
    headers: HeaderMap,
    caller: Caller,
    req: E::Request,
) -> Response {
    let mut meta = Meta::new(E::ID_PREFIX, &state);
    let span = request_span(&state, &headers, E::OPERATION, E::ROUTE, &meta.id);
    let (stream, include_usage) = E::stream_options(&req);
    let params = match E::into_params(req, &mut meta) {
        Ok(p) => p,
        Err(e) => return reject(&state, e, &span),
    };
    meta.n = params
        .n
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(1)
        .clamp(1, crate::validate::MAX_SAMPLES);
    // Tokens are named only for requests that asked for their log-probabilities.
    let namer = params.logprobs.is_some().then(|| {
        let tokenizer = state.validator.tokenizer().tokenizer();
        (0..meta.n)
            .map(|_| Namer::new(tokenizer.clone()))
            .collect::<Vec<_>>()
    });
    let events = match start(&state, &caller, params, span.clone()).await {
        Ok(events) => events,
        Err(e) => return e.into_response(),
    };
    if let Some(Echo::Tokens(ids)) = &meta.echo {
        let ids = ids.clone();
        let text = state
            .validator
            .tokenizer()
            .decode(ids)
            .instrument(span.clone())
            .await;
        match text {
            Ok(t) => meta.echo = Some(Echo::Text(t)),
            Err(e) => {
                span.in_scope(|| log_failure(&e));
                return ApiError::from(e).into_response();
            }
        }
    }
    if stream {
        let chunks = Box::pin(chunks::<E>(
            meta,
            events,
            namer,
            include_usage,
            span.clone(),
        ));
        sse::response(InSpan::new(chunks, span))
    } else {
        whole::<E>(meta, events, namer, span.clone())
            .instrument(span)
            .await
    }
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

/// Admits (the key's limits, `limits.rs`), validates and dispatches in the request's span;
/// logs and counts a failure once.
pub(crate) async fn start(
    state: &AppState,
    caller: &Caller,
    params: GenerateParams,
    span: tracing::Span,
) -> Result<GenerationStream, ApiError> {
    let requested = if params.model.is_empty() {
        state.model.name.clone()
    } else {
        params.model.clone()
    };
    ferry_proto::trace_ctx::set_attribute(&span, "gen_ai.request.model", requested);
    caller.record(&span);
    let started = async {
        let admission = caller.admit()?;
        let valid = state.validator.validate(params).await?;
        caller.charge(&valid)?;
        Ok(admission.hold(state.dispatcher.generate(valid).await?))
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
pub(crate) fn reject(state: &AppState, e: ValidationError, span: &tracing::Span) -> Response {
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

/// The SSE chunks of a streamed response (without the `[DONE]` terminator): each sample's
/// opening, its deltas tagged with its index (its last one with its finish), then the usage
/// chunk after the last sample's finish.
fn chunks<E: Endpoint>(
    meta: Meta,
    mut events: GenerationStream,
    mut namers: Option<Vec<Namer>>,
    include_usage: bool,
    span: tracing::Span,
) -> impl futures::Stream<Item = Chunk> + Send {
    let null_usage = include_usage.then_some(None);
    let n = meta.n as usize;
    async_stream::stream! {
        for index in 0..meta.n {
            if let Some(opening) = E::opening(&meta, index, null_usage) {
                yield opening;
            }
        }
        // Per sample: log-probabilities of tokens whose text is not out yet (an incomplete
        // character or a possible stop string) wait for the chunk that carries it.
        let mut pending: Vec<Vec<LogprobOut>> = vec![Vec::new(); n];
        // Per sample: text held back while it may be a tool call (`Meta::tools`); `None` once
        // it is not.
        let mut held: Vec<Option<String>> = vec![meta.tools.as_ref().map(|_| String::new()); n];
        // Per sample: whether its first chunk (which carries the echoed prompt) went out.
        let mut echoed = vec![false; n];
        while let Some(item) = events.next().await {
            match item {
                Ok(event) => {
                    let index = event.index;
                    let i = (index as usize).min(n - 1);
                    if let Some(namer) = namers.as_mut().and_then(|v| v.get_mut(i)) {
                        if let Some(prompt) = event.prompt_logprobs.as_deref() {
                            pending[i].extend(namer.name_prompt(prompt));
                        }
                        pending[i].extend(namer.name_all(&event.logprobs));
                    }
                    let mut text = event.text;
                    // The prompt comes first in the choice's first chunk (vLLM's order).
                    if let Some(echo) = meta.echo.as_ref().filter(|_| !echoed[i]) {
                        echoed[i] = true;
                        text.insert_str(0, echo.text());
                    }
                    if let (Some(h), Some(tools)) = (held[i].as_mut(), meta.tools.as_ref()) {
                        h.push_str(&text);
                        if event.finish.is_none() {
                            if tools.may_be_call(h) {
                                continue;
                            }
                        } else if let Some(calls) = chat_calls(tools, h) {
                            let logprobs = namers.as_ref().map(|_| std::mem::take(&mut pending[i]));
                            let end = End { finish: event.finish, usage: null_usage };
                            yield E::tool_calls(&meta, index, calls, logprobs.as_deref(), end);
                            if let (true, Some(usage)) = (include_usage, event.usage) {
                                yield E::usage(&meta, usage.into());
                            }
                            continue;
                        }
                        // Not a call: everything held goes out as content.
                        text = std::mem::take(h);
                        held[i] = None;
                    }
                    if text.is_empty() && event.finish.is_none() {
                        continue;
                    }
                    let logprobs = namers.as_ref().map(|_| std::mem::take(&mut pending[i]));
                    let end = End { finish: event.finish, usage: null_usage };
                    yield E::delta(&meta, index, text, logprobs.as_deref(), end);
                    if let (true, Some(usage)) = (include_usage, event.usage) {
                        yield E::usage(&meta, usage.into());
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

/// The calls a sample's whole `text` makes, in chat's shape.
fn chat_calls(tools: &Tools, text: &str) -> Option<Vec<ToolCallOut>> {
    tools
        .parse_calls(text)
        .map(|calls| calls.into_iter().map(ToolCallOut::from).collect())
}

/// The whole response, once every sample finished.
async fn whole<E: Endpoint>(
    meta: Meta,
    mut events: GenerationStream,
    mut namers: Option<Vec<Namer>>,
    span: tracing::Span,
) -> Response {
    let n = meta.n as usize;
    let echo = meta.echo.as_ref().map_or("", Echo::text);
    let mut texts = vec![echo.to_string(); n];
    let mut logprobs: Vec<Vec<LogprobOut>> = vec![Vec::new(); n];
    let mut finishes: Vec<Option<FinishReason>> = vec![None; n];
    while let Some(item) = events.next().await {
        match item {
            Ok(event) => {
                let i = (event.index as usize).min(n - 1);
                texts[i].push_str(&event.text);
                if let Some(namer) = namers.as_mut().and_then(|v| v.get_mut(i)) {
                    if let Some(prompt) = event.prompt_logprobs.as_deref() {
                        logprobs[i].extend(namer.name_prompt(prompt));
                    }
                    logprobs[i].extend(namer.name_all(&event.logprobs));
                }
                if event.finish.is_some() {
                    finishes[i] = event.finish;
                }
                if let Some(usage) = event.usage {
                    let asked = namers.is_some();
                    let choices = texts
                        .into_iter()
                        .zip(logprobs)
                        .zip(finishes)
                        .map(|((text, lps), finish)| WholeChoice {
                            calls: meta.tools.as_ref().and_then(|t| chat_calls(t, &text)),
                            text,
                            logprobs: asked.then_some(lps),
                            finish: finish.unwrap_or(FinishReason::Stop),
                        })
                        .collect();
                    return E::whole(meta, choices, usage.into());
                }
            }
            Err(e) => {
                span.in_scope(|| log_failure(&e));
                return ApiError::from(e).into_response();
            }
        }
    }
    let e = RequestError::Internal("the generation ended without a finish".into());
    span.in_scope(|| log_failure(&e));
    ApiError::from(e).into_response()
}
