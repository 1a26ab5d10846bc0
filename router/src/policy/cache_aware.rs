//! `cache_aware`: Dynamo-style cost in blocks.
//!
//! ```text
//! prefill P = argmin  queued_prefill_blocks(P) + (prompt_blocks − overlap(P))
//!             ties: fewest active requests, then id
//! decode  D = the decode worker holding more of the prefix than P, if any (its own cache
//!             covers that part; the most overlap wins, then fewest active blocks),
//!             else argmin active_blocks(D), ties: fewest active requests, then id
//! no P:   D = argmin active_blocks(D) + queued_prefill_blocks(D) + (prompt_blocks − overlap(D))
//! ```
//! `queued_prefill_blocks` and `active_blocks` are the last heartbeat plus the router's
//! predictive load (`load.rs`), so a burst of identical uncached requests spreads out instead
//! of herding onto the worker that looked idle at the last heartbeat.
use std::cmp::Ordering;

use super::{Candidate, Decision, SelectInput, SelectPolicy};

/// The cache-aware policy (stateless: all state is in the input).
#[derive(Debug, Clone, Copy, Default)]
pub struct CacheAware;

fn by_cost(a: (u64, &Candidate), b: (u64, &Candidate)) -> Ordering {
    a.0.cmp(&b.0)
        .then_with(|| a.1.active_requests().cmp(&b.1.active_requests()))
        .then_with(|| a.1.id.cmp(&b.1.id))
}

/// The decode worker to pair with prefill worker `p`: the one holding more of the prefix than
/// `p` (the most overlap wins, then fewest active blocks), else the fewest active blocks; ties:
/// fewest active requests, then id. Shared with [`super::mooncake`].
pub(super) fn decode_beside<'a>(p: &Candidate, input: &SelectInput<'a>) -> Option<&'a Candidate> {
    let on_p = input.overlaps.get(&p.id);
    let decode: &'a [Candidate] = input.decode;
    let holder = decode
        .iter()
        .filter(|d| input.overlaps.get(&d.id) > on_p)
        .min_by(|a, b| {
            input
                .overlaps
                .get(&b.id)
                .cmp(&input.overlaps.get(&a.id))
                .then_with(|| by_cost((a.active_blocks(), a), (b.active_blocks(), b)))
        });
    holder.or_else(|| {
        decode
            .iter()
            .map(|d| (d.active_blocks(), d))
            .min_by(|a, b| by_cost(*a, *b))
            .map(|(_, d)| d)
    })
}

impl SelectPolicy for CacheAware {
    fn select(&self, input: &SelectInput<'_>) -> Option<Decision> {
        let page = input.page_size;
        let prefill = input
            .prefill
            .iter()
            .map(|p| {
                (
                    p.queued_prefill_blocks(page) + input.uncached_blocks(&p.id),
                    p,
                )
            })
            .min_by(|a, b| by_cost(*a, *b))
            .map(|(_, p)| p);

        let decode = match prefill {
            Some(p) => decode_beside(p, input),
            None => input
                .decode
                .iter()
                .map(|d| {
                    let cost = d.active_blocks()
                        + d.queued_prefill_blocks(page)
                        + input.uncached_blocks(&d.id);
                    (cost, d)
                })
                .min_by(|a, b| by_cost(*a, *b))
                .map(|(_, d)| d),
        }?;
        Some(Decision::new(prefill, decode, input))
    }
}

#[cfg(test)]
mod tests {
    use ferry_proto::ids::WorkerId;

    use super::super::testing::{candidate, Cluster};
    use super::*;
    use crate::index::Overlaps;

    fn id(s: &str) -> WorkerId {
        WorkerId::from(s)
    }

