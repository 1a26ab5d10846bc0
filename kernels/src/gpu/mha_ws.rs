//! Host side of the warp-specialised Hopper prefill kernel (`mha_ws_bf16` in `gpu/mla.cu`):
//! its tiling ([`MhaWsConfig`]). The TMA descriptors it loads Q, K and V through need the CUDA
//! driver and live in `crate::cuda::mha_ws` (`TmaMap`).

use super::mla::{env_list, MlaShape};
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
        shape.mha_qkb() % 64 == 0 && shape.mha_v % 64 == 0 && shape.mha_v > 0
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
            // Fast mode's split rows widen qk (320 for the family): 64-key steps fit.
            Self {
                keys: 64,
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
        1024 + WS_ROWS * shape.mha_qkb() * 2
            + self.stages * self.keys * (shape.mha_qkb() + shape.mha_v) * 2
            + 8 * (1 + 4 * self.stages)
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
