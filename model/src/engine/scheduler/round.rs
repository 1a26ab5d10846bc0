//! The speculative parts of a step (see `super::super::spec` for the design): drafting and
//! reserving for the drafts, committing a verified round with KV rollback, and turning a
//! batch's committed rows into drafter context (and shipping it for prefill jobs).

use std::collections::HashMap;

use ferry_kernels::backend::Tensor;
use ferry_kernels::cpu::logits::RowLogprobs;
use ferry_kernels::cpu::verify::Verified;
use tracing::{trace, warn};

use super::{Owner, Scheduler};
use crate::drafter::ContextSegment;
use crate::engine::sequence::{Next, Phase};
use crate::engine::spec::{Draft, PromptLoad};
use crate::engine::FinishReason;

impl Scheduler {
    /// Drafts for the running sequences (one entry each; empty without a drafter) and reserves
    /// KV for every draft kept; a sequence whose reservation fails takes a plain step. Also
    /// returns the drafter's shared q rows, on the model's backend. `prompts`: the prompt work
    /// waiting beside this step.
    pub(super) fn plan_drafts(
        &mut self,
        budget: usize,
        prompts: PromptLoad,
    ) -> (Vec<Option<Draft>>, Option<Tensor>) {
        // The drafter runs where the target does, sharing its embedding and LM head.
        let Some(sp) = self.spec.as_mut() else {
            return (Vec::new(), None);
        };
        let model = self.backend.model();
        let (mut drafts, q) = sp.plan(model, &mut self.running, budget, prompts);
        for (s, d) in self.running.iter_mut().zip(drafts.iter_mut()) {
            let Some(draft) = d else { continue };
            let before = s.table.blocks().len();
            match self.kv.reserve(&mut s.table, draft.tokens.len()) {
                Ok(()) => {
                    if let Some(sp) = self.spec.as_mut() {
                        sp.fresh(&s.table.blocks()[before..]);
                    }
                }
                Err(_) => *d = None,
            }
        }
        (drafts, q)
    }

    /// Commits `running[i]`'s verified round: the anchor and the accepted drafts stay in the
    /// KV (the rest is rolled back), the accepted tokens and the correction / bonus are
    /// emitted. Returns the positions kept and, when the request ended, why; an error fails
    /// this request alone.
    /// `logprobs` holds one row per verified position when the request asked for them (the
    /// emitted token `k` was decided by row `k`), and is empty otherwise.
    pub(super) fn commit_round(
        &mut self,
        i: usize,
        draft: &Draft,
        verified: Verified,
        logprobs: &[RowLogprobs],
    ) -> Result<(usize, Option<FinishReason>), String> {
        let page = self.kv.page_size();
        let eos = self.backend.config().eos_token_ids.clone();
        let s = &mut self.running[i];
        let start = s.table.len();
        let kept = verified.accepted + 1;
        s.table.advance(kept, page).map_err(|e| e.to_string())?;
        // Rollback: positions of rejected drafts were written by the forward; forget them and
        // give back blocks that only they used.
        self.kv
            .truncate(&mut s.table, start + kept)
            .map_err(|e| e.to_string())?;
        s.tokens.extend_from_slice(&draft.tokens[..kept]);
        // A whole-block round verifies past what the request still needs (`Speculator::plan`);
        // it counts only the drafts the request could use, so the counts are a round's of
        // that length (acceptance is a prefix: the first `useful` drafts are accepted as far as
        // they would be alone), and with none it counts as the plain step it is for the
        // request (its last token).
        let useful = s.usable_drafts();
        let drafted = draft.gamma().min(useful);
        let accepted = verified.accepted.min(drafted);
        let round = u64::from(drafted > 0);
        self.stats.spec_rounds += round;
        self.stats.spec_drafted_tokens += drafted as u64;
        self.stats.spec_accepted_tokens += accepted as u64;
        if drafted > 0 {
            let widths = &mut self.stats.spec_rounds_by_width;
            if widths.len() <= drafted {
                widths.resize(drafted + 1, 0);
            }
            widths[drafted] += 1;
            self.stats
                .spec_by_prediction
                .record(draft.predicted(), accepted);
        }
        s.spec.rounds += round;
        s.spec.drafted_tokens += drafted as u64;
        s.spec.accepted_tokens += accepted as u64;
        if let Some(sp) = self.spec.as_mut() {
            sp.observe_round(draft, verified.accepted);
        }
        trace!(
            seq = s.id.0,
            position = start,
            gamma = draft.gamma(),
            accepted = verified.accepted,
            "speculative round"
        );
        for (k, &tok) in verified.tokens.iter().enumerate() {
            let lp = logprobs.get(k).map(|r| r.of(tok));
            match s.accept(tok, &eos, lp) {
                Next::Continue(t) => s.phase = Phase::Decoding { next: t },
                Next::Finish(r) => return Ok((kept, Some(r))),
                Next::Fail(e) => return Err(e),
            }
        }
        Ok((kept, None))
    }

