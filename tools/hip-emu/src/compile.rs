//! hipRTC for the CPU: a kernel source (CUDA/HIP C++, as ferry hands it to hipRTC) compiled by
//! the system's C++ compiler into a shared object that `hipModuleLoadData` opens.
//!
//! 1. The source gets [`PRELUDE`] in front; `extern __shared__ T name[];` (dynamic shared
//!    memory, which C++ cannot declare) becomes a pointer to the launch's buffer.
//! 2. A preprocessing pass with `FERRY_EMU_SCAN` defined marks every `__global__` function, so
//!    the kernels are found after macros and `#if`s are resolved.
//! 3. The compile appends one `extern "C"` trampoline per kernel, `ferry_emu_k_<name>(void**)`,
//!    which calls the kernel with its `kernelParams`.
//!
//! Modules are cached on disk by a hash of (compiler, flags, prelude, source) under
//! `FERRY_HIP_EMU_CACHE` (default: the temp dir), so a test suite compiles each (source,
//! defines) pair once across its processes. `CXX` picks the compiler (default `c++`).

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The device-side header every source is compiled with.
pub const PRELUDE: &str = include_str!("prelude.h");

/// Bumped when the way modules are built changes, so stale cache entries are not reused.
const CACHE_VERSION: u32 = 1;

/// Compiles `source` with the `-D` options among `options` (others, like `--offload-arch`, are
/// for a GPU compiler and ignored). Returns the module's path or the compiler's log.
pub fn compile(source: &str, options: &[String]) -> Result<PathBuf, String> {
    compile_into(&cache_dir(), source, options)
}

/// [`compile`] with the module cache in `dir`.
fn compile_into(dir: &Path, source: &str, options: &[String]) -> Result<PathBuf, String> {
    let defines: Vec<&String> = options
        .iter()
        .filter(|o| o.starts_with("-D") || o.starts_with("-U"))
        .collect();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let text = format!(
        "{PRELUDE}\n#line 1 \"kernel\"\n{}",
        rewrite_dynamic_shared(source)
    );
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (CACHE_VERSION, &cxx, &defines, &text).hash(&mut h);
    let key = format!("{:016x}", h.finish());
    std::fs::create_dir_all(dir).map_err(|e| format!("cache dir {}: {e}", dir.display()))?;
    let so = dir.join(format!("{key}.so"));
    if so.is_file() {
        return Ok(so);
    }
    // Build under names of this call's own (process id and a per-process counter), then
    // rename: processes and threads compiling the same module side by side each produce a
    // whole file, and none removes a source another is still compiling.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stem = format!("{key}.{}.{call}", std::process::id());
    let cpp = dir.join(format!("{stem}.cpp"));
    std::fs::write(&cpp, &text).map_err(|e| format!("{}: {e}", cpp.display()))?;
    let scanned = run(Command::new(&cxx)
        .args(["-std=c++17", "-E", "-P", "-x", "c++", "-DFERRY_EMU_SCAN"])
        .args(&defines)
        .arg(&cpp))?;
    let kernels = kernel_names(&scanned);
    let mut full = text;
    full.push_str("\n// ferry-hip-emu trampolines\n");
    for k in &kernels {
        full.push_str(&format!(
            "extern \"C\" __attribute__((visibility(\"default\"))) void ferry_emu_k_{k}(void** a) \
             {{ ferry_emu_invoke(&{k}, a); }}\n"
        ));
    }
    std::fs::write(&cpp, &full).map_err(|e| format!("{}: {e}", cpp.display()))?;
    let tmp_so = dir.join(format!("{stem}.so.tmp"));
    run(Command::new(&cxx)
        .args([
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-shared",
            "-w",
            "-fvisibility=hidden",
            "-fno-strict-aliasing",
            "-x",
            "c++",
        ])
        .args(&defines)
        .arg(&cpp)
        .arg("-o")
        .arg(&tmp_so))?;
    std::fs::rename(&tmp_so, &so).map_err(|e| format!("{}: {e}", so.display()))?;
    let _ = std::fs::remove_file(&cpp);
    Ok(so)
}

