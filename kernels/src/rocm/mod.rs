//! The ROCm backend: the HIP runtime through hip-sys, the kernel sources through hipRTC.
//!
//! | module | owns |
//! |---|---|
//! | [`ffi`] | the hipRTC functions hip-sys lacks, declared by hand |
//! | [`hiprtc`] | compiling `gpu/*.cu` into code objects for the card's `gfx` architecture |
//! | this file | [`probe`], [`RocmDevice`]: device selection, module cache, memory, launches |
//!
//! What has run: everything here compiles against Debian's `libamdhip64-dev` 5.2, and hipRTC
//! compiles every kernel source for gfx90a on a machine without a GPU (`tests/rocm.rs`). No
//! AMD GPU was available, so no kernel has been executed through this backend; the model's
//! forward runs on CUDA only, and `--device rocm` falls back to the CPU with that reason.

pub mod ffi;
pub mod hiprtc;

use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::sync::Mutex;

use hip_sys::hiprt as hip;

use crate::device::Device;
use crate::error::KernelError;
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

/// One HIP device: its architecture and the modules compiled for it.
pub struct RocmDevice {
    ordinal: usize,
    arch: String,
    modules: Mutex<HashMap<(Source, Defines), hip::hipModule_t>>,
}

// SAFETY: module handles are only used through the HIP runtime, which is thread-safe; the
// map is behind a mutex.
unsafe impl Send for RocmDevice {}
// SAFETY: as above.
unsafe impl Sync for RocmDevice {}

/// A device allocation (raw address and bytes), freed on drop.
pub struct RocmBuffer {
    ptr: *mut c_void,
    bytes: usize,
}

impl RocmBuffer {
    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr as u64
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for RocmBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from hipMalloc and is freed once.
        let _ = unsafe { hip::hipFree(self.ptr) };
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
        Ok(Self {
            ordinal,
            arch,
            modules: Mutex::new(HashMap::new()),
        })
    }

    /// The `gfx` architecture kernels are compiled for.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// `bytes` of device memory.
    pub fn alloc(&self, bytes: usize) -> Result<RocmBuffer, KernelError> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: allocates into a local; the buffer owns the result.
        check("hipMalloc", unsafe {
            hip::hipMalloc(&mut ptr, bytes.max(256))
        })?;
        Ok(RocmBuffer { ptr, bytes })
    }

    /// Copies `host` into the start of `dst`.
    pub fn upload<T: Copy>(&self, dst: &RocmBuffer, host: &[T]) -> Result<(), KernelError> {
        let bytes = std::mem::size_of_val(host);
        if bytes > dst.bytes {
            return Err(KernelError::ShapeMismatch {
                op: "rocm_upload",
                what: "dst bytes",
                expected: bytes,
                got: dst.bytes,
            });
        }
        // SAFETY: `bytes` fit in `dst`; the copy is synchronous.
        check("hipMemcpyHtoD", unsafe {
            hip::hipMemcpyHtoD(dst.ptr, host.as_ptr() as *mut c_void, bytes)
        })
    }

    /// Copies the start of `src` into `host`.
    pub fn download<T: Copy>(&self, src: &RocmBuffer, host: &mut [T]) -> Result<(), KernelError> {
        let bytes = std::mem::size_of_val(host);
        if bytes > src.bytes {
            return Err(KernelError::ShapeMismatch {
                op: "rocm_download",
                what: "src bytes",
                expected: bytes,
                got: src.bytes,
            });
        }
        // SAFETY: after synchronising, copies `bytes` (inside `src`) into `host`.
        unsafe {
            check("hipDeviceSynchronize", hip::hipDeviceSynchronize())?;
            check(
                "hipMemcpyDtoH",
                hip::hipMemcpyDtoH(host.as_mut_ptr() as *mut c_void, src.ptr, bytes),
            )
        }
    }

    /// The function `name` of `source` compiled with `defines` for this device.
    pub fn function(
        &self,
        source: Source,
        defines: &Defines,
        name: &str,
    ) -> Result<hip::hipFunction_t, KernelError> {
        let mut modules = self.modules.lock().map_err(|_| KernelError::Gpu {
            op: "hiprtc",
            message: "module cache poisoned".into(),
        })?;
        let key = (source, defines.clone());
        if !modules.contains_key(&key) {
            let code = hiprtc::compile(source, defines, &self.arch)?;
            let mut module: hip::hipModule_t = std::ptr::null_mut();
            // SAFETY: `code` is a complete code object from hipRTC, alive for the call.
            check("hipModuleLoadData", unsafe {
                hip::hipModuleLoadData(&mut module, code.as_ptr() as *const c_void)
            })?;
            modules.insert(key.clone(), module);
        }
        let module = modules[&key];
        let cname = CString::new(name).map_err(|_| KernelError::Gpu {
            op: "hipModuleGetFunction",
            message: "bad kernel name".into(),
        })?;
        let mut f: hip::hipFunction_t = std::ptr::null_mut();
        // SAFETY: looks a NUL-terminated name up in a loaded module.
        check("hipModuleGetFunction", unsafe {
            hip::hipModuleGetFunction(&mut f, module, cname.as_ptr())
        })?;
        Ok(f)
    }

    /// Launches `f` with by-value parameters `params` (each slot's bytes as the kernel
    /// expects them), then waits for it.
    ///
    /// # Safety
    /// `params` must match the kernel's parameter list in order, size and meaning, and every
    /// device address in it must cover what the kernel indexes.
    pub unsafe fn launch(
        &self,
        f: hip::hipFunction_t,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        params: &mut [*mut c_void],
    ) -> Result<(), KernelError> {
        // SAFETY: the caller upholds the parameter contract; default stream, no extra.
        unsafe {
            check(
                "hipModuleLaunchKernel",
                hip::hipModuleLaunchKernel(
                    f,
                    grid.0,
                    grid.1,
                    grid.2,
                    block.0,
                    block.1,
                    block.2,
                    0,
                    std::ptr::null_mut(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
            )?;
            check("hipDeviceSynchronize", hip::hipDeviceSynchronize())
        }
    }
}

impl Drop for RocmDevice {
    fn drop(&mut self) {
        if let Ok(m) = self.modules.get_mut() {
            for (_, module) in m.drain() {
                // SAFETY: each module was loaded once and is unloaded once.
                let _ = unsafe { hip::hipModuleUnload(module) };
            }
        }
    }
}
