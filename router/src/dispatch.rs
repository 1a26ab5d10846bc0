//! [`Dispatcher`]: admits a [`ValidRequest`], sends it to the chosen decode worker (naming the
//! prefill peer), tries other decode workers if that one fails before the first token, resumes
//! the request elsewhere if it fails mid-stream (migration), and turns the workers' token
//! streams into one stream of [`GenerationEvent`]s.
//!
//! | file | owns |
//! |---|---|
//! | `dispatch.rs` | admission, attempts, migration of one stream, the stream of an `n` = 1 request |
//! | `dispatch/samples.rs` | the stream of an `n` > 1 request: its samples' messages from one call or, after a migration, one call per sample; stopping a sample the router finished (`CancelSample`) |
//!
//! ```text
//! generate(req)
//!   admission permit (max_concurrent_requests; none left → RESOURCE_EXHAUSTED)
//!   attempt: Selector.select → D.Decode(prefill_peer = P) → wait for the first message
//!     fails before any token → next attempt on another decode worker (each at most once,
//!     MAX_ATTEMPTS in all); a transport failure also marks D down in the registry
//!   stream: first message, then each next one → OutputState (detokenize, stop strings)
//!     finish / stop string / error → end; the worker stream is dropped (cancels on D)
//!     D fails mid-stream (broken connection, UNAVAILABLE, no finish) → migration: attempts
//!       as above with prompt + tokens streamed so far, generated_tokens = their count,
//!       prefilled on the new worker; at most max_migrations times; OutputState carries on
//!   n > 1 (samples.rs): one D.Decode(n) carries every sample, tagged with its index
//!     a sample finished here (stop string) while others go on → D.CancelSample(call, index)
//!     D fails mid-stream → each unfinished sample migrates as above on its own call
//!       (D'.Decode(n = 1, sample_index = i, prompt + sample i's tokens)); each sample at
//!       most max_migrations times; finished samples are not resumed
//! ```
//!
//! Prompt log-probabilities (`echo` with `logprobs`, gRPC `prompt_logprobs`) come on sample
//! 0's first message, checked against the prompt ([`worker_prompt_logprobs`]), and go out on
//! each sample's first event; with `n` > 1, other samples' messages that arrive before them
//! wait. A migration never asks again: they arrived with the first message (with `n` > 1,
//! unless the worker failed before sample 0's first message: its resumed call asks).
//!
//! A migrated greedy or seeded request gives exactly the tokens it would have given on one
//! worker: the new worker's engine resumes at step `generated_tokens`, and seeded sampling
//! draws step `k` from a generator derived from `(seed, k)` alone — with `n` > 1 from sample
//! `i`'s seed, which a `sample_index` call uses as the forked sample did.
//!
//! Ownership does the cleanup: the returned stream owns the admission permit, the
//! [`LoadGuard`](crate::load::LoadGuard)s and the worker streams, so a finished, failed or
//! dropped (client gone) request releases them all. On shutdown, after the drain deadline, the
//! `drain` token ends open streams with [`RequestError::ShuttingDown`].
//!
//! Called inside the request's span: each attempt gets a `route` span (the decision) and a
//! `dispatch` client span whose context travels to the decode worker in the call's metadata.
//! The stream records the request's latencies, tokens and outcome ([`RouterMetrics`]), and
//! its migrations (`ferry.migrations` on the request span).
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use ferry_modelcard::tokenizer::Tokenizer;
use ferry_proto::internal;
use ferry_proto::{trace_ctx, v1};
use futures::Stream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status, Streaming};
use tracing::{field, Instrument, Span};

use crate::error::RequestError;
use crate::metrics::RouterMetrics;
use crate::output::{
    FinishReason, GenerationEvent, OutputState, PromptLogprobs, TokenLogprob, Usage,
};
use crate::select::{DecodeTarget, PrefillTarget, SelectRequest, Selection, Selector};
use crate::spans::{self, InSpan};
use crate::validate::ValidRequest;

