//! Weights → a [`DeepseekModel`], every tensor checked against the config's shapes.
//!
//! Tensor names are those of DeepSeek-V3 / Kimi K2 checkpoints on disk (one tensor per expert
//! projection: `mlp.experts.{e}.gate_proj.weight`), which is also how the embedded model is
//! saved. MTP layers (`model.layers.{num_hidden_layers}.*`) are ignored.

use std::path::Path;

use ferry_kernels::backend::mlp::Dense;
use ferry_kernels::backend::moe::Moe;
use ferry_kernels::backend::{Backend, Tensor, Weight};
use ferry_kernels::cpu::gemm::Matrix;
use ferry_kernels::cpu::mla::MlaDims;
use ferry_kernels::cpu::mlp::GatedMlp;
use ferry_kernels::cpu::moe::{MoeLayer, MoeRouting, RouteScoring};
use ferry_kernels::cpu::rope::Rope;
use rayon::prelude::*;

use super::{DeepseekModel, Ffn, Layer, MlaWeights, QueryProj};
use crate::config::ModelConfig;
use crate::weights::{TensorSource, Weights};
use crate::ModelError;

impl DeepseekModel {
    /// Loads `config.json` and the safetensors weights from a Hugging Face model directory.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        if !dir.is_dir() {
            return Err(ModelError::missing_file(dir.to_path_buf()));
        }
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let weights = Weights::open(dir)?;
        Self::from_weights(config, &weights)
    }

    /// Builds the model from an already-open checkpoint.
    pub fn from_weights(config: ModelConfig, w: &Weights) -> Result<Self, ModelError> {
        Self::from_source(config, w)
    }

    /// `config.json` from `dir` and seeded random weights of its shapes on the host
    /// (`--load-format dummy`; [`crate::dummy`]).
    pub fn dummy(dir: &Path, seed: u64) -> Result<Self, ModelError> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        Self::from_source(config, &crate::dummy::DummyWeights::new(seed))
    }

    /// Builds the model from any tensor source: a checkpoint, or dummy weights.
    pub fn from_source(config: ModelConfig, w: &dyn TensorSource) -> Result<Self, ModelError> {
        let c = &config;
        let dims = MlaDims {
            heads: c.num_attention_heads,
            kv_lora_rank: c.kv_lora_rank,
            qk_nope_head_dim: c.qk_nope_head_dim,
            qk_rope_head_dim: c.qk_rope_head_dim,
            v_head_dim: c.v_head_dim,
        };
        let embed =
            Weight::Host(w.get_matrix("model.embed_tokens.weight", c.vocab_size, c.hidden_size)?);
        let layers = (0..c.num_hidden_layers)
            .into_par_iter()
            .map(|l| load_layer(c, &dims, w, l))
            .collect::<Result<Vec<_>, _>>()?;
        let norm = Tensor::Host(w.get_f32("model.norm.weight", &[c.hidden_size])?);
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(Weight::Host(w.get_matrix(
                "lm_head.weight",
                c.vocab_size,
                c.hidden_size,
            )?))
        };
        let rope = Rope::new(&c.rope)?;
        let scale = c.softmax_scale();
        Ok(Self {
            backend: Backend::Cpu,
            kernels: Default::default(),
            policy: Default::default(),
            prompt_chunk_floats: super::PROMPT_LOGITS_CHUNK_FLOATS,
            config,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            dims,
            scale,
        })
    }
}

