//! ferry-hip-emu: the HIP runtime and hipRTC calls ferry's ROCm backend makes, implemented on
//! the CPU, so the ROCm backend — every launcher and every portable kernel of
//! `kernels/src/gpu/*.cu` — runs, and is checked against the CPU backend, on a machine
//! without a GPU (CI). `scripts/hip_emu.sh` builds it as `libamdhip64.so.5` and runs the
//! kernel contract tests with it in front of Debian's HIP on the library path.
//!
//! | module | owns |
//! |---|---|
//! | [`compile`] | hipRTC: a kernel source → a shared object, via the system C++ compiler and `prelude.h` |
//! | [`fiber`] | one launch: blocks in turn, each block's threads as fibers switched at barriers |
//! | this file | the C ABI: devices, memory (host pages standing in for device memory, each allocation ending at a guard page), modules, launches |
//!
//! **What it checks and what it does not.** Kernel logic runs as written: indexing, the
//! split-row plans and merges, warp shuffles and scans, barriers (a divergent barrier fails
//! the launch with each thread's state), shared memory, every launcher's grid and argument
//! list, atomics between blocks (which run side by side on OS threads), and — run once in each
//! fiber order (`FERRY_HIP_EMU_ORDER`, [`fiber`]) — races through shared memory between a
//! block's threads. Not checked: timing, races through global memory, the memory model, and
//! everything behind `FERRY_MMA` (PTX: tensor cores, `cp.async`, TMA), which compat.cuh
//! compiles out here as hipRTC does. Floating point is the host's: `expf` and friends differ
//! from the GPU's in the last bits, which the contract tests' tolerances already allow.
//!
//! **Runtime model.** Everything is synchronous: a launch returns when the grid has run (its
//! blocks spread over one OS thread per core),
//! copies and memsets happen at the call, streams and synchronisation are no-ops. Device
//! pointers are host addresses. One device, ordinal 0, whose compute-unit count is
//! `FERRY_HIP_EMU_CUS` (default 16: enough that split plans split).

pub mod compile;
pub mod fiber;

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::path::PathBuf;
use std::sync::Mutex;

use fiber::{Dim3, Launch, Trampoline};

type HipError = c_int;
const HIP_SUCCESS: HipError = 0;
const HIP_ERROR_INVALID_VALUE: HipError = 1;
const HIP_ERROR_OUT_OF_MEMORY: HipError = 2;
const HIP_ERROR_INVALID_DEVICE: HipError = 101;
const HIP_ERROR_INVALID_IMAGE: HipError = 200;
const HIP_ERROR_NOT_FOUND: HipError = 500;
const HIP_ERROR_LAUNCH_FAILURE: HipError = 719;

const HIPRTC_SUCCESS: c_int = 0;
const HIPRTC_ERROR_INVALID_INPUT: c_int = 3;
const HIPRTC_ERROR_COMPILATION: c_int = 6;

/// `hipDeviceAttributeMultiprocessorCount` in HIP 5.x.
const ATTR_MULTIPROCESSOR_COUNT: c_int = 63;
/// Offset of `gcnArchName` in HIP 5.x's `hipDeviceProp_t` (hip-sys' layout test).
const GCN_ARCH_NAME_OFFSET: usize = 396;
/// The architecture reported, which ferry passes back as `--offload-arch` (ignored here).
const ARCH: &[u8] = b"gfx90a\0";
const NAME: &[u8] = b"ferry-hip-emu (CPU)\0";

