//! A peer's drafter context, landed by the thread that receives it.
//!
//! A prefill worker with a drafter ships the drafter's context rows of a prompt as extra wire
//! layers after the target's ([`DraftKvLayout`]: drafter layer `l`'s rows split into `chunks`
//! pieces of the target's row width, piece `c` in wire layer `l · chunks + c`). A
//! [`DraftLanding`] turns them back into the drafter KV's natural rows, block by block:
//!
//! - each wire layer of a block is widened from the wire's dtype (the engine's cache dtype) and
//!   put into its piece of the block's natural rows (`[layer][page][kv_width]`);
//! - once a block has every wire layer, a GPU engine's rows are copied into the drafter KV
//!   right there ([`DeviceKvWriter`] over the drafter's device cache, a copy stream of its
//!   own, waited for), and the block is marked stored; a CPU engine's rows wait for the engine
//!   thread, which writes them into its host pool when the transfer completes
//!   ([`DraftLanding::take`]).
//!
//! The engine thread calls [`DraftLanding::write`] for a peer's writes it is handed (the
//! decode worker's transfer region's default route for these layers); with
//! `FERRY_DIRECT_KV_WRITES=all` the region calls it from its receiving thread instead, so none
//! of this stops the engine's steps. That was measured slower on one GPU shared by a prefill
//! and a decode worker (`ferry_decode::region`, BENCHMARKS.md session 42), so it is not the
//! default. Either way a block reaches the device as soon as it is whole, not at the transfer's
//! completion.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use super::DeviceKvWriter;
use crate::drafter::DraftKvLayout;
use crate::kv::{BlockId, KvDtype, KvLayout};
use crate::ModelError;

/// Assembles peers' drafter wire layers into the drafter KV (see the module doc). Owned by the
/// engine's [`super::spec::Speculator`], shared with whichever thread receives them
/// ([`super::EngineHandle::draft_landing`]).
pub struct DraftLanding {
    layout: DraftKvLayout,
    /// The wire layers' geometry: the target pool's, rows of `layout.row_width`.
    wire: KvLayout,
    /// Floats of one block of one drafter layer's natural rows (`page × kv_width`).
    per_block: usize,
    /// The wire's element type: the engine's cache dtype.
    dtype: KvDtype,
    /// Blocks some of whose wire layers arrived, until [`Self::take`] or [`Self::forget`].
    pending: Mutex<HashMap<BlockId, Landing>>,
    /// Copies whole blocks into a GPU drafter KV (`None` on the CPU: the engine thread writes
    /// them at completion).
    writer: Option<DeviceKvWriter>,
}

/// One block being landed.
struct Landing {
    /// Natural rows `[layer][page][kv_width]`; emptied once stored on the device.
    rows: Vec<f32>,
    /// Wire layers received.
    written: usize,
    /// The rows are in the drafter KV (a GPU engine's, copied by the writing thread).
    stored: bool,
}

/// A block whose every wire layer arrived ([`DraftLanding::take`]).
pub(crate) enum Landed {
    /// Already in the drafter KV.
    Stored,
    /// Its natural rows `[layer][page][kv_width]`, for the engine thread to write.
    Rows(Vec<f32>),
}

impl std::fmt::Debug for DraftLanding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftLanding")
            .field("layout", &self.layout)
            .field("dtype", &self.dtype)
            .field("on_device", &self.writer.is_some())
            .finish()
    }
}

impl DraftLanding {
    /// A landing for a drafter of `layout` next to a target pool of geometry `target`, whose
    /// wire carries `dtype`; `writer` copies whole blocks into the drafter's device KV (its
    /// layers are the drafter's, its blocks f32 natural rows).
    pub(crate) fn new(
        layout: DraftKvLayout,
        target: &KvLayout,
        dtype: KvDtype,
        writer: Option<DeviceKvWriter>,
    ) -> Self {
        Self {
            layout,
            wire: layout.pool_layout(target),
            per_block: layout.rows_layout(target).block_floats(),
            dtype,
            pending: Mutex::new(HashMap::new()),
            writer,
        }
    }

    /// Wire layers a block needs.
    fn want(&self) -> usize {
        self.layout.pool_layers()
    }

