//! The CUDA backend against the CPU reference backend.
//!
//! Runs only where a CUDA device can be opened; elsewhere each test prints why it skipped and
//! passes, so CPU-only CI stays green (the GPU runs happen on the device machine, see
//! docs/gpu.md). `nvrtc_compiles_every_source` needs only `libnvrtc` on the library path.
//!
//! Tolerances (max |Δ| relative to max |reference|):
//! - f32 kernels (GEMV, norms, RoPE, the per-head absorbed kernel, f32 MHA): 1e-5..1e-4 —
//!   different summation order only.
//! - split-bf16 cuBLAS GEMM against bf16 weights: 1e-4 (activations keep ~16 mantissa bits).
//! - tensor-core kernels (absorbed tile / packed, flash MHA) on bf16 inputs, compared with the
//!   CPU run on the same bf16-rounded inputs: 1.5e-2 — the kernels round the softmax
//!   probabilities to bf16 (2⁻⁹ relative) before P·V, as every bf16 attention kernel does.
#![cfg(feature = "cuda")]

mod common;

use ferry_kernels::cpu::gemm::{linear, Matrix};
use ferry_kernels::cpu::mla::{mla_absorbed_reference, LatentContext, LatentPages, SeqAttn};
use ferry_kernels::cpu::moe::{MoeRouting, RouteScoring};
use ferry_kernels::cpu::norm::rms_norm;
use ferry_kernels::cpu::rope::{Rope, RopeParams, RopeScaling, RotaryLayout, YarnParams};
use ferry_kernels::cuda::mha_ws::MhaWsConfig;
use ferry_kernels::cuda::mla::{
    mha_prefill, mla_absorbed, mla_absorbed_padded, AbsorbedBatch, AbsorbedKernel, Elems, MhaBatch,
    MhaKernel, MlaShape,
};
use ferry_kernels::cuda::nvrtc::compile_ptx;
use ferry_kernels::cuda::ops::{
    self, bf16_bits, GemmPrecision, GpuExperts, GpuMatrix, MoeArgs, MoeDownRows, MoeMma, NormRows,
    PagesView, PerPairKernels, RopeTables, RouteArgs, RouteKernel, RouteParams, Routes,
};
use ferry_kernels::cuda::{CudaDevice, DeviceBuffer};
use ferry_kernels::gpu::Source;
use half::bf16;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

fn gpu(test: &str) -> Option<CudaDevice> {
    match CudaDevice::open(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipping {test}: {e}");
            None
        }
    }
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    common::max_abs_diff(got, want) / common::max_abs(want).max(1e-30)
}

fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|v| bf16::from_f32(*v).to_f32()).collect()
}

fn bits(x: &[f32]) -> Vec<u16> {
    x.iter().map(|v| bf16::from_f32(*v).to_bits()).collect()
}

const TINY: MlaShape = MlaShape::new(80, 64, 48, 32);
/// The DSpark lease target's attention (12 heads, kv_lora 128, rope 32) on the packed
/// warp-specialised kernel with up to four tiles of a sequence per block, as sm_90 runs it.
const DSPARK_WS: MlaShape = MlaShape::new(160, 128, 96, 64)
    .with_tile_ws(2)
    .with_tile_groups(4);

#[test]
#[ignore = "needs libnvrtc (no GPU): CI runs it with the pip wheel, then ptxas on the PTX (.ci/run)"]
fn nvrtc_compiles_every_source() {
    if !ferry_kernels::cuda::nvrtc::available() {
        eprintln!("skipping nvrtc_compiles_every_source: libnvrtc.so not on the library path");
        return;
    }
    // The two architectures compile on threads of their own (NVRTC is single-threaded per
    // compile; CI's two cores take both at once). A failed assertion fails the test when the
    // scope joins its thread.
    std::thread::scope(|s| {
        for cc in [(9, 0), (8, 0)] {
            s.spawn(move || compiles_every_source_for(cc));
        }
    });
}

