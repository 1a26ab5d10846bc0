//! Tokenization, chat templating and block hashing on tokio's blocking pool.
//!
//! All three are CPU work proportional to the prompt (a 100k-token prompt takes milliseconds),
//! so they never run on the async runtime's workers (STYLE.md, "Compute never runs on the
//! tokio runtime"). Streaming detokenization of generated tokens is the exception: one token
//! at a time over a short window is microseconds, so it runs inline in the response stream.
use std::sync::Arc;

use ferry_modelcard::tokenizer::{ChatMessage, Tokenizer};
use ferry_modelcard::CardError;
use ferry_proto::ids::BlockHash;

use crate::error::RequestError;
use crate::validate::ValidationError;

/// A prompt as the client gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Raw text; the tokenizer adds its special tokens (BOS). Special-token text inside it
    /// is plain text (`Tokenizer::encode_text`).
    Text(String),
    /// Token ids, used as given.
    Tokens(Vec<u32>),
    /// Chat turns, rendered with the chat template and an assistant generation prompt; only
    /// the template inserts control tokens (`Tokenizer::encode_chat`).
    Chat(Vec<ChatMessage>),
    /// Chat turns with the request's tool definitions (OpenAI's `tools`, in the template's
    /// `tools` variable; `Tokenizer::encode_chat_with_tools`).
    ChatTools(Vec<ChatMessage>, Vec<serde_json::Value>),
}

/// A prompt ready to route: its tokens and the chained hashes of its full blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    /// Prompt token ids.
    pub tokens: Vec<u32>,
    /// `ferry_proto::block_hash::block_hashes(tokens, page_size)`.
    pub hashes: Vec<BlockHash>,
}

/// The served model's tokenizer, used from async code.
#[derive(Debug, Clone)]
pub struct TokenizerPool {
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerPool {
    /// Wraps a loaded tokenizer.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self { tokenizer }
    }

    /// The tokenizer itself (for streaming detokenization).
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Tokenizes (or renders and tokenizes) `prompt` and hashes its full blocks, on the
    /// blocking pool. Client text never becomes control tokens: text is tokenized with
    /// special tokens split, chat content too, and only the chat template's own special
    /// tokens are kept. A chat template failure (e.g. an unknown role, or special-token text
    /// in content the template rewrites) is a validation error on `messages`; a tokenizer
    /// failure is internal.
    pub async fn prepare(
        &self,
        prompt: PromptInput,
        page_size: usize,
    ) -> Result<Prepared, RequestError> {
        let tokenizer = self.tokenizer.clone();
        blocking(move || {
            let tokens = match prompt {
                PromptInput::Text(text) => tokenizer.encode_text(&text, true).map_err(internal)?,
                PromptInput::Tokens(ids) => ids,
                PromptInput::Chat(messages) => {
                    tokenizer.encode_chat(&messages, true).map_err(chat_error)?
                }
                PromptInput::ChatTools(messages, tools) => tokenizer
                    .encode_chat_with_tools(&messages, &tools, true)
                    .map_err(chat_error)?,
            };
            let hashes = ferry_proto::block_hash::block_hashes(&tokens, page_size);
            Ok(Prepared { tokens, hashes })
        })
        .await
    }

    /// Token ids of client `text` (special-token text stays plain), on the blocking pool.
    pub async fn encode(
        &self,
        text: String,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, RequestError> {
        let tokenizer = self.tokenizer.clone();
        blocking(move || {
            tokenizer
                .encode_text(&text, add_special_tokens)
                .map_err(internal)
        })
        .await
    }

    /// Token ids of chat `messages` rendered with the chat template (with the assistant
    /// generation prompt when `add_generation_prompt`), on the blocking pool; content never
    /// becomes control tokens ([`Self::prepare`]).
    pub async fn encode_chat(
        &self,
        messages: Vec<ChatMessage>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, RequestError> {
        let tokenizer = self.tokenizer.clone();
        blocking(move || {
            tokenizer
                .encode_chat(&messages, add_generation_prompt)
                .map_err(chat_error)
        })
        .await
    }

    /// Text of `ids` (special tokens kept), on the blocking pool.
    pub async fn decode(&self, ids: Vec<u32>) -> Result<String, RequestError> {
        let tokenizer = self.tokenizer.clone();
        blocking(move || tokenizer.decode(&ids, false).map_err(internal)).await
    }
}

/// A chat template failure is the client's (a 400 naming `messages`); anything else is ours.
fn chat_error(e: CardError) -> RequestError {
    match e {
        CardError::ChatTemplate(msg) => RequestError::Invalid(ValidationError::new(
            "messages",
            format!("cannot be rendered: {msg}"),
        )),
        other => internal(other),
    }
}

fn internal(e: CardError) -> RequestError {
    RequestError::Internal(e.to_string())
}

async fn blocking<T, F>(f: F) -> Result<T, RequestError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, RequestError> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RequestError::Internal(format!("tokenizer task failed: {e}")))?
}
