//! L2 warm-up of weights ahead of the kernels that read them (`crate::gpu::l2`,
//! `FERRY_L2_WARM`): at the start of a layer's attention chain its shared experts and
//! `o_proj` ([`warm`]), before its router the next layer's first projections
//! ([`warm_next_attention`]). On an sm_90+ CUDA device each is one launch requesting the lines
//! `FERRY_L2_WARM` names; on the CPU, on ROCm and with the switch off (the default) nothing is
//! queued. It changes no result.

use super::moe::Moe;
use super::{Backend, Weight};
use crate::KernelError;

/// The weights of one layer that the warm-up may name.
#[derive(Debug, Clone, Copy)]
pub struct LayerWeights<'a> {
    /// The attention output projection.
    pub o_proj: &'a Weight,
    /// The layer's MoE, if it has one (a dense layer's MLP is not warmed).
    pub moe: Option<&'a Moe>,
}

/// Queues the warm-up of what `FERRY_L2_WARM` names in `w` (see the module docs).
pub fn warm(b: &Backend, w: LayerWeights<'_>) -> Result<(), KernelError> {
    #[cfg(feature = "cuda")]
    if let Backend::Cuda(dev) = b {
        let what = crate::gpu::l2::L2Warm::from_env();
        return warm_cuda(dev, w, what);
    }
    let _ = (b, w);
    Ok(())
}

/// [`warm`] with the parts given (`what`) rather than read from the environment.
#[cfg(feature = "cuda")]
pub fn warm_cuda(
    dev: &crate::cuda::CudaDevice,
    w: LayerWeights<'_>,
    what: crate::gpu::l2::L2Warm,
) -> Result<(), KernelError> {
    use crate::gpu::l2;
    if !what.any() {
        return Ok(());
    }
    let mut ranges = Vec::with_capacity(l2::MAX_RANGES);
    if let Some(Moe::Cuda {
        experts, routing, ..
    }) = w.moe
    {
        ranges.extend(l2::shared_expert_ranges(
            experts,
            routing.n_shared.max(0) as usize,
            what,
        ));
    }
    if let (true, Weight::Cuda(o)) = (what.o_proj, w.o_proj) {
        ranges.push((o.ptr(), o.bytes()));
    }
    l2::warm(dev, &ranges, what.last)
}

/// Queues the warm-up of the next layer's first query projection and `kv_a` (`q_first`,
/// `kv_a`) when `FERRY_L2_WARM` names `next_attn`: called before a layer's router, whose
/// short launches leave HBM idle.
pub fn warm_next_attention(
    b: &Backend,
    q_first: &Weight,
    kv_a: &Weight,
) -> Result<(), KernelError> {
    #[cfg(feature = "cuda")]
    if let (Backend::Cuda(dev), Weight::Cuda(q), Weight::Cuda(kv)) = (b, q_first, kv_a) {
        let what = crate::gpu::l2::L2Warm::from_env();
        if what.next_attn {
            let ranges = [(q.ptr(), q.bytes()), (kv.ptr(), kv.bytes())];
            return crate::gpu::l2::warm(dev, &ranges, what.last);
        }
    }
    let _ = (b, q_first, kv_a);
    Ok(())
}