/// [`nvrtc_compiles_every_source`] for one compute capability: every source with the model
/// shapes the tests use, and the kernels each PTX must hold.
fn compiles_every_source_for(cc: (i32, i32)) {
    let v3 = MlaShape::DEEPSEEK_V3;
    for shape in [
        v3,
        TINY,
        v3.with_tile(32, 2),
        v3.with_tile(32, 3),
        v3.with_tile(32, 4),
        v3.with_tile8(4),
        v3.with_tile(64, 2),
        v3.with_tile_ws(2),
        v3.with_tile_ws(4),
        // Fast mode's split rows (the RoPE key as a bf16 pair).
        v3.with_split(64),
        v3.with_split(64).with_tile(64, 2),
        v3.with_split(64).with_tile8(4),
        v3.with_split(64).with_tile_ws(2),
        TINY.with_split(16),
        // The DSpark lease target's shape (12 heads, kv_lora 128) as fast mode tunes it.
        MlaShape::new(160, 128, 96, 64)
            .with_split(32)
            .with_tile_ws(2)
            .with_tile_groups(4),
    ] {
        let ptx = compile_ptx(Source::Mla, &shape.defines(), cc).expect("mla.cu compiles");
        for k in [
            "mla_tile_bf16",
            "mla_packed_bf16",
            "mla_generic_f32",
            "mha_flash_bf16",
        ] {
            assert!(ptx.contains(k), "{k} missing for sm_{}{}", cc.0, cc.1);
        }
        assert!(ptx.contains("mma.sync"), "tensor-core path compiled");
        if shape.tile_warps == 8 {
            assert!(ptx.contains("mla_tile8_bf16") && ptx.contains("mla_packed8_bf16"));
        }
        // The bulk-copy tile kernel exists for sm_90 only (where the shape allows it).
        let ws =
            cc == (9, 0) && shape.krow() % 32 == 0 && shape.split % 32 == 0 && shape.tile_bk == 32;
        assert_eq!(ptx.contains("mla_tile_ws_bf16"), ws);
        for k in [
            "mla_packed_ws_bf16",
            "mla_packed_ws2_bf16",
            "mla_packed_ws3_bf16",
            "mla_packed_ws4_bf16",
        ] {
            assert_eq!(ptx.contains(k), ws, "{k}");
        }
        // Hopper (compiled as sm_90a) gets the warpgroup-MMA prefill kernel, others not.
        let hopper = cc == (9, 0) && shape.wgmma_ok();
        assert_eq!(
            ptx.contains("wgmma.mma_async"),
            hopper,
            "sm_{}{}",
            cc.0,
            cc.1
        );
        assert_eq!(ptx.contains("mha_wgmma_bf16"), hopper);
        assert_eq!(
            ptx.contains("mha_ws_bf16"),
            hopper && MhaWsConfig::shape_ok(shape)
        );
        if let Ok(dir) = std::env::var("FERRY_PTX_DIR") {
            let f = format!(
                "{dir}/mla_{}s{}_w{}_bk{}x{}_sm{}{}.ptx",
                shape.latent,
                shape.split,
                shape.tile_warps,
                shape.tile_bk,
                shape.tile_stages,
                cc.0,
                cc.1
            );
            std::fs::write(f, &ptx).expect("write ptx");
        }
    }
    if cc == (9, 0) {
        // Every warp-specialised tiling the benchmarks sweep (ptxas checks them in CI).
        let v3 = MlaShape::DEEPSEEK_V3;
        let d = MhaWsConfig::default();
        for (i, c) in [
            d,
            MhaWsConfig {
                pingpong: false,
                ..d
            },
            MhaWsConfig { pv_cols: 64, ..d },
            MhaWsConfig {
                keys: 96,
                overlap: true,
                ..d
            },
            MhaWsConfig {
                keys: 64,
                overlap: true,
                stages: 3,
                ..d
            },
        ]
        .into_iter()
        .enumerate()
        {
            assert!(c.valid(v3), "{c:?}");
            let ptx = compile_ptx(Source::Mla, &c.defines(v3.defines()), cc)
                .unwrap_or_else(|e| panic!("{c:?}: {e}"));
            assert!(ptx.contains("mha_ws_bf16"), "{c:?}");
            if let Ok(dir) = std::env::var("FERRY_PTX_DIR") {
                std::fs::write(format!("{dir}/mla_ws{i}_sm90.ptx"), &ptx).expect("write ptx");
            }
        }
    }
    let ptx = compile_ptx(Source::Common, &Default::default(), cc).expect("common.cu compiles");
    assert!(ptx.contains("moe_route") && ptx.contains("gemv_bf16"));
    for k in [
        "moe_route_w2",
        "moe_route_w8",
        "moe_down8_bf16",
        "moe_down16_f32",
    ] {
        assert!(ptx.contains(k), "{k} missing for sm_{}{}", cc.0, cc.1);
    }
    // The portable GEMM (ROCm's large GEMM) compiles for CUDA too: its contract test runs
    // here (`gemm_tiled_matches_cpu`).
    assert!(ptx.contains("gemm_tiled_f32") && ptx.contains("gemm_tiled_bf16"));
    if let Ok(dir) = std::env::var("FERRY_PTX_DIR") {
        std::fs::write(format!("{dir}/common_sm{}{}.ptx", cc.0, cc.1), &ptx).expect("write");
    }
    // The sources compiled without model-shape defines: sampling and the drafter's ops.
    for source in [Source::Sample, Source::Draft] {
        let ptx = compile_ptx(source, &Default::default(), cc)
            .unwrap_or_else(|e| panic!("{} does not compile: {e}", source.name()));
        if source == Source::Draft {
            let mut names = vec![
                "draft_scatter_f32".to_string(),
                "draft_scatter_bf16".into(),
                "draft_attn_combine".into(),
                "draft_concat".into(),
                "draft_confidence".into(),
                "draft_markov_f32".into(),
                "draft_markov_bf16".into(),
            ];
            for kv in ["f32", "bf16"] {
                for q in [4, 8, 16] {
                    for d in [32, 64, 128] {
                        names.push(format!("draft_attn_{kv}_q{q}_d{d}"));
                    }
                }
            }
            for k in names {
                assert!(ptx.contains(&k), "{k} missing for sm_{}{}", cc.0, cc.1);
            }
        }
        if source == Source::Sample {
            for k in [
                "sample_probs",
                "sample_argmax",
                "sample_argmax_part",
                "sample_argmax_merge",
                "sample_softmax_max",
                "sample_softmax_exp",
                "sample_softmax_norm",
                "sample_probs_finish",
                "sample_draw",
                "sample_draw_part",
                "sample_draw_pick",
                "spec_verify_accept",
                "spec_verify_part",
                "spec_verify_pick",
                "spec_verify",
            ] {
                assert!(ptx.contains(k), "{k} missing for sm_{}{}", cc.0, cc.1);
            }
        }
        if let Ok(dir) = std::env::var("FERRY_PTX_DIR") {
            let stem = source.name().trim_end_matches(".cu");
            std::fs::write(format!("{dir}/{stem}_sm{}{}.ptx", cc.0, cc.1), &ptx).expect("write");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn linear_matches_cpu() {
    let Some(dev) = gpu("linear_matches_cpu") else {
        return;
    };
    let mut rng = common::rng(1);
    // k = 100 takes the GEMV's scalar path (rows not a whole number of 16-byte loads).
    for (n, k) in [(96, 256), (130, 1000), (512, 2048), (40, 100)] {
        let wf = common::uniform(&mut rng, n * k, 0.05);
        let wb = common::uniform_bf16(&mut rng, n * k, 0.05);
        for w in [
            Matrix::from_f32(n, k, wf.clone()).expect("len"),
            Matrix::from_bf16(n, k, wb.clone()).expect("len"),
        ] {
            let gw = GpuMatrix::upload(&dev, &w).expect("upload");
            for m in [1, 3, 8, 9, 64] {
                let x = common::uniform(&mut rng, m * k, 1.0);
                let mut want = vec![0.0f32; m * n];
                linear(&x, &w, &mut want).expect("cpu");
                let gx = dev.upload(&x).expect("up");
                let go = dev.zeros::<f32>(m * n).expect("out");
                ops::linear(&dev, gx.v(), &gw, go.v(), GemmPrecision::Exact).expect("gpu");
                let got = dev.download(&go).expect("down");
                let e = rel_err(&got, &want);
                assert!(
                    e < 1e-4,
                    "linear m={m} n={n} k={k} bf16={}: rel err {e}",
                    gw.is_bf16()
                );
            }
        }
    }
}

/// The portable tiled GEMM (`gemm_tiled_{f32,bf16}`: ROCm's GEMM above 8 rows, which no AMD
/// GPU has run) on this CUDA device against the CPU's `linear`: f32 and bf16 weights, row
/// counts from 1 to past two 64-row tiles, widths that are not multiples of the 64 × 64 tile
/// or the 16-deep k step, and the accumulate flag. f32 activations and f32 accumulation in
/// order of k: 1e-5 of max |reference| (summation order only).
#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn gemm_tiled_matches_cpu() {
    let Some(dev) = gpu("gemm_tiled_matches_cpu") else {
        return;
    };
    let mut rng = common::rng(41);
    for (n, k) in [(96, 256), (130, 1000), (40, 100), (7, 33)] {
        let wf = common::uniform(&mut rng, n * k, 0.05);
        let wb = common::uniform_bf16(&mut rng, n * k, 0.05);
        for w in [
            Matrix::from_f32(n, k, wf.clone()).expect("len"),
            Matrix::from_bf16(n, k, wb.clone()).expect("len"),
        ] {
            let gw = GpuMatrix::upload(&dev, &w).expect("upload");
            for m in [1, 9, 64, 65, 130] {
                let x = common::uniform(&mut rng, m * k, 1.0);
                let mut want = vec![0.0f32; m * n];
                linear(&x, &w, &mut want).expect("cpu");
                let gx = dev.upload(&x).expect("up");
                let go = dev.zeros::<f32>(m * n).expect("out");
                ops::gemm_tiled(&dev, gx.v(), &gw, go.v(), false).expect("gemm_tiled");
                let got = dev.download(&go).expect("down");
                let e = rel_err(&got, &want);
                eprintln!(
                    "gemm_tiled m={m} n={n} k={k} bf16={}: rel err {e:.2e}",
                    gw.is_bf16()
                );
                assert!(
                    e < 1e-5,
                    "gemm_tiled m={m} n={n} k={k} bf16={}: rel err {e}",
                    gw.is_bf16()
                );
                // Accumulate: out = base + x · Wᵀ.
                let base = common::uniform(&mut rng, m * n, 1.0);
                let go = dev.upload(&base).expect("base");
                ops::gemm_tiled(&dev, gx.v(), &gw, go.v(), true).expect("accumulate");
                let got = dev.download(&go).expect("down");
                let want_acc: Vec<f32> = want.iter().zip(&base).map(|(a, b)| a + b).collect();
                let e = rel_err(&got, &want_acc);
                assert!(e < 1e-5, "accumulating gemm_tiled m={m}: rel err {e}");
            }
        }
    }
    // Lengths are checked before the launch.
    let gw = GpuMatrix::upload(&dev, &Matrix::from_f32(4, 8, vec![0.0; 32]).expect("w"))
        .expect("upload");
    let gx = dev.zeros::<f32>(9 * 8).expect("x");
    let short = dev.zeros::<f32>(9 * 4 - 1).expect("out");
    let e = ops::gemm_tiled(&dev, gx.v(), &gw, short.v(), false)
        .expect_err("short out")
        .to_string();
    assert!(e.contains("gemm_tiled") && e.contains("`out`"), "{e}");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn norm_rope_and_latent_write_match_cpu() {
    let Some(dev) = gpu("norm_rope_and_latent_write_match_cpu") else {
        return;
    };
    let mut rng = common::rng(2);
    let (t, width) = (5, 2048);
    let x = common::uniform(&mut rng, t * width, 2.0);
    let w = common::uniform(&mut rng, width, 1.0);
    let mut want = vec![0.0; t * width];
    rms_norm(&x, &w, 1e-6, &mut want).expect("cpu");
    let (gh, gw, go) = (
        dev.upload(&x).expect("up"),
        dev.upload(&w).expect("up"),
        dev.zeros::<f32>(t * width).expect("z"),
    );
    let p = NormRows {
        h: gh.v(),
        delta: None,
        weight: gw.v(),
        out: Some(go.v()),
        width,
    };
    ops::add_rms_norm(&dev, p, 1e-6).expect("gpu");
    let e = rel_err(&dev.download(&go).expect("down"), &want);
    assert!(e < 1e-5, "rms_norm rel err {e}");

    let rope = Rope::new(&RopeParams {
        dim: 64,
        theta: 10000.0,
        scaling: RopeScaling::Yarn(YarnParams {
            factor: 40.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: Some(1.0),
            mscale_all_dim: Some(1.0),
            attention_factor: None,
            truncate: true,
        }),
        interleaved: true,
    })
    .expect("rope");
    let positions = [0usize, 1, 17, 4095, 100_000];
    let layout = RotaryLayout {
        heads: 3,
        head_stride: 192,
        offset: 128,
    };
    let mut q = common::uniform(&mut rng, t * 3 * 192, 1.0);
    let gq = dev.upload(&q).expect("up");
    rope.apply(&mut q, &positions, layout).expect("cpu rope");
    let tables = RopeTables::new(&dev, &rope, &positions).expect("tables");
    ops::rope(&dev, gq.v(), &tables, layout).expect("gpu rope");
    let e = rel_err(&dev.download(&gq).expect("down"), &q);
    assert!(e < 1e-5, "rope rel err {e}");
}

/// A pool of `blocks` pages holding several sequences, rows outside every sequence NaN.
struct Pool {
    data: Vec<f32>,
    tables: Vec<Vec<u32>>,
    page: usize,
    width: usize,
}

impl Pool {
    fn new(rng: &mut ChaCha8Rng, width: usize, page: usize, ctx: &[usize]) -> Self {
        let need: usize = ctx.iter().map(|c| c.div_ceil(page)).sum();
        let blocks = 2 * need + 3;
        let mut ids: Vec<u32> = (0..blocks as u32).collect();
        ids.shuffle(rng);
        let mut data = vec![f32::NAN; blocks * page * width];
        let mut tables = Vec::new();
        let mut next = 0;
        for &c in ctx {
            let t: Vec<u32> = ids[next..next + c.div_ceil(page)].to_vec();
            next += t.len();
            for p in 0..c {
                let row = t[p / page] as usize * page + p % page;
                let vals = round_bf16(&common::uniform(rng, width, 1.0));
                data[row * width..(row + 1) * width].copy_from_slice(&vals);
            }
            tables.push(t);
        }
        Self {
            data,
            tables,
            page,
            width,
        }
    }

    fn view(&self, ptr: u64, bf16: bool) -> PagesView {
        PagesView {
            ptr,
            bf16,
            num_blocks: self.data.len() / (self.page * self.width),
            page_size: self.page,
            width: self.width,
            split: 0,
        }
    }

    /// Block tables padded to one stride, as i32.
    fn flat_tables(&self) -> (Vec<i32>, usize) {
        let stride = self.tables.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let mut flat = vec![0i32; stride * self.tables.len()];
        for (i, t) in self.tables.iter().enumerate() {
            for (j, &b) in t.iter().enumerate() {
                flat[i * stride + j] = b as i32;
            }
        }
        (flat, stride)
    }
}

struct AbsorbedCase {
    shape: MlaShape,
    heads: usize,
    sq: usize,
    ctx: Vec<usize>,
    page: usize,
}

/// CPU reference output `[B·sq·H][kv_lora]` of the absorbed form for q (bf16-rounded).
fn absorbed_reference(pool: &Pool, case: &AbsorbedCase, q: &[f32], scale: f32) -> Vec<f32> {
    let (h, sq, dv, w) = (case.heads, case.sq, case.shape.kv_lora, case.shape.latent);
    let mut out = vec![0.0f32; case.ctx.len() * sq * h * dv];
    for (b, &c) in case.ctx.iter().enumerate() {
        let ctx = LatentContext {
            pages: LatentPages {
                data: &pool.data,
                page_size: pool.page,
                width: w,
            },
            seq: SeqAttn {
                block_table: &pool.tables[b],
                start_pos: c - sq,
                num_queries: sq,
            },
            scale,
        };
        let rows = sq * h;
        mla_absorbed_reference(
            &q[b * rows * w..(b + 1) * rows * w],
            h,
            &ctx,
            &mut out[b * rows * dv..(b + 1) * rows * dv],
        )
        .expect("cpu absorbed");
    }
    out
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn absorbed_kernels_match_cpu() {
    let Some(dev) = gpu("absorbed_kernels_match_cpu") else {
        return;
    };
    let mut rng = common::rng(3);
    let v3 = MlaShape::DEEPSEEK_V3;
    let cases = [
        AbsorbedCase {
            shape: v3,
            heads: 16,
            sq: 1,
            ctx: vec![1, 70, 3000],
            page: 64,
        },
        AbsorbedCase {
            shape: v3.with_tile(32, 2).with_l2_prefetch(4),
            heads: 16,
            sq: 1,
            ctx: vec![1, 70, 3000],
            page: 64,
        },
        AbsorbedCase {
            shape: v3.with_tile8(4),
            heads: 16,
            sq: 1,
            ctx: vec![1, 70, 3000],
            page: 64,
        },
        AbsorbedCase {
            shape: v3.with_tile8(3),
            heads: 12,
            sq: 3,
            ctx: vec![9, 1300],
            page: 16,
        },
        AbsorbedCase {
            shape: v3.with_tile_ws(2),
            heads: 16,
            sq: 1,
            ctx: vec![1, 70, 3000],
            page: 64,
        },
        // Verify steps: a sequence's rows span several tiles, grouped into blocks that read
        // its keys once — 5 tiles in groups of 2 (the last block's second group has no rows),
        // 4 tiles in one group of 4, 3 in one of 3 (at the family's 512 columns too), 6 in two
        // of 3, 1 ungrouped; short and split contexts, causal limits inside the step.
        AbsorbedCase {
            shape: v3.with_tile_ws(2).with_tile_groups(2),
            heads: 16,
            sq: 5,
            ctx: vec![9, 1300, 3000],
            page: 64,
        },
        AbsorbedCase {
            shape: v3.with_tile_ws(2).with_tile_groups(3),
            heads: 12,
            sq: 4,
            ctx: vec![5, 1300, 2900],
            page: 64,
        },
        AbsorbedCase {
            shape: DSPARK_WS,
            heads: 12,
            sq: 5,
            ctx: vec![6, 700, 2100],
            page: 16,
        },
        AbsorbedCase {
            shape: DSPARK_WS,
            heads: 12,
            sq: 3,
            ctx: vec![3, 1025],
            page: 16,
        },
        AbsorbedCase {
            shape: DSPARK_WS,
            heads: 12,
            sq: 7,
            ctx: vec![8, 700, 2100, 64],
            page: 16,
        },
        AbsorbedCase {
            shape: DSPARK_WS,
            heads: 12,
            sq: 1,
            ctx: vec![1, 700],
            page: 16,
        },
        AbsorbedCase {
            shape: v3.with_tile_ws(3),
            heads: 12,
            sq: 3,
            ctx: vec![9, 1300],
            page: 16,
        },
        AbsorbedCase {
            shape: v3.with_tile_ws(4),
            heads: 8,
            sq: 1,
            ctx: vec![2, 5000],
            page: 32,
        },
        AbsorbedCase {
            shape: v3.with_tile(64, 2),
            heads: 16,
            sq: 1,
            ctx: vec![1, 70, 3000],
            page: 64,
        },
        AbsorbedCase {
            shape: v3.with_tile(32, 3),
            heads: 16,
            sq: 1,
            ctx: vec![1, 70, 3000],
            page: 64,
        },
        AbsorbedCase {
            shape: v3.with_tile(32, 2),
            heads: 12,
            sq: 3,
            ctx: vec![9, 1300],
            page: 16,
        },
        AbsorbedCase {
            shape: v3.with_tile(32, 4),
            heads: 8,
            sq: 1,
            ctx: vec![2, 5000],
            page: 32,
        },
        AbsorbedCase {
            shape: MlaShape::DEEPSEEK_V3,
            heads: 12,
            sq: 1,
            ctx: vec![5, 700],
            page: 64,
        },
        AbsorbedCase {
            shape: MlaShape::DEEPSEEK_V3,
            heads: 12,
            sq: 3,
            ctx: vec![9, 1300],
            page: 16,
        },
        AbsorbedCase {
            shape: MlaShape::DEEPSEEK_V3,
            heads: 4,
            sq: 2,
            ctx: vec![40, 129],
            page: 64,
        },
        AbsorbedCase {
            shape: MlaShape::DEEPSEEK_V3,
            heads: 32,
            sq: 1,
            ctx: vec![257],
            page: 32,
        },
        AbsorbedCase {
            shape: TINY,
            heads: 12,
            sq: 2,
            ctx: vec![3, 300],
            page: 8,
        },
    ];
    for case in &cases {
        if case.shape.tile_needs_sm90() && dev.compute_capability() < (9, 0) {
            continue;
        }
        let (h, sq, w, dv) = (case.heads, case.sq, case.shape.latent, case.shape.kv_lora);
        let pool = Pool::new(&mut rng, w, case.page, &case.ctx);
        let rows = case.ctx.len() * sq * h;
        let q = round_bf16(&common::uniform(&mut rng, rows * w, 1.0));
        let scale = 0.1352;
        let want = absorbed_reference(&pool, case, &q, scale);
        let (flat, stride) = pool.flat_tables();
        let g_pages_bf = dev.upload(&bits(&pool.data)).expect("pages");
        let g_pages_f = dev.upload(&pool.data).expect("pages");
        let g_table = dev.upload(&flat).expect("table");
        let ctx_i: Vec<i32> = case.ctx.iter().map(|&c| c as i32).collect();
        let g_ctx = dev.upload(&ctx_i).expect("ctx");
        let g_qb = dev.upload(&bits(&q)).expect("q");
        let g_qf = dev.upload(&q).expect("q");
        let out = dev.zeros::<f32>(rows * dv).expect("out");
        let batch = |q: Elems, bf: bool, ptr: u64| AbsorbedBatch {
            q,
            pages: pool.view(ptr, bf),
            block_table: g_table.v(),
            bt_stride: stride,
            ctx_len: g_ctx.v(),
            max_ctx: *case.ctx.iter().max().expect("non-empty"),
            batch: case.ctx.len(),
            sq,
            heads: h,
            scale,
        };
        let bf = batch(Elems::Bf16(g_qb.v()), true, g_pages_bf.ptr());
        let ff = batch(Elems::F32(g_qf.v()), false, g_pages_f.ptr());
        let runs: Vec<(&str, AbsorbedBatch, f32)> = vec![
            ("padded", bf, 1.5e-2),
            ("packed", bf, 1.5e-2),
            ("generic-bf16", bf, 1e-4),
            ("generic-f32", ff, 1e-4),
        ];
        for (name, b, tol) in runs {
            dev.memset_zero(&out).expect("zero");
            match name {
                "padded" => mla_absorbed_padded(&dev, case.shape, &b, out.v()),
                "packed" => mla_absorbed(&dev, case.shape, AbsorbedKernel::Packed, &b, out.v()),
                _ => mla_absorbed(&dev, case.shape, AbsorbedKernel::Generic, &b, out.v()),
            }
            .unwrap_or_else(|e| panic!("{name}: {e}"));
            let got = dev.download(&out).expect("down");
            let e = rel_err(&got, &want);
            eprintln!(
                "absorbed {name} H={h} sq={sq} ctx={:?} dims={} tile {}w {}x{} g{}: rel err {e:.2e}",
                case.ctx,
                w,
                case.shape.tile_warps,
                case.shape.tile_bk,
                case.shape.tile_stages,
                case.shape.tile_groups
            );
            assert!(
                e < tol,
                "absorbed {name} H={h} sq={sq} ctx={:?}: rel err {e}",
                case.ctx
            );
        }
    }
}

/// Rows of `w` f32 as split bf16 rows (`gpu/mla.cu`'s top comment): every element rounded,
/// then the last `split` again as `bf16(x − hi)` (`[lat | hi | lo]`), or for queries
/// (`query`) the hi part twice before the lo part (`[lat | hi | hi | lo]`).
fn split_rows(x: &[f32], w: usize, split: usize, query: bool) -> Vec<u16> {
    let mut out = Vec::new();
    for row in x.chunks_exact(w) {
        out.extend(bits(row));
        if query {
            out.extend(bits(&row[w - split..]));
        }
        out.extend(row[w - split..].iter().map(|&v| {
            let hi = bf16::from_f32(v).to_f32();
            bf16::from_f32(v - hi).to_bits()
        }));
    }
    out
}

/// Fast mode's split rows (the RoPE key and query as bf16 pairs) against an f32 reference whose
/// RoPE parts are *not* bf16 values and large, so their rounding moves attention: the split
/// kernels stay within their bf16-latent tolerance, and plain bf16 rows of the same data are
/// at least 10× further off (the negative control).
#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn split_rows_keep_the_rope_part_precise() {
    let Some(dev) = gpu("split_rows_keep_the_rope_part_precise") else {
        return;
    };
    let mut rng = common::rng(11);
    let v3 = MlaShape::DEEPSEEK_V3;
    let case = |shape: MlaShape, heads, sq, ctx: Vec<usize>, page| AbsorbedCase {
        shape,
        heads,
        sq,
        ctx,
        page,
    };
    // (case, rope): the shapes' tilings kept, rows split.
    let cases = [
        (case(v3, 16, 1, vec![1, 70, 3000], 64), 64),
        (case(v3.with_tile(64, 2), 12, 3, vec![9, 1300], 16), 64),
        (case(v3.with_tile(32, 2), 16, 1, vec![1, 70, 3000], 64), 64),
        (case(v3.with_tile8(4), 16, 1, vec![1, 70, 3000], 64), 64),
        (case(v3.with_tile_ws(2), 12, 3, vec![9, 1300], 16), 64),
        (case(v3.with_tile_ws(3), 16, 1, vec![2, 5000], 32), 64),
        (case(DSPARK_WS, 12, 5, vec![6, 700, 2100], 16), 32),
        (case(TINY, 12, 2, vec![3, 300], 8), 16),
        // A whole prompt's prefill in the absorbed form (every query of it in one launch).
        (case(TINY, 12, 211, vec![211], 16), 16),
        (case(v3, 12, 100, vec![100, 300], 64), 64),
    ];
    for (case, rope) in &cases {
        let shape = MlaShape {
            split: *rope,
            ..case.shape
        };
        if shape.tile_needs_sm90() && dev.compute_capability() < (9, 0) {
            continue;
        }
        let (h, sq, w, dv) = (case.heads, case.sq, shape.latent, shape.kv_lora);
        let mut pool = Pool::new(&mut rng, w, case.page, &case.ctx);
        // Large f32 RoPE parts: the keys' (rows outside every sequence stay NaN) and queries'.
        for row in pool.data.chunks_exact_mut(w) {
            if !row[0].is_nan() {
                row[w - rope..].copy_from_slice(&common::uniform(&mut rng, *rope, 16.0));
            }
        }
        let rows = case.ctx.len() * sq * h;
        let mut q = round_bf16(&common::uniform(&mut rng, rows * w, 1.0));
        for row in q.chunks_exact_mut(w) {
            row[w - rope..].copy_from_slice(&common::uniform(&mut rng, *rope, 16.0));
        }
        let scale = 0.1352;
        let want = absorbed_reference(&pool, case, &q, scale);
        let (flat, stride) = pool.flat_tables();
        let g_split = dev
            .upload(&split_rows(&pool.data, w, *rope, false))
            .expect("pages");
        let g_plain = dev.upload(&bits(&pool.data)).expect("pages");
        let g_table = dev.upload(&flat).expect("table");
        let ctx_i: Vec<i32> = case.ctx.iter().map(|&c| c as i32).collect();
        let g_ctx = dev.upload(&ctx_i).expect("ctx");
        let g_qs = dev.upload(&split_rows(&q, w, *rope, true)).expect("q");
        let g_qp = dev.upload(&bits(&q)).expect("q");
        let out = dev.zeros::<f32>(rows * dv).expect("out");
        let batch = |q: Elems, ptr: u64, split: usize| AbsorbedBatch {
            q,
            pages: PagesView {
                split,
                ..pool.view(ptr, true)
            },
            block_table: g_table.v(),
            bt_stride: stride,
            ctx_len: g_ctx.v(),
            max_ctx: *case.ctx.iter().max().expect("non-empty"),
            batch: case.ctx.len(),
            sq,
            heads: h,
            scale,
        };
        let split = batch(Elems::Bf16(g_qs.v()), g_split.ptr(), *rope);
        let plain = batch(Elems::Bf16(g_qp.v()), g_plain.ptr(), 0);
        let mut runs = vec![("generic", shape, split, 5e-3)];
        let mut worst = 0.0f32;
        if shape.tile_ok() {
            runs.push(("padded", shape, split, 1.5e-2));
            runs.push(("packed", shape, split, 1.5e-2));
        }
        for (name, sh, b, tol) in runs {
            dev.memset_zero(&out).expect("zero");
            match name {
                "padded" => mla_absorbed_padded(&dev, sh, &b, out.v()),
                "packed" => mla_absorbed(&dev, sh, AbsorbedKernel::Packed, &b, out.v()),
                _ => mla_absorbed(&dev, sh, AbsorbedKernel::Generic, &b, out.v()),
            }
            .unwrap_or_else(|e| panic!("{name}: {e}"));
            let e = rel_err(&dev.download(&out).expect("down"), &want);
            eprintln!(
                "split {name} H={h} sq={sq} ctx={:?} dims={w}+{rope} tile {}w {}x{} g{}: rel err {e:.2e}",
                case.ctx, sh.tile_warps, sh.tile_bk, sh.tile_stages, sh.tile_groups
            );
            assert!(
                e < tol,
                "split {name} H={h} ctx={:?}: rel err {e}",
                case.ctx
            );
            worst = worst.max(e);
        }
        // The negative control: plain bf16 rows (the RoPE parts rounded once) on the generic
        // kernel (f32 math) miss the reference by far more than the split tolerance.
        dev.memset_zero(&out).expect("zero");
        mla_absorbed(&dev, case.shape, AbsorbedKernel::Generic, &plain, out.v())
            .expect("plain generic");
        let e = rel_err(&dev.download(&out).expect("down"), &want);
        eprintln!(
            "plain bf16 rows (control) H={h} ctx={:?}: rel err {e:.2e}",
            case.ctx
        );
        assert!(
            e > 10.0 * worst,
            "the control should miss by far more than the split rows' {worst}: rel err {e}"
        );
    }
}

/// Widths of one head: query/key `d`, value `dv`.
#[derive(Clone, Copy)]
struct HeadDims {
    d: usize,
    dv: usize,
}

/// CPU causal attention for one head of one sequence: q [Sq][D], k [Sk][D], v [Sk][Dv].
fn attend(q: &[f32], k: &[f32], v: &[f32], dims: HeadDims, scale: f32) -> Vec<f32> {
    let HeadDims { d, dv } = dims;
    let (sq, sk) = (q.len() / d, k.len() / d);
    let mut out = vec![0.0f32; sq * dv];
    for i in 0..sq {
        let lim = sk - sq + i + 1;
        let s: Vec<f32> = (0..lim)
            .map(|j| (0..d).map(|x| q[i * d + x] * k[j * d + x]).sum::<f32>() * scale)
            .collect();
        let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f32 = e.iter().sum();
        for (j, p) in e.iter().enumerate() {
            for c in 0..dv {
                out[i * dv + c] += p / z * v[j * dv + c];
            }
        }
    }
    out
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn mha_kernels_match_cpu() {
    let Some(dev) = gpu("mha_kernels_match_cpu") else {
        return;
    };
    let mut rng = common::rng(4);
    for (shape, heads) in [
        (MlaShape::DEEPSEEK_V3, 12usize),
        (MlaShape::DEEPSEEK_V3, 16),
        (MlaShape::DEEPSEEK_V3, 3),
        (TINY, 12),
        // Fast mode's split rows: the bf16 kernels see plain rows of qk + 2·rope (320 / 80).
        (MlaShape::DEEPSEEK_V3.with_split(64), 12),
        (TINY.with_split(16), 12),
    ] {
        let (dq, dv) = (shape.mha_qkb(), shape.mha_v);
        // (queries, keys): a fresh prompt, a chunk over a cached prefix, a one-token step.
        let spans = [(200usize, 200usize), (70, 300), (1, 65), (129, 129)];
        let (tq, tk): (usize, usize) = spans.iter().fold((0, 0), |a, s| (a.0 + s.0, a.1 + s.1));
        let q = round_bf16(&common::uniform(&mut rng, tq * heads * dq, 1.0));
        let k = round_bf16(&common::uniform(&mut rng, tk * heads * dq, 1.0));
        let v = round_bf16(&common::uniform(&mut rng, tk * heads * dv, 1.0));
        let scale = 1.0 / (dq as f32).sqrt();
        let mut want = vec![0.0f32; tq * heads * dv];
        let (mut cu_q, mut cu_k, mut q_seq) = (vec![0i32], vec![0i32], Vec::new());
        let (mut q0, mut k0) = (0, 0);
        for (b, &(sq, sk)) in spans.iter().enumerate() {
            for h in 0..heads {
                let pick = |x: &[f32], start: usize, n: usize, d: usize| -> Vec<f32> {
                    (start..start + n)
                        .flat_map(|r| x[(r * heads + h) * d..(r * heads + h + 1) * d].to_vec())
                        .collect()
                };
                let hd = HeadDims { d: dq, dv };
                let o = attend(
                    &pick(&q, q0, sq, dq),
                    &pick(&k, k0, sk, dq),
                    &pick(&v, k0, sk, dv),
                    hd,
                    scale,
                );
                for i in 0..sq {
                    let dst = ((q0 + i) * heads + h) * dv;
                    want[dst..dst + dv].copy_from_slice(&o[i * dv..(i + 1) * dv]);
                }
            }
            q0 += sq;
            k0 += sk;
            cu_q.push(q0 as i32);
            cu_k.push(k0 as i32);
            q_seq.extend(std::iter::repeat_n(b as i32, sq));
        }
        let (gcq, gck, gqs) = (
            dev.upload(&cu_q).expect("up"),
            dev.upload(&cu_k).expect("up"),
            dev.upload(&q_seq).expect("up"),
        );
        let (qf, kf, vf) = (
            dev.upload(&q).expect("q"),
            dev.upload(&k).expect("k"),
            dev.upload(&v).expect("v"),
        );
        let (qb, kb, vb) = (
            dev.upload(&bits(&q)).expect("q"),
            dev.upload(&bits(&k)).expect("k"),
            dev.upload(&bits(&v)).expect("v"),
        );
        let out = dev.zeros::<f32>(tq * heads * dv).expect("out");
        let mk = |q, k, v| MhaBatch {
            q,
            k,
            v,
            cu_q: gcq.v(),
            cu_k: gck.v(),
            q_seq: gqs.v(),
            batch: spans.len(),
            max_q: 200,
            heads,
            scale,
        };
        let bf = || {
            mk(
                Elems::Bf16(qb.v()),
                Elems::Bf16(kb.v()),
                Elems::Bf16(vb.v()),
            )
        };
        // Tolerances: f32 against the f64-free CPU reference is rounding only; the tensor-core
        // kernels round P to bf16 before P·V (relative 2^-8 per weight).
        let mut cases = vec![(MhaKernel::Flash, bf(), 1.5e-2)];
        if shape.split == 0 {
            // The f32 kernel reads logical rows (it never sees split ones).
            cases.push((
                MhaKernel::F32,
                mk(Elems::F32(qf.v()), Elems::F32(kf.v()), Elems::F32(vf.v())),
                1e-4,
            ));
        }
        if dev.compute_capability() == (9, 0) && shape.wgmma_ok() {
            cases.push((MhaKernel::Wgmma, bf(), 1.5e-2));
        }
        if dev.compute_capability() == (9, 0) && MhaWsConfig::shape_ok(shape) {
            cases.push((MhaKernel::WarpSpecialized, bf(), 1.5e-2));
        }
        for (kernel, b, tol) in cases {
            dev.memset_zero(&out).expect("zero");
            mha_prefill(&dev, shape, kernel, &b, out.v()).expect("mha");
            let e = rel_err(&dev.download(&out).expect("down"), &want);
            eprintln!(
                "mha {kernel:?} H={heads} qk={dq} (split {}): rel err {e:.2e}",
                shape.split
            );
            assert!(e < tol, "mha {kernel:?} H={heads}: rel err {e}");
        }
    }
}

/// Both routing kernels match the CPU (ids exactly, weights to 1e-5) and each other bitwise,
/// with random logits and with logits and biases on a coarse grid (many ties: the lower expert
/// or group id wins everywhere). On the grid the sigmoid cases are compared between the kernels
/// only: a group's best two, e.g. σ(1) + σ(-1) against σ(2) + σ(-2), tie to within an ulp there,
/// and the CPU's `exp` and the device's `expf` may round them apart.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn moe_routing_matches_cpu() {
    let Some(dev) = gpu("moe_routing_matches_cpu") else {
        return;
    };
    let mut rng = common::rng(5);
    // DeepSeek-V3's sigmoid routing, then V2's softmax routing (greedy: one group; and
    // group-limited), the V2 cases with `norm_topk_prob` set to show it is ignored there; groups
    // that straddle lanes (200 / 8) and a top-8 of 32.
    let cases = [
        (16, 4, 4, 2, RouteScoring::Sigmoid),
        (64, 6, 1, 1, RouteScoring::Sigmoid),
        (256, 8, 8, 4, RouteScoring::Sigmoid),
        (200, 8, 8, 3, RouteScoring::Sigmoid),
        (64, 6, 1, 1, RouteScoring::Softmax),
        (160, 6, 8, 3, RouteScoring::Softmax),
        (32, 8, 1, 1, RouteScoring::Softmax),
    ];
    for ((e, top_k, n_group, topk_group, scoring), ties) in
        cases.into_iter().flat_map(|c| [(c, false), (c, true)])
    {
        let routing = MoeRouting {
            n_experts: e,
            top_k,
            n_group,
            topk_group,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
            scoring,
        };
        let t = 37;
        let grid = |v: Vec<f32>, step: f32| -> Vec<f32> {
            if ties {
                v.iter().map(|x| (x / step).round() * step).collect()
            } else {
                v
            }
        };
        let logits = grid(common::uniform(&mut rng, t * e, 4.0), 1.0);
        let bias = grid(common::uniform(&mut rng, e, 0.5), 0.25);
        let want = routing.route(&logits, &bias).expect("cpu route");
        let slots = top_k + 2;
        let (gl, gb) = (
            dev.upload(&logits).expect("up"),
            dev.upload(&bias).expect("up"),
        );
        let p = RouteParams {
            n_experts: e as i32,
            top_k: top_k as i32,
            n_group: n_group as i32,
            topk_group: topk_group as i32,
            norm_topk: 1,
            n_shared: 2,
            scale: 2.5,
            softmax: i32::from(scoring == RouteScoring::Softmax),
        };
        let mut runs = Vec::new();
        for kernel in [RouteKernel::Shared, RouteKernel::Registers] {
            let ids = dev.zeros::<i32>(t * slots).expect("ids");
            let wts = dev.zeros::<f32>(t * slots).expect("w");
            let out = Routes {
                ids: ids.v(),
                weights: wts.v(),
                slots,
            };
            let args = RouteArgs {
                logits: gl.v(),
                bias: gb.v(),
                p,
                out,
            };
            ops::moe_route_with(&dev, kernel, args).expect("gpu route");
            let (gi, gw) = (
                dev.download(&ids).expect("d"),
                dev.download(&wts).expect("d"),
            );
            let what = format!("E={e}, {scoring:?}, ties {ties}, {kernel:?}");
            let against_cpu = !ties || scoring == RouteScoring::Softmax;
            for (tok, route) in want.iter().enumerate().filter(|_| against_cpu) {
                for (s, &(ex, w)) in route.iter().enumerate() {
                    assert_eq!(
                        gi[tok * slots + s] as usize,
                        ex,
                        "token {tok} slot {s} ({what})"
                    );
                    assert!(
                        (gw[tok * slots + s] - w).abs() < 1e-5,
                        "weight token {tok} slot {s} ({what})"
                    );
                }
                assert_eq!(gi[tok * slots + top_k], e as i32);
                assert_eq!(gw[tok * slots + top_k + 1], 1.0);
            }
            let wbits: Vec<u32> = gw.iter().map(|w| w.to_bits()).collect();
            runs.push((gi, wbits));
        }
        assert!(
            runs[0] == runs[1],
            "register routing is bitwise the shared-memory kernel's (E={e}, {scoring:?}, ties {ties})"
        );
    }
    let _ = bf16_bits(&[]);
}

/// `n_exp` random experts of `hidden` × `inter` (bf16 or f32) on the device, stacked as the
/// MoE ops take them.
fn random_experts(
    dev: &CudaDevice,
    rng: &mut ChaCha8Rng,
    (hidden, inter, n_exp): (usize, usize, usize),
    bf16: bool,
) -> GpuExperts {
    let mut matrix = |rows: usize, cols: usize| {
        let v = common::uniform(rng, rows * cols, 0.05);
        let m = if bf16 {
            Matrix::from_bf16(rows, cols, v.iter().map(|&x| bf16::from_f32(x)).collect())
        } else {
            Matrix::from_f32(rows, cols, v)
        };
        GpuMatrix::upload(dev, &m.expect("len")).expect("upload")
    };
    GpuExperts {
        gate: matrix(n_exp * inter, hidden),
        up: matrix(n_exp * inter, hidden),
        down: matrix(n_exp * hidden, inter),
        inter,
        hidden,
        shared_ids: None,
        route_done: dev.zeros::<u32>(1).expect("counter"),
    }
}

/// Expert ids of `t` tokens × `slots` slots over `n_exp` experts, spread evenly, or with every
/// other pair on expert 3 (`skewed`): the grouped-kernel tests' batches.
fn grouped_ids(t: usize, slots: usize, n_exp: usize, skewed: bool) -> Vec<i32> {
    (0..t * slots)
        .map(|i| {
            if skewed && i % 2 == 0 {
                3
            } else {
                ((i * 5 + i / slots) % n_exp) as i32
            }
        })
        .collect()
}

/// One MoE op's random inputs for `ids.len() / slots` tokens: activations, the routes' ids and
/// weights on the device, and the residual's starting values on the host.
struct MoeInputs {
    x: DeviceBuffer<f32>,
    ids: DeviceBuffer<i32>,
    w: DeviceBuffer<f32>,
    h0: Vec<f32>,
    slots: usize,
}

impl MoeInputs {
    fn new(
        dev: &CudaDevice,
        rng: &mut ChaCha8Rng,
        hidden: usize,
        slots: usize,
        ids: &[i32],
    ) -> Self {
        let t = ids.len() / slots;
        Self {
            x: dev
                .upload(&common::uniform(rng, t * hidden, 1.0))
                .expect("x"),
            ids: dev.upload(ids).expect("ids"),
            w: dev
                .upload(&common::uniform(rng, t * slots, 1.0))
                .expect("w"),
            h0: common::uniform(rng, t * hidden, 1.0),
            slots,
        }
    }

    /// Runs `op` on a fresh copy of the residual; what it holds afterwards, as bits.
    fn run(
        &self,
        dev: &CudaDevice,
        experts: &GpuExperts,
        op: impl FnOnce(MoeArgs<'_, CudaDevice>),
    ) -> Vec<u32> {
        let h = dev.upload(&self.h0).expect("h");
        let routes = Routes {
            ids: self.ids.v(),
            weights: self.w.v(),
            slots: self.slots,
        };
        op(MoeArgs {
            x: self.x.v(),
            routes,
            experts,
            h: h.v(),
            x_split: None,
        });
        dev.download(&h)
            .expect("h")
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }
}

/// Every per-pair MoE kernel choice (`FERRY_FUSE=0`'s, and `FERRY_MOE_DOWN_R` = 1, 4, 8, 16)
/// adds bitwise the same into `h`: DeepSeek-V2-Lite's widths (5.5 chunks of a 1,408-wide row
/// per lane), nine slots (warp 0 sums two), a hidden width that is not a multiple of 16 (the
/// last block's rows repeat), and an expert width that is not a multiple of 8 (the streaming
/// kernels fall back to four rows per block); bf16 and f32 experts, one and three tokens.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn moe_per_pair_kernels_are_bitwise_equal() {
    let Some(dev) = gpu("moe_per_pair_kernels_are_bitwise_equal") else {
        return;
    };
    let mut rng = common::rng(41);
    for (hidden, inter, n_exp, slots) in [(2048, 1408, 10, 8), (264, 520, 12, 9), (200, 36, 6, 9)] {
        for bf16 in [true, false] {
            let experts = random_experts(&dev, &mut rng, (hidden, inter, n_exp), bf16);
            for t in [1, 3] {
                let ids: Vec<i32> = (0..t * slots)
                    .map(|i| ((i * 7 + t) % n_exp) as i32)
                    .collect();
                let inputs = MoeInputs::new(&dev, &mut rng, hidden, slots, &ids);
                let mut first: Option<Vec<u32>> = None;
                let choices = [
                    (false, MoeDownRows::One),
                    (true, MoeDownRows::One),
                    (true, MoeDownRows::Four),
                    (true, MoeDownRows::Eight),
                    (true, MoeDownRows::Sixteen),
                ];
                for (gate_up_pairs, down) in choices {
                    let which = PerPairKernels {
                        gate_up_pairs,
                        down,
                    };
                    let got = inputs.run(&dev, &experts, |a| {
                        ops::moe_experts_per_pair(&dev, a, which).expect("moe")
                    });
                    match &first {
                        None => first = Some(got),
                        Some(f) => assert!(
                            *f == got,
                            "{which:?}: {hidden}x{inter}, {slots} slots, {t} tokens, bf16 {bf16}"
                        ),
                    }
                }
            }
        }
    }
}

/// Every tensor-core grouped MoE kernel choice (`FERRY_MOE_MMA`: chunks of 16 pairs waited,
/// streamed or prefetched, and chunks of 32 streamed or prefetched) adds bitwise the same into
/// `h`: DeepSeek-V2-Lite's widths, 8 experts, 6 slots; 3 tokens (one partial chunk each), 64
/// and 200 tokens (48 and 150 pairs an expert on average: whole and partial chunks of either
/// size), and a skewed batch where one expert takes half the pairs.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn moe_grouped_kernels_are_bitwise_equal() {
    let Some(dev) = gpu("moe_grouped_kernels_are_bitwise_equal") else {
        return;
    };
    let mut rng = common::rng(43);
    let (hidden, inter, n_exp, slots) = (2048, 1408, 8, 6);
    let experts = random_experts(&dev, &mut rng, (hidden, inter, n_exp), true);
    for (t, skewed) in [(3, false), (64, false), (200, false), (200, true)] {
        let ids = grouped_ids(t, slots, n_exp, skewed);
        let inputs = MoeInputs::new(&dev, &mut rng, hidden, slots, &ids);
        let mut first: Option<Vec<u32>> = None;
        let choices = [
            MoeMma::Wait,
            MoeMma::Stream,
            MoeMma::Prefetch,
            MoeMma::Stream32,
            MoeMma::Prefetch32,
        ];
        for mma in choices {
            let got = inputs.run(&dev, &experts, |a| {
                ops::moe_experts_grouped_mma(&dev, a, mma).expect("moe")
            });
            assert!(
                got.iter().zip(&inputs.h0).any(|(g, h)| *g != h.to_bits()),
                "{mma}: {t} tokens, nothing was added"
            );
            match &first {
                None => first = Some(got),
                Some(f) => assert!(*f == got, "{mma}: {t} tokens, skewed {skewed}"),
            }
        }
    }
}

/// The pipelined grouped GEMM (`MoeMma::Pipe`: cp.async-staged operands, ldmatrix fragments,
/// natural k order) adds into `h` what the register-streamed kernels add, to f32 rounding:
/// DeepSeek-V2-Lite's widths, the token counts and the skewed batch of
/// `moe_grouped_kernels_are_bitwise_equal` plus 256 tokens (one pass with many 32-pair chunks).
/// Tolerance 1e-4 of the largest |Δh| the experts add: both sides multiply the same bf16
/// weights by the same bf16 hi + lo activation parts with f32 accumulation, in another k order
/// (and the pipelined down reads the activations as those parts, where the others split the
/// same f32 values the same way); a pair in the wrong row or a missing k step is O(1).
#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn moe_pipelined_kernels_match_the_grouped_ones() {
    let Some(dev) = gpu("moe_pipelined_kernels_match_the_grouped_ones") else {
        return;
    };
    let mut rng = common::rng(47);
    let (hidden, inter, n_exp, slots) = (2048, 1408, 8, 6);
    let experts = random_experts(&dev, &mut rng, (hidden, inter, n_exp), true);
    assert!(ops::moe_pipe_fits(&experts));
    for (t, skewed) in [
        (3, false),
        (64, false),
        (200, false),
        (200, true),
        (256, false),
    ] {
        let ids = grouped_ids(t, slots, n_exp, skewed);
        let inputs = MoeInputs::new(&dev, &mut rng, hidden, slots, &ids);
        let run = |mma| {
            inputs.run(&dev, &experts, |a| {
                ops::moe_experts_grouped_mma(&dev, a, mma).expect("moe")
            })
        };
        let (want, got) = (run(MoeMma::Prefetch), run(MoeMma::Pipe));
        let added = |bits: &[u32]| -> Vec<f32> {
            bits.iter()
                .zip(&inputs.h0)
                .map(|(b, h)| f32::from_bits(*b) - h)
                .collect()
        };
        let (want, got) = (added(&want), added(&got));
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.1, "{t} tokens: nothing was added ({scale})");
        let worst = want
            .iter()
            .zip(&got)
            .fold(0.0f32, |m, (w, g)| m.max((w - g).abs()));
        assert!(
            worst <= 1e-4 * scale,
            "{t} tokens, skewed {skewed}: max |Δ| {worst} against max |h added| {scale}"
        );
    }
}