fn load_layer(
    c: &ModelConfig,
    dims: &MlaDims,
    w: &dyn TensorSource,
    l: usize,
) -> Result<Layer, ModelError> {
    let p = format!("model.layers.{l}");
    let hidden = c.hidden_size;
    let heads = c.num_attention_heads;
    let q_out = heads * c.qk_head_dim();
    let mat = |name: &str, rows, cols| -> Result<Weight, ModelError> {
        Ok(Weight::Host(w.get_matrix(name, rows, cols)?))
    };
    let vec = |name: &str, len| -> Result<Tensor, ModelError> {
        Ok(Tensor::Host(w.get_f32(name, &[len])?))
    };
    let q = match c.q_lora_rank {
        Some(rank) => QueryProj::LowRank {
            a: mat(&format!("{p}.self_attn.q_a_proj.weight"), rank, hidden)?,
            norm: vec(&format!("{p}.self_attn.q_a_layernorm.weight"), rank)?,
            b: mat(&format!("{p}.self_attn.q_b_proj.weight"), q_out, rank)?,
        },
        None => QueryProj::Full(mat(&format!("{p}.self_attn.q_proj.weight"), q_out, hidden)?),
    };
    let attn = MlaWeights {
        q,
        kv_a: mat(
            &format!("{p}.self_attn.kv_a_proj_with_mqa.weight"),
            dims.latent_width(),
            hidden,
        )?,
        kv_a_norm: vec(
            &format!("{p}.self_attn.kv_a_layernorm.weight"),
            c.kv_lora_rank,
        )?,
        kv_b: mat(
            &format!("{p}.self_attn.kv_b_proj.weight"),
            heads * dims.kv_b_rows_per_head(),
            c.kv_lora_rank,
        )?,
        o: mat(
            &format!("{p}.self_attn.o_proj.weight"),
            hidden,
            heads * c.v_head_dim,
        )?,
    };
    let ffn = if c.is_moe_layer(l) {
        let experts = (0..c.n_routed_experts)
            .map(|e| {
                gated_mlp(
                    w,
                    &format!("{p}.mlp.experts.{e}"),
                    hidden,
                    c.moe_intermediate_size,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let shared = if c.n_shared_experts > 0 {
            Some(gated_mlp(
                w,
                &format!("{p}.mlp.shared_experts"),
                hidden,
                c.moe_intermediate_size * c.n_shared_experts,
            )?)
        } else {
            None
        };
        Ffn::Moe(Box::new(Moe::Host(MoeLayer {
            routing: MoeRouting {
                n_experts: c.n_routed_experts,
                top_k: c.num_experts_per_tok,
                n_group: c.n_group,
                topk_group: c.topk_group,
                norm_topk_prob: c.norm_topk_prob,
                routed_scaling_factor: c.routed_scaling_factor,
                scoring: match c.scoring {
                    crate::config::Scoring::Sigmoid => RouteScoring::Sigmoid,
                    crate::config::Scoring::Softmax => RouteScoring::Softmax,
                },
            },
            router: w.get_matrix(&format!("{p}.mlp.gate.weight"), c.n_routed_experts, hidden)?,
            // DeepSeek-V2's router has no correction bias.
            correction_bias: match c.scoring {
                crate::config::Scoring::Sigmoid => w.get_f32(
                    &format!("{p}.mlp.gate.e_score_correction_bias"),
                    &[c.n_routed_experts],
                )?,
                crate::config::Scoring::Softmax => vec![0.0; c.n_routed_experts],
            },
            experts,
            shared,
        })))
    } else {
        Ffn::Dense(Box::new(Dense::Host(gated_mlp(
            w,
            &format!("{p}.mlp"),
            hidden,
            c.intermediate_size,
        )?)))
    };
    Ok(Layer {
        input_norm: vec(&format!("{p}.input_layernorm.weight"), hidden)?,
        attn,
        post_norm: vec(&format!("{p}.post_attention_layernorm.weight"), hidden)?,
        ffn,
    })
}

fn gated_mlp(
    w: &dyn TensorSource,
    prefix: &str,
    hidden: usize,
    inter: usize,
) -> Result<GatedMlp, ModelError> {
    let m = |name: &str, rows, cols| -> Result<Matrix, ModelError> {
        w.get_matrix(&format!("{prefix}.{name}.weight"), rows, cols)
    };
    Ok(GatedMlp::new(
        m("gate_proj", inter, hidden)?,
        m("up_proj", inter, hidden)?,
        m("down_proj", hidden, inter)?,
    )?)
}
