//! Latent storage and the ref-counted block allocator.
//!
//! Invariants: a block is either on the free list with refcount 0, or off it with refcount ≥ 1;
//! `release` of the last reference puts it back. Double frees and foreign ids are errors, never
//! silent corruption.
//!
//! A pool either owns its rows ([`KvPool::new`]: the CPU engine's KV) or only the block ids
//! ([`KvPool::without_rows`]: a GPU engine, whose rows live in the device cache under the same
//! ids). Both allocate, count references and back the prefix cache alike; row access on an
//! ids-only pool is an error saying where the rows are.
//!
//! A host pool's rows are a [`HostRows`] shared by `Arc`: a decode worker's transfer region
//! holds a clone and exposes each layer as registered memory, so peers' KV lands in the rows
//! directly (a one-sided put, or the TCP receiver's copy) while the engine works on other
//! blocks. Only blocks reserved for a remote prefill are written that way, and the engine
//! neither reads nor writes them until the transfer has completed. The other way, a prefill
//! job's transport may read a shipped layer's rows in place while the forward goes on with
//! later layers (each layer is its own region, and the pool makes references one layer at a
//! time), under a lease the forward waits for before it returns (`LayerRows::pool_leased`).
//! Nothing else touches the rows outside the pool.
//!
//! The rows come from the heap, or from a [`RowMemory`] the pool's owner passes in
//! ([`KvPool::new_in`]): a decode worker takes them from its KV transport
//! (`Transport::alloc_host`), so that a UCX pool lives in shared memory a prefill worker on
//! the same machine copies into directly.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use super::KvLayout;
use crate::ModelError;

/// Index of a block in the pool (the same index in every layer).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "block#{}", self.0)
    }
}

/// `blocks` as runs of consecutive ids, in their order: `(first, count)` each. Memory copies
/// of a run are one copy (a device read or write, a shipped span).
pub fn block_runs(blocks: &[BlockId]) -> Vec<(BlockId, usize)> {
    let mut runs: Vec<(BlockId, usize)> = Vec::new();
    for &b in blocks {
        match runs.last_mut() {
            Some((first, n)) if b.0 as usize == first.0 as usize + *n => *n += 1,
            _ => runs.push((b, 1)),
        }
    }
    runs
}

/// Where a host pool's rows are allocated instead of the heap (see the module docs).
pub trait RowMemory: Send + Sync {
    /// `bytes` zeroed bytes, aligned to at least 4 bytes, alive as long as the buffer.
    fn alloc(&self, bytes: usize) -> Result<RowBuffer, String>;
}

/// Memory from a [`RowMemory`]: a start, a length, and what keeps them alive.
pub struct RowBuffer {
    ptr: NonNull<u8>,
    len: usize,
    _owner: Box<dyn Send + Sync>,
}

impl RowBuffer {
    /// `len` bytes at `ptr`, kept alive by `owner`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be zeroed, writable host memory aligned to 4 bytes, valid until
    /// `owner` drops, and written by nothing but the pool that takes it and the transfer
    /// regions it exposes its rows to.
    pub unsafe fn new(ptr: NonNull<u8>, len: usize, owner: Box<dyn Send + Sync>) -> Self {
        RowBuffer {
            ptr,
            len,
            _owner: owner,
        }
    }
}

/// A host pool's row storage: one zeroed f32 region per layer, `[block][page][width]`,
/// freed when the pool and every transfer region exposing it are gone (see the module docs).
pub struct HostRows {
    layers: Vec<(NonNull<f32>, usize)>,
    /// Every layer, back to back, when the rows came from a [`RowMemory`]; `None`: each
    /// layer is its own heap allocation.
    buffer: Option<RowBuffer>,
}

// SAFETY: plain f32 storage; the pool is its one reader/writer of references, and transfer
// regions write only raw bytes into blocks reserved for them (module docs).
unsafe impl Send for HostRows {}
// SAFETY: as above.
unsafe impl Sync for HostRows {}

impl HostRows {
    fn zeroed(layers: usize, floats: usize) -> Self {
        let layers = (0..layers)
            .map(|_| {
                let b: Box<[f32]> = vec![0.0f32; floats].into_boxed_slice();
                let len = b.len();
                // SAFETY: `Box::into_raw` never returns null.
                let ptr = unsafe { NonNull::new_unchecked(Box::into_raw(b) as *mut f32) };
                (ptr, len)
            })
            .collect();
        HostRows {
            layers,
            buffer: None,
        }
    }

