//! What moves: whole blocks of one layer, addressed by destination block id.
//!
//! A [`WriteBatch`] is one layer's worth of writes (the unit [`crate::LayerStreamer`] sends as
//! soon as a layer is computed); each [`BlockWrite`] carries a *run* of whole blocks of that
//! layer with consecutive destination ids, `block_bytes()` each, in the pool's `[page][latent]`
//! order. Block ids are the *destination's* ids; runs need not be adjacent. A run lands as one
//! transfer (one put, one frame): the destination's blocks of a run are contiguous in its
//! memory, and a ~1 MiB put moves better than many 72 KB ones ([`MAX_RUN_BYTES`]).

use crate::{KvLayoutDesc, TransferError};

/// Whole blocks of one layer: destination blocks `block, block + 1, …`, as many as `data` holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockWrite {
    /// The first destination block id.
    pub block: u32,
    /// The blocks' bytes: a non-zero multiple of [`KvLayoutDesc::block_bytes`] of the
    /// destination layout.
    pub data: Vec<u8>,
}

impl BlockWrite {
    /// The run's blocks and their bytes, one by one (`block_bytes` per block).
    pub fn blocks(&self, block_bytes: usize) -> impl Iterator<Item = (u32, &[u8])> {
        (self.block..).zip(self.data.chunks(block_bytes.max(1)))
    }
}

/// Writes of whole blocks into one layer of the destination.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WriteBatch {
    /// Destination layer.
    pub layer: u32,
    /// The blocks, applied in order (a later write to the same block wins).
    pub writes: Vec<BlockWrite>,
}

impl WriteBatch {
    /// Total payload bytes of the batch.
    pub fn bytes(&self) -> u64 {
        self.writes.iter().map(|w| w.data.len() as u64).sum()
    }

    /// Checks every write against the destination `layout` (see [`check_run`]); the first bad
    /// write is reported. Transports validate a whole batch before sending any of it.
    pub fn validate(&self, layout: &KvLayoutDesc) -> Result<(), TransferError> {
        self.writes
            .iter()
            .try_for_each(|w| check_run(layout, self.layer, w.block, w.data.len()))
    }
}

/// The most bytes one run may carry, unless a single block is larger: bounds what a receiver
/// buffers for one write, and is about the best put size on shared memory (1–2 MiB runs
/// reached 77–88 % of memcpy, 16 MiB runs 73 %, single 72 KB blocks 68–82 %: BENCHMARKS.md).
pub const MAX_RUN_BYTES: usize = 1 << 20;

/// Checks a run of whole blocks against the destination `layout`: `layer < num_layers`, `len`
/// a non-zero multiple of `block_bytes()` and at most `max(MAX_RUN_BYTES, block_bytes())`, and
/// every block of the run `< num_blocks`; else [`TransferError::OutOfRange`].
pub fn check_run(
    layout: &KvLayoutDesc,
    layer: u32,
    block: u32,
    len: usize,
) -> Result<(), TransferError> {
    let bb = layout.block_bytes();
    let fits = layer < layout.num_layers
        && bb > 0
        && len > 0
        && len % bb == 0
        && len <= MAX_RUN_BYTES.max(bb)
        && (block as usize).saturating_add(len / bb) <= layout.num_blocks as usize;
    if fits {
        Ok(())
    } else {
        Err(TransferError::OutOfRange { layer, block, len })
    }
}

/// Checks one block write against the destination `layout`: `layer < num_layers`,
/// `block < num_blocks` and `len == block_bytes()`, else [`TransferError::OutOfRange`].
pub fn check_write(
    layout: &KvLayoutDesc,
    layer: u32,
    block: u32,
    len: usize,
) -> Result<(), TransferError> {
    if layer < layout.num_layers && block < layout.num_blocks && len == layout.block_bytes() {
        Ok(())
    } else {
        Err(TransferError::OutOfRange { layer, block, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dtype;

    const LAYOUT: KvLayoutDesc = KvLayoutDesc {
        num_layers: 2,
        page_size: 4,
        latent_width: 8,
        dtype: Dtype::F32,
        num_blocks: 3,
    };

    fn batch(layer: u32, block: u32, len: usize) -> WriteBatch {
        WriteBatch {
            layer,
            writes: vec![
                BlockWrite {
                    block: 0,
                    data: vec![0; 128],
                },
                BlockWrite {
                    block,
                    data: vec![0; len],
                },
            ],
        }
    }

    #[test]
    fn a_run_of_blocks_fits_or_is_out_of_range() {
        // Blocks 1 and 2 of 3: fits; blocks 2..4: the last is past the pool.
        assert!(check_run(&LAYOUT, 0, 1, 256).is_ok());
        assert!(check_run(&LAYOUT, 0, 2, 256).is_err());
        assert!(check_run(&LAYOUT, 0, 0, 0).is_err(), "an empty run");
        assert!(check_run(&LAYOUT, 0, 0, 192).is_err(), "not whole blocks");
        let w = BlockWrite {
            block: 1,
            data: [vec![1u8; 128], vec![2u8; 128]].concat(),
        };
        let blocks: Vec<(u32, u8)> = w.blocks(128).map(|(b, d)| (b, d[0])).collect();
        assert_eq!(blocks, vec![(1, 1), (2, 2)]);
    }

    #[test]
    fn accepts_in_range_and_counts_bytes() {
        let b = batch(1, 2, 128);
        assert!(b.validate(&LAYOUT).is_ok());
        assert_eq!(b.bytes(), 256);
    }

    #[test]
    fn rejects_layer_block_and_length() {
        for (layer, block, len) in [(2, 0, 128), (0, 3, 128), (0, 1, 127), (0, 1, 129)] {
            match batch(layer, block, len).validate(&LAYOUT) {
                Err(TransferError::OutOfRange {
                    layer: l,
                    block: b,
                    len: n,
                }) => assert_eq!((l, b, n), (layer, block, len)),
                other => panic!("expected out of range, got {other:?}"),
            }
        }
    }
}
