//! The batched forward, written once over the op-level backend ([`ferry_kernels::backend`]).
//!
//! A forward is two steps. [`DeepseekModel::prepare`] computes everything host-side about the
//! batch — positions, cache slots, the rows whose logits are wanted, the attention launch plan
//! (runs of sequences sharing a form) — and puts it on the model's backend: on a GPU these are
//! the only uploads, so none happen between layers. [`DeepseekModel::execute`] then issues
//! only ops: embedding → per layer `x = norm(h)`, MLA (queries, latent write, attention per
//! run, `o_proj`), `h += attn`, `x = norm(h)`, dense MLP or MoE added into `h` → final norm, the
//! wanted rows, LM head. With no hooks it performs no host↔device copy and no synchronisation,
//! so a CUDA graph can capture it ([`crate::gpu::graph`]).
//!
//! Hooks run between layers on every device: `after_layer` as soon as a layer's latent rows are
//! written (CPU) or queued (GPU: work queued from then on runs after them), and `hidden` with
//! the residual stream after the tap layers (a drafter's context; a download on a GPU).

use ferry_kernels::backend::l2::warm_next_attention;
use ferry_kernels::backend::linear::{linear_add, linear_into, Linear};
use ferry_kernels::backend::mla_mha::MhaSeq;
use ferry_kernels::backend::mlp::{dense, DenseFfn};
use ferry_kernels::backend::moe::{moe, MoeFfn};
use ferry_kernels::backend::norm::{add_norm, rms_norm_into, AddNorm, RowNorm};
use ferry_kernels::backend::rope::RopeTable;
use ferry_kernels::backend::rows::{embed, gather, Embed, Gather};
use ferry_kernels::backend::sample::row_logprobs;
use ferry_kernels::backend::{Backend, Ints, Precision, Slots, Tensor};
use ferry_kernels::cpu::logits::TokenLogprobs;

use super::attention::{AttentionForm, FormPolicy};
use super::batch::{BatchGeometry, BatchInputs, BatchLogits, BatchOutput, SeqInput};
use super::{DeepseekModel, Ffn, QueryProj};
use crate::kv::{KvMut, KvPool, KvRef, KvRows};
use crate::ModelError;

/// Called after each layer's KV is written: `(layer, pool)` (the host-pool forward).
pub type LayerHook<'a> = dyn FnMut(usize, &KvPool) -> Result<(), ModelError> + Send + 'a;

/// Called after each decoder layer with the residual stream leaving it, `(layer, [T][hidden])`
/// for the whole batch in batch order (a speculative drafter taps its context from these).
pub type HiddenHook<'a> = dyn FnMut(usize, &[f32]) -> Result<(), ModelError> + Send + 'a;

/// Called with `(layer, kv)` once layer `layer`'s latent rows for every new token are written
/// (CPU) or queued behind the rest of its work (GPU), before its MLP.
pub type AfterLayer<'a> = dyn FnMut(usize, KvRef<'_>) -> Result<(), ModelError> + Send + 'a;

/// The callbacks of [`DeepseekModel::forward_with_hooks`] (a forward over the host pool).
pub struct ForwardHooks<'h, 'a> {
    /// See [`LayerHook`].
    pub after_layer: &'h mut LayerHook<'a>,
    /// See [`HiddenHook`]; called after every layer.
    pub hidden: &'h mut HiddenHook<'a>,
}

/// The callbacks of [`DeepseekModel::forward_hooked`] on any device; the default has none
/// (graph captures take none).
#[derive(Default)]
pub struct Hooks<'h, 'a> {
    /// See [`AfterLayer`].
    pub after_layer: Option<&'h mut AfterLayer<'a>>,
    /// Layers whose outgoing residual stream `hidden` receives (`None`: every layer).
    pub taps: Option<&'h [usize]>,
    /// See [`HiddenHook`].
    pub hidden: Option<&'h mut HiddenHook<'a>>,
    /// Receives `(layer, residual stream)` after each layer of `taps`, copied on the backend
    /// (device to device on a GPU: no download, no synchronisation) — a drafter on the same
    /// device reads its context from these.
    pub tapped: Option<&'h mut Vec<(usize, Tensor)>>,
    /// Like `tapped`, into buffers allocated beforehand, one per tap layer (`(layer, [T][hidden])`):
    /// what a captured graph writes (its buffers outlive the capture).
    pub tap_into: Option<&'h mut [(usize, Tensor)]>,
}