fn compute_units() -> c_int {
    std::env::var("FERRY_HIP_EMU_CUS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &c_int| n > 0)
        .unwrap_or(16)
}

/// Live allocations: the address handed out → the mapping it lies in (`hipFree` unmaps it).
static ALLOCS: Mutex<BTreeMap<usize, Mapping>> = Mutex::new(BTreeMap::new());

/// One allocation's pages: the buffer, then one inaccessible guard page.
#[derive(Clone, Copy)]
struct Mapping {
    base: usize,
    len: usize,
}

/// A buffer whose end touches an inaccessible page, so a kernel reading or writing past it
/// (by more than the rounding to 256 bytes) faults at once, as it may on a GPU, instead of
/// reading a neighbour's bytes. Filled with 0xFF bytes (NaN as f32), so a kernel reading memory
/// nothing wrote shows up in results.
fn map_guarded(bytes: usize) -> Option<(usize, Mapping)> {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    let size = bytes.max(1).checked_next_multiple_of(256)?;
    let body = size.checked_next_multiple_of(page)?;
    let len = body.checked_add(page)?;
    // SAFETY: a fresh anonymous private mapping; no existing memory is touched.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    let base = base as usize;
    // SAFETY: the last page lies inside the mapping just made.
    if unsafe { libc::mprotect((base + body) as *mut c_void, page, libc::PROT_NONE) } != 0 {
        // SAFETY: unmaps the mapping just made.
        unsafe { libc::munmap(base as *mut c_void, len) };
        return None;
    }
    let ptr = base + body - size;
    // SAFETY: `ptr..ptr + size` lies in the writable part of the mapping.
    unsafe { std::ptr::write_bytes(ptr as *mut u8, 0xFF, size) };
    Some((ptr, Mapping { base, len }))
}

fn check_device(ordinal: c_int) -> HipError {
    if ordinal == 0 {
        HIP_SUCCESS
    } else {
        HIP_ERROR_INVALID_DEVICE
    }
}

/// `hipGetErrorString`.
#[no_mangle]
pub extern "C" fn hipGetErrorString(e: HipError) -> *const c_char {
    let s: &'static [u8] = match e {
        HIP_SUCCESS => b"hipSuccess (ferry-hip-emu)\0",
        HIP_ERROR_INVALID_VALUE => b"hipErrorInvalidValue (ferry-hip-emu)\0",
        HIP_ERROR_OUT_OF_MEMORY => b"hipErrorOutOfMemory (ferry-hip-emu)\0",
        HIP_ERROR_INVALID_DEVICE => b"hipErrorInvalidDevice (ferry-hip-emu)\0",
        HIP_ERROR_INVALID_IMAGE => b"hipErrorInvalidImage (ferry-hip-emu)\0",
        HIP_ERROR_NOT_FOUND => b"hipErrorNotFound (ferry-hip-emu)\0",
        HIP_ERROR_LAUNCH_FAILURE => {
            b"hipErrorLaunchFailure (ferry-hip-emu: the reason is on stderr)\0"
        }
        _ => b"unknown error (ferry-hip-emu)\0",
    };
    s.as_ptr() as *const c_char
}

/// `hipGetDeviceCount`: one device.
///
/// # Safety
/// `count` is writable.
#[no_mangle]
pub unsafe extern "C" fn hipGetDeviceCount(count: *mut c_int) -> HipError {
    if count.is_null() {
        return HIP_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null; the caller vouches it is writable.
    unsafe { *count = 1 };
    HIP_SUCCESS
}

/// `hipSetDevice`.
#[no_mangle]
pub extern "C" fn hipSetDevice(ordinal: c_int) -> HipError {
    check_device(ordinal)
}

/// `hipGetDeviceProperties`: the name and `gcnArchName`; the rest stays as the caller
/// initialised it.
///
/// # Safety
/// `props` points at a HIP 5.x `hipDeviceProp_t`.
#[no_mangle]
pub unsafe extern "C" fn hipGetDeviceProperties(props: *mut u8, ordinal: c_int) -> HipError {
    if props.is_null() {
        return HIP_ERROR_INVALID_VALUE;
    }
    let r = check_device(ordinal);
    if r == HIP_SUCCESS {
        // SAFETY: `name` is the struct's first field (256 bytes) and `gcnArchName` 256 bytes
        // at GCN_ARCH_NAME_OFFSET; both strings are shorter.
        unsafe {
            std::ptr::copy_nonoverlapping(NAME.as_ptr(), props, NAME.len());
            std::ptr::copy_nonoverlapping(
                ARCH.as_ptr(),
                props.add(GCN_ARCH_NAME_OFFSET),
                ARCH.len(),
            );
        }
    }
    r
}

/// `hipDeviceGetName`.
///
/// # Safety
/// `name` has `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn hipDeviceGetName(
    name: *mut c_char,
    len: c_int,
    ordinal: c_int,
) -> HipError {
    if name.is_null() || (len as usize) < NAME.len() {
        return HIP_ERROR_INVALID_VALUE;
    }
    // SAFETY: `len` bytes are writable and NAME (NUL included) fits.
    unsafe { std::ptr::copy_nonoverlapping(NAME.as_ptr() as *const c_char, name, NAME.len()) };
    check_device(ordinal)
}

