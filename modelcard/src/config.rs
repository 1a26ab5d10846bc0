//! Hugging Face `config.json` → validated [`ModelConfig`].
//!
//! Parse, don't validate: [`ModelConfig`] can only be built through [`ModelConfig::from_json_str`]
//! (or [`ModelConfig::from_file`]), which checks every field the forward relies on, so code
//! holding a `ModelConfig` never re-checks it. Two architectures are accepted:
//! `DeepseekV3ForCausalLM` (DeepSeek-V3 and Kimi K2 ship under it, `model_type` `deepseek_v3` or
//! `kimi_k2`) and `DeepseekV2ForCausalLM` (DeepSeek-V2 and V2-Lite, `deepseek_v2`): the same MLA
//! and MoE blocks, told apart by their routing ([`Scoring`]).
//!
//! The JSON is read field by field rather than through `#[derive(Deserialize)]` so that every
//! error names its field, the value found and the limit, e.g.
//! ``config field `num_experts_per_tok`: must be <= n_routed_experts (8), got 9``.
//!
//! Defaults for absent fields follow transformers' `DeepseekV3Config` where the field is a
//! behavioural knob (`moe_layer_freq` 1, `norm_topk_prob` true, `rms_norm_eps` 1e-6,
//! `rope_theta` 1e4, `rope_interleave` true, `tie_word_embeddings` false); fields that fix tensor
//! shapes have no default and must be present, so a truncated config fails here rather than as a
//! confusing shape mismatch while loading weights. Absent `n_group`/`topk_group` mean ungrouped
//! routing (1/1).
//!
//! RoPE is read in both spellings transformers accepts: the 5.x `rope_parameters` object
//! (`rope_type`, `rope_theta`, `factor`, …) and the legacy top-level `rope_theta` plus
//! `rope_scaling` object (`type` or `rope_type`).
use std::path::Path;

use crate::rope::{softmax_scale_multiplier, RopeParams, RopeScaling, YarnParams};
use serde_json::{Map, Value};

use crate::error::CardError;

/// The DeepSeek-V3 architecture (DeepSeek-V3, Kimi K2).
pub const ARCHITECTURE: &str = "DeepseekV3ForCausalLM";

/// The DeepSeek-V2 architecture (DeepSeek-V2, V2-Lite): the same MLA and MoE blocks, with
/// softmax routing ([`Scoring::Softmax`]).
pub const ARCHITECTURE_V2: &str = "DeepseekV2ForCausalLM";

/// `model_type` values accepted with [`ARCHITECTURE`] / [`ARCHITECTURE_V2`].
pub const MODEL_TYPES: [&str; 3] = ["deepseek_v3", "kimi_k2", "deepseek_v2"];

/// How a MoE router scores and picks experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    /// DeepSeek-V3 (`scoring_func: "sigmoid"`, `topk_method: "noaux_tc"`): sigmoid scores, the
    /// `e_score_correction_bias` added for the choice only, groups scored by their two best,
    /// weights renormalised when `norm_topk_prob`.
    Sigmoid,
    /// DeepSeek-V2 (`topk_method: "greedy"` or `"group_limited_greedy"`), as transformers'
    /// `DeepseekV2TopkRouter`: softmax scores, no bias, groups scored by their best (only when
    /// group-limited), weights never renormalised.
    Softmax,
}

/// Side of the square weight blocks that share one fp8 scale (`weight_block_size`).
pub const FP8_BLOCK: usize = 128;

/// DeepSeek's fp8 checkpoint format: e4m3fn weights, one f32 `weight_scale_inv` per
/// `block_rows × block_cols` block (`quantization_config.quant_method = "fp8"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8BlockQuant {
    /// Rows per scale block (`weight_block_size[0]`, always 128 here).
    pub block_rows: usize,
    /// Columns per scale block (`weight_block_size[1]`, always 128 here).
    pub block_cols: usize,
}

