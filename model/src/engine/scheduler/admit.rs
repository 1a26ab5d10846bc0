//! The command side of the loop: admitting requests and prefill jobs, peers' KV writes into
//! reserved blocks, the outcome of an awaited remote prefill, and dropping cancelled requests.

use ferry_kernels::cpu::sample::Sampler;
use tracing::{debug, warn};

use super::{NewRequest, Scheduler};
use crate::engine::sequence::{history_for, Next, Origin, Phase, PrefillTask, Sequence};
use crate::engine::{
    EngineEvent, Failure, FailureKind, PrefillJob, PrefillSource, RemoteFirst, SeqId, SpecCounts,
};
use crate::kv::BlockId;
use crate::ModelError;

impl Scheduler {
    pub(super) fn admit(&mut self, req: NewRequest) {
        let NewRequest {
            id,
            job,
            events,
            options,
            span,
            forks,
            forked,
        } = req;
        let prompt_len = job.prompt.len();
        let speculative = self.spec.is_some() && options.speculates(&job.sampling);
        // Positions served from cached blocks have no logits: a request that wants the
        // prompt's log-probabilities computes its whole prompt (vLLM does the same).
        let reuse_cap = match options.prompt_logprobs {
            Some(_) => 0,
            None => prompt_len.saturating_sub(1),
        };
        let (table, cached) = match self.kv.start_sequence(&job.prompt, reuse_cap) {
            Ok(t) => t,
            Err(e) => {
                if speculative {
                    let _ = events.send(EngineEvent::Speculation(SpecCounts::default()));
                }
                let _ = events.send(EngineEvent::Failed(Failure::internal(e.to_string())));
                self.stats.requests_finished += 1;
                for f in forks {
                    f.abandon("could not start", FailureKind::Internal);
                    self.stats.requests_finished += 1;
                }
                return;
            }
        };
        let history = history_for(&job.controls, &job.prompt, options.resumed_tokens);
        // A migrated request's resumed tokens were generated under its grammar: replay them.
        let mut grammar = job.grammar;
        let resumed = &job.prompt[prompt_len.saturating_sub(options.resumed_tokens)..];
        let replayed = match grammar.as_mut() {
            Some(g) => resumed.iter().try_for_each(|&t| g.consume(t)),
            None => Ok(()),
        };
        let mut seq = Sequence {
            id,
            controls: job.controls,
            history,
            logprobs: options.logprobs,
            prompt_logprobs: options.prompt_logprobs,
            prompt_lps: Vec::new(),
            grammar,
            tokens: job.prompt[..cached].to_vec(),
            prompt: job.prompt,
            rng: Sampler::for_params(&job.sampling),
            sampling: job.sampling,
            stop: job.stop,
            table,
            phase: Phase::Prefilling { done: cached },
            generated: options.resumed_tokens,
            cached_tokens: cached,
            origin: if forked { Origin::Fork } else { Origin::Local },
            forks,
            events,
            span,
            queued: None,
            speculative,
            spec: SpecCounts::default(),
            draft_ctx: 0,
        };
        if let Err(e) = replayed {
            self.fail(seq, &format!("the resumed tokens: {e}"));
            return;
        }
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
                for &b in seq.table.blocks().iter().skip(first_remote) {
                    self.fences.reserve(b, id.0);
                }
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

    pub(super) fn admit_prefill(&mut self, job: PrefillJob) {
        // As in `admit`: prompt log-probabilities need every prompt row computed.
        let reuse_cap = match job.prompt_logprobs {
            Some(_) => 0,
            None => job.prompt.len().saturating_sub(1),
        };
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
                let history = history_for(&job.controls, &job.prompt, 0);
                let queued = Some(tracing::info_span!(parent: &job.span, "queue"));
                self.prefills.push(PrefillTask {
                    job,
                    table,
                    reused,
                    rng,
                    history,
                    queued,
                });
            }
            Err(e) => {
                let _ = job.reply.send(Err(e.to_string()));
            }
        }
    }

    /// A peer's run of blocks `first..` of `layer` (see [`super::super::EngineHandle::write_kv`]).
    pub(super) fn write_kv(&mut self, layer: usize, first: BlockId, data: &[u8]) {
        let target_layers = self.kv.pool().layout().num_layers;
        let dtype = self.backend.kv_dtype();
        // The drafter's wire pool is shaped like the target's, so its blocks are as long.
        let block = dtype.block_bytes(self.kv.pool().layout()).max(1);
        if data.is_empty() || data.len() % block != 0 {
            warn!(%first, layer, bytes = data.len(), block, "dropping a KV write that is not whole blocks");
            return;
        }
        let blocks = (0..data.len() / block).map(|i| BlockId(first.0 + i as u32));
        if let Some(b) = blocks.clone().find(|&b| !self.fences.is_reserved(b)) {
            warn!(block = %b, %first, layer, "dropping a KV write into a block not reserved for a peer");
            return;
        }
        // Layers past the target's are the drafter's context (see `docs/spec_decode.md`).
        if layer >= target_layers {
            let Some(sp) = self.spec.as_mut() else {
                warn!(%first, layer, "dropping a drafter KV write: this engine has no drafter");
                return;
            };
            if let Err(e) = sp.write_kv(layer - target_layers, first, data) {
                warn!(%first, layer, error = %e, "dropping a drafter KV write");
            }
            return;
        }
        // In the cache's dtype: into the host pool on the CPU, the device cache on a GPU.
        if let Err(e) = self
            .backend
            .write_kv(self.kv.pool_mut(), layer, first, data)
        {
            warn!(%first, layer, bytes = data.len(), error = %e, "dropping a KV write");
        }
    }

    fn release_remote_blocks(&self, id: SeqId, seq: &Sequence) {
        for &b in seq.table.blocks() {
            self.fences.clear_if(b, id.0);
        }
    }

    pub(super) fn remote_done(&mut self, id: SeqId, first: RemoteFirst, bytes: u64) {
        let RemoteFirst {
            token: first_token,
            logprobs,
            prompt_logprobs,
        } = first;
        let Some(mut seq) = self.awaiting.remove(&id) else {
            return; // cancelled meanwhile
        };
        self.release_remote_blocks(id, &seq);
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
        self.fork(&mut seq);
        self.stats.remote_prefills += 1;
        self.stats.kv_bytes_received += bytes;
        if self.kv.pool().has_rows() {
            // The target's layers landed in the rows (registered memory: a put, or the TCP
            // receiver's copy) without passing through `write_kv`: order the peer's writes
            // (seen through the completion's channel) before the forward's reads of them.
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        }
        let eos = self.eos().to_vec();
        seq.prompt_lps = prompt_logprobs;
        seq.emit_prompt_logprobs();
        match seq.accept(first_token, &eos, logprobs) {
            Next::Continue(t) => {
                seq.phase = Phase::Decoding { next: t };
                self.running.push(seq);
            }
            Next::Finish(r) => self.finish(seq, r),
            Next::Fail(e) => self.fail(seq, &e),
        }
    }

    pub(super) fn remote_failed(
        &mut self,
        id: SeqId,
        recompute: bool,
        reason: String,
        abandoned: bool,
    ) {
        let Some(mut seq) = self.awaiting.remove(&id) else {
            return;
        };
        self.release_remote_blocks(id, &seq);
        if let Some(sp) = self.spec.as_mut() {
            sp.forget_writes(seq.table.blocks());
        }
        if abandoned {
            if let Err(e) = self.quarantine_remote(id, &mut seq) {
                self.fail(seq, &e.to_string());
                return;
            }
        }
        if seq.cancelled() {
            self.release(seq);
            return;
        }
        if recompute {
            if abandoned {
                // Fresh blocks for the positions the peer was writing.
                let n = seq.prompt.len() - seq.cached_tokens;
                let before = seq.table.blocks().len();
                if let Err(e) = self.kv.reserve(&mut seq.table, n) {
                    self.fail(seq, &e.to_string());
                    return;
                }
                if let Some(sp) = self.spec.as_mut() {
                    sp.fresh(&seq.table.blocks()[before..]);
                }
            }
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

    /// Moves the blocks `seq` reserved for its peer out of its table into the quarantine
    /// (which keeps one reference on each), leaving the table at its cached prefix.
    fn quarantine_remote(&mut self, id: SeqId, seq: &mut Sequence) -> Result<(), ModelError> {
        let first = seq.cached_tokens / self.kv.page_size();
        let remote: Vec<BlockId> = seq.table.blocks().get(first..).unwrap_or_default().to_vec();
        for &b in &remote {
            self.kv.pool_mut().retain(b)?;
        }
        self.kv.truncate(&mut seq.table, seq.cached_tokens)?;
        warn!(
            seq = id.0,
            blocks = remote.len(),
            "quarantining the blocks of an abandoned remote prefill until its peer stops"
        );
        self.quarantine.entry(id).or_default().extend(remote);
        Ok(())
    }

    /// The abandoned peer of `id` stopped: its quarantined blocks go back to the pool.
    pub(super) fn remote_settled(&mut self, id: SeqId) {
        if let Some(blocks) = self.quarantine.remove(&id) {
            if let Err(e) = self.kv.pool_mut().release_all(&blocks) {
                warn!(seq = id.0, error = %e, "releasing quarantined blocks");
            }
        }
    }

    pub(super) fn drop_cancelled(&mut self) {
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
}
