//! Decode steps and speculative verify forwards replayed from a CUDA graph.
//!
//! An eager decode step is ~14 launches and a dozen stream-ordered allocations per layer; on
//! a small batch the host spends longer issuing them than the GPU spends running them. A
//! [`DecodeGraph`] captures one step — every sequence `sq` new tokens in the absorbed form:
//! one token for a decode step, the anchor and B drafts for a speculative round's verify
//! forward — once, with its split-K plan and block-table rows sized for `plan_ctx` positions,
//! and replays it: per step the host only refreshes the input buffers (token ids, cache slots,
//! RoPE tables, block tables, context lengths) and launches the graph. A graph captured with
//! tap layers also copies the residual stream after each of them into buffers of its own (a
//! drafter's context), which the caller reads after the replay.

use ferry_kernels::backend::Tensor;
use ferry_kernels::cuda::GpuGraph;

use super::GpuKvCache;
use crate::deepseek::forward::{flat_tables_min, host_inputs, Hooks, Plan, RunPlan};
use crate::deepseek::{
    AttentionForm::Absorbed, BatchInputs, BatchLogits, BatchOutput, DeepseekModel, FormPolicy,
    LogitsWanted,
};
use crate::kv::KvMut;
use crate::ModelError;

/// The largest batch (sequences) replayed from a CUDA graph, for decode steps, verify forwards
/// and drafter passes alike: [`GRAPH_MAX_BATCH`] unless `FERRY_GRAPH_MAX_BATCH` sets another
/// (read once; the benchmarks' A/B switch).
pub fn graph_max_batch() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| match std::env::var("FERRY_GRAPH_MAX_BATCH") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!(value = %v, "FERRY_GRAPH_MAX_BATCH is not a count; using {GRAPH_MAX_BATCH}");
            GRAPH_MAX_BATCH
        }),
        Err(_) => GRAPH_MAX_BATCH,
    })
}

/// See [`graph_max_batch`]. 256 since session 24's serving-length A/B through the engine
/// (512 decode steps, BENCHMARKS.md "CUDA graphs past 64 sequences"): a small model's eager step
/// is bound by the host issuing its launches, and the DSpark target's shape decoded 52–64 %
/// faster at 96 / 128 sequences graphed; V2-Lite, GPU-bound there, ran the same either way
/// (3,290 / 3,590 tok/s). Session 23's short A/B (32 steps, each capture inside them) had
/// measured V2-Lite slower graphed. Verify forwards stay at 64 sequences (256 rows' worth).
pub const GRAPH_MAX_BATCH: usize = 256;

/// Sequences of any length up to this many are graphed (as before session 23), unless
/// `FERRY_GRAPH_MAX_BATCH` is lower.
const GRAPH_MIN_SEQS: usize = 64;

/// The most sequences of `sq` new tokens each a graph replays: [`graph_max_batch`] rows' worth
/// (a graph keeps the memory of every intermediate, which grows with its rows), and at least
/// [`GRAPH_MIN_SEQS`] (a verify forward of 64 sequences × 9 rows was graphed before) unless the
/// limit itself is lower. Decode steps (`sq` = 1): up to the limit.
pub fn graph_max_seqs(sq: usize) -> usize {
    max_seqs(sq, graph_max_batch())
}

fn max_seqs(sq: usize, max: usize) -> usize {
    (max / sq.max(1)).max(GRAPH_MIN_SEQS.min(max))
}

/// Batch sizes up to this run in power-of-two buckets; above it, in multiples of it, so a
/// graph's padding (dummy sequences the GPU computes in full) stays under this many sequences.
const GRAPH_BUCKET_STEP: usize = 32;

/// The bucket (graph batch size) a batch of `n` sequences is padded to, or `None` when `n` is
/// zero or past `max`: the next power of two up to 32, then the next multiple of 32.
pub fn graph_bucket(n: usize, max: usize) -> Option<usize> {
    if n == 0 || n > max {
        return None;
    }
    Some(if n <= GRAPH_BUCKET_STEP {
        n.next_power_of_two()
    } else {
        n.div_ceil(GRAPH_BUCKET_STEP) * GRAPH_BUCKET_STEP
    })
}

/// A captured decode step (or verify forward) and the buffers it reads and writes.
pub struct DecodeGraph {
    graph: GpuGraph,
    plan: Plan,
    logits: Tensor,
    /// `(layer, [seqs · sq][hidden])`: the residual stream after each tap layer.
    taps: Vec<(usize, Tensor)>,
    seqs: usize,
    /// New tokens per sequence.
    sq: usize,
    plan_ctx: usize,
    page: usize,
}

impl std::fmt::Debug for DecodeGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DecodeGraph({} seqs × {} tokens, plan_ctx {})",
            self.seqs, self.sq, self.plan_ctx
        )
    }
}

impl DecodeGraph {
    /// The context the graph was planned for: sequences may grow up to it.
    pub fn plan_ctx(&self) -> usize {
        self.plan_ctx
    }

    /// New tokens per sequence.
    pub fn tokens_per_seq(&self) -> usize {
        self.sq
    }

    /// The residual stream after each tap layer in the last replay, `(layer, [seqs · sq][hidden])`.
    pub fn taps(&self) -> &[(usize, Tensor)] {
        &self.taps
    }
}