/// `hipDeviceGetAttribute`: the multiprocessor count.
///
/// # Safety
/// `value` is writable.
#[no_mangle]
pub unsafe extern "C" fn hipDeviceGetAttribute(
    value: *mut c_int,
    attr: c_int,
    ordinal: c_int,
) -> HipError {
    if value.is_null() || attr != ATTR_MULTIPROCESSOR_COUNT {
        return HIP_ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null.
    unsafe { *value = compute_units() };
    check_device(ordinal)
}

/// `hipMalloc`: host memory, 256-byte aligned, ending at a guard page and filled with 0xFF
/// bytes ([`map_guarded`]).
///
/// # Safety
/// `ptr` is writable.
#[no_mangle]
pub unsafe extern "C" fn hipMalloc(ptr: *mut *mut c_void, bytes: usize) -> HipError {
    if ptr.is_null() {
        return HIP_ERROR_INVALID_VALUE;
    }
    let Some((p, mapping)) = map_guarded(bytes) else {
        return HIP_ERROR_OUT_OF_MEMORY;
    };
    let mut a = ALLOCS.lock().unwrap_or_else(|e| e.into_inner());
    a.insert(p, mapping);
    // SAFETY: checked non-null.
    unsafe { *ptr = p as *mut c_void };
    HIP_SUCCESS
}

/// `hipMallocAsync` (stream ignored).
///
/// # Safety
/// As [`hipMalloc`].
#[no_mangle]
pub unsafe extern "C" fn hipMallocAsync(
    ptr: *mut *mut c_void,
    bytes: usize,
    _stream: *mut c_void,
) -> HipError {
    // SAFETY: forwarded.
    unsafe { hipMalloc(ptr, bytes) }
}

/// `hipFree`.
///
/// # Safety
/// `ptr` came from [`hipMalloc`] and is not used after.
#[no_mangle]
pub unsafe extern "C" fn hipFree(ptr: *mut c_void) -> HipError {
    if ptr.is_null() {
        return HIP_SUCCESS;
    }
    let mapping = {
        let mut a = ALLOCS.lock().unwrap_or_else(|e| e.into_inner());
        a.remove(&(ptr as usize))
    };
    match mapping {
        // SAFETY: mapped by `hipMalloc`, unmapped once (removed from the map).
        Some(m) => unsafe { libc::munmap(m.base as *mut c_void, m.len) },
        None => return HIP_ERROR_INVALID_VALUE,
    };
    HIP_SUCCESS
}

/// Copies `n` bytes; the addresses are host memory either way.
///
/// # Safety
/// Both ranges are valid and do not overlap.
unsafe fn copy(dst: *mut c_void, src: *const c_void, n: usize) -> HipError {
    if n == 0 {
        return HIP_SUCCESS;
    }
    if dst.is_null() || src.is_null() {
        return HIP_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
    HIP_SUCCESS
}

/// `hipMemcpyHtoD`.
///
/// # Safety
/// Both ranges are valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn hipMemcpyHtoD(dst: *mut c_void, src: *mut c_void, n: usize) -> HipError {
    // SAFETY: forwarded.
    unsafe { copy(dst, src, n) }
}

/// `hipMemcpyDtoH`.
///
/// # Safety
/// Both ranges are valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn hipMemcpyDtoH(dst: *mut c_void, src: *mut c_void, n: usize) -> HipError {
    // SAFETY: forwarded.
    unsafe { copy(dst, src, n) }
}