    /// `layers` regions of `floats` zeroed f32 each, back to back in one buffer of `memory`.
    fn in_memory(memory: &dyn RowMemory, layers: usize, floats: usize) -> Result<Self, ModelError> {
        let bytes = layers
            .checked_mul(floats)
            .and_then(|n| n.checked_mul(std::mem::size_of::<f32>()))
            .ok_or_else(|| ModelError::Kv("the KV pool's size overflows".into()))?;
        let buffer = memory
            .alloc(bytes)
            .map_err(|e| ModelError::Kv(format!("allocating the KV pool's rows: {e}")))?;
        if buffer.len < bytes || buffer.ptr.as_ptr() as usize % std::mem::align_of::<f32>() != 0 {
            return Err(ModelError::Kv(format!(
                "the KV pool's row memory has {} bytes at {:p}; {bytes} aligned bytes needed",
                buffer.len,
                buffer.ptr.as_ptr()
            )));
        }
        let base = buffer.ptr.as_ptr() as *mut f32;
        let layers = (0..layers)
            .map(|l| {
                // SAFETY: inside the buffer (checked above), aligned for f32.
                let ptr = unsafe { NonNull::new_unchecked(base.add(l * floats)) };
                (ptr, floats)
            })
            .collect();
        Ok(HostRows {
            layers,
            buffer: Some(buffer),
        })
    }

    /// Layers held.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Layer `layer`'s storage as an address and a length in bytes, for registering it with a
    /// transport (`None` past the last layer).
    pub fn layer_span(&self, layer: usize) -> Option<(*mut u8, usize)> {
        self.layers
            .get(layer)
            .map(|&(p, n)| (p.as_ptr() as *mut u8, n * std::mem::size_of::<f32>()))
    }

    fn slice(&self, layer: usize) -> Option<&[f32]> {
        let &(p, n) = self.layers.get(layer)?;
        // SAFETY: a live allocation of `n` floats; see the module docs for who writes it.
        Some(unsafe { std::slice::from_raw_parts(p.as_ptr(), n) })
    }

    /// # Safety
    /// The caller is the pool, holding `&mut` on itself: no other reference into the rows
    /// exists (transfer regions write raw bytes into reserved blocks only).
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, layer: usize) -> Option<&mut [f32]> {
        let &(p, n) = self.layers.get(layer)?;
        // SAFETY: per the function's contract.
        Some(unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), n) })
    }
}

impl Drop for HostRows {
    fn drop(&mut self) {
        if self.buffer.is_some() {
            // The buffer's owner frees it (after this).
            return;
        }
        for &(p, n) in &self.layers {
            // SAFETY: made by `Box::into_raw` of a boxed slice of `n` floats, freed once.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p.as_ptr(), n)) });
        }
    }
}

impl fmt::Debug for HostRows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRows")
            .field("layers", &self.layers.len())
            .finish()
    }
}

/// The latent KV pool of one engine: storage for every layer (unless ids-only) plus the block
/// allocator.
#[derive(Debug)]
pub struct KvPool {
    layout: KvLayout,
    /// The rows, shared with a transfer region (module docs); `None` in an ids-only pool.
    rows: Option<Arc<HostRows>>,
    refcounts: Vec<u32>,
    /// Free blocks; allocation pops from the end, so low ids are handed out first.
    free: Vec<u32>,
}

impl KvPool {
    /// Allocates zeroed storage for `layout`.
    pub fn new(layout: KvLayout) -> Result<Self, ModelError> {
        layout.validate()?;
        let rows = HostRows::zeroed(layout.num_layers, layout.layer_floats());
        Self::build(layout, Some(Arc::new(rows)))
    }

    /// [`KvPool::new`] with its rows in `memory` (one buffer for every layer).
    pub fn new_in(layout: KvLayout, memory: &dyn RowMemory) -> Result<Self, ModelError> {
        layout.validate()?;
        let rows = HostRows::in_memory(memory, layout.num_layers, layout.layer_floats())?;
        Self::build(layout, Some(Arc::new(rows)))
    }

    /// A pool of `layout`'s block ids with no row storage: allocation, refcounts and the prefix
    /// cache work as in [`KvPool::new`], while [`KvPool::layer`], [`KvPool::block`] and the
    /// other row accessors fail with [`ModelError::Kv`] saying the rows live on the device (a
    /// GPU engine's pool: its rows are the device cache's, under the same ids).
    pub fn without_rows(layout: KvLayout) -> Result<Self, ModelError> {
        layout.validate()?;
        Self::build(layout, None)
    }

