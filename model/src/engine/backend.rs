//! Where the engine's KV rows live, and what a GPU adds around the one forward.
//!
//! The model is one [`DeepseekModel`] on every device (its ops dispatch on its
//! `kernels::backend::Backend`); the engine thread owns one [`Backend`], which says where the
//! forward's KV rows are and runs the device's extras around it. On both, the [`KvManager`]'s pool is the single
//! owner of block ids — allocation, refcounts, the prefix cache and its events — and every
//! forward gets the same [`BatchInputs`] with caller-owned block tables. What differs is where
//! the model and the KV *rows* live:
//!
//! | backend | model | KV rows the forward reads and writes | the host pool | cache dtype |
//! |---|---|---|---|---|
//! | `Cpu` | [`DeepseekModel`] | the host pool | the KV itself ([`KvPool::new`]) | f32 |
//! | `Cuda` | the same [`DeepseekModel`], uploaded (host weights dropped after the upload) | a [`GpuKvCache`] indexed by the same block ids | block ids only, no rows ([`KvPool::without_rows`]) | f32 (exact mode), bf16 (fast mode) |
//!
//! KV moves to and from peers in the cache's own dtype ([`Backend::kv_dtype`]; the transfer
//! wire carries the destination's, see `ferry_kvtransfer`):
//!
//! - **Shipping (prefill worker).** A prefill job's layer sink reads its blocks through a
//!   [`LayerRows`] view. On the CPU that is the pool's layer, between layers. On CUDA, after
//!   each layer's attention is queued, a copy of exactly the shipped blocks of that layer is
//!   queued behind it on a second stream into a slot of a page-locked ring, and the sink reads
//!   that slot once the copy has landed, while later layers compute (`backend/cuda.rs`,
//!   `Shipper`); with `gpu_layerwise_shipping = false` the same copies run after the forward.
//! - **Receiving (decode worker).** A peer's block write ([`Backend::write_kv`]) carries the
//!   cache's dtype: on the CPU it is decoded into the pool's rows; on CUDA its bytes are copied
//!   as they are into the device cache (one host-to-device copy per block), before the next
//!   forward runs.
//!
//! Memory on the host, on CUDA: no KV rows (the pool is ids-only), and the ring — `min(4,
//! layers)` slots of one layer's shipped blocks in the cache's dtype, allocated on the first
//! prefill job and grown to the largest batch of shipped blocks (4 × blocks × page × width × 2
//! bytes in fast mode, × 4 in exact mode), reported as `EngineStats::kv_host_staging_bytes`. A
//! drafter's context still stages through its f32 wire pool (`spec.rs`), allocated on its first
//! transfer.
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
#[cfg(feature = "rocm")]
mod rocm;

use ferry_kernels::Device;

use ferry_kernels::backend::Tensor;

use crate::config::ModelConfig;
use crate::deepseek::{BatchInputs, BatchLogits, DeepseekModel, FormPolicy, Hooks};
use crate::kv::{BlockId, KvDtype, KvLayout, KvPool, KvRef, LayerRows};
use crate::ModelError;

/// Called per layer with that layer's rows of the staged blocks (prefill jobs' layer sinks).
pub(crate) type ShipHook<'a> =
    dyn FnMut(usize, &LayerRows<'_>) -> Result<(), ModelError> + Send + 'a;

/// Numerics of the GPU forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuMode {
    /// f32 activations, f32 latent cache, f32 attention kernels, split-bf16 GEMMs: matches the
    /// CPU backend within the CPU-vs-Hugging-Face tolerance.
    #[default]
    Exact,
    /// bf16 latent cache with the RoPE key as a bf16 hi/lo pair (`KvDtype::Bf16Split`: the
    /// RoPE half of every score kept to ~16 bits), tensor-core attention (absorbed tiles with
    /// 12 → 16 padding, flash prefill), bf16 GEMM inputs; within 2e-2 · max|logit| of exact.
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
    /// Summed µs from each such forward's end (logits on the host) to its last sink call
    /// (and, for rows left on the device, until the transport is done reading them).
    pub(crate) tail_us: u64,
    /// The last such forward's tail, µs (a prefill job's `PrefillOutcome::ship_tail`).
    pub(crate) last_tail_us: u64,
}