    fn cluster(overlaps: &[(&str, usize)]) -> Cluster {
        Cluster {
            prefill: vec![candidate("p0", 0, 0, 0), candidate("p1", 0, 0, 0)],
            decode: vec![candidate("d0", 0, 0, 0), candidate("d1", 0, 0, 0)],
            overlaps: Overlaps::from_pairs(overlaps.iter().map(|(w, n)| (id(w), *n))),
            page_size: 64,
        }
    }

    #[test]
    fn the_worker_holding_the_long_prefix_wins() {
        let mut c = cluster(&[("p0", 1), ("p1", 10)]);
        // p1 even has some queued work: 3 queued + 2 uncached < 0 queued + 11 uncached.
        c.prefill[1].load.queued_prefill_tokens = 3 * 64;
        let d = CacheAware.select(&c.input(12 * 64)).expect("pair");
        assert_eq!(d.prefill, Some(id("p1")));
        assert_eq!(d.predicted_cached_blocks, 10);
    }

    #[test]
    fn a_long_queue_outweighs_a_short_prefix() {
        let mut c = cluster(&[("p0", 4)]);
        c.prefill[0].pending.prefill_blocks = 100;
        let d = CacheAware.select(&c.input(10 * 64)).expect("pair");
        assert_eq!(d.prefill, Some(id("p1")));
    }

    #[test]
    fn load_breaks_ties() {
        let mut c = cluster(&[("p0", 5), ("p1", 5)]);
        c.prefill[0].load.running_requests = 3;
        c.decode[0].load.kv_blocks_used = 50;
        let d = CacheAware.select(&c.input(8 * 64)).expect("pair");
        assert_eq!(d.prefill, Some(id("p1")), "same cost, fewer requests");
        assert_eq!(d.decode, id("d1"), "fewer active blocks");

        let c = cluster(&[]);
        let d = CacheAware.select(&c.input(64)).expect("pair");
        assert_eq!((d.prefill, d.decode), (Some(id("p0")), id("d0")), "then id");
    }

    #[test]
    fn predictive_bookkeeping_spreads_a_burst_of_identical_uncached_requests() {
        let mut c = cluster(&[]);
        let mut count = std::collections::HashMap::<WorkerId, usize>::new();
        for _ in 0..6 {
            let d = CacheAware.select(&c.input(10 * 64)).expect("pair");
            c.charge(&d, 10 * 64);
            *count
                .entry(d.prefill.clone().expect("prefill"))
                .or_default() += 1;
            *count.entry(d.decode.clone()).or_default() += 1;
        }
        for w in ["p0", "p1", "d0", "d1"] {
            assert_eq!(count.get(&id(w)), Some(&3), "{w}: {count:?}");
        }
    }

    #[test]
    fn a_decode_worker_holding_more_than_the_prefill_worker_is_preferred() {
        let mut c = cluster(&[("p0", 2), ("d1", 8)]);
        c.decode[1].load.kv_blocks_used = 40;
        let d = CacheAware.select(&c.input(10 * 64)).expect("pair");
        assert_eq!(d.prefill, Some(id("p0")));
        assert_eq!(d.decode, id("d1"));
        assert_eq!(d.predicted_cached_blocks, 8);

        // Holding no more than P: pure load.
        let mut c = cluster(&[("p0", 8), ("d1", 8)]);
        c.decode[1].load.kv_blocks_used = 40;
        let d = CacheAware.select(&c.input(10 * 64)).expect("pair");
        assert_eq!(d.decode, id("d0"));
    }

    #[test]
    fn without_prefill_workers_the_decode_cache_and_load_decide() {
        let mut c = cluster(&[("d1", 6)]);
        c.prefill.clear();
        let d = CacheAware.select(&c.input(10 * 64)).expect("pair");
        assert_eq!((d.prefill, d.decode.clone()), (None, id("d1")));
        c.decode[1].load.kv_blocks_used = 20;
        let d = CacheAware.select(&c.input(10 * 64)).expect("pair");
        assert_eq!(d.decode, id("d0"), "20 active + 4 uncached > 0 + 10");
    }
}
