//! OpenAI API shapes (the subset ferry serves) and their conversion to [`GenerateParams`].
//!
//! **Nothing is ignored silently.** A field that would change the output and that ferry does
//! not implement yet (`best_of`, `suffix`, `functions`, …, [`UNSUPPORTED`]) is a 400
//! naming it, unless its value is the one that changes nothing (`best_of: 1`, …); a field
//! OpenAI does not define is a 400 too. Fields with no effect on the output are accepted:
//! [`NO_EFFECT`]. Implemented beyond the basics: `presence_penalty`, `frequency_penalty`,
//! `logit_bias`, log-probabilities (chat `logprobs` + `top_logprobs` in [0, 20], completions
//! `logprobs` in [0, 5], with `echo` the prompt's too, as vLLM: docs/api.md); structured output
//! (`response_format` `json_object` / `json_schema`, both endpoints, [`crate::structured`]);
//! tools on chat (`tools`, `tool_choice`, `tool` turns and assistant `tool_calls` in
//! `messages`, [`super::tools`]; a 400 on completions); extensions (vLLM's, sent by OpenAI clients with `extra_body`):
//! `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
//! `speculative`.
use std::collections::HashMap;

use ferry_modelcard::tokenizer::ChatMessage;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::logprobs::{ChatLogprobs, CompletionLogprobs};
use super::tools::{parse_tools, template_tool_calls, ToolCallOut, ToolsApi};
use crate::output::{FinishReason, Usage};
use crate::structured::{parse_format, FormatApi, FormatInput};
use crate::tokenize::PromptInput;
use crate::tools::{self, Tools};
use crate::validate::{GenerateParams, SamplingInput, ValidationError};

/// `/v1/completions` default `max_tokens` (OpenAI's).
pub const DEFAULT_COMPLETION_MAX_TOKENS: i64 = 16;

/// `/v1/completions` `logprobs`, at most (OpenAI's).
pub const MAX_COMPLETION_LOGPROBS: i64 = 5;

/// `/v1/chat/completions` `top_logprobs`, at most (OpenAI's).
pub const MAX_CHAT_TOP_LOGPROBS: i64 = 20;

/// `prompt`: a string, token ids, or a batch of one of either.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A batch of texts (only one is supported).
    Texts(Vec<String>),
    /// A batch of token-id lists (only one is supported).
    TokenBatch(Vec<Vec<u32>>),
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl StopSpec {
    fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Copy, PartialEq, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and empty `choices`).
    #[serde(default)]
    pub include_usage: bool,
}

/// Accepted fields that do not change the output (OpenAI's bookkeeping and routing hints).
pub const NO_EFFECT: &[&str] = &[
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
];

/// OpenAI fields ferry does not implement yet, each with the one value (besides `null`) that
/// changes nothing and is therefore accepted. Completions-only fields (and `tools` /
/// `tool_choice`, implemented on chat) are checked on that endpoint alone.
pub const UNSUPPORTED: &[(&str, &str)] = &[
    ("tools", "[]"),
    ("tool_choice", "\"none\""),
    ("functions", "[]"),
    ("function_call", "\"none\""),
    ("best_of", "1"),
    ("suffix", "\"\""),
];

/// Whether `v` is the value of the unsupported field `field` that changes nothing.
fn is_noop(field: &str, v: &Value) -> bool {
    let num = |want: f64| v.as_f64() == Some(want);
    match field {
        "best_of" => num(1.0),
        "tools" | "functions" => v.as_array().is_some_and(|a| a.is_empty()),
        "tool_choice" | "function_call" => v.as_str() == Some("none"),
        "suffix" => v.as_str() == Some(""),
        _ => false,
    }
}

