//! What a typed launcher needs from a GPU runtime ([`Gpu`]), and the runtime-independent pieces
//! of a launch: device views ([`Dv`]), argument lists ([`KernelArgs`]), grid shapes
//! ([`LaunchDims`]).
//!
//! The launchers in [`super::ops`], [`super::mla`], [`super::sample`] and [`super::draft`] are
//! written once, generic over [`Gpu`], and monomorphised per runtime: `cuda::CudaDevice` (driver
//! API, NVRTC, cuBLAS) and `rocm::RocmDevice` (HIP, hipRTC). A launcher checks every length,
//! asks the runtime for a function by (source, defines, name), fills a [`KernelArgs`] list and
//! launches it with [`LaunchDims`]; scratch comes from [`Gpu::alloc`] and is freed when its
//! buffer drops. For `D = CudaDevice` each call is exactly the launch the launchers made when
//! they were CUDA-only; what differs between runtimes is behind the trait: the large GEMM
//! ([`Gpu::gemm`]: cuBLAS on CUDA, the portable tiled kernel on ROCm), TMA descriptors
//! ([`Gpu::push_tma_bf16_rows`], CUDA only), and whether the tensor-core kernels exist
//! ([`Gpu::TENSOR_CORES`], [`Gpu::compute_capability`]).
//!
//! ```
//! use ferry_kernels::gpu::launch::{KernelArgs, LaunchDims};
//!
//! // Parameters are copied by value into their own slots, in the kernel's order.
//! let mut a = KernelArgs::new();
//! a.push(0x1000u64).push(3i32).push(0.5f32);
//! assert_eq!(a.len(), 3);
//! let d = LaunchDims::elementwise(1000);
//! assert_eq!((d.grid.0, d.block.0), (4, 256));
//! ```

use std::ffi::c_void;

use super::ops::{GemmPrecision, GpuMatrix};
use crate::error::KernelError;
use crate::gpu::{Defines, Source};

/// A plain-old-data element type that may live in device memory.
pub trait DevicePod: Copy + Default + Send + Sync + 'static {}
impl DevicePod for f32 {}
impl DevicePod for u16 {}
impl DevicePod for i32 {}
impl DevicePod for u32 {}
impl DevicePod for i64 {}
impl DevicePod for u8 {}
impl DevicePod for f64 {}

/// A view of `len` elements of device memory starting at `ptr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dv<T> {
    /// Device address of element 0.
    pub ptr: u64,
    /// Elements.
    pub len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: DevicePod> Dv<T> {
    /// A view of raw device memory (the caller vouches for `len` elements at `ptr`; launchers
    /// still check lengths against what they index).
    pub fn raw(ptr: u64, len: usize) -> Self {
        Self {
            ptr,
            len,
            _t: std::marker::PhantomData,
        }
    }

    /// Elements `start..start + len` of this view.
    pub fn sub(self, start: usize, len: usize) -> Result<Self, KernelError> {
        if start + len > self.len {
            return Err(KernelError::IndexOutOfRange {
                op: "device_view",
                what: "end",
                index: start + len,
                len: self.len + 1,
            });
        }
        Ok(Self {
            ptr: self.ptr + (start * std::mem::size_of::<T>()) as u64,
            len,
            _t: std::marker::PhantomData,
        })
    }
}

/// An owned device allocation of one element type (a runtime's buffer).
pub trait DeviceMem {
    /// The element type.
    type Elem: DevicePod;

    /// The whole buffer as a view.
    fn v(&self) -> Dv<Self::Elem>;

    /// Raw device address of element 0.
    fn ptr(&self) -> u64 {
        self.v().ptr
    }

    /// Bytes.
    fn bytes(&self) -> usize {
        self.v().len * std::mem::size_of::<Self::Elem>()
    }

    /// Raw device address of element `i` (`i <= len`).
    fn ptr_at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.v().len);
        self.v().ptr + (i * std::mem::size_of::<Self::Elem>()) as u64
    }
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchDims {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory bytes.
    pub smem: u32,
}

