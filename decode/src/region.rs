//! The KV region peers write into.

use ferry_kvtransfer::error::TransferError;
use ferry_kvtransfer::{Dtype, KvLayoutDesc, KvRegion};
use ferry_model::engine::EngineHandle;
use ferry_model::kv::BlockId;

/// This worker's KV pool as a transfer target. Writes are forwarded to the engine thread (the
/// pool's one owner), which applies them in order before it processes the peer's completion,
/// and only into blocks reserved for a remote prefill.
///
/// With a drafter, the advertised layout has the drafter's context pool layers after the
/// target's: `num_layers = target layers + drafter pool layers`, same page size, width and
/// dtype (the drafter pool is shaped like the target's; see `ferry_model::drafter::DraftKvLayout`).
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
            dtype: Dtype::F32,
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
