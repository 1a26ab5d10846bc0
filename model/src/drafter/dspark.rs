//! The DSpark drafter: a DFlash block-diffusion backbone (arXiv 2602.06036) with DSpark's
//! Markov and confidence heads.
//!
//! Per drafter layer (Qwen3-style: pre-norm, q/k RMSNorm per head, plain RoPE, GQA, SwiGLU):
//!
//! - **context** rows (committed tokens) have K and V only: `K = RoPE(k_norm(k_proj(f)))`,
//!   `V = v_proj(f)` with `f = RMSNorm(fc(concat(target hidden states at target_layer_ids)))`.
//!   They are computed once per token ([`DsparkDrafter::extend_context`]) and cached in the
//!   drafter KV pool; context tokens have no queries and no MLP.
//! - **block** rows `[anchor, MASK × (B − 1)]` at positions `n..n + B` run the whole layer; their
//!   queries attend to every context row and to all B block rows (bidirectional).
//!
//! The final RMSNorm output goes through the target's LM head; the Markov head turns those
//! logits into the left-to-right draft distributions. Weights (safetensors, the names
//! `scripts/make_tiny_k3.py drafter` writes):
//!
//! | tensor | shape |
//! |---|---|
//! | `fc.weight` | `[hidden, hidden × taps]` |
//! | `hidden_norm.weight`, `norm.weight` | `[hidden]` |
//! | `layers.{i}.input_layernorm.weight`, `.post_attention_layernorm.weight` | `[hidden]` |
//! | `layers.{i}.self_attn.{q,k,v,o}_proj.weight` | `[H·d, hidden]`, `[KV·d, hidden]` ×2, `[hidden, H·d]` |
//! | `layers.{i}.self_attn.{q,k}_norm.weight` | `[d]` |
//! | `layers.{i}.mlp.{gate,up,down}_proj.weight` | SwiGLU |
//! | `markov_head.w1.weight`, `markov_head.w2.weight` | `[vocab, rank]` each |
//! | `confidence_head.weight`, `confidence_head.bias` | `[1, hidden + rank]`, `[1]` |

use std::path::Path;

use ferry_kernels::cpu::gemm::{linear, Matrix};
use ferry_kernels::cpu::mlp::GatedMlp;
use ferry_kernels::cpu::norm::rms_norm_inplace;
use ferry_kernels::cpu::rope::{Rope, RopeParams, RopeScaling, RotaryLayout};
use ferry_kernels::cpu::sample::{argmax, probs_from_logits, sample_from_probs};
use rayon::prelude::*;

use super::heads::{ConfidenceHead, MarkovHead};
use super::{
    ContextRows, DraftCtx, DraftDist, DraftInput, DraftKvLayout, DraftRows, Drafter, DrafterConfig,
    Proposal,
};
use crate::config::ModelConfig;
use crate::deepseek::DeepseekModel;
use crate::kv::KvPool;
use crate::weights::Weights;
use crate::ModelError;

/// One drafter decoder layer.
#[derive(Debug)]
struct DraftLayer {
    input_norm: Vec<f32>,
    q: Matrix,
    k: Matrix,
    v: Matrix,
    o: Matrix,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    post_norm: Vec<f32>,
    mlp: GatedMlp,
}

/// A loaded DSpark drafter for one target model.
#[derive(Debug)]
pub struct DsparkDrafter {
    config: DrafterConfig,
    fc: Matrix,
    hidden_norm: Vec<f32>,
    layers: Vec<DraftLayer>,
    norm: Vec<f32>,
    markov: MarkovHead,
    confidence: ConfidenceHead,
    rope: Rope,
    kv: DraftKvLayout,
}

impl DsparkDrafter {
    /// Loads `config.json` and `model.safetensors` from `dir`, checked against the target.
    pub fn load(dir: &Path, target: &ModelConfig) -> Result<Self, ModelError> {
        if !dir.is_dir() {
            return Err(ModelError::missing_file(dir.to_path_buf()));
        }
        let config = DrafterConfig::from_file(&dir.join("config.json"))?;
        config.check_target(target)?;
        let w = Weights::open(dir)?;
        Self::from_weights(config, target, &w)
    }

