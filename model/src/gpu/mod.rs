//! The whole DeepSeek-V3-family forward on a CUDA device.
//!
//! | file | owns |
//! |---|---|
//! | this file | [`GpuModel`]: every weight in device memory, uploaded from a loaded [`DeepseekModel`] or drawn at random ([`GpuModel::random`], benchmarks); [`GpuMode`] |
//! | [`graph`] | [`graph::DecodeGraph`]: one decode step captured as a CUDA graph and replayed, so the host issues one launch per step |
//! | [`kv`] | [`GpuKvCache`]: the paged latent cache of every layer in device memory |
//! | [`forward`] | the batched forward: embedding → layers (MLA in the cost model's form, dense MLP or MoE) → LM head, all on device |
//! | [`bench`] | single-stream decode tokens/s of a random-weight model against the bandwidth roofline |
//! | [`report`] | every GPU benchmark of BENCHMARKS.md as one Markdown report |
//!
//! The batch contract is the CPU forward's ([`BatchInputs`] in, [`BatchOutput`] out, block
//! tables owned by the caller), so a scheduler can drive either backend. Two modes:
//! [`GpuMode::Exact`] keeps f32 activations, an f32 latent cache and f32 attention (the
//! parity target: same tolerance as CPU vs Hugging Face); [`GpuMode::Fast`] uses a bf16 latent
//! cache, the tensor-core absorbed tile kernel (with the 12 → 16 pad dispatcher) for decode,
//! the flash kernel for prefill and bf16 GEMM inputs — the serving configuration.
//!
//! [`BatchInputs`]: crate::deepseek::BatchInputs
//! [`BatchOutput`]: crate::deepseek::BatchOutput

pub mod bench;
pub mod forward;
pub mod graph;
pub mod kv;
pub mod report;

use ferry_kernels::cpu::gemm::Matrix;
use ferry_kernels::cpu::mla::MlaDims;
use ferry_kernels::cpu::mlp::GatedMlp;
use ferry_kernels::cpu::rope::Rope;
use ferry_kernels::cuda::mla::{AbsorbedKernel, MlaShape};
use ferry_kernels::cuda::ops::{GemmPrecision, GpuExperts, GpuMatrixData, RouteParams};
use ferry_kernels::cuda::{CudaDevice, DeviceBuffer, GpuMatrix};
use half::bf16;

pub use forward::GpuHooks;
pub use kv::GpuKvCache;

use crate::config::ModelConfig;
use crate::deepseek::{DeepseekModel, Ffn, FormPolicy, QueryProj};
use crate::ModelError;

/// Numerics of the GPU forward. Defined with the engine's configuration (which names it
/// whether or not the `cuda` feature is built) and re-exported here.
pub use crate::engine::GpuMode;

impl GpuMode {
    pub(crate) fn gemm(self) -> GemmPrecision {
        match self {
            GpuMode::Exact => GemmPrecision::Exact,
            GpuMode::Fast => GemmPrecision::Fast,
        }
    }
}

/// Query projection on the device.
#[derive(Debug)]
pub(crate) enum GpuQuery {
    LowRank {
        a: GpuMatrix,
        norm: DeviceBuffer<f32>,
        b: GpuMatrix,
    },
    Full(GpuMatrix),
}

#[derive(Debug)]
pub(crate) struct GpuAttn {
    pub q: GpuQuery,
    pub kv_a: GpuMatrix,
    pub kv_a_norm: DeviceBuffer<f32>,
    pub kv_b: GpuMatrix,
    pub o: GpuMatrix,
}

#[derive(Debug)]
pub(crate) enum GpuFfn {
    Dense {
        gate: GpuMatrix,
        up: GpuMatrix,
        down: GpuMatrix,
    },
    Moe {
        router: GpuMatrix,
        bias: DeviceBuffer<f32>,
        experts: GpuExperts,
        routing: RouteParams,
    },
}

#[derive(Debug)]
pub(crate) struct GpuLayer {
    pub input_norm: DeviceBuffer<f32>,
    pub attn: GpuAttn,
    pub post_norm: DeviceBuffer<f32>,
    pub ffn: GpuFfn,
}

/// A model resident on one CUDA device.
#[derive(Debug)]
pub struct GpuModel {
    pub(crate) dev: CudaDevice,
    pub(crate) config: ModelConfig,
    pub(crate) dims: MlaDims,
    pub(crate) shape: MlaShape,
    pub(crate) embed: GpuMatrix,
    pub(crate) layers: Vec<GpuLayer>,
    pub(crate) norm: DeviceBuffer<f32>,
    pub(crate) lm_head: Option<GpuMatrix>,
    pub(crate) rope: Rope,
    pub(crate) scale: f32,
    pub(crate) mode: GpuMode,
    pub(crate) policy: FormPolicy,
    pub(crate) absorbed: AbsorbedKernel,
}