/// A validated DeepSeek-V3-family model configuration.
///
/// Field names follow `config.json`. Invariants established by the parser:
/// every size is > 0, `qk_rope_head_dim` is even, `n_routed_experts` is a multiple of `n_group`,
/// `topk_group <= n_group`, `num_experts_per_tok` experts can be picked from `topk_group` groups,
/// special token ids are inside the vocabulary.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `model_type` as written (`deepseek_v3` or `kimi_k2`), if present.
    pub model_type: Option<String>,
    /// Vocabulary rows of the embedding and LM head.
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// Dense MLP width (layers before `first_k_dense_replace`).
    pub intermediate_size: usize,
    /// Width of each routed and shared expert (0 for a dense-only model).
    pub moe_intermediate_size: usize,
    /// Decoder layers (MTP layers excluded).
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Query low-rank width; `None` means a full-rank `q_proj` (DeepSeek-V2-Lite style).
    pub q_lora_rank: Option<usize>,
    /// Width of the compressed KV latent (512 for the whole family).
    pub kv_lora_rank: usize,
    /// Per-head query/key width that is not rotated.
    pub qk_nope_head_dim: usize,
    /// Per-head query/key width that is rotated (shared across heads for keys).
    pub qk_rope_head_dim: usize,
    /// Per-head value width.
    pub v_head_dim: usize,
    /// Routed experts per MoE layer (0 for a dense-only model).
    pub n_routed_experts: usize,
    /// Always-active shared experts per MoE layer.
    pub n_shared_experts: usize,
    /// Routed experts chosen per token.
    pub num_experts_per_tok: usize,
    /// Expert groups for group-limited routing (1 = ungrouped).
    pub n_group: usize,
    /// Groups kept per token before the expert top-k.
    pub topk_group: usize,
    /// Leading layers that use the dense MLP instead of MoE.
    pub first_k_dense_replace: usize,
    /// Every `moe_layer_freq`-th layer (from `first_k_dense_replace` on) is MoE.
    pub moe_layer_freq: usize,
    /// Renormalise the chosen experts' gate weights to sum to 1.
    pub norm_topk_prob: bool,
    /// Multiplier on the routed experts' combined output.
    pub routed_scaling_factor: f32,
    /// How the router scores experts (the architecture's routing).
    pub scoring: Scoring,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Longest context the model supports.
    pub max_position_embeddings: usize,
    /// Multi-token-prediction layers stored after the decoder layers (`num_nextn_predict_layers`).
    pub num_nextn_predict_layers: usize,
    /// Rotary embedding parameters (dim = `qk_rope_head_dim`).
    pub rope: RopeParams,
    /// Whether the LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token, if the model has one.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation (`eos_token_id`, an int or a list).
    pub eos_token_ids: Vec<u32>,
    /// Block-fp8 checkpoint format, when `quantization_config` says so.
    pub quantization: Option<Fp8BlockQuant>,
    /// Checkpoint dtype as written (`dtype` or `torch_dtype`), e.g. `bfloat16`.
    pub torch_dtype: Option<String>,
}

impl ModelConfig {
    /// Reads and validates `config.json` at `path`.
    ///
    /// A missing file is [`CardError::MissingFile`]; malformed JSON is a
    /// [`CardError::Config`] carrying serde's message (with line and column).
    pub fn from_file(path: &Path) -> Result<Self, CardError> {
        if !path.exists() {
            return Err(CardError::MissingFile(path.to_path_buf()));
        }
        let text = std::fs::read_to_string(path).map_err(|source| CardError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text)
    }

    /// Parses and validates the text of a `config.json`.
    pub fn from_json_str(json: &str) -> Result<Self, CardError> {
        let value: Value = serde_json::from_str(json)
            .map_err(|e| CardError::config("config.json", format!("invalid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(CardError::config(
                "config.json",
                "expected a JSON object at the top level",
            ));
        };
        parse(&Fields::new(&map, ""))
    }

