//! Prometheus metrics every worker serves on `--metrics-addr` (`GET /metrics`, text format).
//!
//! | what | where it comes from |
//! |---|---|
//! | engine gauges and counters (running / waiting requests, KV blocks, prefix-cache hits, requests finished; decode: prefill modes, KV bytes received, speculative decoding) | [`EngineStats`], read from the engine thread at scrape time |
//! | `ferry_request_queue_time_seconds` | the engine's `queue` spans, timed by [`queue_time_layer`] |
//! | role metrics (TTFT, KV transfer, …) | `ferry-prefill` / `ferry-decode` `metrics.rs`, registered into [`WorkerMetrics::registry`] |
//!
//! The engine thread is never instrumented for metrics: its counters already exist in
//! [`EngineStats`], and the one duration only it knows (admission → first batch) is the `queue`
//! span it opens anyway for traces. Names follow vLLM's and SGLang's, with the `ferry_` prefix
//! and a unit suffix; every series carries the constant labels `role` and `worker_id`.

use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use ferry_model::engine::{EngineHandle, EngineStats};
use ferry_proto::internal::WorkerRole;
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::span::{Attributes, Id};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

use crate::serve::{role_name, ServeError};

/// Latency buckets in seconds, for request-level durations (TTFT, end to end, queue): from
/// sub-millisecond CPU steps to the minutes a long prompt can wait.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
];

/// Buckets in seconds for per-token gaps (inter-token latency) and KV transfers.
pub const STEP_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0,
];

/// A counter registered in `registry`.
pub fn counter(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntCounter> {
    let c = IntCounter::with_opts(Opts::new(name, help))?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

/// A counter family with `labels`, registered in `registry`.
pub fn counter_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

/// A histogram with `buckets`, registered in `registry`.
pub fn histogram(
    registry: &Registry,
    name: &str,
    help: &str,
    buckets: &[f64],
) -> prometheus::Result<Histogram> {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))?;
    registry.register(Box::new(h.clone()))?;
    Ok(h)
}

fn int_gauge(registry: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
    let g = IntGauge::with_opts(Opts::new(name, help))?;
    registry.register(Box::new(g.clone()))?;
    Ok(g)
}

fn gauge(registry: &Registry, name: &str, help: &str) -> prometheus::Result<Gauge> {
    let g = Gauge::with_opts(Opts::new(name, help))?;
    registry.register(Box::new(g.clone()))?;
    Ok(g)
}

/// Moves a counter mirrored from an engine total up to `total` (engine totals never go down).
fn advance(c: &IntCounter, total: u64) {
    let now = c.get();
    if total > now {
        c.inc_by(total - now);
    }
}

/// Admission → first batch, per request, from the engine's `queue` spans (process-wide: the
/// spans of every engine in the process land here).
static QUEUE_TIME: LazyLock<Histogram> = LazyLock::new(|| {
    Histogram::with_opts(
        HistogramOpts::new(
            "ferry_request_queue_time_seconds",
            "Time requests waited in the engine queue before their first batch",
        )
        .buckets(LATENCY_BUCKETS.to_vec()),
    )
    .expect("invariant: static histogram options are valid")
});

/// Engine-derived series, refreshed from [`EngineStats`] at each scrape.
struct EngineSeries {
    running: IntGauge,
    waiting: IntGauge,
    queued_prefill_tokens: IntGauge,
    kv_used: IntGauge,
    kv_free: IntGauge,
    kv_cached: IntGauge,
    kv_total: IntGauge,
    kv_usage: Gauge,
    computed_tokens: IntCounter,
    query_tokens: IntCounter,
    hit_tokens: IntCounter,
    hit_rate: Gauge,
    finished: IntCounter,
    /// GPU engines: decode steps replayed from CUDA graphs.
    graph_steps: IntCounter,
    /// GPU engines: prefill-job forwards that shipped layers, layers handed to their sink
    /// before the last layer was computed, and the summed ship tail.
    ship_forwards: IntCounter,
    ship_early: IntCounter,
    ship_tail_us: IntCounter,
    /// Engine steps by kind (`decode`, `spec_round`, `prompt`), and their summed wall time by
    /// kind and phase (`plan`, `launch`, `sample`, `commit`).
    steps: IntCounterVec,
    step_us: IntCounterVec,
    step_sequences: IntCounterVec,
    step_rows: IntCounterVec,
    step_graphed: IntCounterVec,
    /// Decode workers only.
    decode: Option<DecodeSeries>,
}

