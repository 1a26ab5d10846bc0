//! `mooncake`: Mooncake's Conductor (FAST'25, Algorithm 1), as far as ferry's cluster allows.
//!
//! ```text
//! prefill P = argmin  TTFT(P) = t_queue(P) + t_prefill(P) + t_xfer(P)
//!             t_queue(P)   = k · t(q / k, 0),  q = queued_prefill_blocks(P) · page_size,
//!                            k = P's active requests (at least 1)
//!             t_prefill(P) = t(prompt − prefix(P), prefix(P)),  prefix(P) = overlap(P) · page_size
//!             t_xfer(P)    = 0
//!             ties: fewest active requests, then id
//! decode  D = as `cache_aware`: a decode worker holding more of the prefix than P wins,
//!             else fewest active blocks (the same code: `cache_aware::decode_beside`)
//! no P:   D = argmin  t(queued_prefill_blocks(D) · page_size, 0) + t(prompt − prefix(D), prefix(D))
//!             ties: fewest active requests, then id
//! ```
//!
//! The cost model ([`PrefillCostModel`]) is `t(n_new, n_prefix) = a·n_new +
//! b·n_new·(n_prefix + n_new/2)`: a linear term for the weights (projections, MLP/MoE, LM head:
//! the same work per token) and a quadratic one for attention. ferry's prefill runs attention
//! in MHA form (decompressed K/V, causal), so each new token attends to the whole cached prefix
//! plus, on average, half of the other new tokens: `n_new·(n_prefix + n_new/2)` query-key pairs
//! at a fixed cost each. This is the shape of the paper's `l·(4n²d + 22nd²)` FLOP count with
//! a cached prefix; the paper's fitted coefficients are unpublished, ours come from
//! `BENCHMARKS.md` (see [`PrefillCostModel::default`]).
//!
//! What differs from the paper:
//! - **No prefix replication** between prefill workers: ferry cannot copy a hot prefix from one
//!   prefill worker to another, so the "pull the best prefix" branch (and its balancing
//!   threshold) does not exist and `t_xfer = 0` for every worker.
//! - **Queued work is priced as equal prompts**: the router knows queued prefill *tokens* per
//!   worker (heartbeat plus its own predictive load) and how many requests it holds, not how
//!   the tokens split, so `t_queue` prices them as that many equal fresh prompts
//!   (`a·q + b·q²/2k`). Pricing them as one sequence (`k = 1`, the first version) over-counted
//!   the attention term of a long queue quadratically: replaying the Mooncake traces at 1.5×
//!   load it steered requests away from their cached prefixes and lost to `cache_aware`
//!   (mean TTFT 5.1 s vs 3.4 s; `BENCHMARKS.md`, "Routing policies on the Mooncake traces").
//!   For the no-prefill-worker branch `k` counts the decode worker's decoding requests too,
//!   which under-prices its queue.
//! - **Early rejection on TTFT only**: the decision carries the chosen worker's estimate, and
//!   the selector rejects the request (RESOURCE_EXHAUSTED / 429) when it exceeds
//!   `--ttft-slo-ms`; the paper's TBT check (decode load predicted for when the prefill ends)
//!   is not done.
//! - The decode worker is chosen by load in blocks (as `cache_aware`), not by predicted
//!   time-between-tokens.
use std::cmp::Ordering;

use super::cache_aware::decode_beside;
use super::{Candidate, Decision, SelectInput, SelectPolicy};

/// Predicted prefill time in seconds: `per_token_s·n_new +
/// per_token_pair_s·n_new·(n_prefix + n_new/2)` (see the module docs for why).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillCostModel {
    /// `a`: seconds per new token for the work that does not depend on context (weights).
    pub per_token_s: f64,
    /// `b`: seconds per attended (query, key) token pair.
    pub per_token_pair_s: f64,
}

