//! The registration agent: keeps the router's view of this worker current.
//!
//! Register with a full snapshot of cached block hashes → every `heartbeat` send load and the
//! KV events since the last tick. The router answers `known = false` (it dropped us) or
//! `in_sync = false` (it saw a gap in event ids); both lead to a fresh registration with a
//! snapshot, which also covers any events lost on the way. The worker's block ownership is the
//! truth; the router's index is advisory.
//!
//! Routers that know it answer each heartbeat with the prefill workers they route to; the agent
//! publishes that list on a [`watch`] channel ([`PrefillView`]) when the worker asked for it
//! (decode workers: a remote prefill whose peer the router dropped is given up at once).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use ferry_model::engine::{EngineHandle, EngineStats};
use ferry_model::kv::KvEventData;
use ferry_proto::auth::{AttachToken, ClusterToken};
use ferry_proto::internal::registry_client::RegistryClient;
use ferry_proto::internal::{
    kv_event, BlocksRemoved, BlocksStored, HeartbeatRequest, KvEvent, KvEventBatch,
    RegisterRequest, WorkerRole,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tracing::{debug, info, warn};

/// Who this worker is and where the router is.
#[derive(Debug, Clone)]
pub struct RegistrationConfig {
    /// The router's gRPC endpoint, e.g. `http://127.0.0.1:50051`.
    pub router: String,
    /// This worker's id.
    pub worker_id: String,
    /// Prefill or decode.
    pub role: WorkerRole,
    /// Where the router reaches this worker's gRPC service (host:port).
    pub advertise: String,
    /// Heartbeat and event-publishing period.
    pub heartbeat: Duration,
    /// Sent on every Registry call.
    pub token: Option<ClusterToken>,
    /// Where to publish the router's list of live prefill workers, if this worker wants it.
    pub prefill_view: Option<watch::Sender<PrefillView>>,
    /// KV transfer transports this worker speaks (`RegisterRequest.transports`).
    pub transports: Vec<String>,
}

/// The prefill workers the router routes to, as its heartbeat answers said.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefillView {
    /// Heartbeat answers that carried the list, since this worker started (0: none yet, e.g.
    /// an older router). A waiter compares it with the count at its own start, so it judges
    /// only by answers the router computed after the request was routed.
    pub answers: u64,
    /// Their ids, in the latest answer.
    pub live: Arc<[String]>,
}

impl PrefillView {
    /// Whether `id` was in the latest answer.
    pub fn is_live(&self, id: &str) -> bool {
        self.live.iter().any(|l| l == id)
    }
}

/// Starts the agent; it runs until `shutdown`.
pub fn spawn(
    config: RegistrationConfig,
    engine: EngineHandle,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    // Random per process start: the router tells this process apart from an earlier (or a
    // forged) registration of the same id.
    let instance = rand::random::<u64>();
    tokio::spawn(async move {
        run_sessions(
            &shutdown,
            || session(&config, instance, &engine, &shutdown),
            |e| debug!(error = %e, "router session ended; registering again"),
        )
        .await;
    })
}

