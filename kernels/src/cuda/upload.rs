//! Small host → device writes that do not wait for the device (on by default;
//! `FERRY_ASYNC_WRITES=0` turns them off).
//!
//! [`CudaDevice::write`] copies from pageable host memory and then synchronises the stream, so
//! that the caller may reuse its slice: every per-step input a decode step or a speculative
//! round refreshes (positions, cache slots, block tables, sampling parameters, a graph's
//! inputs) costs a round trip to an idle device, and the host cannot queue anything behind
//! work still running. Here a write of at most [`SLOT_BYTES`] is staged in one
//! of [`SLOTS`] page-locked slots, its copy queued on the stream, and an event recorded behind
//! it; the call returns at once. A write of up to [`MAX_STAGED_BYTES`] (a verify graph's block
//! tables at a hundred sequences and more, a large model's rotary rows) is staged in
//! consecutive slots, a slot's worth each. The stream runs the copy before anything queued later, so
//! kernels see the data exactly as before; the slot is written again only after its event
//! says its last copy has run. Larger writes, and writes while the stream is being captured
//! into a graph (a captured copy would replay from a slot since reused), take the
//! synchronous path.
//!
//! On by default since session 48: with the engine's early drafter context and queued drafts,
//! a speculative round took 5.7–11.6 % less on an H100 at c = 1 / 64 / 128, and the steps that
//! carry prompts beside rounds ~10 % less (BENCHMARKS.md, session 48); plain steps did not move.

use cudarc::driver::{result, CudaEvent, CudaStream};

use super::context::{gpu_err, CudaDevice};
use super::staging::PinnedBuffer;
use crate::error::KernelError;

/// One staging slot's bytes: a write is staged a slot's worth at a time.
pub const SLOT_BYTES: usize = 64 << 10;
/// Staging slots, used in turn: a slot is reused after this many later writes.
pub const SLOTS: usize = 64;
/// The largest write staged, in [`SLOT_BYTES`] pieces (a quarter of the slots, so that one
/// write never waits on its own earlier pieces).
pub const MAX_STAGED_BYTES: usize = SLOTS / 4 * SLOT_BYTES;

/// Whether small writes are staged: unless `FERRY_ASYNC_WRITES=0` (read once).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERRY_ASYNC_WRITES").map_or(true, |v| v != "0"))
}

/// The staging slots of one device, used in turn: one page-locked allocation of
/// [`SLOTS`] × [`SLOT_BYTES`], and per slot the event recorded behind its latest copy.
pub(super) struct UploadRing {
    buf: PinnedBuffer<u8>,
    copied: Vec<CudaEvent>,
    next: usize,
}

impl UploadRing {
    /// The slots on `dev` (4 MB of page-locked memory).
    pub(super) fn new(dev: &CudaDevice) -> Result<Self, KernelError> {
        let copied = (0..SLOTS)
            .map(|_| {
                dev.context()
                    .new_event(None)
                    .map_err(gpu_err("cuEventCreate"))
            })
            .collect::<Result<Vec<_>, KernelError>>()?;
        Ok(Self {
            buf: dev.pinned::<u8>(SLOTS * SLOT_BYTES)?,
            copied,
            next: 0,
        })
    }

    /// Stages `bytes` and queues their copy to device address `dst` on `stream`, returning
    /// without waiting for it.
    ///
    /// # Safety
    /// `dst..dst + bytes.len()` lies inside a live device allocation of the stream's context
    /// that stays alive until the copy has run (stream order: any later free is queued behind
    /// it).
    pub(super) unsafe fn write(
        &mut self,
        dst: u64,
        bytes: &[u8],
        stream: &CudaStream,
    ) -> Result<(), KernelError> {
        if bytes.len() > SLOT_BYTES {
            return Err(KernelError::ShapeMismatch {
                op: "cuda_staged_write",
                what: "bytes",
                expected: SLOT_BYTES,
                got: bytes.len(),
            });
        }
        let i = self.next;
        self.next = (i + 1) % SLOTS;
        // The slot's previous copy (queued SLOTS writes ago) must have read it.
        self.copied[i]
            .synchronize()
            .map_err(gpu_err("cuEventSynchronize"))?;
        let at = i * SLOT_BYTES;
        let staged = &mut self.buf.as_mut_slice()[at..at + bytes.len()];
        staged.copy_from_slice(bytes);
        // SAFETY: `staged` is page-locked and is not written again until `copied[i]`, recorded
        // right behind this copy, has completed; `dst` is the caller's live range.
        unsafe { result::memcpy_htod_async(dst, &*staged, stream.cu_stream()) }
            .map_err(gpu_err("cuMemcpyHtoDAsync"))?;
        self.copied[i]
            .record(stream)
            .map_err(gpu_err("cuEventRecord"))
    }
}

impl Drop for UploadRing {
    fn drop(&mut self) {
        // No copy may still read a slot when the page-locked memory is freed (`buf` is dropped
        // after this body).
        for e in &self.copied {
            let _ = e.synchronize();
        }
    }
}