/// The first field of `fields` (name, value) that would change the output: a 400 naming it.
fn reject_unsupported<'a>(
    fields: impl IntoIterator<Item = (&'static str, &'a Option<Value>)>,
) -> Result<(), ValidationError> {
    for (field, value) in fields {
        let Some(v) = value.as_ref().filter(|v| !v.is_null()) else {
            continue;
        };
        if !is_noop(field, v) {
            let accepted = UNSUPPORTED
                .iter()
                .find(|(f, _)| *f == field)
                .map_or("null", |(_, ok)| ok);
            return Err(ValidationError::new(
                field,
                format!(
                    "is not supported by ferry yet (it would change the output); omit it or send {accepted}, got {v}"
                ),
            ));
        }
    }
    Ok(())
}

/// Fields both endpoints share, declared once and pasted into each request struct (serde's
/// `flatten` would lose the field path in type errors, which `error.param` reports). Unknown
/// fields are refused (`deny_unknown_fields` on each struct).
macro_rules! common_fields {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$fmeta:meta])* pub $field:ident : $ty:ty,)* }) => {
        $(#[$meta])*
        pub struct $name {
            $($(#[$fmeta])* pub $field: $ty,)*
            /// Subtracted once from the logit of each generated token, in [-2, 2].
            pub presence_penalty: Option<f64>,
            /// Subtracted per occurrence from the logit of each generated token, in [-2, 2].
            pub frequency_penalty: Option<f64>,
            /// Extension (vLLM): divides positive / multiplies negative logits of prompt and
            /// output tokens; > 0.
            pub repetition_penalty: Option<f64>,
            /// Token id (a decimal string, as OpenAI's JSON keys are) → bias in [-100, 100].
            pub logit_bias: Option<HashMap<String, f64>>,
            /// Extension (vLLM): stop tokens masked until this many tokens are generated.
            pub min_tokens: Option<i64>,
            /// Extension (vLLM): more tokens that end generation.
            pub stop_token_ids: Option<Vec<u32>>,
            /// Structured output: `{"type": "text" | "json_object" | "json_schema", …}`.
            pub response_format: Option<Value>,
            /// Chat: the functions the model may call ([`super::tools`]); completions: not
            /// implemented ([`UNSUPPORTED`]).
            pub tools: Option<Value>,
            /// Chat: `none`, `auto`, `required` or a named function; completions: not
            /// implemented ([`UNSUPPORTED`]).
            pub tool_choice: Option<Value>,
            /// Not implemented ([`UNSUPPORTED`]).
            pub functions: Option<Value>,
            /// Not implemented ([`UNSUPPORTED`]).
            pub function_call: Option<Value>,
            /// No effect on the output ([`NO_EFFECT`]).
            pub user: Option<Value>,
            /// No effect on the output ([`NO_EFFECT`]).
            pub metadata: Option<Value>,
            /// No effect on the output ([`NO_EFFECT`]).
            pub store: Option<Value>,
            /// No effect on the output ([`NO_EFFECT`]).
            pub service_tier: Option<Value>,
            /// No effect on the output without tools ([`NO_EFFECT`]).
            pub parallel_tool_calls: Option<Value>,
            /// Softmax temperature.
            pub temperature: Option<f64>,
            /// Nucleus threshold.
            pub top_p: Option<f64>,
            /// Extension: keep the k most likely tokens.
            pub top_k: Option<i64>,
            /// Extension: drop tokens below min_p × the top probability.
            pub min_p: Option<f64>,
            /// Seed.
            pub seed: Option<u64>,
            /// Stop strings.
            pub stop: Option<StopSpec>,
            /// Samples of the prompt, returned as `choices[i]` (index `i`); in
            /// [1, `MAX_SAMPLES`]; unset = 1.
            pub n: Option<i64>,
            /// Extension: keep generating past EOS.
            #[serde(default)]
            pub ignore_eos: bool,
            /// Extension: speculative decoding for this request (`true` / `false`); absent =
            /// the decode worker's setting.
            pub speculative: Option<bool>,
            /// Stream as server-sent events.
            #[serde(default)]
            pub stream: bool,
            /// Streaming options.
            pub stream_options: Option<StreamOptions>,
        }

        impl $name {
            fn sampling(&self) -> Result<SamplingInput, ValidationError> {
                Ok(SamplingInput {
                    temperature: self.temperature,
                    top_k: self.top_k,
                    top_p: self.top_p,
                    min_p: self.min_p,
                    seed: self.seed,
                    presence_penalty: self.presence_penalty,
                    frequency_penalty: self.frequency_penalty,
                    repetition_penalty: self.repetition_penalty,
                    logit_bias: logit_bias(self.logit_bias.as_ref())?,
                })
            }

            /// The shared unsupported fields: a 400 naming the first that would change the
            /// output.
            fn check_unsupported(&self) -> Result<(), ValidationError> {
                reject_unsupported([
                    ("functions", &self.functions),
                    ("function_call", &self.function_call),
                ])
            }

            /// `response_format`, parsed (its schema is compiled by the validator).
            fn response_format(&self) -> Result<Option<FormatInput>, ValidationError> {
                match &self.response_format {
                    Some(v) => parse_format(v, FormatApi::Chat),
                    None => Ok(None),
                }
            }

            fn stop_strings(&self) -> Vec<String> {
                self.stop.clone().map(StopSpec::into_vec).unwrap_or_default()
            }

            /// Whether a usage chunk ends the stream.
            pub fn include_usage(&self) -> bool {
                self.stream_options.is_some_and(|o| o.include_usage)
            }
        }
    };
}

common_fields! {
    /// `POST /v1/completions`.
    #[derive(Debug, Clone, PartialEq, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct CompletionRequest {
        /// Model name; empty or absent = the served one.
        #[serde(default)]
        pub model: String,
        /// The prompt.
        pub prompt: Prompt,
        /// New tokens at most (default 16).
        pub max_tokens: Option<i64>,
        /// Return each token's log-probability with this many alternatives, in [0, 5] (with
        /// `echo`, the prompt's tokens' too).
        pub logprobs: Option<i64>,
        /// Put the prompt before each choice's text (and, with `logprobs`, its tokens before
        /// the generated ones: the first with `null`s). With `max_tokens: 0`, the prompt alone.
        pub echo: Option<bool>,
        /// Not implemented ([`UNSUPPORTED`]).
        pub best_of: Option<Value>,
        /// Not implemented ([`UNSUPPORTED`]).
        pub suffix: Option<Value>,
    }
}

impl CompletionRequest {
    /// The request in the router's terms (checked later by the validator, except the shapes
    /// only this API has: `n` and prompt batches).
    pub fn into_params(self, request_id: &str) -> Result<GenerateParams, ValidationError> {
        self.check_unsupported()?;
        reject_unsupported([
            ("tools", &self.tools),
            ("tool_choice", &self.tool_choice),
            ("best_of", &self.best_of),
            ("suffix", &self.suffix),
        ])?;
        let (sampling, stop) = (self.sampling()?, self.stop_strings());
        let response_format = self.response_format()?;
        let logprobs = match self.logprobs {
            Some(n) if !(0..=MAX_COMPLETION_LOGPROBS).contains(&n) => {
                return Err(ValidationError::new(
                    "logprobs",
                    format!("must be in [0, {MAX_COMPLETION_LOGPROBS}], got {n}"),
                ))
            }
            n => n,
        };
        let echo = self.echo.unwrap_or(false);
        let batch = |len: usize| {
            ValidationError::new(
                "prompt",
                format!("batches are not supported: must hold exactly 1 prompt, got {len}"),
            )
        };
        let prompt = match self.prompt {
            Prompt::Text(t) => PromptInput::Text(t),
            Prompt::Tokens(t) => PromptInput::Tokens(t),
            Prompt::Texts(v) => match <[String; 1]>::try_from(v) {
                Ok([t]) => PromptInput::Text(t),
                Err(v) => return Err(batch(v.len())),
            },
            Prompt::TokenBatch(v) => match <[Vec<u32>; 1]>::try_from(v) {
                Ok([t]) => PromptInput::Tokens(t),
                Err(v) => return Err(batch(v.len())),
            },
        };
        Ok(GenerateParams {
            model: self.model,
            prompt,
            sampling,
            max_tokens: Some(self.max_tokens.unwrap_or(DEFAULT_COMPLETION_MAX_TOKENS)),
            stop,
            ignore_eos: self.ignore_eos,
            min_tokens: self.min_tokens,
            stop_token_ids: self.stop_token_ids.unwrap_or_default(),
            request_id: Some(request_id.to_string()),
            speculative: self.speculative,
            logprobs,
            response_format,
            n: self.n,
            prompt_logprobs: logprobs.filter(|_| echo),
            echo,
        })
    }
}

/// A chat message's content: a string or a list of parts (only `text` parts are supported).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ContentPart {
    /// `text` (others are rejected).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: String,
}

