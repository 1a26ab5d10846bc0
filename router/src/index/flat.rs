//! [`FlatIndex`]: the prefix index as two concurrent maps.
//!
//! ```text
//!  holders: BlockHash ──► [WorkerId]            read by every routing decision
//!  workers: WorkerId  ──► { last_event, in_sync, {BlockHash} }   written by events
//! ```
//!
//! Concurrency: both maps are `DashMap`s (sharded `RwLock`s). Writers for a worker hold that
//! worker's entry in `workers` while they update `holders`, so the two maps stay consistent per
//! worker; readers touch `holders` only. Lock order is always `workers` then `holders`, and no
//! lock is held across an `.await` (there are none here). Cost: an event touches one
//! `holders` entry per block; a lookup walks the prompt's hashes until the first miss.
use std::collections::{HashMap, HashSet};

use dashmap::DashMap;
use ferry_proto::ids::{BlockHash, EventId, WorkerId};

use super::apply::{sequence, Applied, KvEvent, KvEventData, OutOfSync, Sequence, Snapshot};
use super::{Overlaps, PrefixIndex};

/// What the index knows about one worker.
#[derive(Debug)]
struct WorkerBlocks {
    last_event: EventId,
    in_sync: bool,
    blocks: HashSet<BlockHash>,
}

/// The prefix index (see the module docs).
#[derive(Debug, Default)]
pub struct FlatIndex {
    /// Workers holding each block; never empty (emptied entries are removed).
    holders: DashMap<BlockHash, Vec<WorkerId>>,
    workers: DashMap<WorkerId, WorkerBlocks>,
}

impl FlatIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Distinct blocks cached anywhere.
    pub fn block_count(&self) -> usize {
        self.holders.len()
    }

    fn link(&self, worker: &WorkerId, hash: BlockHash) {
        let mut holders = self.holders.entry(hash).or_default();
        if !holders.contains(worker) {
            holders.push(worker.clone());
        }
    }

    fn unlink(&self, worker: &WorkerId, hash: &BlockHash) {
        self.holders.remove_if_mut(hash, |_, holders| {
            holders.retain(|w| w != worker);
            holders.is_empty()
        });
    }
}

impl PrefixIndex for FlatIndex {
    fn replace(&self, worker: &WorkerId, snapshot: Snapshot) {
        let fresh: HashSet<BlockHash> = snapshot.blocks.into_iter().collect();
        let mut entry = self
            .workers
            .entry(worker.clone())
            .or_insert_with(|| WorkerBlocks {
                last_event: EventId(0),
                in_sync: true,
                blocks: HashSet::new(),
            });
        for gone in entry.blocks.difference(&fresh) {
            self.unlink(worker, gone);
        }
        for new in fresh.difference(&entry.blocks) {
            self.link(worker, *new);
        }
        entry.blocks = fresh;
        entry.last_event = snapshot.last_event;
        entry.in_sync = true;
    }

    fn apply(&self, worker: &WorkerId, events: &[KvEvent]) -> Result<Applied, OutOfSync> {
        let Some(mut state) = self.workers.get_mut(worker) else {
            return Err(OutOfSync::UnknownWorker(worker.clone()));
        };
        if !state.in_sync {
            return Err(OutOfSync::AwaitingSnapshot(worker.clone()));
        }
        let mut done = Applied::default();
        for event in events {
            match sequence(state.last_event, event.id) {
                Sequence::Next => {}
                Sequence::Replay => {
                    done.skipped += 1;
                    continue;
                }
                Sequence::Gap { expected } => {
                    state.in_sync = false;
                    return Err(OutOfSync::Gap {
                        worker: worker.clone(),
                        expected,
                        got: event.id,
                    });
                }
            }
            match &event.data {
                KvEventData::Stored(hashes) => {
                    for hash in hashes {
                        if state.blocks.insert(*hash) {
                            self.link(worker, *hash);
                        }
                    }
                }
                KvEventData::Removed(hashes) => {
                    for hash in hashes {
                        if state.blocks.remove(hash) {
                            self.unlink(worker, hash);
                        }
                    }
                }
            }
            state.last_event = event.id;
            done.applied += 1;
        }
        Ok(done)
    }

    fn remove_worker(&self, worker: &WorkerId) {
        self.workers.remove_if_mut(worker, |_, state| {
            for hash in state.blocks.drain() {
                self.unlink(worker, &hash);
            }
            true
        });
    }

    fn matched_blocks(&self, worker: &WorkerId, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| {
                self.holders
                    .get(*h)
                    .is_some_and(|holders| holders.contains(worker))
            })
            .count()
    }

    fn overlaps(&self, hashes: &[BlockHash]) -> Overlaps {
        let mut depth: HashMap<WorkerId, usize> = HashMap::new();
        let mut alive: Vec<WorkerId> = Vec::new();
        for (i, hash) in hashes.iter().enumerate() {
            let Some(holders) = self.holders.get(hash) else {
                break;
            };
            if i == 0 {
                alive = holders.clone();
            } else {
                alive.retain(|w| holders.contains(w));
            }
            drop(holders);
            if alive.is_empty() {
                break;
            }
            for w in &alive {
                depth.insert(w.clone(), i + 1);
            }
        }
        Overlaps::from_pairs(depth)
    }

    fn last_event(&self, worker: &WorkerId) -> Option<EventId> {
        self.workers.get(worker).map(|s| s.last_event)
    }

    fn worker_blocks(&self, worker: &WorkerId) -> usize {
        self.workers.get(worker).map_or(0, |s| s.blocks.len())
    }
}
