//! The CUDA backend: the driver through cudarc with dynamic loading (so a binary built without
//! a CUDA toolkit runs everywhere and reports a missing driver as an error), NVRTC for the
//! kernel sources in `gpu/`, cuBLAS for large GEMMs.
//!
//! | module | owns |
//! |---|---|
//! | [`bench`] | kernel benchmarks (`ferry bench-gpu`) |
//! | [`context`] | [`CudaDevice`] (context, stream, cuBLAS handle, module cache), [`DeviceBuffer`], launches, timing |
//! | [`nvrtc`] | run-time compilation for the card's architecture and the compiled-module cache |
//! | [`cublas`] | `y = x · Wᵀ` through cuBLAS (f32, or bf16 weights with a split-bf16 activation) |
//! | [`ops`] | typed launchers for `common.cu` and the device-resident weight type [`GpuMatrix`] |
//! | [`mla`] | MLA attention launchers: the absorbed tile / head-packed / per-head kernels, the 12 → 16 pad dispatcher, MHA-form prefill |
//! | [`host_time`] | a thread's host time between and inside its CUDA calls, by kernel or call (`FERRY_HOST_TIME=1`, a diagnostic) |
//! | [`mha_ws`] | the warp-specialised Hopper prefill kernel's tiling and TMA descriptors |
//! | [`sample`] | launchers for `gpu/sample.cu`: sampling distributions, draws, argmax, speculative verification |
//! | [`draft`] | launchers for `gpu/draft.cu`: the drafter's block attention, row scatter, tap concatenation, confidence head |
//! | [`staging`] | device → host copies on a second stream into page-locked memory, ordered by marks (layer-wise KV shipping) |
//! | [`sync_sites`] | where the host waits on the stream, by caller (`FERRY_SYNC_SITES=1`, a diagnostic) |
//! | [`upload`] | small host → device writes staged in page-locked slots, queued without waiting (off with `FERRY_ASYNC_WRITES=0`) |
//!
//! All compute goes on the device's one stream, in order; host reads synchronise. Only
//! [`staging`]'s copies run on a second stream, behind explicit marks.

pub mod bench;
pub mod context;
pub mod cublas;
pub mod draft;
pub mod host_time;
pub mod mha_ws;
pub mod mla;
pub mod nvrtc;
pub mod ops;
pub mod sample;
pub mod staging;
pub mod sync_sites;
pub mod upload;

pub use context::{
    graph_arena_switch, CudaDevice, DeviceBuffer, GpuGraph, GpuTimer, GraphEdges, KernelArgs,
    LaunchDims, ARENA_FIRST,
};
pub use ops::{GpuMatrix, GpuMatrixData};
pub use staging::{CopyStream, DeviceRange, Mark, PinnedBuffer};
