//! The engine's CUDA backend: the one [`DeepseekModel`] on a CUDA device + [`GpuKvCache`]
//! (the host pool keeps block ids only), layer-wise shipping through a page-locked ring, peers'
//! writes copied straight into the device cache (see the parent module for the design), and
//! decode steps replayed from CUDA graphs.
//!
//! **Host memory.** No KV rows: the engine's pool is ids-only. Shipping stages through one
//! page-locked ring ([`Shipper`]) of [`RING_LAYERS`] slots (fewer for a shallower model), each
//! one layer's shipped blocks in the cache's dtype; it is allocated on the first prefill job,
//! kept, and grown when a batch ships more blocks (logged, and reported as
//! `EngineStats::kv_host_staging_bytes`). A peer's block write is copied from its own bytes.
//!
//! **Graphs.** A step in which every sequence decodes one token in the absorbed form (the
//! steady state of serving) is replayed from a [`DecodeGraph`] captured for its batch-size
//! bucket ([`graph_bucket`]: the next power of two up to 32, then of 32, up to [`graph_max_seqs`]
//! sequences): the host refreshes the inputs and
//! issues one launch instead of ~14 per layer. The batch is padded to the bucket with dummy
//! sequences that decode token 0 at position 1 of a scratch block — one block past the host
//! pool's, which no sequence owns and nothing else reads — and their logits are dropped. A graph is
//! planned for a context (block-table width and split-K plan) of the next power of two ≥ 256
//! above the batch's longest sequence and recaptured, once per doubling, when a sequence grows
//! past it. A speculative round's verify forward (`sq` rows per sequence) is replayed the same way,
//! from a graph of its own per (bucket, `sq`), for up to [`graph_max_seqs`]`(sq)` sequences. Any
//! other step (a prefill chunk in the batch, an MHA-form chunk, prompt log-probabilities) runs
//! eagerly.

use std::collections::HashMap;

use ferry_kernels::backend::Tensor;
use ferry_kernels::cuda::{CopyStream, CudaDevice, DeviceRange, Mark, PinnedBuffer};

use super::{GpuMode, GpuOptions, Pass, ShipHook, ShipStats};
use crate::deepseek::forward::Hooks;
use crate::deepseek::{
    AttentionForm, BatchInputs, BatchLogits, DeepseekModel, FormPolicy, LogitsWanted, SeqInput,
};
use crate::gpu::graph::{graph_bucket, graph_max_seqs, DecodeGraph};
use crate::gpu::GpuKvCache;
use crate::kv::{block_runs, BlockId, KvDtype, KvLayout, LayerRows};
use crate::ModelError;

/// The smallest context a graph is planned for.
const MIN_GRAPH_CTX: usize = 256;

/// What a CUDA device adds around the one forward: the paged latent cache, graph replay and
/// layer-wise shipping. The model itself is the engine backend's ([`super::Backend`]) and is
/// passed in.
pub(crate) struct CudaRows {
    dev: CudaDevice,
    /// The host pool's blocks plus one scratch block (the last) for graph padding.
    cache: GpuKvCache,
    /// Captured steps by (batch-size bucket, tokens per sequence); `None` when graphs are off.
    graphs: Option<HashMap<(usize, usize), DecodeGraph>>,
    /// Steps replayed from a graph (the engine's `graph_steps`).
    graph_steps: u64,
    /// Graphs captured (or recaptured) so far: a step that captured one paid the capture.
    graph_captures: u64,
    /// The second stream shipped layers are copied on (made on first use).
    copy: Option<CopyStream>,
    /// The page-locked staging ring, kept between forwards (grown when a job needs more).
    ring: Option<PinnedBuffer<u8>>,
    /// Ship prefill jobs' layers during the forward ([`Shipper`]); else after it.
    layerwise: bool,
    /// The shipping counters (`EngineStats::kv_*`).
    ship: ShipStats,
}

