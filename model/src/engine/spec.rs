//! Speculative decoding inside continuous batching.
//!
//! One engine step with a drafter:
//!
//! ```text
//!  plan:    every eligible running sequence → one batched drafter pass (on the model's
//!           backend) → B drafts each, their q (left on the backend), their confidences →
//!           verify length γ per sequence (confidence or fixed, under a per-step budget of
//!           draft slots) → reserve γ more KV positions
//!  forward: the step's one target batch; a drafting sequence feeds [anchor, d_1..d_γ] and asks
//!           for every row's logits; hidden states after the drafter's tap layers are copied
//!           on the backend
//!  verify:  every round of the batch at once, kernels::backend::verify where the logits are
//!           (p from the sampler's own distribution, q as drawn) → accepted a ≤ γ plus a
//!           correction or bonus token per sequence
//!  commit:  the target KV keeps anchor + a accepted drafts; the rest is rolled back
//!           (KvManager::truncate); the drafter context is extended with exactly those a + 1
//!           rows' hidden states; the correction / bonus becomes the next anchor
//! ```
//!
//! A sequence speculates when its request allows it and its drafter context covers every
//! committed position. Every forward of an engine with a drafter extends the context of every
//! row it commits (prefill chunks, plain decode steps, prefill jobs), so a prefix cached here
//! carries valid drafter rows. Rows that are not valid — KV written by a peer that did not ship
//! drafter layers, or a sequence whose context had a gap — mark their blocks *stale* when the
//! sequence is released; a stale block stops speculation for whoever reuses it, until the block
//! is allocated afresh.
//!
//! Randomness: drafts and the verifier's uniforms come from per-round streams derived from
//! `(seed, step)` for seeded requests (salted apart, and apart from plain sampling), from the
//! request's own stream otherwise. A seeded request is reproducible with speculation on, and
//! its output has the plain sampler's distribution, though not its exact token sequence.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use ferry_kernels::backend::rows::DraftIds;
use ferry_kernels::backend::{Backend, Tensor};
use ferry_kernels::KernelError;

use super::goodput::{widths, Choice, Goodput, Observed, Shape};
use super::landing::{DraftLanding, Landed};
use super::sequence::{round_uniforms, Phase, Sequence};
use super::{DeviceKvWriter, SeqId};
use crate::deepseek::DeepseekModel;
use crate::drafter::{
    ContextRows, ContextSegment, DraftCtx, DraftDist, DraftInput, DraftKvLayout, Drafter, Proposal,
    Proposals, QueuedDrafts,
};
use crate::kv::{BlockId, KvDtype, KvLayout, KvStore, LayerRows};
use crate::ModelError;

/// Stream salts: draft sampling and verification draw from independent streams.
const DRAFT_SALT: u64 = 0x6472_6166_7473_0001;
const VERIFY_SALT: u64 = 0x7665_7269_6679_0002;

/// How many drafts each sequence has verified per step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum VerifyLen {
    /// Always `n` (capped by the block size and what the request still needs). On a GPU,
    /// when every running sequence drafted, each verifies `n` drafts its context has room
    /// for, also past what its request needs (a uniform round: one graph's shape). `0`
    /// drafts every step and verifies nothing (the drafter's cost alone; greedy sequences'
    /// drafts are still scored by the tokens decoded after them).
    Fixed(usize),
    /// Admit draft slots in decreasing order of cumulative predicted survival
    /// `Π_{j≤k} c_j` while it is at least `min_survival` and the step's budget lasts.
    Confidence {
        /// Smallest cumulative survival worth a verify slot.
        min_survival: f32,
    },
    /// Verify what the measured costs say pays at the batch's current size
    /// ([`super::goodput`]): the confidence head's survivals, calibrated by what was
    /// accepted, against this engine's own step costs; no drafter pass at all when
    /// speculation would not pay. Until the costs are measured it verifies like
    /// `confidence:0.3`. The default: sessions 19 and 27 measured it never to cost much
    /// against plain decoding; on session 38's H200 pair it lost 29–43 % at 128 concurrent
    /// requests (steps with prompt work, eager rounds; BENCHMARKS.md).
    #[default]
    Goodput,
}

/// The `confidence` floor when none is given, also what `goodput` verifies by while it
/// measures.
const CONFIDENCE_FLOOR: f32 = 0.3;

/// The rule one step verifies by (what a [`VerifyLen`] resolves to for that step).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Rule {
    /// Up to `n` drafts per sequence.
    Fixed(usize),
    /// Exactly `n` drafts for every sequence (all drafted `n` its context has room for): the
    /// shape of one verify graph.
    Uniform(usize),
    /// The most likely slots with cumulative survival at least this, within the budget.
    Confidence(f32),
}

impl fmt::Display for VerifyLen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VerifyLen::Fixed(n) => write!(f, "fixed:{n}"),
            VerifyLen::Confidence { min_survival } => write!(f, "confidence:{min_survival}"),
            VerifyLen::Goodput => write!(f, "goodput"),
        }
    }
}

impl FromStr for VerifyLen {
    type Err = String;

    /// `fixed:N`, `confidence[:MIN_SURVIVAL]` or `goodput`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (kind, arg) = s.split_once(':').unwrap_or((s, ""));
        match (kind, arg) {
            ("fixed", n) => n
                .parse::<usize>()
                .map(VerifyLen::Fixed)
                .map_err(|_| format!("`fixed:N` needs a whole number, got {n:?}")),
            ("confidence", "") => Ok(VerifyLen::Confidence {
                min_survival: CONFIDENCE_FLOOR,
            }),
            ("goodput", "") => Ok(VerifyLen::Goodput),
            ("confidence", m) => match m.parse::<f32>() {
                Ok(v) if (0.0..=1.0).contains(&v) => Ok(VerifyLen::Confidence { min_survival: v }),
                _ => Err(format!(
                    "`confidence:MIN` needs a number in [0, 1], got {m:?}"
                )),
            },
            _ => Err(format!(
                "verify length must be `fixed:N`, `confidence[:MIN]` or `goodput`, got {s:?}"
            )),
        }
    }
}

/// Where a step's draft rows come from: a budget of their own beside the step's token budget
/// (`--max-batch-tokens`, which prompts then keep), or that budget, shared with prompts.
///
/// Under [`DraftBudget::Shared`] a speculating step's drafts take their rows first and the
/// prompts waiting beside it get what is left: at 256 sequences a `fixed:4` round's 1,024
/// drafts leave a 2,048-row step ~770 prompt rows against plain decoding's ~1,800, so prompts
/// wait for more steps, each of which pays attention over every running sequence's context
/// (session 57: TTFT 1.1 s against plain's 52 ms at c = 256). Under [`DraftBudget::Beside`]
/// prompts keep the budget plain decoding gives them and drafts are bounded as before but
/// apart (the same size, and `--max-verify-tokens` for eager slots), so a step carries up to
/// twice `--max-batch-tokens` rows; the `goodput` policy then prices every step beside waiting
/// prompts by the rows its decode part adds (the line of `goodput`'s steps with prompts).
/// `Beside` is the default since session 58's lease (an H100, the trained pair, every prompt
/// prefilled): `goodput` served 1.02× / 1.05× / 1.12× of `Shared` at c = 128 / 192 / 256, with
/// TTFT p50 59 / 419 / 865 ms against 400 / 1,051 / 1,718 (BENCHMARKS.md, session 58).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DraftBudget {
    /// Drafts and prompts share the step's token budget, drafts first (the rule before
    /// session 58; the A/B's control).
    Shared,
    /// Drafts have a budget of their own; prompts keep the step's.
    #[default]
    Beside,
}

impl fmt::Display for DraftBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DraftBudget::Shared => "shared",
            DraftBudget::Beside => "beside",
        })
    }
}

impl FromStr for DraftBudget {
    type Err = String;

    /// `shared` or `beside`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "shared" => Ok(DraftBudget::Shared),
            "beside" => Ok(DraftBudget::Beside),
            _ => Err(format!(
                "draft budget must be `shared` or `beside`, got {s:?}"
            )),
        }
    }
}

/// Speculation policy of an engine.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecConfig {
    /// Verify length per sequence.
    pub verify_len: VerifyLen,
    /// Draft slots verified per step across the batch (the verify budget for eager slots).
    pub max_verify_tokens: usize,
    /// Whether drafts share the step's token budget with prompts.
    pub draft_budget: DraftBudget,
}

impl Default for SpecConfig {
    fn default() -> Self {
        Self {
            verify_len: VerifyLen::default(),
            max_verify_tokens: 64,
            draft_budget: DraftBudget::default(),
        }
    }
}