/// The attention kernels' shape for `d`, with the tile pipeline tuned for `dev`'s card.
fn mla_shape(d: &MlaDims, dev: &CudaDevice) -> MlaShape {
    MlaShape::new(
        d.latent_width(),
        d.kv_lora_rank,
        d.qk_head_dim(),
        d.v_head_dim,
    )
    .tuned_for(dev.compute_capability())
}

impl GpuModel {
    /// Uploads every weight of `model` to `dev`, keeping each tensor's element type.
    pub fn upload(
        dev: &CudaDevice,
        model: &DeepseekModel,
        mode: GpuMode,
    ) -> Result<Self, ModelError> {
        let p = model.parts();
        let c = model.config();
        let up = |m: &Matrix| GpuMatrix::upload(dev, m);
        let vecf = |v: &[f32]| dev.upload(v);
        let mut layers = Vec::with_capacity(p.layers.len());
        for layer in p.layers {
            let w = &layer.attn;
            let q = match &w.q {
                QueryProj::LowRank { a, norm, b } => GpuQuery::LowRank {
                    a: up(a)?,
                    norm: vecf(norm)?,
                    b: up(b)?,
                },
                QueryProj::Full(m) => GpuQuery::Full(up(m)?),
            };
            let attn = GpuAttn {
                q,
                kv_a: up(&w.kv_a)?,
                kv_a_norm: vecf(&w.kv_a_norm)?,
                kv_b: up(&w.kv_b)?,
                o: up(&w.o)?,
            };
            let ffn = match &layer.ffn {
                Ffn::Dense(mlp) => GpuFfn::Dense {
                    gate: up(&mlp.gate)?,
                    up: up(&mlp.up)?,
                    down: up(&mlp.down)?,
                },
                Ffn::Moe(moe) => {
                    let n_shared = if moe.shared.is_some() {
                        c.n_shared_experts.max(1)
                    } else {
                        0
                    };
                    GpuFfn::Moe {
                        router: up(&moe.router)?,
                        bias: vecf(&moe.correction_bias)?,
                        experts: stack_experts(dev, &moe.experts, moe.shared.as_ref(), n_shared)?,
                        routing: RouteParams {
                            n_experts: moe.routing.n_experts as i32,
                            top_k: moe.routing.top_k as i32,
                            n_group: moe.routing.n_group as i32,
                            topk_group: moe.routing.topk_group as i32,
                            norm_topk: i32::from(moe.routing.norm_topk_prob),
                            n_shared: n_shared as i32,
                            scale: moe.routing.routed_scaling_factor,
                        },
                    }
                }
            };
            layers.push(GpuLayer {
                input_norm: vecf(&layer.input_norm)?,
                attn,
                post_norm: vecf(&layer.post_norm)?,
                ffn,
            });
        }
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(up(p.lm_head)?)
        };
        Ok(Self {
            dev: dev.clone(),
            config: c.clone(),
            dims: p.dims,
            shape: mla_shape(&p.dims, dev),
            embed: up(p.embed)?,
            layers,
            norm: vecf(p.norm)?,
            lm_head,
            rope: p.rope.clone(),
            scale: p.scale,
            mode,
            policy: FormPolicy::CostModel,
            absorbed: AbsorbedKernel::Tile,
        })
    }

    /// Which absorbed-form kernel [`GpuMode::Fast`] uses: [`AbsorbedKernel::Tile`] (the
    /// default: 16-row head tiles, other head counts zero-padded), `Packed` or `Generic`.
    pub fn set_absorbed_kernel(&mut self, kernel: AbsorbedKernel) {
        self.absorbed = kernel;
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// The numerics mode.
    pub fn mode(&self) -> GpuMode {
        self.mode
    }

    /// Overrides how each chunk's attention form is chosen (tests, benchmarks).
    pub fn set_policy(&mut self, policy: FormPolicy) {
        self.policy = policy;
    }

    /// A zeroed latent cache for this model: `num_blocks` blocks of `page_size` tokens per
    /// layer, f32 in [`GpuMode::Exact`], bf16 in [`GpuMode::Fast`].
    pub fn new_kv_cache(
        &self,
        num_blocks: usize,
        page_size: usize,
    ) -> Result<GpuKvCache, ModelError> {
        GpuKvCache::new(
            &self.dev,
            crate::kv::KvLayout {
                num_layers: self.layers.len(),
                num_blocks,
                page_size,
                width: self.config.latent_width(),
            },
            self.mode == GpuMode::Fast,
        )
    }

    /// Bytes of weights read per decoded token (dense weights, `top_k` routed + shared
    /// experts per MoE layer, one embedding row and the LM head), for the roofline.
    pub fn active_weight_bytes(&self) -> usize {
        let mut total = self.embed.bytes() / self.config.vocab_size.max(1);
        total += self.lm_head.as_ref().unwrap_or(&self.embed).bytes();
        for l in &self.layers {
            let a = &l.attn;
            total += match &a.q {
                GpuQuery::LowRank { a, b, .. } => a.bytes() + b.bytes(),
                GpuQuery::Full(m) => m.bytes(),
            };
            total += a.kv_a.bytes() + a.kv_b.bytes() + a.o.bytes();
            total += match &l.ffn {
                GpuFfn::Dense { gate, up, down } => gate.bytes() + up.bytes() + down.bytes(),
                GpuFfn::Moe {
                    router,
                    experts,
                    routing,
                    ..
                } => {
                    let per = (experts.gate.bytes() + experts.up.bytes() + experts.down.bytes())
                        / experts.total().max(1);
                    router.bytes() + per * (routing.top_k + routing.n_shared) as usize
                }
            };
        }
        total
    }
}

