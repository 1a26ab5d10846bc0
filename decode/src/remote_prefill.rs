//! Asking a prefill peer to fill reserved blocks, and what to do when it cannot.
//!
//! The call ends in one of four ways: the peer answers (commit), the call fails, the prefill
//! timeout passes, or the router reports the peer gone (its heartbeat answers stop listing the
//! peer's id, [`PrefillView`]); the last three apply the `recompute` / `fail` policy. The
//! last one is what makes a stalled peer (SIGSTOP, a hung host) cost about one router
//! heartbeat timeout instead of `--prefill-timeout-s`.
//!
//! In the last two the peer may still be writing: this side stops waiting, but the call goes
//! on, and the blocks reserved for the peer stay quarantined in the engine (a recompute gets
//! fresh ones) until it ends — a one-sided UCX put cannot be refused on arrival. A call that
//! never ends is given up after [`SETTLE_LIMIT_FACTOR`] × the prefill timeout, with a warning.

use std::time::{Duration, Instant};

use ferry_kvtransfer::Registration;
use ferry_model::engine::{EngineHandle, RemoteFirst, SeqId};
use ferry_model::kv::BlockId;
use ferry_proto::auth::AttachToken;
use ferry_proto::internal::prefill_worker_client::PrefillWorkerClient;
use ferry_proto::internal::{KvDestination, KvLayout, PrefillRequest, Sampling, Stop};
use ferry_proto::trace_ctx;
use ferry_worker::args::{logprobs_from_wire, prompt_logprobs_from_wire};
use ferry_worker::registration::PrefillView;
use tokio::sync::watch;
use tonic::transport::Channel;
use tracing::{info_span, warn, Instrument, Span};

use crate::metrics::DecodeMetrics;
use crate::server::FailurePolicy;

/// An abandoned call is awaited at most this many prefill timeouts before its quarantined
/// blocks are released anyway.
pub const SETTLE_LIMIT_FACTOR: u32 = 10;

/// How waiting for the peer ended.
enum Waited {
    /// The call ended: the peer answered, or failed (either way it writes no more).
    Ended(Result<Prefilled, String>),
    /// This side stopped waiting; the call goes on.
    Abandoned(String),
}

/// Everything one remote prefill needs.
pub struct RemotePrefill {
    /// The request, for logs and the peer's traces.
    pub request_id: String,
    /// The peer's gRPC address (host:port).
    pub peer: String,
    /// The peer's worker id as the router named it (empty: unknown, never reported gone).
    pub peer_id: String,
    /// The router's live prefill workers, updated each heartbeat.
    pub view: watch::Receiver<PrefillView>,
    /// The prompt.
    pub prompt: Vec<u32>,
    /// Sampling parameters for the first token.
    pub sampling: Sampling,
    /// The request's stop conditions (`min_tokens` masks the first token's stop tokens).
    pub stop: Option<Stop>,
    /// Alternatives per token, when the request asked for log-probabilities.
    pub logprobs: Option<u32>,
    /// Alternatives per prompt token, when the request asked for the prompt's
    /// log-probabilities (the peer then computes the whole prompt).
    pub prompt_logprobs: Option<u32>,
    /// The model's vocabulary size (the peer's answer is checked against it).
    pub vocab: usize,
    /// Structured output: the peer constrains the first token to it too.
    pub response_format: Option<ferry_proto::v1::ResponseFormat>,
    /// Blocks reserved here, in position order.
    pub blocks: Vec<BlockId>,
    /// Prompt positions this worker already holds.
    pub cached_tokens: usize,
    /// Where the peer writes (this worker's transfer registration) and in what layout.
    pub registration: Registration,
    /// This worker's pool layout.
    pub layout: KvLayout,
    /// The reservation's fence (the awaiting sequence's id; see `EngineRegion::admit`).
    pub fence: ferry_kvtransfer::Fence,
    /// How long the peer may take.
    pub timeout: Duration,
    /// Signs the call with the cluster token.
    pub auth: AttachToken,
    /// Where the call's duration and failures are counted.
    pub metrics: DecodeMetrics,
}

