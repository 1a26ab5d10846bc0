//! Trace replay: runs the real routing policies over a recorded request trace against a
//! simulated cluster, to compare them on time-to-first-token and prefix-cache hits.
//!
//! The traces are Mooncake's (FAST'25) — JSONL lines `{timestamp (ms), input_length,
//! output_length, hash_ids}` where `hash_ids` are cumulative prefix-block hashes of 512-token
//! blocks (`../shared/traces/mooncake/`). No text travels, so no engine runs: each prefill
//! worker is a single-server FIFO queue whose service time comes from a [`PrefillCostModel`]
//! (the "engine truth"), with an LRU prefix cache of `cache_blocks` blocks. What is real is the
//! routing: every request goes through [`Policy::select`] with [`Candidate`]s built from the
//! simulated workers' state, exactly as the router builds them from heartbeats.
//!
//! Simulation rules (what the numbers below mean):
//! - A prefill worker serves one request at a time, in dispatch order. Its cache is consulted
//!   and updated at dispatch: the request will start after every earlier request on that worker
//!   has finished and stored its blocks, so that is the cache it will see. Overlaps shown to the
//!   policy are the same (a predictive index, as the router's own pending-load bookkeeping).
//! - Hits follow prefix semantics: leading blocks only. A hit block is touched (LRU), missing
//!   blocks are inserted, the least recently used blocks are evicted beyond capacity.
//! - TTFT = prefill finish − arrival (no KV transfer, no decode queueing: prefill placement is
//!   what the policies differ in). Decode workers hold each request for
//!   `output_tokens × tbt_s` after its prefill, which only feeds their load numbers.
//! - Heartbeat load is exact and instantaneous (queued prefill tokens = the uncached tokens
//!   still to compute, the running one pro rata).
use std::collections::{BTreeMap, HashMap, VecDeque};

use ferry_proto::ids::WorkerId;

use crate::index::Overlaps;
use crate::load::PendingSnapshot;
use crate::policy::{Candidate, Policy, PrefillCostModel, SelectInput, SelectPolicy};
use crate::registry::WorkerLoad;

/// Tokens per `hash_ids` block in the Mooncake traces.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// A trace that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// A line is not a trace record.
    #[error("trace line {line}: {message}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong, naming the field.
        message: String,
    },
}

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// Arrival, seconds from the trace start.
    pub arrival_s: f64,
    /// Prompt length in tokens.
    pub input_tokens: u64,
    /// Output length in tokens.
    pub output_tokens: u64,
    /// Cumulative prefix-block hashes of the prompt.
    pub blocks: Vec<u64>,
}

#[derive(serde::Deserialize)]
struct RawRecord {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// Parses a JSONL trace (blank lines skipped).
pub fn parse_trace(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| TraceError::Line {
            line: i + 1,
            message,
        };
        let de = &mut serde_json::Deserializer::from_str(line);
        let r: RawRecord = serde_path_to_error::deserialize(de)
            .map_err(|e| bad(format!("`{}`: {e}", e.path())))?;
        if !(r.timestamp.is_finite() && r.timestamp >= 0.0) {
            return Err(bad(format!(
                "`timestamp` must be >= 0 ms, got {}",
                r.timestamp
            )));
        }
        let want = (r.input_length as usize).div_ceil(TRACE_BLOCK_TOKENS);
        if r.hash_ids.len() != want {
            return Err(bad(format!(
                "`hash_ids` must have ceil(input_length / {TRACE_BLOCK_TOKENS}) = {want} entries, got {}",
                r.hash_ids.len()
            )));
        }
        out.push(TraceRequest {
            arrival_s: r.timestamp / 1e3,
            input_tokens: r.input_length,
            output_tokens: r.output_length,
            blocks: r.hash_ids,
        });
    }
    out.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    Ok(out)
}

