//! MLA attention launchers for `gpu/mla.cu` and their planning, generic over the runtime
//! ([`Gpu`]). On ROCm only the per-head kernels (`mla_generic_*`, `mla_combine`) and the f32
//! MHA form run: the tile / packed kernels' scalar path is not used there and the flash,
//! wgmma and warp-specialised kernels do not exist without PTX (`crate::backend::dispatch`).
//!
//! | entry point | kernel | heads |
//! |---|---|---|
//! | [`mla_absorbed`] with [`AbsorbedKernel::Tile`] | 16-row head tiles, tensor cores | 4, 8, 16k |
//! | [`mla_absorbed_padded`] | the dispatcher: tile kernel directly, or zero-pad to [`HeadPadPlan::padded`] heads, run, slice back | any |
//! | [`mla_absorbed`] with [`AbsorbedKernel::Packed`] | (query token × head) rows packed into 16-row tiles; on sm_90 a sequence's tiles grouped into blocks that read its keys once ([`MlaShape::packed_groups`]) | any |
//! | [`mla_absorbed`] with [`AbsorbedKernel::Generic`] | one block per (token, head), f32 math, f32 or bf16 cache | any |
//! | [`mha_prefill`] | MHA form, causal, variable length: f32 or tensor-core flash | any |
//!
//! The absorbed kernels split each sequence's keys across blocks when the batch alone would
//! not fill the card ([`plan_splits`]) and merge the partial softmax states with
//! `mla_combine`. Shapes reach the kernels as compile-time defines ([`MlaShape::defines`]),
//! so each model's kernels are compiled once for its dimensions.

use super::launch::{DeviceMem, Gpu, KernelArgs, KernelParam, LaunchDims, TmaRows};
use super::mha_ws::{MhaWsConfig, WS_ROWS, WS_THREADS};
use super::ops::{need, Dv, PagesView};
use crate::error::KernelError;
use crate::gpu::{Defines, Source};
use crate::ops::mla_plan::{is_supported_tile_heads, HeadPadPlan, TILE_ROWS};

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// Keys per step of the tile kernel (`BK` in mla.cu).
const TILE_KEYS: usize = 64;

/// Dimensions the MLA kernels are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MlaShape {
    /// Logical latent row / absorbed query width (`kv_lora + rope`, 576).
    pub latent: usize,
    /// Rope elements a bf16 cache keeps as a hi/lo pair (fast mode's split rows, see
    /// `mla.cu`; 0 = plain bf16 rows). bf16 kernels read cache rows of [`Self::krow`] and
    /// queries of [`Self::qrow`]; f32 kernels never split.
    pub split: usize,
    /// Absorbed value width (`kv_lora`, 512).
    pub kv_lora: usize,
    /// MHA-form query/key width per head (`nope + rope`, 192).
    pub mha_qk: usize,
    /// MHA-form value width per head (128).
    pub mha_v: usize,
    /// Keys per pipeline step of the tile kernels (32 or 64).
    pub tile_bk: usize,
    /// Depth of the tile kernels' `cp.async` pipeline (2..=4 steps in flight; 2..=5 for the
    /// 8-warp kernel).
    pub tile_stages: usize,
    /// Warps per tile block: 4 (keys split over warps, `mla_tile_bf16`), 8 (keys and latent
    /// width split, Q in registers, `mla_tile8_bf16`; 32-key steps) or 5 (the 4-warp math fed
    /// by a bulk-copy producer warp, `mla_tile_ws_bf16`; 32-key steps, sm_90 only).
    pub tile_warps: usize,
    /// Steps ahead of the `cp.async` pipeline at which the tile kernels ask L2 for key rows
    /// (0 = no prefetch).
    pub l2_prefetch: usize,
    /// The most 16-row tiles of one sequence a block of the packed warp-specialised kernel
    /// takes, each on its own four compute warps, all reading one key ring (1..=4; 1 = a
    /// block per tile). A verify step's (drafts + 1) × heads rows span several tiles; grouped,
    /// the sequence's keys stream once per block instead of once per tile.
    pub tile_groups: usize,
}

impl MlaShape {
    /// DeepSeek-V3 / Kimi K2 / K3: 576 / 512 / 192 / 128.
    pub const DEEPSEEK_V3: MlaShape = MlaShape::new(576, 512, 192, 128);

    /// A shape with the default tile pipeline: 32-key steps, double-buffered (two blocks fit
    /// an SM; best of the sweep in BENCHMARKS.md), or 64-key steps where the latent width is
    /// not a multiple of 32.
    pub const fn new(latent: usize, kv_lora: usize, mha_qk: usize, mha_v: usize) -> Self {
        Self {
            latent,
            split: 0,
            kv_lora,
            mha_qk,
            mha_v,
            tile_bk: if latent % 32 == 0 { 32 } else { 64 },
            tile_stages: 2,
            tile_warps: 4,
            l2_prefetch: 0,
            tile_groups: 1,
        }
    }

    /// The same shape over split bf16 rows keeping `split` rope elements as a pair (fast
    /// mode), with the default tile pipeline for the wider rows.
    pub const fn with_split(self, split: usize) -> Self {
        let krow = self.latent + split;
        Self {
            split,
            tile_bk: if krow % 32 == 0 && split % 32 == 0 {
                32
            } else {
                64
            },
            ..self
        }
    }

    /// Elements of a bf16 cache row: `latent + split`.
    pub const fn krow(&self) -> usize {
        self.latent + self.split
    }

    /// Elements of a bf16 absorbed query row: `latent + 2·split` (`[q_abs | hi | hi | lo]`).
    pub const fn qrow(&self) -> usize {
        self.latent + 2 * self.split
    }

    /// Per-head width the bf16 MHA kernels see: `mha_qk + 2·split` (`[nope | hi | hi | lo]`
    /// against `[nope | hi | lo | hi]`).
    pub const fn mha_qkb(&self) -> usize {
        self.mha_qk + 2 * self.split
    }

    /// The same shape with L2 prefetch `steps` ahead of the tile pipeline (0 = off).
    pub const fn with_l2_prefetch(self, steps: usize) -> Self {
        Self {
            l2_prefetch: steps,
            ..self
        }
    }

    /// The same shape on the 8-warp tile kernel with a `stages`-deep pipeline.
    pub const fn with_tile8(self, stages: usize) -> Self {
        Self {
            tile_bk: 32,
            tile_stages: stages,
            tile_warps: 8,
            ..self
        }
    }

