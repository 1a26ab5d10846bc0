//! The forward side of a step: building the batch's inputs and hooks, running the forward,
//! and committing its outcome (or failing every request in it).

use std::collections::HashMap;
use std::time::Instant;

use tracing::warn;

use ferry_kernels::cpu::logits::RowLogprobs;

use super::sample::Outcome;
use super::{BatchResult, DrafterStage, Owner, Scheduler, Work};
use crate::deepseek::{BatchInputs, LogitsWanted, PromptRows, SeqInput};
use crate::engine::backend::Pass;
use crate::engine::sequence::{Next, Origin, Phase};
use crate::engine::spec::Draft;
use crate::engine::PrefillOutcome;
use crate::kv::LayerRows;
use crate::ModelError;

impl Scheduler {
    /// Runs one batch and returns when its forward returned and when its tokens were on the
    /// host (the step's phases, [`crate::engine::StepKind`]); a failed forward's are equal.
    pub(super) fn run_batch(
        &mut self,
        work: Vec<Work>,
        drafts: Vec<Option<Draft>>,
        q: Option<ferry_kernels::backend::Tensor>,
        phases: super::HostPhases,
    ) -> (Instant, Instant) {
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
        let mut rows_on_device = true;
        for w in &work {
            if let Work::Prefill(i) = *w {
                let t = &mut self.prefills[i];
                rows_on_device &= t.job.rows_on_device;
                let skip = (t.job.skip_tokens / page).min(t.table.blocks().len());
                let blocks = t.table.blocks()[skip..].to_vec();
                staged.extend_from_slice(&blocks);
                let sink = std::mem::replace(&mut t.job.on_layer, Box::new(|_, _, _| Ok(())));
                sinks.push((i, sink, blocks));
            }
        }
        // Drafts the drafter left on the device (`Speculator::plan`) stay there when the batch
        // opens with their round (every running sequence, in order, each its anchor and γ
        // drafts; prompt work may follow): the forward puts them into its inputs itself. Any
        // other batch needs them on the host first.
        let mut drafts = drafts;
        let round_width = drafts.first().and_then(Option::as_ref).map(Draft::gamma);
        let round_first = drafts.len() == self.running.len()
            && work.len() >= drafts.len()
            && work
                .iter()
                .take(drafts.len())
                .enumerate()
                .all(|(k, w)| matches!(*w, Work::Decode(i) if i == k))
            && drafts
                .iter()
                .all(|d| d.as_ref().map(Draft::gamma) == round_width);
        if !round_first {
            self.fill_queued_drafts(&mut drafts);
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
        // Prompt log-probabilities: every computed prompt row of a request that asked, each
        // predicting the prompt's next token (the last prompt row predicts the first generated
        // token and is sampled as usual).
        let mut prompt_logprobs = Vec::new();
        let mut prompt_items = Vec::new();
        for (item, w) in work.iter().enumerate() {
            let (prompt, start, n, top) = match *w {
                Work::Chunk(i, n) => {
                    let s = &self.waiting[i];
                    (&s.prompt, s.table.len(), n, s.prompt_logprobs)
                }
                Work::Prefill(i) => {
                    let t = &self.prefills[i];
                    let n = t.job.prompt.len() - t.reused;
                    (&t.job.prompt, t.reused, n, t.job.prompt_logprobs)
                }
                Work::Decode(_) => continue,
            };
            let Some(top) = top else { continue };
            let end = (start + n + 1).min(prompt.len());
            prompt_logprobs.push(PromptRows {
                seq: item,
                targets: prompt.get(start + 1..end).unwrap_or_default(),
                top,
            });
            prompt_items.push(item);
        }
        let batch = BatchInputs {
            prompt_logprobs,
            drafts_on_device: self
                .spec
                .as_ref()
                .and_then(|sp| sp.queued_ids(round_width.unwrap_or(0))),
            seqs,
        };

        // A failing sink fails its own job only; the forward goes on.
        let mut hook_errors: HashMap<usize, String> = HashMap::new();
        let mut hook = |layer: usize, rows: &LayerRows<'_>| -> Result<(), ModelError> {
            for (i, sink, blocks) in sinks.iter_mut() {
                if hook_errors.contains_key(i) {
                    continue;
                }
                if let Err(e) = sink(layer, blocks, rows) {
                    hook_errors.insert(*i, e);
                }
            }
            Ok(())
        };
        // The drafter's context is built from the hidden states after its tap layers, copied
        // on the model's device by the forward.
        let taps: Vec<usize> = self
            .spec
            .as_ref()
            .map(|sp| sp.taps().to_vec())
            .unwrap_or_default();
        let mut tapped: Vec<(usize, ferry_kernels::backend::Tensor)> = Vec::new();
        let pass = Pass {
            after_layer: &mut hook,
            taps: &taps,
            tapped: &mut tapped,
            staged: &staged,
            rows_on_device: rows_on_device && !staged.is_empty(),
        };
        self.stats.spec_queued_steps += u64::from(batch.drafts_on_device.is_some());
        let result = self.backend.forward(&batch, self.kv.pool_mut(), pass);
        drop(batch);
        // In the drafter's tap order (a layer tapped twice is copied once).
        let order: Vec<usize> = taps
            .iter()
            .filter_map(|l| tapped.iter().position(|(t, _)| t == l))
            .collect();
        let mut slots: Vec<Option<ferry_kernels::backend::Tensor>> =
            tapped.into_iter().map(|(_, t)| Some(t)).collect();
        let taps: Vec<_> = order
            .into_iter()
            .filter_map(|i| slots.get_mut(i).and_then(Option::take))
            .collect();
        // On a GPU every row the forward computed becomes drafter context before anything
        // waits for the forward (`extend_drafter`), and the commit keeps the rows each request
        // kept; on the CPU the commit writes the kept rows only. (Timed as the launch's: on a
        // GPU these are launches queued behind the forward's.)
        let drafter = if self.backend.model().backend().device().is_gpu() && result.is_ok() {
            let rows = self.computed_rows(&work, &drafts);
            DrafterStage::Written(self.extend_drafter(&rows, &taps, plain_decode(&work, &drafts)))
        } else {
            DrafterStage::Pending(taps)
        };
        let forwarded = Instant::now();
        super::host_phase(phases.sample);
        // The round's drafts, read after its forward was queued (the download waits for it).
        self.fill_queued_drafts(&mut drafts);
        // Every token the logits decide, drawn and verified where the logits are.
        let result = result.and_then(|mut logits| {
            let prompt: HashMap<usize, _> = prompt_items
                .into_iter()
                .zip(std::mem::take(&mut logits.prompt))
                .collect();
            let outcomes = self.sample_batch(&work, &logits, &drafts, q.as_ref())?;
            Ok((outcomes, prompt))
        });
        let sampled = Instant::now();
        super::host_phase(phases.commit);
        match result {
            Ok((outcomes, prompt)) => self.apply(
                work,
                BatchResult {
                    outcomes,
                    prompt,
                    hook_errors,
                    drafts,
                    drafter,
                },
            ),
            Err(e) => self.fail_batch(work, &e.to_string()),
        }
        (forwarded, sampled)
    }

