//! The slice of UCX's `ucp` C API that the transport uses, loaded at run time.
//!
//! Loaded with `dlopen` (like cudarc loads CUDA) rather than linked, so one ferry binary runs
//! on machines without UCX (the TCP transport still works, and `--transport ucx` says what is
//! missing), and loads whichever `libucp.so.0` the machine has: Debian's 1.13 on CPU machines,
//! or the CUDA-enabled 1.22 from PyPI's `libucx-cu13` wheel on a GPU machine
//! (`FERRY_UCX_LIB=/path/to/libucp.so.0`, or `LD_LIBRARY_PATH`).
//!
//! The structs are declared from UCX 1.13's headers (offsets checked against them with a C
//! program; see `docs/transfer.md`). UCX keeps its `ucp` ABI backward compatible within major
//! version 1: parameter structs only grow at the end and every field is gated by a
//! `field_mask` bit, so a newer library reads exactly the fields declared here. Each struct
//! carries trailing zeroed padding, so a library that reads a field this crate never sets finds
//! zeros behind a clear mask bit rather than the end of an allocation.

#![allow(non_camel_case_types, missing_docs)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use libloading::Library;

pub type ucs_status_t = i32;
pub type ucs_status_ptr_t = *mut c_void;
pub type ucp_context_h = *mut c_void;
pub type ucp_worker_h = *mut c_void;
pub type ucp_ep_h = *mut c_void;
pub type ucp_mem_h = *mut c_void;
pub type ucp_rkey_h = *mut c_void;
pub type ucp_config_t = c_void;
pub type ucp_address_t = c_void;

pub const UCS_OK: ucs_status_t = 0;
pub const UCS_INPROGRESS: ucs_status_t = 1;
pub const UCS_ERR_BUSY: ucs_status_t = -15;
pub const UCS_ERR_UNREACHABLE: ucs_status_t = -6;
/// Status pointers in `[-100, -1]` are errors (`UCS_PTR_IS_ERR`).
const UCS_ERR_LAST: isize = -100;

pub const UCP_FEATURE_RMA: u64 = 1 << 1;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub const UCP_FEATURE_AM: u64 = 1 << 6;
pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;

pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub const UCS_THREAD_MODE_SINGLE: c_int = 0;

pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub const UCP_ERR_HANDLING_MODE_NONE: c_int = 0;
pub const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub const UCP_MEM_MAP_PARAM_FIELD_FLAGS: u64 = 1 << 2;
pub const UCP_MEM_MAP_PARAM_FIELD_PROT: u64 = 1 << 3;
pub const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;
/// `ucp_mem_map` allocates the memory (from the first memory domain in `UCX_ALLOC_PRIO` that
/// can: System V or POSIX shared memory before the heap, by default).
pub const UCP_MEM_MAP_ALLOCATE: c_uint = 1 << 1;
pub const UCP_MEM_ATTR_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_ATTR_FIELD_LENGTH: u64 = 1 << 1;
pub const UCP_MEM_MAP_PROT_LOCAL_READ: c_uint = 1 << 0;
pub const UCP_MEM_MAP_PROT_LOCAL_WRITE: c_uint = 1 << 1;
pub const UCP_MEM_MAP_PROT_REMOTE_WRITE: c_uint = 1 << 9;
pub const UCS_MEMORY_TYPE_HOST: c_int = 0;
pub const UCS_MEMORY_TYPE_CUDA: c_int = 1;

pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_OP_ATTR_FIELD_MEMORY_TYPE: u32 = 1 << 6;

pub const UCP_ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;

pub const UCP_AM_SEND_FLAG_REPLY: u32 = 1 << 0;
pub const UCP_AM_SEND_FLAG_EAGER: u32 = 1 << 1;
pub const UCP_AM_RECV_ATTR_FIELD_REPLY_EP: u64 = 1 << 0;
pub const UCP_AM_RECV_ATTR_FLAG_RNDV: u64 = 1 << 17;

pub const UCP_AM_HANDLER_PARAM_FIELD_ID: u64 = 1 << 0;
pub const UCP_AM_HANDLER_PARAM_FIELD_FLAGS: u64 = 1 << 1;
pub const UCP_AM_HANDLER_PARAM_FIELD_CB: u64 = 1 << 2;
pub const UCP_AM_HANDLER_PARAM_FIELD_ARG: u64 = 1 << 3;
pub const UCP_AM_FLAG_WHOLE_MSG: u32 = 1 << 0;

pub type ucp_send_nbx_callback_t = Option<
    unsafe extern "C" fn(request: *mut c_void, status: ucs_status_t, user_data: *mut c_void),
>;
pub type ucp_err_handler_cb_t =
    Option<unsafe extern "C" fn(arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t)>;
