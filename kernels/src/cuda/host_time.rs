//! Where a thread's host time goes between the calls it makes into CUDA (`FERRY_HOST_TIME=1`,
//! a diagnostic; off by default).
//!
//! An eager forward is a chain of host work and device calls (kernel launches, cuBLAS calls,
//! stream-ordered allocations and frees, copies). When the host is slower than the GPU, the
//! GPU idles between kernels and the forward costs the host's time, which a kernel profiler
//! cannot show. With the switch on, every such call made on a thread records two spans: the
//! host time since the same thread's previous call ended (`gap`: the Rust code that prepared
//! this call) and the time inside the call itself (`call`), by what was called: a kernel by
//! its name, or `cublasGemmEx`, `alloc`, `free`, `write`, `download`, `synchronize`. Gaps of
//! [`LONG_GAP`] or more are counted apart (`long`): a thread waiting for work between steps,
//! not a forward's own host work. Calls made inside another recorded call (a `write`'s
//! `synchronize`) belong to the outer one. Two clock reads a call: cheap enough to leave the
//! timing it measures nearly as it was. A thread may name the phase it is in ([`set_phase`]:
//! the engine's scheduler names each step's plan, launch, sample and commit phases by the
//! step's kind), and every record then counts under its phase as well.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A gap at least this long is the thread waiting, not preparing its next call.
pub const LONG_GAP: Duration = Duration::from_millis(1);

/// Host time by what was called.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Spans {
    count: u64,
    gap: Duration,
    call: Duration,
    long: u64,
}

struct State {
    /// By phase, then by what was called.
    by_name: Mutex<HashMap<(&'static str, &'static str), Spans>>,
    /// Kernel names by `CUfunction` address (filled as functions are looked up).
    kernels: Mutex<HashMap<usize, &'static str>>,
}

fn state() -> Option<&'static State> {
    static STATE: OnceLock<Option<State>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            (std::env::var("FERRY_HOST_TIME").as_deref() == Ok("1")).then(|| State {
                by_name: Mutex::new(HashMap::new()),
                kernels: Mutex::new(HashMap::new()),
            })
        })
        .as_ref()
}

thread_local! {
    /// When this thread's last recorded call ended.
    static LAST_END: Cell<Option<Instant>> = const { Cell::new(None) };
    /// Recorded calls this thread is inside.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// The phase this thread said it is in ([`set_phase`]).
    static PHASE: Cell<&'static str> = const { Cell::new("") };
}

/// Files this thread's next calls under `phase` (e.g. `round launch`), until it names another;
/// nothing when recording is off.
pub fn set_phase(phase: &'static str) {
    if enabled() {
        PHASE.with(|p| p.set(phase));
    }
}

/// Whether host time is being recorded (`FERRY_HOST_TIME=1`).
pub fn enabled() -> bool {
    state().is_some()
}

/// Remembers `name` for the kernel at `function` (a `CUfunction`'s address).
pub(crate) fn name_kernel(function: usize, name: &'static str) {
    if let Some(s) = state() {
        if let Ok(mut k) = s.kernels.lock() {
            k.insert(function, name);
        }
    }
}

/// The name [`name_kernel`] gave `function`.
pub(crate) fn kernel_name(function: usize) -> &'static str {
    state()
        .and_then(|s| s.kernels.lock().ok()?.get(&function).copied())
        .unwrap_or("(unnamed kernel)")
}

/// One recorded call: made by [`span`], recorded when dropped.
pub(crate) struct Span {
    name: &'static str,
    phase: &'static str,
    start: Instant,
    gap: Option<Duration>,
}

/// Starts recording a call to `name` (`None` when off, or inside another recorded call).
pub(crate) fn span(name: &'static str) -> Option<Span> {
    state()?;
    let depth = DEPTH.with(|d| {
        let v = d.get();
        d.set(v + 1);
        v
    });
    if depth > 0 {
        return Some(Span {
            name: "",
            phase: "",
            start: Instant::now(),
            gap: None,
        });
    }
    let start = Instant::now();
    let gap = LAST_END
        .with(Cell::get)
        .map(|e| start.saturating_duration_since(e));
    Some(Span {
        name,
        phase: PHASE.with(Cell::get),
        start,
        gap: Some(gap.unwrap_or_default()),
    })
}

