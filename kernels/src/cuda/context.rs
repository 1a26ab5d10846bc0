//! The CUDA device handle, device buffers and kernel launches.
//!
//! [`CudaDevice`] is a cheap `Clone` handle over one context, one stream, one cuBLAS handle and
//! the compiled-module cache. Memory is taken with stream-ordered allocation
//! (`cuMemAllocAsync`, pool kept warm) so per-step scratch buffers cost microseconds, except
//! while a graph is being captured: then from the graph's own [`Arena`], so that the graph
//! holds kernels next to kernels (programmatic edges) rather than memory nodes between them.
//! Kernels are launched with raw `cuLaunchKernel`: the typed launchers in [`super::ops`] and
//! [`super::mla`] check every length before they build the argument list.

use std::collections::HashMap;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaFunction, CudaStream};

use super::nvrtc::ModuleCache;
use crate::device::Device;
use crate::error::KernelError;
use crate::gpu::launch::{DeviceMem, Dv};
pub use crate::gpu::launch::{DevicePod, KernelArgs, KernelParam, LaunchDims};
use crate::gpu::{Defines, Source};

/// Checks that CUDA device `ordinal` can be opened: the driver library loads, NVRTC and
/// cuBLAS load, and the ordinal exists. Never panics.
pub fn probe(ordinal: usize) -> Result<(), KernelError> {
    let device = Device::Cuda(ordinal).to_string();
    let unavailable = |reason: String| KernelError::DeviceUnavailable {
        device: device.clone(),
        reason,
    };
    // SAFETY: only tries to dlopen the driver library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable(
            "no CUDA driver (libcuda.so) on this machine".into(),
        ));
    }
    // SAFETY: as above, for NVRTC.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(unavailable(
            "the CUDA driver loads but NVRTC (libnvrtc.so) does not; add the CUDA libraries to LD_LIBRARY_PATH".into(),
        ));
    }
    // SAFETY: as above, for cuBLAS.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(unavailable(
            "the CUDA driver loads but cuBLAS (libcublas.so) does not; add the CUDA libraries to LD_LIBRARY_PATH".into(),
        ));
    }
    let count = std::panic::catch_unwind(CudaContext::device_count)
        .map_err(|_| unavailable("the CUDA driver panicked while counting devices".into()))?
        .map_err(|e| unavailable(format!("cuDeviceGetCount failed: {e}")))?;
    if ordinal >= count.max(0) as usize {
        return Err(unavailable(format!(
            "ordinal {ordinal} is out of range: {count} CUDA device(s)"
        )));
    }
    Ok(())
}

/// An `[T; len]` array in device memory, freed (stream-ordered) on drop.
pub struct DeviceBuffer<T: DevicePod> {
    ptr: sys::CUdeviceptr,
    len: usize,
    dev: CudaDevice,
    /// From `cuMemAlloc` ([`CudaDevice::zeros_shareable`]), not the stream-ordered pool.
    shareable: bool,
    /// Taken from a graph capture's [`Arena`]: handed back to it on drop.
    arena: Option<Arc<Arena>>,
    _t: PhantomData<T>,
}

impl<T: DevicePod> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuffer<{}>[{}]",
            std::any::type_name::<T>(),
            self.len
        )
    }
}

impl<T: DevicePod> DeviceBuffer<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Raw device address of element 0.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The device that owns the allocation.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// Raw device address of element `i` (`i <= len`).
    pub fn ptr_at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.len);
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }

    /// Bytes.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

impl<T: DevicePod> DeviceBuffer<T> {
    /// The whole buffer as a view.
    pub fn v(&self) -> Dv<T> {
        Dv::raw(self.ptr, self.len)
    }
}

impl<T: DevicePod> DeviceMem for DeviceBuffer<T> {
    type Elem = T;

    fn v(&self) -> Dv<T> {
        Dv::raw(self.ptr, self.len)
    }
}

impl<T: DevicePod> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if let Some(arena) = &self.arena {
            arena.free(self.ptr, arena_bytes(self.bytes()));
            return;
        }
        let _host = super::host_time::span("free");
        let inner = &self.dev.inner;
        if inner.ctx.bind_to_thread().is_err() {
            return;
        }
        if self.shareable {
            // SAFETY: `ptr` came from cuMemAlloc and is freed exactly once, after the work
            // queued on the stream (which may still read it) has run.
            unsafe {
                let _ = result::stream::synchronize(inner.stream.cu_stream());
                let _ = result::free_sync(self.ptr);
            }
            return;
        }
        // SAFETY: `ptr` came from cuMemAllocAsync on this stream and is freed exactly once;
        // work queued on the stream that still reads it runs before the free.
        let _ = unsafe { result::free_async(self.ptr, inner.stream.cu_stream()) };
    }
}

struct Inner {
    /// Page-locked staging for small writes ([`super::upload`]; off with `FERRY_ASYNC_WRITES=0`),
    /// made at the first such write. First, so it is dropped (waiting for its copies) first.
    uploads: Mutex<Option<super::upload::UploadRing>>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The second stream of [`CudaDevice::side`] handles (kernel launches only).
    side_stream: Arc<CudaStream>,
    /// The events [`CudaDevice::wait_for`] records and waits on, one per direction (main →
    /// side, side → main), reused: re-recording an event after a wait was queued does not
    /// change that wait. The lock keeps a record and its wait together.
    order: Mutex<(CudaEvent, CudaEvent)>,
    blas: CudaBlas,
    ordinal: usize,
    name: String,
    cc: (i32, i32),
    sms: u32,
    smem_optin: u32,
    /// Launch with programmatic dependent launch (sm_90+; `FERRY_PDL=0` turns it off): see
    /// [`CudaDevice::launch`].
    pdl: bool,
    modules: ModuleCache,
    /// Functions whose dynamic shared memory limit was already raised.
    smem_set: Mutex<HashMap<(usize, u32), ()>>,
    /// Functions [`Twice`] launches twice (a profiling switch; empty in normal runs).
    twice: Mutex<std::collections::HashSet<usize>>,
    /// Between [`CudaDevice::begin_capture`] and [`CudaDevice::end_capture`].
    capturing: std::sync::atomic::AtomicBool,
    /// The running capture's arena (unless `FERRY_GRAPH_ARENA=0`), which its graph then owns.
    arena: Mutex<Option<Arc<Arena>>>,
}