impl Default for PrefillCostModel {
    /// Fitted to the CPU engine on the embedded model (`BENCHMARKS.md`, session 28, 2 cores):
    /// single fresh prompts of 128–1,000 tokens prefill at ≈12.3k–16.8k tok/s; a least-squares
    /// fit of the time per token, `a + b·n/2`, over 128 / 256 / 512 / 768 / 1,000 tokens gives
    /// `a` ≈ 58 µs and `b` ≈ 0.044 µs per pair (check: 512 tokens → 69 µs a token ≈ 14.4k tok/s,
    /// measured 15.6k; 1,000 → 80 µs ≈ 12.5k, measured 12.3k). On another device, fit your own.
    fn default() -> Self {
        Self {
            per_token_s: 5.8e-5,
            per_token_pair_s: 4.4e-8,
        }
    }
}

impl PrefillCostModel {
    /// Seconds to prefill `new_tokens` after `prefix_tokens` already cached.
    pub fn prefill_s(&self, new_tokens: u64, prefix_tokens: u64) -> f64 {
        let n = new_tokens as f64;
        let prefix = prefix_tokens as f64;
        self.per_token_s * n + self.per_token_pair_s * n * (prefix + n / 2.0)
    }

    /// Seconds to work off `queued_tokens` held by `jobs` queued prompts, priced as `jobs`
    /// equal fresh prompts: `jobs · prefill_s(queued / jobs, 0)`.
    pub fn queue_s(&self, queued_tokens: u64, jobs: u64) -> f64 {
        let q = queued_tokens as f64;
        let k = jobs.max(1) as f64;
        self.per_token_s * q + self.per_token_pair_s * q * q / (2.0 * k)
    }
}

/// The Mooncake policy (stateless: all state is in the input; the cost model is fixed).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Mooncake {
    /// Prices queued and new prefill work.
    pub cost: PrefillCostModel,
}

impl Mooncake {
    /// Estimated TTFT in seconds if `worker` prefills this prompt: its queued prefill work plus
    /// the prompt's uncached part after its cached prefix (no transfer term).
    pub fn ttft_s(&self, worker: &Candidate, input: &SelectInput<'_>) -> f64 {
        let page = input.page_size.max(1) as u64;
        let queued = worker.queued_prefill_blocks(input.page_size) * page;
        let prompt = input.prompt_tokens as u64;
        let prefix = (input.overlaps.get(&worker.id) as u64 * page).min(prompt);
        self.cost.queue_s(queued, worker.active_requests())
            + self.cost.prefill_s(prompt - prefix, prefix)
    }

    fn fastest<'a>(
        &self,
        workers: &'a [Candidate],
        input: &SelectInput<'_>,
    ) -> Option<&'a Candidate> {
        workers
            .iter()
            .map(|w| (self.ttft_s(w, input), w))
            .min_by(|a, b| by_estimate(*a, *b))
            .map(|(_, w)| w)
    }
}

fn by_estimate(a: (f64, &Candidate), b: (f64, &Candidate)) -> Ordering {
    a.0.total_cmp(&b.0)
        .then_with(|| a.1.active_requests().cmp(&b.1.active_requests()))
        .then_with(|| a.1.id.cmp(&b.1.id))
}

impl SelectPolicy for Mooncake {
    fn select(&self, input: &SelectInput<'_>) -> Option<Decision> {
        let prefill = self.fastest(input.prefill, input);
        let decode = match prefill {
            Some(p) => decode_beside(p, input),
            None => self.fastest(input.decode, input),
        }?;
        let ttft = self.ttft_s(prefill.unwrap_or(decode), input);
        Some(Decision::new(prefill, decode, input).with_ttft_estimate(ttft))
    }
}

#[cfg(test)]
mod tests {
    use ferry_proto::ids::WorkerId;

    use super::super::testing::{candidate, Cluster};
    use super::*;
    use crate::index::Overlaps;

    const PAGE: usize = 64;

    fn id(s: &str) -> WorkerId {
        WorkerId::from(s)
    }

    fn cluster(prefill: &[&str], overlaps: &[(&str, usize)]) -> Cluster {
        Cluster {
            prefill: prefill.iter().map(|p| candidate(p, 0, 0, 0)).collect(),
            decode: vec![candidate("d0", 0, 0, 0), candidate("d1", 0, 0, 0)],
            overlaps: Overlaps::from_pairs(overlaps.iter().map(|(w, n)| (id(w), *n))),
            page_size: PAGE,
        }
    }

