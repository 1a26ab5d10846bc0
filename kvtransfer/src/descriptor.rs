//! What moves: whole blocks of one layer, addressed by destination block id.
//!
//! A [`WriteBatch`] is one layer's worth of writes (the unit [`crate::LayerStreamer`] sends as
//! soon as a layer is computed); each [`BlockWrite`] carries a *run* of whole blocks of that
//! layer with consecutive destination ids, `block_bytes()` each, in the pool's `[page][latent]`
//! order. Block ids are the *destination's* ids; runs need not be adjacent. A run lands as one
//! transfer (one put, one frame): the destination's blocks of a run are contiguous in its
//! memory, and a ~1 MiB put moves better than many 72 KB ones ([`MAX_RUN_BYTES`]).

use std::sync::Arc;

use crate::{KvLayoutDesc, TransferError};

/// Whole blocks of one layer: destination blocks `block, block + 1, …`, as many as `data` holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockWrite {
    /// The first destination block id.
    pub block: u32,
    /// The blocks' bytes: a non-zero multiple of [`KvLayoutDesc::block_bytes`] of the
    /// destination layout.
    pub data: Payload,
}

/// A run's bytes: a buffer of their own, or the sender's cache rows read in place (no copy on
/// the way to the transport), kept unchanged until the payload's last clone is dropped.
///
/// A transport drops a batch as soon as it no longer reads it (copied into a frame or a mapped
/// segment, or its puts completed), not at the flush: the rows' owner waits for that drop
/// before it lets anything overwrite them.
#[derive(Clone)]
pub struct Payload(Repr);

#[derive(Clone)]
enum Repr {
    Owned(Vec<u8>),
    InPlace {
        ptr: *const u8,
        len: usize,
        _keep: Arc<dyn Send + Sync>,
    },
}

// SAFETY: an in-place payload is a read-only view of memory that `Payload::in_place`'s caller
// keeps allocated and unwritten, from any thread, until `_keep` is dropped.
unsafe impl Send for Payload {}
// SAFETY: as above; nothing writes through the view.
unsafe impl Sync for Payload {}

impl Payload {
    /// The `len` bytes at `ptr`, read in place; `keep` is dropped when the last clone is.
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay allocated and unwritten until `keep` is dropped.
    pub unsafe fn in_place(ptr: *const u8, len: usize, keep: Arc<dyn Send + Sync>) -> Self {
        Self(Repr::InPlace {
            ptr,
            len,
            _keep: keep,
        })
    }

    /// Whether these bytes are the sender's rows read in place.
    pub fn is_in_place(&self) -> bool {
        matches!(self.0, Repr::InPlace { .. })
    }
}

impl std::ops::Deref for Payload {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            Repr::Owned(v) => v,
            // SAFETY: `in_place`'s contract: allocated and unwritten while `_keep` lives, and
            // it lives as long as `self`.
            Repr::InPlace { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Self {
        Self(Repr::Owned(v))
    }
}

impl PartialEq for Payload {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Payload {}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.is_in_place() {
            "in place"
        } else {
            "owned"
        };
        write!(f, "Payload({} bytes, {kind})", self.len())
    }
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
    /// Whether any write reads the sender's rows in place ([`Payload::in_place`]): the batch
    /// must then be dropped as soon as it has been read, not kept until a flush.
    pub fn in_place(&self) -> bool {
        self.writes.iter().any(|w| w.data.is_in_place())
    }

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

/// Runs of whole blocks of one layer read straight from the writer's own CUDA memory (its
/// device KV cache) and put into the destination's registered device memory: no host copy on
/// either side. Only transports that can read device memory take them
/// ([`RemoteWriter::puts_from_device`](crate::RemoteWriter::puts_from_device): UCX with
/// `cuda_ipc`, or GPUDirect RDMA on a NIC).
///
/// The source must stay unchanged until the transport is done reading it, which is when the
/// batch is dropped: the transport keeps the batch (and so [`DeviceBatch::keep`]) until the
/// last put has completed, and the writer's owner waits for that drop before it lets anything
/// overwrite those blocks (`ferry_model`'s device shipping waits for every lease of a forward).
pub struct DeviceBatch {
    /// Destination layer.
    pub layer: u32,
    /// The CUDA device the source memory is on.
    pub device: i32,
    runs: Vec<DeviceRun>,
    /// Dropped with the batch: tells the source's owner the transport no longer reads it.
    _keep: Box<dyn Send + Sync>,
}

/// One run of a [`DeviceBatch`]: destination blocks `block, block + 1, …` from `len` bytes of
/// device memory at `src` (a whole number of destination blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRun {
    /// The first destination block id.
    pub block: u32,
    /// Device address of the run's first byte.
    pub src: u64,
    /// Bytes of the run.
    pub len: usize,
}