impl Drop for Span {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        let Some(gap) = self.gap else { return };
        let end = Instant::now();
        LAST_END.with(|e| e.set(Some(end)));
        if let Some(s) = state() {
            if let Ok(mut m) = s.by_name.lock() {
                add(
                    m.entry((self.phase, self.name)).or_default(),
                    gap,
                    end - self.start,
                );
            }
        }
    }
}

fn add(s: &mut Spans, gap: Duration, call: Duration) {
    s.count += 1;
    s.call += call;
    if gap >= LONG_GAP {
        s.long += 1;
    } else {
        s.gap += gap;
    }
}

/// What one kind of call cost the host since the last [`take`].
#[derive(Debug, Clone, PartialEq)]
pub struct HostTime {
    /// The phase the calling thread was in ([`set_phase`]; empty if it named none).
    pub phase: &'static str,
    /// A kernel's name, or the call (`cublasGemmEx`, `alloc`, …).
    pub name: &'static str,
    /// Calls recorded.
    pub count: u64,
    /// Host time before them, gaps of [`LONG_GAP`] or more left out.
    pub gap: Duration,
    /// Host time inside them.
    pub call: Duration,
    /// Gaps of [`LONG_GAP`] or more before them.
    pub long_gaps: u64,
}

/// The calls recorded since the last call (on every thread), most host time first, and a
/// fresh count; this thread's next gap starts at its next call.
pub fn take() -> Vec<HostTime> {
    LAST_END.with(|e| e.set(None));
    let Some(s) = state() else {
        return Vec::new();
    };
    let drained = match s.by_name.lock() {
        Ok(mut m) => std::mem::take(&mut *m),
        Err(_) => return Vec::new(),
    };
    sorted(drained)
}

fn sorted(by_name: HashMap<(&'static str, &'static str), Spans>) -> Vec<HostTime> {
    let mut out: Vec<HostTime> = by_name
        .into_iter()
        .map(|((phase, name), s)| HostTime {
            phase,
            name,
            count: s.count,
            gap: s.gap,
            call: s.call,
            long_gaps: s.long,
        })
        .collect();
    out.sort_by_key(|h| std::cmp::Reverse(h.gap + h.call));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_gaps_are_counted_apart_and_the_dearest_call_comes_first() {
        let mut m = HashMap::new();
        let us = Duration::from_micros;
        add(m.entry(("", "cheap")).or_default(), us(2), us(3));
        add(m.entry(("", "dear")).or_default(), us(40), us(5));
        add(m.entry(("", "dear")).or_default(), LONG_GAP, us(5));
        let out = sorted(m);
        assert_eq!(out[0].name, "dear");
        assert_eq!(out[0].count, 2);
        assert_eq!(out[0].gap, us(40), "the long gap is not in the sum");
        assert_eq!(out[0].long_gaps, 1);
        assert_eq!(out[0].call, us(10));
        assert_eq!(out[1].name, "cheap");
    }

    #[test]
    fn one_call_in_two_phases_is_two_rows() {
        let mut m = HashMap::new();
        let us = Duration::from_micros;
        add(
            m.entry(("round launch", "write")).or_default(),
            us(1),
            us(9),
        );
        add(
            m.entry(("round commit", "write")).or_default(),
            us(1),
            us(4),
        );
        add(
            m.entry(("round launch", "write")).or_default(),
            us(1),
            us(9),
        );
        let out = sorted(m);
        let rows: Vec<_> = out.iter().map(|h| (h.phase, h.name, h.count)).collect();
        assert_eq!(
            rows,
            [("round launch", "write", 2), ("round commit", "write", 1)]
        );
    }

    #[test]
    fn nothing_is_recorded_unless_switched_on() {
        // The test process does not set FERRY_HOST_TIME.
        if !enabled() {
            set_phase("round launch");
            assert_eq!(PHASE.with(Cell::get), "", "no phase is kept when off");
            assert!(span("alloc").is_none());
            assert!(take().is_empty());
            assert_eq!(kernel_name(1), "(unnamed kernel)");
        }
    }
}