/// The drafts one sequence verifies this step.
#[derive(Debug, Clone)]
pub(crate) struct Draft {
    /// The target's inputs: the anchor, then the γ drafts.
    pub tokens: Vec<u32>,
    /// Their q (`[γ][vocab]` when sampled).
    pub q: DraftDist,
    /// The γ drafts' cumulative survivals as the confidence head predicted them, for the
    /// `goodput` policy's calibration.
    pub survival: Vec<f32>,
}

impl Draft {
    /// γ.
    pub fn gamma(&self) -> usize {
        self.tokens.len() - 1
    }

    /// Accepted drafts the head predicted: the sum of the slots' cumulative survivals.
    pub fn predicted(&self) -> f64 {
        self.survival.iter().map(|&p| f64::from(p)).sum()
    }
}

/// Drafts of a greedy sequence that the step did not verify, waiting for the tokens decoded
/// after them: greedy verification accepts exactly the drafts that match what the target
/// decodes, so those tokens say how many this round would have accepted, at no cost (the
/// `goodput` policy's evidence about the rounds it skips; see [`counterfactual`]).
#[derive(Debug, Clone)]
struct Shadow {
    /// Index in the sequence's tokens where the round's anchor lands (drafts follow it).
    anchor_at: usize,
    drafts: Vec<u32>,
    survival: Vec<f32>,
}

/// Pending shadows a sequence keeps at most (a plain step after every drafter pass makes one
/// per step; each resolves within a block's worth of tokens).
const MAX_SHADOWS: usize = 16;

/// How many of `drafts` greedy verification would accept when the target goes on with
/// `decoded` (its tokens after the anchor): the matching prefix. `None` while `decoded` is too
/// short to tell.
fn counterfactual(drafts: &[u32], decoded: impl IntoIterator<Item = u32>) -> Option<usize> {
    let mut decoded = decoded.into_iter();
    for (k, &d) in drafts.iter().enumerate() {
        match decoded.next() {
            None => return None,
            Some(t) if t != d => return Some(k),
            Some(_) => {}
        }
    }
    Some(drafts.len())
}

/// A round that a shadow says the head promised `predicted` drafts for and would have
/// accepted `accepted`, for [`super::EngineStats::spec_skipped_by_prediction`].
pub(crate) type Resolved = (f64, usize);

/// The drafter, its KV and the block bookkeeping of an engine.
pub(crate) struct Speculator {
    drafter: Box<dyn Drafter>,
    layout: Option<DraftKvLayout>,
    /// The drafter's context rows, natural layout, on the engine's backend.
    kv: Option<KvStore>,
    /// The target pool's geometry (the wire layers are shaped after it).
    target: KvLayout,
    config: SpecConfig,
    /// Blocks whose drafter rows do not match their target KV.
    stale: HashSet<BlockId>,
    /// A peer's drafter rows per reserved block, assembled in the natural layout as its wire
    /// layers arrive (through [`Self::write_kv`] on the engine thread, or from the decode
    /// worker's receiving thread under `FERRY_DIRECT_KV_WRITES=all`) and, on a GPU, stored in
    /// the drafter KV as each block completes; [`Self::remote_landed`] takes them. `None`
    /// without drafter KV.
    landing: Option<Arc<DraftLanding>>,
    /// Rounds run at a uniform width on a GPU: when every running sequence drafted, each
    /// verifies the same γ drafts (the whole block unless the verify length picks fewer; see
    /// [`Self::plan`]). Entry γ is the most running sequences such a round is replayed for
    /// from a graph (the backend's verify-graph limit, `gpu::graph::graph_max_seqs(γ + 1)` on
    /// CUDA): a larger batch's round runs eagerly, and `goodput` costs it as the eager round it
    /// is. `None` on the CPU.
    uniform_graphs: Option<Vec<usize>>,
    /// The `goodput` policy's measurements (kept whatever the policy; used by `goodput`).
    goodput: Goodput,
    /// The last drafter pass: sequences and seconds, until the engine reports the step.
    last_pass: Option<(usize, f64)>,
    /// The drafter's graph captures when the last step was reported: a step after which it
    /// grew paid a capture ([`Self::observe_step`]).
    drafter_captures: u64,
    /// Host seconds this step spent writing deferred drafter context ([`Self::flush`]): the
    /// plain steps' deferred work, which `goodput`'s estimates leave out of the step that
    /// happened to write it (a round after a run of plain steps would look that much dearer).
    flush_secs: f64,
    /// Under `goodput`: committed rows of plain steps whose drafter context is written later.
    deferred: Deferred,
    /// Drafts of greedy sequences not verified, until the tokens after them resolve them.
    shadows: HashMap<SeqId, Vec<Shadow>>,
    /// This step's round, when its drafts stayed on the device ([`Self::plan`]): the verify
    /// forward reads them there, and [`Self::fill_queued`] brings them to the host after it.
    queued: Option<QueuedDrafts>,
}

/// Committed rows of plain decode steps whose drafter context is not written yet.
///
/// Under `goodput` a step that does not speculate should cost what a plain engine's step
/// costs, but every committed row must become drafter context before its sequence drafts
/// again. So a plain decode step only copies its tapped rows here (one copy per tap layer), and
/// the context of all of them is written in one pass right before the next drafter pass that
/// needs it, before any step that writes context itself, or when the buffer is full. Rows of a
/// sequence that ended before then are dropped: its blocks are marked stale from its written
/// context on, as for any gap.
#[derive(Default)]
struct Deferred {
    /// Per tap layer, `[capacity rows][hidden]` on the model's backend (allocated on first use).
    taps: Vec<Tensor>,
    /// Rows held.
    rows: usize,
    /// Rows the buffers hold at most.
    capacity: usize,
    /// (sequence, first position, first row here, rows).
    segments: Vec<(SeqId, usize, usize, usize)>,
    /// Rows held per sequence.
    per_seq: HashMap<SeqId, usize>,
}

/// Bytes the deferred taps may hold (the rows of many plain steps of a large batch).
const DEFERRED_BYTES: usize = 64 << 20;

impl Deferred {
    /// Copies a plain step's tapped rows (`[rows][hidden]` per tap layer) to the end of the
    /// buffers and records `segments` (sequence, first position, first row in `taps`, rows)
    /// at their rows here. `false` (nothing kept) when they do not fit.
    fn keep(
        &mut self,
        backend: &Backend,
        hidden: usize,
        taps: &[Tensor],
        segments: &[(SeqId, usize, usize, usize)],
    ) -> Result<bool, KernelError> {
        let hidden = hidden.max(1);
        let rows = taps.first().map_or(0, |t| t.len() / hidden);
        if taps.iter().any(|t| t.len() != rows * hidden) {
            return Ok(false);
        }
        if self.taps.is_empty() {
            let per_row = hidden * taps.len().max(1) * std::mem::size_of::<f32>();
            self.capacity = (DEFERRED_BYTES / per_row).max(rows);
            self.taps = taps
                .iter()
                .map(|_| backend.scratch(self.capacity * hidden))
                .collect::<Result<_, _>>()?;
        }
        if self.rows + rows > self.capacity || self.taps.len() != taps.len() {
            return Ok(false);
        }
        for (src, dst) in taps.iter().zip(&mut self.taps) {
            backend.copy_into(src, dst, self.rows * hidden)?;
        }
        for &(id, start, first, n) in segments {
            self.segments.push((id, start, self.rows + first, n));
            *self.per_seq.entry(id).or_default() += n;
        }
        self.rows += rows;
        Ok(true)
    }

    /// Empties the buffer's bookkeeping (the rows stay readable until the next [`Self::keep`])
    /// and returns the segments to write, as (index, first position, first row here, rows):
    /// those that continue their sequence's written context in order. `running` gives each
    /// live sequence's index and written context length; rows of other sequences are dropped.
    fn take(
        &mut self,
        running: impl IntoIterator<Item = (SeqId, (usize, usize))>,
    ) -> Vec<(usize, usize, usize, usize)> {
        self.rows = 0;
        self.per_seq.clear();
        if self.segments.is_empty() {
            return Vec::new();
        }
        let mut ctx: HashMap<SeqId, (usize, usize)> = running.into_iter().collect();
        let mut keep = Vec::new();
        for (id, start, first, n) in self.segments.drain(..) {
            if let Some((i, at)) = ctx.get_mut(&id) {
                if *at == start {
                    *at += n;
                    keep.push((*i, start, first, n));
                }
            }
        }
        keep
    }
}

