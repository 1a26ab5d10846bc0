//! Where the engine's KV rows live, and what a GPU adds around the one forward.
//!
//! The model is one [`DeepseekModel`] on every device (its ops dispatch on its
//! `kernels::backend::Backend`); the engine thread owns one [`Backend`], which says where the
//! forward's KV rows are and runs the device's extras around it. On both, the [`KvManager`]'s pool is the single
//! owner of block ids — allocation, refcounts, the prefix cache and its events — and every
//! forward gets the same [`BatchInputs`] with caller-owned block tables. What differs is where
//! the model and the KV *rows* live:
//!
//! | backend | model | KV rows the forward reads and writes | the host pool's rows |
//! |---|---|---|---|
//! | `Cpu` | [`DeepseekModel`] | the host pool | the KV itself |
//! | `Cuda` | the same [`DeepseekModel`], uploaded (host weights dropped after the upload) | a [`GpuKvCache`] indexed by the same block ids | a staging mirror for transfers (below) |
//!
//! Transfers on CUDA go through the host pool, whose rows are f32 like the transfer wire:
//!
//! - **Shipping (prefill worker).** The forward runs whole; then, layer by layer, exactly the
//!   blocks the batch's prefill jobs ship are downloaded into their host rows and the layer
//!   sink is called. The layers therefore stream *after* the whole forward, not while later
//!   layers compute as on the CPU.
//! - **Receiving (decode worker).** A peer's block write lands in the host rows and marks
//!   `(layer, block)` dirty; the next forward first uploads every dirty row, one copy per run
//!   of consecutive block ids per layer.
//!
//! Rows are f32 on the host and on the device in [`GpuMode::Exact`], bf16 on the device in
//! [`GpuMode::Fast`] (rounded to nearest even on upload, widened on download).
//!
//! Memory: the host mirror is as large as the device cache in f32 (twice the device cache in
//! fast mode), although only rows in transit are ever current. A pinned staging ring sized for
//! the transfers in flight would replace it.
//!
//! On CUDA, decode-only steps are replayed from CUDA graphs per batch-size bucket
//! ([`EngineConfig::cuda_graphs`](super::EngineConfig); see `backend/cuda.rs`).
//!
//! Speculative decoding runs on both, the drafter on the model's own backend: the forward
//! copies the residual stream after the drafter's tap layers on the device ([`Pass::tapped`]),
//! the drafter's KV lives there too, and it shares the target's embedding and LM head.
//! Verification, rollback and the verify length are the engine's, the same on every device.
//!
//! [`KvManager`]: crate::kv::KvManager
//! [`GpuKvCache`]: crate::gpu::GpuKvCache

#[cfg(feature = "cuda")]
mod cuda;

use ferry_kernels::Device;

use ferry_kernels::backend::Tensor;

use crate::config::ModelConfig;
use crate::deepseek::forward::LayerHook;
use crate::deepseek::{BatchInputs, BatchLogits, DeepseekModel, FormPolicy, Hooks};
use crate::kv::{BlockId, KvLayout, KvPool, KvRef};
use crate::ModelError;

/// Numerics of the GPU forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuMode {
    /// f32 activations, f32 latent cache, f32 attention kernels, split-bf16 GEMMs: matches the
    /// CPU backend within the CPU-vs-Hugging-Face tolerance.
    #[default]
    Exact,
    /// bf16 latent cache, tensor-core attention (absorbed tiles with 12 → 16 padding, flash
    /// prefill), bf16 GEMM inputs.
    Fast,
}

impl GpuMode {
    /// The device kernels' precision for this mode.
    pub fn precision(self) -> ferry_kernels::backend::Precision {
        match self {
            GpuMode::Exact => ferry_kernels::backend::Precision::Exact,
            GpuMode::Fast => ferry_kernels::backend::Precision::Fast,
        }
    }
}

/// GPU-only engine options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GpuOptions {
    /// Replay decode-only steps from CUDA graphs.
    pub(crate) cuda_graphs: bool,
    /// Ship prefill jobs' layers while later layers compute.
    pub(crate) layerwise_shipping: bool,
}

/// Counters of the GPU backend's prefill-job shipping.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ShipStats {
    /// Layers handed to their sink before the forward's last layer was computed.
    pub(crate) early: u64,
    /// Forwards that shipped layers.
    pub(crate) forwards: u64,
    /// Summed µs from each such forward's end (logits on the host) to its last sink call.
    pub(crate) tail_us: u64,
}

/// One forward's hooks, and the blocks its `after_layer` hook reads.
pub(crate) struct Pass<'p, 'h, 'a> {
    /// Called per layer with the host pool, its staged blocks' rows of that layer current
    /// (prefill jobs' layer sinks).
    pub(crate) after_layer: &'h mut LayerHook<'a>,
    /// The layers whose outgoing residual stream the drafter reads (its taps).
    pub(crate) taps: &'p [usize],
    /// Receives `(layer, residual stream)` after each tap layer, copied on the model's backend
    /// (never downloaded on a GPU).
    pub(crate) tapped: &'h mut Vec<(usize, Tensor)>,
    /// Blocks whose rows `after_layer` reads from the pool (prefill jobs' shipped blocks): on
    /// CUDA they are downloaded into the host pool before each layer's call.
    pub(crate) staged: &'p [BlockId],
}

/// The one model on its device, and what that device adds around the forward.
pub(crate) struct Backend {
    /// The model; its ops run where its weights live.
    model: DeepseekModel,
    /// Where the forward's KV rows live.
    rows: Rows,
}

