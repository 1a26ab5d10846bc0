//! Speculative-decoding drafters: the DSpark block drafter and the interface the engine drives.
//!
//! | file | owns |
//! |---|---|
//! | [`config`] | the drafter's `config.json` → [`DrafterConfig`] |
//! | [`dspark`] | [`DsparkDrafter`]: weights, context K/V, the one-pass block forward |
//! | [`heads`] | the Markov head (the `q` drafts are drawn from) and the confidence head |
//! | [`mod@self`] | the [`Drafter`] trait, its inputs and outputs, the drafter KV layout |
//!
//! The drafter runs where its target runs: its weights, its KV and every op of its passes are
//! on the target's [`Backend`] (the one op-level backend the target's forward uses), so on a
//! GPU the tapped hidden states never leave the device and the drafts' `q` stays there for the
//! verifier.
//!
//! ```text
//!  target forward (any batch) ── hidden states after target_layer_ids ──► extend_context
//!        concat → fc → RMSNorm → per drafter layer K, V ──► drafter KV (same BlockIds)
//!  propose: [anchor, MASK × (B−1)] at positions n..n+B ── queries from the block only,
//!        bidirectional inside it, attending every committed context row ── target LM head
//!        ── Markov head, left to right ──► B drafts, their q, B confidences
//! ```
//!
//! The drafter KV has the target pool's page size and block count and is addressed through the
//! target's block tables, so a sequence's blocks hold both its target KV and its drafter
//! context; on the wire, drafter rows travel as extra layers of the target's transfer, split
//! to the target's row width ([`DraftKvLayout`], `docs/spec_decode.md`).

pub mod config;
pub mod dspark;
pub mod heads;

pub use config::DrafterConfig;
pub use dspark::DsparkDrafter;

use std::path::PathBuf;

use ferry_kernels::backend::rows::DraftIds;
use ferry_kernels::backend::{Backend, Ints, Tensor};
use ferry_kernels::cpu::sample::SamplingParams;

use crate::deepseek::DeepseekModel;
use crate::kv::{BlockId, KvLayout, KvStore};
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

/// Where drafter context rows live. On every device the drafter's own KV is **natural**: per
/// drafter layer a paged `[block][page][kv_width]` f32 region (K of every KV head, then V),
/// addressed through the target's block tables ([`DraftKvLayout::rows_layout`]) — what the
/// drafter's block attention reads. On the **wire** the rows travel as extra transfer layers of
/// the target's geometry (rows `row_width` = the target's latent width): drafter layer `l`'s
/// row is split into `chunks = ⌈kv_width / row_width⌉` pieces, piece `c` in wire layer
/// `l · chunks + c` (the last piece zero-padded). K3's drafter (2 × 16 × 64 = 2048 floats)
/// takes 4 wire layers of 576 per drafter layer; the embedded one (2 × 2 × 32 = 128) takes 2
/// of 80. [`DraftKvLayout::to_wire`] / [`DraftKvLayout::from_wire`] convert one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftKvLayout {
    /// Drafter layers.
    pub layers: usize,
    /// Floats per context row per drafter layer.
    pub kv_width: usize,
    /// Floats per wire row (the target's latent width).
    pub row_width: usize,
}

impl DraftKvLayout {
    /// Wire layers per drafter layer.
    pub fn chunks(&self) -> usize {
        self.kv_width.div_ceil(self.row_width.max(1))
    }

    /// Wire layers in all (what travels as extra transfer layers).
    pub fn pool_layers(&self) -> usize {
        self.layers * self.chunks()
    }

    /// The wire layers' geometry next to a target pool of geometry `target` (what a transfer
    /// carries: rows of the target's width).
    pub fn pool_layout(&self, target: &KvLayout) -> KvLayout {
        KvLayout {
            num_layers: self.pool_layers(),
            num_blocks: target.num_blocks,
            page_size: target.page_size,
            width: self.row_width,
        }
    }

    /// The drafter's own rows next to a target pool of geometry `target`: one layer per drafter
    /// layer, `kv_width` floats per row.
    pub fn rows_layout(&self, target: &KvLayout) -> KvLayout {
        KvLayout {
            num_layers: self.layers,
            num_blocks: target.num_blocks,
            page_size: target.page_size,
            width: self.kv_width,
        }
    }

    /// Piece `chunk` of one block of natural rows (`[page][kv_width]`) as wire rows
    /// (`[page][row_width]`, zero-padded).
    pub fn to_wire(
        &self,
        natural: &[f32],
        chunk: usize,
        wire: &mut [f32],
    ) -> Result<(), ModelError> {
        let (kw, w) = (self.kv_width, self.row_width);
        let lo = chunk * w;
        let n = kw.saturating_sub(lo).min(w);
        self.check_block(natural, wire)?;
        for (src, dst) in natural.chunks_exact(kw).zip(wire.chunks_exact_mut(w)) {
            dst[..n].copy_from_slice(&src[lo..lo + n]);
            dst[n..].fill(0.0);
        }
        Ok(())
    }