mod samples;

/// Decode workers one request (or one migration of it) is offered to before its first
/// message, at most; each is tried once, so with fewer workers every one is tried.
pub const MAX_ATTEMPTS: usize = 8;

/// The events of one request; ends after the event with `finish`, or after an error.
pub type GenerationStream =
    Pin<Box<dyn Stream<Item = Result<GenerationEvent, RequestError>> + Send>>;

/// How to build a [`Dispatcher`].
#[derive(Debug)]
pub struct DispatcherParams {
    /// Decides where requests go.
    pub selector: Selector,
    /// Detokenizes the output.
    pub tokenizer: Arc<Tokenizer>,
    /// Requests in flight at most.
    pub max_concurrent_requests: usize,
    /// Mid-stream failures one request may be resumed after (0: none).
    pub max_migrations: u32,
    /// Cancelled when open streams must end (shutdown past the drain deadline).
    pub drain: CancellationToken,
    /// Where request latencies, tokens, outcomes and routing decisions are counted.
    pub metrics: Arc<RouterMetrics>,
}

#[derive(Debug)]
struct Inner {
    selector: Selector,
    tokenizer: Arc<Tokenizer>,
    limiter: Arc<Semaphore>,
    limit: usize,
    max_migrations: u32,
    drain: CancellationToken,
    metrics: Arc<RouterMetrics>,
}

/// Sends requests to workers (cheap to clone).
#[derive(Debug, Clone)]
pub struct Dispatcher {
    inner: Arc<Inner>,
}

/// A decode stream that produced its first message.
struct Opened {
    first: internal::DecodeResponse,
    rest: Streaming<internal::DecodeResponse>,
}

/// The attempt that opened a decode stream.
struct Attempt {
    selection: Selection,
    opened: Opened,
    /// Its `dispatch` span.
    span: Span,
}

/// An attempt that failed before the first message.
struct AttemptError {
    error: RequestError,
    /// The failure came from this side's transport (the worker is unreachable).
    transport: bool,
}

/// How a worker stream that had opened stopped short of a finish.
enum Fault {
    /// The router is shutting down.
    Drain,
    /// The worker closed the stream without a finish reason.
    Ended,
    /// The call failed: sent by the worker, or raised by the transport.
    Status(Status),
}

impl Fault {
    /// The client-facing error, if the request is not resumed.
    fn error(&self, worker: &ferry_proto::ids::WorkerId) -> RequestError {
        match self {
            Self::Drain => RequestError::ShuttingDown,
            Self::Ended => RequestError::Worker {
                worker: worker.clone(),
                code: Code::Unavailable,
                message: "the stream ended without a finish reason".into(),
            },
            Self::Status(status) => RequestError::worker(worker, status),
        }
    }

    /// Whether the worker, not the request, failed, so another worker can carry on: a broken
    /// connection, UNAVAILABLE or a stream without a finish; not a refusal of the request
    /// (INVALID_ARGUMENT, RESOURCE_EXHAUSTED), a failed forward (INTERNAL) or the shutdown.
    fn resumable(&self) -> bool {
        match self {
            Self::Drain => false,
            Self::Ended => true,
            Self::Status(status) => transport_failure(status) || status.code() == Code::Unavailable,
        }
    }

    /// Whether the worker is unreachable (mark it down).
    fn transport(&self) -> bool {
        matches!(self, Self::Status(status) if transport_failure(status))
    }
}

/// Whether `status` was raised by this side's transport (connect error, reset or closed
/// connection: tonic keeps the underlying error as its source) rather than sent by the
/// worker (a status from the worker's trailers has none).
fn transport_failure(status: &Status) -> bool {
    std::error::Error::source(status).is_some()
}

/// Per-request accounting; a request dropped before its end counts as `cancelled`.
struct Accounting {
    metrics: Arc<RouterMetrics>,
    request: Span,
    received: Instant,
    last_token: Option<Instant>,
    ended: bool,
}

