//! What `/v1/responses` answers: the response object, its output items (one `message` with
//! one `output_text` part, or one `function_call` item per tool call) and the typed events of
//! a stream.
//!
//! **Streamed**, each SSE event is named by its `type` and numbered (`sequence_number`):
//!
//! ```text
//! response.created, response.in_progress
//! text:   response.output_item.added (message), response.content_part.added,
//!         response.output_text.delta per decoded chunk, response.output_text.done,
//!         response.content_part.done, response.output_item.done
//! calls:  per call i (output_index i): response.output_item.added (function_call, in
//!         progress, empty arguments), response.function_call_arguments.delta (the whole
//!         arguments), response.function_call_arguments.done, response.output_item.done
//! response.completed | response.incomplete (max_output_tokens)    — or one `error` event
//! ```
//!
//! With tools (a `tool_choice` other than none) the text is held back while it may still be a
//! call ([`Tools::may_be_call`]): the message item opens once it cannot be, or at the end when
//! the whole output is not a call; a call is parsed from the whole output
//! ([`Tools::parse_calls`], the code chat completions and gRPC use), so its arguments arrive in
//! one delta.
use futures::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::generate::Meta;
use super::logprobs::{LogprobOut, Namer, TopOut};
use super::responses::ResponsesRequest;
use super::sse;
use crate::dispatch::GenerationStream;
use crate::error::log_failure;
use crate::output::{FinishReason, Usage};
use crate::tools::{ToolCall, Tools};

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
    /// The message item (once it exists), or the function calls.
    pub output: Vec<OutputItem>,
    /// Always true (no effect: a constrained reply is one call, an unconstrained one may
    /// hold several).
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
    /// As sent; unset: `auto` with tools, else `none`.
    pub tool_choice: Value,
    /// As sent (the function tools).
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

/// One output item.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum OutputItem {
    /// The text.
    Message(OutputMessage),
    /// A tool call.
    FunctionCall(FunctionCallItem),
}

/// A `function_call` output item: one call parsed from the output.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCallItem {
    /// Always `function_call`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// `fc_…`: the item's id.
    pub id: String,
    /// `call_…`: what a `function_call_output` input item answers.
    pub call_id: String,
    /// The function.
    pub name: String,
    /// Its arguments as JSON text (empty while in progress, in the stream).
    pub arguments: String,
    /// `in_progress` (in the stream's `output_item.added`) or `completed`.
    pub status: &'static str,
}

