//! The KV block manager's contract, through its public API: prefix reuse, LRU eviction, events,
//! snapshots, all-or-nothing reservation, and a seeded randomized invariant run.

use std::collections::{BTreeSet, HashMap};

use ferry_model::kv::{
    block_hashes, BlockHash, BlockId, BlockTable, EventId, KvEvent, KvEventData, KvLayout,
    KvManager, KvPool,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const PAGE: usize = 4;

fn manager(blocks: usize) -> KvManager {
    KvManager::new(
        KvPool::new(KvLayout {
            num_layers: 2,
            num_blocks: blocks,
            page_size: PAGE,
            width: 3,
        })
        .expect("valid layout"),
    )
}

/// A prompt whose tokens start at `base`: distinct bases give distinct first blocks.
fn prompt(base: u32, len: usize) -> Vec<u32> {
    (base..).take(len).collect()
}

/// Starts `tokens` reusing up to `len - 1`, computes the rest, caches its full blocks.
fn run(m: &mut KvManager, tokens: &[u32]) -> anyhow::Result<(BlockTable, usize)> {
    let (mut t, reused) = m.start_sequence(tokens, tokens.len().saturating_sub(1))?;
    let rest = tokens.len() - reused;
    m.reserve(&mut t, rest)?;
    t.advance(rest, m.page_size())?;
    m.cache_full_blocks(&t, tokens)?;
    Ok((t, reused))
}

fn stored(hashes: &[BlockHash], parent: Option<BlockHash>) -> KvEventData {
    KvEventData::Stored {
        hashes: hashes.to_vec(),
        parent,
    }
}

fn removed(hashes: &[BlockHash]) -> KvEventData {
    KvEventData::Removed {
        hashes: hashes.to_vec(),
    }
}

#[test]
fn hit_and_miss() -> anyhow::Result<()> {
    let mut m = manager(16);
    let p = prompt(0, 10);
    let (mut a, reused) = run(&mut m, &p)?;
    assert_eq!(reused, 0, "cold cache: miss");
    m.free(&mut a)?;

    let (mut b, reused) = m.start_sequence(&p, p.len() - 1)?;
    assert_eq!(reused, 8, "two full blocks hit");
    assert_eq!(b.len(), 8);
    assert_eq!(b.blocks().len(), 2);
    assert_eq!(m.blocks_in_use(), 2);
    assert_eq!(m.blocks_cached_only(), 0, "reused blocks are not evictable");

    // Same first block, different second block: one block hits.
    let mut q = p.clone();
    q[5] = 999;
    let (mut c, reused) = m.start_sequence(&q, q.len() - 1)?;
    assert_eq!(reused, 4);
    assert_eq!(c.blocks()[0], b.blocks()[0]);
    assert_eq!(m.cached_prefix_tokens(&q, q.len() - 1), 4);

    // Different first block: nothing hits, even though block 1 is the same.
    let mut r = p.clone();
    r[0] = 999;
    let (mut d, reused) = m.start_sequence(&r, r.len() - 1)?;
    assert_eq!(reused, 0);
    assert!(d.blocks().is_empty());

    for t in [&mut b, &mut c, &mut d] {
        m.free(t)?;
    }
    assert_eq!(m.blocks_in_use(), 0);
    Ok(())
}

#[test]
fn reuse_is_capped_by_max_reuse_tokens() -> anyhow::Result<()> {
    let mut m = manager(16);
    let p = prompt(0, 12);
    let (mut a, _) = run(&mut m, &p)?;
    assert_eq!(m.cache().len(), 3, "all three blocks are full");
    m.free(&mut a)?;

    for (max, want) in [(11, 8), (8, 8), (7, 4), (4, 4), (3, 0), (0, 0), (100, 12)] {
        let (mut t, reused) = m.start_sequence(&p, max)?;
        assert_eq!(reused, want, "max_reuse_tokens {max}");
        assert_eq!(t.len(), want);
        m.free(&mut t)?;
    }
    // A prompt of exactly two blocks, called the usual way, still computes its last token.
    let (mut t, reused) = m.start_sequence(&p[..8], 7)?;
    assert_eq!(reused, 4);
    m.free(&mut t)?;
    assert_eq!(m.blocks_in_use(), 0);
    Ok(())
}

#[test]
fn eviction_takes_least_recently_used_first() -> anyhow::Result<()> {
    let mut m = manager(6);
    let (p1, p2, p3) = (prompt(100, 4), prompt(200, 4), prompt(300, 4));
    let h = |p: &[u32]| block_hashes(p, PAGE)[0];
    for p in [&p1, &p2, &p3] {
        let (mut t, _) = run(&mut m, p)?;
        m.free(&mut t)?;
    }
    // Touch p1: it becomes the most recently used.
    let (mut t, reused) = m.start_sequence(&p1, 4)?;
    assert_eq!(reused, 4);
    m.free(&mut t)?;
    m.drain_events();

    assert_eq!(m.blocks_free(), 3);
    assert_eq!(m.blocks_cached_only(), 3);
    let mut big = BlockTable::new();
    m.reserve(&mut big, 5 * PAGE)?; // needs 5: 3 free + 2 evicted
    let ev = m.drain_events();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].data, removed(&[h(&p2), h(&p3)]));
    assert_eq!(m.cached_prefix_tokens(&p1, 4), 4, "p1 survived");
    assert_eq!(m.cached_prefix_tokens(&p2, 4), 0);
    m.free(&mut big)?;

    // Within one sequence, the tail goes before the head.
    let mut m = manager(4);
    let p = prompt(0, 12);
    let (mut t, _) = run(&mut m, &p)?;
    m.free(&mut t)?;
    m.drain_events();
    let mut one = BlockTable::new();
    m.reserve(&mut one, 2 * PAGE)?; // 1 free + 1 evicted
    let hs = block_hashes(&p, PAGE);
    assert_eq!(m.drain_events()[0].data, removed(&hs[2..3]));
    assert_eq!(m.cached_prefix_tokens(&p, 11), 8);
    m.free(&mut one)?;
    Ok(())
}

