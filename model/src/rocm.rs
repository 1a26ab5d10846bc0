//! The ROCm side of the one forward (feature `rocm`): the paged latent cache in HIP device
//! memory, so a [`DeepseekModel`] copied onto `Backend::Rocm` runs the same forward as on the
//! CPU and CUDA (`DeepseekModel::to_backend`, then `forward` over a [`RocmKvCache`]).
//!
//! One region per layer, `[block][page][width]`, f32 (exact precision) or bf16 (fast), indexed
//! by the caller's block ids like `crate::gpu::GpuKvCache` on CUDA. Rows cross to and from the
//! host as f32: [`RocmKvCache::write_blocks`] rounds them to bf16 (nearest even) in a bf16 cache
//! and [`RocmKvCache::read_blocks`] widens them back.
//!
//! No AMD GPU was available: this compiles and its contract test
//! (`tests/backend_model.rs`) skips without one. The engine's ROCm rows
//! (`engine/backend/rocm.rs`) keep their KV here.

use ferry_kernels::backend::{Backend, Precision};
use ferry_kernels::gpu::ops::PagesView;
use ferry_kernels::rocm::{HipBuffer, RocmDevice};

use crate::deepseek::DeepseekModel;
use crate::kv::{BlockId, KvLayout};
use crate::ModelError;

/// Storage of one layer.
#[derive(Debug)]
enum Region {
    F32(HipBuffer<f32>),
    Bf16(HipBuffer<u16>),
}

/// Every layer's latent pages on one ROCm device.
#[derive(Debug)]
pub struct RocmKvCache {
    dev: RocmDevice,
    layout: KvLayout,
    layers: Vec<Region>,
}

impl RocmKvCache {
    /// Zeroed storage for `layout`, bf16 or f32.
    pub fn new(dev: &RocmDevice, layout: KvLayout, bf16: bool) -> Result<Self, ModelError> {
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
    pub fn device(&self) -> &RocmDevice {
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

    /// Checks that `count` blocks from `first` lie inside layer `l`; the first element's index.
    fn block_range(&self, l: usize, first: BlockId, count: usize) -> Result<usize, ModelError> {
        let start = first.0 as usize;
        if l >= self.layers.len() || start + count > self.layout.num_blocks {
            return Err(ModelError::Kv(format!(
                "blocks {start}..{} of layer {l} are outside the ROCm cache ({} layers × {} blocks)",
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
        let dev = self.dev.clone();
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

    /// `count` whole blocks of layer `l` from block `first`, as f32 rows `[block][page][width]`
    /// (one device-to-host copy; waits for queued work).
    pub fn read_blocks(
        &self,
        l: usize,
        first: BlockId,
        count: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let offset = self.block_range(l, first, count)?;
        let len = count * self.layout.block_floats();
        match self.layers.get(l) {
            Some(Region::F32(b)) => Ok(self.dev.download_range(b, offset, len)?),
            Some(Region::Bf16(b)) => Ok(self
                .dev
                .download_range(b, offset, len)?
                .into_iter()
                .map(|v| half::bf16::from_bits(v).to_f32())
                .collect()),
            None => Err(ModelError::Kv(format!("layer {l} is outside the cache"))),
        }
    }
}

impl DeepseekModel {
    /// The ROCm device the model lives on, or an error naming where it is.
    pub fn rocm_device(&self) -> Result<&RocmDevice, ModelError> {
        self.backend().rocm().ok_or_else(|| {
            ModelError::Invalid(format!(
                "the model is on the {}, not a ROCm device",
                self.backend().name()
            ))
        })
    }

    /// A zeroed ROCm latent cache for this model (which must be on `Backend::Rocm`):
    /// `num_blocks` blocks of `page_size` tokens per layer, f32 in exact precision, bf16 in
    /// fast.
    pub fn new_rocm_kv_cache(
        &self,
        num_blocks: usize,
        page_size: usize,
    ) -> Result<RocmKvCache, ModelError> {
        RocmKvCache::new(
            self.rocm_device()?,
            self.kv_layout(num_blocks, page_size),
            self.precision() == Precision::Fast,
        )
    }

    /// This host model on `dev` in `precision` (`to_backend` with `Backend::Rocm`).
    pub fn to_rocm(&self, dev: &RocmDevice, precision: Precision) -> Result<Self, ModelError> {
        self.to_backend(&Backend::Rocm(dev.clone()), precision)
    }
}
