//! The stream of an `n` > 1 request ([`Run::stream_samples`]): every sample's messages, from
//! the first call's one worker stream or, after a migration, from one call per resumed
//! sample, merged into the request's one stream of events, each tagged with its sample.
//!
//! ```text
//! D.Decode(n) ─► source carrying every sample (messages name their sample: index)
//!   a sample the router finishes while the others go on (stop string)
//!     → D.CancelSample(request, call, index): D stops it and frees its blocks
//!   the source fails mid-stream (a resumable fault; each of its unfinished samples
//!   migrated fewer than max_migrations times) → D marked down / excluded, one migration
//!   counted, then for each unfinished sample i:
//!     → D'.Decode(n = 1, sample_index = i, prompt + i's tokens, generated_tokens = their
//!       count) → a source carrying sample i alone (attempts as for the first call)
//!     → or, all of i's max_tokens already streamed, i finishes `length` without a call
//!   D reports one sample failed with UNAVAILABLE (`error_code`; e.g. its prefill peer was
//!   unreachable) → that sample alone is migrated as above; the source goes on with the others
//!   (another in-band failure ends the request)
//!   a one-sample source's sample finishes → the source is dropped (cancels it on D')
//! the last sample's finish carries the usage of all; any error ends the request
//! ```
//!
//! Exact across a migration, as for one sample: a forked sample `i` draws with the per-sample
//! seed `sample_seed(seed, i)` and step `k` from (that seed, `k`); a `sample_index` call
//! draws with the same seed and resumes at step `generated_tokens`, so a greedy or seeded
//! (non-speculative) sample gives the tokens it would have given on one worker.
use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ferry_proto::ids::WorkerId;
use ferry_proto::{internal, trace_ctx};
use futures::{Stream, StreamExt};
use tokio::sync::OwnedSemaphorePermit;
use tokio_stream::StreamMap;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status, Streaming};
use tracing::{Instrument, Span};

use super::{
    finish_reason, worker_logprobs, worker_prompt_logprobs, Attempt, Fault, GenerationStream,
    Resume, Run,
};
use crate::error::RequestError;
use crate::load::LoadGuard;
use crate::output::{GenerationEvent, OutputState, PromptLogprobs, Usage};
use crate::select::DecodeTarget;
use crate::spans::InSpan;

/// How long a `CancelSample` may take (it only spares the worker work; nothing waits on it).
const CANCEL_TIMEOUT: Duration = Duration::from_secs(5);

/// A worker stream's messages; its last item, if it stops short of the request's end, says
/// how.
type Messages = Pin<Box<dyn Stream<Item = Result<internal::DecodeResponse, Fault>> + Send>>;

fn messages(rest: Streaming<internal::DecodeResponse>) -> Messages {
    Box::pin(futures::stream::unfold(Some(rest), |rest| async move {
        let mut rest = rest?;
        let fault = match rest.message().await {
            Ok(Some(m)) => return Some((Ok(m), Some(rest))),
            Ok(None) => Fault::Ended,
            Err(status) => Fault::Status(status),
        };
        Some((Err(fault), None))
    }))
}

/// The samples a worker stream carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Carries {
    /// Every sample: the request's first call (`n` > 1).
    All,
    /// One sample, resumed alone (`sample_index`).
    One(usize),
}

/// One decode call of the request; its messages are in [`SampleRun::streams`] under the same
/// key.
struct Source {
    worker: DecodeTarget,
    /// The request's predicted load on this worker, released with the source.
    _guard: LoadGuard,
    carries: Carries,
    /// The worker's id for the call (`DecodeResponse.call_id`), naming it in `CancelSample`;
    /// 0 until a message brings it.
    call_id: u64,
}

/// What the stream handles next.
enum Input {
    /// From source `key`: a message, or how it stopped.
    Source(u64, Result<internal::DecodeResponse, Fault>),
    /// A message received earlier that waited for the prompt's log-probabilities.
    Early(internal::DecodeResponse),
    /// The router is shutting down.
    Drain,
    /// No source is left while samples are unfinished (a bug here).
    Empty,
}