impl Accounting {
    fn tokens(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let now = Instant::now();
        let mut n = n;
        match self.last_token {
            None => {
                self.metrics
                    .ttft
                    .observe((now - self.received).as_secs_f64());
                // Tokens that arrive with the first share its moment.
                for _ in 1..n {
                    self.metrics.itl.observe(0.0);
                }
            }
            Some(last) => {
                let gap = (now - last).as_secs_f64() / n as f64;
                while n > 0 {
                    self.metrics.itl.observe(gap);
                    n -= 1;
                }
            }
        }
        self.last_token = Some(now);
    }

    fn finished(&mut self, usage: &Usage, reason: FinishReason) {
        let m = &self.metrics;
        m.success.with_label_values(&[reason.as_str()]).inc();
        m.e2e.observe(self.received.elapsed().as_secs_f64());
        m.prompt_tokens.inc_by(u64::from(usage.prompt_tokens));
        m.generation_tokens
            .inc_by(u64::from(usage.completion_tokens));
        m.cached_prompt_tokens
            .inc_by(u64::from(usage.cached_prompt_tokens));
        spans::record_finish(&self.request, usage, reason);
        self.ended = true;
    }

    fn failed(&mut self, e: &RequestError) {
        self.metrics.failure.with_label_values(&[e.kind()]).inc();
        spans::mark_failed(&self.request, e);
        spans::mark_failed(&Span::current(), e);
        self.ended = true;
    }
}

impl Drop for Accounting {
    fn drop(&mut self) {
        if !self.ended {
            self.metrics.failure.with_label_values(&["cancelled"]).inc();
            trace_ctx::set_attribute(&self.request, "error.type", "cancelled");
        }
    }
}

impl Dispatcher {
    /// A dispatcher. Does not spawn.
    pub fn new(params: DispatcherParams) -> Self {
        Self {
            inner: Arc::new(Inner {
                selector: params.selector,
                tokenizer: params.tokenizer,
                limiter: Arc::new(Semaphore::new(params.max_concurrent_requests)),
                limit: params.max_concurrent_requests,
                max_migrations: params.max_migrations,
                drain: params.drain,
                metrics: params.metrics,
            }),
        }
    }

    /// The selector (and through it the registry).
    pub fn selector(&self) -> &Selector {
        &self.inner.selector
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.inner.limit - self.inner.limiter.available_permits()
    }

    /// Admits and sends `req`; returns once a decode worker produced its first message.
    /// Call it inside the request's span.
    pub async fn generate(&self, req: ValidRequest) -> Result<GenerationStream, RequestError> {
        let request_span = Span::current();
        spans::record_request(&req);
        let permit = self
            .inner
            .limiter
            .clone()
            .try_acquire_owned()
            .map_err(|_| RequestError::Overloaded {
                limit: self.inner.limit,
            })?;
        let mut excluded = Vec::new();
        let attempt = self
            .inner
            .attempts(&req, None, &mut excluded, &request_span)
            .await?;
        let run = Run {
            inner: self.inner.clone(),
            req,
            excluded,
            request_span,
        };
        Ok(run.stream(attempt, permit))
    }
}

