//! The KV region peers write into.

use std::sync::Arc;

use ferry_kvtransfer::error::TransferError;
use ferry_kvtransfer::{Dtype, Fence, KvLayoutDesc, KvRegion, LayerMemory, Transport};
use ferry_model::engine::{DeviceKv, DeviceKvWriter, DraftLanding, EngineHandle};
use ferry_model::kv::{BlockId, HostRows, KvDtype, RemoteFences, RowBuffer, RowMemory};

/// A CPU engine's KV rows in the KV transport's memory ([`Transport::alloc_host`]): with UCX,
/// shared memory that a prefill worker on this machine maps and copies into; with TCP, the
/// heap.
pub struct TransportRows(pub Arc<dyn Transport>);

impl RowMemory for TransportRows {
    #[allow(unsafe_code)] // see the crate root
    fn alloc(&self, bytes: usize) -> Result<RowBuffer, String> {
        let memory = self.0.alloc_host(bytes).map_err(|e| e.to_string())?;
        let ptr = std::ptr::NonNull::new(memory.as_ptr()).ok_or("a null allocation")?;
        let len = memory.len();
        // SAFETY: `HostMemory` is zeroed, page-aligned and lives as long as the owner (this
        // clone); the pool and its transfer region are its only writers.
        Ok(unsafe { RowBuffer::new(ptr, len, Box::new(memory)) })
    }
}

/// This worker's KV pool as a transfer target: registered memory where the rows are on the
/// host, staged writes elsewhere.
///
/// - **A CPU engine's target layers are exposed as memory** ([`KvRegion::memory`]): the pool's
///   rows ([`HostRows`], shared with the engine), so a UCX peer puts blocks straight into them
///   and the TCP receiver copies each block there, with no engine-thread hop. The engine reads
///   those blocks only after the peer's completion (its prefill reply, sent after its flush).
/// - **A CUDA engine's target layers are exposed as device memory** ([`LayerMemory::Cuda`]:
///   [`EngineHandle::device_kv`]), so a UCX peer with CUDA support puts blocks straight from its
///   own device cache into this one (`cuda_ipc` on one GPU or across NVLink). A transport that
///   cannot reach device memory (TCP, a UCX without CUDA) hands each run of consecutive blocks
///   to [`KvRegion::write_run`] instead, which copies it into the device cache from the
///   receiving thread ([`DeviceKvWriter`]: a copy stream of its own, waited for before the
///   receiver goes on, as a host layer's copy is), not through the engine thread: one command
///   and one synchronous pageable copy per run there stopped decode steps for every prompt
///   landed (~8 MB for 1,024 tokens of session 41's small target; docs/transfer.md). A ROCm engine's cache is written the same way.
/// - **Everything else is staged** through [`KvRegion::write`] to the engine thread (the pool's
///   one owner), which applies writes in order before it processes the completion: the
///   drafter's context layers (its [`DraftLanding`] widens them, puts them together per block
///   in the drafter's own layout and, on a GPU, copies each completed block into the drafter
///   KV), and a CPU engine's target layers where its rows are not the wire's dtype. With
///   `FERRY_DIRECT_KV_WRITES=all` the drafter's layers land from the receiving thread instead
///   (measured slower on one shared GPU: [`direct_writes`]).
/// - **Every block a receiver sees is admitted only under its request's fence**
///   ([`RemoteFences`]: reserved by the engine for exactly that remote prefill), so a peer
///   whose request was abandoned cannot write into blocks since recomputed or reused. A
///   one-sided put is not seen by the receiver; see `docs/transfer.md` for what fences it.
///
/// The advertised dtype is the engine's cache dtype ([`EngineHandle::kv_dtype`]: f32 on the CPU
/// and in CUDA exact mode, bf16 in CUDA fast mode): the wire carries the destination's dtype,
/// so a peer's bytes go into the cache as they arrive (on a GPU, straight into device memory)
/// and the peer converts when its own cache holds another dtype.
///
/// With a drafter, the advertised layout has the drafter's context pool layers after the
/// target's: `num_layers = target layers + drafter pool layers`, same page size, width and
/// dtype (the drafter pool is shaped like the target's; see `ferry_model::drafter::DraftKvLayout`;
/// its f32 rows are widened from the wire's dtype on arrival).
/// A peer with the same drafter writes those layers too; one without writes only the target's,
/// and requests it prefills decode without speculation.
pub struct EngineRegion {
    engine: EngineHandle,
    layout: KvLayoutDesc,
    /// The rows exposed as memory (a CPU engine's), kept alive while registered.
    rows: Option<Arc<HostRows>>,
    /// A CUDA engine's device cache (kept alive by `engine`: the engine thread runs while
    /// any handle does).
    device: Option<DeviceKv>,
    /// Copies staged runs of target layers into a GPU engine's cache (CUDA or ROCm) from the
    /// receiving thread.
    writer: Option<Arc<DeviceKvWriter>>,
    /// Lands the drafter's context layers from the receiving thread (`FERRY_DIRECT_KV_WRITES=all`).
    draft: Option<Arc<DraftLanding>>,
    /// Target layers (the rest are the drafter's context).
    target_layers: u32,
    fences: Arc<RemoteFences>,
}

