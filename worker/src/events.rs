//! The events agent: the registration agent's counterpart when the worker is on the events
//! plane (`--events nats://…`) instead of registering with one router, so that every router
//! sees it (docs/deploy.md, "Several routers").
//!
//! ```text
//! session: snapshot (parts) ──► KV stream ──► every router's index
//!   every period: drained KV events ──► KV stream (acked, in order)
//!                 WorkerHeartbeat (identity + load) ──► ferry.hb.<role>.<id> ──► every router's registry
//!   on ferry.ctl.snapshot.<id> (a router saw a gap or lost us): a fresh snapshot
//!   decode workers: prefill workers' heartbeats ──► PrefillView (who is alive)
//! ```
//! A KV publish that fails (server gone, stream lost) ends the session: the next one starts
//! with a snapshot, which covers the events that did not make it. The worker's block ownership
//! is the truth; the routers' indexes are advisory, as on the direct path.
use std::collections::HashMap;
use std::time::{Duration, Instant};

use ferry_events::{subject, Connection, EventsError, StreamLimits};
use ferry_model::engine::EngineHandle;
use ferry_proto::internal::{
    kv_feed_message, KvEventBatch, KvFeedMessage, KvSnapshotPart, RegisterRequest, WorkerHeartbeat,
    WorkerRole,
};
use futures::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::registration::{run_sessions, to_wire, EngineTick, PrefillView};

/// Hashes per snapshot part: 8 bytes each, so a part stays far below NATS's default 1 MiB
/// payload limit.
pub const SNAPSHOT_PART_HASHES: usize = 32 * 1024;

/// How the agent publishes.
#[derive(Debug, Clone)]
pub struct EventsAgentConfig {
    /// The events plane.
    pub connection: Connection,
    /// This worker's id.
    pub worker_id: String,
    /// Prefill or decode.
    pub role: WorkerRole,
    /// Where routers and peers reach this worker's gRPC service (host:port).
    pub advertise: String,
    /// Heartbeat and event-publishing period.
    pub heartbeat: Duration,
    /// Where to publish the live prefill workers, if this worker wants them (decode workers):
    /// those heard within [`EventsAgentConfig::peer_timeout`].
    pub prefill_view: Option<watch::Sender<PrefillView>>,
    /// A prefill worker silent for longer is not live.
    pub peer_timeout: Duration,
    /// KV transfer transports this worker speaks.
    pub transports: Vec<String>,
}

/// Starts the agent; it runs until `shutdown`.
pub fn spawn(
    config: EventsAgentConfig,
    engine: EngineHandle,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    let instance = rand::random::<u64>();
    tokio::spawn(async move {
        run_sessions(
            &shutdown,
            || session(&config, instance, &engine, &shutdown),
            |e| warn!(worker = %config.worker_id, error = %e, "events session ended; starting again with a snapshot"),
        )
        .await;
    })
}

fn role_name(role: WorkerRole) -> &'static str {
    match role {
        WorkerRole::Prefill => "prefill",
        _ => "decode",
    }
}

/// Publishes the worker's whole cache in parts.
async fn publish_snapshot(
    config: &EventsAgentConfig,
    instance: u64,
    engine: &EngineHandle,
) -> Result<(), String> {
    let (hashes, last_event) = engine.kv_snapshot().await.map_err(|e| e.to_string())?;
    let snapshot_id = rand::random::<u64>();
    let hashes: Vec<u64> = hashes.iter().map(|h| h.0).collect();
    let chunks: Vec<&[u64]> = if hashes.is_empty() {
        vec![&[]]
    } else {
        hashes.chunks(SNAPSHOT_PART_HASHES).collect()
    };
    let parts = u32::try_from(chunks.len()).map_err(|e| e.to_string())?;
    for (part, chunk) in chunks.into_iter().enumerate() {
        let message = KvFeedMessage {
            message: Some(kv_feed_message::Message::Snapshot(KvSnapshotPart {
                worker_id: config.worker_id.clone(),
                instance_id: instance,
                snapshot_id,
                part: u32::try_from(part).map_err(|e| e.to_string())?,
                parts,
                last_event_id: last_event.0,
                block_hashes: chunk.to_vec(),
            })),
        };
        config
            .connection
            .publish_kv(&config.worker_id, &message)
            .await
            .map_err(|e| e.to_string())?;
    }
    debug!(worker = %config.worker_id, blocks = hashes.len(), parts, "KV snapshot published");
    Ok(())
}