    /// Query/key width per head: `qk_nope_head_dim + qk_rope_head_dim` (192 for the family).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Attention softmax scale: `qk_head_dim^-0.5`, times YaRN's `mscale²` when YaRN sets
    /// `mscale_all_dim` (transformers' `DeepseekV3Attention.scaling`; the factor comes from
    /// the kernels crate, which owns RoPE). 0.135234 for DeepSeek-V3, 0.130861 for Kimi K2.
    pub fn softmax_scale(&self) -> f32 {
        let base = (self.qk_head_dim() as f64).powf(-0.5);
        (base * softmax_scale_multiplier(&self.rope)) as f32
    }

    /// Whether decoder layer `layer` uses the MoE block rather than the dense MLP.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.n_routed_experts > 0
            && layer >= self.first_k_dense_replace
            && layer % self.moe_layer_freq == 0
    }

    /// Width of one cached latent row: `kv_lora_rank + qk_rope_head_dim` (576 for the family).
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Weights of the model (MTP layers excluded): `(total, active per token)`. Active counts
    /// every weight a decode step reads for one token — attention, dense MLPs, the router, the
    /// shared experts and `num_experts_per_tok` routed experts, the LM head — but one row of
    /// the embedding: what bounds single-stream decode by memory bandwidth.
    pub fn parameter_counts(&self) -> (u64, u64) {
        let (h, heads) = (self.hidden_size as u64, self.num_attention_heads as u64);
        let qk = (self.qk_nope_head_dim + self.qk_rope_head_dim) as u64;
        let q = match self.q_lora_rank {
            Some(r) => r as u64 * h + r as u64 + heads * qk * r as u64,
            None => heads * qk * h,
        };
        let kv_lora = self.kv_lora_rank as u64;
        let attn = q
            + self.latent_width() as u64 * h
            + kv_lora
            + heads * (self.qk_nope_head_dim + self.v_head_dim) as u64 * kv_lora
            + h * heads * self.v_head_dim as u64
            + 2 * h;
        let expert = 3 * self.moe_intermediate_size as u64 * h;
        let (mut total, mut active) = (0u64, 0u64);
        for l in 0..self.num_hidden_layers {
            total += attn;
            active += attn;
            if self.is_moe_layer(l) {
                let e = self.n_routed_experts as u64;
                // The router, and V3's correction bias.
                let bias = if self.scoring == Scoring::Sigmoid {
                    e
                } else {
                    0
                };
                let shared = expert * self.n_shared_experts as u64 + e * h + bias;
                total += shared + e * expert;
                active += shared + self.num_experts_per_tok as u64 * expert;
            } else {
                let dense = 3 * self.intermediate_size as u64 * h;
                total += dense;
                active += dense;
            }
        }
        let vocab = self.vocab_size as u64 * h;
        let head = if self.tie_word_embeddings { 0 } else { vocab };
        total += vocab + head + h;
        active +=
            h + if self.tie_word_embeddings {
                vocab
            } else {
                head
            } + h;
        (total, active)
    }
}

