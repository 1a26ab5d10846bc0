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
use std::pin::Pin;
use std::sync::Arc;

use ferry_model::tokenizer::Tokenizer;
use ferry_proto::internal::{self, decode_worker_client::DecodeWorkerClient};
use ferry_proto::v1;
use futures::Stream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Streaming};

use crate::error::RequestError;
use crate::output::{FinishReason, GenerationEvent, OutputState};
use crate::select::{PrefillTarget, SelectRequest, Selection, Selector};
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
}

#[derive(Debug)]
struct Inner {
    selector: Selector,
    tokenizer: Arc<Tokenizer>,
    limiter: Arc<Semaphore>,
    limit: usize,
    drain: CancellationToken,
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
    pub async fn generate(&self, req: ValidRequest) -> Result<GenerationStream, RequestError> {
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
        for _ in 0..MAX_ATTEMPTS {
            let selection = match self.inner.selector.select(&SelectRequest {
                hashes: req.block_hashes(),
                prompt_tokens: req.prompt().len(),
                exclude: &excluded,
            }) {
                Ok(s) => s,
                Err(e) => return Err(last_error.unwrap_or(e)),
            };
            tracing::debug!(
                decode = %selection.decode.id,
                prefill = ?selection.prefill.as_ref().map(|p| &p.id),
                cached_blocks = selection.decision.predicted_cached_blocks,
                "selected"
            );
            let wire = decode_request(&req, selection.prefill.as_ref());
            match open(&selection, wire).await {
                Ok(opened) => return Ok(self.stream(&req, selection, opened, permit)),
                Err(e) if e.code() == Code::InvalidArgument => return Err(e),
                Err(e) => {
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

    fn stream(
        &self,
        req: &ValidRequest,
        selection: Selection,
        opened: Opened,
        permit: OwnedSemaphorePermit,
    ) -> GenerationStream {
        let mut output =
            OutputState::new(self.inner.tokenizer.clone(), req.stop(), req.prompt().len());
        output.set_cached_prompt_tokens(opened.first.cached_prompt_tokens);
        let drain = self.inner.drain.clone();
        let worker = selection.decode.id.clone();
        let mut guard = selection.guard;
        let Opened { first, mut rest } = opened;
        Box::pin(async_stream::stream! {
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
                        let done = event.finish.is_some();
                        yield Ok(event);
                        if done {
                            break;
                        }
                    }
                    Err(e) => {
                        yield Err(e);
                        break;
                    }
                }
            }
            drop(guard);
        })
    }
}

/// Calls `Decode` on the selected worker and waits for its first message.
async fn open(
    selection: &Selection,
    request: internal::DecodeRequest,
) -> Result<Opened, RequestError> {
    let worker = &selection.decode.id;
    let mut client = DecodeWorkerClient::new(selection.decode.channel.clone());
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