    /// The same shape on the warp-specialised tile kernel (sm_90) with a `stages`-deep ring.
    pub const fn with_tile_ws(self, stages: usize) -> Self {
        Self {
            tile_bk: 32,
            tile_stages: stages,
            tile_warps: 5,
            ..self
        }
    }

    /// The same shape with at most `groups` 16-row tiles of a sequence per block of the
    /// packed warp-specialised kernel (clamped to 1..=4; other tilings ignore it).
    pub const fn with_tile_groups(self, groups: usize) -> Self {
        Self {
            tile_groups: if groups < 1 {
                1
            } else if groups > 4 {
                4
            } else {
                groups
            },
            ..self
        }
    }

    /// The fastest measured tile pipeline for a card of compute capability `cc`: the
    /// warp-specialised kernel, double-buffered, on sm_90 where the shape allows it (91–100 %
    /// of copy bandwidth against 63 % for the 4-warp kernel on the H200, BENCHMARKS.md), with
    /// [`Self::default_tile_groups`] tile groups; else this shape unchanged.
    pub fn tuned_for(self, cc: (i32, i32)) -> Self {
        let ws = self.with_tile_ws(2);
        if cc >= (9, 0) && ws.tile_ok() {
            ws.with_tile_groups(ws.default_tile_groups())
        } else {
            self
        }
    }

    /// Tile groups per packed block: `FERRY_MLA_TILE_GROUPS` where set (1 turns grouping off),
    /// else the most this shape takes where grouping was measured to pay: `kv_lora` ≤ 256, the
    /// DSpark target's width (H100, session 56: the verify forward 16–18 % shorter at c = 128
    /// and 256, neutral at c ≤ 64; BENCHMARKS.md). At the family's 512 columns it stays 1:
    /// three groups there were neutral at 2–4 rows a sequence and 2–3.5 % slower at 8 (V2-Lite's
    /// verify forward, H100, session 57).
    pub fn default_tile_groups(&self) -> usize {
        static GROUPS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
        let set = GROUPS.get_or_init(|| {
            std::env::var_os("FERRY_MLA_TILE_GROUPS")
                .map(|_| super::ops::env_count("FERRY_MLA_TILE_GROUPS", 1))
        });
        match set {
            Some(groups) => *groups,
            None if self.kv_lora <= 256 => self.max_tile_groups(),
            None => 1,
        }
    }

    /// The most tile groups a packed block of this shape takes: 4 where a compute warp's share
    /// of the output is small (`kv_lora` ≤ 256), else 3 (ptxas: at the family's 512 columns
    /// four groups' 544 threads spill their accumulators; three's 416 do not).
    pub const fn max_tile_groups(&self) -> usize {
        if self.kv_lora <= 256 {
            4
        } else {
            3
        }
    }

    /// The tile groups one packed block takes for a sequence of `tiles` 16-row tiles: as few
    /// blocks as [`Self::tile_groups`] allows, the tiles spread evenly over them (3 tiles: one
    /// block of 3; 5 tiles: two of 3), fewer where the groups' shared memory would not fit.
    /// 1 on every kernel but the warp-specialised one.
    pub fn packed_groups(&self, tiles: usize) -> usize {
        let most = self.most_packed_groups();
        if tiles <= 1 || most == 1 {
            return 1;
        }
        tiles.div_ceil(tiles.div_ceil(most))
    }

    /// The most tile groups one packed block of this shape takes: [`Self::tile_groups`] within
    /// [`Self::max_tile_groups`] and shared memory; 1 on every kernel but the warp-specialised
    /// one.
    pub fn most_packed_groups(&self) -> usize {
        if self.tile_warps != 5 {
            return 1;
        }
        (1..=self.tile_groups.clamp(1, self.max_tile_groups()))
            .rev()
            .find(|&g| self.tile_smem_groups(g) <= 227 * 1024)
            .unwrap_or(1)
    }

    /// Whether this tiling needs an sm_90 card (the bulk-copy producer).
    pub const fn tile_needs_sm90(&self) -> bool {
        self.tile_warps == 5
    }

    /// The same shape with another tile pipeline (benchmarks sweep these).
    pub const fn with_tile(self, bk: usize, stages: usize) -> Self {
        Self {
            tile_bk: bk,
            tile_stages: stages,
            tile_warps: 4,
            ..self
        }
    }

    /// The `-D` defines of `mla.cu`.
    pub fn defines(&self) -> Defines {
        Defines::new()
            .with("MLA_DQK", self.latent)
            .with("MLA_SPLIT", self.split)
            .with("MLA_DV", self.kv_lora)
            .with("MHA_DQK", self.mha_qk)
            .with("MHA_DV", self.mha_v)
            .with("MLA_BK", self.tile_bk)
            .with("MLA_STAGES", self.tile_stages)
            .with("T8_STAGES", self.tile_stages)
            .with("MLA_WS_ST", self.tile_stages)
            .with("MLA_L2PF", self.l2_prefetch)
    }

    /// Whether the tensor-core tile kernel takes this shape (else use the generic kernel).
    pub fn tile_ok(&self) -> bool {
        // Split rows: the pair lies in the RoPE part, and the score's tail (q_lo against
        // k_pe hi) is whole 16-wide k-steps (32-wide on the 32-key paths).
        let split_ok = self.split == 0
            || (self.split <= self.latent - self.kv_lora.min(self.latent) && self.split % 16 == 0);
        let (krow, split32) = (self.krow(), self.split % 32 == 0);
        // The 8-warp and warp-specialised kernels: 32-key steps; the cache row in whole halves
        // of 32-wide pairs (8 warps) or 32-wide steps; value width per warp pair (8 warps) or
        // per warp; their ring depths.
        if let Some((v_multiple, row_multiple, max_stages)) = match self.tile_warps {
            8 => Some((128, 64, 5)),
            5 => Some((64, 32, 4)),
            _ => None,
        } {
            return krow % row_multiple == 0
                && split32
                && split_ok
                && self.kv_lora % v_multiple == 0
                && self.kv_lora <= self.latent
                && self.tile_bk == 32
                && (2..=max_stages).contains(&self.tile_stages)
                && self.tile_smem() <= 227 * 1024;
        }
        let bk_ok = self.tile_bk == 64 || (self.tile_bk == 32 && krow % 32 == 0 && split32);
        krow % 16 == 0
            && split_ok
            && self.kv_lora % 64 == 0
            && self.kv_lora <= self.latent
            && bk_ok
            && (2..=4).contains(&self.tile_stages)
    }