/// What only decode workers report.
struct DecodeSeries {
    /// Prefills by where they ran.
    modes: IntCounterVec,
    /// KV bytes received from peers.
    received: IntCounter,
    /// Speculative rounds, drafted and accepted tokens, mean tokens per round.
    spec_rounds: IntCounter,
    spec_drafted: IntCounter,
    spec_accepted: IntCounter,
    spec_acceptance_length: Gauge,
}

impl DecodeSeries {
    fn register(r: &Registry) -> prometheus::Result<Self> {
        let modes = counter_vec(
            r,
            "ferry_prefills_total",
            "Decode requests by where their prompt KV was computed: remote (a prefill worker), local, recomputed (locally after a remote failure)",
            &["mode"],
        )?;
        let received = IntCounter::with_opts(
            Opts::new(
                "ferry_kv_transfer_bytes_total",
                "KV cache bytes moved between workers",
            )
            .const_label("direction", "receive"),
        )?;
        r.register(Box::new(received.clone()))?;
        for mode in ["remote", "local", "recomputed"] {
            modes.with_label_values(&[mode]);
        }
        Ok(Self {
            modes,
            received,
            spec_rounds: counter(
                r,
                "ferry_spec_decode_num_drafts_total",
                "Speculative decoding rounds (one per drafting sequence per step)",
            )?,
            spec_drafted: counter(
                r,
                "ferry_spec_decode_num_draft_tokens_total",
                "Draft tokens verified",
            )?,
            spec_accepted: counter(
                r,
                "ferry_spec_decode_num_accepted_tokens_total",
                "Draft tokens accepted by verification",
            )?,
            spec_acceptance_length: gauge(
                r,
                "ferry_spec_decode_acceptance_length",
                "Mean tokens emitted per speculative round since start: (accepted + rounds) / rounds (SGLang's spec_accept_length); 0 before the first round",
            )?,
        })
    }

    fn update(&self, s: &EngineStats) {
        advance(
            &self.modes.with_label_values(&["remote"]),
            s.remote_prefills,
        );
        advance(&self.modes.with_label_values(&["local"]), s.local_prefills);
        advance(
            &self.modes.with_label_values(&["recomputed"]),
            s.recomputed_prefills,
        );
        advance(&self.received, s.kv_bytes_received);
        advance(&self.spec_rounds, s.spec_rounds);
        advance(&self.spec_drafted, s.spec_drafted_tokens);
        advance(&self.spec_accepted, s.spec_accepted_tokens);
        self.spec_acceptance_length.set(if s.spec_rounds == 0 {
            0.0
        } else {
            (s.spec_accepted_tokens + s.spec_rounds) as f64 / s.spec_rounds as f64
        });
    }
}

