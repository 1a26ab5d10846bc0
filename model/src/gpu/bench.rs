//! Single-stream decode throughput of a random-weight model on the GPU, against the roofline.
//!
//! The model has DeepSeek-V2-Lite-like shapes ([`v2_lite_like_config`]: hidden 2048, 27
//! layers, 16 heads, full-rank q, kv_lora 512, 64 routed experts top-6 + 2 shared, one dense
//! layer, vocab 102400) with weights drawn on the device, so nothing is downloaded. The
//! cache is pre-filled with `context` random latent rows, then `steps` greedy decode steps run
//! through [`DeepseekModel::forward_logits`] (eager) and [`DeepseekModel::replay_decode_logits`]
//! (CUDA graph) as the serving engine drives them: the greedy token is picked on the device and
//! only the token ids come back between steps.
//! Roofline: (active weight bytes + latent bytes read per token) / measured copy bandwidth.

use std::time::Instant;

use ferry_kernels::backend::mlp::Dense;
use ferry_kernels::backend::moe::Moe;
use ferry_kernels::backend::sample::argmax as device_argmax;
use ferry_kernels::backend::{AttnKernels, Backend, Tensor, Weight};
use ferry_kernels::cpu::mla::MlaDims;
use ferry_kernels::cpu::rope::Rope;
use ferry_kernels::cuda::ops::{fill_random_bf16, GpuExperts, RouteParams};
use ferry_kernels::cuda::{CudaDevice, GpuMatrix};
use ferry_kernels::gpu::ops::shared_expert_ids;

use super::{GpuKvCache, GpuMode};
use crate::config::ModelConfig;
use crate::deepseek::{
    BatchInputs, BatchLogits, DeepseekModel, Ffn, FormPolicy, Hooks, Layer, LogitsWanted,
    MlaWeights, QueryProj, SeqInput,
};
use crate::kv::BlockId;
use crate::ModelError;

/// `config.json` text of the DeepSeek-V2-Lite-like benchmark model (DeepseekV3 architecture,
/// so sigmoid routing; V2-Lite's own gating is softmax — same bytes moved).
pub const V2_LITE_LIKE: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
  "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
  "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
  "num_key_value_heads": 16, "q_lora_rank": null, "kv_lora_rank": 512,
  "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
  "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
  "n_group": 1, "topk_group": 1, "norm_topk_prob": false, "routed_scaling_factor": 1.0,
  "first_k_dense_replace": 1, "moe_layer_freq": 1, "scoring_func": "sigmoid",
  "topk_method": "noaux_tc", "hidden_act": "silu", "max_position_embeddings": 163840,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
  "bos_token_id": 0, "eos_token_id": 1
}"#;

/// The parsed [`V2_LITE_LIKE`] config.
pub fn v2_lite_like_config() -> Result<ModelConfig, ModelError> {
    Ok(ModelConfig::from_json_str(V2_LITE_LIKE)?)
}

/// Draws random bf16 weights (uniform, variance-preserving scale) on `dev`.
struct Draw<'a> {
    dev: &'a CudaDevice,
    seed: u64,
}

impl Draw<'_> {
    fn matrix(&mut self, rows: usize, cols: usize) -> Result<GpuMatrix, ModelError> {
        self.seed += 1;
        let scale = (3.0 / cols as f32).sqrt();
        Ok(GpuMatrix::random_bf16(
            self.dev, rows, cols, self.seed, scale,
        )?)
    }

    fn weight(&mut self, rows: usize, cols: usize) -> Result<Weight, ModelError> {
        Ok(Weight::Cuda(self.matrix(rows, cols)?))
    }

    fn ones(&self, n: usize) -> Result<Tensor, ModelError> {
        Ok(Tensor::Cuda(self.dev.upload(&vec![1.0f32; n])?))
    }
}

impl DeepseekModel {
    /// A model on `dev` with `config`'s shapes and random bf16 weights drawn on the device (norm
    /// weights 1, routing bias 0). For benchmarks: its outputs mean nothing.
    pub fn random(
        dev: &CudaDevice,
        config: ModelConfig,
        mode: GpuMode,
    ) -> Result<Self, ModelError> {
        Self::random_seeded(dev, config, mode, 0)
    }

