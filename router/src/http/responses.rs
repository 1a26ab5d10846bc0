//! `POST /v1/responses`: OpenAI's Responses API (what current OpenAI clients default to), for
//! text in and text or function calls out, whole or streamed as its typed events
//! ([`super::responses_out`]).
//!
//! The request becomes a chat conversation: `instructions` as a system turn, then `input` (a
//! string is one user turn; a list holds messages whose content is a string or `input_text` /
//! `output_text` parts, role `developer` read as `system`; `function_call` items as the
//! assistant turn's tool calls, `function_call_output` items as `tool` turns), rendered with
//! the model's chat template like `/v1/chat/completions`. Function `tools` and `tool_choice`
//! are read in this API's shapes (`http/tools.rs`) into the router's [`crate::tools::Tools`],
//! whose grammar, template definitions and call parsing are the ones chat and gRPC use. The
//! answer is one `message` output item with one `output_text` part, or one `function_call`
//! item per call. ferry keeps no responses: `store` has no effect (the object says `"store":
//! false`) and `previous_response_id` is a 400, as is every field that would change the output
//! and is not implemented (reasoning, built-in tools, …). Structured output: `text.format`
//! `{"type": "json_object"}` or `{"type": "json_schema", "name", "schema", "strict"}`, as on
//! the chat endpoint ([`crate::structured`]), echoed in the response's `text`.
//! Log-probabilities (`include: ["message.output_text.logprobs"]` and/or `top_logprobs` 1–20)
//! are the chat endpoint's: the raw log-softmax, on the text part and on every delta.
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use ferry_modelcard::tokenizer::ChatMessage;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::Value;
use tracing::Instrument;

use super::error::{ApiError, ApiJson};
use super::generate::{self, Meta};
use super::logprobs::Namer;
use super::openai::MAX_CHAT_TOP_LOGPROBS;
use super::responses_out::{stream_events, Done, Shape};
use super::sse;
use super::tools::{parse_tools, ToolsApi};
use crate::auth::Caller;
use crate::dispatch::GenerationStream;
use crate::error::{log_failure, RequestError};
use crate::spans::Operation;
use crate::state::AppState;
use crate::structured::{parse_format, FormatApi, FormatInput};
use crate::tools::{self, Tools};
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
    /// No effect (a constrained reply is one call; an unconstrained one may hold several).
    pub parallel_tool_calls: Option<Value>,
    /// Not implemented: null only (ferry keeps no responses to continue from).
    pub previous_response_id: Option<Value>,
    /// Not implemented: null only.
    pub conversation: Option<Value>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", …}}`.
    pub text: Option<Value>,
    /// Function tools: `{"type": "function", "name", "description"?, "parameters"?,
    /// "strict"?}` (other types, e.g. `web_search`, are a 400 naming `tools[i].type`).
    pub tools: Option<Value>,
    /// `"none"`, `"auto"` (default with tools), `"required"` or `{"type": "function",
    /// "name"}`.
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

