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
    block_attention, gather_concat, markov_step, scatter_rows, BlockAttention, GatherConcat,
    MarkovRows, MarkovStep, ScatterRows,
};
use ferry_kernels::backend::linear::{linear, Linear};
use ferry_kernels::backend::mlp::{dense, Dense, DenseFfn};
use ferry_kernels::backend::norm::{add_norm, norm_strided, AddNorm, NormStrided};
use ferry_kernels::backend::rope::{rope, ApplyRope, RopeTable};
use ferry_kernels::backend::rows::{embed, gather, Embed, Gather};
use ferry_kernels::backend::sample::{argmax, draw_at, probs, Draw, Probs, RowParams, Uniforms};
use ferry_kernels::backend::{Backend, Ints, Precision, Tensor, Weight};
use ferry_kernels::cpu::gemm::Matrix;
use ferry_kernels::cpu::mlp::GatedMlp;
use ferry_kernels::cpu::rope::{Rope, RopeParams, RopeScaling, RotaryLayout};

use super::heads::{ConfidenceHead, MarkovHead};
use super::{
    ContextRows, DraftCtx, DraftInput, DraftKvLayout, Drafter, DrafterConfig, Proposals,
    QueuedDrafts,
};
use crate::config::ModelConfig;
use crate::deepseek::DeepseekModel;
#[cfg(feature = "cuda")]
use crate::gpu::graph::{graph_bucket, graph_max_batch};
use crate::kv::{BlockId, KvStore};
use crate::weights::{TensorSource, Weights};
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
    /// Replay passes from CUDA graphs (per batch-size bucket) when on a CUDA device.
    use_graphs: bool,
    /// The captured passes, by (batch-size bucket, every input greedy).
    #[cfg(feature = "cuda")]
    graphs: std::cell::RefCell<std::collections::HashMap<(usize, bool), DraftGraph>>,
    /// Passes captured so far ([`Drafter::graph_captures`]).
    #[cfg(feature = "cuda")]
    captures: std::cell::Cell<u64>,
}

/// The smallest context a pass graph is planned for.
#[cfg(feature = "cuda")]
const MIN_GRAPH_CTX: usize = 256;

/// One drafter pass captured as a CUDA graph, with the buffers it reads and writes.
#[cfg(feature = "cuda")]
struct DraftGraph {
    graph: ferry_kernels::cuda::GpuGraph,
    plan: PassPlan,
    out: PassOut,
    /// The context the attention was planned for: contexts may grow up to it.
    plan_ctx: usize,
    /// The drafter KV the graph reads (its first layer's address).
    kv: u64,
}

#[cfg(feature = "cuda")]
impl std::fmt::Debug for DraftGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DraftGraph(plan_ctx {})", self.plan_ctx)
    }
}

/// The host side of one pass (see [`DsparkDrafter::host_pass`]).
struct HostPass {
    tokens: Vec<i32>,
    positions: Vec<usize>,
    tables: Vec<i32>,
    stride: usize,
    ctx: Vec<usize>,
    ctx_host: Vec<usize>,
    greedy: bool,
    params: Vec<ferry_kernels::cpu::sample::SamplingParams>,
    anchors: Vec<i32>,
    /// Step-major: step `k`'s uniforms at `k·n ..` (one per input).
    uniforms: Vec<f64>,
}

/// What one pass reads, on the drafter's backend: uploaded before its first op, refreshed in
/// place for a captured graph.
struct PassPlan {
    /// `[n · B]` block tokens: each input's anchor, then masks.
    ids: Ints,
    /// The block rows' positions `n .. n + B` per input.
    rope: RopeTable,
    /// `[n][stride]` context block tables.
    tables: Ints,
    stride: usize,
    /// Context lengths.
    ctx: Ints,
    /// The context lengths the attention is planned for (the inputs' own, or a graph's plan).
    ctx_host: Vec<usize>,
    /// Per-input sampling parameters; `None` when every input is greedy (argmax steps).
    params: Option<RowParams>,
    /// The anchors: step 0's previous tokens.
    anchors: Ints,
    /// Per step `k`, the block rows `s·B + k` of every input.
    at: Vec<Ints>,
    /// Every step's uniforms, step-major (`None` when every input is greedy): one buffer, so
    /// a graph's refresh writes them in one upload.
    uniforms: Option<Uniforms>,
    /// The permutation from step-major q rows to sequence-major ones (sampled batches).
    order: Option<Ints>,
}

