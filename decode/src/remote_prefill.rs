//! Asking a prefill peer to fill reserved blocks, and what to do when it cannot.

use std::time::Duration;

use ferry_kvtransfer::Registration;
use ferry_model::engine::{EngineHandle, SeqId};
use ferry_model::kv::BlockId;
use ferry_proto::internal::prefill_worker_client::PrefillWorkerClient;
use ferry_proto::internal::{KvDestination, KvLayout, PrefillRequest, Sampling};
use tracing::warn;

use crate::server::FailurePolicy;

/// Everything one remote prefill needs.
pub struct RemotePrefill {
    /// The request, for logs and the peer's traces.
    pub request_id: String,
    /// The peer's gRPC address (host:port).
    pub peer: String,
    /// The prompt.
    pub prompt: Vec<u32>,
    /// Sampling parameters for the first token.
    pub sampling: Sampling,
    /// Blocks reserved here, in position order.
    pub blocks: Vec<BlockId>,
    /// Prompt positions this worker already holds.
    pub cached_tokens: usize,
    /// Where the peer writes (this worker's transfer registration) and in what layout.
    pub registration: Registration,
    /// This worker's pool layout.
    pub layout: KvLayout,
    /// How long the peer may take.
    pub timeout: Duration,
}

/// Runs the remote prefill and tells the engine how it ended: `remote_done` with the peer's
/// first token, or `remote_failed` (recompute or fail per `policy`). Always resolves the
/// reservation, so the blocks are freed even if the client is gone.
pub async fn run(job: RemotePrefill, engine: EngineHandle, id: SeqId, policy: FailurePolicy) {
    let result = tokio::time::timeout(job.timeout, call(&job)).await;
    let outcome = match result {
        Ok(r) => r,
        Err(_) => Err(format!(
            "prefill peer {} timed out after {:?}",
            job.peer, job.timeout
        )),
    };
    let sent = match outcome {
        Ok(first) => engine.remote_done(id, first),
        Err(reason) => {
            warn!(request_id = %job.request_id, peer = %job.peer, %reason, ?policy, "remote prefill failed");
            engine.remote_failed(id, policy == FailurePolicy::Recompute, reason)
        }
    };
    if sent.is_err() {
        warn!(request_id = %job.request_id, "engine stopped before the remote prefill resolved");
    }
}

async fn call(job: &RemotePrefill) -> Result<u32, String> {
    let uri = format!("http://{}", job.peer);
    let mut client = PrefillWorkerClient::connect(uri)
        .await
        .map_err(|e| format!("connecting to prefill peer {}: {e}", job.peer))?;
    let reply = client
        .prefill(PrefillRequest {
            request_id: job.request_id.clone(),
            prompt_tokens: job.prompt.clone(),
            sampling: Some(job.sampling),
            skip_tokens: u32::try_from(job.cached_tokens).map_err(|e| e.to_string())?,
            destination: Some(KvDestination {
                transfer_address: job.registration.address.clone(),
                transport: "tcp".into(),
                layout: Some(job.layout.clone()),
                block_ids: job.blocks.iter().map(|b| b.0).collect(),
                remote_key: job.registration.key.0,
            }),
        })
        .await
        .map_err(|s| format!("prefill peer {}: {}", job.peer, s.message()))?
        .into_inner();
    Ok(reply.first_token)
}
