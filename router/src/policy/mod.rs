//! Routing policies: pick the (prefill, decode) pair for one request.
//!
//! | file | policy |
//! |---|---|
//! | [`round_robin`] | rotate through each role's workers |
//! | [`least_loaded`] | fewest queued prefill blocks on P, fewest active requests on D |
//! | [`cache_aware`] | cost in blocks: queued + uncached prefill work on P, active blocks on D |
//! | [`mooncake`] | Mooncake's Conductor: least estimated TTFT on P (queued + uncached prefill through a cost model), D as `cache_aware` |
//!
//! A policy is pure: it sees a copy of the healthy workers (heartbeat load plus the router's
//! predictive load) and each worker's prefix overlap with the prompt, and returns a
//! [`Decision`]. It never touches the network, the registry or the clock. The closed enum
//! [`Policy`] is chosen by [`PolicyKind`].
pub mod cache_aware;
pub mod least_loaded;
pub mod mooncake;
pub mod round_robin;

use ferry_proto::ids::WorkerId;

use crate::config::PolicyKind;
use crate::index::Overlaps;
use crate::load::PendingSnapshot;
use crate::registry::WorkerLoad;

pub use cache_aware::CacheAware;
pub use least_loaded::LeastLoaded;
pub use mooncake::{Mooncake, PrefillCostModel};
pub use round_robin::RoundRobin;

/// One candidate worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The worker.
    pub id: WorkerId,
    /// Its last heartbeat.
    pub load: WorkerLoad,
    /// The router's predictive load on top of it.
    pub pending: PendingSnapshot,
}

impl Candidate {
    /// Queued prefill work in blocks: the heartbeat's queued tokens plus what the router has
    /// dispatched since.
    pub fn queued_prefill_blocks(&self, page_size: usize) -> u64 {
        self.load
            .queued_prefill_tokens
            .div_ceil(page_size.max(1) as u64)
            + self.pending.prefill_blocks
    }

    /// KV blocks in use: the heartbeat's plus the router's predicted ones.
    pub fn active_blocks(&self) -> u64 {
        u64::from(self.load.kv_blocks_used) + self.pending.active_blocks
    }

    /// Requests running or waiting, plus those dispatched since the heartbeat.
    pub fn active_requests(&self) -> u64 {
        u64::from(self.load.running_requests)
            + u64::from(self.load.waiting_requests)
            + self.pending.requests
    }
}

/// Everything a policy may look at for one request.
#[derive(Debug, Clone, Copy)]
pub struct SelectInput<'a> {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// Healthy prefill workers, sorted by id.
    pub prefill: &'a [Candidate],
    /// Healthy decode workers (minus any excluded for a retry), sorted by id.
    pub decode: &'a [Candidate],
    /// Leading prompt blocks each worker holds.
    pub overlaps: &'a Overlaps,
}

impl SelectInput<'_> {
    /// Prompt blocks, counting a partial last block.
    pub fn prompt_blocks(&self) -> u64 {
        (self.prompt_tokens as u64).div_ceil(self.page_size.max(1) as u64)
    }

    /// Prompt blocks `worker` would have to compute.
    pub fn uncached_blocks(&self, worker: &WorkerId) -> u64 {
        self.prompt_blocks()
            .saturating_sub(self.overlaps.get(worker) as u64)
    }
}

/// Where one request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The prefill worker, or `None` for a local prefill on the decode worker.
    pub prefill: Option<WorkerId>,
    /// The decode worker.
    pub decode: WorkerId,
    /// Prompt blocks expected to be cached on the chosen pair (the larger overlap).
    pub predicted_cached_blocks: usize,
    /// The policy's estimate of the time to first token on the chosen worker, in ms (only
    /// policies with a cost model make one: `mooncake`).
    pub estimated_ttft_ms: Option<u64>,
}

impl Decision {
    fn new(prefill: Option<&Candidate>, decode: &Candidate, input: &SelectInput<'_>) -> Self {
        let on_p = prefill.map_or(0, |p| input.overlaps.get(&p.id));
        Self {
            prefill: prefill.map(|p| p.id.clone()),
            decode: decode.id.clone(),
            predicted_cached_blocks: on_p.max(input.overlaps.get(&decode.id)),
            estimated_ttft_ms: None,
        }
    }

    /// The same decision carrying a TTFT estimate of `seconds`.
    pub fn with_ttft_estimate(self, seconds: f64) -> Self {
        Self {
            estimated_ttft_ms: Some((seconds * 1e3).ceil() as u64),
            ..self
        }
    }
}

