//! The layer hook: engine thread → transfer stream.

use ferry_kvtransfer::descriptor::{BlockWrite, WriteBatch};
use ferry_kvtransfer::layerwise::LayerSink;
use ferry_model::engine::LayerSinkFn;

/// The closure the engine calls after each layer: `blocks` are this worker's blocks from the
/// destination's first missing block on; `dest` maps them, in order, to the destination's
/// block ids starting at `dest_first`.
pub fn layer_pusher(sink: LayerSink, dest: Vec<u32>, dest_first: usize) -> LayerSinkFn {
    offset_layer_pusher(sink, dest, dest_first, 0)
}

/// [`layer_pusher`] for a pool whose layer `l` is destination layer `offset + l`: the drafter's
/// context pool, shipped as the transfer layers after the target's.
pub fn offset_layer_pusher(
    sink: LayerSink,
    dest: Vec<u32>,
    dest_first: usize,
    offset: usize,
) -> LayerSinkFn {
    Box::new(move |pool_layer, blocks, pool| {
        let layer = offset + pool_layer;
        let mut writes = Vec::with_capacity(blocks.len());
        for (j, b) in blocks.iter().enumerate() {
            let block = *dest.get(dest_first + j).ok_or_else(|| {
                format!("no destination block for prompt block {}", dest_first + j)
            })?;
            let rows = pool.block(pool_layer, *b).map_err(|e| e.to_string())?;
            let mut data = Vec::with_capacity(rows.len() * 4);
            for v in rows {
                data.extend_from_slice(&v.to_le_bytes());
            }
            writes.push(BlockWrite { block, data });
        }
        let layer = u32::try_from(layer).map_err(|e| e.to_string())?;
        sink.send(WriteBatch { layer, writes })
            .map_err(|e| e.to_string())
    })
}