pub type ucp_am_recv_callback_t = Option<
    unsafe extern "C" fn(
        arg: *mut c_void,
        header: *const c_void,
        header_length: usize,
        data: *mut c_void,
        length: usize,
        param: *const ucp_am_recv_param_t,
    ) -> ucs_status_t,
>;

/// Trailing zeros behind every parameter struct (see the module docs).
const PAD: usize = 64;

#[repr(C)]
pub struct ucp_params_t {
    pub field_mask: u64,
    pub features: u64,
    _rest: [u8; 64 + PAD],
}

#[repr(C)]
pub struct ucp_worker_params_t {
    pub field_mask: u64,
    pub thread_mode: c_int,
    _rest: [u8; 188 + PAD],
}

#[repr(C)]
pub struct ucp_err_handler_t {
    pub cb: ucp_err_handler_cb_t,
    pub arg: *mut c_void,
}

#[repr(C)]
pub struct ucp_ep_params_t {
    pub field_mask: u64,
    pub address: *const ucp_address_t,
    pub err_mode: c_int,
    pub err_handler: ucp_err_handler_t,
    _rest: [u8; 64 + PAD],
}

#[repr(C)]
pub struct ucp_mem_map_params_t {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: c_int,
    _rest: [u8; 4 + PAD],
}

#[repr(C)]
pub struct ucp_mem_attr_t {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub mem_type: c_int,
    _rest: [u8; 4 + PAD],
}

#[repr(C)]
pub struct ucp_request_param_t {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: ucp_send_nbx_callback_t,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    _rest: [u8; 20 + PAD],
}

#[repr(C)]
pub struct ucp_context_attr_t {
    pub field_mask: u64,
    pub request_size: usize,
    pub thread_mode: c_int,
    /// Bit `t` set: memory type `t` (`UCS_MEMORY_TYPE_*`) is supported.
    pub memory_types: u64,
    _rest: [u8; 32 + PAD],
}

#[repr(C)]
pub struct ucp_am_handler_param_t {
    pub field_mask: u64,
    pub id: c_uint,
    pub flags: u32,
    pub cb: ucp_am_recv_callback_t,
    pub arg: *mut c_void,
    _rest: [u8; PAD],
}

#[repr(C)]
pub struct ucp_am_recv_param_t {
    pub recv_attr: u64,
    pub reply_ep: ucp_ep_h,
}

/// Every parameter struct is plain data whose all-zeros value means "no field set".
macro_rules! zeroed {
    ($($t:ty),*) => {$(
        impl $t {
            pub fn zeroed() -> Self {
                // SAFETY: integers, raw pointers and `Option<fn>` are all valid as zeros.
                unsafe { std::mem::zeroed() }
            }
        }
    )*};
}
zeroed!(
    ucp_params_t,
    ucp_worker_params_t,
    ucp_ep_params_t,
    ucp_mem_map_params_t,
    ucp_mem_attr_t,
    ucp_request_param_t,
    ucp_am_handler_param_t,
    ucp_context_attr_t
);

/// `UCS_PTR_IS_ERR`.
pub fn ptr_is_err(p: ucs_status_ptr_t) -> bool {
    let v = p as isize;
    (UCS_ERR_LAST..0).contains(&v)
}

/// `UCS_PTR_STATUS` of an error or null status pointer.
pub fn ptr_status(p: ucs_status_ptr_t) -> ucs_status_t {
    p as isize as ucs_status_t
}