#[test]
fn blocks_of_live_sequences_are_never_evicted() -> anyhow::Result<()> {
    let mut m = manager(4);
    let p = prompt(0, 8);
    let (mut live, _) = run(&mut m, &p)?;
    let (mut done, _) = run(&mut m, &prompt(50, 8))?;
    m.free(&mut done)?;
    assert_eq!(m.blocks_free(), 0);
    assert_eq!(m.blocks_cached_only(), 2);
    assert_eq!(m.blocks_in_use(), 2);

    let mut t = BlockTable::new();
    let err = m
        .reserve(&mut t, 3 * PAGE)
        .expect_err("only 2 blocks can be had");
    assert!(err.to_string().contains("out of KV blocks"), "{err}");
    m.reserve(&mut t, 2 * PAGE)?;
    assert_eq!(
        m.cached_prefix_tokens(&p, 8),
        8,
        "the live sequence's blocks stay cached"
    );
    m.free(&mut t)?;

    m.clear_cache();
    assert_eq!(m.cache().len(), 2, "clear_cache leaves live blocks cached");
    m.free(&mut live)?;
    m.clear_cache();
    assert!(m.cache().is_empty());
    assert_eq!(m.blocks_free(), 4);
    assert_eq!(m.blocks_in_use(), 0);
    Ok(())
}

