//! The one place a client request becomes a [`ValidRequest`].
//!
//! Both front doors (gRPC `Generate`; HTTP `/v1/completions`, `/v1/chat/completions` and
//! `/v1/responses`) translate their wire shapes into [`GenerateParams`] without checking
//! anything but the shapes only they have (tools: [`crate::tools::Tools`], whose grammar and
//! template definitions land in the parameters), then call [`Validator::validate`]. Only a [`ValidRequest`] goes inward: its fields are private, so
//! nothing else can build one. Errors name the field (as the OpenAI API spells it), the limit
//! and the value: "`max_tokens` must be >= 1, got 0".
//!
//! Order: cheap checks first (model, the prompt's size in bytes or token ids, sampling and
//! the logits controls — penalties, `logit_bias` —, `max_tokens` >= 1, stop strings,
//! `stop_token_ids`, non-empty prompt, token ids in the vocabulary), then the output grammar
//! (`response_format`, tools: compiled on the blocking pool, [`crate::structured`]), then
//! tokenization on the blocking pool, then the length checks that need the token count (`max_tokens`, then
//! `min_tokens` <= `max_tokens`).
//!
//! **Bounded input before expensive work.** Tokenizing costs memory and CPU in proportion to
//! the text (a 30 MB prompt once took 13–18 s and a 3.46 GB peak), so text longer than
//! [`Validator::max_prompt_bytes`] (`context_length × Tokenizer::max_token_bytes`) is refused
//! before it reaches the tokenizer: such text needs more tokens than the context holds (the
//! argument is on `Tokenizer::max_token_bytes`). Token-id prompts are refused at
//! `context_length` ids, before hashing.
//!
//! **Numbers in the worker's types.** Sampling values are converted to the `f32`s the decode
//! worker runs with, then checked by the worker's own `SamplingParams::validate`, so whatever
//! the router accepts the worker accepts: `temperature: 1e39` is `inf` in `f32` and is refused
//! here naming `temperature`, not by the worker as a worker failure.
use std::borrow::Cow;

use ferry_modelcard::grammar::{GrammarCompiler, OutputGrammar};
use ferry_modelcard::sampling::{LogitsControls, SamplingError, SamplingParams};
use ferry_modelcard::tokenizer::ChatMessage;
use ferry_proto::ids::{BlockHash, RequestId};
use ferry_proto::v1;

use crate::error::RequestError;
use crate::structured::FormatInput;
use crate::tokenize::{PromptInput, TokenizerPool};
use crate::tools::Tools;

/// Stop strings per request, at most.
pub const MAX_STOP_STRINGS: usize = 4;

/// `stop_token_ids` per request, at most.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// Alternatives per token a request may ask log-probabilities for, at most (OpenAI chat's
/// `top_logprobs` limit; the engine's `MAX_TOP_LOGPROBS`).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// A request field that is missing, malformed or out of limits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{field}` {message}")]
pub struct ValidationError {
    /// The field, as the OpenAI API spells it (`max_tokens`, `prompt`, `messages`, …; a path
    /// with an index where the API has one, e.g. `tools[2].type`).
    pub field: Cow<'static, str>,
    /// The rule, the limit and the value: "must be >= 1, got 0".
    pub message: String,
}

impl ValidationError {
    /// An error on `field`.
    pub fn new(field: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }

    /// A snake_case label: `model_not_found` for an unknown model, else `invalid_value`.
    pub fn kind(&self) -> &'static str {
        match &*self.field {
            "model" => "model_not_found",
            _ => "invalid_value",
        }
    }
}

/// Sampling controls as the client sent them (unset = default).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SamplingInput {
    /// Default 1; finite, >= 0; 0 = greedy.
    pub temperature: Option<f64>,
    /// Default 0 (off); >= 0.
    pub top_k: Option<i64>,
    /// Default 1 (off); in (0, 1].
    pub top_p: Option<f64>,
    /// Default 0 (off); in [0, 1].
    pub min_p: Option<f64>,
    /// Seed for reproducible sampling.
    pub seed: Option<u64>,
    /// Default 0 (off); in [-2, 2].
    pub presence_penalty: Option<f64>,
    /// Default 0 (off); in [-2, 2].
    pub frequency_penalty: Option<f64>,
    /// Default 1 (off); finite, > 0.
    pub repetition_penalty: Option<f64>,
    /// `(token, bias)` pairs as given (the HTTP keys already parsed as token ids); checked
    /// against the vocabulary and [-100, 100].
    pub logit_bias: Vec<(u32, f64)>,
}

/// A generation request in the router's terms, not yet checked.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateParams {
    /// The model asked for; empty = the served one.
    pub model: String,
    /// The prompt.
    pub prompt: PromptInput,
    /// Sampling controls.
    pub sampling: SamplingInput,
    /// New tokens at most; `None` = whatever the context leaves (HTTP chat's default; gRPC
    /// has no default: an unset `stop.max_tokens` is 0, refused).
    pub max_tokens: Option<i64>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Stop tokens are masked until this many tokens are generated; `None` = 0.
    pub min_tokens: Option<i64>,
    /// More tokens that end generation.
    pub stop_token_ids: Vec<u32>,
    /// The client's request id, if any.
    pub request_id: Option<String>,
    /// Speculative decoding for this request; `None` = the decode worker's setting.
    pub speculative: Option<bool>,
    /// Return each token's log-probability with this many alternatives; `None` = none.
    pub logprobs: Option<i64>,
    /// Structured output (`response_format`, or the tool-call grammar of `tool_choice`);
    /// `None` = free text.
    pub response_format: Option<FormatInput>,
    /// Samples of the prompt (OpenAI's `n`, gRPC's `GenerateRequest.n`), in
    /// [1, [`MAX_SAMPLES`]]; `None` = 1.
    pub n: Option<i64>,
    /// Return the prompt's log-probabilities with this many alternatives per token (HTTP
    /// completions' `logprobs` with `echo`, gRPC `prompt_logprobs`); `None` = none.
    pub prompt_logprobs: Option<i64>,
    /// The reply repeats the prompt (completions' `echo`; on gRPC, `prompt_logprobs` is set):
    /// then `max_tokens: 0` is allowed and asks for the prompt alone (vLLM's rule).
    pub echo: bool,
}