/// The loaded library's entry points.
pub struct Ucp {
    _lib: Library,
    pub version: (u32, u32, u32),
    pub config_read:
        unsafe extern "C" fn(*const c_char, *const c_char, *mut *mut ucp_config_t) -> ucs_status_t,
    pub config_release: unsafe extern "C" fn(*mut ucp_config_t),
    pub init_version: unsafe extern "C" fn(
        c_uint,
        c_uint,
        *const ucp_params_t,
        *const ucp_config_t,
        *mut ucp_context_h,
    ) -> ucs_status_t,
    pub cleanup: unsafe extern "C" fn(ucp_context_h),
    pub context_query: unsafe extern "C" fn(ucp_context_h, *mut ucp_context_attr_t) -> ucs_status_t,
    pub worker_create: unsafe extern "C" fn(
        ucp_context_h,
        *const ucp_worker_params_t,
        *mut ucp_worker_h,
    ) -> ucs_status_t,
    pub worker_destroy: unsafe extern "C" fn(ucp_worker_h),
    pub worker_get_address:
        unsafe extern "C" fn(ucp_worker_h, *mut *mut ucp_address_t, *mut usize) -> ucs_status_t,
    pub worker_release_address: unsafe extern "C" fn(ucp_worker_h, *mut ucp_address_t),
    pub worker_progress: unsafe extern "C" fn(ucp_worker_h) -> c_uint,
    pub worker_get_efd: unsafe extern "C" fn(ucp_worker_h, *mut c_int) -> ucs_status_t,
    pub worker_arm: unsafe extern "C" fn(ucp_worker_h) -> ucs_status_t,
    pub worker_signal: unsafe extern "C" fn(ucp_worker_h) -> ucs_status_t,
    pub worker_set_am_recv_handler:
        unsafe extern "C" fn(ucp_worker_h, *const ucp_am_handler_param_t) -> ucs_status_t,
    pub ep_create:
        unsafe extern "C" fn(ucp_worker_h, *const ucp_ep_params_t, *mut ucp_ep_h) -> ucs_status_t,
    pub ep_close_nbx:
        unsafe extern "C" fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub ep_flush_nbx:
        unsafe extern "C" fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub mem_map: unsafe extern "C" fn(
        ucp_context_h,
        *const ucp_mem_map_params_t,
        *mut ucp_mem_h,
    ) -> ucs_status_t,
    pub mem_unmap: unsafe extern "C" fn(ucp_context_h, ucp_mem_h) -> ucs_status_t,
    pub mem_query: unsafe extern "C" fn(ucp_mem_h, *mut ucp_mem_attr_t) -> ucs_status_t,
    pub rkey_pack: unsafe extern "C" fn(
        ucp_context_h,
        ucp_mem_h,
        *mut *mut c_void,
        *mut usize,
    ) -> ucs_status_t,
    pub rkey_buffer_release: unsafe extern "C" fn(*mut c_void),
    pub ep_rkey_unpack:
        unsafe extern "C" fn(ucp_ep_h, *const c_void, *mut ucp_rkey_h) -> ucs_status_t,
    pub rkey_destroy: unsafe extern "C" fn(ucp_rkey_h),
    /// A local pointer to remote memory (shared-memory transports only: the remote segment is
    /// mapped into this process).
    pub rkey_ptr: unsafe extern "C" fn(ucp_rkey_h, u64, *mut *mut c_void) -> ucs_status_t,
    pub put_nbx: unsafe extern "C" fn(
        ucp_ep_h,
        *const c_void,
        usize,
        u64,
        ucp_rkey_h,
        *const ucp_request_param_t,
    ) -> ucs_status_ptr_t,
    pub am_send_nbx: unsafe extern "C" fn(
        ucp_ep_h,
        c_uint,
        *const c_void,
        usize,
        *const c_void,
        usize,
        *const ucp_request_param_t,
    ) -> ucs_status_ptr_t,
    pub request_check_status: unsafe extern "C" fn(*mut c_void) -> ucs_status_t,
    pub request_free: unsafe extern "C" fn(*mut c_void),
    pub status_string: unsafe extern "C" fn(ucs_status_t) -> *const c_char,
}

/// The API version these declarations follow (`UCP_API_MAJOR`, `UCP_API_MINOR` of UCX 1.13).
pub const API: (u32, u32) = (1, 13);

static UCP: OnceLock<Result<Ucp, String>> = OnceLock::new();

/// The process's UCX library, loaded on first use; `Err` says which library was tried and why
/// it failed (no UCX installed, a library older than the declared API).
pub fn ucp() -> Result<&'static Ucp, String> {
    UCP.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Ucp, String> {
    let name = std::env::var("FERRY_UCX_LIB").unwrap_or_else(|_| "libucp.so.0".into());
    // SAFETY: loading UCX runs its constructors, which only initialise UCX's own globals.
    let lib = unsafe { Library::new(&name) }.map_err(|e| {
        format!(
            "cannot load UCX ({name}): {e}; install it (Debian: `apt install libucx0`) or set \
             FERRY_UCX_LIB to a libucp.so.0"
        )
    })?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol's C signature is the field's type (declared from UCX's headers).
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("{name} has no {}: {e}", $name))?
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint) =
        sym!("ucp_get_version");
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: writes three integers.
    unsafe { get_version(&mut major, &mut minor, &mut release) };
    if (major, minor) < API {
        return Err(format!(
            "{name} is UCX {major}.{minor}.{release}; ferry needs {}.{} or newer",
            API.0, API.1
        ));
    }
    Ok(Ucp {
        version: (major, minor, release),
        config_read: sym!("ucp_config_read"),
        config_release: sym!("ucp_config_release"),
        init_version: sym!("ucp_init_version"),
        cleanup: sym!("ucp_cleanup"),
        context_query: sym!("ucp_context_query"),
        worker_create: sym!("ucp_worker_create"),
        worker_destroy: sym!("ucp_worker_destroy"),
        worker_get_address: sym!("ucp_worker_get_address"),
        worker_release_address: sym!("ucp_worker_release_address"),
        worker_progress: sym!("ucp_worker_progress"),
        worker_get_efd: sym!("ucp_worker_get_efd"),
        worker_arm: sym!("ucp_worker_arm"),
        worker_signal: sym!("ucp_worker_signal"),
        worker_set_am_recv_handler: sym!("ucp_worker_set_am_recv_handler"),
        ep_create: sym!("ucp_ep_create"),
        ep_close_nbx: sym!("ucp_ep_close_nbx"),
        ep_flush_nbx: sym!("ucp_ep_flush_nbx"),
        mem_map: sym!("ucp_mem_map"),
        mem_unmap: sym!("ucp_mem_unmap"),
        mem_query: sym!("ucp_mem_query"),
        rkey_pack: sym!("ucp_rkey_pack"),
        rkey_buffer_release: sym!("ucp_rkey_buffer_release"),
        ep_rkey_unpack: sym!("ucp_ep_rkey_unpack"),
        rkey_destroy: sym!("ucp_rkey_destroy"),
        rkey_ptr: sym!("ucp_rkey_ptr"),
        put_nbx: sym!("ucp_put_nbx"),
        am_send_nbx: sym!("ucp_am_send_nbx"),
        request_check_status: sym!("ucp_request_check_status"),
        request_free: sym!("ucp_request_free"),
        status_string: sym!("ucs_status_string"),
        _lib: lib,
    })
}

