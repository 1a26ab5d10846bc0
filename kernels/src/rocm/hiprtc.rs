//! Run-time compilation of the `gpu/*.cu` sources with hipRTC into AMD code objects.
//!
//! The same sources NVRTC compiles; `compat.cuh` switches to HIP's shuffles and bit casts and
//! to the scalar paths where the CUDA code uses PTX. No GPU is needed to compile.

use std::ffi::{c_char, CStr, CString};
use std::sync::Mutex;

use super::ffi::{self, HiprtcProgram, HIPRTC_SUCCESS};
use crate::error::KernelError;
use crate::gpu::{Defines, Source};

fn check(op: &'static str, r: ffi::HiprtcResult) -> Result<(), KernelError> {
    if r == HIPRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: hipRTC returns a static NUL-terminated string for every result code.
    let msg = unsafe { CStr::from_ptr(ffi::hiprtcGetErrorString(r)) };
    Err(KernelError::Gpu {
        op,
        message: msg.to_string_lossy().into_owned(),
    })
}

/// Owns a program handle and destroys it on drop.
struct Program(HiprtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle came from hiprtcCreateProgram and is destroyed once.
        let _ = unsafe { ffi::hiprtcDestroyProgram(&mut self.0) };
    }
}

/// One hipRTC compile at a time in this process: Debian's hipRTC 5.2 is not thread-safe.
/// Two tests compiling side by side once left LLVM's AMDGPU target registered twice, and
/// every compile after that failed with "unable to create target: Cannot choose between
/// targets \"amdgcn\" and \"amdgcn\"" (CI); eight C threads compiling a one-line kernel at
/// once corrupted the heap in one run of five. Kernels compile once per process and are
/// cached by the caller, so serialising costs nothing in serving.
static COMPILE: Mutex<()> = Mutex::new(());

/// Compiles `source` with `defines` for `arch` (e.g. `gfx90a`, `gfx942`); returns the code
/// object for `hipModuleLoadData`.
pub fn compile(source: Source, defines: &Defines, arch: &str) -> Result<Vec<u8>, KernelError> {
    // A poisoned lock only means another compile panicked; hipRTC's state is still usable.
    let _one_at_a_time = COMPILE.lock().unwrap_or_else(|p| p.into_inner());
    let text = CString::new(source.expanded()).map_err(|_| KernelError::Gpu {
        op: "hiprtc",
        message: format!("{} contains a NUL byte", source.name()),
    })?;
    let name = CString::new(source.name()).map_err(|_| KernelError::Gpu {
        op: "hiprtc",
        message: "bad source name".into(),
    })?;
    let mut prog: HiprtcProgram = std::ptr::null_mut();
    // SAFETY: valid NUL-terminated strings; no headers are passed.
    check("hiprtcCreateProgram", unsafe {
        ffi::hiprtcCreateProgram(
            &mut prog,
            text.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    })?;
    let prog = Program(prog);
    let mut opts = defines.options();
    opts.push(format!("--offload-arch={arch}"));
    opts.push("-std=c++17".into());
    opts.push("-O3".into());
    let opts: Vec<CString> = opts
        .into_iter()
        .map(|o| {
            CString::new(o).map_err(|_| KernelError::Gpu {
                op: "hiprtc",
                message: "an option contains a NUL byte".into(),
            })
        })
        .collect::<Result<_, _>>()?;
    let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `ptrs` points at `opts`' strings, alive for the call.
    let r = unsafe { ffi::hiprtcCompileProgram(prog.0, ptrs.len() as i32, ptrs.as_ptr()) };
    if r != HIPRTC_SUCCESS {
        return Err(KernelError::Gpu {
            op: "hiprtcCompileProgram",
            message: format!("{}: {}", source.name(), log(&prog)),
        });
    }
    let mut size = 0usize;
    // SAFETY: writes the code size into a local.
    check("hiprtcGetCodeSize", unsafe {
        ffi::hiprtcGetCodeSize(prog.0, &mut size)
    })?;
    let mut code = vec![0u8; size];
    // SAFETY: `code` has exactly `size` bytes.
    check("hiprtcGetCode", unsafe {
        ffi::hiprtcGetCode(prog.0, code.as_mut_ptr() as *mut c_char)
    })?;
    Ok(code)
}

fn log(prog: &Program) -> String {
    let mut size = 0usize;
    // SAFETY: writes the log size into a local.
    if unsafe { ffi::hiprtcGetProgramLogSize(prog.0, &mut size) } != HIPRTC_SUCCESS || size == 0 {
        return "(no log)".into();
    }
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` has the `size` bytes the log needs, NUL included.
    if unsafe { ffi::hiprtcGetProgramLog(prog.0, buf.as_mut_ptr() as *mut c_char) }
        != HIPRTC_SUCCESS
    {
        return "(no log)".into();
    }
    String::from_utf8_lossy(&buf)
        .trim_end_matches('\0')
        .to_string()
}
