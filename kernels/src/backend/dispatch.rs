//! Which kernel each op runs on a GPU runtime, as functions of the runtime type alone (no
//! device needed): the GPU arms of [`super::linear`], [`super::mla_absorbed`] and
//! [`super::mla_mha`] call [`absorbed`] and [`mha`] to choose, and [`forward_kernels`] lists a
//! forward's kernels for tests and docs.
//!
//! | op | CUDA | ROCm |
//! |---|---|---|
//! | `linear` 1 row | `gemv_{f32,bf16}` (`gemv_pair_*` for two projections) | the same |
//! | `linear` 2–16 rows, bf16 weights of a width % 32 = 0 | `gemv_mma_bf16` (tensor cores, sm_80+; one launch for two projections) | the GEMV up to 8 rows, `gemm_tiled_bf16` above |
//! | `linear` ≤ 8 rows otherwise | `gemv_{f32,bf16}` (`gemv_pair_*` for two projections) | the same |
//! | `linear` > 8 rows otherwise | cuBLAS (exact: split-bf16 activations, two GEMMs) | `gemm_tiled_{f32,bf16}` (f32 activations, both modes) |
//! | `embed`, `gather`, norms, RoPE, latent write, absorb / unabsorb, MLP, MoE | `common.cu` | the same kernels |
//! | absorbed MLA, exact | `mla_generic_f32` | the same |
//! | absorbed MLA, fast | tile (padded), packed, or `mla_generic_bf16` | `mla_generic_bf16` |
//! | MHA-form MLA, exact | `mha_f32` | the same |
//! | MHA-form MLA, fast | `mha_ws_bf16` / `mha_wgmma_bf16` (sm_90), `mha_flash_bf16` | `mha_f32` (bf16 cache widened by `gather_latent_bf16`) |
//! | sampling, verification, drafter ops | `sample.cu`, `draft.cu` | the same kernels |
//!
//! ```
//! # #[cfg(feature = "cuda")] {
//! use ferry_kernels::backend::dispatch::{absorbed, mha, AbsorbedPlan};
//! use ferry_kernels::backend::{AbsorbedKernel, AttnKernels, Precision};
//! use ferry_kernels::cuda::{mla::{MhaKernel, MlaShape}, CudaDevice};
//!
//! let fast = AttnKernels { precision: Precision::Fast, absorbed: AbsorbedKernel::Tile };
//! let v3 = MlaShape::DEEPSEEK_V3;
//! assert_eq!(absorbed::<CudaDevice>(fast, &v3), AbsorbedPlan::TilePadded);
//! assert_eq!(mha::<CudaDevice>(Precision::Fast, &v3, (9, 0)), MhaKernel::WarpSpecialized);
//! assert_eq!(mha::<CudaDevice>(Precision::Exact, &v3, (9, 0)), MhaKernel::F32);
//! # }
//! ```

use super::{AbsorbedKernel, AttnKernels, Precision};
use crate::cpu::mla::MlaDims;
use crate::gpu::launch::Gpu;
use crate::gpu::mla::{MhaKernel, MlaShape};
use crate::gpu::ops::GEMV_MAX_M;
use crate::gpu::Source;

/// The attention kernels' shape (and so `mla.cu`'s defines) for `d` over a cache whose bf16
/// rows keep `split` rope elements as pairs (fast mode: `d.qk_rope_head_dim`; 0 for f32 or
/// plain rows) on a card of compute capability `cc`: the tile pipeline tuned for sm_90, the
/// default elsewhere (ROCm: [`crate::gpu::launch::NOT_CUDA`]).
pub fn mla_shape(d: &MlaDims, cc: (i32, i32), split: usize) -> MlaShape {
    MlaShape::new(
        d.latent_width(),
        d.kv_lora_rank,
        d.qk_head_dim(),
        d.v_head_dim,
    )
    .with_split(split)
    .tuned_for(cc)
}

