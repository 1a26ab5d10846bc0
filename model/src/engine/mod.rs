//! The engine: one OS thread per device owning the model, the KV manager and the scheduler.
//!
//! | file | owns |
//! |---|---|
//! | [`mod@self`] | [`EngineHandle`] (clone-able, async-friendly), commands, events, config |
//! | [`sequence`] | per-request state ([`sequence::Phase`]) |
//! | [`scheduler`] | the loop: commands → batch under a token budget → forward → sample → events (`scheduler/{admit,batch,round}.rs`: command side, forward side, speculative round) |
//! | [`backend`] | where the forward runs: the CPU model over the host pool, or the model and KV cache on a CUDA device (the host pool then keeps block ids only; shipped layers pass through a page-locked ring); [`GpuMode`] |
//! | [`spec`] | speculative decoding: draft, verify length, lossless verify, commit and KV rollback |
//!
//! ```text
//!  tokio tasks (gRPC services, transport receivers)
//!      │ EngineCommand (unbounded; admission is counted by the handle)
//!      ▼
//!  engine thread: KvManager (block ids) + Backend (model, KV rows) + running/waiting sequences
//!      │ EngineEvent per request (tokio mpsc)   │ oneshot replies (prefill jobs, stats)
//!      ▼                                         ▼
//!  the request's stream                        the caller
//! ```
//!
//! Compute never runs on the tokio runtime. Every request owns its blocks through its sequence;
//! a finished, failed or cancelled (receiver dropped) request frees them in the same step.
pub mod backend;
mod goodput;
mod landing;
pub mod scheduler;
pub mod sequence;
pub mod spec;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use ferry_kernels::cpu::logits::LogitsControls;
use ferry_kernels::cpu::sample::SamplingParams;
use ferry_kernels::Device;
use ferry_modelcard::grammar::Grammar;
use tokio::sync::{mpsc, oneshot};

use crate::deepseek::DeepseekModel;
use crate::drafter::Drafter;
use crate::kv::{BlockId, KvDtype, KvEvent, LayerRows};
use crate::ModelError;

#[cfg(feature = "cuda")]
pub use backend::open_cuda;
pub use backend::GpuMode;
pub use ferry_kernels::cpu::logits::TokenLogprobs;
pub use landing::DraftLanding;
pub use spec::{DraftBudget, SpecConfig, VerifyLen};

/// Identifies a request inside one engine.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// Engine sizing and policy.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// New tokens per forward (prefill chunks + decode tokens).
    pub max_batch_tokens: usize,
    /// Sequences decoding at once.
    pub max_running: usize,
    /// Requests queued or running before new ones are refused (overload).
    pub max_in_flight: usize,
    /// Speculative decoding policy (used when the engine has a drafter).
    pub spec: SpecConfig,
    /// Where the model runs: `cpu`, `cuda:N` for the whole model and its KV cache on that GPU,
    /// or `auto` (the first GPU that opens, else the CPU; [`EngineHandle::device`] says which).
    /// A named GPU that cannot be opened fails the engine's start with the reason.
    pub device: Device,
    /// Numerics on a GPU.
    pub gpu_mode: GpuMode,
    /// On CUDA, replay decode-only steps and verify forwards (every sequence the same number of
    /// tokens, absorbed form, up to `gpu::graph::graph_max_seqs` sequences) from CUDA
    /// graphs captured per batch-size bucket; everything else runs eagerly.
    pub cuda_graphs: bool,
    /// On CUDA, ship prefill jobs' layers while later layers compute (the default); `false`
    /// ships them after the whole forward, as before — kept as the benchmark's peer.
    pub gpu_layerwise_shipping: bool,
    /// Where [`EngineHandle::load`] takes the weights from: the checkpoint, or seeded random
    /// weights of `config.json`'s shapes (`--load-format dummy`).
    pub load_format: crate::dummy::LoadFormat,
    /// Where a CPU engine's KV rows are allocated (`None`: the heap). A decode worker passes
    /// its KV transport's memory, which peers on the same machine write into directly.
    pub host_kv_memory: Option<HostKvMemory>,
    /// Whether prompt work rides in the running sequences' step or gets a forward of its own
    /// ([`PromptSteps`]; the default comes from `FERRY_PROMPT_STEPS`, else `Auto`).
    pub prompt_steps: PromptSteps,
}

/// How a step that has both prompt work and running sequences runs them.
///
/// `Mixed` (vLLM's chunked prefill): one forward takes the decode rows — a speculating
/// sequence's whole round — and the prompt chunks, so it runs eagerly, and a speculating engine
/// also drafts over every running sequence and writes the drafter context of the prompts in it.
/// `Apart` (SGLang's default): the running sequences first take a decode-only step, which a GPU
/// replays from its graph as any other, then the prompts take a forward of their own in the same
/// scheduler step, so nothing waits longer for its first token. `Auto` (the default) mixes,
/// except that a speculating round whose graph would be lost to fewer prompt rows than it has
/// drafts runs apart (see [`PromptSteps::Auto`]).
///
/// Measured on a small target (H100, sessions 38–42): a whole 1,024-token prompt is cheaper
/// mixed into a round (`Apart` lost, 1.03× against 1.12× at c = 128: the decode-only rounds it
/// adds cost more than the rows the mixed steps carried), but a prefix-cache hit's few prompt
/// rows made a mixed step of a 128-sequence round cost 24.6 ms against the graphed round's 9.3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PromptSteps {
    /// Mixed, except where a speculating round is replayed from a graph and the prompt work
    /// beside it is fewer rows than its drafts (a cache hit's uncached tail, a chunk's end):
    /// then apart, as the eager forward of every draft row to carry a few prompt rows costs more
    /// than a separate prompt forward. Without graphs (the CPU, ROCm) it is `Mixed`.
    #[default]
    Auto,
    /// Prompt chunks and decode rows in one forward.
    Mixed,
    /// A decode-only step, then a prompt-only forward.
    Apart,
}

impl PromptSteps {
    /// `FERRY_PROMPT_STEPS` (`auto`, `mixed` or `apart`), read once; unset or unknown: `Auto`
    /// (an unknown value is logged).
    pub fn from_env() -> Self {
        static FROM_ENV: std::sync::OnceLock<PromptSteps> = std::sync::OnceLock::new();
        *FROM_ENV.get_or_init(|| match std::env::var("FERRY_PROMPT_STEPS").as_deref() {
            Ok("apart") => PromptSteps::Apart,
            Ok("mixed") => PromptSteps::Mixed,
            Ok("auto") | Err(_) => PromptSteps::Auto,
            Ok(other) => {
                tracing::warn!(
                    value = other,
                    "FERRY_PROMPT_STEPS is `auto`, `mixed` or `apart`; using `auto`"
                );
                PromptSteps::Auto
            }
        })
    }
}

/// The most sequences whose uniform round of `gamma` drafts each (γ + 1 rows) `device`
/// replays from a graph: CUDA's verify-graph limit; unbounded elsewhere (ROCm's uniform rounds
/// run eagerly).
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn verify_graph_seqs(device: Device, gamma: usize) -> usize {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => crate::gpu::graph::graph_max_seqs(gamma + 1),
        _ => usize::MAX,
    }
}

/// A [`RowMemory`](crate::kv::RowMemory) for [`EngineConfig::host_kv_memory`].
#[derive(Clone)]
pub struct HostKvMemory(pub Arc<dyn crate::kv::RowMemory>);

impl std::fmt::Debug for HostKvMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostKvMemory")
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            num_blocks: 1024,
            page_size: crate::kv::layout::DEFAULT_PAGE_SIZE,
            max_batch_tokens: 2048,
            max_running: 64,
            max_in_flight: 512,
            spec: SpecConfig::default(),
            device: Device::Cpu,
            gpu_mode: GpuMode::Exact,
            cuda_graphs: true,
            gpu_layerwise_shipping: true,
            load_format: crate::dummy::LoadFormat::Auto,
            host_kv_memory: None,
            prompt_steps: PromptSteps::from_env(),
        }
    }
}

/// Why a request stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or one of the request's `stop_token_ids`.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// When generation stops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopParams {
    /// New tokens at most (≥ 1).
    pub max_tokens: usize,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// More tokens that end the request like an EOS (not emitted; `ignore_eos` does not apply
    /// to them).
    pub stop_token_ids: Vec<u32>,
    /// Until this many tokens are generated, the stop tokens ([`StopParams::stop_ids`]) are
    /// masked out of the distribution (their logit is `-inf`). 0 = off.
    pub min_tokens: usize,
}

