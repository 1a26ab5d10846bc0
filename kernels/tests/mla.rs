//! MLA attention over a paged latent cache: the absorbed form against the MHA form, the
//! tiled kernel and the padding dispatcher against the naive reference.
//!
//! Every scenario scrambles the block table (non-contiguous, out-of-order block ids) and fills
//! every cache row the sequence does not own with NaN, so any read outside the sequence's
//! positions poisons the output and fails the comparison.

mod common;

use ferry_kernels::cpu::gemm::Matrix;
use ferry_kernels::cpu::mla::{
    mla_absorbed_attention, mla_absorbed_form, mla_absorbed_reference, mla_absorbed_tiled,
    mla_mha_attention, LatentContext, LatentPages, MlaDims, SeqAttn,
};
use ferry_kernels::KernelError;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

const KV_LORA: usize = 512;
const ROPE: usize = 64;
const WIDTH: usize = KV_LORA + ROPE;

/// A paged cache holding one sequence of `context` tokens.
struct Cache {
    data: Vec<f32>,
    table: Vec<u32>,
    page_size: usize,
}

impl Cache {
    fn new(rng: &mut ChaCha8Rng, page_size: usize, context: usize) -> Self {
        let needed = context.div_ceil(page_size);
        let num_blocks = 2 * needed + 3;
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        ids.shuffle(rng);
        let table: Vec<u32> = ids[..needed].to_vec();
        let mut data = vec![f32::NAN; num_blocks * page_size * WIDTH];
        for p in 0..context {
            let row = table[p / page_size] as usize * page_size + p % page_size;
            data[row * WIDTH..(row + 1) * WIDTH].copy_from_slice(&common::uniform(rng, WIDTH, 1.0));
        }
        if needed > 1 {
            assert!(
                table.windows(2).any(|w| w[1] != w[0] + 1),
                "block table should be non-contiguous"
            );
        }
        Self {
            data,
            table,
            page_size,
        }
    }

    fn ctx(&self, start_pos: usize, num_queries: usize, scale: f32) -> LatentContext<'_> {
        LatentContext {
            pages: LatentPages {
                data: &self.data,
                page_size: self.page_size,
                width: WIDTH,
            },
            seq: SeqAttn {
                block_table: &self.table,
                start_pos,
                num_queries,
            },
            scale,
        }
    }
}

/// DeepSeek-V3's softmax scale: 192^-0.5 · (0.1·ln 40 + 1)².
fn scale() -> f32 {
    (192f64.powf(-0.5) * (0.1 * 40f64.ln() + 1.0).powi(2)) as f32
}

/// Relative agreement with `want`, measured against its largest entry.
fn assert_close(got: &[f32], want: &[f32], rel: f32, what: &str) {
    let (diff, mag) = (common::max_abs_diff(got, want), common::max_abs(want));
    assert!(
        diff <= rel * mag,
        "{what}: max |diff| {diff} > {rel} x max |want| {mag}"
    );
}

#[test]
fn absorbed_form_matches_mha_form() {
    // (heads, page_size, start_pos, num_queries, f32 weights): chunk over a cached prefix,
    // fresh prompts spanning more than two pages (and the MHA form's 64-row query blocks,
    // from 0 and from a cached prefix), and decode (up to 4 rows: the absorption's row-by-row
    // path, bf16 and f32 weights).
    let cases = [
        (16, 64, 100, 50, false),
        (12, 16, 70, 130, false),
        (12, 16, 0, 40, false),
        (8, 64, 0, 150, false),
        (12, 64, 149, 1, false),
        (3, 16, 37, 5, false),
        (16, 16, 20, 4, false),
        (8, 64, 70, 3, true),
        (12, 16, 9, 1, true),
    ];
    let mut rng = common::rng(5);
    for (heads, page_size, start_pos, num_queries, f32_weights) in cases {
        let dims = MlaDims {
            heads,
            kv_lora_rank: KV_LORA,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: ROPE,
            v_head_dim: 128,
        };
        let rows = heads * dims.kv_b_rows_per_head();
        let kv_b = if f32_weights {
            Matrix::from_f32(
                rows,
                KV_LORA,
                common::uniform(&mut rng, rows * KV_LORA, 0.1),
            )
        } else {
            Matrix::from_bf16(
                rows,
                KV_LORA,
                common::uniform_bf16(&mut rng, rows * KV_LORA, 0.1),
            )
        }
        .expect("len");
        let cache = Cache::new(&mut rng, page_size, start_pos + num_queries);
        let ctx = cache.ctx(start_pos, num_queries, scale());
        // With these magnitudes scores have a standard deviation of about 2 (peaked softmax).
        let q = common::uniform(&mut rng, num_queries * heads * dims.qk_head_dim(), 2.0);

        let mut mha = vec![0.0f32; num_queries * heads * 128];
        let mut absorbed = vec![0.0f32; mha.len()];
        mla_mha_attention(&q, &dims, &kv_b, &ctx, &mut mha).expect("valid inputs");
        mla_absorbed_form(&q, &dims, &kv_b, &ctx, &mut absorbed).expect("valid inputs");
        // Exact algebra, different association: scores go through a 128-wide then a 512-wide
        // f32 contraction instead of the reverse, and the softmax is online. Errors are ~1e-6
        // relative; 1e-4 of the output's magnitude leaves a wide margin while still catching
        // any indexing mistake (those give O(1) differences).
        assert_close(
            &absorbed,
            &mha,
            1e-4,
            &format!("heads={heads} page={page_size} start={start_pos} S={num_queries}"),
        );
    }
}