impl CudaRows {
    /// Uploads `model` (which is then dropped: the host keeps no weights) and allocates a
    /// device cache with the host pool's geometry (the pool itself keeps block ids only);
    /// returns the device-resident model with it.
    pub(crate) fn new(
        dev: &CudaDevice,
        source: crate::dummy::ModelSource,
        layout: &KvLayout,
        mode: GpuMode,
        options: GpuOptions,
    ) -> Result<(DeepseekModel, Self), ModelError> {
        let gpu = match source {
            // The host keeps no weights: the host model is dropped once uploaded.
            crate::dummy::ModelSource::Model(model) => model.upload(dev, mode)?,
            // Dummy weights are drawn on the device: a large model's would take minutes to
            // draw and upload from the host.
            crate::dummy::ModelSource::Dummy { config, seed } => {
                let started = std::time::Instant::now();
                let m = DeepseekModel::random_seeded(dev, config, mode, seed)?;
                dev.synchronize()?;
                tracing::info!(
                    seconds = started.elapsed().as_secs_f64(),
                    seed,
                    "dummy weights drawn on the GPU"
                );
                m
            }
        };
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
        let dtype = cache.dtype();
        tracing::info!(
            device = ?dev,
            ?mode,
            kv_blocks = layout.num_blocks,
            kv_dtype = %dtype,
            kv_device_bytes = (layout.num_blocks + 1) * layout.num_layers * dtype.block_bytes(layout),
            ring_layers = RING_LAYERS.min(layout.num_layers),
            "engine on the GPU: weights and KV cache in device memory; the host keeps block ids only (no KV rows) and stages shipped layers through a page-locked ring of that many layers of a batch's shipped blocks, allocated on the first prefill job"
        );
        let mut rows = Self {
            dev: dev.clone(),
            cache,
            graphs: options.cuda_graphs.then(HashMap::new),
            graph_steps: 0,
            graph_captures: 0,
            copy: None,
            ring: None,
            layerwise: options.layerwise_shipping,
            ship: ShipStats::default(),
        };
        let started = std::time::Instant::now();
        rows.warm_up(&gpu)?;
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            "GPU kernels compiled and loaded"
        );
        Ok((gpu, rows))
    }

    /// Compiles and loads the kernels of both attention forms before the engine serves.
    /// NVRTC compiles each kernel source on first use, which can take seconds on a cold
    /// machine; on the engine thread that would stall the first requests and the worker's
    /// heartbeats (they wait for the engine's stats), and the router would drop the worker.
    /// Runs a short prompt in the MHA form, then one decode step in the absorbed form (one
    /// sequence, then a batch of 8), in the first blocks of the cache: those rows are garbage afterwards, but every row is written
    /// by a forward or a peer before any forward reads it.
    fn warm_up(&mut self, gpu: &DeepseekModel) -> Result<(), ModelError> {
        let layout = *self.cache.layout();
        let table: Vec<BlockId> = (0..layout.num_blocks.min(2) as u32).map(BlockId).collect();
        let positions = (layout.page_size * table.len()).min(9);
        let tokens = vec![0u32; positions];
        let steps = [
            (AttentionForm::Mha, 0, positions.saturating_sub(1).max(1)),
            (AttentionForm::Absorbed, positions - 1, positions),
        ];
        for (form, start, end) in steps {
            if start >= end {
                continue;
            }
            let batch = BatchInputs {
                prompt_logprobs: Vec::new(),
                drafts_on_device: None,
                seqs: vec![SeqInput {
                    tokens: &tokens[start..end],
                    start_pos: start,
                    block_table: &table,
                    logits: LogitsWanted::Last,
                }],
            };
            gpu.forward_with(&batch, &mut self.cache, FormPolicy::Force(form))?;
        }
        // The absorbed tile kernels take their ring depth as a compile-time define that
        // changes at 8 (sequence, tile) items (`kernels::gpu::mla`): one decode step of 8
        // sequences compiles the batched variant too, so the first batch of 8 does not stall
        // on NVRTC (a 12–13 s TTFT tail at the first concurrency above 4 after each start).
        // The sequences share the warm-up blocks: their rows are garbage as well.
        let last = positions - 1;
        let batch = BatchInputs {
            prompt_logprobs: Vec::new(),
            drafts_on_device: None,
            seqs: (0..8)
                .map(|_| SeqInput {
                    tokens: &tokens[last..positions],
                    start_pos: last,
                    block_table: &table,
                    logits: LogitsWanted::Last,
                })
                .collect(),
        };
        gpu.forward_with(
            &batch,
            &mut self.cache,
            FormPolicy::Force(AttentionForm::Absorbed),
        )
        .map(drop)
    }

    /// The shipping counters.
    pub(crate) fn ship_stats(&self) -> ShipStats {
        self.ship
    }

    /// Steps replayed from a CUDA graph so far.
    pub(crate) fn graph_steps(&self) -> u64 {
        self.graph_steps
    }

    /// Graphs captured so far (a recapture counts again).
    pub(crate) fn graph_captures(&self) -> u64 {
        self.graph_captures
    }

    /// The scratch block graph padding writes into (never one of the host pool's).
    fn scratch_block(&self) -> BlockId {
        BlockId((self.cache.layout().num_blocks - 1) as u32)
    }

    /// Runs `batch` from a captured graph if it is graph-shaped — every sequence the same
    /// number of new tokens in the absorbed form: a decode step (one token each) or a
    /// speculative round's verify forward (anchor + B drafts each) — copying the residual
    /// stream after each of `taps` into `tapped`. `Ok(None)` when it is not (the caller runs
    /// it eagerly).
    fn try_graph(
        &mut self,
        gpu: &DeepseekModel,
        batch: &BatchInputs<'_>,
        taps: &[usize],
        tapped: &mut Vec<(usize, Tensor)>,
    ) -> Result<Option<BatchLogits>, ModelError> {
        let n = batch.seqs.len();
        let scratch = [self.scratch_block()];
        let Some(graphs) = self.graphs.as_mut() else {
            return Ok(None);
        };
        let dims = &gpu.dims;
        let sq = batch.seqs.first().map_or(0, |s| s.tokens.len());
        let wanted = if sq == 1 {
            LogitsWanted::Last
        } else {
            LogitsWanted::All
        };
        // A graph computes only the picked rows' logits: prompt log-probabilities run eagerly.
        let bucket = graph_bucket(n, graph_max_seqs(sq));
        let graph_shaped = bucket.is_some()
            && batch.prompt_logprobs.is_empty()
            && sq >= 1
            // The padding sequences' tokens sit at positions 1..=sq of the scratch block.
            && self.cache.layout().page_size > sq
            && gpu.policy.choose(dims, 1, sq) == AttentionForm::Absorbed
            && batch.seqs.iter().all(|s| {
                s.tokens.len() == sq
                    && s.logits == wanted
                    && gpu.policy.choose(dims, s.start_pos, sq) == AttentionForm::Absorbed
            });
        let (true, Some(bucket)) = (graph_shaped, bucket) else {
            return Ok(None);
        };
        let longest = batch
            .seqs
            .iter()
            .map(|s| s.start_pos + sq)
            .max()
            .unwrap_or(1);
        let plan_ctx = longest
            .next_power_of_two()
            .max(MIN_GRAPH_CTX)
            .min(gpu.config.max_position_embeddings.max(longest));
        // Pad to the bucket with sequences at positions 1..=sq of the scratch block (the
        // absorbed form needs a cached position; position 0 is zeros or an earlier padding
        // row, finite either way).
        let pad = vec![0u32; sq];
        let mut seqs = batch.seqs.clone();
        seqs.resize_with(bucket, || SeqInput {
            tokens: &pad,
            start_pos: 1,
            block_table: &scratch,
            logits: wanted,
        });
        let padded = BatchInputs {
            seqs,
            prompt_logprobs: Vec::new(),
            // The round's sequences come first; the padding's are left as they are.
            drafts_on_device: batch.drafts_on_device,
        };
        let key = (bucket, sq);
        let stale = graphs.get(&key).is_some_and(|g| g.plan_ctx() < plan_ctx);
        if stale || !graphs.contains_key(&key) {
            graphs.remove(&key);
            match gpu.capture_decode(&padded, &mut self.cache, plan_ctx, taps) {
                Ok(g) => {
                    tracing::debug!(bucket, sq, plan_ctx, "captured a decode graph");
                    graphs.insert(key, g);
                    self.graph_captures += 1;
                }
                Err(e) => {
                    // Serving goes on eagerly: a capture that fails says nothing about the
                    // batch (the eager step it ran first rewrites the same rows).
                    tracing::warn!(bucket, sq, plan_ctx, error = %e, "CUDA graph capture failed; decoding eagerly from now on");
                    self.graphs = None;
                    return Ok(None);
                }
            }
        }
        let Some(g) = graphs.get_mut(&key) else {
            return Ok(None);
        };
        let out = gpu.replay_decode_logits(g, &padded, &self.cache, n)?;
        // The real sequences' rows of each tap (the padding's come after them).
        let rows = n * sq * gpu.config.hidden_size;
        for (layer, buf) in g.taps() {
            let mut t = gpu.backend.scratch(rows)?;
            gpu.backend.copy_prefix(buf, &mut t)?;
            tapped.push((*layer, t));
        }
        self.graph_steps += 1;
        Ok(Some(out))
    }

    /// A writer of peers' runs into the device cache on a copy stream of its own, for the
    /// decode worker's receiving threads.
    pub(crate) fn device_kv_writer(&self) -> Result<crate::engine::DeviceKvWriter, ModelError> {
        let pool_blocks = self.cache.layout().num_blocks - 1;
        crate::engine::DeviceKvWriter::cuda(&self.cache, pool_blocks)
    }

    /// The cache's element type.
    pub(crate) fn kv_dtype(&self) -> KvDtype {
        self.cache.dtype()
    }

    /// The device cache's layers as `(address, bytes)` of the host pool's blocks (the scratch
    /// block after them is left out).
    pub(crate) fn device_kv(&self) -> Result<crate::engine::DeviceKv, ModelError> {
        let layout = *self.cache.layout();
        let pool_blocks = layout.num_blocks - 1;
        let layers = (0..layout.num_layers)
            .map(|l| self.cache.block_bytes(l, BlockId(0), pool_blocks))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(crate::engine::DeviceKv {
            device: i32::try_from(self.dev.ordinal()).unwrap_or(i32::MAX),
            layers,
        })
    }

    /// Layer `layer` of the device cache, downloaded as stored.
    pub(crate) fn read_kv_layer(&self, layer: usize) -> Result<Vec<u8>, ModelError> {
        self.cache.download_layer_bytes(layer)
    }

    /// Page-locked bytes of the shipping ring (0 before the first prefill job).
    pub(crate) fn staging_bytes(&self) -> usize {
        self.ring.as_ref().map_or(0, PinnedBuffer::len)
    }

    /// A peer's consecutive blocks of layer `layer` from `first` on, `data` in the cache's
    /// dtype: one host-to-device copy into the cache however many blocks (done when this
    /// returns, so it is ordered before the next forward).
    pub(crate) fn write_kv(
        &mut self,
        layer: usize,
        first: BlockId,
        data: &[u8],
    ) -> Result<(), ModelError> {
        let block = self.cache.dtype().block_bytes(self.cache.layout()).max(1);
        let end = first.0 as usize + data.len() / block;
        if end > self.cache.layout().num_blocks - 1 {
            // The last block is the graphs' scratch block, never a pool block.
            return Err(ModelError::Kv(format!(
                "blocks {first}..block#{end} reach outside the pool"
            )));
        }
        self.cache.write_run_bytes(layer, first, data)
    }

    /// The forward; per layer, `after_layer` sees that layer's rows of the staged blocks, in
    /// the cache's dtype. With staged blocks (a prefill job shipping), each layer's rows leave
    /// while later layers compute ([`Shipper`]); without, nothing is copied and the hook sees
    /// empty views after the forward.
    pub(crate) fn forward(
        &mut self,
        gpu: &DeepseekModel,
        batch: &BatchInputs<'_>,
        pass: Pass<'_, '_, '_>,
    ) -> Result<BatchLogits, ModelError> {
        let Pass {
            after_layer,
            taps,
            tapped,
            ..
        } = pass;
        let mut staged = pass.staged.to_vec();
        staged.sort_unstable();
        staged.dedup();
        let layers = self.cache.layout().num_layers;
        if staged.is_empty() {
            let graphed = self.try_graph(gpu, batch, taps, &mut *tapped)?;
            let out = match graphed {
                Some(out) => out,
                None => {
                    let hooks = Hooks {
                        after_layer: None,
                        taps: Some(taps),
                        hidden: None,
                        tapped: Some(&mut *tapped),
                        tap_into: None,
                    };
                    gpu.forward_logits(batch, &mut self.cache, gpu.policy, hooks)?
                }
            };
            let layout = *self.cache.layout();
            let block_bytes = self.kv_dtype().block_bytes(&layout);
            for layer in 0..layers {
                after_layer(
                    layer,
                    &LayerRows::staged(
                        layer,
                        (self.kv_dtype(), layout.width),
                        block_bytes,
                        &[],
                        &[],
                    )?,
                )?;
            }
            return Ok(out);
        }
        if pass.rows_on_device {
            return self.forward_leaving_rows((gpu, batch), &staged, (after_layer, taps, tapped));
        }
        if self.copy.is_none() {
            self.copy = Some(self.dev.copy_stream()?);
        }
        let mut shipper = Shipper::new(&self.dev, &self.cache, &staged, self.ring.take())?;
        if !self.layerwise {
            return self.forward_then_ship((gpu, batch), shipper, (after_layer, taps, tapped));
        }
        let Some(copy) = self.copy.as_ref() else {
            self.ring = Some(shipper.ring);
            return Err(ModelError::Invalid("no copy stream".into()));
        };
        let result = {
            let mut hook = |l: usize, _: crate::kv::KvRef<'_>| {
                shipper.layer_queued(l, copy, &mut *after_layer)
            };
            let hooks = Hooks {
                after_layer: Some(&mut hook),
                taps: Some(taps),
                hidden: None,
                tapped: Some(&mut *tapped),
                tap_into: None,
            };
            gpu.forward_logits(batch, &mut self.cache, gpu.policy, hooks)
        };
        // The tail is measured from the forward's end on the device (the logits stay there, so
        // the call returns as soon as the work is queued); the prefill job's first token waits
        // for the same work anyway.
        let synced = self.dev.synchronize();
        // Drain whatever is still in flight even when the forward failed, so the ring is free.
        let forward_done = std::time::Instant::now();
        let drained = shipper.drain(&mut *after_layer);
        self.record_ship(forward_done, shipper.early);
        self.ring = Some(shipper.ring);
        let out = result?;
        synced?;
        drained?;
        Ok(out)
    }

    /// The shipping of the engine before layer-wise streaming (`gpu_layerwise_shipping =
    /// false`, the benchmark's peer): the whole forward, then per layer the staged blocks
    /// copied into the ring and the sink called, one layer at a time.
    fn forward_then_ship(
        &mut self,
        (gpu, batch): (&DeepseekModel, &BatchInputs<'_>),
        mut shipper: Shipper,
        (after_layer, taps, tapped): (&mut ShipHook<'_>, &[usize], &mut Vec<(usize, Tensor)>),
    ) -> Result<BatchLogits, ModelError> {
        let hooks = Hooks {
            after_layer: None,
            taps: Some(taps),
            hidden: None,
            tapped: Some(tapped),
            tap_into: None,
        };
        let out = gpu.forward_logits(batch, &mut self.cache, gpu.policy, hooks);
        // From the forward's end on the device, as in the layer-wise path.
        let synced = self.dev.synchronize();
        let forward_done = std::time::Instant::now();
        let shipped = match (&out, self.copy.as_ref()) {
            (Err(_), _) => Ok(()),
            (Ok(_), None) => Err(ModelError::Invalid("no copy stream".into())),
            (Ok(_), Some(copy)) => (0..self.cache.layout().num_layers).try_for_each(|layer| {
                shipper.layer_queued(layer, copy, &mut *after_layer)?;
                shipper.drain(&mut *after_layer)
            }),
        };
        self.ring = Some(shipper.ring);
        let out = out?;
        synced?;
        shipped?;
        self.record_ship(forward_done, 0);
        Ok(out)
    }

    /// Shipping with the rows left in device memory (every prefill job of the forward asked
    /// for it): after each layer's attention is queued, a mark on the compute stream; once it
    /// is done the sink gets a [`LayerRows::device`] view of the staged blocks' addresses —
    /// no copy, no ring — and a lease per layer. Layer-wise while later layers compute (or all
    /// after the forward, without layer-wise shipping). Before returning, the forward waits for
    /// every lease to come back (the transport's puts have read the blocks), so nothing later
    /// writes a block a put is still reading.
    fn forward_leaving_rows(
        &mut self,
        (gpu, batch): (&DeepseekModel, &BatchInputs<'_>),
        staged: &[BlockId],
        (after_layer, taps, tapped): (&mut ShipHook<'_>, &[usize], &mut Vec<(usize, Tensor)>),
    ) -> Result<BatchLogits, ModelError> {
        let layout = *self.cache.layout();
        let dtype = self.cache.dtype();
        let block_bytes = dtype.block_bytes(&layout);
        let ordinal = i32::try_from(self.dev.ordinal()).unwrap_or(i32::MAX);
        let mut runs = vec![Vec::new(); layout.num_layers];
        for (first, n) in block_runs(staged) {
            for (l, r) in runs.iter_mut().enumerate() {
                r.push((first, n, self.cache.block_bytes(l, first, n)?.0));
            }
        }
        let leases = crate::kv::Leases::new();
        let mut pending: std::collections::VecDeque<(usize, Mark)> = Default::default();
        let mut early = 0u64;
        let deliver = |l: usize, sink: &mut ShipHook<'_>| {
            let rows = LayerRows::device(
                l,
                (dtype, layout.width),
                block_bytes,
                staged,
                crate::kv::DeviceRows::new(ordinal, &runs[l], &leases),
            );
            sink(l, &rows)
        };
        let result = if self.layerwise {
            let dev = self.dev.clone();
            let mut hook = |l: usize, _: crate::kv::KvRef<'_>| -> Result<(), ModelError> {
                while let Some((done, _)) = pending.front().filter(|(_, m)| m.is_done()) {
                    let done = *done;
                    pending.pop_front();
                    early += 1;
                    deliver(done, &mut *after_layer)?;
                }
                pending.push_back((l, dev.mark()?));
                Ok(())
            };
            let hooks = Hooks {
                after_layer: Some(&mut hook),
                taps: Some(taps),
                hidden: None,
                tapped: Some(&mut *tapped),
                tap_into: None,
            };
            gpu.forward_logits(batch, &mut self.cache, gpu.policy, hooks)
        } else {
            let hooks = Hooks {
                after_layer: None,
                taps: Some(taps),
                hidden: None,
                tapped: Some(&mut *tapped),
                tap_into: None,
            };
            gpu.forward_logits(batch, &mut self.cache, gpu.policy, hooks)
        };
        let synced = self.dev.synchronize();
        let forward_done = std::time::Instant::now();
        let delivered = if result.is_ok() && synced.is_ok() {
            let rest: Vec<usize> = if self.layerwise {
                pending.drain(..).map(|(l, _)| l).collect()
            } else {
                (0..layout.num_layers).collect()
            };
            rest.into_iter()
                .try_for_each(|l| deliver(l, &mut *after_layer))
        } else {
            Ok(())
        };
        // The transport reads the blocks until its puts complete: nothing may write them
        // before every lease is back (a wedged transport fails the forward after the bound).
        let returned = leases.wait_idle(crate::kv::LEASE_TIMEOUT);
        self.record_ship(forward_done, early);
        let out = result?;
        synced?;
        delivered?;
        if !returned {
            return Err(ModelError::Kv(format!(
                "{} shipped layers still leased by the transport after {:?}",
                leases.outstanding(),
                crate::kv::LEASE_TIMEOUT
            )));
        }
        Ok(out)
    }

    fn record_ship(&mut self, forward_done: std::time::Instant, early: u64) {
        let tail = forward_done.elapsed().as_micros() as u64;
        self.ship.forwards += 1;
        self.ship.tail_us += tail;
        self.ship.last_tail_us = tail;
        self.ship.early += early;
    }
}

/// How many layers' rows may be in flight between the device and the host sink.
const RING_LAYERS: usize = 4;

/// One forward's shipping: after each layer's attention is queued, a copy of that layer's
/// staged blocks (in the cache's own dtype) is queued on the copy stream behind a mark into the
/// next slot of a page-locked ring of [`RING_LAYERS`] layers; the host delivers a layer — calls
/// the sink with a [`LayerRows`] view of its slot, no widening, no further copy — once its copy
/// is done, polling between layers and blocking only when the ring is full and at the end.
struct Shipper {
    dev: CudaDevice,
    /// `(device address, bytes)` of each run of consecutive staged blocks, per layer.
    runs: Vec<Vec<(u64, usize)>>,
    /// The staged blocks (sorted, distinct), in ring order.
    blocks: Vec<BlockId>,
    ring: PinnedBuffer<u8>,
    slot_bytes: usize,
    dtype: KvDtype,
    /// Logical elements per row.
    width: usize,
    /// Bytes of one block of one layer.
    block_bytes: usize,
    /// Layers the ring holds: [`RING_LAYERS`], or fewer for a shallower model.
    slots: usize,
    /// `(layer, slot, copy done)` in layer order.
    pending: std::collections::VecDeque<(usize, usize, Mark)>,
    layers: usize,
    /// Set once the last layer's attention is queued: a mark on the compute stream.
    last_queued: Option<Mark>,
    /// Layers delivered before the last layer was computed.
    early: u64,
}

impl Shipper {
    /// Shipping of `staged` (sorted, distinct) out of `cache`, in `ring` if it is large enough
    /// (else a new, larger one).
    fn new(
        dev: &CudaDevice,
        cache: &GpuKvCache,
        staged: &[BlockId],
        ring: Option<PinnedBuffer<u8>>,
    ) -> Result<Self, ModelError> {
        let layout = *cache.layout();
        let mut runs = vec![Vec::new(); layout.num_layers];
        for (first, n) in block_runs(staged) {
            for (l, r) in runs.iter_mut().enumerate() {
                r.push(cache.block_bytes(l, first, n)?);
            }
        }
        let slot_bytes: usize = runs.first().map_or(0, |r| r.iter().map(|&(_, b)| b).sum());
        let slots = RING_LAYERS.min(layout.num_layers).max(1);
        let ring = match ring {
            Some(r) if r.len() >= slots * slot_bytes => r,
            old => {
                let bytes = slots * slot_bytes;
                tracing::info!(
                    bytes,
                    before = old.as_ref().map_or(0, PinnedBuffer::len),
                    layers = slots,
                    blocks = staged.len(),
                    "KV shipping ring (page-locked host memory) grown"
                );
                drop(old);
                dev.pinned::<u8>(bytes)?
            }
        };
        let dtype = cache.dtype();
        Ok(Self {
            dev: dev.clone(),
            runs,
            blocks: staged.to_vec(),
            ring,
            slot_bytes,
            dtype,
            width: layout.width,
            block_bytes: dtype.block_bytes(&layout),
            slots,
            pending: std::collections::VecDeque::new(),
            layers: layout.num_layers,
            last_queued: None,
            early: 0,
        })
    }

    /// Layer `l`'s attention is queued: deliver what has landed, make room, queue its copy.
    fn layer_queued(
        &mut self,
        l: usize,
        copy: &CopyStream,
        sink: &mut ShipHook<'_>,
    ) -> Result<(), ModelError> {
        while self.pending.front().is_some_and(|(_, _, m)| m.is_done()) {
            self.deliver_next(sink)?;
        }
        if self.pending.len() >= self.slots {
            self.deliver_next(sink)?;
        }
        let slot = l % self.slots;
        let after = self.dev.mark()?;
        let mut at = slot * self.slot_bytes;
        for &(src, bytes) in &self.runs[l] {
            let range = DeviceRange {
                addr: src,
                len: bytes,
            };
            copy.copy_after(&after, range, &mut self.ring, at)?;
            at += bytes;
        }
        self.pending.push_back((l, slot, copy.mark()?));
        if l + 1 == self.layers {
            self.last_queued = Some(after);
        }
        Ok(())
    }

    /// Delivers every layer still in flight, in order.
    fn drain(&mut self, sink: &mut ShipHook<'_>) -> Result<(), ModelError> {
        while !self.pending.is_empty() {
            self.deliver_next(sink)?;
        }
        Ok(())
    }

    /// Waits for the oldest layer's copy and calls the sink with its ring slot.
    fn deliver_next(&mut self, sink: &mut ShipHook<'_>) -> Result<(), ModelError> {
        let Some((layer, slot, done)) = self.pending.pop_front() else {
            return Ok(());
        };
        done.wait()?;
        if self.last_queued.as_ref().is_none_or(|m| !m.is_done()) {
            self.early += 1;
        }
        let bytes = &self.ring.as_slice()[slot * self.slot_bytes..(slot + 1) * self.slot_bytes];
        let rows = LayerRows::staged(
            layer,
            (self.dtype, self.width),
            self.block_bytes,
            &self.blocks,
            bytes,
        )?;
        sink(layer, &rows)
    }
}
