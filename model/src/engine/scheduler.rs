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

use std::collections::{HashMap, HashSet, VecDeque};

use ferry_kernels::cpu::sample::Sampler;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::backend::{Backend, Pass};
use super::sequence::{sample_step, Next, Origin, Phase, PrefillTask, Sequence};
use super::spec::{Draft, Speculator};
use super::{Command, EngineConfig, EngineEvent, EngineStats, FinishReason, PrefillOutcome};
use super::{Failure, FailureKind, GenerateJob, GenerateOptions, PrefillSource, SeqId, SpecCounts};
use crate::deepseek::forward::ForwardHooks;
use crate::deepseek::{BatchInputs, LogitsWanted, SeqInput};
use crate::kv::{BlockId, KvManager, KvPool};
use crate::ModelError;

mod round;

/// Which container a committed row range belongs to.
#[derive(Debug, Clone, Copy)]
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
    /// Blocks peers may write into (reserved for an awaited remote prefill).
    remote_blocks: HashSet<BlockId>,
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
}

/// What a successful forward hands to [`Scheduler::apply`].
struct BatchResult {
    /// Per work item, its logits rows.
    logits: Vec<Vec<f32>>,
    /// Prefill jobs whose layer sink failed.
    hook_errors: HashMap<usize, String>,
    /// Per running sequence, the drafts it verified (empty without a drafter).
    drafts: Vec<Option<Draft>>,
    /// Hidden states after the drafter's tap layers, `[tap][batch rows · hidden]`.
    taps: Vec<Vec<f32>>,
}