impl LaunchDims {
    /// A 1-D grid of `blocks` blocks of `threads` threads.
    pub fn linear(blocks: usize, threads: u32) -> Self {
        Self {
            grid: (blocks.max(1) as u32, 1, 1),
            block: (threads, 1, 1),
            smem: 0,
        }
    }

    /// One thread per element, 256 per block.
    pub fn elementwise(n: usize) -> Self {
        Self::linear(n.div_ceil(256), 256)
    }
}

/// A kernel parameter passed by value (scalars and `#[repr(C)]` structs without padding).
///
/// # Safety
/// The type must be `#[repr(C)]` (or a primitive) with no padding bytes and match the
/// kernel's parameter type exactly.
pub unsafe trait KernelParam: Copy + 'static {}
// SAFETY: primitives have no padding and match the C types of the same width.
unsafe impl KernelParam for i32 {}
// SAFETY: as above.
unsafe impl KernelParam for u32 {}
// SAFETY: as above.
unsafe impl KernelParam for f32 {}
// SAFETY: as above.
unsafe impl KernelParam for i64 {}
// SAFETY: as above (device pointers are u64).
unsafe impl KernelParam for u64 {}

/// The largest by-value parameter: a 128-byte TMA descriptor (`CUtensorMap`).
const ARG_BYTES: usize = 128;

/// One parameter's bytes, aligned like the strictest parameter type (a tensor map, 64).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct ArgSlot([u8; ARG_BYTES]);

/// The argument list of one launch: each parameter's bytes in its own slot.
#[derive(Default)]
pub struct KernelArgs {
    slots: Vec<ArgSlot>,
}

impl KernelArgs {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a by-value parameter.
    pub fn push<T: KernelParam>(&mut self, v: T) -> &mut Self {
        let size = std::mem::size_of::<T>();
        assert!(
            size <= ARG_BYTES,
            "invariant: kernel parameters fit in a slot"
        );
        let mut slot = ArgSlot([0u8; ARG_BYTES]);
        // SAFETY: `T: KernelParam` has no padding, so all `size` bytes of `v` are initialised,
        // and `slot` has room for them.
        unsafe {
            std::ptr::copy_nonoverlapping(&v as *const T as *const u8, slot.0.as_mut_ptr(), size)
        };
        self.slots.push(slot);
        self
    }

    /// Appends a device pointer.
    pub fn ptr(&mut self, b: &impl DeviceMem) -> &mut Self {
        self.push(b.ptr())
    }

    /// Parameters.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether there is no parameter.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// One pointer per parameter slot, as `cuLaunchKernel` / `hipModuleLaunchKernel` take
    /// them (valid while `self` is neither moved nor changed).
    pub(crate) fn pointers(&mut self) -> Vec<*mut c_void> {
        self.slots
            .iter_mut()
            .map(|s| s.0.as_mut_ptr() as *mut c_void)
            .collect()
    }
}

/// What [`Gpu::compute_capability`] gives on a device that is not an NVIDIA GPU.
pub const NOT_CUDA: (i32, i32) = (0, 0);

/// A bf16 tensor `[rows][heads][width]` at `ptr`, read by TMA in boxes of 64 elements of width
/// × one head × `box_rows` rows (the warp-specialised prefill kernel's operands).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TmaRows {
    /// Device address.
    pub ptr: u64,
    /// Rows.
    pub rows: usize,
    /// Heads per row.
    pub heads: usize,
    /// Elements per head.
    pub width: usize,
    /// Rows per box.
    pub box_rows: usize,
}