impl Speculator {
    /// A speculator for an engine whose target pool has geometry `target` and stores its rows
    /// as `wire_dtype` (what peers' drafter layers arrive in), and whose model runs on
    /// `backend`: the drafter moves there, and so does its KV. `uniform_graphs`: rounds run at
    /// a uniform width, and one of γ drafts per sequence is replayed from a graph for up to
    /// `limit(γ)` running sequences; `None` on the CPU.
    pub fn new(
        mut drafter: Box<dyn Drafter>,
        (target, wire_dtype): (&KvLayout, KvDtype),
        backend: &Backend,
        config: SpecConfig,
        uniform_graphs: Option<&dyn Fn(usize) -> usize>,
    ) -> Result<Self, ModelError> {
        let block = drafter.block_size();
        let uniform_graphs = uniform_graphs.map(|limit| (0..=block).map(limit).collect());
        drafter.to_backend(backend)?;
        drafter.set_graphs(uniform_graphs.is_some());
        let layout = drafter.kv_layout();
        let kv = layout
            .map(|l| KvStore::new(backend, l.rows_layout(target)))
            .transpose()?;
        let writer = kv.as_ref().and_then(DeviceKvWriter::of_store).transpose()?;
        let landing = layout.map(|l| Arc::new(DraftLanding::new(l, target, wire_dtype, writer)));
        Ok(Self {
            drafter,
            layout,
            kv,
            target: *target,
            config,
            stale: HashSet::new(),
            landing,
            uniform_graphs,
            goodput: Goodput::default(),
            last_pass: None,
            drafter_captures: 0,
            flush_secs: 0.0,
            deferred: Deferred::default(),
            shadows: HashMap::new(),
            queued: None,
        })
    }

    /// Target layers to tap.
    pub fn taps(&self) -> &[usize] {
        self.drafter.taps()
    }

    /// Drafter wire layers (extra transfer layers after the target's).
    pub fn pool_layers(&self) -> usize {
        self.layout.map_or(0, |l| l.pool_layers())
    }

    /// Whether this engine's drafts share the step's token budget with prompts.
    pub fn draft_budget(&self) -> DraftBudget {
        self.config.draft_budget
    }

    /// Whether `drafts` (one entry per running sequence) make a round a graph replays: every
    /// sequence verifies the same γ drafts, γ a width with graphs, the batch within its
    /// verify-graph limit. That is on CUDA with graphs; ROCm's uniform rounds have no limit but
    /// run eagerly, and the CPU has none: the caller checks the device.
    pub fn replays(&self, drafts: &[Option<Draft>]) -> bool {
        let Some(limits) = &self.uniform_graphs else {
            return false;
        };
        let mut gammas = drafts.iter().map(|d| d.as_ref().map(Draft::gamma));
        let Some(Some(gamma)) = gammas.next() else {
            return false;
        };
        gammas.all(|g| g == Some(gamma))
            && widths(self.drafter.block_size()).any(|w| w == gamma)
            && limits.get(gamma).is_some_and(|&n| drafts.len() <= n)
    }

    /// Where peers' drafter wire layers land (see [`Self::landing`]'s field).
    pub fn landing(&self) -> Option<Arc<DraftLanding>> {
        self.landing.clone()
    }

