//! The paged latent cache in device memory: one region per layer, `[block][page][width]`,
//! f32 or bf16. Block ids are the caller's (the same [`BlockId`]s a `KvPool` hands out), so
//! the CPU-side allocator, prefix cache and events keep working unchanged.
//!
//! Rows cross to and from the host either in the cache's own dtype — a peer's block written
//! as it arrived ([`GpuKvCache::write_block_bytes`]), shipped blocks copied out by address
//! ([`GpuKvCache::block_bytes`], the engine's staging ring) — or as f32 (a drafter's context,
//! tests): [`GpuKvCache::write_blocks`] rounds them to bf16 (nearest even) in a bf16 cache and
//! [`GpuKvCache::read_blocks`] widens them back, so a bf16 row survives the round trip exactly.

use ferry_kernels::cuda::ops::PagesView;
use ferry_kernels::cuda::{CudaDevice, DeviceBuffer};

use crate::kv::{BlockId, KvDtype, KvLayout};
use crate::ModelError;

/// Storage of one layer.
#[derive(Debug)]
enum Region {
    F32(DeviceBuffer<f32>),
    Bf16(DeviceBuffer<u16>),
}

/// Every layer's latent pages on one device.
#[derive(Debug)]
pub struct GpuKvCache {
    dev: CudaDevice,
    layout: KvLayout,
    layers: Vec<Region>,
}

