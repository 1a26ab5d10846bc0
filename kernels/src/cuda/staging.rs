//! Device → host copies that overlap the device's compute: a second stream, page-locked host
//! memory and events.
//!
//! A prefill worker ships each layer's KV as soon as that layer is computed. The forward keeps
//! issuing kernels on the device's stream; after a layer, [`CudaDevice::mark`] records where
//! the stream is, and a [`CopyStream`] queues that layer's rows into a [`PinnedBuffer`] behind
//! the mark ([`CopyStream::copy_after`]) — the copy engine then moves them while later layers
//! run — and records a [`Mark`] the host waits on before it reads them.

use std::sync::Arc;

use cudarc::driver::{result, CudaEvent, CudaStream};

use super::context::{gpu_err, CudaDevice, DevicePod};
use crate::error::KernelError;

/// A point in a stream's queued work: done once everything queued before it is.
pub struct Mark {
    event: CudaEvent,
}

impl Mark {
    /// Blocks until the work before the mark has run.
    pub fn wait(&self) -> Result<(), KernelError> {
        self.event
            .synchronize()
            .map_err(gpu_err("cuEventSynchronize"))
    }

    /// Whether the work before the mark has run (never blocks; an error counts as not done).
    pub fn is_done(&self) -> bool {
        self.event.is_complete()
    }
}

/// Page-locked host memory the copy engine can write asynchronously. Freed on drop.
pub struct PinnedBuffer<T: DevicePod> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively (no aliasing handle exists); page-locked
// host memory may be used and freed from any thread.
unsafe impl<T: DevicePod> Send for PinnedBuffer<T> {}

impl<T: DevicePod> PinnedBuffer<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The contents. Only meaningful once the [`Mark`] of every copy into the range is done.
    pub fn as_slice(&self) -> &[T] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` points to `len` initialised elements (zeroed at allocation) that live
        // as long as `self`; `&self` excludes a concurrent `&mut` from this side, and the
        // caller has waited for the copies into the range (documented above).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: DevicePod> PinnedBuffer<T> {
    /// The contents, to fill before a host → device copy reads them (`super::upload`); the
    /// caller makes sure no queued copy still reads the range.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [T] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: `ptr` points to `len` initialised elements that live as long as `self`, and
        // `&mut self` excludes any other reference from this side.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: DevicePod> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed exactly once, here.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// `len` elements of `T` at device address `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRange {
    /// The first element's device address.
    pub addr: u64,
    /// Elements.
    pub len: usize,
}

/// A second stream for copies between the host and device memory, beside the device's own.
pub struct CopyStream {
    dev: CudaDevice,
    stream: Arc<CudaStream>,
}

impl CudaDevice {
    /// A mark at the current end of this device's stream.
    pub fn mark(&self) -> Result<Mark, KernelError> {
        let event = self
            .context()
            .new_event(None)
            .map_err(gpu_err("cuEventCreate"))?;
        event
            .record(self.stream())
            .map_err(gpu_err("cuEventRecord"))?;
        Ok(Mark { event })
    }

    /// `len` zeroed elements of page-locked host memory.
    pub fn pinned<T: DevicePod>(&self, len: usize) -> Result<PinnedBuffer<T>, KernelError> {
        if len == 0 {
            return Ok(PinnedBuffer {
                ptr: std::ptr::null_mut(),
                len: 0,
            });
        }
        self.bind()?;
        let bytes = len * std::mem::size_of::<T>();
        // SAFETY: a fresh allocation of `bytes`; it is zeroed before any typed view exists.
        let ptr = unsafe { result::malloc_host(bytes, 0) }.map_err(gpu_err("cuMemHostAlloc"))?;
        // SAFETY: `ptr` is valid for `bytes` writes.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        Ok(PinnedBuffer {
            ptr: ptr.cast(),
            len,
        })
    }

    /// A second stream on this device for [`CopyStream::copy_after`].
    pub fn copy_stream(&self) -> Result<CopyStream, KernelError> {
        let stream = self
            .context()
            .new_stream()
            .map_err(gpu_err("cuStreamCreate"))?;
        Ok(CopyStream {
            dev: self.clone(),
            stream,
        })
    }
}

impl CopyStream {
    /// Queues a copy of `src` into `dst[at..at + src.len]`, to start once the work before
    /// `after` (a mark on the device's stream) has run.
    ///
    /// The caller guarantees `src` lies in a live device allocation that no kernel queued after
    /// `after` writes before the copy's [`Self::mark`] is done, and does not read
    /// `dst[at..at + src.len]` before then.
    pub fn copy_after<T: DevicePod>(
        &self,
        after: &Mark,
        src: DeviceRange,
        dst: &mut PinnedBuffer<T>,
        at: usize,
    ) -> Result<(), KernelError> {
        let DeviceRange { addr: src, len } = src;
        if at + len > dst.len {
            return Err(KernelError::ShapeMismatch {
                op: "cuda_copy_after",
                what: "dst",
                expected: at + len,
                got: dst.len,
            });
        }
        if len == 0 {
            return Ok(());
        }
        self.dev.bind()?;
        self.stream
            .wait(&after.event)
            .map_err(gpu_err("cuStreamWaitEvent"))?;
        // SAFETY: `dst[at..at + len]` is inside the pinned allocation (checked above) and
        // stays alive and unread until the caller waits for this stream's mark; `src` is the
        // caller's live device range (the contract above).
        let out = unsafe { std::slice::from_raw_parts_mut(dst.ptr.add(at), len) };
        // SAFETY: as above; the copy is ordered on this stream after `after`.
        unsafe { result::memcpy_dtoh_async(out, src, self.stream.cu_stream()) }
            .map_err(gpu_err("cuMemcpyDtoHAsync"))
    }

    /// Copies `host` to device address `dst` on this stream and waits for it: a host → device
    /// copy that neither queues behind the device's own stream nor holds it up, made from
    /// whatever thread calls (a decode worker's KV receiver lands a peer's blocks with it while
    /// the engine thread computes). Several threads may call at once; each waits for the
    /// copies queued before its own.
    ///
    /// # Safety
    /// `dst .. dst + host.len()` lies in a live device allocation that no queued or later
    /// work reads or writes until this returns.
    pub unsafe fn write_and_wait(&self, dst: u64, host: &[u8]) -> Result<(), KernelError> {
        if host.is_empty() {
            return Ok(());
        }
        self.dev.bind()?;
        // SAFETY: the caller's contract above; `host` outlives the copy (waited for below).
        unsafe { result::memcpy_htod_async(dst, host, self.stream.cu_stream()) }
            .map_err(gpu_err("cuMemcpyHtoDAsync"))?;
        self.stream
            .synchronize()
            .map_err(gpu_err("cuStreamSynchronize"))
    }

    /// A mark after every copy queued so far on this stream.
    pub fn mark(&self) -> Result<Mark, KernelError> {
        let event = self
            .dev
            .context()
            .new_event(None)
            .map_err(gpu_err("cuEventCreate"))?;
        event
            .record(&self.stream)
            .map_err(gpu_err("cuEventRecord"))?;
        Ok(Mark { event })
    }
}