fn parse(f: &Fields<'_>) -> Result<ModelConfig, CardError> {
    let v2 = check_architecture(f)?;
    let model_type = f.opt_str("model_type")?;
    if let Some(t) = &model_type {
        if !MODEL_TYPES.contains(&t.as_str()) {
            return Err(f.err(
                "model_type",
                format!("must be one of {MODEL_TYPES:?}, got {t:?}"),
            ));
        }
    }

    // Features of other model families that the forward does not implement.
    let (scoring, group_limited) = if v2 {
        f.require_str("scoring_func", "softmax", "DeepSeek-V2 routing")?;
        match f.opt_str("topk_method")?.as_deref() {
            None | Some("greedy") => (Scoring::Softmax, false),
            Some("group_limited_greedy") => (Scoring::Softmax, true),
            Some(other) => {
                return Err(f.err(
                    "topk_method",
                    format!(
                        "must be \"greedy\" or \"group_limited_greedy\" (DeepSeek-V2 routing), got {other:?}"
                    ),
                ))
            }
        }
    } else {
        f.require_str("scoring_func", "sigmoid", "DeepSeek-V3 routing")?;
        f.require_str(
            "topk_method",
            "noaux_tc",
            "sigmoid scores plus e_score_correction_bias",
        )?;
        (Scoring::Sigmoid, true)
    };
    f.require_str("hidden_act", "silu", "SwiGLU experts")?;
    if f.opt_bool("attention_bias")?.unwrap_or(false) {
        return Err(f.err(
            "attention_bias",
            "must be false: MLA projections have no bias, got true",
        ));
    }

    let vocab_size = f.positive("vocab_size")?;
    let hidden_size = f.positive("hidden_size")?;
    let intermediate_size = f.positive("intermediate_size")?;
    let num_hidden_layers = f.positive("num_hidden_layers")?;
    let num_attention_heads = f.positive("num_attention_heads")?;
    if let Some(kv_heads) = f.opt_usize("num_key_value_heads")? {
        if kv_heads != num_attention_heads {
            return Err(f.err(
                "num_key_value_heads",
                format!(
                    "must equal num_attention_heads ({num_attention_heads}) for MLA, got {kv_heads}"
                ),
            ));
        }
    }
    let q_lora_rank = match f.opt_usize("q_lora_rank")? {
        Some(0) => return Err(f.err("q_lora_rank", "must be > 0 or null, got 0")),
        other => other,
    };
    let kv_lora_rank = f.positive("kv_lora_rank")?;
    let qk_nope_head_dim = f.positive("qk_nope_head_dim")?;
    let qk_rope_head_dim = f.positive("qk_rope_head_dim")?;
    if qk_rope_head_dim % 2 != 0 {
        return Err(f.err(
            "qk_rope_head_dim",
            format!("must be even (RoPE rotates pairs), got {qk_rope_head_dim}"),
        ));
    }
    let v_head_dim = f.positive("v_head_dim")?;
    let max_position_embeddings = f.positive("max_position_embeddings")?;

    let mut moe = parse_moe(f, num_hidden_layers)?;
    if !group_limited {
        // Greedy routing ignores groups: one group holding every expert.
        moe.n_group = 1;
        moe.topk_group = 1;
    }

    let rms_norm_eps = f.positive_f64("rms_norm_eps", Some(1e-6))?;
    let num_nextn_predict_layers = f.opt_usize("num_nextn_predict_layers")?.unwrap_or(0);
    let rope = parse_rope(f, qk_rope_head_dim, max_position_embeddings)?;
    let tie_word_embeddings = f.opt_bool("tie_word_embeddings")?.unwrap_or(false);

    let bos_token_id = match f.get("bos_token_id") {
        None => None,
        Some(v) => Some(token_id(f, "bos_token_id", v, vocab_size)?),
    };
    let eos_token_ids = match f.get("eos_token_id") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| token_id(f, "eos_token_id", v, vocab_size))
            .collect::<Result<Vec<_>, _>>()?,
        Some(v) => vec![token_id(f, "eos_token_id", v, vocab_size)?],
    };
    let quantization = parse_quantization(f)?;
    let torch_dtype = match f.opt_str("dtype")? {
        Some(d) => Some(d),
        None => f.opt_str("torch_dtype")?,
    };

    Ok(ModelConfig {
        model_type,
        vocab_size,
        hidden_size,
        intermediate_size,
        moe_intermediate_size: moe.moe_intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        q_lora_rank,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        n_routed_experts: moe.n_routed_experts,
        n_shared_experts: moe.n_shared_experts,
        num_experts_per_tok: moe.num_experts_per_tok,
        n_group: moe.n_group,
        topk_group: moe.topk_group,
        first_k_dense_replace: moe.first_k_dense_replace,
        moe_layer_freq: moe.moe_layer_freq,
        norm_topk_prob: moe.norm_topk_prob,
        routed_scaling_factor: moe.routed_scaling_factor,
        scoring,
        rms_norm_eps: rms_norm_eps as f32,
        max_position_embeddings,
        num_nextn_predict_layers,
        rope,
        tie_word_embeddings,
        bos_token_id,
        eos_token_ids,
        quantization,
        torch_dtype,
    })
}

