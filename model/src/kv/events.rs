//! KV events: what a worker tells the router about its prefix cache.
//!
//! The worker's block ownership is the source of truth; the router's prefix index is a derived
//! view kept current by these events (STYLE.md principle 4). Each worker numbers its events
//! 1, 2, 3, … with no gaps, so the router can detect a lost event (a gap) and re-register from a
//! snapshot instead of routing on a stale view. Ids are only ever issued here, for an event that
//! really happened: never synthesised, never reused (Dynamo PR #7072 looped on synthetic ids).

use ferry_proto::ids::{BlockHash, EventId};

/// What changed in a worker's prefix cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventData {
    /// A run of consecutive full blocks became cached. `hashes` are chained: each one's parent is
    /// the one before it, and the first one's parent is `parent` (`None` for a prompt's first
    /// block). The parent is cached when the event is issued.
    Stored {
        /// The newly cached blocks' hashes, in prefix order.
        hashes: Vec<BlockHash>,
        /// The hash of the block before `hashes[0]`, if any.
        parent: Option<BlockHash>,
    },
    /// Blocks were evicted: their hashes no longer name a cached block on this worker.
    Removed {
        /// The evicted blocks' hashes, in eviction order.
        hashes: Vec<BlockHash>,
    },
}

impl KvEventData {
    /// The hashes the event is about.
    pub fn hashes(&self) -> &[BlockHash] {
        match self {
            Self::Stored { hashes, .. } | Self::Removed { hashes } => hashes,
        }
    }
}

/// One numbered event of one worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    /// Per-worker sequence number: exactly one more than the previous event's.
    pub id: EventId,
    /// What changed.
    pub data: KvEventData,
}

/// Issues event ids and buffers events until the engine drains them to the router.
///
/// The buffer grows until [`EventLog::drain`] is called; the engine drains it every step.
#[derive(Debug, Default)]
pub struct EventLog {
    /// The last id issued; 0 before the first event.
    last: u64,
    pending: Vec<KvEvent>,
}

impl EventLog {
    /// A log that has issued nothing; the first event gets id 1.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `data` under the next id and returns that id. An event about no hashes changes
    /// nothing the router could see, so it is not recorded and uses no id (`None`).
    pub fn record(&mut self, data: KvEventData) -> Option<EventId> {
        if data.hashes().is_empty() {
            return None;
        }
        self.last += 1;
        let id = EventId(self.last);
        self.pending.push(KvEvent { id, data });
        Some(id)
    }

    /// The last id issued, `EventId(0)` if none: a snapshot of the cache reflects every event up
    /// to and including this one.
    pub fn last_id(&self) -> EventId {
        EventId(self.last)
    }

    /// Events recorded since the last drain, oldest first.
    pub fn pending(&self) -> &[KvEvent] {
        &self.pending
    }

    /// Takes every buffered event, oldest first. Ids keep counting from where they were.
    pub fn drain(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_start_at_one_and_never_repeat() {
        let mut log = EventLog::new();
        assert_eq!(log.last_id(), EventId(0));
        let a = log.record(KvEventData::Stored {
            hashes: vec![BlockHash(1)],
            parent: None,
        });
        let b = log.record(KvEventData::Removed {
            hashes: vec![BlockHash(1)],
        });
        assert_eq!((a, b), (Some(EventId(1)), Some(EventId(2))));
        let drained = log.drain();
        assert_eq!(drained.len(), 2);
        assert!(log.drain().is_empty());
        let c = log.record(KvEventData::Removed {
            hashes: vec![BlockHash(2)],
        });
        assert_eq!(c, Some(EventId(3)), "draining does not reset ids");
        assert_eq!(log.last_id(), EventId(3));
    }

    #[test]
    fn empty_events_are_not_recorded() {
        let mut log = EventLog::new();
        assert_eq!(log.record(KvEventData::Removed { hashes: vec![] }), None);
        assert_eq!(log.last_id(), EventId(0));
        assert!(log.pending().is_empty());
    }
}
