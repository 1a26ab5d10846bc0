//! The batched forward on the device.
//!
//! Per layer: `x = norm(h)`; queries (low-rank or full, RoPE), the new latent rows
//! (`kv_a_proj`, norm, RoPE, written to the cache in one kernel); attention per run of
//! consecutive sequences that share a form (absorbed: absorb → kernel → unabsorb, one launch
//! for a whole decode batch; MHA: gather the sequence's latents, decompress with `kv_b_proj`,
//! causal attention); `o_proj`; `h += attn`, `x = norm(h)`; dense MLP or MoE (routing and
//! experts on device, shared experts as extra expert slots, the sum added straight into `h`).
//! Only the requested logits rows go through the LM head and come back to the host.

use ferry_kernels::cpu::rope::RotaryLayout;
use ferry_kernels::cuda::mla::{
    mha_prefill, mla_absorbed, mla_absorbed_padded, AbsorbedBatch, AbsorbedKernel, Elems, MhaBatch,
    MhaKernel,
};
use ferry_kernels::cuda::ops::{
    self, AbsorbedOut, Dv, HeadShape, KvOut, LatentFinish, LatentRows, NormRows, PagesView,
    RopeTables, Routes,
};
use ferry_kernels::cuda::{DeviceBuffer, GpuMatrix};

use super::{GpuFfn, GpuKvCache, GpuLayer, GpuMode, GpuModel, GpuQuery};
use crate::deepseek::batch::BatchGeometry;
use crate::deepseek::LATENT_NORM_EPS;
use crate::deepseek::{AttentionForm, BatchInputs, BatchOutput, SeqInput};
use crate::ModelError;

/// [`GpuHooks::hidden`]: `(layer, [T][hidden])` on the host.
pub type TapHook<'a> = dyn FnMut(usize, &[f32]) -> Result<(), ModelError> + 'a;

/// [`GpuHooks::after_attention`]: the layer whose latent rows were just queued.
pub type AttentionHook<'a> = dyn FnMut(usize) -> Result<(), ModelError> + 'a;

/// Host callbacks between the layers of [`GpuModel::forward_hooked`]; the default has none
/// (graph captures take none).
#[derive(Default)]
pub struct GpuHooks<'a> {
    /// Called with `l` as soon as layer `l`'s latent rows are *queued* (right after its
    /// attention, before its MLP): work queued on the device's stream from then on runs after
    /// them, so a copy ordered behind a
    /// [`CudaDevice::mark`](ferry_kernels::cuda::CudaDevice::mark) taken here reads the layer's
    /// final rows while later layers compute.
    pub after_attention: Option<&'a mut AttentionHook<'a>>,
    /// Layers whose outgoing residual stream `hidden` receives.
    pub taps: &'a [usize],
    /// Called with `(l, [T][hidden])` after each layer in `taps`, downloaded to the host (a
    /// drafter's context features), in batch order like the CPU forward's hidden hook.
    pub hidden: Option<&'a mut TapHook<'a>>,
}

/// Everything a forward uploads before its first launch (uploads synchronise the stream, so
/// none happen between layers), and the host facts the launches need. Owns no borrow, so a
/// captured decode graph can keep it and refresh its buffers in place.
pub(crate) struct Shared {
    pub(super) geo: BatchGeometry,
    pub(super) rope: RopeTables,
    pub(super) slots: DeviceBuffer<i64>,
    pub(super) ids: DeviceBuffer<i32>,
    pub(super) runs: Vec<RunPlan>,
    pub(super) picked: DeviceBuffer<i32>,
    pub(super) rows_per_seq: Vec<usize>,
}

/// One attention launch group, the same in every layer.
pub(super) enum RunPlan {
    /// Sequences `first..end`, each with `sq` queries, in the absorbed form.
    Absorbed {
        first: usize,
        end: usize,
        sq: usize,
        table: DeviceBuffer<i32>,
        stride: usize,
        ctx: DeviceBuffer<i32>,
        max_ctx: usize,
    },
    /// Sequence `seq` (`sq` queries after `start` cached positions) in the MHA form.
    Mha {
        seq: usize,
        sq: usize,
        start: usize,
        table: DeviceBuffer<i32>,
        cu_q: DeviceBuffer<i32>,
        cu_k: DeviceBuffer<i32>,
        q_seq: DeviceBuffer<i32>,
    },
}

/// Host-side inputs of one batch, computed before anything is uploaded.
pub(super) struct HostInputs {
    pub(super) geo: BatchGeometry,
    pub(super) tokens: Vec<i32>,
    pub(super) slots: Vec<i64>,
    pub(super) rows: Vec<i32>,
    pub(super) rows_per_seq: Vec<usize>,
}

