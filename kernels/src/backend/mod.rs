//! The op-level device backend: what the one forward is written over.
//!
//! A model's weights and activations live on one [`Backend`]; every coarse op takes one
//! parameter struct and runs where its operands live, calling today's kernels (the CPU
//! reference in [`crate::cpu`]; on a GPU the launchers of `crate::gpu` over the `gpu/*.cu`
//! sources — NVRTC + cuBLAS on CUDA, hipRTC on ROCm).
//!
//! | module | op | parameter struct |
//! |---|---|---|
//! | [`linear`] | `x · Wᵀ` (GEMV for one row; 2–16 rows of bf16 weights on CUDA's tensor-core skinny GEMM; else GEMV for ≤ 8 rows, GEMM above: cuBLAS with split-bf16 or bf16 inputs on CUDA, the portable tiled kernel on ROCm) | [`linear::Linear`] |
//! | [`rows`] | embedding lookup, row gather | [`rows::Embed`], [`rows::Gather`] |
//! | [`norm`] | RMSNorm, fused with the residual add; strided RMSNorm | [`norm::AddNorm`], [`norm::NormStrided`] |
//! | [`rope`] | RoPE / YaRN rotation from per-batch tables | [`rope::ApplyRope`] |
//! | [`latent`] | the new latent rows: norm, RoPE, write into the paged cache | [`latent::LatentWrite`] |
//! | [`mla_absorbed`] | MLA in the absorbed form for a run of sequences (16-row head tiles, 12 → 16 padding, head packing) | [`mla_absorbed::AbsorbedRun`] |
//! | [`mla_mha`] | MLA in the MHA form (decompress, causal flash attention) for a run of sequences | [`mla_mha::MhaRun`] |
//! | [`mlp`] | dense SwiGLU MLP added into the residual | [`mlp::DenseFfn`] |
//! | [`moe`] | MoE routing + routed and shared experts added into the residual | [`moe::MoeFfn`] |
//! | [`sample`] | the sampling distribution of a batch of rows (softmax at temperature, top-k / top-p with pivot ties, min-p), inverse-CDF draws, argmax; per-row parameters and uniforms on the backend | [`sample::Probs`], [`sample::Draw`], [`sample::Sample`], [`sample::RowParams`], [`sample::Uniforms`] |
//! | [`verify`] | lossless speculative verification of a batch of drafted blocks (one result per sequence, one small download on a GPU), from probabilities or straight from logits | [`verify::VerifyBatch`], [`verify::VerifyLogits`] |
//! | [`l2`] | L2 warm-up of a layer's shared experts and `o_proj` during its attention chain (`FERRY_L2_WARM`; CUDA sm_90+ only) | [`l2::LayerWeights`] |
//! | [`draft`] | the drafter's own ops: block attention over a paged context (GQA), row scatter into pages, tap concatenation, the confidence head | [`draft::BlockAttention`], [`draft::ScatterRows`], [`draft::GatherConcat`], [`draft::Confidence`] |
//!
//! **Why a closed enum and not a trait** (argued in `docs/architecture.md`): the set of backends
//! is small and known at compile time; ops are coarse (microseconds to milliseconds), so a match
//! per op costs nothing; a `Backend` trait would make every model type generic (monomorphised
//! per backend, compile time multiplied) or, as trait objects, need associated buffer types it
//! cannot name. A mixed-device call is one runtime error ([`KernelError::DeviceMismatch`]) in
//! one place. candle's `Device` / `Storage` split has the same shape.
//!
//! **GPU arms.** `Cuda` and `Rocm` (each behind its feature) share every line of their arms: an
//! op's GPU arm is one function generic over the runtime (`OnDevice`, which maps the buffer
//! enums to a runtime's buffers), calling the launchers of `crate::gpu`, themselves generic over
//! `crate::gpu::launch::Gpu`. What differs is decided by the runtime type: `dispatch` (only
//! with a GPU feature) says which kernel each op runs — on ROCm only portable kernels (per-head
//! absorbed MLA, `mha_f32`, the tiled GEMM in place of cuBLAS). The ROCm arms compile, their
//! kernels compile with hipRTC, and they run in CI on a CPU HIP (`scripts/hip_emu.sh`), but no
//! AMD GPU has run them (`crate::rocm`).
//!
//! ```
//! use ferry_kernels::backend::{linear::{linear, Linear}, Backend, Precision, Weight};
//! use ferry_kernels::cpu::Matrix;
//!
//! let cpu = Backend::Cpu;
//! let w = Weight::Host(Matrix::from_f32(2, 3, vec![1., 0., 0., 0., 1., 1.]).unwrap());
//! let x = cpu.upload(&[1., 2., 3.]).unwrap();
//! let y = linear(&cpu, Linear { x: &x, w: &w, precision: Precision::Exact }).unwrap();
//! assert_eq!(y.to_host().unwrap(), vec![1., 5.]);
//! ```

// Without a GPU backend every op has one arm: operand names and error helpers go unused.
#![cfg_attr(not(any(feature = "cuda", feature = "rocm")), allow(unused))]

#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod dispatch;
pub mod draft;
pub mod l2;
pub mod latent;
pub mod linear;
pub mod mla_absorbed;
pub mod mla_mha;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod rope;
pub mod rows;
pub mod sample;
pub mod verify;