    /// Whether the tensor-core flash kernel takes this shape.
    pub fn flash_ok(&self) -> bool {
        self.mha_qkb() % 16 == 0 && self.mha_v % 16 == 0
    }

    /// Dynamic shared memory of a packed warp-specialised block of `groups` tile groups: the
    /// key ring once, each group's queries, P and row state, the mbarriers.
    pub fn tile_smem_groups(&self, groups: usize) -> usize {
        let group = TILE_ROWS * (self.qrow() + 8) * 2 + TILE_ROWS * self.tile_bk * 4 + 1024;
        self.tile_smem() + groups.saturating_sub(1) * group
    }

    /// Dynamic shared memory of the tile kernel (either path: mma or scalar).
    pub fn tile_smem(&self) -> usize {
        let (kstr, qstr) = (self.krow() + 8, self.qrow() + 8);
        if self.tile_warps == 8 {
            // Stages of keys, the Q tile, the double-buffered partial-score exchange, row info.
            return self.tile_stages * 32 * kstr * 2
                + TILE_ROWS * qstr * 2
                + 2 * 2 * TILE_ROWS * 36 * 4
                + TILE_ROWS * (4 + 8);
        }
        // (Warp-specialised: the same, plus a full and an empty mbarrier per stage.)
        let barriers = if self.tile_warps == 5 {
            16 * self.tile_stages
        } else {
            0
        };
        self.tile_stages * self.tile_bk * kstr * 2
            + TILE_ROWS * qstr * 2
            + TILE_ROWS * self.tile_bk * 4
            + 1024
            + barriers
    }

    /// Whether the wgmma prefill kernel takes this shape: whole 4-chunk loader items (qk a
    /// multiple of 32) and 64-wide value chunks.
    pub fn wgmma_ok(&self) -> bool {
        self.mha_qkb() % 32 == 0 && self.mha_v % 64 == 0 && self.mha_v > 0
    }

    /// Dynamic shared memory of the flash kernel.
    pub fn flash_smem(&self) -> usize {
        let (fks, fvs) = (self.mha_qkb() + 8, self.mha_v + 8);
        64 * fks * 2 + 2 * 64 * fks * 2 + 2 * 64 * fvs * 2
    }
}

/// Elements of an attention input.
#[derive(Debug, Clone, Copy)]
pub enum Elems {
    /// f32.
    F32(Dv<f32>),
    /// bf16 bits.
    Bf16(Dv<u16>),
}

impl Elems {
    fn ptr(&self) -> u64 {
        match self {
            Elems::F32(v) => v.ptr,
            Elems::Bf16(v) => v.ptr,
        }
    }
    fn len(&self) -> usize {
        match self {
            Elems::F32(v) => v.len,
            Elems::Bf16(v) => v.len,
        }
    }
    fn is_bf16(&self) -> bool {
        matches!(self, Elems::Bf16(_))
    }
}

/// Which absorbed-form kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AbsorbedKernel {
    /// 16-row head tiles (4, 8 or 16k heads only).
    Tile,
    /// (token × head) rows packed into 16-row tiles (any head count).
    Packed,
    /// One block per (token, head) (any head count, f32 or bf16).
    Generic,
}

/// A batch of `batch` sequences with `sq` new queries each, against the paged latent cache.
#[derive(Debug, Clone, Copy)]
pub struct AbsorbedBatch {
    /// Absorbed queries `[batch·sq·heads][qrow]` bf16 (split rows) or `[..][latent]` f32.
    pub q: Elems,
    /// The layer's latent pages.
    pub pages: PagesView,
    /// `[batch][bt_stride]` block ids.
    pub block_table: Dv<i32>,
    /// Entries per block-table row.
    pub bt_stride: usize,
    /// `[batch]`: keys visible to each sequence's last query.
    pub ctx_len: Dv<i32>,
    /// The largest entry of `ctx_len` (plans the split).
    pub max_ctx: usize,
    /// Sequences.
    pub batch: usize,
    /// New queries per sequence.
    pub sq: usize,
    /// Query heads (rows per query token).
    pub heads: usize,
    /// Softmax scale.
    pub scale: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MlaArgsC {
    q: u64,
    pages: u64,
    block_table: u64,
    ctx_len: u64,
    o_part: u64,
    ml_part: u64,
    out: u64,
    bt_stride: i32,
    sq: i32,
    heads: i32,
    page: i32,
    splits: i32,
    keys_per_split: i32,
    scale_log2: f32,
    page_shift: i32,
}
// SAFETY: repr(C): seven u64 then eight 4-byte fields: 88 bytes, no padding; matches
// `struct MlaArgs` in mla.cu field for field.
unsafe impl KernelParam for MlaArgsC {}

/// How many blocks split one (sequence, tile)'s keys, and how many keys each takes.
///
/// As many splits as keep `work_items · splits` within `target_blocks` (the blocks resident
/// at once, so the launch is one wave), at least one, each at least 64 keys;
/// `keys_per_split` is a multiple of 64 (whole tile steps).
pub fn plan_splits(target_blocks: usize, work_items: usize, max_ctx: usize) -> (usize, usize) {
    plan_splits_min(target_blocks, work_items, max_ctx, TILE_KEYS)
}

/// [`plan_splits`] with at least `min_keys` keys per split (rounded up to whole 64-key steps):
/// fewer, longer splits trade parallelism for less per-split work (the query tile's load, one
/// partial row of `kv_lora` floats per head written and merged).
pub fn plan_splits_min(
    target_blocks: usize,
    work_items: usize,
    max_ctx: usize,
    min_keys: usize,
) -> (usize, usize) {
    let max_ctx = max_ctx.max(1);
    let want = (target_blocks / work_items.max(1)).max(1);
    let min_keys = min_keys.max(1).div_ceil(TILE_KEYS) * TILE_KEYS;
    let max_splits = max_ctx.div_ceil(min_keys).max(1);
    let splits = want.min(max_splits);
    let kps = max_ctx.div_ceil(splits).div_ceil(TILE_KEYS) * TILE_KEYS;
    (max_ctx.div_ceil(kps), kps)
}

/// The fewest keys one split of the absorbed kernels takes: `FERRY_MLA_SPLIT_KEYS` (a
/// benchmark sweep's knob), else 64.
fn split_keys() -> usize {
    static KEYS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *KEYS.get_or_init(|| {
        std::env::var("FERRY_MLA_SPLIT_KEYS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(TILE_KEYS)
    })
}

fn int(field: &'static str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| KernelError::InvalidParam {
        op: "gpu_mla",
        field,
        limit: "< 2^31",
        value: v.to_string(),
    })
}

