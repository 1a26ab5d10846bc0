//! The router's side of the events plane (`--events nats://…`): every worker there, an exact
//! prefix index rebuilt from the KV stream, and the other routers' predictive load.
//!
//! ```text
//!  ferry.hb.*.*   WorkerHeartbeat ──► Registry::join (new worker/instance → make sure the
//!                                     index has its cache) ; load
//!  FERRY_KV       KvFeedMessage   ──► snapshot parts → PrefixIndex::replace
//!  (ordered consumer, from the      events          → PrefixIndex::apply (gap → ask)
//!   stream's start)
//!  ferry.load.*   RouterLoad      ──► Registry::set_remote_load (added to own pending load)
//!  own PendingLoad changes        ──► RouterLoad on ferry.load.<this router>
//!  connection lost                ──► Registry::set_events_up(false): route by load only,
//!                                     keep the workers heard so far; back → trust again
//! ```
//!
//! One task owns all of it (no locks): the per-worker feed state, the replay position and
//! which snapshots are owed. A router that starts late replays the stream from its start and
//! asks a worker for a snapshot only where the replay did not leave it in sync (the stream was
//! trimmed, or showed a gap); one that was in step asks for none.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{pull, DeliverPolicy};
use ferry_events::{subject, Connection, EventsError, StreamLimits, Subscriber};
use ferry_proto::ids::{BlockHash, EventId, WorkerId};
use ferry_proto::internal::{
    kv_feed_message, KvFeedMessage, KvSnapshotPart, PendingLoadEntry, RouterLoad, WorkerHeartbeat,
};
use futures::{Stream, StreamExt};
use prost::Message as _;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::index::{KvEvent, Snapshot};
use crate::load::PendingSnapshot;
use crate::metrics::RouterMetrics;
use crate::registry::{Registration, Registry, RemoteLoadReport, WorkerLoad};

/// A worker that still owes a snapshot is asked again after this long.
const ASK_AGAIN: Duration = Duration::from_secs(1);

/// This router's load is republished at least this often, so that the others do not expire
/// it ([`crate::registry::REMOTE_LOAD_TTL`]).
const LOAD_REFRESH: Duration = Duration::from_millis(1000);

/// The same warning about the same worker at most this often.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// What the events task needs.
#[derive(Debug, Clone)]
pub struct EventsParams {
    /// The events plane.
    pub connection: Connection,
    /// The registry and index it feeds.
    pub registry: Registry,
    /// This router's name on the plane.
    pub router_id: String,
    /// Publish and use predictive load.
    pub share_load: bool,
    /// Where to count snapshot requests and feed messages.
    pub metrics: Arc<RouterMetrics>,
}

/// Starts the events task; it runs until `shutdown`.
pub fn spawn(params: EventsParams, shutdown: CancellationToken) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut feed = Feed::new(params);
        feed.run(shutdown).await;
    })
}

/// A snapshot whose parts are arriving.
#[derive(Debug)]
struct Assembly {
    instance: u64,
    snapshot_id: u64,
    last_event: EventId,
    parts: u32,
    got: BTreeMap<u32, Vec<u64>>,
}

/// The KV stream as a stream of messages.
type KvMessages =
    std::pin::Pin<Box<dyn Stream<Item = Result<async_nats::jetstream::Message, String>> + Send>>;

struct Feed {
    p: EventsParams,
    instance: u64,
    /// The worker instance whose snapshot the index holds, per worker.
    fed: HashMap<WorkerId, u64>,
    assembling: HashMap<WorkerId, Assembly>,
    /// Workers whose index entry must be refreshed by a snapshot, and when one was last asked.
    owed: HashMap<WorkerId, Option<Instant>>,
    /// Workers that joined while the replay had not caught up yet.
    joined_early: HashSet<WorkerId>,
    /// The last stream sequence applied, and the stream's last sequence when the consumer was
    /// created (the replay has caught up once the first reaches the second).
    last_seq: u64,
    replay_target: u64,
    caught_up: bool,
    load_seq: u64,
    load_published: Option<Instant>,
    warned: HashMap<String, Instant>,
}

impl Feed {
    fn new(p: EventsParams) -> Self {
        Self {
            p,
            instance: rand::random::<u64>(),
            fed: HashMap::new(),
            assembling: HashMap::new(),
            owed: HashMap::new(),
            joined_early: HashSet::new(),
            last_seq: 0,
            replay_target: 0,
            caught_up: false,
            load_seq: 0,
            load_published: None,
            warned: HashMap::new(),
        }
    }