    /// Ships the drafter context of `blocks` through `sink`, one wire layer at a time, in
    /// `dtype` (the engine's cache dtype, which the wire carries in a matched pair; a sink
    /// converts to another). Each drafter layer's rows of `blocks` are read from the drafter KV
    /// at once (on a device, one gather and one download per layer); each wire layer
    /// `l · chunks + c` is then encoded straight from them into one buffer and handed over as a
    /// staged [`LayerRows`] view (blocks in id order; the sink looks each up).
    ///
    /// Before session 41 the rows went through an f32 wire pool (as large as the target's
    /// pool: page faults on first use) and the sink converted each block on its own: 4.4 of a
    /// 1,024-token prompt's 5.6 ms of shipping on an H100, on the prefill worker's engine thread.
    pub fn ship(
        &self,
        blocks: &[BlockId],
        dtype: KvDtype,
        sink: &mut crate::engine::LayerSinkFn,
    ) -> Result<(), String> {
        let Some(layout) = self.layout else {
            return Ok(());
        };
        let kv = self
            .kv
            .as_ref()
            .ok_or("this engine's drafter keeps no KV")?;
        let started = std::time::Instant::now();
        let mut ids = blocks.to_vec();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err(format!(
                "drafter context of a table that repeats a block: {blocks:?}"
            ));
        }
        let wire_layout = layout.pool_layout(&self.target);
        let width = wire_layout.width;
        let block_bytes = dtype.block_bytes(&wire_layout);
        let per_block = layout.rows_layout(&self.target).block_floats().max(1);
        let mut wire = vec![0.0f32; wire_layout.block_floats()];
        let mut bytes = Vec::with_capacity(ids.len() * block_bytes);
        let (mut read, mut encoded, mut sunk) = Default::default();
        for l in 0..layout.layers {
            let t = std::time::Instant::now();
            let natural = kv.read_blocks_of(l, &ids).map_err(|e| e.to_string())?;
            read += t.elapsed();
            for c in 0..layout.chunks() {
                let t = std::time::Instant::now();
                bytes.clear();
                for block in natural.chunks_exact(per_block) {
                    layout
                        .to_wire(block, c, &mut wire)
                        .map_err(|e| e.to_string())?;
                    dtype.encode_into(&wire, width, &mut bytes);
                }
                let layer = l * layout.chunks() + c;
                let rows = LayerRows::staged(layer, (dtype, width), block_bytes, &ids, &bytes)
                    .map_err(|e| e.to_string())?;
                let t2 = std::time::Instant::now();
                encoded += t2 - t;
                sink(layer, blocks, &rows)?;
                sunk += t2.elapsed();
            }
        }
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        tracing::debug!(
            blocks = blocks.len(),
            read_ms = ms(read),
            encode_ms = ms(encoded),
            sink_ms = ms(sunk),
            total_ms = ms(started.elapsed()),
            "drafter context shipped"
        );
        Ok(())
    }

    /// `blocks` were just allocated: whatever they held before is gone.
    pub fn fresh(&mut self, blocks: &[BlockId]) {
        for b in blocks {
            self.stale.remove(b);
        }
        if let Some(landing) = &self.landing {
            landing.forget(blocks);
        }
    }

    /// Leading positions of a `len`-position table over `blocks` whose drafter rows are valid.
    pub fn valid_prefix(&self, blocks: &[BlockId], len: usize, page: usize) -> usize {
        blocks
            .iter()
            .position(|b| self.stale.contains(b))
            .map_or(len, |i| (i * page).min(len))
    }

    /// A sequence released with drafter rows valid only below `valid`: its blocks from there on
    /// are stale (they may stay cached).
    pub fn mark_stale(&mut self, blocks: &[BlockId], valid: usize, page: usize) {
        self.stale.extend(blocks.iter().skip(valid / page).copied());
    }

    /// A peer's run of drafter wire layer `layer` from block `first` on, whole blocks of
    /// little-endian elements of the engine's cache dtype, handed over by the engine thread
    /// (the transfer region's route for the drafter's layers unless
    /// `FERRY_DIRECT_KV_WRITES=all`): the same [`DraftLanding::write`] a receiving thread may
    /// call.
    pub fn write_kv(&mut self, layer: usize, first: BlockId, data: &[u8]) -> Result<(), String> {
        let Some(landing) = &self.landing else {
            return Err("this engine's drafter keeps no KV".into());
        };
        // SAFETY: the scheduler checked that every block of the run is reserved for a peer,
        // and this engine is alive (it is the caller).
        #[allow(unsafe_code)]
        unsafe { landing.write(layer, first, data) }.map_err(|e| e.to_string())
    }

    /// The peer finished: whether every block of `blocks` received every drafter wire layer;
    /// if so, rows not yet stored on a device are written into the drafter KV (one upload per
    /// layer).
    pub fn remote_landed(&mut self, blocks: &[BlockId]) -> bool {
        let Some(landed) = self.landing.as_ref().and_then(|l| l.take(blocks)) else {
            return false;
        };
        let rows: Vec<(BlockId, Vec<f32>)> = blocks
            .iter()
            .zip(landed)
            .filter_map(|(&b, l)| match l {
                Landed::Rows(rows) => Some((b, rows)),
                Landed::Stored => None,
            })
            .collect();
        if rows.is_empty() {
            return true;
        }
        match self.land(&rows) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "drafter context from a peer could not be stored; those sequences do not speculate");
                false
            }
        }
    }

    /// Writes `rows` (per block, natural rows `[layer][page][kv_width]`) into the drafter KV:
    /// per drafter layer, every block's rows at once.
    fn land(&mut self, rows: &[(BlockId, Vec<f32>)]) -> Result<(), ModelError> {
        let (Some(layout), Some(landing), Some(kv)) =
            (self.layout, self.landing.as_ref(), self.kv.as_mut())
        else {
            return Err(ModelError::Kv("no drafter KV to land peer rows in".into()));
        };
        let per_block = landing.per_block();
        let blocks: Vec<BlockId> = rows.iter().map(|(b, _)| *b).collect();
        let mut natural = Vec::with_capacity(rows.len() * per_block);
        for l in 0..layout.layers {
            natural.clear();
            for (_, r) in rows {
                natural.extend_from_slice(&r[l * per_block..(l + 1) * per_block]);
            }
            kv.write_blocks_of(l, &blocks, &natural)?;
        }
        Ok(())
    }

    /// Forgets a failed peer's partial writes.
    pub fn forget_writes(&mut self, blocks: &[BlockId]) {
        if let Some(landing) = &self.landing {
            landing.forget(blocks);
        }
    }

    /// Drafts for every eligible running sequence and picks its verify length; `budget` is the
    /// step's token budget left for draft slots, `prompts` the prompt work waiting beside the
    /// step (the `goodput` policy costs its options with it). One entry per running sequence
    /// (`None`: a plain decode step), and the drafter's shared q rows (on the model's backend)
    /// that [`DraftDist::Rows`] drafts name.
    pub fn plan(
        &mut self,
        model: &DeepseekModel,
        running: &mut [Sequence],
        budget: usize,
        prompts: PromptLoad,
    ) -> (Vec<Option<Draft>>, Option<Tensor>) {
        let max_pos = model.config().max_position_embeddings;
        // A step that never ran its batch must not leave its drafts to this one.
        self.queued = None;
        let mut plan: Vec<Option<Draft>> = vec![None; running.len()];
        let block = self.drafter.block_size();
        // Slots each sequence may verify at most (`room`): what the request still needs after
        // this step's guaranteed token, what the context has room for, the block size. A
        // whole-block round verifies a sequence's whole block wherever the context has room for
        // it (`ctx_room`), also past what the request still needs: the graph computes those
        // rows anyway, and the commit stops emitting at the request's end. So a sequence in its
        // last block keeps the batch in the graph's shape (it used to send the whole batch's
        // round eager, and at 16–64 sequences most rounds had such a sequence).
        let ctx_room: Vec<usize> = running
            .iter()
            .map(|s| max_pos.saturating_sub(s.table.len() + 1).min(block))
            .collect();
        let room: Vec<usize> = running
            .iter()
            .zip(&ctx_room)
            .map(|(s, &ctx)| s.usable_drafts().min(ctx))
            .collect();
        // `FERRY_WHOLE_BLOCK_TAIL=0`: the rule before (the A/B switch).
        let ctx_room = if whole_block_tail() {
            ctx_room
        } else {
            room.clone()
        };
        // Bit γ: a uniform round of γ drafts per sequence of this batch is replayed from a
        // graph (past the verify graph's limit it runs eagerly: `goodput` costs it so; the rule
        // stays the same).
        let uniform = self.uniform_graphs.is_some();
        let graphed: u32 = self.uniform_graphs.as_ref().map_or(0, |limits| {
            widths(block)
                .filter(|&w| w < 32 && limits.get(w).is_some_and(|&n| running.len() <= n))
                .fold(0, |bits, w| bits | (1 << w))
        });
        // The graphed widths up to `max` drafts.
        let widths_for = |max: usize| graphed & (1u32 << (max + 1).min(31)).wrapping_sub(1);
        // Rows whose context is deferred count as written: they are, before any drafting.
        let mut eligible: Vec<usize> = (0..running.len())
            .filter(|&i| {
                let s = &running[i];
                s.speculative
                    && (room[i] > 0 || (uniform && ctx_room[i] >= block))
                    && s.draft_ctx + self.deferred_rows(s.id) == s.table.len()
                    && matches!(s.phase, Phase::Decoding { .. })
            })
            .collect();
        let goodput = self.config.verify_len == VerifyLen::Goodput;
        // With `FERRY_GOODPUT_PROMPTS=1`, `goodput` also leaves the prompt rows waiting beside
        // this step their room in its token budget: drafts take rows before prompts do, so a
        // wide round would push those prompts to a later step and their sequences would join
        // the batch later (session 49: 79 sequences a round at c = 128 against `fixed:4`'s
        // 100). With no room left the step is plain and the prompts fill it.
        // With drafts beside the prompts' budget (`DraftBudget::Beside`) the prompts join the
        // step whatever it verifies, so `goodput` always prices them and the drafts keep the
        // whole budget.
        let beside = self.config.draft_budget == DraftBudget::Beside;
        let prompt_rows = if goodput && (beside || goodput_prompts()) {
            prompts.rows
        } else {
            0
        };
        let step_budget = if beside {
            budget
        } else {
            budget.saturating_sub(prompt_rows)
        };
        let budget = step_budget.min(self.config.max_verify_tokens);
        // Sequences with no use for drafts only keep others' rounds in the graph's shape: with
        // none that can use them, the step is plain (a lone request's last token, as before).
        if !eligible.iter().any(|&i| room[i] > 0) || budget == 0 {
            return (plan, None);
        }
        // A uniform round can be replayed from a graph only if every running sequence drafts
        // (checked again on the proposals below).
        let pre_max = widest_uniform(
            uniform && eligible.len() == running.len(),
            eligible.iter().map(|&i| ctx_room[i]),
            step_budget,
        );
        let shape = Shape {
            seqs: running.len(),
            eligible: eligible.len(),
            block,
            budget,
            graph_widths: widths_for(pre_max),
            uniform: pre_max,
            // Without `FERRY_GOODPUT_PROMPTS=1`: costed as decode-only steps.
            prompt_rows,
            beside_prompts: prompts.rows > 0,
            splits: prompts.splits,
        };
        if goodput && !self.goodput.should_draft(shape) {
            return (plan, None);
        }
        if self.deferred.rows > 0 {
            if let Err(e) = self.flush(model, running) {
                tracing::warn!(error = %e, "writing deferred drafter context failed; those sequences stop speculating");
            }
            eligible.retain(|&i| running[i].draft_ctx == running[i].table.len());
            if eligible.is_empty() {
                return (plan, None);
            }
        }
        let uniforms: Vec<Vec<f64>> = eligible
            .iter()
            .map(|&i| {
                let s = &mut running[i];
                round_uniforms(&s.sampling, s.generated, DRAFT_SALT, &mut s.rng, block)
            })
            .collect();
        let inputs: Vec<DraftInput<'_>> = eligible
            .iter()
            .zip(&uniforms)
            .map(|(&i, u)| {
                let s = &running[i];
                let anchor = match s.phase {
                    Phase::Decoding { next } => next,
                    _ => 0,
                };
                DraftInput {
                    anchor,
                    context_len: s.table.len(),
                    block_table: s.table.blocks(),
                    tokens: &s.tokens,
                    params: &s.sampling,
                    uniforms: u,
                }
            })
            .collect();
        let ctx = DraftCtx {
            target: model,
            kv: self.kv.as_ref(),
        };
        let started = std::time::Instant::now();
        // A round whose width is known before drafting keeps its drafts on the device: the
        // verify forward is queued right behind the drafter's pass, and the host reads the
        // drafts after it (`fill_queued`), not between the two. That needs every running
        // sequence drafting greedily at one width the rule fixes without the confidences:
        // `fixed:N` within every context's room, or the whole block under `confidence`.
        // (`goodput` picks after reading the confidences, except beside waiting prompts under
        // `FERRY_GOODPUT_QUEUED=1`, where it picks from its acceptance estimates first.)
        let queued_width = match self.config.verify_len {
            VerifyLen::Fixed(n) if n > 0 && n.min(block) <= pre_max => Some(n.min(block)),
            VerifyLen::Confidence { .. } if pre_max >= block => Some(block),
            // Beside waiting prompts `goodput` may pick its uniform width before drafting
            // (`FERRY_GOODPUT_QUEUED=1`, opt-in until a GPU lease measures it).
            VerifyLen::Goodput if goodput_queued() => self
                .goodput
                .width_before_drafting(shape)
                .filter(|&g| g <= pre_max),
            _ => None,
        }
        .filter(|_| {
            queued_drafts()
                && uniform
                && eligible.len() == running.len()
                && model.backend().device().is_gpu()
                && running.iter().all(|s| s.sampling.is_greedy())
        });
        if let Some(g) = queued_width {
            match self.drafter.propose_queued(&ctx, &inputs) {
                Some(Ok(queued)) => {
                    self.last_pass = Some((eligible.len(), started.elapsed().as_secs_f64()));
                    for (i, input) in inputs.iter().enumerate() {
                        // Placeholders (a valid id) that the forward overwrites on the device.
                        let mut tokens = vec![0; g + 1];
                        tokens[0] = input.anchor;
                        plan[i] = Some(Draft {
                            tokens,
                            q: DraftDist::Greedy,
                            survival: Vec::new(),
                        });
                    }
                    self.queued = Some(queued);
                    return (plan, None);
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "drafting failed; plain decode step");
                    return (plan, None);
                }
                None => {}
            }
        }
        // On the CPU the pass runs on rayon's threads, as the target's forward does
        // (`Backend::forward`); a GPU pass stays on the engine thread, whose device it uses.
        let proposals = if model.backend().device().is_gpu() {
            self.drafter.propose(&ctx, &inputs)
        } else {
            let (drafter, ctx, ins) = (&mut self.drafter, &ctx, &inputs);
            rayon::scope(move |_| drafter.propose(ctx, ins))
        };
        self.last_pass = Some((eligible.len(), started.elapsed().as_secs_f64()));
        drop(inputs);
        let vocab = model.config().vocab_size;
        let Proposals { each, q } = proposals;

        let mut slots: Vec<Slot> = Vec::new();
        let mut props = Vec::with_capacity(eligible.len());
        for (&i, p) in eligible.iter().zip(each) {
            match p {
                Ok(p) => {
                    let n = p.drafts.len().min(room[i]);
                    let mut survival = 1.0f32;
                    for k in 0..n {
                        survival *= p.confidence.get(k).copied().unwrap_or(0.0);
                        slots.push(Slot {
                            seq: i,
                            k,
                            survival,
                        });
                    }
                    props.push((i, p));
                }
                Err(e) => {
                    tracing::warn!(seq = running[i].id.0, error = %e, "drafting failed; plain decode step");
                }
            }
        }
        let mut gamma: HashMap<usize, usize> = HashMap::new();
        let mut left = budget;
        // On a GPU, when every running sequence drafted, a round in which each verifies the
        // same γ drafts its context has room for (`uniform_max`: the largest such γ) has one
        // graph's shape: γ + 1 rows per sequence. A round of the whole block verifies all of
        // it (more drafts can only lengthen what is accepted; the graph computes the rows
        // anyway); `fixed:N` verifies N of every block, and `goodput` picks the width, or
        // some slots eagerly, or none. Otherwise the verify-length policy picks γ (within
        // `room`) and the round runs eagerly.
        let uniform_max = widest_uniform(
            uniform && props.len() == running.len(),
            props.iter().map(|(i, p)| p.drafts.len().min(ctx_room[*i])),
            step_budget,
        );
        let whole_blocks = uniform_max >= block;
        // The rule this step verifies by: `goodput` resolves to one of the others.
        let mut policy = match (whole_blocks, self.config.verify_len) {
            (_, VerifyLen::Fixed(0)) => Rule::Fixed(0),
            (_, VerifyLen::Fixed(n)) if n.min(block) <= uniform_max => Rule::Uniform(n.min(block)),
            (true, _) => Rule::Uniform(block),
            (false, VerifyLen::Fixed(n)) => Rule::Fixed(n),
            (false, VerifyLen::Confidence { min_survival }) => Rule::Confidence(min_survival),
            (false, VerifyLen::Goodput) => Rule::Confidence(CONFIDENCE_FLOOR),
        };
        if goodput {
            // Each drafting sequence's cumulative survivals, block order (`slots` holds the
            // drafts it can use, so a uniform round's value counts those only).
            let mut by_seq: Vec<Vec<f32>> = vec![Vec::new(); props.len()];
            let index: HashMap<usize, usize> = props
                .iter()
                .enumerate()
                .map(|(j, (i, _))| (*i, j))
                .collect();
            for sl in &slots {
                if let Some(&j) = index.get(&sl.seq) {
                    by_seq[j].push(sl.survival);
                }
            }
            by_likelihood(&mut slots);
            let survival: Vec<f32> = slots.iter().map(|s| s.survival).collect();
            let shape = Shape {
                eligible: props.len(),
                graph_widths: widths_for(uniform_max),
                uniform: uniform_max,
                ..shape
            };
            policy = match self.goodput.choose(shape, &survival, &by_seq) {
                Choice::Plain => Rule::Fixed(0),
                Choice::Uniform(g) => Rule::Uniform(g.min(uniform_max)),
                // The r most likely slots: the confidence rule with no floor and a budget of r.
                Choice::Slots(r) => {
                    left = r;
                    Rule::Confidence(0.0)
                }
                // Exploring measures what the policy can use: the whole-block round where it
                // is replayed from a graph; past the graph's limit an eager round under the
                // confidence rule (a whole block of every sequence there would teach the eager
                // curve only its largest size, and smaller rounds would look as dear).
                Choice::Explore if whole_blocks && shape.graphs(block) => Rule::Uniform(block),
                Choice::Explore => Rule::Confidence(CONFIDENCE_FLOOR),
            };
        }
        match policy {
            Rule::Uniform(n) => {
                for (i, _) in &props {
                    gamma.insert(*i, n);
                }
            }
            Rule::Fixed(n) => {
                for (i, p) in &props {
                    let g = n.min(p.drafts.len()).min(room[*i]).min(left);
                    left -= g;
                    gamma.insert(*i, g);
                }
            }
            Rule::Confidence(min_survival) => {
                gamma = confidence_lengths(slots, min_survival, left);
            }
        }
        for (i, p) in props {
            let g = gamma.get(&i).copied().unwrap_or(0);
            let usable = p.drafts.len().min(room[i]);
            let survival: Vec<f32> = p
                .confidence
                .iter()
                .chain(std::iter::repeat(&0.0))
                .take(if g == 0 { usable } else { g })
                .scan(1.0f32, |reach, &c| {
                    *reach *= c;
                    Some(*reach)
                })
                .collect();
            let s = &running[i];
            if g == 0 {
                if s.sampling.is_greedy() && usable > 0 {
                    let pending = self.shadows.entry(s.id).or_default();
                    if pending.len() >= MAX_SHADOWS {
                        pending.remove(0);
                    }
                    pending.push(Shadow {
                        anchor_at: s.tokens.len(),
                        drafts: p.drafts[..usable].to_vec(),
                        survival,
                    });
                }
                continue;
            }
            let Phase::Decoding { next } = s.phase else {
                continue;
            };
            let q = match p.q {
                DraftDist::Sampled(mut rows) => {
                    rows.truncate(g * vocab);
                    DraftDist::Sampled(rows)
                }
                other => other,
            };
            let mut tokens = Vec::with_capacity(g + 1);
            tokens.push(next);
            tokens.extend_from_slice(&p.drafts[..g]);
            plan[i] = Some(Draft {
                tokens,
                q,
                survival,
            });
        }
        (plan, q)
    }

    /// Where this step's queued drafts are ([`Self::plan`] left them on the device): what the
    /// verify batch of the running sequences, `gamma` drafts each, takes as
    /// [`crate::deepseek::BatchInputs::drafts_on_device`]. `None` for any other step.
    pub fn queued_ids(&self, gamma: usize) -> Option<DraftIds<'_>> {
        self.queued.as_ref().map(|q| q.ids(gamma))
    }

    /// Brings this step's queued drafts to the host, into the running sequences' `drafts`
    /// (in order): each one's tokens after its anchor and its survivals, as [`Self::plan`]
    /// sets them when it reads the drafts first. The downloads wait for whatever was queued
    /// behind the drafter's pass (the verify forward). Nothing without queued drafts. A
    /// sequence whose drafts failed, or every one when the download failed (the error
    /// returned), keeps its anchor alone ([`fill_draft`]).
    pub fn fill_queued(&mut self, drafts: &mut [Option<Draft>]) -> Result<(), ModelError> {
        let Some(queued) = self.queued.take() else {
            return Ok(());
        };
        let proposals = match queued.collect() {
            Ok(p) => p,
            Err(e) => {
                for d in drafts.iter_mut().flatten() {
                    fill_draft(d, Err(ModelError::Invalid("no drafts came back".into())));
                }
                return Err(e);
            }
        };
        for (d, p) in drafts.iter_mut().zip(proposals) {
            if let Some(d) = d.as_mut() {
                fill_draft(d, p);
            }
        }
        Ok(())
    }

    /// The engine ran a step in `step_secs` (the drafter's pass of [`Self::plan`], if one
    /// ran, included; deferred drafter context it wrote, [`Self::flush`], left out): the
    /// `goodput` policy's cost estimates learn from a decode-only one (`seqs` sequences, `rows`
    /// target rows, `round` if they verified drafts, replayed from a graph or not), and the
    /// price of rows beside prompts from one that carried prompts (its drafter pass left out).
    /// A step that captured a CUDA graph (`captured`: the target's; the drafter's is read here)
    /// teaches them nothing: the capture is a one-off cost.
    pub fn observe_step(&mut self, step: ObservedStep, step_secs: f64, captured: bool) {
        let pass = self.last_pass.take();
        let step_secs = (step_secs - std::mem::take(&mut self.flush_secs)).max(0.0);
        let (drafted, draft_secs) = pass.unwrap_or((0, 0.0));
        let drafter_captures = self.drafter.graph_captures();
        let captured = captured || drafter_captures != self.drafter_captures;
        self.drafter_captures = drafter_captures;
        let (seqs, rows, round, graph) = match step {
            ObservedStep::DecodeOnly {
                seqs,
                rows,
                round,
                graph,
            } => (seqs, rows, round, graph),
            ObservedStep::WithPrompts { rows } => {
                if !captured {
                    self.goodput
                        .observe_prompt_step(rows, (step_secs - draft_secs).max(0.0));
                }
                return;
            }
        };
        self.goodput.observe(Observed {
            seqs,
            drafted,
            rows,
            round,
            graph,
            draft_secs,
            step_secs,
            captured,
        });
    }

    /// Rows of sequence `id` whose drafter context is deferred.
    fn deferred_rows(&self, id: SeqId) -> usize {
        self.deferred.per_seq.get(&id).copied().unwrap_or(0)
    }

    /// Whether this engine defers the context of plain steps (`goodput`).
    pub fn defers(&self) -> bool {
        self.config.verify_len == VerifyLen::Goodput && self.kv.is_some()
    }

    /// Keeps a plain decode step's committed rows for later (see [`Deferred`]): `taps` are the
    /// step's tapped rows (`[rows][hidden]` per tap layer, every row of the step), `segments`
    /// (sequence, first position, first row, rows) the committed ones. Returns `false` when
    /// they do not fit; the caller then writes the context now.
    pub fn defer(
        &mut self,
        backend: &Backend,
        hidden: usize,
        taps: &[Tensor],
        segments: &[(SeqId, usize, usize, usize)],
    ) -> Result<bool, ModelError> {
        Ok(self.deferred.keep(backend, hidden, taps, segments)?)
    }

    /// Writes the deferred rows' context for the sequences still in `running`, in one pass,
    /// and advances their `draft_ctx`; empties the buffer whatever happens.
    pub fn flush(
        &mut self,
        model: &DeepseekModel,
        running: &mut [Sequence],
    ) -> Result<(), ModelError> {
        let keep = self.deferred.take(
            running
                .iter()
                .enumerate()
                .map(|(i, s)| (s.id, (i, s.draft_ctx))),
        );
        if keep.is_empty() {
            return Ok(());
        }
        let Some(kv) = self.kv.as_mut() else {
            return Ok(());
        };
        let started = std::time::Instant::now();
        let segs: Vec<ContextSegment<'_>> = keep
            .iter()
            .map(|&(i, start, first, n)| ContextSegment {
                block_table: running[i].table.blocks(),
                start_pos: start,
                first_row: first,
                rows: n,
            })
            .collect();
        self.drafter.extend_context(
            model,
            kv,
            &ContextRows {
                taps: &self.deferred.taps,
                segments: &segs,
            },
        )?;
        drop(segs);
        self.flush_secs += started.elapsed().as_secs_f64();
        for (i, _, _, n) in keep {
            running[i].draft_ctx += n;
        }
        Ok(())
    }

    /// A sequence's round verified `draft` and accepted `accepted` of its drafts.
    pub fn observe_round(&mut self, draft: &Draft, accepted: usize) {
        self.goodput.observe_round(&draft.survival, accepted);
    }

    /// After a step's commits: the shadows of `running` whose outcome the decoded tokens now
    /// tell feed the `goodput` policy's acceptance as rounds would. Returns them.
    pub fn resolve_shadows(&mut self, running: &[Sequence]) -> Vec<Resolved> {
        let mut out = Vec::new();
        if self.shadows.is_empty() {
            return out;
        }
        for s in running {
            let Some(pending) = self.shadows.get_mut(&s.id) else {
                continue;
            };
            // The tokens decoded after each anchor: the committed ones, then the next input.
            let next = match s.phase {
                Phase::Decoding { next } => Some(next),
                _ => None,
            };
            let goodput = &mut self.goodput;
            pending.retain(|sh| {
                let after = s.tokens.get(sh.anchor_at + 1..).unwrap_or_default();
                match counterfactual(&sh.drafts, after.iter().copied().chain(next)) {
                    Some(accepted) => {
                        goodput.observe_round(&sh.survival, accepted);
                        out.push((sh.survival.iter().map(|&p| f64::from(p)).sum(), accepted));
                        false
                    }
                    None => true,
                }
            });
            if pending.is_empty() {
                self.shadows.remove(&s.id);
            }
        }
        out
    }

    /// `id` ended: shadows it cannot resolve any more are dropped (its last tokens would
    /// tell only about drafts it no longer needed).
    pub fn forget_shadows(&mut self, id: SeqId) {
        self.shadows.remove(&id);
    }

    /// Writes context rows for the committed rows of a batch (`taps`: the tapped residual
    /// streams, on the model's backend, in the drafter's tap order).
    pub fn extend(
        &mut self,
        model: &DeepseekModel,
        taps: &[Tensor],
        segments: &[ContextSegment<'_>],
    ) -> Result<(), ModelError> {
        let Some(kv) = self.kv.as_mut() else {
            return Ok(());
        };
        if segments.is_empty() {
            return Ok(());
        }
        self.drafter
            .extend_context(model, kv, &ContextRows { taps, segments })
    }
}