use crate::cpu::gemm::Matrix;
use crate::cpu::mla::LatentPages;
#[cfg(feature = "cuda")]
use crate::cuda::{CudaDevice, DeviceBuffer};
#[cfg(any(feature = "cuda", feature = "rocm"))]
use crate::gpu::launch::{DeviceMem, Dv, Gpu};
#[cfg(any(feature = "cuda", feature = "rocm"))]
use crate::gpu::ops::PagesView;
#[cfg(feature = "rocm")]
use crate::rocm::{HipBuffer, RocmDevice};
use crate::{Device, KernelError};

/// A CUDA weight matrix.
#[cfg(feature = "cuda")]
type CudaMatrix = crate::gpu::ops::GpuMatrix<CudaDevice>;
/// A ROCm weight matrix.
#[cfg(feature = "rocm")]
type RocmMatrix = crate::gpu::ops::GpuMatrix<RocmDevice>;

/// Where a model's buffers live and its ops run.
#[derive(Debug, Clone, Default)]
pub enum Backend {
    /// The CPU reference kernels over host memory.
    #[default]
    Cpu,
    /// One CUDA device; ops are queued on its stream.
    #[cfg(feature = "cuda")]
    Cuda(CudaDevice),
    /// One ROCm (HIP) device; ops are queued on its null stream. Portable kernels only (see
    /// [`dispatch`]); never executed on an AMD GPU by this project (none was available).
    #[cfg(feature = "rocm")]
    Rocm(RocmDevice),
}

/// Numerics of the device kernels (the CPU is always exact).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 activations and attention, split-bf16 GEMM inputs: the CPU within its tolerance.
    #[default]
    Exact,
    /// bf16 GEMM inputs and bf16 tensor-core attention (the serving configuration).
    Fast,
}

impl Precision {
    /// The large-GEMM input precision for this mode (cuBLAS on CUDA; the portable GEMM on
    /// ROCm takes f32 activations either way).
    #[cfg(any(feature = "cuda", feature = "rocm"))]
    pub(crate) fn gemm(self) -> crate::gpu::ops::GemmPrecision {
        match self {
            Precision::Exact => crate::gpu::ops::GemmPrecision::Exact,
            Precision::Fast => crate::gpu::ops::GemmPrecision::Fast,
        }
    }
}

/// `h += f(x)` on the host, for an `f` that writes a new `[T][hidden]` (the feed-forward ops'
/// CPU arm: the reference MLP / MoE compute into a fresh buffer, then the residual add).
pub(crate) fn add_residual_host(
    op: &'static str,
    x: &Tensor,
    h: &mut Tensor,
    f: impl FnOnce(&[f32], &mut [f32]) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    let x = x.host(op, "x")?;
    let mut y = vec![0.0f32; x.len()];
    f(x, &mut y)?;
    let h = h.host_mut(op, "h")?;
    crate::cpu::gemm::check_len(op, "h", y.len(), h.len())?;
    for (a, v) in h.iter_mut().zip(&y) {
        *a += v;
    }
    Ok(())
}

/// Which absorbed-form attention kernel the fast path takes on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AbsorbedKernel {
    /// 16-row head tiles on tensor cores, other head counts zero-padded (12 → 16).
    #[default]
    Tile,
    /// Heads of several queries packed into one tile.
    Packed,
    /// The scalar kernel (any shape).
    Generic,
}

/// The attention kernel choices of one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttnKernels {
    /// Exact or fast numerics.
    pub precision: Precision,
    /// The absorbed-form kernel in fast mode.
    pub absorbed: AbsorbedKernel,
}

/// An f32 array on one backend: activations and vector weights (norms, biases).
#[derive(Debug)]
pub enum Tensor {
    /// Host memory.
    Host(Vec<f32>),
    /// CUDA device memory.
    #[cfg(feature = "cuda")]
    Cuda(DeviceBuffer<f32>),
    /// ROCm device memory.
    #[cfg(feature = "rocm")]
    Rocm(HipBuffer<f32>),
}

/// An i32 index array (token ids, block tables, row lists) on one backend.
#[derive(Debug)]
pub enum Ints {
    /// Host memory.
    Host(Vec<i32>),
    /// CUDA device memory.
    #[cfg(feature = "cuda")]
    Cuda(DeviceBuffer<i32>),
    /// ROCm device memory.
    #[cfg(feature = "rocm")]
    Rocm(HipBuffer<i32>),
}

/// Flat cache slots (`block · page + offset`) of the batch's new tokens.
#[derive(Debug)]
pub enum Slots {
    /// Host memory.
    Host(Vec<i64>),
    /// CUDA device memory.
    #[cfg(feature = "cuda")]
    Cuda(DeviceBuffer<i64>),
    /// ROCm device memory.
    #[cfg(feature = "rocm")]
    Rocm(HipBuffer<i64>),
}

/// A `[rows][cols]` weight matrix (bf16 or f32) on one backend.
#[derive(Debug)]
pub enum Weight {
    /// Host memory.
    Host(Matrix),
    /// CUDA device memory.
    #[cfg(feature = "cuda")]
    Cuda(CudaMatrix),
    /// ROCm device memory.
    #[cfg(feature = "rocm")]
    Rocm(RocmMatrix),
}

/// One layer's latent pages, read-only (attention).
#[derive(Debug, Clone, Copy)]
pub enum Pages<'a> {
    /// The host pool's layer.
    Host(LatentPages<'a>),
    /// A CUDA device cache's layer.
    #[cfg(feature = "cuda")]
    Cuda(PagesView),
    /// A ROCm device cache's layer.
    #[cfg(feature = "rocm")]
    Rocm(PagesView),
}