/// Runs one absorbed-form kernel; `out` is `[batch·sq·heads][kv_lora]` f32.
pub fn mla_absorbed<D: Gpu>(
    dev: &D,
    shape: MlaShape,
    kernel: AbsorbedKernel,
    b: &AbsorbedBatch,
    out: Dv<f32>,
) -> Result<(), KernelError> {
    match mla_absorbed_parts(dev, shape, kernel, b, out)? {
        Some(parts) => mla_combine(dev, shape, &parts, out),
        None => Ok(()),
    }
}

/// The split-K partials of an absorbed-form launch that were not merged yet (`splits` > 1):
/// `o_part` `[splits][rows][kv_lora]` unnormalised outputs, `ml_part` `[splits][rows][2]` the
/// log2-domain max and sum of each split. [`mla_combine`] merges them into the output rows;
/// `ops::unabsorb_combine` merges them inside the output un-absorption instead.
pub struct SplitParts<D: Gpu> {
    /// `[splits][rows][kv_lora]`.
    pub o_part: D::Buffer<f32>,
    /// `[splits][rows][2]`.
    pub ml_part: D::Buffer<f32>,
    /// Splits of the keys.
    pub splits: usize,
    /// Output rows (`batch·sq·heads`).
    pub rows: usize,
}

/// Merges `parts` into `out` (`[rows][kv_lora]`): the `mla_combine` launch.
pub fn mla_combine<D: Gpu>(
    dev: &D,
    shape: MlaShape,
    parts: &SplitParts<D>,
    out: Dv<f32>,
) -> Result<(), KernelError> {
    need(
        "gpu_mla_combine",
        "out",
        parts.rows * shape.kv_lora,
        out.len,
    )?;
    let f = dev.function(Source::Mla, &shape.defines(), "mla_combine")?;
    let mut a = KernelArgs::new();
    a.ptr(&parts.o_part)
        .ptr(&parts.ml_part)
        .push(int("splits", parts.splits)?)
        .push(int("rows", parts.rows)?)
        .push(out.ptr);
    let dims = LaunchDims {
        grid: (parts.rows as u32, shape.kv_lora.div_ceil(128) as u32, 1),
        block: (128, 1, 1),
        smem: (parts.splits * 4) as u32,
    };
    dev.launch(&f, dims, &mut a)
}

/// [`mla_absorbed`] without the merge: the kernel writes `out` itself when it runs unsplit
/// (`None`), else its split-K partials come back for the caller to merge.
pub fn mla_absorbed_parts<D: Gpu>(
    dev: &D,
    shape: MlaShape,
    kernel: AbsorbedKernel,
    b: &AbsorbedBatch,
    out: Dv<f32>,
) -> Result<Option<SplitParts<D>>, KernelError> {
    const OP: &str = "gpu_mla_absorbed";
    let rows = b.batch * b.sq * b.heads;
    let q_width = if b.q.is_bf16() {
        shape.qrow()
    } else {
        shape.latent
    };
    need(OP, "q", rows * q_width, b.q.len())?;
    need(OP, "out", rows * shape.kv_lora, out.len)?;
    need(OP, "ctx_len", b.batch, b.ctx_len.len)?;
    need(OP, "block_table", b.batch * b.bt_stride, b.block_table.len)?;
    need(
        OP,
        "block_table row",
        b.max_ctx.div_ceil(b.pages.page_size),
        b.bt_stride,
    )?;
    crate::cpu::gemm::check_len(OP, "pages.width", shape.latent, b.pages.width)?;
    let split = if b.pages.bf16 { shape.split } else { 0 };
    crate::cpu::gemm::check_len(OP, "pages.split", split, b.pages.split)?;
    if b.sq > b.max_ctx {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "sq",
            limit: "<= max_ctx",
            value: format!("{} > {}", b.sq, b.max_ctx),
        });
    }
    if rows == 0 {
        return Ok(None);
    }
    let tiled = kernel != AbsorbedKernel::Generic;
    if tiled && !(b.q.is_bf16() && b.pages.bf16 && shape.tile_ok()) {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "inputs",
            limit:
                "bf16 queries and cache, latent % 16 == 0, kv_lora % 64 == 0 for the tile kernels",
            value: format!(
                "q bf16 {}, cache bf16 {}, {shape:?}",
                b.q.is_bf16(),
                b.pages.bf16
            ),
        });
    }
    let page_shift = if b.pages.page_size.is_power_of_two() {
        b.pages.page_size.trailing_zeros() as i32
    } else {
        -1
    };
    if tiled && shape.tile_needs_sm90() && dev.compute_capability() < (9, 0) {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "shape.tile_warps",
            limit: "4 or 8 below sm_90 (the warp-specialised tile kernel needs bulk copies)",
            value: format!(
                "{} on sm_{}{}",
                shape.tile_warps,
                dev.compute_capability().0,
                dev.compute_capability().1
            ),
        });
    }
    if tiled && page_shift < 0 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "pages.page_size",
            limit: "a power of two for the tile kernels",
            value: b.pages.page_size.to_string(),
        });
    }
    if !tiled && b.q.is_bf16() != b.pages.bf16 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "q / cache element types",
            limit: "equal for the generic kernel",
            value: format!("q bf16 {}, cache bf16 {}", b.q.is_bf16(), b.pages.bf16),
        });
    }
    // Few (sequence, tile) items — a single stream: split-K fills the card with short blocks,
    // where a third ring stage beats a second resident block (+46 % at batch 1, +8 % at batch 4,
    // even at 8, worse above: the sweep in BENCHMARKS.md).
    let tiles = match kernel {
        AbsorbedKernel::Packed => (b.sq * b.heads).div_ceil(TILE_ROWS),
        _ => b.sq * (b.heads / b.heads.clamp(1, TILE_ROWS)),
    };
    // A packed sequence of several tiles (a verify step's rows) in blocks of `groups` tiles
    // that read its keys once.
    let groups = if kernel == AbsorbedKernel::Packed {
        shape.packed_groups(tiles)
    } else {
        1
    };
    let tiles = tiles.div_ceil(groups);
    let shape = if shape.tile_warps == 5
        && shape.tile_stages == 2
        && b.batch * tiles < 8
        && shape.with_tile_ws(3).tile_smem_groups(groups) <= 227 * 1024
    {
        shape.with_tile_ws(3)
    } else {
        shape
    };
    let (name, items, target, block_smem) = match kernel {
        AbsorbedKernel::Tile => {
            if !is_supported_tile_heads(b.heads) {
                return Err(KernelError::UnsupportedHeadCount {
                    op: OP,
                    heads: b.heads,
                });
            }
            (
                match shape.tile_warps {
                    8 => "mla_tile8_bf16",
                    5 => "mla_tile_ws_bf16",
                    _ => "mla_tile_bf16",
                },
                tiles,
                dev.sm_count() as usize,
                shape.tile_smem(),
            )
        }
        AbsorbedKernel::Packed => (
            match (shape.tile_warps, groups) {
                (8, _) => "mla_packed8_bf16",
                (5, 1) => "mla_packed_ws_bf16",
                (5, 2) => "mla_packed_ws2_bf16",
                (5, 3) => "mla_packed_ws3_bf16",
                (5, _) => "mla_packed_ws4_bf16",
                _ => "mla_packed_bf16",
            },
            tiles,
            dev.sm_count() as usize,
            shape.tile_smem_groups(groups),
        ),
        AbsorbedKernel::Generic => {
            let name = if b.q.is_bf16() {
                "mla_generic_bf16"
            } else {
                "mla_generic_f32"
            };
            (name, b.sq * b.heads, 8 * dev.sm_count() as usize, 0)
        }
    };
    let tile = matches!(kernel, AbsorbedKernel::Tile | AbsorbedKernel::Packed);
    // (A grouped block: four compute warps per group and the producer.)
    let threads = if tile && groups > 1 {
        32 * (4 * groups as u32 + 1)
    } else if tile {
        32 * shape.tile_warps as u32
    } else {
        128
    };
    // Tile blocks resident per SM: shared memory allows two 4-warp blocks (the 8-warp kernel
    // takes a whole SM); split-K fills every resident slot in one wave.
    let per_sm = if tile && matches!(shape.tile_warps, 4 | 5) {
        ((228 * 1024) / (block_smem + 1024)).clamp(1, 2)
    } else {
        1
    };
    let (splits, kps) = plan_splits_min(target * per_sm, b.batch * items, b.max_ctx, split_keys());
    let defines = shape.defines();
    let (o_part, ml_part) = if splits > 1 {
        (
            Some(dev.alloc::<f32>(splits * rows * shape.kv_lora)?),
            Some(dev.alloc::<f32>(splits * rows * 2)?),
        )
    } else {
        (None, None)
    };
    let args = MlaArgsC {
        q: b.q.ptr(),
        pages: b.pages.ptr,
        block_table: b.block_table.ptr,
        ctx_len: b.ctx_len.ptr,
        o_part: o_part.as_ref().map_or(0, |p| p.ptr()),
        ml_part: ml_part.as_ref().map_or(0, |p| p.ptr()),
        out: out.ptr,
        bt_stride: int("bt_stride", b.bt_stride)?,
        sq: int("sq", b.sq)?,
        heads: int("heads", b.heads)?,
        page: int("page_size", b.pages.page_size)?,
        splits: int("splits", splits)?,
        keys_per_split: int("keys_per_split", kps)?,
        scale_log2: b.scale * LOG2E,
        page_shift,
    };
    let f = dev.function(Source::Mla, &defines, name)?;
    let mut a = KernelArgs::new();
    a.push(args);
    let dims = LaunchDims {
        grid: (splits as u32, items as u32, b.batch as u32),
        block: (threads, 1, 1),
        smem: block_smem as u32,
    };
    dev.launch(&f, dims, &mut a)?;
    Ok(match (o_part, ml_part) {
        (Some(o_part), Some(ml_part)) => Some(SplitParts {
            o_part,
            ml_part,
            splits,
            rows,
        }),
        _ => None,
    })
}

