//! The latent rows one forward reads and writes: the host pool (CPU backend) or a device
//! cache indexed by the same block ids (GPU backend). Block ids, tables and refcounts stay with
//! the [`KvPool`] / `KvManager` on every device; only where the rows live differs.

use ferry_kernels::backend::{Pages, PagesMut};
use ferry_kernels::cpu::mla::LatentPages;

#[cfg(feature = "cuda")]
use crate::gpu::GpuKvCache;
use crate::kv::{BlockId, KvLayout, KvPool};
#[cfg(feature = "rocm")]
use crate::rocm::RocmKvCache;
use crate::ModelError;

/// Latent rows a forward writes into.
#[derive(Debug)]
pub enum KvMut<'a> {
    /// The host pool itself.
    Host(&'a mut KvPool),
    /// A CUDA device cache.
    #[cfg(feature = "cuda")]
    Cuda(&'a mut GpuKvCache),
    /// A ROCm device cache.
    #[cfg(feature = "rocm")]
    Rocm(&'a mut RocmKvCache),
}

/// The same, read-only: what a forward's per-layer hook sees.
#[derive(Debug, Clone, Copy)]
pub enum KvRef<'a> {
    /// The host pool.
    Host(&'a KvPool),
    /// A CUDA device cache.
    #[cfg(feature = "cuda")]
    Cuda(&'a GpuKvCache),
    /// A ROCm device cache.
    #[cfg(feature = "rocm")]
    Rocm(&'a RocmKvCache),
}

/// Storage a forward can run against: the host pool or a device cache.
pub trait KvRows {
    /// A writable view for one forward.
    fn rows(&mut self) -> KvMut<'_>;
}

impl KvRows for KvPool {
    fn rows(&mut self) -> KvMut<'_> {
        KvMut::Host(self)
    }
}

#[cfg(feature = "cuda")]
impl KvRows for GpuKvCache {
    fn rows(&mut self) -> KvMut<'_> {
        KvMut::Cuda(self)
    }
}

#[cfg(feature = "rocm")]
impl KvRows for RocmKvCache {
    fn rows(&mut self) -> KvMut<'_> {
        KvMut::Rocm(self)
    }
}

impl KvMut<'_> {
    /// The geometry.
    pub fn layout(&self) -> &KvLayout {
        match self {
            KvMut::Host(p) => p.layout(),
            #[cfg(feature = "cuda")]
            KvMut::Cuda(c) => c.layout(),
            #[cfg(feature = "rocm")]
            KvMut::Rocm(c) => c.layout(),
        }
    }

    /// Whether rows are stored as bf16 (a fast-mode device cache).
    pub fn is_bf16(&self) -> bool {
        match self {
            KvMut::Host(_) => false,
            #[cfg(feature = "cuda")]
            KvMut::Cuda(c) => c.is_bf16(),
            #[cfg(feature = "rocm")]
            KvMut::Rocm(c) => c.is_bf16(),
        }
    }

    /// Where the rows live, for errors.
    pub fn place(&self) -> &'static str {
        match self {
            KvMut::Host(_) => "host pool",
            #[cfg(feature = "cuda")]
            KvMut::Cuda(_) => "CUDA device cache",
            #[cfg(feature = "rocm")]
            KvMut::Rocm(_) => "ROCm device cache",
        }
    }

    /// Layer `l`'s pages for writing new rows.
    pub fn pages_mut(&mut self, l: usize) -> Result<PagesMut<'_>, ModelError> {
        match self {
            KvMut::Host(p) => {
                let width = p.layout().width;
                Ok(PagesMut::Host {
                    data: p.layer_mut(l)?,
                    width,
                })
            }
            #[cfg(feature = "cuda")]
            KvMut::Cuda(c) => Ok(PagesMut::Cuda(c.pages(l)?)),
            #[cfg(feature = "rocm")]
            KvMut::Rocm(c) => Ok(PagesMut::Rocm(c.pages(l)?)),
        }
    }

    /// Layer `l`'s pages for attention.
    pub fn pages(&self, l: usize) -> Result<Pages<'_>, ModelError> {
        self.as_ref().pages(l)
    }

    /// A read-only view.
    pub fn as_ref(&self) -> KvRef<'_> {
        match self {
            KvMut::Host(p) => KvRef::Host(p),
            #[cfg(feature = "cuda")]
            KvMut::Cuda(c) => KvRef::Cuda(c),
            #[cfg(feature = "rocm")]
            KvMut::Rocm(c) => KvRef::Rocm(c),
        }
    }
}

