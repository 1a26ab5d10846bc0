//! The batched forward.

use ferry_kernels::cpu::gemm::linear;
use ferry_kernels::cpu::norm::rms_norm_inplace;

use super::attention::{FormPolicy, LayerBatch};
use super::batch::{BatchGeometry, BatchInputs, BatchOutput};
use super::{DeepseekModel, Ffn};
use crate::kv::KvPool;
use crate::ModelError;

/// Called after each layer's KV is written: `(layer, pool)`.
pub type LayerHook<'a> = dyn FnMut(usize, &KvPool) -> Result<(), ModelError> + 'a;

/// Called after each decoder layer with the residual stream leaving it, `(layer, [T][hidden])`
/// for the whole batch in batch order (a speculative drafter taps its context from these).
pub type HiddenHook<'a> = dyn FnMut(usize, &[f32]) -> Result<(), ModelError> + 'a;

/// The callbacks of [`DeepseekModel::forward_with_hooks`].
pub struct ForwardHooks<'h, 'a> {
    /// See [`LayerHook`].
    pub after_layer: &'h mut LayerHook<'a>,
    /// See [`HiddenHook`].
    pub hidden: &'h mut HiddenHook<'a>,
}

impl DeepseekModel {
    /// Runs one batch with the cost model choosing each chunk's attention form.
    ///
    /// Every sequence's new tokens are appended to its block table's positions in `kv`; the
    /// caller owns the tables (and advances them afterwards). The batch is validated first, so
    /// a bad sequence fails the batch before any cache row is written.
    pub fn forward(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut KvPool,
    ) -> Result<BatchOutput, ModelError> {
        self.forward_with(batch, kv, FormPolicy::CostModel)
    }

    /// [`Self::forward`] with an explicit attention-form policy.
    pub fn forward_with(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut KvPool,
        policy: FormPolicy,
    ) -> Result<BatchOutput, ModelError> {
        self.forward_hooked(batch, kv, policy, &mut |_, _| Ok(()))
    }

    /// [`Self::forward_with`], calling `after_layer(l, kv)` as soon as layer `l`'s latent rows
    /// for every new token are in the cache (right after its attention, before its MLP), so a
    /// prefill worker can ship that layer's KV while the next layers compute.
    pub fn forward_hooked(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut KvPool,
        policy: FormPolicy,
        after_layer: &mut LayerHook<'_>,
    ) -> Result<BatchOutput, ModelError> {
        let hooks = ForwardHooks {
            after_layer,
            hidden: &mut |_, _| Ok(()),
        };
        self.forward_with_hooks(batch, kv, policy, hooks)
    }

    /// [`Self::forward_hooked`], also calling `hooks.hidden(l, h)` with the residual stream
    /// after each layer `l` (all new tokens of the batch, `[T][hidden]`).
    pub fn forward_with_hooks(
        &self,
        batch: &BatchInputs<'_>,
        kv: &mut KvPool,
        policy: FormPolicy,
        hooks: ForwardHooks<'_, '_>,
    ) -> Result<BatchOutput, ModelError> {
        let ForwardHooks {
            after_layer,
            hidden: after_block,
        } = hooks;
        self.validate(batch, kv)?;
        let hidden = self.config.hidden_size;
        let geo = BatchGeometry::new(&batch.seqs);
        let t = geo.positions.len();

        let mut h = vec![0.0f32; t * hidden];
        let tokens = batch.seqs.iter().flat_map(|s| s.tokens.iter());
        for (row, &tok) in h.chunks_exact_mut(hidden).zip(tokens) {
            self.embed.row_f32(tok as usize, row)?;
        }

        let layer_batch = LayerBatch {
            seqs: &batch.seqs,
            geo: &geo,
            policy,
        };
        let mut x = vec![0.0f32; t * hidden];
        let mut ffn_out = vec![0.0f32; t * hidden];
        for (l, layer) in self.layers.iter().enumerate() {
            x.copy_from_slice(&h);
            rms_norm_inplace(&mut x, &layer.input_norm, self.config.rms_norm_eps)?;
            let attn = self.attention(l, &x, &layer_batch, kv)?;
            after_layer(l, kv)?;
            add_assign(&mut h, &attn);

            x.copy_from_slice(&h);
            rms_norm_inplace(&mut x, &layer.post_norm, self.config.rms_norm_eps)?;
            match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(&x, &mut ffn_out)?,
                Ffn::Moe(moe) => moe.forward(&x, &mut ffn_out)?,
            }
            add_assign(&mut h, &ffn_out);
            after_block(l, &h)?;
        }

        // Final norm and LM head only on the rows someone asked for.
        let wanted = geo.logit_rows(&batch.seqs);
        let mut picked = Vec::new();
        for r in &wanted {
            picked.extend_from_slice(&h[r.start * hidden..r.end * hidden]);
        }
        rms_norm_inplace(&mut picked, &self.norm, self.config.rms_norm_eps)?;
        let vocab = self.config.vocab_size;
        let n_rows = picked.len() / hidden;
        let mut logits = vec![0.0f32; n_rows * vocab];
        linear(&picked, self.lm_head(), &mut logits)?;
        let rows_per_seq: Vec<usize> = wanted.iter().map(|r| r.len()).collect();
        BatchOutput::from_rows(&logits, &rows_per_seq, vocab)
    }

    /// Embedding rows of `tokens` into `out` (`[tokens][hidden]`): the input layer a drafter
    /// shares with this model.
    pub fn embed_tokens(&self, tokens: &[u32], out: &mut [f32]) -> Result<(), ModelError> {
        let hidden = self.config.hidden_size;
        if out.len() != tokens.len() * hidden {
            return Err(ModelError::Invalid(format!(
                "embed_tokens: `out` holds {} floats, {} tokens need {}",
                out.len(),
                tokens.len(),
                tokens.len() * hidden
            )));
        }
        for (row, &tok) in out.chunks_exact_mut(hidden).zip(tokens) {
            self.embed.row_f32(tok as usize, row)?;
        }
        Ok(())
    }

    /// `out = x · lm_headᵀ` for rows `x` that are already normalised (`[rows][hidden]` →
    /// `[rows][vocab]`): the output layer a drafter shares with this model.
    pub fn lm_head_logits(&self, x: &[f32], out: &mut [f32]) -> Result<(), ModelError> {
        Ok(linear(x, self.lm_head(), out)?)
    }

    /// Rejects a batch that would index out of range anywhere, naming the sequence and field.
    fn validate(&self, batch: &BatchInputs<'_>, kv: &KvPool) -> Result<(), ModelError> {
        batch.check(&self.config, self.layers.len(), kv.layout())
    }
}

fn add_assign(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}
