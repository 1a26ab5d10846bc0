//! The engine's CUDA backend: [`GpuModel`] + [`GpuKvCache`], with the host pool as the staging
//! mirror for KV transfers (see the parent module for the design), and decode steps replayed
//! from CUDA graphs.
//!
//! **Graphs.** A step in which every sequence decodes one token in the absorbed form (the
//! steady state of serving) is replayed from a [`DecodeGraph`] captured for its batch-size
//! bucket (the next power of two, up to [`MAX_GRAPH_BATCH`]): the host refreshes the inputs and
//! issues one launch instead of ~14 per layer. The batch is padded to the bucket with dummy
//! sequences that decode token 0 at position 1 of a scratch block — one block past the host
//! pool's, which no sequence owns and nothing else reads — and their logits are dropped. A graph is
//! planned for a context (block-table width and split-K plan) of the next power of two ≥ 256
//! above the batch's longest sequence and recaptured, once per doubling, when a sequence grows
//! past it. Any other step (a prefill chunk in the batch, speculative verification, an MHA-form
//! chunk) runs eagerly.

use std::collections::{BTreeSet, HashMap};

use ferry_kernels::cuda::CudaDevice;
use ferry_kernels::Device;

use super::{GpuMode, Pass};
use crate::config::ModelConfig;
use crate::deepseek::forward::ForwardHooks;
use crate::deepseek::{
    AttentionForm, BatchInputs, BatchOutput, DeepseekModel, FormPolicy, LogitsWanted, SeqInput,
};
use crate::gpu::graph::DecodeGraph;
use crate::gpu::{GpuKvCache, GpuModel};
use crate::kv::{BlockId, KvLayout, KvPool};
use crate::ModelError;

/// The largest batch replayed from a graph; larger decode batches run eagerly (the launch
/// overhead graphs remove is then a small part of the step).
pub(crate) const MAX_GRAPH_BATCH: usize = 64;

/// The smallest context a graph is planned for.
const MIN_GRAPH_CTX: usize = 256;

/// The model and its paged latent cache on one CUDA device.
pub(crate) struct CudaBackend {
    dev: CudaDevice,
    gpu: GpuModel,
    /// The host pool's blocks plus one scratch block (the last) for graph padding.
    cache: GpuKvCache,
    /// `(layer, block)` whose host rows are newer than the device's (a peer's writes): uploaded
    /// before the next forward.
    dirty: BTreeSet<(usize, BlockId)>,
    /// Captured decode steps by batch-size bucket; `None` when graphs are off.
    graphs: Option<HashMap<usize, DecodeGraph>>,
    /// Steps replayed from a graph (the engine's `graph_steps`).
    graph_steps: u64,
}

