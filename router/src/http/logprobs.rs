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
//! With `echo` (completions), the prompt's tokens come first ([`Namer::name_prompt`]): the
//! first has no log-probability and no alternatives (`null` in both lists, as vLLM and
//! OpenAI show it), and the offsets run on from the prompt's tokens into the generated ones.
//!
//! [`ChatLogprobs`] and [`CompletionLogprobs`] are the two endpoints' JSON shapes.
use std::sync::Arc;

use ferry_modelcard::tokenizer::Tokenizer;
use serde::Serialize;
use serde_json::Value;

use crate::output::{PromptLogprobs, TokenLogprob};

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
    /// The prompt's first token (with `echo`): nothing predicts it, so its `logprob` and `top`
    /// are shown as `null`.
    pub unscored: bool,
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
                    unscored: false,
                }
            })
            .collect()
    }

    /// The prompt's tokens, named (`echo`): the first unscored, then one per entry of
    /// `prompt.rest`; the running offset then continues into the generated tokens.
    pub fn name_prompt(&mut self, prompt: &PromptLogprobs) -> Vec<LogprobOut> {
        let chosen = self.name(prompt.first_token, 0.0);
        let text_offset = self.offset;
        self.offset += chosen.token.chars().count();
        let first = LogprobOut {
            chosen,
            top: Vec::new(),
            text_offset,
            unscored: true,
        };
        std::iter::once(first)
            .chain(self.name_all(&prompt.rest))
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
/// token (with `echo`, the prompt's tokens first; the very first has `null`s).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    /// The tokens' texts.
    pub tokens: Vec<String>,
    /// Their log-probabilities (`null` for the prompt's first token).
    pub token_logprobs: Vec<Option<f32>>,
    /// Per token, the most likely tokens' texts → log-probabilities (`logprobs` of them;
    /// `null` for the prompt's first token).
    pub top_logprobs: Vec<Option<serde_json::Map<String, Value>>>,
    /// Per token, the character offset of its text in the completion.
    pub text_offset: Vec<usize>,
}

impl From<&[LogprobOut]> for CompletionLogprobs {
    fn from(tokens: &[LogprobOut]) -> Self {
        Self {
            tokens: tokens.iter().map(|t| t.chosen.token.clone()).collect(),
            token_logprobs: tokens
                .iter()
                .map(|t| (!t.unscored).then_some(t.chosen.logprob))
                .collect(),
            top_logprobs: tokens
                .iter()
                .map(|t| {
                    (!t.unscored).then(|| {
                        t.top
                            .iter()
                            .map(|a| (a.token.clone(), Value::from(a.logprob)))
                            .collect()
                    })
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

    /// `echo`: the prompt's first token is unscored (`null` in both lists), the later ones
    /// carry their values, offsets start at 0 and run on into the generated tokens.
    #[test]
    fn echoed_prompt_tokens_lead_with_a_null_entry() {
        let dir = ferry_modelcard::embedded::default_model_dir();
        let tok = Arc::new(Tokenizer::from_dir(&dir).expect("embedded tokenizer"));
        let ids = tok.encode("And God said", false).expect("encode");
        assert!(ids.len() >= 2);
        let prompt = PromptLogprobs {
            first_token: ids[0],
            rest: ids[1..]
                .iter()
                .map(|&t| TokenLogprob {
                    token: t,
                    logprob: -1.5,
                    top: vec![(t, -1.5), (ids[0], -2.0)],
                })
                .collect(),
        };
        let mut namer = Namer::new(tok.clone());
        let mut named = namer.name_prompt(&prompt);
        let generated = TokenLogprob {
            token: ids[0],
            logprob: -0.25,
            top: vec![(ids[0], -0.25), (ids[1], -3.0)],
        };
        named.extend(namer.name_all(std::slice::from_ref(&generated)));
        let lp = serde_json::to_value(CompletionLogprobs::from(&named[..])).expect("json");
        let n = ids.len() + 1;
        assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(n), "{lp}");
        assert_eq!(lp["token_logprobs"][0], Value::Null, "{lp}");
        assert_eq!(lp["top_logprobs"][0], Value::Null, "{lp}");
        assert_eq!(lp["token_logprobs"][1], -1.5, "{lp}");
        assert_eq!(
            lp["top_logprobs"][1].as_object().map(|o| o.len()),
            Some(2),
            "{lp}"
        );
        assert_eq!(lp["token_logprobs"][n - 1], -0.25, "{lp}");
        let prompt_text = tok.decode(&ids, false).expect("decode");
        assert_eq!(lp["text_offset"][0], 0, "{lp}");
        assert_eq!(
            lp["text_offset"][n - 1],
            prompt_text.chars().count(),
            "{lp}"
        );
    }
}