/// What one pass writes. Every step's drafts and confidences share one buffer each, so a pass
/// costs two downloads, not two per block position (each a synchronising copy).
struct PassOut {
    /// `[B][width]`: at block position `k`, each input's draft (-1: no valid distribution).
    drafts: Ints,
    /// `[B][width]`: at block position `k`, each input's confidence.
    confidence: Tensor,
    /// Inputs of the pass (padded ones included): the rows of `drafts` and `confidence`.
    width: usize,
    /// `[n · B][vocab]` the sampled drafts' distributions, sequence-major (sampled batches).
    q: Option<Tensor>,
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

    /// The drafter in `dir` as `format` says: its checkpoint ([`Self::load`]), or under
    /// `--load-format dummy` its config.json with seeded random weights ([`Self::dummy`]; a
    /// trained drafter's weights would not match a dummy target's). The dummy drafter's drafts
    /// are almost never accepted; what its passes cost is real.
    pub fn load_as(
        dir: &Path,
        target: &ModelConfig,
        format: crate::dummy::LoadFormat,
    ) -> Result<Self, ModelError> {
        match format {
            crate::dummy::LoadFormat::Auto => Self::load(dir, target),
            crate::dummy::LoadFormat::Dummy { seed } => {
                let config = DrafterConfig::from_file(&dir.join("config.json"))?;
                tracing::info!(
                    drafter = %dir.display(),
                    "--load-format dummy: the drafter's config.json with seeded random weights \
                     (its drafts mean nothing)"
                );
                Self::dummy(config, target, seed)
            }
        }
    }

    /// A drafter of `config`'s shapes with seeded random weights ([`crate::dummy::DummyWeights`]),
    /// checked against the target: what a drafter of that size costs, for benchmarks on a model
    /// without a trained drafter (`ferry bench-engine --verify-cost`). Its drafts mean nothing.
    pub fn dummy(
        config: DrafterConfig,
        target: &ModelConfig,
        seed: u64,
    ) -> Result<Self, ModelError> {
        config.check_target(target)?;
        Self::from_weights(config, target, &crate::dummy::DummyWeights::new(seed))
    }

    /// Builds the drafter from a checkpoint or another source of tensors (on the CPU).
    pub fn from_weights(
        config: DrafterConfig,
        target: &ModelConfig,
        w: &impl TensorSource,
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
            use_graphs: false,
            #[cfg(feature = "cuda")]
            graphs: Default::default(),
            #[cfg(feature = "cuda")]
            captures: Default::default(),
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

    /// The host side of one pass over `inputs`: block tokens, positions, context tables and
    /// lengths, and the Markov head's per-step inputs. `plan_ctx` plans the attention for that
    /// many context positions (a graph's) instead of the inputs' longest.
    fn host_pass(
        &self,
        inputs: &[DraftInput<'_>],
        page: usize,
        plan_ctx: Option<usize>,
    ) -> Result<HostPass, ModelError> {
        let c = &self.config;
        let (blk, n) = (c.block_size, inputs.len());
        let mut tokens = Vec::with_capacity(n * blk);
        let mut positions = Vec::with_capacity(n * blk);
        for inp in inputs {
            tokens.push(inp.anchor as i32);
            tokens.extend(std::iter::repeat_n(c.mask_token_id as i32, blk - 1));
            positions.extend(inp.context_len..inp.context_len + blk);
        }
        let ctx: Vec<usize> = inputs.iter().map(|i| i.context_len).collect();
        let longest = ctx.iter().copied().max().unwrap_or(0);
        let planned = plan_ctx.unwrap_or(longest).max(longest);
        let stride = planned.div_ceil(page).max(1);
        let mut tables = vec![0i32; n * stride];
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
                tables[s * stride + j] = id.0 as i32;
            }
        }
        let greedy = inputs.iter().all(|i| i.params.is_greedy());
        let uniforms = (0..blk)
            .flat_map(|k| {
                inputs
                    .iter()
                    .map(move |i| i.uniforms.get(k).copied().unwrap_or(0.5))
            })
            .collect();
        Ok(HostPass {
            tokens,
            positions,
            tables,
            stride,
            ctx_host: match plan_ctx {
                Some(_) => vec![planned; n],
                None => ctx.clone(),
            },
            ctx,
            greedy,
            params: inputs.iter().map(|i| i.params.clone()).collect(),
            anchors: inputs.iter().map(|i| i.anchor as i32).collect(),
            uniforms,
        })
    }

