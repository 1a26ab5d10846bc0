//! Constrained decoding: what a request's output must be ([`OutputGrammar`]: any JSON object,
//! or JSON valid under a JSON Schema), compiled against the served tokenizer into a per-request
//! token matcher ([`Grammar`]) by [`GrammarCompiler`].
//!
//! The grammar engine is [`llguidance`] (the one vLLM and SGLang use): an Earley parser over a
//! lexer, with a token trie of the vocabulary, that gives the set of tokens allowed next
//! (`compute_mask`, tens of microseconds per token) and advances or rolls back per token.
//!
//! | piece | lives | built |
//! |---|---|---|
//! | [`GrammarCompiler`] (token trie, `ParserFactory`) | one per process (router, each worker) | once, from the tokenizer |
//! | [`Grammar`] (`llguidance::Matcher`) | one per request, on the engine thread | per request, from an [`OutputGrammar`] |
//!
//! The router compiles each request's grammar once to refuse invalid or unsupported schemas at
//! the edge (a 400 naming the field); the workers compile it again for their own matcher. Both
//! are CPU work: callers run them off the async runtime.
//!
//! JSON output is compact: ferry compiles schemas with llguidance's `whitespace_flexible` off
//! (no whitespace between JSON tokens; separators `,` and `:`), unless the schema sets its own
//! `x-guidance` options. A tiny or weak model otherwise tends to spend its token budget on
//! whitespace.

use std::collections::HashMap;
use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{self, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use tokenizers::DecoderWrapper;

use crate::tokenizer::Tokenizer;

/// Largest JSON Schema accepted, in bytes of its JSON text. Compilation time and memory grow
/// with the schema; llguidance's own limits ([`ParserLimits`]) bound the rest.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;

/// What a request's output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputGrammar {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value valid under this JSON Schema (`{"type": "json_schema"}`).
    JsonSchema(Value),
}

impl OutputGrammar {
    /// The JSON Schema this grammar enforces (`{"type":"object"}` for [`Self::JsonObject`]).
    pub fn schema(&self) -> Value {
        match self {
            Self::JsonObject => json!({"type": "object"}),
            Self::JsonSchema(v) => v.clone(),
        }
    }
}

/// Why a grammar could not be built or followed.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum GrammarError {
    /// The tokenizer cannot be turned into a token trie (an unknown decoder kind, a vocabulary
    /// larger than the model's).
    #[error("constrained decoding is unavailable for this tokenizer: {0}")]
    Tokenizer(String),
    /// The schema is not one ferry accepts (too large, not an object).
    #[error("{0}")]
    Schema(String),
    /// llguidance refused the schema (unsupported keyword, unsatisfiable, over its limits).
    #[error("{0}")]
    Compile(String),
    /// The matcher failed while decoding (a token the grammar does not allow was committed,
    /// or a mask computation ran over its limits).
    #[error("grammar: {0}")]
    Matcher(String),
}

/// The served tokenizer as llguidance sees it (a token trie over each token's bytes), and the
/// parser factory built on it. Expensive to build (the trie and the lexer's token slices scale
/// with the vocabulary): one per process, shared.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab", &self.factory.tok_env().tok_trie().vocab_size())
            .finish()
    }
}