/// What a finished step was, for [`Speculator::observe_step`].
#[derive(Debug, Clone, Copy)]
pub enum ObservedStep {
    /// Decode rows only: `seqs` sequences, `rows` target rows, `round` if they verified
    /// drafts, `graph` if replayed from a graph.
    DecodeOnly {
        seqs: usize,
        rows: usize,
        round: bool,
        graph: bool,
    },
    /// Prompt rows, alone or beside decode rows: `rows` of every kind, which the `goodput`
    /// policy prices the decode part of steps beside prompts by.
    WithPrompts { rows: usize },
}

/// The prompt work waiting beside a step's decode rows, for the `goodput` policy's costs.
#[derive(Debug, Clone, Copy, Default)]
pub struct PromptLoad {
    /// Prompt rows waiting to join the step, within its token budget.
    pub rows: usize,
    /// Whether a graph round of at least that many drafts keeps its graph and leaves the
    /// prompts a forward of their own (`PromptSteps::Auto` on CUDA with graphs).
    pub splits: bool,
}

/// The most drafts every sequence of a uniform round can verify: the fewest any has room for
/// (`rooms`), within the step's token budget; 0 when no uniform round is possible (`possible`:
/// a GPU engine whose running sequences all draft).
fn widest_uniform(
    possible: bool,
    rooms: impl ExactSizeIterator<Item = usize>,
    budget: usize,
) -> usize {
    let seqs = rooms.len();
    if !possible || seqs == 0 {
        return 0;
    }
    rooms.min().unwrap_or(0).min(budget / seqs)
}