/// `FERRY_PROFILE_TWICE=name,name,...`: every launch of the named kernels is queued twice, so
/// that a decode step's time with and without the repeat gives a kernel's cost *inside* the
/// step (a captured graph with programmatic dependent launch overlaps neighbours, which a
/// profiler timing each kernel alone does not see). Results are wrong under it (in-place
/// kernels apply twice): for timing runs only, and it says so on stderr.
struct Twice;

impl Twice {
    /// The kernel names, read once per process; `None` when unset (the normal case).
    fn names() -> Option<&'static std::collections::HashSet<String>> {
        static NAMES: OnceLock<Option<std::collections::HashSet<String>>> = OnceLock::new();
        NAMES
            .get_or_init(|| {
                let v = std::env::var("FERRY_PROFILE_TWICE").ok()?;
                let names: std::collections::HashSet<String> = v
                    .split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(String::from)
                    .collect();
                if names.is_empty() {
                    return None;
                }
                eprintln!(
                    "FERRY_PROFILE_TWICE: launching {names:?} twice: timings only, results are wrong"
                );
                Some(names)
            })
            .as_ref()
    }

    /// Names each kernel the first time it is looked up, so a run lists what a step launches.
    fn seen(name: &'static str, twice: bool) {
        static SEEN: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
        if let Ok(mut seen) = SEEN.lock() {
            if !seen.contains(&name) {
                seen.push(name);
                eprintln!(
                    "FERRY_PROFILE_TWICE: kernel {name}{}",
                    if twice { " (twice)" } else { "" }
                );
            }
        }
    }
}

/// One CUDA device: context, stream, cuBLAS handle and compiled modules. Cheap to clone.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
    /// Launches go to the side stream ([`CudaDevice::side`]).
    on_side: bool,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaDevice(cuda:{} {} sm_{}{}, {} SMs{})",
            self.inner.ordinal,
            self.inner.name,
            self.inner.cc.0,
            self.inner.cc.1,
            self.inner.sms,
            if self.on_side { ", side stream" } else { "" }
        )
    }
}

/// `dst[offset..offset + host.len()]` is inside `dst`, or a shape error.
fn check_write<T: DevicePod>(
    dst: &DeviceBuffer<T>,
    offset: usize,
    host: &[T],
) -> Result<(), KernelError> {
    if offset + host.len() > dst.len {
        return Err(KernelError::ShapeMismatch {
            op: "cuda_write",
            what: "dst",
            expected: offset + host.len(),
            got: dst.len,
        });
    }
    Ok(())
}