/// One split of a MoE layer's input (`moe_input_split`) read by the shared experts' GEMM, the
/// pipelined routed experts and the router's large GEMM gives each bitwise what it gave
/// converting the input itself: 200 tokens of the DSpark lease target's MoE shape (hidden
/// 512, experts 256 wide, 8 routed + 2 shared chunks, top-4), the router in both precisions.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn one_split_of_a_moe_layers_input_is_bitwise_its_three_conversions() {
    let Some(dev) = gpu("one_split_of_a_moe_layers_input_is_bitwise_its_three_conversions") else {
        return;
    };
    let mut rng = common::rng(53);
    let (hidden, inter, routed, n_shared, top_k, t) = (512, 256, 8, 2, 4, 200);
    let experts = random_experts(&dev, &mut rng, (hidden, inter, routed + n_shared), true);
    assert!(ops::moe_pipe_fits(&experts));
    let ids = grouped_ids(t, top_k, routed, false);
    let inputs = MoeInputs::new(&dev, &mut rng, hidden, top_k, &ids);
    let split = ops::moe_input_split(&dev, inputs.x.v(), &experts, n_shared, true)
        .expect("split")
        .expect("a split where the shared experts run as a GEMM");
    let xs = Some(split.v());

    let shared = |x_split| {
        inputs.run(&dev, &experts, |a| {
            let ran = ops::shared_experts_gemm(&dev, (a.x, x_split), a.experts, n_shared, a.h)
                .expect("shared experts");
            assert!(ran, "bf16 experts on cuBLAS");
        })
    };
    let alone = shared(None);
    assert_ne!(
        alone,
        inputs.h0.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "the shared experts added something"
    );
    assert_eq!(shared(xs), alone, "shared experts");

    let routed_experts = |x_split| {
        inputs.run(&dev, &experts, |a| {
            ops::moe_experts(&dev, MoeArgs { x_split, ..a }).expect("routed experts")
        })
    };
    assert_eq!(routed_experts(xs), routed_experts(None), "routed experts");

    let e = 16;
    let router = GpuMatrix::upload(
        &dev,
        &Matrix::from_bf16(
            e,
            hidden,
            common::uniform(&mut rng, e * hidden, 0.05)
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect(),
        )
        .expect("router"),
    )
    .expect("upload");
    let bias = dev.upload(&vec![0.0f32; e]).expect("bias");
    let done = dev.zeros::<u32>(1).expect("counter");
    let p = RouteParams {
        n_experts: e as i32,
        top_k: top_k as i32,
        n_group: 1,
        topk_group: 1,
        norm_topk: 1,
        n_shared: 0,
        scale: 1.0,
        softmax: 0,
    };
    for gemm in [GemmPrecision::Fast, GemmPrecision::Exact] {
        let route = |x_split| -> (Vec<u32>, Vec<i32>) {
            let logits = dev.zeros::<f32>(t * e).expect("logits");
            let ids = dev.zeros::<i32>(t * top_k).expect("ids");
            let w = dev.zeros::<f32>(t * top_k).expect("weights");
            let a = ops::RouterRoute {
                x: inputs.x.v(),
                router: &router,
                bias: bias.v(),
                p,
                logits: logits.v(),
                out: Routes {
                    ids: ids.v(),
                    weights: w.v(),
                    slots: top_k,
                },
                done: done.v(),
                x_split,
            };
            ops::router_and_route(&dev, a, false, gemm).expect("route");
            let logits = dev.download(&logits).expect("logits");
            (
                logits.iter().map(|v| v.to_bits()).collect(),
                dev.download(&ids).expect("ids"),
            )
        };
        let want = route(None);
        assert!(want.0.iter().any(|&b| b != 0), "{gemm:?}: logits written");
        assert_eq!(route(xs), want, "router, {gemm:?}");
    }
}