/// One queued round's drafts into `d` (its anchor, then γ placeholders): the proposal's first
/// γ drafts and their cumulative survivals. Without a proposal (the drafter failed, or the
/// download did) the round keeps its anchor alone: γ = 0, the plain step of that sequence. Its
/// row 0 was computed from the anchor as always, the placeholders' rows are never read, and
/// the commit rolls their positions back, so nothing wrong is ever accepted and the request
/// goes on.
fn fill_draft(d: &mut Draft, p: Result<Proposal, ModelError>) {
    match p {
        Ok(p) if p.drafts.len() >= d.gamma() => {
            let g = d.gamma();
            d.tokens[1..].copy_from_slice(&p.drafts[..g]);
            d.survival = p
                .confidence
                .iter()
                .chain(std::iter::repeat(&0.0))
                .take(g)
                .scan(1.0f32, |reach, &c| {
                    *reach *= c;
                    Some(*reach)
                })
                .collect();
        }
        Ok(p) => {
            tracing::warn!(
                drafts = p.drafts.len(),
                gamma = d.gamma(),
                "a queued round came back short; its anchor alone"
            );
            d.tokens.truncate(1);
            d.survival.clear();
        }
        Err(e) => {
            tracing::warn!(error = %e, "a queued draft failed; its anchor alone");
            d.tokens.truncate(1);
            d.survival.clear();
        }
    }
}

