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
//!
//! Every pass runs over the op-level backend ([`ferry_kernels::backend`]) the target runs on:
//! the same code on the CPU (the reference kernels, parity with the float32 torch reference) and
//! on a GPU (the tapped hidden states, the drafter's KV, the block pass and the Markov head's
//! left-to-right draws stay on the device; only the drafts and their confidences come back).

use std::path::Path;

use ferry_kernels::backend::draft::{
    block_attention, gather_concat, scatter_rows, BlockAttention, GatherConcat, ScatterRows,
};
use ferry_kernels::backend::linear::{linear, Linear};
use ferry_kernels::backend::mlp::{dense, Dense, DenseFfn};
use ferry_kernels::backend::norm::{add_norm, norm_strided, AddNorm, NormStrided};
use ferry_kernels::backend::rope::{rope, ApplyRope, RopeTable};
use ferry_kernels::backend::rows::{embed, gather, Embed, Gather};
use ferry_kernels::backend::sample::{argmax, draw, probs, Draw, Probs, RowParams, Uniforms};
use ferry_kernels::backend::{Backend, Ints, Precision, Tensor, Weight};
use ferry_kernels::cpu::gemm::Matrix;
use ferry_kernels::cpu::mlp::GatedMlp;
use ferry_kernels::cpu::rope::{Rope, RopeParams, RopeScaling, RotaryLayout};

use super::heads::{ConfidenceHead, MarkovHead};
use super::{
    ContextRows, DraftCtx, DraftDist, DraftInput, DraftKvLayout, Drafter, DrafterConfig, Proposal,
    Proposals,
};
use crate::config::ModelConfig;
use crate::deepseek::DeepseekModel;
use crate::kv::{BlockId, KvStore};
use crate::weights::Weights;
use crate::ModelError;

/// One drafter decoder layer.
#[derive(Debug)]
struct DraftLayer {
    input_norm: Tensor,
    q: Weight,
    k: Weight,
    v: Weight,
    o: Weight,
    q_norm: Tensor,
    k_norm: Tensor,
    post_norm: Tensor,
    mlp: Dense,
}

/// A loaded DSpark drafter for one target model, on one backend (the target's).
#[derive(Debug)]
pub struct DsparkDrafter {
    config: DrafterConfig,
    backend: Backend,
    fc: Weight,
    hidden_norm: Tensor,
    layers: Vec<DraftLayer>,
    norm: Tensor,
    markov: MarkovHead,
    confidence: ConfidenceHead,
    rope: Rope,
    kv: DraftKvLayout,
}

/// What the Markov head's steps read, on the drafter's backend (uploaded before the pass).
struct DrawInputs {
    /// Per-input sampling parameters; `None` when every input is greedy (argmax steps).
    params: Option<RowParams>,
    /// The anchors: step 0's previous tokens.
    anchors: Ints,
    /// Per step `k`, the block rows `s·B + k` of every input.
    at: Vec<Ints>,
    /// Per step, one uniform per input (empty when every input is greedy).
    uniforms: Vec<Uniforms>,
    /// The permutation from step-major q rows to sequence-major ones (sampled batches).
    order: Option<Ints>,
}

/// The block pass's outputs, on the drafter's backend.
#[derive(Debug)]
pub struct BlockPass {
    /// `[inputs · B][hidden]`: the final normalised hidden states.
    pub hidden: Tensor,
    /// `[inputs · B][vocab]`: the LM-head logits before the Markov head.
    pub logits: Tensor,
}

impl DsparkDrafter {
    /// Loads `config.json` and `model.safetensors` from `dir` onto the CPU, checked against the
    /// target; [`Drafter::to_backend`] moves it next to a target on a GPU.
    pub fn load(dir: &Path, target: &ModelConfig) -> Result<Self, ModelError> {
        if !dir.is_dir() {
            return Err(ModelError::missing_file(dir.to_path_buf()));
        }
        let config = DrafterConfig::from_file(&dir.join("config.json"))?;
        config.check_target(target)?;
        let w = Weights::open(dir)?;
        Self::from_weights(config, target, &w)
    }