/// One stream session: a snapshot, then events and heartbeats; Err when the KV stream refused
/// a publish (the next session starts over with a snapshot), Ok on shutdown.
async fn session(
    config: &EventsAgentConfig,
    instance: u64,
    engine: &EngineHandle,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    let conn = &config.connection;
    let mut connected = conn.connected();
    // Wait for the server rather than fail a publish against it.
    tokio::select! {
        _ = shutdown.cancelled() => return Ok(()),
        r = connected.wait_for(|c| *c) => { r.map_err(|e| e.to_string())?; }
    }
    conn.kv_stream(StreamLimits::default())
        .await
        .map_err(|e| e.to_string())?;
    let mut snapshot_requests = conn
        .subscribe(subject::snapshot_request(&config.worker_id))
        .await
        .map_err(|e| e.to_string())?;
    let mut peers = match &config.prefill_view {
        Some(_) => Some(
            conn.subscribe(subject::heartbeats_of("prefill"))
                .await
                .map_err(|e| e.to_string())?,
        ),
        None => None,
    };
    let mut last_heard: HashMap<String, Instant> = HashMap::new();
    // Peers heartbeat at their own period: judge none before having listened a while.
    let listening_since = Instant::now();
    publish_snapshot(config, instance, engine).await?;
    info!(worker = %config.worker_id, events = %conn.url(), "on the events plane");

    let layout = engine.kv_layout();
    let identity = RegisterRequest {
        worker_id: config.worker_id.clone(),
        role: config.role as i32,
        grpc_address: config.advertise.clone(),
        page_size: u32::try_from(layout.page_size).unwrap_or(u32::MAX),
        total_blocks: u32::try_from(layout.num_blocks).unwrap_or(u32::MAX),
        cached_block_hashes: Vec::new(),
        last_event_id: 0,
        instance_id: instance,
        transports: config.transports.clone(),
    };
    let hb_subject = subject::heartbeat(role_name(config.role), &config.worker_id);
    let mut tick = tokio::time::interval(config.heartbeat);
    let mut sample = EngineTick::new(config.heartbeat);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            request = snapshot_requests.next() => {
                if request.is_none() {
                    return Err("snapshot request subscription closed".into());
                }
                publish_snapshot(config, instance, engine).await?;
                continue;
            }
            heard = next_or_pending(&mut peers) => {
                if let Some(id) = heard {
                    last_heard.insert(id, Instant::now());
                }
                continue;
            }
            _ = tick.tick() => {}
        }
        let events = sample.events(engine).await?;
        if !events.is_empty() {
            let message = KvFeedMessage {
                message: Some(kv_feed_message::Message::Events(KvEventBatch {
                    worker_id: config.worker_id.clone(),
                    events: events.into_iter().map(to_wire).collect(),
                    instance_id: instance,
                })),
            };
            conn.publish_kv(&config.worker_id, &message)
                .await
                .map_err(|e: EventsError| e.to_string())?;
        }
        let stats = sample.stats(engine).await?;
        let heartbeat = WorkerHeartbeat {
            registration: Some(identity.clone()),
            load: Some(crate::stats::load(&stats)),
        };
        // Core NATS buffers while disconnected; a failure here is the client closing.
        conn.publish(hb_subject.clone(), &heartbeat)
            .await
            .map_err(|e| e.to_string())?;
        if let Some(tx) = &config.prefill_view {
            // Judge liveness only while connected: a silent server is not a dead peer.
            let now = Instant::now();
            if *connected.borrow() && now.duration_since(listening_since) >= config.peer_timeout / 3
            {
                last_heard.retain(|_, at| now.duration_since(*at) <= config.peer_timeout);
                let mut live: Vec<String> = last_heard.keys().cloned().collect();
                live.sort();
                tx.send_modify(|v| {
                    v.answers += 1;
                    v.live = live.into();
                });
            }
        }
    }
}

/// The worker id of the next prefill heartbeat heard (by its subject), or never when this
/// worker does not listen to them.
async fn next_or_pending(peers: &mut Option<ferry_events::Subscriber>) -> Option<String> {
    match peers {
        Some(sub) => {
            let Some(message) = sub.next().await else {
                // The client closed: stop listening rather than spin on a finished stream.
                *peers = None;
                return None;
            };
            let id = message
                .subject
                .as_str()
                .rsplit('.')
                .next()
                .and_then(subject::id_of);
            if id.is_none() {
                debug!(subject = %message.subject, "heartbeat on a malformed subject");
            }
            id
        }
        None => std::future::pending().await,
    }
}
