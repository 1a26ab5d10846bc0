//! The sampling side of a step: every token a batch's logits decide — plain draws (decode
//! steps, a prompt's last chunk, prefill jobs' first tokens) and speculative rounds — computed
//! on the model's backend, where the logits are. On a GPU the logits never leave the device:
//! one `probs` + `draw` launch pair for the plain rows, one `probs` + `verify` pair for the
//! rounds, and two small downloads (the tokens, the rounds' outcomes). On the CPU the same ops
//! call the CPU sampler and verifier, so the CPU engine's numerics are unchanged.
//!
//! A batch whose rounds and plain rows are all greedy, with argmax drafts and no logits
//! processing (the common greedy case), is decided by one `argmax` over its rows and one
//! download, as a plain greedy step is; each round is then verified on the host from its rows'
//! argmaxes (`cpu::verify::verify_argmax`, exactly the general rule for such rounds). On a GPU
//! that removes, after the verify forward, the rounds' gather, four uploads, the distributions
//! and the verify kernel (`FERRY_VERIFY_ARGMAX=0` keeps the general path: the A/B switch).
//!
//! Before any of that, rows of requests with penalties, `logit_bias` or a `min_tokens` mask
//! go through the one logits-processing step, `backend::sample::apply_controls` (on a GPU a
//! host round trip for those rows only); a verified position's row counts the drafts ahead of
//! it as generated, so it is processed exactly as plain decoding would process it there.
//!
//! Requests with structured output (a grammar) have each row masked the same way: a plain
//! draw with the grammar's mask after the committed tokens; a verified position's row with
//! the mask after the drafts ahead of it (the grammar advanced through them, then rolled
//! back), so verification accepts exactly what the constrained distribution would draw. A
//! draft the grammar refuses gets probability 0 from the row before it and is rejected, so
//! the rows after it (masked like the last allowed one) are never used.
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
use ferry_kernels::cpu::verify::{verify_argmax, Verified};
use ferry_modelcard::grammar::{Grammar, GrammarError};

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

