//! The new tokens' latent rows: `[RMSNorm(c_kv) | RoPE(k_pe)]`, written into the paged cache —
//! and optionally the queries' RoPE, which a GPU does in the same launch.

use super::rope::{ApplyRope, RopeTable};
use super::{Backend, PagesMut, Slots, Tensor};
use crate::cpu::rope::RotaryLayout;
use crate::KernelError;

/// Normalise, rotate and store the `kv_a_proj` output of every new token.
#[derive(Debug)]
pub struct LatentWrite<'a> {
    /// `[tokens][width]` raw latent rows (normalised and rotated in place).
    pub latent: &'a mut Tensor,
    /// `kv_a_layernorm` weight `[kv_lora]`.
    pub norm: &'a Tensor,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// The batch's rotation.
    pub rope: &'a RopeTable,
    /// Cache slot of each token (`block · page_size + offset`).
    pub slots: &'a Slots,
    /// The layer's pages.
    pub pages: PagesMut<'a>,
    /// Queries `[tokens][heads · head_stride]` to rotate with the same table (what
    /// [`super::rope::rope`] does with `layout`), if any: on a GPU the latent's launch does it
    /// too (unless fusion is off, [`super::fuse`]).
    pub queries: Option<(&'a mut Tensor, RotaryLayout)>,
}

/// Runs [`LatentWrite`].
pub fn latent_write(b: &Backend, mut p: LatentWrite<'_>) -> Result<(), KernelError> {
    const OP: &str = "latent_write";
    let fold = !matches!(b, Backend::Cpu) && super::fuse();
    if !fold {
        if let Some((q, layout)) = p.queries.take() {
            let r = ApplyRope {
                x: q,
                table: p.rope,
                layout,
            };
            super::rope::rope(b, r)?;
        }
    }
    match b {
        Backend::Cpu => {
            let got = p.pages.place();
            // (Irrefutable in a build without a GPU backend.)
            #[allow(irrefutable_let_patterns)]
            let PagesMut::Host { data, width } = p.pages
            else {
                return Err(super::mismatch(OP, "pages", b, got));
            };
            let norm = p.norm.host(OP, "norm")?;
            let kv_lora = norm.len();
            let latent = p.latent.host_mut(OP, "latent")?;
            for row in latent.chunks_exact_mut(width.max(1)) {
                crate::cpu::norm::rms_norm_inplace(&mut row[..kv_lora], norm, p.eps)?;
            }
            let layout = RotaryLayout {
                heads: 1,
                head_stride: width,
                offset: kv_lora,
            };
            super::rope::rope(
                b,
                ApplyRope {
                    x: p.latent,
                    table: p.rope,
                    layout,
                },
            )?;
            let latent = p.latent.host(OP, "latent")?;
            let slots = p.slots.host(OP, "slots")?;
            crate::cpu::gemm::check_len(OP, "latent", slots.len() * width, latent.len())?;
            let n = data.len() / width.max(1);
            for (row, &slot) in latent.chunks_exact(width.max(1)).zip(slots) {
                let s = super::host_index(OP, "slot", slot, n)?;
                data[s * width..(s + 1) * width].copy_from_slice(row);
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Backend::Cuda(dev) => write_on(dev, &p),
        #[cfg(feature = "rocm")]
        Backend::Rocm(dev) => write_on(dev, &p),
    }
}

/// The GPU arm: one fused launch (norm, RoPE, store, and the queries' RoPE).
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn write_on<D: super::OnDevice>(dev: &D, p: &LatentWrite<'_>) -> Result<(), KernelError> {
    use super::{pmv, sv, tv};
    const OP: &str = "latent_write";
    let pages = pmv::<D>(&p.pages, OP)?;
    let queries = match &p.queries {
        Some((q, layout)) => Some((tv::<D>(q, OP, "queries")?, *layout)),
        None => None,
    };
    let fin = crate::gpu::ops::LatentFinish {
        latent: tv::<D>(p.latent, OP, "latent")?,
        norm: tv::<D>(p.norm, OP, "norm")?,
        eps: p.eps,
        rope: p.rope.on::<D>(OP)?,
        slots: sv::<D>(p.slots, OP, "slots")?,
        queries,
    };
    crate::gpu::ops::latent_finish(dev, &fin, pages)
}