impl FunctionCallItem {
    fn new(call: ToolCall) -> Self {
        Self {
            kind: "function_call",
            id: format!("fc_{:032x}", rand::random::<u128>()),
            call_id: call.id,
            name: call.name,
            arguments: call.arguments,
            status: "completed",
        }
    }
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
pub(super) fn shortest_f64(x: f32) -> f64 {
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
pub(super) struct Shape {
    /// Id, creation time, model; `meta.tools` when the output is parsed for tool calls.
    pub meta: Meta,
    message_id: String,
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    temperature: f64,
    top_p: f64,
    metadata: Value,
    /// The response's `text`: the request's format, or `{"format": {"type": "text"}}`.
    text: Value,
    /// The request's `tools`, echoed.
    tools: Vec<Value>,
    /// The request's `tool_choice`, echoed (`auto` with tools, else `none`, when unset).
    tool_choice: Value,
}

impl Shape {
    pub(super) fn new(meta: Meta, req: &ResponsesRequest) -> Self {
        let tools = req
            .tools
            .as_ref()
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let tool_choice = match req.tool_choice.as_ref().filter(|c| !c.is_null()) {
            Some(c) => c.clone(),
            None if tools.is_empty() => json!("none"),
            None => json!("auto"),
        };
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
            tools,
            tool_choice,
        }
    }

    /// The tools the output is parsed with, if any.
    fn tools(&self) -> Option<&Tools> {
        self.meta.tools.as_deref()
    }

    /// The function-call items of a whole output that is tool calls; `None` when it is text.
    pub(super) fn calls(&self, text: &str) -> Option<Vec<FunctionCallItem>> {
        let calls = self.tools()?.parse_calls(text)?;
        Some(calls.into_iter().map(FunctionCallItem::new).collect())
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

    /// The response object: in progress (`None`), or finished with its output (text and
    /// its tokens' log-probabilities when asked for, or the calls) and usage.
    pub(super) fn object(&self, done: Option<Done<'_>>) -> ResponseObject {
        let (status, output, incomplete, usage) = match done {
            None => ("in_progress", Vec::new(), None, None),
            Some(Done {
                calls: Some(calls),
                usage,
                ..
            }) => {
                let items = calls
                    .iter()
                    .cloned()
                    .map(OutputItem::FunctionCall)
                    .collect();
                ("completed", items, None, Some(usage.into()))
            }
            Some(Done {
                text,
                logprobs,
                finish,
                usage,
                calls: None,
            }) => {
                let status = status_of(finish);
                let incomplete = (finish == FinishReason::Length)
                    .then(|| json!({"reason": "max_output_tokens"}));
                let item = self.message(status, Some((text.to_string(), logprobs)));
                (
                    status,
                    vec![OutputItem::Message(item)],
                    incomplete,
                    Some(usage.into()),
                )
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
            tool_choice: self.tool_choice.clone(),
            tools: self.tools.clone(),
            top_p: self.top_p,
            truncation: "disabled",
            usage,
            metadata: self.metadata.clone(),
        }
    }
}

/// A finished generation, as the final object shows it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Done<'a> {
    /// The whole text.
    pub text: &'a str,
    /// Its tokens' log-probabilities (empty unless asked for).
    pub logprobs: &'a [LogprobOut],
    /// Why it ended.
    pub finish: FinishReason,
    /// Token counts.
    pub usage: Usage,
    /// The calls the text makes, when it is tool calls (then the output is these items).
    pub calls: Option<&'a [FunctionCallItem]>,
}

/// `completed`, or `incomplete` when the token limit cut the text.
fn status_of(finish: FinishReason) -> &'static str {
    match finish {
        FinishReason::Stop => "completed",
        FinishReason::Length => "incomplete",
    }
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

/// The events of the message item and its text part (numbered by the stream's [`Events`]).
struct MessageEvents<'a> {
    shape: &'a Shape,
}

impl MessageEvents<'_> {
    /// An event's body at the text part: `extra` with `item_id`, `output_index` and
    /// `content_index`.
    fn at(&self, extra: Value) -> Value {
        let mut v = json!({
            "item_id": self.shape.message_id, "output_index": 0, "content_index": 0,
        });
        if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
            o.extend(e);
        }
        v
    }

    /// The message item and its text part open.
    fn open(&self, ev: &mut Events) -> [(&'static str, sse::Chunk); 2] {
        [
            ev.event(
                "response.output_item.added",
                json!({"output_index": 0, "item": self.shape.message("in_progress", None)}),
            ),
            ev.event(
                "response.content_part.added",
                self.at(json!({"part": OutputText::new(String::new(), &[])})),
            ),
        ]
    }

    /// New text and its tokens' entries.
    fn delta(
        &self,
        ev: &mut Events,
        text: &str,
        logprobs: &[LogprobOut],
    ) -> (&'static str, sse::Chunk) {
        ev.event(
            "response.output_text.delta",
            self.at(json!({"delta": text, "logprobs": entries(logprobs)})),
        )
    }

    /// The text done, the part done, the item done.
    fn close(
        &self,
        ev: &mut Events,
        text: &str,
        all: &[LogprobOut],
        finish: FinishReason,
    ) -> [(&'static str, sse::Chunk); 3] {
        let status = status_of(finish);
        [
            ev.event(
                "response.output_text.done",
                self.at(json!({"text": text, "logprobs": entries(all)})),
            ),
            ev.event(
                "response.content_part.done",
                self.at(json!({"part": OutputText::new(text.to_string(), all)})),
            ),
            ev.event(
                "response.output_item.done",
                json!({"output_index": 0, "item": self.shape.message(status, Some((text.to_string(), all)))}),
            ),
        ]
    }
}

/// The four events of each function call, output index `i` for `calls[i]`.
fn call_events(ev: &mut Events, calls: &[FunctionCallItem]) -> Vec<(&'static str, sse::Chunk)> {
    let mut out = Vec::with_capacity(4 * calls.len());
    for (i, call) in calls.iter().enumerate() {
        let opening = FunctionCallItem {
            arguments: String::new(),
            status: "in_progress",
            ..call.clone()
        };
        let at = |extra: Value| {
            let mut v = json!({"item_id": call.id, "output_index": i});
            if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
                o.extend(e);
            }
            v
        };
        out.push(ev.event(
            "response.output_item.added",
            json!({"output_index": i, "item": opening}),
        ));
        out.push(ev.event(
            "response.function_call_arguments.delta",
            at(json!({"delta": call.arguments})),
        ));
        out.push(ev.event(
            "response.function_call_arguments.done",
            at(json!({"arguments": call.arguments, "name": call.name})),
        ));
        out.push(ev.event(
            "response.output_item.done",
            json!({"output_index": i, "item": call}),
        ));
    }
    out
}