impl Inner {
    /// Offers `req` to decode workers until one produces a first message: each at most once,
    /// [`MAX_ATTEMPTS`] in all, skipping `excluded` (to which each failed worker is added).
    /// `resume` is `Some` for a migration. INVALID_ARGUMENT is final; a transport failure
    /// also marks the worker down.
    async fn attempts(
        &self,
        req: &ValidRequest,
        resume: Option<Resume<'_>>,
        excluded: &mut Vec<ferry_proto::ids::WorkerId>,
        request_span: &Span,
    ) -> Result<Attempt, RequestError> {
        let mut last_error = None;
        for attempt in 0..MAX_ATTEMPTS {
            if attempt > 0 {
                self.metrics.retries.inc();
            }
            let selection = match self.route(req, excluded, attempt, resume.is_some()) {
                Ok(s) => s,
                Err(e) => return Err(last_error.unwrap_or(e)),
            };
            let dispatch = tracing::info_span!(
                parent: request_span,
                "dispatch",
                otel.kind = "client",
                worker = %selection.decode.id,
                attempt = spans::int(attempt),
                resumed_tokens = spans::int(resume.map_or(0, |r| r.tokens.len())),
            );
            trace_ctx::set_attribute(&dispatch, "rpc.system", "grpc");
            trace_ctx::set_attribute(&dispatch, "rpc.service", "ferry.internal.v1.DecodeWorker");
            trace_ctx::set_attribute(&dispatch, "rpc.method", "Decode");
            if req.n() > 1 {
                if let Some(r) = resume {
                    trace_ctx::set_attribute(&dispatch, "ferry.sample_index", i64::from(r.sample));
                }
            }
            let wire = decode_request(req, selection.prefill.as_ref(), resume);
            match open(&selection, wire).instrument(dispatch.clone()).await {
                Ok(opened) => {
                    return Ok(Attempt {
                        selection,
                        opened,
                        span: dispatch,
                    })
                }
                Err(f) if f.error.code() == Code::InvalidArgument => {
                    spans::mark_failed(&dispatch, &f.error);
                    return Err(f.error);
                }
                Err(f) => {
                    spans::mark_failed(&dispatch, &f.error);
                    tracing::warn!(
                        worker = %selection.decode.id,
                        error = %f.error,
                        "decode worker failed before the first token"
                    );
                    if f.transport {
                        self.mark_down(&selection.decode);
                    }
                    excluded.push(selection.decode.id.clone());
                    last_error = Some(f.error);
                }
            }
        }
        Err(last_error.unwrap_or(RequestError::NoDecodeWorker))
    }

    /// Drops an unreachable decode worker from routing until it registers again.
    fn mark_down(&self, worker: &DecodeTarget) {
        if self
            .selector
            .registry()
            .mark_down(&worker.id, &worker.grpc_address)
        {
            self.metrics.marked_down.inc();
            tracing::warn!(worker = %worker.id, "decode worker unreachable; marked down until it registers again");
        }
    }

    /// One selection, in a `route` span recording the decision; counts it.
    fn route(
        &self,
        req: &ValidRequest,
        excluded: &[ferry_proto::ids::WorkerId],
        attempt: usize,
        prefill_here: bool,
    ) -> Result<Selection, RequestError> {
        let policy = self.selector.policy_kind().as_str();
        let span = tracing::info_span!(
            "route",
            policy,
            attempt = spans::int(attempt),
            decode_worker = field::Empty,
            prefill_worker = field::Empty,
            predicted_cached_blocks = field::Empty,
        );
        let _entered = span.enter();
        let selection = self
            .selector
            .select(&SelectRequest {
                hashes: req.block_hashes(),
                prompt_tokens: req.prompt().len(),
                exclude: excluded,
                prefill_here,
            })
            .inspect_err(|e| spans::mark_failed(&span, e))?;
        let decode = selection.decode.id.0.as_str();
        let prefill = selection
            .prefill
            .as_ref()
            .map_or("none", |p| p.id.0.as_str());
        let cached = selection.decision.predicted_cached_blocks;
        span.record("decode_worker", decode);
        span.record("prefill_worker", prefill);
        span.record("predicted_cached_blocks", spans::int(cached));
        trace_ctx::set_attribute(
            &span,
            "ferry.routing.prompt_blocks",
            i64::try_from(req.block_hashes().len()).unwrap_or(i64::MAX),
        );
        let m = &self.metrics;
        m.routing
            .with_label_values(&[policy, prefill, decode])
            .inc();
        m.predicted_cached_blocks.observe(cached as f64);
        tracing::debug!(decode, prefill, cached_blocks = cached, "selected");
        Ok(selection)
    }
}

