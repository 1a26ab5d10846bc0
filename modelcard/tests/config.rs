//! `ModelConfig` parsing: the real Kimi K2 and DeepSeek-V3 configs, both RoPE spellings, and
//! errors that name the offending field.
use std::path::{Path, PathBuf};

use ferry_modelcard::config::{Fp8BlockQuant, ModelConfig};
use ferry_modelcard::rope::{RopeScaling, YarnParams};
use ferry_modelcard::CardError;
use serde_json::{json, Value};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn fixture_json(name: &str) -> anyhow::Result<Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(fixture(
        name,
    ))?)?)
}

/// K2's config with `edit` applied, parsed.
fn k2_with(edit: impl FnOnce(&mut Value)) -> anyhow::Result<Result<ModelConfig, CardError>> {
    let mut v = fixture_json("kimi_k2_config.json")?;
    edit(&mut v);
    Ok(ModelConfig::from_json_str(&v.to_string()))
}

fn yarn(cfg: &ModelConfig) -> anyhow::Result<&YarnParams> {
    match &cfg.rope.scaling {
        RopeScaling::Yarn(y) => Ok(y),
        other => anyhow::bail!("expected YaRN, got {other:?}"),
    }
}

/// Asserts a `Config` error for `field` whose message contains every string in `needles`.
fn assert_config_err(
    result: Result<ModelConfig, CardError>,
    field: &str,
    needles: &[&str],
) -> anyhow::Result<()> {
    let err = match result {
        Ok(cfg) => anyhow::bail!("expected an error for `{field}`, parsed {cfg:?}"),
        Err(e) => e,
    };
    let text = err.to_string();
    match &err {
        CardError::Config { field: f, .. } => assert_eq!(f, field, "{text}"),
        other => anyhow::bail!("expected CardError::Config for `{field}`, got {other:?}"),
    }
    assert!(text.contains(&format!("`{field}`")), "{text}");
    for needle in needles {
        assert!(text.contains(needle), "`{needle}` not in: {text}");
    }
    Ok(())
}

#[test]
fn kimi_k2_config_parses() -> anyhow::Result<()> {
    let cfg = ModelConfig::from_file(&fixture("kimi_k2_config.json"))?;
    assert_eq!(cfg.model_type.as_deref(), Some("kimi_k2"));
    assert_eq!(cfg.vocab_size, 163_840);
    assert_eq!(cfg.hidden_size, 7168);
    assert_eq!(cfg.intermediate_size, 18_432);
    assert_eq!(cfg.moe_intermediate_size, 2048);
    assert_eq!(cfg.num_hidden_layers, 61);
    assert_eq!(cfg.num_attention_heads, 64);
    assert_eq!(cfg.q_lora_rank, Some(1536));
    assert_eq!(cfg.kv_lora_rank, 512);
    assert_eq!(
        (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim),
        (128, 64, 128)
    );
    assert_eq!(cfg.qk_head_dim(), 192);
    assert_eq!(cfg.latent_width(), 576);
    assert_eq!(cfg.n_routed_experts, 384);
    assert_eq!(cfg.num_experts_per_tok, 8);
    assert_eq!(cfg.n_shared_experts, 1);
    assert_eq!((cfg.n_group, cfg.topk_group), (1, 1));
    assert_eq!(cfg.first_k_dense_replace, 1);
    assert_eq!(cfg.moe_layer_freq, 1);
    assert!(cfg.norm_topk_prob);
    assert_eq!(cfg.routed_scaling_factor, 2.827);
    assert_eq!(cfg.rms_norm_eps, 1e-6);
    assert_eq!(cfg.max_position_embeddings, 131_072);
    assert_eq!(cfg.num_nextn_predict_layers, 0);
    assert!(!cfg.tie_word_embeddings);
    assert_eq!(cfg.bos_token_id, Some(163_584));
    assert_eq!(cfg.eos_token_ids, vec![163_585]);
    assert_eq!(
        cfg.quantization,
        Some(Fp8BlockQuant {
            block_rows: 128,
            block_cols: 128
        })
    );
    assert_eq!(cfg.torch_dtype.as_deref(), Some("bfloat16"));

    assert_eq!(cfg.rope.dim, 64);
    assert_eq!(cfg.rope.theta, 50_000.0);
    assert!(cfg.rope.interleaved);
    let y = yarn(&cfg)?;
    assert_eq!(y.factor, 32.0);
    assert_eq!(y.original_max_position_embeddings, 4096);
    assert_eq!((y.beta_fast, y.beta_slow), (1.0, 1.0));
    assert_eq!((y.mscale, y.mscale_all_dim), (Some(1.0), Some(1.0)));
    assert_eq!(y.attention_factor, None);
    assert!(y.truncate);

    // mla.md: 192^-0.5 · (0.1·ln 32 + 1)² = 0.130861. Tolerance: the reference is rounded to
    // 6 decimals and the result is f32.
    assert!(
        (cfg.softmax_scale() - 0.130_861).abs() < 1e-5,
        "{}",
        cfg.softmax_scale()
    );

    assert!(!cfg.is_moe_layer(0));
    assert!((1..61).all(|l| cfg.is_moe_layer(l)));
    Ok(())
}

