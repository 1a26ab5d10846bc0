//! Predictive load: what the router has sent a worker since its last heartbeat could say so.
//!
//! Heartbeats arrive every second or so; a burst of requests inside one period would all see
//! the same idle worker and herd onto it. So the router charges each dispatch to the chosen
//! workers at once and releases the charge as the request moves on (Dynamo's "predictive
//! bookkeeping"):
//!
//! | charge | added at dispatch | released |
//! |---|---|---|
//! | P: uncached prompt blocks, one request | [`LoadGuard::new`] | first token (prefill done) or drop |
//! | D: prompt blocks, one request (+ its uncached blocks when D prefills locally) | [`LoadGuard::new`] | drop (end, error or client gone) |
//!
//! The guard releases by ownership, so an error or a cancelled client can never leak load.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// Router-side counters of one worker; kept across re-registrations of the same worker id.
#[derive(Debug, Default)]
pub struct PendingLoad {
    prefill_blocks: AtomicU64,
    active_blocks: AtomicU64,
    requests: AtomicU64,
    /// Told of every change (the events plane publishes this router's load to the others).
    changed: Option<Arc<Notify>>,
}

/// A point-in-time copy of [`PendingLoad`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PendingSnapshot {
    /// Uncached prompt blocks dispatched for prefill and not yet prefilled.
    pub prefill_blocks: u64,
    /// Blocks of requests dispatched for decode and not yet finished.
    pub active_blocks: u64,
    /// Requests dispatched to this worker and not yet finished (or prefilled, for P).
    pub requests: u64,
}

impl std::ops::Add for PendingSnapshot {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            prefill_blocks: self.prefill_blocks.saturating_add(other.prefill_blocks),
            active_blocks: self.active_blocks.saturating_add(other.active_blocks),
            requests: self.requests.saturating_add(other.requests),
        }
    }
}

impl PendingLoad {
    /// Counters that notify `changed` whenever they change.
    pub fn notifying(changed: Arc<Notify>) -> Self {
        Self {
            changed: Some(changed),
            ..Self::default()
        }
    }

    fn notify(&self) {
        if let Some(n) = &self.changed {
            n.notify_one();
        }
    }

    /// Reads the counters.
    pub fn snapshot(&self) -> PendingSnapshot {
        PendingSnapshot {
            prefill_blocks: self.prefill_blocks.load(Ordering::Relaxed),
            active_blocks: self.active_blocks.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
        }
    }
}

/// One charge on one worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Charge {
    /// Added to the worker's pending prefill blocks.
    pub prefill_blocks: u64,
    /// Added to the worker's active blocks.
    pub active_blocks: u64,
}

/// A live charge; subtracts itself when dropped.
#[derive(Debug)]
struct Held {
    load: Arc<PendingLoad>,
    charge: Charge,
}

impl Held {
    fn new(load: Arc<PendingLoad>, charge: Charge) -> Self {
        load.prefill_blocks
            .fetch_add(charge.prefill_blocks, Ordering::Relaxed);
        load.active_blocks
            .fetch_add(charge.active_blocks, Ordering::Relaxed);
        load.requests.fetch_add(1, Ordering::Relaxed);
        load.notify();
        Self { load, charge }
    }
}

fn saturating_sub(counter: &AtomicU64, amount: u64) {
    // `fetch_update` with a closure that always returns `Some` cannot fail.
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(amount))
    });
}

impl Drop for Held {
    fn drop(&mut self) {
        saturating_sub(&self.load.prefill_blocks, self.charge.prefill_blocks);
        saturating_sub(&self.load.active_blocks, self.charge.active_blocks);
        saturating_sub(&self.load.requests, 1);
        self.load.notify();
    }
}

/// The charges of one request: released in two steps (prefill, then decode) or all on drop.
#[derive(Debug)]
pub struct LoadGuard {
    prefill_phase: Option<Held>,
    decode_phase: Held,
}

impl LoadGuard {
    /// Charges `decode` to the decode worker, and `prefill` (if the request is prefilled
    /// remotely) to the prefill worker.
    pub fn new(
        decode: (Arc<PendingLoad>, Charge),
        prefill: Option<(Arc<PendingLoad>, Charge)>,
    ) -> Self {
        Self {
            prefill_phase: prefill.map(|(load, charge)| Held::new(load, charge)),
            decode_phase: Held::new(decode.0, decode.1),
        }
    }

    /// The prompt is prefilled (the first token arrived): release the prefill worker's charge
    /// and the decode worker's local-prefill blocks. Idempotent.
    pub fn prefill_done(&mut self) {
        self.prefill_phase = None;
        let local = std::mem::take(&mut self.decode_phase.charge.prefill_blocks);
        saturating_sub(&self.decode_phase.load.prefill_blocks, local);
        self.decode_phase.load.notify();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_release_in_phases_and_on_drop() {
        let (p, d) = (
            Arc::new(PendingLoad::default()),
            Arc::new(PendingLoad::default()),
        );
        let mut guard = LoadGuard::new(
            (
                d.clone(),
                Charge {
                    prefill_blocks: 2,
                    active_blocks: 5,
                },
            ),
            Some((
                p.clone(),
                Charge {
                    prefill_blocks: 3,
                    active_blocks: 0,
                },
            )),
        );
        assert_eq!(p.snapshot().prefill_blocks, 3);
        assert_eq!(
            d.snapshot(),
            PendingSnapshot {
                prefill_blocks: 2,
                active_blocks: 5,
                requests: 1
            }
        );
        guard.prefill_done();
        guard.prefill_done();
        assert_eq!(p.snapshot(), PendingSnapshot::default());
        assert_eq!(d.snapshot().prefill_blocks, 0);
        assert_eq!(d.snapshot().active_blocks, 5);
        drop(guard);
        assert_eq!(d.snapshot(), PendingSnapshot::default());
    }
}
