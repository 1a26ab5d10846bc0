//! The contract between a scheduler and the forward.

use ferry_kernels::backend::rows::{scatter_drafts, DraftIds};
use ferry_kernels::backend::{Backend, Ints, Tensor};
use ferry_kernels::cpu::logits::TokenLogprobs;

use crate::config::ModelConfig;
use crate::kv::{BlockId, KvLayout};
use crate::ModelError;

/// Which logits a sequence wants back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// Only the last new token's (prefill and decode).
    Last,
    /// Every new token's (parity tests, speculative verification).
    All,
}

/// One sequence's part of a batch: new tokens appended after `start_pos` cached positions.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    /// Tokens to compute, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    /// Positions already in the cache (a reused prefix or earlier steps).
    pub start_pos: usize,
    /// Blocks covering at least `start_pos + tokens.len()` positions.
    pub block_table: &'a [BlockId],
    /// Which logits to return.
    pub logits: LogitsWanted,
}

/// Rows of one sequence whose log-probabilities the forward computes and reduces right away
/// (prompt log-probabilities, `echo` with `logprobs`): row `k` of the sequence's new tokens
/// predicts `targets[k]`, the prompt's next token.
///
/// These rows are not in [`BatchLogits::logits`]: the forward runs the LM head over them in
/// chunks of at most [`PROMPT_LOGITS_CHUNK_FLOATS`] floats and reduces each row at once to the
/// target's log-probability and the `top` most likely tokens
/// ([`ferry_kernels::backend::sample::row_logprobs`]), so a long prompt never holds
/// `prompt_len × vocab` floats.
#[derive(Debug, Clone, Copy)]
pub struct PromptRows<'a> {
    /// The sequence (an index into [`BatchInputs::seqs`]).
    pub seq: usize,
    /// The token each of the sequence's first `targets.len()` new rows predicts.
    pub targets: &'a [u32],
    /// Alternatives per row (at most `MAX_TOP_LOGPROBS`).
    pub top: usize,
}

/// Logits floats one chunk of [`PromptRows`] may hold at once (64 MiB of f32): 129 rows of
/// DeepSeek-V3's 129,280-token vocabulary, 8,192 of the embedded model's 2,048.
pub const PROMPT_LOGITS_CHUNK_FLOATS: usize = 1 << 24;

/// A batch: any mix of fresh prompts, prefill chunks over a cached prefix and decode steps.
#[derive(Debug, Clone, Default)]
pub struct BatchInputs<'a> {
    /// The sequences, each computed against its own block table.
    pub seqs: Vec<SeqInput<'a>>,
    /// Rows reduced to log-probabilities in the forward (prompt log-probabilities); empty for
    /// most batches.
    pub prompt_logprobs: Vec<PromptRows<'a>>,
    /// A uniform verify round's drafts where the drafter left them, on the model's backend:
    /// every sequence's tokens are its anchor then γ placeholders, and the forward puts the
    /// drafts over the placeholders on the device ([`scatter_drafts`]) before its first op, so
    /// the host never waits for the drafter's pass. `None` for every other batch.
    ///
    /// [`scatter_drafts`]: ferry_kernels::backend::rows::scatter_drafts
    pub drafts_on_device: Option<DraftIds<'a>>,
}

/// Per-token positions and the row range of each sequence in the flattened batch: the same on
/// every backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchGeometry {
    /// Absolute position of every new token, in batch order.
    pub positions: Vec<usize>,
    /// `(first_row, rows)` per sequence.
    pub spans: Vec<(usize, usize)>,
}

