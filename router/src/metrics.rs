//! The router's Prometheus metrics, served at `GET /metrics` on the HTTP port.
//!
//! Latencies are measured from the moment a request arrived at the router (before
//! tokenization) to what its client sees; names follow vLLM's and SGLang's with the `ferry_`
//! prefix and a unit suffix, and every series carries the constant label `role="router"`.
//!
//! | metric | type | what |
//! |---|---|---|
//! | `ferry_time_to_first_token_seconds` | histogram | arrival → first token out |
//! | `ferry_inter_token_latency_seconds` | histogram | gap between consecutive output tokens (one sample per token after the first) |
//! | `ferry_e2e_request_latency_seconds` | histogram | arrival → finish, finished requests |
//! | `ferry_request_success_total{finished_reason}` | counter | finished requests (`stop`, `length`) |
//! | `ferry_request_failure_total{kind}` | counter | failed requests by `RequestError::kind` (`invalid_value`, `overloaded`, `no_decode_worker`, `worker_failed`, …), and `cancelled` (the client went away) |
//! | `ferry_prompt_tokens_total`, `ferry_generation_tokens_total` | counter | tokens of finished requests |
//! | `ferry_prompt_cached_tokens_total` | counter | prompt tokens the decode worker already held, finished requests |
//! | `ferry_routing_decisions_total{policy,prefill_worker,decode_worker}` | counter | selections (`prefill_worker="none"`: prefilled on the decode worker) |
//! | `ferry_routing_predicted_cached_blocks` | histogram | prompt blocks the policy expected to be cached on the chosen pair |
//! | `ferry_routing_retries_total` | counter | attempts sent to another decode worker after one failed before the first token |
//! | `ferry_request_migrations_total` | counter | requests resumed on another decode worker after theirs failed mid-stream (one per resumption of a failed worker stream; an `n` > 1 request's first call counts once however many samples it resumes) |
//! | `ferry_routing_workers_marked_down_total` | counter | decode workers dropped from routing at once after a connect error or a broken stream |
//! | `ferry_router_events_connected` | gauge | 1 while the events plane (`--events`) is reachable, 0 while not (routing by load only); absent without one |
//! | `ferry_router_kv_snapshot_requests_total` | counter | snapshots this router asked a worker for on the events plane (a gap, a trimmed stream, a worker it had lost) |
//! | `ferry_router_kv_feed_messages_total` | counter | KV stream messages applied (snapshot parts and event batches) |
//! | `ferry_router_index_blocks{worker}` | gauge | blocks the prefix index holds per healthy worker: this router's view of each worker's cache |
//! | `ferry_router_requests_in_flight` | gauge | admitted requests not yet finished |
//! | `ferry_router_workers{worker_role}` | gauge | healthy registered workers by role |

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// Buckets in seconds for request latencies (same as the workers').
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
];

/// Buckets in seconds for per-token gaps.
const STEP_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0,
];

/// Every `finished_reason` and failure `kind`, created at zero so `rate()` sees each series
/// from the start.
const FINISH_REASONS: &[&str] = &["stop", "length"];
const FAILURE_KINDS: &[&str] = &[
    "invalid_value",
    "model_not_found",
    "overloaded",
    "no_decode_worker",
    "worker_failed",
    "shutting_down",
    "internal",
    "cancelled",
];

/// Buckets for predicted cached blocks.
const BLOCK_BUCKETS: &[f64] = &[
    0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0, 16384.0,
];