impl GrammarCompiler {
    /// The compiler for `tokenizer` serving a model of `vocab` logits (≥ the tokenizer's ids;
    /// padding ids are never allowed), whose end-of-sequence tokens are `eos` (allowed only
    /// where the grammar may end).
    pub fn new(tokenizer: Arc<Tokenizer>, vocab: usize, eos: &[u32]) -> Result<Self, GrammarError> {
        let env = TokenizerBytes::new(tokenizer, vocab, eos)?;
        let env: TokEnv = Arc::new(env);
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Self {
            factory: Arc::new(factory),
        })
    }

    /// Logits per row the masks cover.
    pub fn vocab(&self) -> usize {
        self.factory.tok_env().tok_trie().vocab_size()
    }

    /// Compiles `grammar` into a fresh matcher. CPU work that grows with the schema (a few
    /// milliseconds for a typical one): call it off the async runtime.
    pub fn compile(&self, grammar: &OutputGrammar) -> Result<Grammar, GrammarError> {
        let mut schema = grammar.schema();
        let size = serde_json::to_string(&schema).map_or(0, |s| s.len());
        if size > MAX_SCHEMA_BYTES {
            return Err(GrammarError::Schema(format!(
                "the schema is {size} bytes of JSON, more than the limit of {MAX_SCHEMA_BYTES}"
            )));
        }
        let Some(obj) = schema.as_object_mut() else {
            return Err(GrammarError::Schema(format!(
                "a JSON Schema must be a JSON object, got {}",
                kind_of(&schema)
            )));
        };
        obj.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false}));
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_json_schema(schema))
            .map_err(|e| GrammarError::Compile(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Compile(e));
        }
        Ok(Grammar {
            matcher,
            vocab: self.vocab(),
        })
    }
}

/// The JSON type name of `v`, for messages.
fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// One request's grammar state: which tokens may come next, advanced per committed token and
/// rolled back when speculative drafts it looked ahead through are not committed.
pub struct Grammar {
    matcher: Matcher,
    vocab: usize,
}

/// An independent copy of the state (its own parser and lexer caches), for another sample of
/// the same request (`n` > 1) to advance on its own.
impl Clone for Grammar {
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            vocab: self.vocab,
        }
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl Grammar {
    /// The tokens allowed next, as a bit set over the vocabulary (bit `t % 32` of word
    /// `t / 32` set ⇔ token `t` allowed). End-of-sequence tokens are in it exactly where the
    /// output may end; once the grammar has stopped, only they are.
    pub fn allowed(&mut self) -> Result<Vec<u32>, GrammarError> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Matcher(e.to_string()))?;
        let mut words = mask.as_slice().to_vec();
        words.resize(self.vocab.div_ceil(32), 0);
        Ok(words)
    }

    /// Advances past one committed token; an error when the grammar does not allow it.
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Matcher(e.to_string()))
    }

    /// How many of `tokens` (from the current state) the grammar allows in a row.
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> Result<usize, GrammarError> {
        self.matcher
            .validate_tokens(tokens)
            .map_err(|e| GrammarError::Matcher(e.to_string()))
    }

    /// Undoes the last `n` consumed tokens.
    pub fn rollback(&mut self, n: usize) -> Result<(), GrammarError> {
        if n == 0 {
            return Ok(());
        }
        self.matcher
            .rollback(n)
            .map_err(|e| GrammarError::Matcher(e.to_string()))
    }

    /// Whether the output is complete: nothing but end-of-sequence may follow (the request
    /// finishes here, reason "stop").
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The tokens `allowed` words admit, in order (for tests and diagnostics).
    pub fn tokens_of(words: &[u32]) -> Vec<u32> {
        let mut out = Vec::new();
        for (w, &bits) in words.iter().enumerate() {
            for b in 0..32 {
                if bits & (1 << b) != 0 {
                    out.push((w * 32 + b) as u32);
                }
            }
        }
        out
    }
}