pub(crate) fn gpu_err(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> KernelError {
    move |e| KernelError::Gpu {
        op,
        message: e.to_string(),
    }
}

impl CudaDevice {
    /// Opens device `ordinal` after [`probe`] says it can; errors (never panics) otherwise.
    pub fn open(ordinal: usize) -> Result<Self, KernelError> {
        probe(ordinal)?;
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| KernelError::DeviceUnavailable {
                device: Device::Cuda(ordinal).to_string(),
                reason: "the CUDA driver panicked while creating a context".into(),
            })?
            .map_err(gpu_err("cuCtxCreate"))?;
        // Raw pointers and launches below manage their own ordering on one stream.
        // SAFETY: no cudarc-managed buffers are used with this context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(gpu_err("cuStreamCreate"))?;
        let side_stream = ctx.new_stream().map_err(gpu_err("cuStreamCreate"))?;
        let event = || ctx.new_event(None).map_err(gpu_err("cuEventCreate"));
        let order = Mutex::new((event()?, event()?));
        let blas = CudaBlas::new(stream.clone()).map_err(|e| KernelError::Gpu {
            op: "cublasCreate",
            message: e.to_string(),
        })?;
        let cc = ctx
            .compute_capability()
            .map_err(gpu_err("compute_capability"))?;
        let name = ctx.name().map_err(gpu_err("cuDeviceGetName"))?;
        let attr = |a| ctx.attribute(a).map_err(gpu_err("cuDeviceGetAttribute"));
        let sms = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let smem_optin =
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
                as u32;
        keep_pool_warm(&ctx)?;
        let pdl = cc.0 >= 9 && std::env::var("FERRY_PDL").map_or(true, |v| v != "0");
        Ok(Self {
            inner: Arc::new(Inner {
                uploads: Mutex::new(None),
                ctx,
                stream,
                side_stream,
                order,
                blas,
                ordinal,
                name,
                cc,
                sms,
                smem_optin,
                pdl,
                modules: ModuleCache::default(),
                smem_set: Mutex::new(HashMap::new()),
                twice: Mutex::default(),
                capturing: std::sync::atomic::AtomicBool::new(false),
                arena: Mutex::new(None),
            }),
            on_side: false,
        })
    }

    /// A handle whose kernel launches go to the device's second stream (everything else it
    /// does — allocations, copies, synchronisation — stays on the main stream). Work queued
    /// there runs beside the main stream's; order the two with [`CudaDevice::wait_for`].
    pub fn side(&self) -> CudaDevice {
        CudaDevice {
            inner: self.inner.clone(),
            on_side: true,
        }
    }

    /// The stream this handle launches on.
    fn launch_stream(&self) -> &Arc<CudaStream> {
        if self.on_side {
            &self.inner.side_stream
        } else {
            &self.inner.stream
        }
    }

    /// Work launched through this handle from now on waits for everything queued so far on
    /// `other`'s launch stream: an event recorded there, waited on here (under stream capture,
    /// a graph edge). A no-op when both launch on the same stream.
    pub fn wait_for(&self, other: &CudaDevice) -> Result<(), KernelError> {
        if self.on_side == other.on_side {
            return Ok(());
        }
        self.bind()?;
        let order = self.inner.order.lock().map_err(|_| KernelError::Gpu {
            op: "cuStreamWaitEvent",
            message: "stream-order events poisoned".into(),
        })?;
        let event = if other.on_side { &order.1 } else { &order.0 };
        event
            .record(other.launch_stream())
            .map_err(gpu_err("cuEventRecord"))?;
        self.launch_stream()
            .wait(event)
            .map_err(gpu_err("cuStreamWaitEvent"))
    }

    /// Device name as the driver reports it ("NVIDIA H200").
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Compute capability (9, 0 for Hopper).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.cc
    }

    /// Streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.inner.sms
    }

    /// Largest dynamic shared memory a block may opt into.
    pub fn max_smem_per_block(&self) -> u32 {
        self.inner.smem_optin
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    pub(crate) fn blas_handle(&self) -> cudarc::cublas::sys::cublasHandle_t {
        *self.inner.blas.handle()
    }

    pub(crate) fn bind(&self) -> Result<(), KernelError> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(gpu_err("cuCtxSetCurrent"))
    }

    /// `len` elements of uninitialised device memory.
    pub fn alloc<T: DevicePod>(&self, len: usize) -> Result<DeviceBuffer<T>, KernelError> {
        let _host = super::host_time::span("alloc");
        self.bind()?;
        let bytes = (len * std::mem::size_of::<T>()).max(256);
        // Only while capturing is there an arena to look for (the flag spares eager steps the lock).
        let arena = self
            .capturing()
            .then(|| self.inner.arena.lock().ok().and_then(|a| a.clone()))
            .flatten();
        if let Some(arena) = arena {
            let ptr = arena.alloc(arena_bytes(bytes))?;
            return Ok(DeviceBuffer {
                ptr,
                len,
                dev: self.clone(),
                shareable: false,
                arena: Some(arena),
                _t: PhantomData,
            });
        }
        // SAFETY: a plain stream-ordered allocation on this context's stream; the buffer owns
        // the pointer and frees it once.
        let ptr = unsafe { result::malloc_async(self.inner.stream.cu_stream(), bytes) }
            .map_err(gpu_err("cuMemAllocAsync"))?;
        Ok(DeviceBuffer {
            ptr,
            len,
            dev: self.clone(),
            shareable: false,
            arena: None,
            _t: PhantomData,
        })
    }

    /// `len` zeroed elements in memory other processes can map (`cuMemAlloc`, not the
    /// stream-ordered pool, whose allocations CUDA IPC cannot export): the KV cache, which a
    /// peer's transport (UCX `cuda_ipc`) writes into or reads from directly. Freed after the
    /// stream's queued work.
    pub fn zeros_shareable<T: DevicePod>(
        &self,
        len: usize,
    ) -> Result<DeviceBuffer<T>, KernelError> {
        self.bind()?;
        let bytes = (len * std::mem::size_of::<T>()).max(256);
        // SAFETY: a plain allocation on this context; the buffer owns the pointer and frees it
        // once (`Drop`, with `cuMemFree`).
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(gpu_err("cuMemAlloc"))?;
        let b = DeviceBuffer {
            ptr,
            len,
            dev: self.clone(),
            shareable: true,
            arena: None,
            _t: PhantomData,
        };
        self.memset_zero(&b)?;
        Ok(b)
    }

    /// `len` zeroed elements.
    pub fn zeros<T: DevicePod>(&self, len: usize) -> Result<DeviceBuffer<T>, KernelError> {
        let b = self.alloc::<T>(len)?;
        self.memset_zero(&b)?;
        Ok(b)
    }

    /// Sets every byte of `b` to zero (stream-ordered).
    pub fn memset_zero<T: DevicePod>(&self, b: &DeviceBuffer<T>) -> Result<(), KernelError> {
        self.bind()?;
        // SAFETY: writes exactly the buffer's bytes, in stream order.
        unsafe { result::memset_d8_async(b.ptr, 0, b.bytes(), self.inner.stream.cu_stream()) }
            .map_err(gpu_err("cuMemsetD8Async"))
    }

    /// A device copy of `host`.
    pub fn upload<T: DevicePod>(&self, host: &[T]) -> Result<DeviceBuffer<T>, KernelError> {
        let mut b = self.alloc::<T>(host.len())?;
        self.write(&mut b, 0, host)?;
        Ok(b)
    }

    /// Copies `host` into `dst[offset..offset + host.len()]`; `host` may be reused on return.
    /// The copy is done on return, except that a write of up to
    /// [`super::upload::MAX_STAGED_BYTES`] outside a graph capture takes [`Self::write_staged`]
    /// and is only queued (stream order still puts it before anything queued later), unless
    /// `FERRY_ASYNC_WRITES=0`.
    pub fn write<T: DevicePod>(
        &self,
        dst: &mut DeviceBuffer<T>,
        offset: usize,
        host: &[T],
    ) -> Result<(), KernelError> {
        let _host = super::host_time::span("write");
        if super::upload::enabled()
            && std::mem::size_of_val(host) <= super::upload::MAX_STAGED_BYTES
            && !self.capturing()
        {
            return self.write_staged(dst, offset, host);
        }
        check_write(dst, offset, host)?;
        if host.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the destination range is inside `dst` (checked above); the stream is
        // synchronised before returning, so `host` outlives the asynchronous copy.
        unsafe {
            result::memcpy_htod_async(dst.ptr_at(offset), host, self.inner.stream.cu_stream())
        }
        .map_err(gpu_err("cuMemcpyHtoDAsync"))?;
        self.synchronize()
    }

    /// [`Self::write`] without waiting ([`super::upload`]): `host` (at most
    /// [`super::upload::MAX_STAGED_BYTES`]) is copied into page-locked slots, a slot's worth
    /// each, their copies into `dst` queued on the stream, and the call returns; kernels queued later see the data. Refused
    /// under a graph capture, where the copy would replay from a slot since reused.
    pub fn write_staged<T: DevicePod>(
        &self,
        dst: &mut DeviceBuffer<T>,
        offset: usize,
        host: &[T],
    ) -> Result<(), KernelError> {
        check_write(dst, offset, host)?;
        if self.capturing() {
            return Err(KernelError::InvalidParam {
                op: "cuda_write_staged",
                field: "stream",
                limit: "not under graph capture",
                value: "capturing".into(),
            });
        }
        if host.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let mut ring = self.inner.uploads.lock().map_err(|_| KernelError::Gpu {
            op: "cuda_write_staged",
            message: "the staging slots' lock is poisoned".into(),
        })?;
        let ring = match &mut *ring {
            Some(r) => r,
            empty => empty.insert(super::upload::UploadRing::new(self)?),
        };
        // SAFETY: `T: DevicePod` is a primitive without padding, so its bytes are initialised
        // and may be read as `u8`s.
        let raw = unsafe {
            std::slice::from_raw_parts(host.as_ptr().cast::<u8>(), std::mem::size_of_val(host))
        };
        if raw.len() > super::upload::MAX_STAGED_BYTES {
            return Err(KernelError::ShapeMismatch {
                op: "cuda_write_staged",
                what: "bytes",
                expected: super::upload::MAX_STAGED_BYTES,
                got: raw.len(),
            });
        }
        // A slot's worth at a time, each piece to its own place in `dst`.
        for (k, piece) in raw.chunks(super::upload::SLOT_BYTES).enumerate() {
            let at = dst.ptr_at(offset) + (k * super::upload::SLOT_BYTES) as u64;
            // SAFETY: the piece's destination lies inside `dst`'s checked range, whose free is
            // queued on this stream behind the copy.
            unsafe { ring.write(at, piece, &self.inner.stream) }?;
        }
        Ok(())
    }

    /// Copies the whole buffer back to the host (waits for queued work).
    pub fn download<T: DevicePod>(&self, src: &DeviceBuffer<T>) -> Result<Vec<T>, KernelError> {
        self.download_range(src, 0, src.len)
    }

    /// Copies `src[offset..offset + len]` back to the host.
    pub fn download_range<T: DevicePod>(
        &self,
        src: &DeviceBuffer<T>,
        offset: usize,
        len: usize,
    ) -> Result<Vec<T>, KernelError> {
        if offset + len > src.len {
            return Err(KernelError::ShapeMismatch {
                op: "cuda_download",
                what: "src",
                expected: offset + len,
                got: src.len,
            });
        }
        let _host = super::host_time::span("download");
        let mut out = vec![T::default(); len];
        if len == 0 {
            return Ok(out);
        }
        self.bind()?;
        // SAFETY: the source range is inside `src`; `out` has exactly `len` elements and the
        // stream is synchronised before `out` is returned.
        unsafe {
            result::memcpy_dtoh_async(&mut out, src.ptr_at(offset), self.inner.stream.cu_stream())
        }
        .map_err(gpu_err("cuMemcpyDtoHAsync"))?;
        self.synchronize()?;
        Ok(out)
    }

    /// Device-to-device copy of the first `len` elements of `src` into `dst`.
    pub fn copy<T: DevicePod>(
        &self,
        src: &DeviceBuffer<T>,
        dst: &mut DeviceBuffer<T>,
        len: usize,
    ) -> Result<(), KernelError> {
        let _host = super::host_time::span("copy");
        if len > src.len || len > dst.len {
            return Err(KernelError::ShapeMismatch {
                op: "cuda_copy",
                what: "len",
                expected: src.len.min(dst.len),
                got: len,
            });
        }
        self.bind()?;
        // SAFETY: both ranges are inside their buffers (checked above).
        unsafe {
            result::memcpy_dtod_async(
                dst.ptr,
                src.ptr,
                len * std::mem::size_of::<T>(),
                self.inner.stream.cu_stream(),
            )
        }
        .map_err(gpu_err("cuMemcpyDtoDAsync"))
    }

    /// Device-to-device copy of `src[src_at..src_at + len]` into `dst[dst_at..dst_at + len]`
    /// (stream-ordered).
    pub fn copy_range<T: DevicePod>(
        &self,
        (src, src_at): (&DeviceBuffer<T>, usize),
        (dst, dst_at): (&mut DeviceBuffer<T>, usize),
        len: usize,
    ) -> Result<(), KernelError> {
        let _host = super::host_time::span("copy");
        if src_at + len > src.len || dst_at + len > dst.len {
            return Err(KernelError::ShapeMismatch {
                op: "cuda_copy_range",
                what: "range",
                expected: (src_at + len).max(dst_at + len),
                got: src.len.min(dst.len),
            });
        }
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both ranges are inside their buffers (checked above).
        unsafe {
            result::memcpy_dtod_async(
                dst.ptr_at(dst_at),
                src.ptr_at(src_at),
                len * std::mem::size_of::<T>(),
                self.inner.stream.cu_stream(),
            )
        }
        .map_err(gpu_err("cuMemcpyDtoDAsync"))
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        let _host = super::host_time::span("synchronize");
        let start = super::sync_sites::enabled().then(std::time::Instant::now);
        let done = self
            .inner
            .stream
            .synchronize()
            .map_err(gpu_err("cuStreamSynchronize"));
        if let Some(start) = start {
            super::sync_sites::record(start.elapsed());
        }
        done
    }

    /// The compiled function `name` from `source` built with `defines` for this card.
    pub fn function(
        &self,
        source: Source,
        defines: &Defines,
        name: &'static str,
    ) -> Result<CudaFunction, KernelError> {
        self.bind()?;
        let f =
            self.inner
                .modules
                .function(&self.inner.ctx, self.inner.cc, (source, defines, name))?;
        if super::host_time::enabled() {
            super::host_time::name_kernel(f.cu_function() as usize, name);
        }
        if let Some(names) = Twice::names() {
            Twice::seen(name, names.contains(name));
            if names.contains(name) {
                if let Ok(mut set) = self.inner.twice.lock() {
                    set.insert(f.cu_function() as usize);
                }
            }
        }
        Ok(f)
    }

    /// Launches `f` on the device's stream.
    ///
    /// On sm_90+ every launch carries the programmatic-stream-serialization attribute
    /// (programmatic dependent launch): the kernel's blocks may be scheduled while the kernel
    /// ahead of it is still running, and wait for it with `griddepcontrol.wait`, the first
    /// statement of every kernel in `kernels/src/gpu/*.cu` (`pdl_enter` in compat.cuh). A
    /// decode step is ~400 short launches; this hides each one's launch and ramp-up behind
    /// its predecessor, in eager steps and in captured graphs alike (a captured launch keeps
    /// the attribute as a programmatic edge).
    pub fn launch(
        &self,
        f: &CudaFunction,
        dims: LaunchDims,
        args: &mut KernelArgs,
    ) -> Result<(), KernelError> {
        let _host = super::host_time::enabled()
            .then(|| {
                super::host_time::span(super::host_time::kernel_name(f.cu_function() as usize))
            })
            .flatten();
        if Twice::names().is_some()
            && self
                .inner
                .twice
                .lock()
                .is_ok_and(|s| s.contains(&(f.cu_function() as usize)))
        {
            self.launch_once(f, dims, args)?;
        }
        self.launch_once(f, dims, args)
    }

    fn launch_once(
        &self,
        f: &CudaFunction,
        dims: LaunchDims,
        args: &mut KernelArgs,
    ) -> Result<(), KernelError> {
        self.bind()?;
        if dims.smem > 48 * 1024 {
            self.raise_smem_limit(f, dims.smem)?;
        }
        let mut params = args.pointers();
        if !self.inner.pdl {
            // SAFETY: every typed launcher checks buffer lengths against the kernel's indexing
            // before building `args`, whose slots match the kernel's parameters in order and
            // type.
            return unsafe {
                result::launch_kernel(
                    f.cu_function(),
                    dims.grid,
                    dims.block,
                    dims.smem,
                    self.launch_stream().cu_stream(),
                    &mut params,
                )
            }
            .map_err(gpu_err("cuLaunchKernel"));
        }
        // SAFETY: the union is plain data; the attribute's id says which field is read.
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let config = sys::CUlaunchConfig {
            gridDimX: dims.grid.0,
            gridDimY: dims.grid.1,
            gridDimZ: dims.grid.2,
            blockDimX: dims.block.0,
            blockDimY: dims.block.1,
            blockDimZ: dims.block.2,
            sharedMemBytes: dims.smem,
            hStream: self.launch_stream().cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as above; `config` and `attr` outlive the call, which copies them.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(gpu_err("cuLaunchKernelEx"))
    }

    fn raise_smem_limit(&self, f: &CudaFunction, bytes: u32) -> Result<(), KernelError> {
        if bytes > self.inner.smem_optin {
            return Err(KernelError::InvalidParam {
                op: "cuda_launch",
                field: "dynamic shared memory",
                limit: "<= the device's opt-in maximum",
                value: format!("{bytes} > {}", self.inner.smem_optin),
            });
        }
        let key = (f.cu_function() as usize, bytes);
        let mut set = self.inner.smem_set.lock().map_err(|_| KernelError::Gpu {
            op: "cuda_launch",
            message: "shared-memory attribute cache poisoned".into(),
        })?;
        if set.contains_key(&key) {
            return Ok(());
        }
        // SAFETY: sets an attribute of a live function handle.
        unsafe {
            result::function::set_function_attribute(
                f.cu_function(),
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .map_err(gpu_err("cuFuncSetAttribute"))?;
        set.insert(key, ());
        Ok(())
    }

    /// Starts recording the stream's work into a graph instead of running it (relaxed mode, so
    /// an arena may grow with `cuMemAlloc` while capturing). Nothing may synchronise or copy
    /// host memory until [`Self::end_capture`].
    ///
    /// The buffers allocated while capturing come from an [`Arena`] the graph owns instead
    /// (unless `FERRY_GRAPH_ARENA=0`: then stream-ordered allocations, which become graph
    /// memory nodes), so the graph holds no memory nodes between its kernels.
    pub fn begin_capture(&self) -> Result<(), KernelError> {
        self.bind()?;
        if graph_arena_switch() {
            let arena = Arena::new(self.inner.ctx.clone(), self.inner.stream.clone())?;
            if let Ok(mut slot) = self.inner.arena.lock() {
                *slot = Some(Arc::new(arena));
            }
        }
        self.inner
            .stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(gpu_err("cuStreamBeginCapture"))
            .inspect_err(|_| {
                self.take_arena();
            })?;
        self.inner.capturing.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Ends the running capture's arena (no later allocation takes from it) and returns it.
    fn take_arena(&self) -> Option<Arc<Arena>> {
        self.inner.arena.lock().ok().and_then(|mut a| a.take())
    }

    /// Whether the stream's work is being recorded into a graph ([`Self::begin_capture`]).
    pub fn capturing(&self) -> bool {
        self.inner.capturing.load(Ordering::Relaxed)
    }

    /// Ends a capture and instantiates the graph.
    pub fn end_capture(&self) -> Result<GpuGraph, KernelError> {
        self.inner.capturing.store(false, Ordering::Relaxed);
        let arena = self.take_arena();
        let graph = self
            .inner
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(gpu_err("cuStreamEndCapture"))?
            .ok_or(KernelError::Gpu {
                op: "cuStreamEndCapture",
                message: "the capture recorded nothing".into(),
            })?;
        let graph = GpuGraph {
            graph,
            _arena: arena,
        };
        if graph_edges_switch() {
            match graph.edges() {
                Ok(e) => eprintln!(
                    "FERRY_GRAPH_EDGES: captured {} nodes, {} edges, {} programmatic; nodes: {}; \
                     full edges between kernels: {}",
                    e.nodes, e.edges, e.programmatic, e.kinds, e.full_kernel_edges
                ),
                Err(e) => eprintln!("FERRY_GRAPH_EDGES: {e}"),
            }
        }
        Ok(graph)
    }

    /// A stopwatch of GPU time on this device's stream.
    pub fn timer(&self) -> Result<GpuTimer, KernelError> {
        let make = || {
            self.inner
                .ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(gpu_err("cuEventCreate"))
        };
        Ok(GpuTimer {
            start: make()?,
            stop: make()?,
            stream: self.inner.stream.clone(),
        })
    }
}

/// An instantiated CUDA graph, replayed on the device's stream.
pub struct GpuGraph {
    graph: cudarc::driver::CudaGraph,
    /// The memory of the buffers allocated during its capture ([`Arena`]), freed
    /// after the graph (fields drop in order) and after every buffer taken from it.
    _arena: Option<Arc<Arena>>,
}

// SAFETY: cudarc's `CudaGraph` is `!Send` only because it holds the raw `CUgraph` /
// `CUgraphExec` handles. The driver allows those handles to be used from any host thread of
// the process; what it requires is that the context is current and that one exec is not
// launched from two threads at once. `CudaGraph::launch` and its `Drop` bind the stream's
// context to the calling thread first, and `GpuGraph` is owned (moved, never shared: it is not
// `Sync`), so moving it to the engine thread that then alone uses it is sound.
unsafe impl Send for GpuGraph {}

impl GpuGraph {
    /// Queues one replay.
    pub fn launch(&self) -> Result<(), KernelError> {
        let _host = super::host_time::span("cuGraphLaunch");
        self.graph.launch().map_err(gpu_err("cuGraphLaunch"))
    }

    /// The captured graph's nodes and edges, and how many edges are programmatic (a kernel
    /// launched with programmatic dependent launch kept that in the graph: the next kernel may
    /// be scheduled before this one ends). A diagnostic: `FERRY_GRAPH_EDGES=1` prints it at
    /// each capture, to tell whether graph replays overlap neighbouring kernels at all.
    pub fn edges(&self) -> Result<GraphEdges, KernelError> {
        let g = self.graph.cu_graph();
        let mut nodes = 0usize;
        // SAFETY: a count query on the live graph this handle owns (null node array).
        unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut nodes) }
            .result()
            .map_err(gpu_err("cuGraphGetNodes"))?;
        let mut all = vec![std::ptr::null_mut(); nodes];
        // SAFETY: `all` holds `nodes` entries, the count just queried.
        unsafe { sys::cuGraphGetNodes(g, all.as_mut_ptr(), &mut nodes) }
            .result()
            .map_err(gpu_err("cuGraphGetNodes"))?;
        all.truncate(nodes);
        let kind_of = |node: sys::CUgraphNode| -> Result<u32, KernelError> {
            let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: a query on a node of the live graph.
            unsafe { sys::cuGraphNodeGetType(node, &mut t) }
                .result()
                .map_err(gpu_err("cuGraphNodeGetType"))?;
            Ok(t as u32)
        };
        let mut kinds = std::collections::BTreeMap::<&'static str, usize>::new();
        let mut kernels = std::collections::HashSet::new();
        for &node in &all {
            let t = kind_of(node)?;
            if t == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL as u32 {
                kernels.insert(node as usize);
            }
            *kinds.entry(node_kind_name(t)).or_default() += 1;
        }
        let mut n = 0usize;
        // SAFETY: as above, for the edges.
        unsafe {
            use std::ptr::null_mut;
            sys::cuGraphGetEdges_v2(g, null_mut(), null_mut(), null_mut(), &mut n)
        }
        .result()
        .map_err(gpu_err("cuGraphGetEdges_v2"))?;
        let mut from = vec![std::ptr::null_mut(); n];
        let mut to = vec![std::ptr::null_mut(); n];
        let blank = sys::CUgraphEdgeData {
            from_port: 0,
            to_port: 0,
            type_: 0,
            reserved: [0; 5],
        };
        let mut data = vec![blank; n];
        // SAFETY: the three arrays hold `n` entries each, the count just queried; the driver
        // writes at most `n` and sets `n` to what it wrote.
        unsafe {
            sys::cuGraphGetEdges_v2(
                g,
                from.as_mut_ptr(),
                to.as_mut_ptr(),
                data.as_mut_ptr(),
                &mut n,
            )
        }
        .result()
        .map_err(gpu_err("cuGraphGetEdges_v2"))?;
        let programmatic = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
        let n = n.min(data.len());
        let full_kernel_edges = (0..n)
            .filter(|&i| {
                data[i].type_ != programmatic
                    && kernels.contains(&(from[i] as usize))
                    && kernels.contains(&(to[i] as usize))
            })
            .count();
        Ok(GraphEdges {
            nodes,
            edges: n,
            programmatic: data[..n].iter().filter(|d| d.type_ == programmatic).count(),
            kinds: kinds
                .iter()
                .map(|(k, c)| format!("{c} {k}"))
                .collect::<Vec<_>>()
                .join(", "),
            full_kernel_edges,
        })
    }
}

/// A graph node type's name, for [`GraphEdges::kinds`].
fn node_kind_name(t: u32) -> &'static str {
    match t {
        0 => "kernel",
        1 => "memcpy",
        2 => "memset",
        3 => "host",
        4 => "child graph",
        5 => "empty",
        6 => "event wait",
        7 => "event record",
        10 => "memory alloc",
        11 => "memory free",
        _ => "other",
    }
}

