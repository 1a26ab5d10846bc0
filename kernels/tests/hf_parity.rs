//! Parity with Hugging Face transformers' float32 `DeepseekV3` modules.
//!
//! `tests/hf/fixture.json` was produced by `tests/hf/make_fixture.py` (transformers and torch
//! versions are recorded in the file): DeepSeek-V3's YaRN table and interleaved rotation, one
//! tiny attention layer (3 heads, kv_lora 16, nope 8, rope 4, v 8) and one tiny MoE layer (8
//! experts in 4 groups, top-2 of 2 groups, mixed-sign correction bias), with their weights,
//! inputs and outputs. Tolerances: 1e-5 relative to the largest output — f32 everywhere, only
//! the summation order differs from torch.

mod common;

use ferry_kernels::cpu::gemm::{linear, Matrix};
use ferry_kernels::cpu::mla::{
    mla_absorbed_form, mla_mha_attention, LatentContext, LatentPages, MlaDims, SeqAttn,
};
use ferry_kernels::cpu::mlp::GatedMlp;
use ferry_kernels::cpu::moe::{MoeLayer, MoeRouting};
use ferry_kernels::cpu::norm::rms_norm;
use ferry_kernels::cpu::rope::{
    softmax_scale_multiplier, Rope, RopeParams, RopeScaling, RotaryLayout, YarnParams,
};
use ferry_kernels::KernelError;
use serde_json::Value;

fn fixture() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/hf/fixture.json"
    ))
    .expect("fixture present in the repository");
    serde_json::from_str(&text).expect("fixture is JSON")
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

fn weight(w: &Value, name: &str, rows: usize) -> Matrix {
    let data = floats(&w[name]);
    Matrix::from_f32(rows, data.len() / rows, data).expect("whole rows")
}

fn yarn(dim: usize) -> RopeParams {
    RopeParams {
        dim,
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
    }
}

fn assert_close(got: &[f32], want: &[f32], rel: f32, what: &str) {
    let (diff, mag) = (common::max_abs_diff(got, want), common::max_abs(want));
    assert!(
        diff <= rel * mag,
        "{what}: max |diff| {diff} > {rel} x {mag}"
    );
}

#[test]
fn rope_matches_transformers() {
    let f = fixture();
    let r = &f["rope"];
    let rope = Rope::new(&yarn(64)).expect("valid");
    let hf_inv = floats(&r["inv_freq"]);
    for (i, (a, b)) in rope.inv_freq().iter().zip(&hf_inv).enumerate() {
        // Same f32 formula; only torch's f32 pow may differ from ours in the last ulp.
        assert!(
            (a - b).abs() <= 2.0 * f32::EPSILON * b.abs(),
            "inv_freq[{i}]: {a} vs {b}"
        );
    }
    assert_eq!(
        rope.attention_factor(),
        r["attention_scaling"].as_f64().expect("number") as f32
    );

    let positions: Vec<usize> = r["positions"]
        .as_array()
        .expect("array")
        .iter()
        .map(|p| p.as_u64().expect("int") as usize)
        .collect();
    let (hf_cos, hf_sin) = (floats(&r["cos"]), floats(&r["sin"]));
    let (mut cos, mut sin) = (vec![0.0f32; 32], vec![0.0f32; 32]);
    for (t, &pos) in positions.iter().enumerate() {
        rope.cos_sin(pos, &mut cos, &mut sin).expect("lengths");
        // Both sides take cos/sin of the same f32 angle; libm vs SLEEF differ by ~1 ulp of 1.
        assert_close(&cos, &hf_cos[t * 64..t * 64 + 32], 1e-6, "cos");
        assert_close(&sin, &hf_sin[t * 64..t * 64 + 32], 1e-6, "sin");
    }

    // HF lays x out as [batch=1][heads=2][seq=5][64]; ours is [seq][heads][64].
    let (x, want) = (floats(&r["x"]), floats(&r["x_out"]));
    let to_ours = |v: &[f32]| {
        let mut o = vec![0.0f32; v.len()];
        for h in 0..2 {
            for t in 0..5 {
                o[(t * 2 + h) * 64..(t * 2 + h + 1) * 64]
                    .copy_from_slice(&v[(h * 5 + t) * 64..(h * 5 + t + 1) * 64]);
            }
        }
        o
    };
    let mut got = to_ours(&x);
    rope.apply(
        &mut got,
        &positions,
        RotaryLayout {
            heads: 2,
            head_stride: 64,
            offset: 0,
        },
    )
    .expect("shapes");
    assert_close(&got, &to_ours(&want), 1e-6, "interleaved rotation");
}