/// The simulated cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplayConfig {
    /// Prefill workers.
    pub prefill_workers: usize,
    /// Decode workers.
    pub decode_workers: usize,
    /// Prefix-cache capacity of each prefill worker, in blocks.
    pub cache_blocks: usize,
    /// The engine's real prefill time (the `mooncake` policy is given the same model, i.e. a
    /// perfectly fitted one, as in the paper's setting).
    pub engine: PrefillCostModel,
    /// Seconds per output token on a decode worker.
    pub tbt_s: f64,
    /// Arrival times are divided by this (2 = the same requests twice as fast).
    pub rate_scale: f64,
    /// The router's `--ttft-slo-ms`, in seconds: a request whose estimated TTFT exceeds it is
    /// rejected (only policies that estimate TTFT, i.e. `mooncake`, reject).
    pub ttft_slo_s: Option<f64>,
    /// Routers placing the requests (request i goes to router i mod n), each with its own
    /// predictive load, as on the events plane (docs/deploy.md, "Several routers").
    pub routers: usize,
    /// Heartbeat period, seconds. 0: routers see exact, instantaneous load and a predictive
    /// index (the cache as it will be). Above 0: what the real routers see — load as of the
    /// last heartbeat, a worker's new blocks in the index one heartbeat after its prefill
    /// ends (KV events ride on heartbeats), plus each router's predictive load (its requests
    /// not yet prefilled / finished).
    pub heartbeat_s: f64,
    /// With `heartbeat_s` > 0 and several routers: each router also sees the others'
    /// predictive load (`--share-load`).
    pub share_load: bool,
}

impl Default for ReplayConfig {
    /// Eight prefill and eight decode workers, 8,192 blocks (4.2M tokens) of cache each, an
    /// engine that prefills a fresh 8k prompt in ~0.6 s (≈20k tok/s of weight work plus
    /// attention) — a large-MoE serving instance, not the embedded model.
    fn default() -> Self {
        Self {
            prefill_workers: 8,
            decode_workers: 8,
            cache_blocks: 8192,
            engine: PrefillCostModel {
                per_token_s: 5e-5,
                per_token_pair_s: 6e-9,
            },
            tbt_s: 0.03,
            rate_scale: 1.0,
            ttft_slo_s: None,
            routers: 1,
            heartbeat_s: 0.0,
            share_load: true,
        }
    }
}

/// What one policy achieved on one trace.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayReport {
    /// Requests served (the TTFT figures are over these).
    pub requests: usize,
    /// Requests rejected early for the TTFT SLO.
    pub rejected: usize,
    /// TTFT, seconds: mean and percentiles.
    pub ttft_mean_s: f64,
    /// Median TTFT.
    pub ttft_p50_s: f64,
    /// 90th percentile.
    pub ttft_p90_s: f64,
    /// 99th percentile.
    pub ttft_p99_s: f64,
    /// Prompt tokens served from a prefix cache over all prompt tokens.
    pub token_hit_ratio: f64,
    /// Requests prefilled by the busiest prefill worker over the mean per worker.
    pub max_share: f64,
}

/// An LRU set of block hashes.
#[derive(Debug, Default)]
struct Lru {
    capacity: usize,
    tick: u64,
    last_use: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
}

impl Lru {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            ..Self::default()
        }
    }

    /// Leading blocks present.
    fn prefix_hits(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.last_use.contains_key(b))
            .count()
    }

    /// Touches or inserts every block (in order), then evicts down to capacity; returns the
    /// evicted blocks.
    fn store(&mut self, blocks: &[u64]) -> Vec<u64> {
        for &b in blocks {
            self.tick += 1;
            if let Some(old) = self.last_use.insert(b, self.tick) {
                self.by_age.remove(&old);
            }
            self.by_age.insert(self.tick, b);
        }
        let mut evicted = Vec::new();
        while self.last_use.len() > self.capacity {
            let Some((_, b)) = self.by_age.pop_first() else {
                break;
            };
            self.last_use.remove(&b);
            evicted.push(b);
        }
        evicted
    }

    fn contains(&self, block: u64) -> bool {
        self.last_use.contains_key(&block)
    }
}

/// One request on a prefill worker's FIFO.
#[derive(Debug, Clone, Copy)]
struct Job {
    dispatched_s: f64,
    start_s: f64,
    end_s: f64,
    uncached_tokens: u64,
}

#[derive(Debug)]
struct PrefillSim {
    id: WorkerId,
    cache: Lru,
    /// When each cached block shows in the routers' index (heartbeat mode).
    visible_at: HashMap<u64, f64>,
    jobs: VecDeque<Job>,
    busy_until_s: f64,
    served: usize,
}

impl Simulated for PrefillSim {
    fn id(&self) -> &WorkerId {
        &self.id
    }