/// One incoming chat message.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatMessageIn {
    /// `system`, `user`, `assistant` or `tool` (whatever the chat template renders).
    pub role: String,
    /// The content (may be null for assistant turns).
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// An assistant turn's tool calls (`[{"id", "type": "function", "function": {"name",
    /// "arguments"}}]`), rendered by the chat template.
    #[serde(default)]
    pub tool_calls: Option<Value>,
    /// A `tool` turn: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// A participant name (no effect on the output).
    #[serde(default)]
    pub name: Option<String>,
}

common_fields! {
    /// `POST /v1/chat/completions`.
    #[derive(Debug, Clone, PartialEq, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct ChatRequest {
        /// Model name; empty or absent = the served one.
        #[serde(default)]
        pub model: String,
        /// The conversation.
        pub messages: Vec<ChatMessageIn>,
        /// New tokens at most (deprecated OpenAI name).
        pub max_tokens: Option<i64>,
        /// New tokens at most; wins over `max_tokens`. Default: what the context leaves.
        pub max_completion_tokens: Option<i64>,
        /// Return each token's log-probability (`choices[].logprobs.content`).
        pub logprobs: Option<bool>,
        /// With `logprobs: true`: this many alternatives per token, in [0, 20].
        pub top_logprobs: Option<i64>,
    }
}

