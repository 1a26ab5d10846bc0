//! Host side of the warp-specialised Hopper prefill kernel (`mha_ws_bf16` in `gpu/mla.cu`):
//! its tiling ([`MhaWsConfig`]) and the TMA descriptors it loads Q, K and V through.
//!
//! The kernel's producer warp copies tiles with the Tensor Memory Accelerator, which needs a
//! `CUtensorMap` per operand: the tensor's base, extents and strides, the box one copy moves
//! and the shared-memory swizzle. They are encoded on the host for each launch (a few hundred
//! nanoseconds, no device work) and passed by value as `__grid_constant__` parameters, so a
//! captured CUDA graph carries them too.

use cudarc::driver::sys;

use super::context::KernelParam;
use super::mla::{env_list, MlaShape};
use crate::error::KernelError;
use crate::gpu::Defines;

/// Tiling of the warp-specialised prefill kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MhaWsConfig {
    /// Keys per step (64, 96 or 128).
    pub keys: usize,
    /// K/V ring depth (2..=4, as shared memory allows).
    pub stages: usize,
    /// Columns per P·V wgmma (64 or 128).
    pub pv_cols: usize,
    /// The two consumer warpgroups take turns on the tensor cores (named barriers).
    pub pingpong: bool,
    /// Each consumer overlaps its softmax with its own previous P·V (needs < 128 keys: the
    /// consumers get 168 registers).
    pub overlap: bool,
}

impl Default for MhaWsConfig {
    fn default() -> Self {
        Self {
            keys: 128,
            stages: 2,
            pv_cols: 128,
            // Measured on the H200: turn-taking at two GEMMs per step cost 3–5 % here.
            pingpong: false,
            overlap: false,
        }
    }
}

/// Threads per block: two consumer warpgroups and one producer warp.
pub const WS_THREADS: u32 = 288;
/// Query rows per block.
pub const WS_ROWS: usize = 128;

impl MhaWsConfig {
    /// The default, with `FERRY_MHA_WS=<keys>,<stages>,<pv cols>,<pingpong 0|1>,<overlap 0|1>`
    /// overriding it (benchmark sweeps; an invalid setting is ignored).
    pub fn from_env() -> Self {
        let d = Self::default();
        let Some(f) = env_list("FERRY_MHA_WS") else {
            return d;
        };
        match f.as_slice() {
            [k, st, pv, pp @ (0 | 1), ov @ (0 | 1)] => {
                let c = Self {
                    keys: *k,
                    stages: *st,
                    pv_cols: *pv,
                    pingpong: *pp == 1,
                    overlap: *ov == 1,
                };
                if c.valid(MlaShape::DEEPSEEK_V3) {
                    c
                } else {
                    d
                }
            }
            _ => d,
        }
    }

    /// Whether the kernel takes `shape` at all: whole 64-element swizzle atoms in qk and v.
    pub fn shape_ok(shape: MlaShape) -> bool {
        shape.mha_qk % 64 == 0 && shape.mha_v % 64 == 0 && shape.mha_v > 0
    }

    /// Whether this tiling runs for `shape`.
    pub fn valid(&self, shape: MlaShape) -> bool {
        Self::shape_ok(shape)
            && matches!(self.keys, 64 | 96 | 128)
            && (2..=4).contains(&self.stages)
            && matches!(self.pv_cols, 64 | 128)
            && shape.mha_v % self.pv_cols == 0
            && !(self.overlap && self.keys == 128)
            && self.smem(shape) <= 227 * 1024
    }

    /// This tiling if `shape` allows it, else the default's, else two stages.
    pub fn fitted(self, shape: MlaShape) -> Self {
        [
            self,
            Self::default(),
            Self {
                stages: 2,
                pv_cols: 64,
                ..Self::default()
            },
        ]
        .into_iter()
        .find(|c| c.valid(shape))
        .unwrap_or(self)
    }

    /// Compile-time defines for this tiling.
    pub fn defines(&self, base: Defines) -> Defines {
        base.with("MHA_WS_K", self.keys)
            .with("MHA_WS_ST", self.stages)
            .with("MHA_WS_PVN", self.pv_cols)
            .with("MHA_WS_PINGPONG", u8::from(self.pingpong))
            .with("MHA_WS_OVERLAP", u8::from(self.overlap))
    }

    /// Dynamic shared memory: 1 KB alignment slack, both consumers' Q tiles, the K/V rings
    /// and the mbarriers (one for Q, four per stage).
    pub fn smem(&self, shape: MlaShape) -> usize {
        1024 + WS_ROWS * shape.mha_qk * 2
            + self.stages * self.keys * (shape.mha_qk + shape.mha_v) * 2
            + 8 * (1 + 4 * self.stages)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_tiling_fits_the_family_and_env_sweeps_are_checked() {
        let v3 = MlaShape::DEEPSEEK_V3;
        let d = MhaWsConfig::default();
        assert!(d.valid(v3) && d.fitted(v3) == d, "{}", d.smem(v3));
        // 128-key steps with the intra-warpgroup overlap do not fit the consumers' registers.
        assert!(!MhaWsConfig { overlap: true, ..d }.valid(v3));
        assert!(MhaWsConfig {
            overlap: true,
            keys: 96,
            ..d
        }
        .valid(v3));
        // Three 128-key stages need 1 + 48 + 3·80 KB: more than a block may have.
        assert!(!MhaWsConfig { stages: 3, ..d }.valid(v3));
        assert!(MhaWsConfig {
            stages: 3,
            keys: 64,
            ..d
        }
        .valid(v3));
        // qk 96 is not a whole number of swizzle atoms.
        assert!(!MhaWsConfig::shape_ok(MlaShape::new(576, 512, 96, 64)));
    }
}
