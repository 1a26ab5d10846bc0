//! L2 warm-up: weights pulled into the GPU's L2 cache ahead of the kernel that reads them, while
//! the kernels in between leave HBM idle.
//!
//! At small batches a layer's attention chain (query and latent projections, the latent
//! write, absorption, attention, the merge and un-absorption, `o_proj`, the router and the
//! routing) is a row of short, latency-bound launches: ~30 us a DeepSeek-V2-Lite layer on the
//! H200 in which HBM moves ~15 MB, against the ~130 MB it could. The shared experts' weights
//! do not depend on the routing, nor `o_proj`'s on the attention, so their lines can be
//! requested at the start of that chain (`l2_warm` in `common.cu`, one launch, writes
//! nothing); the expert kernels then read the shared slots from L2 while the routed experts
//! stream from HBM, and `o_proj`'s short GEMV reads L2.
//!
//! Which parts a layer warms is [`L2Warm`], from `FERRY_L2_WARM`; the default is none until an
//! H200 run shows it pays (docs/gpu.md). Warming changes no result: the same kernels read the
//! same bytes, from L2 or from HBM. `crate::backend::l2` calls it for a layer.

use super::launch::{Gpu, KernelArgs, KernelParam, LaunchDims};
use super::ops::GpuExperts;
use super::{Defines, Source};
use crate::KernelError;

/// Which of a layer's routing-independent weights the attention chain warms in L2
/// (`FERRY_L2_WARM`). All off by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct L2Warm {
    /// The shared experts' gate and up rows (DeepSeek-V2-Lite: 23 MB of the 50 MB L2).
    pub gate_up: bool,
    /// Each shared-expert chunk's down columns (V2-Lite: 12 MB).
    pub down: bool,
    /// The attention output projection (`o_proj`; V2-Lite: 8 MB), read by the chain itself
    /// after the attention.
    pub o_proj: bool,
    /// The next layer's first query projection and `kv_a` (V2-Lite: 15 MB), warmed before
    /// this layer's router: the router and the routing leave HBM idle, but this layer's
    /// experts stream ~140 MB through L2 before the next layer reads them, so it needs
    /// `last` to survive.
    pub next_attn: bool,
    /// Mark the warmed lines evict-last, so the chain's own weight streams evict other lines
    /// first.
    pub last: bool,
}

impl L2Warm {
    /// From `FERRY_L2_WARM` (read once): a comma list of `gate_up`, `down`, `o_proj`,
    /// `next_attn`, `last`, or `shared` (= `gate_up,down`); unset, empty or `0` is all off. An
    /// unknown word is logged and ignored.
    pub fn from_env() -> Self {
        static MODE: std::sync::OnceLock<L2Warm> = std::sync::OnceLock::new();
        *MODE.get_or_init(|| Self::parse(std::env::var("FERRY_L2_WARM").ok().as_deref()))
    }

    fn parse(v: Option<&str>) -> Self {
        let mut w = L2Warm::default();
        for word in v.unwrap_or("").split(',').map(str::trim) {
            match word {
                "" | "0" | "off" => {}
                "gate_up" => w.gate_up = true,
                "down" => w.down = true,
                "shared" => (w.gate_up, w.down) = (true, true),
                "o_proj" => w.o_proj = true,
                "next_attn" => w.next_attn = true,
                "last" => w.last = true,
                other => tracing::warn!(
                    word = other,
                    "FERRY_L2_WARM: not gate_up, down, shared, o_proj, next_attn or last; ignored"
                ),
            }
        }
        w
    }

    /// Whether anything is warmed at the start of the attention chain.
    pub fn any(self) -> bool {
        self.gate_up || self.down || self.o_proj
    }
}

/// A byte range of device memory: `(address, bytes)`.
pub type ByteRange = (u64, usize);

/// The device ranges `what` names in `experts` (its `gate_up` and `down`), whose last
/// `n_shared` stacked experts are the shared chunks (`gate` and `up` rows
/// `[E_total·inter][hidden]`, `down` rows `[E_total·hidden][inter]`, so each matrix's shared
/// part is one tail range). Empty without a shared expert.
pub fn shared_expert_ranges<D: Gpu>(
    experts: &GpuExperts<D>,
    n_shared: usize,
    what: L2Warm,
) -> Vec<ByteRange> {
    let total = experts.total();
    if n_shared == 0 || n_shared > total {
        return Vec::new();
    }
    let tail = |ptr: u64, bytes: usize| -> ByteRange {
        let (offset, len) = stacked_tail(bytes, total, n_shared);
        (ptr + offset as u64, len)
    };
    let mut out = Vec::new();
    if what.gate_up {
        out.push(tail(experts.gate.ptr(), experts.gate.bytes()));
        out.push(tail(experts.up.ptr(), experts.up.bytes()));
    }
    if what.down {
        out.push(tail(experts.down.ptr(), experts.down.bytes()));
    }
    out
}

