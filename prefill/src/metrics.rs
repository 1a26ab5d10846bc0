//! The prefill worker's own metrics (the engine-derived ones are `ferry_worker::metrics`).
//!
//! | metric | type | what |
//! |---|---|---|
//! | `ferry_prefill_requests_total{outcome}` | counter | `Prefill` calls by outcome (`ok`, `error`) |
//! | `ferry_prompt_tokens_total` | counter | prompt tokens of successful prefill requests |
//! | `ferry_prefill_duration_seconds` | histogram | one `Prefill` call, request in → KV landed and first token out |
//! | `ferry_kv_transfer_bytes_total{direction="send"}` | counter | KV bytes landed in decode workers' pools |
//! | `ferry_kv_transfer_duration_seconds` | histogram | one transfer: connect → every layer written → flush acknowledged |
//! | `ferry_kv_transfer_failures_total` | counter | transfers that failed (connect, write or flush) |
//! | `ferry_kv_transfer_tail_seconds` | histogram | the end of the prefill forward → flush acknowledged: what the decode worker waits for beyond the compute |

use ferry_worker::metrics::{counter, counter_vec, histogram, LATENCY_BUCKETS, STEP_BUCKETS};
use prometheus::{Histogram, IntCounter, IntCounterVec, Opts, Registry};

/// Registered in the worker's registry by [`PrefillMetrics::register`].
#[derive(Debug, Clone)]
pub struct PrefillMetrics {
    /// `Prefill` calls by outcome.
    pub requests: IntCounterVec,
    /// Prompt tokens of successful calls.
    pub prompt_tokens: IntCounter,
    /// Duration of successful calls.
    pub duration: Histogram,
    /// KV bytes sent.
    pub kv_bytes: IntCounter,
    /// Duration of successful transfers.
    pub kv_duration: Histogram,
    /// Failed transfers.
    pub kv_failures: IntCounter,
    /// Forward end → flush acknowledged, of successful transfers.
    pub kv_tail: Histogram,
}

impl PrefillMetrics {
    /// Registers the prefill metrics in `r`.
    pub fn register(r: &Registry) -> prometheus::Result<Self> {
        let kv_bytes = IntCounter::with_opts(
            Opts::new(
                "ferry_kv_transfer_bytes_total",
                "KV cache bytes moved between workers",
            )
            .const_label("direction", "send"),
        )?;
        r.register(Box::new(kv_bytes.clone()))?;
        let requests = counter_vec(
            r,
            "ferry_prefill_requests_total",
            "Prefill requests served, by outcome",
            &["outcome"],
        )?;
        for outcome in ["ok", "error"] {
            requests.with_label_values(&[outcome]);
        }
        Ok(Self {
            requests,
            prompt_tokens: counter(
                r,
                "ferry_prompt_tokens_total",
                "Prompt tokens of successful prefill requests",
            )?,
            duration: histogram(
                r,
                "ferry_prefill_duration_seconds",
                "Prefill request duration: request in, KV landed at the destination, first token out",
                LATENCY_BUCKETS,
            )?,
            kv_bytes,
            kv_duration: histogram(
                r,
                "ferry_kv_transfer_duration_seconds",
                "KV transfer duration: connect, every layer written, flush acknowledged",
                STEP_BUCKETS,
            )?,
            kv_failures: counter(
                r,
                "ferry_kv_transfer_failures_total",
                "KV transfers that failed (connect, write or flush)",
            )?,
            kv_tail: histogram(
                r,
                "ferry_kv_transfer_tail_seconds",
                "KV transfer tail: the end of the prefill forward to the flush acknowledgement \
                 (what the decode worker waits for beyond the compute)",
                STEP_BUCKETS,
            )?,
        })
    }
}
