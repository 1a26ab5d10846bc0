//! The [`PrefixIndex`] contract: fixed cases, then seeded random operation sequences checked
//! against a naive model (a map of per-worker sets behind one mutex).
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use ferry_proto::ids::{BlockHash, EventId, WorkerId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::apply::{sequence, Sequence};
use super::*;

/// Per worker: last event, in sync, cached blocks.
type NaiveWorker = (EventId, bool, HashSet<BlockHash>);

/// The obviously-correct model the real index must agree with.
#[derive(Debug, Default)]
struct NaiveIndex {
    workers: Mutex<HashMap<WorkerId, NaiveWorker>>,
}

impl PrefixIndex for NaiveIndex {
    fn replace(&self, worker: &WorkerId, snapshot: Snapshot) {
        let mut map = self.workers.lock().expect("test mutex");
        map.insert(
            worker.clone(),
            (
                snapshot.last_event,
                true,
                snapshot.blocks.into_iter().collect(),
            ),
        );
    }

    fn apply(&self, worker: &WorkerId, events: &[KvEvent]) -> Result<Applied, OutOfSync> {
        let mut map = self.workers.lock().expect("test mutex");
        let Some((last, in_sync, blocks)) = map.get_mut(worker) else {
            return Err(OutOfSync::UnknownWorker(worker.clone()));
        };
        if !*in_sync {
            return Err(OutOfSync::AwaitingSnapshot(worker.clone()));
        }
        let mut done = Applied::default();
        for e in events {
            match sequence(*last, e.id) {
                Sequence::Next => {}
                Sequence::Replay => {
                    done.skipped += 1;
                    continue;
                }
                Sequence::Gap { expected } => {
                    *in_sync = false;
                    return Err(OutOfSync::Gap {
                        worker: worker.clone(),
                        expected,
                        got: e.id,
                    });
                }
            }
            match &e.data {
                KvEventData::Stored(hs) => blocks.extend(hs.iter().copied()),
                KvEventData::Removed(hs) => hs.iter().for_each(|h| {
                    blocks.remove(h);
                }),
            }
            *last = e.id;
            done.applied += 1;
        }
        Ok(done)
    }

    fn remove_worker(&self, worker: &WorkerId) {
        self.workers.lock().expect("test mutex").remove(worker);
    }

    fn matched_blocks(&self, worker: &WorkerId, hashes: &[BlockHash]) -> usize {
        let map = self.workers.lock().expect("test mutex");
        let Some((_, _, blocks)) = map.get(worker) else {
            return 0;
        };
        hashes.iter().take_while(|h| blocks.contains(h)).count()
    }

    fn overlaps(&self, hashes: &[BlockHash]) -> Overlaps {
        let ids: Vec<WorkerId> = self
            .workers
            .lock()
            .expect("test mutex")
            .keys()
            .cloned()
            .collect();
        Overlaps::from_pairs(ids.into_iter().map(|w| {
            let n = self.matched_blocks(&w, hashes);
            (w, n)
        }))
    }

    fn last_event(&self, worker: &WorkerId) -> Option<EventId> {
        self.workers
            .lock()
            .expect("test mutex")
            .get(worker)
            .map(|s| s.0)
    }

    fn worker_blocks(&self, worker: &WorkerId) -> usize {
        self.workers
            .lock()
            .expect("test mutex")
            .get(worker)
            .map_or(0, |s| s.2.len())
    }
}

fn w(name: &str) -> WorkerId {
    WorkerId::from(name)
}

fn hs(values: &[u64]) -> Vec<BlockHash> {
    values.iter().copied().map(BlockHash).collect()
}

fn stored(id: u64, values: &[u64]) -> KvEvent {
    KvEvent {
        id: EventId(id),
        data: KvEventData::Stored(hs(values)),
    }
}

fn removed(id: u64, values: &[u64]) -> KvEvent {
    KvEvent {
        id: EventId(id),
        data: KvEventData::Removed(hs(values)),
    }
}

/// The fixed cases, run on any implementation.
fn contract(index: &dyn PrefixIndex) {
    let (a, b) = (w("a"), w("b"));
    assert_eq!(index.matched_blocks(&a, &hs(&[1, 2])), 0);
    assert!(matches!(
        index.apply(&a, &[stored(1, &[1])]),
        Err(OutOfSync::UnknownWorker(_))
    ));

    index.replace(
        &a,
        Snapshot {
            blocks: hs(&[1, 2, 3]),
            last_event: EventId(10),
        },
    );
    index.replace(&b, Snapshot::default());
    assert_eq!(index.matched_blocks(&a, &hs(&[1, 2, 3, 4])), 3);
    assert_eq!(
        index.matched_blocks(&a, &hs(&[1, 9, 3])),
        1,
        "leading run only"
    );
    assert_eq!(index.matched_blocks(&a, &[]), 0);
    assert_eq!(index.last_event(&a), Some(EventId(10)));

    let done = index
        .apply(
            &b,
            &[stored(1, &[1, 2]), removed(2, &[2]), stored(3, &[2, 7])],
        )
        .expect("in order");
    assert_eq!(done.applied, 3);
    assert_eq!(index.matched_blocks(&b, &hs(&[1, 2, 7])), 3);
    let overlaps = index.overlaps(&hs(&[1, 2, 3]));
    assert_eq!((overlaps.get(&a), overlaps.get(&b)), (3, 2));

    // A retried batch is skipped, not applied twice.
    let again = index.apply(&b, &[stored(3, &[2, 7]), removed(4, &[7])]);
    assert_eq!(
        again,
        Ok(Applied {
            applied: 1,
            skipped: 1
        })
    );
    assert_eq!(index.matched_blocks(&b, &hs(&[1, 2, 7])), 2);

    // A gap: out of sync until a snapshot arrives.
    assert!(matches!(
        index.apply(&b, &[stored(6, &[8])]),
        Err(OutOfSync::Gap {
            expected: EventId(5),
            got: EventId(6),
            ..
        })
    ));
    assert!(matches!(
        index.apply(&b, &[stored(5, &[8])]),
        Err(OutOfSync::AwaitingSnapshot(_))
    ));
    index.replace(
        &b,
        Snapshot {
            blocks: hs(&[5]),
            last_event: EventId(6),
        },
    );
    assert_eq!(index.matched_blocks(&b, &hs(&[1])), 0, "snapshot replaces");
    assert_eq!(index.matched_blocks(&b, &hs(&[5])), 1);
    assert!(index.apply(&b, &[stored(7, &[6])]).is_ok());

    index.remove_worker(&a);
    assert_eq!(index.matched_blocks(&a, &hs(&[1, 2, 3])), 0);
    assert_eq!(index.last_event(&a), None);
    assert!(index.overlaps(&hs(&[1, 2, 3])).is_empty());
}

#[test]
fn naive_model_meets_the_contract() {
    contract(&NaiveIndex::default());
}

#[test]
fn flat_index_meets_the_contract() {
    let index = FlatIndex::new();
    contract(&index);
    index.remove_worker(&w("b"));
    assert_eq!(index.block_count(), 0, "no holder entries leak");
}

/// Random operations on both indexes; every answer must agree.
fn random_run(seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let real = FlatIndex::new();
    let naive = NaiveIndex::default();
    let workers: Vec<WorkerId> = (0..4).map(|i| w(&format!("w{i}"))).collect();
    // The id each worker will use next (the workers' truth), including deliberate gaps.
    let mut next_id: HashMap<WorkerId, u64> = HashMap::new();
    let universe = 24u64;

    for step in 0..400 {
        let worker = &workers[rng.random_range(0..workers.len())];
        match rng.random_range(0..10) {
            0 => {
                let blocks: Vec<u64> = (0..rng.random_range(0..10))
                    .map(|_| rng.random_range(0..universe))
                    .collect();
                let last = rng.random_range(0..50);
                let snap = Snapshot {
                    blocks: hs(&blocks),
                    last_event: EventId(last),
                };
                real.replace(worker, snap.clone());
                naive.replace(worker, snap);
                next_id.insert(worker.clone(), last + 1);
            }
            1 => {
                real.remove_worker(worker);
                naive.remove_worker(worker);
            }
            _ => {
                let start = next_id.get(worker).copied().unwrap_or(1);
                // Mostly in order; sometimes a replay (start - 1) or a gap (start + 2).
                let mut id = match rng.random_range(0..20) {
                    0 => start.saturating_sub(1).max(1),
                    1 => start + 2,
                    _ => start,
                };
                let mut batch = Vec::new();
                for _ in 0..rng.random_range(1..4) {
                    let blocks: Vec<u64> = (0..rng.random_range(1..5))
                        .map(|_| rng.random_range(0..universe))
                        .collect();
                    batch.push(if rng.random_bool(0.6) {
                        stored(id, &blocks)
                    } else {
                        removed(id, &blocks)
                    });
                    id += 1;
                }
                let got = real.apply(worker, &batch);
                let want = naive.apply(worker, &batch);
                assert_eq!(got, want, "seed {seed} step {step}: apply");
                if got.is_ok() {
                    next_id.insert(worker.clone(), id);
                }
            }
        }
        for _ in 0..4 {
            let query: Vec<u64> = (0..rng.random_range(0..8))
                .map(|_| rng.random_range(0..universe))
                .collect();
            let query = hs(&query);
            assert_eq!(
                real.overlaps(&query),
                naive.overlaps(&query),
                "seed {seed} step {step}: overlaps of {query:?}"
            );
            for x in &workers {
                assert_eq!(
                    real.matched_blocks(x, &query),
                    naive.matched_blocks(x, &query),
                    "seed {seed} step {step}: matched_blocks({x}, {query:?})"
                );
                assert_eq!(real.last_event(x), naive.last_event(x));
                assert_eq!(real.worker_blocks(x), naive.worker_blocks(x));
            }
        }
    }
}

#[test]
fn flat_index_agrees_with_naive_model_on_random_operations() {
    for seed in 0..16 {
        random_run(seed);
    }
}
