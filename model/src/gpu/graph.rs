//! Decode steps replayed from a CUDA graph.
//!
//! An eager decode step is ~14 launches and a dozen stream-ordered allocations per layer; on
//! a small batch the host spends longer issuing them than the GPU spends running them. A
//! [`DecodeGraph`] captures one step (every sequence one new token, absorbed form) once, with
//! its split-K plan and block-table rows sized for `plan_ctx` positions, and replays it: per
//! step the host only refreshes the input buffers (token ids, cache slots, RoPE tables, block
//! tables, context lengths), launches the graph and downloads the logits.

use ferry_kernels::cuda::{DeviceBuffer, GpuGraph};

use super::forward::{flat_tables_min, host_inputs, RunPlan, Shared};
use super::{GpuKvCache, GpuModel};
use crate::deepseek::{BatchInputs, BatchOutput};
use crate::ModelError;

/// A captured decode step and the buffers it reads and writes.
pub struct DecodeGraph {
    graph: GpuGraph,
    shared: Shared,
    logits: DeviceBuffer<f32>,
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

impl GpuModel {
    /// Captures one decode step shaped like `batch` (one token per sequence, contexts up to
    /// `plan_ctx`). Runs the step once eagerly first (compiling every kernel), which writes
    /// this step's latent rows; the logits come from the next [`Self::replay_decode`].
    pub fn capture_decode(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut GpuKvCache,
        plan_ctx: usize,
    ) -> Result<DecodeGraph, ModelError> {
        self.validate(batch, kv)?;
        check_decode(batch, plan_ctx)?;
        let page = kv.layout().page_size;
        let shared = self.prepare(batch, page, Some(plan_ctx))?;
        if !matches!(shared.runs.as_slice(), [RunPlan::Absorbed { .. }]) {
            return Err(ModelError::Invalid(
                "a decode graph needs every sequence in one absorbed-form launch".into(),
            ));
        }
        let n: usize = shared.rows_per_seq.iter().sum();
        let logits = self.dev.alloc::<f32>(n * self.config.vocab_size)?;
        self.execute(&shared, kv, logits.v())?;
        self.dev.synchronize()?;
        self.dev.begin_capture()?;
        let run = self.execute(&shared, kv, logits.v());
        let graph = self.dev.end_capture();
        run?;
        Ok(DecodeGraph {
            graph: graph?,
            shared,
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
        self.validate(batch, kv)?;
        check_decode(batch, g.plan_ctx)?;
        if batch.seqs.len() != g.seqs || kv.layout().page_size != g.page {
            return Err(ModelError::Invalid(format!(
                "the decode graph was captured for {} sequences, got {}",
                g.seqs,
                batch.seqs.len()
            )));
        }
        let dev = &self.dev;
        let hi = host_inputs(batch, g.page);
        let sh = &mut g.shared;
        dev.write(&mut sh.ids, 0, &hi.tokens)?;
        dev.write(&mut sh.slots, 0, &hi.slots)?;
        sh.rope.refresh(dev, &self.rope, &hi.geo.positions)?;
        if let [RunPlan::Absorbed {
            table, ctx, stride, ..
        }] = sh.runs.as_mut_slice()
        {
            let (flat, s) = flat_tables_min(&batch.seqs, g.page, g.plan_ctx);
            if s != *stride {
                return Err(ModelError::Invalid(format!(
                    "block tables need {s} entries, the graph was planned for {stride}"
                )));
            }
            dev.write(table, 0, &flat)?;
            let lens: Vec<i32> = batch
                .seqs
                .iter()
                .map(|s| (s.start_pos + 1) as i32)
                .collect();
            dev.write(ctx, 0, &lens)?;
        }
        g.graph.launch()?;
        let all = dev.download(&g.logits)?;
        self.split_logits(&all, &hi.rows_per_seq)
    }
}
