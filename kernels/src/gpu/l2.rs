//! L2 warm-up: weights pulled into the GPU's L2 cache ahead of the kernel that reads them, while
//! the kernels in between leave HBM idle.
//!
//! At small batches an MoE layer's attention chain (query and latent projections, the latent
//! write, absorption, attention, the merge and un-absorption, `o_proj`, the router and the
//! routing) is a row of short, latency-bound launches: ~30 us a DeepSeek-V2-Lite layer on the
//! H200 in which HBM moves ~15 MB, against the ~130 MB it could. The shared experts' weights
//! do not depend on the routing, so their lines can be requested at the start of that chain
//! (`l2_warm` in `common.cu`, one launch, writes nothing) and the expert kernels then read
//! them from L2 while the routed experts stream from HBM.
//!
//! Which ranges a layer warms is [`L2Warm`], from `FERRY_L2_WARM`; the default is none until an
//! H200 run shows it pays (docs/gpu.md). Warming changes no result: the same kernels read the
//! same bytes, from L2 or from HBM.

use super::launch::{Gpu, KernelArgs, LaunchDims};
use super::ops::GpuExperts;
use super::{Defines, Source};
use crate::KernelError;

/// Which of an MoE layer's weights the attention chain warms in L2 (`FERRY_L2_WARM`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum L2Warm {
    /// Nothing (the default).
    #[default]
    Off,
    /// The shared experts' gate and up rows (DeepSeek-V2-Lite: 23 MB of the 50 MB L2).
    SharedGateUp,
    /// The shared experts' gate, up and down rows (V2-Lite: 35 MB).
    Shared,
    /// [`L2Warm::Shared`], the lines marked evict-last, so the chain's own weight streams
    /// evict other lines first.
    SharedLast,
}

impl L2Warm {
    /// From `FERRY_L2_WARM` (read once): `gate_up`, `shared`, `shared_last`; anything else,
    /// or unset, is [`L2Warm::Off`].
    pub fn from_env() -> Self {
        static MODE: std::sync::OnceLock<L2Warm> = std::sync::OnceLock::new();
        *MODE.get_or_init(|| Self::parse(std::env::var("FERRY_L2_WARM").ok().as_deref()))
    }

    fn parse(v: Option<&str>) -> Self {
        match v {
            Some("gate_up") => L2Warm::SharedGateUp,
            Some("shared") => L2Warm::Shared,
            Some("shared_last") => L2Warm::SharedLast,
            Some(other) if !other.is_empty() && other != "0" && other != "off" => {
                tracing::warn!(
                    value = other,
                    "FERRY_L2_WARM: not gate_up, shared or shared_last; off"
                );
                L2Warm::Off
            }
            _ => L2Warm::Off,
        }
    }
}

/// A byte range of device memory: `(address, bytes)`.
pub type ByteRange = (u64, usize);

/// The device ranges [`L2Warm`] names in `experts`, whose last `n_shared` stacked experts are the
/// shared chunks (`gate` and `up` rows `[E_total·inter][hidden]`, `down` rows
/// `[E_total·hidden][inter]`, so each matrix's shared part is one tail range). Empty for
/// [`L2Warm::Off`] or without a shared expert.
pub fn shared_expert_ranges<D: Gpu>(
    experts: &GpuExperts<D>,
    n_shared: usize,
    what: L2Warm,
) -> Vec<ByteRange> {
    let total = experts.total();
    if what == L2Warm::Off || n_shared == 0 || n_shared > total {
        return Vec::new();
    }
    let tail = |ptr: u64, bytes: usize| -> ByteRange {
        let (offset, len) = stacked_tail(bytes, total, n_shared);
        (ptr + offset as u64, len)
    };
    let mut out = vec![
        tail(experts.gate.ptr(), experts.gate.bytes()),
        tail(experts.up.ptr(), experts.up.bytes()),
    ];
    if what != L2Warm::SharedGateUp {
        out.push(tail(experts.down.ptr(), experts.down.bytes()));
    }
    out
}

/// `(offset, bytes)` of the last `n` of `total` equal experts stacked in `bytes` bytes.
fn stacked_tail(bytes: usize, total: usize, n: usize) -> (usize, usize) {
    let len = bytes / total.max(1) * n.min(total);
    (bytes - len, len)
}

/// Bytes the grid's blocks cover each: enough blocks that each SM issues a share of the
/// requests (one SM alone issues ~200 GB/s of line requests), few enough to stay one wave.
const BYTES_PER_BLOCK: usize = 256 << 10;

/// Queues `l2_warm` (`l2_warm_last` when `last`) over up to three `ranges` on `dev`. Only an
/// sm_90+ CUDA device has the prefetch instructions (compat.cuh); elsewhere this queues nothing.
pub fn warm<D: Gpu>(dev: &D, ranges: &[ByteRange], last: bool) -> Result<(), KernelError> {
    const OP: &str = "gpu_l2_warm";
    if ranges.len() > 3 {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "ranges",
            limit: "at most 3",
            value: ranges.len().to_string(),
        });
    }
    let bytes: usize = ranges.iter().map(|r| r.1).sum();
    if bytes == 0 || dev.compute_capability().0 < 9 {
        return Ok(());
    }
    let mut args = KernelArgs::new();
    for i in 0..3 {
        let (ptr, len) = ranges.get(i).copied().unwrap_or((0, 0));
        args.push(ptr).push(len as u64);
    }
    let name = if last { "l2_warm_last" } else { "l2_warm" };
    let f = dev.function(Source::Common, &Defines::new(), name)?;
    let blocks = bytes
        .div_ceil(BYTES_PER_BLOCK)
        .min(dev.sm_count().max(1) as usize);
    dev.launch(&f, LaunchDims::linear(blocks, 256), &mut args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_names_three_choices_and_defaults_to_off() {
        assert_eq!(L2Warm::parse(None), L2Warm::Off);
        assert_eq!(L2Warm::parse(Some("0")), L2Warm::Off);
        assert_eq!(L2Warm::parse(Some("gate_up")), L2Warm::SharedGateUp);
        assert_eq!(L2Warm::parse(Some("shared")), L2Warm::Shared);
        assert_eq!(L2Warm::parse(Some("shared_last")), L2Warm::SharedLast);
        assert_eq!(L2Warm::parse(Some("everything")), L2Warm::Off);
    }

    #[test]
    fn the_shared_experts_are_the_tail_of_each_stacked_matrix() {
        // V2-Lite: 64 routed + 2 shared chunks of 1,408 × 2,048 bf16 rows.
        let per = 1408 * 2048 * 2;
        assert_eq!(stacked_tail(66 * per, 66, 2), (64 * per, 2 * per));
        assert_eq!(stacked_tail(66 * per, 66, 0), (66 * per, 0));
        assert_eq!(stacked_tail(3 * per, 3, 3), (0, 3 * per));
    }
}