fn absorbed_inputs(rng: &mut ChaCha8Rng, heads: usize, num_queries: usize) -> (Vec<f32>, Vec<f32>) {
    // Scores then have a standard deviation of about 2: a peaked but not one-hot softmax, so
    // score errors show up in the output.
    let q_abs = common::uniform(rng, num_queries * heads * WIDTH, 2.0);
    (q_abs, vec![f32::NAN; num_queries * heads * KV_LORA])
}

#[test]
fn padded_dispatch_matches_reference() {
    let mut rng = common::rng(6);
    for (heads, page_size, start_pos, num_queries) in [
        (12, 64, 90, 40),
        (12, 16, 0, 45),
        (1, 64, 130, 1),
        (3, 16, 20, 17),
        (5, 64, 0, 70),
        (20, 16, 33, 9),
    ] {
        let cache = Cache::new(&mut rng, page_size, start_pos + num_queries);
        let ctx = cache.ctx(start_pos, num_queries, scale());
        let (q_abs, mut got) = absorbed_inputs(&mut rng, heads, num_queries);
        let mut want = got.clone();
        mla_absorbed_attention(&q_abs, heads, &ctx, &mut got).expect("any head count");
        mla_absorbed_reference(&q_abs, heads, &ctx, &mut want).expect("any head count");
        // Online vs one-shot softmax and a different summation order: f32 rounding only. Scores
        // reach |s| ~ 8 here, so exp() turns their ~1e-6 rounding into ~4e-6 relative output
        // differences (observed); 2e-5 leaves margin without hiding indexing errors.
        assert_close(
            &got,
            &want,
            2e-5,
            &format!("heads={heads} page={page_size}"),
        );
    }
}

#[test]
fn tiled_kernel_head_counts() {
    let mut rng = common::rng(7);
    let cache = Cache::new(&mut rng, 64, 150);
    let ctx = cache.ctx(120, 30, scale());
    for heads in [4, 8, 16, 32] {
        let (q_abs, mut got) = absorbed_inputs(&mut rng, heads, 30);
        let mut want = got.clone();
        mla_absorbed_tiled(&q_abs, heads, &ctx, &mut got).expect("supported head count");
        mla_absorbed_reference(&q_abs, heads, &ctx, &mut want).expect("any head count");
        // Same reasoning as `padded_dispatch_matches_reference`.
        assert_close(&got, &want, 2e-5, &format!("heads={heads}"));
    }
    for heads in [1, 3, 12, 20] {
        let (q_abs, mut out) = absorbed_inputs(&mut rng, heads, 30);
        let err =
            mla_absorbed_tiled(&q_abs, heads, &ctx, &mut out).expect_err("unsupported head count");
        assert_eq!(
            err,
            KernelError::UnsupportedHeadCount {
                op: "mla_absorbed_tiled",
                heads
            }
        );
    }
}

#[test]
fn dispatcher_is_the_tiled_kernel_when_no_padding_is_needed() {
    let mut rng = common::rng(8);
    let cache = Cache::new(&mut rng, 16, 75);
    let ctx = cache.ctx(60, 15, scale());
    let (q_abs, mut a) = absorbed_inputs(&mut rng, 16, 15);
    let mut b = a.clone();
    mla_absorbed_attention(&q_abs, 16, &ctx, &mut a).expect("supported");
    mla_absorbed_tiled(&q_abs, 16, &ctx, &mut b).expect("supported");
    assert_eq!(
        a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
fn short_or_bad_block_tables_are_rejected() {
    let mut rng = common::rng(9);
    let cache = Cache::new(&mut rng, 16, 40); // 3 blocks
    let (q_abs, mut out) = absorbed_inputs(&mut rng, 4, 10);
    let mut ctx = cache.ctx(30, 10, scale());
    ctx.seq.block_table = &cache.table[..2];
    assert!(matches!(
        mla_absorbed_tiled(&q_abs, 4, &ctx, &mut out),
        Err(KernelError::BlockTableTooShort {
            blocks: 2,
            page_size: 16,
            needed_tokens: 40,
            ..
        })
    ));
    let bad_table = [cache.table[0], cache.table[1], 10_000];
    ctx.seq.block_table = &bad_table;
    assert!(matches!(
        mla_absorbed_reference(&q_abs, 4, &ctx, &mut out),
        Err(KernelError::IndexOutOfRange { index: 10_000, .. })
    ));
}
