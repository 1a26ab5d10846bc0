//! The paged latent cache in device memory: one region per layer, `[block][page][width]`,
//! f32 or bf16. Block ids are the caller's (the same [`BlockId`]s a `KvPool` hands out), so
//! the CPU-side allocator, prefix cache and events keep working unchanged.
//!
//! [`BlockId`]: crate::kv::BlockId

use ferry_kernels::cuda::ops::PagesView;
use ferry_kernels::cuda::{CudaDevice, DeviceBuffer};

use crate::kv::KvLayout;
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
        Ok(Self { layout, layers })
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