/// The padding dispatcher: the tile kernel for 4, 8 or 16k heads; otherwise zero-pad the
/// queries to [`HeadPadPlan::padded`] heads, run the tile kernel, and slice the real heads'
/// rows back into `out` (`[batch·sq·heads][kv_lora]`). Exact: heads never mix.
pub fn mla_absorbed_padded<D: Gpu>(
    dev: &D,
    shape: MlaShape,
    b: &AbsorbedBatch,
    out: Dv<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_mla_absorbed_padded";
    let plan = HeadPadPlan::for_heads(b.heads)?;
    if !plan.needs_padding() {
        return mla_absorbed(dev, shape, AbsorbedKernel::Tile, b, out);
    }
    let Elems::Bf16(q) = b.q else {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "q",
            limit: "bf16",
            value: "f32".into(),
        });
    };
    let tokens = b.batch * b.sq;
    need(OP, "q", tokens * b.heads * shape.qrow(), q.len)?;
    need(OP, "out", tokens * b.heads * shape.kv_lora, out.len)?;
    let defines = shape.defines();
    let q_pad = dev.alloc::<u16>(tokens * plan.padded * shape.qrow())?;
    let f = dev.function(Source::Mla, &defines, "pad_heads_bf16")?;
    let mut a = KernelArgs::new();
    a.push(q.ptr)
        .ptr(&q_pad)
        .push(int("heads", b.heads)?)
        .push(int("padded", plan.padded)?)
        .push(int("latent", shape.qrow())?);
    dev.launch(&f, LaunchDims::linear(tokens * plan.padded, 128), &mut a)?;
    let o_pad = dev.alloc::<f32>(tokens * plan.padded * shape.kv_lora)?;
    let padded = AbsorbedBatch {
        q: Elems::Bf16(q_pad.v()),
        heads: plan.padded,
        ..*b
    };
    mla_absorbed(dev, shape, AbsorbedKernel::Tile, &padded, o_pad.v())?;
    let f = dev.function(Source::Mla, &defines, "unpad_heads_f32")?;
    let mut a = KernelArgs::new();
    a.ptr(&o_pad)
        .push(out.ptr)
        .push(int("heads", b.heads)?)
        .push(int("padded", plan.padded)?)
        .push(int("kv_lora", shape.kv_lora)?);
    dev.launch(&f, LaunchDims::linear(tokens * b.heads, 128), &mut a)
}

/// Which MHA-form kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MhaKernel {
    /// f32 inputs, CUDA cores (exact path; any shape).
    F32,
    /// bf16 inputs, tensor cores, FlashAttention-2 style (`mma.sync`, sm_80+).
    Flash,
    /// bf16 inputs, Hopper warpgroup MMA with operands in shared memory (sm_90 only; see
    /// [`MlaShape::wgmma_ok`]).
    Wgmma,
    /// bf16 inputs, Hopper warp-specialised: a TMA producer warp and two ping-pong consumer
    /// warpgroups (sm_90 only; see [`MhaWsConfig::shape_ok`]).
    WarpSpecialized,
}

