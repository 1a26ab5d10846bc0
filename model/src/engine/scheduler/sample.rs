//! The sampling side of a step: every token a batch's logits decide — plain draws (decode
//! steps, a prompt's last chunk, prefill jobs' first tokens) and speculative rounds — computed
//! on the model's backend, where the logits are. On a GPU the logits never leave the device:
//! one `probs` + `draw` launch pair for the plain rows, one `probs` + `verify` pair for the
//! rounds, and two small downloads (the tokens, the rounds' outcomes). On the CPU the same ops
//! call the CPU sampler and verifier, so the CPU engine's numerics are unchanged.
//!
//! Before any of that, rows of requests with penalties, `logit_bias` or a `min_tokens` mask
//! go through the one logits-processing step, `backend::sample::apply_controls` (on a GPU a
//! host round trip for those rows only); a verified position's row counts the drafts ahead of
//! it as generated, so it is processed exactly as plain decoding would process it there.
//!
//! Requests that ask for log-probabilities get each decided row's raw log-softmax
//! (`backend::sample::row_logprobs`, before any processing: one gather and one download for all
//! such rows of the batch) with their outcome; a round gets one per verified position, and the
//! commit hands out those of the tokens it emits.
//!
//! Randomness is the host's, as before: each plain draw takes one uniform from the request's
//! stream (a per-step stream for seeded requests; none for greedy ones, whose distribution is a
//! point mass), each round γ + 1 from its verify stream (`spec::round_uniforms`).

use ferry_kernels::backend::rows::{gather, Gather};
use ferry_kernels::backend::sample::{
    apply_controls, argmax, row_logprobs, sample, RowParams, Sample, Uniforms,
};
use ferry_kernels::backend::verify::{verify_logits, VerifyLogits};
use ferry_kernels::backend::Tensor;
use ferry_kernels::cpu::logits::{LogitsControls, RowControls, RowLogprobs, TokenHistory};
use ferry_kernels::cpu::sample::SamplingParams;
use ferry_kernels::cpu::verify::Verified;

use super::{Owner, Scheduler, Work};
use crate::deepseek::BatchLogits;
use crate::drafter::DraftDist;
use crate::engine::sequence::step_uniform;
use crate::engine::spec::{verify_uniforms, Draft};
use crate::ModelError;

/// What a work item's logits decided.
pub(super) enum Outcome {
    /// Nothing to sample (a prompt chunk that is not the last).
    Nothing,
    /// A plain draw: the token, or why this request failed; and the row's log-probabilities
    /// when the request asked.
    Token(Result<u32, String>, Option<RowLogprobs>),
    /// A speculative round: the verified drafts and the correction / bonus, or why it failed;
    /// and one row of log-probabilities per verified position when the request asked (empty
    /// otherwise).
    Round(Result<Verified, String>, Vec<RowLogprobs>),
}

/// Outcomes by work item index.
type Decided<T> = Vec<(usize, Result<T, String>)>;

/// One plain draw: the logits row, its request, the parameters and the uniform.
struct PlainRow {
    item: usize,
    row: usize,
    owner: Owner,
    params: SamplingParams,
    uniform: f64,
}

/// One round: its first logits row, its sequence (`running[seq]`), the drafts and the
/// uniforms.
struct RoundRows<'d> {
    item: usize,
    first: usize,
    seq: usize,
    draft: &'d Draft,
    params: SamplingParams,
    uniforms: Vec<f64>,
}