/// What the absorbed-form GPU arm launches (between `absorb` and `unabsorb`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbsorbedPlan {
    /// f32 absorbed queries against an f32 cache: `mla_generic_f32`.
    GenericF32,
    /// bf16 absorbed queries against a bf16 cache: `mla_generic_bf16`.
    GenericBf16,
    /// bf16 queries in 16-row head tiles on tensor cores, other head counts zero-padded
    /// (`mla_absorbed_padded`).
    TilePadded,
    /// bf16 queries with several tokens' heads packed into one tensor-core tile.
    Packed,
}

impl AbsorbedPlan {
    /// The attention kernel's name in `mla.cu` for `shape`'s tiling.
    pub fn kernel(self, shape: &MlaShape) -> &'static str {
        match (self, shape.tile_warps) {
            (AbsorbedPlan::GenericF32, _) => "mla_generic_f32",
            (AbsorbedPlan::GenericBf16, _) => "mla_generic_bf16",
            (AbsorbedPlan::TilePadded, 8) => "mla_tile8_bf16",
            (AbsorbedPlan::TilePadded, 5) => "mla_tile_ws_bf16",
            (AbsorbedPlan::TilePadded, _) => "mla_tile_bf16",
            (AbsorbedPlan::Packed, 8) => "mla_packed8_bf16",
            (AbsorbedPlan::Packed, 5) => "mla_packed_ws_bf16",
            (AbsorbedPlan::Packed, _) => "mla_packed_bf16",
        }
    }

    /// Whether the absorbed queries (and so the cache) are bf16.
    pub fn bf16(self) -> bool {
        self != AbsorbedPlan::GenericF32
    }
}

/// The absorbed-form kernel on the runtime `D`: exact mode is the per-head f32 kernel
/// everywhere; fast mode takes the requested tensor-core kernel where the runtime has tensor
/// cores and the shape fits the tiles, else the per-head bf16 kernel.
pub fn absorbed<D: Gpu>(k: AttnKernels, shape: &MlaShape) -> AbsorbedPlan {
    match k.precision {
        Precision::Exact => AbsorbedPlan::GenericF32,
        Precision::Fast => match k.absorbed {
            AbsorbedKernel::Tile if D::TENSOR_CORES && shape.tile_ok() => AbsorbedPlan::TilePadded,
            AbsorbedKernel::Packed if D::TENSOR_CORES && shape.tile_ok() => AbsorbedPlan::Packed,
            _ => AbsorbedPlan::GenericBf16,
        },
    }
}

/// The MHA-form kernel on the runtime `D` for a card of compute capability `cc`: the best
/// tensor-core kernel in fast mode where the runtime has tensor cores and the shape fits the
/// flash tiles, else the f32 kernel (a bf16 cache is widened to f32 first).
pub fn mha<D: Gpu>(precision: Precision, shape: &MlaShape, cc: (i32, i32)) -> MhaKernel {
    if precision == Precision::Fast && D::TENSOR_CORES && shape.flash_ok() {
        MhaKernel::best_bf16_for(cc, *shape)
    } else {
        MhaKernel::F32
    }
}

/// The kernels of one op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpKernels {
    /// The backend op.
    pub op: &'static str,
    /// The source its kernels are in.
    pub source: Source,
    /// Kernel names (both weight / cache element types where the op has two).
    pub kernels: Vec<&'static str>,
}