/// Whether `goodput` picks a uniform width before drafting beside waiting prompts, so that the
/// drafter's pass is queued ahead of the verify forward ([`Goodput::width_before_drafting`]):
/// with `FERRY_GOODPUT_QUEUED=1` (read once). Off until a GPU lease measures it (written in
/// session 58 after its lease).
fn goodput_queued() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERRY_GOODPUT_QUEUED").is_ok_and(|v| v.trim() == "1"))
}

/// `FERRY_QUEUED_DRAFTS=0`: every round's drafts come to the host before its verify forward
/// is queued (the rule before; the A/B switch).
fn queued_drafts() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERRY_QUEUED_DRAFTS").map_or(true, |v| v.trim() != "0"))
}

/// Whether `goodput` costs a step beside waiting prompts as such (`Goodput`'s line of the steps
/// that carried prompts): with `FERRY_GOODPUT_PROMPTS=1` (read once). Off by default until a
/// GPU A/B against the decode-only pricing says it pays (written in session 50, which got no
/// GPU machine).
fn goodput_prompts() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERRY_GOODPUT_PROMPTS").is_ok_and(|v| v.trim() == "1"))
}

/// Whether whole-block rounds keep sequences in their last block ([`Speculator::plan`]): unless
/// `FERRY_WHOLE_BLOCK_TAIL=0` (read once; the benchmarks' A/B switch).
fn whole_block_tail() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERRY_WHOLE_BLOCK_TAIL").map_or(true, |v| v.trim() != "0"))
}

/// One draft slot a sequence could verify this step: position `k` of its block, and the
/// confidence head's cumulative survival `Π_{j≤k} c_j` (the predicted chance that drafts
/// `0..=k` are all accepted).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Slot {
    /// Index of the sequence among the step's running sequences.
    seq: usize,
    k: usize,
    survival: f32,
}

/// Sorts slots most likely first; on a tie the earlier position first, so that a sequence's
/// slots keep their block order (equal survivals mean the later drafts were predicted certain).
fn by_likelihood(slots: &mut [Slot]) {
    slots.sort_by(|a, b| b.survival.total_cmp(&a.survival).then(a.k.cmp(&b.k)));
}

/// The confidence rule: admit the `budget` most likely slots whose cumulative survival is at
/// least `min_survival` (a NaN never is); each sequence then verifies the longest prefix of
/// its block that was admitted. Cumulative survival never grows along a block, so what is
/// admitted is already a prefix and no budget is spent on a slot that cannot be verified.
/// Returns γ for every sequence that had a slot admitted.
fn confidence_lengths(
    mut slots: Vec<Slot>,
    min_survival: f32,
    budget: usize,
) -> HashMap<usize, usize> {
    slots.retain(|s| s.survival >= min_survival);
    by_likelihood(&mut slots);
    let admitted: HashSet<(usize, usize)> =
        slots.iter().take(budget).map(|s| (s.seq, s.k)).collect();
    let mut gamma = HashMap::new();
    for &(seq, _) in &admitted {
        gamma
            .entry(seq)
            .or_insert_with(|| (0..).take_while(|k| admitted.contains(&(seq, *k))).count());
    }
    gamma
}

