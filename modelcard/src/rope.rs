//! Rotary-embedding parameters as a model's `config.json` states them (plain or YaRN).
//!
//! Pure data plus the two closed-form YaRN factors the attention scale needs; the rotary table
//! itself is built by `ferry_kernels::cpu::rope::Rope` from these.

/// YaRN parameters exactly as Hugging Face `rope_parameters` carries them for `rope_type = "yarn"`.
#[derive(Debug, Clone, PartialEq)]
pub struct YarnParams {
    /// Context-extension factor (`factor`).
    pub factor: f64,
    /// Pre-training context length (`original_max_position_embeddings`).
    pub original_max_position_embeddings: usize,
    /// Rotations bounding the extrapolated band (`beta_fast`, default 32).
    pub beta_fast: f64,
    /// Rotations bounding the interpolated band (`beta_slow`, default 1).
    pub beta_slow: f64,
    /// `mscale` (numerator of the cos/sin attention factor).
    pub mscale: Option<f64>,
    /// `mscale_all_dim` (denominator of the cos/sin factor; also squared into the softmax scale).
    pub mscale_all_dim: Option<f64>,
    /// Explicit cos/sin attention factor; derived from the mscales when absent.
    pub attention_factor: Option<f64>,
    /// Round the correction range to whole dimensions (`truncate`, default true).
    pub truncate: bool,
}

/// How rotary frequencies are scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// YaRN (DeepSeek-V3, Kimi K2).
    Yarn(YarnParams),
}

/// Everything needed to build a rotary table.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeParams {
    /// Rotated width per head (`qk_rope_head_dim`, 64 for the DeepSeek-V3 family).
    pub dim: usize,
    /// Base wavelength (`rope_theta`).
    pub theta: f64,
    /// Frequency scaling.
    pub scaling: RopeScaling,
    /// DeepSeek's interleaved pair layout (`rope_interleave`, default true in transformers).
    pub interleaved: bool,
}

/// YaRN magnitude correction: `0.1 · m · ln(s) + 1` for `s > 1`, else 1.
pub fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// Multiplier on `qk_head_dim^-0.5` for the attention softmax scale: `mscale(factor,
/// mscale_all_dim)²` for YaRN with a non-zero `mscale_all_dim` (DeepSeek-V3: ≈ 1.874), else 1.
pub fn softmax_scale_multiplier(params: &RopeParams) -> f64 {
    match &params.scaling {
        RopeScaling::Yarn(YarnParams {
            factor,
            mscale_all_dim: Some(all),
            ..
        }) if *all != 0.0 => {
            let m = yarn_mscale(*factor, *all);
            m * m
        }
        _ => 1.0,
    }
}