    /// Builds the drafter from an open checkpoint.
    pub fn from_weights(
        config: DrafterConfig,
        target: &ModelConfig,
        w: &Weights,
    ) -> Result<Self, ModelError> {
        let c = &config;
        let (hid, hd) = (c.hidden_size, c.head_dim);
        let (q_out, kv_out) = (c.num_heads * hd, c.num_kv_heads * hd);
        let layers = (0..c.num_layers)
            .map(|i| {
                let p = format!("layers.{i}");
                let m = |n: &str, r, cols| w.get_matrix(&format!("{p}.{n}.weight"), r, cols);
                let v = |n: &str, len| w.get_f32(&format!("{p}.{n}.weight"), &[len]);
                Ok(DraftLayer {
                    input_norm: v("input_layernorm", hid)?,
                    q: m("self_attn.q_proj", q_out, hid)?,
                    k: m("self_attn.k_proj", kv_out, hid)?,
                    v: m("self_attn.v_proj", kv_out, hid)?,
                    o: m("self_attn.o_proj", hid, q_out)?,
                    q_norm: v("self_attn.q_norm", hd)?,
                    k_norm: v("self_attn.k_norm", hd)?,
                    post_norm: v("post_attention_layernorm", hid)?,
                    mlp: GatedMlp::new(
                        m("mlp.gate_proj", c.intermediate_size, hid)?,
                        m("mlp.up_proj", c.intermediate_size, hid)?,
                        m("mlp.down_proj", hid, c.intermediate_size)?,
                    )?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let conf_w = w.get_f32("confidence_head.weight", &[1, hid + c.markov_rank])?;
        let conf_b = w.get_f32("confidence_head.bias", &[1])?;
        let rope = Rope::new(&RopeParams {
            dim: hd,
            theta: c.rope_theta,
            scaling: RopeScaling::None,
            interleaved: false,
        })?;
        let kv = DraftKvLayout {
            layers: c.num_layers,
            kv_width: c.kv_width(),
            row_width: target.latent_width(),
        };
        Ok(Self {
            fc: w.get_matrix("fc.weight", hid, c.feature_width())?,
            hidden_norm: w.get_f32("hidden_norm.weight", &[hid])?,
            layers,
            norm: w.get_f32("norm.weight", &[hid])?,
            markov: MarkovHead {
                w1: w.get_matrix("markov_head.w1.weight", c.vocab_size, c.markov_rank)?,
                w2: w.get_matrix("markov_head.w2.weight", c.vocab_size, c.markov_rank)?,
            },
            confidence: ConfidenceHead {
                w: conf_w,
                b: conf_b.first().copied().unwrap_or(0.0),
            },
            rope,
            kv,
            config,
        })
    }

    /// The validated configuration.
    pub fn config(&self) -> &DrafterConfig {
        &self.config
    }

    /// Per-head RMSNorm over `[rows][heads][head_dim]`, then RoPE at `positions`.
    fn norm_rope(
        &self,
        x: &mut [f32],
        weight: &[f32],
        heads: usize,
        positions: &[usize],
    ) -> Result<(), ModelError> {
        rms_norm_inplace(x, weight, self.config.rms_norm_eps)?;
        let layout = RotaryLayout {
            heads,
            head_stride: self.config.head_dim,
            offset: 0,
        };
        self.rope.apply(x, positions, layout)?;
        Ok(())
    }

    /// Context feature `RMSNorm(fc(concat taps))` for the rows named by `rows`, `[R][hidden]`,
    /// and each row's position.
    fn context_feature(
        &self,
        rows: &ContextRows<'_>,
    ) -> Result<(Vec<f32>, Vec<usize>), ModelError> {
        let hid = self.config.hidden_size;
        let taps = self.config.target_layer_ids.len();
        if rows.taps.len() != taps {
            return Err(ModelError::Invalid(format!(
                "drafter context: {} tapped layers given, the drafter needs {taps}",
                rows.taps.len()
            )));
        }
        let total: usize = rows.segments.iter().map(|s| s.rows).sum();
        let mut feat = vec![0.0f32; total * hid * taps];
        let mut positions = Vec::with_capacity(total);
        let mut r = 0;
        for seg in rows.segments {
            for i in 0..seg.rows {
                let src_row = seg.first_row + i;
                for (t, tap) in rows.taps.iter().enumerate() {
                    let src = tap.get(src_row * hid..(src_row + 1) * hid).ok_or_else(|| {
                        ModelError::Invalid(format!(
                            "drafter context: row {src_row} is outside the tapped buffer"
                        ))
                    })?;
                    let dst = (r * taps + t) * hid;
                    feat[dst..dst + hid].copy_from_slice(src);
                }
                positions.push(seg.start_pos + i);
                r += 1;
            }
        }
        let mut f = vec![0.0f32; total * hid];
        linear(&feat, &self.fc, &mut f)?;
        rms_norm_inplace(&mut f, &self.hidden_norm, self.config.rms_norm_eps)?;
        Ok((f, positions))
    }

    /// Runs the block forward for `inputs`: `(final normed hidden [S·B][hidden], U logits
    /// [S·B][vocab])` — the LM-head logits before the Markov head (parity tests compare them
    /// with the float32 torch reference).
    pub fn block_forward(
        &self,
        ctx: &DraftCtx<'_>,
        inputs: &[DraftInput<'_>],
    ) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        let c = &self.config;
        let (b, hid, hd) = (c.block_size, c.hidden_size, c.head_dim);
        let pool = ctx
            .pool
            .ok_or_else(|| ModelError::Invalid("the DSpark drafter needs its KV pool".into()))?;
        let rows = inputs.len() * b;
        let mut tokens = Vec::with_capacity(rows);
        let mut positions = Vec::with_capacity(rows);
        for inp in inputs {
            tokens.push(inp.anchor);
            tokens.extend(std::iter::repeat_n(c.mask_token_id, b - 1));
            positions.extend(inp.context_len..inp.context_len + b);
        }
        let mut x = vec![0.0f32; rows * hid];
        ctx.target.embed_tokens(&tokens, &mut x)?;
        let (qw, kvw) = (c.num_heads * hd, c.num_kv_heads * hd);
        let mut h = vec![0.0f32; rows * hid];
        let mut q = vec![0.0f32; rows * qw];
        let mut k = vec![0.0f32; rows * kvw];
        let mut v = vec![0.0f32; rows * kvw];
        let mut attn = vec![0.0f32; rows * qw];
        let mut o = vec![0.0f32; rows * hid];
        for (l, layer) in self.layers.iter().enumerate() {
            h.copy_from_slice(&x);
            rms_norm_inplace(&mut h, &layer.input_norm, c.rms_norm_eps)?;
            linear(&h, &layer.q, &mut q)?;
            linear(&h, &layer.k, &mut k)?;
            linear(&h, &layer.v, &mut v)?;
            self.norm_rope(&mut q, &layer.q_norm, c.num_heads, &positions)?;
            self.norm_rope(&mut k, &layer.k_norm, c.num_kv_heads, &positions)?;
            attn.par_chunks_mut(b * qw)
                .zip(inputs.par_iter())
                .enumerate()
                .try_for_each(|(s, (out, inp))| {
                    let blk = s * b..(s + 1) * b;
                    self.attend_one(
                        AttendArgs {
                            pool,
                            layer: l,
                            input: inp,
                            q: &q[blk.start * qw..blk.end * qw],
                            k: &k[blk.start * kvw..blk.end * kvw],
                            v: &v[blk.start * kvw..blk.end * kvw],
                        },
                        out,
                    )
                })?;
            linear(&attn, &layer.o, &mut o)?;
            add_assign(&mut x, &o);
            h.copy_from_slice(&x);
            rms_norm_inplace(&mut h, &layer.post_norm, c.rms_norm_eps)?;
            layer.mlp.forward(&h, &mut o)?;
            add_assign(&mut x, &o);
        }
        rms_norm_inplace(&mut x, &self.norm, c.rms_norm_eps)?;
        let mut logits = vec![0.0f32; rows * c.vocab_size];
        ctx.target.lm_head_logits(&x, &mut logits)?;
        Ok((x, logits))
    }

    /// One sequence's block attention for one layer: queries from the block, keys and values
    /// from every context row (the pool) and every block row.
    fn attend_one(&self, a: AttendArgs<'_>, out: &mut [f32]) -> Result<(), ModelError> {
        let c = &self.config;
        let (b, hd) = (c.block_size, c.head_dim);
        let kvh = c.num_kv_heads;
        let kvw = kvh * hd;
        let n = a.input.context_len;
        let mut ctx_rows = vec![0.0f32; n * self.kv.kv_width];
        let at = DraftRows {
            layer: a.layer,
            table: a.input.block_table,
        };
        self.kv.read_rows(a.pool, at, n, &mut ctx_rows)?;
        let group = c.num_heads / kvh;
        let scale = 1.0 / (hd as f32).sqrt();
        let keys = n + b;
        let mut scores = vec![0.0f32; keys];
        // Row j of the keys / values: context rows first, then the block.
        let key = |j: usize, g: usize| -> &[f32] {
            if j < n {
                &ctx_rows[j * 2 * kvw + g * hd..j * 2 * kvw + (g + 1) * hd]
            } else {
                let r = j - n;
                &a.k[r * kvw + g * hd..r * kvw + (g + 1) * hd]
            }
        };
        let value = |j: usize, g: usize| -> &[f32] {
            if j < n {
                &ctx_rows[j * 2 * kvw + kvw + g * hd..j * 2 * kvw + kvw + (g + 1) * hd]
            } else {
                let r = j - n;
                &a.v[r * kvw + g * hd..r * kvw + (g + 1) * hd]
            }
        };
        for i in 0..b {
            for head in 0..c.num_heads {
                let g = head / group;
                let qv = &a.q[(i * c.num_heads + head) * hd..(i * c.num_heads + head + 1) * hd];
                let mut max = f32::NEG_INFINITY;
                for (j, s) in scores.iter_mut().enumerate() {
                    *s = qv.iter().zip(key(j, g)).map(|(x, y)| x * y).sum::<f32>() * scale;
                    max = max.max(*s);
                }
                let mut sum = 0.0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let dst =
                    &mut out[(i * c.num_heads + head) * hd..(i * c.num_heads + head + 1) * hd];
                dst.fill(0.0);
                for (j, &s) in scores.iter().enumerate() {
                    let wgt = s / sum;
                    for (d, x) in dst.iter_mut().zip(value(j, g)) {
                        *d += wgt * x;
                    }
                }
            }
        }
        Ok(())
    }

    /// The Markov head, left to right, for every sequence: drafts, their q, confidences.
    fn draft(
        &self,
        inputs: &[DraftInput<'_>],
        hidden: &[f32],
        logits: &[f32],
    ) -> Vec<Result<Proposal, ModelError>> {
        let c = &self.config;
        let (b, hid, vocab) = (c.block_size, c.hidden_size, c.vocab_size);
        let mut out: Vec<Result<Proposal, ModelError>> = inputs
            .iter()
            .map(|inp| {
                Ok(Proposal {
                    drafts: Vec::with_capacity(b),
                    q: if inp.params.is_greedy() {
                        DraftDist::Greedy
                    } else {
                        DraftDist::Sampled(Vec::with_capacity(b * vocab))
                    },
                    confidence: Vec::with_capacity(b),
                })
            })
            .collect();
        for k in 0..b {
            let prev: Vec<u32> = inputs
                .iter()
                .zip(&out)
                .map(|(inp, p)| match p {
                    Ok(p) if k > 0 => p.drafts.get(k - 1).copied().unwrap_or(inp.anchor),
                    _ => inp.anchor,
                })
                .collect();
            let step = self.markov.embed(&prev).and_then(|e| {
                let mut rows = Vec::with_capacity(inputs.len() * vocab);
                for s in 0..inputs.len() {
                    let r = s * b + k;
                    rows.extend_from_slice(&logits[r * vocab..(r + 1) * vocab]);
                }
                self.markov.add_bias(&e, &mut rows)?;
                Ok((e, rows))
            });
            let (e, rows) = match step {
                Ok(v) => v,
                Err(err) => {
                    let msg = err.to_string();
                    return inputs
                        .iter()
                        .map(|_| Err(ModelError::Invalid(format!("drafter Markov head: {msg}"))))
                        .collect();
                }
            };
            let rank = self.markov.rank();
            for (s, (inp, p)) in inputs.iter().zip(out.iter_mut()).enumerate() {
                let Ok(prop) = p else { continue };
                let r = s * b + k;
                let row = &rows[s * vocab..(s + 1) * vocab];
                let e_s = &e[s * rank..(s + 1) * rank];
                prop.confidence.push(
                    self.confidence
                        .survival(&hidden[r * hid..(r + 1) * hid], e_s),
                );
                let drafted = match &mut prop.q {
                    DraftDist::Greedy => Ok(argmax(row)),
                    DraftDist::Sampled(q) => probs_from_logits(row, inp.params).and_then(|probs| {
                        let u = inp.uniforms.get(k).copied().unwrap_or(0.5);
                        let x = sample_from_probs(&probs, u)?;
                        q.extend_from_slice(&probs);
                        Ok(x)
                    }),
                };
                match drafted {
                    Ok(x) => prop.drafts.push(x),
                    Err(err) => *p = Err(err.into()),
                }
            }
        }
        out
    }
}

/// One sequence's attention inputs for one layer.
struct AttendArgs<'a> {
    pool: &'a KvPool,
    layer: usize,
    input: &'a DraftInput<'a>,
    /// `[B][heads][head_dim]`.
    q: &'a [f32],
    /// `[B][kv_heads][head_dim]`.
    k: &'a [f32],
    v: &'a [f32],
}

impl Drafter for DsparkDrafter {
    fn block_size(&self) -> usize {
        self.config.block_size
    }

    fn taps(&self) -> &[usize] {
        &self.config.target_layer_ids
    }

    fn kv_layout(&self) -> Option<DraftKvLayout> {
        Some(self.kv)
    }

    fn extend_context(
        &self,
        _target: &DeepseekModel,
        pool: &mut KvPool,
        rows: &ContextRows<'_>,
    ) -> Result<(), ModelError> {
        if rows.segments.iter().all(|s| s.rows == 0) {
            return Ok(());
        }
        let c = &self.config;
        let (f, positions) = self.context_feature(rows)?;
        let r = positions.len();
        let kvw = c.num_kv_heads * c.head_dim;
        let mut k = vec![0.0f32; r * kvw];
        let mut v = vec![0.0f32; r * kvw];
        let mut row = vec![0.0f32; 2 * kvw];
        for (l, layer) in self.layers.iter().enumerate() {
            linear(&f, &layer.k, &mut k)?;
            linear(&f, &layer.v, &mut v)?;
            self.norm_rope(&mut k, &layer.k_norm, c.num_kv_heads, &positions)?;
            let mut i = 0;
            for seg in rows.segments {
                for j in 0..seg.rows {
                    row[..kvw].copy_from_slice(&k[i * kvw..(i + 1) * kvw]);
                    row[kvw..].copy_from_slice(&v[i * kvw..(i + 1) * kvw]);
                    let at = DraftRows {
                        layer: l,
                        table: seg.block_table,
                    };
                    self.kv.write_row(pool, at, seg.start_pos + j, &row)?;
                    i += 1;
                }
            }
        }
        Ok(())
    }

    fn propose(
        &self,
        ctx: &DraftCtx<'_>,
        inputs: &[DraftInput<'_>],
    ) -> Vec<Result<Proposal, ModelError>> {
        if inputs.is_empty() {
            return Vec::new();
        }
        match self.block_forward(ctx, inputs) {
            Ok((hidden, logits)) => self.draft(inputs, &hidden, &logits),
            Err(e) => {
                let msg = e.to_string();
                inputs
                    .iter()
                    .map(|_| Err(ModelError::Invalid(format!("drafter forward: {msg}"))))
                    .collect()
            }
        }
    }
}

fn add_assign(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}