/// What [`GpuGraph::edges`] counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphEdges {
    /// Nodes (kernels, copies, memory nodes, event nodes).
    pub nodes: usize,
    /// Dependencies between them.
    pub edges: usize,
    /// Of those, programmatic ones (programmatic dependent launch).
    pub programmatic: usize,
    /// The nodes by type, e.g. `"12 kernel, 3 memset"`.
    pub kinds: String,
    /// Edges from a kernel to a kernel that are not programmatic (the second waits for the
    /// whole first: cuBLAS's kernels, or launches without the attribute).
    pub full_kernel_edges: usize,
}

/// Device memory for the buffers a graph capture allocates, owned by the captured graph
/// (`FERRY_GRAPH_ARENA=0`: stream-ordered allocations, as before). Stream-ordered allocations made while capturing become memory nodes
/// of the graph, and an edge into or out of a memory node is a full dependency: the kernel
/// after it cannot start early under programmatic dependent launch. Taking the capture's
/// buffers from memory reserved beforehand leaves kernels next to kernels.
///
/// Chunks come from `cuMemAlloc` (the first, [`ARENA_FIRST`], before the capture begins;
/// later ones during it, which the relaxed capture mode allows, each at least as large as all
/// before it, so an arena reserves less than twice what its capture needed at most at once). Within a capture a freed range is taken again by a later allocation (first fit):
/// the graph is one chain on the main stream (the side stream forks from it and joins it
/// before buffers it reads are freed), and a kernel writes only after `griddepcontrol.wait`
/// (every kernel's `pdl_enter`), i.e. after all kernels before it have finished, so the later
/// buffer's writes never meet the earlier one's reads.
pub(crate) struct Arena {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    state: Mutex<ArenaState>,
}

