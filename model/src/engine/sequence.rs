//! Per-request state on the engine thread.

use ferry_kernels::cpu::logits::{LogitsControls, TokenHistory, TokenLogprobs};
use ferry_kernels::cpu::sample::{Sampler, SamplingParams};
use ferry_modelcard::grammar::Grammar;
use tokio::sync::mpsc;

use super::{EngineEvent, FinishReason, PrefillJob, SeqId, SpecCounts, StopParams};
use crate::kv::BlockTable;

/// Where a decode sequence is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// A peer is writing the prompt KV into the reserved blocks.
    AwaitingKv,
    /// Prompt positions `0..done` are in the cache; the rest is prefilled here in chunks.
    Prefilling {
        /// Prompt positions already in the cache.
        done: usize,
    },
    /// Generating: `next` was sampled and is not yet in the cache.
    Decoding {
        /// The token the next step feeds.
        next: u32,
    },
}

/// How a decode sequence's prompt KV was obtained (for counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Written by a peer.
    Remote,
    /// Computed here by choice.
    Local,
    /// Computed here after a peer failed.
    Recomputed,
    /// Sample `i ≥ 1` of an `n` > 1 request: the prompt's full blocks shared with the sample
    /// it was forked from, only the rest computed here.
    Fork,
}

/// A decode request.
pub struct Sequence {
    pub(crate) id: SeqId,
    pub(crate) prompt: Vec<u32>,
    pub(crate) sampling: SamplingParams,
    /// Penalties and `logit_bias` (applied before `sampling`).
    pub(crate) controls: LogitsControls,
    /// The prompt and the generated tokens, as the penalties count them; kept only when
    /// `controls` change something (empty otherwise).
    pub(crate) history: TokenHistory,
    /// Alternatives per token when the request asked for log-probabilities.
    pub(crate) logprobs: Option<usize>,
    /// Alternatives per prompt token when the request asked for the prompt's
    /// log-probabilities ([`super::GenerateOptions::prompt_logprobs`]).
    pub(crate) prompt_logprobs: Option<usize>,
    /// The prompt's log-probabilities computed so far (one per prompt token after the first,
    /// filled chunk by chunk), sent before the first token.
    pub(crate) prompt_lps: Vec<TokenLogprobs>,
    /// Structured output: the grammar state after the committed tokens; every sampled row is
    /// masked with it (speculative rows with it advanced through the drafts ahead).
    pub(crate) grammar: Option<Grammar>,
    pub(crate) stop: StopParams,
    pub(crate) table: BlockTable,
    /// Tokens whose KV is in `table` (prompt, then generated tokens once fed back).
    pub(crate) tokens: Vec<u32>,
    pub(crate) phase: Phase,
    pub(crate) generated: usize,
    pub(crate) cached_tokens: usize,
    pub(crate) origin: Origin,
    pub(crate) events: mpsc::UnboundedSender<EngineEvent>,
    pub(crate) rng: Sampler,
    /// Whether this request may speculate (its own choice and the engine's drafter).
    pub(crate) speculative: bool,
    /// Its speculative rounds so far (sent with its end when `speculative`).
    pub(crate) spec: SpecCounts,
    /// Leading positions whose drafter context rows are valid (== `table.len()` to speculate).
    pub(crate) draft_ctx: usize,
    /// The request's span (batch spans link to it).
    pub(crate) span: tracing::Span,
    /// Open from admission until the request's first batch (its `queue` span).
    pub(crate) queued: Option<tracing::Span>,
    /// The other samples of an `n` > 1 request, forked off this one once its prompt is in the
    /// cache (`Scheduler::fork`); failed with it if it ends before that.
    pub(crate) forks: Vec<super::scheduler::PendingFork>,
}

/// A prefill-only job in flight.
pub struct PrefillTask {
    pub(crate) job: PrefillJob,
    pub(crate) table: BlockTable,
    pub(crate) reused: usize,
    pub(crate) rng: Sampler,
    /// The prompt, as the penalties count it (empty when the job's controls are a no-op).
    pub(crate) history: TokenHistory,
    /// Open from admission until the job's batch (its `queue` span).
    pub(crate) queued: Option<tracing::Span>,
}

/// What sampling a token led to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Keep decoding with this token.
    Continue(u32),
    /// The request is done.
    Finish(FinishReason),
    /// The request failed (its grammar refused a committed token).
    Fail(String),
}

impl Sequence {
    /// Whether the client has gone away.
    pub(crate) fn cancelled(&self) -> bool {
        self.events.is_closed()
    }

    /// Sends an event; a closed channel is noticed as cancellation on the next step.
    pub(crate) fn emit(&self, e: EngineEvent) {
        let _ = self.events.send(e);
    }

