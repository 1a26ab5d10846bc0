//! Engine counters → wire messages.

use ferry_model::engine::EngineStats;
use ferry_proto::internal::{WorkerLoad, WorkerStats};

fn u32_sat(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// The load a heartbeat reports.
pub fn load(s: &EngineStats) -> WorkerLoad {
    WorkerLoad {
        running_requests: u32_sat(s.running),
        waiting_requests: u32_sat(s.waiting),
        kv_blocks_used: u32_sat(s.kv_blocks_used),
        kv_blocks_total: u32_sat(s.kv_blocks_total),
        queued_prefill_tokens: s.queued_prefill_tokens,
    }
}

/// `GetStats` for a worker; `kv_transfer_bytes` is the worker's own transfer counter.
pub fn worker_stats(worker_id: &str, s: &EngineStats, kv_transfer_bytes: u64) -> WorkerStats {
    WorkerStats {
        worker_id: worker_id.to_string(),
        prefill_computed_tokens: s.prefill_computed_tokens,
        prefill_reused_tokens: s.prefill_reused_tokens,
        requests_finished: s.requests_finished,
        remote_prefills: s.remote_prefills,
        local_prefills: s.local_prefills,
        recomputed_prefills: s.recomputed_prefills,
        kv_blocks_used: u32_sat(s.kv_blocks_used),
        kv_blocks_total: u32_sat(s.kv_blocks_total),
        kv_blocks_cached: u32_sat(s.kv_blocks_cached),
        kv_transfer_bytes,
        running_requests: u32_sat(s.running),
        waiting_requests: u32_sat(s.waiting),
        forked_samples: s.forked_samples,
        fork_tail_tokens: s.fork_tail_tokens,
    }
}
