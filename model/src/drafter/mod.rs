//! Speculative-decoding drafters: the DSpark block drafter and the interface the engine drives.
//!
//! | file | owns |
//! |---|---|
//! | [`config`] | the drafter's `config.json` → [`DrafterConfig`] |
//! | [`dspark`] | [`DsparkDrafter`]: weights, context K/V, the one-pass block forward |
//! | [`heads`] | the Markov head (the `q` drafts are drawn from) and the confidence head |
//! | [`mod@self`] | the [`Drafter`] trait, its inputs and outputs, the drafter KV layout |
//!
//! ```text
//!  target forward (any batch) ── hidden states after target_layer_ids ──► extend_context
//!        concat → fc → RMSNorm → per drafter layer K, V ──► drafter KV pool (same BlockIds)
//!  propose: [anchor, MASK × (B−1)] at positions n..n+B ── queries from the block only,
//!        bidirectional inside it, attending every committed context row ── target LM head
//!        ── Markov head, left to right ──► B drafts, their q, B confidences
//! ```
//!
//! The drafter KV pool has the target pool's geometry (page size, block count, row width) and
//! is addressed through the target's block tables, so a sequence's blocks hold both its target
//! KV and its drafter context; see [`DraftKvLayout`] for how a drafter row wider than a target
//! row is split over several pool layers. That also makes the drafter context travel with the
//! target KV as extra layers of the same transfer (`docs/spec_decode.md`).

pub mod config;
pub mod dspark;
pub mod heads;

pub use config::DrafterConfig;
pub use dspark::DsparkDrafter;

use std::path::PathBuf;

use ferry_kernels::cpu::sample::SamplingParams;

use crate::deepseek::DeepseekModel;
use crate::kv::{BlockId, KvLayout, KvPool};
use crate::ModelError;

/// The source checkout's copy of the embedded drafter, `models/tiny-k3-dspark` (trained by
/// `scripts/make_tiny_k3.py train-drafter`, self-distilled from the embedded target), with its
/// golden data; tests read it. A binary finds the drafter through [`default_for`], which also
/// works with no source tree (the weights are compiled in).
pub fn embedded_dir() -> PathBuf {
    ferry_modelcard::embedded::DRAFTER.source_dir()
}

/// The drafter to use by default for the target in `target_dir`: the embedded drafter
/// (compiled into the binary, unpacked on first use) when the target is the embedded model
/// (its `config.json` byte-identical to the embedded one); else none.
pub fn default_for(target_dir: &std::path::Path) -> Result<Option<PathBuf>, ModelError> {
    Ok(ferry_modelcard::embedded::default_drafter_for(target_dir).transpose()?)
}

/// How drafter context rows (`kv_width` floats: K then V of every KV head) are stored in a pool
/// whose rows are `row_width` floats (the target's latent width): drafter layer `l`'s row is
/// split into `chunks = ⌈kv_width / row_width⌉` pieces, piece `c` in pool layer
/// `l · chunks + c` (the last piece zero-padded). K3's drafter (2 × 16 × 64 = 2048 floats)
/// takes 4 pool layers of 576 per drafter layer; the embedded one (2 × 2 × 32 = 128) takes 2 of 80.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftKvLayout {
    /// Drafter layers.
    pub layers: usize,
    /// Floats per context row per drafter layer.
    pub kv_width: usize,
    /// Floats per pool row (the target's latent width).
    pub row_width: usize,
}

impl DraftKvLayout {
    /// Pool layers per drafter layer.
    pub fn chunks(&self) -> usize {
        self.kv_width.div_ceil(self.row_width.max(1))
    }

    /// Pool layers in all (what travels as extra transfer layers).
    pub fn pool_layers(&self) -> usize {
        self.layers * self.chunks()
    }

