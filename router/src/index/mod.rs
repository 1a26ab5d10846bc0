//! The KV prefix index: which worker holds which cached blocks, rebuilt from worker events.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | the [`PrefixIndex`] contract and [`Overlaps`], the per-request lookup result |
//! | [`flat`] | [`FlatIndex`], the implementation: `BlockHash → workers` plus per-worker sets |
//! | [`apply`] | event and snapshot types, the event-id sequence rule, [`OutOfSync`] |
//!
//! The workers' block ownership is the source of truth; this index is an advisory view that
//! may lag by a heartbeat. Routing on a stale entry costs a cache miss, never a wrong answer:
//! the decode and prefill workers look up their own caches.
//!
//! Why not a radix tree: block hashes are chained (`h_i = H(h_{i-1}, block i)`), so one hash
//! already names a whole prefix, and a flat map from hash to holders answers "how many leading
//! blocks does worker W hold" by walking the prompt's hashes until the first miss — the same
//! walk a radix tree does, without the tree.
pub mod apply;
pub mod flat;

use std::collections::HashMap;
use std::fmt;

use ferry_proto::ids::{BlockHash, EventId, WorkerId};

pub use apply::{Applied, KvEvent, KvEventData, OutOfSync, Snapshot};
pub use flat::FlatIndex;

/// The contract every prefix index meets (tests in `tests.rs` run it against a naive model).
pub trait PrefixIndex: Send + Sync + fmt::Debug {
    /// Replaces everything known about `worker` with `snapshot` and marks it in sync.
    fn replace(&self, worker: &WorkerId, snapshot: Snapshot);

    /// Applies `events` in order. A replayed id is skipped; a gap stops the batch, marks the
    /// worker out of sync and returns [`OutOfSync::Gap`] (events before the gap stay applied).
    fn apply(&self, worker: &WorkerId, events: &[KvEvent]) -> Result<Applied, OutOfSync>;

    /// Forgets `worker` entirely.
    fn remove_worker(&self, worker: &WorkerId);

    /// How many of `hashes`, from the first, `worker` holds without interruption.
    fn matched_blocks(&self, worker: &WorkerId, hashes: &[BlockHash]) -> usize;

    /// [`PrefixIndex::matched_blocks`] for every worker at once (workers matching 0 blocks
    /// are absent).
    fn overlaps(&self, hashes: &[BlockHash]) -> Overlaps;

    /// The last event applied for `worker`, if it is known.
    fn last_event(&self, worker: &WorkerId) -> Option<EventId>;

    /// How many blocks the index holds for `worker` (0 if unknown): for `/metrics`, so that
    /// an operator (and the tests) can compare a router's view with the workers' caches.
    fn worker_blocks(&self, worker: &WorkerId) -> usize;
}

/// Leading blocks of one prompt held by each worker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overlaps(HashMap<WorkerId, usize>);

impl Overlaps {
    /// Overlaps from explicit pairs (tests and synthetic states).
    pub fn from_pairs(pairs: impl IntoIterator<Item = (WorkerId, usize)>) -> Self {
        Self(pairs.into_iter().filter(|(_, n)| *n > 0).collect())
    }

    /// Leading blocks `worker` holds (0 when absent).
    pub fn get(&self, worker: &WorkerId) -> usize {
        self.0.get(worker).copied().unwrap_or(0)
    }

    /// Workers holding at least one leading block.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no worker holds the first block.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The largest overlap of any worker.
    pub fn max(&self) -> usize {
        self.0.values().copied().max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests;
