//! One sequence's state over a KV pool: the simplest way to run the model token by token.
//!
//! `ferry generate` and the parity tests use it; the serving engine batches many sequences
//! through [`DeepseekModel::forward`] directly.

use crate::deepseek::{BatchInputs, DeepseekModel, FormPolicy, LogitsWanted, SeqInput};
use crate::kv::{BlockTable, KvPool};
use crate::ModelError;

/// A sequence being computed: its tokens so far and the blocks that hold their KV.
#[derive(Debug, Default)]
pub struct Session {
    table: BlockTable,
    tokens: Vec<u32>,
    policy: FormPolicy,
}

impl Session {
    /// An empty sequence; attention forms chosen by the cost model.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty sequence whose attention form is chosen by `policy` (tests, benchmarks).
    pub fn with_policy(policy: FormPolicy) -> Self {
        Self {
            policy,
            ..Self::default()
        }
    }

    /// Starts a sequence that reuses the first `tokens` cached positions of `prefix` (whole
    /// blocks) without recomputing them.
    pub fn fork_prefix(
        pool: &mut KvPool,
        prefix: &Session,
        tokens: usize,
    ) -> Result<Self, ModelError> {
        let table = BlockTable::share_prefix(pool, &prefix.table, tokens)?;
        let tokens = prefix
            .tokens
            .get(..tokens)
            .map(<[u32]>::to_vec)
            .ok_or_else(|| {
                ModelError::Kv(format!(
                    "prefix of {tokens} tokens is longer than the sequence"
                ))
            })?;
        Ok(Self {
            table,
            tokens,
            policy: prefix.policy,
        })
    }

    /// Tokens whose KV is cached.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The block table.
    pub fn table(&self) -> &BlockTable {
        &self.table
    }

    /// Computes `new` tokens after the cached ones and returns their logits (`[rows][vocab]`).
    /// On error nothing is committed: the sequence keeps its previous length (blocks reserved
    /// for the failed step stay with the table and are reused by the next one).
    pub fn extend(
        &mut self,
        model: &DeepseekModel,
        pool: &mut KvPool,
        new: &[u32],
        wanted: LogitsWanted,
    ) -> Result<Vec<f32>, ModelError> {
        self.table.reserve(pool, new.len())?;
        let batch = BatchInputs {
            prompt_logprobs: Vec::new(),
            drafts_on_device: None,
            seqs: vec![SeqInput {
                tokens: new,
                start_pos: self.table.len(),
                block_table: self.table.blocks(),
                logits: wanted,
            }],
        };
        let mut out = model.forward_with(&batch, pool, self.policy)?;
        self.table.advance(new.len(), pool.layout().page_size)?;
        self.tokens.extend_from_slice(new);
        Ok(out.logits.pop().unwrap_or_default())
    }

    /// Gives every block back to the pool.
    pub fn free(mut self, pool: &mut KvPool) -> Result<(), ModelError> {
        self.table.free(pool)
    }
}