/// What one received message amounts to.
enum Received {
    /// An event to send, nothing yet, or the error that ends the request.
    Event(Option<Result<GenerationEvent, RequestError>>),
    /// The worker reported sample `.0` failed with UNAVAILABLE (`DecodeResponse.error_code`):
    /// resumed elsewhere like a worker going away, the call's other samples going on.
    SampleFailed(usize, Fault),
}

/// The state of an `n` > 1 request's stream; owned by it.
struct SampleRun {
    run: Run,
    outputs: Vec<OutputState>,
    finished: Vec<bool>,
    /// Each sample's tokens received so far: what a migration resumes it with.
    received: Vec<Vec<u32>>,
    /// Each sample's migrations so far (at most `max_migrations`, as a request of one).
    migrations: Vec<u32>,
    /// The key of the source carrying each sample.
    carrier: Vec<u64>,
    /// The worker each sample is (or was last) on, to name in its errors.
    worker: Vec<WorkerId>,
    sources: HashMap<u64, Source>,
    streams: StreamMap<u64, Messages>,
    next_key: u64,
    /// First messages of opened calls, handled before anything else from the streams.
    opened: VecDeque<(u64, internal::DecodeResponse)>,
    /// The request asked for the prompt's log-probabilities: sample 0's first message brings
    /// them (`prompt`) and each sample's first event carries them; messages of other samples
    /// received before wait in `early`, in order.
    asked_prompt: bool,
    prompt: Option<Arc<PromptLogprobs>>,
    started: Vec<bool>,
    early: VecDeque<internal::DecodeResponse>,
    /// Every finished sample's completion tokens.
    completion_tokens: u32,
    prompt_tokens: u32,
    /// Cached prompt tokens the first call reported.
    cached: u32,
}

impl Run {
    /// The stream of an `n` > 1 request (module docs): each sample has its own
    /// [`OutputState`] (detokenization, stop strings) and ends with its own finish; the last
    /// one to finish carries the usage of all (the prompt once, every sample's completion
    /// tokens). A sample the router finishes while others go on is stopped on the worker
    /// (`CancelSample`). A worker failing mid-stream is resumed as for one sample, each
    /// unfinished sample on its own call; so is a sample the worker reports failed with
    /// UNAVAILABLE, alone. Any other failure of a sample ends the request with an error.
    pub(super) fn stream_samples(
        self,
        attempt: Attempt,
        permit: OwnedSemaphorePermit,
    ) -> GenerationStream {
        let span = attempt.span.clone();
        let n = self.req.n() as usize;
        let cached = attempt.opened.first.cached_prompt_tokens;
        let drain = self.inner.drain.clone();
        let mut accounting = self.accounting();
        let mut state = SampleRun {
            outputs: (0..n).map(|_| self.output_state(cached)).collect(),
            finished: vec![false; n],
            received: vec![Vec::new(); n],
            migrations: vec![0; n],
            carrier: vec![0; n],
            worker: vec![attempt.selection.decode.id.clone(); n],
            sources: HashMap::new(),
            streams: StreamMap::new(),
            next_key: 0,
            opened: VecDeque::new(),
            asked_prompt: self.req.prompt_logprobs().is_some(),
            prompt: None,
            started: vec![false; n],
            early: VecDeque::new(),
            completion_tokens: 0,
            prompt_tokens: u32::try_from(self.req.prompt().len()).unwrap_or(u32::MAX),
            cached,
            run: self,
        };
        state.add_source(attempt, Carries::All);
        let stream = Box::pin(async_stream::stream! {
            let _permit = permit;
            'run: loop {
                let events: Vec<Result<GenerationEvent, RequestError>> =
                    match state.next(&drain).await {
                        Input::Source(key, Ok(m)) => match state.receive(key, m) {
                            Received::Event(e) => e.into_iter().collect(),
                            Received::SampleFailed(i, fault) => {
                                match state.on_fault(key, fault, Some(i)).await {
                                    Ok(events) => events.into_iter().map(Ok).collect(),
                                    Err(e) => vec![Err(e)],
                                }
                            }
                        },
                        Input::Source(key, Err(fault)) => match state.on_fault(key, fault, None).await {
                            Ok(events) => events.into_iter().map(Ok).collect(),
                            Err(e) => vec![Err(e)],
                        },
                        Input::Early(m) => state.process(m).transpose().into_iter().collect(),
                        Input::Drain => vec![Err(RequestError::ShuttingDown)],
                        Input::Empty => vec![Err(RequestError::Internal(
                            "no decode stream is left for the unfinished samples".into(),
                        ))],
                    };
                for event in events {
                    match event {
                        Ok(event) => {
                            accounting.tokens(event.token_ids.len());
                            // Only the last sample's finish carries the usage.
                            let last = match (event.finish, event.usage.as_ref()) {
                                (Some(reason), Some(usage)) => {
                                    accounting.finished(usage, reason);
                                    true
                                }
                                _ => false,
                            };
                            yield Ok(event);
                            if last {
                                break 'run;
                            }
                        }
                        Err(e) => {
                            accounting.failed(&e);
                            yield Err(e);
                            break 'run;
                        }
                    }
                }
            }
            drop(state);
        });
        Box::pin(InSpan::new(stream, span))
    }
}