    /// Builds the drafter from an open checkpoint (on the CPU).
    pub fn from_weights(
        config: DrafterConfig,
        target: &ModelConfig,
        w: &Weights,
    ) -> Result<Self, ModelError> {
        let c = &config;
        let (hid, hd) = (c.hidden_size, c.head_dim);
        let (q_out, kv_out) = (c.num_heads * hd, c.num_kv_heads * hd);
        let host = |m: Matrix| Weight::Host(m);
        let layers = (0..c.num_layers)
            .map(|i| {
                let p = format!("layers.{i}");
                let m = |n: &str, r, cols| w.get_matrix(&format!("{p}.{n}.weight"), r, cols);
                let v = |n: &str, len| {
                    w.get_f32(&format!("{p}.{n}.weight"), &[len])
                        .map(Tensor::Host)
                };
                Ok(DraftLayer {
                    input_norm: v("input_layernorm", hid)?,
                    q: host(m("self_attn.q_proj", q_out, hid)?),
                    k: host(m("self_attn.k_proj", kv_out, hid)?),
                    v: host(m("self_attn.v_proj", kv_out, hid)?),
                    o: host(m("self_attn.o_proj", hid, q_out)?),
                    q_norm: v("self_attn.q_norm", hd)?,
                    k_norm: v("self_attn.k_norm", hd)?,
                    post_norm: v("post_attention_layernorm", hid)?,
                    mlp: Dense::Host(GatedMlp::new(
                        m("mlp.gate_proj", c.intermediate_size, hid)?,
                        m("mlp.up_proj", c.intermediate_size, hid)?,
                        m("mlp.down_proj", hid, c.intermediate_size)?,
                    )?),
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
            backend: Backend::Cpu,
            fc: host(w.get_matrix("fc.weight", hid, c.feature_width())?),
            hidden_norm: Tensor::Host(w.get_f32("hidden_norm.weight", &[hid])?),
            layers,
            norm: Tensor::Host(w.get_f32("norm.weight", &[hid])?),
            markov: MarkovHead {
                w1: host(w.get_matrix("markov_head.w1.weight", c.vocab_size, c.markov_rank)?),
                w2: host(w.get_matrix("markov_head.w2.weight", c.vocab_size, c.markov_rank)?),
            },
            confidence: ConfidenceHead {
                w: Tensor::Host(conf_w),
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

    /// The backend the drafter's weights live on.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// Checks that the target runs where the drafter does (they share its embedding and LM
    /// head, and the drafter reads the target's tapped hidden states).
    fn check_target(&self, target: &DeepseekModel) -> Result<(), ModelError> {
        if target.backend().device() != self.backend.device() {
            return Err(ModelError::Invalid(format!(
                "the drafter is on the {} but its target is on the {}",
                self.backend.device(),
                target.backend().device()
            )));
        }
        Ok(())
    }

    /// Per-head RMSNorm over `[rows][heads][head_dim]`, then RoPE from `table`.
    fn norm_rope(
        &self,
        x: &mut Tensor,
        weight: &Tensor,
        heads: usize,
        table: &RopeTable,
    ) -> Result<(), ModelError> {
        let b = &self.backend;
        let hd = self.config.head_dim;
        norm_strided(
            b,
            NormStrided {
                x,
                stride: hd,
                weight,
                eps: self.config.rms_norm_eps,
            },
        )?;
        let layout = RotaryLayout {
            heads,
            head_stride: hd,
            offset: 0,
        };
        rope(b, ApplyRope { x, table, layout })?;
        Ok(())
    }

    /// `x · Wᵀ` at the target's precision.
    fn linear(&self, x: &Tensor, w: &Weight, precision: Precision) -> Result<Tensor, ModelError> {
        Ok(linear(&self.backend, Linear { x, w, precision })?)
    }

    /// Runs the block forward for `inputs`: the final normalised hidden states and the LM-head
    /// logits before the Markov head (parity tests compare them with the float32 torch
    /// reference).
    pub fn block_forward(
        &self,
        ctx: &DraftCtx<'_>,
        inputs: &[DraftInput<'_>],
    ) -> Result<BlockPass, ModelError> {
        self.check_target(ctx.target)?;
        let c = &self.config;
        let b = &self.backend;
        let precision = ctx.target.precision();
        let (blk, hid, eps) = (c.block_size, c.hidden_size, c.rms_norm_eps);
        let kv = ctx
            .kv
            .ok_or_else(|| ModelError::Invalid("the DSpark drafter needs its KV".into()))?;
        let page = kv.layout().page_size;
        let rows = inputs.len() * blk;
        let mut tokens = Vec::with_capacity(rows);
        let mut positions = Vec::with_capacity(rows);
        for inp in inputs {
            tokens.push(inp.anchor as i32);
            tokens.extend(std::iter::repeat_n(c.mask_token_id as i32, blk - 1));
            positions.extend(inp.context_len..inp.context_len + blk);
        }
        // Context block tables, one row per input, covering its committed positions.
        let ctx_host: Vec<usize> = inputs.iter().map(|i| i.context_len).collect();
        let stride = ctx_host
            .iter()
            .map(|n| n.div_ceil(page))
            .max()
            .unwrap_or(0)
            .max(1);
        let mut flat = vec![0i32; inputs.len() * stride];
        for (s, inp) in inputs.iter().enumerate() {
            let need = inp.context_len.div_ceil(page);
            let table = inp.block_table.get(..need).ok_or_else(|| {
                ModelError::Kv(format!(
                    "drafter context of {} positions is beyond the block table ({} blocks)",
                    inp.context_len,
                    inp.block_table.len()
                ))
            })?;
            for (j, id) in table.iter().enumerate() {
                flat[s * stride + j] = id.0 as i32;
            }
        }
        let tables = b.ints(flat)?;
        let ctx_len = b.ints(ctx_host.iter().map(|&n| n as i32).collect())?;
        let ids = b.ints(tokens)?;
        let table = RopeTable::new(b, &self.rope, &positions)?;

        let mut x = embed(
            b,
            Embed {
                table: &ctx.target.embed,
                ids: &ids,
            },
        )?;
        let mut h = b.scratch(rows * hid)?;
        for (l, layer) in self.layers.iter().enumerate() {
            add_norm(
                b,
                AddNorm {
                    h: &mut x,
                    delta: None,
                    weight: &layer.input_norm,
                    out: Some(&mut h),
                    width: hid,
                    eps,
                },
            )?;
            let mut q = self.linear(&h, &layer.q, precision)?;
            let mut k = self.linear(&h, &layer.k, precision)?;
            let v = self.linear(&h, &layer.v, precision)?;
            self.norm_rope(&mut q, &layer.q_norm, c.num_heads, &table)?;
            self.norm_rope(&mut k, &layer.k_norm, c.num_kv_heads, &table)?;
            let attn = block_attention(
                b,
                BlockAttention {
                    q: &q,
                    k: &k,
                    v: &v,
                    pages: kv.pages(l)?,
                    tables: &tables,
                    stride,
                    ctx: &ctx_len,
                    ctx_host: &ctx_host,
                    heads: c.num_heads,
                    kv_heads: c.num_kv_heads,
                    head_dim: c.head_dim,
                    block: blk,
                },
            )?;
            let o = self.linear(&attn, &layer.o, precision)?;
            add_norm(
                b,
                AddNorm {
                    h: &mut x,
                    delta: Some(&o),
                    weight: &layer.post_norm,
                    out: Some(&mut h),
                    width: hid,
                    eps,
                },
            )?;
            dense(
                b,
                DenseFfn {
                    w: &layer.mlp,
                    x: &h,
                    h: &mut x,
                    precision,
                },
            )?;
        }
        add_norm(
            b,
            AddNorm {
                h: &mut x,
                delta: None,
                weight: &self.norm,
                out: Some(&mut h),
                width: hid,
                eps,
            },
        )?;
        let logits = self.linear(&h, ctx.target.lm_head(), precision)?;
        Ok(BlockPass { hidden: h, logits })
    }

    /// Puts what the Markov head's steps read on the backend before any of the pass's work is
    /// queued (an upload synchronises with the stream on a GPU: done here, the stream is idle,
    /// and the left-to-right loop issues only ops).
    fn prepare_draws(&self, inputs: &[DraftInput<'_>]) -> Result<DrawInputs, ModelError> {
        let b = &self.backend;
        let (blk, n) = (self.config.block_size, inputs.len());
        let greedy = inputs.iter().all(|i| i.params.is_greedy());
        let params: Vec<_> = inputs.iter().map(|i| i.params.clone()).collect();
        let uniforms = if greedy {
            Vec::new()
        } else {
            (0..blk)
                .map(|k| {
                    let u: Vec<f64> = inputs
                        .iter()
                        .map(|i| i.uniforms.get(k).copied().unwrap_or(0.5))
                        .collect();
                    Uniforms::new(b, &u)
                })
                .collect::<Result<_, _>>()?
        };
        Ok(DrawInputs {
            params: (!greedy).then(|| RowParams::new(b, &params)).transpose()?,
            anchors: b.ints(inputs.iter().map(|i| i.anchor as i32).collect())?,
            at: (0..blk)
                .map(|k| b.ints((0..n).map(|s| (s * blk + k) as i32).collect()))
                .collect::<Result<_, _>>()?,
            uniforms,
            order: (!greedy)
                .then(|| {
                    b.ints(
                        (0..n)
                            .flat_map(|s| (0..blk).map(move |k| (k * n + s) as i32))
                            .collect(),
                    )
                })
                .transpose()?,
        })
    }

    /// The Markov head, left to right, for every input: drafts, their q, confidences. Each step
    /// corrects the backbone's logits at block position `k` with the previous draft's bigram
    /// bias, builds the distribution the plain sampler would (greedy requests: a point mass at
    /// the argmax) and draws from it with the input's own uniform — all on the backend; the
    /// drafts and confidences are downloaded once at the end, the q rows stay where they are.
    /// A batch of greedy requests only takes each step's argmax (no distributions, no q).
    fn draft(
        &self,
        inputs: &[DraftInput<'_>],
        pass: &BlockPass,
        draws: &DrawInputs,
        precision: Precision,
    ) -> Result<Proposals, ModelError> {
        let c = &self.config;
        let b = &self.backend;
        let (blk, hid, vocab) = (c.block_size, c.hidden_size, c.vocab_size);
        let n = inputs.len();
        let sampled: Vec<bool> = inputs.iter().map(|i| !i.params.is_greedy()).collect();
        // Step-major q: row k·n + s is input s's distribution at block position k.
        let mut q_steps = match draws.params {
            Some(_) => Some(b.scratch(blk * n * vocab)?),
            None => None,
        };
        // A row that could not be drawn (-1) fails its own proposal; the next step must still
        // embed a valid id there: on the host the -1 is replaced by 0 (a device embed reads an
        // out-of-range id as a zero row).
        let mut clamped: Option<Ints> = None;
        let mut confidence: Vec<Tensor> = Vec::with_capacity(blk);
        let mut step_ids: Vec<Ints> = Vec::with_capacity(blk);
        for (k, at) in draws.at.iter().enumerate() {
            let prev = match (k, &clamped) {
                (0, _) => &draws.anchors,
                (_, Some(c)) => c,
                (_, None) => &step_ids[k - 1],
            };
            let e = self.markov.embed(b, prev)?;
            let bias = self.markov.bias(b, &e, precision)?;
            let mut logits_k = gather(
                b,
                Gather {
                    src: &pass.logits,
                    rows: at,
                    width: vocab,
                },
            )?;
            add_norm(
                b,
                AddNorm {
                    h: &mut logits_k,
                    delta: Some(&bias),
                    weight: &bias,
                    out: None,
                    width: vocab,
                    eps: 0.0,
                },
            )?;
            let hidden_k = gather(
                b,
                Gather {
                    src: &pass.hidden,
                    rows: at,
                    width: hid,
                },
            )?;
            confidence.push(self.confidence.survival(b, &hidden_k, &e)?);
            let ids = match (&draws.params, draws.uniforms.get(k)) {
                (Some(params), Some(uniforms)) => {
                    let p = probs(
                        b,
                        Probs {
                            logits: &logits_k,
                            vocab,
                            params,
                        },
                    )?;
                    if let Some(q) = q_steps.as_mut() {
                        b.copy_into(&p, q, k * n * vocab)?;
                    }
                    draw(
                        b,
                        Draw {
                            probs: &p,
                            vocab,
                            uniforms,
                        },
                    )?
                }
                _ => argmax(b, &logits_k, vocab)?,
            };
            clamped = match &ids {
                Ints::Host(v) => Some(Ints::Host(v.iter().map(|&t| t.max(0)).collect())),
                // Device ids are clamped by the embedding kernel itself.
                #[allow(unreachable_patterns)]
                _ => None,
            };
            step_ids.push(ids);
        }
        let drafts: Vec<Vec<i32>> = step_ids
            .iter()
            .map(Ints::to_host)
            .collect::<Result<_, _>>()?;
        let confidence: Vec<Vec<f32>> = confidence
            .iter()
            .map(Tensor::to_host)
            .collect::<Result<_, _>>()?;
        // Sequence-major q for the verifier: row s·B + k.
        let q = match (q_steps, &draws.order) {
            (Some(q), Some(order)) => Some(gather(
                b,
                Gather {
                    src: &q,
                    rows: order,
                    width: vocab,
                },
            )?),
            _ => None,
        };
        let each = (0..n)
            .map(|s| {
                let ids: Vec<i32> = drafts.iter().map(|d| d[s]).collect();
                if let Some(k) = ids.iter().position(|&t| t < 0) {
                    return Err(ModelError::Invalid(format!(
                        "drafter Markov head: block position {k} has no valid distribution"
                    )));
                }
                Ok(Proposal {
                    drafts: ids.iter().map(|&t| t as u32).collect(),
                    q: if sampled[s] {
                        DraftDist::Rows { first: s * blk }
                    } else {
                        DraftDist::Greedy
                    },
                    confidence: confidence.iter().map(|c| c[s]).collect(),
                })
            })
            .collect();
        Ok(Proposals { each, q })
    }

    /// Context feature `RMSNorm(fc(concat taps))` for the rows named by `rows`, `[R][hidden]`,
    /// and each row's position and cache slot.
    fn context_feature(
        &self,
        rows: &ContextRows<'_>,
        page: usize,
        precision: Precision,
    ) -> Result<(Tensor, Vec<usize>, Vec<i64>), ModelError> {
        let b = &self.backend;
        let c = &self.config;
        let hid = c.hidden_size;
        let taps = c.target_layer_ids.len();
        if rows.taps.len() != taps {
            return Err(ModelError::Invalid(format!(
                "drafter context: {} tapped layers given, the drafter needs {taps}",
                rows.taps.len()
            )));
        }
        let total: usize = rows.segments.iter().map(|s| s.rows).sum();
        let mut src_rows = Vec::with_capacity(total);
        let mut positions = Vec::with_capacity(total);
        let mut slots = Vec::with_capacity(total);
        let tapped_rows = rows
            .taps
            .iter()
            .map(|t| t.len() / hid.max(1))
            .min()
            .unwrap_or(0);
        for seg in rows.segments {
            for i in 0..seg.rows {
                let src = seg.first_row + i;
                if src >= tapped_rows {
                    return Err(ModelError::Invalid(format!(
                        "drafter context: row {src} is outside the tapped buffer ({tapped_rows} rows)"
                    )));
                }
                let pos = seg.start_pos + i;
                let block: &BlockId = seg.block_table.get(pos / page).ok_or_else(|| {
                    ModelError::Kv(format!(
                        "drafter context position {pos} is beyond the block table ({} blocks)",
                        seg.block_table.len()
                    ))
                })?;
                src_rows.push(src as i32);
                positions.push(pos);
                slots.push(i64::from(block.0) * page as i64 + (pos % page) as i64);
            }
        }
        let srcs: Vec<&Tensor> = rows.taps.iter().collect();
        let feat = gather_concat(
            b,
            GatherConcat {
                srcs: &srcs,
                rows: &b.ints(src_rows)?,
                width: hid,
            },
        )?;
        let mut f = self.linear(&feat, &self.fc, precision)?;
        let mut out = b.scratch(total * hid)?;
        add_norm(
            b,
            AddNorm {
                h: &mut f,
                delta: None,
                weight: &self.hidden_norm,
                out: Some(&mut out),
                width: hid,
                eps: c.rms_norm_eps,
            },
        )?;
        Ok((out, positions, slots))
    }
}

/// `m` (a host weight) on `b`.
fn weight_on(b: &Backend, w: &Weight, what: &'static str) -> Result<Weight, ModelError> {
    Ok(b.weight(w.host("drafter to_backend", what)?)?)
}

/// `t` (a host vector) on `b`.
fn vector_on(b: &Backend, t: &Tensor, what: &'static str) -> Result<Tensor, ModelError> {
    Ok(b.upload(t.host("drafter to_backend", what)?)?)
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

    fn to_backend(&mut self, b: &Backend) -> Result<(), ModelError> {
        if b.device() == self.backend.device() {
            return Ok(());
        }
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(DraftLayer {
                    input_norm: vector_on(b, &l.input_norm, "input_layernorm")?,
                    q: weight_on(b, &l.q, "q_proj")?,
                    k: weight_on(b, &l.k, "k_proj")?,
                    v: weight_on(b, &l.v, "v_proj")?,
                    o: weight_on(b, &l.o, "o_proj")?,
                    q_norm: vector_on(b, &l.q_norm, "q_norm")?,
                    k_norm: vector_on(b, &l.k_norm, "k_norm")?,
                    post_norm: vector_on(b, &l.post_norm, "post_attention_layernorm")?,
                    mlp: Dense::to_backend(l.mlp.host()?, b)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        *self = Self {
            config: self.config.clone(),
            backend: b.clone(),
            fc: weight_on(b, &self.fc, "fc")?,
            hidden_norm: vector_on(b, &self.hidden_norm, "hidden_norm")?,
            layers,
            norm: vector_on(b, &self.norm, "norm")?,
            markov: self.markov.to_backend(b)?,
            confidence: self.confidence.to_backend(b)?,
            rope: self.rope.clone(),
            kv: self.kv,
        };
        Ok(())
    }

    fn extend_context(
        &self,
        target: &DeepseekModel,
        kv: &mut KvStore,
        rows: &ContextRows<'_>,
    ) -> Result<(), ModelError> {
        if rows.segments.iter().all(|s| s.rows == 0) {
            return Ok(());
        }
        self.check_target(target)?;
        let b = &self.backend;
        let c = &self.config;
        let precision = target.precision();
        let page = kv.layout().page_size;
        let (f, positions, slots) = self.context_feature(rows, page, precision)?;
        let r = positions.len();
        let kvw = c.num_kv_heads * c.head_dim;
        let table = RopeTable::new(b, &self.rope, &positions)?;
        let slots = b.slots(slots)?;
        let identity = b.ints((0..r as i32).collect())?;
        for (l, layer) in self.layers.iter().enumerate() {
            let mut k = self.linear(&f, &layer.k, precision)?;
            let v = self.linear(&f, &layer.v, precision)?;
            self.norm_rope(&mut k, &layer.k_norm, c.num_kv_heads, &table)?;
            // One context row per token: K of every KV head, then V.
            let row = gather_concat(
                b,
                GatherConcat {
                    srcs: &[&k, &v],
                    rows: &identity,
                    width: kvw,
                },
            )?;
            scatter_rows(
                b,
                ScatterRows {
                    rows: &row,
                    pages: kv.pages_mut(l)?,
                    slots: &slots,
                },
            )?;
        }
        Ok(())
    }

    fn propose(&self, ctx: &DraftCtx<'_>, inputs: &[DraftInput<'_>]) -> Proposals {
        if inputs.is_empty() {
            return Proposals::host(Vec::new());
        }
        let precision = ctx.target.precision();
        match self.prepare_draws(inputs).and_then(|draws| {
            let pass = self.block_forward(ctx, inputs)?;
            self.draft(inputs, &pass, &draws, precision)
        }) {
            Ok(p) => p,
            Err(e) => Proposals::failed(inputs.len(), &format!("drafter forward: {e}")),
        }
    }
}
