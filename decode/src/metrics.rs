//! The decode worker's own metrics (the engine-derived ones are `ferry_worker::metrics`).
//!
//! | metric | type | what |
//! |---|---|---|
//! | `ferry_time_to_first_token_seconds` | histogram | `Decode` call in → first token out of the engine (includes any remote prefill) |
//! | `ferry_inter_token_latency_seconds` | histogram | gap between consecutive tokens of one request |
//! | `ferry_e2e_request_latency_seconds` | histogram | `Decode` call in → finish, finished requests |
//! | `ferry_request_success_total{finished_reason}` | counter | finished requests (`stop`, `length`) |
//! | `ferry_request_failure_total{kind}` | counter | `invalid_argument`, `overloaded`, `failed`, `cancelled` (client went away) |
//! | `ferry_prompt_tokens_total`, `ferry_generation_tokens_total` | counter | tokens of finished requests |
//! | `ferry_remote_prefill_duration_seconds` | histogram | asking the prefill peer → its answer (KV landed) |
//! | `ferry_remote_prefill_failures_total` | counter | remote prefills that failed or timed out |
//!
//! Speculative decoding (drafts, accepted tokens, acceptance length) and the KV bytes received
//! are engine totals: `ferry_worker::metrics` reads them from the engine at scrape time.

use ferry_worker::metrics::{counter, counter_vec, histogram, LATENCY_BUCKETS, STEP_BUCKETS};
use prometheus::{Histogram, IntCounter, IntCounterVec, Registry};

/// Registered in the worker's registry by [`DecodeMetrics::register`]; cheap to clone.
#[derive(Debug, Clone)]
pub struct DecodeMetrics {
    /// Call in → first token.
    pub ttft: Histogram,
    /// Between consecutive tokens.
    pub itl: Histogram,
    /// Call in → finish.
    pub e2e: Histogram,
    /// Finished requests by reason.
    pub success: IntCounterVec,
    /// Failed requests by kind.
    pub failure: IntCounterVec,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: IntCounter,
    /// Generated tokens of finished requests.
    pub generation_tokens: IntCounter,
    /// Remote prefill calls that succeeded, by duration.
    pub remote_prefill: Histogram,
    /// Remote prefill calls that failed.
    pub remote_prefill_failures: IntCounter,
}

/// Every `finished_reason` and failure `kind`, created at zero.
const FINISH_REASONS: &[&str] = &["stop", "length"];
const FAILURE_KINDS: &[&str] = &["invalid_argument", "overloaded", "failed", "cancelled"];

impl DecodeMetrics {
    /// Registers the decode metrics in `r`.
    pub fn register(r: &Registry) -> prometheus::Result<Self> {
        let m = Self::build(r)?;
        for reason in FINISH_REASONS {
            m.success.with_label_values(&[reason]);
        }
        for kind in FAILURE_KINDS {
            m.failure.with_label_values(&[kind]);
        }
        Ok(m)
    }

    fn build(r: &Registry) -> prometheus::Result<Self> {
        Ok(Self {
            ttft: histogram(
                r,
                "ferry_time_to_first_token_seconds",
                "Time to first token, from the request's arrival at this process",
                LATENCY_BUCKETS,
            )?,
            itl: histogram(
                r,
                "ferry_inter_token_latency_seconds",
                "Time between consecutive output tokens of a request",
                STEP_BUCKETS,
            )?,
            e2e: histogram(
                r,
                "ferry_e2e_request_latency_seconds",
                "End-to-end latency of finished requests, from their arrival at this process",
                LATENCY_BUCKETS,
            )?,
            success: counter_vec(
                r,
                "ferry_request_success_total",
                "Finished requests by finish reason",
                &["finished_reason"],
            )?,
            failure: counter_vec(
                r,
                "ferry_request_failure_total",
                "Requests that failed or were cancelled, by kind",
                &["kind"],
            )?,
            prompt_tokens: counter(
                r,
                "ferry_prompt_tokens_total",
                "Prompt tokens of finished requests",
            )?,
            generation_tokens: counter(
                r,
                "ferry_generation_tokens_total",
                "Generated tokens of finished requests",
            )?,
            remote_prefill: histogram(
                r,
                "ferry_remote_prefill_duration_seconds",
                "Remote prefill: asking the prefill worker until it answered (the KV has landed)",
                LATENCY_BUCKETS,
            )?,
            remote_prefill_failures: counter(
                r,
                "ferry_remote_prefill_failures_total",
                "Remote prefills that failed or timed out",
            )?,
        })
    }
}