#[test]
fn mla_matches_transformers_attention() {
    let f = fixture();
    let a = &f["attn"];
    let w = &a["weights"];
    let (s, hidden, heads) = (6usize, 32usize, 3usize);
    let dims = MlaDims {
        heads,
        kv_lora_rank: 16,
        qk_nope_head_dim: 8,
        qk_rope_head_dim: 4,
        v_head_dim: 8,
    };
    let scale = a["scaling"].as_f64().expect("number") as f32;
    let ours = (12f64.powf(-0.5) * softmax_scale_multiplier(&yarn(4))) as f32;
    assert!(
        (scale - ours).abs() <= 1e-6 * scale,
        "softmax scale {ours} vs transformers {scale}"
    );

    let h = floats(&a["hidden"]);
    let mut q_a = vec![0.0f32; s * 16];
    linear(&h, &weight(w, "q_a_proj.weight", 16), &mut q_a).expect("shapes");
    let q_a_in = q_a.clone();
    rms_norm(&q_a_in, &floats(&w["q_a_layernorm.weight"]), 1e-6, &mut q_a).expect("shapes");
    let mut q = vec![0.0f32; s * heads * 12];
    linear(&q_a, &weight(w, "q_b_proj.weight", heads * 12), &mut q).expect("shapes");
    let mut ckv = vec![0.0f32; s * 20];
    linear(&h, &weight(w, "kv_a_proj_with_mqa.weight", 20), &mut ckv).expect("shapes");

    let rope = Rope::new(&yarn(4)).expect("valid");
    let positions: Vec<usize> = (0..s).collect();
    rope.apply(
        &mut q,
        &positions,
        RotaryLayout {
            heads,
            head_stride: 12,
            offset: 8,
        },
    )
    .expect("shapes");
    rope.apply(
        &mut ckv,
        &positions,
        RotaryLayout {
            heads: 1,
            head_stride: 20,
            offset: 16,
        },
    )
    .expect("shapes");
    let kv_norm = floats(&w["kv_a_layernorm.weight"]);

    // Cache rows [norm(c_kv) | rotated k_pe] in 4-token pages, blocks scrambled: table [2, 0].
    let (page_size, width) = (4usize, 20usize);
    let table = [2u32, 0];
    let mut pages = vec![f32::NAN; 3 * page_size * width];
    for p in 0..s {
        let row = (table[p / page_size] as usize * page_size + p % page_size) * width;
        rms_norm(
            &ckv[p * 20..p * 20 + 16],
            &kv_norm,
            1e-6,
            &mut pages[row..row + 16],
        )
        .expect("shapes");
        pages[row + 16..row + 20].copy_from_slice(&ckv[p * 20 + 16..p * 20 + 20]);
    }
    let kv_b = weight(w, "kv_b_proj.weight", heads * 16);
    let o_proj = weight(w, "o_proj.weight", hidden);
    let want = floats(&a["out"]);

    // A fresh prompt of all 6 tokens, then the same as a 4-token prefill plus a 2-token chunk.
    for (start_pos, num_queries) in [(0usize, 6usize), (0, 4), (4, 2)] {
        let ctx = LatentContext {
            pages: LatentPages {
                data: &pages,
                page_size,
                width,
            },
            seq: SeqAttn {
                block_table: &table,
                start_pos,
                num_queries,
            },
            scale,
        };
        let q_chunk = &q[start_pos * heads * 12..(start_pos + num_queries) * heads * 12];
        let want_chunk = &want[start_pos * hidden..(start_pos + num_queries) * hidden];
        type Form = for<'a> fn(
            &[f32],
            &MlaDims,
            &Matrix,
            &LatentContext<'a>,
            &mut [f32],
        ) -> Result<(), KernelError>;
        let forms: [(Form, &str); 2] =
            [(mla_mha_attention, "mha"), (mla_absorbed_form, "absorbed")];
        for (form, name) in forms {
            let mut attn = vec![0.0f32; num_queries * heads * 8];
            form(q_chunk, &dims, &kv_b, &ctx, &mut attn).expect("valid inputs");
            let mut out = vec![0.0f32; num_queries * hidden];
            linear(&attn, &o_proj, &mut out).expect("shapes");
            assert_close(
                &out,
                want_chunk,
                1e-5,
                &format!("{name} start={start_pos} S={num_queries}"),
            );
        }
    }
}