impl DeviceBatch {
    /// A batch of `runs` into destination layer `layer`, read from device `device`; `keep` is
    /// dropped when the transport no longer reads the source.
    ///
    /// # Safety
    /// Every run's `src..src + len` must be device memory of `device` that stays allocated and
    /// unwritten until `keep` is dropped.
    pub unsafe fn new(
        layer: u32,
        device: i32,
        runs: Vec<DeviceRun>,
        keep: Box<dyn Send + Sync>,
    ) -> Self {
        Self {
            layer,
            device,
            runs,
            _keep: keep,
        }
    }

    /// The runs, in order.
    pub fn runs(&self) -> &[DeviceRun] {
        &self.runs
    }

    /// Total payload bytes.
    pub fn bytes(&self) -> u64 {
        self.runs.iter().map(|r| r.len as u64).sum()
    }

    /// Checks every run against the destination `layout`: `layer < num_layers`, `len` a
    /// non-zero multiple of `block_bytes()`, every block `< num_blocks`. Unlike a host run
    /// ([`check_run`]) a device run has no size cap: the receiver never buffers it, and large
    /// device-to-device puts are the fast ones (1 MiB puts reach ~7 % of what 64 MiB puts do
    /// over `cuda_ipc`: docs/transfer.md).
    pub fn validate(&self, layout: &KvLayoutDesc) -> Result<(), TransferError> {
        let bb = layout.block_bytes();
        self.runs.iter().try_for_each(|r| {
            let fits = self.layer < layout.num_layers
                && bb > 0
                && r.len > 0
                && r.len % bb == 0
                && (r.block as usize).saturating_add(r.len / bb) <= layout.num_blocks as usize;
            if fits {
                Ok(())
            } else {
                Err(TransferError::OutOfRange {
                    layer: self.layer,
                    block: r.block,
                    len: r.len,
                })
            }
        })
    }
}

impl std::fmt::Debug for DeviceBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBatch")
            .field("layer", &self.layer)
            .field("device", &self.device)
            .field("runs", &self.runs)
            .finish_non_exhaustive()
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
                    data: vec![0; 128].into(),
                },
                BlockWrite {
                    block,
                    data: vec![0; len].into(),
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
            data: [vec![1u8; 128], vec![2u8; 128]].concat().into(),
        };
        let blocks: Vec<(u32, u8)> = w.blocks(128).map(|(b, d)| (b, d[0])).collect();
        assert_eq!(blocks, vec![(1, 1), (2, 2)]);
    }

    #[test]
    fn device_runs_are_checked_without_the_host_cap() {
        let layout = KvLayoutDesc {
            num_blocks: 10_000,
            ..LAYOUT
        };
        let batch = |layer, block, len| {
            let run = DeviceRun {
                block,
                src: 0x1000,
                len,
            };
            // SAFETY: never read (validation only).
            unsafe { DeviceBatch::new(layer, 0, vec![run], Box::new(())) }
        };
        // 9,000 blocks of 128 bytes (1.1 MB) in one run: too large for a host run, fine from
        // the device; the end of the pool is still the limit.
        let big = 9_000 * 128;
        assert!(big > MAX_RUN_BYTES && check_run(&layout, 1, 1_000, big).is_err());
        assert!(batch(1, 1_000, big).validate(&layout).is_ok());
        assert_eq!(batch(1, 1_000, big).bytes(), big as u64);
        for (layer, block, len) in [(2, 0, 128), (0, 9_999, 256), (0, 1, 100), (0, 1, 0)] {
            assert!(
                matches!(
                    batch(layer, block, len).validate(&layout),
                    Err(TransferError::OutOfRange { .. })
                ),
                "{layer} {block} {len}"
            );
        }
    }

    #[test]
    fn a_device_batch_releases_its_source_when_dropped() {
        let lease = std::sync::Arc::new(());
        // SAFETY: never read.
        let b = unsafe { DeviceBatch::new(0, 0, Vec::new(), Box::new(lease.clone())) };
        assert_eq!(std::sync::Arc::strong_count(&lease), 2);
        drop(b);
        assert_eq!(std::sync::Arc::strong_count(&lease), 1);
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
