//! The paged latent cache in GPU memory, written once for every runtime
//! ([`ferry_kernels::gpu::launch::Gpu`]): `crate::gpu::GpuKvCache` on CUDA and
//! `crate::rocm::RocmKvCache` on ROCm are this type.
//!
//! One region per layer, `[block][page][row]`: f32 rows (exact mode) or split bf16 rows (fast
//! mode: [`KvDtype::Bf16Split`], the RoPE key as a bf16 pair after each row). Block ids are the
//! caller's (the same [`BlockId`]s a `KvPool` hands out), so the host-side allocator, prefix
//! cache and events keep working unchanged.
//!
//! Rows cross to and from the host either in the cache's own dtype — a peer's block written as
//! it arrived ([`DeviceKvCache::write_run_bytes`]), shipped blocks copied out by address
//! ([`DeviceKvCache::block_bytes`], the CUDA engine's staging ring) — or as f32 (a drafter's
//! context, tests): [`DeviceKvCache::write_blocks`] encodes them as the cache stores them and
//! [`DeviceKvCache::read_blocks`] widens them back (`hi + lo`), so a stored row survives the
//! round trip exactly.

use ferry_kernels::gpu::launch::{DeviceMem, DevicePod, Gpu};
use ferry_kernels::gpu::ops::PagesView;

use super::{BlockId, KvDtype, KvLayout};
use crate::ModelError;

/// Storage of one layer.
#[derive(Debug)]
enum Region<D: Gpu> {
    F32(D::Buffer<f32>),
    Bf16(D::Buffer<u16>),
}

/// Every layer's latent pages on one device of runtime `D`.
#[derive(Debug)]
pub struct DeviceKvCache<D: Gpu> {
    dev: D,
    layout: KvLayout,
    dtype: KvDtype,
    layers: Vec<Region<D>>,
}