#[test]
fn deepseek_v3_config_parses() -> anyhow::Result<()> {
    let cfg = ModelConfig::from_file(&fixture("deepseek_v3_config.json"))?;
    assert_eq!(cfg.model_type.as_deref(), Some("deepseek_v3"));
    assert_eq!(cfg.vocab_size, 129_280);
    assert_eq!(cfg.num_attention_heads, 128);
    assert_eq!(cfg.n_routed_experts, 256);
    assert_eq!((cfg.n_group, cfg.topk_group), (8, 4));
    assert_eq!(cfg.first_k_dense_replace, 3);
    assert_eq!(cfg.routed_scaling_factor, 2.5);
    assert_eq!(cfg.max_position_embeddings, 163_840);
    assert_eq!(cfg.num_nextn_predict_layers, 1);
    assert_eq!(cfg.bos_token_id, Some(0));
    assert_eq!(cfg.eos_token_ids, vec![1]);
    assert!(cfg.quantization.is_some());
    assert_eq!(cfg.rope.theta, 10_000.0);
    let y = yarn(&cfg)?;
    assert_eq!(y.factor, 40.0);
    assert_eq!((y.beta_fast, y.beta_slow), (32.0, 1.0));
    // mla.md: 0.135234, same tolerance reasoning as for K2.
    assert!(
        (cfg.softmax_scale() - 0.135_234).abs() < 1e-5,
        "{}",
        cfg.softmax_scale()
    );
    assert!(!cfg.is_moe_layer(2));
    assert!(cfg.is_moe_layer(3));
    assert!(cfg.is_moe_layer(60));
    Ok(())
}

#[test]
fn transformers5_rope_parameters_equal_legacy_rope_scaling() -> anyhow::Result<()> {
    let legacy = ModelConfig::from_file(&fixture("kimi_k2_config.json"))?;
    // The same config as transformers 5.x saves it.
    let modern = k2_with(|v| {
        let map = v.as_object_mut().expect("fixture is an object");
        map.remove("rope_scaling");
        map.remove("rope_theta");
        map.remove("torch_dtype");
        map.insert("dtype".into(), json!("bfloat16"));
        map.insert(
            "rope_parameters".into(),
            json!({
                "beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                "rope_theta": 50000.0, "rope_type": "yarn", "type": "yarn"
            }),
        );
    })??;
    assert_eq!(modern, legacy);
    Ok(())
}