/// Which architecture the config names: `Ok(true)` for [`ARCHITECTURE_V2`].
fn check_architecture(f: &Fields<'_>) -> Result<bool, CardError> {
    let Some(value) = f.get("architectures") else {
        return Err(f.err(
            "architectures",
            format!("missing; expected [\"{ARCHITECTURE}\"]"),
        ));
    };
    let Value::Array(items) = value else {
        return Err(f.err(
            "architectures",
            format!("must be a list of strings, got {value}"),
        ));
    };
    let names: Vec<&str> = items.iter().filter_map(Value::as_str).collect();
    if names.contains(&ARCHITECTURE) {
        return Ok(false);
    }
    if names.contains(&ARCHITECTURE_V2) {
        return Ok(true);
    }
    if names.is_empty() {
        return Err(f.err(
            "architectures",
            format!("expected [\"{ARCHITECTURE}\"], got {value}"),
        ));
    }
    Err(CardError::UnsupportedArchitecture(names.join(", ")))
}

/// The MoE part of the config, validated together because its limits refer to each other.
struct Moe {
    n_routed_experts: usize,
    n_shared_experts: usize,
    num_experts_per_tok: usize,
    moe_intermediate_size: usize,
    n_group: usize,
    topk_group: usize,
    first_k_dense_replace: usize,
    moe_layer_freq: usize,
    norm_topk_prob: bool,
    routed_scaling_factor: f32,
}

fn parse_moe(f: &Fields<'_>, num_hidden_layers: usize) -> Result<Moe, CardError> {
    let n_routed_experts = f.opt_usize("n_routed_experts")?.unwrap_or(0);
    let moe_layer_freq = f.opt_usize("moe_layer_freq")?.unwrap_or(1);
    if moe_layer_freq == 0 {
        return Err(f.err("moe_layer_freq", "must be > 0, got 0"));
    }
    let first_k_dense_replace = f.opt_usize("first_k_dense_replace")?.unwrap_or(0);
    if first_k_dense_replace > num_hidden_layers {
        return Err(f.err(
            "first_k_dense_replace",
            format!(
                "must be <= num_hidden_layers ({num_hidden_layers}), got {first_k_dense_replace}"
            ),
        ));
    }
    let norm_topk_prob = f.opt_bool("norm_topk_prob")?.unwrap_or(true);
    if n_routed_experts == 0 {
        // A dense-only model: no expert field is consulted.
        return Ok(Moe {
            n_routed_experts,
            n_shared_experts: 0,
            num_experts_per_tok: 0,
            moe_intermediate_size: 0,
            n_group: 1,
            topk_group: 1,
            first_k_dense_replace,
            moe_layer_freq,
            norm_topk_prob,
            routed_scaling_factor: 1.0,
        });
    }
    let num_experts_per_tok = f.positive("num_experts_per_tok")?;
    let moe_intermediate_size = f.positive("moe_intermediate_size")?;
    let n_shared_experts = f.opt_usize("n_shared_experts")?.unwrap_or(0);
    let n_group = f.opt_usize("n_group")?.unwrap_or(1);
    let topk_group = f.opt_usize("topk_group")?.unwrap_or(1);
    if n_group == 0 {
        return Err(f.err("n_group", "must be > 0, got 0"));
    }
    if topk_group == 0 {
        return Err(f.err("topk_group", "must be > 0, got 0"));
    }
    if n_routed_experts % n_group != 0 {
        return Err(f.err(
            "n_group",
            format!("must divide n_routed_experts ({n_routed_experts}), got {n_group}"),
        ));
    }
    if topk_group > n_group {
        return Err(f.err(
            "topk_group",
            format!("must be <= n_group ({n_group}), got {topk_group}"),
        ));
    }
    if num_experts_per_tok > n_routed_experts {
        return Err(f.err(
            "num_experts_per_tok",
            format!("must be <= n_routed_experts ({n_routed_experts}), got {num_experts_per_tok}"),
        ));
    }
    let reachable = topk_group * (n_routed_experts / n_group);
    if num_experts_per_tok > reachable {
        return Err(f.err(
            "num_experts_per_tok",
            format!(
                "must be <= topk_group × experts per group ({reachable}), got {num_experts_per_tok}"
            ),
        ));
    }
    let routed_scaling_factor = f.positive_f64("routed_scaling_factor", None)?;
    Ok(Moe {
        n_routed_experts,
        n_shared_experts,
        num_experts_per_tok,
        moe_intermediate_size,
        n_group,
        topk_group,
        first_k_dense_replace,
        moe_layer_freq,
        norm_topk_prob,
        routed_scaling_factor: routed_scaling_factor as f32,
    })
}