impl<'a> KvRef<'a> {
    /// Layer `l`'s pages for attention.
    pub fn pages(self, l: usize) -> Result<Pages<'a>, ModelError> {
        match self {
            KvRef::Host(p) => {
                let layout = p.layout();
                Ok(Pages::Host(LatentPages {
                    data: p.layer(l)?,
                    page_size: layout.page_size,
                    width: layout.width,
                }))
            }
            #[cfg(feature = "cuda")]
            KvRef::Cuda(c) => Ok(Pages::Cuda(c.pages(l)?)),
            #[cfg(feature = "rocm")]
            KvRef::Rocm(c) => Ok(Pages::Rocm(c.pages(l)?)),
        }
    }

    /// The host pool, if the rows live there.
    pub fn host(self) -> Option<&'a KvPool> {
        match self {
            KvRef::Host(p) => Some(p),
            #[cfg(feature = "cuda")]
            KvRef::Cuda(_) => None,
            #[cfg(feature = "rocm")]
            KvRef::Rocm(_) => None,
        }
    }
}

/// KV rows owned on a backend: a host pool, or a device cache. What a drafter keeps its
/// context in — on the device its model runs on — indexed by the target's block ids.
#[derive(Debug)]
pub enum KvStore {
    /// Host memory (the CPU backend).
    Host(KvPool),
    /// A CUDA device cache (f32 rows).
    #[cfg(feature = "cuda")]
    Cuda(GpuKvCache),
    /// A ROCm device cache (f32 rows).
    #[cfg(feature = "rocm")]
    Rocm(RocmKvCache),
}

impl KvRows for KvStore {
    fn rows(&mut self) -> KvMut<'_> {
        match self {
            KvStore::Host(p) => KvMut::Host(p),
            #[cfg(feature = "cuda")]
            KvStore::Cuda(c) => KvMut::Cuda(c),
            #[cfg(feature = "rocm")]
            KvStore::Rocm(c) => KvMut::Rocm(c),
        }
    }
}

impl KvStore {
    /// Zeroed f32 rows of `layout` where `b` runs.
    pub fn new(b: &ferry_kernels::backend::Backend, layout: KvLayout) -> Result<Self, ModelError> {
        match b {
            ferry_kernels::backend::Backend::Cpu => Ok(KvStore::Host(KvPool::new(layout)?)),
            #[cfg(feature = "cuda")]
            ferry_kernels::backend::Backend::Cuda(dev) => Ok(KvStore::Cuda(GpuKvCache::new(
                dev,
                layout,
                crate::kv::KvDtype::F32,
            )?)),
            #[cfg(feature = "rocm")]
            ferry_kernels::backend::Backend::Rocm(dev) => Ok(KvStore::Rocm(RocmKvCache::new(
                dev,
                layout,
                crate::kv::KvDtype::F32,
            )?)),
            // A device the kernels crate was built with but this crate's features leave out.
            #[allow(unreachable_patterns)]
            b => Err(ModelError::Invalid(format!(
                "no KV rows on the {} in this build (ferry-model feature off)",
                b.name()
            ))),
        }
    }

    /// The geometry.
    pub fn layout(&self) -> &KvLayout {
        match self {
            KvStore::Host(p) => p.layout(),
            #[cfg(feature = "cuda")]
            KvStore::Cuda(c) => c.layout(),
            #[cfg(feature = "rocm")]
            KvStore::Rocm(c) => c.layout(),
        }
    }