impl SampleRun {
    fn n(&self) -> usize {
        self.finished.len()
    }

    /// Takes over an opened call carrying `carries`; its first message is handled next.
    fn add_source(&mut self, attempt: Attempt, carries: Carries) {
        let Attempt {
            selection, opened, ..
        } = attempt;
        let mut guard = selection.guard;
        guard.prefill_done();
        let key = self.next_key;
        self.next_key += 1;
        let samples = match carries {
            Carries::All => 0..self.n(),
            Carries::One(i) => i..i + 1,
        };
        for i in samples {
            self.carrier[i] = key;
            self.worker[i] = selection.decode.id.clone();
        }
        self.sources.insert(
            key,
            Source {
                worker: selection.decode,
                _guard: guard,
                carries,
                call_id: 0,
            },
        );
        self.streams.insert(key, messages(opened.rest));
        self.opened.push_back((key, opened.first));
    }

    /// The next input: a message that waited (once the prompt's log-probabilities came), a
    /// call's first message, or the next message or fault of any source.
    async fn next(&mut self, drain: &CancellationToken) -> Input {
        if !self.asked_prompt || self.prompt.is_some() {
            if let Some(m) = self.early.pop_front() {
                return Input::Early(m);
            }
        }
        if let Some((key, m)) = self.opened.pop_front() {
            return Input::Source(key, Ok(m));
        }
        tokio::select! {
            biased;
            _ = drain.cancelled() => Input::Drain,
            next = self.streams.next() => match next {
                Some((key, item)) => Input::Source(key, item),
                None => Input::Empty,
            },
        }
    }