impl EngineSeries {
    fn register(r: &Registry, role: WorkerRole) -> prometheus::Result<Self> {
        let decode = if role == WorkerRole::Decode {
            Some(DecodeSeries::register(r)?)
        } else {
            None
        };
        Ok(Self {
            running: int_gauge(
                r,
                "ferry_num_requests_running",
                "Requests in the running batch",
            )?,
            waiting: int_gauge(
                r,
                "ferry_num_requests_waiting",
                "Requests waiting: queued for prefill, or awaiting a peer's KV",
            )?,
            queued_prefill_tokens: int_gauge(
                r,
                "ferry_queued_prefill_tokens",
                "Prompt tokens queued and not yet computed",
            )?,
            kv_used: int_gauge(
                r,
                "ferry_kv_cache_used_blocks",
                "KV blocks referenced by live requests",
            )?,
            kv_free: int_gauge(
                r,
                "ferry_kv_cache_free_blocks",
                "KV blocks on the free list",
            )?,
            kv_cached: int_gauge(
                r,
                "ferry_kv_cache_cached_blocks",
                "KV blocks held only by the prefix cache (reusable, evictable)",
            )?,
            kv_total: int_gauge(r, "ferry_kv_cache_total_blocks", "KV blocks in the pool")?,
            kv_usage: gauge(
                r,
                "ferry_kv_cache_usage_ratio",
                "Fraction of KV blocks used by live requests (0 to 1; vLLM's kv_cache_usage_perc)",
            )?,
            computed_tokens: counter(
                r,
                "ferry_prefill_computed_tokens_total",
                "Prompt tokens computed by prefills on this worker",
            )?,
            query_tokens: counter(
                r,
                "ferry_prefix_cache_queries_tokens_total",
                "Prompt tokens looked up in the prefix cache",
            )?,
            hit_tokens: counter(
                r,
                "ferry_prefix_cache_hits_tokens_total",
                "Prompt tokens found in the prefix cache (reused, not computed)",
            )?,
            hit_rate: gauge(
                r,
                "ferry_prefix_cache_hit_rate",
                "Prefix-cache hit tokens / queried tokens since start (0 to 1)",
            )?,
            finished: counter(
                r,
                "ferry_engine_requests_finished_total",
                "Requests the engine ended, any outcome (decode requests and prefill jobs)",
            )?,
            graph_steps: counter(
                r,
                "ferry_engine_graph_steps_total",
                "Engine steps replayed from a CUDA graph (decode-only steps on a GPU)",
            )?,
            ship_forwards: counter(
                r,
                "ferry_kv_ship_forwards_total",
                "Forwards on a GPU that shipped prefill-job layers to a peer",
            )?,
            ship_early: counter(
                r,
                "ferry_kv_ship_layers_early_total",
                "Shipped layers handed to the transfer before the forward's last layer was computed (GPU layer-wise shipping)",
            )?,
            ship_tail_us: counter(
                r,
                "ferry_kv_ship_tail_microseconds_total",
                "Summed wall time from the end of each shipping forward to its last layer handed to the transfer (the shipping the forward did not hide); divide by ferry_kv_ship_forwards_total",
            )?,
            steps: counter_vec(
                r,
                "ferry_engine_steps_total",
                "Engine steps (batches) by kind: decode (decode-only, no drafts verified), spec_round (decode-only, drafts verified), prompt (with prompt work)",
                &["kind"],
            )?,
            step_us: counter_vec(
                r,
                "ferry_engine_step_microseconds_total",
                "Summed host wall time of engine steps by kind and phase: plan (the drafter pass), launch (inputs and the forward's launches), sample (sampling or verification, on a GPU the wait for the forward included), commit (tables, tokens sent, drafter context); sum the phases and divide by ferry_engine_steps_total for the mean step",
                &["kind", "phase"],
            )?,
            step_sequences: counter_vec(
                r,
                "ferry_engine_step_sequences_total",
                "Decoding sequences (prompt work not counted) summed over engine steps by kind; divide by ferry_engine_steps_total for how full a step of that kind was",
                &["kind"],
            )?,
            step_rows: counter_vec(
                r,
                "ferry_engine_step_decode_rows_total",
                "Decode rows summed over engine steps by kind: one per running sequence plus the drafts it verified (prompt tokens not counted)",
                &["kind"],
            )?,
            step_graphed: counter_vec(
                r,
                "ferry_engine_steps_graphed_total",
                "Engine steps by kind whose target forward was replayed from a CUDA graph (the rest ran eagerly); divide by ferry_engine_steps_total for the share",
                &["kind"],
            )?,
            decode,
        })
    }

    fn update(&self, s: &EngineStats) {
        let i = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        self.running.set(i(s.running));
        self.waiting.set(i(s.waiting));
        self.queued_prefill_tokens
            .set(i64::try_from(s.queued_prefill_tokens).unwrap_or(i64::MAX));
        self.kv_used.set(i(s.kv_blocks_used));
        self.kv_cached.set(i(s.kv_blocks_cached));
        self.kv_total.set(i(s.kv_blocks_total));
        self.kv_free.set(i(s
            .kv_blocks_total
            .saturating_sub(s.kv_blocks_used)
            .saturating_sub(s.kv_blocks_cached)));
        self.kv_usage.set(if s.kv_blocks_total == 0 {
            0.0
        } else {
            s.kv_blocks_used as f64 / s.kv_blocks_total as f64
        });
        let queried = s.prefill_computed_tokens + s.prefill_reused_tokens;
        advance(&self.computed_tokens, s.prefill_computed_tokens);
        advance(&self.query_tokens, queried);
        advance(&self.hit_tokens, s.prefill_reused_tokens);
        self.hit_rate.set(if queried == 0 {
            0.0
        } else {
            s.prefill_reused_tokens as f64 / queried as f64
        });
        advance(&self.finished, s.requests_finished);
        advance(&self.graph_steps, s.graph_steps);
        advance(&self.ship_forwards, s.kv_ship_forwards);
        advance(&self.ship_early, s.kv_layers_shipped_early);
        advance(&self.ship_tail_us, s.kv_ship_tail_us);
        for (kind, k) in s.step_times.kinds() {
            advance(&self.steps.with_label_values(&[kind]), k.steps);
            advance(&self.step_sequences.with_label_values(&[kind]), k.sequences);
            advance(&self.step_rows.with_label_values(&[kind]), k.decode_rows);
            advance(&self.step_graphed.with_label_values(&[kind]), k.graphed);
            for (phase, us) in [
                ("plan", k.plan_us),
                ("launch", k.launch_us),
                ("sample", k.sample_us),
                ("commit", k.commit_us),
            ] {
                advance(&self.step_us.with_label_values(&[kind, phase]), us);
            }
        }
        if let Some(decode) = &self.decode {
            decode.update(s);
        }
    }
}

