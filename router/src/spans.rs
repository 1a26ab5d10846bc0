//! The router's spans: one `request` server span per client request (a child of the caller's
//! `traceparent`, if any), with OpenTelemetry GenAI semantic-convention attributes.
//!
//! ```text
//!  request  (server; HTTP `traceparent` / gRPC metadata → parent)   front door: http/, grpc.rs
//!  ├─ route     policy, chosen workers, predicted cached blocks       dispatch.rs
//!  └─ dispatch  (client) DecodeWorker/Decode, context → metadata     dispatch.rs
//!       └─ decode (server, decode worker) → remote_prefill → prefill → kv_transfer → kv_receive
//! ```
//!
//! Semantic-convention attributes are set with [`trace_ctx::set_attribute`]: exported, but
//! not `tracing` fields, so log lines stay short. Spans end at their last exit, so every span
//! that outlives its handler is entered while its response streams ([`InSpan`]).
use std::pin::Pin;
use std::task::{Context, Poll};

use ferry_proto::trace_ctx;
use futures::Stream;
use tracing::{field, Span};

use crate::error::{log_failure, RequestError};
use crate::metrics::RouterMetrics;
use crate::output::{FinishReason, Usage};
use crate::validate::ValidRequest;

/// What the client asked for (`gen_ai.operation.name`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// `/v1/completions`, gRPC `Generate`.
    TextCompletion,
    /// `/v1/chat/completions`.
    Chat,
}

impl Operation {
    /// The semantic-convention value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TextCompletion => "text_completion",
            Self::Chat => "chat",
        }
    }
}

/// Where a request came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrontDoor {
    /// The OpenAI HTTP API, with its route.
    Http(&'static str),
    /// `ferry.v1.Inference/Generate`.
    Grpc,
}

/// The `request` span of one client request, named `{operation} {model}` as the GenAI
/// conventions ask. Set its remote parent right away ([`trace_ctx::set_parent_from_headers`]).
pub fn request_span(door: FrontDoor, operation: Operation, served_model: &str) -> Span {
    let api = match door {
        FrontDoor::Http(_) => "http",
        FrontDoor::Grpc => "grpc",
    };
    let span = tracing::info_span!(
        "request",
        otel.name = %format!("{} {served_model}", operation.as_str()),
        otel.kind = "server",
        request_id = field::Empty,
        api,
    );
    trace_ctx::set_attribute(&span, "gen_ai.operation.name", operation.as_str());
    trace_ctx::set_attribute(&span, "gen_ai.response.model", served_model.to_string());
    match door {
        FrontDoor::Http(route) => {
            trace_ctx::set_attribute(&span, "http.request.method", "POST");
            trace_ctx::set_attribute(&span, "http.route", route);
        }
        FrontDoor::Grpc => {
            trace_ctx::set_attribute(&span, "rpc.system", "grpc");
            trace_ctx::set_attribute(&span, "rpc.service", "ferry.v1.Inference");
            trace_ctx::set_attribute(&span, "rpc.method", "Generate");
        }
    }
    span
}

/// A count as an OpenTelemetry integer (`tracing` exports unsigned fields as strings).
pub fn int(v: impl TryInto<i64>) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

/// The validated request's parameters, on the current (request) span.
pub fn record_request(req: &ValidRequest) {
    let span = Span::current();
    let s = req.sampling();
    trace_ctx::set_attribute(&span, "gen_ai.response.id", req.id().0.clone());
    trace_ctx::set_attribute(&span, "gen_ai.request.max_tokens", int(req.max_tokens()));
    trace_ctx::set_attribute(
        &span,
        "gen_ai.request.temperature",
        f64::from(s.temperature),
    );
    trace_ctx::set_attribute(&span, "gen_ai.request.top_p", f64::from(s.top_p));
    trace_ctx::set_attribute(&span, "gen_ai.request.top_k", int(s.top_k));
    let c = &s.controls;
    if c.presence_penalty != 0.0 {
        let p = f64::from(c.presence_penalty);
        trace_ctx::set_attribute(&span, "gen_ai.request.presence_penalty", p);
    }
    if c.frequency_penalty != 0.0 {
        let p = f64::from(c.frequency_penalty);
        trace_ctx::set_attribute(&span, "gen_ai.request.frequency_penalty", p);
    }
    if let Some(seed) = s.seed {
        trace_ctx::set_attribute(&span, "gen_ai.request.seed", int(seed));
    }
    trace_ctx::set_attribute(&span, "gen_ai.usage.input_tokens", int(req.prompt().len()));
    if let Some(on) = req.speculative() {
        trace_ctx::set_attribute(&span, "ferry.spec.requested", on);
    }
}

/// Usage and finish reason of a finished request, on `span`.
///
/// Input tokens were set with the request ([`record_request`]).
pub fn record_finish(span: &Span, usage: &Usage, finish: FinishReason) {
    trace_ctx::set_attribute(
        span,
        "gen_ai.usage.output_tokens",
        int(usage.completion_tokens),
    );
    trace_ctx::set_attribute(
        span,
        "gen_ai.usage.cache_read.input_tokens",
        int(usage.cached_prompt_tokens),
    );
    trace_ctx::set_attribute(span, "gen_ai.response.finish_reasons", finish.as_str());
}

/// A request failed before its stream started: log it once, count it, mark the span.
pub fn request_failed(metrics: &RouterMetrics, span: &Span, e: &RequestError) {
    span.in_scope(|| log_failure(e));
    metrics.failure.with_label_values(&[e.kind()]).inc();
    mark_failed(span, e);
}

/// Marks `span` failed with `e` (`error.type` is the error's kind).
pub fn mark_failed(span: &Span, e: &RequestError) {
    trace_ctx::set_attribute(span, "error.type", e.kind());
    trace_ctx::set_error(span, e.to_string());
}

/// A stream polled inside `span`, so the span stays current while the stream runs and ends
/// when the stream does.
pub struct InSpan<S> {
    inner: S,
    span: Span,
}

impl<S> InSpan<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, span: Span) -> Self {
        Self { inner, span }
    }
}

impl<S: Stream + Unpin> Stream for InSpan<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let this = &mut *self;
        let _entered = this.span.enter();
        Pin::new(&mut this.inner).poll_next(cx)
    }
}