/// One forward's hooks, and the blocks its `after_layer` hook reads.
pub(crate) struct Pass<'p, 'h, 'a> {
    /// Called per layer, in layer order, with rows holding at least the staged blocks of that
    /// layer in the cache's dtype (prefill jobs' layer sinks).
    pub(crate) after_layer: &'h mut ShipHook<'a>,
    /// The layers whose outgoing residual stream the drafter reads (its taps).
    pub(crate) taps: &'p [usize],
    /// Receives `(layer, residual stream)` after each tap layer, copied on the model's backend
    /// (never downloaded on a GPU).
    pub(crate) tapped: &'h mut Vec<(usize, Tensor)>,
    /// Blocks whose rows `after_layer` reads (prefill jobs' shipped blocks): on CUDA exactly
    /// these are copied off the device, per layer.
    pub(crate) staged: &'p [BlockId],
    /// Leave the staged rows on the device (every prefill job of the forward asked for it:
    /// [`crate::engine::PrefillJob::rows_on_device`]); CUDA only.
    pub(crate) rows_on_device: bool,
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
    /// A device cache, graphs and layer-wise shipping through a page-locked ring.
    #[cfg(feature = "cuda")]
    Cuda(Box<cuda::CudaRows>),
    /// A ROCm device cache (eager steps, shipping after the forward).
    #[cfg(feature = "rocm")]
    Rocm(Box<rocm::RocmRows>),
}

impl Backend {
    /// `model` on `device` (`auto` resolved first) with a KV cache shaped like the host pool's
    /// `layout`. A named GPU that cannot be opened, cannot hold the model or the cache, or whose
    /// backend this binary lacks (ROCm without the `rocm` feature) is an error naming the
    /// reason: never a quiet fall-back to the CPU.
    pub(crate) fn open(
        source: crate::dummy::ModelSource,
        layout: &KvLayout,
        device: Device,
        mode: GpuMode,
        gpu: GpuOptions,
    ) -> Result<Self, ModelError> {
        let device = device.resolve()?;
        if device == Device::Cpu {
            return Ok(Backend {
                model: source.into_host()?,
                rows: Rows::Host,
            });
        }
        open_gpu(source, layout, device, mode, gpu)
    }

    /// How the GPU backend has shipped prefill jobs' layers (zeros on the CPU, whose forward
    /// calls its sinks between layers).
    pub(crate) fn ship_stats(&self) -> ShipStats {
        match &self.rows {
            Rows::Host => ShipStats::default(),
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => c.ship_stats(),
            #[cfg(feature = "rocm")]
            Rows::Rocm(r) => r.ship_stats(),
        }
    }

    /// Forwards replayed from a CUDA graph (0 on the CPU).
    pub(crate) fn graph_steps(&self) -> u64 {
        match &self.rows {
            Rows::Host => 0,
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => c.graph_steps(),
            #[cfg(feature = "rocm")]
            Rows::Rocm(_) => 0,
        }
    }

    /// CUDA graphs captured so far (0 on the CPU): a step during which this grew paid a
    /// capture, a one-off cost that says nothing about what its shape costs.
    pub(crate) fn graph_captures(&self) -> u64 {
        match &self.rows {
            Rows::Host => 0,
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => c.graph_captures(),
            #[cfg(feature = "rocm")]
            Rows::Rocm(_) => 0,
        }
    }

    /// The device the forward runs on.
    pub(crate) fn device(&self) -> Device {
        self.model.backend().device()
    }

    /// The engine's pool for `layout`: with rows on the CPU (the forward's KV; in `memory`
    /// when given, else the heap), ids only on a GPU (the rows are the device cache's).
    pub(crate) fn new_pool(
        &self,
        layout: KvLayout,
        memory: Option<&dyn crate::kv::RowMemory>,
    ) -> Result<KvPool, ModelError> {
        match &self.rows {
            Rows::Host => match memory {
                Some(m) => KvPool::new_in(layout, m),
                None => KvPool::new(layout),
            },
            #[cfg(feature = "cuda")]
            Rows::Cuda(_) => KvPool::without_rows(layout),
            #[cfg(feature = "rocm")]
            Rows::Rocm(_) => KvPool::without_rows(layout),
        }
    }