    /// The inverse of [`Self::to_wire`]: piece `chunk` of wire rows into natural rows.
    pub fn from_wire(
        &self,
        wire: &[f32],
        chunk: usize,
        natural: &mut [f32],
    ) -> Result<(), ModelError> {
        let (kw, w) = (self.kv_width, self.row_width);
        let lo = chunk * w;
        let n = kw.saturating_sub(lo).min(w);
        self.check_block(natural, wire)?;
        for (src, dst) in wire.chunks_exact(w).zip(natural.chunks_exact_mut(kw)) {
            dst[lo..lo + n].copy_from_slice(&src[..n]);
        }
        Ok(())
    }

    fn check_block(&self, natural: &[f32], wire: &[f32]) -> Result<(), ModelError> {
        let (kw, w) = (self.kv_width.max(1), self.row_width.max(1));
        if natural.len() % kw != 0 || wire.len() % w != 0 || natural.len() / kw != wire.len() / w {
            return Err(ModelError::Kv(format!(
                "a drafter block of {} natural floats (rows of {kw}) does not match {} wire floats (rows of {w})",
                natural.len(),
                wire.len()
            )));
        }
        Ok(())
    }
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
    /// Per tapped layer, in [`Drafter::taps`] order: `[batch rows][hidden]` on the target's
    /// backend (copied there by the forward, never downloaded on a GPU).
    pub taps: &'a [Tensor],
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
    /// context from its KV).
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
    /// `[drafts][vocab]` on the host: the exact distribution each draft was sampled from.
    Sampled(Vec<f32>),
    /// Rows `first..first + drafts` of the call's [`Proposals::q`] (on the drafter's backend):
    /// the exact distribution each draft was sampled from, left where it was computed.
    Rows {
        /// The first draft's row.
        first: usize,
    },
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

/// A pass's greedy drafts and confidences still on the drafter's backend
/// ([`Drafter::propose_queued`]), step-major like the pass writes them: block position `k`'s
/// for every input at `[k · width ..]`.
#[derive(Debug)]
pub struct QueuedDrafts {
    drafts: Ints,
    confidence: Tensor,
    /// Inputs of the pass, padding included (the row stride).
    width: usize,
    /// The real inputs: the first `seqs` of each row.
    seqs: usize,
    block: usize,
}

impl QueuedDrafts {
    /// `[block][width]` drafts and confidences of which the first `seqs` of each row are real.
    pub fn new(
        drafts: Ints,
        confidence: Tensor,
        (width, seqs, block): (usize, usize, usize),
    ) -> Self {
        Self {
            drafts,
            confidence,
            width,
            seqs,
            block,
        }
    }

    /// The inputs drafted for.
    pub fn seqs(&self) -> usize {
        self.seqs
    }

    /// What a verify batch of these inputs, in order, `gamma` drafts each, takes as
    /// [`crate::deepseek::BatchInputs::drafts_on_device`].
    pub fn ids(&self, gamma: usize) -> DraftIds<'_> {
        DraftIds {
            drafts: &self.drafts,
            width: self.width,
            seqs: self.seqs,
            gamma: gamma.min(self.block),
        }
    }

    /// Each input's proposal, as [`Drafter::propose`] would have returned it (two downloads,
    /// which wait for whatever was queued behind the pass).
    pub fn collect(&self) -> Result<Vec<Result<Proposal, ModelError>>, ModelError> {
        let drafts = self.drafts.to_host()?;
        let confidence = self.confidence.to_host()?;
        let greedy = vec![false; self.seqs];
        Ok(proposals_from(
            (&drafts, &confidence),
            self.width,
            self.block,
            &greedy,
        ))
    }
}

/// Each input's proposal from a pass's step-major host outputs (`[block][width]` drafts and
/// confidences), one per entry of `sampled` (whether that input's drafts were sampled, so its
/// distributions are rows of the pass's q, or greedy). A draft of -1 (no valid distribution)
/// fails its input's proposal.
pub(crate) fn proposals_from(
    (drafts, confidence): (&[i32], &[f32]),
    width: usize,
    block: usize,
    sampled: &[bool],
) -> Vec<Result<Proposal, ModelError>> {
    sampled
        .iter()
        .enumerate()
        .map(|(s, &sampled)| {
            let ids: Vec<i32> = (0..block).map(|k| drafts[k * width + s]).collect();
            if let Some(k) = ids.iter().position(|&t| t < 0) {
                return Err(ModelError::Invalid(format!(
                    "drafter Markov head: block position {k} has no valid distribution"
                )));
            }
            Ok(Proposal {
                drafts: ids.iter().map(|&t| t as u32).collect(),
                q: if sampled {
                    DraftDist::Rows { first: s * block }
                } else {
                    DraftDist::Greedy
                },
                confidence: (0..block).map(|k| confidence[k * width + s]).collect(),
            })
        })
        .collect()
}

