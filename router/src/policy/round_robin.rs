//! `round_robin`: the n-th request goes to the n-th worker of each role (modulo their counts),
//! ignoring load and cache. The baseline the other policies are measured against.
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Decision, SelectInput, SelectPolicy};

/// The round-robin policy: one counter.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl SelectPolicy for RoundRobin {
    fn select(&self, input: &SelectInput<'_>) -> Option<Decision> {
        if input.decode.is_empty() {
            return None;
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let decode = input.decode.get(n % input.decode.len())?;
        let prefill = match input.prefill.len() {
            0 => None,
            len => input.prefill.get(n % len),
        };
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
    fn rotates_through_each_role() {
        let c = Cluster {
            prefill: vec![candidate("p0", 0, 0, 0), candidate("p1", 0, 0, 0)],
            decode: vec![
                candidate("d0", 0, 0, 0),
                candidate("d1", 0, 0, 0),
                candidate("d2", 0, 0, 0),
            ],
            overlaps: Overlaps::default(),
            page_size: 64,
        };
        let rr = RoundRobin::default();
        let picks: Vec<(Option<WorkerId>, WorkerId)> = (0..4)
            .map(|_| rr.select(&c.input(10)).expect("pair"))
            .map(|d| (d.prefill, d.decode))
            .collect();
        let w = |s: &str| WorkerId::from(s);
        assert_eq!(
            picks,
            vec![
                (Some(w("p0")), w("d0")),
                (Some(w("p1")), w("d1")),
                (Some(w("p0")), w("d2")),
                (Some(w("p1")), w("d0")),
            ]
        );
    }
}