    /// Brings drafts the drafter left on the device to the host (nothing when there are
    /// none). After a failed download those rounds keep their anchors alone
    /// ([`crate::engine::spec::Speculator::fill_queued`]).
    fn fill_queued_drafts(&mut self, drafts: &mut [Option<Draft>]) {
        if let Some(sp) = self.spec.as_mut() {
            if let Err(e) = sp.fill_queued(drafts) {
                warn!(error = %e, "reading the drafts back failed; those rounds keep their anchors alone");
            }
        }
    }

    /// Commits a successful forward: advance tables, sample, emit, finish.
    fn apply(&mut self, work: Vec<Work>, result: BatchResult) {
        let BatchResult {
            outcomes,
            mut prompt,
            hook_errors,
            drafts,
            drafter,
        } = result;
        // The forward just run shipped the batch's prefill jobs (if any).
        let ship_tail_us = self.backend.ship_stats().last_tail_us;
        let page = self.kv.page_size();
        let eos = self.eos().to_vec();
        let mut finished_running = Vec::new();
        let mut promoted = Vec::new();
        let mut done_prefills = Vec::new();
        // Committed rows per work item, for the drafter's context: (who, first position,
        // first batch row, rows).
        let mut committed = Vec::new();
        let mut first_row = 0;
        for (item, (w, outcome)) in work.iter().zip(outcomes).enumerate() {
            let row = first_row;
            let prompt_lps = prompt.remove(&item);
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
                    if let (Some(Some(d)), Outcome::Round(verified, lps)) =
                        (drafts.get(i), &outcome)
                    {
                        let start = self.running[i].table.len();
                        let committed_round = verified
                            .clone()
                            .and_then(|v| self.commit_round(i, d, v, lps));
                        match committed_round {
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
                    let (tok, lp) = token(outcome);
                    match tok {
                        Ok(tok) => match s.accept(tok, &eos, lp.map(|r| r.of(tok))) {
                            Next::Continue(t) => s.phase = Phase::Decoding { next: t },
                            Next::Finish(r) => finished_running.push((i, Ok(r))),
                            Next::Fail(e) => finished_running.push((i, Err(e))),
                        },
                        Err(e) => finished_running.push((i, Err(e))),
                    }
                }
                Work::Chunk(i, n) => {
                    let s = &mut self.waiting[i];
                    if let Err(e) = s.table.advance(n, page) {
                        promoted.push((i, Err(e.to_string())));
                        continue;
                    }
                    match prompt_lps {
                        Some(Ok(lps)) => s.prompt_lps.extend(lps),
                        Some(Err(e)) => {
                            promoted.push((i, Err(e)));
                            continue;
                        }
                        None => {}
                    }
                    let done = s.table.len();
                    committed.push((Owner::Waiting(i), done - n, row, n));
                    s.tokens.extend_from_slice(&s.prompt[done - n..done]);
                    if s.origin == Origin::Fork {
                        self.stats.fork_tail_tokens += n as u64;
                    } else {
                        self.stats.prefill_computed_tokens += n as u64;
                    }
                    s.phase = Phase::Prefilling { done };
                    if done < s.prompt.len() {
                        continue;
                    }
                    if s.origin != Origin::Fork {
                        self.stats.prefill_reused_tokens += s.cached_tokens as u64;
                    }
                    let (tok, lp) = token(outcome);
                    match tok {
                        Ok(tok) => {
                            s.emit_prompt_logprobs();
                            promoted.push((i, Ok(s.accept(tok, &eos, lp.map(|r| r.of(tok))))))
                        }
                        Err(e) => promoted.push((i, Err(e))),
                    }
                }
                Work::Prefill(i) => {
                    let t = &mut self.prefills[i];
                    let computed = t.job.prompt.len() - t.reused;
                    let outcome = match (hook_errors.get(&i), prompt_lps) {
                        (Some(e), _) => Err(format!("KV transfer failed: {e}")),
                        (None, Some(Err(e))) => Err(e),
                        (None, prompt_lps) => {
                            let (tok, lp) = token(outcome);
                            tok.map(|first_token| PrefillOutcome {
                                first_token,
                                first_logprobs: lp.map(|r| r.of(first_token)),
                                prompt_logprobs: prompt_lps
                                    .and_then(Result::ok)
                                    .unwrap_or_default(),
                                computed_tokens: computed,
                                reused_tokens: t.reused,
                                ship_tail: std::time::Duration::from_micros(ship_tail_us),
                            })
                        }
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
        // Before anything is released: the committed rows are (or stay) drafter context, and
        // prefill jobs ship it.
        let written = match drafter {
            DrafterStage::Written(rows) => rows,
            DrafterStage::Pending(taps) => {
                self.extend_drafter(&committed, &taps, plain_decode(&work, &drafts))
            }
        };
        let mut draft_errors = self.commit_drafter(written, &committed);
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
                Origin::Fork => self.stats.forked_samples += 1,
                Origin::Remote => {}
            }
            if r.is_ok() {
                // The prompt is in the cache: the request's other samples fork off it.
                self.fork(&mut s);
            }
            match r {
                Ok(Next::Continue(t)) => {
                    s.phase = Phase::Decoding { next: t };
                    self.running.push(s);
                }
                Ok(Next::Finish(reason)) => self.finish(s, reason),
                Ok(Next::Fail(e)) | Err(e) => self.fail(s, &e),
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

    /// Per work item, the rows the forward computed: (who, first position, first batch row,
    /// rows). A round's are its anchor and every draft; a plain decode step's its one token
    /// (a sequence not decoding computes a row no one keeps, and is left out).
    fn computed_rows(
        &self,
        work: &[Work],
        drafts: &[Option<Draft>],
    ) -> Vec<(Owner, usize, usize, usize)> {
        let mut rows = Vec::with_capacity(work.len());
        let mut first_row = 0;
        for w in work {
            let (entry, n) = match *w {
                Work::Decode(i) => {
                    let s = &self.running[i];
                    let n = drafts
                        .get(i)
                        .and_then(Option::as_ref)
                        .map_or(1, |d| d.tokens.len());
                    let decoding = matches!(s.phase, Phase::Decoding { .. });
                    let entry =
                        decoding.then_some((Owner::Running(i), s.table.len(), first_row, n));
                    (entry, n)
                }
                Work::Chunk(i, n) => {
                    let s = &self.waiting[i];
                    (Some((Owner::Waiting(i), s.table.len(), first_row, n)), n)
                }
                Work::Prefill(i) => {
                    let t = &self.prefills[i];
                    let n = t.job.prompt.len() - t.reused;
                    (Some((Owner::Prefill(i), t.reused, first_row, n)), n)
                }
            };
            rows.extend(entry);
            first_row += n;
        }
        rows
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
}

/// The token a plain draw decided, with its row's log-probabilities when the request asked (an
/// outcome of any other kind is an engine bug, reported as this request's error).
fn token(outcome: Outcome) -> (Result<u32, String>, Option<RowLogprobs>) {
    match outcome {
        Outcome::Token(t, lp) => (t, lp),
        Outcome::Round(..) | Outcome::Nothing => {
            (Err("no token was sampled for this row".into()), None)
        }
    }
}

/// A batch of plain decode steps only: no drafts, no prompt work (an engine that defers keeps
/// its drafter rows for later).
fn plain_decode(work: &[Work], drafts: &[Option<Draft>]) -> bool {
    drafts.iter().all(Option::is_none) && work.iter().all(|w| matches!(w, Work::Decode(_)))
}
