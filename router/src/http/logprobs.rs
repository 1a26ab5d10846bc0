//! Log-probabilities as OpenAI shows them: each token with its text, its UTF-8 bytes and its
//! log-probability, and the most likely alternatives likewise. The values are the model's raw
//! log-softmax at each position (before penalties, `logit_bias` and temperature: vLLM's
//! default), computed by the engine; this module only names the tokens.
//!
//! A token's text is its own decoding (`Tokenizer::decode` of that one id, special tokens
//! kept), so a token holding part of a multi-byte character shows U+FFFD, and its `bytes` are
//! that text's UTF-8. A log-probability below -9999 (or `-inf`) is reported as -9999, as vLLM
//! does, since JSON has no infinity. `text_offset` (completions) is the character offset of the
//! token's text in the completion, counted over the tokens' texts.
//!
//! [`ChatLogprobs`] and [`CompletionLogprobs`] are the two endpoints' JSON shapes.
use std::sync::Arc;

use ferry_modelcard::tokenizer::Tokenizer;
use serde::Serialize;
use serde_json::Value;

use crate::output::TokenLogprob;

/// The smallest log-probability reported.
pub const MIN_LOGPROB: f32 = -9999.0;

/// One alternative at a position.
#[derive(Debug, Clone, PartialEq)]
pub struct TopOut {
    /// Its text.
    pub token: String,
    /// Its text's UTF-8 bytes.
    pub bytes: Vec<u8>,
    /// Its log-probability (at least [`MIN_LOGPROB`]).
    pub logprob: f32,
}

/// One generated token with its log-probabilities, named.
#[derive(Debug, Clone, PartialEq)]
pub struct LogprobOut {
    /// The token itself.
    pub chosen: TopOut,
    /// The most likely tokens at its position, most likely first.
    pub top: Vec<TopOut>,
    /// Characters of the completion before this token.
    pub text_offset: usize,
}

/// Names a request's tokens as they stream, keeping the running text offset.
#[derive(Debug)]
pub struct Namer {
    tokenizer: Arc<Tokenizer>,
    offset: usize,
}

impl Namer {
    /// A namer for one request.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            offset: 0,
        }
    }

    fn name(&self, token: u32, logprob: f32) -> TopOut {
        let token_text = self.tokenizer.decode(&[token], false).unwrap_or_default();
        TopOut {
            bytes: token_text.as_bytes().to_vec(),
            token: token_text,
            logprob: if logprob.is_nan() {
                MIN_LOGPROB
            } else {
                logprob.max(MIN_LOGPROB)
            },
        }
    }

    /// The next tokens' log-probabilities, named, in order.
    pub fn name_all(&mut self, logprobs: &[TokenLogprob]) -> Vec<LogprobOut> {
        logprobs
            .iter()
            .map(|lp| {
                let chosen = self.name(lp.token, lp.logprob);
                let text_offset = self.offset;
                self.offset += chosen.token.chars().count();
                LogprobOut {
                    top: lp.top.iter().map(|&(t, l)| self.name(t, l)).collect(),
                    chosen,
                    text_offset,
                }
            })
            .collect()
    }
}

/// A token or an alternative in chat `logprobs.content`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// The text's UTF-8 bytes.
    pub bytes: Vec<u8>,
}

/// One generated token in chat `logprobs.content`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// The text's UTF-8 bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at its position (`top_logprobs` of them).
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// Chat `choices[].logprobs`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<ChatTokenLogprob>,
}

impl From<&[LogprobOut]> for ChatLogprobs {
    fn from(tokens: &[LogprobOut]) -> Self {
        let entry = |t: &TopOut| ChatTopLogprob {
            token: t.token.clone(),
            logprob: t.logprob,
            bytes: t.bytes.clone(),
        };
        Self {
            content: tokens
                .iter()
                .map(|t| ChatTokenLogprob {
                    token: t.chosen.token.clone(),
                    logprob: t.chosen.logprob,
                    bytes: t.chosen.bytes.clone(),
                    top_logprobs: t.top.iter().map(entry).collect(),
                })
                .collect(),
        }
    }
}

/// Completions `choices[].logprobs` (OpenAI's legacy shape): parallel lists, one entry per
/// generated token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    /// The tokens' texts.
    pub tokens: Vec<String>,
    /// Their log-probabilities.
    pub token_logprobs: Vec<f32>,
    /// Per token, the most likely tokens' texts → log-probabilities (`logprobs` of them).
    pub top_logprobs: Vec<serde_json::Map<String, Value>>,
    /// Per token, the character offset of its text in the completion.
    pub text_offset: Vec<usize>,
}

impl From<&[LogprobOut]> for CompletionLogprobs {
    fn from(tokens: &[LogprobOut]) -> Self {
        Self {
            tokens: tokens.iter().map(|t| t.chosen.token.clone()).collect(),
            token_logprobs: tokens.iter().map(|t| t.chosen.logprob).collect(),
            top_logprobs: tokens
                .iter()
                .map(|t| {
                    t.top
                        .iter()
                        .map(|a| (a.token.clone(), Value::from(a.logprob)))
                        .collect()
                })
                .collect(),
            text_offset: tokens.iter().map(|t| t.text_offset).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_named_with_offsets_and_clamped_logprobs() {
        let dir = ferry_modelcard::embedded::default_model_dir();
        let tok = Arc::new(Tokenizer::from_dir(&dir).expect("embedded tokenizer"));
        let ids = tok.encode("hello there", false).expect("encode");
        let mut namer = Namer::new(tok.clone());
        let lps: Vec<TokenLogprob> = ids
            .iter()
            .map(|&t| TokenLogprob {
                token: t,
                logprob: -0.5,
                top: vec![(t, -0.5), (ids[0], f32::NEG_INFINITY)],
            })
            .collect();
        let named = namer.name_all(&lps);
        let text: String = named.iter().map(|n| n.chosen.token.as_str()).collect();
        assert_eq!(text, tok.decode(&ids, false).expect("decode"));
        let mut at = 0;
        for n in &named {
            assert_eq!(n.text_offset, at);
            at += n.chosen.token.chars().count();
            assert_eq!(n.chosen.bytes, n.chosen.token.as_bytes());
            assert_eq!(n.top[1].logprob, MIN_LOGPROB, "-inf is reported as -9999");
        }
        // The offset carries over to the next call.
        let more = namer.name_all(&lps[..1]);
        assert_eq!(more[0].text_offset, at);
    }
}