    /// [`Self::random`] from `seed` (`--load-format dummy --dummy-seed`): the same seed gives
    /// the same weights on every CUDA device (not the host's dummy weights, which are drawn by
    /// another generator).
    pub fn random_seeded(
        dev: &CudaDevice,
        config: ModelConfig,
        mode: GpuMode,
        seed: u64,
    ) -> Result<Self, ModelError> {
        let c = &config;
        let dims = MlaDims {
            heads: c.num_attention_heads,
            kv_lora_rank: c.kv_lora_rank,
            qk_nope_head_dim: c.qk_nope_head_dim,
            qk_rope_head_dim: c.qk_rope_head_dim,
            v_head_dim: c.v_head_dim,
        };
        let mut draw = Draw {
            dev,
            seed: seed.wrapping_mul(1 << 20).wrapping_add(1),
        };
        let h = c.hidden_size;
        let q_out = dims.heads * dims.qk_head_dim();
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let q = match c.q_lora_rank {
                Some(r) => QueryProj::LowRank {
                    a: draw.weight(r, h)?,
                    norm: draw.ones(r)?,
                    b: draw.weight(q_out, r)?,
                },
                None => QueryProj::Full(draw.weight(q_out, h)?),
            };
            let attn = MlaWeights {
                q,
                kv_a: draw.weight(dims.latent_width(), h)?,
                kv_a_norm: draw.ones(dims.kv_lora_rank)?,
                kv_b: draw.weight(dims.heads * dims.kv_b_rows_per_head(), dims.kv_lora_rank)?,
                o: draw.weight(h, dims.heads * dims.v_head_dim)?,
            };
            let ffn = if c.is_moe_layer(l) {
                let (e, inter) = (
                    c.n_routed_experts + c.n_shared_experts,
                    c.moe_intermediate_size,
                );
                Ffn::Moe(Box::new(Moe::Cuda {
                    router: draw.matrix(c.n_routed_experts, h)?,
                    bias: dev.zeros::<f32>(c.n_routed_experts)?,
                    experts: GpuExperts {
                        gate: draw.matrix(e * inter, h)?,
                        up: draw.matrix(e * inter, h)?,
                        down: draw.matrix(e * h, inter)?,
                        inter,
                        hidden: h,
                        shared_ids: shared_expert_ids(dev, c.n_routed_experts, c.n_shared_experts)?,
                        route_done: dev.zeros::<u32>(1)?,
                    },
                    routing: RouteParams {
                        n_experts: c.n_routed_experts as i32,
                        top_k: c.num_experts_per_tok as i32,
                        n_group: c.n_group as i32,
                        topk_group: c.topk_group as i32,
                        norm_topk: i32::from(c.norm_topk_prob),
                        n_shared: c.n_shared_experts as i32,
                        scale: c.routed_scaling_factor,
                        softmax: i32::from(c.scoring == crate::config::Scoring::Softmax),
                    },
                }))
            } else {
                Ffn::Dense(Box::new(Dense::Cuda {
                    gate: draw.matrix(c.intermediate_size, h)?,
                    up: draw.matrix(c.intermediate_size, h)?,
                    down: draw.matrix(h, c.intermediate_size)?,
                }))
            };
            layers.push(Layer {
                input_norm: draw.ones(h)?,
                attn,
                post_norm: draw.ones(h)?,
                ffn,
            });
        }
        let embed = draw.weight(c.vocab_size, h)?;
        let lm_head = Some(draw.weight(c.vocab_size, h)?);
        let norm = draw.ones(h)?;
        let rope = Rope::new(&c.rope)?;
        Ok(Self {
            backend: Backend::Cuda(dev.clone()),
            dims,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            scale: c.softmax_scale(),
            kernels: AttnKernels {
                precision: mode.precision(),
                ..AttnKernels::default()
            },
            policy: FormPolicy::CostModel,
            prompt_chunk_floats: crate::deepseek::PROMPT_LOGITS_CHUNK_FLOATS,
            config,
        })
    }
}

impl GpuKvCache {
    /// Fills every bf16 row with noise (benchmarks start decoding after a random context).
    pub fn fill_random(&self, dev: &CudaDevice) -> Result<(), ModelError> {
        for l in 0..self.layout().num_layers {
            let p = self.pages(l)?;
            if p.bf16 {
                let n = p.num_blocks * p.page_size * p.row();
                let view = ferry_kernels::cuda::ops::Dv::<u16>::raw(p.ptr, n);
                fill_random_bf16(dev, view, 100 + l as u64, 1.0)?;
            }
        }
        Ok(())
    }
}