/// The router's metrics (shared through `AppState`).
pub struct RouterMetrics {
    registry: Registry,
    /// Arrival → first token.
    pub ttft: Histogram,
    /// Between consecutive tokens.
    pub itl: Histogram,
    /// Arrival → finish.
    pub e2e: Histogram,
    /// Finished requests by reason.
    pub success: IntCounterVec,
    /// Failed requests by kind.
    pub failure: IntCounterVec,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: IntCounter,
    /// Generated tokens of finished requests.
    pub generation_tokens: IntCounter,
    /// Prompt tokens the decode worker had cached, finished requests.
    pub cached_prompt_tokens: IntCounter,
    /// Selections by policy and chosen pair.
    pub routing: IntCounterVec,
    /// Predicted cached blocks of each selection.
    pub predicted_cached_blocks: Histogram,
    /// Attempts after a failure before the first token.
    pub retries: IntCounter,
    /// Resumptions after a mid-stream failure.
    pub migrations: IntCounter,
    /// Workers marked down on a transport failure.
    pub marked_down: IntCounter,
    /// Whether the events plane is reachable (registered only with one).
    pub events_connected: IntGauge,
    /// Snapshots asked for on the events plane.
    pub snapshot_requests: IntCounter,
    /// KV stream messages applied.
    pub kv_feed_messages: IntCounter,
    in_flight: IntGauge,
    workers: IntGaugeVec,
    index_blocks: IntGaugeVec,
}

impl RouterMetrics {
    /// Exposes `ferry_router_events_connected` (a router on the events plane calls it once).
    pub fn register_events_gauge(&self) {
        if let Err(e) = self
            .registry
            .register(Box::new(self.events_connected.clone()))
        {
            tracing::debug!(error = %e, "events gauge already registered");
        }
    }
}

impl std::fmt::Debug for RouterMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterMetrics").finish_non_exhaustive()
    }
}

/// Live values read at scrape time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Gauges {
    /// Admitted requests not yet finished.
    pub in_flight: usize,
    /// Healthy prefill workers.
    pub prefill_workers: usize,
    /// Healthy decode workers.
    pub decode_workers: usize,
}

/// Blocks the index holds per healthy worker, read at scrape time.
pub type IndexBlocks = Vec<(String, usize)>;

fn histogram(r: &Registry, name: &str, help: &str, b: &[f64]) -> prometheus::Result<Histogram> {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(b.to_vec()))?;
    r.register(Box::new(h.clone()))?;
    Ok(h)
}