/// `hipMemcpyDtoDAsync` (done at the call).
///
/// # Safety
/// Both ranges are valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn hipMemcpyDtoDAsync(
    dst: *mut c_void,
    src: *mut c_void,
    n: usize,
    _stream: *mut c_void,
) -> HipError {
    // SAFETY: forwarded.
    unsafe { copy(dst, src, n) }
}

/// `hipMemsetD8Async` (done at the call).
///
/// # Safety
/// `dst` is valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn hipMemsetD8Async(
    dst: *mut c_void,
    value: u8,
    n: usize,
    _stream: *mut c_void,
) -> HipError {
    if n == 0 {
        return HIP_SUCCESS;
    }
    if dst.is_null() {
        return HIP_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::write_bytes(dst as *mut u8, value, n) };
    HIP_SUCCESS
}

/// `hipStreamSynchronize`: everything already ran.
#[no_mangle]
pub extern "C" fn hipStreamSynchronize(_stream: *mut c_void) -> HipError {
    HIP_SUCCESS
}

/// `hipDeviceSynchronize`: everything already ran.
#[no_mangle]
pub extern "C" fn hipDeviceSynchronize() -> HipError {
    HIP_SUCCESS
}

/// A loaded module: the shared object, kept open while the module lives.
struct Module {
    lib: libloading::Library,
    path: PathBuf,
}

/// A kernel of a loaded module.
struct Function {
    trampoline: Trampoline,
    name: String,
}

