//! [`Dispatcher`]: admits a [`ValidRequest`], sends it to the chosen decode worker (naming the
//! prefill peer), retries once elsewhere if that worker fails before the first token, and turns
//! the worker's token stream into a stream of [`GenerationEvent`]s.
//!
//! ```text
//! generate(req)
//!   admission permit (max_concurrent_requests; none left → RESOURCE_EXHAUSTED)
//!   attempt 1: Selector.select → D.Decode(prefill_peer = P) → wait for the first message
//!     fails before any token → attempt 2 on another decode worker (D excluded)
//!   stream: first message, then each next one → OutputState (detokenize, stop strings)
//!     finish / stop string / error → end; the worker stream is dropped (cancels on D)
//! ```
//!
//! Ownership does the cleanup: the returned stream owns the admission permit, the
//! [`LoadGuard`](crate::load::LoadGuard) and the worker stream, so a finished, failed or
//! dropped (client gone) request releases all three. On shutdown, after the drain deadline, the
//! `drain` token ends open streams with [`RequestError::ShuttingDown`].
//!
//! Called inside the request's span: each attempt gets a `route` span (the decision) and a
//! `dispatch` client span whose context travels to the decode worker in the call's metadata.
//! The stream records the request's latencies, tokens and outcome ([`RouterMetrics`]).
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use ferry_model::tokenizer::Tokenizer;
use ferry_proto::internal;
use ferry_proto::{trace_ctx, v1};
use futures::Stream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Streaming};
use tracing::{field, Instrument, Span};

use crate::error::RequestError;
use crate::metrics::RouterMetrics;
use crate::output::{FinishReason, GenerationEvent, OutputState, Usage};
use crate::select::{PrefillTarget, SelectRequest, Selection, Selector};
use crate::spans::{self, InSpan};
use crate::validate::ValidRequest;