/// One worker's metrics: its registry (role crates add theirs) and the engine series.
pub struct WorkerMetrics {
    registry: Registry,
    engine: EngineSeries,
    /// One scrape at a time refreshes the mirrored engine counters.
    refresh: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for WorkerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerMetrics").finish_non_exhaustive()
    }
}

impl WorkerMetrics {
    /// A registry labelled `role` and `worker_id`, with the engine series and the queue-time
    /// histogram registered.
    pub fn new(role: WorkerRole, worker_id: &str) -> Result<Self, ServeError> {
        let labels = [
            ("role".to_string(), role_name(role).to_string()),
            ("worker_id".to_string(), worker_id.to_string()),
        ]
        .into_iter()
        .collect();
        let build = || -> prometheus::Result<Self> {
            let registry = Registry::new_custom(None, Some(labels))?;
            let engine = EngineSeries::register(&registry, role)?;
            registry.register(Box::new(QUEUE_TIME.clone()))?;
            Ok(Self {
                registry,
                engine,
                refresh: tokio::sync::Mutex::new(()),
            })
        };
        build().map_err(|e| ServeError::Metrics(e.to_string()))
    }

    /// The registry role crates register their metrics in.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The text exposition of every metric, with the engine series read from `engine` now.
    pub async fn render(&self, engine: &EngineHandle) -> String {
        let _one = self.refresh.lock().await;
        match engine.stats().await {
            Ok(s) => self.engine.update(&s),
            Err(e) => tracing::debug!(error = %e, "metrics: engine stats unavailable"),
        }
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::warn!(error = %e, "metrics: encoding failed");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// A bound, not yet serving, metrics listener.
#[derive(Debug)]
pub struct MetricsListener {
    listener: TcpListener,
    addr: SocketAddr,
}

impl MetricsListener {
    /// Binds `addr` (port 0 picks one; read it back with [`MetricsListener::local_addr`]).
    pub async fn bind(addr: SocketAddr) -> Result<Self, ServeError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| ServeError::Transport(format!("metrics listener {addr}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| ServeError::Transport(e.to_string()))?;
        Ok(Self { listener, addr })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves `GET /metrics` until `shutdown`.
    pub fn spawn(
        self,
        metrics: Arc<WorkerMetrics>,
        engine: EngineHandle,
        shutdown: CancellationToken,
    ) -> JoinHandle<()> {
        let app = axum::Router::new()
            .route("/metrics", axum::routing::get(scrape))
            .with_state((metrics, engine));
        let addr = self.addr;
        tokio::spawn(async move {
            let served = axum::serve(self.listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await;
            if let Err(e) = served {
                tracing::warn!(%addr, error = %e, "metrics server stopped");
            }
        })
    }
}

async fn scrape(
    State((metrics, engine)): State<(Arc<WorkerMetrics>, EngineHandle)>,
) -> impl IntoResponse {
    (
        [(CONTENT_TYPE, prometheus::TEXT_FORMAT)],
        metrics.render(&engine).await,
    )
}

/// When a `queue` span opened.
struct QueueStart(Instant);

fn is_queue_span(meta: &tracing::Metadata<'_>) -> bool {
    meta.is_span() && meta.name() == "queue" && meta.target().starts_with("ferry_model::engine")
}

/// Times the engine's `queue` spans into `ferry_request_queue_time_seconds`. Installed by the
/// CLI in worker processes; it sees only those spans (a per-layer filter), so it costs one
/// timestamp per request.
pub fn queue_time_layer<S>() -> impl Layer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    QueueTimeLayer.with_filter(tracing_subscriber::filter::filter_fn(is_queue_span))
}

struct QueueTimeLayer;

impl<S> Layer<S> for QueueTimeLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, _attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(QueueStart(Instant::now()));
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id) {
            if let Some(QueueStart(at)) = span.extensions().get::<QueueStart>() {
                QUEUE_TIME.observe(at.elapsed().as_secs_f64());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_model::engine::{StepKind, StepTimes};

    /// A step kind of `steps` steps with `[plan, launch, sample, commit]` µs.
    fn kind(steps: u64, [plan_us, launch_us, sample_us, commit_us]: [u64; 4]) -> StepKind {
        StepKind {
            steps,
            plan_us,
            launch_us,
            sample_us,
            commit_us,
            sequences: steps * 3,
            decode_rows: steps * 5,
            graphed: steps,
        }
    }

    #[test]
    fn engine_counters_follow_the_stats_and_never_go_down() {
        let m = EngineSeries::register(&Registry::new(), WorkerRole::Decode).expect("register");
        let mut s = EngineStats {
            prefill_computed_tokens: 30,
            prefill_reused_tokens: 10,
            kv_blocks_used: 4,
            kv_blocks_cached: 2,
            kv_blocks_total: 16,
            remote_prefills: 3,
            spec_rounds: 4,
            spec_drafted_tokens: 12,
            spec_accepted_tokens: 6,
            graph_steps: 9,
            kv_ship_forwards: 2,
            kv_layers_shipped_early: 5,
            kv_ship_tail_us: 700,
            step_times: StepTimes {
                decode: kind(10, [0, 600, 300, 100]),
                round: kind(4, [300, 400, 300, 200]),
                prompt: kind(2, [0, 4_000, 800, 200]),
            },
            ..EngineStats::default()
        };
        m.update(&s);
        assert_eq!(m.graph_steps.get(), 9);
        let steps =
            ["decode", "spec_round", "prompt"].map(|k| m.steps.with_label_values(&[k]).get());
        assert_eq!(steps, [10, 4, 2]);
        let us = |k: &str, p: &str| m.step_us.with_label_values(&[k, p]).get();
        assert_eq!(
            ["plan", "launch", "sample", "commit"].map(|p| us("spec_round", p)),
            [300, 400, 300, 200]
        );
        assert_eq!(us("prompt", "launch"), 4_000);
        let per =
            |v: &IntCounterVec| ["decode", "spec_round"].map(|k| v.with_label_values(&[k]).get());
        assert_eq!(per(&m.step_sequences), [30, 12]);
        assert_eq!(per(&m.step_rows), [50, 20]);
        assert_eq!(per(&m.step_graphed), [10, 4]);
        assert_eq!(
            (
                m.ship_forwards.get(),
                m.ship_early.get(),
                m.ship_tail_us.get()
            ),
            (2, 5, 700)
        );
        assert_eq!(m.query_tokens.get(), 40);
        assert_eq!(m.hit_tokens.get(), 10);
        assert!((m.hit_rate.get() - 0.25).abs() < 1e-12);
        assert_eq!(m.kv_free.get(), 10);
        assert!((m.kv_usage.get() - 0.25).abs() < 1e-12);
        s.remote_prefills = 5;
        m.update(&s);
        let decode = m.decode.as_ref().expect("decode series");
        assert_eq!(decode.modes.with_label_values(&["remote"]).get(), 5);
        assert_eq!(decode.spec_drafted.get(), 12);
        assert!((decode.spec_acceptance_length.get() - 2.5).abs() < 1e-12);
        s.prefill_computed_tokens = 0;
        m.update(&s);
        assert_eq!(m.computed_tokens.get(), 30, "a counter never goes down");
    }

    #[test]
    fn queue_spans_are_timed_into_the_histogram() {
        use tracing_subscriber::layer::SubscriberExt;
        let before = QUEUE_TIME.get_sample_count();
        let subscriber = tracing_subscriber::registry().with(queue_time_layer());
        tracing::subscriber::with_default(subscriber, || {
            let other = tracing::info_span!("queue");
            drop(other);
            let span = tracing::info_span!(target: "ferry_model::engine::scheduler", "queue");
            drop(span);
        });
        assert_eq!(QUEUE_TIME.get_sample_count(), before + 1);
    }
}