impl BatchGeometry {
    /// The geometry of `seqs`.
    pub fn new(seqs: &[SeqInput<'_>]) -> Self {
        let mut positions = Vec::new();
        let mut spans = Vec::with_capacity(seqs.len());
        for s in seqs {
            spans.push((positions.len(), s.tokens.len()));
            positions.extend(s.start_pos..s.start_pos + s.tokens.len());
        }
        Self { positions, spans }
    }

    /// The batch rows whose logits `seqs` asked for, per sequence (`seqs` as given to
    /// [`Self::new`]).
    pub fn logit_rows(&self, seqs: &[SeqInput<'_>]) -> Vec<std::ops::Range<usize>> {
        seqs.iter()
            .zip(&self.spans)
            .map(|(s, &(first, n))| match s.logits {
                LogitsWanted::Last => first + n - 1..first + n,
                LogitsWanted::All => first..first + n,
            })
            .collect()
    }
}

/// The logits a forward computed, left on the model's backend: `[rows][vocab]`, the rows each
/// sequence wanted, in batch order. On a GPU nothing has been downloaded: samplers and
/// verifiers on the same backend read them in place.
#[derive(Debug)]
pub struct BatchLogits {
    /// `[rows][vocab]` on the model's backend.
    pub logits: Tensor,
    /// Rows per sequence, in batch order.
    pub rows_per_seq: Vec<usize>,
    /// Vocabulary size (floats per row).
    pub vocab: usize,
    /// Per entry of [`BatchInputs::prompt_logprobs`], in order: one [`TokenLogprobs`] per
    /// target, or why that sequence's rows could not be reduced (a row without a finite
    /// maximum).
    pub prompt: Vec<Result<Vec<TokenLogprobs>, String>>,
}

impl BatchLogits {
    /// The rows on the host, split per sequence (a download from a GPU).
    pub fn to_output(&self) -> Result<BatchOutput, ModelError> {
        BatchOutput::from_rows(&self.logits.to_host()?, &self.rows_per_seq, self.vocab)
    }

    /// The first row of each sequence.
    pub fn first_rows(&self) -> Vec<usize> {
        self.rows_per_seq
            .iter()
            .scan(0, |at, &n| {
                let first = *at;
                *at += n;
                Some(first)
            })
            .collect()
    }
}

impl BatchOutput {
    /// Splits the logits of the picked rows (`[rows][vocab]`, in batch order) per sequence.
    pub fn from_rows(
        all: &[f32],
        rows_per_seq: &[usize],
        vocab: usize,
    ) -> Result<Self, ModelError> {
        let mut logits = Vec::with_capacity(rows_per_seq.len());
        let mut rest = all;
        for &n in rows_per_seq {
            if rest.len() < n * vocab {
                return Err(ModelError::Invalid(
                    "fewer logits rows than requested".into(),
                ));
            }
            let (mine, tail) = rest.split_at(n * vocab);
            logits.push(mine.to_vec());
            rest = tail;
        }
        Ok(Self { logits, vocab })
    }
}

impl BatchInputs<'_> {
    /// Puts [`Self::drafts_on_device`] over the placeholders of the batch's token ids `ids`
    /// (uploaded from the host just before, in stream order); nothing without them. The round's
    /// sequences must come first, each with its anchor and γ drafts.
    pub(crate) fn place_drafts(&self, b: &Backend, ids: &mut Ints) -> Result<(), ModelError> {
        let Some(p) = self.drafts_on_device else {
            return Ok(());
        };
        let uniform = self
            .seqs
            .get(..p.seqs)
            .is_some_and(|s| s.iter().all(|s| s.tokens.len() == p.gamma + 1));
        if !uniform {
            return Err(ModelError::Invalid(format!(
                "drafts on the device: the batch's first {} sequences must each feed an anchor \
                 and {} drafts",
                p.seqs, p.gamma
            )));
        }
        Ok(scatter_drafts(b, p, ids)?)
    }

    /// [`Self::check_seqs`] after checking that the cache's geometry (`layout`) is the model's
    /// (`layers` attention layers of `config.latent_width()`): what every backend's forward
    /// validates before writing any cache row.
    pub fn check(
        &self,
        config: &ModelConfig,
        layers: usize,
        layout: &KvLayout,
    ) -> Result<(), ModelError> {
        if layout.num_layers != layers || layout.width != config.latent_width() {
            return Err(ModelError::Kv(format!(
                "KV cache geometry ({} layers × {} wide) does not match the model ({} × {})",
                layout.num_layers,
                layout.width,
                layers,
                config.latent_width()
            )));
        }
        self.check_seqs(config, layout)
    }

    /// Rejects a batch that would index out of range anywhere, naming the sequence and field:
    /// empty or out-of-vocabulary tokens, positions beyond the context, block tables too short
    /// or pointing outside the cache. Every backend calls this before writing any cache row.
    pub fn check_seqs(&self, config: &ModelConfig, layout: &KvLayout) -> Result<(), ModelError> {
        let vocab = config.vocab_size;
        let max_pos = config.max_position_embeddings;
        for (i, s) in self.seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(ModelError::Invalid(format!(
                    "sequence {i}: `tokens` must not be empty"
                )));
            }
            if let Some(bad) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(ModelError::Invalid(format!(
                    "sequence {i}: token id {bad} is outside the vocabulary of {vocab}"
                )));
            }
            let end = s.start_pos + s.tokens.len();
            if end > max_pos {
                return Err(ModelError::PromptTooLong {
                    tokens: end,
                    limit: max_pos,
                });
            }
            if layout.blocks_for(end) > s.block_table.len() {
                return Err(ModelError::Kv(format!(
                    "sequence {i}: block table of {} blocks cannot hold {end} positions",
                    s.block_table.len()
                )));
            }
            if let Some(b) = s
                .block_table
                .iter()
                .find(|b| b.0 as usize >= layout.num_blocks)
            {
                return Err(ModelError::Kv(format!(
                    "sequence {i}: {b} is outside the KV cache"
                )));
            }
        }
        for (i, p) in self.prompt_logprobs.iter().enumerate() {
            let Some(s) = self.seqs.get(p.seq) else {
                return Err(ModelError::Invalid(format!(
                    "prompt_logprobs {i}: sequence {} is not in the batch of {}",
                    p.seq,
                    self.seqs.len()
                )));
            };
            if p.targets.len() > s.tokens.len() {
                return Err(ModelError::Invalid(format!(
                    "prompt_logprobs {i}: {} targets for {} new tokens of sequence {}",
                    p.targets.len(),
                    s.tokens.len(),
                    p.seq
                )));
            }
            if let Some(bad) = p.targets.iter().find(|&&t| t as usize >= vocab) {
                return Err(ModelError::Invalid(format!(
                    "prompt_logprobs {i}: target {bad} is outside the vocabulary of {vocab}"
                )));
            }
        }
        Ok(())
    }

    /// New tokens across the batch.
    pub fn total_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}

/// The forward's result.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchOutput {
    /// Per sequence, row-major `[rows][vocab]`: one row for [`LogitsWanted::Last`], one per new
    /// token for [`LogitsWanted::All`].
    pub logits: Vec<Vec<f32>>,
    /// Vocabulary size (row width).
    pub vocab: usize,
}

impl BatchOutput {
    /// The last row of sequence `seq`.
    pub fn last_row(&self, seq: usize) -> Option<&[f32]> {
        let l = self.logits.get(seq)?;
        l.len()
            .checked_sub(self.vocab)
            .and_then(|start| l.get(start..))
    }
}