/// The output un-absorption with the split-K merge folded in (`unabsorb_combine`) is bitwise
/// `mla_combine` then `unabsorb`: random partials of 1–37 splits (one split's rows all masked,
/// −∞, as a split past a short context is), 1, 3 and 11 tokens (more than the 8 rows one pass
/// merges), f32 and bf16 `kv_b`.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn unabsorb_combine_is_bitwise_combine_then_unabsorb() {
    use ferry_kernels::cuda::mla::{mla_combine, SplitParts};
    let Some(dev) = gpu("unabsorb_combine_is_bitwise_combine_then_unabsorb") else {
        return;
    };
    let mut rng = common::rng(41);
    let (heads, nope, rope, v, kv_lora) = (4, 32, 16, 32, 64);
    let shape = MlaShape::new(kv_lora + rope, kv_lora, nope + rope, v);
    let hs = ops::HeadShape {
        heads,
        nope,
        rope,
        v,
        kv_lora,
        split: 0,
    };
    let kv_b_f32 = common::uniform(&mut rng, heads * (nope + v) * kv_lora, 0.3);
    for bf in [false, true] {
        let m = if bf {
            let w = kv_b_f32.iter().map(|&x| bf16::from_f32(x)).collect();
            Matrix::from_bf16(heads * (nope + v), kv_lora, w).expect("kv_b")
        } else {
            Matrix::from_f32(heads * (nope + v), kv_lora, kv_b_f32.clone()).expect("kv_b")
        };
        let kv_b = GpuMatrix::upload(&dev, &m).expect("upload kv_b");
        for (splits, tokens) in [(1, 1), (2, 3), (17, 1), (37, 11)] {
            let rows = tokens * heads;
            let o = common::uniform(&mut rng, splits * rows * kv_lora, 4.0);
            let mut ml = Vec::with_capacity(splits * rows * 2);
            for s in 0..splits {
                for _ in 0..rows {
                    let masked = splits > 1 && s == splits - 1;
                    let m = if masked {
                        f32::NEG_INFINITY
                    } else {
                        common::uniform(&mut rng, 1, 6.0)[0]
                    };
                    let l = if masked {
                        0.0
                    } else {
                        1.0 + common::uniform(&mut rng, 1, 0.9)[0]
                    };
                    ml.extend([m, l]);
                }
            }
            let parts = SplitParts {
                o_part: dev.upload(&o).expect("o"),
                ml_part: dev.upload(&ml).expect("ml"),
                splits,
                rows,
            };
            let o_lat = dev.alloc::<f32>(rows * kv_lora).expect("o_lat");
            let want = dev.alloc::<f32>(tokens * heads * v).expect("want");
            let got = dev.alloc::<f32>(tokens * heads * v).expect("got");
            mla_combine(&dev, shape, &parts, o_lat.v()).expect("combine");
            ops::unabsorb(&dev, o_lat.v(), &kv_b, hs, want.v()).expect("unabsorb");
            ops::unabsorb_combine(&dev, &parts, &kv_b, hs, got.v()).expect("unabsorb_combine");
            let (want, got) = (
                dev.download(&want).expect("want"),
                dev.download(&got).expect("got"),
            );
            assert!(want.iter().all(|x| x.is_finite()), "reference not finite");
            let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                b(&got),
                b(&want),
                "{splits} splits, {tokens} tokens, bf16 kv_b {bf}"
            );
        }
    }
}