#[test]
fn rope_defaults() -> anyhow::Result<()> {
    // No RoPE fields at all: plain RoPE, theta 1e4.
    let cfg = k2_with(|v| {
        let map = v.as_object_mut().expect("fixture is an object");
        map.remove("rope_scaling");
        map.remove("rope_theta");
    })??;
    assert_eq!(cfg.rope.scaling, RopeScaling::None);
    assert_eq!(cfg.rope.theta, 10_000.0);
    assert!((cfg.softmax_scale() - 192f32.powf(-0.5)).abs() < 1e-7);

    // rope_type "default" is plain too; YaRN defaults fill absent fields.
    let cfg = k2_with(|v| v["rope_parameters"] = json!({"rope_type": "default"}))??;
    assert_eq!(cfg.rope.scaling, RopeScaling::None);
    let cfg = k2_with(|v| {
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        v["rope_interleave"] = json!(false);
    })??;
    let y = yarn(&cfg)?;
    assert_eq!((y.beta_fast, y.beta_slow), (32.0, 1.0));
    assert_eq!(y.original_max_position_embeddings, 131_072);
    assert_eq!((y.mscale, y.mscale_all_dim), (None, None));
    assert!(y.truncate);
    assert!(!cfg.rope.interleaved);
    Ok(())
}

#[test]
fn optional_fields_and_eos_lists() -> anyhow::Result<()> {
    let cfg = k2_with(|v| {
        v["eos_token_id"] = json!([163_585, 163_586]);
        v["q_lora_rank"] = Value::Null;
        v["bos_token_id"] = Value::Null;
        let map = v.as_object_mut().expect("fixture is an object");
        map.remove("quantization_config");
        map.remove("moe_layer_freq");
    })??;
    assert_eq!(cfg.eos_token_ids, vec![163_585, 163_586]);
    assert_eq!(cfg.q_lora_rank, None);
    assert_eq!(cfg.bos_token_id, None);
    assert_eq!(cfg.quantization, None);
    assert_eq!(cfg.moe_layer_freq, 1);
    Ok(())
}

#[test]
fn unsupported_architecture_is_named() -> anyhow::Result<()> {
    let result = k2_with(|v| v["architectures"] = json!(["LlamaForCausalLM"]))?;
    match result {
        Err(e @ CardError::UnsupportedArchitecture(_)) => {
            assert!(e.to_string().contains("LlamaForCausalLM"), "{e}");
        }
        other => anyhow::bail!("expected UnsupportedArchitecture, got {other:?}"),
    }
    assert_config_err(
        k2_with(|v| v["model_type"] = json!("llama"))?,
        "model_type",
        &["\"llama\""],
    )
}

#[test]
fn missing_file_and_bad_json() -> anyhow::Result<()> {
    let path = fixture("no_such_config.json");
    match ModelConfig::from_file(&path) {
        Err(CardError::MissingFile(p)) => assert_eq!(p, path),
        other => anyhow::bail!("expected MissingFile, got {other:?}"),
    }
    match ModelConfig::from_json_str("{\"hidden_size\": 7168,") {
        Err(e @ CardError::Config { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains("invalid JSON") && text.contains("line 1"),
                "{text}"
            );
        }
        other => anyhow::bail!("expected a Config error, got {other:?}"),
    }
    Ok(())
}