impl Scheduler {
    /// Samples and verifies every work item of a batch whose forward gave `logits`; one
    /// outcome per item, in order. `q` is the drafter call's shared q rows
    /// ([`DraftDist::Rows`]). An error here is the whole batch's (a backend failure); a bad row
    /// fails its own request through its outcome.
    pub(super) fn sample_batch(
        &mut self,
        work: &[Work],
        logits: &BatchLogits,
        drafts: &[Option<Draft>],
        q: Option<&Tensor>,
    ) -> Result<Vec<Outcome>, ModelError> {
        let firsts = logits.first_rows();
        let mut plain = Vec::new();
        let mut rounds = Vec::new();
        for (item, w) in work.iter().enumerate() {
            let row = firsts.get(item).copied().unwrap_or(0);
            match *w {
                Work::Decode(i) => {
                    let s = &mut self.running[i];
                    match drafts.get(i).and_then(Option::as_ref) {
                        Some(draft) => rounds.push(RoundRows {
                            item,
                            first: row,
                            seq: i,
                            draft,
                            params: s.sampling.clone(),
                            uniforms: verify_uniforms(s, draft.gamma()),
                        }),
                        None => plain.push(PlainRow {
                            item,
                            row,
                            owner: Owner::Running(i),
                            params: s.sampling.clone(),
                            uniform: step_uniform(&s.sampling, s.generated, &mut s.rng),
                        }),
                    }
                }
                Work::Chunk(i, n) => {
                    let s = &mut self.waiting[i];
                    if s.table.len() + n >= s.prompt.len() {
                        plain.push(PlainRow {
                            item,
                            row,
                            owner: Owner::Waiting(i),
                            params: s.sampling.clone(),
                            uniform: step_uniform(&s.sampling, s.generated, &mut s.rng),
                        });
                    }
                }
                Work::Prefill(i) => {
                    let t = &mut self.prefills[i];
                    plain.push(PlainRow {
                        item,
                        row,
                        owner: Owner::Prefill(i),
                        params: t.job.sampling.clone(),
                        uniform: step_uniform(&t.job.sampling, 0, &mut t.rng),
                    });
                }
            }
        }
        // Raw log-probabilities, from the unprocessed logits, for the requests that asked.
        let mut wanted: Vec<(usize, usize)> = Vec::new();
        for r in &plain {
            if let Some(n) = self.logprobs_of(r.owner) {
                wanted.push((r.row, n));
            }
        }
        for r in &rounds {
            if let Some(n) = self.logprobs_of(Owner::Running(r.seq)) {
                wanted.extend((0..=r.draft.gamma()).map(|j| (r.first + j, n)));
            }
        }
        let b = self.backend.model().backend();
        let mut lps = row_logprobs(b, &logits.logits, logits.vocab, &wanted)?.into_iter();
        let plain_lps: Vec<Option<Result<RowLogprobs, String>>> = plain
            .iter()
            .map(|r| self.logprobs_of(r.owner).map(|_| next_logprobs(&mut lps)))
            .collect();
        let round_lps: Vec<Result<Vec<RowLogprobs>, String>> = rounds
            .iter()
            .map(|r| match self.logprobs_of(Owner::Running(r.seq)) {
                Some(_) => (0..=r.draft.gamma())
                    .map(|_| next_logprobs(&mut lps))
                    .collect(),
                None => Ok(Vec::new()),
            })
            .collect();
        let mut out: Vec<Outcome> = work.iter().map(|_| Outcome::Nothing).collect();
        let drawn = self.draw_plain(logits, &plain)?;
        for ((item, token), lp) in drawn.into_iter().zip(plain_lps) {
            out[item] = match lp.transpose() {
                Ok(lp) => Outcome::Token(token, lp),
                Err(e) => Outcome::Token(Err(e), None),
            };
        }
        let verified = self.verify_rounds(logits, &rounds, q)?;
        for ((item, round), lp) in verified.into_iter().zip(round_lps) {
            out[item] = match lp {
                Ok(lp) => Outcome::Round(round, lp),
                Err(e) => Outcome::Round(Err(e), Vec::new()),
            };
        }
        Ok(out)
    }

    /// How many alternatives `owner` wants per token, if it asked for log-probabilities.
    fn logprobs_of(&self, owner: Owner) -> Option<usize> {
        match owner {
            Owner::Running(i) => self.running.get(i)?.logprobs,
            Owner::Waiting(i) => self.waiting.get(i)?.logprobs,
            Owner::Prefill(i) => self.prefills.get(i)?.job.logprobs,
        }
    }