    /// A message from source `key`: checked against the samples it carries, recorded (a
    /// migration resumes with it), then handled now or, when it must wait for the prompt's
    /// log-probabilities, later.
    fn receive(&mut self, key: u64, m: internal::DecodeResponse) -> Received {
        let Some(source) = self.sources.get_mut(&key) else {
            return Received::Event(None);
        };
        let index = m.index as usize;
        let ours = match source.carries {
            Carries::All => index < self.finished.len(),
            Carries::One(i) => index == i,
        };
        if !ours {
            let call = match source.carries {
                Carries::All => format!("a request of {}", self.finished.len()),
                Carries::One(i) => format!("a call for sample {i}"),
            };
            return Received::Event(Some(Err(RequestError::Worker {
                worker: source.worker.id.clone(),
                code: Code::Internal,
                message: format!("sent sample index {index} on {call}"),
            })));
        }
        if source.call_id == 0 {
            source.call_id = m.call_id;
        }
        if self.finished[index] {
            return Received::Event(None);
        }
        if !m.error.is_empty() {
            let message = format!("sample {index} failed: {}", m.error);
            if m.error_code == Code::Unavailable as u32 {
                return Received::SampleFailed(index, Fault::Status(Status::unavailable(message)));
            }
            return Received::Event(Some(Err(RequestError::Worker {
                worker: source.worker.id.clone(),
                code: Code::Internal,
                message,
            })));
        }
        self.received[index].extend_from_slice(&m.token_ids);
        if self.asked_prompt && self.prompt.is_none() && index != 0 {
            self.early.push_back(m);
            return Received::Event(None);
        }
        Received::Event(self.process(m).transpose())
    }

    /// Turns a received message of an unfinished sample into its event (`None`: the sample
    /// finished meanwhile).
    fn process(
        &mut self,
        m: internal::DecodeResponse,
    ) -> Result<Option<GenerationEvent>, RequestError> {
        let index = m.index as usize;
        if self.finished.get(index).is_none_or(|&f| f) {
            return Ok(None);
        }
        let worker = self.worker[index].clone();
        let by_worker = finish_reason(&worker, m.finish_reason)?;
        let logprobs = worker_logprobs(&worker, &self.run.req, &m)?;
        if self.asked_prompt && self.prompt.is_none() {
            self.prompt = Some(worker_prompt_logprobs(&worker, &self.run.req, &m)?);
        }
        let mut event = self.outputs[index].on_tokens(&m.token_ids, logprobs, by_worker)?;
        event.index = m.index;
        if self.asked_prompt && !self.started[index] {
            self.started[index] = true;
            event.prompt_logprobs = self.prompt.clone();
        }
        if event.finish.is_some() {
            self.finish(index, &mut event, by_worker.is_some());
        }
        Ok(Some(event))
    }

    /// Sample `index` finished with `event`: its usage joins the request's (on the event only
    /// when it is the last sample), and its call stops generating it: a one-sample call is
    /// dropped; on the first call, a sample the router finished (`by_worker` false) while
    /// others go on is stopped with `CancelSample`.
    fn finish(&mut self, index: usize, event: &mut GenerationEvent, by_worker: bool) {
        self.finished[index] = true;
        let sample = event.usage.take().unwrap_or_default();
        self.completion_tokens = self
            .completion_tokens
            .saturating_add(sample.completion_tokens);
        let key = self.carrier[index];
        match self.sources.get(&key).map(|s| s.carries) {
            Some(Carries::One(_)) => {
                self.sources.remove(&key);
                self.streams.remove(&key);
            }
            Some(Carries::All) if !by_worker => {
                let others = (0..self.n()).any(|i| !self.finished[i] && self.carrier[i] == key);
                if let (Some(source), true) = (self.sources.get(&key), others) {
                    stop_on_worker(source, &self.run.req.id().0, index);
                }
            }
            _ => {}
        }
        if self.finished.iter().all(|&f| f) {
            event.usage = Some(Usage {
                prompt_tokens: self.prompt_tokens,
                completion_tokens: self.completion_tokens,
                cached_prompt_tokens: self.cached,
            });
        }
    }

