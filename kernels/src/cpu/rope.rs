//! Rotary position embeddings, plain and YaRN-scaled, with Hugging Face transformers semantics.
//!
//! [`Rope::new`] builds the per-pair inverse frequencies exactly as transformers'
//! `ROPE_INIT_FUNCTIONS` do (`default` and `yarn`), rounding to f32 where torch does;
//! [`Rope::apply`] rotates query or key slices in place, in DeepSeek's interleaved pair layout
//! (`apply_rotary_pos_emb_interleave`) or the `rotate_half` layout.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use super::gemm::check_len;
use crate::error::KernelError;

pub use ferry_modelcard::rope::{
    softmax_scale_multiplier, yarn_mscale, RopeParams, RopeScaling, YarnParams,
};

/// Where the rotated slice sits inside each head of a `[tokens][heads][head_stride]` buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RotaryLayout {
    /// Heads per token (1 for the shared MLA `k_pe`).
    pub heads: usize,
    /// Floats per head.
    pub head_stride: usize,
    /// First rotated element within a head (`qk_nope_head_dim` for MLA queries).
    pub offset: usize,
}

/// A rotary table: per-pair inverse frequencies and the cos/sin attention factor.
///
/// Each position's cos/sin rows are evaluated once (f64 `cos`/`sin`, ~13 ns a pair) and kept
/// ([`RowCache`], shared by clones): a step's tables (every verify row and prompt token, on
/// the target and on the drafter) are then copies of rows computed before.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    attention_factor: f32,
    dim: usize,
    interleaved: bool,
    rows: Arc<RowCache>,
}

impl PartialEq for Rope {
    /// The same table: frequencies, factor, width and layout (the cache is not compared).
    fn eq(&self, other: &Self) -> bool {
        self.inv_freq == other.inv_freq
            && self.attention_factor == other.attention_factor
            && self.dim == other.dim
            && self.interleaved == other.interleaved
    }
}

/// Positions per cached chunk of cos/sin rows.
const CHUNK: usize = 256;

/// Host memory the cache of one [`Rope`] may hold; positions past it are evaluated each time.
const CACHE_BYTES: usize = 64 << 20;

/// The cos/sin rows of a [`Rope`] computed so far: chunk `c` holds positions
/// `c·CHUNK .. (c+1)·CHUNK`, each as `dim / 2` cos then `dim / 2` sin.
#[derive(Debug, Default)]
struct RowCache {
    chunks: RwLock<HashMap<usize, Arc<[f32]>>>,
}

impl Rope {
    /// Builds the table exactly as transformers' `ROPE_INIT_FUNCTIONS` (`default` or `yarn`)
    /// does, including where it rounds to f32.
    pub fn new(params: &RopeParams) -> Result<Self, KernelError> {
        let dim = params.dim;
        if dim == 0 || dim % 2 != 0 {
            return Err(invalid("dim", "even and > 0", dim.to_string()));
        }
        if !(params.theta.is_finite() && params.theta > 1.0) {
            return Err(invalid("theta", "finite and > 1", params.theta.to_string()));
        }
        // pos_freqs = theta ** (arange(0, dim, 2).float() / dim), all in f32 as torch does.
        // The power is taken in f64 and rounded once (correctly rounded in practice), which
        // agrees with torch's f32 `pow` to within its last-ulp error.
        let theta32 = f64::from(params.theta as f32);
        let pos_freqs: Vec<f32> = (0..dim / 2)
            .map(|i| theta32.powf(f64::from((2 * i) as f32 / dim as f32)) as f32)
            .collect();
        let (inv_freq, attention_factor) = match &params.scaling {
            RopeScaling::None => (pos_freqs.iter().map(|p| 1.0 / p).collect(), 1.0),
            RopeScaling::Yarn(y) => yarn_table(&pos_freqs, dim, params.theta, y)?,
        };
        Ok(Self {
            inv_freq,
            attention_factor,
            dim,
            interleaved: params.interleaved,
            rows: Arc::default(),
        })
    }