impl GpuKvCache {
    /// Zeroed storage for `layout`, bf16 or f32.
    pub fn new(dev: &CudaDevice, layout: KvLayout, bf16: bool) -> Result<Self, ModelError> {
        layout.validate()?;
        let n = layout.layer_floats();
        let layers = (0..layout.num_layers)
            .map(|_| {
                Ok(if bf16 {
                    Region::Bf16(dev.zeros::<u16>(n)?)
                } else {
                    Region::F32(dev.zeros::<f32>(n)?)
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Self {
            dev: dev.clone(),
            layout,
            layers,
        })
    }

    /// The device the rows live on.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// The geometry.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Whether rows are bf16.
    pub fn is_bf16(&self) -> bool {
        matches!(self.layers.first(), Some(Region::Bf16(_)))
    }

    /// The rows' element type.
    pub fn dtype(&self) -> KvDtype {
        if self.is_bf16() {
            KvDtype::Bf16
        } else {
            KvDtype::F32
        }
    }

    /// Layer `l`'s pages as the kernels take them.
    pub fn pages(&self, l: usize) -> Result<PagesView, ModelError> {
        let region = self
            .layers
            .get(l)
            .ok_or_else(|| ModelError::Kv(format!("layer {l} is outside the cache")))?;
        let (ptr, bf16) = match region {
            Region::F32(b) => (b.ptr(), false),
            Region::Bf16(b) => (b.ptr(), true),
        };
        Ok(PagesView {
            ptr,
            bf16,
            num_blocks: self.layout.num_blocks,
            page_size: self.layout.page_size,
            width: self.layout.width,
        })
    }

    /// Device address and length in bytes of blocks `first..first + count` of layer `l` (for
    /// asynchronous copies out; see `ferry_kernels::cuda::staging`).
    pub fn block_bytes(
        &self,
        l: usize,
        first: BlockId,
        count: usize,
    ) -> Result<(u64, usize), ModelError> {
        let offset = self.block_range(l, first, count)?;
        let elem = if self.is_bf16() { 2 } else { 4 };
        let base = self.pages(l)?.ptr;
        Ok((
            base + (offset * elem) as u64,
            count * self.layout.block_floats() * elem,
        ))
    }

    /// Checks that `count` blocks from `first` lie inside layer `l`; the first element's index.
    fn block_range(&self, l: usize, first: BlockId, count: usize) -> Result<usize, ModelError> {
        let start = first.0 as usize;
        if l >= self.layers.len() || start + count > self.layout.num_blocks {
            return Err(ModelError::Kv(format!(
                "blocks {start}..{} of layer {l} are outside the device cache ({} layers × {} blocks)",
                start + count,
                self.layers.len(),
                self.layout.num_blocks
            )));
        }
        Ok(start * self.layout.block_floats())
    }

    /// Writes whole blocks of layer `l` from f32 `rows` (`[block][page][width]`, a multiple of
    /// one block), starting at block `first`: one host-to-device copy, rounded to bf16 in a
    /// bf16 cache. Returns once the copy is done.
    pub fn write_blocks(
        &mut self,
        dev: &CudaDevice,
        l: usize,
        first: BlockId,
        rows: &[f32],
    ) -> Result<(), ModelError> {
        let per_block = self.layout.block_floats();
        if rows.len() % per_block != 0 {
            return Err(ModelError::Kv(format!(
                "a block write must hold whole blocks of {per_block} floats, got {}",
                rows.len()
            )));
        }
        let offset = self.block_range(l, first, rows.len() / per_block)?;
        match self.layers.get_mut(l) {
            Some(Region::F32(b)) => dev.write(b, offset, rows)?,
            Some(Region::Bf16(b)) => {
                let bits: Vec<u16> = rows
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                dev.write(b, offset, &bits)?;
            }
            None => return Err(ModelError::Kv(format!("layer {l} is outside the cache"))),
        }
        Ok(())
    }

    /// Writes one whole block of layer `l` from `bytes`: its `[page][width]` rows as
    /// little-endian elements of the cache's own dtype ([`Self::dtype`]), copied as they are
    /// (no rounding). One host-to-device copy; returns once it is done.
    pub fn write_block_bytes(
        &mut self,
        dev: &CudaDevice,
        l: usize,
        block: BlockId,
        bytes: &[u8],
    ) -> Result<(), ModelError> {
        let per_block = self.layout.block_floats();
        let dtype = self.dtype();
        if bytes.len() != per_block * dtype.elem_size() {
            return Err(ModelError::Kv(format!(
                "a block write into a {dtype} cache must be {} bytes, got {}",
                per_block * dtype.elem_size(),
                bytes.len()
            )));
        }
        let offset = self.block_range(l, block, 1)?;
        match self.layers.get_mut(l) {
            Some(Region::F32(b)) => match bytemuck::try_cast_slice::<u8, f32>(bytes) {
                Ok(rows) => dev.write(b, offset, rows)?,
                Err(_) => {
                    let rows: Vec<f32> = bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    dev.write(b, offset, &rows)?
                }
            },
            Some(Region::Bf16(b)) => match bytemuck::try_cast_slice::<u8, u16>(bytes) {
                Ok(bits) => dev.write(b, offset, bits)?,
                Err(_) => {
                    let bits: Vec<u16> = bytes
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .collect();
                    dev.write(b, offset, &bits)?
                }
            },
            None => return Err(ModelError::Kv(format!("layer {l} is outside the cache"))),
        }
        Ok(())
    }

    /// `count` whole blocks of layer `l` from block `first`, as f32 rows `[block][page][width]`
    /// (one device-to-host copy; waits for queued work).
    pub fn read_blocks(
        &self,
        dev: &CudaDevice,
        l: usize,
        first: BlockId,
        count: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let offset = self.block_range(l, first, count)?;
        let len = count * self.layout.block_floats();
        match self.layers.get(l) {
            Some(Region::F32(b)) => Ok(dev.download_range(b, offset, len)?),
            Some(Region::Bf16(b)) => Ok(dev
                .download_range(b, offset, len)?
                .into_iter()
                .map(|v| half::bf16::from_bits(v).to_f32())
                .collect()),
            None => Err(ModelError::Kv(format!("layer {l} is outside the cache"))),
        }
    }

    /// Layer `l` copied back as f32 rows `[block][page][width]` (tests).
    pub fn download_layer(&self, dev: &CudaDevice, l: usize) -> Result<Vec<f32>, ModelError> {
        match self.layers.get(l) {
            Some(Region::F32(b)) => Ok(dev.download(b)?),
            Some(Region::Bf16(b)) => Ok(dev
                .download(b)?
                .into_iter()
                .map(|v| half::bf16::from_bits(v).to_f32())
                .collect()),
            None => Err(ModelError::Kv(format!("layer {l} is outside the cache"))),
        }
    }
}