impl StopParams {
    /// At most `max_tokens` new tokens, stopping at EOS; nothing else.
    pub fn max_tokens(max_tokens: usize) -> Self {
        Self {
            max_tokens,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            min_tokens: 0,
        }
    }

    /// Whether `token` ends the request: one of `stop_token_ids`, or of the model's `eos`
    /// unless `ignore_eos`.
    pub fn is_stop(&self, token: u32, eos: &[u32]) -> bool {
        self.stop_token_ids.contains(&token) || (!self.ignore_eos && eos.contains(&token))
    }

    /// The tokens `min_tokens` masks when choosing generated token number `generated + 1`:
    /// every stop token while `generated < min_tokens`, none after.
    pub fn masked(&self, generated: usize, eos: &[u32]) -> Vec<u32> {
        if generated >= self.min_tokens {
            return Vec::new();
        }
        let mut ids = self.stop_token_ids.clone();
        if !self.ignore_eos {
            ids.extend(eos.iter().filter(|t| !self.stop_token_ids.contains(t)));
        }
        ids
    }
}

/// Where a decode request's prompt KV comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillSource {
    /// This engine computes it.
    Local,
    /// A peer writes it into blocks this engine reserves, unless at most `local_threshold`
    /// prompt tokens are uncached here, in which case it is computed locally after all.
    Remote {
        /// Uncached prompt tokens at or below which local prefill is cheaper than a transfer.
        local_threshold: usize,
    },
}

/// A generation request.
#[derive(Debug)]
pub struct GenerateJob {
    /// Prompt token ids (validated by the caller against vocab and context).
    pub prompt: Vec<u32>,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Penalties and `logit_bias`, applied to the logits before `sampling`.
    pub controls: LogitsControls,
    /// Stop conditions.
    pub stop: StopParams,
    /// Where the prompt KV comes from.
    pub prefill: PrefillSource,
    /// Structured output: the request's compiled grammar, fresh (a migrated request's resumed
    /// tokens are consumed at admission). Every token is drawn from the logits masked to what
    /// it allows; the request finishes (reason stop) when the grammar is complete.
    pub grammar: Option<Grammar>,
}

/// Per-request engine options beyond the job itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GenerateOptions {
    /// Speculative decoding for this request: `None` follows the engine (on when it has a
    /// drafter) except for a seeded sampled request, which decodes plainly (see
    /// [`Self::speculates`]); `Some(false)` turns it off; `Some(true)` turns it on, and on an
    /// engine without a drafter is plain decoding.
    pub speculative: Option<bool>,
    /// Request migration: the last `resumed_tokens` of the prompt were generated for this
    /// request earlier (by an engine that failed mid-stream). Generation continues at step
    /// `resumed_tokens`, so seeded sampling draws the same per-step streams and
    /// `max_tokens` counts those tokens too. 0 for a fresh request.
    pub resumed_tokens: usize,
    /// Send each generated token's raw log-probability with the `n` most likely alternatives
    /// ([`EngineEvent::Logprobs`], right before its [`EngineEvent::Token`]); `n` at most
    /// `cpu::logits::MAX_TOP_LOGPROBS`. `None`: no log-probabilities.
    pub logprobs: Option<usize>,
    /// Send the prompt's log-probabilities with the `n` most likely alternatives
    /// ([`EngineEvent::PromptLogprobs`], once, before the first token): for each prompt token
    /// after the first, the model's raw log-softmax at the position before it. Such a
    /// request reuses no cached prefix (positions served from the cache have no logits) and
    /// computes its whole prompt, here or on its prefill peer; its other samples (`n` > 1)
    /// reuse its blocks as usual. `None`: none.
    pub prompt_logprobs: Option<usize>,
}

impl GenerateOptions {
    /// Whether a request sampled with `sampling` speculates on an engine with a drafter.
    ///
    /// Unless the request says, it does — except when it is seeded and sampled (a seed,
    /// temperature > 0): plain seeded sampling draws step `k` from `(seed, k)` alone, so its
    /// tokens are the same whatever the load, on any worker and across a migration; a
    /// speculative round's draws depend on how many drafts it verified, which the step's
    /// shared verify budget, a graph round and (under `goodput`) measured timings decide.
    /// Such a request still speculates when it asks to (`Some(true)`). Greedy requests lose
    /// nothing: their verification is exact argmax matching.
    pub fn speculates(&self, sampling: &SamplingParams) -> bool {
        self.speculative
            .unwrap_or(sampling.seed.is_none() || sampling.is_greedy())
    }
}

/// Samples one request may fork into ([`EngineHandle::generate_n`]) at most: bounds the work
/// and the KV one request can claim.
pub const MAX_SAMPLES: usize = 16;

/// The seed of sample `index` of a request seeded with `seed`: sample 0 uses `seed` itself
/// (so `n` = 1 and sample 0 of `n` > 1 draw the same tokens); sample `i ≥ 1` uses
/// `splitmix64(seed ⊕ splitmix64(i))`, a distinct, deterministic stream per sample.
pub fn sample_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        seed
    } else {
        sequence::splitmix64(seed ^ sequence::splitmix64(index as u64))
    }
}

/// Speculative decoding of one request, sent with its end ([`EngineEvent::Speculation`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecCounts {
    /// Speculative rounds: steps in which the request verified γ ≥ 1 drafts.
    pub rounds: u64,
    /// Drafts verified in those rounds (the sum of their γ).
    pub drafted_tokens: u64,
    /// Drafts accepted.
    pub accepted_tokens: u64,
}

impl SpecCounts {
    /// Mean tokens committed per round, `(accepted + rounds) / rounds` (each round also emits a
    /// correction or bonus token); `None` without rounds.
    pub fn acceptance_length(&self) -> Option<f64> {
        (self.rounds > 0).then(|| (self.accepted_tokens + self.rounds) as f64 / self.rounds as f64)
    }
}

/// Why a request failed, as far as the caller must tell causes apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// A peer the request depended on (its prefill worker) failed and the policy is not to
    /// recompute: the service is unavailable for it, not broken (gRPC UNAVAILABLE).
    PeerUnavailable,
    /// Anything else: admission, a forward, sampling or verification error (gRPC INTERNAL).
    Internal,
}

/// A failed request: its kind and a message naming the cause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The cause's class.
    pub kind: FailureKind,
    /// What happened, for the client and the logs.
    pub message: String,
}

impl Failure {
    /// An [`FailureKind::Internal`] failure.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            kind: FailureKind::Internal,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// What a request's stream receives.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Remote prefill: blocks reserved for the prompt. Positions below `cached_tokens` are
    /// already here; the peer must fill the rest of `blocks` and then [`EngineHandle::remote_done`]
    /// (or [`EngineHandle::remote_failed`]) is called.
    Reserved {
        /// The prompt's blocks, in position order.
        blocks: Vec<BlockId>,
        /// Prompt positions this engine already holds (whole blocks).
        cached_tokens: usize,
    },
    /// The prompt will be prefilled here (`cached_tokens` of it came from the prefix cache).
    LocalPrefill {
        /// Prompt positions reused from the prefix cache.
        cached_tokens: usize,
    },
    /// The prompt's log-probabilities (requests that asked,
    /// [`GenerateOptions::prompt_logprobs`]), sent once before the first token: entry `i` is
    /// prompt token `i + 1` under the model's raw `log_softmax` at position `i` (nothing
    /// predicts the first token), so there are prompt length − 1 entries.
    PromptLogprobs(Vec<TokenLogprobs>),
    /// The log-probabilities of the token in the next [`EngineEvent::Token`] (requests that
    /// asked, [`GenerateOptions::logprobs`]): the model's raw `log_softmax` there, before
    /// penalties and temperature.
    Logprobs(TokenLogprobs),
    /// A new token.
    Token(u32),
    /// This request's speculative counts, sent right before `Finished` / `Failed` when the
    /// request was allowed to speculate (the engine has a drafter and the request did not opt
    /// out), also with zero rounds. Not sent for a request that could not speculate.
    Speculation(SpecCounts),
    /// The request ended normally.
    Finished(FinishReason),
    /// The request failed; its blocks are already free.
    Failed(Failure),
}

