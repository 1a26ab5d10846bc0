//! `tokenizer.json` through Hugging Face `tokenizers`, chat templates through `minijinja`, and a
//! streaming detokenizer for token-by-token output.
//!
//! | item | what |
//! |---|---|
//! | [`Tokenizer`] | encode/decode plus the model's chat template, loaded from a model directory |
//! | [`ChatMessage`] | one `{role, content}` turn handed to the template (with `tool_calls` / `tool_call_id` in tool conversations) |
//! | [`DecodeStream`] | turns one id at a time into text, holding back incomplete UTF-8 |
//!
//! **Client text never becomes a control token.** [`Tokenizer::encode_text`] tokenizes text
//! with special tokens split (a typed `<|user|>` is plain characters, several ids), and
//! [`Tokenizer::encode_chat`] keeps the chat template's control tokens while tokenizing the
//! messages' content as plain text (see there how). [`Tokenizer::encode`] parses special tokens
//! and is for trusted text only: a rendered template, the CLI's own prompt.
//!
//! Templates render the way transformers renders them (`trim_blocks` and `lstrip_blocks` on;
//! variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and `tools` (the
//! request's tool definitions in OpenAI's shape, or undefined without tools); a
//! `raise_exception(msg)` function; Python string/dict methods such as `.strip()` and
//! `.get()` through minijinja-contrib's pycompat; and a `tojson` filter that writes JSON the way
//! Python's `json.dumps(..., ensure_ascii=False)` does, including the `indent` and `separators`
//! arguments Kimi's template uses). The template comes from `chat_template.jinja` when that file
//! exists, else from `chat_template` in `tokenizer_config.json`.
//!
//! Tokenization is CPU work: callers on an async runtime run it on `spawn_blocking`.
use std::ops::Range;
use std::path::Path;

use aho_corasick::{AhoCorasick, MatchKind};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::CardError;

/// The tokenizer file every model directory must have.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// Optional file with the chat template and special-token strings.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// Optional file holding the chat template alone (newer transformers layout); wins over
/// `tokenizer_config.json`'s `chat_template`.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

const TEMPLATE_NAME: &str = "chat_template";

/// How much shorter a normalizer may make text, at most, for [`Tokenizer::max_token_bytes`]:
/// Unicode composition (NFC/NFKC) turns at most three code points (a Hangul L+V+T jamo
/// sequence, 9 bytes) into one of 3 bytes.
const NORMALIZER_SHRINK: usize = 4;

/// Brackets a message's index in the placeholder render of [`Tokenizer::encode_chat`]
/// (private-use code points, which no template adds or strips).
const PLACEHOLDER_OPEN: char = '\u{E000}';
const PLACEHOLDER_CLOSE: char = '\u{E001}';

/// One conversation turn as chat templates see it (`message['role']`, `message['content']`,
/// and in tool conversations `message['tool_calls']` / `message['tool_call_id']`, absent
/// otherwise, as in transformers).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, … — whatever the template understands.
    pub role: String,
    /// The turn's text.
    pub content: String,
    /// An assistant turn's tool calls, OpenAI's shape (`{"id", "type": "function",
    /// "function": {"name", "arguments"}}`) with `arguments` as a JSON value, as transformers'
    /// templates expect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` turn's answer to this call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }

    /// Client text of this turn besides `content` and `role` (its tool calls and call id), as
    /// JSON, for the special-token check.
    fn tool_text(&self) -> Option<String> {
        if self.tool_calls.is_none() && self.tool_call_id.is_none() {
            return None;
        }
        Some(format!(
            "{} {}",
            serde_json::to_string(&self.tool_calls).unwrap_or_default(),
            self.tool_call_id.as_deref().unwrap_or_default()
        ))
    }
}