impl ChatRequest {
    /// The request in the router's terms.
    pub fn into_params(self, request_id: &str) -> Result<GenerateParams, ValidationError> {
        self.into_params_with_tools(request_id).map(|(p, _)| p)
    }

    /// The request in the router's terms and its checked tools (`None` without tools): the
    /// tool-call grammar of `tool_choice` `required` / a named function becomes the
    /// request's output grammar (with `response_format` too it is a 400).
    pub fn into_params_with_tools(
        self,
        request_id: &str,
    ) -> Result<(GenerateParams, Option<Tools>), ValidationError> {
        self.check_unsupported()?;
        let (sampling, stop) = (self.sampling()?, self.stop_strings());
        let tools = parse_tools(
            ToolsApi::Chat,
            self.tools.as_ref(),
            self.tool_choice.as_ref(),
        )?;
        let response_format =
            tools::output_grammar(self.response_format()?, tools.as_ref(), "response_format")?;
        let logprobs = match (self.logprobs, self.top_logprobs) {
            (Some(true), Some(n)) if !(0..=MAX_CHAT_TOP_LOGPROBS).contains(&n) => {
                return Err(ValidationError::new(
                    "top_logprobs",
                    format!("must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {n}"),
                ))
            }
            (Some(true), n) => Some(n.unwrap_or(0)),
            (_, Some(n)) => {
                return Err(ValidationError::new(
                    "top_logprobs",
                    format!("needs `logprobs: true`, got {n} without it"),
                ))
            }
            (_, None) => None,
        };
        let prompt = tools::chat_prompt(chat_messages(self.messages)?, tools.as_ref());
        let params = GenerateParams {
            model: self.model,
            prompt,
            sampling,
            max_tokens: self.max_completion_tokens.or(self.max_tokens),
            stop,
            ignore_eos: self.ignore_eos,
            min_tokens: self.min_tokens,
            stop_token_ids: self.stop_token_ids.unwrap_or_default(),
            request_id: Some(request_id.to_string()),
            speculative: self.speculative,
            logprobs,
            response_format,
            n: self.n,
            prompt_logprobs: None,
            echo: false,
        };
        Ok((params, tools))
    }
}