/// Samples one request may ask for (`n`) at most. All `n` share one prefill of the prompt on
/// one decode worker, but each decodes up to `max_tokens`: the cap bounds what one request
/// can claim, and the key's token budget is charged `n × max_tokens`.
pub const MAX_SAMPLES: u32 = 16;

/// A gRPC `GenerateRequest` in the router's terms: the parameters to validate, and the
/// request's tools (parsed again from each sample's output when the choice is not none).
#[derive(Debug, Clone, PartialEq)]
pub struct GrpcGenerate {
    /// The parameters.
    pub params: GenerateParams,
    /// The checked tools (`tools`, `tool_choice`); `None` without tools.
    pub tools: Option<Tools>,
}

impl TryFrom<v1::GenerateRequest> for GenerateParams {
    type Error = ValidationError;

    /// [`GrpcGenerate`]'s parameters.
    fn try_from(r: v1::GenerateRequest) -> Result<Self, ValidationError> {
        GrpcGenerate::try_from(r).map(|g| g.params)
    }
}

impl TryFrom<v1::GenerateRequest> for GrpcGenerate {
    type Error = ValidationError;

    /// The gRPC request in the router's terms. Checked here: `response_format` (its schema
    /// must be JSON text) and the tools ([`crate::tools::from_wire`]: their shapes, and chat
    /// input only, else a 400 naming `tools`); the rest by the validator.
    fn try_from(r: v1::GenerateRequest) -> Result<Self, ValidationError> {
        let format = crate::structured::from_wire(r.response_format.clone())?;
        let tools = crate::tools::from_wire(r.tools, r.tool_choice)?;
        let response_format =
            crate::tools::output_grammar(format, tools.as_ref(), "response_format")?;
        use v1::generate_request::Input;
        let prompt = match r.input {
            Some(Input::Chat(c)) => {
                let messages = c.messages.into_iter().map(chat_message).collect();
                crate::tools::chat_prompt(messages, tools.as_ref())
            }
            _ if tools.is_some() => {
                return Err(ValidationError::new(
                    "tools",
                    "need chat input (`chat`): the chat template renders them; text and token \
                     prompts have no place for them",
                ))
            }
            Some(Input::Text(text)) => PromptInput::Text(text),
            Some(Input::Tokens(t)) => PromptInput::Tokens(t.ids),
            None => PromptInput::Text(String::new()),
        };
        let sampling = r
            .sampling
            .map_or_else(SamplingInput::default, |s| SamplingInput {
                temperature: s.temperature.map(f64::from),
                top_k: s.top_k.map(i64::from),
                top_p: s.top_p.map(f64::from),
                min_p: s.min_p.map(f64::from),
                seed: s.seed,
                presence_penalty: s.presence_penalty.map(f64::from),
                frequency_penalty: s.frequency_penalty.map(f64::from),
                repetition_penalty: s.repetition_penalty.map(f64::from),
                logit_bias: s
                    .logit_bias
                    .into_iter()
                    .map(|(t, b)| (t, f64::from(b)))
                    .collect(),
            });
        // The proto has no default: `max_tokens` must be >= 1, and an unset `stop` reads as
        // `max_tokens: 0`, which validation refuses by name.
        let (max_tokens, stop, ignore_eos, min_tokens, stop_token_ids) = match r.stop {
            Some(s) => (
                Some(i64::from(s.max_tokens)),
                s.stop,
                s.ignore_eos,
                Some(i64::from(s.min_tokens)),
                s.stop_token_ids,
            ),
            None => (Some(0), Vec::new(), false, None, Vec::new()),
        };
        let params = GenerateParams {
            model: r.model,
            prompt,
            sampling,
            max_tokens,
            stop,
            ignore_eos,
            min_tokens,
            stop_token_ids,
            request_id: Some(r.request_id).filter(|id| !id.is_empty()),
            speculative: r.speculative,
            logprobs: r.logprobs.map(i64::from),
            response_format,
            n: r.n.map(i64::from),
            prompt_logprobs: r.prompt_logprobs.map(i64::from),
            echo: r.prompt_logprobs.is_some(),
        };
        Ok(Self { params, tools })
    }
}

/// A gRPC chat turn as the template takes it: its tool calls' arguments parsed from JSON
/// text ([`crate::tools::template_call`]), an empty `tool_call_id` absent.
fn chat_message(m: v1::ChatMessage) -> ChatMessage {
    let mut message = ChatMessage::new(m.role, m.content);
    if !m.tool_calls.is_empty() {
        message.tool_calls = Some(
            m.tool_calls
                .into_iter()
                .map(|c| {
                    let id = Some(c.id).filter(|id| !id.is_empty());
                    crate::tools::template_call(id, &c.name, serde_json::Value::String(c.arguments))
                })
                .collect(),
        );
    }
    message.tool_call_id = Some(m.tool_call_id).filter(|id| !id.is_empty());
    message
}

/// Resolved sampling parameters (defaults applied, limits checked).
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// >= 0, finite; 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: u32,
    /// In (0, 1]; 1 = off.
    pub top_p: f32,
    /// In [0, 1]; 0 = off.
    pub min_p: f32,
    /// Seed, if the client gave one.
    pub seed: Option<u64>,
    /// Penalties and `logit_bias` (the worker's own type, checked with its own rules).
    pub controls: LogitsControls,
}

/// A request that passed validation: the only kind the dispatcher accepts.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    id: RequestId,
    prompt: Vec<u32>,
    block_hashes: Vec<BlockHash>,
    sampling: Sampling,
    max_tokens: u32,
    stop: Vec<String>,
    ignore_eos: bool,
    min_tokens: u32,
    stop_token_ids: Vec<u32>,
    speculative: Option<bool>,
    logprobs: Option<u32>,
    prompt_logprobs: Option<u32>,
    prompt_only: bool,
    response_format: Option<OutputGrammar>,
    n: u32,
    received: std::time::Instant,
}

