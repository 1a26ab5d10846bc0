//! Where the host waits on the GPU (`FERRY_SYNC_SITES=1`, a diagnostic; off by default).
//!
//! Every [`CudaDevice::synchronize`](super::CudaDevice::synchronize) — which every blocking
//! write and every download ends in — is counted by its caller, with the time the host spent
//! waiting there. An eager forward that waits many times in the middle of its launches leaves
//! the GPU idle while the host queues the next kernels; this says which call sites do it and
//! how long each waited. The caller is found from a resolved backtrace (function names only,
//! so a binary stripped of debug info but not of symbols, `strip --strip-debug`, still names
//! them), which costs far more than the wait itself: a run with the switch on measures where
//! and how often, not how fast.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Frames of the caller chain kept in a site's name (innermost first, below the device's own).
const DEPTH: usize = 3;

/// Waits by site: count and total seconds.
type Sites = HashMap<String, (u64, f64)>;

fn sites() -> Option<&'static Mutex<Sites>> {
    static SITES: OnceLock<Option<Mutex<Sites>>> = OnceLock::new();
    SITES
        .get_or_init(|| {
            (std::env::var("FERRY_SYNC_SITES").as_deref() == Ok("1"))
                .then(|| Mutex::new(HashMap::new()))
        })
        .as_ref()
}

/// Whether waits are being counted (`FERRY_SYNC_SITES=1`).
pub fn enabled() -> bool {
    sites().is_some()
}

/// Counts one wait of `waited` at the current call site (a no-op unless [`enabled`]).
pub(crate) fn record(waited: Duration) {
    let Some(sites) = sites() else { return };
    let site = caller(&std::backtrace::Backtrace::force_capture().to_string());
    if let Ok(mut s) = sites.lock() {
        let e = s.entry(site).or_default();
        e.0 += 1;
        e.1 += waited.as_secs_f64();
    }
}

/// One call site's waits since the last [`take`].
#[derive(Debug, Clone, PartialEq)]
pub struct SyncSite {
    /// The caller chain, innermost first (`a < b < c`).
    pub site: String,
    /// Waits counted there.
    pub count: u64,
    /// Seconds the host waited there in all.
    pub waited_s: f64,
}

/// The sites counted since the last call, most waited first, and a fresh count.
pub fn take() -> Vec<SyncSite> {
    let Some(sites) = sites() else {
        return Vec::new();
    };
    let drained: Sites = match sites.lock() {
        Ok(mut s) => std::mem::take(&mut *s),
        Err(_) => return Vec::new(),
    };
    let mut out: Vec<SyncSite> = drained
        .into_iter()
        .map(|(site, (count, waited_s))| SyncSite {
            site,
            count,
            waited_s,
        })
        .collect();
    out.sort_by(|a, b| b.waited_s.total_cmp(&a.waited_s));
    out
}

/// The first [`DEPTH`] frames of `backtrace` (std's rendering) outside the backtrace machinery,
/// this module, the CUDA device's own methods and the generic device trait's forwarding: the
/// code that asked to wait.
fn caller(backtrace: &str) -> String {
    const SKIP: [&str; 8] = [
        "std::backtrace",
        "sync_sites::record",
        "cuda::context::CudaDevice",
        "as ferry_kernels::gpu::launch::Gpu",
        "as ferry_kernels::gpu::launch::DeviceMem",
        "core::ops::function",
        "std::rt::",
        "__rust",
    ];
    let frames = backtrace.lines().filter_map(|l| {
        // "  12: ferry_model::engine::backend::cuda::CudaBackend::forward" (addresses and
        // "at file:line" lines are skipped).
        let (n, name) = l.trim_start().split_once(": ")?;
        n.parse::<usize>().ok()?;
        Some(name.trim())
    });
    let kept: Vec<&str> = frames
        .filter(|f| !SKIP.iter().any(|s| f.contains(s)))
        .take(DEPTH)
        .map(short)
        .collect();
    if kept.is_empty() {
        "(unknown: no symbols)".into()
    } else {
        kept.join(" < ")
    }
}

/// `ferry_model::engine::backend::cuda::CudaBackend::forward::h0123abcd` as
/// `cuda::CudaBackend::forward`: the last three path segments, without the symbol's hash.
fn short(name: &str) -> &str {
    let name = match name.rsplit_once("::h") {
        Some((head, hash)) if hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()) => {
            head
        }
        _ => name,
    };
    let mut cut = name.len();
    for _ in 0..3 {
        match name[..cut].rfind("::") {
            Some(i) => cut = i,
            None => return name,
        }
    }
    &name[cut + 2..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_site_is_the_first_frames_below_the_device_named_by_their_last_segments() {
        let bt = "   0: std::backtrace::Backtrace::force_capture
   1: ferry_kernels::cuda::sync_sites::record
             at ./kernels/src/cuda/sync_sites.rs:40:5
   2: ferry_kernels::cuda::context::CudaDevice::synchronize
   3: ferry_kernels::cuda::context::CudaDevice::write
   4: <ferry_kernels::cuda::context::CudaDevice as ferry_kernels::gpu::launch::Gpu>::write
   5: ferry_kernels::gpu::ops::RopeTables::fill::h0123456789abcdef
   6: ferry_model::deepseek::gpu::forward::prefill
   7: ferry_model::engine::backend::cuda::CudaBackend::forward
   8: std::rt::lang_start_internal
";
        assert_eq!(
            caller(bt),
            "ops::RopeTables::fill < gpu::forward::prefill < cuda::CudaBackend::forward"
        );
        assert_eq!(caller("no frames here"), "(unknown: no symbols)");
    }

    #[test]
    fn a_real_backtrace_names_the_function_that_asked() {
        let site = caller(&std::backtrace::Backtrace::force_capture().to_string());
        assert!(
            site.starts_with("sync_sites::tests::a_real_backtrace_names_the_function_that_asked"),
            "{site}"
        );
    }

    #[test]
    fn nothing_is_counted_unless_switched_on() {
        // The test process does not set FERRY_SYNC_SITES.
        if !enabled() {
            record(Duration::from_millis(1));
            assert!(take().is_empty());
        }
    }
}
