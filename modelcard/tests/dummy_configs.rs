//! The config-only model directories under `models/dummy/` (served with `--load-format
//! dummy`) parse, and have the shapes and sizes their README states.

use std::path::Path;

use ferry_modelcard::config::ModelConfig;

fn config(name: &str) -> ModelConfig {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/dummy")
        .join(name);
    ModelConfig::from_file(&dir.join("config.json")).expect("the fixture parses")
}

#[test]
fn deepseek_v2_lite() {
    let c = config("deepseek-v2-lite");
    assert_eq!(c.scoring, ferry_modelcard::config::Scoring::Softmax);
    assert_eq!(
        (
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.q_lora_rank
        ),
        (2048, 27, 16, None)
    );
    assert_eq!(
        (
            c.n_routed_experts,
            c.num_experts_per_tok,
            c.n_shared_experts
        ),
        (64, 6, 2)
    );
    let (total, active) = c.parameter_counts();
    // DeepSeek-V2-Lite's model card: 15.7 B parameters, 2.4 B active per token. The shape
    // below without V3's 64 correction biases per MoE layer (V2's router has none).
    assert_eq!(total, 15_706_484_224, "total");
    assert_eq!(active, 2_451_437_056, "active");
}

#[test]
fn v2_lite_shape() {
    let c = config("v2-lite-shape");
    assert_eq!(
        (
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.q_lora_rank
        ),
        (2048, 27, 16, None)
    );
    assert_eq!(
        (
            c.n_routed_experts,
            c.num_experts_per_tok,
            c.n_shared_experts
        ),
        (64, 6, 2)
    );
    let (total, active) = c.parameter_counts();
    // DeepSeek-V2-Lite's model card: 15.7 B parameters, 2.4 B active per token. Counted by
    // hand: attention 13,767,168 per layer × 27, the dense first MLP 67,239,936, per MoE layer
    // 64 experts × 8,650,752 + 2 shared + the router (and V3's 64 correction biases) × 26,
    // embedding + LM head 419,430,400, the final norm.
    assert_eq!(total, 15_706_485_888, "total");
    assert_eq!(active, 2_451_438_720, "active");
}

#[test]
fn v3_tp8_slice() {
    let c = config("v3-tp8-slice");
    assert_eq!(
        (
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.q_lora_rank
        ),
        (7168, 24, 12, Some(1536))
    );
    assert_eq!((c.n_routed_experts, c.n_group, c.topk_group), (256, 8, 4));
    assert_eq!(c.latent_width(), 576);
    // By hand: attention 31,277,056 per layer × 24, 3 dense MLPs of 49,545,216, per MoE layer
    // 256 experts × 5,505,024 + 1 shared + the router and its biases × 21, embedding + LM head
    // 1,853,358,080, the final norm; active: 8 routed experts instead of 256, one embedding row.
    let (total, active) = c.parameter_counts();
    assert_eq!(total, 32_501_805_312, "total");
    assert_eq!(active, 2_904_968_448, "active");
}

/// The shape of the DSpark lease's trained target (`scripts/train_target.py --preset h200`),
/// for measuring a speculating engine's costs on it without a lease's training.
#[test]
fn dspark_h200() {
    let c = config("dspark-h200");
    assert_eq!(
        (
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.q_lora_rank,
            c.vocab_size
        ),
        (512, 20, 12, Some(256), 8192)
    );
    assert_eq!(
        (
            c.n_routed_experts,
            c.num_experts_per_tok,
            c.n_shared_experts
        ),
        (32, 4, 2)
    );
    let (total, active) = c.parameter_counts();
    // The lease's training report (2026-12-04, session 23): 287,059,968 parameters counted by
    // torch on the trained checkpoint, where V3's routing correction biases are buffers, not
    // parameters (+ 32 per MoE layer × 19 here); 73,674,752 active per token without the
    // embedding table, by its own formula, which leaves out the final norm (+ 512).
    assert_eq!(total, 287_059_968 + 19 * 32, "total");
    assert_eq!(active, 73_674_752 + 19 * 32 + 512, "active");
}