/// Everything a forward puts on the backend before its first op, and the host facts the ops
/// need. Owns no borrow, so a captured decode graph keeps it and refreshes its buffers in place.
pub(crate) struct Plan {
    pub(crate) geo: BatchGeometry,
    pub(crate) rope: RopeTable,
    pub(crate) slots: Slots,
    pub(crate) ids: Ints,
    pub(crate) runs: Vec<RunPlan>,
    pub(crate) picked: Ints,
    pub(crate) rows_per_seq: Vec<usize>,
}

/// One attention launch group, the same in every layer.
pub(crate) enum RunPlan {
    /// Sequences `first..end`, each with `sq` queries, in the absorbed form.
    Absorbed {
        first: usize,
        end: usize,
        sq: usize,
        table: Ints,
        stride: usize,
        ctx: Ints,
        max_ctx: usize,
    },
    /// Sequences `first..first + seqs.len()` in the MHA form, one launch group (each with its
    /// own query count).
    Mha {
        first: usize,
        seqs: Vec<MhaSeq>,
        table: Ints,
        stride: usize,
        cu_q: Ints,
        cu_k: Ints,
        q_seq: Ints,
    },
}

/// Keys (whole contexts) one MHA-form run decompresses at most, unless a single sequence has
/// more: the run's gathered latents, `kv_b` products and K / V live at once, ~25 KB a key at a
/// K3 rank's shape (the f32 `kv_b` product alone is 12 KB), so a run holds at most the ~400 MB
/// of scratch one 16k-token prompt needed on its own.
pub(crate) const MHA_RUN_MAX_KEYS: usize = 16_384;

/// Host-side inputs of one batch, computed before anything is uploaded.
pub(crate) struct HostInputs {
    pub(crate) geo: BatchGeometry,
    pub(crate) tokens: Vec<i32>,
    pub(crate) slots: Vec<i64>,
    pub(crate) rows: Vec<i32>,
    pub(crate) rows_per_seq: Vec<usize>,
}

pub(crate) fn host_inputs(batch: &BatchInputs<'_>, page: usize) -> HostInputs {
    let geo = BatchGeometry::new(&batch.seqs);
    let mut tokens = Vec::with_capacity(geo.positions.len());
    let mut slots = Vec::with_capacity(geo.positions.len());
    for s in &batch.seqs {
        for (i, &tok) in s.tokens.iter().enumerate() {
            let pos = s.start_pos + i;
            tokens.push(tok as i32);
            let block = s.block_table[pos / page].0 as i64;
            slots.push(block * page as i64 + (pos % page) as i64);
        }
    }
    let wanted = geo.logit_rows(&batch.seqs);
    let rows_per_seq = wanted.iter().map(|r| r.len()).collect();
    let rows = wanted.into_iter().flatten().map(|r| r as i32).collect();
    HostInputs {
        geo,
        tokens,
        slots,
        rows,
        rows_per_seq,
    }
}

impl DeepseekModel {
    /// Runs one batch (any mix of prefill chunks and decode steps) with the model's form
    /// policy, appending every new token's latent rows to `kv` (the host pool on the CPU, a
    /// device cache on a GPU) at its block table's positions; the caller owns the tables (and
    /// advances them afterwards). The batch is validated first, so a bad sequence fails the
    /// batch before any cache row is written.
    pub fn forward<K: KvRows + ?Sized>(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut K,
    ) -> Result<BatchOutput, ModelError> {
        self.forward_hooked(batch, kv, Hooks::default())
    }

