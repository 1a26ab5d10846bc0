//! The engine loop: continuous batching under a token budget.
//!
//! Each step: apply queued commands; drop cancelled requests; build one batch of every
//! decoding sequence's next token plus prefill work (prefill jobs whole, local prompt prefills
//! chunked) up to `max_batch_tokens`; run the forward; sample; emit events; finish and free.
//! A failing forward fails the requests of that batch only, frees their blocks, and the loop
//! goes on.
//!
//! With a drafter, a decoding sequence may instead feed its anchor and γ drafts and commit up
//! to γ + 1 tokens in one step; `round.rs` holds those parts and `super::spec` the design.
//!
//! | file | owns |
//! |---|---|
//! | `scheduler.rs` | the state, the loop, command dispatch, building a step's work, finishing and freeing |
//! | `admit.rs` | the command side: admission, peers' KV writes, remote prefill outcomes, cancellation |
//! | `batch.rs` | the forward side: a batch's inputs and hooks, the forward, committing or failing it |
//! | `round.rs` | the speculative parts: drafting, committing a verified round, drafter context |
//! | `sample.rs` | the sampling side: every plain draw and every round's verification of a batch, on the model's backend |

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use tokio::sync::mpsc;
use tracing::warn;

use super::backend::Backend;
use super::sequence::{PrefillTask, Sequence};
use super::spec::{Draft, DraftBudget, ObservedStep, PromptLoad, Speculator};
use super::{Command, EngineConfig, EngineEvent, EngineStats, FinishReason, PromptSteps};
use super::{Failure, FailureKind, GenerateJob, GenerateOptions, SeqId};
use super::{StepPhases, StepShape};
use crate::kv::{BlockId, KvManager, KvPool, RemoteFences};
use ferry_kernels::cpu::logits::TokenLogprobs;

mod admit;
mod batch;
mod round;
mod sample;

/// Which container a committed row range belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Owner {
    Running(usize),
    Waiting(usize),
    Prefill(usize),
}

/// One entry of a batch.
enum Work {
    /// Decode step of `running[i]`.
    Decode(usize),
    /// A chunk of `n` prompt tokens of `waiting[i]`.
    Chunk(usize, usize),
    /// The whole uncached prompt of `prefills[i]`.
    Prefill(usize),
}

/// What one forward of a scheduler step takes ([`PromptSteps`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StepWork {
    /// The running sequences and the prompt work that fits beside them.
    All,
    /// The running sequences only.
    Decode,
    /// Prompt work only.
    Prompts,
}

/// The state the engine thread owns.
pub(crate) struct Scheduler {
    /// The model on its device (and, on a GPU, the KV rows).
    backend: Backend,
    kv: KvManager,
    config: EngineConfig,
    running: Vec<Sequence>,
    waiting: VecDeque<Sequence>,
    awaiting: HashMap<SeqId, Sequence>,
    prefills: Vec<PrefillTask>,
    /// Blocks peers may write into (reserved for an awaited remote prefill), under each
    /// request's fence; shared with the transfer region, written only here.
    fences: Arc<RemoteFences>,
    /// Blocks of abandoned remote prefills whose peer may still be writing, held (one
    /// reference each) until the peer's call ends.
    quarantine: HashMap<SeqId, Vec<BlockId>>,
    stats: EngineStats,
    /// The drafter and its KV, when this engine speculates.
    spec: Option<Speculator>,
}

/// A request entering the engine.
struct NewRequest {
    id: SeqId,
    job: GenerateJob,
    events: mpsc::UnboundedSender<EngineEvent>,
    options: GenerateOptions,
    span: tracing::Span,
    /// Samples to fork off this one once its prompt is in the cache.
    forks: Vec<PendingFork>,
    /// This request is such a fork ([`Origin::Fork`](super::sequence::Origin::Fork)).
    forked: bool,
}

/// A sample of an `n` > 1 request waiting for the first sample's prompt: admitted (as a local
/// prefill that finds the prompt's full blocks in the prefix cache) when that is in the cache.
pub(crate) struct PendingFork {
    id: SeqId,
    job: GenerateJob,
    events: mpsc::UnboundedSender<EngineEvent>,
    options: GenerateOptions,
}

