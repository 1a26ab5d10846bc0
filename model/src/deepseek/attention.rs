//! MLA for one layer over a whole batch: projections, RoPE, latent cache writes, and the
//! choice between the decompressed (MHA) and absorbed forms per sequence chunk.

use ferry_kernels::cpu::gemm::linear;
use ferry_kernels::cpu::mla::{
    mla_absorbed_form, mla_mha_attention, LatentContext, LatentPages, MlaDims, SeqAttn,
};
use ferry_kernels::cpu::norm::rms_norm_inplace;
use ferry_kernels::cpu::rope::RotaryLayout;

use super::batch::{BatchGeometry, SeqInput};
use super::{DeepseekModel, MlaWeights, QueryProj, LATENT_NORM_EPS};
use crate::kv::KvPool;
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

/// What every layer's attention needs to know about the batch.
pub(super) struct LayerBatch<'a> {
    /// The sequences, each with its own block table.
    pub seqs: &'a [SeqInput<'a>],
    /// Positions and row spans.
    pub geo: &'a BatchGeometry,
    /// How each chunk's form is chosen.
    pub policy: FormPolicy,
}

impl DeepseekModel {
    /// Attention of layer `layer` for the normalised hidden states `x` (`[T][hidden]`); writes
    /// the new tokens' latent rows into `kv` and returns `o_proj` output `[T][hidden]`.
    pub(super) fn attention(
        &self,
        layer: usize,
        x: &[f32],
        batch: &LayerBatch<'_>,
        kv: &mut KvPool,
    ) -> Result<Vec<f32>, ModelError> {
        let LayerBatch { seqs, geo, policy } = *batch;
        let w = &self.layers[layer].attn;
        let d = &self.dims;
        let t = geo.positions.len();
        let (qk, width) = (d.qk_head_dim(), d.latent_width());

        let q = self.queries(w, x, &geo.positions)?;

        // The latent: [normalised c_kv | rotated k_pe] per token, written into the cache.
        let mut latent = vec![0.0f32; t * width];
        linear(x, &w.kv_a, &mut latent)?;
        for row in latent.chunks_exact_mut(width) {
            rms_norm_inplace(&mut row[..d.kv_lora_rank], &w.kv_a_norm, LATENT_NORM_EPS)?;
        }
        let k_layout = RotaryLayout {
            heads: 1,
            head_stride: width,
            offset: d.kv_lora_rank,
        };
        self.rope.apply(&mut latent, &geo.positions, k_layout)?;
        for (s, &(first, rows)) in seqs.iter().zip(&geo.spans) {
            for i in 0..rows {
                let src = &latent[(first + i) * width..(first + i + 1) * width];
                kv.row_mut(layer, s.block_table, s.start_pos + i)?
                    .copy_from_slice(src);
            }
        }

        let page_size = kv.layout().page_size;
        let pages = LatentPages {
            data: kv.layer(layer)?,
            page_size,
            width,
        };
        let hv = d.heads * d.v_head_dim;
        let mut attn = vec![0.0f32; t * hv];
        for (s, &(first, rows)) in seqs.iter().zip(&geo.spans) {
            if rows == 0 {
                continue;
            }
            let table: Vec<u32> = s.block_table.iter().map(|b| b.0).collect();
            let ctx = LatentContext {
                pages,
                seq: SeqAttn {
                    block_table: &table,
                    start_pos: s.start_pos,
                    num_queries: rows,
                },
                scale: self.scale,
            };
            let q_s = &q[first * d.heads * qk..(first + rows) * d.heads * qk];
            let out_s = &mut attn[first * hv..(first + rows) * hv];
            match policy.choose(d, s.start_pos, rows) {
                AttentionForm::Mha => mla_mha_attention(q_s, d, &w.kv_b, &ctx, out_s)?,
                AttentionForm::Absorbed => mla_absorbed_form(q_s, d, &w.kv_b, &ctx, out_s)?,
            }
        }

        let mut out = vec![0.0f32; t * self.config.hidden_size];
        linear(&attn, &w.o, &mut out)?;
        Ok(out)
    }

    /// `[T][heads][qk_nope | qk_rope]` queries with RoPE applied to the rope part.
    fn queries(
        &self,
        w: &MlaWeights,
        x: &[f32],
        positions: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        let d = &self.dims;
        let t = positions.len();
        let mut q = vec![0.0f32; t * d.heads * d.qk_head_dim()];
        match &w.q {
            QueryProj::LowRank { a, norm, b } => {
                let mut qa = vec![0.0f32; t * a.rows()];
                linear(x, a, &mut qa)?;
                rms_norm_inplace(&mut qa, norm, LATENT_NORM_EPS)?;
                linear(&qa, b, &mut q)?;
            }
            QueryProj::Full(p) => linear(x, p, &mut q)?,
        }
        let layout = RotaryLayout {
            heads: d.heads,
            head_stride: d.qk_head_dim(),
            offset: d.qk_nope_head_dim,
        };
        self.rope.apply(&mut q, positions, layout)?;
        Ok(q)
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