/// A model's tokenizer and, when it ships one, its chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` with special-token matching off (`encode_special_tokens`): client text goes
    /// through it, so special-token text in it stays plain text.
    plain: tokenizers::Tokenizer,
    /// Finds special tokens' text (leftmost-longest, as `tokenizers` matches added tokens);
    /// `None` when the vocabulary has none.
    specials: Option<AhoCorasick>,
    /// See [`Tokenizer::max_token_bytes`].
    max_token_bytes: usize,
    /// Compiled template (registered as [`TEMPLATE_NAME`]); `None` when the model has none.
    template: Option<Environment<'static>>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("has_chat_template", &self.template.is_some())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl Tokenizer {
    /// The tokenizer of the model in `dir`; for a directory holding only a `config.json` (a
    /// model served with dummy weights, whose tokenizer this machine may not have either), the
    /// embedded model's tokenizer instead — `true` in the result says so, for the caller to
    /// log. Its ids are a prefix of any larger vocabulary, so prompts encode; generated ids
    /// past its vocabulary decode to nothing.
    pub fn from_dir_or_embedded(dir: &Path) -> Result<(Self, bool), CardError> {
        if !dir.join(TOKENIZER_FILE).exists() && dir.join("config.json").exists() {
            let embedded = crate::embedded::default_model_dir();
            return Ok((Self::from_dir(&embedded)?, true));
        }
        Ok((Self::from_dir(dir)?, false))
    }

    /// Loads `tokenizer.json` (required: [`CardError::MissingFile`] if absent) and, when
    /// present, `tokenizer_config.json` and `chat_template.jinja` from `dir`.
    ///
    /// The chat template is compiled here, so a template with a syntax error fails loading
    /// ([`CardError::ChatTemplate`]) rather than the first request.
    pub fn from_dir(dir: &Path) -> Result<Self, CardError> {
        let path = dir.join(TOKENIZER_FILE);
        if !path.exists() {
            return Err(CardError::MissingFile(path));
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| CardError::Tokenizer(format!("cannot load `{}`: {e}", path.display())))?;

        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config = if config_path.exists() {
            let text = read(&config_path)?;
            serde_json::from_str::<serde_json::Value>(&text).map_err(|e| {
                CardError::Tokenizer(format!("invalid `{}`: {e}", config_path.display()))
            })?
        } else {
            serde_json::Value::Null
        };
        let bos_token = special_token(&config, "bos_token");
        let eos_token = special_token(&config, "eos_token");

        let template_path = dir.join(CHAT_TEMPLATE_FILE);
        let source = if template_path.exists() {
            Some(read(&template_path)?)
        } else {
            template_from_config(&config)
        };
        let template = source.map(compile_template).transpose()?;
        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        let special_texts: Vec<String> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(_, t)| t)
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        let specials = if special_texts.is_empty() {
            None
        } else {
            let matcher = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(&special_texts)
                .map_err(|e| CardError::Tokenizer(format!("special-token matcher: {e}")))?;
            Some(matcher)
        };
        let longest = inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1);
        let max_token_bytes = if inner.get_normalizer().is_some() {
            longest * NORMALIZER_SHRINK
        } else {
            longest
        };
        Ok(Self {
            inner,
            plain,
            specials,
            max_token_bytes,
            template,
            bos_token,
            eos_token,
        })
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (e.g.
    /// a leading BOS). Prompts rendered by a chat template already contain their special tokens.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, CardError> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| CardError::Tokenizer(format!("encode failed: {e}")))
    }

    /// Token ids of client text: like [`Tokenizer::encode`], but special-token text in `text`
    /// is tokenized as the plain characters it is (`<|bos|>` becomes several ordinary ids), so
    /// a prompt cannot forge the control tokens a chat template uses. `add_special_tokens`
    /// still applies the post-processor (e.g. a leading BOS), which the client asks for.
    pub fn encode_text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, CardError> {
        self.plain
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| CardError::Tokenizer(format!("encode failed: {e}")))
    }

    /// The first special token's text found in `text`, if any.
    pub fn find_special_token<'t>(&self, text: &'t str) -> Option<&'t str> {
        let m = self.specials.as_ref()?.find(text)?;
        text.get(m.range())
    }

    /// At most this many bytes of client text become one token: the longest token string in
    /// the vocabulary (added tokens included), times [`NORMALIZER_SHRINK`] when the tokenizer
    /// has a normalizer.
    ///
    /// Why it bounds the text one token covers: the tokenizers LLMs ship are lossless (every
    /// input byte is inside exactly one token's span), and a token's vocabulary string is at
    /// least as long as the bytes it stands for. Byte-level BPE spells each byte as one char of
    /// 1–2 UTF-8 bytes (`Ġ` = a space), SentencePiece-style BPE spells a space as `▁` (3 bytes)
    /// and a fallback byte as `<0x0A>` (6 bytes), an added token matches its own text. So `n`
    /// tokens cover at most `n × max_token_bytes` bytes, and text longer than
    /// `context × max_token_bytes` cannot fit a context of `context` tokens: the router
    /// refuses it before tokenizing. (Not a bound for WordPiece, whose `[UNK]` stands for a
    /// whole word, nor for normalizers that delete text such as accent stripping; no model
    /// ferry serves uses either.)
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// Token ids of `messages` rendered with the chat template: the template's own special
    /// tokens are control tokens, the messages' content is client text ([`Tokenizer::encode_text`]).
    ///
    /// When no content holds special-token text (the usual case) this is exactly
    /// `encode(apply_chat_template(..), false)`. Otherwise the template is rendered a second
    /// time with each content replaced by a placeholder, which tells where each content lies
    /// in the real render; special tokens are then recognised only outside those spans, and
    /// the text between them is tokenized plainly (whole, so merges across the template/content
    /// boundary are as in a normal encode). If putting the contents back into the placeholder
    /// render does not give the real render (the template transforms content, e.g. with
    /// `.strip()` or `.split()`), the spans are unknown and the request fails
    /// ([`CardError::ChatTemplate`]) rather than risk a forged control token. A role holding
    /// special-token text fails the same way.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, CardError> {
        self.encode_chat_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`Self::encode_chat`] with the request's tool definitions (OpenAI's `tools`) in the
    /// template's `tools` variable. Tool definitions, tool calls and call ids are client text
    /// the template may place anywhere: one holding special-token text is refused
    /// ([`CardError::ChatTemplate`]).
    pub fn encode_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, CardError> {
        for (i, m) in messages.iter().enumerate() {
            if let Some(token) = self.find_special_token(&m.role) {
                return Err(CardError::ChatTemplate(format!(
                    "the role of message {i} contains the special token {token:?}"
                )));
            }
            if let Some(token) = m
                .tool_text()
                .and_then(|t| self.find_special_token(&t).map(str::to_owned))
            {
                return Err(CardError::ChatTemplate(format!(
                    "the tool calls of message {i} contain the special token {token:?}"
                )));
            }
        }
        if !tools.is_empty() {
            let text = serde_json::to_string(tools).unwrap_or_default();
            if let Some(token) = self.find_special_token(&text) {
                return Err(CardError::ChatTemplate(format!(
                    "the tool definitions contain the special token {token:?}"
                )));
            }
        }
        let rendered = self.render(messages, tools, add_generation_prompt)?;
        let injected = messages
            .iter()
            .enumerate()
            .find_map(|(i, m)| self.find_special_token(&m.content).map(|t| (i, t)));
        let Some((index, token)) = injected else {
            return self.encode(&rendered, false);
        };
        let spans = self
            .content_spans(messages, tools, add_generation_prompt, &rendered)?
            .ok_or_else(|| {
                CardError::ChatTemplate(format!(
                    "message {index} contains the special token {token:?}, and this model's \
                     chat template changes message content, so its text cannot be kept apart \
                     from the template's control tokens; remove the special token"
                ))
            })?;
        self.encode_with_content_spans(&rendered, &spans)
    }

    /// Where the contents of `messages` lie in `rendered` (sorted byte ranges), from a render
    /// with placeholders; `None` when the contents do not appear verbatim.
    fn content_spans(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
        rendered: &str,
    ) -> Result<Option<Vec<Range<usize>>>, CardError> {
        let marked: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage {
                content: format!("{PLACEHOLDER_OPEN}{i}{PLACEHOLDER_CLOSE}"),
                ..m.clone()
            })
            .collect();
        let skeleton = self.render(&marked, tools, add_generation_prompt)?;
        let mut rebuilt = String::with_capacity(rendered.len());
        let mut spans = Vec::new();
        let mut rest = skeleton.as_str();
        while let Some(open) = rest.find(PLACEHOLDER_OPEN) {
            let (before, marker) = rest.split_at(open);
            rebuilt.push_str(before);
            let body = &marker[PLACEHOLDER_OPEN.len_utf8()..];
            let parsed = body.find(PLACEHOLDER_CLOSE).and_then(|close| {
                let index: usize = body.get(..close)?.parse().ok()?;
                Some((messages.get(index)?, close))
            });
            match parsed {
                Some((message, close)) => {
                    let start = rebuilt.len();
                    rebuilt.push_str(&message.content);
                    spans.push(start..rebuilt.len());
                    rest = &body[close + PLACEHOLDER_CLOSE.len_utf8()..];
                }
                None => {
                    rebuilt.push(PLACEHOLDER_OPEN);
                    rest = body;
                }
            }
        }
        rebuilt.push_str(rest);
        Ok((rebuilt == rendered).then_some(spans))
    }

    /// Tokenizes `text` with special tokens recognised only outside `spans` (sorted,
    /// non-overlapping byte ranges) and everything else tokenized as plain text.
    fn encode_with_content_spans(
        &self,
        text: &str,
        spans: &[Range<usize>],
    ) -> Result<Vec<u32>, CardError> {
        // Special tokens the template emitted: matches lying wholly in template-owned text.
        let mut controls: Vec<(Range<usize>, u32)> = Vec::new();
        let mut owned_start = 0;
        let owned = spans
            .iter()
            .map(|s| (s.start, s.end))
            .chain(std::iter::once((text.len(), text.len())));
        for (content_start, content_end) in owned {
            let region = owned_start..content_start.max(owned_start);
            if let (Some(matcher), Some(slice)) = (&self.specials, text.get(region.clone())) {
                for m in matcher.find_iter(slice) {
                    let range = region.start + m.start()..region.start + m.end();
                    let id = text
                        .get(range.clone())
                        .and_then(|t| self.inner.token_to_id(t));
                    if let Some(id) = id {
                        controls.push((range, id));
                    }
                }
            }
            owned_start = owned_start.max(content_end);
        }
        let mut ids = Vec::new();
        let mut at = 0;
        for (range, id) in controls {
            let run = text.get(at..range.start).unwrap_or_default();
            if !run.is_empty() {
                ids.extend(self.encode_text(run, false)?);
            }
            ids.push(id);
            at = range.end;
        }
        let tail = text.get(at..).unwrap_or_default();
        if !tail.is_empty() {
            ids.extend(self.encode_text(tail, false)?);
        }
        Ok(ids)
    }

    /// Text of `ids`; `skip_special_tokens` drops special tokens such as BOS/EOS.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, CardError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| CardError::Tokenizer(format!("decode failed: {e}")))
    }

    /// Number of ids the tokenizer can produce, added tokens included. May be smaller than the
    /// model's `vocab_size`, whose embedding is often padded.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of token `token` (e.g. `"<|im_end|>"`), if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// `bos_token` from `tokenizer_config.json`, if set.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// `eos_token` from `tokenizer_config.json`, if set.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Whether the model ships a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The wrapped `tokenizers` tokenizer, for features this wrapper does not expose.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Renders `messages` with the model's chat template; `add_generation_prompt` appends the
    /// assistant-turn opener so the model answers next.
    ///
    /// [`CardError::ChatTemplate`] when the model has no template, or rendering fails
    /// (including the template's own `raise_exception`).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, CardError> {
        self.render(messages, &[], add_generation_prompt)
    }

    /// [`Self::apply_chat_template`] with `tools` in the template's `tools` variable (left
    /// undefined when empty, as transformers passes `None`).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String, CardError> {
        let env = self.template.as_ref().ok_or_else(|| {
            CardError::ChatTemplate(format!(
                "this model has no chat template (neither `{CHAT_TEMPLATE_FILE}` nor \
                 `chat_template` in `{TOKENIZER_CONFIG_FILE}`)"
            ))
        })?;
        let template = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| CardError::ChatTemplate(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.as_deref().unwrap_or(""),
                eos_token => self.eos_token.as_deref().unwrap_or(""),
                tools => (!tools.is_empty()).then_some(tools),
            })
            .map_err(|e| CardError::ChatTemplate(render_error(&e)))
    }
}