    /// The element type of the KV rows the forward runs against.
    pub(crate) fn kv_dtype(&self) -> KvDtype {
        match &self.rows {
            Rows::Host => KvDtype::F32,
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => c.kv_dtype(),
            #[cfg(feature = "rocm")]
            Rows::Rocm(r) => r.kv_dtype(),
        }
    }

    /// Where a CUDA engine's KV layers are in device memory (`None` elsewhere): for a decode
    /// worker's transfer region to register them with a transport that puts into GPU memory.
    pub(crate) fn device_kv(&self) -> Option<crate::engine::DeviceKv> {
        match &self.rows {
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => c.device_kv().ok(),
            _ => None,
        }
    }

    /// A writer of peers' runs straight into a GPU engine's device cache (`None` on the CPU).
    pub(crate) fn device_kv_writer(&self) -> Option<crate::engine::DeviceKvWriter> {
        let writer: Result<crate::engine::DeviceKvWriter, ModelError> = match &self.rows {
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => Some(c.device_kv_writer()),
            #[cfg(feature = "rocm")]
            Rows::Rocm(r) => Some(r.device_kv_writer()),
            _ => None,
        }?;
        writer
            .inspect_err(|e| tracing::warn!(error = %e, "peers' KV writes go through the engine thread: no writer of the device cache"))
            .ok()
    }

    /// Page-locked host bytes staging shipped layers (0 on the CPU).
    pub(crate) fn staging_bytes(&self) -> usize {
        match &self.rows {
            Rows::Host => 0,
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => c.staging_bytes(),
            #[cfg(feature = "rocm")]
            Rows::Rocm(_) => 0,
        }
    }

    /// The model configuration.
    pub(crate) fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// The model, on its device (a drafter shares its embedding and LM head and runs there too).
    pub(crate) fn model(&self) -> &DeepseekModel {
        &self.model
    }

