//! The ROCm backend without an AMD GPU: hipRTC compiles every kernel source with every set of
//! defines the ROCm arms use (the embedded model's shape and DeepSeek-V3's), every kernel the
//! ROCm dispatch picks is in the code object, the dispatch itself (which kernel each op runs on
//! ROCm) holds for every precision and kernel request, and device probing fails cleanly.
//! Nothing here executes a kernel: no AMD GPU was available to this project (README, "GPU
//! backends"); `tests/backend*.rs` run the ops on a ROCm device where one opens.
#![cfg(feature = "rocm")]

use ferry_kernels::backend::dispatch::{absorbed, forward_kernels, mha, mla_shape, AbsorbedPlan};
use ferry_kernels::backend::{AbsorbedKernel, AttnKernels, Precision};
use ferry_kernels::cpu::mla::MlaDims;
use ferry_kernels::gpu::launch::NOT_CUDA;
use ferry_kernels::gpu::mla::{MhaKernel, MlaShape};
use ferry_kernels::gpu::{Defines, Source};
use ferry_kernels::rocm::{hiprtc, probe, RocmDevice};
use ferry_kernels::Device;
use ferry_modelcard::config::ModelConfig;

/// The architecture CI compiles for (MI200); the backend compiles for the card's own.
const ARCH: &str = "gfx90a";

/// The embedded model's attention dimensions (from its committed config).
fn embedded_dims() -> MlaDims {
    let dir = ferry_modelcard::embedded::default_model_dir();
    let c = ModelConfig::from_file(&dir.join("config.json")).expect("the embedded config");
    MlaDims {
        heads: c.num_attention_heads,
        kv_lora_rank: c.kv_lora_rank,
        qk_nope_head_dim: c.qk_nope_head_dim,
        qk_rope_head_dim: c.qk_rope_head_dim,
        v_head_dim: c.v_head_dim,
    }
}

/// DeepSeek-V3's: 128 heads, kv_lora 512, nope 128, rope 64, v 128.
const DEEPSEEK_V3: MlaDims = MlaDims {
    heads: 128,
    kv_lora_rank: 512,
    qk_nope_head_dim: 128,
    qk_rope_head_dim: 64,
    v_head_dim: 128,
};

fn every_request() -> Vec<AttnKernels> {
    let mut all = Vec::new();
    for precision in [Precision::Exact, Precision::Fast] {
        for absorbed in [
            AbsorbedKernel::Tile,
            AbsorbedKernel::Packed,
            AbsorbedKernel::Generic,
        ] {
            all.push(AttnKernels {
                precision,
                absorbed,
            });
        }
    }
    all
}

/// Whether a code object holds the symbol `name` (its string table lists every kernel).
fn has_symbol(code: &[u8], name: &str) -> bool {
    code.windows(name.len() + 1)
        .any(|w| w.starts_with(name.as_bytes()) && matches!(w[name.len()], 0 | b'.'))
}

#[test]
fn the_rocm_dispatch_picks_only_portable_kernels() {
    for (model, dims) in [("embedded", embedded_dims()), ("DeepSeek-V3", DEEPSEEK_V3)] {
        let shape = mla_shape(&dims, NOT_CUDA, 0);
        // Untuned on a card that is not CUDA: the default 4-warp pipeline's defines.
        assert_eq!(
            shape,
            MlaShape::new(
                dims.latent_width(),
                dims.kv_lora_rank,
                dims.qk_head_dim(),
                dims.v_head_dim,
            )
        );
        for k in every_request() {
            let plan = absorbed::<RocmDevice>(k, &shape);
            let want = match k.precision {
                Precision::Exact => AbsorbedPlan::GenericF32,
                Precision::Fast => AbsorbedPlan::GenericBf16,
            };
            assert_eq!(plan, want, "{model} {k:?}");
            assert_eq!(
                mha::<RocmDevice>(k.precision, &shape, NOT_CUDA),
                MhaKernel::F32,
                "{model} {k:?}"
            );
            let ops = forward_kernels::<RocmDevice>(k, &shape, NOT_CUDA);
            let linear = &ops
                .iter()
                .find(|o| o.op == "linear")
                .expect("linear")
                .kernels;
            assert!(
                linear.contains(&"gemm_tiled_f32") && linear.contains(&"gemm_tiled_bf16"),
                "ROCm's large GEMM is the portable kernel: {linear:?}"
            );
            for o in &ops {
                for name in &o.kernels {
                    assert!(
                        !name.starts_with("mla_tile")
                            && !name.starts_with("mla_packed")
                            && !name.starts_with("mha_flash")
                            && !name.starts_with("mha_wgmma")
                            && !name.starts_with("mha_ws"),
                        "{model} {k:?}: {} picks the tensor-core kernel {name}",
                        o.op
                    );
                }
            }
        }
        // The same requests on CUDA keep their tensor-core kernels (the choice is the
        // runtime's, not the request's).
        #[cfg(feature = "cuda")]
        {
            use ferry_kernels::cuda::CudaDevice;
            let fast = AttnKernels {
                precision: Precision::Fast,
                absorbed: AbsorbedKernel::Tile,
            };
            // Fast mode's cache splits the rope part (the shape the forward dispatches with).
            let tuned = mla_shape(&dims, (9, 0), dims.qk_rope_head_dim);
            if tuned.tile_ok() {
                assert_eq!(
                    absorbed::<CudaDevice>(fast, &tuned),
                    AbsorbedPlan::TilePadded
                );
            }
            assert_ne!(
                mha::<CudaDevice>(Precision::Fast, &tuned, (9, 0)),
                MhaKernel::F32
            );
        }
    }
}