impl EngineRegion {
    /// The region over `engine`'s pool.
    pub fn new(engine: EngineHandle) -> Self {
        let l = engine.kv_layout();
        let u = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        let layout = KvLayoutDesc {
            num_layers: u(l.num_layers + engine.draft_kv_layers()),
            page_size: u(l.page_size),
            latent_width: u(l.width),
            dtype: match engine.kv_dtype() {
                KvDtype::F32 => Dtype::F32,
                KvDtype::Bf16Split { rope } => Dtype::Bf16Split { rope: u(rope) },
            },
            num_blocks: u(l.num_blocks),
        };
        // Rows are exposed only when they are what the wire carries (f32 host rows).
        let rows = engine
            .host_rows()
            .filter(|_| engine.kv_dtype() == KvDtype::F32);
        Self {
            rows,
            device: engine.device_kv(),
            writer: engine.device_kv_writer().filter(|_| direct_writes().target),
            draft: engine.draft_landing().filter(|_| direct_writes().drafter),
            target_layers: u(l.num_layers),
            fences: engine.remote_fences(),
            engine,
            layout,
        }
    }
}

/// Which layers a region lands from the receiving thread ([`direct_writes`]).
#[derive(Debug, Clone, Copy)]
struct DirectWrites {
    /// A GPU engine's target layers ([`DeviceKvWriter`]).
    target: bool,
    /// Every engine's drafter layers ([`DraftLanding`]).
    drafter: bool,
}

/// `FERRY_DIRECT_KV_WRITES` (read once), the benchmarks' A/B switch for the hop through the
/// engine thread: unset (or anything else), a GPU engine's target layers land from the
/// receiving thread and the drafter's go through the engine thread (the default); `all`, the
/// drafter's land from the receiving thread too; `0`, every write is an engine command.
///
/// Why the drafter's layers stay on the engine thread by default: moving them off (session 42,
/// `all`) kept a speculating decode worker stepping all the time (busy 0.84–0.91 → 0.97–0.99)
/// but made the one-GPU cluster 4–5 % slower at c = 64 / 128 (four interleaved pairs,
/// BENCHMARKS.md session 42): with both workers on one GPU, a decode worker that never pauses
/// takes GPU time from the prefill worker, and its steps carry fewer sequences (82–86 against
/// 97–106 at c = 128). Where the decode worker has its own GPU it may pay; not measured.
fn direct_writes() -> DirectWrites {
    static ON: std::sync::OnceLock<DirectWrites> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let v = std::env::var("FERRY_DIRECT_KV_WRITES").unwrap_or_default();
        match v.trim() {
            "0" => DirectWrites {
                target: false,
                drafter: false,
            },
            "all" => DirectWrites {
                target: true,
                drafter: true,
            },
            _ => DirectWrites {
                target: true,
                drafter: false,
            },
        }
    })
}

impl KvRegion for EngineRegion {
    fn layout(&self) -> KvLayoutDesc {
        self.layout
    }

    #[allow(unsafe_code)] // see the crate root
    fn memory(&self, layer: u32) -> LayerMemory {
        if let Some(kv) = self.device.as_ref().filter(|_| layer < self.target_layers) {
            return match kv.layers.get(layer as usize) {
                // SAFETY: the device cache lives as long as the engine thread, which runs while
                // this region's handle does; peers write only blocks reserved for them, which
                // the engine reads only after the transfer's completion (as for host rows).
                Some(&(addr, len)) => unsafe { LayerMemory::cuda(addr, len, kv.device) },
                None => LayerMemory::Staged,
            };
        }
        match &self.rows {
            Some(rows) if layer < self.target_layers => match rows.layer_span(layer as usize) {
                // SAFETY: the rows live as long as this region (it holds the `Arc`); peers
                // write only blocks the engine reserved for them (`admit`, and the writer's
                // own request), which the engine does not touch until the transfer completes
                // (`ferry_model::kv::pool`).
                Some((ptr, len)) => unsafe { LayerMemory::host(ptr, len) },
                None => LayerMemory::Staged,
            },
            _ => LayerMemory::Staged,
        }
    }

    fn admit(&self, block: u32, fence: Fence) -> Result<(), TransferError> {
        if self.fences.holds(block, fence.0) {
            Ok(())
        } else {
            Err(TransferError::Region(format!(
                "block {block} is not reserved for this transfer (fence {}): its request was \
                 given up, or the block belongs to another",
                fence.0
            )))
        }
    }

    fn write(&self, layer: u32, block: u32, data: &[u8]) -> Result<(), TransferError> {
        self.write_run(layer, block, data)
    }

    /// A GPU engine's target layer: one host-to-device copy from this thread. A drafter layer
    /// under `FERRY_DIRECT_KV_WRITES=all`: landed from this thread ([`DraftLanding::write`]).
    /// Anything else (the drafter's layers, a CPU engine's staged layers): one engine command
    /// per run, applied in order before the transfer's completion.
    fn write_run(&self, layer: u32, first: u32, data: &[u8]) -> Result<(), TransferError> {
        if let Some(draft) = self.draft.as_ref().filter(|_| layer >= self.target_layers) {
            // SAFETY: as for the target's layers below: every block of the run was admitted
            // under its transfer's fence, and `self.engine` keeps the drafter KV alive.
            #[allow(unsafe_code)]
            return unsafe {
                draft.write((layer - self.target_layers) as usize, BlockId(first), data)
            }
            .map_err(|e| TransferError::Region(e.to_string()));
        }
        if let Some(writer) = self.writer.as_ref().filter(|_| layer < self.target_layers) {
            // SAFETY: the transfer registry admitted every block of this run under its
            // transfer's fence before handing it here (`KvRegion::admit`), so the engine keeps
            // off those blocks until the transfer completes (or quarantines them if it gives
            // up: docs/transfer.md, Fences); `self.engine` keeps the device cache alive.
            #[allow(unsafe_code)]
            return unsafe { writer.write_run(layer as usize, BlockId(first), data) }
                .map_err(|e| TransferError::Region(e.to_string()));
        }
        self.engine
            .write_kv(layer as usize, BlockId(first), data.to_vec())
            .map_err(|e| TransferError::Region(e.to_string()))
    }
}