#[test]
fn events_are_numbered_and_describe_the_cache() -> anyhow::Result<()> {
    let mut m = manager(16);
    assert_eq!(m.snapshot(), (vec![], EventId(0)));
    let p = prompt(0, 9);
    let hs = block_hashes(&p, PAGE);
    let (mut a, _) = run(&mut m, &p)?;
    // Extend the same sequence past a page boundary: only the new block is stored, with parent.
    let ext: Vec<u32> = p.iter().copied().chain([50, 51, 52]).collect();
    m.reserve(&mut a, 3)?;
    a.advance(3, PAGE)?;
    m.cache_full_blocks(&a, &ext)?;
    let hx = block_hashes(&ext, PAGE);
    assert_eq!(hx[..2], hs[..]);
    m.cache_full_blocks(&a, &ext)?; // nothing new: no event
    m.free(&mut a)?;
    m.clear_cache();

    let ev = m.drain_events();
    let ids: Vec<EventId> = ev.iter().map(|e| e.id).collect();
    assert_eq!(ids, vec![EventId(1), EventId(2), EventId(3)]);
    assert_eq!(ev[0].data, stored(&hs, None));
    assert_eq!(ev[1].data, stored(&hx[2..], Some(hx[1])));
    assert_eq!(ev[2].data, removed(&[hx[2], hx[1], hx[0]]));
    assert!(m.drain_events().is_empty());

    let (mut b, _) = run(&mut m, &p)?;
    let ev = m.drain_events();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].id, EventId(4), "ids continue across drains");
    m.free(&mut b)?;
    Ok(())
}

#[test]
fn snapshot_after_evictions() -> anyhow::Result<()> {
    let mut m = manager(5);
    let (p1, p2) = (prompt(0, 8), prompt(100, 12));
    for p in [&p1, &p2] {
        let (mut t, _) = run(&mut m, p)?;
        m.free(&mut t)?;
    }
    let mut t = BlockTable::new();
    m.reserve(&mut t, 3 * PAGE)?; // 0 free: evicts p1's tail, then head, then p2's tail
    let (hashes, last) = m.snapshot();
    let h2 = block_hashes(&p2, PAGE);
    assert_eq!(hashes, h2[..2].to_vec());
    assert_eq!(last, EventId(3));
    assert_eq!(m.drain_events().last().map(|e| e.id), Some(last));
    m.free(&mut t)?;
    Ok(())
}

#[test]
fn out_of_blocks_changes_nothing() -> anyhow::Result<()> {
    let mut m = manager(6);
    let (mut live, _) = run(&mut m, &prompt(0, 9))?; // 3 blocks, 2 cached
    let (mut done, _) = run(&mut m, &prompt(100, 8))?;
    m.free(&mut done)?; // 2 evictable
    let mut t = BlockTable::new();
    m.reserve(&mut t, 2)?;
    t.advance(2, PAGE)?;
    let before = (
        m.blocks_free(),
        m.blocks_cached_only(),
        m.blocks_in_use(),
        m.snapshot(),
        m.pending_events().to_vec(),
        t.clone(),
        live.clone(),
    );
    // 0 free + 2 evictable, and t needs 4 more blocks, live 5.
    assert!(m.reserve(&mut t, 4 * PAGE).is_err());
    assert!(m.reserve(&mut live, 5 * PAGE).is_err());
    let after = (
        m.blocks_free(),
        m.blocks_cached_only(),
        m.blocks_in_use(),
        m.snapshot(),
        m.pending_events().to_vec(),
        t.clone(),
        live.clone(),
    );
    assert_eq!(before, after);
    m.free(&mut t)?;
    m.free(&mut live)?;
    assert_eq!(m.blocks_in_use(), 0);
    Ok(())
}

/// One live sequence of the randomized run.
struct Seq {
    table: BlockTable,
    /// Tokens whose KV is in the table.
    tokens: Vec<u32>,
    /// Prompt tokens not computed yet.
    pending: Vec<u32>,
}

