//! [`LiveSamples`]: the samples of this worker's running `n` > 1 calls, by call id, so that the
//! router can stop one sample (`CancelSample`) while the call's other samples go on.
//!
//! ```text
//! Decode(n > 1) ──register(call id, request id, n)──► LiveSamples: call id → one token per sample
//!   each sample's task holds its token's drop guard and its share of the call's entry
//! CancelSample(request id, call id, index) ──► that sample's token cancelled
//!   the sample's task returns → its Generation is dropped → the engine cancels the sample
//!   and frees its blocks at its next step (the path of a client that went away)
//! the call's last task ends ──► the entry leaves the map
//! ```
//!
//! A sample whose task ended (finished, failed, stopped) has its token cancelled by the drop
//! guard, so stopping it again, or a call id, index or request id this worker does not run,
//! stops nothing and says so. The call id is sample 0's engine id: unique on this worker, and
//! checked against the request id, so a router that reuses a client's request id for two
//! calls stops only the one it names.
use std::sync::Arc;

use dashmap::DashMap;
use tokio_util::sync::{CancellationToken, DropGuard};

/// The running `n` > 1 calls of this worker (cheap to clone).
#[derive(Debug, Clone, Default)]
pub struct LiveSamples {
    calls: Arc<DashMap<u64, Call>>,
}

#[derive(Debug)]
struct Call {
    request_id: String,
    /// Sample `i`'s token; cancelled when the sample is stopped or its task ended.
    samples: Vec<CancellationToken>,
}

/// One sample's hold on its call: its stop token, cancelled (by the guard) when the sample's
/// task ends, and its share of the call's entry, which leaves the map with the last share.
#[derive(Debug)]
pub struct SampleSlot {
    /// Cancelled when the router stops this sample.
    pub stop: CancellationToken,
    _done: DropGuard,
    _call: Arc<CallEntry>,
}

/// Removes a call from the map when its last sample's task ends.
#[derive(Debug)]
struct CallEntry {
    calls: Arc<DashMap<u64, Call>>,
    id: u64,
}

impl Drop for CallEntry {
    fn drop(&mut self) {
        self.calls.remove(&self.id);
    }
}

impl LiveSamples {
    /// Registers call `id` of `request_id` with `n` samples; returns one slot per sample, in
    /// sample order, for the sample tasks to hold.
    pub fn register(&self, id: u64, request_id: &str, n: usize) -> Vec<SampleSlot> {
        let samples: Vec<CancellationToken> = (0..n).map(|_| CancellationToken::new()).collect();
        self.calls.insert(
            id,
            Call {
                request_id: request_id.to_owned(),
                samples: samples.clone(),
            },
        );
        let entry = Arc::new(CallEntry {
            calls: self.calls.clone(),
            id,
        });
        samples
            .into_iter()
            .map(|stop| SampleSlot {
                _done: stop.clone().drop_guard(),
                stop,
                _call: entry.clone(),
            })
            .collect()
    }

    /// Stops sample `index` of call `id` if it is running and the call is `request_id`'s;
    /// returns whether it stopped one.
    pub fn cancel(&self, request_id: &str, id: u64, index: u32) -> bool {
        let Some(call) = self.calls.get(&id) else {
            return false;
        };
        if call.request_id != request_id {
            return false;
        }
        match call.samples.get(index as usize) {
            Some(token) if !token.is_cancelled() => {
                token.cancel();
                true
            }
            _ => false,
        }
    }

    /// Calls registered now.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// Whether no call is registered.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_only_the_named_running_sample_of_the_named_request() {
        let live = LiveSamples::default();
        let mut slots = live.register(7, "r", 3);
        assert!(!live.cancel("other", 7, 1), "another request's call");
        assert!(!live.cancel("r", 8, 1), "an unknown call");
        assert!(!live.cancel("r", 7, 3), "an index out of range");
        assert!(live.cancel("r", 7, 1));
        assert!(slots[1].stop.is_cancelled());
        assert!(!slots[0].stop.is_cancelled() && !slots[2].stop.is_cancelled());
        assert!(!live.cancel("r", 7, 1), "already stopped");
        // A sample whose task ended is not running: nothing to stop.
        drop(slots.remove(2));
        assert!(!live.cancel("r", 7, 2));
        assert_eq!(live.len(), 1);
        drop(slots);
        assert!(live.is_empty(), "the call leaves with its last sample");
        assert!(!live.cancel("r", 7, 0));
    }
}
