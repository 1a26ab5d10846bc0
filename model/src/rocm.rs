//! The ROCm side of the one forward (feature `rocm`): the paged latent cache in HIP device
//! memory, so a [`DeepseekModel`] copied onto `Backend::Rocm` runs the same forward as on the
//! CPU and CUDA (`DeepseekModel::to_backend`, then `forward` over a [`RocmKvCache`]).
//!
//! One region per layer, `[block][page][row]`, f32 (exact precision) or split bf16 (fast:
//! [`KvDtype::Bf16Split`], the RoPE key as a bf16 pair), indexed by the caller's block ids like
//! `crate::gpu::GpuKvCache` on CUDA. Rows cross to and from the host as f32:
//! [`RocmKvCache::write_blocks`] encodes them as the cache stores them and
//! [`RocmKvCache::read_blocks`] widens them back.
//!
//! No AMD GPU was available: this compiles and its contract test
//! (`tests/backend_model.rs`) skips without one. The engine's ROCm rows
//! (`engine/backend/rocm.rs`) keep their KV here.

use ferry_kernels::backend::{Backend, Precision};
use ferry_kernels::gpu::ops::PagesView;
use ferry_kernels::rocm::{HipBuffer, RocmDevice};

use crate::deepseek::DeepseekModel;
use crate::kv::{BlockId, KvDtype, KvLayout};
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
    dtype: KvDtype,
    layers: Vec<Region>,
}

impl RocmKvCache {
    /// Zeroed storage for `layout`, rows stored as `dtype`.
    pub fn new(dev: &RocmDevice, layout: KvLayout, dtype: KvDtype) -> Result<Self, ModelError> {
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
                    KvDtype::Bf16Split { .. } => Region::Bf16(dev.zeros::<u16>(n)?),
                    KvDtype::F32 => Region::F32(dev.zeros::<f32>(n)?),
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

    /// Stored elements of one block.
    fn block_elems(&self) -> usize {
        self.layout.page_size * self.dtype.row_elems(self.layout.width)
    }

    /// How the rows are stored.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// The device the rows live on.
    pub fn device(&self) -> &RocmDevice {
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
            split: self.dtype.row_elems(self.layout.width) - self.layout.width,
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
        let dev = self.dev.clone();
        match self.layers.get_mut(l) {
            Some(Region::F32(b)) => dev.write(b, offset, rows)?,
            Some(Region::Bf16(b)) => {
                let mut bytes = Vec::new();
                self.dtype.encode_into(rows, self.layout.width, &mut bytes);
                let bits: Vec<u16> = bytes
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
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
        let len = count * self.block_elems();
        match self.layers.get(l) {
            Some(Region::F32(b)) => Ok(self.dev.download_range(b, offset, len)?),
            Some(Region::Bf16(b)) => {
                let bits = self.dev.download_range(b, offset, len)?;
                self.dtype
                    .widen(bytemuck::cast_slice(&bits), self.layout.width)
            }
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
    /// `num_blocks` blocks of `page_size` tokens per layer, stored as
    /// [`DeepseekModel::kv_dtype`].
    pub fn new_rocm_kv_cache(
        &self,
        num_blocks: usize,
        page_size: usize,
    ) -> Result<RocmKvCache, ModelError> {
        RocmKvCache::new(
            self.rocm_device()?,
            self.kv_layout(num_blocks, page_size),
            self.kv_dtype(),
        )
    }

    /// This host model on `dev` in `precision` (`to_backend` with `Backend::Rocm`).
    pub fn to_rocm(&self, dev: &RocmDevice, precision: Precision) -> Result<Self, ModelError> {
        self.to_backend(&Backend::Rocm(dev.clone()), precision)
    }
}