impl ValidRequest {
    /// When the request arrived (validation started): latencies are measured from here.
    pub fn received(&self) -> std::time::Instant {
        self.received
    }
    /// The request id (the client's or a generated one).
    pub fn id(&self) -> &RequestId {
        &self.id
    }
    /// Prompt token ids; non-empty, shorter than the context.
    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }
    /// Chained hashes of the prompt's full blocks.
    pub fn block_hashes(&self) -> &[BlockHash] {
        &self.block_hashes
    }
    /// Resolved sampling.
    pub fn sampling(&self) -> &Sampling {
        &self.sampling
    }
    /// New tokens at most; >= 1, and prompt + max_tokens fits the context.
    pub fn max_tokens(&self) -> u32 {
        self.max_tokens
    }
    /// Stop strings (at most [`MAX_STOP_STRINGS`], none empty).
    pub fn stop(&self) -> &[String] {
        &self.stop
    }
    /// Whether EOS tokens are ignored.
    pub fn ignore_eos(&self) -> bool {
        self.ignore_eos
    }
    /// Stop tokens are masked until this many tokens are generated (<= `max_tokens`).
    pub fn min_tokens(&self) -> u32 {
        self.min_tokens
    }
    /// More tokens that end generation (at most [`MAX_STOP_TOKEN_IDS`], each in the
    /// vocabulary).
    pub fn stop_token_ids(&self) -> &[u32] {
        &self.stop_token_ids
    }
    /// Speculative decoding: `None` follows the decode worker, `Some(false)` turns it off for
    /// this request, `Some(true)` asks for it (plain decoding on a worker without a drafter).
    pub fn speculative(&self) -> Option<bool> {
        self.speculative
    }
    /// Alternatives per token when the client asked for log-probabilities (at most
    /// [`MAX_TOP_LOGPROBS`]).
    pub fn logprobs(&self) -> Option<u32> {
        self.logprobs
    }
    /// Alternatives per prompt token when the client asked for the prompt's
    /// log-probabilities (at most [`MAX_TOP_LOGPROBS`]).
    pub fn prompt_logprobs(&self) -> Option<u32> {
        self.prompt_logprobs
    }
    /// The client asked for the prompt alone (`max_tokens: 0` with `echo`): the workers
    /// generate one token (`max_tokens()` is 1), which the reply leaves out, as vLLM does.
    pub fn prompt_only(&self) -> bool {
        self.prompt_only
    }
    /// What the output must be (compiled once by the router: the workers' compiler accepts
    /// it); `None` = free text.
    pub fn response_format(&self) -> Option<&OutputGrammar> {
        self.response_format.as_ref()
    }
    /// Samples of the prompt, in [1, [`MAX_SAMPLES`]].
    pub fn n(&self) -> u32 {
        self.n
    }
}

/// What the validator needs to know about the served model.
#[derive(Debug, Clone)]
pub struct ValidatorParams {
    /// The name clients use.
    pub model_name: String,
    /// Longest prompt + completion, in tokens.
    pub context_length: usize,
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// Tokens per KV block (for the block hashes).
    pub page_size: usize,
    /// The tokenizer.
    pub tokenizer: TokenizerPool,
    /// The grammar compiler on that tokenizer (structured output); `None` when the tokenizer
    /// cannot become a token trie, and then every `response_format` is refused.
    pub grammar: Option<GrammarCompiler>,
}

/// Checks requests against the served model (cheap to clone).
#[derive(Debug, Clone)]
pub struct Validator {
    params: std::sync::Arc<ValidatorParams>,
    max_prompt_bytes: usize,
}

impl Validator {
    /// A validator for one served model; computes [`Validator::max_prompt_bytes`] once.
    pub fn new(params: ValidatorParams) -> Self {
        let per_token = params.tokenizer.tokenizer().max_token_bytes();
        let max_prompt_bytes = params.context_length.saturating_mul(per_token);
        Self {
            params: std::sync::Arc::new(params),
            max_prompt_bytes,
        }
    }

    /// Longest prompt text, in bytes, that could fit the context:
    /// `context_length × Tokenizer::max_token_bytes` (no token covers more bytes of text than
    /// the longest vocabulary string, so longer text needs more tokens than the context
    /// holds). Applies to a text prompt, a chat's message contents and roles together, and
    /// `Tokenize` text; checked before tokenizing.
    pub fn max_prompt_bytes(&self) -> usize {
        self.max_prompt_bytes
    }

    /// `text` (the value of `field`) must be at most [`Validator::max_prompt_bytes`] long.
    pub fn check_text_size(&self, field: &'static str, text: &str) -> Result<(), ValidationError> {
        self.check_size(field, "", text.len())
    }

    fn check_size(
        &self,
        field: &'static str,
        what: &str,
        bytes: usize,
    ) -> Result<(), ValidationError> {
        if bytes <= self.max_prompt_bytes {
            return Ok(());
        }
        let per_token = self.params.tokenizer.tokenizer().max_token_bytes();
        Err(ValidationError::new(
            field,
            format!(
                "{what}must be at most {} bytes (context length {} tokens × {per_token} bytes, \
                 the longest token), got {bytes} bytes",
                self.max_prompt_bytes, self.params.context_length
            ),
        ))
    }

    /// The prompt's size, before any tokenizing or hashing: text and chat by bytes
    /// ([`Validator::max_prompt_bytes`]), token ids by count (fewer than the context).
    fn check_prompt_size(&self, prompt: &PromptInput) -> Result<(), ValidationError> {
        match prompt {
            PromptInput::Text(text) => self.check_text_size("prompt", text),
            PromptInput::Tokens(ids) => {
                fit_context(ids.len(), Some(1), self.params.context_length).map(|_| ())
            }
            PromptInput::Chat(messages) => {
                let bytes = messages.iter().fold(0usize, |n, m| {
                    n.saturating_add(m.content.len() + m.role.len())
                });
                self.check_size("messages", "content and roles together ", bytes)
            }
            PromptInput::ChatTools(messages, tools) => {
                // Tool calls and definitions are prompt text too (the template renders them).
                let calls = |m: &ChatMessage| {
                    m.tool_calls
                        .as_ref()
                        .map_or(0, |c| serde_json::to_string(c).map_or(0, |s| s.len()))
                };
                let bytes = messages.iter().fold(0usize, |n, m| {
                    n.saturating_add(m.content.len() + m.role.len() + calls(m))
                });
                let tools = serde_json::to_string(tools).map_or(0, |s| s.len());
                self.check_size(
                    "messages",
                    "content, roles, tool calls and tools together ",
                    bytes.saturating_add(tools),
                )
            }
        }
    }