/// Incremental detokenizer: feed ids one at a time, get text as soon as it is complete.
///
/// Byte-level BPE tokens can end in the middle of a UTF-8 character; decoding such a prefix
/// yields U+FFFD, so the stream holds text back until the character completes. It decodes a
/// short window of recent ids (not only the new one) because decoders such as Metaspace change
/// a token's text depending on what precedes it. This is the algorithm of `tokenizers`'
/// `DecodeStream`, with owned state so it can live in per-sequence state without borrowing
/// the tokenizer. Concatenating every chunk from [`DecodeStream::step`] and
/// [`DecodeStream::finish`] equals `decode(all ids)`.
#[derive(Debug, Clone, Default)]
pub struct DecodeStream {
    skip_special_tokens: bool,
    /// Window of recent ids: those already emitted as `prefix`, then pending ones.
    ids: Vec<u32>,
    /// Text of `ids[..prefix_index]`.
    prefix: String,
    prefix_index: usize,
}

impl DecodeStream {
    /// An empty stream; `skip_special_tokens` as in [`Tokenizer::decode`].
    pub fn new(skip_special_tokens: bool) -> Self {
        Self {
            skip_special_tokens,
            ..Self::default()
        }
    }

    /// Adds `id`; returns the newly completed text, or `None` while a character is incomplete.
    pub fn step(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Option<String>, CardError> {
        tokenizers::step_decode_stream(
            &tokenizer.inner,
            vec![id],
            self.skip_special_tokens,
            &mut self.ids,
            &mut self.prefix,
            &mut self.prefix_index,
        )
        .map_err(|e| CardError::Tokenizer(format!("streaming decode failed: {e}")))
    }

    /// Flushes text still held back (an incomplete character at the end of generation decodes
    /// as U+FFFD, as in a full decode) and resets the stream.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<Option<String>, CardError> {
        let text = tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        let prefix = std::mem::take(&mut self.prefix);
        self.ids.clear();
        self.prefix_index = 0;
        match text.strip_prefix(prefix.as_str()) {
            Some("") => Ok(None),
            Some(rest) => Ok(Some(rest.to_string())),
            None => Err(CardError::Tokenizer(format!(
                "streaming decode: window text {text:?} does not start with emitted {prefix:?}"
            ))),
        }
    }
}