/// One layer's latent pages, writable (new rows).
#[derive(Debug)]
pub enum PagesMut<'a> {
    /// The host pool's layer: `[block][page][width]` floats.
    Host {
        /// The layer's rows.
        data: &'a mut [f32],
        /// Floats per row.
        width: usize,
    },
    /// A CUDA device cache's layer.
    #[cfg(feature = "cuda")]
    Cuda(PagesView),
    /// A ROCm device cache's layer.
    #[cfg(feature = "rocm")]
    Rocm(PagesView),
}

impl Backend {
    /// The device this backend runs on.
    pub fn device(&self) -> Device {
        match self {
            Backend::Cpu => Device::Cpu,
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => Device::Cuda(d.ordinal()),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => Device::Rocm(d.ordinal()),
        }
    }

    /// A short name for errors ("CPU", "CUDA device", "ROCm device").
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Cpu => "CPU",
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => "CUDA device",
            #[cfg(feature = "rocm")]
            Backend::Rocm(_) => "ROCm device",
        }
    }

    /// The CUDA device, if this backend is one.
    #[cfg(feature = "cuda")]
    pub fn cuda(&self) -> Option<&CudaDevice> {
        match self {
            Backend::Cuda(d) => Some(d),
            _ => None,
        }
    }

    /// The ROCm device, if this backend is one.
    #[cfg(feature = "rocm")]
    pub fn rocm(&self) -> Option<&RocmDevice> {
        match self {
            Backend::Rocm(d) => Some(d),
            _ => None,
        }
    }

    /// `n` zeros.
    pub fn zeros(&self, n: usize) -> Result<Tensor, KernelError> {
        Ok(match self {
            Backend::Cpu => Tensor::Host(vec![0.0; n]),
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => Tensor::Cuda(d.zeros(n)?),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => Tensor::Rocm(d.zeros(n)?),
        })
    }

    /// `n` floats whose values the next op overwrites (uninitialised on a GPU).
    pub fn scratch(&self, n: usize) -> Result<Tensor, KernelError> {
        Ok(match self {
            Backend::Cpu => Tensor::Host(vec![0.0; n]),
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => Tensor::Cuda(d.alloc(n)?),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => Tensor::Rocm(d.alloc(n)?),
        })
    }

    /// `v` copied onto this backend.
    pub fn upload(&self, v: &[f32]) -> Result<Tensor, KernelError> {
        Ok(match self {
            Backend::Cpu => Tensor::Host(v.to_vec()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => Tensor::Cuda(d.upload(v)?),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => Tensor::Rocm(d.upload(v)?),
        })
    }

    /// `v` moved onto this backend (no copy on the CPU).
    pub fn take(&self, v: Vec<f32>) -> Result<Tensor, KernelError> {
        Ok(match self {
            Backend::Cpu => Tensor::Host(v),
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => Tensor::Cuda(d.upload(&v)?),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => Tensor::Rocm(d.upload(&v)?),
        })
    }

    /// `v` as an index array on this backend.
    pub fn ints(&self, v: Vec<i32>) -> Result<Ints, KernelError> {
        Ok(match self {
            Backend::Cpu => Ints::Host(v),
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => Ints::Cuda(d.upload(&v)?),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => Ints::Rocm(d.upload(&v)?),
        })
    }

    /// `v` as cache slots on this backend.
    pub fn slots(&self, v: Vec<i64>) -> Result<Slots, KernelError> {
        Ok(match self {
            Backend::Cpu => Slots::Host(v),
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => Slots::Cuda(d.upload(&v)?),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => Slots::Rocm(d.upload(&v)?),
        })
    }

    /// `m` on this backend, keeping its element type.
    pub fn weight(&self, m: &Matrix) -> Result<Weight, KernelError> {
        Ok(match self {
            Backend::Cpu => Weight::Host(m.clone()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => Weight::Cuda(CudaMatrix::upload(d, m)?),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => Weight::Rocm(RocmMatrix::upload(d, m)?),
        })
    }

    /// A copy of `t` on this backend (device to device on a GPU, in stream order: no
    /// synchronisation, capturable into a graph).
    pub fn copy(&self, t: &Tensor) -> Result<Tensor, KernelError> {
        let mut out = self.scratch(t.len())?;
        self.copy_into(t, &mut out, 0)?;
        Ok(out)
    }

    /// A copy of `t` on this backend (device to device on a GPU, in stream order).
    pub fn copy_ints(&self, t: &Ints) -> Result<Ints, KernelError> {
        let mut out = match self {
            Backend::Cpu => Ints::Host(vec![0; t.len()]),
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => Ints::Cuda(d.alloc(t.len())?),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => Ints::Rocm(d.alloc(t.len())?),
        };
        self.copy_ints_into(t, &mut out, 0)?;
        Ok(out)
    }

    /// Copies all of `src` into `dst` from element `at` on (index arrays; stream-ordered on a
    /// GPU).
    pub fn copy_ints_into(&self, src: &Ints, dst: &mut Ints, at: usize) -> Result<(), KernelError> {
        const OP: &str = "copy_ints_into";
        let (n, got) = (src.len(), dst.len());
        if at + n > got {
            return Err(KernelError::ShapeMismatch {
                op: OP,
                what: "dst",
                expected: at + n,
                got,
            });
        }
        match (self, src, dst) {
            (Backend::Cpu, Ints::Host(s), Ints::Host(d)) => {
                d[at..at + n].copy_from_slice(s);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Backend::Cuda(dev), Ints::Cuda(s), Ints::Cuda(d)) => {
                dev.copy_range((s, 0), (d, at), n)
            }
            #[cfg(feature = "rocm")]
            (Backend::Rocm(dev), Ints::Rocm(s), Ints::Rocm(d)) => {
                dev.copy_range((s, 0), (d, at), n)
            }
            (b, Ints::Host(_), _) if !matches!(b, Backend::Cpu) => {
                Err(mismatch(OP, "src", b, "CPU"))
            }
            (b, _, _) => Err(mismatch(OP, "dst", b, "another backend")),
        }
    }

    /// Copies the first `dst.len()` elements of `src` into `dst`.
    pub fn copy_prefix(&self, src: &Tensor, dst: &mut Tensor) -> Result<(), KernelError> {
        const OP: &str = "copy_prefix";
        let (n, got) = (dst.len(), src.len());
        if n > got {
            return Err(KernelError::ShapeMismatch {
                op: OP,
                what: "src",
                expected: n,
                got,
            });
        }
        match self {
            Backend::Cpu => {
                let s = src.host(OP, "src")?;
                dst.host_mut(OP, "dst")?.copy_from_slice(&s[..n]);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => copy_on(d, OP, src, (dst, 0), n),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => copy_on(d, OP, src, (dst, 0), n),
        }
    }

    /// Copies all of `src` into `dst[at..at + src.len()]`.
    pub fn copy_into(&self, src: &Tensor, dst: &mut Tensor, at: usize) -> Result<(), KernelError> {
        const OP: &str = "copy_into";
        let (n, got) = (src.len(), dst.len());
        if at + n > got {
            return Err(KernelError::ShapeMismatch {
                op: OP,
                what: "dst",
                expected: at + n,
                got,
            });
        }
        match self {
            Backend::Cpu => {
                let s = src.host(OP, "src")?;
                dst.host_mut(OP, "dst")?[at..at + n].copy_from_slice(s);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => copy_on(d, OP, src, (dst, at), n),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => copy_on(d, OP, src, (dst, at), n),
        }
    }

    /// Waits for every queued op (a no-op on the CPU, whose ops are synchronous).
    pub fn synchronize(&self) -> Result<(), KernelError> {
        match self {
            Backend::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(d) => d.synchronize(),
            #[cfg(feature = "rocm")]
            Backend::Rocm(d) => d.synchronize(),
        }
    }
}

/// `dst[at..at + n] = src[..n]` on the device `dev`, both operands on it (stream-ordered).
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn copy_on<D: OnDevice>(
    dev: &D,
    op: &'static str,
    src: &Tensor,
    (dst, at): (&mut Tensor, usize),
    n: usize,
) -> Result<(), KernelError> {
    let s = D::tensor(src).ok_or_else(|| mismatch_on::<D>(op, "src", src.place()))?;
    let got = dst.place();
    let t = D::tensor_mut(dst).ok_or_else(|| mismatch_on::<D>(op, "dst", got))?;
    dev.copy_range((s, 0), (t, at), n)
}

/// How the buffer enums hold a runtime's memory: the GPU arms of every op are written once,
/// generic over the runtime `D`, and read their operands through this.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) trait OnDevice: Gpu {
    /// The tensor's buffer, if it lives on this runtime.
    fn tensor(t: &Tensor) -> Option<&Self::Buffer<f32>>;
    /// The same, mutable.
    fn tensor_mut(t: &mut Tensor) -> Option<&mut Self::Buffer<f32>>;
    /// The index array's buffer, if it lives on this runtime.
    fn ints(t: &Ints) -> Option<&Self::Buffer<i32>>;
    /// A buffer of this runtime as an index array.
    fn into_ints(b: Self::Buffer<i32>) -> Ints;
    /// The slots' buffer, if they live on this runtime.
    fn slots(t: &Slots) -> Option<&Self::Buffer<i64>>;
    /// The weight's device matrix, if it lives on this runtime.
    fn weight(w: &Weight) -> Option<&crate::gpu::ops::GpuMatrix<Self>>;
    /// The layer's device pages, if they live on this runtime.
    fn pages(p: &Pages<'_>) -> Option<PagesView>;
    /// The same, writable pages.
    fn pages_mut(p: &PagesMut<'_>) -> Option<PagesView>;
    /// The rotary tables, if they live on this runtime.
    fn rope(t: &rope::RopeTable) -> Option<&crate::gpu::ops::RopeTables<Self>>;
}

#[cfg(feature = "cuda")]
impl OnDevice for CudaDevice {
    fn tensor(t: &Tensor) -> Option<&DeviceBuffer<f32>> {
        match t {
            Tensor::Cuda(b) => Some(b),
            _ => None,
        }
    }
    fn tensor_mut(t: &mut Tensor) -> Option<&mut DeviceBuffer<f32>> {
        match t {
            Tensor::Cuda(b) => Some(b),
            _ => None,
        }
    }
    fn ints(t: &Ints) -> Option<&DeviceBuffer<i32>> {
        match t {
            Ints::Cuda(b) => Some(b),
            _ => None,
        }
    }
    fn into_ints(b: DeviceBuffer<i32>) -> Ints {
        Ints::Cuda(b)
    }
    fn slots(t: &Slots) -> Option<&DeviceBuffer<i64>> {
        match t {
            Slots::Cuda(b) => Some(b),
            _ => None,
        }
    }
    fn weight(w: &Weight) -> Option<&CudaMatrix> {
        match w {
            Weight::Cuda(m) => Some(m),
            _ => None,
        }
    }
    fn pages(p: &Pages<'_>) -> Option<PagesView> {
        match p {
            Pages::Cuda(v) => Some(*v),
            _ => None,
        }
    }
    fn pages_mut(p: &PagesMut<'_>) -> Option<PagesView> {
        match p {
            PagesMut::Cuda(v) => Some(*v),
            _ => None,
        }
    }
    fn rope(t: &rope::RopeTable) -> Option<&crate::cuda::ops::RopeTables> {
        match t {
            rope::RopeTable::Cuda(t) => Some(t),
            _ => None,
        }
    }
}

#[cfg(feature = "rocm")]
impl OnDevice for RocmDevice {
    fn tensor(t: &Tensor) -> Option<&HipBuffer<f32>> {
        match t {
            Tensor::Rocm(b) => Some(b),
            _ => None,
        }
    }
    fn tensor_mut(t: &mut Tensor) -> Option<&mut HipBuffer<f32>> {
        match t {
            Tensor::Rocm(b) => Some(b),
            _ => None,
        }
    }
    fn ints(t: &Ints) -> Option<&HipBuffer<i32>> {
        match t {
            Ints::Rocm(b) => Some(b),
            _ => None,
        }
    }
    fn into_ints(b: HipBuffer<i32>) -> Ints {
        Ints::Rocm(b)
    }
    fn slots(t: &Slots) -> Option<&HipBuffer<i64>> {
        match t {
            Slots::Rocm(b) => Some(b),
            _ => None,
        }
    }
    fn weight(w: &Weight) -> Option<&RocmMatrix> {
        match w {
            Weight::Rocm(m) => Some(m),
            _ => None,
        }
    }
    fn pages(p: &Pages<'_>) -> Option<PagesView> {
        match p {
            Pages::Rocm(v) => Some(*v),
            _ => None,
        }
    }
    fn pages_mut(p: &PagesMut<'_>) -> Option<PagesView> {
        match p {
            PagesMut::Rocm(v) => Some(*v),
            _ => None,
        }
    }
    fn rope(t: &rope::RopeTable) -> Option<&crate::gpu::ops::RopeTables<RocmDevice>> {
        match t {
            rope::RopeTable::Rocm(t) => Some(t),
            _ => None,
        }
    }
}

/// Whether GPU ops use session 13's fuller launches: `gemv_pair` (a layer's first query
/// projection and `kv_a` in one GEMV), and the per-pair MoE kernels with two gate/up rows per
/// warp and four down outputs per block (or `FERRY_MOE_DOWN_R`'s) — and session 14's register
/// routing kernel (`moe_route_w*`).
/// `FERRY_FUSE=0` runs the launches as they were before, so one binary measures the before and
/// after; the results are bitwise equal either way.
pub(crate) fn fuse() -> bool {
    static FUSE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FUSE.get_or_init(|| env_switch("FERRY_FUSE"))
}

/// Whether the sampling kernels split a few long rows over several blocks each (the argmax,
/// the distribution, the draw and the verifier's draw; `gpu::sample::row_parts`):
/// `FERRY_SPLIT_ROWS=0` runs one block a row as before session 30, read once, so one binary
/// measures both. Argmax and verify results are identical either way; distributions and draws
/// differ by summation order only.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn split_rows() -> bool {
    static SPLIT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SPLIT.get_or_init(|| env_switch("FERRY_SPLIT_ROWS"))
}

/// Whether a GPU's `draft::markov_step` is its one launch (the default) or the composition the
/// CPU runs (`FERRY_MARKOV_FUSED=0`: seven launches, as before session 30), read once, so one
/// binary measures both; equal within summation order.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn markov_fused() -> bool {
    static FUSED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FUSED.get_or_init(|| env_switch("FERRY_MARKOV_FUSED"))
}

/// An A/B switch read from environment variable `name`: on unless it is `0`.
fn env_switch(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| v != "0")
}

/// A choice parsed from environment variable `name`: its `Default` when unset, and when the
/// value does not parse (logged with the parser's message, which names the accepted values).
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn env_choice<T>(name: &str) -> T
where
    T: std::str::FromStr + Default,
    T::Err: std::fmt::Display,
{
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|e| {
            tracing::warn!("{e}; using the default");
            T::default()
        }),
        Err(_) => T::default(),
    }
}

