//! The ROCm backend: the HIP runtime through hip-sys, the kernel sources through hipRTC, and
//! [`RocmDevice`] as a [`Gpu`] runtime, so the launchers of [`crate::gpu`] — the ones the CUDA
//! backend runs — run here too and `backend::Backend::Rocm` implements every coarse op.
//!
//! | module | owns |
//! |---|---|
//! | [`ffi`] | the hipRTC functions hip-sys lacks, declared by hand |
//! | [`hiprtc`] | compiling `gpu/*.cu` into code objects for the card's `gfx` architecture |
//! | this file | [`probe`], [`RocmDevice`] (device selection, module cache, memory, launches), [`HipBuffer`] |
//!
//! **Runtime model.** Everything goes on the device's null (default) stream, in order:
//! launches are asynchronous (`hipModuleLaunchKernel`), device-to-device copies and memsets are
//! queued on the same stream, uploads (`hipMemcpyHtoD`) return once the copy is done and
//! downloads synchronise first. Memory is plain `hipMalloc`; a [`HipBuffer`] frees itself on
//! drop with `hipFree`, which HIP documents as an implicit `hipDeviceSynchronize` — so a
//! scratch buffer is never freed under a queued kernel, at the price of one device
//! synchronisation per freed buffer (stream-ordered `hipMallocAsync` would remove it; it is
//! beta in HIP 5.2 and untested here). Set HIP's own `HIP_LAUNCH_BLOCKING=1` to make every
//! launch synchronous while debugging. The current device is per host thread in HIP, so every
//! call selects the device's ordinal first (`hipSetDevice`, as `cuCtxSetCurrent` on CUDA).
//! Modules are compiled once per (source, defines) and their functions looked up once.
//!
//! **What runs on ROCm.** Only portable kernels: hipRTC defines `FERRY_MMA` 0, so no PTX, no
//! tensor-core tile / packed / flash kernels, no wgmma / TMA / bulk-copy kernels, and no
//! cuBLAS ([`Gpu::gemm`] is the portable tiled kernel). [`Gpu::TENSOR_CORES`] is false, which
//! is how the backend picks the per-head absorbed kernels and the f32 MHA-form kernel here;
//! `backend::dispatch` lists the choice per op.
//!
//! **What has run.** Everything here compiles against Debian's `libamdhip64-dev` 5.2, and hipRTC
//! compiles every kernel source with every set of defines the ROCm arms use for gfx90a on a
//! machine without a GPU (`tests/rocm.rs`). The launchers are the CUDA backend's, exercised on
//! an H200; the portable GEMM kernel has run there too (`tests/cuda_parity.rs`). No AMD GPU was
//! available, so this backend has run only against a CPU implementation of the same HIP calls
//! (`tools/hip-emu`, in CI through `scripts/hip_emu.sh`): the contract tests
//! (`tests/backend*.rs`, `model/tests/backend_model.rs`, the drafter and engine tests) include
//! it when `RocmDevice::open(0)` works and skip it otherwise.

pub mod ffi;
pub mod hiprtc;

use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use hip_sys::hiprt as hip;

use crate::device::Device;
use crate::error::KernelError;
use crate::gpu::launch::{DeviceMem, DevicePod, Dv, Gpu, KernelArgs, LaunchDims, NOT_CUDA};
use crate::gpu::ops::{gemm_tiled, GemmPrecision, GpuMatrix};
use crate::gpu::{Defines, Source};

fn check(op: &'static str, r: hip::hipError_t) -> Result<(), KernelError> {
    if r == hip::hipError_t::hipSuccess {
        return Ok(());
    }
    // SAFETY: HIP returns a static NUL-terminated string for every error code.
    let msg = unsafe { CStr::from_ptr(hip::hipGetErrorString(r)) };
    Err(KernelError::Gpu {
        op,
        message: msg.to_string_lossy().into_owned(),
    })
}

/// The null stream: every op of a device is queued on it, in order.
fn null_stream() -> hip::hipStream_t {
    std::ptr::null_mut()
}

/// Checks that HIP device `ordinal` exists. Never panics (`hipErrorNoDevice` on a machine
/// without an AMD GPU).
pub fn probe(ordinal: usize) -> Result<(), KernelError> {
    let mut count = 0i32;
    // SAFETY: writes the device count into a local.
    let r = unsafe { hip::hipGetDeviceCount(&mut count) };
    let device = Device::Rocm(ordinal).to_string();
    if r != hip::hipError_t::hipSuccess {
        // SAFETY: as in `check`.
        let msg = unsafe { CStr::from_ptr(hip::hipGetErrorString(r)) };
        return Err(KernelError::DeviceUnavailable {
            device,
            reason: format!("hipGetDeviceCount: {}", msg.to_string_lossy()),
        });
    }
    if ordinal >= count.max(0) as usize {
        return Err(KernelError::DeviceUnavailable {
            device,
            reason: format!("ordinal {ordinal} is out of range: {count} HIP device(s)"),
        });
    }
    Ok(())
}