#[test]
fn hiprtc_compiles_every_source_with_the_rocm_arms_defines() {
    let mut compiled: Vec<(Source, Defines, Vec<u8>)> = Vec::new();
    for (model, dims) in [("embedded", embedded_dims()), ("DeepSeek-V3", DEEPSEEK_V3)] {
        // Fast mode's split cache (exact mode's kernels are in the same module).
        let shape = mla_shape(&dims, NOT_CUDA, dims.qk_rope_head_dim);
        for k in every_request() {
            for op in forward_kernels::<RocmDevice>(k, &shape, NOT_CUDA) {
                let defines = match op.source {
                    Source::Mla => shape.defines(),
                    _ => Defines::new(),
                };
                let at = match compiled
                    .iter()
                    .position(|(s, d, _)| *s == op.source && *d == defines)
                {
                    Some(i) => i,
                    None => {
                        let code = hiprtc::compile(op.source, &defines, ARCH).unwrap_or_else(|e| {
                            panic!(
                                "{} ({model}) does not compile with hipRTC: {e}",
                                op.source.name()
                            )
                        });
                        assert!(!code.is_empty(), "{} produced no code", op.source.name());
                        compiled.push((op.source, defines, code));
                        compiled.len() - 1
                    }
                };
                let code = &compiled[at].2;
                for name in &op.kernels {
                    assert!(
                        has_symbol(code, name),
                        "{name} ({}, {model}, {k:?}) is not in the {ARCH} code object of {}",
                        op.op,
                        op.source.name()
                    );
                }
            }
        }
    }
    // Every source was compiled: the four sources, mla.cu once per model shape.
    for source in Source::ALL {
        assert!(
            compiled.iter().any(|(s, _, _)| *s == source),
            "{} was never compiled",
            source.name()
        );
    }
    assert_eq!(
        compiled
            .iter()
            .filter(|(s, _, _)| *s == Source::Mla)
            .count(),
        2
    );
}

#[test]
fn the_tensor_core_kernels_are_absent_from_the_hip_code_object() {
    // hipRTC defines FERRY_MMA 0: the flash / wgmma / warp-specialised kernels are not compiled
    // at all (their launchers could only fail to find them), while the tile kernels compile
    // their scalar path (unused on ROCm: at DeepSeek-V3's shape their default two-stage
    // layout needs more than the 64 KiB of LDS a workgroup has).
    let v3 = mla_shape(&DEEPSEEK_V3, NOT_CUDA, 0);
    let code = hiprtc::compile(Source::Mla, &v3.defines(), ARCH).expect("mla.cu compiles");
    for absent in [
        "mha_flash_bf16",
        "mha_wgmma_bf16",
        "mha_ws_bf16",
        "mla_tile_ws_bf16",
        "mla_packed_ws2_bf16",
        "mla_packed_ws4_bf16",
    ] {
        assert!(!has_symbol(&code, absent), "{absent} compiled for {ARCH}");
    }
    for present in [
        "mla_generic_f32",
        "mla_generic_bf16",
        "mla_combine",
        "mha_f32",
        "mla_tile_bf16",
    ] {
        assert!(has_symbol(&code, present), "{present} missing for {ARCH}");
    }
    assert!(
        !has_symbol(&code, "no_such_kernel"),
        "the symbol search finds only symbols"
    );
    assert!(v3.tile_smem() > 64 * 1024, "{}", v3.tile_smem());
}

#[test]
fn probing_without_an_amd_gpu_is_an_error_not_a_panic() {
    match probe(0) {
        Ok(()) => eprintln!("an AMD GPU is present"),
        Err(e) => eprintln!("rocm:0 unavailable as expected here: {e}"),
    }
    assert!(Device::Rocm(usize::MAX).probe().is_err());
    assert!(RocmDevice::open(usize::MAX).is_err());
}