    async fn run(&mut self, shutdown: CancellationToken) {
        let conn = self.p.connection.clone();
        let mut connected = conn.connected();
        let up = *connected.borrow_and_update();
        self.p.registry.set_events_up(up, Instant::now());
        self.p.metrics.register_events_gauge();
        self.p.metrics.events_connected.set(i64::from(up));
        // Core subscriptions are renewed by the client after a reconnect.
        let Some(mut heartbeats) = self.subscribe(subject::HEARTBEAT_ALL, &shutdown).await else {
            return;
        };
        let mut loads = match self.p.share_load {
            true => self.subscribe(subject::ROUTER_LOAD_ALL, &shutdown).await,
            false => None,
        };
        let changed = self.p.registry.pending_changed();
        let mut kv: Option<KvMessages> = None;
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                c = connected.changed() => {
                    if c.is_err() {
                        return;
                    }
                    let up = *connected.borrow_and_update();
                    self.p.registry.set_events_up(up, Instant::now());
                    self.p.metrics.events_connected.set(i64::from(up));
                    if up {
                        tracing::info!(events = %conn.url(), "events plane reachable: routing on the prefix index again");
                    } else {
                        tracing::warn!(events = %conn.url(), "events plane unreachable: routing by load only until it is back");
                    }
                }
                m = next_kv(&mut kv) => match m {
                    Some(Ok(message)) => self.on_kv(&message),
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "KV stream consumer: recreating");
                        kv = None;
                    }
                    None => kv = None,
                },
                m = heartbeats.next() => match m {
                    Some(message) => self.on_heartbeat(&message.payload),
                    None => return,
                },
                m = next_load(&mut loads) => match m {
                    Some(message) => self.on_router_load(&message.payload),
                    // The client closed: stop listening rather than spin.
                    None => loads = None,
                },
                _ = changed.notified(), if self.p.share_load => self.publish_load().await,
                _ = tick.tick() => {
                    if kv.is_none() && *connected.borrow() {
                        kv = self.open_kv().await;
                    }
                    self.ask_owed().await;
                    if self.p.share_load {
                        self.p.registry.expire_remote_load(Instant::now());
                        if self.load_published.is_none_or(|at| at.elapsed() >= LOAD_REFRESH) {
                            self.publish_load().await;
                        }
                    }
                }
            }
        }
    }

    async fn subscribe(&self, subject: &str, shutdown: &CancellationToken) -> Option<Subscriber> {
        // The client queues the subscription while it is not connected yet; an error here is
        // the client closed.
        loop {
            match self.p.connection.subscribe(subject.to_string()).await {
                Ok(s) => return Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, subject, "events plane: subscribing failed; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
        }
    }

    /// A fresh ordered consumer of the KV stream, from where this router left off (from the
    /// start the first time, or when the stream was recreated since).
    async fn open_kv(&mut self) -> Option<KvMessages> {
        match self.try_open_kv().await {
            Ok(m) => Some(m),
            Err(e) => {
                self.warn_once(
                    "kv-stream",
                    format!("events plane: KV stream unavailable: {e}"),
                );
                None
            }
        }
    }

    async fn try_open_kv(&mut self) -> Result<KvMessages, EventsError> {
        let mut stream = self.p.connection.kv_stream(StreamLimits::default()).await?;
        let info = stream.info().await.map_err(EventsError::jetstream)?;
        let last = info.state.last_sequence;
        if last < self.last_seq {
            // The stream is not the one this router was reading (recreated, e.g. a server that
            // kept it in memory restarted): read the new one from its start.
            tracing::warn!(
                was = self.last_seq,
                now = last,
                "KV stream was recreated; replaying it"
            );
            self.last_seq = 0;
        }
        let deliver_policy = match self.last_seq {
            0 => DeliverPolicy::All,
            seq => DeliverPolicy::ByStartSequence {
                start_sequence: seq + 1,
            },
        };
        if !self.caught_up {
            self.replay_target = last;
            self.check_caught_up();
        }
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                filter_subject: subject::KV_ALL.to_string(),
                deliver_policy,
                ..Default::default()
            })
            .await
            .map_err(EventsError::jetstream)?;
        let messages = consumer.messages().await.map_err(EventsError::jetstream)?;
        Ok(Box::pin(messages.map(|m| m.map_err(|e| e.to_string()))))
    }

    fn on_kv(&mut self, message: &async_nats::jetstream::Message) {
        if let Ok(info) = message.info() {
            self.last_seq = info.stream_sequence;
        }
        match KvFeedMessage::decode(message.payload.as_ref()) {
            Ok(KvFeedMessage {
                message: Some(kv_feed_message::Message::Snapshot(part)),
            }) => self.on_snapshot_part(part),
            Ok(KvFeedMessage {
                message: Some(kv_feed_message::Message::Events(batch)),
            }) => {
                let worker = WorkerId(batch.worker_id.clone());
                if batch.worker_id.is_empty() {
                    self.warn_once(
                        "bad-kv",
                        "KV stream: an event batch without `worker_id`".into(),
                    );
                } else if self.fed.get(&worker) != Some(&batch.instance_id) {
                    // Events of an instance whose snapshot this router has not seen: an older
                    // process (ignore), or a stream trimmed past the snapshot (ask).
                    if self.p.registry.instance(&worker) == Some(batch.instance_id) {
                        self.owe(worker);
                    }
                } else {
                    match batch
                        .events
                        .into_iter()
                        .map(KvEvent::try_from)
                        .collect::<Result<Vec<_>, _>>()
                    {
                        Ok(events) => {
                            if let Err(e) = self.p.registry.index().apply(&worker, &events) {
                                tracing::debug!(worker = %worker, error = %e, "KV stream out of sync; asking for a snapshot");
                                self.owe(worker);
                            } else {
                                self.p.metrics.kv_feed_messages.inc();
                            }
                        }
                        Err(e) => self.warn_once("bad-kv", format!("KV stream: {e}")),
                    }
                }
            }
            Ok(KvFeedMessage { message: None }) | Err(_) => {
                self.warn_once("bad-kv", "KV stream: an undecodable message".into());
            }
        }
        self.check_caught_up();
    }

    fn on_snapshot_part(&mut self, part: KvSnapshotPart) {
        if part.worker_id.is_empty() || part.parts == 0 || part.part >= part.parts {
            self.warn_once(
                "bad-kv",
                format!(
                    "KV stream: a snapshot part with `worker_id` {:?}, `part` {} of `parts` {}",
                    part.worker_id, part.part, part.parts
                ),
            );
            return;
        }
        let worker = WorkerId(part.worker_id.clone());
        let fresh = |p: &KvSnapshotPart| Assembly {
            instance: p.instance_id,
            snapshot_id: p.snapshot_id,
            last_event: EventId(p.last_event_id),
            parts: p.parts,
            got: BTreeMap::new(),
        };
        let assembly = self
            .assembling
            .entry(worker.clone())
            .or_insert_with(|| fresh(&part));
        if assembly.snapshot_id != part.snapshot_id || assembly.instance != part.instance_id {
            // A newer snapshot started before the older one finished: the newer one wins.
            *assembly = fresh(&part);
        }
        assembly.got.insert(part.part, part.block_hashes);
        if assembly.got.len() < assembly.parts as usize {
            return;
        }
        let Some(done) = self.assembling.remove(&worker) else {
            return;
        };
        let blocks: Vec<BlockHash> = done.got.into_values().flatten().map(BlockHash).collect();
        self.p.registry.index().replace(
            &worker,
            Snapshot {
                blocks,
                last_event: done.last_event,
            },
        );
        self.fed.insert(worker.clone(), done.instance);
        self.owed.remove(&worker);
        self.p.metrics.kv_feed_messages.inc();
    }

    fn check_caught_up(&mut self) {
        if self.caught_up || self.last_seq < self.replay_target {
            return;
        }
        self.caught_up = true;
        let joined: Vec<WorkerId> = self.joined_early.drain().collect();
        tracing::info!(
            stream_sequence = self.last_seq,
            workers = self.fed.len(),
            "KV stream replayed: index rebuilt"
        );
        for worker in joined {
            if !self.in_sync(&worker) {
                self.owe(worker);
            }
        }
    }

    /// Whether the index holds the cache of the instance of `worker` the registry knows.
    fn in_sync(&self, worker: &WorkerId) -> bool {
        let registered = self.p.registry.instance(worker);
        registered.is_some()
            && self.fed.get(worker).copied() == registered
            && self.p.registry.index().last_event(worker).is_some()
    }

    fn owe(&mut self, worker: WorkerId) {
        self.owed.entry(worker).or_insert(None);
    }

    /// Asks every worker that owes a snapshot (once the replay has caught up: until then a
    /// later snapshot in the stream may settle it), again after [`ASK_AGAIN`].
    async fn ask_owed(&mut self) {
        if !self.caught_up || !self.p.registry.events_up() {
            return;
        }
        let now = Instant::now();
        let due: Vec<WorkerId> = self
            .owed
            .iter()
            .filter(|(_, asked)| asked.is_none_or(|at| now.duration_since(at) >= ASK_AGAIN))
            .map(|(w, _)| w.clone())
            .collect();
        for worker in due {
            if self.p.registry.instance(&worker).is_none() {
                // Gone: nothing to ask; it is asked again if it comes back.
                self.owed.remove(&worker);
                continue;
            }
            let subject = subject::snapshot_request(&worker.0);
            match self
                .p
                .connection
                .client()
                .publish(subject, Vec::new().into())
                .await
            {
                Ok(()) => {
                    self.p.metrics.snapshot_requests.inc();
                    self.owed.insert(worker, Some(now));
                }
                Err(e) => tracing::debug!(error = %e, "snapshot request not sent"),
            }
        }
    }

    fn on_heartbeat(&mut self, payload: &[u8]) {
        let Ok(WorkerHeartbeat {
            registration: Some(registration),
            load,
        }) = WorkerHeartbeat::decode(payload)
        else {
            self.warn_once("bad-hb", "events plane: an undecodable heartbeat".into());
            return;
        };
        let reg = match Registration::try_from(registration) {
            Ok(reg) => reg,
            Err(e) => {
                self.warn_once("bad-hb", format!("events plane: heartbeat refused: {e}"));
                return;
            }
        };
        let (id, role, address) = (reg.id.clone(), reg.role, reg.grpc_address.clone());
        let load = load.map(WorkerLoad::from).unwrap_or_default();
        match self.p.registry.join(reg, load, Instant::now()) {
            Ok(false) => {}
            Ok(true) => {
                tracing::info!(worker = %id, %role, %address, "worker joined (events plane)");
                if !self.caught_up {
                    self.joined_early.insert(id);
                } else if !self.in_sync(&id) {
                    self.owe(id);
                }
            }
            Err(e) => self.warn_once(&id.0, format!("worker {id} refused: {e}")),
        }
    }

    fn on_router_load(&mut self, payload: &[u8]) {
        let Ok(load) = RouterLoad::decode(payload) else {
            self.warn_once(
                "bad-load",
                "events plane: an undecodable router load".into(),
            );
            return;
        };
        if load.router_id == self.p.router_id && load.instance_id == self.instance {
            return;
        }
        let workers = load
            .workers
            .into_iter()
            .filter(|w| !w.worker_id.is_empty())
            .map(|w| {
                (
                    WorkerId(w.worker_id),
                    PendingSnapshot {
                        prefill_blocks: w.prefill_blocks,
                        active_blocks: w.active_blocks,
                        requests: w.requests,
                    },
                )
            })
            .collect();
        self.p.registry.set_remote_load(
            RemoteLoadReport {
                router: load.router_id,
                instance: load.instance_id,
                seq: load.seq,
                workers,
            },
            Instant::now(),
        );
    }

    async fn publish_load(&mut self) {
        self.load_seq += 1;
        let message = RouterLoad {
            router_id: self.p.router_id.clone(),
            instance_id: self.instance,
            seq: self.load_seq,
            workers: self
                .p
                .registry
                .local_pending()
                .into_iter()
                .map(|(w, p)| PendingLoadEntry {
                    worker_id: w.0,
                    prefill_blocks: p.prefill_blocks,
                    active_blocks: p.active_blocks,
                    requests: p.requests,
                })
                .collect(),
        };
        let subject = subject::router_load(&self.p.router_id);
        if let Err(e) = self.p.connection.publish(subject, &message).await {
            tracing::debug!(error = %e, "router load not published");
        }
        self.load_published = Some(Instant::now());
    }

    fn warn_once(&mut self, key: &str, message: String) {
        let now = Instant::now();
        let due = self
            .warned
            .get(key)
            .is_none_or(|at| now.duration_since(*at) >= WARN_EVERY);
        if due {
            tracing::warn!("{message}");
            self.warned.insert(key.to_string(), now);
        }
    }
}

async fn next_kv(
    kv: &mut Option<KvMessages>,
) -> Option<Result<async_nats::jetstream::Message, String>> {
    match kv {
        Some(messages) => messages.next().await,
        None => std::future::pending().await,
    }
}

async fn next_load(loads: &mut Option<Subscriber>) -> Option<async_nats::Message> {
    match loads {
        Some(sub) => sub.next().await,
        None => std::future::pending().await,
    }
}