/// One input item: a message (`type` absent or `"message"`), a `function_call` (an earlier
/// answer's call, sent back) or a `function_call_output` (its result). Other fields an item
/// carries when an earlier response's output is sent back (`id`, `status`, …) have no effect.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct InputItem {
    /// `message`, `function_call` or `function_call_output` (others, e.g. images or
    /// reasoning, are a 400).
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    /// A message's role: `user`, `assistant`, `system` or `developer`.
    #[serde(default)]
    pub role: Option<String>,
    /// A message's content: a string or parts.
    #[serde(default)]
    pub content: Option<InputContent>,
    /// A call's id (`function_call`), or the call a `function_call_output` answers.
    #[serde(default)]
    pub call_id: Option<Value>,
    /// A `function_call`'s function.
    #[serde(default)]
    pub name: Option<Value>,
    /// A `function_call`'s arguments, JSON text.
    #[serde(default)]
    pub arguments: Option<Value>,
    /// A `function_call_output`'s result: a string or `input_text` parts.
    #[serde(default)]
    pub output: Option<Value>,
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
        let checks = [
            Unsupported::new(
                "previous_response_id",
                &self.previous_response_id,
                null,
                "null",
            ),
            Unsupported::new("conversation", &self.conversation, null, "null"),
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
            match item.kind.as_deref() {
                None | Some("message") => messages.push(message_item(item, &bad)?),
                Some("function_call") => {
                    let text = |field: &str, v: &Option<Value>| match v {
                        Some(Value::String(s)) => Ok(s.clone()),
                        other => Err(bad(format!(
                            "a function_call's `{field}` must be a string, got {}",
                            other
                                .as_ref()
                                .map_or_else(|| "nothing".into(), Value::to_string)
                        ))),
                    };
                    let call = tools::template_call(
                        Some(text("call_id", &item.call_id)?),
                        &text("name", &item.name)?,
                        Value::String(text("arguments", &item.arguments)?),
                    );
                    // Calls right after an assistant turn (its text, or calls before them)
                    // belong to that turn.
                    match messages.last_mut().filter(|m| m.role == "assistant") {
                        Some(turn) => turn.tool_calls.get_or_insert_with(Vec::new).push(call),
                        None => {
                            let mut turn = ChatMessage::new("assistant", "");
                            turn.tool_calls = Some(vec![call]);
                            messages.push(turn);
                        }
                    }
                }
                Some("function_call_output") => {
                    let call_id = match &item.call_id {
                        Some(Value::String(s)) => s.clone(),
                        other => {
                            return Err(bad(format!(
                                "a function_call_output's `call_id` must be a string, got {}",
                                other
                                    .as_ref()
                                    .map_or_else(|| "nothing".into(), Value::to_string)
                            )))
                        }
                    };
                    let output = match &item.output {
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Array(parts)) => parts_text(parts, &bad)?,
                        other => {
                            return Err(bad(format!(
                                "a function_call_output's `output` must be a string or \
                                 input_text parts, got {}",
                                other
                                    .as_ref()
                                    .map_or_else(|| "nothing".into(), Value::to_string)
                            )))
                        }
                    };
                    let mut turn = ChatMessage::new("tool", output);
                    turn.tool_call_id = Some(call_id);
                    messages.push(turn);
                }
                Some(kind) => {
                    return Err(bad(format!(
                        "only message, function_call and function_call_output items are \
                         supported, got type {kind:?}"
                    )))
                }
            }
        }
        Ok(messages)
    }

    /// The request in the router's terms (the rest is checked by the validator) and its
    /// checked tools (`None` without tools): the tool-call grammar of `tool_choice`
    /// `required` / a named function becomes the output grammar (with `text.format` too it is
    /// a 400).
    pub fn into_params(
        &self,
        request_id: &str,
    ) -> Result<(GenerateParams, Option<Tools>), ValidationError> {
        self.check_unsupported()?;
        let tools = parse_tools(
            ToolsApi::Responses,
            self.tools.as_ref(),
            self.tool_choice.as_ref(),
        )?;
        let response_format =
            tools::output_grammar(self.text_format()?, tools.as_ref(), "text.format")?;
        if let Some(n) = self.max_output_tokens.filter(|&n| n < 1) {
            return Err(ValidationError::new(
                "max_output_tokens",
                format!("must be >= 1, got {n}"),
            ));
        }
        let params = GenerateParams {
            model: self.model.clone(),
            prompt: tools::chat_prompt(self.messages()?, tools.as_ref()),
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
            response_format,
            n: None,
            prompt_logprobs: None,
            echo: false,
        };
        Ok((params, tools))
    }
}

/// A message item as a chat turn.
fn message_item(
    item: &InputItem,
    bad: &dyn Fn(String) -> ValidationError,
) -> Result<ChatMessage, ValidationError> {
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
    Ok(ChatMessage::new(role, content))
}

/// A function call output given as parts: the `input_text` parts' text, joined.
fn parts_text(
    parts: &[Value],
    bad: &dyn Fn(String) -> ValidationError,
) -> Result<String, ValidationError> {
    let mut text = String::new();
    for p in parts {
        match (p.get("type").and_then(Value::as_str), p.get("text")) {
            (Some("input_text"), Some(Value::String(t))) => text.push_str(t),
            _ => {
                return Err(bad(format!(
                    "a function_call_output's parts must be input_text parts, got {p}"
                )))
            }
        }
    }
    Ok(text)
}