#[derive(Default)]
struct ArenaState {
    /// (base, bytes) of each `cuMemAlloc` chunk.
    chunks: Vec<(sys::CUdeviceptr, usize)>,
    /// Free ranges (start, bytes), sorted by start, neighbours merged.
    free: Vec<(u64, usize)>,
}

impl ArenaState {
    /// The start of `bytes` taken from the first free range that holds them.
    fn take(&mut self, bytes: usize) -> Option<u64> {
        let i = self.free.iter().position(|&(_, len)| len >= bytes)?;
        let (start, len) = self.free[i];
        if len == bytes {
            self.free.remove(i);
        } else {
            self.free[i] = (start + bytes as u64, len - bytes);
        }
        Some(start)
    }

    /// Makes `[start, start + bytes)` free again, merged with free neighbours.
    fn give(&mut self, start: u64, bytes: usize) {
        let at = self.free.partition_point(|&(s, _)| s < start);
        self.free.insert(at, (start, bytes));
        if at + 1 < self.free.len()
            && self.free[at].0 + self.free[at].1 as u64 == self.free[at + 1].0
        {
            self.free[at].1 += self.free[at + 1].1;
            self.free.remove(at + 1);
        }
        if at > 0 && self.free[at - 1].0 + self.free[at - 1].1 as u64 == self.free[at].0 {
            self.free[at - 1].1 += self.free[at].1;
            self.free.remove(at);
        }
    }
}

