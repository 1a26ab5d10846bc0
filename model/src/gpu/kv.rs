//! The CUDA latent cache: the one device cache ([`crate::kv::device::DeviceKvCache`], written
//! once for every GPU runtime) on a [`CudaDevice`].

use ferry_kernels::cuda::CudaDevice;

use crate::kv::device::DeviceKvCache;

/// Every layer's latent pages on one CUDA device (f32, or fast mode's split bf16 rows).
pub type GpuKvCache = DeviceKvCache<CudaDevice>;