    /// The formula written out with the default coefficients.
    fn t(n_new: f64, n_prefix: f64) -> f64 {
        5.8e-5 * n_new + 4.4e-8 * n_new * (n_prefix + n_new / 2.0)
    }

    fn assert_close(got: f64, want: f64) {
        assert!((got - want).abs() < 1e-9, "got {got}, want {want}");
    }

    #[test]
    fn the_cost_model_matches_the_benchmark_it_was_fitted_to() {
        let m = PrefillCostModel::default();
        let tok_per_s = 512.0 / m.prefill_s(512, 0);
        assert!((14_000.0..15_000.0).contains(&tok_per_s), "{tok_per_s}");
        let tok_per_s = 1000.0 / m.prefill_s(1000, 0);
        assert!((12_000.0..13_000.0).contains(&tok_per_s), "{tok_per_s}");
        // Sequential chunks cost the same as one prefill: the quadratic term is additive.
        assert_close(
            m.prefill_s(1024, 0) + m.prefill_s(1024, 1024),
            m.prefill_s(2048, 0),
        );
    }

    #[test]
    fn a_long_uncached_prompt_goes_to_the_shortest_queue() {
        let mut c = cluster(&["p0", "p1", "p2"], &[]);
        c.prefill[0].load.queued_prefill_tokens = 20 * 64;
        c.prefill[1].pending.prefill_blocks = 5;
        c.prefill[2].load.queued_prefill_tokens = 10 * 64;
        let input = c.input(4096);
        assert_close(
            Mooncake::default().ttft_s(&c.prefill[1], &input),
            t(320.0, 0.0) + t(4096.0, 0.0),
        );
        let d = Mooncake::default().select(&input).expect("pair");
        assert_eq!(d.prefill, Some(id("p1")));
        assert_eq!(d.predicted_cached_blocks, 0);
        // The decision carries the chosen worker's estimate, rounded up to whole ms.
        let est = t(320.0, 0.0) + t(4096.0, 0.0);
        assert_eq!(d.estimated_ttft_ms, Some((est * 1e3).ceil() as u64));
    }

    #[test]
    fn a_cached_prefix_beats_a_slightly_shorter_queue_but_not_a_much_shorter_one() {
        let m = Mooncake::default();
        // 2048-token prompt; p0 holds its first 16 blocks (1024 tokens), p1 nothing.
        let mut c = cluster(&["p0", "p1"], &[("p0", 16)]);
        c.prefill[0].load.queued_prefill_tokens = 4 * 64;
        let input = c.input(2048);
        // p0: t(256, 0) + t(1024, 1024) = 0.0163 + 0.1286 = 0.1449 s
        // p1: t(0, 0) + t(2048, 0)                          = 0.2111 s
        let p0 = m.ttft_s(&c.prefill[0], &input);
        let p1 = m.ttft_s(&c.prefill[1], &input);
        assert_close(p0, 0.016_289_792 + 0.128_598_016);
        assert_close(p1, 0.211_058_688);
        assert_close(p0, t(256.0, 0.0) + t(1024.0, 1024.0));
        let d = m.select(&input).expect("pair");
        assert_eq!(d.prefill, Some(id("p0")));
        assert_eq!(d.predicted_cached_blocks, 16);

        // A small hit (2 blocks) behind a long queue (64 blocks) loses to an idle p1:
        // p0: t(4096, 0) + t(1920, 128) = 0.6067 + 0.2033 = 0.8099 s > 0.2111 s.
        let mut c = cluster(&["p0", "p1"], &[("p0", 2)]);
        c.prefill[0].pending.prefill_blocks = 64;
        let input = c.input(2048);
        assert_close(
            m.ttft_s(&c.prefill[0], &input),
            0.606_666_752 + 0.203_274_24,
        );
        assert_close(
            m.ttft_s(&c.prefill[0], &input),
            t(4096.0, 0.0) + t(1920.0, 128.0),
        );
        let d = m.select(&input).expect("pair");
        assert_eq!(d.prefill, Some(id("p1")));
    }