/// The batch path of the query absorption and the output un-absorption (per-head tensor-core
/// GEMMs on cuBLAS, `absorb_gemm` / `unabsorb_gemm`) against the CUDA-core kernels, which the
/// CPU parity tests hold to the CPU backend: DeepSeek-V2-Lite's head shape (16 heads, nope 128,
/// rope 64, v 128, kv_lora 512), bf16 `kv_b`, 37 tokens, f32 and split-bf16 query rows.
/// Tolerances, relative to the largest reference value: exact mode splits the activations into
/// bf16 hi + lo (~16 mantissa bits, as exact-mode linears do): 1e-4; fast mode rounds them to
/// bf16 (2^-9 relative per element, errors of random sign over 128–512 terms): 1e-2; bf16
/// output rows add one bf16 ulp (2^-8) for their own rounding. The rope part of the absorbed
/// rows is copied, so it must match bit for bit.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --include-ignored (docs/gpu.md)"]
fn head_gemms_match_the_absorb_kernels() {
    let Some(dev) = gpu("head_gemms_match_the_absorb_kernels") else {
        return;
    };
    let mut rng = common::rng(43);
    let (heads, nope, rope, v, kv_lora, t) = (16, 128, 64, 128, 512, 37);
    let w: Vec<bf16> = common::uniform(&mut rng, heads * (nope + v) * kv_lora, 0.05)
        .iter()
        .map(|&x| bf16::from_f32(x))
        .collect();
    let m = Matrix::from_bf16(heads * (nope + v), kv_lora, w).expect("kv_b");
    let kv_b = GpuMatrix::upload(&dev, &m).expect("upload kv_b");
    let q = dev
        .upload(&common::uniform(&mut rng, t * heads * (nope + rope), 1.0))
        .expect("q");
    let o_lat = dev
        .upload(&common::uniform(&mut rng, t * heads * kv_lora, 1.0))
        .expect("o_lat");
    let worst = |want: &[f32], got: &[f32]| {
        let scale = want.iter().fold(0.0f32, |a, x| a.max(x.abs()));
        let err = want
            .iter()
            .zip(got)
            .fold(0.0f32, |a, (w, g)| a.max((w - g).abs()));
        (err, scale)
    };
    for (precision, tol) in [(GemmPrecision::Exact, 1e-4), (GemmPrecision::Fast, 1e-2)] {
        let hw = |shape| ops::HeadWeights {
            kv_b: &kv_b,
            shape,
            precision,
        };
        for split in [0, rope] {
            let hs = ops::HeadShape {
                heads,
                nope,
                rope,
                v,
                kv_lora,
                split,
            };
            let lw = kv_lora + rope + 2 * split;
            let (want, got) = if split == 0 {
                let a = dev.alloc::<f32>(t * heads * lw).expect("a");
                let b = dev.alloc::<f32>(t * heads * lw).expect("b");
                ops::absorb(&dev, q.v(), &kv_b, hs, ops::AbsorbedOut::F32(a.v())).expect("absorb");
                let ran = ops::absorb_gemm(&dev, q.v(), hw(hs), ops::AbsorbedOut::F32(b.v()))
                    .expect("absorb_gemm");
                assert!(ran, "CUDA has the tensor-core path");
                (dev.download(&a).expect("a"), dev.download(&b).expect("b"))
            } else {
                let a = dev.alloc::<u16>(t * heads * lw).expect("a");
                let b = dev.alloc::<u16>(t * heads * lw).expect("b");
                ops::absorb(&dev, q.v(), &kv_b, hs, ops::AbsorbedOut::Bf16(a.v())).expect("absorb");
                let ran = ops::absorb_gemm(&dev, q.v(), hw(hs), ops::AbsorbedOut::Bf16(b.v()))
                    .expect("absorb_gemm");
                assert!(ran, "CUDA has the tensor-core path");
                let widen = |v: Vec<u16>| {
                    v.into_iter()
                        .map(|x| bf16::from_bits(x).to_f32())
                        .collect::<Vec<_>>()
                };
                (
                    widen(dev.download(&a).expect("a")),
                    widen(dev.download(&b).expect("b")),
                )
            };
            let (lat_want, lat_got): (Vec<f32>, Vec<f32>) = want
                .chunks(lw)
                .zip(got.chunks(lw))
                .flat_map(|(a, b)| {
                    a[..kv_lora]
                        .iter()
                        .copied()
                        .zip(b[..kv_lora].iter().copied())
                })
                .unzip();
            // bf16 rows: both sides then round to bf16, and a difference far below the
            // tolerance can still land on the neighbouring bf16 value (one ulp, 2^-8 relative).
            let tol = if split == 0 { tol } else { tol + 1.0 / 256.0 };
            let (err, scale) = worst(&lat_want, &lat_got);
            assert!(
                err <= tol * scale,
                "absorb {precision:?} split {split}: max error {err} > {tol} × {scale}"
            );
            for (a, b) in want.chunks(lw).zip(got.chunks(lw)) {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&a[kv_lora..]),
                    bits(&b[kv_lora..]),
                    "rope part, split {split}"
                );
            }
        }
        let hs = ops::HeadShape {
            heads,
            nope,
            rope,
            v,
            kv_lora,
            split: 0,
        };
        let a = dev.alloc::<f32>(t * heads * v).expect("a");
        let b = dev.alloc::<f32>(t * heads * v).expect("b");
        ops::unabsorb(&dev, o_lat.v(), &kv_b, hs, a.v()).expect("unabsorb");
        let ran = ops::unabsorb_gemm(&dev, o_lat.v(), hw(hs), b.v()).expect("unabsorb_gemm");
        assert!(ran, "CUDA has the tensor-core path");
        let (want, got) = (dev.download(&a).expect("a"), dev.download(&b).expect("b"));
        let (err, scale) = worst(&want, &got);
        assert!(
            err <= tol * scale,
            "unabsorb {precision:?}: max error {err} > {tol} × {scale}"
        );
    }
}