#[test]
fn moe_matches_transformers() {
    let f = fixture();
    let m = &f["moe"];
    let w = &m["weights"];
    let (hidden, inter, experts) = (32usize, 6usize, 8usize);
    let mlp = |prefix: &str, inter: usize| {
        GatedMlp::new(
            weight(w, &format!("{prefix}.gate_proj.weight"), inter),
            weight(w, &format!("{prefix}.up_proj.weight"), inter),
            weight(w, &format!("{prefix}.down_proj.weight"), hidden),
        )
        .expect("consistent shapes")
    };
    let routed: Vec<GatedMlp> = if w.get("experts.0.gate_proj.weight").is_some() {
        (0..experts)
            .map(|e| mlp(&format!("experts.{e}"), inter))
            .collect()
    } else {
        // transformers 5 fuses experts: gate_up_proj [E][2·I][H] (gate rows first), down_proj [E][H][I].
        let (gu, down) = (
            floats(&w["experts.gate_up_proj"]),
            floats(&w["experts.down_proj"]),
        );
        (0..experts)
            .map(|e| {
                let gu_e = &gu[e * 2 * inter * hidden..(e + 1) * 2 * inter * hidden];
                GatedMlp::new(
                    Matrix::from_f32(inter, hidden, gu_e[..inter * hidden].to_vec()).expect("len"),
                    Matrix::from_f32(inter, hidden, gu_e[inter * hidden..].to_vec()).expect("len"),
                    Matrix::from_f32(
                        hidden,
                        inter,
                        down[e * hidden * inter..(e + 1) * hidden * inter].to_vec(),
                    )
                    .expect("len"),
                )
                .expect("consistent shapes")
            })
            .collect()
    };
    let layer = MoeLayer {
        routing: MoeRouting {
            n_experts: experts,
            top_k: 2,
            n_group: 4,
            topk_group: 2,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
            scoring: Default::default(),
        },
        router: weight(w, "gate.weight", experts),
        correction_bias: floats(&m["bias"]),
        experts: routed,
        shared: Some(mlp("shared_experts", inter)),
    };
    let x = floats(&m["x"]);

    // Routing: same experts (transformers' order is unspecified) with the same weights. The
    // gate returns (router_logits, topk_weights, topk_indices).
    let gate = m["gate_out"].as_array().expect("array");
    let mut logits = vec![0.0f32; 5 * experts];
    linear(&x, &layer.router, &mut logits).expect("shapes");
    let hf_logits: Vec<f32> = gate[0]
        .as_array()
        .expect("array")
        .iter()
        .flat_map(floats)
        .collect();
    assert_close(&logits, &hf_logits, 1e-5, "router logits");
    let routes = layer
        .routing
        .route(&logits, &layer.correction_bias)
        .expect("valid");
    let (hf_w, hf_idx) = (
        gate[1].as_array().expect("array"),
        gate[2].as_array().expect("array"),
    );
    for (t, route) in routes.iter().enumerate() {
        let w_t = floats(&hf_w[t]);
        for (k, e) in hf_idx[t].as_array().expect("array").iter().enumerate() {
            let e = e.as_u64().expect("int") as usize;
            let ours = route
                .iter()
                .find(|(x, _)| *x == e)
                .unwrap_or_else(|| panic!("token {t}: expert {e} not routed"));
            // Sigmoid, a two-term sum, a division and a multiplication in f32: a few ulp of 2.5.
            assert!(
                (ours.1 - w_t[k]).abs() <= 2e-6 * 2.5,
                "token {t} expert {e}: {} vs {}",
                ours.1,
                w_t[k]
            );
        }
    }

    let mut out = vec![0.0f32; x.len()];
    layer.forward(&x, &mut out).expect("shapes");
    assert_close(&out, &floats(&m["out"]), 1e-5, "moe output");
}