/// What a migration resumes: one sample's tokens streamed so far.
#[derive(Debug, Clone, Copy)]
struct Resume<'a> {
    /// The sample: 0 for a request of one sample; with `n` > 1, the sample this call
    /// generates alone (`DecodeRequest.sample_index`).
    sample: u32,
    /// Its tokens streamed so far: appended to the prompt, counted in `generated_tokens`.
    tokens: &'a [u32],
    /// Ask for the prompt's log-probabilities (when the request does): only for sample 0 of
    /// an `n` > 1 request whose first message never came; otherwise they came with it.
    prompt_logprobs: bool,
}

/// One admitted request after its first message: what a migration needs to resume it.
struct Run {
    inner: Arc<Inner>,
    req: ValidRequest,
    /// Decode workers that failed this request.
    excluded: Vec<ferry_proto::ids::WorkerId>,
    request_span: Span,
}

/// The worker stream a request is reading now.
struct Current {
    worker: DecodeTarget,
    /// The request's predicted load on this worker, released when the request moves on.
    _guard: crate::load::LoadGuard,
    rest: Streaming<internal::DecodeResponse>,
}

impl Current {
    /// Takes over an opened attempt; returns it with the attempt's first message.
    fn from_attempt(attempt: Attempt) -> (Self, internal::DecodeResponse) {
        let Attempt {
            selection, opened, ..
        } = attempt;
        let mut guard = selection.guard;
        guard.prefill_done();
        let current = Self {
            worker: selection.decode,
            _guard: guard,
            rest: opened.rest,
        };
        (current, opened.first)
    }

    /// The next message, or how the stream stopped short of a finish.
    async fn next(&mut self, drain: &CancellationToken) -> Result<internal::DecodeResponse, Fault> {
        tokio::select! {
            biased;
            _ = drain.cancelled() => Err(Fault::Drain),
            r = self.rest.message() => match r {
                Ok(Some(message)) => Ok(message),
                Ok(None) => Err(Fault::Ended),
                Err(status) => Err(Fault::Status(status)),
            },
        }
    }
}

impl Run {
    /// A sample's output state (detokenization, stop strings, usage) for this request, with
    /// `cached` prompt tokens served from the decode worker's cache.
    fn output_state(&self, cached: u32) -> OutputState {
        let mut output = OutputState::new(
            self.inner.tokenizer.clone(),
            self.req.stop(),
            self.req.prompt().len(),
        )
        .prompt_only(self.req.prompt_only());
        output.set_cached_prompt_tokens(cached);
        output
    }

    /// The request's metrics and span bookkeeping, from its first token to its end.
    fn accounting(&self) -> Accounting {
        Accounting {
            metrics: self.inner.metrics.clone(),
            request: self.request_span.clone(),
            received: self.req.received(),
            last_token: None,
            ended: false,
        }
    }

