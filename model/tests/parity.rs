//! Parity of the CPU forward with Hugging Face transformers, and its internal consistency; the
//! DeepSeek-V2 models (softmax routing) in the module `deepseek_v2` at the end.
//!
//! Golden data (`models/tiny-k3/golden/`) comes from `scripts/make_tiny_k3.py golden`:
//! transformers' `DeepseekV3ForCausalLM` in float32 on CPU, from the same bf16 checkpoint.
//!
//! Tolerances: both sides compute in f32 from identical bf16 weights; the only differences are
//! summation order (GEMM blocking, the absorbed form's different but exact algebra) and libm
//! vs torch transcendental rounding, which stay ~1e-6 relative per op and grow to ~1e-5 over 4
//! layers. The bound, max |Δlogit| ≤ 1e-3 · max|logit|, leaves ~100× headroom; the
//! greedy margins recorded with the golden data (≥ 0.02) are far above any such error, so
//! greedy tokens must be identical.

use std::path::PathBuf;

use ferry_model::deepseek::{
    AttentionForm, BatchInputs, DeepseekModel, FormPolicy, LogitsWanted, SeqInput,
};
use ferry_model::kv::{BlockTable, KvPool};
use ferry_model::session::Session;
use ferry_model::tokenizer::Tokenizer;
use serde_json::Value;

fn model_dir() -> PathBuf {
    ferry_model::embedded::default_model_dir()
}

fn load() -> DeepseekModel {
    DeepseekModel::load(&model_dir()).expect("the embedded model loads")
}

fn pool(model: &DeepseekModel) -> KvPool {
    model.new_kv_pool(64, 64).expect("pool")
}

struct Case {
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    logits: Vec<f32>,
    prompt: String,
}

fn golden() -> Vec<Case> {
    let dir = model_dir().join("golden");
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("logits.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    meta["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let t = st.tensor(c["logits_tensor"].as_str().unwrap()).unwrap();
            let logits = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            Case {
                prompt_ids: ids(&c["prompt_ids"]),
                greedy_ids: ids(&c["greedy_ids"]),
                logits,
                prompt: c["prompt"].as_str().unwrap().to_string(),
            }
        })
        .collect()
}

fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn argmax(row: &[f32]) -> u32 {
    ferry_kernels::cpu::sample::argmax(row)
}

/// Greedy continuation: prefill, then one-token decode steps (absorbed form by the cost model).
fn greedy(model: &DeepseekModel, pool: &mut KvPool, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = Session::new();
    let mut logits = s.extend(model, pool, prompt, LogitsWanted::Last).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        logits = s.extend(model, pool, &[t], LogitsWanted::Last).unwrap();
    }
    s.free(pool).unwrap();
    out
}

#[test]
fn tokenizer_matches_the_reference_ids() {
    let tok = Tokenizer::from_dir(&model_dir()).unwrap();
    for case in golden() {
        assert_eq!(tok.encode(&case.prompt, true).unwrap(), case.prompt_ids);
    }
}

#[test]
fn prefill_logits_match_transformers() {
    let model = load();
    let mut pool = pool(&model);
    let cases = golden();
    assert!(
        cases.iter().any(|c| c.prompt_ids.len() > 2 * 64),
        "one golden prompt must span more than two KV pages"
    );
    for (i, case) in cases.iter().enumerate() {
        let mut s = Session::new();
        let ours = s
            .extend(&model, &mut pool, &case.prompt_ids, LogitsWanted::All)
            .unwrap();
        let tol = 1e-3 * max_abs(&case.logits);
        let diff = max_diff(&ours, &case.logits);
        assert!(diff <= tol, "prompt {i}: max |Δlogit| {diff} > {tol}");
        s.free(&mut pool).unwrap();
    }
    assert_eq!(pool.free_blocks(), 64, "every block returned");
}

#[test]
fn greedy_continuations_match_transformers() {
    let model = load();
    let mut pool = pool(&model);
    for (i, case) in golden().iter().enumerate() {
        let ours = greedy(&model, &mut pool, &case.prompt_ids, case.greedy_ids.len());
        assert_eq!(ours, case.greedy_ids, "prompt {i}");
    }
    assert_eq!(pool.free_blocks(), 64);
}

#[test]
fn absorbed_form_equals_mha_form() {
    let model = load();
    let mut pool = pool(&model);
    let case = golden()
        .into_iter()
        .max_by_key(|c| c.prompt_ids.len())
        .unwrap();
    let run = |pool: &mut KvPool, form| {
        let mut s = Session::with_policy(FormPolicy::Force(form));
        let l = s
            .extend(&model, pool, &case.prompt_ids, LogitsWanted::All)
            .unwrap();
        s.free(pool).unwrap();
        l
    };
    let mha = run(&mut pool, AttentionForm::Mha);
    let absorbed = run(&mut pool, AttentionForm::Absorbed);
    // Same math, different f32 contraction order (a 64-wide latent product instead of per-head
    // 32-wide ones): agreement to ~1e-6 relative per layer; 1e-4 of the logit range is strict.
    let tol = 1e-4 * max_abs(&mha);
    let diff = max_diff(&mha, &absorbed);
    assert!(diff <= tol, "absorbed vs MHA: {diff} > {tol}");
}