/// Runs the remote prefill and tells the engine how it ended: `remote_done` with the peer's
/// first token, or `remote_failed` (recompute or fail per `policy`). Always resolves the
/// reservation, so the blocks are freed even if the client is gone.
///
/// Runs in a `remote_prefill` client span (a child of the current one) whose context travels
/// to the peer in the request metadata.
pub async fn run(job: RemotePrefill, engine: EngineHandle, id: SeqId, policy: FailurePolicy) {
    let span = info_span!(
        "remote_prefill",
        otel.kind = "client",
        peer = %job.peer,
        skip_tokens = i64::try_from(job.cached_tokens).unwrap_or(i64::MAX),
    );
    trace_ctx::set_attribute(&span, "rpc.system", "grpc");
    trace_ctx::set_attribute(&span, "rpc.service", "ferry.internal.v1.PrefillWorker");
    trace_ctx::set_attribute(&span, "rpc.method", "Prefill");
    let started = Instant::now();
    let mut pending = std::pin::pin!(call(&job).instrument(span.clone()));
    let waited = tokio::select! {
        result = &mut pending => Waited::Ended(result),
        () = tokio::time::sleep(job.timeout) => Waited::Abandoned(format!(
            "prefill peer {} timed out after {:?}",
            job.peer, job.timeout
        )),
        reason = peer_gone(job.view.clone(), &job.peer_id) => Waited::Abandoned(reason),
    };
    let reason = match &waited {
        Waited::Ended(Ok(_)) => {
            job.metrics
                .remote_prefill
                .observe(started.elapsed().as_secs_f64());
            None
        }
        Waited::Ended(Err(r)) | Waited::Abandoned(r) => {
            job.metrics.remote_prefill_failures.inc();
            trace_ctx::set_error(&span, r.clone());
            warn!(request_id = %job.request_id, peer = %job.peer, reason = %r, ?policy, "remote prefill failed");
            Some(r.clone())
        }
    };
    let recompute = policy == FailurePolicy::Recompute;
    let sent = match waited {
        Waited::Ended(Ok((first, bytes))) => engine.remote_done_with(id, first, bytes),
        Waited::Ended(Err(_)) => engine.remote_failed(id, recompute, reason.unwrap_or_default()),
        Waited::Abandoned(_) => {
            let sent = engine.remote_abandoned(id, recompute, reason.unwrap_or_default());
            // The peer may still be writing into the quarantined blocks: wait for its call to
            // end (its writer has flushed or aborted by then), bounded.
            let limit = job.timeout * SETTLE_LIMIT_FACTOR;
            if tokio::time::timeout(limit, &mut pending).await.is_err() {
                warn!(
                    request_id = %job.request_id,
                    peer = %job.peer,
                    "an abandoned prefill peer did not answer within {limit:?}; releasing its quarantined blocks"
                );
            }
            sent.and_then(|()| engine.remote_settled(id))
        }
    };
    if sent.is_err() {
        warn!(request_id = %job.request_id, "engine stopped before the remote prefill resolved");
    }
}

/// Resolves once the router's heartbeat answers say `peer_id` is gone: it is missing from an
/// answer at least the second one after this call began (the first may have been computed
/// before the router routed this request). Never resolves for an unnamed peer, or while no
/// answers come (an older router, or the router itself is down).
async fn peer_gone(mut view: watch::Receiver<PrefillView>, peer_id: &str) -> String {
    let start = view.borrow_and_update().answers;
    if !peer_id.is_empty() {
        while view.changed().await.is_ok() {
            let v = view.borrow_and_update();
            if v.answers >= start + 2 && !v.is_live(peer_id) {
                return format!("the router dropped prefill peer {peer_id}");
            }
        }
    }
    std::future::pending().await
}

/// The first token with its and the prompt's log-probabilities (when the request asked), and
/// the bytes written.
type Prefilled = (RemoteFirst, u64);

async fn call(job: &RemotePrefill) -> Result<Prefilled, String> {
    let channel = Channel::from_shared(format!("http://{}", job.peer))
        .map_err(|e| format!("prefill peer address {:?}: {e}", job.peer))?
        .connect()
        .await
        .map_err(|e| format!("connecting to prefill peer {}: {e}", job.peer))?;
    let mut client = PrefillWorkerClient::with_interceptor(channel, job.auth.clone());
    let mut request = tonic::Request::new(PrefillRequest {
        request_id: job.request_id.clone(),
        prompt_tokens: job.prompt.clone(),
        sampling: Some(job.sampling.clone()),
        stop: job.stop.clone(),
        logprobs: job.logprobs,
        prompt_logprobs: job.prompt_logprobs,
        response_format: job.response_format.clone(),
        skip_tokens: u32::try_from(job.cached_tokens).map_err(|e| e.to_string())?,
        destination: Some(KvDestination {
            transfer_address: job.registration.address.clone(),
            transport: job.registration.transport.into(),
            layout: Some(job.layout.clone()),
            block_ids: job.blocks.iter().map(|b| b.0).collect(),
            remote_key: job.registration.key.0,
            fence: job.fence.0,
        }),
    });
    trace_ctx::inject_request(&Span::current(), &mut request);
    let reply = client
        .prefill(request)
        .await
        .map_err(|s| format!("prefill peer {}: {}", job.peer, s.message()))?
        .into_inner();
    // A request that asked for log-probabilities needs them for every token, the first too.
    let logprobs = match (job.logprobs, reply.first_logprobs.as_ref()) {
        (None, _) => None,
        (Some(_), Some(lp)) => Some(logprobs_from_wire(lp)),
        (Some(_), None) => {
            return Err(format!(
                "prefill peer {} returned no log-probabilities for the first token",
                job.peer
            ))
        }
    };
    // Checked like every peer answer: one entry per prompt token after the first, each for
    // that token; a request that did not ask gets none.
    let prompt_logprobs = match job.prompt_logprobs {
        None => Vec::new(),
        Some(top) => {
            prompt_logprobs_from_wire(&reply.prompt_logprobs, &job.prompt, top as usize, job.vocab)
                .map_err(|e| format!("prefill peer {}: {e}", job.peer))?
        }
    };
    let first = RemoteFirst {
        token: reply.first_token,
        logprobs,
        prompt_logprobs,
    };
    Ok((first, reply.bytes_transferred))
}