    /// The drafter pool's geometry next to a target pool of geometry `target`.
    pub fn pool_layout(&self, target: &KvLayout) -> KvLayout {
        KvLayout {
            num_layers: self.pool_layers(),
            num_blocks: target.num_blocks,
            page_size: target.page_size,
            width: self.row_width,
        }
    }

    /// Writes drafter layer `at.layer`'s context row for position `pos` of the sequence with
    /// block table `at.table`.
    pub fn write_row(
        &self,
        pool: &mut KvPool,
        at: DraftRows<'_>,
        pos: usize,
        row: &[f32],
    ) -> Result<(), ModelError> {
        let DraftRows { layer, table } = at;
        let w = self.row_width;
        for c in 0..self.chunks() {
            let dst = pool.row_mut(layer * self.chunks() + c, table, pos)?;
            let src = row.get(c * w..).unwrap_or_default();
            let n = src.len().min(w);
            dst[..n].copy_from_slice(&src[..n]);
            dst[n..].fill(0.0);
        }
        Ok(())
    }

    /// Reads drafter layer `at.layer`'s context rows for positions `0..len` into `out`
    /// (`[len][kv_width]`).
    pub fn read_rows(
        &self,
        pool: &KvPool,
        at: DraftRows<'_>,
        len: usize,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let DraftRows { layer, table } = at;
        let page = pool.layout().page_size;
        let (w, kw) = (self.row_width, self.kv_width);
        if out.len() != len * kw {
            return Err(ModelError::Kv(format!(
                "drafter context buffer holds {} floats, {len} rows need {}",
                out.len(),
                len * kw
            )));
        }
        if table.len() * page < len {
            return Err(ModelError::Kv(format!(
                "drafter context of {len} positions is beyond the block table ({} blocks)",
                table.len()
            )));
        }
        for c in 0..self.chunks() {
            let lo = c * w;
            let n = kw.saturating_sub(lo).min(w);
            for (b, &block) in table.iter().enumerate().take(len.div_ceil(page)) {
                let data = pool.block(layer * self.chunks() + c, block)?;
                let rows = (len - b * page).min(page);
                for r in 0..rows {
                    let pos = b * page + r;
                    out[pos * kw + lo..pos * kw + lo + n].copy_from_slice(&data[r * w..r * w + n]);
                }
            }
        }
        Ok(())
    }
}

/// One drafter layer's rows of one sequence.
#[derive(Debug, Clone, Copy)]
pub struct DraftRows<'a> {
    /// Drafter layer.
    pub layer: usize,
    /// The sequence's block table.
    pub table: &'a [BlockId],
}

/// Where committed rows of a target batch go in the drafter's context.
#[derive(Debug, Clone, Copy)]
pub struct ContextSegment<'a> {
    /// The sequence's block table.
    pub block_table: &'a [BlockId],
    /// Position of the first row.
    pub start_pos: usize,
    /// First row in the tapped buffers.
    pub first_row: usize,
    /// Rows to write.
    pub rows: usize,
}

/// Tapped target hidden states and where their committed rows belong.
#[derive(Debug, Clone, Copy)]
pub struct ContextRows<'a> {
    /// Per tapped layer, in [`Drafter::taps`] order: `[batch rows][hidden]`.
    pub taps: &'a [Vec<f32>],
    /// The rows to turn into context, per sequence.
    pub segments: &'a [ContextSegment<'a>],
}

/// One sequence to draft for.
#[derive(Debug, Clone, Copy)]
pub struct DraftInput<'a> {
    /// The last sampled token, not yet in the target cache: the block's first input.
    pub anchor: u32,
    /// Committed positions (the anchor sits at this position).
    pub context_len: usize,
    /// The sequence's block table (drafter context is read through it).
    pub block_table: &'a [BlockId],
    /// The committed tokens, `context_len` of them (test drafters read them; DSpark reads its
    /// context from the pool).
    pub tokens: &'a [u32],
    /// The request's sampling parameters: greedy requests get argmax drafts.
    pub params: &'a SamplingParams,
    /// One uniform per block position, for sampled drafts.
    pub uniforms: &'a [f64],
}