impl PendingFork {
    /// Tells the sample it will not run: the prompt it was to share failed (as `kind`: a
    /// peer that could not prefill it fails the sample as UNAVAILABLE too, which the router
    /// resumes elsewhere) or went away.
    pub(crate) fn abandon(self, why: &str, kind: FailureKind) {
        let _ = self.events.send(EngineEvent::Failed(super::Failure {
            kind,
            message: format!("the prompt this sample shares {why}"),
        }));
    }
}

/// Sample `index`'s own copy of `job` (its seed, a fresh grammar), prefilled locally after
/// the prompt's full blocks are shared.
fn fork_job(job: &GenerateJob, index: usize) -> GenerateJob {
    let mut sampling = job.sampling.clone();
    sampling.seed = sampling.seed.map(|s| super::sample_seed(s, index));
    GenerateJob {
        prompt: job.prompt.clone(),
        sampling,
        controls: job.controls.clone(),
        stop: job.stop.clone(),
        prefill: super::PrefillSource::Local,
        grammar: job.grammar.clone(),
    }
}

/// What a successful forward hands to [`Scheduler::apply`].
struct BatchResult {
    /// Per work item, what its logits decided (sampled and verified on the backend).
    outcomes: Vec<sample::Outcome>,
    /// Per work item, the prompt log-probabilities its rows gave (items that asked), or why
    /// they could not be computed.
    prompt: HashMap<usize, Result<Vec<TokenLogprobs>, String>>,
    /// Prefill jobs whose layer sink failed.
    hook_errors: HashMap<usize, String>,
    /// Per running sequence, the drafts it verified (empty without a drafter).
    drafts: Vec<Option<Draft>>,
    /// The drafter's context from this batch: written before the sampling, or still to write.
    drafter: DrafterStage,
}

/// Where a batch's drafter context stands when its sampling is done.
enum DrafterStage {
    /// On a GPU: every computed row written behind the forward, before the sampling waited
    /// for it ([`Scheduler::extend_drafter`]); the commit keeps what each request kept.
    Written(round::DrafterRows),
    /// On the CPU, whose forward is done when it returns (nothing to overlap): the taps, from
    /// which the commit writes only the kept rows.
    Pending(Vec<ferry_kernels::backend::Tensor>),
}

impl Scheduler {
    pub(crate) fn new(
        backend: Backend,
        pool: KvPool,
        spec: Option<Speculator>,
        config: EngineConfig,
        fences: Arc<RemoteFences>,
    ) -> Self {
        Self {
            fences,
            quarantine: HashMap::new(),
            backend,
            kv: KvManager::new(pool),
            config,
            running: Vec::new(),
            waiting: VecDeque::new(),
            awaiting: HashMap::new(),
            prefills: Vec::new(),
            stats: EngineStats::default(),
            spec,
        }
    }

    /// Runs until every handle is dropped.
    pub(crate) fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        loop {
            if self.idle() {
                match rx.blocking_recv() {
                    Some(cmd) => self.handle(cmd),
                    None => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            }
            self.drop_cancelled();
            self.step();
        }
    }