/// The per-layer callback of a prefill job: `(layer, blocks to ship, rows)`. `rows` holds at
/// least those blocks of that layer in the cache's own dtype ([`LayerRows::dtype`]: f32 on the
/// CPU and in CUDA exact mode, bf16 in CUDA fast mode; f32 for a drafter's context layers) and
/// lives only for the call: a sink copies what it keeps, converting where its destination wants
/// another dtype.
pub type LayerSinkFn =
    Box<dyn FnMut(usize, &[BlockId], &LayerRows<'_>) -> Result<(), String> + Send>;

/// A prefill-only job (prefill workers): compute the prompt's KV, stream each layer's blocks
/// from `skip_tokens` on through `on_layer`, sample the first token.
pub struct PrefillJob {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Parameters for the first token.
    pub sampling: SamplingParams,
    /// Penalties and `logit_bias` for the first token (the prompt is its history).
    pub controls: LogitsControls,
    /// The request's stop conditions: `min_tokens` masks its stop tokens from the first token.
    /// `max_tokens` is not used here.
    pub stop: StopParams,
    /// Return the first token's log-probabilities with this many alternatives
    /// ([`PrefillOutcome::first_logprobs`]).
    pub logprobs: Option<usize>,
    /// Return the prompt's log-probabilities with this many alternatives
    /// ([`PrefillOutcome::prompt_logprobs`]); the job then reuses none of this engine's cached
    /// prefix (see [`GenerateOptions::prompt_logprobs`]).
    pub prompt_logprobs: Option<usize>,
    /// Structured output: the first token is drawn from the logits masked to what this fresh
    /// grammar allows.
    pub grammar: Option<Grammar>,
    /// Prompt positions the destination already holds (whole blocks): not shipped.
    pub skip_tokens: usize,
    /// Called on the engine thread with `(layer, blocks to ship from skip_tokens on, rows)` as
    /// soon as the layer is computed: on the CPU between layers, `rows` a view of the host
    /// pool; on a GPU once the layer's blocks have been copied out behind its compute (a
    /// second stream into a page-locked ring), `rows` that ring slot in the cache's dtype,
    /// while later layers still compute. An error fails this job only.
    pub on_layer: LayerSinkFn,
    /// The outcome.
    pub reply: oneshot::Sender<Result<PrefillOutcome, String>>,
    /// When set and the engine has a drafter: called after the forward with
    /// `(drafter pool layer, blocks, rows)` for every drafter pool layer (f32 rows of the
    /// drafter's wire staging pool), so the drafter's context for the prompt travels with the
    /// target KV. An error fails this job.
    pub on_draft_layer: Option<LayerSinkFn>,
    /// Leave the shipped rows in device memory: on a CUDA engine, `on_layer` gets
    /// [`LayerRows::on_device`] views (block addresses in the device cache, and a lease that
    /// keeps them unchanged) instead of host copies, for a transport that puts from device
    /// memory itself. Honoured when every prefill job of the forward asks for it (else all get
    /// host rows); ignored on the CPU, whose rows are on the host anyway.
    pub rows_on_device: bool,
    /// The caller's span: the engine's `queue` span is its child, and each batch span that
    /// computes the job links to it (`follows_from`), so the job stays in the request's trace.
    pub span: tracing::Span,
}

impl std::fmt::Debug for PrefillJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillJob")
            .field("prompt_len", &self.prompt.len())
            .field("skip_tokens", &self.skip_tokens)
            .finish_non_exhaustive()
    }
}

/// What [`EngineHandle::prefill_work`] runs.
pub struct PrefillWork {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Parameters for the first token.
    pub sampling: SamplingParams,
    /// See [`PrefillJob::controls`].
    pub controls: LogitsControls,
    /// See [`PrefillJob::stop`].
    pub stop: StopParams,
    /// See [`PrefillJob::logprobs`].
    pub logprobs: Option<usize>,
    /// See [`PrefillJob::prompt_logprobs`].
    pub prompt_logprobs: Option<usize>,
    /// See [`PrefillJob::grammar`].
    pub grammar: Option<Grammar>,
    /// Prompt positions the destination already holds (whole blocks): not shipped.
    pub skip_tokens: usize,
    /// See [`PrefillJob::on_layer`].
    pub on_layer: LayerSinkFn,
    /// See [`PrefillJob::on_draft_layer`].
    pub on_draft_layer: Option<LayerSinkFn>,
    /// See [`PrefillJob::rows_on_device`].
    pub rows_on_device: bool,
}

/// A GPU engine's KV cache in device memory: per target layer, the `(address, bytes)` of the
/// pool's blocks (block `b` at `address + b × block bytes`, in [`EngineHandle::kv_dtype`]).
/// The memory lives as long as the engine thread, which runs while any [`EngineHandle`] does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceKv {
    /// CUDA device ordinal.
    pub device: i32,
    /// Per layer: device address and length in bytes.
    pub layers: Vec<(u64, usize)>,
}

/// Lands a peer's runs of KV blocks straight in a GPU engine's device cache, from the calling
/// thread ([`EngineHandle::device_kv_writer`]): on CUDA on a copy stream of its own, on ROCm
/// ordered after the device's queued work. A decode worker's TCP receiver copies each received
/// run with it, so landing a prompt's KV (~8 MB for 1,024 tokens of session 41's 20-layer
/// target; a pageable host → device copy of 20 × 1.25 MB took 5.9 ms on an H100) no longer
/// stops the engine thread between steps, as one engine command per run did.
pub struct DeviceKvWriter {
    lane: CopyLane,
    /// Per target layer: device address and length in bytes of the pool's blocks (the graphs'
    /// scratch block is outside).
    layers: Vec<(u64, usize)>,
    /// Bytes of one block of one layer, in the cache's dtype.
    block_bytes: usize,
}

/// How a [`DeviceKvWriter`] reaches device memory (no variant without a GPU backend).
enum CopyLane {
    #[cfg(feature = "cuda")]
    Cuda(ferry_kernels::cuda::CopyStream),
    #[cfg(feature = "rocm")]
    Rocm(ferry_kernels::rocm::RocmDevice),
}

impl std::fmt::Debug for DeviceKvWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKvWriter")
            .field("layers", &self.layers.len())
            .field("block_bytes", &self.block_bytes)
            .finish()
    }
}

impl DeviceKvWriter {
    /// A writer into the first `blocks` blocks of each of `cache`'s layers, through `lane`.
    #[cfg(any(feature = "cuda", feature = "rocm"))]
    fn over<D: ferry_kernels::gpu::launch::Gpu>(
        lane: CopyLane,
        cache: &crate::kv::device::DeviceKvCache<D>,
        blocks: usize,
    ) -> Result<Self, ModelError> {
        let layout = *cache.layout();
        let layers = (0..layout.num_layers)
            .map(|l| cache.block_bytes(l, BlockId(0), blocks))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            lane,
            layers,
            block_bytes: cache.dtype().block_bytes(&layout),
        })
    }

    /// A writer of a GPU engine's target cache (its first `blocks` blocks: CUDA keeps the
    /// graphs' scratch block after the pool's) on a copy stream of its own.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(cache: &crate::gpu::GpuKvCache, blocks: usize) -> Result<Self, ModelError> {
        Self::over(CopyLane::Cuda(cache.device().copy_stream()?), cache, blocks)
    }

    /// A writer of a ROCm engine's target cache (every block: ROCm keeps no scratch block).
    #[cfg(feature = "rocm")]
    pub(crate) fn rocm(cache: &crate::rocm::RocmKvCache) -> Result<Self, ModelError> {
        let blocks = cache.layout().num_blocks;
        Self::over(CopyLane::Rocm(cache.device().clone()), cache, blocks)
    }

    /// A writer of a drafter's context rows where they live on a GPU (`None` on the host).
    pub(crate) fn of_store(store: &crate::kv::KvStore) -> Option<Result<Self, ModelError>> {
        match store {
            crate::kv::KvStore::Host(_) => None,
            #[cfg(feature = "cuda")]
            crate::kv::KvStore::Cuda(c) => Some(Self::cuda(c, c.layout().num_blocks)),
            #[cfg(feature = "rocm")]
            crate::kv::KvStore::Rocm(c) => Some(Self::rocm(c)),
        }
    }

    /// Copies `data`, whole consecutive blocks of layer `layer` from `first` on in the cache's
    /// dtype, into the device cache, and waits for the copy. Errors (nothing written) for a
    /// run that is not whole blocks or reaches outside the layer's pool blocks.
    ///
    /// # Safety
    /// Every block of the run is reserved for the caller's transfer (admitted under its fence,
    /// [`crate::kv::RemoteFences`]), so the engine neither reads nor writes it until that
    /// transfer completes, and an [`EngineHandle`] of this engine is alive (the cache lives
    /// while the engine thread runs).
    #[allow(unsafe_code)]
    pub unsafe fn write_run(
        &self,
        layer: usize,
        first: BlockId,
        data: &[u8],
    ) -> Result<(), ModelError> {
        let block = self.block_bytes.max(1);
        if data.is_empty() || data.len() % block != 0 {
            return Err(ModelError::Kv(format!(
                "a KV run must be whole blocks of {block} bytes, got {}",
                data.len()
            )));
        }
        let &(addr, len) = self
            .layers
            .get(layer)
            .ok_or_else(|| ModelError::Kv(format!("layer {layer} is outside the device cache")))?;
        let offset = first.0 as usize * block;
        if offset + data.len() > len {
            return Err(ModelError::Kv(format!(
                "blocks {first}.. ({} bytes) reach outside layer {layer}'s {len} bytes of pool blocks",
                data.len()
            )));
        }
        let dst = addr + offset as u64;
        match &self.lane {
            #[cfg(feature = "cuda")]
            CopyLane::Cuda(copy) => {
                // SAFETY: the range lies in the layer's pool blocks (checked above), which live
                // while the engine does; the caller's blocks are its transfer's alone (above).
                unsafe { copy.write_and_wait(dst, data) }.map_err(ModelError::from)
            }
            #[cfg(feature = "rocm")]
            CopyLane::Rocm(dev) => {
                // SAFETY: as for CUDA.
                unsafe { dev.write_to(dst, data) }.map_err(ModelError::from)
            }
            #[allow(unreachable_patterns)]
            _ => {
                let _ = dst;
                Err(ModelError::Kv("this build has no GPU backend".into()))
            }
        }
    }
}

