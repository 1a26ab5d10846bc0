//! DeepSeek-V2 (softmax routing, `DeepseekV2ForCausalLM`) against Hugging Face transformers.
//!
//! Golden data (`models/tiny-v2/{greedy,grouped}/golden.safetensors`) comes from
//! `scripts/make_tiny_v2.py`: transformers 5.25's `DeepseekV2ForCausalLM` in float32 on CPU with
//! seeded random weights, the logits of every position of three token sequences. `greedy` has
//! V2-Lite's structure (full-rank q, `topk_method: greedy`, YaRN with mscale); `grouped` has
//! V2's (low-rank q, `group_limited_greedy` over 4 groups keeping 2, `routed_scaling_factor`
//! 16). Each position's logits are checked, prefilled whole and decoded one token at a time
//! (the absorbed form), so both attention forms and the router run on every token.
//!
//! Tolerance: max |Δlogit| ≤ 1e-3 · max|logit|, as for the V3 parity test (both sides in f32 from
//! the same f32 weights; summation order and libm vs torch rounding stay ~1e-5 over 3 layers).
//! A routing difference (an expert picked differently) would move logits by far more.

use std::path::{Path, PathBuf};

use ferry_model::config::Scoring;
use ferry_model::deepseek::{DeepseekModel, LogitsWanted};
use ferry_model::session::Session;

fn dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tiny-v2")
        .join(name)
}

/// `(token ids, logits [positions × vocab])` of each golden sequence.
fn golden(name: &str) -> Vec<(Vec<u32>, Vec<f32>)> {
    let d = dir(name);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("sequences.json")).unwrap()).unwrap();
    let bytes = std::fs::read(d.join("golden.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    meta["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, seq)| {
            let ids = seq
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let t = st.tensor(&format!("logits_{i}")).unwrap();
            let logits = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (ids, logits)
        })
        .collect()
}

fn check(name: &str) {
    let model = DeepseekModel::load(&dir(name)).expect("the tiny V2 model loads");
    assert_eq!(model.config().scoring, Scoring::Softmax);
    let vocab = model.config().vocab_size;
    let mut pool = model.new_kv_pool(32, 16).unwrap();
    for (i, (ids, want)) in golden(name).iter().enumerate() {
        let tol = 1e-3 * want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let diff = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        };
        // Whole prompt at once.
        let mut s = Session::new();
        let ours = s.extend(&model, &mut pool, ids, LogitsWanted::All).unwrap();
        assert_eq!(ours.len(), want.len());
        let d = diff(&ours, want);
        assert!(
            d <= tol,
            "{name} sequence {i}, prefill: max |Δlogit| {d} > {tol}"
        );
        s.free(&mut pool).unwrap();
        // One token at a time.
        let mut s = Session::new();
        for (p, &t) in ids.iter().enumerate() {
            let row = s
                .extend(&model, &mut pool, &[t], LogitsWanted::Last)
                .unwrap();
            let d = diff(&row, &want[p * vocab..(p + 1) * vocab]);
            assert!(
                d <= tol,
                "{name} sequence {i}, decode step {p}: max |Δlogit| {d} > {tol}"
            );
        }
        s.free(&mut pool).unwrap();
    }
    assert_eq!(pool.free_blocks(), 32, "every block returned");
}

#[test]
fn v2_lite_structure_greedy_routing_matches_transformers() {
    check("greedy");
}

#[test]
fn v2_structure_group_limited_routing_matches_transformers() {
    check("grouped");
}