    fn idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty() && self.prefills.is_empty()
    }

    fn eos(&self) -> &[u32] {
        &self.backend.config().eos_token_ids
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Generate {
                id,
                job,
                events,
                options,
                span,
                forks,
            } => {
                let forks = forks
                    .into_iter()
                    .enumerate()
                    .map(|(i, (id, events))| PendingFork {
                        id,
                        job: fork_job(&job, i + 1),
                        events,
                        // Sample 0 reports the prompt's log-probabilities; the others share
                        // its prompt blocks.
                        options: GenerateOptions {
                            prompt_logprobs: None,
                            ..options
                        },
                    })
                    .collect();
                self.admit(NewRequest {
                    id,
                    job,
                    events,
                    options,
                    span,
                    forks,
                    forked: false,
                })
            }
            Command::Prefill(job) => self.admit_prefill(job),
            Command::WriteKv { layer, first, data } => self.write_kv(layer, first, &data),
            Command::RemoteDone { id, first, bytes } => self.remote_done(id, first, bytes),
            Command::RemoteFailed {
                id,
                recompute,
                reason,
                abandoned,
            } => self.remote_failed(id, recompute, reason, abandoned),
            Command::RemoteSettled { id } => self.remote_settled(id),
            Command::ReadKv { layer, reply } => {
                let read = self
                    .backend
                    .read_kv_layer(self.kv.pool(), layer)
                    .map_err(|e| e.to_string());
                let _ = reply.send(read);
            }
            Command::Stats(tx) => {
                let _ = tx.send(self.snapshot_stats());
            }
            Command::All(cmds) => {
                for cmd in cmds {
                    self.handle(cmd);
                }
            }
            Command::DrainEvents(tx) => {
                let _ = tx.send(self.kv.drain_events());
            }
            Command::Snapshot(tx) => {
                // Pending events are covered by the snapshot: the router starts from its id.
                let _ = self.kv.drain_events();
                let _ = tx.send(self.kv.snapshot());
            }
        }
    }

    /// Runs one scheduler step: one forward over the running sequences and the prompt work
    /// that fits, or with [`PromptSteps::Apart`] and both kinds of work, a decode-only forward
    /// and then a prompt-only one ([`PromptSteps::Auto`] decides after drafting, in
    /// [`Self::forward_step`]).
    fn step(&mut self) {
        let prompts_waiting = !self.prefills.is_empty() || !self.waiting.is_empty();
        if self.config.prompt_steps == PromptSteps::Apart
            && !self.running.is_empty()
            && prompts_waiting
        {
            self.forward_step(StepWork::Decode);
            self.forward_step(StepWork::Prompts);
        } else {
            self.forward_step(StepWork::All);
        }
    }

    /// Builds and runs one batch of `what`.
    fn forward_step(&mut self, what: StepWork) {
        let decode = what != StepWork::Prompts;
        let prompts = what != StepWork::Decode;
        // Every decoding sequence needs room for one more position. One that cannot get it
        // fails alone (no preemption yet); the others go on.
        let mut i = 0;
        while decode && i < self.running.len() {
            let s = &mut self.running[i];
            let before = s.table.blocks().len();
            match self.kv.reserve(&mut s.table, 1) {
                Ok(()) => {
                    if let Some(sp) = self.spec.as_mut() {
                        sp.fresh(&s.table.blocks()[before..]);
                    }
                    i += 1;
                }
                Err(e) => {
                    let s = self.running.swap_remove(i);
                    self.fail(s, &e.to_string());
                }
            }
        }
        let decoding = if decode { self.running.len() } else { 0 };
        let mut budget = self.config.max_batch_tokens.saturating_sub(decoding);
        let started = std::time::Instant::now();
        host_phase("plan (drafter pass)");
        let graphs_before = self.backend.graph_steps();
        let captures_before = self.backend.graph_captures();
        // Only a drafter plans: without one the step has no plan phase (its waiting prompt
        // rows are not even counted), so none of its time is filed there.
        let drafting = decode && self.spec.is_some();
        // What waits beside the drafts: the drafter's policy prices it, and `Auto`'s split
        // below reads it.
        let load = PromptLoad {
            rows: if drafting && prompts {
                self.prompt_rows(budget)
            } else {
                0
            },
            splits: what == StepWork::All && self.splits_graphed_rounds(),
        };
        let (drafts, q) = if drafting {
            self.plan_drafts(budget, load)
        } else {
            (Vec::new(), None)
        };
        let planned = if drafting {
            std::time::Instant::now()
        } else {
            started
        };
        let mut work: Vec<Work> = (0..decoding).map(Work::Decode).collect();
        by_width(&mut work, &drafts);
        let drafted: usize = drafts.iter().flatten().map(Draft::gamma).sum();
        // `Auto`: a graphed round keeps its graph when the prompt work beside it is fewer rows
        // than its drafts; the prompts then get a forward of their own after it.
        // (`load.rows` was counted whenever a drafter planned, and only a drafter's round
        // replays.)
        let apart = load.splits
            && self.spec.as_ref().is_some_and(|sp| sp.replays(&drafts))
            && (1..=drafted).contains(&load.rows);
        let prompts = prompts && !apart;
        // Drafts take their rows from the prompts' budget unless they have one of their own.
        if self.spec.as_ref().map(Speculator::draft_budget) != Some(DraftBudget::Beside) {
            budget = budget.saturating_sub(drafted);
        }
        let prefills = if prompts { self.prefills.len() } else { 0 };
        for i in 0..prefills {
            let need = self.prefills[i].job.prompt.len() - self.prefills[i].reused;
            if need > budget && !work.is_empty() {
                break;
            }
            work.push(Work::Prefill(i));
            budget = budget.saturating_sub(need);
        }
        let room = if prompts {
            self.config.max_running.saturating_sub(self.running.len())
        } else {
            0
        };
        for i in 0..self.waiting.len().min(room) {
            if budget == 0 {
                break;
            }
            let n = self.waiting[i].remaining_prompt().min(budget);
            let seq = &mut self.waiting[i];
            let before = seq.table.blocks().len();
            let reserved = self.kv.reserve(&mut seq.table, n);
            if let (Ok(()), Some(sp)) = (&reserved, self.spec.as_mut()) {
                sp.fresh(&seq.table.blocks()[before..]);
            }
            if let Err(e) = reserved {
                if work.is_empty() && self.running.is_empty() {
                    // Nothing else will ever free blocks for it: fail it now (running
                    // sequences out of this forward, `StepWork::Prompts`, still will).
                    if let Some(s) = self.waiting.remove(i) {
                        self.fail(s, &e.to_string());
                    }
                    return;
                }
                break;
            }
            work.push(Work::Chunk(i, n));
            budget -= n;
        }
        if work.is_empty() {
            return;
        }
        // A decode-only step's shape, for the `goodput` verify length's cost estimates.
        let decode_only = work.iter().all(|w| matches!(w, Work::Decode(_)));
        let prompt_work: usize = work
            .iter()
            .map(|w| match *w {
                Work::Decode(_) => 0,
                Work::Prefill(i) => self.prefills[i].job.prompt.len() - self.prefills[i].reused,
                Work::Chunk(_, n) => n,
            })
            .sum();
        let seqs = decoding;
        let rows = seqs + drafted;
        let host_phases = HostPhases::of(!decode_only, drafted);
        host_phase(host_phases.launch);
        let (forwarded, sampled) = self.run_batch(work, drafts, q, host_phases);
        let done = std::time::Instant::now();
        host_phase("between steps");
        let secs = (done - started).as_secs_f64();
        let phases = StepPhases {
            plan: (planned - started).as_secs_f64(),
            launch: (forwarded - planned).as_secs_f64(),
            sample: (sampled - forwarded).as_secs_f64(),
            commit: (done - sampled).as_secs_f64(),
        };
        let graph = self.backend.graph_steps() > graphs_before;
        let shape = StepShape {
            prompt: !decode_only,
            sequences: seqs,
            drafts: drafted,
            graph,
        };
        self.stats.step_times.record(shape, phases);
        if let Some(sp) = self.spec.as_mut() {
            let step = if decode_only {
                ObservedStep::DecodeOnly {
                    seqs,
                    rows,
                    round: drafted > 0,
                    graph,
                }
            } else {
                ObservedStep::WithPrompts {
                    rows: rows + prompt_work,
                }
            };
            sp.observe_step(step, secs, self.backend.graph_captures() != captures_before);
            for (predicted, accepted) in sp.resolve_shadows(&self.running) {
                self.stats
                    .spec_skipped_by_prediction
                    .record(predicted, accepted);
            }
        }
        if apart {
            self.forward_step(StepWork::Prompts);
        }
    }

    /// Whether a step's round replayed from a graph has the step's prompt rows run apart
    /// when they are at most its drafts (`PromptSteps::Auto` on CUDA with graphs; elsewhere
    /// rounds run eagerly, and the prompts with them).
    fn splits_graphed_rounds(&self) -> bool {
        matches!(self.backend.device(), ferry_kernels::Device::Cuda(_))
            && self.config.cuda_graphs
            && self.config.prompt_steps == PromptSteps::Auto
    }

    /// Prompt rows waiting to be computed, at most `budget`: the queued prefill jobs' and the
    /// admissible waiting sequences' (what a mixed step would carry, before the drafts take
    /// their share of the budget).
    fn prompt_rows(&self, budget: usize) -> usize {
        let room = self.config.max_running.saturating_sub(self.running.len());
        let jobs = self.prefills.iter().map(|p| p.job.prompt.len() - p.reused);
        let chunks = self
            .waiting
            .iter()
            .take(room)
            .map(Sequence::remaining_prompt);
        jobs.chain(chunks).sum::<usize>().min(budget)
    }

    fn finish(&mut self, s: Sequence, reason: FinishReason) {
        s.emit_end(EngineEvent::Finished(reason));
        self.release(s);
    }

    fn fail(&mut self, s: Sequence, err: &str) {
        self.fail_with(s, Failure::internal(err));
    }

    fn fail_with(&mut self, mut s: Sequence, failure: Failure) {
        // The samples waiting to share this prompt fail as it did.
        for f in std::mem::take(&mut s.forks) {
            f.abandon(&format!("failed: {}", failure.message), failure.kind);
            self.stats.requests_finished += 1;
        }
        s.emit_end(EngineEvent::Failed(failure));
        self.release(s);
    }

    /// Sample 0 of an `n` > 1 request has its prompt in the cache: the prompt's full blocks go
    /// into the prefix cache (if not there yet) and every other sample is admitted, finding
    /// them there (reference-counted, shared) and computing only the rest of the prompt.
    fn fork(&mut self, s: &mut Sequence) {
        if s.forks.is_empty() {
            return;
        }
        let page = self.kv.page_size();
        if s.tokens.len() == s.table.len() && s.table.len() >= s.prompt.len() {
            if let Some(sp) = self.spec.as_mut() {
                // As on release: full blocks whose drafter rows are not valid must not pass for
                // valid drafter context when shared.
                let full = s.prompt.len() / page;
                if s.draft_ctx < full * page {
                    let blocks = s.table.blocks().get(..full).unwrap_or_default();
                    sp.mark_stale(blocks, s.draft_ctx, page);
                }
            }
            if let Err(e) = self.kv.cache_full_blocks(&s.table, &s.tokens) {
                // The forks then prefill the prompt themselves: slower, still correct.
                warn!(error = %e, "could not share a prompt's blocks with its other samples");
            }
        }
        let span = s.span.clone();
        for f in std::mem::take(&mut s.forks) {
            self.admit(NewRequest {
                id: f.id,
                job: f.job,
                events: f.events,
                options: f.options,
                span: span.clone(),
                forks: Vec::new(),
                forked: true,
            });
        }
    }

    /// Caches the sequence's full blocks and frees its references.
    fn release(&mut self, mut s: Sequence) {
        for f in std::mem::take(&mut s.forks) {
            f.abandon("ended before its prefill completed", FailureKind::Internal);
            self.stats.requests_finished += 1;
        }
        if let Some(sp) = self.spec.as_mut() {
            sp.forget_shadows(s.id);
            // Blocks whose drafter rows do not match their KV must not pass for valid context
            // when their prefix is reused.
            if s.draft_ctx < s.table.len() {
                sp.mark_stale(s.table.blocks(), s.draft_ctx, self.kv.page_size());
            }
        }
        if !s.tokens.is_empty() && s.tokens.len() == s.table.len() {
            if let Err(e) = self.kv.cache_full_blocks(&s.table, &s.tokens) {
                warn!(error = %e, "could not cache a finished sequence");
            }
        }
        if let Err(e) = self.kv.free(&mut s.table) {
            warn!(error = %e, "freeing a sequence's blocks");
        }
        self.stats.requests_finished += 1;
    }

    fn snapshot_stats(&self) -> EngineStats {
        let queued: usize = self
            .waiting
            .iter()
            .map(Sequence::remaining_prompt)
            .sum::<usize>()
            + self
                .prefills
                .iter()
                .map(|t| t.job.prompt.len() - t.reused)
                .sum::<usize>();
        EngineStats {
            kv_blocks_used: self.kv.blocks_in_use(),
            kv_blocks_total: self.kv.blocks_total(),
            kv_blocks_cached: self.kv.blocks_cached_only(),
            running: self.running.len() + self.prefills.len(),
            waiting: self.waiting.len() + self.awaiting.len(),
            queued_prefill_tokens: queued as u64,
            graph_steps: self.backend.graph_steps(),
            kv_layers_shipped_early: self.backend.ship_stats().early,
            kv_ship_forwards: self.backend.ship_stats().forwards,
            kv_ship_tail_us: self.backend.ship_stats().tail_us,
            kv_host_row_bytes: self.kv.pool().row_bytes() as u64,
            kv_host_staging_bytes: self.backend.staging_bytes() as u64,
            ..self.stats.clone()
        }
    }
}