    fn build(layout: KvLayout, rows: Option<Arc<HostRows>>) -> Result<Self, ModelError> {
        let n = u32::try_from(layout.num_blocks)
            .map_err(|_| ModelError::Kv("`num_blocks` must fit in u32".into()))?;
        Ok(Self {
            layout,
            rows,
            refcounts: vec![0; layout.num_blocks],
            free: (0..n).rev().collect(),
        })
    }

    /// The pool's geometry.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Whether the pool holds rows (false for [`KvPool::without_rows`]).
    pub fn has_rows(&self) -> bool {
        self.rows.is_some()
    }

    /// The row storage, to expose to a transfer region (`None` for an ids-only pool).
    pub fn host_rows(&self) -> Option<Arc<HostRows>> {
        self.rows.clone()
    }

    /// Host bytes of row storage: every layer's region in f32, or 0 for an ids-only pool.
    pub fn row_bytes(&self) -> usize {
        self.rows.as_ref().map_or(0, |r| {
            (0..r.num_layers())
                .filter_map(|l| r.layer_span(l))
                .map(|(_, n)| n)
                .sum()
        })
    }

    fn rows_mut(&mut self, layer: usize) -> Result<&mut [f32], ModelError> {
        let rows = self.rows.as_ref().ok_or_else(no_rows)?;
        // SAFETY: `&mut self`: the pool hands out no other reference into its rows now.
        unsafe { rows.slice_mut(layer) }
            .ok_or_else(|| ModelError::Kv(format!("layer {layer} out of range")))
    }

    /// Blocks not referenced by any sequence.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// References held on `block` (0 when free).
    pub fn refcount(&self, block: BlockId) -> Option<u32> {
        self.refcounts.get(block.0 as usize).copied()
    }