/// A function handle of a loaded module.
#[derive(Debug, Clone, Copy)]
pub struct HipFunction(hip::hipFunction_t);

// SAFETY: a `hipFunction_t` is an immutable handle into a loaded module; the HIP runtime
// allows launching it from any host thread. The module outlives it (unloaded only when the
// last device handle drops).
unsafe impl Send for HipFunction {}
// SAFETY: as above; launching does not mutate the handle.
unsafe impl Sync for HipFunction {}

struct Loaded {
    module: hip::hipModule_t,
    functions: HashMap<&'static str, HipFunction>,
}

struct Inner {
    ordinal: usize,
    arch: String,
    name: String,
    compute_units: u32,
    modules: Mutex<HashMap<(Source, Defines), Loaded>>,
}

// SAFETY: module handles are only used through the HIP runtime, which is thread-safe; the map
// is behind a mutex.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: selects this device for the unloads below.
        if unsafe { hip::hipSetDevice(self.ordinal as i32) } != hip::hipError_t::hipSuccess {
            return;
        }
        if let Ok(m) = self.modules.get_mut() {
            for (_, loaded) in m.drain() {
                // SAFETY: each module was loaded once and is unloaded once; no buffer or
                // function of this device outlives the last handle (buffers hold one).
                let _ = unsafe { hip::hipModuleUnload(loaded.module) };
            }
        }
    }
}

/// One HIP device: its architecture, compiled modules and memory. A cheap `Clone` handle.
#[derive(Clone)]
pub struct RocmDevice {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RocmDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RocmDevice(rocm:{} {} {}, {} CUs)",
            self.inner.ordinal, self.inner.name, self.inner.arch, self.inner.compute_units
        )
    }
}

/// An `[T; len]` array in HIP device memory, freed on drop (`hipFree`: an implicit device
/// synchronisation, so no queued kernel still reads it).
pub struct HipBuffer<T: DevicePod> {
    ptr: u64,
    len: usize,
    dev: RocmDevice,
    _t: PhantomData<T>,
}

impl<T: DevicePod> std::fmt::Debug for HipBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HipBuffer<{}>[{}]", std::any::type_name::<T>(), self.len)
    }
}

impl<T: DevicePod> HipBuffer<T> {
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

    /// Raw device address of element `i` (`i <= len`).
    pub fn ptr_at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.len);
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }

    /// Bytes.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device that owns the allocation.
    pub fn device(&self) -> &RocmDevice {
        &self.dev
    }

    /// The whole buffer as a view.
    pub fn v(&self) -> Dv<T> {
        Dv::raw(self.ptr, self.len)
    }
}

impl<T: DevicePod> DeviceMem for HipBuffer<T> {
    type Elem = T;

    fn v(&self) -> Dv<T> {
        Dv::raw(self.ptr, self.len)
    }
}

// SAFETY: the buffer owns a device allocation (a plain address); HIP's memory calls may be
// made from any thread.
unsafe impl<T: DevicePod> Send for HipBuffer<T> {}
// SAFETY: shared references only read the address and length.
unsafe impl<T: DevicePod> Sync for HipBuffer<T> {}

impl<T: DevicePod> Drop for HipBuffer<T> {
    fn drop(&mut self) {
        if self.dev.bind().is_err() {
            return;
        }
        // SAFETY: `ptr` came from hipMalloc on this device and is freed exactly once; hipFree
        // synchronises the device first, so no queued work still reads it.
        let _ = unsafe { hip::hipFree(self.ptr as *mut c_void) };
    }
}

