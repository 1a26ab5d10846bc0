//! The KV block manager: the one owner of a worker's KV state (pool, prefix cache, event log).
//!
//! Prefill and decode workers both use it, from their engine thread, without locks (STYLE.md
//! principle 1: one owner, driven by the engine's commands). A sequence's life:
//!
//! ```text
//! start_sequence(prompt, max_reuse) ──► (table, reused)      reuse the longest cached prefix
//!   reserve(table, n) ─► forward writes rows ─► table.advance(n, page)   (repeat per step)
//!   cache_full_blocks(table, tokens)          full blocks become shareable  → Stored event
//! free(table)                                 cached blocks stay, now evictable
//! reserve(..) when the free list is short     evicts LRU evictable blocks   → Removed event
//! ```
//!
//! Every block is in exactly one of three states, and the counters add up:
//! `blocks_free() + blocks_cached_only() + blocks_in_use() == blocks_total()`.
//!
//! | state | pool refcount | counted by |
//! |---|---|---|
//! | free | 0 | [`KvManager::blocks_free`] |
//! | cached, no sequence uses it (evictable) | 1 (the cache's) | [`KvManager::blocks_cached_only`] |
//! | referenced by a live sequence (maybe also cached) | ≥ 1 | [`KvManager::blocks_in_use`] |
//!
//! Reference changes on cached blocks must go through the manager (`start_sequence`, `free`,
//! `truncate`, `cache_full_blocks`) so the evictable set stays exact; [`KvManager::pool_mut`] is
//! for writing rows.

use ferry_proto::ids::{BlockHash, EventId};

use super::events::{EventLog, KvEvent, KvEventData};
use super::hash::block_hashes;
use super::prefix::PrefixCache;
use super::{BlockId, BlockTable, KvPool};
use crate::ModelError;

/// A worker's KV state: the block pool, the prefix cache over it, and the events that describe
/// the cache to the router.
#[derive(Debug)]
pub struct KvManager {
    pool: KvPool,
    cache: PrefixCache,
    events: EventLog,
}

impl KvManager {
    /// Manages `pool` (normally fresh: every block free) with an empty cache and no events.
    pub fn new(pool: KvPool) -> Self {
        Self {
            pool,
            cache: PrefixCache::new(),
            events: EventLog::new(),
        }
    }