/// Checks every invariant that ties the pool, the cache and the live tables together.
fn check(m: &KvManager, seqs: &[Option<Seq>], op: usize) {
    let total = m.blocks_total();
    let mut table_refs = vec![0u32; total];
    for s in seqs.iter().flatten() {
        for b in s.table.blocks() {
            table_refs[b.0 as usize] += 1;
        }
        // A cached block in a table holds exactly the KV of the tokens that hash to it.
        let hashes = block_hashes(&s.tokens, PAGE);
        for (h, b) in hashes.iter().zip(s.table.blocks()) {
            if let Some(cached) = m.cache().hash_of(*b) {
                assert_eq!(cached, *h, "op {op}: {b} cached under a foreign hash");
            }
        }
        assert_eq!(s.tokens.len(), s.table.len(), "op {op}");
    }
    let (mut free, mut evictable, mut in_use) = (0, 0, 0);
    for (i, &refs) in table_refs.iter().enumerate() {
        let b = BlockId(i as u32);
        let cached = m.cache().hash_of(b).is_some();
        let rc = m.pool().refcount(b).expect("block in range");
        assert_eq!(rc, refs + u32::from(cached), "op {op}: refcount of {b}");
        assert_eq!(
            m.cache().is_evictable(b),
            cached && refs == 0,
            "op {op}: evictability of {b}"
        );
        match (rc, refs) {
            (0, _) => free += 1,
            (_, 0) => evictable += 1,
            _ => in_use += 1,
        }
    }
    assert_eq!(m.blocks_free(), free, "op {op}");
    assert_eq!(m.blocks_cached_only(), evictable, "op {op}");
    assert_eq!(m.blocks_in_use(), in_use, "op {op}");
    assert_eq!(
        m.blocks_free() + m.blocks_cached_only() + m.blocks_in_use(),
        total
    );
}

/// Applies events to a router-side view, checking ids are consecutive from `next_id`.
fn apply(view: &mut BTreeSet<BlockHash>, next_id: &mut u64, events: Vec<KvEvent>) {
    for e in events {
        assert_eq!(e.id, EventId(*next_id), "event ids have no gaps");
        *next_id += 1;
        match e.data {
            KvEventData::Stored { hashes, parent } => {
                assert!(!hashes.is_empty());
                if let Some(p) = parent {
                    assert!(view.contains(&p), "a Stored parent is cached");
                }
                for h in hashes {
                    assert!(view.insert(h), "stored twice: {h}");
                }
            }
            KvEventData::Removed { hashes } => {
                assert!(!hashes.is_empty());
                for h in hashes {
                    assert!(view.remove(&h), "removed without being stored: {h}");
                }
            }
        }
    }
}

fn randomized_run(seed: u64, ops: usize) -> anyhow::Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut m = manager(24);
    // A few shared bases so prompts often share prefixes.
    let bases: Vec<Vec<u32>> = (0..4).map(|i| prompt(1000 * i, 40)).collect();
    let mut seqs: Vec<Option<Seq>> = (0..6).map(|_| None).collect();
    let mut view = BTreeSet::new();
    let mut next_id = 1u64;
    let mut counts: HashMap<&str, usize> = HashMap::new();

    for op in 0..ops {
        let slot = rng.random_range(0..seqs.len());
        let kind = rng.random_range(0..100);
        let name = match (&mut seqs[slot], kind) {
            (None, _) => {
                let base = &bases[rng.random_range(0..bases.len())];
                let len = rng.random_range(1..=base.len());
                let mut p = base[..len].to_vec();
                if rng.random_bool(0.3) {
                    let i = rng.random_range(0..len);
                    p[i] = rng.random_range(0..50);
                }
                let max_reuse = if rng.random_bool(0.8) {
                    len - 1
                } else {
                    rng.random_range(0..=len)
                };
                let (table, reused) = m.start_sequence(&p, max_reuse)?;
                assert!(reused <= max_reuse && reused % PAGE == 0);
                if reused > 0 {
                    *counts.entry("hit").or_default() += 1;
                }
                let pending = p.split_off(reused);
                seqs[slot] = Some(Seq {
                    table,
                    tokens: p,
                    pending,
                });
                "start"
            }
            (Some(s), 0..=44) => {
                let n = if s.pending.is_empty() {
                    rng.random_range(1..=6)
                } else {
                    rng.random_range(1..=s.pending.len())
                };
                match m.reserve(&mut s.table, n) {
                    Ok(()) => {
                        s.table.advance(n, PAGE)?;
                        if s.pending.is_empty() {
                            s.tokens.extend((0..n).map(|_| rng.random_range(0..50u32)));
                        } else {
                            s.tokens.extend(s.pending.drain(..n));
                        }
                        "compute"
                    }
                    Err(_) => "out_of_blocks",
                }
            }
            (Some(s), 45..=69) => {
                m.cache_full_blocks(&s.table, &s.tokens)?;
                "cache"
            }
            (Some(s), 70..=76) => {
                let len = rng.random_range(0..=s.table.len());
                match m.truncate(&mut s.table, len) {
                    Ok(()) => {
                        s.tokens.truncate(len);
                        s.pending.clear();
                        "truncate"
                    }
                    Err(_) => "truncate_refused",
                }
            }
            (Some(_), 77..=78) => {
                m.clear_cache();
                "clear"
            }
            (Some(s), _) => {
                m.free(&mut s.table)?;
                seqs[slot] = None;
                "free"
            }
        };
        *counts.entry(name).or_default() += 1;
        check(&m, &seqs, op);
        if m.pending_events()
            .iter()
            .any(|e| matches!(e.data, KvEventData::Removed { .. }))
        {
            *counts.entry("evicted").or_default() += 1;
        }
        if rng.random_bool(0.2) {
            apply(&mut view, &mut next_id, m.drain_events());
        }
    }

    for s in seqs.iter_mut().flatten() {
        m.free(&mut s.table)?;
    }
    seqs.iter_mut().for_each(|s| *s = None);
    check(&m, &seqs, ops);
    assert_eq!(m.blocks_in_use(), 0, "seed {seed}");

    // The router's view, rebuilt from events, is exactly the worker's cache.
    apply(&mut view, &mut next_id, m.drain_events());
    let (snap, last) = m.snapshot();
    assert_eq!(last, EventId(next_id - 1));
    assert_eq!(snap.iter().copied().collect::<BTreeSet<_>>(), view);
    assert_eq!(snap.len(), view.len(), "no duplicate hashes in a snapshot");

    m.clear_cache();
    apply(&mut view, &mut next_id, m.drain_events());
    assert!(view.is_empty());
    assert_eq!(m.blocks_free(), m.blocks_total());

    // Every kind of operation actually happened.
    for name in [
        "start",
        "hit",
        "compute",
        "out_of_blocks",
        "evicted",
        "cache",
        "truncate",
        "truncate_refused",
        "free",
    ] {
        assert!(
            counts.get(name).copied().unwrap_or(0) > 0,
            "seed {seed}: no {name}"
        );
    }
    Ok(())
}