impl MhaKernel {
    /// The fastest tensor-core kernel for this card and shape: on Hopper the warp-specialised
    /// kernel (0.82–0.92× cuDNN on the H200), else [`MhaKernel::Wgmma`] where its looser shape
    /// rule allows; [`MhaKernel::Flash`] elsewhere.
    pub fn best_bf16<D: Gpu>(dev: &D, shape: MlaShape) -> Self {
        Self::best_bf16_for(dev.compute_capability(), shape)
    }

    /// [`MhaKernel::best_bf16`] for a card of compute capability `cc` (no device needed).
    pub fn best_bf16_for(cc: (i32, i32), shape: MlaShape) -> Self {
        let hopper = cc == (9, 0);
        if hopper
            && MhaWsConfig::shape_ok(shape)
            && MhaWsConfig::default().fitted(shape).valid(shape)
        {
            MhaKernel::WarpSpecialized
        } else if hopper && shape.wgmma_ok() {
            MhaKernel::Wgmma
        } else {
            MhaKernel::Flash
        }
    }

    /// The kernel's name in `mla.cu`.
    pub fn name(self) -> &'static str {
        match self {
            MhaKernel::F32 => "mha_f32",
            MhaKernel::Flash => "mha_flash_bf16",
            MhaKernel::Wgmma => "mha_wgmma_bf16",
            MhaKernel::WarpSpecialized => "mha_ws_bf16",
        }
    }
}

/// A variable-length batch for the MHA form.
#[derive(Debug, Clone, Copy)]
pub struct MhaBatch {
    /// `[Tq][heads][mha_qk]`.
    pub q: Elems,
    /// `[Tk][heads][mha_qk]`.
    pub k: Elems,
    /// `[Tk][heads][mha_v]`.
    pub v: Elems,
    /// `[batch + 1]` query row offsets.
    pub cu_q: Dv<i32>,
    /// `[batch + 1]` key row offsets.
    pub cu_k: Dv<i32>,
    /// `[Tq]` sequence index of each query row (the f32 kernel's row → sequence map).
    pub q_seq: Dv<i32>,
    /// Sequences.
    pub batch: usize,
    /// Longest query span (plans the flash grid).
    pub max_q: usize,
    /// Heads.
    pub heads: usize,
    /// Softmax scale.
    pub scale: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MhaArgsC {
    q: u64,
    k: u64,
    v: u64,
    cu_q: u64,
    cu_k: u64,
    q_seq: u64,
    out: u64,
    heads: i32,
    scale_log2: f32,
}
// SAFETY: repr(C): seven u64 then two 4-byte fields, 64 bytes, no padding; matches `MhaArgs`.
unsafe impl KernelParam for MhaArgsC {}

/// Causal MHA-form attention; `out` is `[Tq][heads][mha_v]` f32.
pub fn mha_prefill<D: Gpu>(
    dev: &D,
    shape: MlaShape,
    kernel: MhaKernel,
    b: &MhaBatch,
    out: Dv<f32>,
) -> Result<(), KernelError> {
    const OP: &str = "gpu_mha_prefill";
    let bf16 = kernel != MhaKernel::F32;
    let qk = if bf16 { shape.mha_qkb() } else { shape.mha_qk };
    let tq = b.q.len() / (b.heads * qk).max(1);
    need(OP, "out", tq * b.heads * shape.mha_v, out.len)?;
    need(OP, "cu_q", b.batch + 1, b.cu_q.len)?;
    need(OP, "cu_k", b.batch + 1, b.cu_k.len)?;
    let shape_ok = match kernel {
        MhaKernel::F32 => true,
        MhaKernel::Flash => shape.flash_ok() && D::TENSOR_CORES,
        MhaKernel::Wgmma => shape.wgmma_ok() && dev.compute_capability() == (9, 0),
        MhaKernel::WarpSpecialized => {
            MhaWsConfig::shape_ok(shape) && dev.compute_capability() == (9, 0)
        }
    };
    if [b.q, b.k, b.v].iter().any(|e| e.is_bf16() != bf16) || !shape_ok {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "inputs",
            limit: "f32 for the f32 kernel; bf16 and qk, v multiples of 16 for flash; \
                    qk % 32, v % 64 and an sm_90 card for wgmma; qk and v % 64 and sm_90 \
                    for the warp-specialised kernel",
            value: format!("{kernel:?} with {shape:?}"),
        });
    }
    if !bf16 {
        need(OP, "q_seq", tq, b.q_seq.len)?;
    }
    if tq == 0 {
        return Ok(());
    }
    let args = MhaArgsC {
        q: b.q.ptr(),
        k: b.k.ptr(),
        v: b.v.ptr(),
        cu_q: b.cu_q.ptr,
        cu_k: b.cu_k.ptr,
        q_seq: b.q_seq.ptr,
        out: out.ptr,
        heads: int("heads", b.heads)?,
        scale_log2: b.scale * LOG2E,
    };
    let defines = shape.defines();
    let mut a = KernelArgs::new();
    a.push(args);
    match kernel {
        MhaKernel::F32 => {
            let f = dev.function(Source::Mla, &defines, "mha_f32")?;
            dev.launch(&f, LaunchDims::linear(tq * b.heads, 128), &mut a)
        }
        MhaKernel::Flash => {
            let f = dev.function(Source::Mla, &defines, "mha_flash_bf16")?;
            let dims = LaunchDims {
                grid: (b.max_q.div_ceil(64) as u32, b.heads as u32, b.batch as u32),
                block: (128, 1, 1),
                smem: shape.flash_smem() as u32,
            };
            dev.launch(&f, dims, &mut a)
        }
        MhaKernel::Wgmma => {
            let cfg = WgmmaConfig::from_env().fitted(shape);
            let f = dev.function(Source::Mla, &cfg.defines(defines), "mha_wgmma_bf16")?;
            let dims = LaunchDims {
                grid: (
                    b.max_q.div_ceil(64 * cfg.warpgroups) as u32,
                    b.heads as u32,
                    b.batch as u32,
                ),
                block: (128 * cfg.warpgroups as u32, 1, 1),
                smem: cfg.smem(shape) as u32,
            };
            dev.launch(&f, dims, &mut a)
        }
        MhaKernel::WarpSpecialized => {
            let cfg = MhaWsConfig::from_env().fitted(shape);
            let tk = b.k.len() / (b.heads * qk).max(1);
            let tv = b.v.len() / (b.heads * shape.mha_v).max(1);
            let heads = b.heads;
            let map = |ptr, rows, width, box_rows| TmaRows {
                ptr,
                rows,
                heads,
                width,
                box_rows,
            };
            dev.push_tma_bf16_rows(&mut a, map(b.q.ptr(), tq, qk, 64))?;
            dev.push_tma_bf16_rows(&mut a, map(b.k.ptr(), tk, qk, cfg.keys))?;
            dev.push_tma_bf16_rows(&mut a, map(b.v.ptr(), tv, shape.mha_v, cfg.keys))?;
            let f = dev.function(Source::Mla, &cfg.defines(defines), "mha_ws_bf16")?;
            let dims = LaunchDims {
                grid: (
                    b.max_q.div_ceil(WS_ROWS) as u32,
                    b.heads as u32,
                    b.batch as u32,
                ),
                block: (WS_THREADS, 1, 1),
                smem: cfg.smem(shape) as u32,
            };
            dev.launch(&f, dims, &mut a)
        }
    }
}