    /// Queued tokens (the running job pro rata), running, waiting, as of `now` (jobs
    /// dispatched after `now` are not seen; finished ones are dropped by [`Self::forget`]).
    fn load_at(&mut self, now: f64) -> WorkerLoad {
        let mut queued = 0.0;
        let (mut running, mut waiting) = (0, 0);
        for j in self
            .jobs
            .iter()
            .filter(|j| j.dispatched_s <= now && j.end_s > now)
        {
            if j.start_s <= now {
                running += 1;
                let left = (j.end_s - now) / (j.end_s - j.start_s).max(1e-12);
                queued += j.uncached_tokens as f64 * left;
            } else {
                waiting += 1;
                queued += j.uncached_tokens as f64;
            }
        }
        WorkerLoad {
            running_requests: running,
            waiting_requests: waiting,
            kv_blocks_used: 0,
            kv_blocks_total: self.cache.capacity as u32,
            queued_prefill_tokens: queued.round() as u64,
        }
    }
}

#[derive(Debug)]
struct DecodeSim {
    id: WorkerId,
    /// (dispatch time, finish time, blocks) of requests assigned and not finished.
    active: Vec<(f64, f64, u64)>,
}

impl Simulated for DecodeSim {
    fn id(&self) -> &WorkerId {
        &self.id
    }

    fn load_at(&mut self, now: f64) -> WorkerLoad {
        let live = || {
            self.active
                .iter()
                .filter(move |&&(at, end, _)| at <= now && end > now)
        };
        WorkerLoad {
            running_requests: live().count() as u32,
            waiting_requests: 0,
            kv_blocks_used: live().map(|&(_, _, b)| b).sum::<u64>() as u32,
            kv_blocks_total: u32::MAX,
            queued_prefill_tokens: 0,
        }
    }
}