impl Scheduler {
    pub(crate) fn new(
        backend: Backend,
        pool: KvPool,
        spec: Option<Speculator>,
        config: EngineConfig,
    ) -> Self {
        Self {
            backend,
            kv: KvManager::new(pool),
            config,
            running: Vec::new(),
            waiting: VecDeque::new(),
            awaiting: HashMap::new(),
            prefills: Vec::new(),
            remote_blocks: HashSet::new(),
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
            } => self.admit(NewRequest {
                id,
                job,
                events,
                options,
                span,
            }),
            Command::Prefill(job) => self.admit_prefill(job),
            Command::WriteKv { layer, block, data } => self.write_kv(layer, block, &data),
            Command::RemoteDone { id, first_token } => self.remote_done(id, first_token),
            Command::RemoteFailed {
                id,
                recompute,
                reason,
            } => self.remote_failed(id, recompute, reason),
            Command::Stats(tx) => {
                let _ = tx.send(self.snapshot_stats());
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

    fn admit(&mut self, req: NewRequest) {
        let NewRequest {
            id,
            job,
            events,
            options,
            span,
        } = req;
        let prompt_len = job.prompt.len();
        let speculative = self.spec.is_some() && options.speculative.unwrap_or(true);
        let reuse_cap = prompt_len.saturating_sub(1);
        let (table, cached) = match self.kv.start_sequence(&job.prompt, reuse_cap) {
            Ok(t) => t,
            Err(e) => {
                if speculative {
                    let _ = events.send(EngineEvent::Speculation(SpecCounts::default()));
                }
                let _ = events.send(EngineEvent::Failed(Failure::internal(e.to_string())));
                self.stats.requests_finished += 1;
                return;
            }
        };
        let mut seq = Sequence {
            id,
            tokens: job.prompt[..cached].to_vec(),
            prompt: job.prompt,
            rng: Sampler::for_params(&job.sampling),
            sampling: job.sampling,
            stop: job.stop,
            table,
            phase: Phase::Prefilling { done: cached },
            generated: 0,
            cached_tokens: cached,
            origin: Origin::Local,
            events,
            span,
            queued: None,
            speculative,
            spec: SpecCounts::default(),
            draft_ctx: 0,
        };
        let page = self.kv.page_size();
        if let Some(sp) = &self.spec {
            seq.draft_ctx = sp.valid_prefix(seq.table.blocks(), cached, page);
        }
        match job.prefill {
            PrefillSource::Remote { local_threshold } if prompt_len - cached > local_threshold => {
                let before = seq.table.blocks().len();
                if let Err(e) = self.kv.reserve(&mut seq.table, prompt_len - cached) {
                    self.fail(seq, &e.to_string());
                    return;
                }
                if let Some(sp) = self.spec.as_mut() {
                    sp.fresh(&seq.table.blocks()[before..]);
                }
                let first_remote = cached / self.kv.page_size();
                self.remote_blocks
                    .extend(seq.table.blocks().iter().skip(first_remote).copied());
                seq.phase = Phase::AwaitingKv;
                seq.origin = Origin::Remote;
                seq.emit(EngineEvent::Reserved {
                    blocks: seq.table.blocks().to_vec(),
                    cached_tokens: cached,
                });
                self.awaiting.insert(id, seq);
            }
            _ => {
                seq.queued = Some(tracing::info_span!(parent: &seq.span, "queue"));
                seq.emit(EngineEvent::LocalPrefill {
                    cached_tokens: cached,
                });
                self.waiting.push_back(seq);
            }
        }
    }

    fn admit_prefill(&mut self, job: super::PrefillJob) {
        let reuse_cap = job.prompt.len().saturating_sub(1);
        match self.kv.start_sequence(&job.prompt, reuse_cap) {
            Ok((mut table, reused)) => {
                let before = table.blocks().len();
                if let Err(e) = self.kv.reserve(&mut table, job.prompt.len() - reused) {
                    let _ = self.kv.free(&mut table);
                    let _ = job.reply.send(Err(e.to_string()));
                    return;
                }
                if let Some(sp) = self.spec.as_mut() {
                    sp.fresh(&table.blocks()[before..]);
                }
                let rng = Sampler::for_params(&job.sampling);
                let queued = Some(tracing::info_span!(parent: &job.span, "queue"));
                self.prefills.push(PrefillTask {
                    job,
                    table,
                    reused,
                    rng,
                    queued,
                });
            }
            Err(e) => {
                let _ = job.reply.send(Err(e.to_string()));
            }
        }
    }

    fn write_kv(&mut self, layer: usize, block: BlockId, data: &[u8]) {
        if !self.remote_blocks.contains(&block) {
            warn!(%block, layer, "dropping a KV write into a block not reserved for a peer");
            return;
        }
        // Layers past the target's are the drafter's context (see `docs/spec_decode.md`).
        let target_layers = self.kv.pool().layout().num_layers;
        if layer >= target_layers {
            let written = match self.spec.as_mut() {
                Some(sp) => sp.write_kv(layer - target_layers, block, data),
                None => Err("this engine has no drafter".into()),
            };
            match written {
                Ok(()) => self.stats.kv_bytes_received += data.len() as u64,
                Err(e) => warn!(%block, layer, error = %e, "dropping a drafter KV write"),
            }
            return;
        }
        let dst = match self.kv.pool_mut().block_mut(layer, block) {
            Ok(d) => d,
            Err(e) => {
                warn!(%block, layer, error = %e, "dropping an out-of-range KV write");
                return;
            }
        };
        if data.len() != dst.len() * 4 {
            warn!(%block, layer, bytes = data.len(), "dropping a KV write of the wrong size");
            return;
        }
        for (d, b) in dst.iter_mut().zip(data.chunks_exact(4)) {
            *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        self.backend.host_rows_written(layer, block);
        self.stats.kv_bytes_received += data.len() as u64;
    }

    fn release_remote_blocks(&mut self, seq: &Sequence) {
        for b in seq.table.blocks() {
            self.remote_blocks.remove(b);
        }
    }

    fn remote_done(&mut self, id: SeqId, first_token: u32) {
        let Some(mut seq) = self.awaiting.remove(&id) else {
            return; // cancelled meanwhile
        };
        self.release_remote_blocks(&seq);
        if seq.cancelled() {
            self.release(seq);
            return;
        }
        let new = seq.prompt.len() - seq.cached_tokens;
        if let Err(e) = seq.table.advance(new, self.kv.page_size()) {
            self.fail(seq, &e.to_string());
            return;
        }
        seq.tokens = seq.prompt.clone();
        if let Some(sp) = self.spec.as_mut() {
            let page = self.kv.page_size();
            let remote = &seq.table.blocks()[seq.cached_tokens / page..];
            if sp.remote_landed(remote) && seq.draft_ctx == seq.cached_tokens {
                seq.draft_ctx = seq.prompt.len();
            }
        }
        self.stats.remote_prefills += 1;
        let eos = self.eos().to_vec();
        match seq.accept(first_token, &eos) {
            Next::Continue(t) => {
                seq.phase = Phase::Decoding { next: t };
                self.running.push(seq);
            }
            Next::Finish(r) => self.finish(seq, r),
        }
    }

    fn remote_failed(&mut self, id: SeqId, recompute: bool, reason: String) {
        let Some(mut seq) = self.awaiting.remove(&id) else {
            return;
        };
        self.release_remote_blocks(&seq);
        if let Some(sp) = self.spec.as_mut() {
            sp.forget_writes(seq.table.blocks());
        }
        if seq.cancelled() {
            self.release(seq);
            return;
        }
        if recompute {
            warn!(seq = id.0, %reason, "remote prefill failed; recomputing locally");
            seq.origin = Origin::Recomputed;
            seq.phase = Phase::Prefilling {
                done: seq.cached_tokens,
            };
            self.waiting.push_back(seq);
        } else {
            let failure = Failure {
                kind: FailureKind::PeerUnavailable,
                message: format!("remote prefill failed: {reason}"),
            };
            self.fail_with(seq, failure);
        }
    }

    fn drop_cancelled(&mut self) {
        let mut gone = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancelled() {
                gone.push(self.running.swap_remove(i));
            } else {
                i += 1;
            }
        }
        let (keep, cancelled): (Vec<_>, Vec<_>) =
            self.waiting.drain(..).partition(|s| !s.cancelled());
        self.waiting = keep.into();
        gone.extend(cancelled);
        // A cancelled request awaiting a peer keeps its blocks until the peer's prefill
        // resolves (`remote_done` / `remote_failed`): the peer may still be writing into them.
        for s in gone {
            debug!(seq = s.id.0, "request cancelled");
            self.release(s);
        }
    }

    /// Builds and runs one batch.
    fn step(&mut self) {
        // Every decoding sequence needs room for one more position. One that cannot get it
        // fails alone (no preemption yet); the others go on.
        let mut i = 0;
        while i < self.running.len() {
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
        let mut budget = self
            .config
            .max_batch_tokens
            .saturating_sub(self.running.len());
        let drafts = self.plan_drafts(budget);
        let mut work = Vec::new();
        for i in 0..self.running.len() {
            work.push(Work::Decode(i));
        }
        let drafted: usize = drafts.iter().flatten().map(Draft::gamma).sum();
        budget = budget.saturating_sub(drafted);
        for i in 0..self.prefills.len() {
            let need = self.prefills[i].job.prompt.len() - self.prefills[i].reused;
            if need > budget && !work.is_empty() {
                break;
            }
            work.push(Work::Prefill(i));
            budget = budget.saturating_sub(need);
        }
        let room = self.config.max_running.saturating_sub(self.running.len());
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
                if work.is_empty() {
                    // Nothing else will ever free blocks for it: fail it now.
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
        self.run_batch(work, drafts);
    }

    fn run_batch(&mut self, work: Vec<Work>, drafts: Vec<Option<Draft>>) {
        // One span per batch, linked to the span of every request it serves (their `queue`
        // spans end here, the first time a request is scheduled).
        let batch_span = tracing::debug_span!("batch", requests = work.len());
        for w in &work {
            let (span, queued) = match *w {
                Work::Decode(i) => {
                    let s = &mut self.running[i];
                    (&s.span, &mut s.queued)
                }
                Work::Chunk(i, _) => {
                    let s = &mut self.waiting[i];
                    (&s.span, &mut s.queued)
                }
                Work::Prefill(i) => {
                    let t = &mut self.prefills[i];
                    (&t.job.span, &mut t.queued)
                }
            };
            batch_span.follows_from(span);
            queued.take();
        }
        let _batch = batch_span.enter();
        // Prefill jobs run whole in this batch: take their layer sinks and the blocks each ships.
        let page = self.kv.page_size();
        let mut sinks = Vec::new();
        let mut staged = Vec::new();
        for w in &work {
            if let Work::Prefill(i) = *w {
                let t = &mut self.prefills[i];
                let skip = (t.job.skip_tokens / page).min(t.table.blocks().len());
                let blocks = t.table.blocks()[skip..].to_vec();
                staged.extend_from_slice(&blocks);
                let sink = std::mem::replace(&mut t.job.on_layer, Box::new(|_, _, _| Ok(())));
                sinks.push((i, sink, blocks));
            }
        }
        // A drafting sequence feeds its anchor and drafts and wants every row's logits.
        let decode_inputs: Vec<Vec<u32>> = self
            .running
            .iter()
            .enumerate()
            .map(|(i, s)| match (drafts.get(i), s.phase) {
                (Some(Some(d)), _) => d.tokens.clone(),
                (_, Phase::Decoding { next }) => vec![next],
                _ => vec![0],
            })
            .collect();
        let mut seqs = Vec::with_capacity(work.len());
        for w in &work {
            seqs.push(match *w {
                Work::Decode(i) => SeqInput {
                    tokens: &decode_inputs[i],
                    start_pos: self.running[i].table.len(),
                    block_table: self.running[i].table.blocks(),
                    logits: if decode_inputs[i].len() > 1 {
                        LogitsWanted::All
                    } else {
                        LogitsWanted::Last
                    },
                },
                Work::Chunk(i, n) => {
                    let s = &self.waiting[i];
                    let done = s.table.len();
                    SeqInput {
                        tokens: &s.prompt[done..done + n],
                        start_pos: done,
                        block_table: s.table.blocks(),
                        logits: LogitsWanted::Last,
                    }
                }
                Work::Prefill(i) => {
                    let t = &self.prefills[i];
                    SeqInput {
                        tokens: &t.job.prompt[t.reused..],
                        start_pos: t.reused,
                        block_table: t.table.blocks(),
                        logits: LogitsWanted::Last,
                    }
                }
            });
        }
        let batch = BatchInputs { seqs };

        // A failing sink fails its own job only; the forward goes on.
        let mut hook_errors: HashMap<usize, String> = HashMap::new();
        let mut hook = |layer: usize, pool: &KvPool| -> Result<(), ModelError> {
            for (i, sink, blocks) in sinks.iter_mut() {
                if hook_errors.contains_key(i) {
                    continue;
                }
                if let Err(e) = sink(layer, blocks, pool) {
                    hook_errors.insert(*i, e);
                }
            }
            Ok(())
        };
        // The drafter's context is built from the hidden states after its tap layers.
        let taps: Vec<usize> = self
            .spec
            .as_ref()
            .map(|sp| sp.taps().to_vec())
            .unwrap_or_default();
        let mut tapped: Vec<Vec<f32>> = vec![Vec::new(); taps.len()];
        let mut hidden = |layer: usize, h: &[f32]| -> Result<(), ModelError> {
            for (buf, _) in tapped.iter_mut().zip(&taps).filter(|(_, &t)| t == layer) {
                *buf = h.to_vec();
            }
            Ok(())
        };
        let pass = Pass {
            hooks: ForwardHooks {
                after_layer: &mut hook,
                hidden: &mut hidden,
            },
            staged: &staged,
        };
        let result = self.backend.forward(&batch, self.kv.pool_mut(), pass);
        drop(batch);
        match result {
            Ok(out) => self.apply(
                work,
                BatchResult {
                    logits: out.logits,
                    hook_errors,
                    drafts,
                    taps: tapped,
                },
            ),
            Err(e) => self.fail_batch(work, &e.to_string()),
        }
    }

    /// Commits a successful forward: advance tables, sample, emit, finish.
    fn apply(&mut self, work: Vec<Work>, result: BatchResult) {
        let BatchResult {
            logits,
            hook_errors,
            drafts,
            taps,
        } = result;
        let page = self.kv.page_size();
        let eos = self.eos().to_vec();
        let mut finished_running = Vec::new();
        let mut promoted = Vec::new();
        let mut done_prefills = Vec::new();
        // Committed rows per work item, for the drafter's context: (who, first position,
        // first batch row, rows).
        let mut committed = Vec::new();
        let mut first_row = 0;
        for (w, l) in work.iter().zip(&logits) {
            let row = first_row;
            first_row += match *w {
                Work::Decode(i) => drafts
                    .get(i)
                    .and_then(Option::as_ref)
                    .map_or(1, |d| d.tokens.len()),
                Work::Chunk(_, n) => n,
                Work::Prefill(i) => self.prefills[i].job.prompt.len() - self.prefills[i].reused,
            };
            match *w {
                Work::Decode(i) => {
                    if let Some(Some(d)) = drafts.get(i) {
                        let start = self.running[i].table.len();
                        match self.commit_round(i, d, l) {
                            Ok((kept, end)) => {
                                committed.push((Owner::Running(i), start, row, kept));
                                if let Some(reason) = end {
                                    finished_running.push((i, Ok(reason)));
                                }
                            }
                            Err(e) => finished_running.push((i, Err(e))),
                        }
                        continue;
                    }
                    let s = &mut self.running[i];
                    let Phase::Decoding { next } = s.phase else {
                        continue;
                    };
                    let start = s.table.len();
                    if let Err(e) = s.table.advance(1, page) {
                        finished_running.push((i, Err(e.to_string())));
                        continue;
                    }
                    committed.push((Owner::Running(i), start, row, 1));
                    s.tokens.push(next);
                    match sample_step(l, &s.sampling, s.generated, &mut s.rng) {
                        Ok(tok) => match s.accept(tok, &eos) {
                            Next::Continue(t) => s.phase = Phase::Decoding { next: t },
                            Next::Finish(r) => finished_running.push((i, Ok(r))),
                        },
                        Err(e) => finished_running.push((i, Err(e.to_string()))),
                    }
                }
                Work::Chunk(i, n) => {
                    let s = &mut self.waiting[i];
                    if let Err(e) = s.table.advance(n, page) {
                        promoted.push((i, Err(e.to_string())));
                        continue;
                    }
                    let done = s.table.len();
                    committed.push((Owner::Waiting(i), done - n, row, n));
                    s.tokens.extend_from_slice(&s.prompt[done - n..done]);
                    self.stats.prefill_computed_tokens += n as u64;
                    s.phase = Phase::Prefilling { done };
                    if done < s.prompt.len() {
                        continue;
                    }
                    self.stats.prefill_reused_tokens += s.cached_tokens as u64;
                    match sample_step(l, &s.sampling, s.generated, &mut s.rng) {
                        Ok(tok) => promoted.push((i, Ok(s.accept(tok, &eos)))),
                        Err(e) => promoted.push((i, Err(e.to_string()))),
                    }
                }
                Work::Prefill(i) => {
                    let t = &mut self.prefills[i];
                    let computed = t.job.prompt.len() - t.reused;
                    let outcome = match hook_errors.get(&i) {
                        Some(e) => Err(format!("KV transfer failed: {e}")),
                        None => sample_step(l, &t.job.sampling, 0, &mut t.rng)
                            .map(|first_token| PrefillOutcome {
                                first_token,
                                computed_tokens: computed,
                                reused_tokens: t.reused,
                            })
                            .map_err(|e| e.to_string()),
                    };
                    if let Err(e) = t.table.advance(computed, page) {
                        done_prefills.push((i, Err(e.to_string())));
                        continue;
                    }
                    committed.push((Owner::Prefill(i), t.reused, row, computed));
                    self.stats.prefill_computed_tokens += computed as u64;
                    self.stats.prefill_reused_tokens += t.reused as u64;
                    done_prefills.push((i, outcome));
                }
            }
        }
        // Before anything is released: the committed rows become drafter context, and prefill
        // jobs ship it.
        let mut draft_errors = self.extend_drafter(&committed, &taps);
        // Remove from the highest index down so earlier indices stay valid.
        finished_running.sort_by_key(|e| std::cmp::Reverse(e.0));
        for (i, r) in finished_running {
            let s = self.running.swap_remove(i);
            match r {
                Ok(reason) => self.finish(s, reason),
                Err(e) => self.fail(s, &e),
            }
        }
        promoted.sort_by_key(|e| std::cmp::Reverse(e.0));
        for (i, r) in promoted {
            let Some(mut s) = self.waiting.remove(i) else {
                continue;
            };
            match s.origin {
                Origin::Local => self.stats.local_prefills += 1,
                Origin::Recomputed => self.stats.recomputed_prefills += 1,
                Origin::Remote => {}
            }
            match r {
                Ok(Next::Continue(t)) => {
                    s.phase = Phase::Decoding { next: t };
                    self.running.push(s);
                }
                Ok(Next::Finish(reason)) => self.finish(s, reason),
                Err(e) => self.fail(s, &e),
            }
        }
        done_prefills.sort_by_key(|e| std::cmp::Reverse(e.0));
        for (i, r) in done_prefills {
            let r = match draft_errors.remove(&i) {
                Some(e) if r.is_ok() => Err(format!("drafter KV transfer failed: {e}")),
                _ => r,
            };
            let mut t = self.prefills.swap_remove(i);
            if t.table.len() == t.job.prompt.len() {
                if let Err(e) = self.kv.cache_full_blocks(&t.table, &t.job.prompt) {
                    warn!(error = %e, "could not cache a prefilled prompt");
                }
            }
            if let Err(e) = self.kv.free(&mut t.table) {
                warn!(error = %e, "freeing a prefill job's blocks");
            }
            self.stats.requests_finished += 1;
            let _ = t.job.reply.send(r);
        }
    }

    /// A forward failed: every request in it fails and frees its blocks.
    fn fail_batch(&mut self, work: Vec<Work>, err: &str) {
        warn!(error = err, requests = work.len(), "batch failed");
        let mut running = Vec::new();
        let mut waiting = Vec::new();
        let mut prefills = Vec::new();
        for w in work {
            match w {
                Work::Decode(i) => running.push(i),
                Work::Chunk(i, _) => waiting.push(i),
                Work::Prefill(i) => prefills.push(i),
            }
        }
        running.sort_unstable_by(|a, b| b.cmp(a));
        for i in running {
            let s = self.running.swap_remove(i);
            self.fail(s, err);
        }
        waiting.sort_unstable_by(|a, b| b.cmp(a));
        for i in waiting {
            if let Some(s) = self.waiting.remove(i) {
                self.fail(s, err);
            }
        }
        prefills.sort_unstable_by(|a, b| b.cmp(a));
        for i in prefills {
            let mut t = self.prefills.swap_remove(i);
            let _ = self.kv.free(&mut t.table);
            self.stats.requests_finished += 1;
            let _ = t.job.reply.send(Err(err.to_string()));
        }
    }

    fn finish(&mut self, s: Sequence, reason: FinishReason) {
        s.emit_end(EngineEvent::Finished(reason));
        self.release(s);
    }

    fn fail(&mut self, s: Sequence, err: &str) {
        self.fail_with(s, Failure::internal(err));
    }

    fn fail_with(&mut self, s: Sequence, failure: Failure) {
        s.emit_end(EngineEvent::Failed(failure));
        self.release(s);
    }

    /// Caches the sequence's full blocks and frees its references.
    fn release(&mut self, mut s: Sequence) {
        if let Some(sp) = self.spec.as_mut() {
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
            ..self.stats.clone()
        }
    }
}