fn read(path: &Path) -> Result<String, CardError> {
    std::fs::read_to_string(path).map_err(|source| CardError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// `bos_token`/`eos_token` in `tokenizer_config.json`: a string or an AddedToken object.
fn special_token(config: &serde_json::Value, key: &str) -> Option<String> {
    match config.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// `chat_template` in `tokenizer_config.json`: a string, or a list of `{name, template}` from
/// which the one named `default` (else the first) is used.
fn template_from_config(config: &serde_json::Value) -> Option<String> {
    match config.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(items) => {
            let named = |item: &&serde_json::Value| {
                item.get("name").and_then(serde_json::Value::as_str) == Some("default")
            };
            let chosen = items.iter().find(named).or_else(|| items.first())?;
            chosen.get("template")?.as_str().map(str::to_string)
        }
        _ => None,
    }
}

fn compile_template(source: String) -> Result<Environment<'static>, CardError> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_filter("tojson", tojson);
    env.add_template_owned(TEMPLATE_NAME, source)
        .map_err(|e| CardError::ChatTemplate(format!("does not compile: {}", render_error(&e))))?;
    Ok(env)
}

/// A minijinja error with its chain of causes (the template's line is in the message).
fn render_error(e: &minijinja::Error) -> String {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    message
}

/// `raise_exception(msg)`: how HF templates reject conversations they cannot render.
fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as transformers defines it: `json.dumps(value, ensure_ascii=False, indent=indent,
/// separators=separators)`, keys in insertion order, output marked safe.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: `separators` must be a pair (item_separator, key_separator)",
            ))
        }
        // Python's defaults: ", " without indent, "," with it.
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let format = JsonFormat {
        indent,
        item_sep,
        key_sep,
    };
    let mut out = String::new();
    write_json(&mut out, &value, &format, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonFormat {
    indent: Option<usize>,
    item_sep: String,
    key_sep: String,
}

impl JsonFormat {
    fn newline(&self, out: &mut String, level: usize) {
        if let Some(width) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', width * level));
        }
    }

    /// Separator and indentation before item `index` of a container at `level`.
    fn item_start(&self, out: &mut String, index: usize, level: usize) {
        if index > 0 {
            out.push_str(&self.item_sep);
        }
        self.newline(out, level + 1);
    }

    /// Closes a container at `level`; Python puts `[]`/`{}` of empty ones on one line.
    fn close(&self, out: &mut String, non_empty: bool, level: usize, bracket: char) {
        if non_empty {
            self.newline(out, level);
        }
        out.push(bracket);
    }
}

