//! Decode steps replayed from a CUDA graph.
//!
//! An eager decode step is ~14 launches and a dozen stream-ordered allocations per layer; on
//! a small batch the host spends longer issuing them than the GPU spends running them. A
//! [`DecodeGraph`] captures one step (every sequence one new token, absorbed form) once, with
//! its split-K plan and block-table rows sized for `plan_ctx` positions, and replays it: per
//! step the host only refreshes the input buffers (token ids, cache slots, RoPE tables, block
//! tables, context lengths), launches the graph and downloads the logits.

use ferry_kernels::backend::Tensor;
use ferry_kernels::cuda::GpuGraph;

use super::GpuKvCache;
use crate::deepseek::forward::{flat_tables_min, host_inputs, Hooks, Plan, RunPlan};
use crate::deepseek::{
    AttentionForm::Absorbed, BatchInputs, BatchLogits, BatchOutput, DeepseekModel, FormPolicy,
};
use crate::kv::KvMut;
use crate::ModelError;

/// A captured decode step and the buffers it reads and writes.
pub struct DecodeGraph {
    graph: GpuGraph,
    plan: Plan,
    logits: Tensor,
    seqs: usize,
    plan_ctx: usize,
    page: usize,
}

impl std::fmt::Debug for DecodeGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DecodeGraph({} seqs, plan_ctx {})",
            self.seqs, self.plan_ctx
        )
    }
}

impl DecodeGraph {
    /// The context the graph was planned for: sequences may grow up to it.
    pub fn plan_ctx(&self) -> usize {
        self.plan_ctx
    }
}

fn check_decode(batch: &BatchInputs<'_>, plan_ctx: usize) -> Result<(), ModelError> {
    for (i, s) in batch.seqs.iter().enumerate() {
        if s.tokens.len() != 1 {
            return Err(ModelError::Invalid(format!(
                "sequence {i}: a decode graph takes one token per sequence, got {}",
                s.tokens.len()
            )));
        }
        if s.start_pos + 1 > plan_ctx {
            return Err(ModelError::Invalid(format!(
                "sequence {i}: position {} is beyond the graph's plan of {plan_ctx} positions",
                s.start_pos
            )));
        }
    }
    Ok(())
}

impl DeepseekModel {
    /// Captures one decode step shaped like `batch` (one token per sequence, contexts up to
    /// `plan_ctx`). Runs the step once eagerly first (compiling every kernel), which writes
    /// this step's latent rows; the logits come from the next [`Self::replay_decode`].
    pub fn capture_decode(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut GpuKvCache,
        plan_ctx: usize,
    ) -> Result<DecodeGraph, ModelError> {
        let dev = self.cuda_device()?.clone();
        self.validate(batch, &KvMut::Cuda(kv))?;
        check_decode(batch, plan_ctx)?;
        let page = kv.layout().page_size;
        let plan = self.prepare(batch, page, Some(plan_ctx), FormPolicy::Force(Absorbed))?;
        if !matches!(plan.runs.as_slice(), [RunPlan::Absorbed { .. }]) {
            return Err(ModelError::Invalid(
                "a decode graph needs every sequence in one absorbed-form launch".into(),
            ));
        }
        let n: usize = plan.rows_per_seq.iter().sum();
        let mut logits = self.backend.scratch(n * self.config.vocab_size)?;
        let mut kv = KvMut::Cuda(kv);
        self.execute(&plan, &mut kv, &mut logits, Hooks::default())?;
        dev.synchronize()?;
        dev.begin_capture()?;
        let run = self.execute(&plan, &mut kv, &mut logits, Hooks::default());
        let graph = dev.end_capture();
        run?;
        Ok(DecodeGraph {
            graph: graph?,
            plan,
            logits,
            seqs: batch.seqs.len(),
            plan_ctx,
            page,
        })
    }

    /// One decode step through a captured graph: same sequence count as at capture, one token
    /// each, contexts within its plan. Same contract as [`Self::forward`].
    pub fn replay_decode(
        &self,
        g: &mut DecodeGraph,
        batch: &BatchInputs<'_>,
        kv: &GpuKvCache,
    ) -> Result<BatchOutput, ModelError> {
        let rows_per_seq = self.replay(g, batch, kv)?;
        let all = g.logits.to_host()?;
        BatchOutput::from_rows(&all, &rows_per_seq, self.config.vocab_size)
    }

    /// [`Self::replay_decode`] leaving the logits on the device: a copy of the graph's logits
    /// buffer (the next replay overwrites it), rows of the first `keep` sequences only.
    pub fn replay_decode_logits(
        &self,
        g: &mut DecodeGraph,
        batch: &BatchInputs<'_>,
        kv: &GpuKvCache,
        keep: usize,
    ) -> Result<BatchLogits, ModelError> {
        let mut rows_per_seq = self.replay(g, batch, kv)?;
        rows_per_seq.truncate(keep);
        let vocab = self.config.vocab_size;
        let n: usize = rows_per_seq.iter().sum();
        let mut logits = self.backend.scratch(n * vocab)?;
        self.backend.copy_prefix(&g.logits, &mut logits)?;
        Ok(BatchLogits {
            logits,
            rows_per_seq,
            vocab,
        })
    }

    /// Refreshes the graph's inputs for `batch` and launches it; the rows each sequence wants.
    fn replay(
        &self,
        g: &mut DecodeGraph,
        batch: &BatchInputs<'_>,
        kv: &GpuKvCache,
    ) -> Result<Vec<usize>, ModelError> {
        self.cuda_device()?;
        // Validation only reads the cache; the graph writes rows through its captured views.
        check_decode(batch, g.plan_ctx)?;
        batch.check(&self.config, self.layers.len(), kv.layout())?;
        if batch.seqs.len() != g.seqs || kv.layout().page_size != g.page {
            return Err(ModelError::Invalid(format!(
                "the decode graph was captured for {} sequences, got {}",
                g.seqs,
                batch.seqs.len()
            )));
        }
        let hi = host_inputs(batch, g.page);
        let plan = &mut g.plan;
        plan.ids.write(&hi.tokens)?;
        plan.slots.write(&hi.slots)?;
        plan.rope.refresh(&self.rope, &hi.geo.positions)?;
        if let [RunPlan::Absorbed {
            table, ctx, stride, ..
        }] = plan.runs.as_mut_slice()
        {
            let (flat, s) = flat_tables_min(&batch.seqs, g.page, g.plan_ctx);
            if s != *stride {
                return Err(ModelError::Invalid(format!(
                    "block tables need {s} entries, the graph was planned for {stride}"
                )));
            }
            table.write(&flat)?;
            let lens: Vec<i32> = batch
                .seqs
                .iter()
                .map(|s| (s.start_pos + 1) as i32)
                .collect();
            ctx.write(&lens)?;
        }
        g.graph.launch()?;
        Ok(hi.rows_per_seq)
    }
}
