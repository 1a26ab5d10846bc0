//! Leases on KV blocks that a transfer is reading in place.
//!
//! When a prefill job ships straight from the cache (a transport putting from GPU memory into
//! the destination's, or reading a CPU engine's host rows without copying them first), the
//! cache blocks are the transfer's source until it has read them. The forward hands out one [`Lease`] per shipped layer ([`Leases::lease`]); the
//! transport drops it when its last put of that layer has completed (or when the batch is
//! refused or dropped), and the engine waits for every lease of a forward to come back
//! ([`Leases::wait_idle`]) before it lets any later step write those blocks.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a forward that shipped rows for a transport to read in place waits for it to finish
/// reading them (its flush bound).
pub const LEASE_TIMEOUT: Duration = Duration::from_secs(60);

/// The count of leases out, and a condition to wait on it.
#[derive(Default)]
struct Count {
    out: Mutex<usize>,
    back: Condvar,
}

/// The leases of one forward's shipping.
#[derive(Clone, Default)]
pub struct Leases(Arc<Count>);

/// One outstanding lease; returned when dropped.
pub struct Lease(Arc<Count>);

impl Leases {
    /// No leases out.
    pub fn new() -> Self {
        Self::default()
    }

    /// Hands out a lease.
    pub fn lease(&self) -> Lease {
        *self.0.out.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        Lease(self.0.clone())
    }

    /// Leases not yet returned.
    pub fn outstanding(&self) -> usize {
        *self.0.out.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until every lease is back or `timeout` passes; true when all are back.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut out = self.0.out.lock().unwrap_or_else(PoisonError::into_inner);
        while *out > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            out = self
                .0
                .back
                .wait_timeout(out, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut out = self.0.out.lock().unwrap_or_else(PoisonError::into_inner);
        *out = out.saturating_sub(1);
        self.0.back.notify_all();
    }
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases")
            .field("outstanding", &self.outstanding())
            .finish()
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Lease")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_until_every_lease_is_back() {
        let leases = Leases::new();
        assert!(leases.wait_idle(Duration::ZERO), "none out");
        let a = leases.lease();
        let b = leases.lease();
        assert_eq!(leases.outstanding(), 2);
        assert!(!leases.wait_idle(Duration::from_millis(20)), "two out");
        drop(a);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            drop(b);
        });
        assert!(
            leases.wait_idle(Duration::from_secs(10)),
            "returned by another thread"
        );
        assert_eq!(leases.outstanding(), 0);
        t.join().unwrap();
    }
}
