//! The launchers of `gpu/common.cu` on CUDA: the shared, runtime-generic launchers of
//! [`crate::gpu::ops`] re-exported with their device types fixed to [`CudaDevice`], and what only
//! CUDA has — [`Gpu`] for [`CudaDevice`], whose large GEMM is cuBLAS.
//!
//! Every launcher checks that each buffer holds what the kernel will index before launching;
//! buffers are passed as [`Dv`] views (address + length) so callers can hand in sub-ranges.

pub use crate::gpu::ops::*;

use super::context::{CudaDevice, DeviceBuffer, DevicePod};
use super::cublas::{gemm, GemmInputs, GemmPtrs, GemmShape};
use crate::error::KernelError;
use crate::gpu::launch::{Gpu, KernelArgs, LaunchDims, TmaRows};
use crate::gpu::{Defines, Source};

/// A weight matrix in CUDA device memory.
pub type GpuMatrix = crate::gpu::ops::GpuMatrix<CudaDevice>;
/// Storage of a [`GpuMatrix`].
pub type GpuMatrixData = crate::gpu::ops::GpuMatrixData<CudaDevice>;
/// Per-token rotary tables in CUDA device memory.
pub type RopeTables = crate::gpu::ops::RopeTables<CudaDevice>;
/// Stacked expert weights of one MoE layer in CUDA device memory.
pub type GpuExperts = crate::gpu::ops::GpuExperts<CudaDevice>;
/// The latent write's operands on CUDA.
pub type LatentFinish<'a> = crate::gpu::ops::LatentFinish<'a, CudaDevice>;

impl Gpu for CudaDevice {
    type Function = cudarc::driver::CudaFunction;
    type Buffer<T: DevicePod> = DeviceBuffer<T>;

    const NAME: &'static str = "CUDA device";
    const TENSOR_CORES: bool = true;
    const VENDOR_GEMM: Option<&'static str> = Some("cuBLAS");

    fn function(
        &self,
        source: Source,
        defines: &Defines,
        name: &'static str,
    ) -> Result<Self::Function, KernelError> {
        CudaDevice::function(self, source, defines, name)
    }

    fn launch(
        &self,
        f: &Self::Function,
        dims: LaunchDims,
        args: &mut KernelArgs,
    ) -> Result<(), KernelError> {
        CudaDevice::launch(self, f, dims, args)
    }

    fn alloc<T: DevicePod>(&self, len: usize) -> Result<DeviceBuffer<T>, KernelError> {
        CudaDevice::alloc(self, len)
    }

    fn zeros<T: DevicePod>(&self, len: usize) -> Result<DeviceBuffer<T>, KernelError> {
        CudaDevice::zeros(self, len)
    }

    fn zeros_shareable<T: DevicePod>(&self, len: usize) -> Result<DeviceBuffer<T>, KernelError> {
        CudaDevice::zeros_shareable(self, len)
    }

    fn upload<T: DevicePod>(&self, host: &[T]) -> Result<DeviceBuffer<T>, KernelError> {
        CudaDevice::upload(self, host)
    }

    fn write<T: DevicePod>(
        &self,
        dst: &mut DeviceBuffer<T>,
        offset: usize,
        host: &[T],
    ) -> Result<(), KernelError> {
        CudaDevice::write(self, dst, offset, host)
    }

    fn download<T: DevicePod>(&self, src: &DeviceBuffer<T>) -> Result<Vec<T>, KernelError> {
        CudaDevice::download(self, src)
    }

    fn download_range<T: DevicePod>(
        &self,
        src: &DeviceBuffer<T>,
        offset: usize,
        len: usize,
    ) -> Result<Vec<T>, KernelError> {
        CudaDevice::download_range(self, src, offset, len)
    }

    fn copy_range<T: DevicePod>(
        &self,
        src: (&DeviceBuffer<T>, usize),
        dst: (&mut DeviceBuffer<T>, usize),
        len: usize,
    ) -> Result<(), KernelError> {
        CudaDevice::copy_range(self, src, dst, len)
    }

    fn synchronize(&self) -> Result<(), KernelError> {
        CudaDevice::synchronize(self)
    }

    fn side(&self) -> Option<Self> {
        Some(CudaDevice::side(self))
    }

    fn wait_for(&self, other: &Self) -> Result<(), KernelError> {
        CudaDevice::wait_for(self, other)
    }

    fn capturing(&self) -> bool {
        CudaDevice::capturing(self)
    }

    fn ordinal(&self) -> usize {
        CudaDevice::ordinal(self)
    }

    fn sm_count(&self) -> u32 {
        CudaDevice::sm_count(self)
    }

    fn compute_capability(&self) -> (i32, i32) {
        CudaDevice::compute_capability(self)
    }