/// llguidance's view of the served tokenizer: each token id's bytes (special tokens marked
/// with [`TokTrie::SPECIAL_TOKEN_MARKER`], so no grammar produces them as text), built the way
/// `toktrie_hf_tokenizers` does it, over ferry's own `tokenizers` version.
struct TokenizerBytes {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerBytes {
    fn new(tokenizer: Arc<Tokenizer>, vocab: usize, eos: &[u32]) -> Result<Self, GrammarError> {
        let hf = tokenizer.inner();
        let mut kind = None;
        if let Some(d) = hf.get_decoder() {
            decoder_kind(d, &mut kind);
        }
        let kind = kind.ok_or_else(|| {
            GrammarError::Tokenizer(
                "its decoder is neither byte-level nor byte-fallback, so token bytes are unknown"
                    .into(),
            )
        })?;
        let n = hf.get_vocab_size(true);
        if n > vocab {
            return Err(GrammarError::Tokenizer(format!(
                "the tokenizer has {n} ids, more than the model's {vocab} logits"
            )));
        }
        let specials: HashMap<u32, String> = hf
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special || (t.content.starts_with('<') && t.content.ends_with('>')))
            .map(|(id, t)| (id, t.content))
            .collect();
        let chars = byte_level_chars();
        let mut words: Vec<Vec<u8>> = Vec::with_capacity(vocab);
        for id in 0..vocab as u32 {
            let word = match (specials.get(&id), hf.id_to_token(id)) {
                (Some(name), _) => marked(name),
                (None, Some(name)) => match kind {
                    DecoderKind::ByteLevel => name
                        .chars()
                        .map(|c| chars.get(&c).copied())
                        .collect::<Option<Vec<u8>>>()
                        // An added (non-special) token is stored as its text.
                        .unwrap_or_else(|| name.clone().into_bytes()),
                    DecoderKind::ByteFallback { space } => byte_fallback(&name, space),
                },
                // Padding ids past the tokenizer: special, never produced by a grammar.
                (None, None) => marked(&format!("<[{id}]>")),
            };
            words.push(word);
        }
        let first_eos = eos.first().copied().unwrap_or(0);
        let info = TokRxInfo::new(vocab as u32, first_eos);
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(eos);
        }
        Ok(Self { trie, tokenizer })
    }
}

/// `name` as a special token's trie word.
fn marked(name: &str) -> Vec<u8> {
    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    w.extend_from_slice(name.as_bytes());
    w
}

/// A byte-fallback (SentencePiece-style) token's bytes: `<0xAB>` is one byte, otherwise the
/// text with the metaspace character as a space.
fn byte_fallback(name: &str, space: char) -> Vec<u8> {
    if name.len() == 6 && name.starts_with("<0x") && name.ends_with('>') {
        if let Ok(b) = u8::from_str_radix(&name[3..5], 16) {
            return vec![b];
        }
    }
    name.replace(space, " ").into_bytes()
}

#[derive(Debug, Clone, Copy)]
enum DecoderKind {
    ByteLevel,
    ByteFallback { space: char },
}

fn decoder_kind(d: &DecoderWrapper, kind: &mut Option<DecoderKind>) {
    match d {
        DecoderWrapper::ByteLevel(_) => *kind = Some(DecoderKind::ByteLevel),
        // A `Metaspace` decoder seen earlier keeps its replacement character.
        DecoderWrapper::ByteFallback(_)
            if !matches!(kind, Some(DecoderKind::ByteFallback { .. })) =>
        {
            *kind = Some(DecoderKind::ByteFallback { space: '▁' });
        }
        DecoderWrapper::Metaspace(m) => {
            *kind = Some(DecoderKind::ByteFallback {
                space: m.get_replacement(),
            })
        }
        DecoderWrapper::Sequence(seq) => {
            for d in seq.get_decoders() {
                decoder_kind(d, kind);
            }
        }
        _ => {}
    }
}

/// GPT-2's byte-level alphabet: the printable character standing for each byte.
fn byte_level_chars() -> HashMap<char, u8> {
    let printable = |c: u32| matches!(c, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
    let mut map = HashMap::new();
    let mut next = 0x100u32;
    for b in 0..=255u32 {
        let c = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        if let Some(c) = char::from_u32(c) {
            map.insert(c, b as u8);
        }
    }
    map
}

impl TokenizerEnv for TokenizerBytes {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Bytes to tokens as the served tokenizer would split them (special-token text stays
    /// text); the trie's greedy split where the bytes are not UTF-8 or the tokenizer fails.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<toktrie::TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode_text(text, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
        })
    }
}
