//! The `DecodeWorker` gRPC service.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ferry_kvtransfer::{KvLayoutDesc, Registration};
use ferry_model::engine::{
    EngineError, EngineEvent, EngineHandle, FinishReason, GenerateJob, Generation, PrefillSource,
    StopParams,
};
use ferry_proto::internal::decode_worker_server::DecodeWorker;
use ferry_proto::internal::{
    DecodeRequest, DecodeResponse, GetStatsRequest, KvLayout, WorkerStats,
};
use ferry_proto::v1::FinishReason as WireFinish;
use ferry_worker::args::{sampling, validate_prompt};
use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::{debug, info_span, Instrument};

use crate::remote_prefill::{self, RemotePrefill};
use crate::server::FailurePolicy;

/// Decode-side settings the service applies per request.
#[derive(Debug, Clone)]
pub struct DecodePolicy {
    /// Uncached prompt tokens at or below which the prompt is prefilled here.
    pub local_prefill_threshold: usize,
    /// What a failed remote prefill leads to.
    pub on_failure: FailurePolicy,
    /// How long a prefill peer may take.
    pub prefill_timeout: Duration,
}

/// The service state.
#[derive(Clone)]
pub struct DecodeService {
    worker_id: String,
    engine: EngineHandle,
    registration: Registration,
    layout: KvLayoutDesc,
    policy: Arc<DecodePolicy>,
}

impl DecodeService {
    /// A service over `engine`, whose pool peers reach through `registration`.
    pub fn new(
        worker_id: String,
        engine: EngineHandle,
        registration: Registration,
        layout: KvLayoutDesc,
        policy: DecodePolicy,
    ) -> Self {
        Self {
            worker_id,
            engine,
            registration,
            layout,
            policy: Arc::new(policy),
        }
    }

    /// The engine this service drives.
    pub fn engine_handle(&self) -> EngineHandle {
        self.engine.clone()
    }
}

type DecodeStream = Pin<Box<dyn Stream<Item = Result<DecodeResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DecodeWorker for DecodeService {
    type DecodeStream = DecodeStream;

    async fn decode(
        &self,
        request: Request<DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        let r = request.into_inner();
        let stop = r
            .stop
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("`stop` is required"))?;
        if stop.max_tokens == 0 {
            return Err(Status::invalid_argument(
                "`stop.max_tokens` must be >= 1, got 0",
            ));
        }
        let max_tokens = stop.max_tokens as usize;
        validate_prompt(self.engine.model_config(), &r.prompt_tokens, max_tokens)?;
        let params = sampling(r.sampling.as_ref())?;
        let peer = r
            .prefill_peer
            .as_ref()
            .filter(|p| !p.grpc_address.is_empty())
            .map(|p| p.grpc_address.clone());
        let prefill = match peer {
            Some(_) => PrefillSource::Remote {
                local_threshold: self.policy.local_prefill_threshold,
            },
            None => PrefillSource::Local,
        };
        let generation = self
            .engine
            .generate(GenerateJob {
                prompt: r.prompt_tokens.clone(),
                sampling: params,
                stop: StopParams {
                    max_tokens,
                    ignore_eos: stop.ignore_eos,
                },
                prefill,
            })
            .map_err(engine_status)?;
        let (tx, rx) = mpsc::channel(64);
        let ctx = Drive {
            engine: self.engine.clone(),
            request: r,
            peer,
            registration: self.registration.clone(),
            layout: self.layout,
            policy: self.policy.clone(),
        };
        let span = info_span!("decode", request_id = %ctx.request.request_id);
        tokio::spawn(drive(ctx, generation, tx).instrument(span));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_stats(
        &self,
        _request: Request<GetStatsRequest>,
    ) -> Result<Response<WorkerStats>, Status> {
        let s = self.engine.stats().await.map_err(engine_status)?;
        Ok(Response::new(ferry_worker::stats::worker_stats(
            &self.worker_id,
            &s,
            s.kv_bytes_received,
        )))
    }
}

struct Drive {
    engine: EngineHandle,
    request: DecodeRequest,
    peer: Option<String>,
    registration: Registration,
    layout: KvLayoutDesc,
    policy: Arc<DecodePolicy>,
}

/// Forwards engine events to the client; starts the remote prefill when blocks are reserved.
/// Returning drops the generation, which cancels the request in the engine.
async fn drive(
    ctx: Drive,
    mut generation: Generation,
    tx: mpsc::Sender<Result<DecodeResponse, Status>>,
) {
    let mut cached = 0u32;
    let mut mode = "local";
    let mut first = true;
    loop {
        let event = tokio::select! {
            _ = tx.closed() => {
                debug!("client went away; cancelling");
                return;
            }
            e = generation.events.recv() => e,
        };
        let msg = match event {
            None => Err(Status::internal(
                "the engine ended the request without a reason",
            )),
            Some(EngineEvent::Reserved {
                blocks,
                cached_tokens,
            }) => {
                cached = u32::try_from(cached_tokens).unwrap_or(u32::MAX);
                mode = "remote";
                let job = RemotePrefill {
                    request_id: ctx.request.request_id.clone(),
                    peer: ctx.peer.clone().unwrap_or_default(),
                    prompt: ctx.request.prompt_tokens.clone(),
                    sampling: ctx.request.sampling.unwrap_or_default(),
                    blocks,
                    cached_tokens,
                    registration: ctx.registration.clone(),
                    layout: KvLayout::from(ctx.layout),
                    timeout: ctx.policy.prefill_timeout,
                };
                tokio::spawn(
                    remote_prefill::run(
                        job,
                        ctx.engine.clone(),
                        generation.id,
                        ctx.policy.on_failure,
                    )
                    .in_current_span(),
                );
                continue;
            }
            Some(EngineEvent::LocalPrefill { cached_tokens }) => {
                cached = u32::try_from(cached_tokens).unwrap_or(u32::MAX);
                continue;
            }
            Some(EngineEvent::Token(t)) => Ok(DecodeResponse {
                token_ids: vec![t],
                ..Default::default()
            }),
            Some(EngineEvent::Finished(r)) => Ok(DecodeResponse {
                finish_reason: match r {
                    FinishReason::Stop => WireFinish::Stop,
                    FinishReason::Length => WireFinish::Length,
                } as i32,
                ..Default::default()
            }),
            Some(EngineEvent::Failed(e)) => Err(Status::internal(e)),
        };
        let done = !matches!(&msg, Ok(m) if m.finish_reason == WireFinish::Unspecified as i32);
        let msg = msg.map(|mut m| {
            if first {
                m.cached_prompt_tokens = cached;
                m.prefill_mode = mode.into();
                first = false;
            }
            m
        });
        if tx.send(msg).await.is_err() || done {
            return;
        }
    }
}

/// Engine errors → gRPC status.
pub fn engine_status(e: EngineError) -> Status {
    match e {
        EngineError::Overloaded { .. } => Status::resource_exhausted(e.to_string()),
        EngineError::Stopped => Status::unavailable(e.to_string()),
        EngineError::Job(m) => Status::internal(m),
    }
}
