//! MLA for one layer over a whole batch: projections, RoPE, latent cache writes, and the
//! choice between the decompressed (MHA) and absorbed forms per sequence chunk (the launch
//! plan groups runs of sequences that share a form; see [`super::forward`]).

use ferry_kernels::backend::l2::{warm as l2_warm, LayerWeights};
use ferry_kernels::backend::latent::{latent_write, LatentWrite};
use ferry_kernels::backend::linear::{linear, linear_pair, Linear, LinearPair};
use ferry_kernels::backend::mla_absorbed::{mla_absorbed, AbsorbedRun};
use ferry_kernels::backend::mla_mha::{mla_mha, MhaRun};
use ferry_kernels::backend::norm::{norm_strided, NormStrided};
use ferry_kernels::backend::{Tensor, Weight};
use ferry_kernels::cpu::mla::MlaDims;
use ferry_kernels::cpu::rope::RotaryLayout;

use super::forward::{Plan, RunPlan};
use super::{DeepseekModel, Ffn, QueryProj, LATENT_NORM_EPS};
use crate::kv::KvMut;
use crate::ModelError;

/// The two algebraically equal ways to compute MLA attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionForm {
    /// Decompress every key's latent into per-head K and V, then ordinary causal attention.
    Mha,
    /// Fold `W_UK` into the query and `W_UV` into the output; attend over the shared latent.
    Absorbed,
}

/// How the forward picks an [`AttentionForm`] for each sequence chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FormPolicy {
    /// The cheaper form by [`estimate_flops`] (fresh prompts → MHA, short chunks over a long
    /// cached prefix and decode → absorbed).
    #[default]
    CostModel,
    /// Always this form (tests and benchmarks).
    Force(AttentionForm),
}

impl FormPolicy {
    /// The form for a chunk of `new` tokens after `cached` positions.
    pub fn choose(self, dims: &MlaDims, cached: usize, new: usize) -> AttentionForm {
        match self {
            FormPolicy::Force(form) => form,
            FormPolicy::CostModel => {
                let mha = estimate_flops(AttentionForm::Mha, dims, cached, new);
                let absorbed = estimate_flops(AttentionForm::Absorbed, dims, cached, new);
                if absorbed < mha {
                    AttentionForm::Absorbed
                } else {
                    AttentionForm::Mha
                }
            }
        }
    }
}

/// FLOPs (2 per multiply-add) of one layer's attention for `new` query tokens after `cached`
/// positions, in `form`. With the family's shapes this reproduces `mla.md`: MHA costs
/// 640·H per (query, key) pair plus 262,144·H per decompressed key; absorbed costs 2176·H per
/// pair plus the per-query absorb/unabsorb, so absorbed wins for chunks of under ~171 tokens
/// over a long prefix and MHA wins for fresh prompts.
pub fn estimate_flops(form: AttentionForm, dims: &MlaDims, cached: usize, new: usize) -> f64 {
    let h = dims.heads as f64;
    let r = dims.kv_lora_rank as f64;
    let (dn, dr, dv) = (
        dims.qk_nope_head_dim as f64,
        dims.qk_rope_head_dim as f64,
        dims.v_head_dim as f64,
    );
    let (c, s) = (cached as f64, new as f64);
    let pairs = s * c + s * (s + 1.0) / 2.0;
    match form {
        AttentionForm::Mha => 2.0 * r * h * (dn + dv) * (c + s) + pairs * 2.0 * h * (dn + dr + dv),
        AttentionForm::Absorbed => 2.0 * s * h * (dn + dv) * r + pairs * 2.0 * h * (2.0 * r + dr),
    }
}