/// RoPE from `rope_parameters` (transformers 5.x) or `rope_theta` + `rope_scaling` (legacy).
fn parse_rope(
    f: &Fields<'_>,
    dim: usize,
    max_position_embeddings: usize,
) -> Result<RopeParams, CardError> {
    let interleaved = f.opt_bool("rope_interleave")?.unwrap_or(true);
    let top_theta = f.opt_f64("rope_theta")?;
    let (params, theta) = match f.object("rope_parameters")? {
        Some(p) => {
            let theta = p.opt_f64("rope_theta")?.or(top_theta);
            (Some(p), theta)
        }
        None => (f.object("rope_scaling")?, top_theta),
    };
    let theta = theta.unwrap_or(10_000.0);
    if !(theta.is_finite() && theta > 0.0) {
        return Err(f.err("rope_theta", format!("must be finite and > 0, got {theta}")));
    }
    let scaling = match params {
        None => RopeScaling::None,
        Some(p) => {
            let (type_key, rope_type) = match p.opt_str("rope_type")? {
                Some(t) => ("rope_type", Some(t)),
                None => ("type", p.opt_str("type")?),
            };
            match rope_type.as_deref() {
                None | Some("default") => RopeScaling::None,
                Some("yarn") => RopeScaling::Yarn(parse_yarn(&p, max_position_embeddings)?),
                Some(other) => {
                    return Err(p.err(
                        type_key,
                        format!(
                            "unsupported RoPE scaling {other:?}: only \"default\" and \"yarn\""
                        ),
                    ))
                }
            }
        }
    };
    Ok(RopeParams {
        dim,
        theta,
        scaling,
        interleaved,
    })
}

fn parse_yarn(p: &Fields<'_>, max_position_embeddings: usize) -> Result<YarnParams, CardError> {
    let factor = p.positive_f64("factor", None)?;
    let original_max_position_embeddings = p
        .opt_usize("original_max_position_embeddings")?
        .unwrap_or(max_position_embeddings);
    if original_max_position_embeddings == 0 {
        return Err(p.err("original_max_position_embeddings", "must be > 0, got 0"));
    }
    let beta_fast = p.positive_f64("beta_fast", Some(32.0))?;
    let beta_slow = p.positive_f64("beta_slow", Some(1.0))?;
    Ok(YarnParams {
        factor,
        original_max_position_embeddings,
        beta_fast,
        beta_slow,
        mscale: p.opt_f64("mscale")?,
        mscale_all_dim: p.opt_f64("mscale_all_dim")?,
        attention_factor: p.opt_f64("attention_factor")?,
        truncate: p.opt_bool("truncate")?.unwrap_or(true),
    })
}

fn parse_quantization(f: &Fields<'_>) -> Result<Option<Fp8BlockQuant>, CardError> {
    let Some(q) = f.object("quantization_config")? else {
        return Ok(None);
    };
    let method = q.opt_str("quant_method")?;
    if method.as_deref() != Some("fp8") {
        return Err(q.err(
            "quant_method",
            format!(
                "only DeepSeek's block fp8 (\"fp8\") is supported, got {}",
                method.map_or_else(|| "nothing".to_string(), |m| format!("{m:?}"))
            ),
        ));
    }
    if let Some(fmt) = q.opt_str("fmt")? {
        if fmt != "e4m3" {
            return Err(q.err("fmt", format!("must be \"e4m3\", got {fmt:?}")));
        }
    }
    let block = match q.get("weight_block_size") {
        None => vec![FP8_BLOCK, FP8_BLOCK],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_u64().and_then(|n| usize::try_from(n).ok()))
            .collect::<Option<Vec<usize>>>()
            .unwrap_or_default(),
        Some(_) => Vec::new(),
    };
    if block != [FP8_BLOCK, FP8_BLOCK] {
        return Err(q.err(
            "weight_block_size",
            format!(
                "must be [{FP8_BLOCK}, {FP8_BLOCK}], got {}",
                q.get("weight_block_size")
                    .map_or_else(String::new, Value::to_string)
            ),
        ));
    }
    Ok(Some(Fp8BlockQuant {
        block_rows: FP8_BLOCK,
        block_cols: FP8_BLOCK,
    }))
}