/// The one method a policy implements.
pub trait SelectPolicy {
    /// The pair for this request; `None` only when there is no decode candidate.
    fn select(&self, input: &SelectInput<'_>) -> Option<Decision>;
}

/// The configured policy.
#[derive(Debug)]
pub enum Policy {
    /// See [`RoundRobin`].
    RoundRobin(RoundRobin),
    /// See [`LeastLoaded`].
    LeastLoaded(LeastLoaded),
    /// See [`CacheAware`].
    CacheAware(CacheAware),
    /// See [`Mooncake`].
    Mooncake(Mooncake),
}

impl Policy {
    /// The policy named by `kind`, in its initial state.
    pub fn new(kind: PolicyKind) -> Self {
        match kind {
            PolicyKind::RoundRobin => Self::RoundRobin(RoundRobin::default()),
            PolicyKind::LeastLoaded => Self::LeastLoaded(LeastLoaded),
            PolicyKind::CacheAware => Self::CacheAware(CacheAware),
            PolicyKind::Mooncake => Self::Mooncake(Mooncake::default()),
        }
    }

    /// Which policy this is.
    pub fn kind(&self) -> PolicyKind {
        match self {
            Self::RoundRobin(_) => PolicyKind::RoundRobin,
            Self::LeastLoaded(_) => PolicyKind::LeastLoaded,
            Self::CacheAware(_) => PolicyKind::CacheAware,
            Self::Mooncake(_) => PolicyKind::Mooncake,
        }
    }
}

impl SelectPolicy for Policy {
    fn select(&self, input: &SelectInput<'_>) -> Option<Decision> {
        match self {
            Self::RoundRobin(p) => p.select(input),
            Self::LeastLoaded(p) => p.select(input),
            Self::CacheAware(p) => p.select(input),
            Self::Mooncake(p) => p.select(input),
        }
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! Synthetic worker states for policy tests.
    use super::*;

    /// A candidate with the given heartbeat numbers and no pending load.
    pub fn candidate(id: &str, queued_tokens: u64, used_blocks: u32, requests: u32) -> Candidate {
        Candidate {
            id: WorkerId::from(id),
            load: WorkerLoad {
                running_requests: requests,
                waiting_requests: 0,
                kv_blocks_used: used_blocks,
                kv_blocks_total: 1000,
                queued_prefill_tokens: queued_tokens,
            },
            pending: PendingSnapshot::default(),
        }
    }

    /// A synthetic cluster: candidates of both roles plus the prompt's overlaps.
    #[derive(Debug, Clone)]
    pub struct Cluster {
        pub prefill: Vec<Candidate>,
        pub decode: Vec<Candidate>,
        pub overlaps: Overlaps,
        pub page_size: usize,
    }

    impl Cluster {
        /// The policy input for a prompt of `prompt_tokens`.
        pub fn input(&self, prompt_tokens: usize) -> SelectInput<'_> {
            SelectInput {
                prompt_tokens,
                page_size: self.page_size,
                prefill: &self.prefill,
                decode: &self.decode,
                overlaps: &self.overlaps,
            }
        }

        /// Applies the bookkeeping the selector does on dispatch (see `load.rs`).
        pub fn charge(&mut self, decision: &Decision, prompt_tokens: usize) {
            let blocks = self.input(prompt_tokens).prompt_blocks();
            if let Some(p) = &decision.prefill {
                let uncached = blocks.saturating_sub(self.overlaps.get(p) as u64);
                if let Some(c) = self.prefill.iter_mut().find(|c| &c.id == p) {
                    c.pending.prefill_blocks += uncached;
                    c.pending.requests += 1;
                }
            }
            if let Some(c) = self.decode.iter_mut().find(|c| c.id == decision.decode) {
                c.pending.active_blocks += blocks;
                c.pending.requests += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    /// The contract every policy meets.
    #[test]
    fn every_policy_picks_a_healthy_pair_or_none() {
        for kind in PolicyKind::ALL {
            let policy = Policy::new(kind);
            assert_eq!(policy.kind(), kind);
            let overlaps = Overlaps::default();
            let prefill = [candidate("p0", 0, 0, 0), candidate("p1", 0, 0, 0)];
            let decode = [candidate("d0", 0, 0, 0)];
            let input = SelectInput {
                prompt_tokens: 100,
                page_size: 16,
                prefill: &prefill,
                decode: &decode,
                overlaps: &overlaps,
            };
            let d = policy.select(&input).expect("a pair");
            assert_eq!(d.decode, WorkerId::from("d0"));
            assert!(d.prefill.is_some(), "{kind}: prefill workers exist");

            let none = SelectInput {
                decode: &[],
                ..input
            };
            assert_eq!(policy.select(&none), None, "{kind}: no decode worker");

            let local = SelectInput {
                prefill: &[],
                ..input
            };
            assert_eq!(
                policy.select(&local).and_then(|d| d.prefill),
                None,
                "{kind}: no prefill worker means a local prefill"
            );
        }
    }
}