    /// [`Self::forward`] with an explicit attention-form policy for this batch.
    pub fn forward_with<K: KvRows + ?Sized>(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut K,
        policy: FormPolicy,
    ) -> Result<BatchOutput, ModelError> {
        self.run(batch, kv.rows(), policy, Hooks::default())
    }

    /// [`Self::forward`] with host callbacks between layers ([`Hooks`]).
    pub fn forward_hooked<K: KvRows + ?Sized>(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut K,
        hooks: Hooks<'_, '_>,
    ) -> Result<BatchOutput, ModelError> {
        self.run(batch, kv.rows(), self.policy, hooks)
    }

    /// A forward over the host pool with `policy`, calling `hooks.after_layer(l, pool)` as soon
    /// as layer `l`'s latent rows are in the pool (so a prefill worker can ship that layer's KV
    /// while the next layers compute) and `hooks.hidden(l, h)` after every layer.
    pub fn forward_with_hooks(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut KvPool,
        policy: FormPolicy,
        hooks: ForwardHooks<'_, '_>,
    ) -> Result<BatchOutput, ModelError> {
        let ForwardHooks {
            after_layer,
            hidden,
        } = hooks;
        let mut on_layer = |l: usize, kv: KvRef<'_>| match kv.host() {
            Some(pool) => after_layer(l, pool),
            None => Err(ModelError::Kv("a host-pool hook got a device cache".into())),
        };
        let hooks = Hooks {
            after_layer: Some(&mut on_layer),
            taps: None,
            hidden: Some(hidden),
            tapped: None,
            tap_into: None,
        };
        self.run(batch, KvMut::Host(kv), policy, hooks)
    }

    /// [`Self::forward_hooked`] with an explicit attention-form policy, leaving the logits on
    /// the model's backend (the engine samples and verifies them there).
    pub fn forward_logits<K: KvRows + ?Sized>(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut K,
        policy: FormPolicy,
        hooks: Hooks<'_, '_>,
    ) -> Result<BatchLogits, ModelError> {
        self.run_logits(batch, kv.rows(), policy, hooks)
    }

    fn run(
        &self,
        batch: &BatchInputs<'_>,
        kv: KvMut<'_>,
        policy: FormPolicy,
        hooks: Hooks<'_, '_>,
    ) -> Result<BatchOutput, ModelError> {
        let out = self.run_logits(batch, kv, policy, hooks)?;
        BatchOutput::from_rows(&out.logits.into_host()?, &out.rows_per_seq, out.vocab)
    }

    fn run_logits(
        &self,
        batch: &BatchInputs<'_>,
        mut kv: KvMut<'_>,
        policy: FormPolicy,
        hooks: Hooks<'_, '_>,
    ) -> Result<BatchLogits, ModelError> {
        self.validate(batch, &kv)?;
        let plan = self.prepare(batch, kv.layout().page_size, None, policy)?;
        let n: usize = plan.rows_per_seq.iter().sum();
        let mut logits = self.backend.scratch(n * self.config.vocab_size)?;
        let x = self.execute_hidden(&plan, &mut kv, hooks)?;
        self.lm_head_rows(&plan, &x, &mut logits)?;
        let prompt = self.prompt_logprobs(batch, &plan.geo, &x)?;
        Ok(BatchLogits {
            logits,
            rows_per_seq: plan.rows_per_seq,
            vocab: self.config.vocab_size,
            prompt,
        })
    }

    /// The rows of `batch.prompt_logprobs` reduced to log-probabilities
    /// ([`super::PromptRows`]): the LM head over at most [`super::PROMPT_LOGITS_CHUNK_FLOATS`] floats
    /// (or what [`Self::set_prompt_logits_chunk`] set) of logits at a time (rows of
    /// several sequences share a chunk), each row reduced on the host at once
    /// (`row_logprobs`: on a GPU one gather and one download per chunk) and its logits
    /// dropped. `x` is the final-normed hidden state of every batch row.
    fn prompt_logprobs(
        &self,
        batch: &BatchInputs<'_>,
        geo: &BatchGeometry,
        x: &Tensor,
    ) -> Result<Vec<Result<Vec<TokenLogprobs>, String>>, ModelError> {
        let b = &self.backend;
        let vocab = self.config.vocab_size;
        let width = self.config.hidden_size;
        // (entry, batch row, target, top) for every wanted row, in batch order.
        let mut rows = Vec::new();
        for (e, p) in batch.prompt_logprobs.iter().enumerate() {
            let first = geo.spans.get(p.seq).map_or(0, |&(first, _)| first);
            for (k, &target) in p.targets.iter().enumerate() {
                rows.push((e, first + k, target, p.top));
            }
        }
        let mut out: Vec<Result<Vec<TokenLogprobs>, String>> = batch
            .prompt_logprobs
            .iter()
            .map(|p| Ok(Vec::with_capacity(p.targets.len())))
            .collect();
        let per_chunk = (self.prompt_chunk_floats / vocab.max(1)).max(1);
        for chunk in rows.chunks(per_chunk) {
            let at = b.ints(chunk.iter().map(|&(_, r, _, _)| r as i32).collect())?;
            let picked = gather(
                b,
                Gather {
                    src: x,
                    rows: &at,
                    width,
                },
            )?;
            let mut logits = b.scratch(chunk.len() * vocab)?;
            let p = Linear {
                x: &picked,
                w: self.lm_head(),
                precision: self.kernels.precision,
            };
            linear_into(b, p, &mut logits)?;
            let asked: Vec<(usize, usize)> = chunk
                .iter()
                .enumerate()
                .map(|(k, &(_, _, _, top))| (k, top))
                .collect();
            let reduced = row_logprobs(b, &logits, vocab, &asked)?;
            for (&(e, _, target, _), row) in chunk.iter().zip(reduced) {
                if let Some(Ok(list)) = out.get_mut(e) {
                    match row {
                        Ok(row) => list.push(row.of(target)),
                        Err(err) => out[e] = Err(format!("prompt log-probabilities: {err}")),
                    }
                }
            }
        }
        Ok(out)
    }

    /// Puts the batch's inputs on the backend. `plan_ctx` plans every absorbed run for that
    /// many positions (block tables padded to it) instead of the batch's own longest context,
    /// so a captured graph stays valid as sequences grow.
    pub(crate) fn prepare(
        &self,
        batch: &BatchInputs<'_>,
        page: usize,
        plan_ctx: Option<usize>,
        policy: FormPolicy,
    ) -> Result<Plan, ModelError> {
        let b = &self.backend;
        let hi = host_inputs(batch, page);
        let mut ids = b.ints(hi.tokens)?;
        batch.place_drafts(b, &mut ids)?;
        Ok(Plan {
            rope: RopeTable::new(b, &self.rope, &hi.geo.positions)?,
            slots: b.slots(hi.slots)?,
            ids,
            runs: self.plan_runs(&batch.seqs, page, plan_ctx, policy)?,
            picked: b.ints(hi.rows)?,
            rows_per_seq: hi.rows_per_seq,
            geo: hi.geo,
        })
    }

    /// Every op of the forward, writing the picked rows' logits into `logits`. Without hooks
    /// it performs no host↔device copy and no synchronisation (capturable into a graph).
    pub(crate) fn execute(
        &self,
        plan: &Plan,
        kv: &mut KvMut<'_>,
        logits: &mut Tensor,
        hooks: Hooks<'_, '_>,
    ) -> Result<(), ModelError> {
        let x = self.execute_hidden(plan, kv, hooks)?;
        self.lm_head_rows(plan, &x, logits)
    }

    /// The picked rows of the final-normed hidden state `x` through the LM head, into `logits`.
    fn lm_head_rows(&self, plan: &Plan, x: &Tensor, logits: &mut Tensor) -> Result<(), ModelError> {
        let b = &self.backend;
        let picked = gather(
            b,
            Gather {
                src: x,
                rows: &plan.picked,
                width: self.config.hidden_size,
            },
        )?;
        let p = Linear {
            x: &picked,
            w: self.lm_head(),
            precision: self.kernels.precision,
        };
        Ok(linear_into(b, p, logits)?)
    }

    /// Every op of the forward up to the final norm: the final-normed hidden state of every
    /// batch row (`[T][hidden]`), which the LM head reads.
    fn execute_hidden(
        &self,
        plan: &Plan,
        kv: &mut KvMut<'_>,
        hooks: Hooks<'_, '_>,
    ) -> Result<Tensor, ModelError> {
        let Hooks {
            mut after_layer,
            taps,
            mut hidden,
            mut tapped,
            mut tap_into,
        } = hooks;
        let b = &self.backend;
        let width = self.config.hidden_size;
        let eps = self.config.rms_norm_eps;
        let t = plan.geo.positions.len();
        let mut h = embed(
            b,
            Embed {
                table: &self.embed,
                ids: &plan.ids,
            },
        )?;
        let mut x = b.scratch(t * width)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let norm = |weight| RowNorm { weight, eps };
            rms_norm_into(b, &h, norm(&layer.input_norm), &mut x)?;
            let attn = self.attention(l, &x, plan, kv)?;
            // `h += o_proj(attn)`, added in place (no separate add on a GPU).
            let p = Linear {
                x: &attn,
                w: &layer.attn.o,
                precision: self.kernels.precision,
            };
            linear_add(b, p, &mut h)?;
            if let Some(hook) = after_layer.as_mut() {
                hook(l, kv.as_ref())?;
            }
            rms_norm_into(b, &h, norm(&layer.post_norm), &mut x)?;
            // The next layer's first projections into L2 while the router and the routing
            // leave HBM idle (`FERRY_L2_WARM=next_attn`; nothing by default).
            if let Some(next) = self.layers.get(l + 1) {
                let first = match &next.attn.q {
                    QueryProj::LowRank { a, .. } => a,
                    QueryProj::Full(p) => p,
                };
                warm_next_attention(b, first, &next.attn.kv_a)?;
            }
            let precision = self.kernels.precision;
            match &layer.ffn {
                Ffn::Dense(w) => dense(
                    b,
                    DenseFfn {
                        w,
                        x: &x,
                        h: &mut h,
                        precision,
                    },
                )?,
                Ffn::Moe(w) => moe(
                    b,
                    MoeFfn {
                        w,
                        x: &x,
                        h: &mut h,
                        precision,
                    },
                )?,
            }
            if let Some(kept) = tapped.as_mut() {
                if taps.is_some_and(|taps| taps.contains(&l)) {
                    kept.push((l, b.copy(&h)?));
                }
            }
            if let Some(bufs) = tap_into.as_mut() {
                for (_, buf) in bufs.iter_mut().filter(|(t, _)| *t == l) {
                    b.copy_into(&h, buf, 0)?;
                }
            }
            if let Some(hook) = hidden.as_mut() {
                if taps.is_none_or(|taps| taps.contains(&l)) {
                    match h.host("forward", "hidden") {
                        Ok(v) => hook(l, v)?,
                        // A synchronising download: only forwards that feed a drafter tap.
                        Err(_) => hook(l, &h.to_host()?)?,
                    }
                }
            }
        }
        let p = AddNorm {
            h: &mut h,
            delta: None,
            weight: &self.norm,
            out: Some(&mut x),
            width,
            eps,
        };
        add_norm(b, p)?;
        Ok(x)
    }

    /// Groups the batch into attention launches: runs of consecutive sequences that take the
    /// absorbed form with equal query counts share one launch, and so do runs of consecutive
    /// MHA-form sequences (fresh prompts, long chunks) up to [`MHA_RUN_MAX_KEYS`] keys.
    fn plan_runs(
        &self,
        seqs: &[SeqInput<'_>],
        page: usize,
        plan_ctx: Option<usize>,
        policy: FormPolicy,
    ) -> Result<Vec<RunPlan>, ModelError> {
        let b = &self.backend;
        let d = &self.dims;
        let mut runs = Vec::new();
        let mut i = 0;
        while i < seqs.len() {
            let s0 = &seqs[i];
            if s0.tokens.is_empty() {
                i += 1;
                continue;
            }
            let form = policy.choose(d, s0.start_pos, s0.tokens.len());
            if form == AttentionForm::Mha {
                let group = mha_group(&seqs[i..], |s| {
                    policy.choose(d, s.start_pos, s.tokens.len()) == AttentionForm::Mha
                });
                let (flat, stride) = flat_tables_min(&seqs[i..i + group.len()], page, 0);
                let mut cu_q = vec![0i32];
                let mut cu_k = vec![0i32];
                let mut q_seq = Vec::new();
                for (n, g) in group.iter().enumerate() {
                    cu_q.push(cu_q[n] + g.sq as i32);
                    cu_k.push(cu_k[n] + g.keys() as i32);
                    q_seq.extend(std::iter::repeat_n(n as i32, g.sq));
                }
                let next = i + group.len();
                runs.push(RunPlan::Mha {
                    first: i,
                    seqs: group,
                    table: b.ints(flat)?,
                    stride,
                    cu_q: b.ints(cu_q)?,
                    cu_k: b.ints(cu_k)?,
                    q_seq: b.ints(q_seq)?,
                });
                i = next;
                continue;
            }
            let mut j = i + 1;
            while j < seqs.len()
                && seqs[j].tokens.len() == s0.tokens.len()
                && policy.choose(d, seqs[j].start_pos, seqs[j].tokens.len()) == form
            {
                j += 1;
            }
            let (flat, stride) = flat_tables_min(&seqs[i..j], page, plan_ctx.unwrap_or(0));
            let ctx: Vec<i32> = seqs[i..j]
                .iter()
                .map(|s| (s.start_pos + s.tokens.len()) as i32)
                .collect();
            let max_ctx =
                (ctx.iter().copied().max().unwrap_or(1) as usize).max(plan_ctx.unwrap_or(0));
            runs.push(RunPlan::Absorbed {
                first: i,
                end: j,
                sq: s0.tokens.len(),
                table: b.ints(flat)?,
                stride,
                ctx: b.ints(ctx)?,
                max_ctx,
            });
            i = j;
        }
        Ok(runs)
    }

    /// Rejects a batch that would index out of range anywhere (naming the sequence and field),
    /// or KV rows that do not fit this model's backend and precision.
    pub(crate) fn validate(
        &self,
        batch: &BatchInputs<'_>,
        kv: &KvMut<'_>,
    ) -> Result<(), ModelError> {
        let on_host = matches!(kv, KvMut::Host(_));
        if on_host != matches!(self.backend, Backend::Cpu) {
            return Err(ModelError::Kv(format!(
                "a {} does not hold the rows of a model on the {}",
                kv.place(),
                self.backend.name()
            )));
        }
        if !on_host && kv.is_bf16() != (self.kernels.precision == Precision::Fast) {
            return Err(ModelError::Kv(format!(
                "a {} latent cache does not fit a {:?}-precision model",
                if kv.is_bf16() { "bf16" } else { "f32" },
                self.kernels.precision
            )));
        }
        batch.check(&self.config, self.layers.len(), kv.layout())
    }

    /// Embedding rows of `tokens` into `out` (`[tokens][hidden]`): the input layer a drafter
    /// shares with this model (host weights).
    pub fn embed_tokens(&self, tokens: &[u32], out: &mut [f32]) -> Result<(), ModelError> {
        let hidden = self.config.hidden_size;
        if out.len() != tokens.len() * hidden {
            return Err(ModelError::Invalid(format!(
                "embed_tokens: `out` holds {} floats, {} tokens need {}",
                out.len(),
                tokens.len(),
                tokens.len() * hidden
            )));
        }
        let table = self.embed.host("embed_tokens", "embed")?;
        for (row, &tok) in out.chunks_exact_mut(hidden).zip(tokens) {
            table.row_f32(tok as usize, row)?;
        }
        Ok(())
    }

    /// `out = x · lm_headᵀ` for rows `x` that are already normalised (`[rows][hidden]` →
    /// `[rows][vocab]`): the output layer a drafter shares with this model (host weights).
    pub fn lm_head_logits(&self, x: &[f32], out: &mut [f32]) -> Result<(), ModelError> {
        let head = self.lm_head().host("lm_head_logits", "lm_head")?;
        Ok(ferry_kernels::cpu::gemm::linear(x, head, out)?)
    }
}

