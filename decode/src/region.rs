//! The KV region peers write into.

use ferry_kvtransfer::error::TransferError;
use ferry_kvtransfer::{Dtype, KvLayoutDesc, KvRegion};
use ferry_model::engine::EngineHandle;
use ferry_model::kv::{BlockId, KvDtype};

/// This worker's KV pool as a transfer target. Writes are forwarded to the engine thread (the
/// pool's one owner), which applies them in order before it processes the peer's completion,
/// and only into blocks reserved for a remote prefill.
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
        Self { engine, layout }
    }
}

impl KvRegion for EngineRegion {
    fn layout(&self) -> KvLayoutDesc {
        self.layout
    }

    fn write(&self, layer: u32, block: u32, data: &[u8]) -> Result<(), TransferError> {
        self.engine
            .write_kv(layer as usize, BlockId(block), data.to_vec())
            .map_err(|e| TransferError::Region(e.to_string()))
    }
}