    fn stream(mut self, attempt: Attempt, permit: OwnedSemaphorePermit) -> GenerationStream {
        if self.req.n() > 1 {
            return self.stream_samples(attempt, permit);
        }
        let span = attempt.span.clone();
        let mut output = self.output_state(attempt.opened.first.cached_prompt_tokens);
        let drain = self.inner.drain.clone();
        let mut accounting = self.accounting();
        let (mut current, first) = Current::from_attempt(attempt);
        let stream = Box::pin(async_stream::stream! {
            let _permit = permit;
            let mut generated: Vec<u32> = Vec::new();
            let mut migrations = 0u32;
            let mut next = Some(first);
            // The prompt's log-probabilities are due on the first message (when asked).
            let mut prompt_due = self.req.prompt_logprobs().is_some();
            loop {
                let received = match next.take() {
                    Some(message) => Ok(message),
                    None => current.next(&drain).await,
                };
                let event = match received {
                    Ok(m) => finish_reason(&current.worker.id, m.finish_reason)
                        .and_then(|finish| {
                            let logprobs = worker_logprobs(&current.worker.id, &self.req, &m)?;
                            let prompt = if prompt_due {
                                prompt_due = false;
                                Some(worker_prompt_logprobs(&current.worker.id, &self.req, &m)?)
                            } else {
                                None
                            };
                            generated.extend_from_slice(&m.token_ids);
                            let mut event = output.on_tokens(&m.token_ids, logprobs, finish)?;
                            event.prompt_logprobs = prompt;
                            Ok(event)
                        }),
                    Err(fault) if fault.resumable() && migrations < self.inner.max_migrations => {
                        migrations += 1;
                        match self.migrate(&mut current, &fault, &generated, migrations).await {
                            Ok(Some(first)) => {
                                next = Some(first);
                                continue;
                            }
                            // Every token was streamed; only the finish was lost.
                            Ok(None) => {
                                output.on_tokens(&[], Vec::new(), Some(FinishReason::Length))
                            }
                            Err(e) => Err(e),
                        }
                    }
                    Err(fault) => Err(fault.error(&current.worker.id)),
                };
                match event {
                    Ok(event) => {
                        accounting.tokens(event.token_ids.len());
                        if let (Some(reason), Some(usage)) = (event.finish, event.usage.as_ref()) {
                            accounting.finished(usage, reason);
                        }
                        let done = event.finish.is_some();
                        yield Ok(event);
                        if done {
                            break;
                        }
                    }
                    Err(e) => {
                        accounting.failed(&e);
                        yield Err(e);
                        break;
                    }
                }
            }
            drop(current);
        });
        Box::pin(InSpan::new(stream, span))
    }

    /// Resumes the request on another decode worker after `fault` on the current one, with
    /// the prompt and the `generated` tokens: `Ok(Some(first message))` with `current`
    /// replaced, `Ok(None)` when all `max_tokens` were already streamed (nothing to resume),
    /// or the error to end the request with (the fault's, when no worker is left).
    async fn migrate(
        &mut self,
        current: &mut Current,
        fault: &Fault,
        generated: &[u32],
        migration: u32,
    ) -> Result<Option<internal::DecodeResponse>, RequestError> {
        let failed = self.worker_failed(&current.worker, fault);
        if generated.len() >= self.req.max_tokens() as usize {
            return Ok(None);
        }
        self.count_migration(&current.worker, &failed, generated.len(), migration);
        let resume = Resume {
            sample: 0,
            tokens: generated,
            prompt_logprobs: false,
        };
        let attempt = self.resume(resume, failed).await?;
        let (next, first) = Current::from_attempt(attempt);
        *current = next;
        Ok(Some(first))
    }

    /// Takes `worker`, which failed this request mid-stream with `fault`, out of its way:
    /// marked down when unreachable, excluded from its further attempts. Returns the
    /// client-facing error, should the request not be resumed.
    fn worker_failed(&mut self, worker: &DecodeTarget, fault: &Fault) -> RequestError {
        if fault.transport() {
            self.inner.mark_down(worker);
        }
        self.excluded.push(worker.id.clone());
        fault.error(&worker.id)
    }

    /// Counts migration number `migration` of this request (the metric, the request span's
    /// `ferry.migrations`) away from `worker`, which `failed` after `streamed` tokens.
    fn count_migration(
        &self,
        worker: &DecodeTarget,
        failed: &RequestError,
        streamed: usize,
        migration: u32,
    ) {
        self.inner.metrics.migrations.inc();
        trace_ctx::set_attribute(&self.request_span, "ferry.migrations", i64::from(migration));
        tracing::warn!(
            worker = %worker.id,
            error = %failed,
            streamed_tokens = streamed,
            migration,
            "decode worker failed mid-stream; resuming the request on another one"
        );
    }