/// OpenAI's `logit_bias` object (keys are token ids as decimal strings) as `(token, bias)`
/// pairs, sorted by token; a key that is not a token id is a 400 naming `logit_bias`. Ranges
/// and the vocabulary are checked by the validator.
fn logit_bias(map: Option<&HashMap<String, f64>>) -> Result<Vec<(u32, f64)>, ValidationError> {
    let mut out = Vec::with_capacity(map.map_or(0, HashMap::len));
    for (key, &bias) in map.into_iter().flatten() {
        let token = key.trim().parse::<u32>().map_err(|_| {
            ValidationError::new(
                "logit_bias",
                format!("keys must be token ids (non-negative integers), got {key:?}"),
            )
        })?;
        out.push((token, bias));
    }
    out.sort_by_key(|&(t, _)| t);
    Ok(out)
}

/// Incoming chat turns as the tokenizer takes them: string content, or `text` parts joined
/// (other part types are a 400 naming `messages`).
pub fn chat_messages(incoming: Vec<ChatMessageIn>) -> Result<Vec<ChatMessage>, ValidationError> {
    let mut messages = Vec::with_capacity(incoming.len());
    for (i, m) in incoming.into_iter().enumerate() {
        let content = match m.content {
            None => String::new(),
            Some(MessageContent::Text(t)) => t,
            Some(MessageContent::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(ValidationError::new(
                            "messages",
                            format!(
                                "content parts must be of type \"text\", got {:?} in message {i}",
                                p.kind
                            ),
                        ));
                    }
                    text.push_str(&p.text);
                }
                text
            }
        };
        let mut message = ChatMessage::new(m.role, content);
        if let Some(calls) = m.tool_calls.as_ref().filter(|v| !v.is_null()) {
            message.tool_calls = Some(template_tool_calls(i, calls)?);
        }
        message.tool_call_id = m.tool_call_id;
        messages.push(message);
    }
    Ok(messages)
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from a KV cache.
    pub cached_tokens: u32,
}

/// `usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct UsageOut {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Their sum.
    pub total_tokens: u32,
    /// Cache details.
    pub prompt_tokens_details: PromptTokensDetails,
}

impl From<Usage> for UsageOut {
    fn from(u: Usage) -> Self {
        Self {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens.saturating_add(u.completion_tokens),
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_prompt_tokens,
            },
        }
    }
}

/// `finish_reason` as OpenAI spells it.
pub fn finish_str(f: Option<FinishReason>) -> Option<&'static str> {
    f.map(FinishReason::as_str)
}

/// One `/v1/completions` choice (whole or a streamed chunk).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionChoice {
    /// The sample's index: 0 to `n` − 1.
    pub index: u32,
    /// The text.
    pub text: String,
    /// The tokens' log-probabilities when the request asked (`logprobs`), else null.
    pub logprobs: Option<CompletionLogprobs>,
    /// `stop`, `length`, or null while streaming.
    pub finish_reason: Option<&'static str>,
}

/// `/v1/completions` response and stream chunk (`object: "text_completion"` for both).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionResponse {
    /// `cmpl-…`.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// One choice (none on a usage-only chunk).
    pub choices: Vec<CompletionChoice>,
    /// Absent while streaming without `include_usage`; null on the chunks before the last
    /// with it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageOut>>,
}

/// `message` of a chat choice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatMessageOut {
    /// `assistant`.
    pub role: &'static str,
    /// The generated text; null when the reply is tool calls.
    pub content: Option<String>,
    /// The tool calls parsed from the output ([`super::tools`]); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// One chat choice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChoice {
    /// The sample's index: 0 to `n` − 1.
    pub index: u32,
    /// The reply.
    pub message: ChatMessageOut,
    /// The tokens' log-probabilities when the request asked (`logprobs: true`), else null.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop` or `length`.
    pub finish_reason: Option<&'static str>,
}