    /// Rotated width per head.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Whether inputs use DeepSeek's interleaved pair layout.
    pub fn interleaved(&self) -> bool {
        self.interleaved
    }

    /// Inverse frequency of each rotated pair (`dim / 2` entries).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Factor that multiplies cos and sin (YaRN's `attention_scaling`; 1 for plain RoPE).
    pub fn attention_factor(&self) -> f32 {
        self.attention_factor
    }

    /// Fills `cos`/`sin` (`dim / 2` each) for one position: `freq = pos · inv_freq` in f32,
    /// then `cos(freq) · attention_factor` (the cos/sin are rounded once from f64). From the
    /// cache: bitwise [`Self::cos_sin_uncached`].
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) -> Result<(), KernelError> {
        check_len("rope_cos_sin", "cos", self.inv_freq.len(), cos.len())?;
        check_len("rope_cos_sin", "sin", self.inv_freq.len(), sin.len())?;
        let half = self.inv_freq.len();
        match self.chunk(pos / CHUNK) {
            Some(rows) => {
                let row = &rows[(pos % CHUNK) * 2 * half..][..2 * half];
                cos.copy_from_slice(&row[..half]);
                sin.copy_from_slice(&row[half..]);
            }
            None => self.evaluate(pos, cos, sin),
        }
        Ok(())
    }

    /// [`Self::cos_sin`] evaluated now, without the cache (what the cache holds; for tests
    /// and benchmarks).
    pub fn cos_sin_uncached(
        &self,
        pos: usize,
        cos: &mut [f32],
        sin: &mut [f32],
    ) -> Result<(), KernelError> {
        check_len("rope_cos_sin", "cos", self.inv_freq.len(), cos.len())?;
        check_len("rope_cos_sin", "sin", self.inv_freq.len(), sin.len())?;
        self.evaluate(pos, cos, sin);
        Ok(())
    }

    /// `cos`/`sin` of `pos`, evaluated (lengths checked by the caller).
    fn evaluate(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let p = pos as f32;
        for ((c, s), f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let freq = f64::from(p * f);
            *c = (freq.cos() as f32) * self.attention_factor;
            *s = (freq.sin() as f32) * self.attention_factor;
        }
    }

    /// Chunk `c`'s rows, computed on first use; `None` past [`CACHE_BYTES`] (or if the lock
    /// was poisoned: the caller evaluates).
    fn chunk(&self, c: usize) -> Option<Arc<[f32]>> {
        let half = self.inv_freq.len();
        let chunk_bytes = CHUNK * 2 * half * std::mem::size_of::<f32>();
        if c.saturating_add(1).saturating_mul(chunk_bytes) > CACHE_BYTES {
            return None;
        }
        if let Some(rows) = self.rows.chunks.read().ok()?.get(&c) {
            return Some(rows.clone());
        }
        let mut rows = vec![0.0f32; CHUNK * 2 * half];
        for (i, row) in rows.chunks_exact_mut(2 * half).enumerate() {
            let (cos, sin) = row.split_at_mut(half);
            self.evaluate(c * CHUNK + i, cos, sin);
        }
        let rows: Arc<[f32]> = rows.into();
        let mut chunks = self.rows.chunks.write().ok()?;
        Some(chunks.entry(c).or_insert(rows).clone())
    }

    /// Rotates `x[t][h][offset .. offset + dim]` in place for position `positions[t]`.
    ///
    /// Non-interleaved inputs get `rotate_half`. Interleaved inputs (DeepSeek's
    /// `apply_rotary_pos_emb_interleave`) are de-interleaved first, so the output holds the
    /// rotated even elements in its first half and the rotated odd ones in its second half.
    pub fn apply(
        &self,
        x: &mut [f32],
        positions: &[usize],
        layout: RotaryLayout,
    ) -> Result<(), KernelError> {
        let RotaryLayout {
            heads,
            head_stride,
            offset,
        } = layout;
        if offset + self.dim > head_stride {
            return Err(invalid(
                "offset + dim",
                "<= head_stride",
                format!("{} > {head_stride}", offset + self.dim),
            ));
        }
        check_len(
            "rope_apply",
            "x",
            positions.len() * heads * head_stride,
            x.len(),
        )?;
        let half = self.dim / 2;
        let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
        let mut tmp = vec![0.0f32; self.dim];
        let token_width = heads * head_stride;
        if token_width == 0 {
            return Ok(());
        }
        for (token, &pos) in x.chunks_exact_mut(token_width).zip(positions) {
            self.cos_sin(pos, &mut cos, &mut sin)?;
            for head in token.chunks_exact_mut(head_stride) {
                let v = &mut head[offset..offset + self.dim];
                if self.interleaved {
                    for j in 0..half {
                        tmp[j] = v[2 * j];
                        tmp[j + half] = v[2 * j + 1];
                    }
                } else {
                    tmp.copy_from_slice(v);
                }
                rotate_half(&tmp, &cos, &sin, v);
            }
        }
        Ok(())
    }
}