/// A benchmark sweep's comma-separated numbers from environment variable `name` (entries that
/// are not numbers dropped), or `None` when it is unset.
pub(crate) fn env_list(name: &str) -> Option<Vec<usize>> {
    let v = std::env::var(name).ok()?;
    Some(v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
}

/// Tiling of the wgmma prefill kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WgmmaConfig {
    /// Warpgroups per block, 64 query rows each (1 or 2).
    pub warpgroups: usize,
    /// Keys per step (64 or 128).
    pub keys: usize,
    /// Q's fragments in registers (else read from shared memory by every Q·Kᵀ).
    pub q_in_registers: bool,
    /// Issue the next step's Q·Kᵀ before this step's softmax.
    pub overlap: bool,
    /// K/V stages in shared memory (2..=4; 3..=4 with `overlap`).
    pub stages: usize,
    /// K and V tiles in the 128-byte-swizzle layout (needs Q in registers; else the
    /// no-swizzle core-matrix layout, whose wgmma reads conflict on shared-memory banks).
    pub swizzle: bool,
}

impl Default for WgmmaConfig {
    fn default() -> Self {
        Self {
            warpgroups: 2,
            keys: 128,
            q_in_registers: true,
            overlap: false,
            stages: 2,
            swizzle: true,
        }
    }
}

