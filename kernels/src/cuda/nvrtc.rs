//! Run-time compilation of the `gpu/*.cu` sources with NVRTC, and the module cache.
//!
//! A module is compiled once per (source, defines, compute capability) for `sm_XY` of the card
//! in hand and kept for the life of the device; functions are looked up once per module.
//! [`compile_ptx`] needs only `libnvrtc`, not a GPU, so the sources can be compile-checked on
//! any machine that has the library (see `tests/cuda_parity.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::error::KernelError;
use crate::gpu::{Defines, Source};

/// Whether `libnvrtc` can be loaded here (no GPU needed).
pub fn available() -> bool {
    // SAFETY: only tries to dlopen libnvrtc by its usual names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles `source` with `defines` for compute capability `cc`; returns PTX text.
pub fn compile_ptx(
    source: Source,
    defines: &Defines,
    cc: (i32, i32),
) -> Result<String, KernelError> {
    Ok(compile(source, defines, cc)?.to_src())
}

fn compile(source: Source, defines: &Defines, cc: (i32, i32)) -> Result<Ptx, KernelError> {
    if !available() {
        return Err(KernelError::DeviceUnavailable {
            device: "nvrtc".into(),
            reason: "libnvrtc.so is not on the library path".into(),
        });
    }
    let mut options = defines.options();
    options.push(format!("--gpu-architecture={}", arch(cc)));
    options.push("--std=c++17".into());
    options.push("-lineinfo".into());
    let opts = CompileOptions {
        options,
        name: Some(source.name().to_string()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(source.expanded(), opts).map_err(|e| {
        let message = match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                format!("{}: {}", source.name(), log.to_string_lossy())
            }
            other => format!("{}: {other}", source.name()),
        };
        KernelError::Gpu {
            op: "nvrtc",
            message,
        }
    })
}

/// The NVRTC target for compute capability `cc`: Hopper compiles for `sm_90a`, whose
/// architecture-specific features (warpgroup MMA) the MHA prefill kernel uses; every other card
/// gets its plain `sm_XY`.
pub fn arch(cc: (i32, i32)) -> String {
    if cc == (9, 0) {
        "sm_90a".into()
    } else {
        format!("sm_{}{}", cc.0, cc.1)
    }
}

type ModuleKey = (Source, Defines, (i32, i32));

struct Loaded {
    module: Arc<CudaModule>,
    functions: HashMap<&'static str, CudaFunction>,
}

/// Compiled modules of one device.
#[derive(Default)]
pub(crate) struct ModuleCache {
    modules: Mutex<HashMap<ModuleKey, Loaded>>,
}

impl ModuleCache {
    /// The function `name` of `source` compiled with `defines`, compiling and loading the
    /// module on first use.
    pub(crate) fn function(
        &self,
        ctx: &Arc<CudaContext>,
        cc: (i32, i32),
        (source, defines, name): (Source, &Defines, &'static str),
    ) -> Result<CudaFunction, KernelError> {
        let mut modules = self.modules.lock().map_err(|_| KernelError::Gpu {
            op: "nvrtc",
            message: "module cache poisoned".into(),
        })?;
        let key = (source, defines.clone(), cc);
        if !modules.contains_key(&key) {
            let started = std::time::Instant::now();
            let ptx = compile(source, defines, cc)?;
            let module = ctx.load_module(ptx).map_err(|e| KernelError::Gpu {
                op: "cuModuleLoadData",
                message: format!("{}: {e}", source.name()),
            })?;
            tracing::debug!(
                source = source.name(),
                defines = %defines.key(),
                ms = started.elapsed().as_millis() as u64,
                "compiled GPU module"
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
            op: "nvrtc",
            message: "module vanished from the cache".into(),
        })?;
        if let Some(f) = loaded.functions.get(name) {
            return Ok(f.clone());
        }
        let f = loaded
            .module
            .load_function(name)
            .map_err(|e| KernelError::Gpu {
                op: "cuModuleGetFunction",
                message: format!("{name} in {}: {e}", source.name()),
            })?;
        loaded.functions.insert(name, f.clone());
        Ok(f)
    }
}