    /// Wire layer `layer` of the run of blocks `first..`, `data` whole blocks of little-endian
    /// elements of the wire's dtype. A block that has every wire layer after this write is
    /// stored in a GPU drafter KV before this returns. Errors name the layer, the size or the
    /// device copy; a block whose copy failed is dropped (it lands as missing: its sequence
    /// decodes without speculation).
    ///
    /// # Safety
    /// Every block of the run is reserved for the caller's transfer (admitted under its fence,
    /// [`crate::kv::RemoteFences`]), so the engine neither reads nor writes it until that
    /// transfer completes, and an [`super::EngineHandle`] of this engine is alive (the drafter
    /// KV lives while the engine thread runs).
    #[allow(unsafe_code)]
    pub unsafe fn write(
        &self,
        layer: usize,
        first: BlockId,
        data: &[u8],
    ) -> Result<(), ModelError> {
        let chunks = self.layout.chunks().max(1);
        if layer >= self.want() {
            return Err(ModelError::Kv(format!(
                "drafter wire layer {layer} is past the drafter's {} layers of {chunks} chunks",
                self.layout.layers
            )));
        }
        let block_bytes = self.dtype.block_bytes(&self.wire).max(1);
        if data.is_empty() || data.len() % block_bytes != 0 {
            return Err(ModelError::Kv(format!(
                "a drafter KV write must be whole blocks of {block_bytes} bytes of {}, got {}",
                self.dtype,
                data.len()
            )));
        }
        let (l, c) = (layer / chunks, layer % chunks);
        let piece = l * self.per_block..(l + 1) * self.per_block;
        let mut wire = vec![0.0f32; self.wire.block_floats()];
        let mut complete: Vec<(BlockId, Vec<f32>)> = Vec::new();
        // Blocks completed before a bad block are still stored (they are marked so).
        let assembled = data
            .chunks_exact(block_bytes)
            .enumerate()
            .try_for_each(|(i, bytes)| {
                let block = BlockId(first.0 + i as u32);
                self.dtype
                    .widen_into(bytes, self.wire.width, &mut wire)
                    .map_err(|e| ModelError::Kv(e.to_string()))?;
                let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
                let landing = pending.entry(block).or_insert_with(|| Landing {
                    rows: vec![0.0; self.layout.layers * self.per_block],
                    written: 0,
                    stored: false,
                });
                if landing.stored || landing.written >= self.want() {
                    return Err(ModelError::Kv(format!(
                        "drafter wire layer {layer} of block {block} arrived after all {} of them",
                        self.want()
                    )));
                }
                self.layout
                    .from_wire(&wire, c, &mut landing.rows[piece.clone()])?;
                landing.written += 1;
                if landing.written == self.want() && self.writer.is_some() {
                    landing.stored = true;
                    complete.push((block, std::mem::take(&mut landing.rows)));
                }
                Ok(())
            });
        if !complete.is_empty() {
            // SAFETY: the caller's contract (the blocks are its transfer's, the engine is
            // alive).
            if let Err(e) = unsafe { self.store(&complete) } {
                let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
                for (b, _) in &complete {
                    pending.remove(b);
                }
                return Err(e);
            }
        }
        assembled
    }

    /// Copies complete blocks (in id order, as a run's are) into the drafter's device KV: per
    /// drafter layer, one copy per run of consecutive ids.
    ///
    /// # Safety
    /// As [`Self::write`].
    #[allow(unsafe_code)]
    unsafe fn store(&self, complete: &[(BlockId, Vec<f32>)]) -> Result<(), ModelError> {
        let Some(writer) = &self.writer else {
            return Ok(());
        };
        let mut runs: Vec<&[(BlockId, Vec<f32>)]> = Vec::new();
        let mut start = 0;
        for i in 1..=complete.len() {
            if i == complete.len() || complete[i].0 .0 != complete[i - 1].0 .0 + 1 {
                runs.push(&complete[start..i]);
                start = i;
            }
        }
        let mut staged: Vec<f32> = Vec::new();
        for l in 0..self.layout.layers {
            let piece = l * self.per_block..(l + 1) * self.per_block;
            for run in &runs {
                staged.clear();
                for (_, rows) in run.iter() {
                    staged.extend_from_slice(&rows[piece.clone()]);
                }
                // SAFETY: the blocks are the caller's transfer's and the drafter KV is alive
                // (this function's contract).
                unsafe { writer.write_run(l, run[0].0, bytemuck::cast_slice(&staged)) }?;
            }
        }
        Ok(())
    }

    /// The peer finished `blocks`: `None` unless every one received every wire layer (and, on a
    /// GPU, was stored); otherwise each block's state, in order. Their entries are gone either
    /// way.
    pub(crate) fn take(&self, blocks: &[BlockId]) -> Option<Vec<Landed>> {
        let want = self.want();
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let taken: Vec<Option<Landing>> = blocks.iter().map(|b| pending.remove(b)).collect();
        drop(pending);
        if want == 0 {
            return None;
        }
        taken
            .into_iter()
            .map(|l| match l {
                Some(l) if l.stored => Some(Landed::Stored),
                Some(l) if l.written == want && self.writer.is_none() => Some(Landed::Rows(l.rows)),
                _ => None,
            })
            .collect()
    }