fn cache_dir() -> PathBuf {
    match std::env::var_os("FERRY_HIP_EMU_CACHE") {
        Some(d) => PathBuf::from(d),
        None => std::env::temp_dir().join("ferry-hip-emu"),
    }
}

fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("running {:?}: {e}", cmd.get_program()))?;
    if !out.status.success() {
        return Err(format!(
            "{:?} failed ({}):\n{}",
            cmd.get_program(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The names of the functions marked `FERRY_EMU_KERNEL` (`__global__` in the scan pass), in
/// order, each once.
fn kernel_names(preprocessed: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = preprocessed;
    while let Some(at) = rest.find("FERRY_EMU_KERNEL") {
        rest = &rest[at + "FERRY_EMU_KERNEL".len()..];
        // `void name(`: the identifier right before the first parenthesis.
        let Some(paren) = rest.find('(') else { break };
        let head = rest[..paren].trim_end();
        let name: String = head
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        if !name.is_empty() && !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// `extern __shared__ <type> name[];` → `<type>* name = (<type>*)ferry_emu_ctx()->dyn_smem;`.
fn rewrite_dynamic_shared(source: &str) -> String {
    const DECL: &str = "extern __shared__";
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find(DECL) {
        out.push_str(&rest[..at]);
        let after = &rest[at + DECL.len()..];
        let Some(end) = after.find("[];") else {
            out.push_str(DECL);
            rest = after;
            continue;
        };
        let decl = after[..end].trim();
        let split = decl
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(0, |i| i + 1);
        let (ty, name) = (decl[..split].trim(), &decl[split..]);
        out.push_str(&format!(
            "{ty}* {name} = reinterpret_cast<{ty_plain}*>(ferry_emu_ctx()->dyn_smem);",
            ty_plain = ty.split(')').next_back().unwrap_or(ty).trim()
        ));
        rest = &after[end + 3..];
    }
    out.push_str(rest);
    out
}

/// Whether `path` looks like a module this crate built (for `hipModuleLoadData`'s check).
pub fn is_module(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "so") && path.is_file()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_shared_becomes_a_pointer_into_the_launch_buffer() {
        let s = "x; extern __shared__ float qs[];  // c\n extern __shared__ __align__(16) unsigned char smem[]; y";
        let r = rewrite_dynamic_shared(s);
        assert!(r.contains("float* qs = reinterpret_cast<float*>(ferry_emu_ctx()->dyn_smem);"));
        assert!(r.contains(
            "__align__(16) unsigned char* smem = reinterpret_cast<unsigned char*>(ferry_emu_ctx()->dyn_smem);"
        ));
        assert!(r.starts_with("x; ") && r.ends_with(" y"));
    }

    #[test]
    fn kernels_are_found_after_preprocessing() {
        let pre = "static inline float f(int);\nextern \"C\" FERRY_EMU_KERNEL void  argmax_rows (const float* x)\n{}\nextern \"C\" FERRY_EMU_KERNEL void k2(int)";
        assert_eq!(kernel_names(pre), vec!["argmax_rows", "k2"]);
    }

    /// CI once failed here: threads of one test binary compiling the same module shared one
    /// source file, and the first to finish removed it under the others.
    #[test]
    fn threads_compiling_one_module_side_by_side_all_get_it() {
        let dir = std::env::temp_dir().join(format!("ferry-hip-emu-race-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let source = "extern \"C\" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }";
        let modules: Vec<Result<PathBuf, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6)
                .map(|_| s.spawn(|| compile_into(&dir, source, &[])))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("compile thread"))
                .collect()
        });
        let first = modules[0].clone().expect("module");
        for m in &modules {
            assert_eq!(m.as_ref().expect("every thread gets the module"), &first);
        }
        let left: Vec<String> = std::fs::read_dir(&dir)
            .expect("cache dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            left,
            vec![first.file_name().unwrap().to_string_lossy().into_owned()],
            "only the module is left"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
