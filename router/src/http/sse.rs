//! Server-sent events in OpenAI's framings: the chat and completion streams' `data: {json}\n\n`
//! per chunk, then `data: [DONE]`; the Responses API's `event: {type}` + `data: {json}` per
//! event, with no terminator.
use std::convert::Infallible;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::{stream, Stream, StreamExt};
use serde::Serialize;

/// The terminator every OpenAI stream ends with.
pub const DONE: &str = "[DONE]";

/// One SSE `data:` payload, already serialized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk(pub String);

impl Chunk {
    /// Serializes `value` (compact JSON: no newlines, so one `data:` line).
    pub fn json<T: Serialize>(value: &T) -> Self {
        Self(serde_json::to_string(value).unwrap_or_else(|e| {
            format!(r#"{{"error":{{"message":"cannot serialize a chunk: {e}","type":"internal_error","param":null,"code":"internal"}}}}"#)
        }))
    }
}

/// An SSE response sending `chunks`, then `[DONE]`. Dropping the response body (client gone)
/// drops `chunks`, which cancels the request upstream.
pub fn response<S>(chunks: S) -> Response
where
    S: Stream<Item = Chunk> + Send + 'static,
{
    let events = chunks
        .chain(stream::once(async { Chunk(DONE.to_string()) }))
        .map(|c| Ok::<_, Infallible>(Event::default().data(c.0)));
    Sse::new(events).into_response()
}

/// An SSE response sending each `(name, payload)` as an event named `name`, with no
/// terminator (the Responses API's framing). Dropping the body drops `events`, which cancels
/// the request upstream.
pub fn named_events<S>(events: S) -> Response
where
    S: Stream<Item = (&'static str, Chunk)> + Send + 'static,
{
    let events =
        events.map(|(name, c)| Ok::<_, Infallible>(Event::default().event(name).data(c.0)));
    Sse::new(events).into_response()
}