/// The handler.
pub async fn responses(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    caller: Caller,
    ApiJson(req): ApiJson<ResponsesRequest>,
) -> Response {
    let mut meta = Meta::new("resp", &state);
    let span = generate::request_span(&state, &headers, Operation::Chat, ROUTE, &meta.id);
    let params = match req.into_params(&meta.id) {
        Ok((p, tools)) => {
            meta.tools = tools.filter(Tools::parses).map(Arc::new);
            p
        }
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
                    let calls = shape.calls(&text);
                    let done = Done {
                        text: &text,
                        logprobs: &logprobs,
                        finish,
                        usage,
                        calls: calls.as_deref(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{FinishReason, Usage};
    use serde_json::json;

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
    fn function_calls_and_their_outputs_become_tool_turns() {
        let r = request(json!({"input": [
            {"role": "user", "content": "Weather in Ur?"},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
             "arguments": "{\"city\":\"Ur\"}", "status": "completed"},
            {"type": "function_call", "call_id": "call_2", "name": "noop", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "Done."}]}
        ]}));
        let m = r.messages().expect("valid");
        assert_eq!(
            turns(&m),
            [
                ("user", "Weather in Ur?"),
                ("assistant", ""),
                ("tool", "Sunny."),
                ("tool", "Done.")
            ]
            .map(|(r, c)| (r.to_string(), c.to_string()))
        );
        let calls = m[1].tool_calls.as_ref().expect("one turn with both calls");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["id"], "call_1");
        assert_eq!(calls[0]["function"]["arguments"], json!({"city": "Ur"}));
        assert_eq!(m[3].tool_call_id.as_deref(), Some("call_2"));
        for bad in [
            json!({"type": "function_call", "name": "f", "arguments": "{}"}),
            json!({"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}),
            json!({"type": "function_call_output", "output": "x"}),
            json!({"type": "function_call_output", "call_id": "c", "output": 3}),
            json!({"type": "reasoning", "summary": []}),
        ] {
            let e = request(json!({"input": [bad.clone()]}))
                .messages()
                .expect_err(&bad.to_string());
            assert_eq!(e.field, "input", "{bad}: {e}");
        }
    }

    #[test]
    fn tools_are_read_in_this_apis_shapes() {
        let tools = json!([{"type": "function", "name": "noop", "description": "Nothing."}]);
        let r = request(json!({"input": "x", "tools": tools, "tool_choice": "required"}));
        let (p, t) = r.into_params("resp_1").expect("valid");
        let t = t.expect("tools");
        assert!(
            p.response_format.is_some(),
            "required constrains the output"
        );
        assert!(
            matches!(p.prompt, crate::tokenize::PromptInput::ChatTools(_, ref d) if d.len() == 1)
        );
        assert_eq!(t.template_tools()[0]["function"]["description"], "Nothing.");
        let both = request(
            json!({"input": "x", "tools": tools, "tool_choice": "required",
            "text": {"format": {"type": "json_object"}}}),
        );
        assert_eq!(
            both.into_params("r").expect_err("both").field,
            "text.format"
        );
        let web = request(json!({"input": "x", "tools": [{"type": "web_search"}]}));
        assert_eq!(
            web.into_params("r").expect_err("built-in").field,
            "tools[0].type"
        );
    }

    #[test]
    fn a_finished_object_says_why_it_stopped() {
        let meta = Meta {
            id: "resp_1".into(),
            created: 7,
            model: "tiny-k3".into(),
            tools: None,
            n: 1,
            echo: None,
        };
        let shape = Shape::new(
            meta.clone(),
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
            calls: None,
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
        assert_eq!(
            (&open["tool_choice"], &open["tools"]),
            (&json!("none"), &json!([]))
        );

        // With tools, an output that is a call becomes one completed function_call item.
        let req = request(json!({"input": "x", "tools": [{"type": "function", "name": "noop"}]}));
        let (_, tools) = req.into_params("resp_1").expect("valid");
        let shape = Shape::new(
            Meta {
                tools: tools.map(Arc::new),
                ..meta
            },
            &req,
        );
        assert!(shape.calls("In the beginning").is_none());
        let calls = shape
            .calls(r#"{"name": "noop", "arguments": {}}"#)
            .expect("a call");
        let done = Done {
            calls: Some(&calls),
            ..done(FinishReason::Stop)
        };
        let called = serde_json::to_value(shape.object(Some(done))).unwrap();
        assert_eq!(called["status"], "completed");
        assert_eq!(called["tool_choice"], "auto");
        assert_eq!(called["tools"][0]["name"], "noop");
        let item = &called["output"][0];
        assert_eq!(
            (
                &item["type"],
                &item["name"],
                &item["arguments"],
                &item["status"]
            ),
            (
                &json!("function_call"),
                &json!("noop"),
                &json!("{}"),
                &json!("completed")
            )
        );
        assert!(
            item["id"].as_str().is_some_and(|i| i.starts_with("fc_")),
            "{item}"
        );
        assert!(
            item["call_id"]
                .as_str()
                .is_some_and(|i| i.starts_with("call_")),
            "{item}"
        );
    }
}