/// The tensor-core grouped MoE kernels: `FERRY_MOE_MMA` = one of [`crate::gpu::ops::MoeMma`]'s
/// names (`auto` by default), read once, so one binary measures each;
/// the results are bitwise equal whichever runs. A value outside those is logged and ignored.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn moe_mma() -> crate::gpu::ops::MoeMma {
    static MMA: std::sync::OnceLock<crate::gpu::ops::MoeMma> = std::sync::OnceLock::new();
    *MMA.get_or_init(|| env_choice("FERRY_MOE_MMA"))
}

/// Whether `unabsorb` spreads a batch's token chunks over the grid (the default) or loops over
/// them in each warp (`FERRY_UNABSORB_Z=0`, as before session 20), read once; bitwise equal.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn unabsorb_z() -> bool {
    static Z: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *Z.get_or_init(|| env_switch("FERRY_UNABSORB_Z"))
}

/// Outputs per block of the per-pair MoE down kernel when fusion is on: `FERRY_MOE_DOWN_R` =
/// 1, 4 (the default), 8 or 16, read once, so one binary measures each (docs/gpu.md); the
/// results are bitwise equal whichever runs. A value outside those is logged and ignored.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn moe_down_rows() -> crate::gpu::ops::MoeDownRows {
    static ROWS: std::sync::OnceLock<crate::gpu::ops::MoeDownRows> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| env_choice("FERRY_MOE_DOWN_R"))
}

