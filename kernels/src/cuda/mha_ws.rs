//! The CUDA half of the warp-specialised Hopper prefill kernel (`mha_ws_bf16`): the TMA
//! descriptors it loads Q, K and V through. Its tiling ([`MhaWsConfig`]) is host arithmetic
//! shared with every runtime (`crate::gpu::mha_ws`).
//!
//! The kernel's producer warp copies tiles with the Tensor Memory Accelerator, which needs a
//! `CUtensorMap` per operand: the tensor's base, extents and strides, the box one copy moves
//! and the shared-memory swizzle. They are encoded on the host for each launch (a few hundred
//! nanoseconds, no device work) and passed by value as `__grid_constant__` parameters, so a
//! captured CUDA graph carries them too.

use cudarc::driver::sys;

use crate::error::KernelError;
use crate::gpu::launch::KernelParam;
pub use crate::gpu::mha_ws::{MhaWsConfig, WS_ROWS, WS_THREADS};

/// A `CUtensorMap` as the kernel's `TmaMap` parameter (128 bytes, 64-byte aligned).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct TmaMap(sys::CUtensorMap);

// SAFETY: `CUtensorMap` is `#[repr(C)]`, sixteen u64 (no padding), matching `TmaMap` in mla.cu.
unsafe impl KernelParam for TmaMap {}

impl TmaMap {
    /// A map over the bf16 tensor `[rows][heads][width]` at device address `ptr` whose box is
    /// 64 elements of width × one head × `box_rows` rows, landing in shared memory in the
    /// 128-byte-swizzle layout wgmma reads. Rows past `rows` read as zeros.
    pub fn bf16_rows(
        ptr: u64,
        rows: usize,
        heads: usize,
        width: usize,
        box_rows: usize,
    ) -> Result<Self, KernelError> {
        const OP: &str = "tma_map";
        let bad = |field, limit, value: usize| KernelError::InvalidParam {
            op: OP,
            field,
            limit,
            value: value.to_string(),
        };
        if ptr % 16 != 0 {
            return Err(bad("ptr", "16-byte aligned", ptr as usize));
        }
        if width % 64 != 0 || width == 0 {
            return Err(bad("width", "a positive multiple of 64", width));
        }
        if !(1..=256).contains(&box_rows) {
            return Err(bad("box_rows", "1..=256", box_rows));
        }
        let dims: [u64; 3] = [width as u64, heads as u64, rows.max(1) as u64];
        let strides: [u64; 2] = [(width * 2) as u64, (heads * width * 2) as u64];
        let boxes: [u32; 3] = [64, 1, box_rows as u32];
        let elem_strides: [u32; 3] = [1, 1, 1];
        // SAFETY: an all-zero CUtensorMap is a valid (opaque) buffer for the encoder to fill.
        let mut map: sys::CUtensorMap = unsafe { std::mem::zeroed() };
        // SAFETY: every array has the rank's length (3; strides rank - 1) and outlives the
        // call; the encoder only writes `map` and reads the arrays (no device access).
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                3,
                ptr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(KernelError::Gpu {
                op: "cuTensorMapEncodeTiled",
                message: format!("{r:?} for [{rows}][{heads}][{width}] box {box_rows}"),
            });
        }
        Ok(Self(map))
    }
}