/// Every kernel a forward (and the sampling, verification and drafter ops) may launch on the
/// runtime `D` for a model of `shape` with `k`, on a card of compute capability `cc`; the large
/// GEMM is listed as its kernels where it is one of ours ([`Gpu::VENDOR_GEMM`] is `None`).
pub fn forward_kernels<D: Gpu>(k: AttnKernels, shape: &MlaShape, cc: (i32, i32)) -> Vec<OpKernels> {
    let op = |op, source, kernels: &[&'static str]| OpKernels {
        op,
        source,
        kernels: kernels.to_vec(),
    };
    let mut linear = vec!["gemv_f32", "gemv_bf16", "gemv_pair_f32", "gemv_pair_bf16"];
    if D::TENSOR_CORES && cc >= (8, 0) {
        linear.push("gemv_mma_bf16");
    }
    if D::VENDOR_GEMM.is_none() {
        linear.extend(["gemm_tiled_f32", "gemm_tiled_bf16"]);
    }
    let plan = absorbed::<D>(k, shape);
    let mut attn = vec![plan.kernel(shape), "mla_combine"];
    if plan == AbsorbedPlan::TilePadded {
        attn.extend(["pad_heads_bf16", "unpad_heads_f32"]);
    }
    // Steps of several tiles a sequence run the grouped packed kernels (`mla_absorbed.rs`).
    if plan != AbsorbedPlan::GenericF32 && plan != AbsorbedPlan::GenericBf16 {
        let grouped = [
            "mla_packed_ws2_bf16",
            "mla_packed_ws3_bf16",
            "mla_packed_ws4_bf16",
        ];
        attn.extend(grouped.iter().take(shape.most_packed_groups() - 1));
    }
    let abs_out = if plan.bf16() {
        ["absorb_f32_bf16", "absorb_bf16_bf16"]
    } else {
        ["absorb_f32_f32", "absorb_bf16_f32"]
    };
    let mha_kernel = mha::<D>(k.precision, shape, cc);
    let (cache, kv) = match (k.precision, mha_kernel) {
        (Precision::Exact, _) => ("gather_latent_f32", "mha_build_kv_f32"),
        (Precision::Fast, MhaKernel::F32) => ("gather_latent_bf16", "mha_build_kv_f32"),
        (Precision::Fast, _) => ("gather_latent_bf16", "mha_build_kv_bf16"),
    };
    let latent = match k.precision {
        Precision::Exact => "latent_finish_f32",
        Precision::Fast => "latent_finish_bf16",
    };
    vec![
        OpKernels {
            op: "linear",
            source: Source::Common,
            kernels: linear,
        },
        op("embed", Source::Common, &["embed_f32", "embed_bf16"]),
        op("gather_rows", Source::Common, &["gather_rows"]),
        op(
            "add_rms_norm",
            Source::Common,
            &["add_rms_norm", "rms_norm_strided"],
        ),
        op("rope", Source::Common, &["rope_apply"]),
        op("latent_write", Source::Common, &[latent]),
        op(
            "mla_absorbed (absorb, unabsorb)",
            Source::Common,
            &[
                abs_out[0],
                abs_out[1],
                "unabsorb_f32",
                "unabsorb_bf16",
                "unabsorb_combine_f32",
                "unabsorb_combine_bf16",
            ],
        ),
        OpKernels {
            op: "mla_absorbed",
            source: Source::Mla,
            kernels: attn,
        },
        op("mla_mha (decompress)", Source::Common, &[cache, kv]),
        op("mla_mha", Source::Mla, &[mha_kernel.name()]),
        op("dense_mlp", Source::Common, &["silu_mul"]),
        op(
            "moe",
            Source::Common,
            &[
                "moe_route",
                "moe_gate_up_f32",
                "moe_gate_up_bf16",
                "moe_down_f32",
                "moe_down_bf16",
            ],
        ),
        op(
            "sample / verify",
            Source::Sample,
            &[
                "sample_probs",
                "sample_draw",
                "sample_argmax",
                "sample_argmax_part",
                "sample_argmax_merge",
                "sample_softmax_max",
                "sample_softmax_exp",
                "sample_softmax_norm",
                "sample_probs_finish",
                "sample_draw_part",
                "sample_draw_pick",
                "spec_verify",
                "spec_verify_accept",
                "spec_verify_part",
                "spec_verify_pick",
            ],
        ),
        OpKernels {
            op: "draft",
            source: Source::Draft,
            kernels: [
                "draft_scatter_f32",
                "draft_scatter_bf16",
                "draft_attn_combine",
                "draft_concat",
                "draft_confidence",
                "draft_markov_f32",
                "draft_markov_bf16",
            ]
            .into_iter()
            .chain(crate::gpu::draft::attn_kernels())
            .collect(),
        },
    ]
}

/// Rows above which `linear` leaves the GEMV kernel for the runtime's large GEMM.
pub const LINEAR_GEMV_ROWS: usize = GEMV_MAX_M;