/// `out = x · cos + rotate_half(x) · sin`, rounded the way torch evaluates it.
fn rotate_half(x: &[f32], cos: &[f32], sin: &[f32], out: &mut [f32]) {
    let half = cos.len();
    for j in 0..half {
        let (x1, x2) = (x[j], x[j + half]);
        out[j] = x1 * cos[j] + (-x2) * sin[j];
        out[j + half] = x2 * cos[j] + x1 * sin[j];
    }
}

/// YaRN's `(inv_freq, attention_factor)` (transformers `_compute_yarn_parameters`).
fn yarn_table(
    pos_freqs: &[f32],
    dim: usize,
    theta: f64,
    y: &YarnParams,
) -> Result<(Vec<f32>, f32), KernelError> {
    if !(y.factor.is_finite() && y.factor > 0.0) {
        return Err(invalid("factor", "finite and > 0", y.factor.to_string()));
    }
    if y.original_max_position_embeddings == 0 {
        return Err(invalid(
            "original_max_position_embeddings",
            "> 0",
            "0".into(),
        ));
    }
    if !(y.beta_fast > 0.0 && y.beta_slow > 0.0) {
        return Err(invalid(
            "beta_fast, beta_slow",
            "> 0",
            format!("{}, {}", y.beta_fast, y.beta_slow),
        ));
    }
    let orig = y.original_max_position_embeddings as f64;
    let correction_dim = |rot: f64| {
        dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
    if y.truncate {
        low = low.floor();
        high = high.ceil();
    }
    let low = low.max(0.0);
    let mut high = high.min((dim - 1) as f64);
    if low == high {
        high += 0.001;
    }
    // torch: (arange(dim // 2).float() - low) / (high - low), clamped, in f32; the python
    // scalars become f32 operands.
    let (low32, span32) = (low as f32, (high - low) as f32);
    let factor = y.factor as f32;
    let inv_freq = pos_freqs
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let ramp = ((i as f32 - low32) / span32).clamp(0.0, 1.0);
            let extrap = 1.0 - ramp;
            let inv_extrap = 1.0 / p;
            let inv_interp = 1.0 / (factor * p);
            inv_interp * (1.0 - extrap) + inv_extrap * extrap
        })
        .collect();
    let attention_factor = match (y.attention_factor, y.mscale, y.mscale_all_dim) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
            yarn_mscale(y.factor, m) / yarn_mscale(y.factor, all)
        }
        _ => yarn_mscale(y.factor, 1.0),
    };
    Ok((inv_freq, attention_factor as f32))
}

fn invalid(field: &'static str, limit: &'static str, value: String) -> KernelError {
    KernelError::InvalidParam {
        op: "rope",
        field,
        limit,
        value,
    }
}