/// Every sequence has `sq` new tokens (logits wanted for the last one when `sq` is 1, for all
/// of them otherwise) within `plan_ctx` positions.
fn check_decode(batch: &BatchInputs<'_>, plan_ctx: usize) -> Result<usize, ModelError> {
    let sq = batch.seqs.first().map_or(1, |s| s.tokens.len());
    for (i, s) in batch.seqs.iter().enumerate() {
        if s.tokens.len() != sq || sq == 0 {
            return Err(ModelError::Invalid(format!(
                "sequence {i}: a decode graph takes {sq} tokens per sequence, got {}",
                s.tokens.len()
            )));
        }
        let wanted = if sq == 1 {
            LogitsWanted::Last
        } else {
            LogitsWanted::All
        };
        if s.logits != wanted {
            return Err(ModelError::Invalid(format!(
                "sequence {i}: a graph of {sq}-token sequences returns {wanted:?} logits"
            )));
        }
        if s.start_pos + sq > plan_ctx {
            return Err(ModelError::Invalid(format!(
                "sequence {i}: positions up to {} are beyond the graph's plan of {plan_ctx}",
                s.start_pos + sq
            )));
        }
    }
    Ok(sq)
}

impl DeepseekModel {
    /// Captures one decode step shaped like `batch` (the same number of tokens in every
    /// sequence — one, or a verify forward's anchor and drafts — contexts up to `plan_ctx`),
    /// copying the residual stream after each layer of `taps` into the graph's own buffers.
    /// Runs the step once eagerly first (compiling every kernel), which writes this step's
    /// latent rows; the logits come from the next [`Self::replay_decode`].
    pub fn capture_decode(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut GpuKvCache,
        plan_ctx: usize,
        taps: &[usize],
    ) -> Result<DecodeGraph, ModelError> {
        let dev = self.cuda_device()?.clone();
        self.validate(batch, &KvMut::Cuda(kv))?;
        let sq = check_decode(batch, plan_ctx)?;
        let page = kv.layout().page_size;
        let plan = self.prepare(batch, page, Some(plan_ctx), FormPolicy::Force(Absorbed))?;
        if !matches!(plan.runs.as_slice(), [RunPlan::Absorbed { .. }]) {
            return Err(ModelError::Invalid(
                "a decode graph needs every sequence in one absorbed-form launch".into(),
            ));
        }
        let n: usize = plan.rows_per_seq.iter().sum();
        let mut logits = self.backend.scratch(n * self.config.vocab_size)?;
        let rows = batch.seqs.len() * sq * self.config.hidden_size;
        let mut tap_bufs = taps
            .iter()
            .map(|&l| Ok((l, self.backend.scratch(rows)?)))
            .collect::<Result<Vec<_>, ModelError>>()?;
        let mut kv = KvMut::Cuda(kv);
        fn hooks<'h>(taps: &'h [usize], bufs: &'h mut [(usize, Tensor)]) -> Hooks<'h, 'h> {
            Hooks {
                taps: Some(taps),
                tap_into: Some(bufs),
                ..Hooks::default()
            }
        }
        self.execute(&plan, &mut kv, &mut logits, hooks(taps, &mut tap_bufs))?;
        dev.synchronize()?;
        dev.begin_capture()?;
        let run = self.execute(&plan, &mut kv, &mut logits, hooks(taps, &mut tap_bufs));
        let graph = dev.end_capture();
        run?;
        Ok(DecodeGraph {
            graph: graph?,
            plan,
            logits,
            taps: tap_bufs,
            seqs: batch.seqs.len(),
            sq,
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
            prompt: Vec::new(),
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
        let sq = check_decode(batch, g.plan_ctx)?;
        batch.check(&self.config, self.layers.len(), kv.layout())?;
        if batch.seqs.len() != g.seqs || sq != g.sq || kv.layout().page_size != g.page {
            return Err(ModelError::Invalid(format!(
                "the decode graph was captured for {} sequences of {} tokens, got {} of {sq}",
                g.seqs,
                g.sq,
                batch.seqs.len()
            )));
        }
        let hi = host_inputs(batch, g.page);
        let plan = &mut g.plan;
        plan.ids.write(&hi.tokens)?;
        batch.place_drafts(&self.backend, &mut plan.ids)?;
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
                .map(|s| (s.start_pos + sq) as i32)
                .collect();
            ctx.write(&lens)?;
        }
        g.graph.launch()?;
        Ok(hi.rows_per_seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_then_multiples_of_32_up_to_the_limit() {
        let got: Vec<_> = [1, 2, 3, 5, 17, 32, 33, 64, 65, 100, 128, 129, 255, 256]
            .iter()
            .map(|&n| graph_bucket(n, 256))
            .collect();
        let want = [1, 2, 4, 8, 32, 32, 64, 64, 96, 128, 128, 160, 256, 256];
        assert_eq!(got, want.map(Some).to_vec());
        assert_eq!(graph_bucket(0, 256), None);
        assert_eq!(graph_bucket(257, 256), None);
        // The limit before session 23: nothing past 64 is graphed.
        assert_eq!(graph_bucket(65, 64), None);
        assert_eq!(graph_bucket(64, 64), Some(64));
        // Decode steps up to the limit; verify forwards by rows, never below 64 sequences.
        assert_eq!(max_seqs(1, 256), 256);
        assert_eq!(max_seqs(2, 256), 128);
        assert_eq!(max_seqs(9, 256), 64);
        assert_eq!(max_seqs(1, 64), 64);
        assert_eq!(max_seqs(9, 32), 32);
        // Padding stays under one step past 32 sequences.
        for n in 33..=256 {
            let b = graph_bucket(n, 256).unwrap_or(0);
            assert!(b >= n && b - n < GRAPH_BUCKET_STEP, "{n} -> {b}");
        }
    }
}