/// `hipModuleLoadData`: `image` is the code [`hiprtcGetCode`] gave, the module's path.
///
/// # Safety
/// `module` is writable; `image` is a NUL-terminated path from [`hiprtcGetCode`].
#[no_mangle]
pub unsafe extern "C" fn hipModuleLoadData(
    module: *mut *mut c_void,
    image: *const c_void,
) -> HipError {
    if module.is_null() || image.is_null() {
        return HIP_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's contract.
    let path = PathBuf::from(
        unsafe { CStr::from_ptr(image as *const c_char) }
            .to_string_lossy()
            .into_owned(),
    );
    if !compile::is_module(&path) {
        return HIP_ERROR_INVALID_IMAGE;
    }
    // SAFETY: the module is a shared object this crate compiled from a kernel source; loading
    // runs no code of its own beyond static initialisers of the prelude's headers.
    match unsafe { libloading::Library::new(&path) } {
        Ok(lib) => {
            // SAFETY: checked non-null.
            unsafe { *module = Box::into_raw(Box::new(Module { lib, path })) as *mut c_void };
            HIP_SUCCESS
        }
        Err(e) => {
            eprintln!("ferry-hip-emu: loading {}: {e}", path.display());
            HIP_ERROR_INVALID_IMAGE
        }
    }
}

/// `hipModuleGetFunction`.
///
/// # Safety
/// `module` came from [`hipModuleLoadData`]; `name` is NUL-terminated; `f` is writable.
#[no_mangle]
pub unsafe extern "C" fn hipModuleGetFunction(
    f: *mut *mut c_void,
    module: *mut c_void,
    name: *const c_char,
) -> HipError {
    if f.is_null() || module.is_null() || name.is_null() {
        return HIP_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's contract.
    let (m, name) = unsafe { (&*(module as *const Module), CStr::from_ptr(name)) };
    let name = name.to_string_lossy().into_owned();
    let symbol = format!("ferry_emu_k_{name}\0");
    // SAFETY: every `ferry_emu_k_*` symbol is a trampoline with this signature
    // (compile.rs).
    match unsafe { m.lib.get::<Trampoline>(symbol.as_bytes()) } {
        Ok(t) => {
            let function = Function {
                trampoline: *t,
                name,
            };
            // SAFETY: checked non-null. The handle is never freed: HIP has no call to release
            // a function, and the module (whose code it points into) is never unloaded early
            // by ferry.
            unsafe { *f = Box::into_raw(Box::new(function)) as *mut c_void };
            HIP_SUCCESS
        }
        Err(_) => {
            eprintln!("ferry-hip-emu: no kernel {name} in {}", m.path.display());
            HIP_ERROR_NOT_FOUND
        }
    }
}

/// `hipModuleUnload`.
///
/// # Safety
/// `module` came from [`hipModuleLoadData`] and none of its functions runs or is launched
/// after.
#[no_mangle]
pub unsafe extern "C" fn hipModuleUnload(module: *mut c_void) -> HipError {
    if module.is_null() {
        return HIP_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's contract; the box came from `hipModuleLoadData`.
    drop(unsafe { Box::from_raw(module as *mut Module) });
    HIP_SUCCESS
}

/// `hipModuleLaunchKernel`: runs the grid now (see [`fiber`]). `extra` is not supported.
///
/// # Safety
/// `f` came from [`hipModuleGetFunction`]; `params` holds one pointer per kernel parameter,
/// to a value of that parameter's type; the pointers among the values are valid for what the
/// kernel reads and writes.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn hipModuleLaunchKernel(
    f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    smem: c_uint,
    _stream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> HipError {
    if f.is_null() || !extra.is_null() {
        return HIP_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's contract.
    let function = unsafe { &*(f as *const Function) };
    let launch = Launch {
        grid: Dim3 {
            x: gx,
            y: gy,
            z: gz,
        },
        block: Dim3 {
            x: bx,
            y: by,
            z: bz,
        },
        smem: smem as usize,
    };
    // SAFETY: forwarded from the caller.
    match unsafe { fiber::run(function.trampoline, params, launch) } {
        Ok(()) => HIP_SUCCESS,
        Err(e) => {
            eprintln!("ferry-hip-emu: launch of {} failed: {}", function.name, e.0);
            HIP_ERROR_LAUNCH_FAILURE
        }
    }
}

/// A hipRTC program: the source, then the module or the compiler's log.
struct Program {
    source: String,
    log: CString,
    code: Option<CString>,
}

/// `hiprtcGetErrorString`.
#[no_mangle]
pub extern "C" fn hiprtcGetErrorString(r: c_int) -> *const c_char {
    let s: &'static [u8] = match r {
        HIPRTC_SUCCESS => b"HIPRTC_SUCCESS (ferry-hip-emu)\0",
        HIPRTC_ERROR_INVALID_INPUT => b"HIPRTC_ERROR_INVALID_INPUT (ferry-hip-emu)\0",
        HIPRTC_ERROR_COMPILATION => b"HIPRTC_ERROR_COMPILATION (ferry-hip-emu)\0",
        _ => b"hipRTC error (ferry-hip-emu)\0",
    };
    s.as_ptr() as *const c_char
}

/// `hiprtcCreateProgram` (headers are not supported: ferry passes none).
///
/// # Safety
/// `prog` is writable; `src` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn hiprtcCreateProgram(
    prog: *mut *mut c_void,
    src: *const c_char,
    _name: *const c_char,
    num_headers: c_int,
    _headers: *const *const c_char,
    _include_names: *const *const c_char,
) -> c_int {
    if prog.is_null() || src.is_null() || num_headers != 0 {
        return HIPRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: the caller's contract.
    let source = unsafe { CStr::from_ptr(src) }
        .to_string_lossy()
        .into_owned();
    let p = Program {
        source,
        log: CString::default(),
        code: None,
    };
    // SAFETY: checked non-null.
    unsafe { *prog = Box::into_raw(Box::new(p)) as *mut c_void };
    HIPRTC_SUCCESS
}

/// `hiprtcCompileProgram`.
///
/// # Safety
/// `prog` came from [`hiprtcCreateProgram`]; `options` holds `n` NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn hiprtcCompileProgram(
    prog: *mut c_void,
    n: c_int,
    options: *const *const c_char,
) -> c_int {
    if prog.is_null() || (n > 0 && options.is_null()) {
        return HIPRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: the caller's contract.
    let p = unsafe { &mut *(prog as *mut Program) };
    let opts: Vec<String> = (0..n.max(0) as usize)
        // SAFETY: `n` valid strings.
        .map(|i| {
            unsafe { CStr::from_ptr(*options.add(i)) }
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    match compile::compile(&p.source, &opts) {
        Ok(m) => {
            p.code = CString::new(m.to_string_lossy().into_owned()).ok();
            p.log = CString::default();
            if p.code.is_some() {
                HIPRTC_SUCCESS
            } else {
                HIPRTC_ERROR_COMPILATION
            }
        }
        Err(log) => {
            p.log = CString::new(log.replace('\0', " ")).unwrap_or_default();
            HIPRTC_ERROR_COMPILATION
        }
    }
}

/// `hiprtcGetProgramLogSize` (NUL included).
///
/// # Safety
/// `prog` came from [`hiprtcCreateProgram`]; `size` is writable.
#[no_mangle]
pub unsafe extern "C" fn hiprtcGetProgramLogSize(prog: *mut c_void, size: *mut usize) -> c_int {
    if prog.is_null() || size.is_null() {
        return HIPRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: the caller's contract.
    unsafe { *size = (*(prog as *const Program)).log.as_bytes_with_nul().len() };
    HIPRTC_SUCCESS
}

/// `hiprtcGetProgramLog`.
///
/// # Safety
/// `log` has the bytes [`hiprtcGetProgramLogSize`] gave.
#[no_mangle]
pub unsafe extern "C" fn hiprtcGetProgramLog(prog: *mut c_void, log: *mut c_char) -> c_int {
    if prog.is_null() || log.is_null() {
        return HIPRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: the caller's contract.
    let l = unsafe { &(*(prog as *const Program)).log };
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(l.as_ptr(), log, l.as_bytes_with_nul().len()) };
    HIPRTC_SUCCESS
}

/// `hiprtcGetCodeSize`: the module path's bytes, NUL included.
///
/// # Safety
/// `prog` came from [`hiprtcCreateProgram`]; `size` is writable.
#[no_mangle]
pub unsafe extern "C" fn hiprtcGetCodeSize(prog: *mut c_void, size: *mut usize) -> c_int {
    if prog.is_null() || size.is_null() {
        return HIPRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: the caller's contract.
    match unsafe { &(*(prog as *const Program)).code } {
        Some(c) => {
            // SAFETY: checked non-null.
            unsafe { *size = c.as_bytes_with_nul().len() };
            HIPRTC_SUCCESS
        }
        None => HIPRTC_ERROR_INVALID_INPUT,
    }
}

/// `hiprtcGetCode`: the module's path (what [`hipModuleLoadData`] takes).
///
/// # Safety
/// `code` has the bytes [`hiprtcGetCodeSize`] gave.
#[no_mangle]
pub unsafe extern "C" fn hiprtcGetCode(prog: *mut c_void, code: *mut c_char) -> c_int {
    if prog.is_null() || code.is_null() {
        return HIPRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: the caller's contract.
    match unsafe { &(*(prog as *const Program)).code } {
        Some(c) => {
            // SAFETY: as above.
            unsafe { std::ptr::copy_nonoverlapping(c.as_ptr(), code, c.as_bytes_with_nul().len()) };
            HIPRTC_SUCCESS
        }
        None => HIPRTC_ERROR_INVALID_INPUT,
    }
}

/// `hiprtcDestroyProgram`.
///
/// # Safety
/// `*prog` came from [`hiprtcCreateProgram`] and is not used after.
#[no_mangle]
pub unsafe extern "C" fn hiprtcDestroyProgram(prog: *mut *mut c_void) -> c_int {
    if prog.is_null() {
        return HIPRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: the caller's contract.
    let p = unsafe { *prog };
    if !p.is_null() {
        // SAFETY: the box came from `hiprtcCreateProgram`; the handle is cleared below.
        drop(unsafe { Box::from_raw(p as *mut Program) });
        // SAFETY: checked non-null.
        unsafe { *prog = std::ptr::null_mut() };
    }
    HIPRTC_SUCCESS
}
