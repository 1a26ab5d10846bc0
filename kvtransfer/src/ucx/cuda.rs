//! The CUDA driver calls the progress thread makes before UCX touches device memory.
//!
//! UCX's CUDA transports (`cuda_copy`, `cuda_ipc`) work in the calling thread's current CUDA
//! context. The progress thread is ours and has none, so before it registers device memory or
//! puts from it, it makes the device's primary context current (the one the engine's CUDA
//! runtime uses too), retained once per device and released when the thread ends. The driver
//! (`libcuda.so.1`) is loaded on first use, so machines without a GPU never load it.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};

use libloading::Library;

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;

struct Driver {
    _lib: Library,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    primary_ctx_release: unsafe extern "C" fn(CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
}

/// The primary contexts this thread retained, by device ordinal.
#[derive(Default)]
pub(super) struct Contexts {
    driver: Option<Driver>,
    retained: HashMap<i32, (CuDevice, CuContext)>,
}

impl Contexts {
    /// Makes device `ordinal`'s primary context current on this thread.
    pub(super) fn make_current(&mut self, ordinal: i32) -> Result<(), String> {
        if self.driver.is_none() {
            self.driver = Some(load()?);
        }
        let Some(d) = self.driver.as_ref() else {
            return Err("no CUDA driver".into());
        };
        let ctx = match self.retained.get(&ordinal) {
            Some(&(_, ctx)) => ctx,
            None => {
                let (mut dev, mut ctx) = (0, std::ptr::null_mut());
                // SAFETY: out-pointers to locals; the context is released in `Drop`.
                unsafe {
                    check((d.device_get)(&mut dev, ordinal), "cuDeviceGet")?;
                    check(
                        (d.primary_ctx_retain)(&mut ctx, dev),
                        "cuDevicePrimaryCtxRetain",
                    )?;
                }
                self.retained.insert(ordinal, (dev, ctx));
                ctx
            }
        };
        // SAFETY: a context retained above and not yet released.
        check(unsafe { (d.ctx_set_current)(ctx) }, "cuCtxSetCurrent")
    }
}

impl Drop for Contexts {
    fn drop(&mut self) {
        if let Some(d) = &self.driver {
            for (_, (dev, _)) in self.retained.drain() {
                // SAFETY: retained once by `make_current`, released once.
                unsafe { (d.primary_ctx_release)(dev) };
            }
        }
    }
}

fn check(r: CuResult, what: &str) -> Result<(), String> {
    if r == 0 {
        Ok(())
    } else {
        Err(format!("{what} failed with CUDA error {r}"))
    }
}

fn load() -> Result<Driver, String> {
    // SAFETY: loading the CUDA driver runs only its own initialisers.
    let lib = unsafe { Library::new("libcuda.so.1") }
        .map_err(|e| format!("cannot load the CUDA driver (libcuda.so.1): {e}"))?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol's C signature is the field's type (CUDA driver API).
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("libcuda.so.1 has no {}: {e}", $name))?
        };
    }
    let init: unsafe extern "C" fn(u32) -> CuResult = sym!("cuInit");
    // SAFETY: cuInit(0) may be called any number of times.
    check(unsafe { init(0) }, "cuInit")?;
    Ok(Driver {
        device_get: sym!("cuDeviceGet"),
        primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
        primary_ctx_release: sym!("cuDevicePrimaryCtxRelease_v2"),
        ctx_set_current: sym!("cuCtxSetCurrent"),
        _lib: lib,
    })
}
