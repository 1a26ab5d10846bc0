//! The request plumbing both generation endpoints share, written once:
//!
//! ```text
//! handle::<E>(body)
//!   Meta (id `{E::ID_PREFIX}-…`), request span (parent from `traceparent`)
//!   E::into_params → 400 naming the field            (reject)
//!   key slot → validate → key tokens → dispatch, in the span → error status   (start)
//!   stream: E::opening, E::delta per event, E::usage after the finish, then `[DONE]`;
//!           an error mid-stream is one error chunk
//!   whole:  text accumulated until the finish → E::whole
//!   tools (chat, `Meta::tools`): text held back while it may be a tool call; a parsed call
//!           → E::tool_calls (streamed) / E::whole_tool_calls instead of the text
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
use super::tools::{ToolCallOut, Tools};
use crate::auth::Caller;
use crate::dispatch::GenerationStream;
use crate::error::{log_failure, RequestError};
use crate::output::FinishReason;
use crate::spans::{self, FrontDoor, InSpan, Operation};
use crate::state::AppState;
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

    /// The chunk sent before any token, if the endpoint has one. `usage` is what every chunk
    /// before the usage chunk carries (absent, or null with `include_usage`).
    fn opening(meta: &Meta, usage: Option<Option<UsageOut>>) -> Option<Chunk>;

    /// A chunk with new text, its tokens' log-probabilities (when the request asked) and, on
    /// the last one, the finish reason.
    fn delta(meta: &Meta, text: String, logprobs: Option<&[LogprobOut]>, end: End) -> Chunk;

    /// The usage-only chunk after the finish (with `include_usage`).
    fn usage(meta: &Meta, usage: UsageOut) -> Chunk;

    /// The non-streamed response (with every token's log-probabilities when the request
    /// asked).
    fn whole(
        meta: Meta,
        text: String,
        logprobs: Option<&[LogprobOut]>,
        finish: FinishReason,
        usage: UsageOut,
    ) -> Response;

    /// The last chunk of a streamed reply that is tool calls (only endpoints whose
    /// [`Meta::tools`] can be set, i.e. chat, override it; by default the calls' JSON text).
    fn tool_calls(
        meta: &Meta,
        calls: Vec<ToolCallOut>,
        logprobs: Option<&[LogprobOut]>,
        end: End,
    ) -> Chunk {
        let text = serde_json::to_string(&calls).unwrap_or_default();
        Self::delta(meta, text, logprobs, end)
    }

    /// The non-streamed reply that is tool calls (see [`Endpoint::tool_calls`]).
    fn whole_tool_calls(
        meta: Meta,
        calls: Vec<ToolCallOut>,
        logprobs: Option<&[LogprobOut]>,
        finish: FinishReason,
        usage: UsageOut,
    ) -> Response {
        let text = serde_json::to_string(&calls).unwrap_or_default();
        Self::whole(meta, text, logprobs, finish, usage)
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
}

impl Meta {
    pub(crate) fn new(prefix: &str, state: &AppState) -> Self {
        Self {
            id: format!("{prefix}-{:032x}", rand::random::<u128>()),
            created: unix_now(),
            model: state.model.name.clone(),
            tools: None,
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
    // Tokens are named only for requests that asked for their log-probabilities.
    let namer = params
        .logprobs
        .is_some()
        .then(|| Namer::new(state.validator.tokenizer().tokenizer().clone()));
    let events = match start(&state, &caller, params, span.clone()).await {
        Ok(events) => events,
        Err(e) => return e.into_response(),
    };
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

/// The SSE chunks of a streamed response (without the `[DONE]` terminator).
fn chunks<E: Endpoint>(
    meta: Meta,
    mut events: GenerationStream,
    mut namer: Option<Namer>,
    include_usage: bool,
    span: tracing::Span,
) -> impl futures::Stream<Item = Chunk> + Send {
    let null_usage = include_usage.then_some(None);
    async_stream::stream! {
        if let Some(opening) = E::opening(&meta, null_usage) {
            yield opening;
        }
        // Log-probabilities of tokens whose text is not out yet (an incomplete character or a
        // possible stop string) wait for the chunk that carries it.
        let mut pending: Vec<LogprobOut> = Vec::new();
        // Text held back while it may be a tool call (`Meta::tools`); `None` once it is not.
        let mut held: Option<String> = meta.tools.as_ref().map(|_| String::new());
        while let Some(item) = events.next().await {
            match item {
                Ok(event) => {
                    if let Some(n) = namer.as_mut() {
                        pending.extend(n.name_all(&event.logprobs));
                    }
                    let mut text = event.text;
                    if let (Some(h), Some(tools)) = (held.as_mut(), meta.tools.as_ref()) {
                        h.push_str(&text);
                        if event.finish.is_none() {
                            if tools.may_be_call(h) {
                                continue;
                            }
                        } else if let Some(calls) = tools.parse_calls(h) {
                            let logprobs = namer.as_ref().map(|_| std::mem::take(&mut pending));
                            let end = End { finish: event.finish, usage: null_usage };
                            yield E::tool_calls(&meta, calls, logprobs.as_deref(), end);
                            if let (true, Some(usage)) = (include_usage, event.usage) {
                                yield E::usage(&meta, usage.into());
                            }
                            continue;
                        }
                        // Not a call: everything held goes out as content.
                        text = std::mem::take(h);
                        held = None;
                    }
                    if text.is_empty() && event.finish.is_none() {
                        continue;
                    }
                    let logprobs = namer.as_ref().map(|_| std::mem::take(&mut pending));
                    let end = End { finish: event.finish, usage: null_usage };
                    yield E::delta(&meta, text, logprobs.as_deref(), end);
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

/// The whole response, once the generation finished.
async fn whole<E: Endpoint>(
    meta: Meta,
    mut events: GenerationStream,
    mut namer: Option<Namer>,
    span: tracing::Span,
) -> Response {
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
                    let logprobs = namer.as_ref().map(|_| logprobs.as_slice());
                    if let Some(calls) = meta.tools.as_ref().and_then(|t| t.parse_calls(&text)) {
                        return E::whole_tool_calls(meta, calls, logprobs, finish, usage.into());
                    }
                    return E::whole(meta, text, logprobs, finish, usage.into());
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