/// Result of a prefill job.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillOutcome {
    /// The first generated token.
    pub first_token: u32,
    /// Its log-probabilities, when the job asked ([`PrefillJob::logprobs`]).
    pub first_logprobs: Option<TokenLogprobs>,
    /// The prompt's log-probabilities when the job asked ([`PrefillJob::prompt_logprobs`]; as
    /// [`EngineEvent::PromptLogprobs`]); empty otherwise.
    pub prompt_logprobs: Vec<TokenLogprobs>,
    /// Prompt tokens computed.
    pub computed_tokens: usize,
    /// Prompt tokens reused from this engine's prefix cache.
    pub reused_tokens: usize,
    /// From the end of the forward that computed the prompt to the last layer handed to the
    /// job's sink — and, for rows left on the device, until the transport finished reading
    /// them: how long shipping trailed the compute inside the engine (zero on the CPU, whose
    /// forward calls the sinks between layers).
    pub ship_tail: std::time::Duration,
}

/// What a prefill peer returned for an awaited request besides its KV
/// ([`EngineHandle::remote_done_with`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RemoteFirst {
    /// The first generated token.
    pub token: u32,
    /// Its log-probabilities, when the request asked.
    pub logprobs: Option<TokenLogprobs>,
    /// The prompt's log-probabilities, when the request asked (as
    /// [`EngineEvent::PromptLogprobs`]); empty otherwise.
    pub prompt_logprobs: Vec<TokenLogprobs>,
}

/// Counters since start and current gauges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Prompt tokens computed by prefills.
    pub prefill_computed_tokens: u64,
    /// Prompt tokens reused from the prefix cache.
    pub prefill_reused_tokens: u64,
    /// Requests ended (any outcome).
    pub requests_finished: u64,
    /// Decode requests whose prompt KV came from a peer / was computed here / was recomputed
    /// here after a peer failed.
    pub remote_prefills: u64,
    /// See `remote_prefills`.
    pub local_prefills: u64,
    /// See `remote_prefills`.
    pub recomputed_prefills: u64,
    /// Samples forked from another sample's prompt (`n` > 1: every sample but the first). A
    /// fork shares the prompt's full blocks and computes only the rest (1 to a page of
    /// tokens), which `fork_tail_tokens` counts; neither counts as a prefill above.
    pub forked_samples: u64,
    /// See `forked_samples`.
    pub fork_tail_tokens: u64,
    /// KV bytes peers landed here for completed remote prefills (what their transfers
    /// acknowledged: [`EngineHandle::remote_done`]).
    pub kv_bytes_received: u64,
    /// Blocks referenced by live requests.
    pub kv_blocks_used: usize,
    /// Pool size.
    pub kv_blocks_total: usize,
    /// Blocks held only by the prefix cache.
    pub kv_blocks_cached: usize,
    /// Sequences in the running batch.
    pub running: usize,
    /// Sequences waiting (queued prefill or awaiting a peer's KV).
    pub waiting: usize,
    /// Prompt tokens queued and not yet computed.
    pub queued_prefill_tokens: u64,
    /// Speculative rounds (one per drafting sequence per step with γ ≥ 1).
    pub spec_rounds: u64,
    /// Drafts verified in those rounds.
    pub spec_drafted_tokens: u64,
    /// Drafts accepted. Mean acceptance length = (accepted + rounds) / rounds.
    pub spec_accepted_tokens: u64,
    /// Rounds by the drafts each verified (entry γ: a sequence's rounds of γ drafts it could
    /// use; entry 0 unused): which widths a verify-length policy picked, e.g. whether
    /// `goodput` ever ran a narrower graphed width at load (session 42). Sums to
    /// `spec_rounds`.
    pub spec_rounds_by_width: Vec<u64>,
    /// Steps whose verify forward read the drafts where the drafter left them, on the device
    /// (a round whose width was known before drafting: `fixed:N` or a whole block under
    /// `confidence`, every running sequence greedy; `FERRY_QUEUED_DRAFTS=0` turns it off).
    pub spec_queued_steps: u64,
    /// Rounds by what the confidence head predicted they would accept, against what they did:
    /// the evidence for `goodput`'s choice after drafting (a round predicted to accept little
    /// is skipped there, so a policy that verifies every round, e.g. `fixed:8`, measures it).
    pub spec_by_prediction: PredictionBins,
    /// Greedy sequences' drafts the step did not verify, binned the same way, with what
    /// verification would have accepted (the tokens decoded after them tell exactly): what
    /// `goodput`'s skipped rounds were worth. Not counted in the `spec_*` totals.
    pub spec_skipped_by_prediction: PredictionBins,
    /// Forwards replayed from a CUDA graph (decode-only steps on CUDA; 0 on the CPU).
    pub graph_steps: u64,
    /// On CUDA, prefill-job layers handed to their sink before the forward's last layer was
    /// computed (layer-wise shipping observed; 0 on the CPU, which is layer-wise by design).
    pub kv_layers_shipped_early: u64,
    /// On CUDA, forwards that shipped prefill-job layers, and the summed wall time (µs) from
    /// the end of each such forward (logits on the host) to its last layer handed to the
    /// sink: the shipping the forward did not hide.
    pub kv_ship_forwards: u64,
    /// See `kv_ship_forwards`.
    pub kv_ship_tail_us: u64,
    /// Host bytes of KV row storage in the engine's pool: the whole cache in f32 on the CPU,
    /// 0 on a GPU (its pool keeps block ids only; the rows live in the device cache).
    pub kv_host_row_bytes: u64,
    /// On a GPU, page-locked host bytes staging shipped layers (the ring, sized for the layers
    /// in flight of the largest prefill batch so far); 0 on the CPU and before any shipping.
    pub kv_host_staging_bytes: u64,
    /// Engine steps by kind and their summed wall time by phase: where a worker's time goes.
    /// See [`StepTimes`].
    pub step_times: StepTimes,
}

/// Engine steps by kind, each with its count and its summed wall time by phase.
///
/// A step is one batch. Speculation pays when a round step's tokens per second beat a plain
/// decode step's, so the kinds are kept apart; the phases say where a kind's time goes. They
/// are host wall time, measured without extra device synchronisation: on a GPU the forward's
/// launches return before the device is done, so `launch` is the host's share and `sample`
/// holds the wait for the device (and a commit's launched drafter context is waited for by
/// the next step).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepTimes {
    /// Decode-only steps that verified no drafts (plain decoding, or speculation skipped).
    pub decode: StepKind,
    /// Decode-only steps that verified drafts (speculative rounds).
    pub round: StepKind,
    /// Steps with prompt work (prefill jobs or prompt chunks), decode rows riding along or not.
    pub prompt: StepKind,
}