    /// Offers `resume` to the decode workers this request has not excluded; when none is
    /// left, the error is `failed` (the fault that made it move).
    async fn resume(
        &mut self,
        resume: Resume<'_>,
        failed: RequestError,
    ) -> Result<Attempt, RequestError> {
        self.inner
            .attempts(
                &self.req,
                Some(resume),
                &mut self.excluded,
                &self.request_span,
            )
            .await
            .map_err(|e| match e {
                RequestError::NoDecodeWorker => failed,
                e => e,
            })
    }
}

/// Calls `Decode` on the selected worker and waits for its first message.
async fn open(
    selection: &Selection,
    request: internal::DecodeRequest,
) -> Result<Opened, AttemptError> {
    let worker = &selection.decode.id;
    let failed = |status: Status| AttemptError {
        error: RequestError::worker(worker, &status),
        transport: transport_failure(&status),
    };
    let mut client = selection.decode.decode_client();
    let mut request = tonic::Request::new(request);
    trace_ctx::inject_request(&Span::current(), &mut request);
    let mut rest = client.decode(request).await.map_err(failed)?.into_inner();
    match rest.message().await {
        Ok(Some(first)) => Ok(Opened { first, rest }),
        Ok(None) => Err(AttemptError {
            error: RequestError::Worker {
                worker: worker.clone(),
                code: Code::Unavailable,
                message: "the stream ended before the first token".into(),
            },
            transport: false,
        }),
        Err(status) => Err(failed(status)),
    }
}

/// The internal wire form of a validated request; `resume` is a migration's (one sample: its
/// tokens already streamed are appended to the prompt).
fn decode_request(
    req: &ValidRequest,
    prefill: Option<&PrefillTarget>,
    resume: Option<Resume<'_>>,
) -> internal::DecodeRequest {
    let resumed = resume.map_or(&[][..], |r| r.tokens);
    let s = req.sampling();
    let mut prompt_tokens = req.prompt().to_vec();
    prompt_tokens.extend_from_slice(resumed);
    internal::DecodeRequest {
        request_id: req.id().0.clone(),
        prompt_tokens,
        sampling: Some(internal::Sampling {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            seed: s.seed,
            // Unset when off: the wire's default is "no penalty".
            presence_penalty: Some(s.controls.presence_penalty).filter(|&p| p != 0.0),
            frequency_penalty: Some(s.controls.frequency_penalty).filter(|&p| p != 0.0),
            repetition_penalty: Some(s.controls.repetition_penalty).filter(|&p| p != 1.0),
            logit_bias: s
                .controls
                .logit_bias
                .iter()
                .map(|&(token, bias)| internal::LogitBias { token, bias })
                .collect(),
        }),
        stop: Some(internal::Stop {
            max_tokens: req.max_tokens(),
            ignore_eos: req.ignore_eos(),
            stop: req.stop().to_vec(),
            min_tokens: req.min_tokens(),
            stop_token_ids: req.stop_token_ids().to_vec(),
        }),
        prefill_peer: prefill.map(|p| internal::PrefillPeer {
            worker_id: p.id.0.clone(),
            grpc_address: p.grpc_address.clone(),
        }),
        speculative: req.speculative(),
        logprobs: req.logprobs(),
        // A migration asks only when they never came (see `Resume::prompt_logprobs`).
        prompt_logprobs: req
            .prompt_logprobs()
            .filter(|_| resume.is_none_or(|r| r.prompt_logprobs)),
        response_format: req.response_format().map(crate::structured::to_wire),
        generated_tokens: u32::try_from(resumed.len()).unwrap_or(u32::MAX),
        // A migration resumes one sample per call.
        n: if resume.is_some() { 1 } else { req.n() },
        sample_index: resume.map_or(0, |r| r.sample),
    }
}

