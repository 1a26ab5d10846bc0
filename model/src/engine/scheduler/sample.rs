//! The sampling side of a step: every token a batch's logits decide — plain draws (decode
//! steps, a prompt's last chunk, prefill jobs' first tokens) and speculative rounds — computed
//! on the model's backend, where the logits are. On a GPU the logits never leave the device:
//! one `probs` + `draw` launch pair for the plain rows, one `probs` + `verify` pair for the
//! rounds, and two small downloads (the tokens, the rounds' outcomes). On the CPU the same ops
//! call the CPU sampler and verifier, so the CPU engine's numerics are unchanged.
//!
//! Randomness is the host's, as before: each plain draw takes one uniform from the request's
//! stream (a per-step stream for seeded requests; none for greedy ones, whose distribution is a
//! point mass), each round γ + 1 from its verify stream (`spec::round_uniforms`).

use ferry_kernels::backend::rows::{gather, Gather};
use ferry_kernels::backend::sample::{argmax, sample, RowParams, Sample, Uniforms};
use ferry_kernels::backend::verify::{verify_logits, VerifyLogits};
use ferry_kernels::backend::Tensor;
use ferry_kernels::cpu::sample::SamplingParams;
use ferry_kernels::cpu::verify::Verified;

use super::{Scheduler, Work};
use crate::deepseek::BatchLogits;
use crate::drafter::DraftDist;
use crate::engine::sequence::step_uniform;
use crate::engine::spec::{verify_uniforms, Draft};
use crate::ModelError;

/// What a work item's logits decided.
pub(super) enum Outcome {
    /// Nothing to sample (a prompt chunk that is not the last).
    Nothing,
    /// A plain draw: the token, or why this request failed.
    Token(Result<u32, String>),
    /// A speculative round: the verified drafts and the correction / bonus, or why it failed.
    Round(Result<Verified, String>),
}

/// Outcomes by work item index.
type Decided<T> = Vec<(usize, Result<T, String>)>;

/// One plain draw: the logits row, the parameters and the uniform.
struct PlainRow {
    item: usize,
    row: usize,
    params: SamplingParams,
    uniform: f64,
}

/// One round: its first logits row, the drafts and the uniforms.
struct RoundRows<'d> {
    item: usize,
    first: usize,
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
                            draft,
                            params: s.sampling.clone(),
                            uniforms: verify_uniforms(s, draft.gamma()),
                        }),
                        None => plain.push(PlainRow {
                            item,
                            row,
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
                        params: t.job.sampling.clone(),
                        uniform: step_uniform(&t.job.sampling, 0, &mut t.rng),
                    });
                }
            }
        }
        let mut out: Vec<Outcome> = work.iter().map(|_| Outcome::Nothing).collect();
        for (item, token) in self.draw_plain(logits, &plain)? {
            out[item] = Outcome::Token(token);
        }
        for (item, round) in self.verify_rounds(logits, &rounds, q)? {
            out[item] = Outcome::Round(round);
        }
        Ok(out)
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
        // A decode-only batch samples every row in order: no gather.
        let total: usize = logits.rows_per_seq.iter().sum();
        let in_order = rows.len() == total && rows.iter().enumerate().all(|(i, r)| r.row == i);
        let picked;
        let x = if in_order {
            &logits.logits
        } else {
            let at = b.ints(rows.iter().map(|r| r.row as i32).collect())?;
            picked = gather(
                b,
                Gather {
                    src: &logits.logits,
                    rows: &at,
                    width: vocab,
                },
            )?;
            &picked
        };
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
        let x = gather(
            b,
            Gather {
                src: &logits.logits,
                rows: &b.ints(rows)?,
                width: vocab,
            },
        )?;
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
