//! Replays a Mooncake-format request trace through every routing policy on a simulated
//! cluster and prints one markdown table (see `ferry_router::replay` for the rules):
//!
//! ```text
//! cargo run --release -p ferry-router --example replay_trace -- \
//!     ../shared/traces/mooncake/conversation_trace.jsonl --prefill-workers 8 --rate-scale 1
//! ```
use anyhow::Context;
use clap::Parser;
use ferry_router::config::PolicyKind;
use ferry_router::policy::{Mooncake, Policy, PrefillCostModel};
use ferry_router::replay::{parse_trace, replay, ReplayConfig};

#[derive(Parser)]
struct Args {
    /// JSONL trace: {timestamp ms, input_length, output_length, hash_ids of 512-token blocks}.
    trace: std::path::PathBuf,
    /// Prefill workers.
    #[arg(long, default_value_t = 8)]
    prefill_workers: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 8)]
    decode_workers: usize,
    /// Prefix-cache capacity per prefill worker, in 512-token blocks.
    #[arg(long, default_value_t = 8192)]
    cache_blocks: usize,
    /// Arrival times are divided by this (load multiplier).
    #[arg(long, default_value_t = 1.0)]
    rate_scale: f64,
    /// Reject requests whose estimated TTFT exceeds this many seconds (`mooncake` only).
    #[arg(long)]
    ttft_slo_s: Option<f64>,
    /// Engine: seconds per new token (weight work).
    #[arg(long, default_value_t = 5e-5)]
    per_token_s: f64,
    /// Engine: seconds per attended (query, key) pair.
    #[arg(long, default_value_t = 6e-9)]
    per_token_pair_s: f64,
    /// Instead of the policy table: `cache_aware` through 1 router and through N routers
    /// (shared predictive load off and on), all with heartbeats every `--heartbeat-ms` (what
    /// routers on the events plane see: docs/deploy.md, "Several routers").
    #[arg(long)]
    routers: Option<usize>,
    /// Heartbeat period for `--routers` (the workers' default is 200 ms).
    #[arg(long, default_value_t = 200.0)]
    heartbeat_ms: f64,
    /// With `--routers`: also write the rows as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let text = std::fs::read_to_string(&a.trace)
        .with_context(|| format!("reading {}", a.trace.display()))?;
    let trace = parse_trace(&text)?;
    let engine = PrefillCostModel {
        per_token_s: a.per_token_s,
        per_token_pair_s: a.per_token_pair_s,
    };
    let cfg = ReplayConfig {
        prefill_workers: a.prefill_workers,
        decode_workers: a.decode_workers,
        cache_blocks: a.cache_blocks,
        engine,
        rate_scale: a.rate_scale,
        ttft_slo_s: a.ttft_slo_s,
        ..ReplayConfig::default()
    };
    println!(
        "{} requests, {} prefill workers × {} cache blocks, rate × {}\n",
        trace.len(),
        cfg.prefill_workers,
        cfg.cache_blocks,
        cfg.rate_scale
    );
    if let Some(n) = a.routers {
        return routers_table(&trace, &cfg, n, a.heartbeat_ms / 1e3, a.json.as_deref());
    }
    println!(
        "| policy | TTFT mean s | p50 | p90 | p99 | token hit | busiest P / mean | rejected |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for kind in PolicyKind::ALL {
        let policy = match kind {
            // Given the engine's own model: a perfectly fitted estimator, as in the paper.
            PolicyKind::Mooncake => Policy::Mooncake(Mooncake { cost: engine }),
            k => Policy::new(k),
        };
        let r = replay(&trace, &cfg, &policy);
        println!(
            "| {kind} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} % | {:.2} | {} |",
            r.ttft_mean_s,
            r.ttft_p50_s,
            r.ttft_p90_s,
            r.ttft_p99_s,
            100.0 * r.token_hit_ratio,
            r.max_share,
            r.rejected
        );
    }
    Ok(())
}

/// `cache_aware` through 1 router, then `n` routers without and with shared predictive load.
fn routers_table(
    trace: &[ferry_router::replay::TraceRequest],
    cfg: &ReplayConfig,
    n: usize,
    heartbeat_s: f64,
    json: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    println!(
        "cache_aware, heartbeats every {:.0} ms\n",
        heartbeat_s * 1e3
    );
    println!(
        "| routers | shared load | TTFT mean s | p50 | p90 | p99 | token hit | busiest P / mean |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let policy = Policy::new(PolicyKind::CacheAware);
    let mut rows = Vec::new();
    for (routers, share) in [(1, true), (n, false), (n, true)] {
        let cfg = ReplayConfig {
            routers,
            heartbeat_s,
            share_load: share,
            ..*cfg
        };
        let r = replay(trace, &cfg, &policy);
        let shared = if routers == 1 {
            "—"
        } else if share {
            "on"
        } else {
            "off"
        };
        println!(
            "| {routers} | {shared} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} % | {:.2} |",
            r.ttft_mean_s,
            r.ttft_p50_s,
            r.ttft_p90_s,
            r.ttft_p99_s,
            100.0 * r.token_hit_ratio,
            r.max_share
        );
        rows.push(serde_json::json!({
            "routers": routers, "share_load": share, "heartbeat_ms": heartbeat_s * 1e3,
            "rate_scale": cfg.rate_scale, "requests": r.requests,
            "ttft_mean_s": r.ttft_mean_s, "ttft_p50_s": r.ttft_p50_s, "ttft_p90_s": r.ttft_p90_s,
            "ttft_p99_s": r.ttft_p99_s, "token_hit_ratio": r.token_hit_ratio, "max_share": r.max_share,
        }));
    }
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
