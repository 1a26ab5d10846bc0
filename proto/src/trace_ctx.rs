//! W3C trace context on every hop: HTTP headers, gRPC metadata and the KV-transfer hello.
//!
//! One trace follows a request through the router, the decode worker, the prefill worker and
//! the transfer connection. Each hop's *client* side injects the context of the span it is in
//! (`traceparent`, `tracestate`); the *server* side extracts it and makes it the parent of the
//! span it creates. The propagator is OpenTelemetry's [`TraceContextPropagator`]; nothing here
//! parses headers by hand.
//!
//! ```text
//!  HTTP client ──traceparent──► router `request` span
//!  router `dispatch` span ──metadata──► decode `decode` span
//!  decode `remote_prefill` span ──metadata──► prefill `prefill` span
//!  prefill `kv_transfer` span ──TransferHello.trace_context──► decode `kv_receive` span
//! ```
//!
//! Everything is a no-op when the process exports no traces (no OpenTelemetry layer is
//! installed): spans then have no OpenTelemetry context, nothing is injected, and a received
//! context is dropped. A span's parent can only be set before the span is first entered, so call
//! the `set_parent_*` functions right after creating it.
use std::collections::HashMap;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::Status;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::codegen::http::{HeaderMap, HeaderName, HeaderValue};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C header (and metadata key) that carries the trace and parent span ids.
pub const TRACEPARENT: &str = "traceparent";

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// Makes the context carried in `headers` the parent of `span`. `headers` are HTTP request
/// headers, or gRPC metadata through `MetadataMap::as_ref()`. Without a `traceparent` the span
/// stays where it is (a new root, or the child of the current span).
pub fn set_parent_from_headers(span: &Span, headers: &HeaderMap) {
    if !headers.contains_key(TRACEPARENT) {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    // Fails only when no OpenTelemetry layer is installed or the span is disabled: then there
    // is nothing to parent.
    let _ = span.set_parent(cx);
}

/// Makes the context in a gRPC request's metadata the parent of `span` (server side).
pub fn set_parent_from_request<T>(span: &Span, request: &tonic::Request<T>) {
    set_parent_from_headers(span, request.metadata().as_ref());
}

/// Writes `span`'s context into `headers`.
pub fn inject_headers(span: &Span, headers: &mut HeaderMap) {
    let cx = span.context();
    TraceContextPropagator::new().inject_context(&cx, &mut HeaderInjector(headers));
}

/// Writes `span`'s context into a gRPC request's metadata (client side).
pub fn inject_request<T>(span: &Span, request: &mut tonic::Request<T>) {
    inject_headers(span, request.metadata_mut().as_mut());
}

/// `span`'s context as a string map (for protobuf `map<string, string>` carriers such as
/// `TransferHello.trace_context`); empty when the span has no OpenTelemetry context.
pub fn to_carrier(span: &Span) -> HashMap<String, String> {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    carrier
}

/// Makes the context in a string-map carrier the parent of `span`.
pub fn set_parent_from_carrier(span: &Span, carrier: &HashMap<String, String>) {
    if !carrier.contains_key(TRACEPARENT) {
        return;
    }
    let _ = span.set_parent(TraceContextPropagator::new().extract(carrier));
}

/// Sets an OpenTelemetry attribute on `span` without making it a `tracing` field, so it is
/// exported but not printed in every log line (semantic-convention attributes such as
/// `gen_ai.usage.input_tokens`). A no-op when traces are not exported.
pub fn set_attribute(span: &Span, key: &'static str, value: impl Into<opentelemetry::Value>) {
    span.set_attribute(key, value);
}

/// Marks `span` as failed, with `description` as the status message.
pub fn set_error(span: &Span, description: impl Into<String>) {
    span.set_status(Status::error(description.into()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_an_exporter_nothing_is_injected_and_nothing_breaks() {
        let span = tracing::info_span!("test");
        let mut headers = HeaderMap::new();
        inject_headers(&span, &mut headers);
        assert!(headers.is_empty());
        assert!(to_carrier(&span).is_empty());
        headers.insert(
            TRACEPARENT,
            HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        );
        set_parent_from_headers(&span, &headers);
        set_attribute(&span, "gen_ai.usage.input_tokens", 3_i64);
        set_error(&span, "boom");
    }

    #[test]
    fn the_propagator_round_trips_a_traceparent_through_metadata_and_maps() {
        use opentelemetry::trace::TraceContextExt;
        let value = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut headers = HeaderMap::new();
        headers.insert(TRACEPARENT, HeaderValue::from_static(value));
        let cx = TraceContextPropagator::new().extract(&HeaderExtractor(&headers));
        assert_eq!(
            cx.span().span_context().trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        let mut out = HeaderMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut HeaderInjector(&mut out));
        assert_eq!(
            out.get(TRACEPARENT).and_then(|v| v.to_str().ok()),
            Some(value)
        );
        let mut map = HashMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut map);
        assert_eq!(map.get(TRACEPARENT).map(String::as_str), Some(value));
    }
}