impl RocmDevice {
    /// Opens device `ordinal` after [`probe`].
    pub fn open(ordinal: usize) -> Result<Self, KernelError> {
        probe(ordinal)?;
        // SAFETY: selects an existing device for this thread.
        check("hipSetDevice", unsafe { hip::hipSetDevice(ordinal as i32) })?;
        let mut props = std::mem::MaybeUninit::<hip::hipDeviceProp_t>::zeroed();
        // SAFETY: fills the struct for an existing device.
        check("hipGetDeviceProperties", unsafe {
            hip::hipGetDeviceProperties(props.as_mut_ptr(), ordinal as i32)
        })?;
        // SAFETY: initialised by the successful call above.
        let props = unsafe { props.assume_init() };
        // SAFETY: gcnArchName is a NUL-terminated fixed array filled by the runtime.
        let full = unsafe { CStr::from_ptr(props.gcnArchName.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let arch = full.split(':').next().unwrap_or("gfx90a").to_string();
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: writes at most `name.len()` bytes (NUL included) into the local array.
        check("hipDeviceGetName", unsafe {
            hip::hipDeviceGetName(name.as_mut_ptr(), name.len() as i32, ordinal as i32)
        })?;
        // SAFETY: the runtime NUL-terminated the name inside the array.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut cus = 0i32;
        // SAFETY: writes one int attribute of an existing device into a local.
        check("hipDeviceGetAttribute", unsafe {
            hip::hipDeviceGetAttribute(
                &mut cus,
                hip::hipDeviceAttribute_t::hipDeviceAttributeMultiprocessorCount,
                ordinal as i32,
            )
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                ordinal,
                arch,
                name,
                compute_units: cus.max(1) as u32,
                modules: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The `gfx` architecture kernels are compiled for.
    pub fn arch(&self) -> &str {
        &self.inner.arch
    }

    /// The device's name as the runtime reports it.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// Compute units (what split-K plans fill).
    pub fn compute_units(&self) -> u32 {
        self.inner.compute_units
    }

    fn bind(&self) -> Result<(), KernelError> {
        // SAFETY: selects an existing device (checked at open) for this thread.
        check("hipSetDevice", unsafe {
            hip::hipSetDevice(self.inner.ordinal as i32)
        })
    }

    /// `len` elements of uninitialised device memory.
    pub fn alloc<T: DevicePod>(&self, len: usize) -> Result<HipBuffer<T>, KernelError> {
        self.bind()?;
        let bytes = (len * std::mem::size_of::<T>()).max(256);
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: allocates into a local; the buffer owns the result and frees it once.
        check("hipMalloc", unsafe { hip::hipMalloc(&mut ptr, bytes) })?;
        Ok(HipBuffer {
            ptr: ptr as u64,
            len,
            dev: self.clone(),
            _t: PhantomData,
        })
    }

    /// `len` zeroed elements.
    pub fn zeros<T: DevicePod>(&self, len: usize) -> Result<HipBuffer<T>, KernelError> {
        let b = self.alloc::<T>(len)?;
        self.memset_zero(&b)?;
        Ok(b)
    }

    /// Sets every byte of `b` to zero (queued on the null stream).
    pub fn memset_zero<T: DevicePod>(&self, b: &HipBuffer<T>) -> Result<(), KernelError> {
        if b.bytes() == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: writes exactly the buffer's bytes, in stream order.
        check("hipMemsetD8Async", unsafe {
            hip::hipMemsetD8Async(b.ptr as *mut c_void, 0, b.bytes(), null_stream())
        })
    }

    /// A device copy of `host`.
    pub fn upload<T: DevicePod>(&self, host: &[T]) -> Result<HipBuffer<T>, KernelError> {
        let mut b = self.alloc::<T>(host.len())?;
        self.write(&mut b, 0, host)?;
        Ok(b)
    }

    /// Copies `host` into `dst[offset..offset + host.len()]`; returns once the copy is done
    /// (after the work queued before it), so `host` may be reused immediately.
    pub fn write<T: DevicePod>(
        &self,
        dst: &mut HipBuffer<T>,
        offset: usize,
        host: &[T],
    ) -> Result<(), KernelError> {
        if offset + host.len() > dst.len {
            return Err(KernelError::ShapeMismatch {
                op: "rocm_write",
                what: "dst",
                expected: offset + host.len(),
                got: dst.len,
            });
        }
        if host.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the destination range is inside `dst` (checked above); the copy is
        // synchronous with respect to the host and ordered after the null stream's work.
        check("hipMemcpyHtoD", unsafe {
            hip::hipMemcpyHtoD(
                dst.ptr_at(offset) as *mut c_void,
                host.as_ptr() as *mut c_void,
                std::mem::size_of_val(host),
            )
        })
    }

    /// Copies `host` to device address `dst` and returns once it is done (ordered after the
    /// null stream's queued work, like [`Self::write`]), from whatever thread calls: a decode
    /// worker's KV receiver lands a peer's blocks with it while the engine thread computes.
    ///
    /// # Safety
    /// `dst .. dst + host.len()` lies in a live device allocation that no queued or later work
    /// reads or writes until this returns.
    pub unsafe fn write_to(&self, dst: u64, host: &[u8]) -> Result<(), KernelError> {
        if host.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller's contract above; the copy is synchronous with respect to the host.
        check("hipMemcpyHtoD", unsafe {
            hip::hipMemcpyHtoD(dst as *mut c_void, host.as_ptr() as *mut c_void, host.len())
        })
    }

    /// Copies the whole buffer back to the host (waits for queued work).
    pub fn download<T: DevicePod>(&self, src: &HipBuffer<T>) -> Result<Vec<T>, KernelError> {
        self.download_range(src, 0, src.len)
    }

    /// Copies `src[offset..offset + len]` back to the host (waits for queued work).
    pub fn download_range<T: DevicePod>(
        &self,
        src: &HipBuffer<T>,
        offset: usize,
        len: usize,
    ) -> Result<Vec<T>, KernelError> {
        if offset + len > src.len {
            return Err(KernelError::ShapeMismatch {
                op: "rocm_download",
                what: "src",
                expected: offset + len,
                got: src.len,
            });
        }
        let mut out = vec![T::default(); len];
        if len == 0 {
            return Ok(out);
        }
        self.synchronize()?;
        // SAFETY: the source range is inside `src`; `out` has exactly `len` elements; the
        // copy is synchronous, after every queued op (synchronised above).
        check("hipMemcpyDtoH", unsafe {
            hip::hipMemcpyDtoH(
                out.as_mut_ptr() as *mut c_void,
                src.ptr_at(offset) as *mut c_void,
                len * std::mem::size_of::<T>(),
            )
        })?;
        Ok(out)
    }

    /// Device-to-device copy of `src[src_at..src_at + len]` into `dst[dst_at..dst_at + len]`
    /// (queued on the null stream).
    pub fn copy_range<T: DevicePod>(
        &self,
        (src, src_at): (&HipBuffer<T>, usize),
        (dst, dst_at): (&mut HipBuffer<T>, usize),
        len: usize,
    ) -> Result<(), KernelError> {
        if src_at + len > src.len || dst_at + len > dst.len {
            return Err(KernelError::ShapeMismatch {
                op: "rocm_copy_range",
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
        check("hipMemcpyDtoDAsync", unsafe {
            hip::hipMemcpyDtoDAsync(
                dst.ptr_at(dst_at) as *mut c_void,
                src.ptr_at(src_at) as *mut c_void,
                len * std::mem::size_of::<T>(),
                null_stream(),
            )
        })
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.bind()?;
        // SAFETY: waits for the current (this) device's null stream.
        check("hipStreamSynchronize", unsafe {
            hip::hipStreamSynchronize(null_stream())
        })
    }

    /// The function `name` of `source` compiled with `defines` for this device (compiled with
    /// hipRTC and loaded on first use, then cached with its functions).
    pub fn function(
        &self,
        source: Source,
        defines: &Defines,
        name: &'static str,
    ) -> Result<HipFunction, KernelError> {
        let mut modules = self.inner.modules.lock().map_err(|_| KernelError::Gpu {
            op: "hiprtc",
            message: "module cache poisoned".into(),
        })?;
        let key = (source, defines.clone());
        if !modules.contains_key(&key) {
            let started = std::time::Instant::now();
            let code = hiprtc::compile(source, defines, &self.inner.arch)?;
            self.bind()?;
            let mut module: hip::hipModule_t = std::ptr::null_mut();
            // SAFETY: `code` is a complete code object from hipRTC, alive for the call.
            check("hipModuleLoadData", unsafe {
                hip::hipModuleLoadData(&mut module, code.as_ptr() as *const c_void)
            })?;
            tracing::debug!(
                source = source.name(),
                defines = %defines.key(),
                ms = started.elapsed().as_millis() as u64,
                "compiled HIP module"
            );
            modules.insert(
                key.clone(),
                Loaded {
                    module,
                    functions: HashMap::new(),
                },
            );
        }
        let loaded = modules.get_mut(&key).ok_or(KernelError::Gpu {
            op: "hiprtc",
            message: "module vanished from the cache".into(),
        })?;
        if let Some(f) = loaded.functions.get(name) {
            return Ok(*f);
        }
        let cname = CString::new(name).map_err(|_| KernelError::Gpu {
            op: "hipModuleGetFunction",
            message: "bad kernel name".into(),
        })?;
        let mut f: hip::hipFunction_t = std::ptr::null_mut();
        // SAFETY: looks a NUL-terminated name up in a loaded module.
        check("hipModuleGetFunction", unsafe {
            hip::hipModuleGetFunction(&mut f, loaded.module, cname.as_ptr())
        })
        .map_err(|e| KernelError::Gpu {
            op: "hipModuleGetFunction",
            message: format!("{name} in {}: {e}", source.name()),
        })?;
        let f = HipFunction(f);
        loaded.functions.insert(name, f);
        Ok(f)
    }

    /// Queues `f` on the null stream with by-value parameters `args`.
    pub fn launch(
        &self,
        f: &HipFunction,
        dims: LaunchDims,
        args: &mut KernelArgs,
    ) -> Result<(), KernelError> {
        self.bind()?;
        let mut params = args.pointers();
        // SAFETY: every typed launcher checks buffer lengths against the kernel's indexing
        // before building `args`, whose slots match the kernel's parameters in order and type
        // (the same lists the CUDA launches use); `params` points into `args`, alive for the
        // call, and HIP copies the values before returning.
        check("hipModuleLaunchKernel", unsafe {
            hip::hipModuleLaunchKernel(
                f.0,
                dims.grid.0,
                dims.grid.1,
                dims.grid.2,
                dims.block.0,
                dims.block.1,
                dims.block.2,
                dims.smem,
                null_stream(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Gpu for RocmDevice {
    type Function = HipFunction;
    type Buffer<T: DevicePod> = HipBuffer<T>;

    const NAME: &'static str = "ROCm device";
    const TENSOR_CORES: bool = false;
    const VENDOR_GEMM: Option<&'static str> = None;

    fn function(
        &self,
        source: Source,
        defines: &Defines,
        name: &'static str,
    ) -> Result<HipFunction, KernelError> {
        RocmDevice::function(self, source, defines, name)
    }

    fn launch(
        &self,
        f: &HipFunction,
        dims: LaunchDims,
        args: &mut KernelArgs,
    ) -> Result<(), KernelError> {
        RocmDevice::launch(self, f, dims, args)
    }

    fn alloc<T: DevicePod>(&self, len: usize) -> Result<HipBuffer<T>, KernelError> {
        RocmDevice::alloc(self, len)
    }

    fn zeros<T: DevicePod>(&self, len: usize) -> Result<HipBuffer<T>, KernelError> {
        RocmDevice::zeros(self, len)
    }

    fn upload<T: DevicePod>(&self, host: &[T]) -> Result<HipBuffer<T>, KernelError> {
        RocmDevice::upload(self, host)
    }

    fn write<T: DevicePod>(
        &self,
        dst: &mut HipBuffer<T>,
        offset: usize,
        host: &[T],
    ) -> Result<(), KernelError> {
        RocmDevice::write(self, dst, offset, host)
    }

    fn download<T: DevicePod>(&self, src: &HipBuffer<T>) -> Result<Vec<T>, KernelError> {
        RocmDevice::download(self, src)
    }

    fn download_range<T: DevicePod>(
        &self,
        src: &HipBuffer<T>,
        offset: usize,
        len: usize,
    ) -> Result<Vec<T>, KernelError> {
        RocmDevice::download_range(self, src, offset, len)
    }

    fn copy_range<T: DevicePod>(
        &self,
        src: (&HipBuffer<T>, usize),
        dst: (&mut HipBuffer<T>, usize),
        len: usize,
    ) -> Result<(), KernelError> {
        RocmDevice::copy_range(self, src, dst, len)
    }

    fn synchronize(&self) -> Result<(), KernelError> {
        RocmDevice::synchronize(self)
    }

    fn ordinal(&self) -> usize {
        RocmDevice::ordinal(self)
    }

    fn sm_count(&self) -> u32 {
        self.compute_units()
    }

    fn compute_capability(&self) -> (i32, i32) {
        NOT_CUDA
    }

    /// The portable tiled kernel ([`gemm_tiled`]) in both precisions: f32 activations against
    /// f32 or bf16 weights (fast mode does not round the activations here; the kernel has no
    /// bf16 input path to gain from it).
    fn gemm(
        &self,
        x: Dv<f32>,
        w: &GpuMatrix<Self>,
        out: crate::gpu::ops::GemmOut,
        _precision: GemmPrecision,
    ) -> Result<(), KernelError> {
        gemm_tiled(self, x, w, out.out, out.accumulate)
    }
}

/// ROCm's device types, for callers outside the backend.
pub mod types {
    use super::RocmDevice;

    /// A weight matrix in HIP device memory.
    pub type RocmMatrix = crate::gpu::ops::GpuMatrix<RocmDevice>;
    /// Per-token rotary tables in HIP device memory.
    pub type RocmRopeTables = crate::gpu::ops::RopeTables<RocmDevice>;
    /// Stacked expert weights of one MoE layer in HIP device memory.
    pub type RocmExperts = crate::gpu::ops::GpuExperts<RocmDevice>;
}