impl Ucp {
    /// UCX's name for `status`.
    pub fn describe(&self, status: ucs_status_t) -> String {
        // SAFETY: returns a static C string for any status value.
        let p = unsafe { (self.status_string)(status) };
        if p.is_null() {
            return format!("UCS status {status}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The offsets UCX 1.13's headers give (printed by a C program with `offsetof`).
    #[test]
    fn struct_layouts_match_the_headers() {
        use std::mem::offset_of;
        assert_eq!(offset_of!(ucp_params_t, features), 8);
        assert_eq!(offset_of!(ucp_worker_params_t, thread_mode), 8);
        assert_eq!(offset_of!(ucp_ep_params_t, address), 8);
        assert_eq!(offset_of!(ucp_ep_params_t, err_mode), 16);
        assert_eq!(offset_of!(ucp_ep_params_t, err_handler), 24);
        assert_eq!(std::mem::size_of::<ucp_err_handler_t>(), 16);
        assert_eq!(offset_of!(ucp_mem_map_params_t, length), 16);
        assert_eq!(offset_of!(ucp_mem_map_params_t, flags), 24);
        assert_eq!(offset_of!(ucp_mem_map_params_t, prot), 28);
        assert_eq!(offset_of!(ucp_mem_map_params_t, memory_type), 32);
        assert_eq!(offset_of!(ucp_mem_attr_t, address), 8);
        assert_eq!(offset_of!(ucp_mem_attr_t, length), 16);
        assert_eq!(offset_of!(ucp_mem_attr_t, mem_type), 24);
        assert_eq!(offset_of!(ucp_request_param_t, flags), 4);
        assert_eq!(offset_of!(ucp_request_param_t, request), 8);
        assert_eq!(offset_of!(ucp_request_param_t, cb), 16);
        assert_eq!(offset_of!(ucp_request_param_t, datatype), 24);
        assert_eq!(offset_of!(ucp_request_param_t, user_data), 32);
        assert_eq!(offset_of!(ucp_request_param_t, reply_buffer), 40);
        assert_eq!(offset_of!(ucp_request_param_t, memory_type), 48);
        assert_eq!(offset_of!(ucp_am_handler_param_t, id), 8);
        assert_eq!(offset_of!(ucp_am_handler_param_t, flags), 12);
        assert_eq!(offset_of!(ucp_am_handler_param_t, cb), 16);
        assert_eq!(offset_of!(ucp_am_handler_param_t, arg), 24);
        assert_eq!(offset_of!(ucp_am_recv_param_t, reply_ep), 8);
        assert_eq!(offset_of!(ucp_context_attr_t, thread_mode), 16);
        assert_eq!(offset_of!(ucp_context_attr_t, memory_types), 24);
        // At least the 1.13 sizes (the library never reads past them for 1.13 fields).
        assert!(std::mem::size_of::<ucp_params_t>() >= 80);
        assert!(std::mem::size_of::<ucp_worker_params_t>() >= 200);
        assert!(std::mem::size_of::<ucp_ep_params_t>() >= 104);
        assert!(std::mem::size_of::<ucp_mem_map_params_t>() >= 40);
        assert!(std::mem::size_of::<ucp_request_param_t>() >= 72);
        assert!(std::mem::size_of::<ucp_am_handler_param_t>() >= 32);
    }

    #[test]
    fn error_pointers_decode() {
        assert!(!ptr_is_err(std::ptr::null_mut()));
        let e = (-6isize) as ucs_status_ptr_t;
        assert!(ptr_is_err(e));
        assert_eq!(ptr_status(e), -6);
        assert!(!ptr_is_err(0x1000 as ucs_status_ptr_t));
    }
}