    /// Runs one batch. Latent rows of the new positions go to the backend's KV (`pool`'s rows
    /// on the CPU; on a GPU `pool` is ids-only and untouched); `after_layer` sees each layer's
    /// rows of the staged blocks. The logits stay on the model's backend.
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
                // A transport may read a shipped layer's rows in place after the hook returns
                // (no copy on the way out); the forward returns only once every lease is back,
                // so no later step writes rows it is still reading. Layers after `l` are other
                // memory, written while it reads.
                let leases = crate::kv::Leases::new();
                let mut on_layer = |l: usize, kv: KvRef<'_>| match kv.host() {
                    Some(pool) => after_layer(l, &LayerRows::pool_leased(pool, l, &leases)?),
                    None => Err(ModelError::Kv("a host-pool hook got a device cache".into())),
                };
                let hooks = Hooks {
                    after_layer: Some(&mut on_layer),
                    taps: Some(taps),
                    hidden: None,
                    tapped: Some(tapped),
                    tap_into: None,
                };
                // The forward runs on one of rayon's threads: its ops' parallel loops then
                // split from inside the pool, instead of each queueing its work from this
                // thread and parking it until the pool is done.
                let model = &self.model;
                let out = rayon::scope(|_| {
                    model.forward_logits(batch, pool, FormPolicy::CostModel, hooks)
                });
                if !leases.wait_idle(crate::kv::LEASE_TIMEOUT) {
                    return Err(ModelError::Kv(format!(
                        "{} shipped layers still leased by the transport after {:?}",
                        leases.outstanding(),
                        crate::kv::LEASE_TIMEOUT
                    )));
                }
                out
            }
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => c.forward(&self.model, batch, pass),
            #[cfg(feature = "rocm")]
            Rows::Rocm(r) => r.forward(&self.model, batch, pass),
        }
    }

    /// Stores one block of one target layer from a peer: `data` is its `[page][width]` rows in
    /// [`Self::kv_dtype`] (little-endian). On the CPU they are decoded into `pool`; on a GPU
    /// they are copied as they are into the device cache (`pool` is ids-only there).
    /// Every pool block of target layer `layer` as the cache stores it (see
    /// [`crate::engine::EngineHandle::read_kv_layer`]).
    pub(crate) fn read_kv_layer(&self, pool: &KvPool, layer: usize) -> Result<Vec<u8>, ModelError> {
        let layout = pool.layout();
        let keep = layout.num_blocks * self.kv_dtype().block_bytes(layout);
        let mut bytes = match &self.rows {
            Rows::Host => bytemuck::cast_slice(pool.layer(layer)?).to_vec(),
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => c.read_kv_layer(layer)?,
            #[cfg(feature = "rocm")]
            Rows::Rocm(r) => r.read_kv_layer(layer)?,
        };
        // A GPU cache has a scratch block after the pool's.
        bytes.truncate(keep);
        Ok(bytes)
    }

    /// A peer's consecutive blocks of layer `layer` from `first` on (`data`: whole blocks in
    /// the cache's dtype): decoded into the host pool, or copied into a device cache in one go.
    pub(crate) fn write_kv(
        &mut self,
        pool: &mut KvPool,
        layer: usize,
        first: BlockId,
        data: &[u8],
    ) -> Result<(), ModelError> {
        match &mut self.rows {
            Rows::Host => {
                let layout = *pool.layout();
                let block = KvDtype::F32.block_bytes(&layout).max(1);
                if data.is_empty() || data.len() % block != 0 {
                    return Err(ModelError::Kv(format!(
                        "a block write must be whole blocks of {block} bytes, got {}",
                        data.len()
                    )));
                }
                for (i, bytes) in data.chunks_exact(block).enumerate() {
                    let dst = pool.block_mut(layer, BlockId(first.0 + i as u32))?;
                    KvDtype::F32.widen_into(bytes, layout.width, dst)?;
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Rows::Cuda(c) => {
                let _ = pool;
                c.write_kv(layer, first, data)
            }
            #[cfg(feature = "rocm")]
            Rows::Rocm(r) => {
                let _ = pool;
                r.write_kv(layer, first, data)
            }
        }
    }
}

/// `model` on the GPU `device` names (resolved): a CUDA device with the CUDA rows, a ROCm
/// device with the ROCm rows where the binary has them; anything else an error naming why.
fn open_gpu(
    source: crate::dummy::ModelSource,
    layout: &KvLayout,
    device: Device,
    mode: GpuMode,
    gpu: GpuOptions,
) -> Result<Backend, ModelError> {
    #[cfg(feature = "rocm")]
    if let Device::Rocm(n) = device {
        let _ = gpu;
        let dev = ferry_kernels::rocm::RocmDevice::open(n)?;
        tracing::info!(device = %device, arch = dev.arch(), "running on the GPU (ROCm)");
        let (model, rows) = rocm::RocmRows::new(&dev, source.into_host()?, layout, mode)?;
        return Ok(Backend {
            model,
            rows: Rows::Rocm(Box::new(rows)),
        });
    }
    open_cuda_rows(source, layout, device, mode, gpu)
}

#[cfg(feature = "cuda")]
fn open_cuda_rows(
    model: crate::dummy::ModelSource,
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
fn open_cuda_rows(
    _model: crate::dummy::ModelSource,
    _layout: &KvLayout,
    device: Device,
    _mode: GpuMode,
    _gpu: GpuOptions,
) -> Result<Backend, ModelError> {
    Err(ferry_kernels::KernelError::DeviceUnavailable {
        device: device.to_string(),
        reason: "the model forward on this GPU needs the `cuda` feature".into(),
    }
    .into())
}

/// The CUDA device `device` names (`auto` resolved first), opened. Anything else is an error
/// naming the reason: no driver or libraries, no such ordinal, the CPU, or a ROCm device (the
/// engine opens those itself, in a `rocm` build).
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
            "not a CUDA device: on ROCm only the serving engine runs, in a binary built with \
             `--features rocm`",
        )
        .into()),
        Device::Cpu | Device::Auto => Err(unavailable("no CUDA device here").into()),
    }
}