#[test]
fn mixed_length_batch_equals_each_sequence_alone() {
    let model = load();
    let mut pool = pool(&model);
    let cases = golden();
    let alone: Vec<Vec<f32>> = cases
        .iter()
        .map(|c| {
            let mut s = Session::new();
            let l = s
                .extend(&model, &mut pool, &c.prompt_ids, LogitsWanted::All)
                .unwrap();
            s.free(&mut pool).unwrap();
            l
        })
        .collect();

    let mut tables: Vec<BlockTable> = Vec::new();
    for c in &cases {
        let mut t = BlockTable::new();
        t.reserve(&mut pool, c.prompt_ids.len()).unwrap();
        tables.push(t);
    }
    let batch = BatchInputs {
        prompt_logprobs: Vec::new(),
        drafts_on_device: None,
        seqs: cases
            .iter()
            .zip(&tables)
            .map(|(c, t)| SeqInput {
                tokens: &c.prompt_ids,
                start_pos: 0,
                block_table: t.blocks(),
                logits: LogitsWanted::All,
            })
            .collect(),
    };
    let out = model.forward(&batch, &mut pool).unwrap();
    for (i, (batched, single)) in out.logits.iter().zip(&alone).enumerate() {
        // Only GEMM blocking over a different row count can differ: ~1e-6 relative.
        let tol = 1e-5 * max_abs(single);
        let diff = max_diff(batched, single);
        assert!(diff <= tol, "sequence {i}: batched vs alone {diff} > {tol}");
    }
    for mut t in tables {
        t.free(&mut pool).unwrap();
    }
    assert_eq!(pool.free_blocks(), 64);
}

#[test]
fn decode_after_reused_prefix_equals_decode_after_full_prefill() {
    let model = load();
    let mut pool = pool(&model);
    let case = golden()
        .into_iter()
        .max_by_key(|c| c.prompt_ids.len())
        .unwrap();
    let prompt = &case.prompt_ids;
    assert!(prompt.len() > 128);

    // Full prefill of the whole prompt, then 8 greedy decode steps.
    let full = greedy(&model, &mut pool, prompt, 8);

    // A first request caches the prompt; a second one shares its first two full blocks and
    // computes only the rest (a chunk over a cached prefix), then decodes.
    let mut first = Session::new();
    first
        .extend(&model, &mut pool, prompt, LogitsWanted::Last)
        .unwrap();
    let used_by_first = 64 - pool.free_blocks();
    let mut second = Session::fork_prefix(&mut pool, &first, 128).unwrap();
    let mut logits = second
        .extend(&model, &mut pool, &prompt[128..], LogitsWanted::Last)
        .unwrap();
    assert_eq!(
        64 - pool.free_blocks(),
        used_by_first + model.kv_layout(64, 64).blocks_for(prompt.len() + 1) - 2,
        "the shared prefix blocks are not copied"
    );
    let mut reused = Vec::new();
    for _ in 0..8 {
        let t = argmax(&logits);
        reused.push(t);
        logits = second
            .extend(&model, &mut pool, &[t], LogitsWanted::Last)
            .unwrap();
    }
    assert_eq!(reused, full);
    first.free(&mut pool).unwrap();
    second.free(&mut pool).unwrap();
    assert_eq!(pool.free_blocks(), 64);
}

#[test]
fn bad_batches_are_rejected_before_touching_the_cache() {
    let model = load();
    let mut pool = pool(&model);
    let mut t = BlockTable::new();
    t.reserve(&mut pool, 4).unwrap();
    let bad_token = [model.config().vocab_size as u32];
    let batch = BatchInputs {
        prompt_logprobs: Vec::new(),
        drafts_on_device: None,
        seqs: vec![SeqInput {
            tokens: &bad_token,
            start_pos: 0,
            block_table: t.blocks(),
            logits: LogitsWanted::Last,
        }],
    };
    let err = model.forward(&batch, &mut pool).unwrap_err().to_string();
    assert!(err.contains("outside the vocabulary"), "{err}");

    let too_long = vec![5u32; 65];
    let batch = BatchInputs {
        prompt_logprobs: Vec::new(),
        drafts_on_device: None,
        seqs: vec![SeqInput {
            tokens: &too_long,
            start_pos: 0,
            block_table: t.blocks(),
            logits: LogitsWanted::Last,
        }],
    };
    let err = model.forward(&batch, &mut pool).unwrap_err().to_string();
    assert!(err.contains("block table"), "{err}");
    t.free(&mut pool).unwrap();
}

/// DeepSeek-V2 (softmax routing, `DeepseekV2ForCausalLM`) against Hugging Face transformers.
///
/// Golden data (`models/tiny-v2/{greedy,grouped}/golden.safetensors`) comes from
/// `scripts/make_tiny_v2.py`: transformers 5.25's `DeepseekV2ForCausalLM` in float32 on CPU with
/// seeded random weights, the logits of every position of three token sequences. `greedy` has
/// V2-Lite's structure (full-rank q, `topk_method: greedy`, YaRN with mscale); `grouped` has
/// V2's (low-rank q, `group_limited_greedy` over 4 groups keeping 2, `routed_scaling_factor`
/// 16). Each position's logits are checked, prefilled whole and decoded one token at a time
/// (the absorbed form), so both attention forms and the router run on every token.
///
/// Tolerance: max |Δlogit| ≤ 1e-3 · max|logit|, as for the V3 parity test (both sides in f32 from
/// the same f32 weights; summation order and libm vs torch rounding stay ~1e-5 over 3 layers).
/// A routing difference (an expert picked differently) would move logits by far more.
mod deepseek_v2 {
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
            serde_json::from_str(&std::fs::read_to_string(d.join("sequences.json")).unwrap())
                .unwrap();
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
}