/// One kind of engine step: how many ran and their summed wall time (µs) by phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepKind {
    /// Steps.
    pub steps: u64,
    /// Planning: the drafter pass, and any deferred drafter context written before it.
    pub plan_us: u64,
    /// Building the batch's inputs and running (on a GPU: launching) its forward.
    pub launch_us: u64,
    /// Sampling and verification, the tokens brought to the host (on a GPU: the wait for the
    /// forward included).
    pub sample_us: u64,
    /// Committing: block tables, tokens sent, drafter context of the committed rows.
    pub commit_us: u64,
    /// Decoding sequences (prompt work not counted), summed over the steps (÷ `steps`: how
    /// full a step of this kind was).
    pub sequences: u64,
    /// Decode rows, summed over the steps: one per sequence plus its drafts verified (prompt
    /// tokens not counted).
    pub decode_rows: u64,
    /// Steps whose target forward was replayed from a CUDA graph (the rest ran eagerly).
    pub graphed: u64,
}

impl StepKind {
    /// All phases.
    pub fn total_us(&self) -> u64 {
        self.plan_us + self.launch_us + self.sample_us + self.commit_us
    }

    /// Mean milliseconds of `us` per step; `None` without steps.
    pub fn mean_ms(&self, us: u64) -> Option<f64> {
        (self.steps > 0).then(|| us as f64 / self.steps as f64 / 1e3)
    }

    /// The counts since `before` (an earlier snapshot of the same engine).
    pub fn since(&self, before: &StepKind) -> StepKind {
        StepKind {
            steps: self.steps.saturating_sub(before.steps),
            plan_us: self.plan_us.saturating_sub(before.plan_us),
            launch_us: self.launch_us.saturating_sub(before.launch_us),
            sample_us: self.sample_us.saturating_sub(before.sample_us),
            commit_us: self.commit_us.saturating_sub(before.commit_us),
            sequences: self.sequences.saturating_sub(before.sequences),
            decode_rows: self.decode_rows.saturating_sub(before.decode_rows),
            graphed: self.graphed.saturating_sub(before.graphed),
        }
    }
}

/// Upper edges of [`PredictionBins`]' bins: the drafts the head predicted a round would accept
/// (the sum of its verified drafts' cumulative survivals); the last bin is open.
pub const PREDICTION_EDGES: [f64; 7] = [0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0];

/// One bin of [`PredictionBins`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PredictionBin {
    /// Rounds whose prediction fell in the bin.
    pub rounds: u64,
    /// Their predictions summed, in thousandths of a draft.
    pub predicted_milli: u64,
    /// Drafts they accepted.
    pub accepted: u64,
}

/// Rounds binned by the head's prediction ([`PREDICTION_EDGES`], then one open bin).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PredictionBins(pub [PredictionBin; PREDICTION_EDGES.len() + 1]);

impl PredictionBins {
    /// A round the head predicted to accept `predicted` drafts accepted `accepted`.
    pub(crate) fn record(&mut self, predicted: f64, accepted: usize) {
        let i = PREDICTION_EDGES
            .iter()
            .position(|&e| predicted < e)
            .unwrap_or(PREDICTION_EDGES.len());
        let b = &mut self.0[i];
        b.rounds += 1;
        b.predicted_milli += (predicted.max(0.0) * 1e3).round() as u64;
        b.accepted += accepted as u64;
    }

    /// The counts since `before`.
    pub fn since(&self, before: &PredictionBins) -> PredictionBins {
        let mut out = *self;
        for (o, b) in out.0.iter_mut().zip(&before.0) {
            o.rounds = o.rounds.saturating_sub(b.rounds);
            o.predicted_milli = o.predicted_milli.saturating_sub(b.predicted_milli);
            o.accepted = o.accepted.saturating_sub(b.accepted);
        }
        out
    }
}

/// What one step carried (see [`StepKind`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StepShape {
    /// It had prompt work.
    pub prompt: bool,
    /// Decoding sequences.
    pub sequences: usize,
    /// Drafts verified.
    pub drafts: usize,
    /// Its target forward was replayed from a CUDA graph.
    pub graph: bool,
}

/// Wall time of one step's phases, in seconds (see [`StepKind`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StepPhases {
    pub plan: f64,
    pub launch: f64,
    pub sample: f64,
    pub commit: f64,
}

impl StepTimes {
    /// The kinds with their metric label: `decode`, `spec_round`, `prompt`.
    pub fn kinds(&self) -> [(&'static str, &StepKind); 3] {
        [
            ("decode", &self.decode),
            ("spec_round", &self.round),
            ("prompt", &self.prompt),
        ]
    }

    /// The counts since `before` (an earlier snapshot of the same engine).
    pub fn since(&self, before: &StepTimes) -> StepTimes {
        StepTimes {
            decode: self.decode.since(&before.decode),
            round: self.round.since(&before.round),
            prompt: self.prompt.since(&before.prompt),
        }
    }

    /// Counts one step: `prompt` if it had prompt work, else a round if it verified drafts.
    pub(crate) fn record(&mut self, shape: StepShape, p: StepPhases) {
        let kind = if shape.prompt {
            &mut self.prompt
        } else if shape.drafts > 0 {
            &mut self.round
        } else {
            &mut self.decode
        };
        let us = |s: f64| (s.max(0.0) * 1e6) as u64;
        kind.steps += 1;
        kind.plan_us += us(p.plan);
        kind.launch_us += us(p.launch);
        kind.sample_us += us(p.sample);
        kind.commit_us += us(p.commit);
        kind.sequences += shape.sequences as u64;
        kind.decode_rows += (shape.sequences + shape.drafts) as u64;
        kind.graphed += u64::from(shape.graph);
    }
}

/// Commands the engine thread executes, in order.
pub(crate) enum Command {
    Generate {
        id: SeqId,
        job: GenerateJob,
        events: mpsc::UnboundedSender<EngineEvent>,
        options: GenerateOptions,
        /// The caller's span (see [`PrefillJob::span`]).
        span: tracing::Span,
        /// Samples 1.. of an `n` > 1 request (empty for one sample): forked off this request
        /// once its prompt is in the cache.
        forks: Vec<(SeqId, mpsc::UnboundedSender<EngineEvent>)>,
    },
    Prefill(PrefillJob),
    /// Consecutive blocks of one layer from a peer, from `first` on, in the engine's cache
    /// dtype.
    WriteKv {
        layer: usize,
        first: BlockId,
        data: Vec<u8>,
    },
    RemoteDone {
        id: SeqId,
        first: RemoteFirst,
        bytes: u64,
    },
    /// Every block of one target layer as the cache stores it.
    ReadKv {
        layer: usize,
        reply: oneshot::Sender<Result<Vec<u8>, String>>,
    },
    RemoteFailed {
        id: SeqId,
        recompute: bool,
        reason: String,
        /// Whether the peer may still be writing (the decode side stopped waiting).
        abandoned: bool,
    },
    RemoteSettled {
        id: SeqId,
    },
    Stats(oneshot::Sender<EngineStats>),
    /// Several commands handled together, before the next step ([`EngineHandle::generate_all`]).
    All(Vec<Command>),
    DrainEvents(oneshot::Sender<Vec<KvEvent>>),
    Snapshot(oneshot::Sender<(Vec<ferry_proto::ids::BlockHash>, ferry_proto::ids::EventId)>),
}

/// Errors of the handle itself (the engine's per-request errors arrive as events).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Too many requests in flight.
    #[error("engine overloaded: {in_flight} requests in flight, limit {limit}")]
    Overloaded {
        /// Requests queued or running.
        in_flight: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The engine thread is gone.
    #[error("the engine has stopped")]
    Stopped,
    /// A job failed.
    #[error("{0}")]
    Job(String),
}

/// A cheap, clone-able handle to one engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    next_id: Arc<AtomicU64>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: usize,
    layout: crate::kv::KvLayout,
    /// The element type of the engine's KV cache (what peers' writes carry).
    kv_dtype: KvDtype,
    config: Arc<crate::config::ModelConfig>,
    /// Drafter KV pool layers (0 without a drafter or without drafter context).
    draft_kv_layers: usize,
    /// The device the forward runs on.
    device: Device,
    /// The host pool's rows (CPU engines), for a transfer region to expose.
    host_rows: Option<Arc<crate::kv::HostRows>>,
    /// The device cache's layers (CUDA engines), for a transfer region to expose.
    device_kv: Option<DeviceKv>,
    /// Copies peers' runs into the device cache off the engine thread (GPU engines).
    device_kv_writer: Option<Arc<DeviceKvWriter>>,
    /// Assembles peers' drafter context rows off the engine thread (engines with a drafter
    /// that keeps KV).
    draft_landing: Option<Arc<DraftLanding>>,
    /// Which remote prefill each block is reserved for (written by the engine thread).
    fences: Arc<crate::kv::RemoteFences>,
    /// The engine thread, waited for when the last handle goes (declared after `tx`, whose
    /// drop is what ends it). Held for its `Drop` only.
    #[allow(dead_code)]
    thread: Arc<EngineThread>,
}