    /// Source `key` stopped short with `fault` (`only`: `None`), or reported its sample `only`
    /// failed with it while its other samples go on: the unfinished samples it hit are resumed
    /// on other decode workers (module docs), or the request ends with the fault's error.
    /// Returns the events of samples finished without a call (all their tokens were streamed).
    async fn on_fault(
        &mut self,
        key: u64,
        fault: Fault,
        only: Option<usize>,
    ) -> Result<Vec<GenerationEvent>, RequestError> {
        let Some(source) = self.sources.get(&key) else {
            return Ok(Vec::new());
        };
        // A failed call ends; a call of several samples goes on without the one that failed.
        let source_worker = source.worker.clone();
        if only.is_none() || source.carries != Carries::All {
            self.streams.remove(&key);
            self.sources.remove(&key);
        }
        let affected: Vec<usize> = (0..self.n())
            .filter(|&i| !self.finished[i] && self.carrier[i] == key)
            .filter(|&i| only.is_none_or(|o| o == i))
            .collect();
        let max_migrations = self.run.inner.max_migrations;
        if !fault.resumable()
            || affected
                .iter()
                .any(|&i| self.migrations[i] >= max_migrations)
        {
            return Err(fault.error(&source_worker.id));
        }
        let failed = self.run.worker_failed(&source_worker, &fault);
        let max_tokens = self.run.req.max_tokens() as usize;
        let (done, resumed): (Vec<usize>, Vec<usize>) = affected
            .into_iter()
            .partition(|&i| self.received[i].len() >= max_tokens);
        if let Some(migration) = resumed.iter().map(|&i| self.migrations[i] + 1).max() {
            let streamed = resumed.iter().map(|&i| self.received[i].len()).sum();
            self.run
                .count_migration(&source_worker, &failed, streamed, migration);
        }
        let mut events = Vec::new();
        // Every token of these was streamed; only the finish was lost. It comes after the
        // sample's tokens still waiting, if any.
        for i in done {
            let lost = internal::DecodeResponse {
                index: u32::try_from(i).unwrap_or(u32::MAX),
                finish_reason: ferry_proto::v1::FinishReason::Length as i32,
                ..Default::default()
            };
            if self.asked_prompt && self.prompt.is_none() && i != 0 {
                self.early.push_back(lost);
            } else if let Some(event) = self.process(lost)? {
                events.push(event);
            }
        }
        for i in resumed {
            self.migrations[i] += 1;
            let resume = Resume {
                sample: u32::try_from(i).unwrap_or(u32::MAX),
                tokens: &self.received[i],
                prompt_logprobs: i == 0 && self.prompt.is_none(),
            };
            let attempt = self
                .run
                .resume(resume, fault.error(&source_worker.id))
                .await?;
            self.add_source(attempt, Carries::One(i));
        }
        Ok(events)
    }
}

/// Asks `source`'s worker to stop sample `index` of its call, which the router finished while
/// the call's other samples go on: the worker would otherwise generate it (and hold its
/// blocks) until its own finish, for tokens the router drops. In the background, best effort:
/// a failure only leaves that work undone.
fn stop_on_worker(source: &Source, request_id: &str, index: usize) {
    let worker = source.worker.id.clone();
    if source.call_id == 0 {
        tracing::debug!(%worker, index, "the decode worker named no call id; the sample runs to its finish there");
        return;
    }
    let mut client = source.worker.decode_client();
    let mut request = tonic::Request::new(internal::CancelSampleRequest {
        request_id: request_id.to_owned(),
        call_id: source.call_id,
        index: u32::try_from(index).unwrap_or(u32::MAX),
    });
    trace_ctx::inject_request(&Span::current(), &mut request);
    tokio::spawn(
        async move {
            match tokio::time::timeout(CANCEL_TIMEOUT, client.cancel_sample(request)).await {
                Ok(Ok(reply)) => tracing::debug!(
                    %worker,
                    index,
                    stopped = reply.into_inner().stopped,
                    "asked the decode worker to stop a finished sample"
                ),
                Ok(Err(status)) => tracing::warn!(
                    %worker,
                    index,
                    error = %status,
                    "could not stop a finished sample on the decode worker"
                ),
                Err(_) => tracing::warn!(
                    %worker,
                    index,
                    "could not stop a finished sample on the decode worker: no answer in time"
                ),
            }
        }
        .in_current_span(),
    );
}
