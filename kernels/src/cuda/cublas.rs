//! `out[m][n] = x[m][k] · W[n][k]ᵀ` through cuBLAS, f32 accumulation.
//!
//! Weights are row-major `[n][k]` (torch `nn.Linear.weight`); in cuBLAS's column-major terms
//! that is a `k × n` matrix, so the call is `C(n×m) = op_T(W) · x` with `lda = ldb = k`,
//! `ldc = n`, which is `out` row-major. f32 weights use f32 GEMM (no TF32: cuBLAS's default
//! math mode); bf16 weights use `cublasGemmEx` with bf16 inputs and f32 compute and output.

use std::ffi::c_void;

use cudarc::cublas::result::gemm_ex;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};

use super::context::CudaDevice;
use crate::error::{c_int as dim, KernelError};

/// Shape of one product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmShape {
    /// Activation rows.
    pub m: usize,
    /// Weight rows (output features).
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
}

/// Element type of both operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmInputs {
    /// f32 activations and weights.
    F32,
    /// bf16 activations and weights.
    Bf16,
}

/// Raw operands of one GEMM (device addresses).
#[derive(Debug, Clone, Copy)]
pub struct GemmPtrs {
    /// `[m][k]` activations.
    pub x: u64,
    /// `[n][k]` weights.
    pub w: u64,
    /// `[m][n]` f32 output.
    pub out: u64,
}

/// Runs one product; `accumulate` adds into `out` instead of overwriting it.
///
/// The caller guarantees the three addresses hold at least `m·k`, `n·k` and `m·n` elements of
/// the stated types (the typed wrappers in `ops.rs` check this).
pub(crate) fn gemm(
    dev: &CudaDevice,
    inputs: GemmInputs,
    p: GemmPtrs,
    shape: GemmShape,
    accumulate: bool,
) -> Result<(), KernelError> {
    let GemmShape { m, n, k } = shape;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let dim = |v, field| dim("cublas_gemm", field, v);
    let (mi, ni, ki) = (dim(m, "m")?, dim(n, "n")?, dim(k, "k")?);
    let dtype = match inputs {
        GemmInputs::F32 => cudaDataType::CUDA_R_32F,
        GemmInputs::Bf16 => cudaDataType::CUDA_R_16BF,
    };
    let alpha = 1.0f32;
    let beta = if accumulate { 1.0f32 } else { 0.0f32 };
    let _host = super::host_time::span("cublasGemmEx");
    dev.bind()?;
    // SAFETY: the handle is bound to the device's stream; the caller guarantees the operand
    // sizes; alpha/beta are host f32 scalars matching CUBLAS_COMPUTE_32F.
    unsafe {
        gemm_ex(
            dev.blas_handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            ni,
            mi,
            ki,
            &alpha as *const f32 as *const c_void,
            p.w as *const c_void,
            dtype,
            ki,
            p.x as *const c_void,
            dtype,
            ki,
            &beta as *const f32 as *const c_void,
            p.out as *mut c_void,
            cudaDataType::CUDA_R_32F,
            ni,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| KernelError::Gpu {
        op: "cublasGemmEx",
        message: format!("{e:?} (m={m}, n={n}, k={k})"),
    })
}

/// One product per attention head, all heads in one `cublasGemmStridedBatchedEx` call, bf16
/// operands, f32 compute and output: `out_h[t][:n] (+)= x_h[t][:k] · op(W_h)` where head `h`'s
/// operands start `h · *_head` elements after the given addresses and rows are `*_ld` apart.
/// `w_rows_are_outputs`: `W_h` is row-major `[n][k]` (`x · W_hᵀ`, the output un-absorption's
/// `W_UV`), else `[k][n]` (`x · W_h`, the query absorption's `W_UK`).
///
/// The caller guarantees every addressed element lies inside live allocations of the stated
/// types (`gpu::ops::HeadGemm`'s checks).
pub(crate) fn gemm_heads_bf16(
    dev: &CudaDevice,
    g: &crate::gpu::ops::HeadGemm,
    x: u64,
    accumulate: bool,
) -> Result<(), KernelError> {
    use cudarc::cublas::result::gemm_strided_batched_ex;
    let dim = |v, field| dim("cublas_gemm_heads", field, v);
    let long = |v: usize, field| {
        i64::try_from(v).map_err(|_| KernelError::InvalidParam {
            op: "cublas_gemm_heads",
            field,
            limit: "< 2^63",
            value: v.to_string(),
        })
    };
    if g.m == 0 || g.n == 0 || g.heads == 0 {
        return Ok(());
    }
    let transa = if g.w_rows_are_outputs {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    };
    let lda = dim(g.w_ld, "w_ld")?;
    let alpha = 1.0f32;
    let beta = if accumulate { 1.0f32 } else { 0.0f32 };
    let _host = super::host_time::span("cublasGemmStridedBatchedEx");
    dev.bind()?;
    // SAFETY: the handle is bound to the device's stream; the caller guarantees the operands'
    // extents; alpha/beta are host f32 scalars matching CUBLAS_COMPUTE_32F.
    unsafe {
        gemm_strided_batched_ex(
            dev.blas_handle(),
            transa,
            cublasOperation_t::CUBLAS_OP_N,
            dim(g.n, "n")?,
            dim(g.m, "m")?,
            dim(g.k, "k")?,
            &alpha as *const f32 as *const c_void,
            g.w as *const c_void,
            cudaDataType::CUDA_R_16BF,
            lda,
            long(g.w_head, "w_head")?,
            x as *const c_void,
            cudaDataType::CUDA_R_16BF,
            dim(g.x_ld, "x_ld")?,
            long(g.x_head, "x_head")?,
            &beta as *const f32 as *const c_void,
            g.out.ptr as *mut c_void,
            cudaDataType::CUDA_R_32F,
            dim(g.out_ld, "out_ld")?,
            long(g.out_head, "out_head")?,
            dim(g.heads, "heads")?,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| KernelError::Gpu {
        op: "cublasGemmStridedBatchedEx",
        message: format!("{e:?} (m={}, n={}, k={}, heads={})", g.m, g.n, g.k, g.heads),
    })
}
