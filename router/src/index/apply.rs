//! KV events as the index sees them, and the event-id sequence rule.
//!
//! A worker numbers its events 1, 2, 3, … (per worker, never synthesised). A snapshot sent at
//! registration reflects every event up to `last_event`; the next event must be
//! `last_event + 1`. An event at or below the last applied id is a replay and is skipped; an
//! event above `last + 1` is a gap: the index can no longer trust its copy of that worker and
//! answers out-of-sync until the worker re-registers with a fresh snapshot.
use ferry_proto::ids::{BlockHash, EventId, WorkerId};

/// One cached-block change on one worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    /// Per-worker sequence number.
    pub id: EventId,
    /// What changed.
    pub data: KvEventData,
}

/// What a [`KvEvent`] changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventData {
    /// These blocks became cached (full, hashed), in prefix order.
    Stored(Vec<BlockHash>),
    /// These blocks were evicted.
    Removed(Vec<BlockHash>),
}

/// A worker's whole cache at registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Every cached block.
    pub blocks: Vec<BlockHash>,
    /// The last event reflected in `blocks`.
    pub last_event: EventId,
}

impl Default for Snapshot {
    /// An empty cache before any event.
    fn default() -> Self {
        Self {
            blocks: Vec::new(),
            last_event: EventId(0),
        }
    }
}

/// Where an incoming event id stands relative to the last applied one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sequence {
    /// `last + 1`: apply it.
    Next,
    /// `<= last`: already applied (a retried batch); skip it.
    Replay,
    /// `> last + 1`: events were lost.
    Gap {
        /// `last + 1`.
        expected: EventId,
    },
}

/// Classifies event `got` after `last`.
pub fn sequence(last: EventId, got: EventId) -> Sequence {
    if got <= last {
        return Sequence::Replay;
    }
    // `got > last`, so `last < u64::MAX` and `last + 1` cannot overflow.
    let expected = EventId(last.0.saturating_add(1));
    if got == expected {
        Sequence::Next
    } else {
        Sequence::Gap { expected }
    }
}

/// Why the index refused a worker's events: the worker must re-register with a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutOfSync {
    /// The index has no state for this worker (never registered, or removed).
    #[error("worker `{0}` is not in the index; it must register with a snapshot")]
    UnknownWorker(WorkerId),
    /// An event id was skipped.
    #[error("worker `{worker}` skipped events: expected {expected}, got {got}")]
    Gap {
        /// The worker.
        worker: WorkerId,
        /// The id that should have come next.
        expected: EventId,
        /// The id that came.
        got: EventId,
    },
    /// A gap was seen earlier and no snapshot has arrived since.
    #[error("worker `{0}` is out of sync since an earlier gap; it must re-register")]
    AwaitingSnapshot(WorkerId),
}

/// What applying a batch did, for logs and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Applied {
    /// Events applied.
    pub applied: usize,
    /// Replayed events skipped.
    pub skipped: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_rule() {
        assert_eq!(sequence(EventId(0), EventId(1)), Sequence::Next);
        assert_eq!(sequence(EventId(5), EventId(6)), Sequence::Next);
        assert_eq!(sequence(EventId(5), EventId(5)), Sequence::Replay);
        assert_eq!(sequence(EventId(5), EventId(2)), Sequence::Replay);
        assert_eq!(
            sequence(EventId(5), EventId(8)),
            Sequence::Gap {
                expected: EventId(6)
            }
        );
        assert_eq!(
            sequence(EventId(u64::MAX), EventId(u64::MAX)),
            Sequence::Replay
        );
    }
}
