//! A sequence's block table.

use super::{BlockId, KvPool};
use crate::ModelError;

/// The blocks holding one sequence's positions, in order, plus how many positions are filled.
///
/// A table owns one reference on each of its blocks; [`BlockTable::free`] gives them back.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
    len: usize,
}

impl BlockTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// A table over `blocks` whose first `len` positions are already filled, taking over one
    /// reference on each block the caller already holds (the KV manager's cached-prefix reuse).
    pub(crate) fn from_cached(blocks: Vec<BlockId>, len: usize) -> Self {
        Self { blocks, len }
    }

    /// The blocks, in position order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Positions already written.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Starts a table that shares the first `tokens` positions of `prefix` (which must be whole
    /// blocks), taking a reference on each shared block.
    pub fn share_prefix(
        pool: &mut KvPool,
        prefix: &BlockTable,
        tokens: usize,
    ) -> Result<Self, ModelError> {
        let page = pool.layout().page_size;
        if tokens % page != 0 || tokens > prefix.len {
            return Err(ModelError::Kv(format!(
                "a shared prefix must be whole filled blocks: {tokens} tokens, page {page}, {} filled",
                prefix.len
            )));
        }
        let blocks = prefix.blocks[..tokens / page].to_vec();
        for &b in &blocks {
            pool.retain(b)?;
        }
        Ok(Self {
            blocks,
            len: tokens,
        })
    }

    /// Makes room for `extra` more positions, allocating blocks as needed (all or nothing).
    pub fn reserve(&mut self, pool: &mut KvPool, extra: usize) -> Result<(), ModelError> {
        let need = pool.layout().blocks_for(self.len + extra);
        if need > self.blocks.len() {
            let new = pool.allocate(need - self.blocks.len())?;
            self.blocks.extend(new);
        }
        Ok(())
    }

    /// Marks `n` more positions as written (after a forward filled them).
    pub fn advance(&mut self, n: usize, page_size: usize) -> Result<(), ModelError> {
        if self.len + n > self.blocks.len() * page_size {
            return Err(ModelError::Kv(format!(
                "advance by {n} past the table's capacity of {} positions",
                self.blocks.len() * page_size
            )));
        }
        self.len += n;
        Ok(())
    }

    /// Forgets positions from `len` on (KV rollback), returning now-unused tail blocks.
    pub fn truncate(&mut self, pool: &mut KvPool, len: usize) -> Result<(), ModelError> {
        if len > self.len {
            return Err(ModelError::Kv(format!(
                "truncate to {len} beyond the filled {}",
                self.len
            )));
        }
        let keep = pool.layout().blocks_for(len);
        let tail: Vec<BlockId> = self.blocks.drain(keep..).collect();
        self.len = len;
        pool.release_all(&tail)
    }

    /// Returns every block to the pool.
    pub fn free(&mut self, pool: &mut KvPool) -> Result<(), ModelError> {
        let blocks = std::mem::take(&mut self.blocks);
        self.len = 0;
        pool.release_all(&blocks)
    }
}