/// An operand that is not on the runtime `D`.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn mismatch_on<D: Gpu>(
    op: &'static str,
    what: &'static str,
    got: &'static str,
) -> KernelError {
    KernelError::DeviceMismatch {
        op,
        what,
        expected: D::NAME,
        got,
    }
}

/// `t` as a view on the runtime `D`, or a mismatch error naming `op` and `what`.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn tv<D: OnDevice>(
    t: &Tensor,
    op: &'static str,
    what: &'static str,
) -> Result<Dv<f32>, KernelError> {
    D::tensor(t)
        .map(|b| b.v())
        .ok_or_else(|| mismatch_on::<D>(op, what, t.place()))
}

/// `t` as a view on the runtime `D`, or a mismatch error.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn iv<D: OnDevice>(
    t: &Ints,
    op: &'static str,
    what: &'static str,
) -> Result<Dv<i32>, KernelError> {
    D::ints(t)
        .map(|b| b.v())
        .ok_or_else(|| mismatch_on::<D>(op, what, t.place()))
}

/// `t` as a view on the runtime `D`, or a mismatch error.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn sv<D: OnDevice>(
    t: &Slots,
    op: &'static str,
    what: &'static str,
) -> Result<Dv<i64>, KernelError> {
    D::slots(t)
        .map(|b| b.v())
        .ok_or_else(|| mismatch_on::<D>(op, what, t.place()))
}