/// Stacks routed experts (and the shared expert split into `n_shared` chunks of the routed
/// width) into one `[E_total·inter][hidden]` gate/up and `[E_total·hidden][inter]` down.
/// All-bf16 experts stay bf16; anything else is widened to f32 (exact).
fn stack_experts(
    dev: &CudaDevice,
    experts: &[GatedMlp],
    shared: Option<&GatedMlp>,
    n_shared: usize,
) -> Result<GpuExperts, ModelError> {
    let first = experts
        .first()
        .ok_or_else(|| ModelError::Invalid("an MoE layer has no experts".into()))?;
    let (inter, hidden) = (first.intermediate(), first.hidden());
    let mut gates: Vec<Matrix> = Vec::new();
    let mut ups: Vec<Matrix> = Vec::new();
    let mut downs: Vec<Matrix> = Vec::new();
    for e in experts {
        gates.push(e.gate.clone());
        ups.push(e.up.clone());
        downs.push(e.down.clone());
    }
    if let Some(s) = shared {
        if s.intermediate() != inter * n_shared {
            return Err(ModelError::Invalid(format!(
                "shared expert width {} is not {n_shared} × the routed width {inter}",
                s.intermediate()
            )));
        }
        for k in 0..n_shared {
            gates.push(s.gate.slice_rows(k * inter, inter)?);
            ups.push(s.up.slice_rows(k * inter, inter)?);
            downs.push(columns(&s.down, k * inter, inter)?);
        }
    }
    let all_bf16 = gates
        .iter()
        .chain(&ups)
        .chain(&downs)
        .all(|m| matches!(m.data(), ferry_kernels::cpu::MatrixData::Bf16(_)));
    let stack = |ms: &[Matrix], cols: usize| -> Result<GpuMatrix, ModelError> {
        let rows: usize = ms.iter().map(Matrix::rows).sum();
        let data = if all_bf16 {
            let mut v: Vec<u16> = Vec::with_capacity(rows * cols);
            for m in ms {
                if let ferry_kernels::cpu::MatrixData::Bf16(d) = m.data() {
                    v.extend(d.iter().map(|x| x.to_bits()));
                }
            }
            GpuMatrixData::Bf16(dev.upload(&v)?)
        } else {
            let mut v: Vec<f32> = Vec::with_capacity(rows * cols);
            for m in ms {
                v.extend(m.to_f32_vec());
            }
            GpuMatrixData::F32(dev.upload(&v)?)
        };
        Ok(GpuMatrix::from_parts(rows, cols, data)?)
    };
    Ok(GpuExperts {
        gate: stack(&gates, hidden)?,
        up: stack(&ups, hidden)?,
        down: stack(&downs, inter)?,
        inter,
        hidden,
    })
}

/// Columns `start..start + count` of `m` as a new matrix of the same element type.
fn columns(m: &Matrix, start: usize, count: usize) -> Result<Matrix, ModelError> {
    let cols = m.cols();
    if start + count > cols {
        return Err(ModelError::Invalid(format!(
            "columns {start}..{} of a {cols}-column matrix",
            start + count
        )));
    }
    Ok(match m.data() {
        ferry_kernels::cpu::MatrixData::Bf16(d) => {
            let v: Vec<bf16> = d
                .chunks_exact(cols)
                .flat_map(|r| r[start..start + count].iter().copied())
                .collect();
            Matrix::from_bf16(m.rows(), count, v)?
        }
        ferry_kernels::cpu::MatrixData::F32(d) => {
            let v: Vec<f32> = d
                .chunks_exact(cols)
                .flat_map(|r| r[start..start + count].iter().copied())
                .collect();
            Matrix::from_f32(m.rows(), count, v)?
        }
    })
}
