//! The engine's CUDA backend: [`GpuModel`] + [`GpuKvCache`], with the host pool as the staging
//! mirror for KV transfers (see the parent module for the design).

use std::collections::BTreeSet;

use ferry_kernels::cuda::CudaDevice;
use ferry_kernels::Device;

use super::{GpuMode, Pass};
use crate::config::ModelConfig;
use crate::deepseek::forward::ForwardHooks;
use crate::deepseek::{
    AttentionForm, BatchInputs, BatchOutput, DeepseekModel, FormPolicy, LogitsWanted, SeqInput,
};
use crate::gpu::{GpuKvCache, GpuModel};
use crate::kv::{BlockId, KvLayout, KvPool};
use crate::ModelError;

/// The model and its paged latent cache on one CUDA device.
pub(crate) struct CudaBackend {
    dev: CudaDevice,
    gpu: GpuModel,
    cache: GpuKvCache,
    /// `(layer, block)` whose host rows are newer than the device's (a peer's writes): uploaded
    /// before the next forward.
    dirty: BTreeSet<(usize, BlockId)>,
}

impl CudaBackend {
    /// Uploads `model` (which is then dropped: the host keeps no weights) and allocates a
    /// device cache with the host pool's geometry.
    pub(crate) fn new(
        dev: &CudaDevice,
        model: DeepseekModel,
        layout: &KvLayout,
        mode: GpuMode,
    ) -> Result<Self, ModelError> {
        let gpu = GpuModel::upload(dev, &model, mode)?;
        drop(model);
        let cache = gpu.new_kv_cache(layout.num_blocks, layout.page_size)?;
        if cache.layout() != layout {
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
        let out = self.gpu.forward(batch, &mut self.cache)?;
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