/// `w` as a device matrix of the runtime `D`, or a mismatch error.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn wv<'w, D: OnDevice>(
    w: &'w Weight,
    op: &'static str,
    what: &'static str,
) -> Result<&'w crate::gpu::ops::GpuMatrix<D>, KernelError> {
    D::weight(w).ok_or_else(|| mismatch_on::<D>(op, what, w.place()))
}

/// `p` as device pages of the runtime `D`, or a mismatch error.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn pv<D: OnDevice>(p: &Pages<'_>, op: &'static str) -> Result<PagesView, KernelError> {
    D::pages(p).ok_or_else(|| mismatch_on::<D>(op, "pages", p.place()))
}

/// `p` as writable device pages of the runtime `D`, or a mismatch error.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) fn pmv<D: OnDevice>(
    p: &PagesMut<'_>,
    op: &'static str,
) -> Result<PagesView, KernelError> {
    D::pages_mut(p).ok_or_else(|| mismatch_on::<D>(op, "pages", p.place()))
}

pub(crate) fn mismatch(
    op: &'static str,
    what: &'static str,
    b: &Backend,
    got: &'static str,
) -> KernelError {
    KernelError::DeviceMismatch {
        op,
        what,
        expected: b.name(),
        got,
    }
}

/// `i` as an index below `len`, or an out-of-range error naming `op` and `what` (a negative
/// index is out of range too; it is reported as 0).
pub(crate) fn host_index(
    op: &'static str,
    what: &'static str,
    i: i64,
    len: usize,
) -> Result<usize, KernelError> {
    usize::try_from(i)
        .ok()
        .filter(|&i| i < len)
        .ok_or(KernelError::IndexOutOfRange {
            op,
            what,
            index: i.max(0) as usize,
            len,
        })
}

/// Rows `rows` of a `[n][width]` slice, or an error naming the row past its end.
pub(crate) fn rows_of<'a>(
    op: &'static str,
    data: &'a [f32],
    rows: std::ops::Range<usize>,
    width: usize,
    what: &'static str,
) -> Result<&'a [f32], KernelError> {
    let n = data.len() / width.max(1);
    data.get(rows.start * width..rows.end * width)
        .ok_or(out_of_range(op, what, rows.end, n))
}

/// Row `index` (exclusive end) is past the `len` rows there are.
pub(crate) fn out_of_range(
    op: &'static str,
    what: &'static str,
    index: usize,
    len: usize,
) -> KernelError {
    KernelError::IndexOutOfRange {
        op,
        what,
        index,
        len: len + 1,
    }
}

fn write_prefix<T: Copy>(op: &'static str, dst: &mut [T], v: &[T]) -> Result<(), KernelError> {
    let got = dst.len();
    let dst = dst.get_mut(..v.len()).ok_or(KernelError::ShapeMismatch {
        op,
        what: "dst",
        expected: v.len(),
        got,
    })?;
    dst.copy_from_slice(v);
    Ok(())
}