    /// The plain rows: gathered, `probs` + `draw`, one download.
    fn draw_plain(
        &self,
        logits: &BatchLogits,
        rows: &[PlainRow],
    ) -> Result<Decided<u32>, ModelError> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let b = self.backend.model().backend();
        let vocab = logits.vocab;
        let controlled: Vec<(usize, RowCtl<'_>)> = rows
            .iter()
            .enumerate()
            .filter_map(|(k, r)| self.controls_of(r.owner, 0, &[]).map(|c| (k, c)))
            .collect();
        // A decode-only batch without controls samples every row in order: no gather.
        let total: usize = logits.rows_per_seq.iter().sum();
        let in_order = controlled.is_empty()
            && rows.len() == total
            && rows.iter().enumerate().all(|(i, r)| r.row == i);
        let mut picked = if in_order {
            None
        } else {
            let at = b.ints(rows.iter().map(|r| r.row as i32).collect())?;
            Some(gather(
                b,
                Gather {
                    src: &logits.logits,
                    rows: &at,
                    width: vocab,
                },
            )?)
        };
        if let Some(x) = picked.as_mut() {
            let list: Vec<(usize, RowControls<'_>)> =
                controlled.iter().map(|(k, c)| (*k, c.row())).collect();
            apply_controls(b, x, vocab, &list)?;
        }
        let x = picked.as_ref().unwrap_or(&logits.logits);
        // Greedy rows only (the common serving case): the argmax, nothing to upload.
        let tokens: Vec<Result<u32, String>> = if rows.iter().all(|r| r.params.is_greedy()) {
            argmax(b, x, vocab)?
                .to_host()?
                .into_iter()
                .map(|t| u32::try_from(t).map_err(|_| "no token: every logit is NaN".into()))
                .collect()
        } else {
            let params: Vec<SamplingParams> = rows.iter().map(|r| r.params.clone()).collect();
            let uniforms: Vec<f64> = rows.iter().map(|r| r.uniform).collect();
            sample(
                b,
                Sample {
                    logits: x,
                    vocab,
                    params: &RowParams::new(b, &params)?,
                    uniforms: &Uniforms::new(b, &uniforms)?,
                },
            )?
            .into_iter()
            .map(|t| t.map_err(|e| e.to_string()))
            .collect()
        };
        Ok(rows.iter().map(|r| r.item).zip(tokens).collect())
    }

    /// The rounds: their logits rows gathered, `probs` + `verify` in one batch against the
    /// drafts' q (sampled drafts' rows; greedy drafts need none), one download.
    fn verify_rounds(
        &self,
        logits: &BatchLogits,
        rounds: &[RoundRows<'_>],
        q: Option<&Tensor>,
    ) -> Result<Decided<Verified>, ModelError> {
        if rounds.is_empty() {
            return Ok(Vec::new());
        }
        let b = self.backend.model().backend();
        let vocab = logits.vocab;
        let rows: Vec<i32> = rounds
            .iter()
            .flat_map(|r| (r.first..=r.first + r.draft.gamma()).map(|x| x as i32))
            .collect();
        let mut x = gather(
            b,
            Gather {
                src: &logits.logits,
                rows: &b.ints(rows)?,
                width: vocab,
            },
        )?;
        // Row j of a round follows the drafts d_1..d_j: they count as generated there.
        let mut controlled: Vec<(usize, RowCtl<'_>)> = Vec::new();
        let mut at = 0;
        for r in rounds {
            for j in 0..=r.draft.gamma() {
                let ahead = r.draft.tokens.get(1..=j).unwrap_or(&[]);
                if let Some(c) = self.controls_of(Owner::Running(r.seq), j, ahead) {
                    controlled.push((at + j, c));
                }
            }
            at += r.draft.gamma() + 1;
        }
        let list: Vec<(usize, RowControls<'_>)> =
            controlled.iter().map(|(k, c)| (*k, c.row())).collect();
        apply_controls(b, &mut x, vocab, &list)?;
        let gammas: Vec<usize> = rounds.iter().map(|r| r.draft.gamma()).collect();
        let greedy: Vec<bool> = rounds
            .iter()
            .map(|r| matches!(r.draft.q, DraftDist::Greedy))
            .collect();
        let q_rows = self.round_q(rounds, q, vocab)?;
        let params: Vec<SamplingParams> = rounds.iter().map(|r| r.params.clone()).collect();
        let drafts: Vec<i32> = rounds
            .iter()
            .flat_map(|r| r.draft.tokens[1..].iter().map(|&t| t as i32))
            .collect();
        let uniforms: Vec<f64> = rounds.iter().flat_map(|r| r.uniforms.clone()).collect();
        let verified = verify_logits(
            b,
            VerifyLogits {
                logits: &x,
                params: &RowParams::for_blocks(b, &params, &gammas)?,
                q: q_rows.as_ref(),
                greedy: &greedy,
                drafts: &b.ints(drafts)?,
                gammas: &gammas,
                uniforms: &Uniforms::new(b, &uniforms)?,
                vocab,
            },
        )?;
        Ok(rounds
            .iter()
            .zip(verified)
            .map(|(r, v)| {
                (
                    r.item,
                    v.map_err(|e| format!("speculative verification: {e}")),
                )
            })
            .collect())
    }

    /// The logits processing of `owner`'s row for its generated token number
    /// `generated + ahead + 1`, `drafted` being the `ahead` drafts before it; `None` when the
    /// request uses no controls and `min_tokens` masks nothing there.
    fn controls_of<'s>(
        &'s self,
        owner: Owner,
        ahead: usize,
        drafted: &'s [u32],
    ) -> Option<RowCtl<'s>> {
        let (controls, history, stop, generated) = match owner {
            Owner::Running(i) => {
                let s = self.running.get(i)?;
                (&s.controls, &s.history, &s.stop, s.generated)
            }
            Owner::Waiting(i) => {
                let s = self.waiting.get(i)?;
                (&s.controls, &s.history, &s.stop, s.generated)
            }
            Owner::Prefill(i) => {
                let t = self.prefills.get(i)?;
                (&t.job.controls, &t.history, &t.job.stop, 0)
            }
        };
        let masked = stop.masked(generated + ahead, self.eos());
        if controls.is_noop() && masked.is_empty() {
            return None;
        }
        Some(RowCtl {
            controls,
            history,
            drafted,
            masked,
        })
    }

    /// The q rows of the rounds' sampled drafts, in round order, on the backend: gathered from
    /// the drafter's shared rows, or (drafters that keep q on the host) uploaded.
    fn round_q(
        &self,
        rounds: &[RoundRows<'_>],
        q: Option<&Tensor>,
        vocab: usize,
    ) -> Result<Option<Tensor>, ModelError> {
        let b = self.backend.model().backend();
        let sampled: Vec<&RoundRows<'_>> = rounds
            .iter()
            .filter(|r| !matches!(r.draft.q, DraftDist::Greedy))
            .collect();
        if sampled.is_empty() {
            return Ok(None);
        }
        if sampled
            .iter()
            .all(|r| matches!(r.draft.q, DraftDist::Rows { .. }))
        {
            let src = q.ok_or_else(|| {
                ModelError::Invalid("drafts name q rows the drafter did not return".into())
            })?;
            let rows: Vec<i32> = sampled
                .iter()
                .flat_map(|r| {
                    let first = match r.draft.q {
                        DraftDist::Rows { first } => first,
                        _ => 0,
                    };
                    (first..first + r.draft.gamma()).map(|x| x as i32)
                })
                .collect();
            return Ok(Some(gather(
                b,
                Gather {
                    src,
                    rows: &b.ints(rows)?,
                    width: vocab,
                },
            )?));
        }
        // Host rows (a drafter that computes q on the host), possibly mixed with shared rows.
        let shared = match q {
            Some(t) => Some(t.to_host()?),
            None => None,
        };
        let mut host = Vec::new();
        for r in sampled {
            let g = r.draft.gamma();
            match &r.draft.q {
                DraftDist::Sampled(rows) => {
                    host.extend_from_slice(rows.get(..g * vocab).ok_or_else(|| {
                        ModelError::Invalid(format!(
                            "a draft's q holds {} floats, {g} drafts need {}",
                            rows.len(),
                            g * vocab
                        ))
                    })?)
                }
                DraftDist::Rows { first } => host.extend_from_slice(
                    shared
                        .as_deref()
                        .and_then(|s| s.get(first * vocab..(first + g) * vocab))
                        .ok_or_else(|| {
                            ModelError::Invalid(format!(
                                "draft rows {first}..{} are outside the drafter's q",
                                first + g
                            ))
                        })?,
                ),
                DraftDist::Greedy => {}
            }
        }
        Ok(Some(b.take(host)?))
    }
}

/// One row's logits processing, borrowed from its request (the mask is built per row).
struct RowCtl<'s> {
    controls: &'s LogitsControls,
    history: &'s TokenHistory,
    drafted: &'s [u32],
    masked: Vec<u32>,
}

impl RowCtl<'_> {
    fn row(&self) -> RowControls<'_> {
        RowControls {
            controls: self.controls,
            history: self.history,
            drafted: self.drafted,
            masked: &self.masked,
        }
    }
}

/// The next computed row of log-probabilities (in the order they were asked for), or why it
/// could not be computed (a row without a finite maximum).
fn next_logprobs(
    rows: &mut impl Iterator<Item = Result<RowLogprobs, ferry_kernels::KernelError>>,
) -> Result<RowLogprobs, String> {
    match rows.next() {
        Some(Ok(r)) => Ok(r),
        Some(Err(e)) => Err(format!("log-probabilities: {e}")),
        None => Err("log-probabilities: a row was not computed".into()),
    }
}