impl CudaBackend {
    /// Uploads `model` (which is then dropped: the host keeps no weights) and allocates a
    /// device cache with the host pool's geometry.
    pub(crate) fn new(
        dev: &CudaDevice,
        model: DeepseekModel,
        layout: &KvLayout,
        mode: GpuMode,
        cuda_graphs: bool,
    ) -> Result<Self, ModelError> {
        let gpu = GpuModel::upload(dev, &model, mode)?;
        drop(model);
        // One block more than the host pool: the graphs' scratch block.
        let cache = gpu.new_kv_cache(layout.num_blocks + 1, layout.page_size)?;
        let device_layout = crate::kv::KvLayout {
            num_blocks: layout.num_blocks,
            ..*cache.layout()
        };
        if device_layout != *layout {
            return Err(ModelError::Kv(format!(
                "the device cache {:?} does not match the host pool {layout:?}",
                cache.layout()
            )));
        }
        tracing::info!(
            device = ?dev,
            ?mode,
            kv_blocks = layout.num_blocks,
            "engine on the GPU: weights and KV cache in device memory"
        );
        let mut backend = Self {
            dev: dev.clone(),
            gpu,
            cache,
            dirty: BTreeSet::new(),
            graphs: cuda_graphs.then(HashMap::new),
            graph_steps: 0,
        };
        let started = std::time::Instant::now();
        backend.warm_up()?;
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            "GPU kernels compiled and loaded"
        );
        Ok(backend)
    }

    /// Compiles and loads the kernels of both attention forms before the engine serves.
    /// NVRTC compiles each kernel source on first use, which can take seconds on a cold
    /// machine; on the engine thread that would stall the first requests and the worker's
    /// heartbeats (they wait for the engine's stats), and the router would drop the worker.
    /// Runs a short prompt in the MHA form, then one decode step in the absorbed form, in the
    /// first blocks of the cache: those rows are garbage afterwards, but every row is written
    /// by a forward or a peer before any forward reads it.
    fn warm_up(&mut self) -> Result<(), ModelError> {
        let layout = *self.cache.layout();
        let table: Vec<BlockId> = (0..layout.num_blocks.min(2) as u32).map(BlockId).collect();
        let positions = (layout.page_size * table.len()).min(9);
        let tokens = vec![0u32; positions];
        let steps = [
            (AttentionForm::Mha, 0, positions.saturating_sub(1).max(1)),
            (AttentionForm::Absorbed, positions - 1, positions),
        ];
        let mut result = Ok(());
        for (form, start, end) in steps {
            if start >= end {
                continue;
            }
            self.gpu.set_policy(FormPolicy::Force(form));
            let batch = BatchInputs {
                seqs: vec![SeqInput {
                    tokens: &tokens[start..end],
                    start_pos: start,
                    block_table: &table,
                    logits: LogitsWanted::Last,
                }],
            };
            result = self.gpu.forward(&batch, &mut self.cache).map(drop);
            if result.is_err() {
                break;
            }
        }
        self.gpu.set_policy(FormPolicy::CostModel);
        result
    }

    pub(crate) fn device(&self) -> Device {
        Device::Cuda(self.dev.ordinal())
    }

    pub(crate) fn config(&self) -> &ModelConfig {
        self.gpu.config()
    }

    /// Steps replayed from a CUDA graph so far.
    pub(crate) fn graph_steps(&self) -> u64 {
        self.graph_steps
    }

    /// The scratch block graph padding writes into (never one of the host pool's).
    fn scratch_block(&self) -> BlockId {
        BlockId((self.cache.layout().num_blocks - 1) as u32)
    }

    /// Runs `batch` from a captured graph if it is a graph-shaped decode step: `Ok(None)` when
    /// it is not (the caller runs it eagerly).
    fn try_graph(&mut self, batch: &BatchInputs<'_>) -> Result<Option<BatchOutput>, ModelError> {
        let n = batch.seqs.len();
        let scratch = [self.scratch_block()];
        let Some(graphs) = self.graphs.as_mut() else {
            return Ok(None);
        };
        let dims = &self.gpu.dims;
        let decode_step = n > 0
            && n <= MAX_GRAPH_BATCH
            && self.cache.layout().page_size >= 2
            && self.gpu.policy.choose(dims, 1, 1) == AttentionForm::Absorbed
            && batch.seqs.iter().all(|s| {
                s.tokens.len() == 1
                    && s.logits == LogitsWanted::Last
                    && self.gpu.policy.choose(dims, s.start_pos, 1) == AttentionForm::Absorbed
            });
        if !decode_step {
            return Ok(None);
        }
        let bucket = n.next_power_of_two();
        let longest = batch
            .seqs
            .iter()
            .map(|s| s.start_pos + 1)
            .max()
            .unwrap_or(1);
        let plan_ctx = longest
            .next_power_of_two()
            .max(MIN_GRAPH_CTX)
            .min(self.gpu.config.max_position_embeddings.max(longest));
        // Pad to the bucket with one-token sequences at position 1 of the scratch block (the
        // absorbed form needs a cached position; position 0 is zeros or an earlier padding
        // row, finite either way).
        let pad = [0u32];
        let mut seqs = batch.seqs.clone();
        seqs.resize_with(bucket, || SeqInput {
            tokens: &pad,
            start_pos: 1,
            block_table: &scratch,
            logits: LogitsWanted::Last,
        });
        let padded = BatchInputs { seqs };
        let stale = graphs.get(&bucket).is_some_and(|g| g.plan_ctx() < plan_ctx);
        if stale || !graphs.contains_key(&bucket) {
            graphs.remove(&bucket);
            match self.gpu.capture_decode(&padded, &mut self.cache, plan_ctx) {
                Ok(g) => {
                    tracing::debug!(bucket, plan_ctx, "captured a decode graph");
                    graphs.insert(bucket, g);
                }
                Err(e) => {
                    // Serving goes on eagerly: a capture that fails says nothing about the
                    // batch (the eager step it ran first rewrites the same rows).
                    tracing::warn!(bucket, plan_ctx, error = %e, "CUDA graph capture failed; decoding eagerly from now on");
                    self.graphs = None;
                    return Ok(None);
                }
            }
        }
        let Some(g) = graphs.get_mut(&bucket) else {
            return Ok(None);
        };
        let mut out = self.gpu.replay_decode(g, &padded, &self.cache)?;
        out.logits.truncate(n);
        self.graph_steps += 1;
        Ok(Some(out))
    }

    pub(crate) fn mark_dirty(&mut self, layer: usize, block: BlockId) {
        self.dirty.insert((layer, block));
    }

    /// Uploads every dirty host row: one copy per run of consecutive blocks per layer.
    fn upload_dirty(&mut self, pool: &KvPool) -> Result<(), ModelError> {
        if self.dirty.is_empty() {
            return Ok(());
        }
        let per_block = pool.layout().block_floats();
        let dirty: Vec<(usize, BlockId)> = self.dirty.iter().copied().collect();
        let mut i = 0;
        while i < dirty.len() {
            let (layer, first) = dirty[i];
            let mut n = 1;
            while dirty
                .get(i + n)
                .is_some_and(|&(l, b)| l == layer && b.0 as usize == first.0 as usize + n)
            {
                n += 1;
            }
            let start = first.0 as usize * per_block;
            let rows = pool
                .layer(layer)?
                .get(start..start + n * per_block)
                .ok_or_else(|| ModelError::Kv(format!("{first} + {n} is outside the pool")))?;
            self.cache.write_blocks(&self.dev, layer, first, rows)?;
            i += n;
        }
        self.dirty.clear();
        Ok(())
    }

    /// Copies `blocks` (sorted, distinct) of `layer` from the device into the host pool.
    fn stage(&self, layer: usize, blocks: &[BlockId], pool: &mut KvPool) -> Result<(), ModelError> {
        let per_block = pool.layout().block_floats();
        let mut i = 0;
        while i < blocks.len() {
            let first = blocks[i];
            let mut n = 1;
            while blocks
                .get(i + n)
                .is_some_and(|b| b.0 as usize == first.0 as usize + n)
            {
                n += 1;
            }
            let rows = self.cache.read_blocks(&self.dev, layer, first, n)?;
            for (j, chunk) in rows.chunks_exact(per_block).enumerate() {
                pool.block_mut(layer, BlockId(first.0 + j as u32))?
                    .copy_from_slice(chunk);
            }
            i += n;
        }
        Ok(())
    }

    /// Peers' rows up, the forward, then per layer: the staged blocks down and `after_layer`.
    pub(crate) fn forward(
        &mut self,
        batch: &BatchInputs<'_>,
        pool: &mut KvPool,
        pass: Pass<'_, '_, '_>,
    ) -> Result<BatchOutput, ModelError> {
        self.upload_dirty(pool)?;
        let out = match self.try_graph(batch)? {
            Some(out) => out,
            None => self.gpu.forward(batch, &mut self.cache)?,
        };
        let ForwardHooks { after_layer, .. } = pass.hooks;
        let mut staged = pass.staged.to_vec();
        staged.sort_unstable();
        staged.dedup();
        for layer in 0..self.cache.layout().num_layers {
            if !staged.is_empty() {
                self.stage(layer, &staged, pool)?;
            }
            after_layer(layer, pool)?;
        }
        Ok(out)
    }
}
