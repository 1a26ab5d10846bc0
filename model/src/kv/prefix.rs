//! The prefix cache: which pool block holds the KV of which full-block hash, and which cached
//! blocks may be evicted, least recently used first.
//!
//! Ownership: the cache holds exactly one pool reference on each cached block, so a cached block
//! never returns to the free list while cached. A cached block whose pool refcount is 1 is
//! referenced only by the cache: no live sequence uses it, and it is *evictable*. The cache keeps
//! those in LRU order; [`super::KvManager`] tells it (through `refresh`) whenever a reference on a
//! cached block is taken or dropped, so the LRU set is exactly "cached and refcount 1".
//!
//! A block becomes least recently used when its last sequence lets go of it. A freed sequence
//! refreshes its blocks tail first, so a chain is evicted from its tail: lookups stop at the first
//! missing hash, and evicting a parent first would strand its still-cached children (that is
//! allowed, only wasteful).
//!
//! Lineage: vLLM's hash-keyed block pool with an evictable LRU, mistral.rs
//! `paged_attention/block_pool.rs`. Complexity: lookup is one hash probe per block; insert,
//! acquire and refresh are O(log n) in the evictable count; eviction is O(log n) per block.

use std::collections::{BTreeMap, HashMap};

use ferry_proto::ids::BlockHash;

use super::events::{EventLog, KvEventData};
use super::{BlockId, KvPool};
use crate::ModelError;

/// What the cache knows about one cached block.
#[derive(Debug, Clone, Copy)]
struct Entry {
    hash: BlockHash,
    /// When the block was cached (the clock's value), for snapshot order.
    inserted: u64,
    /// The block's key in the LRU when it is evictable.
    lru_tick: Option<u64>,
}

/// Hash → block map of a worker's cached full blocks, plus the LRU order of the evictable ones.
#[derive(Debug, Default)]
pub struct PrefixCache {
    by_hash: HashMap<BlockHash, BlockId>,
    entries: HashMap<BlockId, Entry>,
    /// Evictable blocks by the tick at which they became evictable; the first is evicted first.
    lru: BTreeMap<u64, BlockId>,
    /// Monotonic counter for `Entry::inserted` and LRU ticks.
    clock: u64,
}