/// Runs `session` again and again until it returns Ok or `shutdown`, waiting 50 ms doubling to
/// 2 s between attempts; `ended` is told why each one ended. Both agents (direct registration
/// and the events plane) recover this way: every new session starts with a full snapshot.
pub(crate) async fn run_sessions<F, Fut>(
    shutdown: &CancellationToken,
    mut session: F,
    ended: impl Fn(&str),
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let mut backoff = Duration::from_millis(50);
    loop {
        let result = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = session() => r,
        };
        match result {
            Ok(()) => return,
            Err(e) => {
                ended(&e);
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// What a heartbeat tick asks the engine for, without waiting on it for long: the engine
/// answers between forwards, and one forward can take longer than the router's heartbeat
/// timeout (a long prefill on a large model). A drain still unanswered stays pending to the
/// next tick (dropping it would lose the events it drained), and the load sent is the last
/// one the engine reported.
pub(crate) struct EngineTick {
    drain: Option<std::pin::Pin<Box<dyn Future<Output = DrainResult> + Send>>>,
    last_stats: Option<EngineStats>,
    wait: Duration,
}

impl EngineTick {
    /// For a heartbeat `period`: each call waits at most half of it.
    pub(crate) fn new(period: Duration) -> Self {
        Self {
            drain: None,
            last_stats: None,
            wait: (period / 2).max(Duration::from_millis(5)),
        }
    }

    /// The KV events drained since the last call (none yet if the engine is busy).
    pub(crate) async fn events(
        &mut self,
        engine: &EngineHandle,
    ) -> Result<Vec<ferry_model::kv::KvEvent>, String> {
        let pending = self.drain.get_or_insert_with(|| {
            let engine = engine.clone();
            Box::pin(async move { engine.drain_kv_events().await })
        });
        match tokio::time::timeout(self.wait, pending.as_mut()).await {
            Ok(events) => {
                self.drain = None;
                events.map_err(|e| e.to_string())
            }
            Err(_) => Ok(Vec::new()),
        }
    }

    /// The engine's stats now, or the last ones it reported if it is busy.
    pub(crate) async fn stats(&mut self, engine: &EngineHandle) -> Result<EngineStats, String> {
        match tokio::time::timeout(self.wait, engine.stats()).await {
            Ok(stats) => {
                let stats = stats.map_err(|e| e.to_string())?;
                self.last_stats = Some(stats.clone());
                Ok(stats)
            }
            Err(_) => {
                debug!("engine busy: heartbeat with its last load");
                Ok(self.last_stats.clone().unwrap_or_default())
            }
        }
    }
}

/// One registration and the heartbeats after it; returns Err when the router needs a fresh
/// registration (or is unreachable), Ok on shutdown.
async fn session(
    config: &RegistrationConfig,
    instance: u64,
    engine: &EngineHandle,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    let channel = Channel::from_shared(config.router.clone())
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("connecting to the router at {}: {e}", config.router))?;
    let mut client =
        RegistryClient::with_interceptor(channel, AttachToken::new(config.token.clone()));
    let (hashes, last_event) = engine.kv_snapshot().await.map_err(|e| e.to_string())?;
    let layout = engine.kv_layout();
    let reply = client
        .register(RegisterRequest {
            worker_id: config.worker_id.clone(),
            role: config.role as i32,
            grpc_address: config.advertise.clone(),
            page_size: u32::try_from(layout.page_size).unwrap_or(u32::MAX),
            total_blocks: u32::try_from(layout.num_blocks).unwrap_or(u32::MAX),
            cached_block_hashes: hashes.iter().map(|h| h.0).collect(),
            last_event_id: last_event.0,
            instance_id: instance,
            transports: config.transports.clone(),
        })
        .await
        .map_err(|e| {
            // A refusal (wrong token, id claimed by a live worker elsewhere, bad field) is an
            // operator's problem: say so each time, not only at debug level.
            if e.code() != tonic::Code::Unavailable {
                warn!(worker = %config.worker_id, router = %config.router, error = %e.message(), "registration refused");
            }
            e.to_string()
        })?
        .into_inner();
    info!(worker = %config.worker_id, router = %config.router, "registered");
    let period = if reply.heartbeat_interval_ms > 0 {
        Duration::from_millis(u64::from(reply.heartbeat_interval_ms)).min(config.heartbeat)
    } else {
        config.heartbeat
    };
    let mut tick = tokio::time::interval(period);
    let mut sample = EngineTick::new(period);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        let events = sample.events(engine).await?;
        if !events.is_empty() {
            let batch = KvEventBatch {
                worker_id: config.worker_id.clone(),
                events: events.into_iter().map(to_wire).collect(),
                instance_id: instance,
            };
            let ack = client
                .publish_kv_events(batch)
                .await
                .map_err(|e| e.to_string())?
                .into_inner();
            if !ack.in_sync {
                warn!(worker = %config.worker_id, "router lost KV event sync; re-registering");
                return Err("out of sync".into());
            }
        }
        let stats = sample.stats(engine).await?;
        let hb = client
            .heartbeat(HeartbeatRequest {
                worker_id: config.worker_id.clone(),
                load: Some(crate::stats::load(&stats)),
                instance_id: instance,
            })
            .await
            .map_err(|e| e.to_string())?
            .into_inner();
        if let (Some(tx), Some(live)) = (&config.prefill_view, hb.live_prefill_workers) {
            tx.send_modify(|v| {
                v.answers += 1;
                v.live = live.worker_ids.into();
            });
        }
        if !hb.known {
            return Err("the router does not know this worker".into());
        }
    }
}

/// What an engine's KV event drain resolves to.
type DrainResult = Result<Vec<ferry_model::kv::KvEvent>, ferry_model::engine::EngineError>;

pub(crate) fn to_wire(e: ferry_model::kv::KvEvent) -> KvEvent {
    let data = match e.data {
        KvEventData::Stored { hashes, parent } => kv_event::Data::Stored(BlocksStored {
            block_hashes: hashes.iter().map(|h| h.0).collect(),
            parent_hash: parent.map(|h| h.0),
        }),
        KvEventData::Removed { hashes } => kv_event::Data::Removed(BlocksRemoved {
            block_hashes: hashes.iter().map(|h| h.0).collect(),
        }),
    };
    KvEvent {
        event_id: e.id.0,
        data: Some(data),
    }
}
