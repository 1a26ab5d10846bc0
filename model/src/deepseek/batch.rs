//! The contract between a scheduler and the forward.

use crate::kv::BlockId;

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

/// A batch: any mix of fresh prompts, prefill chunks over a cached prefix and decode steps.
#[derive(Debug, Clone, Default)]
pub struct BatchInputs<'a> {
    /// The sequences, each computed against its own block table.
    pub seqs: Vec<SeqInput<'a>>,
}

impl BatchInputs<'_> {
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
