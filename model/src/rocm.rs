//! The ROCm side of the one forward (feature `rocm`): the paged latent cache in HIP device
//! memory, so a [`DeepseekModel`] copied onto `Backend::Rocm` runs the same forward as on the
//! CPU and CUDA (`DeepseekModel::to_backend`, then `forward` over a [`RocmKvCache`]).
//!
//! The cache is the same type as CUDA's (`crate::kv::device::DeviceKvCache`), on HIP.
//!
//! No AMD GPU was available: its contract test (`tests/backend_model.rs`) and the engine's
//! ROCm test ran only on a CPU HIP (`scripts/hip_emu.sh`). The engine's ROCm rows
//! (`engine/backend/rocm.rs`) keep their KV here.

use ferry_kernels::backend::{Backend, Precision};
use ferry_kernels::rocm::RocmDevice;

use crate::deepseek::DeepseekModel;
use crate::ModelError;

/// Every layer's latent pages on one ROCm device: the one device cache
/// ([`crate::kv::device::DeviceKvCache`], written once for every GPU runtime) on HIP.
pub type RocmKvCache = crate::kv::device::DeviceKvCache<RocmDevice>;

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