    /// A read-only view.
    pub fn as_ref(&self) -> KvRef<'_> {
        match self {
            KvStore::Host(p) => KvRef::Host(p),
            #[cfg(feature = "cuda")]
            KvStore::Cuda(c) => KvRef::Cuda(c),
            #[cfg(feature = "rocm")]
            KvStore::Rocm(c) => KvRef::Rocm(c),
        }
    }

    /// Layer `l`'s pages for reading.
    pub fn pages(&self, l: usize) -> Result<Pages<'_>, ModelError> {
        self.as_ref().pages(l)
    }

    /// Layer `l`'s pages for writing.
    pub fn pages_mut(&mut self, l: usize) -> Result<PagesMut<'_>, ModelError> {
        match self {
            KvStore::Host(p) => {
                let width = p.layout().width;
                Ok(PagesMut::Host {
                    data: p.layer_mut(l)?,
                    width,
                })
            }
            #[cfg(feature = "cuda")]
            KvStore::Cuda(c) => Ok(PagesMut::Cuda(c.pages(l)?)),
            #[cfg(feature = "rocm")]
            KvStore::Rocm(c) => Ok(PagesMut::Rocm(c.pages(l)?)),
        }
    }

    /// One block of layer `l` as f32 rows `[page][width]` (a download from a device).
    pub fn read_block(&self, l: usize, block: BlockId) -> Result<Vec<f32>, ModelError> {
        match self {
            KvStore::Host(p) => Ok(p.block(l, block)?.to_vec()),
            #[cfg(feature = "cuda")]
            KvStore::Cuda(c) => c.read_blocks(l, block, 1),
            #[cfg(feature = "rocm")]
            KvStore::Rocm(c) => c.read_blocks(l, block, 1),
        }
    }

    /// Blocks `blocks` of layer `l`, in that order, as f32 rows `[block][page][width]` (from a
    /// device: one gather and one download, not one per block).
    pub fn read_blocks_of(&self, l: usize, blocks: &[BlockId]) -> Result<Vec<f32>, ModelError> {
        match self {
            KvStore::Host(p) => {
                let mut out = Vec::with_capacity(blocks.len() * p.layout().block_floats());
                for &b in blocks {
                    out.extend_from_slice(p.block(l, b)?);
                }
                Ok(out)
            }
            #[cfg(feature = "cuda")]
            KvStore::Cuda(c) => c.read_blocks_of(l, blocks),
            #[cfg(feature = "rocm")]
            KvStore::Rocm(c) => c.read_blocks_of(l, blocks),
        }
    }

    /// Overwrites blocks `blocks` of layer `l` with f32 rows `[block][page][width]`, one block
    /// per entry, in that order (to a device: one upload, not one per block).
    pub fn write_blocks_of(
        &mut self,
        l: usize,
        blocks: &[BlockId],
        rows: &[f32],
    ) -> Result<(), ModelError> {
        match self {
            KvStore::Host(_) => {
                let per_block = self.layout().block_floats();
                self.layout()
                    .check_block_rows(l, blocks.len(), rows.len())?;
                for (&b, block) in blocks.iter().zip(rows.chunks_exact(per_block.max(1))) {
                    self.write_block(l, b, block)?;
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            KvStore::Cuda(c) => c.write_blocks_of(l, blocks, rows),
            #[cfg(feature = "rocm")]
            KvStore::Rocm(c) => c.write_blocks_of(l, blocks, rows),
        }
    }

    /// Overwrites one block of layer `l` with f32 rows `[page][width]`.
    pub fn write_block(
        &mut self,
        l: usize,
        block: BlockId,
        rows: &[f32],
    ) -> Result<(), ModelError> {
        match self {
            KvStore::Host(p) => {
                let dst = p.block_mut(l, block)?;
                if dst.len() != rows.len() {
                    return Err(ModelError::Kv(format!(
                        "a block of layer {l} holds {} floats, got {}",
                        dst.len(),
                        rows.len()
                    )));
                }
                dst.copy_from_slice(rows);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            KvStore::Cuda(c) => c.write_blocks(l, block, rows),
            #[cfg(feature = "rocm")]
            KvStore::Rocm(c) => c.write_blocks(l, block, rows),
        }
    }
}