/// Result of [`decode_throughput`].
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeReport {
    /// Sequences decoded together (one token each per step).
    pub batch: usize,
    /// Cached tokens of each sequence before the first step.
    pub context: usize,
    /// Steps timed.
    pub steps: usize,
    /// Decode steps per second, eager launches (wall clock, device argmax included); a step
    /// decodes `batch` tokens.
    pub steps_per_s: f64,
    /// The same through a captured CUDA graph ([`DeepseekModel::replay_decode`]), or why not.
    pub graph_steps_per_s: Result<f64, String>,
    /// Weight bytes read per token of a single stream (attention, dense layers, router, the
    /// `top_k` routed and the shared experts, lm_head).
    pub weight_bytes: usize,
    /// Weight bytes a step of `batch` tokens needs at least: every weight but the routed
    /// experts once, plus each MoE layer's routed experts expected to be touched by `batch`
    /// tokens under uniform routing (`E · (1 − (1 − k/E)^batch)` of them).
    pub distinct_weight_bytes: f64,
    /// Latent bytes read per token (all layers, at the mean context of the run).
    pub kv_bytes: usize,
    /// Steps per second the bandwidth allows: `bandwidth / (distinct weight + batch · kv bytes)`.
    pub roofline_steps_per_s: f64,
}

impl DecodeReport {
    /// Tokens per second through the graph if it ran, else eager.
    pub fn best_tokens_per_s(&self) -> f64 {
        self.batch as f64 * self.graph_steps_per_s.clone().unwrap_or(self.steps_per_s)
    }

    /// Bytes a step needs ÷ the best step time, in GB/s.
    pub fn effective_gbs(&self) -> f64 {
        let step_bytes = self.distinct_weight_bytes + (self.batch * self.kv_bytes) as f64;
        step_bytes * self.best_tokens_per_s() / self.batch as f64 / 1e9
    }
}

/// Routed expert bytes of one expert (gate, up and down), the experts per token and per layer,
/// and the MoE layers of `model`.
fn routed_expert_bytes(model: &DeepseekModel) -> (f64, f64, f64, usize) {
    let c = &model.config;
    let per_expert = 3.0 * (c.hidden_size * c.moe_intermediate_size) as f64 * 2.0; // bf16
    let moe_layers = (0..c.num_hidden_layers)
        .filter(|&l| c.is_moe_layer(l))
        .count();
    (
        per_expert,
        c.num_experts_per_tok as f64,
        c.n_routed_experts as f64,
        moe_layers,
    )
}

/// One decode step's inputs: sequence `i` gets `seqs[i]`'s tokens at its position and `tables[i]`.
fn batch_inputs<'a>(seqs: &'a [(Vec<u32>, usize)], tables: &'a [Vec<BlockId>]) -> BatchInputs<'a> {
    BatchInputs {
        prompt_logprobs: Vec::new(),
        drafts_on_device: None,
        seqs: seqs
            .iter()
            .zip(tables)
            .map(|((tokens, pos), table)| SeqInput {
                tokens,
                start_pos: *pos,
                block_table: table,
                logits: LogitsWanted::Last,
            })
            .collect(),
    }
}