fn token_id(f: &Fields<'_>, key: &str, v: &Value, vocab_size: usize) -> Result<u32, CardError> {
    let id = v
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| {
            f.err(
                key,
                format!("must be a token id (u32) or a list of them, got {v}"),
            )
        })?;
    if id as usize >= vocab_size {
        return Err(f.err(
            key,
            format!("must be < vocab_size ({vocab_size}), got {id}"),
        ));
    }
    Ok(id)
}

/// Typed, error-naming access to one JSON object; `prefix` is the dotted path of the object
/// (empty at the top level), so nested errors read `rope_scaling.factor`.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    prefix: String,
}

impl<'a> Fields<'a> {
    fn new(map: &'a Map<String, Value>, prefix: &str) -> Self {
        Self {
            map,
            prefix: prefix.to_string(),
        }
    }

    fn path(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.prefix)
        }
    }

    fn err(&self, key: &str, message: impl Into<String>) -> CardError {
        CardError::config(self.path(key), message)
    }

    /// The value at `key`; JSON `null` counts as absent.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, CardError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        // Accept integral floats (`4096.0`), which some exporters write.
        let n = match v.as_u64() {
            Some(n) => Some(n),
            None => v
                .as_f64()
                .filter(|x| x.fract() == 0.0 && *x >= 0.0 && *x <= u32::MAX as f64)
                .map(|x| x as u64),
        };
        n.and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| self.err(key, format!("must be a non-negative integer, got {v}")))
    }

    fn positive(&self, key: &str) -> Result<usize, CardError> {
        match self.opt_usize(key)? {
            None => Err(self.err(key, "missing")),
            Some(0) => Err(self.err(key, "must be > 0, got 0")),
            Some(n) => Ok(n),
        }
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>, CardError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_f64()
            .map(Some)
            .ok_or_else(|| self.err(key, format!("must be a number, got {v}")))
    }

    /// A finite number > 0; `default` when absent, or a "missing" error when there is none.
    fn positive_f64(&self, key: &str, default: Option<f64>) -> Result<f64, CardError> {
        let x = self
            .opt_f64(key)?
            .or(default)
            .ok_or_else(|| self.err(key, "missing"))?;
        if x.is_finite() && x > 0.0 {
            Ok(x)
        } else {
            Err(self.err(key, format!("must be finite and > 0, got {x}")))
        }
    }

    /// Errors unless the string at `key` is absent or equals `want` (`why` says what it means).
    fn require_str(&self, key: &str, want: &str, why: &str) -> Result<(), CardError> {
        match self.opt_str(key)? {
            Some(got) if got != want => {
                Err(self.err(key, format!("must be {want:?} ({why}), got {got:?}")))
            }
            _ => Ok(()),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, CardError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| self.err(key, format!("must be true or false, got {v}")))
    }

    fn opt_str(&self, key: &str) -> Result<Option<String>, CardError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_str()
            .map(|s| Some(s.to_string()))
            .ok_or_else(|| self.err(key, format!("must be a string, got {v}")))
    }

    fn object(&self, key: &str) -> Result<Option<Fields<'a>>, CardError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(Fields::new(m, &self.path(key)))),
            Some(v) => Err(self.err(key, format!("must be an object or null, got {v}"))),
        }
    }
}