    /// cuBLAS: f32 GEMM for f32 weights; against bf16 weights the activations are split into
    /// bf16 hi + lo and multiplied twice ([`GemmPrecision::Exact`]) or rounded to bf16 once
    /// ([`GemmPrecision::Fast`]); `out.accumulate` adds into the output (cuBLAS's beta = 1).
    fn gemm(
        &self,
        x: Dv<f32>,
        w: &GpuMatrix,
        out: GemmOut,
        precision: GemmPrecision,
    ) -> Result<(), KernelError> {
        let GemmOut { out, accumulate } = out;
        let (n, k) = (w.rows(), w.cols());
        let m = x.len / k.max(1);
        let shape = GemmShape { m, n, k };
        if !w.is_bf16() {
            let p = GemmPtrs {
                x: x.ptr,
                w: w.ptr(),
                out: out.ptr,
            };
            return gemm(self, GemmInputs::F32, p, shape, accumulate);
        }
        // One conversion of x (a bf16 cast, or hi + lo rows in exact mode), then the products
        // `gemm_split` makes of any caller's conversion.
        let xs = bf16_rows(self, x, precision)?;
        self.gemm_split((xs.v(), m), w, GemmOut { out, accumulate }, precision)?;
        Ok(())
    }

    fn gemm_split(
        &self,
        (xs, m): (Dv<u16>, usize),
        w: &GpuMatrix,
        out: GemmOut,
        precision: GemmPrecision,
    ) -> Result<bool, KernelError> {
        if !w.is_bf16() {
            return Ok(false);
        }
        let GemmOut { out, accumulate } = out;
        let (n, k) = (w.rows(), w.cols());
        let len = m * k;
        let halves = if precision == GemmPrecision::Exact {
            2
        } else {
            1
        };
        if xs.len < halves * len || (xs.len != len && xs.len != 2 * len) || out.len < m * n {
            return Err(KernelError::InvalidParam {
                op: "gemm_split",
                field: "xs",
                limit: "m·k hi elements, then m·k lo ones (exact mode needs both)",
                value: format!("{} (m {m}, k {k}, {precision:?})", xs.len),
            });
        }
        let shape = GemmShape { m, n, k };
        let halves: &[(u64, bool)] = match precision {
            GemmPrecision::Fast => &[(xs.ptr, accumulate)],
            GemmPrecision::Exact => &[
                (xs.ptr, accumulate),
                (xs.ptr + (len * std::mem::size_of::<u16>()) as u64, true),
            ],
        };
        for &(x, acc) in halves {
            let p = GemmPtrs {
                x,
                w: w.ptr(),
                out: out.ptr,
            };
            gemm(self, GemmInputs::Bf16, p, shape, acc)?;
        }
        Ok(true)
    }

    fn gemm_heads(
        &self,
        g: &crate::gpu::ops::HeadGemm,
        precision: GemmPrecision,
    ) -> Result<bool, KernelError> {
        let x = g.x;
        match precision {
            GemmPrecision::Fast if g.stacked => {
                return Err(KernelError::InvalidParam {
                    op: "gemm_heads",
                    field: "stacked",
                    limit: "exact precision (hi and lo rows)",
                    value: "fast".into(),
                });
            }
            GemmPrecision::Fast => {
                let hi = bf16_rows(self, x, precision)?;
                super::cublas::gemm_heads_bf16(self, g, hi.ptr(), g.accumulate)?;
            }
            GemmPrecision::Exact if g.stacked => {
                if x.len != g.m * g.x_ld {
                    return Err(KernelError::InvalidParam {
                        op: "gemm_heads",
                        field: "x",
                        limit: "m · x_ld elements when stacked",
                        value: format!("{} (m {}, x_ld {})", x.len, g.m, g.x_ld),
                    });
                }
                let rows = crate::gpu::ops::HeadGemm { m: 2 * g.m, ..*g };
                if let Some(xs) = g.x_split {
                    if xs.len != 2 * x.len {
                        return Err(KernelError::InvalidParam {
                            op: "gemm_heads",
                            field: "x_split",
                            limit: "2 · x.len elements ([hi | lo])",
                            value: format!("{} (x: {})", xs.len, x.len),
                        });
                    }
                    super::cublas::gemm_heads_bf16(self, &rows, xs.ptr, g.accumulate)?;
                    return Ok(true);
                }
                let both = bf16_rows(self, x, GemmPrecision::Exact)?;
                super::cublas::gemm_heads_bf16(self, &rows, both.ptr(), g.accumulate)?;
            }
            GemmPrecision::Exact => {
                let both = bf16_rows(self, x, precision)?;
                let lo = both.ptr() + (x.len * std::mem::size_of::<u16>()) as u64;
                super::cublas::gemm_heads_bf16(self, g, both.ptr(), g.accumulate)?;
                super::cublas::gemm_heads_bf16(self, g, lo, true)?;
            }
        }
        Ok(true)
    }

    fn push_tma_bf16_rows(&self, a: &mut KernelArgs, t: TmaRows) -> Result<(), KernelError> {
        let map = super::mha_ws::TmaMap::bf16_rows(t.ptr, t.rows, t.heads, t.width, t.box_rows)?;
        a.push(map);
        Ok(())
    }
}