    /// Forgets whatever arrived for `blocks` (a failed peer; blocks allocated afresh).
    pub(crate) fn forget(&self, blocks: &[BlockId]) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        for b in blocks {
            pending.remove(b);
        }
    }

    /// Floats of one block of one drafter layer's natural rows.
    pub(crate) fn per_block(&self) -> usize {
        self.per_block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two drafter layers of 5 floats per row, wire rows of 3 (two chunks each), pages of 2.
    fn landing() -> (DraftLanding, DraftKvLayout, KvLayout) {
        let layout = DraftKvLayout {
            layers: 2,
            kv_width: 5,
            row_width: 3,
        };
        let target = KvLayout {
            num_layers: 4,
            num_blocks: 8,
            page_size: 2,
            width: 3,
        };
        (
            DraftLanding::new(layout, &target, KvDtype::F32, None),
            layout,
            target,
        )
    }

    /// Block `b`'s natural rows `[layer][page][kv_width]`, distinct per block.
    fn natural(b: u32, layout: &DraftKvLayout, target: &KvLayout) -> Vec<f32> {
        let n = layout.layers * target.page_size * layout.kv_width;
        (0..n).map(|i| (b * 1000) as f32 + i as f32).collect()
    }

    /// Wire layer `w` of a run of blocks, as a peer sends it (f32 little-endian).
    fn wire(w: usize, blocks: &[u32], layout: &DraftKvLayout, target: &KvLayout) -> Vec<u8> {
        let (l, c) = (w / layout.chunks(), w % layout.chunks());
        let per_block = target.page_size * layout.kv_width;
        let mut out = Vec::new();
        for &b in blocks {
            let rows = natural(b, layout, target);
            let mut piece = vec![0.0f32; target.page_size * layout.row_width];
            layout
                .to_wire(&rows[l * per_block..(l + 1) * per_block], c, &mut piece)
                .unwrap();
            out.extend(piece.iter().flat_map(|x| x.to_le_bytes()));
        }
        out
    }

    #[allow(unsafe_code)]
    #[test]
    fn wire_layers_in_any_order_land_as_the_natural_rows_and_only_once_complete() {
        let (landing, layout, target) = landing();
        let ids = [BlockId(3), BlockId(4)];
        // Wire layers 3, 0, 2 arrive; the blocks are not complete yet.
        for w in [3, 0, 2] {
            // SAFETY: no device writer: nothing but host memory is written.
            unsafe { landing.write(w, BlockId(3), &wire(w, &[3, 4], &layout, &target)) }.unwrap();
        }
        assert!(landing.take(&ids).is_none(), "three of four wire layers");
        // `take` forgot them: the last layer alone is not a whole block either.
        // SAFETY: as above.
        unsafe { landing.write(1, BlockId(3), &wire(1, &[3, 4], &layout, &target)) }.unwrap();
        assert!(landing.take(&ids).is_none(), "one of four after a take");
        for w in [1, 3, 2, 0] {
            // SAFETY: as above.
            unsafe { landing.write(w, BlockId(3), &wire(w, &[3, 4], &layout, &target)) }.unwrap();
        }
        let landed = landing.take(&ids).expect("every wire layer arrived");
        for (b, l) in [3, 4].into_iter().zip(landed) {
            match l {
                Landed::Rows(rows) => assert_eq!(rows, natural(b, &layout, &target), "block {b}"),
                Landed::Stored => panic!("no device to store on"),
            }
        }
        assert!(landing.take(&ids).is_none(), "taken once");
    }

    #[allow(unsafe_code)]
    #[test]
    fn bad_writes_say_why_and_forget_drops_partial_blocks() {
        let (landing, layout, target) = landing();
        let data = wire(0, &[1], &layout, &target);
        // SAFETY: no device writer: nothing but host memory is written.
        let past = unsafe { landing.write(4, BlockId(1), &data) };
        assert!(past.is_err_and(|e| e.to_string().contains("past the drafter")));
        // SAFETY: as above.
        let ragged = unsafe { landing.write(0, BlockId(1), &data[1..]) };
        assert!(ragged.is_err_and(|e| e.to_string().contains("whole blocks")));
        for w in 0..4 {
            // SAFETY: as above.
            unsafe { landing.write(w, BlockId(1), &wire(w, &[1], &layout, &target)) }.unwrap();
        }
        // SAFETY: as above.
        let again = unsafe { landing.write(0, BlockId(1), &data) };
        assert!(again.is_err_and(|e| e.to_string().contains("after all 4")));
        landing.forget(&[BlockId(1)]);
        assert!(landing.take(&[BlockId(1)]).is_none(), "forgotten");
    }
}