impl DeepseekModel {
    /// MLA of layer `l` for the normalised hidden states `x` (`[T][hidden]`): writes the new
    /// tokens' latent rows into `kv` and returns the heads' outputs `[T][heads · v_head_dim]`,
    /// the input of `o_proj` (which the forward adds into the residual stream).
    pub(super) fn attention(
        &self,
        l: usize,
        x: &Tensor,
        plan: &Plan,
        kv: &mut KvMut<'_>,
    ) -> Result<Tensor, ModelError> {
        let b = &self.backend;
        let w = &self.layers[l].attn;
        let d = self.dims;
        let t = plan.geo.positions.len();
        let precision = self.kernels.precision;
        let lin = |x: &Tensor, w: &Weight| linear(b, Linear { x, w, precision });

        // The two projections of `x`: the first query projection (q_a, or the full q) and
        // kv_a, one launch for a decode step on a GPU.
        let first = match &w.q {
            QueryProj::LowRank { a, .. } => a,
            QueryProj::Full(p) => p,
        };
        let p = LinearPair {
            x,
            first,
            second: &w.kv_a,
            precision,
        };
        let (q0, mut latent) = linear_pair(b, p)?;
        // The layer's shared experts and `o_proj` into L2 while the rest of the chain leaves
        // HBM idle (`FERRY_L2_WARM`; nothing by default).
        let moe = match &self.layers[l].ffn {
            Ffn::Moe(m) => Some(&**m),
            Ffn::Dense(_) => None,
        };
        l2_warm(b, LayerWeights { o_proj: &w.o, moe })?;

        // Queries `[T][heads][qk_nope | qk_rope]` (RoPE on the rope part below).
        let mut q = match &w.q {
            QueryProj::LowRank { a, norm, b: qb } => {
                let mut qa = q0;
                let p = NormStrided {
                    x: &mut qa,
                    stride: a.rows(),
                    weight: norm,
                    eps: LATENT_NORM_EPS,
                };
                norm_strided(b, p)?;
                lin(&qa, qb)?
            }
            QueryProj::Full(_) => q0,
        };
        // The latent: [normalised c_kv | rotated k_pe] per token, written into the cache; the
        // queries' rope parts rotated with it (one launch on a GPU).
        let layout = RotaryLayout {
            heads: d.heads,
            head_stride: d.qk_head_dim(),
            offset: d.qk_nope_head_dim,
        };
        let p = LatentWrite {
            latent: &mut latent,
            norm: &w.kv_a_norm,
            eps: LATENT_NORM_EPS,
            rope: &plan.rope,
            slots: &plan.slots,
            pages: kv.pages_mut(l)?,
            queries: Some((&mut q, layout)),
        };
        latent_write(b, p)?;

        let mut attn = b.scratch(t * d.heads * d.v_head_dim)?;
        let pages = kv.pages(l)?;
        for run in &plan.runs {
            match run {
                RunPlan::Absorbed {
                    first,
                    end,
                    sq,
                    table,
                    stride,
                    ctx,
                    max_ctx,
                } => {
                    let p = AbsorbedRun {
                        q: &q,
                        first_row: plan.geo.spans[*first].0,
                        seqs: end - first,
                        sq: *sq,
                        tables: table,
                        stride: *stride,
                        ctx,
                        max_ctx: *max_ctx,
                        kv_b: &w.kv_b,
                        pages,
                        dims: d,
                        scale: self.scale,
                        kernels: self.kernels,
                        out: &mut attn,
                    };
                    mla_absorbed(b, p)?;
                }
                RunPlan::Mha {
                    first,
                    seqs,
                    table,
                    stride,
                    cu_q,
                    cu_k,
                    q_seq,
                } => {
                    let p = MhaRun {
                        q: &q,
                        first_row: plan.geo.spans[*first].0,
                        seqs,
                        tables: table,
                        stride: *stride,
                        cu_q,
                        cu_k,
                        q_seq,
                        kv_b: &w.kv_b,
                        pages,
                        dims: d,
                        scale: self.scale,
                        precision,
                        out: &mut attn,
                    };
                    mla_mha(b, p)?;
                }
            }
        }
        Ok(attn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k3_rank_dims() -> MlaDims {
        MlaDims {
            heads: 12,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        }
    }

    #[test]
    fn cost_model_matches_the_reference_crossover() {
        let d = k3_rank_dims();
        let p = FormPolicy::CostModel;
        // Fresh prompts: MHA at every length.
        for s in [1, 16, 1024, 65536] {
            assert_eq!(
                p.choose(&d, 0, s),
                AttentionForm::Mha,
                "fresh prompt of {s}"
            );
        }
        // Decode and short chunks over a long prefix: absorbed; long chunks: MHA.
        assert_eq!(p.choose(&d, 100_000, 1), AttentionForm::Absorbed);
        assert_eq!(p.choose(&d, 100_000, 150), AttentionForm::Absorbed);
        assert_eq!(p.choose(&d, 100_000, 200), AttentionForm::Mha);
        assert_eq!(
            FormPolicy::Force(AttentionForm::Mha).choose(&d, 100_000, 1),
            AttentionForm::Mha
        );
    }
}