impl Tensor {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Tensor::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            Tensor::Cuda(b) => b.len(),
            #[cfg(feature = "rocm")]
            Tensor::Rocm(b) => b.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn place(&self) -> &'static str {
        match self {
            Tensor::Host(_) => Backend::Cpu.name(),
            #[cfg(feature = "cuda")]
            Tensor::Cuda(_) => "CUDA device",
            #[cfg(feature = "rocm")]
            Tensor::Rocm(_) => "ROCm device",
        }
    }

    /// The values on the host (a synchronising download from a GPU).
    pub fn to_host(&self) -> Result<Vec<f32>, KernelError> {
        match self {
            Tensor::Host(v) => Ok(v.clone()),
            #[cfg(feature = "cuda")]
            Tensor::Cuda(b) => b.device().download(b),
            #[cfg(feature = "rocm")]
            Tensor::Rocm(b) => b.device().download(b),
        }
    }

    /// The values on the host, without a copy on the CPU.
    pub fn into_host(self) -> Result<Vec<f32>, KernelError> {
        match self {
            Tensor::Host(v) => Ok(v),
            #[cfg(any(feature = "cuda", feature = "rocm"))]
            t => t.to_host(),
        }
    }

    /// The host slice, or a mismatch error naming `op` and `what`.
    pub fn host(&self, op: &'static str, what: &'static str) -> Result<&[f32], KernelError> {
        match self {
            Tensor::Host(v) => Ok(v),
            #[cfg(any(feature = "cuda", feature = "rocm"))]
            t => Err(mismatch(op, what, &Backend::Cpu, t.place())),
        }
    }

    /// The host slice, mutable.
    pub fn host_mut(
        &mut self,
        op: &'static str,
        what: &'static str,
    ) -> Result<&mut [f32], KernelError> {
        match self {
            Tensor::Host(v) => Ok(v),
            #[cfg(any(feature = "cuda", feature = "rocm"))]
            t => {
                let got = t.place();
                Err(mismatch(op, what, &Backend::Cpu, got))
            }
        }
    }

    /// The CUDA device view, or a mismatch error.
    #[cfg(feature = "cuda")]
    pub fn dv(&self, op: &'static str, what: &'static str) -> Result<Dv<f32>, KernelError> {
        tv::<CudaDevice>(self, op, what)
    }
}

impl Ints {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Ints::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            Ints::Cuda(b) => b.len(),
            #[cfg(feature = "rocm")]
            Ints::Rocm(b) => b.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn place(&self) -> &'static str {
        match self {
            Ints::Host(_) => Backend::Cpu.name(),
            #[cfg(feature = "cuda")]
            Ints::Cuda(_) => "CUDA device",
            #[cfg(feature = "rocm")]
            Ints::Rocm(_) => "ROCm device",
        }
    }

    /// The values on the host (a synchronising download from a GPU).
    pub fn to_host(&self) -> Result<Vec<i32>, KernelError> {
        match self {
            Ints::Host(v) => Ok(v.clone()),
            #[cfg(feature = "cuda")]
            Ints::Cuda(b) => b.device().download(b),
            #[cfg(feature = "rocm")]
            Ints::Rocm(b) => b.device().download(b),
        }
    }

    /// The host slice, or a mismatch error.
    pub fn host(&self, op: &'static str, what: &'static str) -> Result<&[i32], KernelError> {
        match self {
            Ints::Host(v) => Ok(v),
            #[cfg(any(feature = "cuda", feature = "rocm"))]
            t => Err(mismatch(op, what, &Backend::Cpu, t.place())),
        }
    }

    /// The host slice, mutable, or a mismatch error.
    pub fn host_mut(
        &mut self,
        op: &'static str,
        what: &'static str,
    ) -> Result<&mut [i32], KernelError> {
        match self {
            Ints::Host(v) => Ok(v),
            #[cfg(any(feature = "cuda", feature = "rocm"))]
            t => {
                let got = t.place();
                Err(mismatch(op, what, &Backend::Cpu, got))
            }
        }
    }

    /// The CUDA device view, or a mismatch error.
    #[cfg(feature = "cuda")]
    pub fn dv(&self, op: &'static str, what: &'static str) -> Result<Dv<i32>, KernelError> {
        iv::<CudaDevice>(self, op, what)
    }

    /// Overwrites the first `v.len()` entries in place (a captured graph reads the new values).
    pub fn write(&mut self, v: &[i32]) -> Result<(), KernelError> {
        match self {
            Ints::Host(h) => write_prefix("ints_write", h, v),
            #[cfg(feature = "cuda")]
            Ints::Cuda(b) => b.device().clone().write(b, 0, v),
            #[cfg(feature = "rocm")]
            Ints::Rocm(b) => b.device().clone().write(b, 0, v),
        }
    }
}

impl Slots {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Slots::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            Slots::Cuda(b) => b.len(),
            #[cfg(feature = "rocm")]
            Slots::Rocm(b) => b.len(),
        }
    }

    /// Whether it holds no slot.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn place(&self) -> &'static str {
        match self {
            Slots::Host(_) => Backend::Cpu.name(),
            #[cfg(feature = "cuda")]
            Slots::Cuda(_) => "CUDA device",
            #[cfg(feature = "rocm")]
            Slots::Rocm(_) => "ROCm device",
        }
    }

    /// The host slice, or a mismatch error.
    pub fn host(&self, op: &'static str, what: &'static str) -> Result<&[i64], KernelError> {
        match self {
            Slots::Host(v) => Ok(v),
            #[cfg(any(feature = "cuda", feature = "rocm"))]
            t => Err(mismatch(op, what, &Backend::Cpu, t.place())),
        }
    }

    /// The CUDA device view, or a mismatch error.
    #[cfg(feature = "cuda")]
    pub fn dv(&self, op: &'static str, what: &'static str) -> Result<Dv<i64>, KernelError> {
        sv::<CudaDevice>(self, op, what)
    }

    /// Overwrites the first `v.len()` entries in place.
    pub fn write(&mut self, v: &[i64]) -> Result<(), KernelError> {
        match self {
            Slots::Host(h) => write_prefix("slots_write", h, v),
            #[cfg(feature = "cuda")]
            Slots::Cuda(b) => b.device().clone().write(b, 0, v),
            #[cfg(feature = "rocm")]
            Slots::Rocm(b) => b.device().clone().write(b, 0, v),
        }
    }
}