/// The typed events of a streamed response.
pub(super) fn stream_events(
    shape: Shape,
    mut events: GenerationStream,
    mut namer: Option<Namer>,
    span: tracing::Span,
) -> impl futures::Stream<Item = (&'static str, sse::Chunk)> + Send {
    async_stream::stream! {
        let mut ev = Events { next: 0 };
        let msg = MessageEvents { shape: &shape };
        yield ev.event("response.created", json!({"response": shape.object(None)}));
        yield ev.event("response.in_progress", json!({"response": shape.object(None)}));
        // With tools, the text held back while it may still be a call; `None` once the
        // message item is open.
        let mut held: Option<String> = shape.tools().map(|_| String::new());
        if held.is_none() {
            for e in msg.open(&mut ev) {
                yield e;
            }
        }
        let mut text = String::new();
        // Every token's log-probabilities (for the closing events), and those whose text is not
        // out yet (an incomplete character, a possible stop string, text held back), which
        // wait for the delta that carries it.
        let (mut all, mut pending): (Vec<LogprobOut>, Vec<LogprobOut>) = (Vec::new(), Vec::new());
        while let Some(item) = events.next().await {
            match item {
                Ok(event) => {
                    if let Some(n) = namer.as_mut() {
                        pending.extend(n.name_all(&event.logprobs));
                    }
                    let mut delta = event.text;
                    if let (Some(h), Some(tools)) = (held.as_mut(), shape.tools()) {
                        h.push_str(&delta);
                        if event.finish.is_none() && tools.may_be_call(h) {
                            continue;
                        }
                        if let (Some(_), Some(usage)) = (event.finish, event.usage) {
                            if let Some(calls) = shape.calls(h) {
                                for e in call_events(&mut ev, &calls) {
                                    yield e;
                                }
                                let done = Done {
                                    text: h,
                                    logprobs: &[],
                                    finish: FinishReason::Stop,
                                    usage,
                                    calls: Some(&calls),
                                };
                                yield ev.event("response.completed", json!({"response": shape.object(Some(done))}));
                                return;
                            }
                        }
                        // Not a call: the message opens and everything held goes out.
                        delta = std::mem::take(h);
                        held = None;
                        for e in msg.open(&mut ev) {
                            yield e;
                        }
                    }
                    if !delta.is_empty() {
                        text.push_str(&delta);
                        yield msg.delta(&mut ev, &delta, &pending);
                        all.append(&mut pending);
                    }
                    let (Some(finish), Some(usage)) = (event.finish, event.usage) else {
                        continue;
                    };
                    // Tokens whose text is not out (a stop string cut it, or it ends in an
                    // incomplete character) still count, as on chat: their entries go out in
                    // a last delta without text.
                    if !pending.is_empty() {
                        yield msg.delta(&mut ev, "", &pending);
                        all.append(&mut pending);
                    }
                    for e in msg.close(&mut ev, &text, &all, finish) {
                        yield e;
                    }
                    let last = if finish == FinishReason::Length {
                        "response.incomplete"
                    } else {
                        "response.completed"
                    };
                    let done = Done { text: &text, logprobs: &all, finish, usage, calls: None };
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