/// How long the last [`EngineHandle`]'s drop waits for the engine thread to end.
const ENGINE_EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The engine thread's end, seen from the handles: when the last handle is dropped (its
/// command sender first, so the thread leaves its loop after the step it is in), the drop waits
/// — at most [`ENGINE_EXIT_WAIT`] — until the thread has dropped the scheduler and with it the
/// model, the KV cache and any GPU state. Without the wait a process could return from `main`
/// while its engine thread was still inside cuBLAS or freeing device memory, and the CUDA
/// teardown at exit then met it: a segfault after the work was done (docs/gpu.md, sessions 9,
/// 10 and 24).
struct EngineThread {
    /// Disconnected when the thread has dropped the scheduler (in a mutex only so the handles
    /// stay `Sync`: the drop reads it through `&mut self`).
    done: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
    /// Joined once `done` says the thread is about to return (never while it may block).
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Drop for EngineThread {
    fn drop(&mut self) {
        let Some(h) = self.handle.take() else { return };
        if std::thread::current().id() == h.thread().id() {
            return; // never wait for oneself
        }
        let ended = match self.done.get_mut() {
            Ok(done) => !matches!(
                done.recv_timeout(ENGINE_EXIT_WAIT),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout)
            ),
            Err(_) => false,
        };
        if ended {
            let _ = h.join();
        } else {
            tracing::warn!(
                seconds = ENGINE_EXIT_WAIT.as_secs(),
                "the engine thread did not end after its last handle was dropped"
            );
        }
    }
}

/// Decrements the in-flight count when a request's handle-side state is dropped.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A running generation: its id and event stream.
pub struct Generation {
    /// The engine's id for the request (for remote prefill completion).
    pub id: SeqId,
    /// Events until `Finished` or `Failed`; dropping it cancels the request.
    pub events: mpsc::UnboundedReceiver<EngineEvent>,
    _in_flight: InFlight,
}

impl EngineHandle {
    /// Starts the engine thread for `model` with a pool sized by `config`.
    pub fn spawn(model: DeepseekModel, config: EngineConfig) -> Result<Self, ModelError> {
        Self::spawn_with(model, None, config)
    }

    /// Starts the engine thread on `config.device`, speculating with `drafter` when one is
    /// given (requests opt out per [`GenerateOptions`]), on every device: the drafter moves to
    /// the target's backend and drafts there from the target's tapped hidden states (see
    /// [`backend`]). Blocking: on a GPU it uploads the model and the drafter.
    pub fn spawn_with(
        model: DeepseekModel,
        drafter: Option<Box<dyn Drafter>>,
        config: EngineConfig,
    ) -> Result<Self, ModelError> {
        Self::spawn_source(crate::dummy::ModelSource::Model(model), drafter, config)
    }

    /// [`Self::spawn_with`] from a [`ModelSource`](crate::dummy::ModelSource): a built model,
    /// or a config whose dummy weights are drawn where the model runs (on a CUDA device, drawn
    /// there directly).
    pub fn spawn_source(
        source: crate::dummy::ModelSource,
        drafter: Option<Box<dyn Drafter>>,
        config: EngineConfig,
    ) -> Result<Self, ModelError> {
        let c = source.config();
        let layout = crate::kv::KvLayout::for_model(c, config.num_blocks, config.page_size);
        layout.validate()?;
        let model_config = Arc::new(c.clone());
        let backend = backend::Backend::open(
            source,
            &layout,
            config.device,
            config.gpu_mode,
            backend::GpuOptions {
                cuda_graphs: config.cuda_graphs,
                layerwise_shipping: config.gpu_layerwise_shipping,
            },
        )?;
        let device = backend.device();
        // Block ids on every device; rows on the host only where the forward reads them there.
        let pool = backend.new_pool(layout, config.host_kv_memory.as_ref().map(|m| &*m.0))?;
        let host_rows = pool.host_rows();
        let device_kv = backend.device_kv();
        let device_kv_writer = backend.device_kv_writer().map(Arc::new);
        let fences = Arc::new(crate::kv::RemoteFences::new(layout.num_blocks));
        let kv_dtype = backend.kv_dtype();
        // On a GPU with graphs, rounds run at a uniform width (γ + 1 rows per sequence),
        // replayed from graphs on CUDA for as many sequences as a verify graph of that width
        // holds (ROCm runs them eagerly, at any batch).
        let uniform = device.is_gpu() && config.cuda_graphs;
        let spec = drafter
            .map(|d| {
                let b = backend.model().backend();
                let limit = |gamma: usize| verify_graph_seqs(device, gamma);
                let graphs = uniform.then_some(&limit as &dyn Fn(usize) -> usize);
                spec::Speculator::new(d, (&layout, kv_dtype), b, config.spec.clone(), graphs)
            })
            .transpose()?;
        let draft_landing = spec.as_ref().and_then(spec::Speculator::landing);
        let draft_kv_layers = spec.as_ref().map_or(0, spec::Speculator::pool_layers);
        let (tx, rx) = mpsc::unbounded_channel();
        let max_in_flight = config.max_in_flight;
        let engine_fences = fences.clone();
        let (done_tx, done) = std::sync::mpsc::channel::<()>();
        let handle = std::thread::Builder::new()
            .name("ferry-engine".into())
            .spawn(move || {
                // `run` owns the scheduler: it is dropped (model, cache, GPU state) before the
                // handles are told the thread is done.
                scheduler::Scheduler::new(backend, pool, spec, config, engine_fences).run(rx);
                drop(done_tx);
            })
            .map_err(|e| ModelError::Invalid(format!("cannot start the engine thread: {e}")))?;
        let thread = Arc::new(EngineThread {
            done: std::sync::Mutex::new(done),
            handle: Some(handle),
        });
        Ok(Self {
            tx,
            next_id: Arc::new(AtomicU64::new(1)),
            in_flight: Arc::new(AtomicUsize::new(0)),
            max_in_flight,
            layout,
            kv_dtype,
            config: model_config,
            draft_kv_layers,
            device,
            host_rows,
            device_kv,
            device_kv_writer,
            draft_landing,
            fences,
            thread,
        })
    }

    /// Loads the target from `model_dir` and, when `drafter_dir` is given, a DSpark drafter
    /// from it, then starts the engine. Blocking (loading maps and converts weights): call it
    /// off the async runtime.
    pub fn load(
        model_dir: &std::path::Path,
        drafter_dir: Option<&std::path::Path>,
        config: EngineConfig,
    ) -> Result<Self, ModelError> {
        if let crate::dummy::LoadFormat::Dummy { seed } = config.load_format {
            let model_config =
                crate::config::ModelConfig::from_file(&model_dir.join("config.json"))?;
            // The drafter's config.json gets seeded random weights too, so a speculating
            // engine's costs (drafter pass, verify forwards, rounds) can be measured on a large
            // model's shape.
            let drafter = drafter_dir
                .map(|d| {
                    crate::drafter::DsparkDrafter::load_as(d, &model_config, config.load_format)
                })
                .transpose()?
                .map(|d| Box::new(d) as Box<dyn Drafter>);
            tracing::info!(
                model = %model_dir.display(),
                seed,
                "--load-format dummy: config.json with seeded random weights (outputs mean nothing)"
            );
            let source = crate::dummy::ModelSource::Dummy {
                config: model_config,
                seed,
            };
            return Self::spawn_source(source, drafter, config);
        }
        let model = DeepseekModel::load(model_dir)?;
        let drafter = drafter_dir
            .map(|d| crate::drafter::DsparkDrafter::load(d, model.config()))
            .transpose()?
            .map(|d| Box::new(d) as Box<dyn Drafter>);
        Self::spawn_with(model, drafter, config)
    }

    /// Drafter KV pool layers a peer may write after the target's layers (0: none). Layer
    /// `num_layers + j` of a transfer is drafter pool layer `j`.
    pub fn draft_kv_layers(&self) -> usize {
        self.draft_kv_layers
    }