/// Bytes an arena hands out for a request: whole 256-byte units, as the pool aligns.
fn arena_bytes(bytes: usize) -> usize {
    bytes.max(1).div_ceil(256) * 256
}

/// Bytes of an arena's first chunk.
pub const ARENA_FIRST: usize = 16 << 20;

impl Arena {
    fn new(ctx: Arc<CudaContext>, stream: Arc<CudaStream>) -> Result<Self, KernelError> {
        let arena = Arena {
            ctx,
            stream,
            state: Mutex::new(ArenaState::default()),
        };
        arena.grow(ARENA_FIRST)?;
        Ok(arena)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, ArenaState>, KernelError> {
        self.state.lock().map_err(|_| KernelError::Gpu {
            op: "graph_arena",
            message: "arena lock poisoned".into(),
        })
    }

    /// Adds a chunk of at least `bytes`.
    fn grow(&self, bytes: usize) -> Result<(), KernelError> {
        let bytes = arena_bytes(bytes);
        self.ctx
            .bind_to_thread()
            .map_err(gpu_err("cuCtxSetCurrent"))?;
        // SAFETY: a plain allocation on this context, freed once when the arena drops.
        let base = unsafe { result::malloc_sync(bytes) }.map_err(gpu_err("cuMemAlloc"))?;
        let mut st = self.lock()?;
        st.chunks.push((base, bytes));
        st.give(base, bytes);
        Ok(())
    }

    /// `bytes` (a multiple of 256) from the first free range that holds them.
    fn alloc(&self, bytes: usize) -> Result<sys::CUdeviceptr, KernelError> {
        for attempt in 0..2 {
            if let Some(ptr) = self.lock()?.take(bytes) {
                return Ok(ptr);
            }
            if attempt == 0 {
                self.grow(bytes.max(self.reserved()))?;
            }
        }
        Err(KernelError::Gpu {
            op: "graph_arena",
            message: format!("no free range of {bytes} bytes after growing"),
        })
    }

    /// Hands `[ptr, ptr + bytes)` back, merging it with free neighbours.
    fn free(&self, ptr: sys::CUdeviceptr, bytes: usize) {
        if let Ok(mut st) = self.state.lock() {
            st.give(ptr, bytes);
        }
    }

    /// Bytes of all chunks.
    fn reserved(&self) -> usize {
        self.state
            .lock()
            .map(|st| st.chunks.iter().map(|&(_, b)| b).sum())
            .unwrap_or(0)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        let chunks = self
            .state
            .get_mut()
            .map(|st| std::mem::take(&mut st.chunks))
            .unwrap_or_default();
        // SAFETY: each chunk came from cuMemAlloc and is freed once, after the stream's queued
        // work (a replay of the graph that used it) has run.
        unsafe {
            let _ = result::stream::synchronize(self.stream.cu_stream());
            for (base, _) in chunks {
                let _ = result::free_sync(base);
            }
        }
    }
}

/// Whether graph captures take their buffers from an [`Arena`] (read once): yes unless
/// `FERRY_GRAPH_ARENA=0`. On an H100 the arena made every edge of a single-stream step's graph
/// programmatic (355 kernels; before, 299 allocation and 299 free nodes left 187 of 1,003
/// edges programmatic) and the step 5.6 % faster (BENCHMARKS.md, session 35).
pub fn graph_arena_switch() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERRY_GRAPH_ARENA").map_or(true, |v| v != "0"))
}