    /// The tokenizer pool.
    pub fn tokenizer(&self) -> &TokenizerPool {
        &self.params.tokenizer
    }

    /// `model` must be empty or the served name.
    pub fn check_model(&self, model: &str) -> Result<(), ValidationError> {
        if model.is_empty() || model == self.params.model_name {
            Ok(())
        } else {
            Err(ValidationError::new(
                "model",
                format!(
                    "must be {:?} (the served model) or empty, got {model:?}",
                    self.params.model_name
                ),
            ))
        }
    }

    /// Validates `p`, tokenizing on the blocking pool.
    pub async fn validate(&self, p: GenerateParams) -> Result<ValidRequest, RequestError> {
        let received = std::time::Instant::now();
        self.check_model(&p.model)?;
        self.check_prompt_size(&p.prompt)?;
        let sampling = resolve_sampling(&p.sampling, self.params.vocab_size)?;
        // `max_tokens: 0` with `echo` asks for the prompt alone: the workers still generate
        // one token (their prefill samples it), which the reply leaves out.
        let prompt_only = p.echo && p.max_tokens == Some(0);
        let asked_max_tokens = if prompt_only { Some(1) } else { p.max_tokens };
        if let Some(n) = asked_max_tokens {
            if n < 1 {
                let rule = if p.echo { ">= 0 with `echo`" } else { ">= 1" };
                return Err(
                    ValidationError::new("max_tokens", format!("must be {rule}, got {n}")).into(),
                );
            }
        }
        let n = match p.n {
            None => 1,
            Some(n) => u32::try_from(n)
                .ok()
                .filter(|n| (1..=MAX_SAMPLES).contains(n))
                .ok_or_else(|| {
                    ValidationError::new("n", format!("must be in [1, {MAX_SAMPLES}], got {n}"))
                })?,
        };
        let stop = check_stop(p.stop)?;
        let stop_token_ids = check_stop_token_ids(p.stop_token_ids, self.params.vocab_size)?;
        let logprobs = check_logprobs(p.logprobs)?;
        let prompt_logprobs = check_top_n("prompt_logprobs", p.prompt_logprobs)?;
        check_prompt_shape(&p.prompt, self.params.vocab_size)?;
        let response_format = match p.response_format {
            Some(f) => Some(crate::structured::check(self.params.grammar.as_ref(), f).await?),
            None => None,
        };

        let prepared = self
            .params
            .tokenizer
            .prepare(p.prompt, self.params.page_size)
            .await?;
        if prepared.tokens.is_empty() {
            return Err(ValidationError::new("prompt", "must not be empty, got 0 tokens").into());
        }
        let max_tokens = fit_context(
            prepared.tokens.len(),
            asked_max_tokens,
            self.params.context_length,
        )?;
        // Against what the client asked for: 0 with `max_tokens: 0`.
        let min_tokens = check_min_tokens(p.min_tokens, if prompt_only { 0 } else { max_tokens })?;
        let id = p
            .request_id
            .map(RequestId)
            .unwrap_or_else(|| RequestId(format!("req-{:016x}", rand::random::<u64>())));
        Ok(ValidRequest {
            id,
            prompt: prepared.tokens,
            block_hashes: prepared.hashes,
            sampling,
            max_tokens,
            stop,
            ignore_eos: p.ignore_eos,
            min_tokens,
            stop_token_ids,
            speculative: p.speculative,
            logprobs,
            prompt_logprobs,
            prompt_only,
            response_format,
            n,
            received,
        })
    }