/// Staged writes (`CudaDevice::write_staged`, what small writes take unless `FERRY_ASYNC_WRITES=0`)
/// land in stream order: three times as many writes as there are staging slots, each of its
/// own pattern into the same small buffer and each followed by a device copy of that buffer
/// into its own place, leave every pattern in its place — so no write overtook the copy
/// queued before it, and no slot was refilled while its last copy had yet to read it. A write
/// larger than a slot lands whole from consecutive slots; one past `MAX_STAGED_BYTES` is
/// refused with the limit named.
#[test]
fn staged_writes_land_in_stream_order() {
    use ferry_kernels::cuda::upload::{MAX_STAGED_BYTES, SLOTS, SLOT_BYTES};
    let Some(dev) = gpu("staged_writes_land_in_stream_order") else {
        return;
    };
    let n = SLOT_BYTES / 4;
    let rounds = 3 * SLOTS + 5;
    let mut src = dev.alloc::<i32>(n).expect("src");
    let mut out = dev.alloc::<i32>(n * rounds).expect("out");
    for r in 0..rounds {
        let pattern: Vec<i32> = (0..n).map(|i| (r * n + i) as i32).collect();
        dev.write_staged(&mut src, 0, &pattern)
            .expect("staged write");
        dev.copy_range((&src, 0), (&mut out, r * n), n)
            .expect("device copy");
    }
    let got = dev.download(&out).expect("download");
    let bad = got
        .iter()
        .enumerate()
        .find(|&(i, &v)| v != i as i32)
        .map(|(i, _)| i / n);
    assert_eq!(bad, None, "the first place holding another round's pattern");
    // Past a slot: consecutive slots, each piece at its own offset, the last one partial,
    // written at an offset into the buffer; a write past the bound is refused.
    let m = 3 * n + 7;
    let mut big = dev.zeros::<i32>(m + 5).expect("big");
    let pattern: Vec<i32> = (0..m as i32).map(|i| i.wrapping_mul(7919)).collect();
    dev.write_staged(&mut big, 5, &pattern)
        .expect("staged write of several slots");
    let got = dev.download(&big).expect("download");
    assert_eq!(&got[..5], &[0; 5]);
    assert!(got[5..] == pattern[..], "a multi-slot write landed wrong");
    let too_big = MAX_STAGED_BYTES / 4 + 1;
    let mut huge = dev.alloc::<i32>(too_big).expect("huge");
    let err = dev
        .write_staged(&mut huge, 0, &vec![0i32; too_big])
        .expect_err("larger than the staged bound");
    assert!(
        err.to_string().contains(&MAX_STAGED_BYTES.to_string()),
        "{err}"
    );
}