/// Orders a step's decode items by how many drafts each verifies, widest first (stable, so
/// a uniform round and a plain step keep the running order). The forward gives consecutive
/// sequences with as many query rows one attention launch (`plan_runs`), so a round whose
/// widths differ (the confidence rule, `goodput` exploring past the graphs) launches at most
/// one run per width a layer instead of one per change of width along the batch. Session 57's
/// lease saw such steps beside prompts at c = 256 (~110 sequences, 7.3 rows each) spend 21 ms
/// of 26.5 in their launch phase where uniform ones spent 6 of 13: launching a run per
/// sequence is the likely cause, not yet measured apart. Every later stage of the step finds
/// its rows through the work item, not the running index.
fn by_width(work: &mut [Work], drafts: &[Option<Draft>]) {
    work.sort_by_key(|w| match *w {
        Work::Decode(i) => std::cmp::Reverse(
            drafts
                .get(i)
                .and_then(Option::as_ref)
                .map_or(0, Draft::gamma),
        ),
        Work::Chunk(..) | Work::Prefill(_) => std::cmp::Reverse(0),
    });
}

/// The names `FERRY_HOST_TIME=1` files a step's CUDA calls under, by the step's kind and phase
/// (`ferry_kernels::cuda::host_time::set_phase`), so a round's launch is told from a prompt
/// step's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct HostPhases {
    pub(super) launch: &'static str,
    pub(super) sample: &'static str,
    pub(super) commit: &'static str,
}