/// The γ + 1 uniforms of sequence `s`'s verification this step (one per draft, then the
/// correction / bonus draw), from its verify stream.
pub(crate) fn verify_uniforms(s: &mut Sequence, gamma: usize) -> Vec<f64> {
    round_uniforms(&s.sampling, s.generated, VERIFY_SALT, &mut s.rng, gamma + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deferred drafter context written during a step (`flush`) is the plain steps' work
    /// before it: `goodput`'s estimates leave it out of the step that wrote it, so a round
    /// after a run of plain steps is not costed as that much dearer (session 38 at T = 0.7: a
    /// ~1 ms flush in each exploratory round kept `goodput` off rounds that paid 1.19×).
    #[test]
    fn a_shadow_accepts_the_prefix_the_target_went_on_with() {
        assert_eq!(counterfactual(&[5, 6, 7], [5, 6, 9, 7]), Some(2));
        assert_eq!(
            counterfactual(&[5, 6, 7], [5, 6, 7]),
            Some(3),
            "all of them"
        );
        assert_eq!(
            counterfactual(&[5, 6, 7], [4]),
            Some(0),
            "the first differs"
        );
        assert_eq!(
            counterfactual(&[5, 6, 7], [5, 6]),
            None,
            "the third is not decoded yet"
        );
        assert_eq!(counterfactual(&[5, 6, 7], []), None);
    }

    /// A speculator of the embedded pair on the CPU under `goodput`.
    fn goodput_speculator() -> Speculator {
        let model = DeepseekModel::load(&crate::embedded::default_model_dir()).expect("model");
        let drafter =
            crate::drafter::DsparkDrafter::load(&crate::drafter::embedded_dir(), model.config())
                .expect("drafter");
        let layout = KvLayout::for_model(model.config(), 16, 16);
        let config = SpecConfig {
            verify_len: VerifyLen::Goodput,
            ..SpecConfig::default()
        };
        Speculator::new(
            Box::new(drafter),
            (&layout, KvDtype::F32),
            &Backend::Cpu,
            config,
            None,
        )
        .expect("speculator")
    }

    #[test]
    fn deferred_context_written_in_a_step_is_not_its_cost() {
        let mut sp = goodput_speculator();
        // Three plain steps of one sequence, 1 ms each; each also wrote 4 ms of deferred
        // context.
        for _ in 0..3 {
            sp.flush_secs += 0.004;
            sp.observe_step(
                ObservedStep::DecodeOnly {
                    seqs: 1,
                    rows: 1,
                    round: false,
                    graph: false,
                },
                0.005,
                false,
            );
        }
        let plain = sp.goodput.plain_estimate(1).expect("measured twice");
        assert!((plain - 0.001).abs() < 1e-9, "{plain}");
        assert_eq!(sp.flush_secs, 0.0);
    }

    #[test]
    fn a_step_with_prompts_prices_rows_without_its_drafter_pass() {
        let mut sp = goodput_speculator();
        // Steps of 1,100–2,025 rows beside prompts, each after a 3 ms drafter pass and with 1 ms
        // of deferred context written: the forward itself costs 2 ms + 5 µs a row.
        for i in 0..40 {
            let rows = 1100 + 37 * (i % 26);
            sp.last_pass = Some((64, 0.003));
            sp.flush_secs += 0.001;
            let forward = 2e-3 + 5e-6 * rows as f64;
            sp.observe_step(ObservedStep::WithPrompts { rows }, 0.004 + forward, false);
        }
        let (a, b) = sp.goodput.prompt_fit().expect("a line");
        assert!(
            (a - 2e-3).abs() < 1e-6 && (b - 5e-6).abs() < 1e-9,
            "{a} {b}"
        );
        assert!(sp.last_pass.is_none() && sp.flush_secs == 0.0);
    }

    /// The slots of one sequence from its per-position confidences, as the planner forms them.
    fn block(seq: usize, confidence: &[f32]) -> Vec<Slot> {
        let mut survival = 1.0f32;
        confidence
            .iter()
            .enumerate()
            .map(|(k, c)| {
                survival *= c;
                Slot { seq, k, survival }
            })
            .collect()
    }

    fn lengths(blocks: &[&[f32]], min_survival: f32, budget: usize) -> Vec<usize> {
        let slots = blocks
            .iter()
            .enumerate()
            .flat_map(|(seq, c)| block(seq, c))
            .collect();
        let gamma = confidence_lengths(slots, min_survival, budget);
        (0..blocks.len())
            .map(|seq| gamma.get(&seq).copied().unwrap_or(0))
            .collect()
    }

    #[test]
    fn the_budget_goes_to_the_most_likely_slots_across_sequences() {
        // Cumulative survivals: A 0.9, 0.72, 0.144; B 0.95, 0.475, 0.43.
        let (a, b): (&[f32], &[f32]) = (&[0.9, 0.8, 0.2], &[0.95, 0.5, 0.9]);
        assert_eq!(lengths(&[a, b], 0.0, 1), [0, 1]);
        assert_eq!(lengths(&[a, b], 0.0, 3), [2, 1]);
        assert_eq!(lengths(&[a, b], 0.0, 4), [2, 2]);
        assert_eq!(lengths(&[a, b], 0.0, 5), [2, 3]);
        assert_eq!(lengths(&[a, b], 0.0, 99), [3, 3]);
    }

    #[test]
    fn slots_below_the_floor_are_never_verified_whatever_the_budget() {
        let (a, b): (&[f32], &[f32]) = (&[0.9, 0.8, 0.2], &[0.95, 0.5, 0.9]);
        assert_eq!(lengths(&[a, b], 0.5, 99), [2, 1]);
        assert_eq!(lengths(&[a, b], 0.96, 99), [0, 0]);
        // A NaN confidence ends its block's admissible prefix.
        assert_eq!(lengths(&[&[0.9, f32::NAN, 0.9]], 0.0, 99), [1]);
    }

    #[test]
    fn equal_survivals_are_admitted_in_block_order() {
        // Every cumulative survival is 1: a tie everywhere. Slot order must still be each
        // block's own order, or the budget would buy slots past a gap that cannot be verified.
        let certain: &[f32] = &[1.0, 1.0, 1.0, 1.0];
        assert_eq!(lengths(&[certain, certain], 0.3, 2), [1, 1]);
        assert_eq!(lengths(&[certain, certain], 0.3, 5), [3, 2]);
        assert_eq!(lengths(&[certain, certain], 0.3, 8), [4, 4]);
    }

    #[test]
    fn a_sequence_without_admitted_slots_gets_no_length() {
        let gamma = confidence_lengths(block(7, &[0.1, 0.1]), 0.3, 4);
        assert!(gamma.is_empty(), "{gamma:?}");
        assert!(confidence_lengths(Vec::new(), 0.0, 4).is_empty());
        assert!(confidence_lengths(block(0, &[0.9]), 0.0, 0).is_empty());
    }

    #[test]
    fn a_queued_round_takes_its_drafts_or_keeps_its_anchor_alone() {
        let placeholder = || Draft {
            tokens: vec![7, 0, 0, 0],
            q: DraftDist::Greedy,
            survival: Vec::new(),
        };
        let mut d = placeholder();
        let p = Proposal {
            drafts: vec![5, 6, 8, 9],
            q: DraftDist::Greedy,
            confidence: vec![0.5, 0.5, 0.5, 0.5],
        };
        fill_draft(&mut d, Ok(p.clone()));
        assert_eq!(d.tokens, [7, 5, 6, 8]);
        assert_eq!(d.survival, [0.5, 0.25, 0.125]);
        // A failed proposal, or one shorter than the round: the anchor's plain step.
        for bad in [
            Err(ModelError::Invalid("no valid distribution".into())),
            Ok(Proposal {
                drafts: vec![5, 6],
                ..p
            }),
        ] {
            let mut d = placeholder();
            fill_draft(&mut d, bad);
            assert_eq!((d.tokens.as_slice(), d.gamma()), (&[7u32][..], 0));
            assert!(d.survival.is_empty());
        }
    }

    #[test]
    fn verify_len_parses_and_prints() {
        assert_eq!("fixed:3".parse::<VerifyLen>(), Ok(VerifyLen::Fixed(3)));
        assert_eq!(
            "confidence".parse::<VerifyLen>(),
            Ok(VerifyLen::Confidence { min_survival: 0.3 })
        );
        assert_eq!(VerifyLen::default(), VerifyLen::Goodput);
        assert_eq!(
            "confidence:0.5".parse::<VerifyLen>(),
            Ok(VerifyLen::Confidence { min_survival: 0.5 })
        );
        assert_eq!("goodput".parse::<VerifyLen>(), Ok(VerifyLen::Goodput));
        assert!("goodput:1".parse::<VerifyLen>().is_err());
        assert!("confidence:2".parse::<VerifyLen>().is_err());
        assert!("sometimes".parse::<VerifyLen>().is_err());
        for v in [
            VerifyLen::Fixed(4),
            VerifyLen::Confidence { min_survival: 0.3 },
            VerifyLen::Goodput,
        ] {
            assert_eq!(v.to_string().parse::<VerifyLen>(), Ok(v));
        }
    }

    /// Tapped rows of a plain step: row `r` of tap layer `l` holds `100·l + tag(r)` in every
    /// column, so a row read back names the step, sequence and position it came from.
    fn step_taps(hidden: usize, layers: usize, tags: &[f32]) -> Vec<Tensor> {
        (0..layers)
            .map(|l| {
                let v = tags
                    .iter()
                    .flat_map(|&t| std::iter::repeat_n(100.0 * l as f32 + t, hidden))
                    .collect();
                Tensor::Host(v)
            })
            .collect()
    }

    /// What the deferred buffer writes at flush: for each sequence still running whose
    /// context it continues, the rows of its positions in order, found at the rows named.
    #[test]
    fn deferred_rows_come_back_at_their_positions_and_rows() {
        let (hidden, layers) = (3, 2);
        let (a, b, c) = (SeqId(1), SeqId(2), SeqId(3));
        let mut d = Deferred::default();
        // Step 1: a at position 10 (row 0), b at 20 (row 1), c at 30 (row 2).
        let taps = step_taps(hidden, layers, &[10.0, 20.0, 30.0]);
        let segs = [(a, 10, 0, 1), (b, 20, 1, 1), (c, 30, 2, 1)];
        assert!(d.keep(&Backend::Cpu, hidden, &taps, &segs).unwrap());
        // Step 2: c ended; b first (row 0, position 21), then a (row 1, position 11) and a
        // padding row no sequence committed.
        let taps = step_taps(hidden, layers, &[21.0, 11.0, -1.0]);
        let segs = [(b, 21, 0, 1), (a, 11, 1, 1)];
        assert!(d.keep(&Backend::Cpu, hidden, &taps, &segs).unwrap());
        assert_eq!((d.rows, d.per_seq[&a], d.per_seq[&b]), (6, 2, 2));
        // a has written context up to 10, b only up to 19 (a gap: its rows are dropped);
        // c is gone. a is running at index 4.
        let keep = d.take([(a, (4, 10)), (b, (0, 19))]);
        assert_eq!(keep, vec![(4, 10, 0, 1), (4, 11, 4, 1)]);
        for (_, start, first, n) in keep {
            for (l, t) in d.taps.iter().enumerate() {
                let t = t.host("test", "taps").unwrap();
                for r in first..first + n {
                    let pos = start + r - first;
                    let want = 100.0 * l as f32 + pos as f32;
                    assert!(
                        t[r * hidden..(r + 1) * hidden].iter().all(|&x| x == want),
                        "layer {l} row {r}: position {pos}"
                    );
                }
            }
        }
        // Taken: empty again, and the next step starts at row 0.
        assert_eq!((d.rows, d.per_seq.len(), d.segments.len()), (0, 0, 0));
        assert!(d.take([(a, (4, 12))]).is_empty());
    }

    /// Rows that do not fit are refused whole, so the caller writes them at once.
    #[test]
    fn deferred_buffer_refuses_rows_beyond_its_capacity() {
        let mut d = Deferred::default();
        let hidden = DEFERRED_BYTES / std::mem::size_of::<f32>() / 4;
        let taps = step_taps(hidden, 1, &[1.0, 2.0]);
        assert!(d
            .keep(&Backend::Cpu, hidden, &taps, &[(SeqId(1), 0, 0, 2)])
            .unwrap());
        assert!(d
            .keep(&Backend::Cpu, hidden, &taps, &[(SeqId(1), 2, 0, 2)])
            .unwrap());
        assert!(!d
            .keep(&Backend::Cpu, hidden, &taps, &[(SeqId(1), 4, 0, 2)])
            .unwrap());
        assert_eq!((d.rows, d.per_seq[&SeqId(1)]), (4, 4));
        // Mismatched tap shapes are refused too.
        let odd = vec![Tensor::Host(vec![0.0; hidden + 1])];
        assert!(!d.keep(&Backend::Cpu, hidden, &odd, &[]).unwrap());
    }
}