/// Attempts per request: the first decode worker and one retry.
pub const MAX_ATTEMPTS: usize = 2;

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
    /// Its `dispatch` span, current while the stream runs.
    span: Span,
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

    /// Admits and sends `req`; returns once the decode worker produced its first message.
    /// Call it inside the request's span.
    pub async fn generate(&self, req: ValidRequest) -> Result<GenerationStream, RequestError> {
        let request_span = Span::current();
        spans::record_request(&req);
        let policy = self.inner.selector.policy_kind().as_str();
        let permit = self
            .inner
            .limiter
            .clone()
            .try_acquire_owned()
            .map_err(|_| RequestError::Overloaded {
                limit: self.inner.limit,
            })?;
        let mut excluded = Vec::new();
        let mut last_error = None;
        for attempt in 0..MAX_ATTEMPTS {
            if attempt > 0 {
                self.inner.metrics.retries.inc();
            }
            let selection = match self.route(&req, &excluded, policy, attempt) {
                Ok(s) => s,
                Err(e) => return Err(last_error.unwrap_or(e)),
            };
            let dispatch = tracing::info_span!(
                "dispatch",
                otel.kind = "client",
                worker = %selection.decode.id,
                attempt = spans::int(attempt),
            );
            trace_ctx::set_attribute(&dispatch, "rpc.system", "grpc");
            trace_ctx::set_attribute(&dispatch, "rpc.service", "ferry.internal.v1.DecodeWorker");
            trace_ctx::set_attribute(&dispatch, "rpc.method", "Decode");
            let wire = decode_request(&req, selection.prefill.as_ref());
            match open(&selection, wire).instrument(dispatch.clone()).await {
                Ok(opened) => {
                    let attempt = Attempt {
                        selection,
                        opened,
                        span: dispatch,
                    };
                    return Ok(self.stream(&req, attempt, permit, request_span));
                }
                Err(e) if e.code() == Code::InvalidArgument => {
                    spans::mark_failed(&dispatch, &e);
                    return Err(e);
                }
                Err(e) => {
                    spans::mark_failed(&dispatch, &e);
                    tracing::warn!(
                        worker = %selection.decode.id,
                        error = %e,
                        "decode worker failed before the first token"
                    );
                    excluded.push(selection.decode.id.clone());
                    last_error = Some(e);
                }
            }
        }
        Err(last_error.unwrap_or(RequestError::NoDecodeWorker))
    }

    /// One selection, in a `route` span recording the decision; counts it.
    fn route(
        &self,
        req: &ValidRequest,
        excluded: &[ferry_proto::ids::WorkerId],
        policy: &'static str,
        attempt: usize,
    ) -> Result<Selection, RequestError> {
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
            .inner
            .selector
            .select(&SelectRequest {
                hashes: req.block_hashes(),
                prompt_tokens: req.prompt().len(),
                exclude: excluded,
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
        let m = &self.inner.metrics;
        m.routing
            .with_label_values(&[policy, prefill, decode])
            .inc();
        m.predicted_cached_blocks.observe(cached as f64);
        tracing::debug!(decode, prefill, cached_blocks = cached, "selected");
        Ok(selection)
    }

    fn stream(
        &self,
        req: &ValidRequest,
        attempt: Attempt,
        permit: OwnedSemaphorePermit,
        request_span: Span,
    ) -> GenerationStream {
        let Attempt {
            selection,
            opened,
            span,
        } = attempt;
        let mut output =
            OutputState::new(self.inner.tokenizer.clone(), req.stop(), req.prompt().len());
        output.set_cached_prompt_tokens(opened.first.cached_prompt_tokens);
        let drain = self.inner.drain.clone();
        let worker = selection.decode.id.clone();
        let mut guard = selection.guard;
        let Opened { first, mut rest } = opened;
        let mut accounting = Accounting {
            metrics: self.inner.metrics.clone(),
            request: request_span,
            received: req.received(),
            last_token: None,
            ended: false,
        };
        let stream = Box::pin(async_stream::stream! {
            let _permit = permit;
            guard.prefill_done();
            let mut next = Some(first);
            loop {
                let received = match next.take() {
                    Some(message) => Ok(message),
                    None => tokio::select! {
                        biased;
                        _ = drain.cancelled() => Err(RequestError::ShuttingDown),
                        r = rest.message() => match r {
                            Ok(Some(message)) => Ok(message),
                            Ok(None) => Err(RequestError::Worker {
                                worker: worker.clone(),
                                code: Code::Unavailable,
                                message: "the stream ended without a finish reason".into(),
                            }),
                            Err(status) => Err(RequestError::worker(&worker, &status)),
                        },
                    },
                };
                let event = received
                    .and_then(|m| finish_reason(&worker, m.finish_reason).map(|f| (m, f)))
                    .and_then(|(m, finish)| output.on_tokens(&m.token_ids, finish));
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
            drop(guard);
        });
        Box::pin(InSpan::new(stream, span))
    }
}

/// Calls `Decode` on the selected worker and waits for its first message.
async fn open(
    selection: &Selection,
    request: internal::DecodeRequest,
) -> Result<Opened, RequestError> {
    let worker = &selection.decode.id;
    let mut client = selection.decode.decode_client();
    let mut request = tonic::Request::new(request);
    trace_ctx::inject_request(&Span::current(), &mut request);
    let mut rest = client
        .decode(request)
        .await
        .map_err(|s| RequestError::worker(worker, &s))?
        .into_inner();
    match rest.message().await {
        Ok(Some(first)) => Ok(Opened { first, rest }),
        Ok(None) => Err(RequestError::Worker {
            worker: worker.clone(),
            code: Code::Unavailable,
            message: "the stream ended before the first token".into(),
        }),
        Err(status) => Err(RequestError::worker(worker, &status)),
    }
}

/// The internal wire form of a validated request.
fn decode_request(req: &ValidRequest, prefill: Option<&PrefillTarget>) -> internal::DecodeRequest {
    let s = req.sampling();
    internal::DecodeRequest {
        request_id: req.id().0.clone(),
        prompt_tokens: req.prompt().to_vec(),
        sampling: Some(internal::Sampling {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            seed: s.seed,
        }),
        stop: Some(internal::Stop {
            max_tokens: req.max_tokens(),
            ignore_eos: req.ignore_eos(),
            stop: req.stop().to_vec(),
        }),
        prefill_peer: prefill.map(|p| internal::PrefillPeer {
            worker_id: p.id.0.clone(),
            grpc_address: p.grpc_address.clone(),
        }),
        speculative: req.speculative(),
    }
}

fn finish_reason(
    worker: &ferry_proto::ids::WorkerId,
    raw: i32,
) -> Result<Option<FinishReason>, RequestError> {
    match v1::FinishReason::try_from(raw) {
        Ok(v1::FinishReason::Unspecified) => Ok(None),
        Ok(v1::FinishReason::Stop) => Ok(Some(FinishReason::Stop)),
        Ok(v1::FinishReason::Length) => Ok(Some(FinishReason::Length)),
        Err(_) => Err(RequestError::Worker {
            worker: worker.clone(),
            code: Code::Internal,
            message: format!("unknown finish_reason {raw}"),
        }),
    }
}
