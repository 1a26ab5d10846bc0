//! Turns a decode worker's token stream into client-facing events: incremental
//! detokenization, stop strings, usage.
use std::sync::Arc;

use ferry_modelcard::tokenizer::{DecodeStream, Tokenizer};

use crate::error::RequestError;
use crate::stop::{StopMatcher, StopOutcome};

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    /// The OpenAI spelling: `stop` or `length`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens received from the decode worker (including any after a stop string
    /// in the same chunk).
    pub completion_tokens: u32,
    /// Prompt tokens the decode worker already had cached.
    pub cached_prompt_tokens: u32,
}

/// A generated token's log-probability (the model's raw log-softmax at its position) and the
/// most likely tokens there, most likely first.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TokenLogprob {
    /// The token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// `(token, logprob)` of the most likely tokens at its position.
    pub top: Vec<(u32, f32)>,
}

impl From<&ferry_proto::v1::TokenLogprob> for TokenLogprob {
    fn from(w: &ferry_proto::v1::TokenLogprob) -> Self {
        Self {
            token: w.token_id,
            logprob: w.logprob,
            top: w
                .top_logprobs
                .iter()
                .map(|t| (t.token_id, t.logprob))
                .collect(),
        }
    }
}

impl From<&TokenLogprob> for ferry_proto::v1::TokenLogprob {
    fn from(t: &TokenLogprob) -> Self {
        Self {
            token_id: t.token,
            logprob: t.logprob,
            top_logprobs: t
                .top
                .iter()
                .map(|&(token_id, logprob)| ferry_proto::v1::TopLogprob { token_id, logprob })
                .collect(),
        }
    }
}

/// The prompt's tokens with their log-probabilities (requests that asked for them): the
/// first token has none (nothing predicts it), every later one the model's raw log-softmax at
/// the position before it, with the most likely tokens there.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PromptLogprobs {
    /// The prompt's first token.
    pub first_token: u32,
    /// One entry per later prompt token, in order.
    pub rest: Vec<TokenLogprob>,
}

/// One step of a generation as clients see it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenerationEvent {
    /// New token ids.
    pub token_ids: Vec<u32>,
    /// Their log-probabilities, one per id, when the request asked (empty otherwise).
    pub logprobs: Vec<TokenLogprob>,
    /// Their text; may be empty while a character or a possible stop string is incomplete.
    pub text: String,
    /// Set on the last event only.
    pub finish: Option<FinishReason>,
    /// Set on the last event only: with several samples, on the event that finishes the last
    /// one, counting every sample's completion tokens.
    pub usage: Option<Usage>,
    /// The sample these tokens belong to (`choices[index]`; 0 for a request of one sample).
    /// With several samples each one's last event has `finish`.
    pub index: u32,
    /// On each sample's first event, when the request asked: the prompt's log-probabilities.
    pub prompt_logprobs: Option<std::sync::Arc<PromptLogprobs>>,
}

/// Per-request output state.
#[derive(Debug)]
pub struct OutputState {
    tokenizer: Arc<Tokenizer>,
    decoder: DecodeStream,
    stop: StopMatcher,
    usage: Usage,
    /// The client asked for the prompt alone (`max_tokens: 0` with `echo`): the worker's
    /// token is left out of the text, the log-probabilities and the usage.
    prompt_only: bool,
}

impl OutputState {
    /// State for a request with `stops` and a prompt of `prompt_tokens`.
    pub fn new(tokenizer: Arc<Tokenizer>, stops: &[String], prompt_tokens: usize) -> Self {
        Self {
            tokenizer,
            decoder: DecodeStream::new(true),
            stop: StopMatcher::new(stops),
            usage: Usage {
                prompt_tokens: u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
                ..Usage::default()
            },
            prompt_only: false,
        }
    }

    /// Leaves every generated token out (text, log-probabilities, usage) and finishes with
    /// `length` at the worker's finish: a request for the prompt alone
    /// ([`crate::validate::ValidRequest::prompt_only`]), answered as vLLM does.
    pub fn prompt_only(self, on: bool) -> Self {
        Self {
            prompt_only: on,
            ..self
        }
    }

    /// Records the decode worker's cached prompt tokens (from its first message).
    pub fn set_cached_prompt_tokens(&mut self, n: u32) {
        self.usage.cached_prompt_tokens = n;
    }

    /// Feeds one worker message: `ids` (several when a speculative round committed them
    /// together) and, on the last one, `finish`. The returned event has `finish` set when the
    /// request is over (the worker finished, or a stop string matched: the caller then drops
    /// the worker stream, which cancels the request there). Stop strings are matched token by
    /// token, so a message of several tokens ends where the same tokens one a message would:
    /// tokens after the one that completed a stop string are not returned or counted.
    pub fn on_tokens(
        &mut self,
        ids: &[u32],
        mut logprobs: Vec<TokenLogprob>,
        finish: Option<FinishReason>,
    ) -> Result<GenerationEvent, RequestError> {
        if self.prompt_only {
            return Ok(GenerationEvent {
                finish: finish.map(|_| FinishReason::Length),
                usage: finish.map(|_| self.usage),
                ..GenerationEvent::default()
            });
        }
        let mut text = String::new();
        let mut taken = 0;
        let mut stopped = false;
        for &id in ids {
            taken += 1;
            let piece = self.decoder.step(&self.tokenizer, id).map_err(detok)?;
            if self.push(piece.as_deref().unwrap_or_default(), &mut text) {
                stopped = true;
                break;
            }
        }
        if finish.is_some() && !stopped {
            let rest = self.decoder.finish(&self.tokenizer).map_err(detok)?;
            stopped = self.push(rest.as_deref().unwrap_or_default(), &mut text);
            if !stopped {
                text.push_str(&self.stop.finish());
            }
        }
        let added = u32::try_from(taken).unwrap_or(u32::MAX);
        self.usage.completion_tokens = self.usage.completion_tokens.saturating_add(added);
        logprobs.truncate(taken);
        let finish = if stopped {
            Some(FinishReason::Stop)
        } else {
            finish
        };
        Ok(GenerationEvent {
            token_ids: ids[..taken].to_vec(),
            logprobs,
            text,
            finish,
            usage: finish.map(|_| self.usage),
            index: 0,
            prompt_logprobs: None,
        })
    }