    /// Token ids of `text` for the Tokenize rpc (model checked first).
    pub async fn tokenize(
        &self,
        model: &str,
        text: String,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, RequestError> {
        self.check_model(model)?;
        self.check_text_size("text", &text)?;
        self.params.tokenizer.encode(text, add_special_tokens).await
    }
}

impl Validator {
    /// Token ids of chat `messages` for `/tokenize` (model and size checked first).
    pub async fn tokenize_chat(
        &self,
        model: &str,
        messages: Vec<ChatMessage>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, RequestError> {
        self.check_model(model)?;
        let chat = PromptInput::Chat(messages);
        self.check_prompt_size(&chat)?;
        check_prompt_shape(&chat, self.params.vocab_size)?;
        let messages = match chat {
            PromptInput::Chat(m) => m,
            _ => Vec::new(),
        };
        self.params
            .tokenizer
            .encode_chat(messages, add_generation_prompt)
            .await
    }

    /// Text of `ids` for `/detokenize`: the model checked, at most the context's length of
    /// ids (the cost bound), each below the vocabulary size.
    pub async fn detokenize(&self, model: &str, ids: Vec<u32>) -> Result<String, RequestError> {
        self.check_model(model)?;
        if ids.len() > self.params.context_length {
            return Err(ValidationError::new(
                "tokens",
                format!(
                    "must hold at most {} ids (the context length), got {}",
                    self.params.context_length,
                    ids.len()
                ),
            )
            .into());
        }
        let vocab = self.params.vocab_size;
        if let Some(i) = ids.iter().position(|&t| t as usize >= vocab) {
            return Err(ValidationError::new(
                "tokens",
                format!(
                    "ids must be < {vocab} (the vocabulary size), got {} at index {i}",
                    ids[i]
                ),
            )
            .into());
        }
        self.params.tokenizer.decode(ids).await
    }
}

/// Applies defaults, converts to the `f32`s the decode worker samples with, and runs the
/// worker's own checks (`SamplingParams::validate`, `LogitsControls::validate` and
/// `LogitsControls::logit_bias_from` against `vocab`) on them: what passes here passes there.
/// A value that changes class in `f32` (`1e39` → `inf`, `1e-50` → `0`) is named with both.
pub fn resolve_sampling(s: &SamplingInput, vocab: usize) -> Result<Sampling, ValidationError> {
    let top_k = s.top_k.unwrap_or(0);
    let top_k = u32::try_from(top_k).map_err(|_| {
        ValidationError::new(
            "top_k",
            format!("must be in [0, {}], got {top_k}", u32::MAX),
        )
    })?;
    let params = SamplingParams {
        temperature: s.temperature.unwrap_or(1.0) as f32,
        top_k,
        top_p: s.top_p.unwrap_or(1.0) as f32,
        min_p: s.min_p.unwrap_or(0.0) as f32,
        seed: s.seed,
    };
    let named = |SamplingError {
                     field,
                     value,
                     limit,
                 }| {
        let given = match field {
            "temperature" => s.temperature,
            "top_p" => s.top_p,
            "min_p" => s.min_p,
            "presence_penalty" => s.presence_penalty,
            "frequency_penalty" => s.frequency_penalty,
            "repetition_penalty" => s.repetition_penalty,
            _ => None,
        }
        .unwrap_or(value);
        let as_f32 = if given.is_nan() || given == value {
            String::new()
        } else {
            format!(" ({value:?} as a 32-bit float)")
        };
        ValidationError::new(field, format!("must be {limit}, got {given:?}{as_f32}"))
    };
    params.validate().map_err(named)?;
    // A bias is checked as given (before rounding to f32): 100.00000001 is out of range.
    if let Some(&(token, bias)) = s
        .logit_bias
        .iter()
        .find(|(_, b)| !(-100.0..=100.0).contains(b))
    {
        return Err(ValidationError::new(
            "logit_bias",
            format!("values must be in [-100, 100], got {bias:?} for token {token}"),
        ));
    }
    let logit_bias =
        LogitsControls::logit_bias_from(s.logit_bias.iter().map(|&(t, b)| (t, b as f32)), vocab)
            .map_err(|e| {
                // The error's text already starts with the field's name.
                let text = e.to_string();
                let message = text
                    .strip_prefix("`logit_bias` ")
                    .unwrap_or(&text)
                    .to_string();
                ValidationError::new("logit_bias", message)
            })?;
    let controls = LogitsControls {
        presence_penalty: s.presence_penalty.unwrap_or(0.0) as f32,
        frequency_penalty: s.frequency_penalty.unwrap_or(0.0) as f32,
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0) as f32,
        logit_bias,
    };
    controls.validate().map_err(named)?;
    Ok(Sampling {
        temperature: params.temperature,
        top_k: params.top_k,
        top_p: params.top_p,
        min_p: params.min_p,
        seed: params.seed,
        controls,
    })
}

/// At most [`MAX_STOP_TOKEN_IDS`] stop token ids, each below `vocab`.
pub fn check_stop_token_ids(ids: Vec<u32>, vocab: usize) -> Result<Vec<u32>, ValidationError> {
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ValidationError::new(
            "stop_token_ids",
            format!(
                "must hold at most {MAX_STOP_TOKEN_IDS} ids, got {}",
                ids.len()
            ),
        ));
    }
    if let Some((i, t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(ValidationError::new(
            "stop_token_ids",
            format!("must be < {vocab} (the vocabulary size), got {t} at index {i}"),
        ));
    }
    Ok(ids)
}

/// `logprobs` in `[0, MAX_TOP_LOGPROBS]` when given.
pub fn check_logprobs(n: Option<i64>) -> Result<Option<u32>, ValidationError> {
    check_top_n("logprobs", n)
}

/// A count of alternatives per token (`field`) in `[0, MAX_TOP_LOGPROBS]` when given.
fn check_top_n(field: &'static str, n: Option<i64>) -> Result<Option<u32>, ValidationError> {
    match n {
        None => Ok(None),
        Some(n) if (0..=i64::from(MAX_TOP_LOGPROBS)).contains(&n) => Ok(Some(n as u32)),
        Some(n) => Err(ValidationError::new(
            field,
            format!("must be in [0, {MAX_TOP_LOGPROBS}], got {n}"),
        )),
    }
}

/// `min_tokens` in `[0, max_tokens]` (the resolved `max_tokens`); unset is 0.
pub fn check_min_tokens(min_tokens: Option<i64>, max_tokens: u32) -> Result<u32, ValidationError> {
    let n = min_tokens.unwrap_or(0);
    if n < 0 || n > i64::from(max_tokens) {
        return Err(ValidationError::new(
            "min_tokens",
            format!("must be in [0, {max_tokens}] (at most `max_tokens`), got {n}"),
        ));
    }
    Ok(n as u32)
}

/// At most [`MAX_STOP_STRINGS`] stop strings, none empty.
pub fn check_stop(stop: Vec<String>) -> Result<Vec<String>, ValidationError> {
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ValidationError::new(
            "stop",
            format!(
                "must have at most {MAX_STOP_STRINGS} strings, got {}",
                stop.len()
            ),
        ));
    }
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ValidationError::new(
            "stop",
            format!("strings must not be empty, got an empty string at index {i}"),
        ));
    }
    Ok(stop)
}

fn check_prompt_shape(prompt: &PromptInput, vocab_size: usize) -> Result<(), ValidationError> {
    match prompt {
        PromptInput::Text(t) if t.is_empty() => Err(ValidationError::new(
            "prompt",
            "must not be empty, got \"\"",
        )),
        PromptInput::Tokens(ids) if ids.is_empty() => {
            Err(ValidationError::new("prompt", "must not be empty, got []"))
        }
        PromptInput::Tokens(ids) => match ids.iter().position(|&t| t as usize >= vocab_size) {
            Some(i) => Err(ValidationError::new(
                "prompt",
                format!(
                    "token ids must be < {vocab_size} (the vocabulary size), got {} at index {i}",
                    ids.get(i).copied().unwrap_or_default()
                ),
            )),
            None => Ok(()),
        },
        PromptInput::Chat(m) | PromptInput::ChatTools(m, _) if m.is_empty() => Err(
            ValidationError::new("messages", "must not be empty, got []"),
        ),
        _ => Ok(()),
    }
}

