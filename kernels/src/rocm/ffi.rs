//! hipRTC declarations. hip-sys 0.1.2 binds the HIP runtime but not hipRTC; in ROCm 5.x the
//! `hiprtc*` symbols live in `libamdhip64` itself (which hip-sys already links), so these few
//! are declared here by hand from `hip/hiprtc.h`.

use std::ffi::{c_char, c_int, c_void};

/// `hiprtcProgram`: an opaque program handle.
pub type HiprtcProgram = *mut c_void;

/// `hiprtcResult`: 0 is `HIPRTC_SUCCESS`.
pub type HiprtcResult = c_int;

/// `HIPRTC_SUCCESS`.
pub const HIPRTC_SUCCESS: HiprtcResult = 0;

extern "C" {
    /// `hiprtcCreateProgram(prog, src, name, numHeaders, headers, includeNames)`.
    pub fn hiprtcCreateProgram(
        prog: *mut HiprtcProgram,
        src: *const c_char,
        name: *const c_char,
        num_headers: c_int,
        headers: *const *const c_char,
        include_names: *const *const c_char,
    ) -> HiprtcResult;
    /// `hiprtcCompileProgram(prog, numOptions, options)`.
    pub fn hiprtcCompileProgram(
        prog: HiprtcProgram,
        num_options: c_int,
        options: *const *const c_char,
    ) -> HiprtcResult;
    /// `hiprtcGetProgramLogSize(prog, size)`.
    pub fn hiprtcGetProgramLogSize(prog: HiprtcProgram, size: *mut usize) -> HiprtcResult;
    /// `hiprtcGetProgramLog(prog, log)`.
    pub fn hiprtcGetProgramLog(prog: HiprtcProgram, log: *mut c_char) -> HiprtcResult;
    /// `hiprtcGetCodeSize(prog, size)`: bytes of the compiled code object.
    pub fn hiprtcGetCodeSize(prog: HiprtcProgram, size: *mut usize) -> HiprtcResult;
    /// `hiprtcGetCode(prog, code)`.
    pub fn hiprtcGetCode(prog: HiprtcProgram, code: *mut c_char) -> HiprtcResult;
    /// `hiprtcDestroyProgram(prog)`.
    pub fn hiprtcDestroyProgram(prog: *mut HiprtcProgram) -> HiprtcResult;
    /// `hiprtcGetErrorString(result)`.
    pub fn hiprtcGetErrorString(result: HiprtcResult) -> *const c_char;
}