#[test]
fn randomized_invariants_hold() -> anyhow::Result<()> {
    for seed in [1, 2, 3, 42, 0xfe77] {
        randomized_run(seed, 3000)?;
    }
    Ok(())
}

#[test]
fn an_ids_only_pool_backs_the_same_prefix_cache_and_refuses_rows() -> anyhow::Result<()> {
    // A GPU engine's pool: block ids, refcounts, prefix cache and events, no rows.
    let layout = KvLayout {
        num_layers: 2,
        num_blocks: 4,
        page_size: PAGE,
        width: 3,
    };
    let mut m = KvManager::new(KvPool::without_rows(layout)?);
    assert!(!m.pool().has_rows());
    let p = prompt(0, 10);
    let (mut a, reused) = run(&mut m, &p)?;
    assert_eq!(reused, 0);
    let events = m.drain_events();
    assert_eq!(events.len(), 1, "the two full blocks are announced");
    m.free(&mut a)?;
    assert_eq!(m.blocks_cached_only(), 2);
    let (mut b, reused) = m.start_sequence(&p, p.len() - 1)?;
    assert_eq!(reused, 8, "two cached blocks reused");
    assert_eq!(m.pool().refcount(b.blocks()[0]), Some(2));
    // Filling the pool evicts the LRU cached block, as with rows.
    m.free(&mut b)?;
    let (mut c, _) = run(&mut m, &prompt(100, 13))?;
    assert!(m
        .drain_events()
        .iter()
        .any(|e| matches!(e.data, KvEventData::Removed { .. })));
    let e = m.pool().block(0, c.blocks()[0]).unwrap_err().to_string();
    assert!(e.contains("rows live in the device cache"), "{e}");
    assert!(m.pool_mut().layer_mut(1).is_err());
    m.free(&mut c)?;
    assert_eq!(m.blocks_in_use(), 0);
    Ok(())
}
