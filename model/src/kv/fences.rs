//! Which remote prefill each block is reserved for: the decode side of the KV transfer fence.
//!
//! The engine thread (the scheduler) is the one writer: it records a block under the request's
//! fence when it reserves the block for a peer's prefill, and clears it when that transfer
//! completes or is given up. Transfer receivers read it from their own threads
//! (`KvRegion::admit` in the decode worker) before landing a block, so a writer whose request
//! was abandoned (timed out, its blocks recomputed or reused) can no longer write into them.

use std::sync::atomic::{AtomicU64, Ordering};

use super::BlockId;

/// Per block: the fence of the remote prefill it is reserved for, or 0.
#[derive(Debug)]
pub struct RemoteFences(Box<[AtomicU64]>);

impl RemoteFences {
    /// No block reserved, for a pool of `blocks` blocks.
    pub fn new(blocks: usize) -> Self {
        RemoteFences((0..blocks).map(|_| AtomicU64::new(0)).collect())
    }

    /// Reserves `block` for the transfer fenced by `fence` (non-zero). Published before the
    /// peer is asked, so its first write finds it.
    pub fn reserve(&self, block: BlockId, fence: u64) {
        if let Some(f) = self.0.get(block.0 as usize) {
            f.store(fence, Ordering::Release);
        }
    }

    /// Ends `block`'s reservation if it is the one fenced by `fence`: later writes into it
    /// are refused. A block reserved under another fence (or none) is left as it is.
    pub fn clear_if(&self, block: BlockId, fence: u64) {
        if let Some(f) = self.0.get(block.0 as usize) {
            let _ = f.compare_exchange(fence, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    /// Whether `block` is reserved for any remote prefill.
    pub fn is_reserved(&self, block: BlockId) -> bool {
        self.0
            .get(block.0 as usize)
            .is_some_and(|f| f.load(Ordering::Acquire) != 0)
    }

    /// Whether `block` is reserved for the transfer fenced by `fence` (never for fence 0).
    pub fn holds(&self, block: u32, fence: u64) -> bool {
        fence != 0
            && self
                .0
                .get(block as usize)
                .is_some_and(|f| f.load(Ordering::Acquire) == fence)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_admits_only_its_current_fence() {
        let f = RemoteFences::new(4);
        assert!(!f.holds(1, 0) && !f.holds(1, 7));
        f.reserve(BlockId(1), 7);
        assert!(f.holds(1, 7) && f.is_reserved(BlockId(1)));
        assert!(!f.holds(1, 6), "a stale writer's fence");
        assert!(
            !f.holds(2, 7) && !f.is_reserved(BlockId(2)),
            "another block"
        );
        f.clear_if(BlockId(1), 6);
        assert!(f.holds(1, 7), "another request's release leaves it");
        f.clear_if(BlockId(1), 7);
        assert!(!f.holds(1, 7) && !f.is_reserved(BlockId(1)));
        f.reserve(BlockId(1), 9);
        assert!(
            f.holds(1, 9) && !f.holds(1, 7),
            "reused for another request"
        );
        assert!(!f.holds(99, 9), "outside the pool");
    }
}