/// What the drafts were drawn from (the verifier's `q`).
#[derive(Debug, Clone, PartialEq)]
pub enum DraftDist {
    /// Argmax drafts: `q_k = δ(x_k)`.
    Greedy,
    /// `[drafts][vocab]`: the exact distribution each draft was sampled from.
    Sampled(Vec<f32>),
}

/// A drafter's block for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Proposal {
    /// Draft tokens, in order (at most [`Drafter::block_size`]).
    pub drafts: Vec<u32>,
    /// Their distributions.
    pub q: DraftDist,
    /// Per draft, the predicted probability that it survives given the previous ones did
    /// (non-anticipating: computed without looking at that draft).
    pub confidence: Vec<f32>,
}

/// The target model and the drafter pool, for a drafter call.
pub struct DraftCtx<'a> {
    /// The target (shared embedding and LM head).
    pub target: &'a DeepseekModel,
    /// The drafter KV pool (`None` for drafters without context).
    pub pool: Option<&'a KvPool>,
}

/// A drafter the engine can drive. [`DsparkDrafter`] is the real one; tests plug in drafters of
/// known behaviour (always right, always wrong, deliberately broken).
pub trait Drafter: Send {
    /// Drafts per pass (B).
    fn block_size(&self) -> usize;

    /// Target layers whose outputs the context needs (empty: no context).
    fn taps(&self) -> &[usize];

    /// How context rows are stored (`None`: no drafter KV pool).
    fn kv_layout(&self) -> Option<DraftKvLayout>;

    /// Turns committed rows' tapped hidden states into context K/V in `pool`.
    fn extend_context(
        &self,
        target: &DeepseekModel,
        pool: &mut KvPool,
        rows: &ContextRows<'_>,
    ) -> Result<(), ModelError>;

    /// Drafts a block for each input, in one batched pass; one result per input.
    fn propose(
        &self,
        ctx: &DraftCtx<'_>,
        inputs: &[DraftInput<'_>],
    ) -> Vec<Result<Proposal, ModelError>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_wider_than_the_pool_split_over_layers_and_round_trip() {
        let target = KvLayout {
            num_layers: 4,
            num_blocks: 6,
            page_size: 4,
            width: 5,
        };
        let l = DraftKvLayout {
            layers: 2,
            kv_width: 12,
            row_width: 5,
        };
        assert_eq!((l.chunks(), l.pool_layers()), (3, 6));
        let mut pool = KvPool::new(l.pool_layout(&target)).expect("valid layout");
        let table = [BlockId(3), BlockId(1), BlockId(5)];
        let row = |layer: usize, pos: usize| -> Vec<f32> {
            (0..12)
                .map(|j| (layer * 1000 + pos * 100 + j) as f32)
                .collect()
        };
        for layer in 0..2 {
            for pos in 0..10 {
                let at = DraftRows {
                    layer,
                    table: &table,
                };
                l.write_row(&mut pool, at, pos, &row(layer, pos))
                    .expect("in range");
            }
        }
        for layer in 0..2 {
            let mut out = vec![0.0; 10 * 12];
            let at = DraftRows {
                layer,
                table: &table,
            };
            l.read_rows(&pool, at, 10, &mut out).expect("in range");
            for pos in 0..10 {
                assert_eq!(&out[pos * 12..(pos + 1) * 12], row(layer, pos).as_slice());
            }
        }
        // The padding of the last piece stays zero; a short table is an error.
        let last = pool.block(2, BlockId(3)).expect("in range");
        assert_eq!(&last[2..5], &[0.0, 0.0, 0.0]);
        let at = DraftRows {
            layer: 0,
            table: &table[..1],
        };
        assert!(l.read_rows(&pool, at, 10, &mut vec![0.0; 120]).is_err());
    }
}