impl Weight {
    /// Output features.
    pub fn rows(&self) -> usize {
        match self {
            Weight::Host(m) => m.rows(),
            #[cfg(feature = "cuda")]
            Weight::Cuda(m) => m.rows(),
            #[cfg(feature = "rocm")]
            Weight::Rocm(m) => m.rows(),
        }
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        match self {
            Weight::Host(m) => m.cols(),
            #[cfg(feature = "cuda")]
            Weight::Cuda(m) => m.cols(),
            #[cfg(feature = "rocm")]
            Weight::Rocm(m) => m.cols(),
        }
    }

    /// Bytes of storage.
    pub fn bytes(&self) -> usize {
        match self {
            Weight::Host(m) => m.bytes(),
            #[cfg(feature = "cuda")]
            Weight::Cuda(m) => m.bytes(),
            #[cfg(feature = "rocm")]
            Weight::Rocm(m) => m.bytes(),
        }
    }

    fn place(&self) -> &'static str {
        match self {
            Weight::Host(_) => Backend::Cpu.name(),
            #[cfg(feature = "cuda")]
            Weight::Cuda(_) => "CUDA device",
            #[cfg(feature = "rocm")]
            Weight::Rocm(_) => "ROCm device",
        }
    }

    /// The host matrix, or a mismatch error.
    pub fn host(&self, op: &'static str, what: &'static str) -> Result<&Matrix, KernelError> {
        match self {
            Weight::Host(m) => Ok(m),
            #[cfg(any(feature = "cuda", feature = "rocm"))]
            w => Err(mismatch(op, what, &Backend::Cpu, w.place())),
        }
    }

    /// The CUDA device matrix, or a mismatch error.
    #[cfg(feature = "cuda")]
    pub fn gpu(&self, op: &'static str, what: &'static str) -> Result<&CudaMatrix, KernelError> {
        wv::<CudaDevice>(self, op, what)
    }
}

impl<'a> Pages<'a> {
    fn place(&self) -> &'static str {
        match self {
            Pages::Host(_) => Backend::Cpu.name(),
            #[cfg(feature = "cuda")]
            Pages::Cuda(_) => "CUDA device",
            #[cfg(feature = "rocm")]
            Pages::Rocm(_) => "ROCm device",
        }
    }

    /// The host pages, or a mismatch error.
    pub fn host(self, op: &'static str) -> Result<LatentPages<'a>, KernelError> {
        match self {
            Pages::Host(p) => Ok(p),
            #[cfg(any(feature = "cuda", feature = "rocm"))]
            p => Err(mismatch(op, "pages", &Backend::Cpu, p.place())),
        }
    }

    /// The CUDA device pages, or a mismatch error.
    #[cfg(feature = "cuda")]
    pub fn dv(self, op: &'static str) -> Result<PagesView, KernelError> {
        pv::<CudaDevice>(&self, op)
    }

    /// `(page_size, width)` of the layer.
    pub fn geometry(&self) -> (usize, usize) {
        match self {
            Pages::Host(h) => (h.page_size, h.width),
            #[cfg(feature = "cuda")]
            Pages::Cuda(v) => (v.page_size, v.width),
            #[cfg(feature = "rocm")]
            Pages::Rocm(v) => (v.page_size, v.width),
        }
    }
}

impl PagesMut<'_> {
    pub(crate) fn place(&self) -> &'static str {
        match self {
            PagesMut::Host { .. } => Backend::Cpu.name(),
            #[cfg(feature = "cuda")]
            PagesMut::Cuda(_) => "CUDA device",
            #[cfg(feature = "rocm")]
            PagesMut::Rocm(_) => "ROCm device",
        }
    }

    /// Floats per row.
    pub fn width(&self) -> usize {
        match self {
            PagesMut::Host { width, .. } => *width,
            #[cfg(feature = "cuda")]
            PagesMut::Cuda(v) => v.width,
            #[cfg(feature = "rocm")]
            PagesMut::Rocm(v) => v.width,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_operand_on_a_gpu_op_names_the_op_and_operand() {
        let t = Tensor::Host(vec![1.0]);
        assert!(t.host("x", "y").is_ok());
        #[cfg(feature = "cuda")]
        {
            let e = t.dv("cuda_linear", "x").unwrap_err().to_string();
            assert!(e.contains("cuda_linear") && e.contains("`x`"), "{e}");
        }
        // No AMD GPU needed: the ROCm arm reads its operands through the same extractors.
        #[cfg(feature = "rocm")]
        {
            let e = tv::<RocmDevice>(&t, "linear", "x").unwrap_err().to_string();
            assert!(
                e.contains("linear") && e.contains("`x`") && e.contains("ROCm device"),
                "{e}"
            );
            let w = Weight::Host(Matrix::from_f32(1, 1, vec![1.0]).expect("w"));
            let e = wv::<RocmDevice>(&w, "linear", "w").unwrap_err().to_string();
            assert!(e.contains("`w`") && e.contains("CPU"), "{e}");
        }
    }
}