pub(super) fn host_inputs(batch: &BatchInputs<'_>, page: usize) -> HostInputs {
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

impl GpuModel {
    /// Runs one batch (any mix of prefill chunks and decode steps), appending every new
    /// token's latent rows to `kv` at its block table's positions; the caller owns the tables.
    pub fn forward(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut GpuKvCache,
    ) -> Result<BatchOutput, ModelError> {
        self.forward_hooked(batch, kv, GpuHooks::default())
    }

    /// [`Self::forward`] with host callbacks between layers ([`GpuHooks`]).
    pub fn forward_hooked(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut GpuKvCache,
        hooks: GpuHooks<'_>,
    ) -> Result<BatchOutput, ModelError> {
        self.validate(batch, kv)?;
        let sh = self.prepare(batch, kv.layout().page_size, None)?;
        let n: usize = sh.rows_per_seq.iter().sum();
        let logits = self.dev.alloc::<f32>(n * self.config.vocab_size)?;
        self.execute_hooked(&sh, kv, logits.v(), hooks)?;
        self.split_logits(&self.dev.download(&logits)?, &sh.rows_per_seq)
    }

    /// Uploads the batch's inputs. `plan_ctx` plans every absorbed run for that many
    /// positions (block tables padded to it) instead of the batch's own longest context, so a
    /// captured graph stays valid as sequences grow.
    pub(crate) fn prepare(
        &self,
        batch: &BatchInputs<'_>,
        page: usize,
        plan_ctx: Option<usize>,
    ) -> Result<Shared, ModelError> {
        let dev = &self.dev;
        let hi = host_inputs(batch, page);
        Ok(Shared {
            rope: RopeTables::new(dev, &self.rope, &hi.geo.positions)?,
            slots: dev.upload(&hi.slots)?,
            ids: dev.upload(&hi.tokens)?,
            runs: self.plan_runs(&batch.seqs, page, plan_ctx)?,
            picked: dev.upload(&hi.rows)?,
            rows_per_seq: hi.rows_per_seq,
            geo: hi.geo,
        })
    }

    /// Every launch of the forward, writing the picked rows' logits into `logits`. Performs
    /// no host↔device copy and no synchronisation, so it can be captured into a graph.
    pub(crate) fn execute(
        &self,
        sh: &Shared,
        kv: &mut GpuKvCache,
        logits: Dv<f32>,
    ) -> Result<(), ModelError> {
        self.execute_hooked(sh, kv, logits, GpuHooks::default())
    }

    /// [`Self::execute`] with a host callback after each layer's attention (see
    /// [`Self::forward_hooked`]); a graph capture passes none.
    pub(crate) fn execute_hooked(
        &self,
        sh: &Shared,
        kv: &mut GpuKvCache,
        logits: Dv<f32>,
        hooks: GpuHooks<'_>,
    ) -> Result<(), ModelError> {
        let GpuHooks {
            mut after_attention,
            taps,
            hidden: mut on_hidden,
        } = hooks;
        let dev = &self.dev;
        let hidden = self.config.hidden_size;
        let t = sh.geo.positions.len();
        let h = dev.alloc::<f32>(t * hidden)?;
        let x = dev.alloc::<f32>(t * hidden)?;
        ops::embed(dev, &self.embed, sh.ids.v(), h.v())?;
        for (l, layer) in self.layers.iter().enumerate() {
            self.norm_into(h.v(), None, &layer.input_norm, x.v())?;
            let attn = self.attention(l, x.v(), sh, kv)?;
            if let Some(hook) = after_attention.as_mut() {
                hook(l)?;
            }
            self.norm_into(h.v(), Some(attn.v()), &layer.post_norm, x.v())?;
            self.ffn(layer, x.v(), h.v())?;
            if let Some(hook) = on_hidden.as_mut().filter(|_| taps.contains(&l)) {
                // A synchronising download: only forwards that feed a drafter tap.
                hook(l, &dev.download(&h)?)?;
            }
        }
        self.norm_into(h.v(), None, &self.norm, x.v())?;
        let n = sh.picked.len();
        let picked = dev.alloc::<f32>(n * hidden)?;
        ops::gather_rows(dev, x.v(), sh.picked.v(), picked.v(), hidden)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        ops::linear(dev, picked.v(), head, logits, self.mode.gemm())?;
        Ok(())
    }

    pub(crate) fn split_logits(
        &self,
        all: &[f32],
        rows_per_seq: &[usize],
    ) -> Result<BatchOutput, ModelError> {
        BatchOutput::from_rows(all, rows_per_seq, self.config.vocab_size)
    }

    fn norm_into(
        &self,
        h: Dv<f32>,
        delta: Option<Dv<f32>>,
        w: &DeviceBuffer<f32>,
        out: Dv<f32>,
    ) -> Result<(), ModelError> {
        let p = NormRows {
            h,
            delta,
            weight: w.v(),
            out: Some(out),
            width: self.config.hidden_size,
        };
        Ok(ops::add_rms_norm(&self.dev, p, self.config.rms_norm_eps)?)
    }

    fn linear(
        &self,
        x: Dv<f32>,
        w: &GpuMatrix,
        rows: usize,
    ) -> Result<DeviceBuffer<f32>, ModelError> {
        let out = self.dev.alloc::<f32>(rows * w.rows())?;
        ops::linear(&self.dev, x, w, out.v(), self.mode.gemm())?;
        Ok(out)
    }

    fn ffn(&self, layer: &GpuLayer, x: Dv<f32>, h: Dv<f32>) -> Result<(), ModelError> {
        let dev = &self.dev;
        let t = x.len / self.config.hidden_size;
        match &layer.ffn {
            GpuFfn::Dense { gate, up, down } => {
                let g = self.linear(x, gate, t)?;
                let u = self.linear(x, up, t)?;
                ops::silu_mul(dev, g.v(), u.v())?;
                let y = self.linear(g.v(), down, t)?;
                let p = NormRows {
                    h,
                    delta: Some(y.v()),
                    weight: y.v(),
                    out: None,
                    width: self.config.hidden_size,
                };
                Ok(ops::add_rms_norm(dev, p, 0.0)?)
            }
            GpuFfn::Moe {
                router,
                bias,
                experts,
                routing,
            } => {
                let logits = self.linear(x, router, t)?;
                let slots = (routing.top_k + routing.n_shared) as usize;
                let ids = dev.alloc::<i32>(t * slots)?;
                let w = dev.alloc::<f32>(t * slots)?;
                let routes = Routes {
                    ids: ids.v(),
                    weights: w.v(),
                    slots,
                };
                ops::moe_route(dev, logits.v(), bias.v(), *routing, routes)?;
                Ok(ops::moe_experts(dev, x, routes, experts, h)?)
            }
        }
    }

    fn head_shape(&self) -> HeadShape {
        let d = &self.dims;
        HeadShape {
            heads: d.heads,
            nope: d.qk_nope_head_dim,
            rope: d.qk_rope_head_dim,
            v: d.v_head_dim,
            kv_lora: d.kv_lora_rank,
        }
    }

    /// MLA of one layer for `x [T][hidden]`; returns `o_proj` output `[T][hidden]`.
    fn attention(
        &self,
        l: usize,
        x: Dv<f32>,
        sh: &Shared,
        kv: &mut GpuKvCache,
    ) -> Result<DeviceBuffer<f32>, ModelError> {
        let layer = &self.layers[l];
        let dev = &self.dev;
        let d = &self.dims;
        let w = &layer.attn;
        let t = sh.geo.positions.len();
        let qk = d.qk_head_dim();
        let q = match &w.q {
            GpuQuery::LowRank { a, norm, b } => {
                let qa = self.linear(x, a, t)?;
                ops::rms_norm_strided(dev, qa.v(), a.rows(), norm.v(), LATENT_NORM_EPS)?;
                self.linear(qa.v(), b, t)?
            }
            GpuQuery::Full(p) => self.linear(x, p, t)?,
        };
        let layout = RotaryLayout {
            heads: d.heads,
            head_stride: qk,
            offset: d.qk_nope_head_dim,
        };
        ops::rope(dev, q.v(), &sh.rope, layout)?;
        let latent = self.linear(x, &w.kv_a, t)?;
        let pages = kv.pages(l)?;
        let fin = LatentFinish {
            latent: latent.v(),
            norm: w.kv_a_norm.v(),
            eps: LATENT_NORM_EPS,
            rope: &sh.rope,
            slots: sh.slots.v(),
        };
        ops::latent_finish(dev, &fin, pages)?;

        let hv = d.heads * d.v_head_dim;
        let attn = dev.alloc::<f32>(t * hv)?;
        for run in &sh.runs {
            let io = AttnIo {
                q: q.v(),
                kv_b: &w.kv_b,
                pages,
                out: attn.v(),
            };
            match run {
                RunPlan::Absorbed { .. } => self.absorbed_run(run, io, sh)?,
                RunPlan::Mha { .. } => self.mha_seq(run, io, sh)?,
            }
        }
        self.linear(attn.v(), &w.o, t)
    }
}

/// Block tables of `seqs` as one `[n][stride]` i32 array.
fn flat_tables(seqs: &[SeqInput<'_>], page: usize) -> (Vec<i32>, usize) {
    flat_tables_min(seqs, page, 0)
}

/// [`flat_tables`] with rows covering at least `min_positions` positions (missing entries 0).
pub(super) fn flat_tables_min(
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

/// What one layer's attention reads and writes.
#[derive(Clone, Copy)]
struct AttnIo<'a> {
    /// `[T][H][qk]` roped queries.
    q: Dv<f32>,
    kv_b: &'a GpuMatrix,
    pages: PagesView,
    /// `[T][H][v]` output.
    out: Dv<f32>,
}

impl GpuModel {
    /// Groups the batch into attention launches: runs of consecutive sequences that take the
    /// absorbed form with equal query counts share one launch; MHA-form sequences go alone.
    fn plan_runs(
        &self,
        seqs: &[SeqInput<'_>],
        page: usize,
        plan_ctx: Option<usize>,
    ) -> Result<Vec<RunPlan>, ModelError> {
        let dev = &self.dev;
        let d = &self.dims;
        let mut runs = Vec::new();
        let mut i = 0;
        while i < seqs.len() {
            let s0 = &seqs[i];
            let form = self.policy.choose(d, s0.start_pos, s0.tokens.len());
            if form == AttentionForm::Mha {
                let (flat, _) = flat_tables(std::slice::from_ref(s0), page);
                let (sq, l) = (s0.tokens.len(), s0.start_pos + s0.tokens.len());
                runs.push(RunPlan::Mha {
                    seq: i,
                    sq,
                    start: s0.start_pos,
                    table: dev.upload(&flat)?,
                    cu_q: dev.upload(&[0i32, sq as i32])?,
                    cu_k: dev.upload(&[0i32, l as i32])?,
                    q_seq: dev.zeros::<i32>(sq)?,
                });
                i += 1;
                continue;
            }
            let mut j = i + 1;
            while j < seqs.len()
                && seqs[j].tokens.len() == s0.tokens.len()
                && self
                    .policy
                    .choose(d, seqs[j].start_pos, seqs[j].tokens.len())
                    == form
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
                table: dev.upload(&flat)?,
                stride,
                ctx: dev.upload(&ctx)?,
                max_ctx,
            });
            i = j;
        }
        Ok(runs)
    }

    /// Absorbed form for one [`RunPlan::Absorbed`] group.
    fn absorbed_run(&self, run: &RunPlan, io: AttnIo<'_>, sh: &Shared) -> Result<(), ModelError> {
        let RunPlan::Absorbed {
            first,
            end,
            sq,
            table,
            stride,
            ctx,
            max_ctx,
        } = run
        else {
            return Err(ModelError::Invalid("absorbed_run given an MHA run".into()));
        };
        let (stride, max_ctx, sq, n_seqs) = (*stride, *max_ctx, *sq, end - first);
        let dev = &self.dev;
        let d = &self.dims;
        let hs = self.head_shape();
        let first_row = sh.geo.spans[*first].0;
        let rows = n_seqs * sq;
        let (qk, lw, hv) = (d.qk_head_dim(), d.latent_width(), d.heads * d.v_head_dim);
        let q = io.q.sub(first_row * d.heads * qk, rows * d.heads * qk)?;
        let o_lat = dev.alloc::<f32>(rows * d.heads * d.kv_lora_rank)?;
        let out = io.out.sub(first_row * hv, rows * hv)?;
        let mk = |q: Elems| AbsorbedBatch {
            q,
            pages: io.pages,
            block_table: table.v(),
            bt_stride: stride,
            ctx_len: ctx.v(),
            max_ctx,
            batch: n_seqs,
            sq,
            heads: d.heads,
            scale: self.scale,
        };
        match self.mode {
            GpuMode::Exact => {
                let q_abs = dev.alloc::<f32>(rows * d.heads * lw)?;
                ops::absorb(dev, q, io.kv_b, hs, AbsorbedOut::F32(q_abs.v()))?;
                let b = mk(Elems::F32(q_abs.v()));
                mla_absorbed(dev, self.shape, AbsorbedKernel::Generic, &b, o_lat.v())?;
            }
            GpuMode::Fast => {
                let q_abs = dev.alloc::<u16>(rows * d.heads * lw)?;
                ops::absorb(dev, q, io.kv_b, hs, AbsorbedOut::Bf16(q_abs.v()))?;
                let b = mk(Elems::Bf16(q_abs.v()));
                match self.absorbed {
                    AbsorbedKernel::Tile if self.shape.tile_ok() => {
                        mla_absorbed_padded(dev, self.shape, &b, o_lat.v())?
                    }
                    AbsorbedKernel::Packed if self.shape.tile_ok() => {
                        mla_absorbed(dev, self.shape, AbsorbedKernel::Packed, &b, o_lat.v())?
                    }
                    _ => mla_absorbed(dev, self.shape, AbsorbedKernel::Generic, &b, o_lat.v())?,
                }
            }
        }
        Ok(ops::unabsorb(dev, o_lat.v(), io.kv_b, hs, out)?)
    }

    /// MHA form for one sequence: decompress its whole context, causal attention.
    fn mha_seq(&self, run: &RunPlan, io: AttnIo<'_>, sh: &Shared) -> Result<(), ModelError> {
        let RunPlan::Mha {
            seq,
            sq,
            start,
            table,
            cu_q,
            cu_k,
            q_seq,
        } = run
        else {
            return Err(ModelError::Invalid("mha_seq given an absorbed run".into()));
        };
        let (sq, start) = (*sq, *start);
        let dev = &self.dev;
        let d = &self.dims;
        let hs = self.head_shape();
        let first_row = sh.geo.spans[*seq].0;
        let l = start + sq;
        let (qk, lw, h, v) = (d.qk_head_dim(), d.latent_width(), d.heads, d.v_head_dim);
        let lat = dev.alloc::<f32>(l * lw)?;
        let ckv = dev.alloc::<f32>(l * d.kv_lora_rank)?;
        let rows = LatentRows {
            rows: lat.v(),
            ckv: ckv.v(),
            kv_lora: d.kv_lora_rank,
        };
        ops::gather_latent(dev, io.pages, table.v(), l, rows)?;
        let kvx = self.linear(ckv.v(), io.kv_b, l)?;
        let q = io.q.sub(first_row * h * qk, sq * h * qk)?;
        let out = io.out.sub(first_row * h * v, sq * h * v)?;
        let mk = |q, k, vv| MhaBatch {
            q,
            k,
            v: vv,
            cu_q: cu_q.v(),
            cu_k: cu_k.v(),
            q_seq: q_seq.v(),
            batch: 1,
            max_q: sq,
            heads: h,
            scale: self.scale,
        };
        if self.mode == GpuMode::Fast && self.shape.flash_ok() {
            let kb = dev.alloc::<u16>(l * h * qk)?;
            let vb = dev.alloc::<u16>(l * h * v)?;
            ops::mha_build_kv(dev, kvx.v(), lat.v(), hs, KvOut::Bf16(kb.v(), vb.v()))?;
            let qb = dev.alloc::<u16>(sq * h * qk)?;
            ops::cast_f32_bf16(dev, q, qb.v())?;
            let b = mk(
                Elems::Bf16(qb.v()),
                Elems::Bf16(kb.v()),
                Elems::Bf16(vb.v()),
            );
            mha_prefill(
                dev,
                self.shape,
                MhaKernel::best_bf16(dev, self.shape),
                &b,
                out,
            )?;
        } else {
            let kf = dev.alloc::<f32>(l * h * qk)?;
            let vf = dev.alloc::<f32>(l * h * v)?;
            ops::mha_build_kv(dev, kvx.v(), lat.v(), hs, KvOut::F32(kf.v(), vf.v()))?;
            let b = mk(Elems::F32(q), Elems::F32(kf.v()), Elems::F32(vf.v()));
            mha_prefill(dev, self.shape, MhaKernel::F32, &b, out)?;
        }
        Ok(())
    }

    /// Rejects a batch that would index out of range, naming the sequence and field.
    pub(super) fn validate(
        &self,
        batch: &BatchInputs<'_>,
        kv: &GpuKvCache,
    ) -> Result<(), ModelError> {
        if kv.is_bf16() != (self.mode == GpuMode::Fast) {
            return Err(ModelError::Kv(format!(
                "a {} latent cache does not fit a {:?}-mode model",
                if kv.is_bf16() { "bf16" } else { "f32" },
                self.mode
            )));
        }
        batch.check(&self.config, self.layers.len(), kv.layout())
    }
}