/// The ranges [`warm`] takes in one launch.
pub const MAX_RANGES: usize = 4;

/// `common.cu`'s `L2Ranges`: the ranges' addresses, then their bytes (unused ones empty).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct L2RangesC {
    base: [u64; MAX_RANGES],
    len: [u64; MAX_RANGES],
}
// SAFETY: `#[repr(C)]`, eight u64s without padding, the layout of `L2Ranges` in common.cu.
unsafe impl KernelParam for L2RangesC {}

/// `(offset, bytes)` of the last `n` of `total` equal experts stacked in `bytes` bytes.
fn stacked_tail(bytes: usize, total: usize, n: usize) -> (usize, usize) {
    let len = bytes / total.max(1) * n.min(total);
    (bytes - len, len)
}

/// `range` shrunk to whole 16-byte units at a 16-byte-aligned address, as the bulk prefetch
/// takes them: `(address, bytes)`, the bytes 0 when nothing whole is left.
fn bulk_aligned((ptr, len): ByteRange) -> (u64, u64) {
    let start = ptr.next_multiple_of(16);
    let end = (ptr + len as u64) & !15;
    (start, end.saturating_sub(start))
}

/// Bytes the grid's blocks cover each (64 of its lanes' 4 KB chunks): enough blocks that the
/// SMs' copy engines share the requests, few enough to stay one wave.
const BYTES_PER_BLOCK: usize = 256 << 10;

/// Queues `l2_warm` (`l2_warm_last` when `last`) over up to [`MAX_RANGES`] `ranges` on `dev`.
/// Only an sm_90+ CUDA device has the prefetch instructions (compat.cuh); elsewhere this
/// queues nothing.
pub fn warm<D: Gpu>(dev: &D, ranges: &[ByteRange], last: bool) -> Result<(), KernelError> {
    const OP: &str = "gpu_l2_warm";
    if ranges.len() > MAX_RANGES {
        return Err(KernelError::InvalidParam {
            op: OP,
            field: "ranges",
            limit: "at most 4",
            value: ranges.len().to_string(),
        });
    }
    let bytes: usize = ranges.iter().map(|r| r.1).sum();
    if bytes == 0 || dev.compute_capability().0 < 9 {
        return Ok(());
    }
    let mut r = L2RangesC::default();
    for (i, &range) in ranges.iter().enumerate() {
        (r.base[i], r.len[i]) = bulk_aligned(range);
    }
    let mut args = KernelArgs::new();
    args.push(r);
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
    fn the_switch_is_a_list_of_parts_and_defaults_to_none() {
        let none = L2Warm::default();
        assert_eq!(L2Warm::parse(None), none);
        assert_eq!(L2Warm::parse(Some("0")), none);
        assert!(!L2Warm::parse(Some("")).any());
        let w = |gate_up, down, o_proj, last| L2Warm {
            gate_up,
            down,
            o_proj,
            last,
            next_attn: false,
        };
        assert_eq!(L2Warm::parse(Some("gate_up")), w(true, false, false, false));
        assert_eq!(L2Warm::parse(Some("shared")), w(true, true, false, false));
        assert_eq!(
            L2Warm::parse(Some("shared, o_proj,last")),
            w(true, true, true, true)
        );
        assert_eq!(
            L2Warm::parse(Some("o_proj,everything")),
            w(false, false, true, false)
        );
        assert!(!L2Warm::parse(Some("last")).any());
        let next = L2Warm::parse(Some("next_attn,last"));
        assert!(next.next_attn && next.last && !next.any());
    }

    #[test]
    fn bulk_ranges_keep_whole_aligned_16_byte_units_inside() {
        assert_eq!(bulk_aligned((256, 4096)), (256, 4096));
        assert_eq!(bulk_aligned((250, 100)), (256, 80));
        assert_eq!(bulk_aligned((1, 20)), (16, 0));
        assert_eq!(bulk_aligned((3, 0)), (16, 0));
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