    /// `h` on the backend, in fresh buffers (every upload of a pass happens here, before its
    /// first op: on a GPU an upload synchronises with the stream).
    fn upload_pass(&self, h: &HostPass) -> Result<PassPlan, ModelError> {
        let b = &self.backend;
        let (blk, n) = (self.config.block_size, h.anchors.len());
        let sampled = !h.greedy;
        Ok(PassPlan {
            ids: b.ints(h.tokens.clone())?,
            rope: RopeTable::new(b, &self.rope, &h.positions)?,
            tables: b.ints(h.tables.clone())?,
            stride: h.stride,
            ctx: b.ints(h.ctx.iter().map(|&x| x as i32).collect())?,
            ctx_host: h.ctx_host.clone(),
            params: sampled.then(|| RowParams::new(b, &h.params)).transpose()?,
            anchors: b.ints(h.anchors.clone())?,
            at: (0..blk)
                .map(|k| b.ints((0..n).map(|s| (s * blk + k) as i32).collect()))
                .collect::<Result<_, _>>()?,
            uniforms: sampled.then(|| Uniforms::new(b, &h.uniforms)).transpose()?,
            order: sampled
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

    /// Rewrites `plan`'s buffers in place with `h` (same input count, same greedy-ness, same
    /// table stride): what a captured graph reads on its next replay.
    #[cfg(feature = "cuda")]
    fn refresh_pass(&self, plan: &mut PassPlan, h: &HostPass) -> Result<(), ModelError> {
        plan.ids.write(&h.tokens)?;
        plan.rope.refresh(&self.rope, &h.positions)?;
        plan.tables.write(&h.tables)?;
        let ctx: Vec<i32> = h.ctx.iter().map(|&x| x as i32).collect();
        plan.ctx.write(&ctx)?;
        plan.anchors.write(&h.anchors)?;
        if let Some(p) = plan.params.as_mut() {
            p.write(&h.params)?;
        }
        if let Some(u) = plan.uniforms.as_mut() {
            u.write(&h.uniforms)?;
        }
        Ok(())
    }

    /// The backbone over `plan`: embedding → the drafter's layers (block attention against
    /// the context in `kv`) → final norm → the target's LM head.
    fn backbone(
        &self,
        target: &DeepseekModel,
        kv: &KvStore,
        plan: &PassPlan,
    ) -> Result<BlockPass, ModelError> {
        let c = &self.config;
        let b = &self.backend;
        let precision = target.precision();
        let (blk, hid, eps) = (c.block_size, c.hidden_size, c.rms_norm_eps);
        let rows = plan.anchors.len() * blk;
        let mut x = embed(
            b,
            Embed {
                table: &target.embed,
                ids: &plan.ids,
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
            self.norm_rope(&mut q, &layer.q_norm, c.num_heads, &plan.rope)?;
            self.norm_rope(&mut k, &layer.k_norm, c.num_kv_heads, &plan.rope)?;
            let attn = block_attention(
                b,
                BlockAttention {
                    q: &q,
                    k: &k,
                    v: &v,
                    pages: kv.pages(l)?,
                    tables: &plan.tables,
                    stride: plan.stride,
                    ctx: &plan.ctx,
                    ctx_host: &plan.ctx_host,
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
        let logits = self.linear(&h, target.lm_head(), precision)?;
        Ok(BlockPass { hidden: h, logits })
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
        let kv = ctx
            .kv
            .ok_or_else(|| ModelError::Invalid("the DSpark drafter needs its KV".into()))?;
        let host = self.host_pass(inputs, kv.layout().page_size, None)?;
        let plan = self.upload_pass(&host)?;
        self.backbone(ctx.target, kv, &plan)
    }

    /// Buffers for what a pass over `n` inputs writes (a graph's outlive its capture).
    fn new_out(&self, n: usize, sampled: bool) -> Result<PassOut, ModelError> {
        let b = &self.backend;
        let blk = self.config.block_size;
        Ok(PassOut {
            drafts: b.ints(vec![0; blk * n])?,
            confidence: b.zeros(blk * n)?,
            width: n,
            q: sampled
                .then(|| b.zeros(n * blk * self.config.vocab_size))
                .transpose()?,
        })
    }

    /// One whole pass over `plan` into `out`: the backbone, then the Markov head left to
    /// right. Each step corrects the backbone's logits at block position `k` with the previous
    /// draft's bigram bias, builds the distribution the plain sampler would (greedy requests: a
    /// point mass at the argmax) and draws from it with the input's own uniform — all on the
    /// backend, issuing only ops (capturable into a graph). A batch of greedy requests only
    /// takes each step's argmax (no distributions, no q).
    fn run_pass(
        &self,
        target: &DeepseekModel,
        kv: &KvStore,
        plan: &PassPlan,
        out: &mut PassOut,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let b = &self.backend;
        let pass = self.backbone(target, kv, plan)?;
        let (blk, vocab) = (c.block_size, c.vocab_size);
        let n = plan.anchors.len();
        // Step-major q: row k·n + s is input s's distribution at block position k.
        let mut q_steps = match plan.params {
            Some(_) => Some(b.scratch(blk * n * vocab)?),
            None => None,
        };
        // A row that could not be drawn (-1) fails its own proposal; the next step must still
        // embed a valid id there: on the host the -1 is replaced by 0 (a device embed reads an
        // out-of-range id as a zero row).
        let mut prev: Option<Ints> = None;
        for (k, at) in plan.at.iter().enumerate() {
            let MarkovRows {
                logits: logits_k,
                confidence: conf,
            } = markov_step(
                b,
                MarkovStep {
                    logits: &pass.logits,
                    hidden: &pass.hidden,
                    at,
                    prev: prev.as_ref().unwrap_or(&plan.anchors),
                    w1: &self.markov.w1,
                    w2: &self.markov.w2,
                    conf_w: &self.confidence.w,
                    conf_bias: self.confidence.b,
                    precision: target.precision(),
                },
            )?;
            b.copy_into(&conf, &mut out.confidence, k * n)?;
            let ids = match (&plan.params, &plan.uniforms) {
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
                    draw_at(
                        b,
                        Draw {
                            probs: &p,
                            vocab,
                            uniforms,
                        },
                        k * n,
                    )?
                }
                _ => argmax(b, &logits_k, vocab)?,
            };
            b.copy_ints_into(&ids, &mut out.drafts, k * n)?;
            prev = Some(match ids {
                Ints::Host(v) => Ints::Host(v.iter().map(|&t| t.max(0)).collect()),
                // Device ids are clamped by the embedding kernel itself.
                #[allow(unreachable_patterns)]
                device => device,
            });
        }
        // Sequence-major q for the verifier: row s·B + k.
        if let (Some(q), Some(order), Some(dst)) = (q_steps, &plan.order, out.q.as_mut()) {
            let rows = gather(
                b,
                Gather {
                    src: &q,
                    rows: order,
                    width: vocab,
                },
            )?;
            b.copy_into(&rows, dst, 0)?;
        }
        Ok(())
    }

    /// The proposals of the first `inputs.len()` inputs of a pass's `out`: drafts and
    /// confidences downloaded (one download each), the q rows copied on the backend
    /// (a graph's buffers are overwritten by its next replay).
    fn collect(&self, inputs: &[DraftInput<'_>], out: &PassOut) -> Result<Proposals, ModelError> {
        let b = &self.backend;
        let (blk, vocab) = (self.config.block_size, self.config.vocab_size);
        let n = inputs.len();
        let w = out.width;
        let drafts = out.drafts.to_host()?;
        let confidence = out.confidence.to_host()?;
        let sampled: Vec<bool> = inputs.iter().map(|i| !i.params.is_greedy()).collect();
        let q = match &out.q {
            Some(all) if sampled.iter().any(|&s| s) => {
                let mut q = b.scratch(n * blk * vocab)?;
                b.copy_prefix(all, &mut q)?;
                Some(q)
            }
            _ => None,
        };
        let each = super::proposals_from((&drafts, &confidence), w, blk, &sampled);
        Ok(Proposals { each, q })
    }

    /// A pass replayed from a CUDA graph for `inputs`' batch-size bucket (captured on first
    /// use, recaptured when a context outgrows the graph's plan), or `None` when graphs do not
    /// apply (off, not on CUDA, too many inputs, a failed capture: the caller runs eagerly).
    /// The inputs are padded to the bucket with empty ones (anchor 0, no context). `finish`
    /// takes what the caller needs from the pass's outputs before anything overwrites them.
    #[cfg(feature = "cuda")]
    fn propose_graphed<T>(
        &self,
        target: &DeepseekModel,
        kv: &KvStore,
        inputs: &[DraftInput<'_>],
        finish: &impl Fn(&PassOut) -> Result<T, ModelError>,
    ) -> Result<Option<T>, ModelError> {
        let Backend::Cuda(dev) = &self.backend else {
            return Ok(None);
        };
        let n = inputs.len();
        // The engine's buckets, and its limit for decode steps (`FERRY_GRAPH_MAX_BATCH`).
        let bucket = match graph_bucket(n, graph_max_batch()) {
            Some(b) if self.use_graphs => b,
            _ => return Ok(None),
        };
        let kv_id = match kv.pages(0)? {
            ferry_kernels::backend::Pages::Cuda(v) => v.ptr,
            _ => return Ok(None),
        };
        let page = kv.layout().page_size;
        let greedy = inputs.iter().all(|i| i.params.is_greedy());
        let longest = inputs.iter().map(|i| i.context_len).max().unwrap_or(0);
        let max_pos = target.config().max_position_embeddings.max(longest);
        let plan_ctx = longest
            .max(1)
            .next_power_of_two()
            .max(MIN_GRAPH_CTX)
            .min(max_pos);
        let mut padded = inputs.to_vec();
        padded.resize(
            bucket,
            DraftInput {
                anchor: 0,
                context_len: 0,
                block_table: &[],
                tokens: &[],
                params: inputs[0].params,
                uniforms: &[],
            },
        );
        let host = self.host_pass(&padded, page, Some(plan_ctx))?;
        let mut graphs = self.graphs.borrow_mut();
        let key = (bucket, greedy);
        let fresh = graphs
            .get(&key)
            .is_some_and(|g| g.plan_ctx >= plan_ctx && g.kv == kv_id);
        if fresh {
            let Some(g) = graphs.get_mut(&key) else {
                return Ok(None);
            };
            self.refresh_pass(&mut g.plan, &host)?;
            g.graph.launch()?;
            return Ok(Some(finish(&g.out)?));
        }
        graphs.remove(&key);
        // Run once eagerly (compiling every kernel; its outputs are this call's), then capture.
        let plan = self.upload_pass(&host)?;
        let mut out = self.new_out(bucket, !greedy)?;
        self.run_pass(target, kv, &plan, &mut out)?;
        let proposals = finish(&out)?;
        dev.synchronize()?;
        dev.begin_capture()?;
        let run = self.run_pass(target, kv, &plan, &mut out);
        let graph = dev.end_capture();
        match (run, graph) {
            (Ok(()), Ok(graph)) => {
                tracing::debug!(bucket, greedy, plan_ctx, "captured a drafter graph");
                self.captures.set(self.captures.get() + 1);
                graphs.insert(
                    key,
                    DraftGraph {
                        graph,
                        plan,
                        out,
                        plan_ctx,
                        kv: kv_id,
                    },
                );
            }
            (run, graph) => {
                let e = run
                    .err()
                    .map(|e| e.to_string())
                    .or(graph.err().map(|e| e.to_string()));
                tracing::warn!(bucket, error = ?e, "drafter graph capture failed; drafting eagerly");
            }
        }
        Ok(Some(proposals))
    }

    /// One eager pass over `inputs`: uploads, ops, then `finish` of its outputs.
    fn propose_eager<T>(
        &self,
        target: &DeepseekModel,
        kv: &KvStore,
        inputs: &[DraftInput<'_>],
        finish: &impl Fn(&PassOut) -> Result<T, ModelError>,
    ) -> Result<T, ModelError> {
        let host = self.host_pass(inputs, kv.layout().page_size, None)?;
        let plan = self.upload_pass(&host)?;
        let mut out = self.new_out(inputs.len(), !host.greedy)?;
        self.run_pass(target, kv, &plan, &mut out)?;
        finish(&out)
    }

    /// A pass's drafts and confidences copied on the backend (a graph's buffers are
    /// overwritten by its next replay), for the first `n` inputs.
    fn queue(&self, n: usize, out: &PassOut) -> Result<QueuedDrafts, ModelError> {
        let b = &self.backend;
        Ok(QueuedDrafts::new(
            b.copy_ints(&out.drafts)?,
            b.copy(&out.confidence)?,
            (out.width, n, self.config.block_size),
        ))
    }

    /// The pass for `inputs` (replayed from a graph where one applies), then `finish` of its
    /// outputs.
    fn pass_with<T>(
        &self,
        ctx: &DraftCtx<'_>,
        inputs: &[DraftInput<'_>],
        finish: impl Fn(&PassOut) -> Result<T, ModelError>,
    ) -> Result<T, ModelError> {
        self.check_target(ctx.target)?;
        let kv = ctx
            .kv
            .ok_or_else(|| ModelError::Invalid("the DSpark drafter needs its KV".into()))?;
        #[cfg(feature = "cuda")]
        if let Some(done) = self.propose_graphed(ctx.target, kv, inputs, &finish)? {
            return Ok(done);
        }
        self.propose_eager(ctx.target, kv, inputs, &finish)
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
            use_graphs: self.use_graphs,
            #[cfg(feature = "cuda")]
            graphs: Default::default(),
            #[cfg(feature = "cuda")]
            captures: Default::default(),
        };
        Ok(())
    }

    fn set_graphs(&mut self, on: bool) {
        self.use_graphs = on;
        #[cfg(feature = "cuda")]
        self.graphs.get_mut().clear();
    }

    fn graph_captures(&self) -> u64 {
        #[cfg(feature = "cuda")]
        return self.captures.get();
        #[cfg(not(feature = "cuda"))]
        0
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
        match self.pass_with(ctx, inputs, |out| self.collect(inputs, out)) {
            Ok(p) => p,
            Err(e) => Proposals::failed(inputs.len(), &format!("drafter forward: {e}")),
        }
    }

    fn propose_queued(
        &self,
        ctx: &DraftCtx<'_>,
        inputs: &[DraftInput<'_>],
    ) -> Option<Result<QueuedDrafts, ModelError>> {
        // Sampled drafts fail on the host when a position has no valid distribution, and
        // their rows of q are the verifier's: only greedy passes stay queued.
        if inputs.is_empty() || !inputs.iter().all(|i| i.params.is_greedy()) {
            return None;
        }
        Some(self.pass_with(ctx, inputs, |out| self.queue(inputs.len(), out)))
    }
}