impl<D: Gpu> DeviceKvCache<D> {
    /// Zeroed storage for `layout`, rows stored as `dtype`.
    pub fn new(dev: &D, layout: KvLayout, dtype: KvDtype) -> Result<Self, ModelError> {
        layout.validate()?;
        if let KvDtype::Bf16Split { rope } = dtype {
            if rope == 0 || rope > layout.width {
                return Err(ModelError::Kv(format!(
                    "a {dtype} cache needs 0 < rope <= the row width {}",
                    layout.width
                )));
            }
        }
        let n = layout.num_blocks * layout.page_size * dtype.row_elems(layout.width);
        let layers = (0..layout.num_layers)
            .map(|_| {
                Ok(match dtype {
                    // Shareable: a peer's transport may map it (UCX `cuda_ipc`).
                    KvDtype::Bf16Split { .. } => Region::Bf16(dev.zeros_shareable::<u16>(n)?),
                    KvDtype::F32 => Region::F32(dev.zeros_shareable::<f32>(n)?),
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Self {
            dev: dev.clone(),
            layout,
            dtype,
            layers,
        })
    }

    /// The device the rows live on.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// The geometry.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Whether rows are stored as bf16 (fast mode).
    pub fn is_bf16(&self) -> bool {
        self.dtype != KvDtype::F32
    }

    /// How the rows are stored.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Stored elements of one block.
    fn block_elems(&self) -> usize {
        self.layout.page_size * self.dtype.row_elems(self.layout.width)
    }

    fn region(&self, l: usize) -> Result<&Region<D>, ModelError> {
        self.layers
            .get(l)
            .ok_or_else(|| ModelError::Kv(format!("layer {l} is outside the cache")))
    }

    /// Layer `l`'s pages as the kernels take them.
    pub fn pages(&self, l: usize) -> Result<PagesView, ModelError> {
        let (ptr, bf16) = match self.region(l)? {
            Region::F32(b) => (b.ptr(), false),
            Region::Bf16(b) => (b.ptr(), true),
        };
        Ok(PagesView {
            ptr,
            bf16,
            num_blocks: self.layout.num_blocks,
            page_size: self.layout.page_size,
            width: self.layout.width,
            split: self.dtype.row_elems(self.layout.width) - self.layout.width,
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
        let elem = self.dtype.elem_size();
        let base = self.pages(l)?.ptr;
        Ok((
            base + (offset * elem) as u64,
            count * self.block_elems() * elem,
        ))
    }

    /// Checks that `count` blocks from `first` lie inside layer `l`; the first element's index.
    fn block_range(&self, l: usize, first: BlockId, count: usize) -> Result<usize, ModelError> {
        let start = first.0 as usize;
        if l >= self.layers.len() || start + count > self.layout.num_blocks {
            return Err(ModelError::Kv(format!(
                "blocks {start}..{} of layer {l} are outside the {} cache ({} layers × {} blocks)",
                start + count,
                D::NAME,
                self.layers.len(),
                self.layout.num_blocks
            )));
        }
        Ok(start * self.block_elems())
    }

    /// Writes whole blocks of layer `l` from f32 `rows` (`[block][page][width]`, a multiple of
    /// one block), starting at block `first`: one host-to-device copy, encoded as the cache
    /// stores them ([`KvDtype::encode_into`]). Returns once the copy is done.
    pub fn write_blocks(
        &mut self,
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
        let (dtype, width) = (self.dtype, self.layout.width);
        match self.layers.get_mut(l) {
            Some(Region::F32(b)) => self.dev.write(b, offset, rows)?,
            Some(Region::Bf16(b)) => {
                let mut bytes = Vec::new();
                dtype.encode_into(rows, width, &mut bytes);
                self.dev.write(b, offset, &bf16_bits(&bytes))?;
            }
            None => return Err(ModelError::Kv(format!("layer {l} is outside the cache"))),
        }
        Ok(())
    }

    /// Writes whole consecutive blocks of layer `l` from block `first` on from `bytes`: their
    /// `[block][page][row]` stored elements as little-endian bytes of the cache's own dtype
    /// ([`Self::dtype`]), copied as they are (no rounding). One host-to-device copy however many
    /// blocks (a peer's run); returns once it is done.
    pub fn write_run_bytes(
        &mut self,
        l: usize,
        first: BlockId,
        bytes: &[u8],
    ) -> Result<(), ModelError> {
        let block = self.block_elems() * self.dtype.elem_size();
        if bytes.is_empty() || bytes.len() % block != 0 {
            return Err(ModelError::Kv(format!(
                "a block write into a {} cache must be whole blocks of {block} bytes, got {}",
                self.dtype,
                bytes.len()
            )));
        }
        let offset = self.block_range(l, first, bytes.len() / block)?;
        match self.layers.get_mut(l) {
            Some(Region::F32(b)) => match bytemuck::try_cast_slice::<u8, f32>(bytes) {
                Ok(rows) => self.dev.write(b, offset, rows)?,
                Err(_) => {
                    let rows: Vec<f32> = bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    self.dev.write(b, offset, &rows)?
                }
            },
            Some(Region::Bf16(b)) => match bytemuck::try_cast_slice::<u8, u16>(bytes) {
                Ok(bits) => self.dev.write(b, offset, bits)?,
                Err(_) => self.dev.write(b, offset, &bf16_bits(bytes))?,
            },
            None => return Err(ModelError::Kv(format!("layer {l} is outside the cache"))),
        }
        Ok(())
    }

    /// `count` whole blocks of layer `l` from block `first`, as f32 rows `[block][page][width]`
    /// (one device-to-host copy; waits for queued work).
    pub fn read_blocks(
        &self,
        l: usize,
        first: BlockId,
        count: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let offset = self.block_range(l, first, count)?;
        let len = count * self.block_elems();
        match self.region(l)? {
            Region::F32(b) => Ok(self.dev.download_range(b, offset, len)?),
            Region::Bf16(b) => self.widen(&self.dev.download_range(b, offset, len)?),
        }
    }

    /// Blocks `blocks` of layer `l`, in that order, as f32 rows `[block][page][width]`: each
    /// run of consecutive ids gathered on the device (in stream order), then one device-to-host
    /// copy. A sequence's blocks need not be consecutive; this costs one wait, where a read per
    /// block would wait once per block.
    pub fn read_blocks_of(&self, l: usize, blocks: &[BlockId]) -> Result<Vec<f32>, ModelError> {
        let runs = super::block_runs(blocks);
        if let [(first, count)] = runs[..] {
            return self.read_blocks(l, first, count);
        }
        match self.region(l)? {
            Region::F32(b) => self.gather(l, b, &runs),
            Region::Bf16(b) => self.widen(&self.gather(l, b, &runs)?),
        }
    }

    /// `runs` of layer `l`'s region `src`, one after another, on the host.
    fn gather<T: DevicePod>(
        &self,
        l: usize,
        src: &D::Buffer<T>,
        runs: &[(BlockId, usize)],
    ) -> Result<Vec<T>, ModelError> {
        let per_block = self.block_elems();
        let total: usize = runs.iter().map(|&(_, n)| n * per_block).sum();
        if total == 0 {
            return Ok(Vec::new());
        }
        let mut scratch = self.dev.alloc::<T>(total)?;
        let mut at = 0;
        for &(first, n) in runs {
            let from = self.block_range(l, first, n)?;
            self.dev
                .copy_range((src, from), (&mut scratch, at), n * per_block)?;
            at += n * per_block;
        }
        Ok(self.dev.download(&scratch)?)
    }

    /// Writes f32 `rows` (`[block][page][width]`, one block per entry of `blocks`, in that
    /// order) into layer `l`, encoded as the cache stores them: one host-to-device copy, then
    /// each run of consecutive ids copied into place on the device, in stream order before any
    /// later work (the staging buffer is freed in that order too).
    pub fn write_blocks_of(
        &mut self,
        l: usize,
        blocks: &[BlockId],
        rows: &[f32],
    ) -> Result<(), ModelError> {
        self.layout.check_block_rows(l, blocks.len(), rows.len())?;
        let runs = super::block_runs(blocks);
        if let [(first, _)] = runs[..] {
            return self.write_blocks(l, first, rows);
        }
        let per_block = self.block_elems();
        let mut offsets = Vec::with_capacity(runs.len());
        for &(first, n) in &runs {
            offsets.push((self.block_range(l, first, n)?, n * per_block));
        }
        let (dtype, width) = (self.dtype, self.layout.width);
        match self.layers.get_mut(l) {
            Some(Region::F32(dst)) => {
                let staged = self.dev.upload(rows)?;
                copy_runs(&self.dev, &staged, dst, &offsets)
            }
            Some(Region::Bf16(dst)) => {
                let mut bytes = Vec::new();
                dtype.encode_into(rows, width, &mut bytes);
                let staged = self.dev.upload(&bf16_bits(&bytes))?;
                copy_runs(&self.dev, &staged, dst, &offsets)
            }
            None => Err(ModelError::Kv(format!("layer {l} is outside the cache"))),
        }
    }

    /// Layer `l` copied back as f32 rows `[block][page][width]` (tests).
    pub fn download_layer(&self, l: usize) -> Result<Vec<f32>, ModelError> {
        match self.region(l)? {
            Region::F32(b) => Ok(self.dev.download(b)?),
            Region::Bf16(b) => self.widen(&self.dev.download(b)?),
        }
    }

    /// Layer `l`'s stored bytes as they are, `[block][page][row]` little-endian elements of
    /// [`Self::dtype`] (tests compare shipped bytes with them).
    pub fn download_layer_bytes(&self, l: usize) -> Result<Vec<u8>, ModelError> {
        Ok(match self.region(l)? {
            Region::F32(b) => bytemuck::cast_slice(&self.dev.download(b)?).to_vec(),
            Region::Bf16(b) => bytemuck::cast_slice(&self.dev.download(b)?).to_vec(),
        })
    }

    /// Stored bf16 rows as f32 rows of the logical width.
    fn widen(&self, bits: &[u16]) -> Result<Vec<f32>, ModelError> {
        self.dtype
            .widen(bytemuck::cast_slice(bits), self.layout.width)
    }
}

/// Copies `staged` (runs one after another) to `(offset, len)` of `dst` each, in stream order.
fn copy_runs<D: Gpu, T: DevicePod>(
    dev: &D,
    staged: &D::Buffer<T>,
    dst: &mut D::Buffer<T>,
    offsets: &[(usize, usize)],
) -> Result<(), ModelError> {
    let mut at = 0;
    for &(to, len) in offsets {
        dev.copy_range((staged, at), (&mut *dst, to), len)?;
        at += len;
    }
    Ok(())
}

/// Little-endian bytes as bf16 bit patterns.
fn bf16_bits(bytes: &[u8]) -> Vec<u16> {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}