/// The log-probabilities of a worker message's tokens when the request asked for them: one per
/// token, for the token it names (anything else is the worker's fault).
fn worker_logprobs(
    worker: &ferry_proto::ids::WorkerId,
    req: &ValidRequest,
    m: &internal::DecodeResponse,
) -> Result<Vec<TokenLogprob>, RequestError> {
    if req.logprobs().is_none() {
        return Ok(Vec::new());
    }
    let aligned = m.logprobs.len() == m.token_ids.len()
        && m.logprobs
            .iter()
            .zip(&m.token_ids)
            .all(|(l, &t)| l.token_id == t);
    if !aligned {
        return Err(RequestError::Worker {
            worker: worker.clone(),
            code: Code::Internal,
            message: format!(
                "sent {} log-probabilities for {} tokens (or for other tokens)",
                m.logprobs.len(),
                m.token_ids.len()
            ),
        });
    }
    Ok(m.logprobs.iter().map(TokenLogprob::from).collect())
}

/// The prompt's log-probabilities on a worker message (sample 0's first, for a request that
/// asked): one per prompt token after the first, each for that token, with at most the asked
/// number of alternatives (anything else is the worker's fault).
fn worker_prompt_logprobs(
    worker: &ferry_proto::ids::WorkerId,
    req: &ValidRequest,
    m: &internal::DecodeResponse,
) -> Result<Arc<PromptLogprobs>, RequestError> {
    let prompt = req.prompt();
    let top = req.prompt_logprobs().unwrap_or(0) as usize;
    let want = prompt.get(1..).unwrap_or_default();
    let aligned = m.prompt_logprobs.len() == want.len()
        && m.prompt_logprobs
            .iter()
            .zip(want)
            .all(|(l, &t)| l.token_id == t && l.top_logprobs.len() <= top);
    if !aligned {
        return Err(RequestError::Worker {
            worker: worker.clone(),
            code: Code::Internal,
            message: format!(
                "sent {} prompt log-probabilities for a prompt of {} tokens (or for other \
                 tokens, or with more than {top} alternatives)",
                m.prompt_logprobs.len(),
                prompt.len()
            ),
        });
    }
    Ok(Arc::new(PromptLogprobs {
        first_token: prompt.first().copied().unwrap_or_default(),
        rest: m.prompt_logprobs.iter().map(TokenLogprob::from).collect(),
    }))
}

fn finish_reason(
    worker: &ferry_proto::ids::WorkerId,
    raw: i32,
) -> Result<Option<FinishReason>, RequestError> {
    match v1::FinishReason::try_from(raw) {
        Ok(v1::FinishReason::Unspecified) => Ok(None),
        Ok(v1::FinishReason::Stop) => Ok(Some(FinishReason::Stop)),
        Ok(v1::FinishReason::Length) => Ok(Some(FinishReason::Length)),
        // Tool calls are parsed here, at the router; a worker never reports them.
        Ok(v1::FinishReason::ToolCalls) | Err(_) => Err(RequestError::Worker {
            worker: worker.clone(),
            code: Code::Internal,
            message: format!("unknown finish_reason {raw}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_transport_failures_and_unavailable_are_resumed_and_only_transport_marks_down() {
        let refused = Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "tcp connect error",
        )));
        assert!(transport_failure(&refused), "raised here: {refused:?}");
        let sent = |code| Fault::Status(Status::new(code, "from the worker"));
        for (fault, resumable, transport) in [
            (Fault::Status(refused), true, true),
            (sent(Code::Unavailable), true, false),
            (Fault::Ended, true, false),
            (sent(Code::InvalidArgument), false, false),
            (sent(Code::ResourceExhausted), false, false),
            (sent(Code::Internal), false, false),
            (Fault::Drain, false, false),
        ] {
            let e = fault.error(&ferry_proto::ids::WorkerId::from("d0"));
            assert_eq!(fault.resumable(), resumable, "{e}");
            assert_eq!(fault.transport(), transport, "{e}");
        }
    }
}