    /// The pool, for reading KV (forward passes, transfers).
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// The pool, for writing KV rows. Take and drop block references through the manager, not
    /// here, or the evictable set goes stale.
    pub fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }

    /// The prefix cache, read-only (metrics, tests).
    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// Tokens per block.
    pub fn page_size(&self) -> usize {
        self.pool.layout().page_size
    }

    /// How many leading tokens of `prompt` [`KvManager::start_sequence`] would reuse now, without
    /// taking anything: for deciding where (or whether) to prefill.
    pub fn cached_prefix_tokens(&self, prompt: &[u32], max_reuse_tokens: usize) -> usize {
        self.cache
            .match_prefix(&self.reusable_hashes(prompt, max_reuse_tokens))
            .len()
            * self.page_size()
    }

    /// Starts a sequence for `prompt`, reusing the longest cached prefix of whole blocks, capped
    /// at `max_reuse_tokens` (rounded down to whole blocks). Callers pass `prompt.len() - 1` so at
    /// least one token is computed and yields logits, or less to limit reuse.
    ///
    /// Each reused block gets the sequence's reference (it stops being evictable). Returns the
    /// table, filled up to the reused tokens, and that count; the rest of the prompt still needs
    /// [`KvManager::reserve`] and a forward.
    pub fn start_sequence(
        &mut self,
        prompt: &[u32],
        max_reuse_tokens: usize,
    ) -> Result<(BlockTable, usize), ModelError> {
        let blocks = self
            .cache
            .match_prefix(&self.reusable_hashes(prompt, max_reuse_tokens));
        for (i, &b) in blocks.iter().enumerate() {
            if let Err(e) = self.cache.acquire(&mut self.pool, b) {
                // Give back what was taken so a failed start leaves no trace.
                for &taken in blocks.get(..i).unwrap_or_default().iter().rev() {
                    // These were just retained, so their release cannot fail.
                    let _ = self.pool.release(taken);
                    self.cache.refresh(&self.pool, taken);
                }
                return Err(e);
            }
        }
        let reused = blocks.len() * self.page_size();
        Ok((BlockTable::from_cached(blocks, reused), reused))
    }

    /// Makes room in `table` for `extra` more positions. When the free list is short it first
    /// evicts least recently used cached blocks (recording a `Removed` event); when even that is
    /// not enough it fails with "out of KV blocks" and changes nothing.
    pub fn reserve(&mut self, table: &mut BlockTable, extra: usize) -> Result<(), ModelError> {
        let want = table.len().checked_add(extra).ok_or_else(|| {
            ModelError::Kv(format!(
                "cannot reserve {extra} positions after {}: overflow",
                table.len()
            ))
        })?;
        let need = self
            .pool
            .layout()
            .blocks_for(want)
            .saturating_sub(table.blocks().len());
        let free = self.pool.free_blocks();
        if need > free {
            let evictable = self.cache.evictable_len();
            if need > free + evictable {
                return Err(ModelError::Kv(format!(
                    "out of KV blocks: need {need} more for {extra} positions, \
                     {free} free + {evictable} evictable of {}",
                    self.blocks_total()
                )));
            }
            self.cache
                .evict(&mut self.pool, &mut self.events, need - free);
        }
        table.reserve(&mut self.pool, extra)
    }

    /// Makes every full block of `table` shareable: each one whose hash is not cached yet is
    /// cached (the cache takes its own reference) and one `Stored` event is recorded per
    /// consecutive run of newly cached blocks (normally one run), with its parent hash. A block
    /// whose hash is already cached (another sequence computed the same prefix) stays private to
    /// this table.
    ///
    /// `tokens` are the sequence's tokens whose KV is in the table (`tokens.len() ==
    /// table.len()`); only accepted tokens belong here, never unverified drafts. Cost: hashing
    /// all of `tokens`, so call it when a block has filled (after a prefill, when decode crosses
    /// a page boundary), not every step.
    pub fn cache_full_blocks(
        &mut self,
        table: &BlockTable,
        tokens: &[u32],
    ) -> Result<(), ModelError> {
        if tokens.len() != table.len() {
            return Err(ModelError::Kv(format!(
                "`tokens` must be the table's {} filled positions, got {}",
                table.len(),
                tokens.len()
            )));
        }
        let hashes = block_hashes(tokens, self.page_size());
        let blocks = table.blocks();
        if hashes.len() > blocks.len() {
            return Err(ModelError::Kv(format!(
                "{} full blocks of tokens but the table has {} blocks",
                hashes.len(),
                blocks.len()
            )));
        }
        // Validate before changing anything: a cached block's KV is shared, so the same block
        // under a different hash means `tokens` are not what the block holds.
        for (&h, &b) in hashes.iter().zip(blocks) {
            if let Some(cached) = self.cache.hash_of(b) {
                if cached != h {
                    return Err(ModelError::Kv(format!(
                        "{b} is cached as hash {cached} but `tokens` hash it to {h}"
                    )));
                }
            }
        }
        let mut run = Vec::new();
        let mut run_parent = None;
        let mut prev = None;
        let mut result = Ok(());
        for (&h, &b) in hashes.iter().zip(blocks) {
            match self.cache.insert(&mut self.pool, h, b) {
                Ok(true) => {
                    if run.is_empty() {
                        run_parent = prev;
                    }
                    run.push(h);
                }
                Ok(false) => self.record_stored(&mut run, run_parent),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
            prev = Some(h);
        }
        // Even after an error, what was cached is announced, so the router stays exact.
        self.record_stored(&mut run, run_parent);
        result
    }

    /// Forgets `table`'s positions from `len` on (speculative-decode rollback), returning
    /// now-unused tail blocks; cached ones stay cached and may become evictable. Truncating into
    /// the middle of a cached block is an error (the next writes would corrupt a shared block).
    pub fn truncate(&mut self, table: &mut BlockTable, len: usize) -> Result<(), ModelError> {
        let page = self.page_size();
        if len % page != 0 {
            if let Some(&b) = table.blocks().get(len / page) {
                if let Some(h) = self.cache.hash_of(b) {
                    return Err(ModelError::Kv(format!(
                        "truncate to {len} would leave cached {b} (hash {h}) partly filled; \
                         a cached block is shared and never rewritten"
                    )));
                }
            }
        }
        let keep = self.pool.layout().blocks_for(len);
        let tail = table.blocks().get(keep..).unwrap_or_default().to_vec();
        let result = table.truncate(&mut self.pool, len);
        self.refresh_released(&tail);
        result
    }

    /// Releases the sequence's references and empties `table`. Its cached blocks stay cached
    /// and, once no other sequence uses them, become evictable (tail blocks first in LRU order,
    /// so a prefix is evicted from its end).
    pub fn free(&mut self, table: &mut BlockTable) -> Result<(), ModelError> {
        let blocks = table.blocks().to_vec();
        let result = table.free(&mut self.pool);
        self.refresh_released(&blocks);
        result
    }

    /// Blocks in the pool.
    pub fn blocks_total(&self) -> usize {
        self.pool.layout().num_blocks
    }

    /// Blocks on the free list (refcount 0).
    pub fn blocks_free(&self) -> usize {
        self.pool.free_blocks()
    }

    /// Cached blocks that no sequence references: evictable on demand.
    pub fn blocks_cached_only(&self) -> usize {
        self.cache.evictable_len()
    }

    /// Blocks referenced by live sequences (`total − free − evictable`). Returns to 0 once every
    /// sequence is freed; cluster tests assert exactly that.
    pub fn blocks_in_use(&self) -> usize {
        self.blocks_total()
            .saturating_sub(self.blocks_free())
            .saturating_sub(self.blocks_cached_only())
    }

    /// Takes the events recorded since the last drain, oldest first, for the router.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        self.events.drain()
    }

    /// Events recorded since the last drain, oldest first, without taking them.
    pub fn pending_events(&self) -> &[KvEvent] {
        self.events.pending()
    }

    /// Every cached hash (parents cached before their children first) and the last event id
    /// issued (`EventId(0)` if none): the state as of that event, for (re)registering with the
    /// router, which then applies only events with larger ids.
    pub fn snapshot(&self) -> (Vec<BlockHash>, EventId) {
        (self.cache.hashes(), self.events.last_id())
    }

    /// Evicts every evictable block (recording a `Removed` event); blocks used by live sequences
    /// stay cached.
    pub fn clear_cache(&mut self) {
        self.cache
            .evict(&mut self.pool, &mut self.events, usize::MAX);
    }

    /// Hashes of the whole blocks of `prompt` that may be reused under `max_reuse_tokens`.
    fn reusable_hashes(&self, prompt: &[u32], max_reuse_tokens: usize) -> Vec<BlockHash> {
        let page = self.page_size();
        let limit = max_reuse_tokens.min(prompt.len()) / page * page;
        block_hashes(prompt.get(..limit).unwrap_or_default(), page)
    }

    /// Records the run of newly cached hashes, if any, as one `Stored` event and empties it.
    fn record_stored(&mut self, run: &mut Vec<BlockHash>, parent: Option<BlockHash>) {
        self.events.record(KvEventData::Stored {
            hashes: std::mem::take(run),
            parent,
        });
    }

    /// After `blocks` each lost a reference: refresh their evictability, last block first so a
    /// prefix's tail is evicted before its head.
    fn refresh_released(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            self.cache.refresh(&self.pool, b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvLayout;

    fn manager(blocks: usize) -> KvManager {
        KvManager::new(
            KvPool::new(KvLayout {
                num_layers: 1,
                num_blocks: blocks,
                page_size: 4,
                width: 1,
            })
            .expect("valid layout"),
        )
    }

    /// Starts, computes and caches `prompt` as one sequence; returns its table.
    fn run(m: &mut KvManager, prompt: &[u32]) -> BlockTable {
        let (mut t, reused) = m
            .start_sequence(prompt, prompt.len().saturating_sub(1))
            .unwrap();
        m.reserve(&mut t, prompt.len() - reused).unwrap();
        t.advance(prompt.len() - reused, m.page_size()).unwrap();
        m.cache_full_blocks(&t, prompt).unwrap();
        t
    }

    #[test]
    fn reuse_then_free_makes_blocks_evictable() {
        let mut m = manager(8);
        let prompt: Vec<u32> = (0..10).collect();
        let mut a = run(&mut m, &prompt);
        assert_eq!(m.blocks_in_use(), 3);
        assert_eq!(m.cache().len(), 2);
        let (mut b, reused) = m.start_sequence(&prompt, 9).unwrap();
        assert_eq!(reused, 8);
        assert_eq!(b.blocks(), &a.blocks()[..2]);
        assert_eq!(m.pool().refcount(a.blocks()[0]), Some(3));
        m.free(&mut a).unwrap();
        m.free(&mut b).unwrap();
        assert_eq!(m.blocks_in_use(), 0);
        assert_eq!(m.blocks_cached_only(), 2);
        assert_eq!(m.blocks_free(), 6);
        // The tail block is evicted first.
        let tail = m.cache().get(block_hashes(&prompt, 4)[1]).unwrap();
        assert_eq!(m.cache().eviction_order()[0], tail);
    }

    #[test]
    fn duplicate_computation_is_not_cached_twice() {
        let mut m = manager(8);
        let prompt: Vec<u32> = (0..8).collect();
        let (mut a, _) = m.start_sequence(&prompt, 7).unwrap();
        let (mut b, _) = m.start_sequence(&prompt, 7).unwrap();
        for t in [&mut a, &mut b] {
            m.reserve(t, 8).unwrap();
            t.advance(8, 4).unwrap();
        }
        m.cache_full_blocks(&a, &prompt).unwrap();
        m.cache_full_blocks(&b, &prompt).unwrap();
        assert_eq!(m.cache().len(), 2);
        assert_eq!(m.drain_events().len(), 1, "b's blocks were already cached");
        m.free(&mut b).unwrap();
        m.free(&mut a).unwrap();
        assert_eq!(m.blocks_free(), 6);
        assert_eq!(m.blocks_cached_only(), 2);
    }

    #[test]
    fn wrong_tokens_are_rejected_before_any_change() {
        let mut m = manager(8);
        let prompt: Vec<u32> = (0..8).collect();
        let t = run(&mut m, &prompt);
        let other: Vec<u32> = (100..108).collect();
        assert!(m.cache_full_blocks(&t, &other).is_err());
        assert!(m.cache_full_blocks(&t, &prompt[..4]).is_err());
        assert_eq!(m.cache().len(), 2);
    }

    #[test]
    fn truncate_into_a_cached_block_is_refused() {
        let mut m = manager(8);
        let prompt: Vec<u32> = (0..10).collect();
        let mut t = run(&mut m, &prompt);
        assert!(m.truncate(&mut t, 6).is_err());
        assert_eq!(t.len(), 10);
        m.truncate(&mut t, 4).unwrap();
        assert_eq!(t.blocks().len(), 1);
        assert_eq!(
            m.blocks_cached_only(),
            1,
            "the dropped cached block is evictable"
        );
        m.free(&mut t).unwrap();
        assert_eq!(m.blocks_in_use(), 0);
    }
}