/// The MHA-form run that starts at `seqs[0]`: it and the sequences after it that have tokens
/// and take the MHA form (`mha`), while their keys fit [`MHA_RUN_MAX_KEYS`] (the first always
/// goes, however long).
fn mha_group(seqs: &[SeqInput<'_>], mha: impl Fn(&SeqInput<'_>) -> bool) -> Vec<MhaSeq> {
    let mut group: Vec<MhaSeq> = Vec::new();
    let mut keys = 0;
    for s in seqs {
        let seq = MhaSeq {
            sq: s.tokens.len(),
            start: s.start_pos,
        };
        let first = group.is_empty();
        if !first && (seq.sq == 0 || !mha(s) || keys + seq.keys() > MHA_RUN_MAX_KEYS) {
            break;
        }
        keys += seq.keys();
        group.push(seq);
    }
    group
}

/// Block tables of `seqs` as one `[n][stride]` i32 array, rows covering at least
/// `min_positions` positions (missing entries 0).
pub(crate) fn flat_tables_min(
    seqs: &[SeqInput<'_>],
    page: usize,
    min_positions: usize,
) -> (Vec<i32>, usize) {
    let stride = seqs
        .iter()
        .map(|s| (s.start_pos + s.tokens.len()).div_ceil(page))
        .max()
        .unwrap_or(1)
        .max(min_positions.div_ceil(page))
        .max(1);
    let mut flat = vec![0i32; stride * seqs.len()];
    for (i, s) in seqs.iter().enumerate() {
        for (j, b) in s.block_table.iter().take(stride).enumerate() {
            flat[i * stride + j] = b.0 as i32;
        }
    }
    (flat, stride)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deepseek::batch::LogitsWanted;

    fn seq(tokens: &[u32], start_pos: usize) -> SeqInput<'_> {
        SeqInput {
            tokens,
            start_pos,
            block_table: &[],
            logits: LogitsWanted::Last,
        }
    }

    /// Fresh prompts share a run up to the key cap; a decode row, an empty sequence or the
    /// cap ends it; a first sequence past the cap still goes, alone.
    #[test]
    fn consecutive_mha_sequences_share_a_run_up_to_the_key_cap() {
        let long = vec![0u32; MHA_RUN_MAX_KEYS];
        let prompt = vec![0u32; 1024];
        let mha = |s: &SeqInput<'_>| s.tokens.len() > 1;
        let keys = |g: &[MhaSeq]| g.iter().map(MhaSeq::keys).collect::<Vec<_>>();

        let batch = [
            seq(&prompt, 0),
            seq(&prompt, 24),
            seq(&[1], 99),
            seq(&prompt, 0),
        ];
        assert_eq!(
            keys(&mha_group(&batch, mha)),
            [1024, 1048],
            "a decode row ends it"
        );

        let batch = [seq(&prompt, 0), seq(&[], 5), seq(&prompt, 0)];
        assert_eq!(
            keys(&mha_group(&batch, mha)),
            [1024],
            "an empty sequence ends it"
        );

        let many: Vec<_> = (0..17).map(|_| seq(&prompt, 0)).collect();
        let g = mha_group(&many, mha);
        assert_eq!(g.len(), MHA_RUN_MAX_KEYS / 1024, "the cap ends it");

        let batch = [seq(&long, 8), seq(&prompt, 0)];
        assert_eq!(
            keys(&mha_group(&batch, mha)),
            [MHA_RUN_MAX_KEYS + 8],
            "past the cap, alone"
        );
    }
}