    /// Sends the final event (`Finished` / `Failed`), preceded by the request's speculative
    /// counts when it was allowed to speculate.
    pub(crate) fn emit_end(&self, end: EngineEvent) {
        if self.speculative {
            self.emit(EngineEvent::Speculation(self.spec));
        }
        self.emit(end);
    }

    /// Prompt tokens still to compute here.
    pub(crate) fn remaining_prompt(&self) -> usize {
        match self.phase {
            Phase::Prefilling { done } => self.prompt.len() - done,
            _ => 0,
        }
    }

    /// Sends the prompt's log-probabilities once, before the first token, when the request
    /// asked for them.
    pub(crate) fn emit_prompt_logprobs(&mut self) {
        if self.prompt_logprobs.is_some() {
            let lps = std::mem::take(&mut self.prompt_lps);
            self.emit(EngineEvent::PromptLogprobs(lps));
        }
    }

    /// Drafts this request could still use in a round: the tokens it still needs after the one
    /// every step emits. Planning bounds a round's drafts by it, and a commit counts no more
    /// drafts than it.
    pub(crate) fn usable_drafts(&self) -> usize {
        self.stop.max_tokens.saturating_sub(self.generated + 1)
    }

    /// Applies the stop rules to a freshly sampled token, emitting it (preceded by its
    /// `logprobs`, when given) when it is output, and advances the grammar past it (a
    /// stopped grammar finishes the request, reason stop).
    pub(crate) fn accept(
        &mut self,
        token: u32,
        eos: &[u32],
        logprobs: Option<TokenLogprobs>,
    ) -> Next {
        self.generated += 1;
        if !self.controls.is_noop() {
            self.history.push(token);
        }
        if self.stop.is_stop(token, eos) {
            return Next::Finish(FinishReason::Stop);
        }
        if let Some(g) = self.grammar.as_mut() {
            if let Err(e) = g.consume(token) {
                return Next::Fail(e.to_string());
            }
        }
        if let Some(lp) = logprobs {
            self.emit(EngineEvent::Logprobs(lp));
        }
        self.emit(EngineEvent::Token(token));
        // The output is complete (a JSON document closed): nothing but EOS may follow.
        if self.grammar.as_ref().is_some_and(Grammar::is_stopped) {
            return Next::Finish(FinishReason::Stop);
        }
        if self.generated >= self.stop.max_tokens {
            Next::Finish(FinishReason::Length)
        } else {
            Next::Continue(token)
        }
    }
}

/// The uniform draw that decides the token at generation step `step` of a request (the
/// sampler's inverse-CDF draw over its distribution; `sample::draw` on the backend).
///
/// With a seed, every step draws from its own generator derived from `(seed, step)`, so a
/// seeded request produces the same tokens whether its first token was sampled by a prefill
/// peer or here. Without one, the request's own entropy-seeded generator is used. A greedy
/// request's distribution is a point mass: no draw is consumed (0 is returned).
pub(crate) fn step_uniform(params: &SamplingParams, step: usize, rng: &mut Sampler) -> f64 {
    if params.is_greedy() {
        return 0.0;
    }
    match params.seed {
        Some(seed) => Sampler::new(Some(splitmix64(seed ^ splitmix64(step as u64)))).next_uniform(),
        None => rng.next_uniform(),
    }
}

/// `n` uniforms for generation step `step` of a speculative round, from a stream that is
/// derived from `(seed, step, salt)` for seeded requests (reproducible, independent of plain
/// sampling and of the other salt) and the request's own stream otherwise.
pub(crate) fn round_uniforms(
    params: &SamplingParams,
    step: usize,
    salt: u64,
    rng: &mut Sampler,
    n: usize,
) -> Vec<f64> {
    match params.seed {
        Some(seed) => {
            let mut s = Sampler::new(Some(splitmix64(
                seed ^ splitmix64(step as u64) ^ splitmix64(salt),
            )));
            (0..n).map(|_| s.next_uniform()).collect()
        }
        None => (0..n).map(|_| rng.next_uniform()).collect(),
    }
}

pub(crate) fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The history the penalties of `controls` need for `prompt`, whose last `generated` tokens
/// were generated (a migrated request's); empty when `controls` change nothing.
pub(crate) fn history_for(
    controls: &LogitsControls,
    prompt: &[u32],
    generated: usize,
) -> TokenHistory {
    if controls.is_noop() {
        return TokenHistory::default();
    }
    let split = prompt.len().saturating_sub(generated);
    let (prompt, output) = prompt.split_at(split);
    TokenHistory::new(prompt, output)
}