/// Checks prompt + max_tokens against the context; resolves an unset `max_tokens` to what the
/// context leaves.
pub fn fit_context(
    prompt_tokens: usize,
    max_tokens: Option<i64>,
    context: usize,
) -> Result<u32, ValidationError> {
    if prompt_tokens >= context {
        return Err(ValidationError::new(
            "prompt",
            format!(
                "has {prompt_tokens} tokens, but the context length is {context} and at least \
                 one token must be left for the completion"
            ),
        ));
    }
    let room = context - prompt_tokens;
    let n = match max_tokens {
        Some(n) => n,
        None => i64::try_from(room).unwrap_or(i64::MAX),
    };
    if n < 1 {
        return Err(ValidationError::new(
            "max_tokens",
            format!("must be >= 1, got {n}"),
        ));
    }
    if n as u64 > room as u64 {
        return Err(ValidationError::new(
            "max_tokens",
            format!(
                "must be <= {room} (context length {context} minus {prompt_tokens} prompt \
                 tokens), got {n}"
            ),
        ));
    }
    u32::try_from(n).map_err(|_| {
        ValidationError::new("max_tokens", format!("must be <= {}, got {n}", u32::MAX))
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ferry_modelcard::tokenizer::Tokenizer;

    use super::*;

    fn validator() -> Validator {
        let dir = ferry_modelcard::embedded::default_model_dir();
        let tokenizer = Tokenizer::from_dir(&dir).expect("embedded tokenizer");
        Validator::new(ValidatorParams {
            model_name: "tiny".into(),
            context_length: 1024,
            vocab_size: 2048,
            page_size: 4,
            tokenizer: TokenizerPool::new(Arc::new(tokenizer)),
            grammar: None,
        })
    }

    fn params(prompt: PromptInput) -> GenerateParams {
        GenerateParams {
            model: String::new(),
            prompt,
            sampling: SamplingInput::default(),
            max_tokens: Some(8),
            stop: Vec::new(),
            ignore_eos: false,
            min_tokens: None,
            stop_token_ids: Vec::new(),
            request_id: None,
            speculative: None,
            logprobs: None,
            response_format: None,
            n: None,
            prompt_logprobs: None,
            echo: false,
        }
    }

    async fn field_of(p: GenerateParams) -> (String, String) {
        match validator().validate(p).await {
            Err(RequestError::Invalid(e)) => (e.field.to_string(), e.to_string()),
            other => panic!("expected a validation error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_valid_text_request_resolves_defaults_and_hashes() {
        let v = validator()
            .validate(params(PromptInput::Text("hello world, hello world".into())))
            .await
            .expect("valid");
        assert!(!v.prompt().is_empty());
        assert_eq!(v.block_hashes().len(), v.prompt().len() / 4);
        assert_eq!(v.sampling().temperature, 1.0);
        assert_eq!(v.sampling().top_p, 1.0);
        assert_eq!(v.max_tokens(), 8);
        assert!(v.id().0.starts_with("req-"));
    }

    #[tokio::test]
    async fn chat_renders_the_template() {
        let mut p = params(PromptInput::Chat(vec![ChatMessage::new("user", "hi")]));
        p.max_tokens = None;
        let v = validator().validate(p).await.expect("valid");
        assert_eq!(
            v.max_tokens() as usize,
            1024 - v.prompt().len(),
            "rest of the context"
        );

        let bad = params(PromptInput::Chat(vec![ChatMessage::new("wizard", "hi")]));
        let (field, msg) = field_of(bad).await;
        assert_eq!(field, "messages");
        assert!(msg.contains("unknown role"), "{msg}");
    }

    #[tokio::test]
    async fn errors_name_the_field_the_limit_and_the_value() {
        let (f, m) = field_of(params(PromptInput::Text(String::new()))).await;
        assert_eq!(f, "prompt", "{m}");
        let (f, _) = field_of(params(PromptInput::Tokens(vec![]))).await;
        assert_eq!(f, "prompt");
        let (f, m) = field_of(params(PromptInput::Tokens(vec![1, 5000]))).await;
        assert_eq!(f, "prompt");
        assert!(m.contains("2048") && m.contains("5000"), "{m}");
        let (f, _) = field_of(params(PromptInput::Chat(vec![]))).await;
        assert_eq!(f, "messages");

        let mut p = params(PromptInput::Text("hi".into()));
        p.max_tokens = Some(0);
        assert_eq!(field_of(p).await.1, "`max_tokens` must be >= 1, got 0");

        let mut p = params(PromptInput::Tokens(vec![7; 1000]));
        p.max_tokens = Some(100);
        let (f, m) = field_of(p).await;
        assert_eq!(f, "max_tokens");
        assert!(m.contains("<= 24") && m.contains("100"), "{m}");

        let p = params(PromptInput::Tokens(vec![7; 2000]));
        let (f, m) = field_of(p).await;
        assert_eq!(f, "prompt");
        assert!(m.contains("2000") && m.contains("1024"), "{m}");

        let mut p = params(PromptInput::Text("hi".into()));
        p.model = "gpt-4".into();
        let (f, m) = field_of(p).await;
        assert_eq!(f, "model");
        assert!(m.contains("gpt-4") && m.contains("tiny"), "{m}");

        let mut p = params(PromptInput::Text("hi".into()));
        p.stop = vec!["a".into(), String::new()];
        assert_eq!(field_of(p).await.0, "stop");
        let mut p = params(PromptInput::Text("hi".into()));
        p.stop = vec!["a".into(); 5];
        assert_eq!(field_of(p).await.0, "stop");
    }

    #[test]
    fn sampling_limits() {
        let ok = resolve_sampling(&SamplingInput::default(), 2048).expect("defaults");
        assert_eq!((ok.top_k, ok.min_p, ok.seed), (0, 0.0, None));
        let cases = [
            (
                SamplingInput {
                    temperature: Some(-1.0),
                    ..Default::default()
                },
                "temperature",
                "got -1",
            ),
            (
                SamplingInput {
                    temperature: Some(f64::NAN),
                    ..Default::default()
                },
                "temperature",
                "got NaN",
            ),
            (
                SamplingInput {
                    top_p: Some(1.5),
                    ..Default::default()
                },
                "top_p",
                "got 1.5",
            ),
            (
                SamplingInput {
                    top_p: Some(0.0),
                    ..Default::default()
                },
                "top_p",
                "got 0",
            ),
            (
                SamplingInput {
                    min_p: Some(2.0),
                    ..Default::default()
                },
                "min_p",
                "got 2",
            ),
            (
                SamplingInput {
                    top_k: Some(-1),
                    ..Default::default()
                },
                "top_k",
                "got -1",
            ),
        ];
        for (input, field, value) in cases {
            let err = resolve_sampling(&input, 2048).expect_err(field);
            assert_eq!(err.field, field);
            assert!(err.to_string().contains(value), "{err}");
        }
        let greedy = SamplingInput {
            temperature: Some(0.0),
            top_p: Some(1.0),
            min_p: Some(1.0),
            top_k: Some(5),
            seed: Some(3),
            ..Default::default()
        };
        assert!(resolve_sampling(&greedy, 2048).is_ok());
    }

    #[test]
    fn grpc_requests_convert_without_checks() {
        let wire = v1::GenerateRequest {
            model: "m".into(),
            input: Some(v1::generate_request::Input::Tokens(v1::TokenIds {
                ids: vec![1, 2],
            })),
            sampling: Some(v1::SamplingParams {
                temperature: Some(0.5),
                ..Default::default()
            }),
            stop: Some(v1::StopConditions {
                max_tokens: 0,
                stop: vec!["x".into()],
                ignore_eos: true,
                ..Default::default()
            }),
            request_id: String::new(),
            speculative: None,
            logprobs: Some(7),
            response_format: None,
            n: Some(3),
            ..Default::default()
        };
        let p = GenerateParams::try_from(wire.clone()).expect("converts");
        assert_eq!(p.logprobs, Some(7));
        assert_eq!(p.n, Some(3), "checked by the validator, as on HTTP");
        assert_eq!(p.prompt, PromptInput::Tokens(vec![1, 2]));
        assert_eq!(p.max_tokens, Some(0), "0 is kept so validation can name it");
        assert_eq!(p.sampling.temperature, Some(0.5));
        assert_eq!(p.request_id, None);
        assert!(p.ignore_eos);
        assert_eq!(p.speculative, None, "unset: the decode worker decides");
        for choice in [false, true] {
            let p = GenerateParams::try_from(v1::GenerateRequest {
                speculative: Some(choice),
                ..wire.clone()
            })
            .expect("converts");
            assert_eq!(p.speculative, Some(choice));
        }
    }

    #[test]
    fn sampling_is_checked_in_the_workers_f32() {
        let cases = [
            (
                SamplingInput {
                    temperature: Some(1e39),
                    ..Default::default()
                },
                "temperature",
                "got 1e39 (inf as a 32-bit float)",
            ),
            (
                SamplingInput {
                    top_p: Some(1e-50),
                    ..Default::default()
                },
                "top_p",
                "got 1e-50 (0.0 as a 32-bit float)",
            ),
            (
                SamplingInput {
                    temperature: Some(f64::INFINITY),
                    ..Default::default()
                },
                "temperature",
                "got inf",
            ),
        ];
        for (input, field, value) in cases {
            let err = resolve_sampling(&input, 2048).expect_err(field);
            assert_eq!(err.field, field);
            assert!(err.to_string().contains(value), "{err}");
        }
        // The largest finite f32 passes, and the worker's check agrees with what we resolved.
        let big = resolve_sampling(
            &SamplingInput {
                temperature: Some(f64::from(f32::MAX)),
                min_p: Some(1e-50),
                ..Default::default()
            },
            2048,
        )
        .expect("finite in f32");
        let worker = SamplingParams {
            temperature: big.temperature,
            top_k: big.top_k,
            top_p: big.top_p,
            min_p: big.min_p,
            seed: big.seed,
        };
        assert!(worker.validate().is_ok());
        assert_eq!(big.min_p, 0.0, "1e-50 is 0 in f32: min_p off");
    }

    #[tokio::test]
    async fn prompts_larger_than_the_context_can_hold_are_refused_by_size() {
        let v = validator();
        // Context 1024 × 15 bytes (`Ġrighteousness`, the longest token).
        assert_eq!(v.max_prompt_bytes(), 1024 * 15);
        let limit = v.max_prompt_bytes();
        let (f, m) = field_of(params(PromptInput::Text("a".repeat(limit + 1)))).await;
        assert_eq!(f, "prompt");
        assert!(
            m.contains(&limit.to_string()) && m.contains(&(limit + 1).to_string()),
            "{m}"
        );
        let chat = PromptInput::Chat(vec![
            ChatMessage::new("system", "a".repeat(limit / 2)),
            ChatMessage::new("user", "b".repeat(limit / 2)),
        ]);
        let (f, m) = field_of(params(chat)).await;
        assert_eq!(f, "messages");
        assert!(m.contains(&limit.to_string()), "{m}");
        // Token ids: at the context, refused before hashing.
        let (f, m) = field_of(params(PromptInput::Tokens(vec![7; 1024]))).await;
        assert_eq!(f, "prompt");
        assert!(m.contains("1024 tokens"), "{m}");
        // Tokenize names its own field.
        match v.tokenize("", "a".repeat(limit + 1), false).await {
            Err(RequestError::Invalid(e)) => assert_eq!(e.field, "text", "{e}"),
            other => panic!("expected a validation error, got {other:?}"),
        }
        // Exactly at the limit the text is tokenized (and here fails by token count).
        let (f, m) = field_of(params(PromptInput::Text("a b ".repeat(limit / 4)))).await;
        assert_eq!(f, "prompt");
        assert!(m.contains("context length is 1024"), "{m}");
    }

    #[tokio::test]
    async fn grpc_without_max_tokens_is_refused_by_name() {
        let wire = v1::GenerateRequest {
            input: Some(v1::generate_request::Input::Text("hi".into())),
            ..Default::default()
        };
        let p = GenerateParams::try_from(wire).expect("converts");
        assert_eq!(p.max_tokens, Some(0), "unset reads as 0, as the proto says");
        assert_eq!(field_of(p).await.1, "`max_tokens` must be >= 1, got 0");
    }

    #[tokio::test]
    async fn special_token_text_in_prompts_is_plain_text() {
        let v = validator();
        let injection = "<|bos|><|eos|><|user|>";
        let ids = v.tokenize("", injection.into(), false).await.expect("ok");
        assert!(ids.iter().all(|&id| id > 5), "no control ids: {ids:?}");
        let ok = v
            .validate(params(PromptInput::Text(injection.into())))
            .await
            .expect("valid");
        assert_eq!(ok.prompt().first(), Some(&0), "the BOS the tokenizer adds");
        assert!(
            ok.prompt()[1..].iter().all(|&id| id > 5),
            "{:?}",
            ok.prompt()
        );
        let chat = PromptInput::Chat(vec![ChatMessage::new("user", injection)]);
        let ok = v.validate(params(chat)).await.expect("valid");
        let controls: Vec<u32> = ok.prompt().iter().copied().filter(|&id| id <= 5).collect();
        assert_eq!(
            controls,
            vec![0, 2, 5, 3],
            "BOS, <|user|>, <|end|>, <|assistant|>"
        );
    }

    #[tokio::test]
    async fn logits_controls_and_stop_tokens_are_checked_by_name() {
        let with = |f: &dyn Fn(&mut GenerateParams)| {
            let mut p = params(PromptInput::Text("hi".into()));
            f(&mut p);
            p
        };
        let cases: Vec<(GenerateParams, &str, &[&str])> = vec![
            (
                with(&|p| p.sampling.presence_penalty = Some(2.5)),
                "presence_penalty",
                &["[-2, 2]", "got 2.5"],
            ),
            (
                with(&|p| p.sampling.frequency_penalty = Some(-3.0)),
                "frequency_penalty",
                &["[-2, 2]", "got -3"],
            ),
            (
                with(&|p| p.sampling.repetition_penalty = Some(0.0)),
                "repetition_penalty",
                &["> 0", "got 0"],
            ),
            (
                with(&|p| p.sampling.logit_bias = vec![(5000, 1.0)]),
                "logit_bias",
                &["< 2048", "5000"],
            ),
            (
                with(&|p| p.sampling.logit_bias = vec![(7, 150.0)]),
                "logit_bias",
                &["[-100, 100]", "150"],
            ),
            (
                with(&|p| p.sampling.logit_bias = (0..301).map(|t| (t, 1.0)).collect()),
                "logit_bias",
                &["at most 300", "got 301"],
            ),
            (
                with(&|p| p.stop_token_ids = vec![1, 9999]),
                "stop_token_ids",
                &["< 2048", "9999"],
            ),
            (
                with(&|p| p.stop_token_ids = vec![1; 65]),
                "stop_token_ids",
                &["at most 64", "65"],
            ),
            (
                with(&|p| p.min_tokens = Some(9)),
                "min_tokens",
                &["[0, 8]", "got 9"],
            ),
            (
                with(&|p| p.min_tokens = Some(-1)),
                "min_tokens",
                &["got -1"],
            ),
            (
                with(&|p| p.logprobs = Some(21)),
                "logprobs",
                &["[0, 20]", "got 21"],
            ),
        ];
        for (p, field, parts) in cases {
            let (f, m) = field_of(p).await;
            assert_eq!(f, field, "{m}");
            assert!(m.starts_with(&format!("`{field}`")), "{m}");
            for part in parts {
                assert!(m.contains(part), "{m} lacks {part}");
            }
        }
        let ok = with(&|p| {
            p.sampling.presence_penalty = Some(-2.0);
            p.sampling.frequency_penalty = Some(2.0);
            p.sampling.repetition_penalty = Some(1.3);
            p.sampling.logit_bias = vec![(9, -100.0), (3, 100.0)];
            p.min_tokens = Some(8);
            p.stop_token_ids = vec![4, 2047];
        });
        let v = validator().validate(ok).await.expect("valid");
        let c = &v.sampling().controls;
        assert_eq!(
            (
                c.presence_penalty,
                c.frequency_penalty,
                c.repetition_penalty
            ),
            (-2.0, 2.0, 1.3)
        );
        assert_eq!(
            c.logit_bias,
            vec![(3, 100.0), (9, -100.0)],
            "sorted by token"
        );
        assert_eq!((v.min_tokens(), v.stop_token_ids()), (8, &[4, 2047][..]));
        assert_eq!(v.logprobs(), None);
        let asks = with(&|p| p.logprobs = Some(20));
        let v = validator().validate(asks).await.expect("valid");
        assert_eq!(v.logprobs(), Some(20));
    }

    /// `echo`: `max_tokens: 0` asks for the prompt alone (the workers get 1, the request says
    /// `prompt_only`), without `echo` it is refused as before; `prompt_logprobs` is checked
    /// like `logprobs`, by its own name; `min_tokens` is held to the client's 0.
    #[tokio::test]
    async fn echo_allows_max_tokens_zero_and_prompt_logprobs_are_checked() {
        let with = |f: &dyn Fn(&mut GenerateParams)| {
            let mut p = params(PromptInput::Text("hi".into()));
            f(&mut p);
            p
        };
        let only = with(&|p| {
            p.echo = true;
            p.max_tokens = Some(0);
            p.prompt_logprobs = Some(2);
        });
        let v = validator().validate(only).await.expect("valid");
        assert!(v.prompt_only());
        assert_eq!((v.max_tokens(), v.prompt_logprobs()), (1, Some(2)));
        let echo = with(&|p| p.echo = true);
        let v = validator().validate(echo).await.expect("valid");
        assert!(!v.prompt_only());
        assert_eq!((v.max_tokens(), v.prompt_logprobs()), (8, None));
        let cases: Vec<(GenerateParams, &str, &str)> = vec![
            (
                with(&|p| p.max_tokens = Some(0)),
                "max_tokens",
                "must be >= 1, got 0",
            ),
            (
                with(&|p| {
                    p.echo = true;
                    p.max_tokens = Some(-1);
                }),
                "max_tokens",
                "must be >= 0 with `echo`, got -1",
            ),
            (
                with(&|p| {
                    p.echo = true;
                    p.prompt_logprobs = Some(21);
                }),
                "prompt_logprobs",
                "must be in [0, 20], got 21",
            ),
            (
                with(&|p| {
                    p.echo = true;
                    p.max_tokens = Some(0);
                    p.min_tokens = Some(1);
                }),
                "min_tokens",
                "must be in [0, 0]",
            ),
        ];
        for (p, field, part) in cases {
            let (f, m) = field_of(p).await;
            assert_eq!(f, field, "{m}");
            assert!(m.contains(part), "{m} lacks {part}");
        }
    }

    #[tokio::test]
    async fn the_speculation_choice_is_kept() {
        for choice in [None, Some(false), Some(true)] {
            let mut p = params(PromptInput::Text("hi".into()));
            p.speculative = choice;
            let v = validator().validate(p).await.expect("valid");
            assert_eq!(v.speculative(), choice);
        }
    }
}
