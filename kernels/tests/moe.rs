//! DeepSeek-V3 routing on hand-built cases, and the MoE layer against a naive loop.

mod common;

use ferry_kernels::cpu::gemm::Matrix;
use ferry_kernels::cpu::mlp::GatedMlp;
use ferry_kernels::cpu::moe::{MoeLayer, MoeRouting};

fn routing(top_k: usize, norm: bool) -> MoeRouting {
    MoeRouting {
        n_experts: 8,
        top_k,
        n_group: 4,
        topk_group: 2,
        norm_topk_prob: norm,
        routed_scaling_factor: 2.5,
        scoring: Default::default(),
    }
}

fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + (-v).exp())
}

/// Logits where expert 0 is the best single expert but its group (0, 1) loses because expert
/// 1 is poor; groups 1 (experts 2, 3) and 2 (experts 4, 5) win.
const LOGITS: [f32; 8] = [3.0, -5.0, 1.0, 0.9, 0.8, 0.7, -1.0, -1.0];

#[test]
fn group_limiting_excludes_best_expert_of_losing_group() {
    let routes = routing(2, true).route(&LOGITS, &[0.0; 8]).expect("valid");
    let experts: Vec<usize> = routes[0].iter().map(|&(e, _)| e).collect();
    assert_eq!(experts, vec![2, 3]);
}

#[test]
fn weights_are_normalised_then_scaled() {
    let routes = routing(3, true).route(&LOGITS, &[0.0; 8]).expect("valid");
    let picked: Vec<usize> = routes[0].iter().map(|&(e, _)| e).collect();
    assert_eq!(picked, vec![2, 3, 4]);
    let denom: f32 = picked.iter().map(|&e| sigmoid(LOGITS[e])).sum();
    for &(e, w) in &routes[0] {
        // One division and one multiplication in f32 on each side.
        assert!((w - sigmoid(LOGITS[e]) / denom * 2.5).abs() < 1e-6);
    }
    let total: f32 = routes[0].iter().map(|&(_, w)| w).sum();
    assert!((total - 2.5).abs() < 1e-5);

    let raw = routing(3, false).route(&LOGITS, &[0.0; 8]).expect("valid");
    for &(e, w) in &raw[0] {
        assert_eq!(w, sigmoid(LOGITS[e]) * 2.5);
    }
}

#[test]
fn bias_changes_selection_not_weights() {
    // A bias on expert 5 lifts it above 3 and 4 for the choice, but its weight stays its score.
    let mut bias = [0.0f32; 8];
    bias[5] = 0.5;
    let routes = routing(2, false).route(&LOGITS, &bias).expect("valid");
    assert_eq!(
        routes[0].iter().map(|&(e, _)| e).collect::<Vec<_>>(),
        vec![5, 2]
    );
    assert_eq!(routes[0][0].1, sigmoid(LOGITS[5]) * 2.5);
    // A large bias on expert 7 makes its group win too, and it is chosen first.
    bias[7] = 2.0;
    let routes = routing(2, false).route(&LOGITS, &bias).expect("valid");
    assert_eq!(routes[0][0], (7, sigmoid(LOGITS[7]) * 2.5));
}

#[test]
fn ties_go_to_lower_index() {
    let r = MoeRouting {
        n_experts: 4,
        top_k: 2,
        n_group: 1,
        topk_group: 1,
        norm_topk_prob: false,
        routed_scaling_factor: 1.0,
        scoring: Default::default(),
    };
    let routes = r.route(&[0.5, 0.5, 0.5, 0.5], &[0.0; 4]).expect("valid");
    assert_eq!(
        routes[0].iter().map(|&(e, _)| e).collect::<Vec<_>>(),
        vec![0, 1]
    );
}

#[test]
fn invalid_routing_is_rejected() {
    let bad = [
        MoeRouting {
            n_group: 3,
            ..routing(2, true)
        },
        MoeRouting {
            topk_group: 5,
            ..routing(2, true)
        },
        MoeRouting {
            top_k: 5,
            ..routing(2, true)
        },
        MoeRouting {
            top_k: 0,
            ..routing(2, true)
        },
    ];
    for r in bad {
        assert!(r.route(&LOGITS, &[0.0; 8]).is_err(), "{r:?}");
    }
    assert!(routing(2, true).route(&LOGITS[..7], &[0.0; 8]).is_err());
}

fn random_mlp(rng: &mut rand_chacha::ChaCha8Rng, hidden: usize, inter: usize) -> GatedMlp {
    GatedMlp::new(
        Matrix::from_bf16(
            inter,
            hidden,
            common::uniform_bf16(rng, inter * hidden, 0.3),
        )
        .expect("len"),
        Matrix::from_bf16(
            inter,
            hidden,
            common::uniform_bf16(rng, inter * hidden, 0.3),
        )
        .expect("len"),
        Matrix::from_bf16(
            hidden,
            inter,
            common::uniform_bf16(rng, hidden * inter, 0.3),
        )
        .expect("len"),
    )
    .expect("consistent shapes")
}

#[test]
fn moe_layer_matches_per_token_loop() {
    let mut rng = common::rng(4);
    let (hidden, inter, tokens) = (24, 16, 11);
    let routing = routing(3, true);
    let layer = MoeLayer {
        routing: routing.clone(),
        router: Matrix::from_f32(8, hidden, common::uniform(&mut rng, 8 * hidden, 0.5))
            .expect("len"),
        correction_bias: common::uniform(&mut rng, 8, 0.1),
        experts: (0..8)
            .map(|_| random_mlp(&mut rng, hidden, inter))
            .collect(),
        shared: Some(random_mlp(&mut rng, hidden, 2 * inter)),
    };
    let x = common::uniform(&mut rng, tokens * hidden, 1.0);
    let mut out = vec![0.0f32; x.len()];
    layer.forward(&x, &mut out).expect("shapes match");

    for t in 0..tokens {
        let xt = &x[t * hidden..(t + 1) * hidden];
        let mut logits = vec![0.0f32; 8];
        ferry_kernels::cpu::gemm::linear(xt, &layer.router, &mut logits).expect("shapes");
        let route = routing
            .route(&logits, &layer.correction_bias)
            .expect("valid");
        let mut want = vec![0.0f32; hidden];
        let mut y = vec![0.0f32; hidden];
        for &(e, w) in &route[0] {
            layer.experts[e].forward(xt, &mut y).expect("shapes");
            for (o, v) in want.iter_mut().zip(&y) {
                *o += w * v;
            }
        }
        layer
            .shared
            .as_ref()
            .expect("has shared")
            .forward(xt, &mut y)
            .expect("shapes");
        for (o, v) in want.iter_mut().zip(&y) {
            *o += v;
        }
        // Same arithmetic, different expert summation order and GEMM batching: f32 rounding.
        let got = &out[t * hidden..(t + 1) * hidden];
        assert!(
            common::max_abs_diff(got, &want) <= 1e-5 * common::max_abs(&want).max(1.0),
            "token {t}"
        );
    }
}