/// A graph's buffers come from its arena (unless `FERRY_GRAPH_ARENA=0`): the captured graph
/// holds no memory nodes, the arena grows past its first chunk, a freed range is taken again,
/// and replays move the right bytes through it, also after the capture's buffers were dropped.
#[test]
fn a_graph_s_buffers_come_from_its_arena() {
    use ferry_kernels::cuda::{graph_arena_switch, ARENA_FIRST};
    let Some(dev) = gpu("a_graph_s_buffers_come_from_its_arena") else {
        return;
    };
    // Three buffers of 3/4 of the first chunk each: the arena must grow twice.
    let n = ARENA_FIRST * 3 / 4 / 4;
    let host: Vec<i32> = (0..n as i32).map(|i| i.wrapping_mul(7919)).collect();
    let mut src = dev.upload(&host).expect("src");
    let mut out = dev.zeros::<i32>(n).expect("out");
    dev.synchronize().expect("sync");
    dev.begin_capture().expect("begin capture");
    let mut a = dev.alloc::<i32>(n).expect("a");
    dev.copy(&src, &mut a, n).expect("src → a");
    let mut b = dev.alloc::<i32>(n).expect("b");
    dev.copy(&a, &mut b, n).expect("a → b");
    let a_at = a.ptr();
    drop(a);
    // Taken from where `a` was: stream order makes that safe (its last reader ran before).
    let mut c = dev.alloc::<i32>(n).expect("c");
    if graph_arena_switch() {
        assert_eq!(c.ptr(), a_at, "the freed range is taken again");
    }
    dev.copy(&b, &mut c, n).expect("b → c");
    let mut d = dev.alloc::<i32>(n).expect("d");
    dev.copy(&c, &mut d, n).expect("c → d");
    dev.copy(&d, &mut out, n).expect("d → out");
    drop((b, c, d));
    let graph = dev.end_capture().expect("end capture");
    let edges = graph.edges().expect("edges");
    if graph_arena_switch() {
        assert!(
            !edges.kinds.contains("memory"),
            "memory nodes left: {}",
            edges.kinds
        );
    } else {
        assert!(edges.kinds.contains("memory alloc"), "{}", edges.kinds);
    }
    for round in 0..2 {
        graph.launch().expect("replay");
        assert_eq!(dev.download(&out).expect("out"), host, "replay {round}");
        // The next replay must move new bytes, not find the last ones still there.
        let next: Vec<i32> = host.iter().map(|x| x ^ (round + 1)).collect();
        dev.write(&mut src, 0, &next).expect("new src");
        graph.launch().expect("replay");
        assert_eq!(
            dev.download(&out).expect("out"),
            next,
            "replay {round}, new bytes"
        );
        dev.write(&mut src, 0, &host).expect("src back");
        dev.memset_zero(&out).expect("out cleared");
    }
}
