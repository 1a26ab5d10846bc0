//! Kernel sources shared by the CUDA and ROCm backends, and their typed launchers.
//!
//! | file | holds |
//! |---|---|
//! | `compat.cuh` | the CUDA/HIP differences: bf16 bits, warp shuffles, whether PTX `mma` is available |
//! | `common.cu` | embedding, RMSNorm, RoPE, the latent-cache write, GEMV, MLA absorb/unabsorb, MoE routing and experts |
//! | `mla.cu` | MLA attention: absorbed tile / head-packed / per-head kernels and their split-K merge, MHA-form prefill (f32 and tensor-core flash) |
//! | `sample.cu` | sampling distributions (temperature softmax, top-k / top-p with pivot ties, min-p), inverse-CDF draws, argmax, speculative verification |
//! | `draft.cu` | the speculative drafter's ops: block attention over a paged context (GQA), row scatter into pages, tap concatenation, the confidence head |
//!
//! Sources are compiled at run time (NVRTC or hipRTC) for the card in hand, with the model's
//! shapes as `-D` defines, and cached per (source, defines, architecture).
//!
//! With a GPU feature (`cuda` or `rocm`) the launchers are here too, written once and generic
//! over the runtime ([`launch::Gpu`], implemented by `cuda::CudaDevice` and `rocm::RocmDevice`):
//!
//! | module | launches |
//! |---|---|
//! | `l2` | `common.cu`'s `l2_warm`: an MoE layer's shared experts pulled into L2 during its attention chain |
//! | `launch` | the [`launch::Gpu`] trait, device views, argument lists, grid shapes |
//! | `ops` | `common.cu`: GEMV, the portable tiled GEMM, norms, RoPE, the latent write, absorb / unabsorb, MoE; the device weight type |
//! | `mla` | `mla.cu`: absorbed attention (tile / packed / per-head, split-K), MHA-form prefill |
//! | `mha_ws` | the warp-specialised Hopper prefill's tiling (its TMA descriptors are CUDA-only) |
//! | `sample` | `sample.cu`: sampling distributions, draws, argmax, verification |
//! | `draft` | `draft.cu`: the drafter's scatter, block attention, concatenation, confidence head |

#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod draft;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod l2;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod launch;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod mha_ws;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod mla;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod ops;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod sample;

/// The shared CUDA/HIP compatibility header, prepended to every source.
pub const COMPAT_CUH: &str = include_str!("compat.cuh");

/// One kernel source file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// `common.cu`.
    Common,
    /// `mla.cu`.
    Mla,
    /// `sample.cu`.
    Sample,
    /// `draft.cu`.
    Draft,
}

impl Source {
    /// Every source, for compile checks.
    pub const ALL: [Source; 4] = [Source::Common, Source::Mla, Source::Sample, Source::Draft];

    /// File name.
    pub fn name(self) -> &'static str {
        match self {
            Source::Common => "common.cu",
            Source::Mla => "mla.cu",
            Source::Sample => "sample.cu",
            Source::Draft => "draft.cu",
        }
    }

    /// The text as written.
    pub fn text(self) -> &'static str {
        match self {
            Source::Common => include_str!("common.cu"),
            Source::Mla => include_str!("mla.cu"),
            Source::Sample => include_str!("sample.cu"),
            Source::Draft => include_str!("draft.cu"),
        }
    }

    /// The text with `compat.cuh` inlined in place of its `#include`, as handed to the
    /// run-time compilers (which are given no include path).
    pub fn expanded(self) -> String {
        self.text()
            .replace("#include \"compat.cuh\"", COMPAT_CUH)
            .replace("#pragma once", "")
    }
}

/// `-D` defines for one compilation, kept sorted so equal sets share a cache entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Defines(Vec<(String, String)>);

impl Defines {
    /// No defines.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `-Dname=value`.
    pub fn with(mut self, name: &str, value: impl ToString) -> Self {
        self.0.retain(|(n, _)| n != name);
        self.0.push((name.to_string(), value.to_string()));
        self.0.sort();
        self
    }

    /// Compiler options: `-Dname=value` each.
    pub fn options(&self) -> Vec<String> {
        self.0.iter().map(|(n, v)| format!("-D{n}={v}")).collect()
    }

    /// A short text key.
    pub fn key(&self) -> String {
        self.options().join(" ")
    }
}