fn counter(r: &Registry, name: &str, help: &str) -> prometheus::Result<IntCounter> {
    let c = IntCounter::with_opts(Opts::new(name, help))?;
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

fn counter_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

impl RouterMetrics {
    /// A fresh registry with every router metric.
    pub fn new() -> Self {
        Self::build().expect("invariant: the router's metric names and options are valid")
    }

    fn build() -> prometheus::Result<Self> {
        let labels = [("role".to_string(), "router".to_string())]
            .into_iter()
            .collect();
        let r = Registry::new_custom(None, Some(labels))?;

        let in_flight = IntGauge::with_opts(Opts::new(
            "ferry_router_requests_in_flight",
            "Requests admitted by the router and not yet finished",
        ))?;
        r.register(Box::new(in_flight.clone()))?;
        let events_connected = IntGauge::with_opts(Opts::new(
            "ferry_router_events_connected",
            "1 while the events plane is reachable, 0 while routing by load only",
        ))?;
        let workers = IntGaugeVec::new(
            Opts::new("ferry_router_workers", "Healthy registered workers by role"),
            &["worker_role"],
        )?;
        r.register(Box::new(workers.clone()))?;
        let index_blocks = IntGaugeVec::new(
            Opts::new(
                "ferry_router_index_blocks",
                "Blocks the prefix index holds per healthy worker",
            ),
            &["worker"],
        )?;
        r.register(Box::new(index_blocks.clone()))?;
        let success = counter_vec(
            &r,
            "ferry_request_success_total",
            "Finished requests by finish reason",
            &["finished_reason"],
        )?;
        let failure = counter_vec(
            &r,
            "ferry_request_failure_total",
            "Requests that failed or were cancelled, by kind",
            &["kind"],
        )?;
        for reason in FINISH_REASONS {
            success.with_label_values(&[reason]);
        }
        for kind in FAILURE_KINDS {
            failure.with_label_values(&[kind]);
        }
        Ok(Self {
            ttft: histogram(
                &r,
                "ferry_time_to_first_token_seconds",
                "Time to first token, from the request's arrival at the router",
                LATENCY_BUCKETS,
            )?,
            itl: histogram(
                &r,
                "ferry_inter_token_latency_seconds",
                "Time between consecutive output tokens of a request",
                STEP_BUCKETS,
            )?,
            e2e: histogram(
                &r,
                "ferry_e2e_request_latency_seconds",
                "End-to-end latency of finished requests, from their arrival at the router",
                LATENCY_BUCKETS,
            )?,
            success,
            failure,
            prompt_tokens: counter(
                &r,
                "ferry_prompt_tokens_total",
                "Prompt tokens of finished requests",
            )?,
            generation_tokens: counter(
                &r,
                "ferry_generation_tokens_total",
                "Generated tokens of finished requests",
            )?,
            cached_prompt_tokens: counter(
                &r,
                "ferry_prompt_cached_tokens_total",
                "Prompt tokens of finished requests that the decode worker already had cached",
            )?,
            routing: counter_vec(
                &r,
                "ferry_routing_decisions_total",
                "Routing decisions by policy and chosen workers (prefill_worker=\"none\": prefilled on the decode worker)",
                &["policy", "prefill_worker", "decode_worker"],
            )?,
            predicted_cached_blocks: histogram(
                &r,
                "ferry_routing_predicted_cached_blocks",
                "Prompt blocks the routing policy expected to find cached on the chosen workers",
                BLOCK_BUCKETS,
            )?,
            retries: counter(
                &r,
                "ferry_routing_retries_total",
                "Attempts sent to another decode worker after one failed before the request's first token",
            )?,
            migrations: counter(
                &r,
                "ferry_request_migrations_total",
                "Requests resumed on another decode worker (prompt + tokens already streamed) after theirs failed mid-stream",
            )?,
            events_connected,
            snapshot_requests: counter(
                &r,
                "ferry_router_kv_snapshot_requests_total",
                "Snapshots this router asked workers for on the events plane",
            )?,
            kv_feed_messages: counter(
                &r,
                "ferry_router_kv_feed_messages_total",
                "KV stream messages (snapshot parts, event batches) applied to the index",
            )?,
            marked_down: counter(
                &r,
                "ferry_routing_workers_marked_down_total",
                "Decode workers dropped from routing at once after a connect error or a broken stream",
            )?,
            in_flight,
            workers,
            index_blocks,
            registry: r,
        })
    }

    /// The text exposition, with the live `gauges`.
    pub fn render(&self, gauges: Gauges) -> String {
        self.render_with_index(gauges, Vec::new())
    }

    /// [`RouterMetrics::render`], with the index's block count per healthy worker (workers
    /// no longer healthy drop out of the series).
    pub fn render_with_index(&self, gauges: Gauges, index: IndexBlocks) -> String {
        let i = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        self.index_blocks.reset();
        for (worker, blocks) in &index {
            self.index_blocks
                .with_label_values(&[worker])
                .set(i(*blocks));
        }
        self.in_flight.set(i(gauges.in_flight));
        self.workers
            .with_label_values(&["prefill"])
            .set(i(gauges.prefill_workers));
        self.workers
            .with_label_values(&["decode"])
            .set(i(gauges.decode_workers));
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::warn!(error = %e, "metrics: encoding failed");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

impl Default for RouterMetrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family_with_the_role_label() {
        let m = RouterMetrics::new();
        m.success.with_label_values(&["length"]).inc();
        m.ttft.observe(0.01);
        let text = m.render(Gauges {
            in_flight: 2,
            prefill_workers: 1,
            decode_workers: 3,
        });
        assert!(text.contains("# TYPE ferry_time_to_first_token_seconds histogram"));
        assert!(
            text.contains(
                "ferry_request_failure_total{kind=\"no_decode_worker\",role=\"router\"} 0"
            ),
            "every failure kind exists from the start"
        );
        assert!(text
            .contains("ferry_request_success_total{finished_reason=\"length\",role=\"router\"} 1"));
        assert!(
            text.contains("ferry_router_workers{worker_role=\"decode\",role=\"router\"} 3"),
            "{text}"
        );
        assert!(text.contains("ferry_router_requests_in_flight{role=\"router\"} 2"));
    }
}