    /// The device the forward runs on: `config.device`, or the CPU when that GPU could not be
    /// opened.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The KV pool geometry.
    pub fn kv_layout(&self) -> crate::kv::KvLayout {
        self.layout
    }

    /// The host pool's rows (a CPU engine's KV), shared so a decode worker's transfer region
    /// can expose them as registered memory; `None` when the rows live on a device.
    pub fn host_rows(&self) -> Option<Arc<crate::kv::HostRows>> {
        self.host_rows.clone()
    }

    /// Where a CUDA engine's KV cache is in device memory, so a decode worker's transfer region
    /// can register it for peers to put into (valid while any handle lives); `None` on the CPU
    /// and ROCm.
    pub fn device_kv(&self) -> Option<DeviceKv> {
        self.device_kv.clone()
    }

    /// Copies peers' runs of target-layer blocks into the device cache from the caller's
    /// thread (CUDA and ROCm engines; `None` on the CPU): what a decode worker's transfer
    /// region uses for a transport that cannot put into device memory itself (TCP), instead of
    /// [`Self::write_kv`]'s hop through the engine thread.
    pub fn device_kv_writer(&self) -> Option<Arc<DeviceKvWriter>> {
        self.device_kv_writer.clone()
    }

    /// Lands peers' writes of the drafter's context layers (transfer layers from
    /// [`Self::kv_layout`]'s `num_layers` on) from the caller's thread: widened, assembled per
    /// block and, on a GPU, copied into the drafter KV (`None` without a drafter that keeps
    /// KV). What a decode worker's transfer region uses under `FERRY_DIRECT_KV_WRITES=all`
    /// instead of [`Self::write_kv`]'s hop through the engine thread for those layers.
    pub fn draft_landing(&self) -> Option<Arc<DraftLanding>> {
        self.draft_landing.clone()
    }

    /// Which remote prefill each block is reserved for: a block written by a peer must be
    /// reserved under the peer's fence, which is the awaiting sequence's id
    /// ([`RemoteFences::holds`](crate::kv::RemoteFences::holds)).
    pub fn remote_fences(&self) -> Arc<crate::kv::RemoteFences> {
        self.fences.clone()
    }

    /// The element type of the engine's KV cache: f32 on the CPU and in CUDA exact mode, bf16
    /// in CUDA fast mode. Peers' writes ([`Self::write_kv`]) carry this dtype, and a decode
    /// worker advertises it as the transfer wire's.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    /// The model configuration.
    pub fn model_config(&self) -> &crate::config::ModelConfig {
        &self.config
    }

    fn admit(&self) -> Result<InFlight, EngineError> {
        let n = self.in_flight.fetch_add(1, Ordering::AcqRel);
        let guard = InFlight(self.in_flight.clone());
        if n >= self.max_in_flight {
            return Err(EngineError::Overloaded {
                in_flight: n,
                limit: self.max_in_flight,
            });
        }
        Ok(guard)
    }

    fn send(&self, cmd: Command) -> Result<(), EngineError> {
        self.tx.send(cmd).map_err(|_| EngineError::Stopped)
    }

    /// Submits a generation request. The current span becomes the request's span on the
    /// engine thread (parent of its `queue` span, linked from the batches that run it).
    pub fn generate(&self, job: GenerateJob) -> Result<Generation, EngineError> {
        self.generate_with(job, GenerateOptions::default())
    }

    /// [`Self::generate`] with per-request options (speculation on or off).
    pub fn generate_with(
        &self,
        job: GenerateJob,
        options: GenerateOptions,
    ) -> Result<Generation, EngineError> {
        let guard = self.admit()?;
        let (cmd, generation) = self.request(job, options, guard, tracing::Span::current());
        self.send(cmd)?;
        Ok(generation)
    }

    /// One request's command (a fresh id, its event channel, no forks) and the caller's
    /// [`Generation`] holding `guard`.
    fn request(
        &self,
        job: GenerateJob,
        options: GenerateOptions,
        guard: InFlight,
        span: tracing::Span,
    ) -> (Command, Generation) {
        let id = SeqId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (events, rx) = mpsc::unbounded_channel();
        let cmd = Command::Generate {
            id,
            job,
            events,
            options,
            span,
            forks: Vec::new(),
        };
        let generation = Generation {
            id,
            events: rx,
            _in_flight: guard,
        };
        (cmd, generation)
    }

    /// Several requests submitted as one command: the engine admits all of them before its
    /// next step, so they can share their first prompt step (a benchmark level's first batch,
    /// or a client's list of prompts), which requests sent one by one cannot rely on: the
    /// engine may step between two sends. Fails as a whole (nothing submitted) when the
    /// engine is overloaded or stopped.
    pub fn generate_all(&self, jobs: Vec<GenerateJob>) -> Result<Vec<Generation>, EngineError> {
        let mut guards = Vec::with_capacity(jobs.len());
        for _ in &jobs {
            guards.push(self.admit()?);
        }
        let span = tracing::Span::current();
        let (cmds, generations): (Vec<_>, Vec<_>) = jobs
            .into_iter()
            .zip(guards)
            .map(|(job, guard)| self.request(job, GenerateOptions::default(), guard, span.clone()))
            .unzip();
        self.send(Command::All(cmds))?;
        Ok(generations)
    }

    /// `n` samples of one prompt (`1 ≤ n ≤` [`MAX_SAMPLES`]), one [`Generation`] each, in
    /// sample order. The prompt is prefilled once, as `job.prefill` says, by sample 0; when its
    /// KV is in the cache every other sample is forked off it: it shares the prompt's full
    /// blocks by reference and computes only the rest (the last, partly filled block, or the
    /// last page when the prompt fills its blocks exactly — at least the last token, whose
    /// logits it samples its first token from). Each sample then decodes, finishes, fails and
    /// frees its blocks on its own. Sample `i` draws with [`sample_seed`]`(seed, i)` when the
    /// job is seeded; each has its own copy of the grammar. If the prompt's prefill fails (or
    /// sample 0 goes away before it), every sample fails with it. Each sample counts as one
    /// request in flight. Not for migrated requests (`options.resumed_tokens` must be 0).
    pub fn generate_n(
        &self,
        job: GenerateJob,
        n: usize,
        options: GenerateOptions,
    ) -> Result<Vec<Generation>, EngineError> {
        if n == 0 || n > MAX_SAMPLES {
            return Err(EngineError::Job(format!(
                "`n` must be between 1 and {MAX_SAMPLES}, got {n}"
            )));
        }
        if n > 1 && options.resumed_tokens > 0 {
            return Err(EngineError::Job(
                "a resumed request cannot fork into several samples".into(),
            ));
        }
        let mut guards = Vec::with_capacity(n);
        for _ in 0..n {
            guards.push(self.admit()?);
        }
        let mut channels: Vec<_> = (0..n)
            .map(|_| {
                let id = SeqId(self.next_id.fetch_add(1, Ordering::Relaxed));
                let (tx, rx) = mpsc::unbounded_channel();
                (id, tx, rx)
            })
            .collect();
        let mut generations = Vec::with_capacity(n);
        let mut forks = Vec::with_capacity(n - 1);
        let (id, events) = {
            let (id, tx, _) = &channels[0];
            (*id, tx.clone())
        };
        for (i, ((sid, tx, rx), guard)) in channels.drain(..).zip(guards).enumerate() {
            if i > 0 {
                forks.push((sid, tx));
            }
            generations.push(Generation {
                id: sid,
                events: rx,
                _in_flight: guard,
            });
        }
        self.send(Command::Generate {
            id,
            job,
            events,
            options,
            span: tracing::Span::current(),
            forks,
        })?;
        Ok(generations)
    }

    /// Runs a prefill job and waits for its outcome (in the current span, as for
    /// [`EngineHandle::generate`]), with no logits controls and no `min_tokens`.
    pub async fn prefill(
        &self,
        prompt: Vec<u32>,
        sampling: SamplingParams,
        skip_tokens: usize,
        on_layer: LayerSinkFn,
    ) -> Result<PrefillOutcome, EngineError> {
        self.prefill_work(PrefillWork {
            prompt,
            sampling,
            controls: LogitsControls::default(),
            stop: StopParams::max_tokens(1),
            logprobs: None,
            prompt_logprobs: None,
            grammar: None,
            skip_tokens,
            on_layer,
            on_draft_layer: None,
            rows_on_device: false,
        })
        .await
    }