/// A simulated worker as the router sees it: its heartbeat at `now`, nothing pending (the
/// heartbeat is exact).
trait Simulated {
    fn id(&self) -> &WorkerId;
    fn load_at(&mut self, now: f64) -> WorkerLoad;
    fn candidate_at(&mut self, now: f64) -> Candidate {
        Candidate {
            id: self.id().clone(),
            load: self.load_at(now),
            pending: PendingSnapshot::default(),
        }
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// One router's predictive load: what it dispatched, until it is released (prefill charges
/// at the prefill's end, decode charges at the request's end), per worker index.
#[derive(Debug, Default, Clone)]
struct RouterSim {
    /// (release time, uncached blocks) per prefill worker.
    prefill: Vec<Vec<(f64, u64)>>,
    /// (release time, blocks) per decode worker.
    decode: Vec<Vec<(f64, u64)>>,
}

impl RouterSim {
    fn new(prefill: usize, decode: usize) -> Self {
        Self {
            prefill: vec![Vec::new(); prefill],
            decode: vec![Vec::new(); decode],
        }
    }

    fn release(&mut self, now: f64) {
        for v in self.prefill.iter_mut().chain(self.decode.iter_mut()) {
            v.retain(|&(until, _)| until > now);
        }
    }
}

fn pending_of(charges: &[(f64, u64)], prefill: bool) -> PendingSnapshot {
    let blocks = charges.iter().map(|&(_, b)| b).sum();
    PendingSnapshot {
        prefill_blocks: if prefill { blocks } else { 0 },
        active_blocks: if prefill { 0 } else { blocks },
        requests: charges.len() as u64,
    }
}

/// Replays `trace` through `policy` on the cluster `cfg`.
pub fn replay(trace: &[TraceRequest], cfg: &ReplayConfig, policy: &Policy) -> ReplayReport {
    let page = TRACE_BLOCK_TOKENS;
    let mut prefill: Vec<PrefillSim> = (0..cfg.prefill_workers)
        .map(|i| PrefillSim {
            id: WorkerId::from(format!("p{i:02}").as_str()),
            cache: Lru::new(cfg.cache_blocks),
            visible_at: HashMap::new(),
            jobs: VecDeque::new(),
            busy_until_s: 0.0,
            served: 0,
        })
        .collect();
    let mut decode: Vec<DecodeSim> = (0..cfg.decode_workers.max(1))
        .map(|i| DecodeSim {
            id: WorkerId::from(format!("d{i:02}").as_str()),
            active: Vec::new(),
        })
        .collect();
    let hb = cfg.heartbeat_s.max(0.0);
    let mut routers: Vec<RouterSim> = (0..cfg.routers.max(1))
        .map(|_| RouterSim::new(prefill.len(), decode.len()))
        .collect();
    let scale = cfg.rate_scale.max(1e-9);
    let mut ttfts = Vec::with_capacity(trace.len());
    let (mut hit_tokens, mut input_tokens) = (0u64, 0u64);
    let mut rejected = 0;
    for (i, r) in trace.iter().enumerate() {
        let now = r.arrival_s / scale;
        // What the routers' heartbeats say: now (exact mode), or the last heartbeat's.
        let seen = if hb > 0.0 {
            (now / hb).floor() * hb
        } else {
            now
        };
        for p in prefill.iter_mut() {
            while p.jobs.front().is_some_and(|j| j.end_s <= seen) {
                p.jobs.pop_front();
            }
        }
        for d in decode.iter_mut() {
            d.active.retain(|&(_, end, _)| end > seen);
        }
        routers.iter_mut().for_each(|x| x.release(now));
        let me = i % routers.len();
        // The predictive load this router sees on worker `w` (heartbeat mode only: in exact
        // mode the heartbeat already shows everything).
        let pending = |w: usize, is_prefill: bool| -> PendingSnapshot {
            if hb == 0.0 {
                return PendingSnapshot::default();
            }
            let charges = |x: &RouterSim| {
                let v = if is_prefill {
                    &x.prefill[w]
                } else {
                    &x.decode[w]
                };
                pending_of(v, is_prefill)
            };
            if cfg.share_load {
                routers
                    .iter()
                    .map(charges)
                    .fold(PendingSnapshot::default(), |a, b| a + b)
            } else {
                charges(&routers[me])
            }
        };
        let p_cands: Vec<Candidate> = prefill
            .iter_mut()
            .enumerate()
            .map(|(w, p)| Candidate {
                pending: pending(w, true),
                ..p.candidate_at(seen)
            })
            .collect();
        let d_cands: Vec<Candidate> = decode
            .iter_mut()
            .enumerate()
            .map(|(w, d)| Candidate {
                pending: pending(w, false),
                ..d.candidate_at(seen)
            })
            .collect();
        let overlaps = Overlaps::from_pairs(prefill.iter().map(|p| {
            let known = if hb > 0.0 {
                r.blocks
                    .iter()
                    .take_while(|b| {
                        p.cache.contains(**b) && p.visible_at.get(b).is_some_and(|&t| t <= now)
                    })
                    .count()
            } else {
                p.cache.prefix_hits(&r.blocks)
            };
            (p.id.clone(), known)
        }));
        let input = SelectInput {
            prompt_tokens: r.input_tokens as usize,
            page_size: page,
            prefill: &p_cands,
            decode: &d_cands,
            overlaps: &overlaps,
        };
        let Some(decision) = policy.select(&input) else {
            continue;
        };
        if let (Some(slo), Some(est_ms)) = (cfg.ttft_slo_s, decision.estimated_ttft_ms) {
            if est_ms as f64 > slo * 1e3 {
                rejected += 1;
                continue;
            }
        }
        // The replayed cluster always has prefill workers; a policy that prefills locally
        // would be charged on the first prefill worker's clock (none of ours does).
        let pi = decision
            .prefill
            .as_ref()
            .and_then(|id| prefill.iter().position(|p| &p.id == id))
            .unwrap_or(0);
        let Some(p) = prefill.get_mut(pi) else {
            continue;
        };
        let hit_blocks = p.cache.prefix_hits(&r.blocks);
        let cached = ((hit_blocks * page) as u64).min(r.input_tokens);
        let uncached = r.input_tokens - cached;
        let start = now.max(p.busy_until_s);
        let end = start + cfg.engine.prefill_s(uncached, cached);
        p.busy_until_s = end;
        p.jobs.push_back(Job {
            dispatched_s: now,
            start_s: start,
            end_s: end,
            uncached_tokens: uncached,
        });
        for b in p.cache.store(&r.blocks) {
            p.visible_at.remove(&b);
        }
        for &b in &r.blocks {
            // Stored at the prefill's end, in the index with the next heartbeat's events.
            p.visible_at.entry(b).or_insert(end + hb);
        }
        p.served += 1;
        routers[me].prefill[pi].push((end, uncached.div_ceil(page as u64)));
        if let Some(di) = decode.iter().position(|d| d.id == decision.decode) {
            let blocks = (r.input_tokens + r.output_tokens).div_ceil(page as u64);
            let finish = end + r.output_tokens as f64 * cfg.tbt_s;
            decode[di].active.push((now, finish, blocks));
            routers[me].decode[di].push((finish, blocks));
        }
        ttfts.push(end - now);
        hit_tokens += cached;
        input_tokens += r.input_tokens;
    }
    let n = ttfts.len();
    let mean = ttfts.iter().sum::<f64>() / n.max(1) as f64;
    ttfts.sort_by(f64::total_cmp);
    let max_served = prefill.iter().map(|p| p.served).max().unwrap_or(0);
    ReplayReport {
        requests: n,
        rejected,
        ttft_mean_s: mean,
        ttft_p50_s: percentile(&ttfts, 0.5),
        ttft_p90_s: percentile(&ttfts, 0.9),
        ttft_p99_s: percentile(&ttfts, 0.99),
        token_hit_ratio: hit_tokens as f64 / input_tokens.max(1) as f64,
        max_share: max_served as f64 * prefill.len() as f64 / n.max(1) as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PolicyKind;
    use crate::policy::Mooncake;

    fn req(at_ms: u64, blocks: &[u64]) -> String {
        format!(
            r#"{{"timestamp": {at_ms}, "input_length": {}, "output_length": 10, "hash_ids": {blocks:?}}}"#,
            blocks.len() * TRACE_BLOCK_TOKENS
        )
    }

    fn policy(kind: PolicyKind, cfg: &ReplayConfig) -> Policy {
        match kind {
            PolicyKind::Mooncake => Policy::Mooncake(Mooncake { cost: cfg.engine }),
            k => Policy::new(k),
        }
    }

    #[test]
    fn a_bad_line_names_its_number_and_field() {
        let text = format!(
            "{}\n\n{{\"timestamp\": 5, \"input_length\": 1000}}\n",
            req(0, &[1, 2])
        );
        let e = parse_trace(&text).expect_err("missing fields");
        let msg = e.to_string();
        assert!(
            msg.contains("line 3") && msg.contains("output_length"),
            "{msg}"
        );
        let e = parse_trace(
            r#"{"timestamp": 1, "input_length": 1500, "output_length": 1, "hash_ids": [1]}"#,
        )
        .expect_err("1500 tokens need 3 blocks");
        assert!(e.to_string().contains("hash_ids"), "{e}");
        let ok = parse_trace(&format!("{}\n{}", req(20, &[7]), req(10, &[1, 2]))).expect("valid");
        assert_eq!(ok.len(), 2);
        assert_eq!(ok[0].blocks, vec![1, 2], "sorted by arrival");
        assert!((ok[1].arrival_s - 0.02).abs() < 1e-12);
    }

    #[test]
    fn lru_keeps_prefix_semantics_and_capacity() {
        let mut c = Lru::new(3);
        c.store(&[1, 2, 3]);
        assert_eq!(c.prefix_hits(&[1, 2, 3, 4]), 3);
        assert_eq!(c.prefix_hits(&[2, 3]), 2);
        assert_eq!(c.prefix_hits(&[9, 1]), 0, "only leading blocks count");
        c.store(&[1, 4]); // 1 touched, 4 inserted: 2 is the oldest and goes
        assert_eq!(c.prefix_hits(&[1, 2]), 1);
        assert_eq!(c.prefix_hits(&[2]), 0);
        assert_eq!(c.prefix_hits(&[3, 4]), 2);
    }

    /// Several routers with heartbeats: sharing predictive load makes two routers place a
    /// burst exactly as one router does; without it, each router fills the gap the stale
    /// heartbeat shows and together they overshoot (herding), which costs TTFT.
    #[test]
    fn routers_sharing_load_place_like_one_router_and_without_it_they_herd() {
        // Bursts of 8 simultaneous distinct 8-block prompts, one every 5 s.
        let mut lines = Vec::new();
        for burst in 0..6u64 {
            for i in 0..8u64 {
                let blocks: Vec<u64> = (0..8).map(|b| 100_000 * burst + 1000 * i + b).collect();
                lines.push(req(burst * 5000 + i, &blocks));
            }
        }
        let trace = parse_trace(&lines.join("\n")).expect("trace");
        let cfg = |routers, share_load| ReplayConfig {
            prefill_workers: 4,
            decode_workers: 2,
            routers,
            heartbeat_s: 0.2,
            share_load,
            ..ReplayConfig::default()
        };
        let policy = Policy::new(PolicyKind::CacheAware);
        let one = replay(&trace, &cfg(1, true), &policy);
        let shared = replay(&trace, &cfg(2, true), &policy);
        let unshared = replay(&trace, &cfg(2, false), &policy);
        assert_eq!(shared, one, "shared load: two routers place like one");
        assert!(
            unshared.ttft_mean_s > one.ttft_mean_s,
            "without sharing two routers herd: {unshared:?} vs {one:?}"
        );
    }

    /// Sessions that return to their own growing prefix: routing by cache finds the earlier
    /// turns, rotating does not.
    #[test]
    fn cache_aware_routing_reuses_sessions_that_round_robin_scatters() {
        let mut lines = Vec::new();
        for turn in 0..6u64 {
            for s in 0..4u64 {
                let blocks: Vec<u64> = (0..=turn).map(|b| 1000 * s + b).collect();
                lines.push(req(turn * 60_000 + s * 1000, &blocks));
            }
        }
        let trace = parse_trace(&lines.join("\n")).expect("trace");
        let cfg = ReplayConfig {
            prefill_workers: 3,
            decode_workers: 2,
            ..ReplayConfig::default()
        };
        let rr = replay(&trace, &cfg, &policy(PolicyKind::RoundRobin, &cfg));
        for kind in [PolicyKind::CacheAware, PolicyKind::Mooncake] {
            let r = replay(&trace, &cfg, &policy(kind, &cfg));
            assert_eq!(r.requests, 24);
            // Every turn after the first finds all earlier turns' blocks: 15 of 21 blocks
            // per session.
            assert!(
                (r.token_hit_ratio - 15.0 / 21.0).abs() < 1e-9,
                "{kind}: hit {}",
                r.token_hit_ratio
            );
            assert!(
                r.token_hit_ratio > rr.token_hit_ratio,
                "{kind} vs round robin"
            );
            assert!(r.ttft_mean_s < rr.ttft_mean_s, "{kind}: {r:?} vs {rr:?}");
        }
    }

    /// A burst beyond what the cluster can serve within the SLO: `mooncake` turns away the
    /// requests it predicts to be late, and the ones it admits meet the SLO (its estimate is
    /// the engine's own model here); policies without an estimate reject nothing.
    #[test]
    fn early_rejection_keeps_admitted_requests_within_the_slo() {
        let lines: Vec<String> = (0..40u64)
            .map(|s| req(0, &(0..16).map(|b| s * 100 + b).collect::<Vec<_>>()))
            .collect();
        let trace = parse_trace(&lines.join("\n")).expect("trace");
        let cfg = ReplayConfig {
            prefill_workers: 2,
            ttft_slo_s: Some(5.0),
            ..ReplayConfig::default()
        };
        let m = replay(&trace, &cfg, &policy(PolicyKind::Mooncake, &cfg));
        assert!(m.rejected > 0 && m.requests > 0, "{m:?}");
        assert_eq!(m.requests + m.rejected, 40);
        assert!(m.ttft_p99_s <= 5.0 + 1e-3, "{m:?}");
        let c = replay(&trace, &cfg, &policy(PolicyKind::CacheAware, &cfg));
        assert_eq!((c.requests, c.rejected), (40, 0));
        assert!(c.ttft_p99_s > 5.0, "{c:?}");
    }

    /// Every request shares one hot first block (as in the conversation trace) and arrives at
    /// once: pure prefix affinity piles them on one worker, the TTFT estimate spreads them.
    #[test]
    fn mooncake_spreads_a_burst_that_shares_only_a_hot_first_block() {
        let mut lines = vec![req(0, &[0])];
        for s in 1..=16u64 {
            let blocks: Vec<u64> = std::iter::once(0)
                .chain((0..16).map(|b| s * 100 + b))
                .collect();
            lines.push(req(1000, &blocks));
        }
        let trace = parse_trace(&lines.join("\n")).expect("trace");
        let cfg = ReplayConfig {
            prefill_workers: 4,
            ..ReplayConfig::default()
        };
        let m = replay(&trace, &cfg, &policy(PolicyKind::Mooncake, &cfg));
        assert!(m.max_share < 1.5, "{m:?}");
        let ll = replay(&trace, &cfg, &policy(PolicyKind::LeastLoaded, &cfg));
        assert!(m.ttft_mean_s <= ll.ttft_mean_s * 1.01, "{m:?} vs {ll:?}");
    }
}
