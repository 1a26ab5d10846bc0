//! The engine's ROCm backend (feature `rocm`): the one [`DeepseekModel`] on a HIP device and a
//! [`RocmKvCache`] indexed by the engine's block ids, with nothing on the host but block ids (the
//! pool is ids-only, as on CUDA).
//!
//! What it does not have yet, next to the CUDA backend: no graphs (every step eager), and a
//! prefill job's layers are shipped after the whole forward — each staged block read back as
//! f32 rows (widened from a bf16 cache) and handed to the sink, which converts to the wire's
//! dtype — instead of through a page-locked ring while later layers compute. Peers' rows are
//! written straight into the device cache. No AMD GPU was available: this compiles, and runs
//! nowhere yet (docs/gpu.md).

use ferry_kernels::rocm::RocmDevice;

use super::{GpuMode, Pass, ShipStats};
use crate::deepseek::forward::Hooks;
use crate::deepseek::{BatchInputs, BatchLogits, DeepseekModel};
use crate::kv::{BlockId, KvDtype, KvLayout, LayerRows};
use crate::rocm::RocmKvCache;
use crate::ModelError;

/// A ROCm device's KV rows and shipping counters; the model is the engine backend's.
pub(crate) struct RocmRows {
    cache: RocmKvCache,
    ship: ShipStats,
}

impl RocmRows {
    /// Copies `model` onto `dev` (the host keeps no weights) and allocates a device cache with
    /// the host pool's geometry; returns the device-resident model with it.
    pub(crate) fn new(
        dev: &RocmDevice,
        model: DeepseekModel,
        layout: &KvLayout,
        mode: GpuMode,
    ) -> Result<(DeepseekModel, Self), ModelError> {
        let gpu = model.to_rocm(dev, mode.precision())?;
        drop(model);
        let cache = gpu.new_rocm_kv_cache(layout.num_blocks, layout.page_size)?;
        if cache.layout() != layout {
            return Err(ModelError::Kv(format!(
                "the ROCm cache {:?} does not match the engine's pool {layout:?}",
                cache.layout()
            )));
        }
        tracing::info!(
            device = dev.ordinal(),
            ?mode,
            kv_blocks = layout.num_blocks,
            "engine on ROCm: weights and KV cache in device memory (eager steps, shipping after the forward)"
        );
        Ok((
            gpu,
            Self {
                cache,
                ship: ShipStats::default(),
            },
        ))
    }

    /// The element type of the device cache's rows.
    pub(crate) fn kv_dtype(&self) -> KvDtype {
        self.cache.dtype()
    }

    /// The shipping counters.
    pub(crate) fn ship_stats(&self) -> ShipStats {
        self.ship
    }

    /// The forward over the device cache, then per layer the staged blocks' rows read back and
    /// handed to `after_layer` (every layer gets a call, with no blocks when nothing ships).
    pub(crate) fn forward(
        &mut self,
        gpu: &DeepseekModel,
        batch: &BatchInputs<'_>,
        pass: Pass<'_, '_, '_>,
    ) -> Result<BatchLogits, ModelError> {
        // Rows always leave through host memory here (`rows_on_device` is CUDA's).
        let Pass {
            after_layer,
            taps,
            tapped,
            staged,
            rows_on_device: _,
        } = pass;
        let hooks = Hooks {
            taps: Some(taps),
            tapped: Some(&mut *tapped),
            ..Hooks::default()
        };
        let out = gpu.forward_logits(batch, &mut self.cache, gpu.policy, hooks)?;
        let mut staged = staged.to_vec();
        staged.sort_unstable();
        staged.dedup();
        let layout = *self.cache.layout();
        let block_bytes = layout.block_floats() * 4;
        let done = std::time::Instant::now();
        for layer in 0..layout.num_layers {
            let mut bytes = Vec::with_capacity(staged.len() * block_bytes);
            for &b in &staged {
                for v in self.cache.read_blocks(layer, b, 1)? {
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
            }
            let rows = LayerRows::staged(
                layer,
                (KvDtype::F32, layout.width),
                block_bytes,
                &staged,
                &bytes,
            )?;
            after_layer(layer, &rows)?;
        }
        if !staged.is_empty() {
            let tail = done.elapsed().as_micros() as u64;
            self.ship.forwards += 1;
            self.ship.tail_us += tail;
            self.ship.last_tail_us = tail;
        }
        Ok(out)
    }

    /// Layer `layer` of the device cache, downloaded as stored.
    pub(crate) fn read_kv_layer(&self, layer: usize) -> Result<Vec<u8>, ModelError> {
        self.cache.download_layer_bytes(layer)
    }

    /// A writer of peers' runs into the device cache from the decode worker's receiving
    /// threads (every block of the cache is a pool block: ROCm keeps no graph scratch block).
    pub(crate) fn device_kv_writer(&self) -> Result<crate::engine::DeviceKvWriter, ModelError> {
        crate::engine::DeviceKvWriter::rocm(&self.cache)
    }

    /// Consecutive blocks of one layer from a peer, from `first` on, `data` in the cache's
    /// dtype: copied into the device cache as it is, in one copy (the shared device cache's
    /// byte write, as on CUDA).
    pub(crate) fn write_kv(
        &mut self,
        layer: usize,
        first: BlockId,
        data: &[u8],
    ) -> Result<(), ModelError> {
        self.cache.write_run_bytes(layer, first, data)
    }
}