impl HostPhases {
    /// A step that carries prompt work, else a round (it verifies drafts), else a decode step.
    fn of(prompt: bool, drafted: usize) -> Self {
        match (prompt, drafted > 0) {
            (true, _) => Self {
                launch: "prompt step: launch",
                sample: "prompt step: sample",
                commit: "prompt step: commit",
            },
            (false, true) => Self {
                launch: "round: launch",
                sample: "round: sample",
                commit: "round: commit",
            },
            (false, false) => Self {
                launch: "decode step: launch",
                sample: "decode step: sample",
                commit: "decode step: commit",
            },
        }
    }
}

/// Names the phase the engine thread's next CUDA calls belong to (`FERRY_HOST_TIME=1`);
/// nothing when that is off or without CUDA.
pub(super) fn host_phase(phase: &'static str) {
    #[cfg(feature = "cuda")]
    ferry_kernels::cuda::host_time::set_phase(phase);
    #[cfg(not(feature = "cuda"))]
    let _ = phase;
}

#[cfg(test)]
mod tests {
    use super::{by_width, HostPhases, Work};
    use crate::drafter::DraftDist;
    use crate::engine::spec::Draft;

    #[test]
    fn a_ragged_round_groups_its_sequences_by_width() {
        let draft = |gamma: usize| {
            Some(Draft {
                tokens: vec![7; gamma + 1],
                q: DraftDist::Greedy,
                survival: Vec::new(),
            })
        };
        // Widths 2, none, 3, 2, none, 3, 1 along the running sequences.
        let drafts = [draft(2), None, draft(3), draft(2), None, draft(3), draft(1)];
        let mut work: Vec<Work> = (0..drafts.len()).map(Work::Decode).collect();
        by_width(&mut work, &drafts);
        let order: Vec<usize> = work
            .iter()
            .map(|w| match *w {
                Work::Decode(i) => i,
                _ => usize::MAX,
            })
            .collect();
        // Widest first, the running order kept within a width: four runs, not seven.
        assert_eq!(order, [2, 5, 0, 3, 6, 1, 4]);
        // A uniform round and a plain step keep the running order (a queued round's drafts
        // on the device are in that order).
        for drafts in [vec![draft(4); 5], vec![None; 5]] {
            let mut work: Vec<Work> = (0..5).map(Work::Decode).collect();
            by_width(&mut work, &drafts);
            assert!(work
                .iter()
                .enumerate()
                .all(|(k, w)| matches!(*w, Work::Decode(i) if i == k)));
        }
    }

    #[test]
    fn a_steps_calls_are_filed_by_its_kind() {
        assert_eq!(HostPhases::of(true, 40).launch, "prompt step: launch");
        assert_eq!(HostPhases::of(false, 40).sample, "round: sample");
        assert_eq!(HostPhases::of(false, 0).commit, "decode step: commit");
    }
}