/// `/v1/chat/completions` response (`object: "chat.completion"`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatResponse {
    /// `chatcmpl-…`.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// One choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: UsageOut,
}

/// `delta` of a chat chunk.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Delta {
    /// `assistant` on the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// The reply's tool calls, whole, in the last content chunk ([`super::tools`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// One chat chunk choice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChunkChoice {
    /// The sample's index: 0 to `n` − 1.
    pub index: u32,
    /// What is new.
    pub delta: Delta,
    /// The new tokens' log-probabilities when the request asked, else null.
    pub logprobs: Option<ChatLogprobs>,
    /// Set on the last content chunk.
    pub finish_reason: Option<&'static str>,
}

/// `/v1/chat/completions` stream chunk (`object: "chat.completion.chunk"`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChunk {
    /// `chatcmpl-…`, the same on every chunk.
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// One choice (none on a usage-only chunk).
    pub choices: Vec<ChunkChoice>,
    /// As in [`CompletionResponse::usage`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageOut>>,
}

/// One entry of `/v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelEntry {
    /// The model name.
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// `ferry`.
    pub owned_by: &'static str,
}

/// `/v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// The served models.
    pub data: Vec<ModelEntry>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_and_batches() {
        let r: CompletionRequest =
            serde_json::from_str(r#"{"prompt": [1, 2], "stop": "x", "user": "ignored"}"#)
                .expect("parses");
        let p = r.into_params("cmpl-1").expect("converts");
        assert_eq!(p.prompt, PromptInput::Tokens(vec![1, 2]));
        assert_eq!(p.max_tokens, Some(16));
        assert_eq!(p.stop, vec!["x".to_string()]);
        assert_eq!(p.speculative, None);

        let r: CompletionRequest =
            serde_json::from_str(r#"{"prompt": ["a", "b"]}"#).expect("parses");
        let e = r.into_params("x").expect_err("batch of 2");
        assert_eq!(e.field, "prompt");
        let r: CompletionRequest =
            serde_json::from_str(r#"{"prompt": [[5]], "n": 1}"#).expect("parses");
        assert_eq!(
            r.into_params("x").expect("one").prompt,
            PromptInput::Tokens(vec![5])
        );
    }

    #[test]
    fn chat_content_parts_and_max_tokens_names() {
        let r: ChatRequest = serde_json::from_str(
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_tokens": 5, "max_completion_tokens": 7}"#,
        )
        .expect("parses");
        let p = r.into_params("x").expect("converts");
        assert_eq!(p.max_tokens, Some(7));
        assert_eq!(p.speculative, None);
        assert_eq!(
            p.prompt,
            PromptInput::Chat(vec![ChatMessage::new("user", "hi")])
        );
    }

    #[test]
    fn speculative_is_an_optional_bool_on_both_endpoints() {
        for (body, want) in [
            (r#""speculative": false"#, Some(false)),
            (r#""speculative": true"#, Some(true)),
            (r#""speculative": null"#, None),
        ] {
            let r: CompletionRequest =
                serde_json::from_str(&format!(r#"{{"prompt": "x", {body}}}"#)).expect(body);
            assert_eq!(r.into_params("x").expect("converts").speculative, want);
            let r: ChatRequest = serde_json::from_str(&format!(
                r#"{{"messages": [{{"role": "user", "content": "x"}}], {body}}}"#
            ))
            .expect(body);
            assert_eq!(r.into_params("x").expect("converts").speculative, want);
        }
    }

    #[test]
    fn usage_field_is_absent_null_or_set() {
        let mut r = CompletionResponse {
            id: "cmpl-1".into(),
            object: "text_completion",
            created: 1,
            model: "m".into(),
            choices: vec![],
            usage: None,
        };
        let v = serde_json::to_value(&r).expect("serializes");
        assert!(v.get("usage").is_none());
        r.usage = Some(None);
        let v = serde_json::to_value(&r).expect("serializes");
        assert_eq!(v.get("usage"), Some(&serde_json::Value::Null));
    }
}