impl PrefixCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cached blocks (evictable or not).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Cached blocks referenced only by the cache: what eviction can give back to the pool.
    pub fn evictable_len(&self) -> usize {
        self.lru.len()
    }

    /// The block caching `hash`, if any.
    pub fn get(&self, hash: BlockHash) -> Option<BlockId> {
        self.by_hash.get(&hash).copied()
    }

    /// The hash `block` is cached under, if it is cached.
    pub fn hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.entries.get(&block).map(|e| e.hash)
    }

    /// Whether `block` is cached and referenced by no sequence.
    pub fn is_evictable(&self, block: BlockId) -> bool {
        self.entries
            .get(&block)
            .is_some_and(|e| e.lru_tick.is_some())
    }

    /// The blocks of the longest cached prefix of `hashes`: stops at the first hash not cached.
    pub fn match_prefix(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes.iter().map_while(|h| self.get(*h)).collect()
    }

    /// Every cached hash, in the order the blocks were cached (a parent cached before its child
    /// comes first).
    pub fn hashes(&self) -> Vec<BlockHash> {
        let mut v: Vec<(u64, BlockHash)> = self
            .entries
            .values()
            .map(|e| (e.inserted, e.hash))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, h)| h).collect()
    }

    /// The evictable blocks, the next one to be evicted first.
    pub fn eviction_order(&self) -> Vec<BlockId> {
        self.lru.values().copied().collect()
    }

    /// Caches `block` under `hash`, taking one pool reference on it. Returns `false` (and changes
    /// nothing) when `hash` is already cached: the existing block stays the cached one.
    ///
    /// A block caches at most one hash; caching it under a second one is an error.
    pub(crate) fn insert(
        &mut self,
        pool: &mut KvPool,
        hash: BlockHash,
        block: BlockId,
    ) -> Result<bool, ModelError> {
        if self.by_hash.contains_key(&hash) {
            return Ok(false);
        }
        if let Some(e) = self.entries.get(&block) {
            return Err(ModelError::Kv(format!(
                "{block} is already cached as hash {}, cannot cache it as {hash}",
                e.hash
            )));
        }
        pool.retain(block)?;
        self.clock += 1;
        self.by_hash.insert(hash, block);
        self.entries.insert(
            block,
            Entry {
                hash,
                inserted: self.clock,
                lru_tick: None,
            },
        );
        self.refresh(pool, block);
        Ok(true)
    }

    /// Takes a sequence's reference on the cached `block`; it stops being evictable.
    pub(crate) fn acquire(&mut self, pool: &mut KvPool, block: BlockId) -> Result<(), ModelError> {
        if !self.entries.contains_key(&block) {
            return Err(ModelError::Kv(format!("acquire of uncached {block}")));
        }
        pool.retain(block)?;
        self.refresh(pool, block);
        Ok(())
    }

    /// Brings `block`'s LRU membership in line with its pool refcount after a reference on it
    /// was taken or dropped: evictable (and most recently used) iff cached with refcount 1.
    /// Does nothing for a block that is not cached.
    pub(crate) fn refresh(&mut self, pool: &KvPool, block: BlockId) {
        let Some(entry) = self.entries.get_mut(&block) else {
            return;
        };
        let evictable = pool.refcount(block) == Some(1);
        match (evictable, entry.lru_tick) {
            (true, None) => {
                self.clock += 1;
                entry.lru_tick = Some(self.clock);
                self.lru.insert(self.clock, block);
            }
            (false, Some(tick)) => {
                self.lru.remove(&tick);
                entry.lru_tick = None;
            }
            _ => {}
        }
    }

    /// Evicts up to `n` least recently used evictable blocks: drops the cache's reference (each
    /// block returns to the pool's free list) and records one `Removed` event for them all.
    /// Returns how many were evicted.
    pub(crate) fn evict(&mut self, pool: &mut KvPool, events: &mut EventLog, n: usize) -> usize {
        let mut removed = Vec::new();
        while removed.len() < n {
            let Some((_, block)) = self.lru.pop_first() else {
                break;
            };
            let Some(entry) = self.entries.get_mut(&block) else {
                continue;
            };
            entry.lru_tick = None;
            // Every reference change goes through `refresh`, so this holds; should a reference
            // have been taken behind the cache's back, the block is not evictable after all and
            // the next `refresh` on release re-lists it.
            if pool.refcount(block) != Some(1) || pool.release(block).is_err() {
                continue;
            }
            let hash = entry.hash;
            self.entries.remove(&block);
            self.by_hash.remove(&hash);
            removed.push(hash);
        }
        let count = removed.len();
        events.record(KvEventData::Removed { hashes: removed });
        count
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvLayout;

    fn pool(blocks: usize) -> KvPool {
        KvPool::new(KvLayout {
            num_layers: 1,
            num_blocks: blocks,
            page_size: 2,
            width: 1,
        })
        .expect("valid layout")
    }

    #[test]
    fn insert_holds_one_reference_and_duplicates_are_noops() {
        let mut p = pool(4);
        let mut c = PrefixCache::new();
        let b = p.allocate(2).unwrap();
        assert!(c.insert(&mut p, BlockHash(10), b[0]).unwrap());
        assert_eq!(p.refcount(b[0]), Some(2));
        assert!(!c.is_evictable(b[0]), "the sequence still holds it");
        assert!(!c.insert(&mut p, BlockHash(10), b[1]).unwrap());
        assert_eq!(p.refcount(b[1]), Some(1), "the duplicate is not cached");
        assert_eq!(c.get(BlockHash(10)), Some(b[0]));
        assert!(c.insert(&mut p, BlockHash(11), b[0]).is_err());
        p.release(b[0]).unwrap();
        c.refresh(&p, b[0]);
        assert!(c.is_evictable(b[0]));
        assert_eq!(c.evictable_len(), 1);
    }

    #[test]
    fn eviction_is_lru_and_records_one_event() {
        let mut p = pool(4);
        let mut c = PrefixCache::new();
        let mut log = EventLog::new();
        let b = p.allocate(3).unwrap();
        for (i, &blk) in b.iter().enumerate() {
            c.insert(&mut p, BlockHash(i as u64), blk).unwrap();
        }
        // Released in the order 2, 0, 1: that is the eviction order.
        for i in [2, 0, 1] {
            p.release(b[i]).unwrap();
            c.refresh(&p, b[i]);
        }
        assert_eq!(c.eviction_order(), vec![b[2], b[0], b[1]]);
        // Taking block 0 again makes it unevictable; releasing it makes it most recent.
        c.acquire(&mut p, b[0]).unwrap();
        assert_eq!(c.eviction_order(), vec![b[2], b[1]]);
        p.release(b[0]).unwrap();
        c.refresh(&p, b[0]);
        assert_eq!(c.eviction_order(), vec![b[2], b[1], b[0]]);

        assert_eq!(c.evict(&mut p, &mut log, 2), 2);
        assert_eq!(p.free_blocks(), 3);
        assert_eq!(c.len(), 1);
        let ev = log.drain();
        assert_eq!(ev.len(), 1);
        assert_eq!(
            ev[0].data,
            KvEventData::Removed {
                hashes: vec![BlockHash(2), BlockHash(1)]
            }
        );
        assert_eq!(c.match_prefix(&[BlockHash(0), BlockHash(1)]), vec![b[0]]);
        assert_eq!(c.evict(&mut p, &mut log, 5), 1);
        assert_eq!(c.evict(&mut p, &mut log, 5), 0);
        assert_eq!(log.drain().len(), 1, "evicting nothing records nothing");
        assert_eq!(p.free_blocks(), 4);
        assert!(c.is_empty());
    }

    #[test]
    fn hashes_come_in_insertion_order() {
        let mut p = pool(4);
        let mut c = PrefixCache::new();
        let b = p.allocate(3).unwrap();
        for (h, &blk) in [30u64, 10, 20].iter().zip(&b) {
            c.insert(&mut p, BlockHash(*h), blk).unwrap();
        }
        assert_eq!(
            c.hashes(),
            vec![BlockHash(30), BlockHash(10), BlockHash(20)]
        );
    }
}