/// What one [`Drafter::propose`] call drafted.
#[derive(Debug)]
pub struct Proposals {
    /// One result per input, in order.
    pub each: Vec<Result<Proposal, ModelError>>,
    /// `[rows][vocab]` on the drafter's backend, the rows [`DraftDist::Rows`] proposals name
    /// (`None` when no proposal does).
    pub q: Option<Tensor>,
}

impl Proposals {
    /// Proposals without shared rows (host drafters).
    pub fn host(each: Vec<Result<Proposal, ModelError>>) -> Self {
        Self { each, q: None }
    }

    /// Every proposal failed with `msg`.
    pub fn failed(n: usize, msg: &str) -> Self {
        Self::host(
            (0..n)
                .map(|_| Err(ModelError::Invalid(msg.to_string())))
                .collect(),
        )
    }
}

/// The target model and the drafter's KV, for a drafter call.
pub struct DraftCtx<'a> {
    /// The target (shared embedding and LM head), on the backend the drafter runs on.
    pub target: &'a DeepseekModel,
    /// The drafter's context rows (`None` for drafters without context).
    pub kv: Option<&'a KvStore>,
}

/// A drafter the engine can drive. [`DsparkDrafter`] is the real one; tests plug in drafters of
/// known behaviour (always right, always wrong, deliberately broken).
pub trait Drafter: Send {
    /// Drafts per pass (B).
    fn block_size(&self) -> usize;

    /// Target layers whose outputs the context needs (empty: no context).
    fn taps(&self) -> &[usize];

    /// How context rows are stored (`None`: no drafter KV).
    fn kv_layout(&self) -> Option<DraftKvLayout>;

    /// Moves the drafter's weights onto `b`, the backend its target runs on (drafters without
    /// weights keep this default).
    fn to_backend(&mut self, b: &Backend) -> Result<(), ModelError> {
        let _ = b;
        Ok(())
    }

    /// Whether passes may be replayed from CUDA graphs (the engine's `cuda_graphs` on a GPU;
    /// drafters without device passes keep this default).
    fn set_graphs(&mut self, on: bool) {
        let _ = on;
    }

    /// Pass graphs captured so far (a recapture counts again; drafters without graphs keep
    /// this default): a pass during which this grew paid the capture.
    fn graph_captures(&self) -> u64 {
        0
    }

    /// Turns committed rows' tapped hidden states into context K/V in `kv` (natural rows on the
    /// target's backend, [`DraftKvLayout::rows_layout`]).
    fn extend_context(
        &self,
        target: &DeepseekModel,
        kv: &mut KvStore,
        rows: &ContextRows<'_>,
    ) -> Result<(), ModelError>;

    /// Drafts a block for each input, in one batched pass; one result per input.
    fn propose(&self, ctx: &DraftCtx<'_>, inputs: &[DraftInput<'_>]) -> Proposals;

    /// [`Self::propose`] for greedy inputs, with the drafts and confidences left where the
    /// pass ran: nothing is downloaded and nothing waits for the pass, so a verify forward can
    /// be queued behind it ([`QueuedDrafts::ids`]) and the drafts read after it
    /// ([`QueuedDrafts::collect`]). `None` where this drafter or these inputs cannot (the
    /// caller proposes as usual).
    fn propose_queued(
        &self,
        ctx: &DraftCtx<'_>,
        inputs: &[DraftInput<'_>],
    ) -> Option<Result<QueuedDrafts, ModelError>> {
        let _ = (ctx, inputs);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_wider_than_the_wire_split_over_layers_and_round_trip() {
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
        assert_eq!(l.pool_layout(&target).width, 5);
        assert_eq!(l.rows_layout(&target).num_layers, 2);
        let natural: Vec<f32> = (0..4 * 12).map(|i| i as f32 + 1.0).collect();
        let mut back = vec![0.0; natural.len()];
        for c in 0..l.chunks() {
            let mut wire = vec![-1.0; 4 * 5];
            l.to_wire(&natural, c, &mut wire).expect("one block");
            if c == 2 {
                // The last piece holds 2 floats per row; the padding is zero.
                assert_eq!(&wire[2..5], &[0.0, 0.0, 0.0]);
            }
            l.from_wire(&wire, c, &mut back).expect("one block");
        }
        assert_eq!(back, natural);
        // A block of the wrong size is an error, not a panic.
        assert!(l.to_wire(&natural[..12], 0, &mut [0.0; 20]).is_err());
    }
}