/// One plain draw: the logits row, its request, the parameters and the uniform, and the
/// grammar mask (or why it could not be computed).
struct PlainRow {
    item: usize,
    row: usize,
    owner: Owner,
    params: SamplingParams,
    uniform: f64,
    allowed: Result<Option<Vec<u32>>, String>,
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
    /// One grammar mask per verified position (empty without a grammar), or why not.
    allowed: Result<Vec<Vec<u32>>, String>,
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
        let eos = self.eos().to_vec();
        let mut plain = Vec::new();
        let mut rounds = Vec::new();
        for (item, w) in work.iter().enumerate() {
            let row = firsts.get(item).copied().unwrap_or(0);
            match *w {
                Work::Decode(i) => {
                    let s = &mut self.running[i];
                    match drafts.get(i).and_then(Option::as_ref) {
                        Some(draft) => {
                            let ahead = draft.tokens.get(1..).unwrap_or(&[]);
                            let stop = &s.stop;
                            let allowed = match s.grammar.as_mut() {
                                Some(g) => round_masks(g, ahead, |t| stop.is_stop(t, &eos))
                                    .map_err(|e| e.to_string()),
                                None => Ok(Vec::new()),
                            };
                            rounds.push(RoundRows {
                                item,
                                first: row,
                                seq: i,
                                draft,
                                params: s.sampling.clone(),
                                uniforms: verify_uniforms(s, draft.gamma()),
                                allowed,
                            })
                        }
                        None => plain.push(PlainRow {
                            item,
                            row,
                            owner: Owner::Running(i),
                            params: s.sampling.clone(),
                            uniform: step_uniform(&s.sampling, s.generated, &mut s.rng),
                            allowed: plain_mask(s.grammar.as_mut()),
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
                            allowed: plain_mask(s.grammar.as_mut()),
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
                        allowed: plain_mask(t.job.grammar.as_mut()),
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
        let (drawn, verified) = if self.argmax_decides(&plain, &rounds) {
            decide_by_argmax(b, logits, &plain, &rounds)?
        } else {
            (
                self.draw_plain(logits, &plain)?,
                self.verify_rounds(logits, &rounds, q)?,
            )
        };
        for (((item, token), lp), r) in drawn.into_iter().zip(plain_lps).zip(&plain) {
            out[item] = match (lp.transpose(), &r.allowed) {
                (_, Err(e)) => Outcome::Token(Err(e.clone()), None),
                (Err(e), _) => Outcome::Token(Err(e), None),
                (Ok(lp), Ok(_)) => Outcome::Token(token, lp),
            };
        }
        for (((item, round), lp), r) in verified.into_iter().zip(round_lps).zip(&rounds) {
            out[item] = match (lp, &r.allowed) {
                (_, Err(e)) => Outcome::Round(Err(e.clone()), Vec::new()),
                (Err(e), _) => Outcome::Round(Err(e), Vec::new()),
                (Ok(lp), Ok(_)) => Outcome::Round(round, lp),
            };
        }
        Ok(out)
    }

    /// Whether the batch's logits decide everything by their argmaxes alone: it has rounds
    /// (a batch of plain draws keeps [`Self::draw_plain`]), every plain row and every round is
    /// greedy with argmax drafts, and no row is processed (no controls, `min_tokens` mask or
    /// grammar). Then [`decide_by_argmax`] gives what [`Self::draw_plain`] and
    /// [`Self::verify_rounds`] would (`FERRY_VERIFY_ARGMAX=0` keeps those two: the A/B switch).
    fn argmax_decides(&self, plain: &[PlainRow], rounds: &[RoundRows<'_>]) -> bool {
        if rounds.is_empty() || !verify_argmax_on() {
            return false;
        }
        let plain_ok = plain.iter().all(|r| {
            r.params.is_greedy()
                && matches!(r.allowed, Ok(None))
                && self.controls_of(r.owner, 0, &[], None).is_none()
        });
        plain_ok
            && rounds.iter().all(|r| {
                r.params.is_greedy()
                    && matches!(r.draft.q, DraftDist::Greedy)
                    && r.allowed.as_ref().is_ok_and(Vec::is_empty)
                    && (0..=r.draft.gamma()).all(|j| {
                        let ahead = r.draft.tokens.get(1..=j).unwrap_or(&[]);
                        self.controls_of(Owner::Running(r.seq), j, ahead, None)
                            .is_none()
                    })
            })
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
            .filter_map(|(k, r)| {
                let allowed = r.allowed.as_ref().ok().and_then(Option::as_deref);
                self.controls_of(r.owner, 0, &[], allowed).map(|c| (k, c))
            })
            .collect();
        // A decode-only batch without controls samples every row in order: no gather.
        let at: Vec<i32> = rows.iter().map(|r| r.row as i32).collect();
        let picked = processed_rows(b, logits, at, &controlled)?;
        let x = picked.tensor();
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
        // Row j of a round follows the drafts d_1..d_j: they count as generated there.
        let mut controlled: Vec<(usize, RowCtl<'_>)> = Vec::new();
        let mut at = 0;
        for r in rounds {
            for j in 0..=r.draft.gamma() {
                let ahead = r.draft.tokens.get(1..=j).unwrap_or(&[]);
                let allowed = r
                    .allowed
                    .as_ref()
                    .ok()
                    .and_then(|m| m.get(j))
                    .map(Vec::as_slice);
                if let Some(c) = self.controls_of(Owner::Running(r.seq), j, ahead, allowed) {
                    controlled.push((at + j, c));
                }
            }
            at += r.draft.gamma() + 1;
        }
        let rows: Vec<i32> = rounds
            .iter()
            .flat_map(|r| (r.first..=r.first + r.draft.gamma()).map(|x| x as i32))
            .collect();
        // A batch of rounds only, without controls, verifies its logits in place.
        let picked = processed_rows(b, logits, rows, &controlled)?;
        let x = picked.tensor();
        let gammas: Vec<usize> = rounds.iter().map(|r| r.draft.gamma()).collect();
        let greedy: Vec<bool> = rounds
            .iter()
            .map(|r| matches!(r.draft.q, DraftDist::Greedy))
            .collect();
        let q_rows = round_q(b, rounds, q, vocab)?;
        let params: Vec<SamplingParams> = rounds.iter().map(|r| r.params.clone()).collect();
        let drafts: Vec<i32> = rounds
            .iter()
            .flat_map(|r| r.draft.tokens[1..].iter().map(|&t| t as i32))
            .collect();
        let uniforms: Vec<f64> = rounds.iter().flat_map(|r| r.uniforms.clone()).collect();
        let verified = verify_logits(
            b,
            VerifyLogits {
                logits: x,
                params: &RowParams::for_blocks(b, &params, &gammas)?,
                q: q_rows.as_ref().map(Rows::tensor),
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
    /// `generated + ahead + 1`, `drafted` being the `ahead` drafts before it and `allowed`
    /// the grammar's mask there; `None` when the request uses no controls, `min_tokens` masks
    /// nothing there and there is no grammar.
    fn controls_of<'s>(
        &'s self,
        owner: Owner,
        ahead: usize,
        drafted: &'s [u32],
        allowed: Option<&'s [u32]>,
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
        if controls.is_noop() && masked.is_empty() && allowed.is_none() {
            return None;
        }
        Some(RowCtl {
            controls,
            history,
            drafted,
            masked,
            allowed,
        })
    }
}

/// The q rows of the rounds' sampled drafts, in round order, on the backend: the drafter's
/// shared rows themselves when the rounds take every one of them in order (every sequence
/// drafted and verifies its whole block: no gather), else gathered from them, or (drafters
/// that keep q on the host) uploaded.
fn round_q<'q>(
    b: &ferry_kernels::backend::Backend,
    rounds: &[RoundRows<'_>],
    q: Option<&'q Tensor>,
    vocab: usize,
) -> Result<Option<Rows<'q>>, ModelError> {
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
        let all = src.len() / vocab.max(1);
        if rows.len() == all && rows.iter().enumerate().all(|(i, &r)| r as usize == i) {
            return Ok(Some(Rows::Shared(src)));
        }
        return Ok(Some(Rows::Own(gather(
            b,
            Gather {
                src,
                rows: &b.ints(rows)?,
                width: vocab,
            },
        )?)));
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
    Ok(Some(Rows::Own(b.take(host)?)))
}

/// Rows on the backend: another tensor's, all of them in order (no copy), or a copy of some.
enum Rows<'t> {
    Shared(&'t Tensor),
    Own(Tensor),
}

impl Rows<'_> {
    fn tensor(&self) -> &Tensor {
        match self {
            Rows::Shared(t) => t,
            Rows::Own(t) => t,
        }
    }
}

/// The batch's logits rows `rows`, in that order, with `controlled` (`(index into rows,
/// processing)`) applied: the logits themselves when `rows` is every row in order and nothing
/// is processed, else a gathered copy the processing changes.
fn processed_rows<'l>(
    b: &ferry_kernels::backend::Backend,
    logits: &'l BatchLogits,
    rows: Vec<i32>,
    controlled: &[(usize, RowCtl<'_>)],
) -> Result<Rows<'l>, ModelError> {
    let total: usize = logits.rows_per_seq.iter().sum();
    let in_order = controlled.is_empty()
        && rows.len() == total
        && rows.iter().enumerate().all(|(i, &r)| r as usize == i);
    if in_order {
        return Ok(Rows::Shared(&logits.logits));
    }
    let vocab = logits.vocab;
    let mut x = gather(
        b,
        Gather {
            src: &logits.logits,
            rows: &b.ints(rows)?,
            width: vocab,
        },
    )?;
    let list: Vec<(usize, RowControls<'_>)> =
        controlled.iter().map(|(k, c)| (*k, c.row())).collect();
    apply_controls(b, &mut x, vocab, &list)?;
    Ok(Rows::Own(x))
}

/// Whether greedy rounds are verified from argmaxes ([`Scheduler::argmax_decides`]): unless
/// `FERRY_VERIFY_ARGMAX=0` (read once; the benchmarks' A/B switch).
fn verify_argmax_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERRY_VERIFY_ARGMAX").map_or(true, |v| v.trim() != "0"))
}

/// The plain draws and the rounds of a batch that [`Scheduler::argmax_decides`] admitted: one
/// argmax over every logits row and one download, as a greedy plain step takes, then each
/// round verified on the host by [`verify_argmax`] (exactly the general rule for greedy rounds:
/// a draft is accepted when it is its row's argmax). On a GPU this replaces the rounds' gather,
/// four uploads, the distributions and the verify kernel after the verify forward.
fn decide_by_argmax(
    b: &ferry_kernels::backend::Backend,
    logits: &BatchLogits,
    plain: &[PlainRow],
    rounds: &[RoundRows<'_>],
) -> Result<(Decided<u32>, Decided<Verified>), ModelError> {
    let vocab = logits.vocab;
    let best = argmax(b, &logits.logits, vocab)?.to_host()?;
    let drawn = plain
        .iter()
        .map(|r| {
            let token = best
                .get(r.row)
                .and_then(|&t| u32::try_from(t).ok())
                .ok_or_else(|| "no token: every logit is NaN".to_string());
            (r.item, token)
        })
        .collect();
    let verified = rounds
        .iter()
        .map(|r| {
            let rows = best.get(r.first..=r.first + r.draft.gamma()).unwrap_or(&[]);
            let v = verify_argmax(&r.draft.tokens[1..], rows, vocab)
                .map_err(|e| format!("speculative verification: {e}"));
            (r.item, v)
        })
        .collect();
    Ok((drawn, verified))
}

/// One row's logits processing, borrowed from its request (the mask is built per row).
struct RowCtl<'s> {
    controls: &'s LogitsControls,
    history: &'s TokenHistory,
    drafted: &'s [u32],
    masked: Vec<u32>,
    allowed: Option<&'s [u32]>,
}

impl RowCtl<'_> {
    fn row(&self) -> RowControls<'_> {
        RowControls {
            controls: self.controls,
            history: self.history,
            drafted: self.drafted,
            masked: &self.masked,
            allowed: self.allowed,
        }
    }
}

/// The grammar mask of a plain draw (`None` without a grammar), or why it failed.
fn plain_mask(g: Option<&mut Grammar>) -> Result<Option<Vec<u32>>, String> {
    g.map(|g| g.allowed().map_err(|e| e.to_string()))
        .transpose()
}

/// The grammar masks of a round's `drafts.len() + 1` verified positions: position `j`'s with
/// the grammar advanced through `drafts[..j]`, then rolled back to where it was. Drafts from
/// the first one the grammar refuses (or the first stop token, which ends the request) on
/// can never be accepted, so their positions repeat the last computed mask.
fn round_masks(
    g: &mut Grammar,
    drafts: &[u32],
    is_stop: impl Fn(u32) -> bool,
) -> Result<Vec<Vec<u32>>, GrammarError> {
    let until_stop = drafts
        .iter()
        .position(|&t| is_stop(t))
        .unwrap_or(drafts.len());
    let valid = g.valid_prefix(&drafts[..until_stop])?;
    let mut masks = Vec::with_capacity(drafts.len() + 1);
    masks.push(g.allowed()?);
    let mut consumed = 0;
    let mut walk = || -> Result<(), GrammarError> {
        for &t in &drafts[..valid] {
            g.consume(t)?;
            consumed += 1;
            masks.push(g.allowed()?);
        }
        Ok(())
    };
    let walked = walk();
    g.rollback(consumed)?;
    walked?;
    while masks.len() < drafts.len() + 1 {
        let last = masks.last().cloned().unwrap_or_default();
        masks.push(last);
    }
    Ok(masks)
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

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_kernels::backend::Backend;

    fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        }
    }

    /// A batch of plain greedy rows and greedy rounds decided by one argmax gives what the
    /// general path gives: the argmax kernel for the plain rows, `probs` + `verify` for the
    /// rounds. Rows have ties, rounds accept every length from none to all.
    #[test]
    fn argmax_decisions_are_the_general_paths() {
        let b = Backend::Cpu;
        let vocab = 5;
        // Rows: plain 0, round A 1..=3 (γ 2), plain 4, round B 5..=8 (γ 3), round C 9..=10 (γ 1).
        let rows: [[f32; 5]; 11] = [
            [0., 3., 3., 1., 0.],
            [4., 1., 0., 0., 0.],
            [0., 0., 2., 2., 1.],
            [1., 1., 1., 1., 9.],
            [0., 0., 0., 0., 1.],
            [5., 0., 0., 0., 0.],
            [0., 5., 0., 0., 0.],
            [0., 0., 5., 0., 0.],
            [0., 0., 0., 5., 5.],
            [0., 1., 0., 0., 0.],
            [2., 2., 2., 2., 2.],
        ];
        let logits = BatchLogits {
            logits: Tensor::Host(rows.concat()),
            rows_per_seq: vec![1, 3, 1, 4, 2],
            vocab,
            prompt: Vec::new(),
        };
        let draft = |tokens: Vec<u32>| Draft {
            tokens,
            q: DraftDist::Greedy,
            survival: Vec::new(),
        };
        // A: draft 0 accepted, draft 1 rejected for 2 (row 2's argmax, ties to the lowest);
        // B: all 3 and the bonus; C: draft 3 rejected for 1.
        let drafts = [
            draft(vec![7, 0, 1]),
            draft(vec![7, 0, 1, 2]),
            draft(vec![7, 3]),
        ];
        let plain_row = |item, row| PlainRow {
            item,
            row,
            owner: Owner::Running(item),
            params: greedy(),
            uniform: 0.5,
            allowed: Ok(None),
        };
        fn round(item: usize, first: usize, d: &Draft) -> RoundRows<'_> {
            RoundRows {
                item,
                first,
                seq: item,
                draft: d,
                params: greedy(),
                uniforms: vec![0.999; d.gamma() + 1],
                allowed: Ok(Vec::new()),
            }
        }
        let plain = [plain_row(0, 0), plain_row(2, 4)];
        let rounds = [
            round(1, 1, &drafts[0]),
            round(3, 5, &drafts[1]),
            round(4, 9, &drafts[2]),
        ];
        let (drawn, verified) = decide_by_argmax(&b, &logits, &plain, &rounds).unwrap();

        let want_plain: Vec<(usize, Result<u32, String>)> = plain
            .iter()
            .map(|r| (r.item, Ok(ferry_kernels::cpu::sample::argmax(&rows[r.row]))))
            .collect();
        assert_eq!(drawn, want_plain);
        let gammas: Vec<usize> = rounds.iter().map(|r| r.draft.gamma()).collect();
        let params = vec![greedy(); rounds.len()];
        let round_rows: Vec<f32> = rounds
            .iter()
            .flat_map(|r| rows[r.first..=r.first + r.draft.gamma()].concat())
            .collect();
        let general = verify_logits(
            &b,
            VerifyLogits {
                logits: &Tensor::Host(round_rows),
                params: &RowParams::for_blocks(&b, &params, &gammas).unwrap(),
                q: None,
                greedy: &[true; 3],
                drafts: &b
                    .ints(
                        rounds
                            .iter()
                            .flat_map(|r| r.draft.tokens[1..].iter().map(|&t| t as i32))
                            .collect(),
                    )
                    .unwrap(),
                gammas: &gammas,
                uniforms: &Uniforms::new(&b, &[0.999; 9]).unwrap(),
                vocab,
            },
        )
        .unwrap();
        let general: Vec<(usize, Verified)> = rounds
            .iter()
            .zip(general)
            .map(|(r, v)| (r.item, v.unwrap()))
            .collect();
        let got: Vec<(usize, Verified)> =
            verified.into_iter().map(|(i, v)| (i, v.unwrap())).collect();
        assert_eq!(got, general);
        let accepted: Vec<usize> = got.iter().map(|(_, v)| v.accepted).collect();
        assert_eq!(accepted, [1, 3, 0]);
        assert_eq!(got[0].1.tokens, [0, 2]);
        assert_eq!(got[1].1.tokens, [0, 1, 2, 3]);
        assert_eq!(got[2].1.tokens, [1]);
    }

    /// The rounds' q rows: the drafter's tensor itself when the rounds take all of its rows in
    /// order, the rows they name (in round order) otherwise.
    #[test]
    fn round_q_takes_the_drafters_rows_whole_only_when_they_are_all_in_order() {
        let b = Backend::Cpu;
        let vocab = 2;
        // Two inputs of a block of 2: rows 0–3.
        let q = Tensor::Host(vec![0., 1., 2., 3., 4., 5., 6., 7.]);
        let sampled = SamplingParams::default();
        let d = |first: usize, n: usize| Draft {
            tokens: vec![0; n + 1],
            q: DraftDist::Rows { first },
            survival: Vec::new(),
        };
        fn round<'a>(first_row: usize, d: &'a Draft, params: &SamplingParams) -> RoundRows<'a> {
            RoundRows {
                item: 0,
                first: first_row,
                seq: 0,
                draft: d,
                params: params.clone(),
                uniforms: Vec::new(),
                allowed: Ok(Vec::new()),
            }
        }
        let rows = |r: Option<Rows<'_>>| r.map(|r| r.tensor().to_host().unwrap());
        let (a, c) = (d(0, 2), d(2, 2));
        let whole = round_q(
            &b,
            &[round(0, &a, &sampled), round(3, &c, &sampled)],
            Some(&q),
            vocab,
        )
        .unwrap();
        assert!(matches!(whole, Some(Rows::Shared(t)) if std::ptr::eq(t, &q)));
        // The second input verifies one draft only: its row 3 is left out, so a copy.
        let short = d(2, 1);
        let part = round_q(
            &b,
            &[round(0, &a, &sampled), round(3, &short, &sampled)],
            Some(&q),
            vocab,
        )
        .unwrap();
        assert!(matches!(part, Some(Rows::Own(_))));
        assert_eq!(rows(part), Some(vec![0., 1., 2., 3., 4., 5.]));
        // Out of order (the second input first): a copy in round order.
        let swapped = round_q(
            &b,
            &[round(0, &c, &sampled), round(3, &a, &sampled)],
            Some(&q),
            vocab,
        )
        .unwrap();
        assert_eq!(rows(swapped), Some(vec![4., 5., 6., 7., 0., 1., 2., 3.]));
        // Greedy rounds have no q rows.
        let g = Draft {
            q: DraftDist::Greedy,
            ..d(0, 2)
        };
        assert!(round_q(&b, &[round(0, &g, &greedy())], Some(&q), vocab)
            .unwrap()
            .is_none());
    }
}