fn write_json(
    out: &mut String,
    value: &Value,
    format: &JsonFormat,
    level: usize,
) -> Result<(), minijinja::Error> {
    let to_err = |e: serde_json::Error| {
        minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}"))
    };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                out.push_str(&value.to_string());
            } else {
                let x = f64::try_from(value.clone())?;
                out.push_str(&python_float(x));
            }
        }
        ValueKind::String => {
            let s = value.as_str().unwrap_or_default();
            out.push_str(&serde_json::to_string(s).map_err(to_err)?);
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                format.item_start(out, i, level);
                write_json(out, item, format, level + 1)?;
            }
            format.close(out, !items.is_empty(), level, ']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = value.try_iter()?.collect();
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                format.item_start(out, i, level);
                let key_text = match key.as_str() {
                    Some(s) => s.to_string(),
                    None => key.to_string(),
                };
                out.push_str(&serde_json::to_string(&key_text).map_err(to_err)?);
                out.push_str(&format.key_sep);
                write_json(out, &value.get_item(key)?, format, level + 1)?;
            }
            format.close(out, !keys.is_empty(), level, '}');
        }
        _ => out.push_str(&serde_json::to_string(value).map_err(to_err)?),
    }
    Ok(())
}

/// Python's `repr(float)` for the common cases: integral values keep a `.0`.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        "NaN".to_string()
    } else if x.is_infinite() {
        if x > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
    } else if x.fract() == 0.0 && x.abs() < 1e16 {
        format!("{x:.1}")
    } else {
        x.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &str, ctx: Value) -> Result<String, CardError> {
        let env = compile_template(template.to_string())?;
        env.get_template(TEMPLATE_NAME)
            .and_then(|t| t.render(ctx))
            .map_err(|e| CardError::ChatTemplate(render_error(&e)))
    }

    #[test]
    fn tojson_matches_python_json_dumps() -> Result<(), CardError> {
        let x = r#"{% set x = {"b": [1, 2.0, "é\n"], "a": none, "c": true} %}"#;
        let ctx = Value::UNDEFINED;
        // Insertion order kept, Python's default separators, no ASCII escaping.
        assert_eq!(
            render(&format!("{x}{{{{ x | tojson }}}}"), ctx.clone())?,
            r#"{"b": [1, 2.0, "é\n"], "a": null, "c": true}"#
        );
        assert_eq!(
            render(
                &format!("{x}{{{{ x | tojson(separators=(',', ':')) }}}}"),
                ctx.clone()
            )?,
            r#"{"b":[1,2.0,"é\n"],"a":null,"c":true}"#
        );
        assert_eq!(
            render(&format!("{x}{{{{ x | tojson(indent=2) }}}}"), ctx)?,
            "{\n  \"b\": [\n    1,\n    2.0,\n    \"é\\n\"\n  ],\n  \"a\": null,\n  \"c\": true\n}"
        );
        Ok(())
    }

    #[test]
    fn deepseek_style_constructs_render_like_jinja2() -> Result<(), CardError> {
        // namespace(), `in`/`not in`, `.split()[-1]` (pycompat), `{% break %}` (transformers
        // enables jinja2's loopcontrols) and `{%-`/`{{-` trimming, as DeepSeek's templates use.
        let template = "{% set ns = namespace(system_prompt='', first=true) %}\n{%- for message in messages %}\n    {%- if message['role'] == 'system' %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{%- endif %}\n{%- endfor %}\n{{- bos_token }}{{ ns.system_prompt }}\n{%- for message in messages %}\n    {%- if message.role == 'user' %}{{ '<｜User｜>' + message['content'] }}\n    {%- elif message.role == 'assistant' and 'tool_calls' not in message %}{{ '<｜Assistant｜>' + message['content'].split('</think>')[-1] + eos_token }}\n    {%- elif message.role == 'stop' %}{% break %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}";
        let messages = [
            ChatMessage::new("system", "S."),
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "<think>x</think>Yo"),
            ChatMessage::new("user", "Q"),
            ChatMessage::new("stop", ""),
            ChatMessage::new("user", "never"),
        ];
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => "<｜begin▁of▁sentence｜>",
            eos_token => "<｜end▁of▁sentence｜>",
        };
        // Expected: Python jinja2 3.1.6 with transformers' environment settings.
        assert_eq!(
            render(template, ctx)?,
            "<｜begin▁of▁sentence｜>S.<｜User｜>Hi<｜Assistant｜>Yo<｜end▁of▁sentence｜><｜User｜>Q<｜Assistant｜>"
        );
        Ok(())
    }

    #[test]
    fn raise_exception_becomes_a_chat_template_error() {
        let err = render("{{ raise_exception('no tools here') }}", Value::UNDEFINED);
        let message = err.unwrap_or_else(|e| e.to_string());
        assert!(message.contains("no tools here"), "{message}");
    }

    #[test]
    fn special_tokens_accept_strings_and_added_token_objects() {
        let config = serde_json::json!({
            "bos_token": "<s>",
            "eos_token": {"content": "</s>", "special": true},
        });
        assert_eq!(special_token(&config, "bos_token").as_deref(), Some("<s>"));
        assert_eq!(special_token(&config, "eos_token").as_deref(), Some("</s>"));
        assert_eq!(special_token(&config, "pad_token"), None);
    }

    #[test]
    fn template_lists_prefer_default() {
        let config = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]});
        assert_eq!(template_from_config(&config).as_deref(), Some("D"));
    }
}
