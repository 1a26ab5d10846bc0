//! `least_loaded`: ignores the cache. P = fewest queued prefill blocks (ties: fewest active
//! requests, then id); D = fewest active requests (ties: fewest active blocks, then id). Both
//! include the router's predictive load, so bursts spread.
use super::{Candidate, Decision, SelectInput, SelectPolicy};

/// The least-loaded policy (stateless).
#[derive(Debug, Clone, Copy, Default)]
pub struct LeastLoaded;

impl SelectPolicy for LeastLoaded {
    fn select(&self, input: &SelectInput<'_>) -> Option<Decision> {
        let page = input.page_size;
        let prefill = input.prefill.iter().min_by(|a, b| {
            let key = |c: &Candidate| (c.queued_prefill_blocks(page), c.active_requests());
            key(a).cmp(&key(b)).then_with(|| a.id.cmp(&b.id))
        });
        let decode = input.decode.iter().min_by(|a, b| {
            let key = |c: &Candidate| (c.active_requests(), c.active_blocks());
            key(a).cmp(&key(b)).then_with(|| a.id.cmp(&b.id))
        })?;
        Some(Decision::new(prefill, decode, input))
    }
}

#[cfg(test)]
mod tests {
    use ferry_proto::ids::WorkerId;

    use super::super::testing::{candidate, Cluster};
    use super::*;
    use crate::index::Overlaps;

    #[test]
    fn ignores_the_cache_and_follows_load() {
        let mut c = Cluster {
            prefill: vec![candidate("p0", 640, 0, 0), candidate("p1", 0, 0, 0)],
            decode: vec![candidate("d0", 0, 0, 2), candidate("d1", 0, 0, 1)],
            overlaps: Overlaps::from_pairs([(WorkerId::from("p0"), 10)]),
            page_size: 64,
        };
        let d = LeastLoaded.select(&c.input(640)).expect("pair");
        assert_eq!(
            d.prefill,
            Some(WorkerId::from("p1")),
            "p0 holds the prefix but is queued"
        );
        assert_eq!(d.decode, WorkerId::from("d1"));
        c.charge(&d, 640);
        let d = LeastLoaded.select(&c.input(640)).expect("pair");
        assert_eq!(
            d.decode,
            WorkerId::from("d0"),
            "ties on requests, then blocks"
        );
    }
}