    /// [`Self::prefill`], also shipping the drafter's context when `on_draft_layer` is set.
    pub async fn prefill_work(&self, work: PrefillWork) -> Result<PrefillOutcome, EngineError> {
        let _guard = self.admit()?;
        let (reply, rx) = oneshot::channel();
        self.send(Command::Prefill(PrefillJob {
            prompt: work.prompt,
            sampling: work.sampling,
            controls: work.controls,
            stop: work.stop,
            logprobs: work.logprobs,
            prompt_logprobs: work.prompt_logprobs,
            grammar: work.grammar,
            skip_tokens: work.skip_tokens,
            on_layer: work.on_layer,
            reply,
            span: tracing::Span::current(),
            on_draft_layer: work.on_draft_layer,
            rows_on_device: work.rows_on_device,
        }))?;
        rx.await
            .map_err(|_| EngineError::Stopped)?
            .map_err(EngineError::Job)
    }

    /// Writes blocks of one layer received from a peer: `first` and the blocks after it, as
    /// many as `data` holds (a transport's run of consecutive blocks; one block is a run of
    /// one), only into blocks reserved for a remote prefill (a run with any other block is
    /// dropped with a warning). `data` is the blocks' `[block][page][width]` rows as
    /// little-endian elements of [`Self::kv_dtype`], for the drafter's context layers (`layer
    /// ≥` the target's layers) too; a write that is not whole blocks is dropped with a warning.
    /// On the CPU it lands in the host pool; on a GPU it is copied straight into the device
    /// cache, one copy per run.
    pub fn write_kv(&self, layer: usize, first: BlockId, data: Vec<u8>) -> Result<(), EngineError> {
        self.send(Command::WriteKv { layer, first, data })
    }

    /// The peer finished the prompt KV of `id` and sampled `first_token`, having landed `bytes`
    /// of it here (its transfer's acknowledged total, drafter context included), which
    /// [`EngineStats::kv_bytes_received`] counts: bytes a peer put into registered memory pass
    /// no engine code, so the engine counts what the completed transfers report.
    pub fn remote_done(&self, id: SeqId, first_token: u32, bytes: u64) -> Result<(), EngineError> {
        self.remote_done_with_logprobs(id, first_token, None, bytes)
    }

    /// [`Self::remote_done`], with the first token's log-probabilities as the peer computed
    /// them (for a request that asked, [`GenerateOptions::logprobs`]).
    pub fn remote_done_with_logprobs(
        &self,
        id: SeqId,
        first_token: u32,
        logprobs: Option<TokenLogprobs>,
        bytes: u64,
    ) -> Result<(), EngineError> {
        let first = RemoteFirst {
            token: first_token,
            logprobs,
            prompt_logprobs: Vec::new(),
        };
        self.remote_done_with(id, first, bytes)
    }

    /// [`Self::remote_done`] with everything the peer returned besides the KV: the first token,
    /// its log-probabilities and the prompt's (requests that asked,
    /// [`GenerateOptions::logprobs`] / [`GenerateOptions::prompt_logprobs`]; the caller has
    /// checked them against the request).
    pub fn remote_done_with(
        &self,
        id: SeqId,
        first: RemoteFirst,
        bytes: u64,
    ) -> Result<(), EngineError> {
        self.send(Command::RemoteDone { id, first, bytes })
    }

    /// The peer or the transfer failed for `id`: recompute locally, or fail the request.
    pub fn remote_failed(
        &self,
        id: SeqId,
        recompute: bool,
        reason: String,
    ) -> Result<(), EngineError> {
        self.remote_outcome(id, recompute, reason, false)
    }

    /// This side stopped waiting for `id`'s peer (timeout, or the router dropped the peer)
    /// while the peer may still be writing: like [`Self::remote_failed`], but the blocks
    /// reserved for the peer are quarantined (held, neither reused nor read) until
    /// [`Self::remote_settled`], and a recompute gets fresh blocks. One-sided puts cannot be
    /// refused on arrival, so this is what keeps a late write out of someone else's KV.
    pub fn remote_abandoned(
        &self,
        id: SeqId,
        recompute: bool,
        reason: String,
    ) -> Result<(), EngineError> {
        self.remote_outcome(id, recompute, reason, true)
    }

    fn remote_outcome(
        &self,
        id: SeqId,
        recompute: bool,
        reason: String,
        abandoned: bool,
    ) -> Result<(), EngineError> {
        self.send(Command::RemoteFailed {
            id,
            recompute,
            reason,
            abandoned,
        })
    }

    /// The abandoned peer of `id` has stopped (its call ended): its quarantined blocks are
    /// released.
    pub fn remote_settled(&self, id: SeqId) -> Result<(), EngineError> {
        self.send(Command::RemoteSettled { id })
    }

    /// Current counters and gauges.
    /// Layer `layer` of the KV cache as it is stored, block `b` at `b ×` block bytes, in
    /// [`Self::kv_dtype`] (little-endian; the host pool's f32 on the CPU, the device cache's
    /// bytes on a GPU): what a peer's transfer landed, for inspection and tests.
    pub async fn read_kv_layer(&self, layer: usize) -> Result<Vec<u8>, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::ReadKv { layer, reply })?;
        rx.await
            .map_err(|_| EngineError::Stopped)?
            .map_err(EngineError::Job)
    }

    pub async fn stats(&self) -> Result<EngineStats, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Stats(tx))?;
        rx.await.map_err(|_| EngineError::Stopped)
    }

    /// KV events since the last drain.
    pub async fn drain_kv_events(&self) -> Result<Vec<KvEvent>, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::DrainEvents(tx))?;
        rx.await.map_err(|_| EngineError::Stopped)
    }

    /// Every cached block hash and the last event id (for (re)registration).
    pub async fn kv_snapshot(
        &self,
    ) -> Result<(Vec<ferry_proto::ids::BlockHash>, ferry_proto::ids::EventId), EngineError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Snapshot(tx))?;
        rx.await.map_err(|_| EngineError::Stopped)
    }
}

#[cfg(test)]
mod tests {
    use super::{GenerateOptions, SamplingParams, SpecCounts};

    /// The speculator plans a whole-block round as a graph round only for as many sequences as
    /// the CUDA backend replays one for (`try_graph`'s bucket), so `goodput` costs a larger
    /// batch's round as the eager round it is; ROCm and the CPU replay none, so no bound.
    #[cfg(feature = "cuda")]
    #[test]
    fn whole_block_rounds_are_graph_rounds_only_within_the_verify_graph_limit() {
        use crate::gpu::graph::{graph_bucket, graph_max_seqs};
        use ferry_kernels::Device;
        let block = 8;
        let limit = super::verify_graph_seqs(Device::Cuda(0), block);
        assert_eq!(limit, graph_max_seqs(block + 1));
        assert!(graph_bucket(limit, graph_max_seqs(block + 1)).is_some());
        assert!(graph_bucket(limit + 1, graph_max_seqs(block + 1)).is_none());
        if std::env::var_os("FERRY_GRAPH_MAX_BATCH").is_none() {
            assert_eq!(limit, 64, "256 rows' worth, at least 64 sequences");
        }
        for d in [Device::Rocm(0), Device::Cpu] {
            assert_eq!(super::verify_graph_seqs(d, block), usize::MAX, "{d}");
        }
    }

    #[test]
    fn seeded_sampled_requests_speculate_only_when_they_ask() {
        let sampled = SamplingParams::default();
        let seeded = SamplingParams {
            seed: Some(7),
            ..SamplingParams::default()
        };
        let greedy_seeded = SamplingParams {
            temperature: 0.0,
            ..seeded.clone()
        };
        let top1_seeded = SamplingParams {
            top_k: 1,
            ..seeded.clone()
        };
        let unset = GenerateOptions::default();
        assert!(unset.speculates(&sampled));
        assert!(unset.speculates(&greedy_seeded));
        assert!(unset.speculates(&top1_seeded));
        assert!(!unset.speculates(&seeded));
        for p in [&sampled, &seeded, &greedy_seeded] {
            for on in [false, true] {
                let asked = GenerateOptions {
                    speculative: Some(on),
                    ..GenerateOptions::default()
                };
                assert_eq!(asked.speculates(p), on, "{p:?} asked {on}");
            }
        }
    }

    #[test]
    fn acceptance_length_counts_the_extra_token_of_each_round() {
        assert_eq!(SpecCounts::default().acceptance_length(), None);
        let c = SpecCounts {
            rounds: 4,
            drafted_tokens: 16,
            accepted_tokens: 6,
        };
        assert_eq!(c.acceptance_length(), Some(2.5));
    }
}