    #[test]
    fn a_queue_of_many_prompts_is_priced_as_that_many_equal_prompts() {
        let m = PrefillCostModel::default();
        assert_close(m.queue_s(4096, 1), m.prefill_s(4096, 0));
        assert_close(m.queue_s(4096, 8), 8.0 * m.prefill_s(512, 0));
        assert_close(m.queue_s(0, 3), 0.0);
        // p0 holds 16 of the 32 prompt blocks behind 64 queued blocks of 8 requests; p1 holds
        // nothing behind 32 blocks of one request. p0: 8 · t(512, 0) + t(1024, 1024) =
        // 0.284 + 0.129 = 0.412 s; p1: t(2048, 0) + t(2048, 0) = 0.422 s: the prefix wins.
        let mut c = cluster(&["p0", "p1"], &[("p0", 16)]);
        c.prefill[0].load.queued_prefill_tokens = 64 * 64;
        c.prefill[0].load.waiting_requests = 8;
        c.prefill[1].load.queued_prefill_tokens = 32 * 64;
        c.prefill[1].load.running_requests = 1;
        let input = c.input(2048);
        let mc = Mooncake::default();
        assert_close(
            mc.ttft_s(&c.prefill[0], &input),
            8.0 * t(512.0, 0.0) + t(1024.0, 1024.0),
        );
        assert_close(mc.ttft_s(&c.prefill[1], &input), 2.0 * t(2048.0, 0.0));
        assert_eq!(mc.select(&input).and_then(|d| d.prefill), Some(id("p0")));
        // Priced as one 4096-token sequence, p0's queue would have cost 2.37 s and the request
        // would have left its cached prefix for p1.
        assert!(m.prefill_s(4096, 0) + t(1024.0, 1024.0) > 2.0 * t(2048.0, 0.0));
    }

    #[test]
    fn ties_break_by_active_requests_then_id() {
        let mut c = cluster(&["p0", "p1"], &[("p0", 3), ("p1", 3)]);
        c.prefill[0].load.running_requests = 2;
        let d = Mooncake::default().select(&c.input(8 * 64)).expect("pair");
        assert_eq!(d.prefill, Some(id("p1")), "same estimate, fewer requests");

        let c = cluster(&["p0", "p1"], &[]);
        let d = Mooncake::default().select(&c.input(64)).expect("pair");
        assert_eq!((d.prefill, d.decode), (Some(id("p0")), id("d0")), "then id");
    }

    #[test]
    fn the_decode_worker_follows_the_cache_aware_rule() {
        let mut c = cluster(&["p0"], &[("p0", 2), ("d1", 8)]);
        c.decode[1].load.kv_blocks_used = 40;
        let d = Mooncake::default().select(&c.input(10 * 64)).expect("pair");
        assert_eq!(d.decode, id("d1"), "holds more of the prefix than P");
        assert_eq!(d.predicted_cached_blocks, 8);

        let mut c = cluster(&["p0"], &[]);
        c.decode[0].load.kv_blocks_used = 40;
        let d = Mooncake::default().select(&c.input(10 * 64)).expect("pair");
        assert_eq!(d.decode, id("d1"), "fewest active blocks");
    }

    #[test]
    fn without_prefill_workers_the_decode_worker_with_the_least_local_ttft_wins() {
        let m = Mooncake::default();
        // d1 holds half the 2048-token prompt: t(1024, 1024) = 0.4724 s < d0's t(2048, 0).
        let mut c = cluster(&[], &[("d1", 16)]);
        c.decode[1].load.kv_blocks_used = 500; // active blocks do not count here
        let d = m.select(&c.input(2048)).expect("pair");
        assert_eq!((d.prefill, d.decode.clone()), (None, id("d1")));

        // Queue 20 blocks on d1: t(1280, 0) + t(1024, 1024) = 0.3266 + 0.4724 > 0.7035 s.
        c.decode[1].load.queued_prefill_tokens = 20 * 64;
        let input = c.input(2048);
        assert_close(
            m.ttft_s(&c.decode[1], &input),
            t(1280.0, 0.0) + t(1024.0, 1024.0),
        );
        assert!(m.ttft_s(&c.decode[1], &input) > m.ttft_s(&c.decode[0], &input));
        let d = m.select(&input).expect("pair");
        assert_eq!(d.decode, id("d0"));
    }
}