/// Where the forward's KV rows live.
enum Rows {
    /// The host pool itself (CPU).
    Host,
    /// A device cache with the host pool as staging mirror, graphs and layer-wise shipping.
    #[cfg(feature = "cuda")]
    Cuda(Box<cuda::CudaRows>),
}

impl Backend {
    /// `model` on `device` (`auto` resolved first) with a KV cache shaped like the host pool's
    /// `layout`. A named GPU that cannot be opened, cannot hold the model or the cache, or whose
    /// backend does not run the whole model (ROCm, for now) is an error naming the reason:
    /// never a quiet fall-back to the CPU.
    pub(crate) fn open(
        model: DeepseekModel,
        layout: &KvLayout,
        device: Device,
        mode: GpuMode,
        gpu: GpuOptions,
    ) -> Result<Self, ModelError> {
        let device = device.resolve()?;
        if device == Device::Cpu {
            return Ok(Backend {
                model,
                rows: Rows::Host,
            });
        }
        open_gpu(model, layout, device, mode, gpu)
    }

    /// How the GPU backend has shipped prefill jobs' layers (zeros on the CPU, whose forward
    /// calls its sinks between layers).
    pub(crate) fn ship_stats(&self) -> ShipStats {
        match &self.rows {
            Rows::Host => ShipStats::default(),
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => c.ship_stats(),
        }
    }

    /// Forwards replayed from a CUDA graph (0 on the CPU).
    pub(crate) fn graph_steps(&self) -> u64 {
        match &self.rows {
            Rows::Host => 0,
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => c.graph_steps(),
        }
    }

    /// The device the forward runs on.
    pub(crate) fn device(&self) -> Device {
        self.model.backend().device()
    }

    /// The model configuration.
    pub(crate) fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// The model, on its device (a drafter shares its embedding and LM head and runs there too).
    pub(crate) fn model(&self) -> &DeepseekModel {
        &self.model
    }

    /// Runs one batch. Latent rows of the new positions go to the backend's KV; `after_layer`
    /// sees the pool with the staged blocks current for that layer. The logits stay on the
    /// model's backend.
    pub(crate) fn forward(
        &mut self,
        batch: &BatchInputs<'_>,
        pool: &mut KvPool,
        pass: Pass<'_, '_, '_>,
    ) -> Result<BatchLogits, ModelError> {
        match &mut self.rows {
            Rows::Host => {
                let Pass {
                    after_layer,
                    taps,
                    tapped,
                    ..
                } = pass;
                let mut on_layer = |l: usize, kv: KvRef<'_>| match kv.host() {
                    Some(pool) => after_layer(l, pool),
                    None => Err(ModelError::Kv("a host-pool hook got a device cache".into())),
                };
                let hooks = Hooks {
                    after_layer: Some(&mut on_layer),
                    taps: Some(taps),
                    hidden: None,
                    tapped: Some(tapped),
                    tap_into: None,
                };
                self.model
                    .forward_logits(batch, pool, FormPolicy::CostModel, hooks)
            }
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => c.forward(&self.model, batch, pool, pass),
        }
    }

    /// The host rows of `(layer, block)` were written (a peer's KV): on CUDA they are uploaded
    /// before the next forward.
    pub(crate) fn host_rows_written(&mut self, layer: usize, block: BlockId) {
        match &mut self.rows {
            Rows::Host => {
                let _ = (layer, block);
            }
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => c.mark_dirty(layer, block),
        }
    }
}

#[cfg(feature = "cuda")]
fn open_gpu(
    model: DeepseekModel,
    layout: &KvLayout,
    device: Device,
    mode: GpuMode,
    gpu: GpuOptions,
) -> Result<Backend, ModelError> {
    let dev = open_cuda(device)?;
    let (model, rows) = cuda::CudaRows::new(&dev, model, layout, mode, gpu)?;
    Ok(Backend {
        model,
        rows: Rows::Cuda(Box::new(rows)),
    })
}

#[cfg(not(feature = "cuda"))]
fn open_gpu(
    _model: DeepseekModel,
    _layout: &KvLayout,
    device: Device,
    _mode: GpuMode,
    _gpu: GpuOptions,
) -> Result<Backend, ModelError> {
    Err(ferry_kernels::KernelError::DeviceUnavailable {
        device: device.to_string(),
        reason: "the model forward on a GPU needs the `cuda` feature".into(),
    }
    .into())
}

/// The CUDA device `device` names (`auto` resolved first), opened. Anything else is an error
/// naming the reason: no driver or libraries, no such ordinal, the CPU, or ROCm (whose backend
/// runs the kernel sources but not the whole model yet).
#[cfg(feature = "cuda")]
pub fn open_cuda(device: Device) -> Result<ferry_kernels::cuda::CudaDevice, ModelError> {
    let unavailable = |reason: &str| ferry_kernels::KernelError::DeviceUnavailable {
        device: device.to_string(),
        reason: reason.into(),
    };
    match device.resolve()? {
        Device::Cuda(n) => {
            let dev = ferry_kernels::cuda::CudaDevice::open(n)?;
            tracing::info!(device = ?dev, "running on the GPU");
            Ok(dev)
        }
        Device::Rocm(_) => Err(unavailable(
            "the ROCm backend compiles and runs the kernels, but not the whole model yet",
        )
        .into()),
        Device::Cpu | Device::Auto => Err(unavailable("no CUDA device here").into()),
    }
}
