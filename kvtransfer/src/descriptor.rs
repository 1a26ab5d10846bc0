//! What moves: whole blocks of one layer, addressed by destination block id.
//!
//! A [`WriteBatch`] is one layer's worth of writes (the unit [`crate::LayerStreamer`] sends as
//! soon as a layer is computed); each [`BlockWrite`] carries one whole block of that layer,
//! `page_size × latent_width × dtype size` bytes, in the pool's `[page][latent]` order. Block ids
//! are the *destination's* ids and need not be contiguous.

use crate::{KvLayoutDesc, TransferError};

/// One whole block of one layer, for destination block `block`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockWrite {
    /// Destination block id.
    pub block: u32,
    /// The block's bytes: exactly [`KvLayoutDesc::block_bytes`] of the destination layout.
    pub data: Vec<u8>,
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

    /// Checks every write against the destination `layout` (see [`check_write`]); the first bad
    /// write is reported. Transports validate a whole batch before sending any of it.
    pub fn validate(&self, layout: &KvLayoutDesc) -> Result<(), TransferError> {
        self.writes
            .iter()
            .try_for_each(|w| check_write(layout, self.layer, w.block, w.data.len()))
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