/// What the typed launchers need from a GPU runtime. Implemented by `cuda::CudaDevice` and
/// `rocm::RocmDevice`; see the module documentation.
///
/// Methods that share a name with an inherent method of the device (`alloc`, `upload`, …) do
/// what that method does; generic code calls them through the trait.
pub trait Gpu: Clone + std::fmt::Debug + Send + Sync + Sized + 'static {
    /// A compiled kernel, ready to launch.
    type Function;
    /// `[T; len]` in device memory, freed on drop.
    type Buffer<T: DevicePod>: DeviceMem<Elem = T> + std::fmt::Debug + Send + Sync;

    /// A short name for errors ("CUDA device").
    const NAME: &'static str;

    /// Whether the tensor-core kernels exist on this runtime (`FERRY_MMA` is 1: PTX `mma.sync`,
    /// `ldmatrix`, `cp.async`): the absorbed tile / packed kernels, the flash prefill. False
    /// on ROCm, whose hipRTC builds compile only the portable scalar paths.
    const TENSOR_CORES: bool;

    /// The vendor BLAS behind [`Gpu::gemm`], if any (`"cuBLAS"`); `None` where the large GEMM
    /// is the portable `gemm_tiled_{f32,bf16}` kernel of `common.cu` (ROCm: no hipBLAS
    /// binding). Names what `gemm` runs, for [`crate::backend::dispatch`].
    const VENDOR_GEMM: Option<&'static str>;

    /// The function `name` of `source` compiled with `defines` for this device (compiled and
    /// loaded on first use, then cached).
    fn function(
        &self,
        source: Source,
        defines: &Defines,
        name: &'static str,
    ) -> Result<Self::Function, KernelError>;

    /// Queues `f` on the device's stream.
    fn launch(
        &self,
        f: &Self::Function,
        dims: LaunchDims,
        args: &mut KernelArgs,
    ) -> Result<(), KernelError>;

    /// `len` elements of uninitialised device memory.
    fn alloc<T: DevicePod>(&self, len: usize) -> Result<Self::Buffer<T>, KernelError>;

    /// `len` zeroed elements.
    fn zeros<T: DevicePod>(&self, len: usize) -> Result<Self::Buffer<T>, KernelError>;

    /// `len` zeroed elements that another process may map (CUDA IPC): for the KV cache, which
    /// a peer's transport writes into or reads from directly. The default is [`Gpu::zeros`].
    fn zeros_shareable<T: DevicePod>(&self, len: usize) -> Result<Self::Buffer<T>, KernelError> {
        self.zeros(len)
    }

    /// A device copy of `host`.
    fn upload<T: DevicePod>(&self, host: &[T]) -> Result<Self::Buffer<T>, KernelError>;

    /// Copies `host` into `dst[offset..offset + host.len()]`; `host` may be reused on return.
    fn write<T: DevicePod>(
        &self,
        dst: &mut Self::Buffer<T>,
        offset: usize,
        host: &[T],
    ) -> Result<(), KernelError>;

    /// The whole buffer on the host (waits for queued work).
    fn download<T: DevicePod>(&self, src: &Self::Buffer<T>) -> Result<Vec<T>, KernelError>;

    /// Copies `src[offset..offset + len]` back to the host (waits for queued work).
    fn download_range<T: DevicePod>(
        &self,
        src: &Self::Buffer<T>,
        offset: usize,
        len: usize,
    ) -> Result<Vec<T>, KernelError>;

    /// Device-to-device copy of `src[src_at..src_at + len]` into `dst[dst_at..dst_at + len]`,
    /// in stream order.
    fn copy_range<T: DevicePod>(
        &self,
        src: (&Self::Buffer<T>, usize),
        dst: (&mut Self::Buffer<T>, usize),
        len: usize,
    ) -> Result<(), KernelError>;

    /// Waits for all queued work.
    fn synchronize(&self) -> Result<(), KernelError>;

    /// A handle on the same device whose kernel launches go to a second stream, so that work
    /// that does not depend on the main stream's latest kernels can run beside them (memory
    /// operations through it stay on the main stream). Order the two with
    /// [`Gpu::wait_for`]: `side.wait_for(main)` before the side's first launch,
    /// `main.wait_for(side)` before anything reads what it wrote. `None` where the runtime
    /// has no second stream (ROCm here): callers then queue the same work on the main stream.
    fn side(&self) -> Option<Self> {
        None
    }

    /// Makes the work queued on this handle's stream from now on wait for everything queued
    /// on `other`'s stream so far (an event recorded there and waited on here; it becomes a
    /// graph edge under capture). A no-op when both are the same stream.
    fn wait_for(&self, other: &Self) -> Result<(), KernelError> {
        let _ = other;
        Ok(())
    }

    /// Whether the work queued now is being recorded into a graph rather than run (CUDA's
    /// stream capture): launch orders that pay only when replayed (their per-launch host
    /// cost is paid once) can be chosen for captures alone.
    fn capturing(&self) -> bool {
        false
    }

    /// The device's ordinal.
    fn ordinal(&self) -> usize;

    /// Multiprocessors (CUDA SMs, AMD compute units): split-K plans fill this many.
    fn sm_count(&self) -> u32;

    /// The CUDA compute capability; [`NOT_CUDA`] on a device that is not an NVIDIA GPU (no
    /// PTX, so none of the sm_80 / sm_90 kernels).
    fn compute_capability(&self) -> (i32, i32);

    /// `out[m][n] = x[m][k] · Wᵀ` for more rows than the GEMV kernel takes (lengths checked
    /// by the caller, `super::ops::linear`): cuBLAS on CUDA, the portable tiled kernel
    /// (`gemm_tiled_*` in `common.cu`) on ROCm.
    /// `out` says whether the product replaces or is added into the output.
    fn gemm(
        &self,
        x: Dv<f32>,
        w: &GpuMatrix<Self>,
        out: super::ops::GemmOut,
        precision: GemmPrecision,
    ) -> Result<(), KernelError>;

    /// [`Gpu::gemm`] of `m` rows the caller already converted ([`super::ops::bf16_rows`]): `xs`
    /// holds their bf16 hi rows (`m·k` elements; a cast's rounding) and, after them, their lo
    /// rows (`2·m·k`: [`super::ops::split_bf16`]'s halves). The same products as `gemm` of the
    /// f32 rows, bitwise: fast mode reads the hi rows, exact mode both halves (so it needs
    /// them). `Ok(false)`, with nothing launched, where the runtime's large GEMM does not read
    /// bf16 activations (ROCm's tiled kernel) or the weights are not bf16: the caller then
    /// calls `gemm`.
    fn gemm_split(
        &self,
        (xs, m): (Dv<u16>, usize),
        w: &GpuMatrix<Self>,
        out: super::ops::GemmOut,
        precision: GemmPrecision,
    ) -> Result<bool, KernelError> {
        let _ = (xs, m, w, out, precision);
        Ok(false)
    }

    /// Per-head products on the vendor BLAS's tensor cores ([`super::ops::HeadGemm`]; the
    /// activations rounded to bf16, or split into bf16 hi + lo, as [`Gpu::gemm`] does).
    /// `Ok(false)` where the runtime has no vendor BLAS (ROCm) or the weights are not bf16:
    /// the caller then runs its own kernel.
    fn gemm_heads(
        &self,
        g: &super::ops::HeadGemm,
        precision: GemmPrecision,
    ) -> Result<bool, KernelError> {
        let _ = (g, precision);
        Ok(false)
    }

    /// Appends a TMA descriptor of `t` to `a` (the warp-specialised Hopper prefill). Only a
    /// CUDA device encodes one; elsewhere this is an error naming the device.
    fn push_tma_bf16_rows(&self, a: &mut KernelArgs, t: TmaRows) -> Result<(), KernelError> {
        let _ = (a, t);
        Err(KernelError::InvalidParam {
            op: "tma_map",
            field: "device",
            limit: "a CUDA sm_90 device (TMA descriptors)",
            value: Self::NAME.into(),
        })
    }
}