    /// Runs `piece` through the stop strings, appending what may go out to `text`; true when a
    /// stop string matched (`text` then ends before it).
    fn push(&mut self, piece: &str, text: &mut String) -> bool {
        match self.stop.push(piece) {
            StopOutcome::Stopped(before) => {
                text.push_str(&before);
                true
            }
            StopOutcome::Continue(safe) => {
                text.push_str(&safe);
                false
            }
        }
    }
}

fn detok(e: ferry_modelcard::CardError) -> RequestError {
    RequestError::Internal(format!("detokenization failed: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> Arc<Tokenizer> {
        let dir = ferry_modelcard::embedded::default_model_dir();
        Arc::new(Tokenizer::from_dir(&dir).expect("embedded tokenizer"))
    }

    #[test]
    fn streams_text_and_counts_usage() {
        let tok = tokenizer();
        let ids = tok.encode("hello there, general", false).expect("encode");
        let mut out = OutputState::new(tok.clone(), &[], 7);
        out.set_cached_prompt_tokens(4);
        let mut text = String::new();
        let (last, init) = ids.split_last().expect("some tokens");
        for id in init {
            let e = out.on_tokens(&[*id], Vec::new(), None).expect("step");
            assert_eq!(e.finish, None);
            text.push_str(&e.text);
        }
        let e = out
            .on_tokens(&[*last], Vec::new(), Some(FinishReason::Length))
            .expect("last");
        text.push_str(&e.text);
        assert_eq!(text, tok.decode(&ids, true).expect("decode"));
        assert_eq!(e.finish, Some(FinishReason::Length));
        assert_eq!(
            e.usage,
            Some(Usage {
                prompt_tokens: 7,
                completion_tokens: ids.len() as u32,
                cached_prompt_tokens: 4
            })
        );
    }

    #[test]
    fn a_stop_string_truncates_and_finishes() {
        let tok = tokenizer();
        let ids = tok.encode("one two three four", false).expect("encode");
        let mut out = OutputState::new(tok, &[" three".to_string()], 1);
        let mut text = String::new();
        let mut finished = None;
        for id in ids {
            let e = out.on_tokens(&[id], Vec::new(), None).expect("step");
            text.push_str(&e.text);
            if e.finish.is_some() {
                finished = e.finish;
                break;
            }
        }
        assert_eq!(finished, Some(FinishReason::Stop));
        assert_eq!(text, "one two");
    }

    /// What one message per token gives: each event's text, and the last one's finish and usage.
    fn one_by_one(ids: &[u32], stops: &[String]) -> (String, Option<FinishReason>, Option<Usage>) {
        let mut out = OutputState::new(tokenizer(), stops, 3);
        let mut text = String::new();
        for (k, &id) in ids.iter().enumerate() {
            let last = (k + 1 == ids.len()).then_some(FinishReason::Length);
            let e = out.on_tokens(&[id], Vec::new(), last).expect("step");
            text.push_str(&e.text);
            if e.finish.is_some() {
                return (text, e.finish, e.usage);
            }
        }
        (text, None, None)
    }

    #[test]
    fn a_round_of_tokens_in_one_message_streams_what_one_a_message_would() {
        // A speculative round's tokens reach the router as one message (one SSE chunk).
        let tok = tokenizer();
        let ids = tok
            .encode("one two three four five six", false)
            .expect("encode");
        for stops in [vec![], vec![" three".to_string()], vec!["f".to_string()]] {
            let want = one_by_one(&ids, &stops);
            let mut out = OutputState::new(tok.clone(), &stops, 3);
            let mut text = String::new();
            let mut got = (String::new(), None, None);
            for (k, round) in ids.chunks(4).enumerate() {
                let last = ((k + 1) * 4 >= ids.len()).then_some(FinishReason::Length);
                let lps = round
                    .iter()
                    .map(|&t| TokenLogprob {
                        token: t,
                        logprob: -1.0,
                        top: Vec::new(),
                    })
                    .collect();
                let e = out.on_tokens(round, lps, last).expect("round");
                text.push_str(&e.text);
                assert_eq!(e.logprobs.len(), e.token_ids.len(), "one per token kept");
                if e.finish.is_some() {
                    got = (text.clone(), e.finish, e.usage);
                    break;
                }
            }
            assert_eq!(got, want, "stops {stops:?}");
        }
    }
}