impl WgmmaConfig {
    /// The default, with `FERRY_WGMMA=<warpgroups>,<keys>,<qreg 0|1>,<overlap 0|1>,<stages>[,<swizzle 0|1>]`
    /// overriding it (benchmark sweeps; an invalid or over-budget setting is ignored).
    pub fn from_env() -> Self {
        let d = Self::default();
        let Some(f) = env_list("FERRY_WGMMA") else {
            return d;
        };
        match f.as_slice() {
            [w @ (1 | 2), k @ (64 | 128), q @ (0 | 1), o @ (0 | 1), st @ (2..=4), rest @ ..] => {
                let c = Self {
                    warpgroups: *w,
                    keys: *k,
                    q_in_registers: *q == 1,
                    overlap: *o == 1,
                    stages: *st,
                    swizzle: rest.first().is_some_and(|&z| z == 1),
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

    /// This tiling if `shape` allows it, else the nearest that does: no swizzle (qk not a
    /// multiple of 64), then 64-key steps (shared memory).
    pub fn fitted(self, shape: MlaShape) -> Self {
        let mut c = self;
        if !c.valid(shape) {
            c.swizzle = false;
        }
        if !c.valid(shape) {
            c = Self {
                keys: 64,
                overlap: false,
                stages: 2,
                swizzle: false,
                ..c
            };
        }
        c
    }

    /// Whether the kernel can run this tiling for `shape` (stage count, shared memory).
    pub fn valid(&self, shape: MlaShape) -> bool {
        let min_stages = if self.overlap { 3 } else { 2 };
        (min_stages..=4).contains(&self.stages)
            && self.smem(shape) <= 227 * 1024
            && (!self.swizzle || (self.q_in_registers && shape.mha_qkb() % 64 == 0))
    }

    fn defines(&self, base: Defines) -> Defines {
        base.with("MHA_WGS", self.warpgroups)
            .with("MHA_WGK", self.keys)
            .with("MHA_WG_QREG", u8::from(self.q_in_registers))
            .with("MHA_WG_OVERLAP", u8::from(self.overlap))
            .with("MHA_WGST", self.stages)
            .with("MHA_WG_SWZ", u8::from(self.swizzle))
    }

    /// Dynamic shared memory: the Q tile and the K/V stages.
    pub fn smem(&self, shape: MlaShape) -> usize {
        let stages = self.stages;
        // 1 KB of slack to align the swizzled atoms.
        let slack = if self.swizzle { 1024 } else { 0 };
        slack
            + (64 * self.warpgroups * shape.mha_qkb()
                + stages * self.keys * (shape.mha_qkb() + shape.mha_v))
                * 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_fill_the_resident_slots_but_keep_whole_steps() {
        // One sequence, one tile, 128k keys, 132 slots: 132 splits of whole 64-key steps.
        let (s, kps) = plan_splits(132, 1, 131_072);
        assert!((120..=132).contains(&s), "{s}");
        assert_eq!(kps % 64, 0);
        assert!(s * kps >= 131_072);
        // A full batch needs no split.
        assert_eq!(plan_splits(132, 256, 4096).0, 1);
        // Never more blocks than slots (one wave): 128 sequences in 264 slots split in two.
        assert_eq!(plan_splits(264, 128, 32_768).0, 2);
        assert_eq!(plan_splits(264, 32, 32_768).0, 8);
        // Short contexts still spread, one 64-key step per split at least.
        let (s, kps) = plan_splits(132, 1, 1000);
        assert!(kps >= 64 && s * kps >= 1000 && s == 16, "{s} x {kps}");
    }

    #[test]
    fn smem_fits_hopper() {
        let s = MlaShape::DEEPSEEK_V3;
        assert!(s.tile_smem() <= 227 * 1024, "{}", s.tile_smem());
        assert_eq!((s.tile_bk, s.tile_stages, s.tile_warps), (32, 2, 4));
        for (bk, st) in [(32, 2), (32, 3), (32, 4), (64, 2)] {
            let t = s.with_tile(bk, st);
            assert!(
                t.tile_ok() && t.tile_smem() <= 227 * 1024,
                "{bk}x{st}: {}",
                t.tile_smem()
            );
        }
        for st in 2..=5 {
            let t = s.with_tile8(st);
            assert!(t.tile_ok(), "8 warps x {st}: {}", t.tile_smem());
        }
        assert!(!s.with_tile8(6).tile_ok());
        for st in 2..=4 {
            let t = s.with_tile_ws(st);
            assert!(
                t.tile_ok() && t.tile_needs_sm90(),
                "ws x {st}: {}",
                t.tile_smem()
            );
        }
        assert!(!s.with_tile_ws(5).tile_ok());
        assert!(!MlaShape::new(80, 64, 48, 32).with_tile(32, 2).tile_ok());
        assert!(s.flash_smem() <= 227 * 1024 / 2, "{}", s.flash_smem());
        assert!(s.tile_ok() && s.flash_ok() && s.wgmma_ok());
    }

    #[test]
    fn a_verify_steps_tiles_are_grouped_evenly_into_blocks_that_fit() {
        let dspark = MlaShape::new(160, 128, 96, 64)
            .with_split(32)
            .with_tile_ws(2);
        let four = dspark.with_tile_groups(4);
        // (tiles of a sequence, groups per block): as few blocks as 4 groups allow, the
        // tiles spread evenly (6 tiles: two blocks of 3, not 4 + 2).
        for (tiles, want) in [
            (1, 1),
            (2, 2),
            (3, 3),
            (4, 4),
            (5, 3),
            (6, 3),
            (8, 4),
            (9, 3),
        ] {
            assert_eq!(four.packed_groups(tiles), want, "{tiles} tiles");
        }
        assert_eq!(dspark.packed_groups(4), 1, "one tile a block unless asked");
        assert_eq!(four.with_tile_groups(9).tile_groups, 4, "clamped");
        // Only the warp-specialised kernel groups.
        assert_eq!(four.with_tile(32, 2).packed_groups(4), 1);
        // The family's wide rows at four ring stages: the groups shrink to what fits.
        let wide = MlaShape::DEEPSEEK_V3
            .with_split(64)
            .with_tile_ws(4)
            .with_tile_groups(4);
        let g = wide.packed_groups(4);
        assert_eq!(
            g, 2,
            "three groups' queries beside a four-stage ring exceed 227 KiB"
        );
        assert!(wide.tile_smem_groups(2) <= 227 * 1024 && wide.tile_smem_groups(3) > 227 * 1024);
        assert!(four.tile_smem_groups(4) <= 227 * 1024);
        // The family's 512 columns take three groups at most (four spill).
        let v3 = MlaShape::DEEPSEEK_V3.with_tile_ws(2).with_tile_groups(4);
        assert_eq!(
            v3.packed_groups(4),
            2,
            "4 tiles: two blocks of 2, not 3 + 1"
        );
        assert_eq!(v3.packed_groups(3), 3);
        // On by default where measured (the DSpark width), off at 512 columns until measured.
        if std::env::var_os("FERRY_MLA_TILE_GROUPS").is_none() {
            assert_eq!(dspark.tuned_for((9, 0)).tile_groups, 4);
            assert_eq!(MlaShape::DEEPSEEK_V3.tuned_for((9, 0)).tile_groups, 1);
            assert_eq!(dspark.tuned_for((8, 0)).packed_groups(4), 1, "sm_90 only");
        }
    }

    #[test]
    fn split_rows_widen_the_rows_and_keep_the_kernels() {
        // Fast mode's rows: the family's 576 + a 64-wide pair, queries 576 + 2·64.
        let s = MlaShape::DEEPSEEK_V3.with_split(64);
        assert_eq!((s.krow(), s.qrow(), s.mha_qkb()), (640, 704, 320));
        assert_eq!(s.tile_bk, 32, "whole 32-wide tails: the 32-key path");
        assert!(s.tile_ok() && s.flash_ok() && s.wgmma_ok());
        for t in [
            s.with_tile(64, 2),
            s.with_tile(32, 3),
            s.with_tile8(4),
            s.with_tile_ws(2),
        ] {
            assert!(t.tile_ok(), "{t:?}: {}", t.tile_smem());
        }
        assert!(
            s.tuned_for((9, 0)).tile_needs_sm90(),
            "the Hopper default stays"
        );
        assert!(
            s.defines().key().contains("MLA_SPLIT=64"),
            "{}",
            s.defines().key()
        );
        // The embedded model's 16-wide pair: 64-key steps (one 16-wide tail k-step).
        let tiny = MlaShape::new(80, 64, 48, 32).with_split(16);
        assert_eq!((tiny.krow(), tiny.qrow(), tiny.tile_bk), (96, 112, 64));
        assert!(tiny.tile_ok() && tiny.flash_ok());
        assert!(
            !tiny.with_tile(32, 2).tile_ok(),
            "a 16-wide tail is not a 32-key step"
        );
        // A pair wider than the RoPE part, or not whole k-steps, is refused.
        assert!(!MlaShape::DEEPSEEK_V3.with_split(128).tile_ok());
        assert!(!MlaShape::DEEPSEEK_V3.with_split(8).tile_ok());
        // The warp-specialised prefill fits the wider rows with 64-key steps.
        let ws = MhaWsConfig::default().fitted(s);
        assert!(ws.valid(s) && ws.keys == 64, "{ws:?}: {}", ws.smem(s));
        assert_eq!(
            MhaKernel::best_bf16_for((9, 0), s),
            MhaKernel::WarpSpecialized
        );
    }

    #[test]
    fn wgmma_tiling_fits_every_shape_it_takes() {
        let v3 = MlaShape::DEEPSEEK_V3;
        let d = WgmmaConfig::default();
        assert!(d.valid(v3) && d.swizzle && d.fitted(v3) == d);
        assert!(d.smem(v3) <= 227 * 1024, "{}", d.smem(v3));
        // qk 96: a multiple of 32 (the kernel takes it) but not of 64 (no swizzled atoms).
        let odd = MlaShape::new(576, 512, 96, 64);
        assert!(odd.wgmma_ok());
        let f = d.fitted(odd);
        assert!(f.valid(odd) && !f.swizzle, "{f:?}");
        // Wide heads: 128-key stages no longer fit shared memory.
        let wide = MlaShape::new(576, 512, 256, 256);
        let f = d.fitted(wide);
        assert!(f.valid(wide) && f.keys == 64, "{f:?}");
        // The tiny model's heads are not a wgmma shape at all.
        assert!(!MlaShape::new(80, 64, 48, 32).wgmma_ok());
    }
}