    /// Takes `n` free blocks (refcount 1 each), all or nothing.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, ModelError> {
        if n > self.free.len() {
            return Err(ModelError::Kv(format!(
                "out of KV blocks: need {n}, {} free of {}",
                self.free.len(),
                self.layout.num_blocks
            )));
        }
        let split = self.free.len() - n;
        let taken: Vec<BlockId> = self.free.drain(split..).rev().map(BlockId).collect();
        for b in &taken {
            self.refcounts[b.0 as usize] = 1;
        }
        Ok(taken)
    }

    /// Adds a reference to an allocated block (prefix sharing).
    pub fn retain(&mut self, block: BlockId) -> Result<(), ModelError> {
        match self.refcounts.get_mut(block.0 as usize) {
            Some(rc) if *rc > 0 => {
                *rc += 1;
                Ok(())
            }
            Some(_) => Err(ModelError::Kv(format!("retain of free {block}"))),
            None => Err(ModelError::Kv(format!("retain of unknown {block}"))),
        }
    }

    /// Drops one reference; the block returns to the free list when none are left.
    pub fn release(&mut self, block: BlockId) -> Result<(), ModelError> {
        match self.refcounts.get_mut(block.0 as usize) {
            Some(rc) if *rc > 0 => {
                *rc -= 1;
                if *rc == 0 {
                    self.free.push(block.0);
                }
                Ok(())
            }
            Some(_) => Err(ModelError::Kv(format!("double free of {block}"))),
            None => Err(ModelError::Kv(format!("release of unknown {block}"))),
        }
    }

    /// Releases every block in `blocks`, reporting the first failure after trying them all.
    pub fn release_all(&mut self, blocks: &[BlockId]) -> Result<(), ModelError> {
        let mut first_err = None;
        for &b in blocks {
            if let Err(e) = self.release(b) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// One layer's whole region, `[block][page][width]`.
    pub fn layer(&self, layer: usize) -> Result<&[f32], ModelError> {
        self.rows
            .as_ref()
            .ok_or_else(no_rows)?
            .slice(layer)
            .ok_or_else(|| ModelError::Kv(format!("layer {layer} out of range")))
    }

    /// One layer's whole region, for writing (the forward's new latent rows).
    pub fn layer_mut(&mut self, layer: usize) -> Result<&mut [f32], ModelError> {
        self.rows_mut(layer)
    }

    /// One block of one layer, `[page][width]`, for reading (shipping KV to a peer).
    pub fn block(&self, layer: usize, block: BlockId) -> Result<&[f32], ModelError> {
        let n = self.layout.block_floats();
        let start = block.0 as usize * n;
        self.rows
            .as_ref()
            .ok_or_else(no_rows)?
            .slice(layer)
            .and_then(|l| l.get(start..start + n))
            .ok_or_else(|| ModelError::Kv(format!("{block} or layer {layer} out of range")))
    }

    /// One block of one layer, for writing (KV received from a peer).
    pub fn block_mut(&mut self, layer: usize, block: BlockId) -> Result<&mut [f32], ModelError> {
        let n = self.layout.block_floats();
        let start = block.0 as usize * n;
        self.rows_mut(layer)?
            .get_mut(start..start + n)
            .ok_or_else(|| ModelError::Kv(format!("{block} or layer {layer} out of range")))
    }

    /// The row of `layer` that holds position `pos` of a sequence with `table`, for writing.
    pub fn row_mut(
        &mut self,
        layer: usize,
        table: &[BlockId],
        pos: usize,
    ) -> Result<&mut [f32], ModelError> {
        let KvLayout {
            page_size, width, ..
        } = self.layout;
        let block = table.get(pos / page_size).ok_or_else(|| {
            ModelError::Kv(format!(
                "position {pos} is beyond the block table ({} blocks)",
                table.len()
            ))
        })?;
        let start = (block.0 as usize * page_size + pos % page_size) * width;
        self.rows_mut(layer)?
            .get_mut(start..start + width)
            .ok_or_else(|| ModelError::Kv(format!("{block} or layer {layer} out of range")))
    }
}

/// Row access on an ids-only pool.
fn no_rows() -> ModelError {
    ModelError::Kv(
        "this KV pool keeps block ids only: its rows live in the device cache, not on the host"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_runs_group_consecutive_ids_in_their_order() {
        let ids = |v: &[u32]| v.iter().map(|&b| BlockId(b)).collect::<Vec<_>>();
        assert_eq!(block_runs(&[]), vec![]);
        assert_eq!(
            block_runs(&ids(&[3, 4, 5, 9, 11, 12])),
            vec![(BlockId(3), 3), (BlockId(9), 1), (BlockId(11), 2)]
        );
        assert_eq!(block_runs(&ids(&[7])), vec![(BlockId(7), 1)]);
        assert_eq!(
            block_runs(&ids(&[5, 6, 2, 3, 4])),
            vec![(BlockId(5), 2), (BlockId(2), 3)],
            "runs follow the given order, unsorted"
        );
    }

    fn pool(blocks: usize) -> KvPool {
        KvPool::new(KvLayout {
            num_layers: 2,
            num_blocks: blocks,
            page_size: 4,
            width: 3,
        })
        .expect("valid layout")
    }

    #[test]
    fn allocate_release_roundtrip() {
        let mut p = pool(4);
        let a = p.allocate(3).unwrap();
        assert_eq!(p.free_blocks(), 1);
        assert!(p.allocate(2).is_err(), "all-or-nothing allocation");
        assert_eq!(p.free_blocks(), 1);
        p.retain(a[0]).unwrap();
        p.release_all(&a).unwrap();
        assert_eq!(p.free_blocks(), 3, "the shared block is still held");
        p.release(a[0]).unwrap();
        assert_eq!(p.free_blocks(), 4);
        assert!(p.release(a[0]).is_err(), "double free is an error");
        assert!(p.retain(BlockId(99)).is_err());
    }

    #[test]
    fn rows_follow_the_block_table() {
        let mut p = pool(4);
        let table = [BlockId(2), BlockId(0)];
        p.row_mut(1, &table, 5)
            .unwrap()
            .copy_from_slice(&[1.0, 2.0, 3.0]);
        let layer = p.layer(1).unwrap();
        // position 5 = block table[1] = block 0, row 1.
        assert_eq!(&layer[3..6], &[1.0, 2.0, 3.0]);
        assert!(p.row_mut(0, &table, 8).is_err());
    }

    #[test]
    fn an_ids_only_pool_allocates_but_refuses_rows() {
        let layout = KvLayout {
            num_layers: 2,
            num_blocks: 4,
            page_size: 4,
            width: 3,
        };
        let mut p = KvPool::without_rows(layout).unwrap();
        assert!(!p.has_rows());
        assert_eq!(p.row_bytes(), 0);
        assert_eq!(pool(4).row_bytes(), 2 * 4 * 4 * 3 * 4);
        let a = p.allocate(3).unwrap();
        p.retain(a[1]).unwrap();
        assert_eq!(p.refcount(a[1]), Some(2));
        p.release_all(&a).unwrap();
        assert_eq!(p.free_blocks(), 3);
        let errors = [
            p.layer(0).unwrap_err(),
            p.block(0, a[0]).unwrap_err(),
            p.block_mut(1, a[0]).unwrap_err(),
            p.layer_mut(1).unwrap_err(),
            p.row_mut(0, &a, 1).unwrap_err(),
        ];
        for e in errors {
            assert!(
                matches!(&e, ModelError::Kv(m) if m.contains("rows live in the device cache")),
                "{e}"
            );
        }
    }
}