#[test]
fn bad_values_name_field_value_and_limit() -> anyhow::Result<()> {
    assert_config_err(
        k2_with(|v| v["scoring_func"] = json!("softmax"))?,
        "scoring_func",
        &["\"softmax\"", "sigmoid"],
    )?;
    assert_config_err(
        k2_with(|v| v["topk_method"] = json!("greedy"))?,
        "topk_method",
        &["\"greedy\"", "noaux_tc"],
    )?;
    assert_config_err(
        k2_with(|v| v["num_experts_per_tok"] = json!(385))?,
        "num_experts_per_tok",
        &["385", "384"],
    )?;
    assert_config_err(
        k2_with(|v| v["hidden_act"] = json!("gelu"))?,
        "hidden_act",
        &["gelu"],
    )?;
    assert_config_err(
        k2_with(|v| v["attention_bias"] = json!(true))?,
        "attention_bias",
        &["true"],
    )?;
    assert_config_err(
        k2_with(|v| v["n_group"] = json!(5))?,
        "n_group",
        &["5", "384"],
    )?;
    assert_config_err(
        k2_with(|v| {
            v["n_group"] = json!(8);
            v["topk_group"] = json!(9);
        })?,
        "topk_group",
        &["9", "8"],
    )?;
    assert_config_err(
        k2_with(|v| v["qk_rope_head_dim"] = json!(63))?,
        "qk_rope_head_dim",
        &["63", "even"],
    )?;
    assert_config_err(
        k2_with(|v| v["num_key_value_heads"] = json!(8))?,
        "num_key_value_heads",
        &["8", "64"],
    )?;
    assert_config_err(
        k2_with(|v| v["hidden_size"] = json!(0))?,
        "hidden_size",
        &["> 0", "0"],
    )?;
    assert_config_err(
        k2_with(|v| v["vocab_size"] = json!("big"))?,
        "vocab_size",
        &["\"big\""],
    )?;
    assert_config_err(
        k2_with(|v| {
            v.as_object_mut().expect("object").remove("kv_lora_rank");
        })?,
        "kv_lora_rank",
        &["missing"],
    )?;
    assert_config_err(
        k2_with(|v| v["eos_token_id"] = json!(163_840))?,
        "eos_token_id",
        &["163840", "vocab_size"],
    )?;
    assert_config_err(
        k2_with(|v| v["rope_scaling"]["type"] = json!("linear"))?,
        "rope_scaling.type",
        &["\"linear\""],
    )?;
    assert_config_err(
        k2_with(|v| {
            v["rope_parameters"] = json!({"rope_type": "longrope", "rope_theta": 1e4});
        })?,
        "rope_parameters.rope_type",
        &["\"longrope\""],
    )?;
    assert_config_err(
        k2_with(|v| v["rope_scaling"]["factor"] = json!(-2.0))?,
        "rope_scaling.factor",
        &["-2"],
    )?;
    assert_config_err(
        k2_with(|v| v["quantization_config"] = json!({"quant_method": "compressed-tensors"}))?,
        "quantization_config.quant_method",
        &["\"compressed-tensors\"", "fp8"],
    )?;
    assert_config_err(
        k2_with(|v| v["quantization_config"]["weight_block_size"] = json!([64, 64]))?,
        "quantization_config.weight_block_size",
        &["[64,64]", "128"],
    )
}

#[test]
fn deepseek_v2_configs_parse_with_softmax_routing_and_name_bad_fields() -> anyhow::Result<()> {
    use ferry_modelcard::config::Scoring;
    // Kimi K2's shapes under DeepSeek-V2's architecture and routing.
    let v2 = |edit: fn(&mut Value)| {
        k2_with(|v| {
            v["architectures"] = json!(["DeepseekV2ForCausalLM"]);
            v["model_type"] = json!("deepseek_v2");
            v["scoring_func"] = json!("softmax");
            v["topk_method"] = json!("group_limited_greedy");
            v["n_group"] = json!(8);
            v["topk_group"] = json!(4);
            edit(v);
        })
    };
    let grouped = v2(|_| {})??;
    assert_eq!(grouped.scoring, Scoring::Softmax);
    assert_eq!(
        (grouped.n_group, grouped.topk_group),
        (8, 4),
        "group-limited keeps the config's groups"
    );
    // `greedy` ignores groups; an absent `scoring_func` is V2's softmax.
    let greedy = v2(|v| {
        v["topk_method"] = json!("greedy");
        v.as_object_mut().unwrap().remove("scoring_func");
    })??;
    assert_eq!(
        (greedy.scoring, greedy.n_group, greedy.topk_group),
        (Scoring::Softmax, 1, 1)
    );
    // V3's routing named under V2, and the other way round, are errors naming the field.
    assert_config_err(
        v2(|v| v["topk_method"] = json!("noaux_tc"))?,
        "topk_method",
        &["\"noaux_tc\"", "greedy"],
    )?;
    assert_config_err(
        v2(|v| v["scoring_func"] = json!("sigmoid"))?,
        "scoring_func",
        &["\"sigmoid\"", "softmax"],
    )?;
    assert_eq!(k2_with(|_| {})??.scoring, Scoring::Sigmoid);
    Ok(())
}