    /// Turns the rows a batch computed into drafter context, queued on the backend right behind
    /// the forward, before anything waits for the forward (so, with small writes staged as
    /// they are by default on CUDA, its launches overlap the forward). `rows` holds every row
    /// the forward computed per work item: a round's anchor and all of its drafts, although
    /// the verification may reject some. A rejected draft's row lands past the context the
    /// sequence keeps, which advances by the kept rows only ([`Self::commit_drafter`]), and
    /// the next round writes that position again before the drafter reads it. A plain decode
    /// step (`plain_decode`: no drafts, no prompt work) of an engine that defers (`goodput`)
    /// only keeps its rows for later; any other step first writes what was kept.
    pub(super) fn extend_drafter(
        &mut self,
        rows: &[(Owner, usize, usize, usize)],
        taps: &[Tensor],
        plain_decode: bool,
    ) -> DrafterRows {
        let Some(sp) = self.spec.as_mut() else {
            return DrafterRows::default();
        };
        let model = self.backend.model();
        if plain_decode && sp.defers() {
            let segments: Option<Vec<_>> = rows
                .iter()
                .map(|&(owner, start, first, rows)| match owner {
                    Owner::Running(i) => Some((self.running[i].id, start, first, rows)),
                    _ => None,
                })
                .collect();
            if let Some(segments) = segments {
                let hidden = model.config().hidden_size;
                match sp.defer(model.backend(), hidden, taps, &segments) {
                    Ok(true) => return DrafterRows::default(),
                    Ok(false) => {}
                    Err(e) => {
                        warn!(error = %e, "keeping drafter context rows for later failed; writing them now");
                    }
                }
            }
        }
        if let Err(e) = sp.flush(model, &mut self.running) {
            warn!(error = %e, "writing deferred drafter context failed; those sequences stop speculating");
        }
        let mut extended = Vec::with_capacity(rows.len());
        let mut segments = Vec::with_capacity(rows.len());
        for &(owner, start, first_row, rows) in rows {
            let (table, ctx) = match owner {
                Owner::Running(i) => (&self.running[i].table, Some(self.running[i].draft_ctx)),
                Owner::Waiting(i) => (&self.waiting[i].table, Some(self.waiting[i].draft_ctx)),
                Owner::Prefill(i) => (&self.prefills[i].table, None),
            };
            if ctx.is_some_and(|c| c != start) {
                continue; // a gap in this sequence's context: it no longer speculates
            }
            extended.push(owner);
            // A round's rows past its table (the drafts' reserved positions) are in the
            // reservation's blocks, which the table lists.
            segments.push(ContextSegment {
                block_table: table.blocks(),
                start_pos: start,
                first_row,
                rows,
            });
        }
        let started = std::time::Instant::now();
        let result = sp.extend(model, taps, &segments);
        tracing::debug!(
            segments = segments.len(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "drafter context extended"
        );
        drop(segments);
        if let Err(e) = &result {
            warn!(error = %e, "extending the drafter context failed; those sequences stop speculating");
        }
        DrafterRows {
            extended,
            failed: result.err().map(|e| e.to_string()),
        }
    }

    /// After the batch committed: the sequences [`Self::extend_drafter`] extended keep the rows
    /// they committed (`committed`: who, first position, first batch row, rows kept) as drafter
    /// context, and prefill jobs ship their drafter layers. Returns the prefill jobs whose
    /// drafter shipping failed.
    pub(super) fn commit_drafter(
        &mut self,
        written: DrafterRows,
        committed: &[(Owner, usize, usize, usize)],
    ) -> HashMap<usize, String> {
        let mut errors = HashMap::new();
        let Some(sp) = self.spec.as_mut() else {
            return errors;
        };
        let page = self.kv.page_size();
        // Rows each owner kept, looked up once per extended owner.
        let kept: HashMap<Owner, usize> = committed
            .iter()
            .map(|&(owner, .., rows)| (owner, rows))
            .collect();
        let kept = |owner: Owner| kept.get(&owner).copied();
        for owner in written.extended {
            match owner {
                Owner::Running(i) if written.failed.is_none() => {
                    self.running[i].draft_ctx += kept(owner).unwrap_or(0);
                }
                Owner::Waiting(i) if written.failed.is_none() => {
                    self.waiting[i].draft_ctx += kept(owner).unwrap_or(0);
                }
                Owner::Prefill(i) => {
                    let t = &mut self.prefills[i];
                    let Some(mut sink) = t.job.on_draft_layer.take() else {
                        continue;
                    };
                    if let Some(e) = &written.failed {
                        errors.insert(i, e.clone());
                        continue;
                    }
                    let skip = (t.job.skip_tokens / page).min(t.table.blocks().len());
                    let blocks = &t.table.blocks()[skip..];
                    if let Err(e) = sp.ship(blocks, self.backend.kv_dtype(), &mut sink) {
                        errors.insert(i, e);
                    }
                }
                _ => {}
            }
        }
        errors
    }
}

/// What [`Scheduler::extend_drafter`] wrote, for [`Scheduler::commit_drafter`]: the work items
/// whose rows became drafter context (none when they were deferred or there is no drafter),
/// and why the write failed, if it did.
#[derive(Debug, Default)]
pub(super) struct DrafterRows {
    extended: Vec<Owner>,
    failed: Option<String>,
}