/// Greedy decode of `batch` sequences for `steps` steps after `context` random cached tokens
/// each, every step one token per sequence in one forward; `bandwidth_gbs` (measured copy
/// bandwidth) sets the roofline. `batch` 1 is single-stream decode.
pub fn decode_throughput(
    model: &DeepseekModel,
    batch: usize,
    context: usize,
    steps: usize,
    bandwidth_gbs: f64,
) -> Result<DecodeReport, ModelError> {
    let dev = model.cuda_device()?;
    let page = 64;
    let per_seq = (context + steps + 1).div_ceil(page);
    let mut kv = model.new_kv_cache(batch * per_seq, page)?;
    kv.fill_random(dev)?;
    let tables: Vec<Vec<BlockId>> = (0..batch)
        .map(|s| {
            (0..per_seq)
                .map(|b| BlockId((s * per_seq + b) as u32))
                .collect()
        })
        .collect();
    let inputs = |pos: usize, toks: &[[u32; 1]]| -> Vec<(Vec<u32>, usize)> {
        toks.iter().map(|t| (t.to_vec(), pos)).collect()
    };
    // Greedy tokens picked where the logits are, as the engine does: only the token ids come
    // back to the host, not `batch` rows of the vocabulary.
    let vocab = model.config.vocab_size;
    let pick = |logits: &BatchLogits, toks: &mut [[u32; 1]]| -> Result<(), ModelError> {
        let ids = device_argmax(&model.backend, &logits.logits, vocab)?.to_host()?;
        for (t, id) in toks.iter_mut().zip(ids) {
            t[0] = u32::try_from(id).unwrap_or(0);
        }
        Ok(())
    };
    let mut tokens = vec![[1u32]; batch];
    let mut step = |pos: usize, toks: &mut [[u32; 1]]| -> Result<(), ModelError> {
        let seqs = inputs(pos, toks);
        let batch = batch_inputs(&seqs, &tables);
        let out = model.forward_logits(&batch, &mut kv, model.policy, Hooks::default())?;
        pick(&out, toks)
    };
    // Warm-up: compiles every kernel and fills the allocator's pool.
    step(context, &mut tokens)?;
    let start = Instant::now();
    for i in 0..steps {
        step(context + 1 + i, &mut tokens)?;
    }
    let secs = start.elapsed().as_secs_f64();
    let steps_per_s = steps as f64 / secs.max(f64::MIN_POSITIVE);

    // The same steps again (rewinding the positions) through a captured graph.
    let plan_ctx = per_seq * page;
    let graph_steps_per_s = (|| -> Result<f64, ModelError> {
        let mut toks = vec![[1u32]; batch];
        let first = inputs(context, &toks);
        let mut g = model.capture_decode(&batch_inputs(&first, &tables), &mut kv, plan_ctx, &[])?;
        let out = model.replay_decode_logits(&mut g, &batch_inputs(&first, &tables), &kv, batch)?;
        pick(&out, &mut toks)?;
        let start = Instant::now();
        for i in 0..steps {
            let seqs = inputs(context + 1 + i, &toks);
            let out =
                model.replay_decode_logits(&mut g, &batch_inputs(&seqs, &tables), &kv, batch)?;
            pick(&out, &mut toks)?;
        }
        Ok(steps as f64 / start.elapsed().as_secs_f64().max(f64::MIN_POSITIVE))
    })()
    .map_err(|e| e.to_string());
    let weight_bytes = model.active_weight_bytes();
    let (per_expert, k, e, moe_layers) = routed_expert_bytes(model);
    let touched = e * (1.0 - (1.0 - k / e).powi(batch as i32));
    let distinct_weight_bytes =
        weight_bytes as f64 - moe_layers as f64 * per_expert * (k - touched);
    let mean_ctx = context + 1 + steps / 2;
    let row_bytes = model.kv_dtype().row_bytes(model.config.latent_width());
    let kv_bytes = model.layers.len() * mean_ctx * row_bytes;
    let roofline = bandwidth_gbs * 1e9 / (distinct_weight_bytes + (batch * kv_bytes) as f64);
    Ok(DecodeReport {
        batch,
        context,
        steps,
        steps_per_s,
        graph_steps_per_s,
        weight_bytes,
        distinct_weight_bytes,
        kv_bytes,
        roofline_steps_per_s: roofline,
    })
}

/// Seconds one prefill forward of a fresh `tokens`-token sequence takes (the logits of its last
/// row copied back, as a prefill worker needs them), the median of `runs` after a warm-up.
pub fn prefill_seconds(
    model: &DeepseekModel,
    tokens: usize,
    runs: usize,
) -> Result<f64, ModelError> {
    let page = 64;
    let blocks = tokens.div_ceil(page);
    let mut kv = model.new_kv_cache(blocks, page)?;
    let table: Vec<BlockId> = (0..blocks as u32).map(BlockId).collect();
    let ids: Vec<u32> = (0..tokens)
        .map(|i| (i * 7919 % model.config.vocab_size) as u32)
        .collect();
    let batch = BatchInputs {
        prompt_logprobs: Vec::new(),
        drafts_on_device: None,
        seqs: vec![SeqInput {
            tokens: &ids,
            start_pos: 0,
            block_table: &table,
            logits: LogitsWanted::Last,
        }],
    };
    model.forward(&batch, &mut kv)?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        let start = Instant::now();
        model.forward(&batch, &mut kv)?;
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v2_lite_like_config_parses() {
        let c = v2_lite_like_config().expect("valid config");
        assert_eq!(c.hidden_size, 2048);
        assert_eq!(c.num_hidden_layers, 27);
        assert_eq!(c.num_attention_heads, 16);
        assert_eq!(c.n_routed_experts, 64);
        assert_eq!(c.num_experts_per_tok, 6);
        assert_eq!(c.latent_width(), 576);
        assert!(c.q_lora_rank.is_none());
    }
}