/// `FERRY_GRAPH_EDGES=1` (read once): print each captured graph's [`GraphEdges`] on stderr.
fn graph_edges_switch() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERRY_GRAPH_EDGES").is_ok_and(|v| v == "1"))
}

/// GPU-side timing between two events on the device's stream.
pub struct GpuTimer {
    start: CudaEvent,
    stop: CudaEvent,
    stream: Arc<CudaStream>,
}

impl GpuTimer {
    /// Records the start event.
    pub fn start(&self) -> Result<(), KernelError> {
        self.start
            .record(&self.stream)
            .map_err(gpu_err("cuEventRecord"))
    }

    /// Records the stop event, waits for it and returns the elapsed milliseconds.
    pub fn stop_ms(&self) -> Result<f32, KernelError> {
        self.stop
            .record(&self.stream)
            .map_err(gpu_err("cuEventRecord"))?;
        self.stop
            .synchronize()
            .map_err(gpu_err("cuEventSynchronize"))?;
        self.start
            .elapsed_ms(&self.stop)
            .map_err(gpu_err("cuEventElapsedTime"))
    }
}

/// Keeps freed memory in the default pool instead of returning it to the OS at every sync.
fn keep_pool_warm(ctx: &Arc<CudaContext>) -> Result<(), KernelError> {
    if !ctx.has_async_alloc() {
        return Err(KernelError::DeviceUnavailable {
            device: Device::Cuda(ctx.ordinal()).to_string(),
            reason: "the device does not support stream-ordered allocation".into(),
        });
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: queries the default pool of a valid device into a local.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .map_err(gpu_err("cuDeviceGetDefaultMemPool"))?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: sets a documented attribute of that pool from a local u64.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut c_void,
        )
    }
    .result()
    .map_err(gpu_err("cuMemPoolSetAttribute"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// First fit, reuse of freed ranges, and merging, on made-up addresses (no GPU).
    #[test]
    fn an_arena_reuses_what_was_freed_and_merges_neighbours() {
        let mut st = ArenaState::default();
        st.give(0x1000, 4096);
        let a = st.take(1024).unwrap();
        let b = st.take(1024).unwrap();
        let c = st.take(1024).unwrap();
        assert_eq!((a, b, c), (0x1000, 0x1400, 0x1800));
        assert_eq!(st.free, vec![(0x1c00, 1024)]);
        assert_eq!(st.take(2048), None, "only 1 KiB is left");
        st.give(b, 1024);
        assert_eq!(
            st.take(512),
            Some(b),
            "a freed range is taken first (first fit)"
        );
        st.give(b, 512);
        st.give(a, 1024);
        st.give(c, 1024);
        assert_eq!(
            st.free,
            vec![(0x1000, 4096)],
            "neighbours merge back into one range"
        );
        assert_eq!(arena_bytes(1), 256);
        assert_eq!(arena_bytes(257), 512);
    }
}
