//! The worker registry: who is up, in which role, at which address, under what load.
//!
//! ```text
//!  worker ──Register(snapshot)──► RegistryService ──► Registry.register ──► index.replace
//!         ──Heartbeat(load)─────►                 ──► Registry.heartbeat
//!         ──PublishKvEvents─────►                 ──► index.apply (gap → in_sync = false)
//!  reaper task (spawn_reaper): every timeout/4, removes workers silent for > timeout
//!  Dispatcher ──► Registry.mark_down (connect error / broken stream): removed at once; its
//!                 next heartbeat is answered known = false, so a live worker re-registers
//!  Selector ──► Registry.healthy_workers() (a copy: id, role, load, channel)
//! ```
//!
//! The workers map is the one owner of worker state; it is a `DashMap` because it is read on
//! every request and written once per heartbeat (no lock is held across an `.await`). Each
//! entry keeps a lazily connected tonic [`Channel`] so requests reuse one HTTP/2 connection per
//! worker. Router-side predictive load ([`PendingLoad`]) is kept per worker id across
//! re-registrations, because requests dispatched before a re-registration are still running.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use ferry_proto::auth::{AttachToken, ClusterToken, RequireToken};
use ferry_proto::ids::{BlockHash, EventId, WorkerId};
use ferry_proto::internal::{self, registry_server};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

use crate::error::RegistryError;
use crate::index::{KvEvent, KvEventData, OutOfSync, PrefixIndex, Snapshot};
use crate::load::{PendingLoad, PendingSnapshot};

/// What a worker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// Computes prompts' KV for decode workers.
    Prefill,
    /// Generates tokens (and prefills locally when no prefill worker helps).
    Decode,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        })
    }
}

/// A worker's last reported load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkerLoad {
    /// Requests running.
    pub running_requests: u32,
    /// Requests queued.
    pub waiting_requests: u32,
    /// KV blocks referenced by live requests.
    pub kv_blocks_used: u32,
    /// KV pool size in blocks.
    pub kv_blocks_total: u32,
    /// Prompt tokens queued for prefill and not yet computed.
    pub queued_prefill_tokens: u64,
}

impl From<internal::WorkerLoad> for WorkerLoad {
    fn from(w: internal::WorkerLoad) -> Self {
        Self {
            running_requests: w.running_requests,
            waiting_requests: w.waiting_requests,
            kv_blocks_used: w.kv_blocks_used,
            kv_blocks_total: w.kv_blocks_total,
            queued_prefill_tokens: w.queued_prefill_tokens,
        }
    }
}

/// The KV transfer transports a worker speaks (`RegisterRequest.transports`), as a set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transports(u8);

impl Transports {
    const NAMES: [&'static str; 2] = ["tcp", "ucx"];

    /// TCP only: what a worker that names none speaks.
    pub const TCP: Transports = Transports(1);

    /// Parses the registration's names; empty is [`Transports::TCP`], an unknown name is an
    /// error naming it.
    pub fn parse(names: &[String]) -> Result<Self, RegistryError> {
        if names.is_empty() {
            return Ok(Self::TCP);
        }
        let mut bits = 0u8;
        for n in names {
            let i = Self::NAMES.iter().position(|k| k == n).ok_or_else(|| {
                RegistryError::invalid(
                    "transports",
                    format!("must name \"tcp\" or \"ucx\", got {n:?}"),
                )
            })?;
            bits |= 1 << i;
        }
        Ok(Transports(bits))
    }

    /// Whether the two sets share a transport (a prefill worker can write to a decode worker).
    pub fn meets(self, other: Transports) -> bool {
        self.0 & other.0 != 0
    }
}

impl std::fmt::Display for Transports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = Self::NAMES
            .iter()
            .enumerate()
            .filter(|(i, _)| self.0 & (1 << i) != 0)
            .map(|(_, n)| *n)
            .collect();
        f.write_str(&names.join(","))
    }
}

/// A parsed `RegisterRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The worker.
    pub id: WorkerId,
    /// Its role.
    pub role: Role,
    /// Its gRPC address, `host:port` (or a full `http://` URI).
    pub grpc_address: String,
    /// Tokens per KV block.
    pub page_size: usize,
    /// KV pool size in blocks.
    pub total_blocks: u32,
    /// Its cache at registration.
    pub snapshot: Snapshot,
    /// Random per worker process start; heartbeats and events must carry it.
    pub instance: u64,
    /// The KV transfer transports it speaks.
    pub transports: Transports,
}

impl TryFrom<internal::RegisterRequest> for Registration {
    type Error = RegistryError;

    fn try_from(r: internal::RegisterRequest) -> Result<Self, Self::Error> {
        let id = worker_id(r.worker_id)?;
        let role = match internal::WorkerRole::try_from(r.role) {
            Ok(internal::WorkerRole::Prefill) => Role::Prefill,
            Ok(internal::WorkerRole::Decode) => Role::Decode,
            _ => {
                return Err(RegistryError::invalid(
                    "role",
                    format!(
                        "must be WORKER_ROLE_PREFILL (1) or WORKER_ROLE_DECODE (2), got {}",
                        r.role
                    ),
                ))
            }
        };
        if r.grpc_address.trim().is_empty() {
            return Err(RegistryError::invalid("grpc_address", "must not be empty"));
        }
        Ok(Self {
            id,
            role,
            grpc_address: r.grpc_address,
            page_size: r.page_size as usize,
            total_blocks: r.total_blocks,
            snapshot: Snapshot {
                blocks: r.cached_block_hashes.into_iter().map(BlockHash).collect(),
                last_event: EventId(r.last_event_id),
            },
            instance: r.instance_id,
            transports: Transports::parse(&r.transports)?,
        })
    }
}

fn worker_id(raw: String) -> Result<WorkerId, RegistryError> {
    if raw.is_empty() {
        return Err(RegistryError::invalid("worker_id", "must not be empty"));
    }
    Ok(WorkerId(raw))
}

impl TryFrom<internal::KvEvent> for KvEvent {
    type Error = RegistryError;

    fn try_from(e: internal::KvEvent) -> Result<Self, Self::Error> {
        use internal::kv_event::Data;
        let data = match e.data {
            Some(Data::Stored(s)) => {
                KvEventData::Stored(s.block_hashes.into_iter().map(BlockHash).collect())
            }
            Some(Data::Removed(r)) => {
                KvEventData::Removed(r.block_hashes.into_iter().map(BlockHash).collect())
            }
            None => {
                return Err(RegistryError::invalid(
                    "events.data",
                    format!(
                        "must be `stored` or `removed`, got neither in event {}",
                        e.event_id
                    ),
                ))
            }
        };
        Ok(Self {
            id: EventId(e.event_id),
            data,
        })
    }
}

/// One worker as the selector sees it: a copy taken at selection time.
#[derive(Debug, Clone)]
pub struct WorkerSnapshot {
    /// The worker.
    pub id: WorkerId,
    /// Its role.
    pub role: Role,
    /// Its gRPC address as registered.
    pub grpc_address: String,
    /// Its last heartbeat's load.
    pub load: WorkerLoad,
    /// Router-side load not yet reflected in heartbeats.
    pub pending: PendingSnapshot,
    /// Handle to charge predictive load to.
    pub pending_handle: Arc<PendingLoad>,
    /// Lazily connected channel to the worker.
    pub channel: Channel,
    /// Signs calls to the worker with the cluster token.
    pub auth: AttachToken,
    /// The KV transfer transports it speaks.
    pub transports: Transports,
}

/// How a worker made itself known, which decides whether it may be reaped while the events
/// plane is unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// `Register` on the internal listener; heartbeats arrive by gRPC.
    Direct,
    /// Heartbeats heard on the events plane (`crate::events`).
    Events,
}

#[derive(Debug, Clone)]
struct Entry {
    source: Source,
    role: Role,
    grpc_address: String,
    transports: Transports,
    instance: u64,
    load: WorkerLoad,
    last_seen: Instant,
    channel: Channel,
}

#[derive(Debug)]
struct Inner {
    workers: DashMap<WorkerId, Entry>,
    pending: DashMap<WorkerId, Arc<PendingLoad>>,
    index: Arc<dyn PrefixIndex>,
    timeout: Duration,
    page_size: usize,
    cluster_token: Option<ClusterToken>,
    /// Whether the events plane is reachable (always true without one): while it is not,
    /// workers known through it are not reaped (their heartbeats cannot arrive) and the index
    /// it feeds is not trusted ([`Registry::index_trusted`]).
    events_up: AtomicBool,
    /// Other routers' predictive load on the workers, as they published it.
    remote: DashMap<String, RemoteLoad>,
    /// Signalled whenever this router's own predictive load changes.
    pending_changed: Arc<Notify>,
}

/// What another router published about its predictive load (`RouterLoad` on the wire).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteLoadReport {
    /// Its name.
    pub router: String,
    /// Its process instance.
    pub instance: u64,
    /// Message order within the instance.
    pub seq: u64,
    /// Its pending load per worker.
    pub workers: HashMap<WorkerId, PendingSnapshot>,
}

/// One other router's published predictive load.
#[derive(Debug, Clone)]
struct RemoteLoad {
    instance: u64,
    seq: u64,
    received: Instant,
    workers: HashMap<WorkerId, PendingSnapshot>,
}

/// Another router's load is forgotten when it has not been refreshed for this long (the
/// router died, or lost the events plane).
pub const REMOTE_LOAD_TTL: Duration = Duration::from_secs(3);

/// How to build a [`Registry`].
#[derive(Debug, Clone)]
pub struct RegistryParams {
    /// The prefix index fed by registrations and events.
    pub index: Arc<dyn PrefixIndex>,
    /// Workers silent for longer are unhealthy and reaped.
    pub heartbeat_timeout: Duration,
    /// The router's page size; workers must match it.
    pub page_size: usize,
    /// The internal plane's token: required on Registry calls, sent on calls to workers.
    pub cluster_token: Option<ClusterToken>,
}

/// A handle to the registry (cheap to clone).
#[derive(Debug, Clone)]
pub struct Registry {
    inner: Arc<Inner>,
}

impl Registry {
    /// An empty registry. Does not spawn; see [`Registry::spawn_reaper`].
    pub fn new(params: RegistryParams) -> Self {
        Self {
            inner: Arc::new(Inner {
                workers: DashMap::new(),
                pending: DashMap::new(),
                index: params.index,
                timeout: params.heartbeat_timeout,
                page_size: params.page_size,
                cluster_token: params.cluster_token,
                events_up: AtomicBool::new(true),
                remote: DashMap::new(),
                pending_changed: Arc::new(Notify::new()),
            }),
        }
    }

    /// The heartbeat period workers are asked to keep: a third of the timeout, so two
    /// heartbeats can be lost before a worker is dropped.
    pub fn heartbeat_interval(&self) -> Duration {
        (self.inner.timeout / 3).max(Duration::from_millis(50))
    }

    /// Registers or re-registers a worker at `now`: replaces its index entries with the
    /// snapshot and resets its load. Keeps the existing channel when the address is unchanged.
    ///
    /// A live worker (heartbeat within the timeout) keeps its id: a registration of that id
    /// from another address is [`RegistryError::Claimed`], whatever its instance. From the same
    /// address it is the worker itself (a restart binds the port the old process held), so the
    /// new instance replaces the old one.
    pub fn register(&self, reg: Registration, now: Instant) -> Result<(), RegistryError> {
        let (id, snapshot) = (reg.id.clone(), reg.snapshot.clone());
        self.admit(reg, Source::Direct, now)?;
        self.inner.index.replace(&id, snapshot);
        Ok(())
    }

    /// Adds or refreshes a worker heard on the events plane at `now` (its heartbeat carries
    /// its registration): the index is left alone (the KV stream feeds it). The same claim
    /// rule as [`Registry::register`] applies. Returns whether the worker (this instance) is
    /// new to the registry, i.e. the caller must make sure the index has its cache.
    pub fn join(
        &self,
        reg: Registration,
        load: WorkerLoad,
        now: Instant,
    ) -> Result<bool, RegistryError> {
        if self.heartbeat(&reg.id, reg.instance, load, now) {
            return Ok(false);
        }
        let (id, instance) = (reg.id.clone(), reg.instance);
        self.admit(reg, Source::Events, now)?;
        self.heartbeat(&id, instance, load, now);
        Ok(true)
    }

    /// The membership half of a registration: checks, claims the id, inserts the entry.
    fn admit(&self, reg: Registration, source: Source, now: Instant) -> Result<(), RegistryError> {
        if reg.page_size != self.inner.page_size {
            return Err(RegistryError::invalid(
                "page_size",
                format!(
                    "must equal the router's page size {}, got {}",
                    self.inner.page_size, reg.page_size
                ),
            ));
        }
        let existing = match self.inner.workers.get(&reg.id) {
            Some(e) if e.grpc_address == reg.grpc_address => Some(e.channel.clone()),
            Some(e) if self.is_live(&e, now) => {
                return Err(RegistryError::Claimed {
                    id: reg.id.clone(),
                    registered: e.grpc_address.clone(),
                    claimed: reg.grpc_address,
                })
            }
            _ => None,
        };
        let channel = match existing {
            Some(channel) => channel,
            None => connect_lazy(&reg.grpc_address)?,
        };
        self.inner.pending.entry(reg.id.clone()).or_insert_with(|| {
            Arc::new(PendingLoad::notifying(self.inner.pending_changed.clone()))
        });
        self.inner.workers.insert(
            reg.id,
            Entry {
                source,
                role: reg.role,
                grpc_address: reg.grpc_address,
                transports: reg.transports,
                instance: reg.instance,
                load: WorkerLoad {
                    kv_blocks_total: reg.total_blocks,
                    ..WorkerLoad::default()
                },
                last_seen: now,
                channel,
            },
        );
        Ok(())
    }

    /// Heard from within the timeout; or known through the events plane while that is down
    /// (its heartbeats cannot arrive then: a dead worker is still found by the dispatcher,
    /// which marks it down).
    fn is_live(&self, e: &Entry, now: Instant) -> bool {
        (e.source == Source::Events && !self.events_up())
            || now.saturating_duration_since(e.last_seen) <= self.inner.timeout
    }

    /// The instance of `id` the registry knows, if it knows the worker.
    pub fn instance(&self, id: &WorkerId) -> Option<u64> {
        self.inner.workers.get(id).map(|e| e.instance)
    }

    /// Whether the events plane is reachable (true when there is none).
    pub fn events_up(&self) -> bool {
        self.inner.events_up.load(Ordering::Relaxed)
    }

    /// Records whether the events plane is reachable at `now`. When it comes back, the workers
    /// known through it get one heartbeat timeout from `now` to be heard again before they
    /// count as silent.
    pub fn set_events_up(&self, up: bool, now: Instant) {
        let was = self.inner.events_up.swap(up, Ordering::Relaxed);
        if up && !was {
            for mut e in self.inner.workers.iter_mut() {
                if e.source == Source::Events {
                    e.last_seen = now;
                }
            }
        }
    }

    /// Whether routing may use the prefix index: not while the events plane that feeds it is
    /// down (routing is then by load only).
    pub fn index_trusted(&self) -> bool {
        self.events_up()
    }

    /// Notified whenever this router's own predictive load changes.
    pub fn pending_changed(&self) -> Arc<Notify> {
        self.inner.pending_changed.clone()
    }

    /// This router's own predictive load per worker (workers with nothing pending left out).
    pub fn local_pending(&self) -> Vec<(WorkerId, PendingSnapshot)> {
        let mut out: Vec<(WorkerId, PendingSnapshot)> = self
            .inner
            .pending
            .iter()
            .map(|p| (p.key().clone(), p.value().snapshot()))
            .filter(|(_, p)| *p != PendingSnapshot::default())
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Records another router's published predictive load at `now` (`seq` orders the
    /// messages of one router instance; an older one is dropped). Returns whether it was
    /// applied.
    pub fn set_remote_load(&self, report: RemoteLoadReport, now: Instant) -> bool {
        let mut entry = self
            .inner
            .remote
            .entry(report.router)
            .or_insert_with(|| RemoteLoad {
                instance: report.instance,
                seq: 0,
                received: now,
                workers: HashMap::new(),
            });
        if entry.instance == report.instance && report.seq <= entry.seq && entry.seq != 0 {
            return false;
        }
        *entry = RemoteLoad {
            instance: report.instance,
            seq: report.seq,
            received: now,
            workers: report.workers,
        };
        true
    }

    /// Forgets other routers' load not refreshed within [`REMOTE_LOAD_TTL`] of `now`.
    pub fn expire_remote_load(&self, now: Instant) {
        self.inner
            .remote
            .retain(|_, r| now.saturating_duration_since(r.received) <= REMOTE_LOAD_TTL);
    }

    /// The other routers' predictive load on `worker`, summed.
    fn remote_pending(&self, worker: &WorkerId) -> PendingSnapshot {
        self.inner
            .remote
            .iter()
            .filter_map(|r| r.workers.get(worker).copied())
            .fold(PendingSnapshot::default(), |a, b| a + b)
    }

    /// Records a heartbeat of `instance`; `false` when the worker is unknown, or registered
    /// since by another instance (it must register again).
    pub fn heartbeat(&self, id: &WorkerId, instance: u64, load: WorkerLoad, now: Instant) -> bool {
        match self.inner.workers.get_mut(id) {
            Some(mut entry) if entry.instance == instance => {
                entry.load = load;
                entry.last_seen = now;
                true
            }
            _ => false,
        }
    }

    /// Applies the KV events of `instance` of a worker to the index.
    pub fn publish(
        &self,
        id: &WorkerId,
        instance: u64,
        events: &[KvEvent],
    ) -> Result<(), OutOfSync> {
        let registered = self
            .inner
            .workers
            .get(id)
            .is_some_and(|e| e.instance == instance);
        if !registered {
            return Err(OutOfSync::UnknownWorker(id.clone()));
        }
        self.inner.index.apply(id, events).map(|_| ())
    }

    /// Removes a worker and its index entries.
    pub fn remove(&self, id: &WorkerId) {
        self.inner.workers.remove(id);
        self.inner.index.remove_worker(id);
    }

    /// Marks a worker down at once, on evidence stronger than a missed heartbeat (the router
    /// could not connect to it, or its connection broke mid-stream): removes it and its index
    /// entries as the reaper would, so the selector stops offering it and `/health` stops
    /// counting it. Its next heartbeat is answered `known = false`, so a worker that is in
    /// fact alive re-registers (with a fresh snapshot) within one heartbeat period. Only the
    /// registration at `grpc_address` is removed: one made elsewhere meanwhile stays. Returns
    /// whether a registration was removed.
    pub fn mark_down(&self, id: &WorkerId, grpc_address: &str) -> bool {
        let removed = self
            .inner
            .workers
            .remove_if(id, |_, e| e.grpc_address == grpc_address)
            .is_some();
        if removed {
            self.inner.index.remove_worker(id);
        }
        removed
    }

    /// Ids of the healthy workers of `role` at `now`, sorted (decode workers learn the live
    /// prefill workers from their heartbeat answers).
    pub fn live_ids(&self, role: Role, now: Instant) -> Vec<String> {
        let mut ids: Vec<String> = self
            .inner
            .workers
            .iter()
            .filter(|e| e.role == role && self.is_live(e.value(), now))
            .map(|e| e.key().0.clone())
            .collect();
        ids.sort();
        ids
    }

    /// Removes every worker whose last heartbeat is older than the timeout at `now`; returns
    /// them.
    pub fn reap(&self, now: Instant) -> Vec<WorkerId> {
        let reapable = |e: &Entry| !self.is_live(e, now);
        let stale: Vec<WorkerId> = self
            .inner
            .workers
            .iter()
            .filter(|e| reapable(e.value()))
            .map(|e| e.key().clone())
            .collect();
        for id in &stale {
            // Re-check under the entry lock: a heartbeat may have arrived meanwhile.
            let removed = self.inner.workers.remove_if(id, |_, e| reapable(e));
            if removed.is_some() {
                self.inner.index.remove_worker(id);
            }
        }
        stale
    }

    /// Starts the task that reaps silent workers until `shutdown` is cancelled.
    pub fn spawn_reaper(&self, shutdown: CancellationToken) -> JoinHandle<()> {
        let registry = self.clone();
        let period = (self.inner.timeout / 4).max(Duration::from_millis(10));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tick.tick() => {
                        for id in registry.reap(Instant::now()) {
                            tracing::warn!(worker = %id, "worker missed its heartbeats; removed");
                        }
                    }
                }
            }
        })
    }

    /// Workers whose last heartbeat is within the timeout at `now`, sorted by id.
    pub fn healthy_workers(&self, now: Instant) -> Vec<WorkerSnapshot> {
        let mut out: Vec<WorkerSnapshot> = self
            .inner
            .workers
            .iter()
            .filter(|e| self.is_live(e.value(), now))
            .map(|e| {
                let pending_handle = self
                    .inner
                    .pending
                    .get(e.key())
                    .map(|p| p.clone())
                    .unwrap_or_default();
                WorkerSnapshot {
                    id: e.key().clone(),
                    role: e.role,
                    grpc_address: e.grpc_address.clone(),
                    load: e.load,
                    pending: pending_handle.snapshot() + self.remote_pending(e.key()),
                    pending_handle,
                    channel: e.channel.clone(),
                    auth: AttachToken::new(self.inner.cluster_token.clone()),
                    transports: e.transports,
                }
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Healthy workers of `role` at `now`.
    pub fn count(&self, role: Role, now: Instant) -> usize {
        self.inner
            .workers
            .iter()
            .filter(|e| e.role == role && self.is_live(e.value(), now))
            .count()
    }

    /// The prefix index this registry feeds.
    pub fn index(&self) -> &Arc<dyn PrefixIndex> {
        &self.inner.index
    }

    /// The router's page size.
    pub fn page_size(&self) -> usize {
        self.inner.page_size
    }

    /// The check the Registry service runs on every call (the cluster token, if any).
    pub fn require_token(&self) -> RequireToken {
        RequireToken::new(self.inner.cluster_token.clone())
    }
}

fn connect_lazy(address: &str) -> Result<Channel, RegistryError> {
    let uri = if address.contains("://") {
        address.to_string()
    } else {
        format!("http://{address}")
    };
    let endpoint = Endpoint::from_shared(uri).map_err(|e| {
        RegistryError::invalid(
            "grpc_address",
            format!("must be host:port, got {address:?}: {e}"),
        )
    })?;
    Ok(endpoint
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        .connect_lazy())
}

/// The tonic face of the [`Registry`].
#[derive(Debug, Clone)]
pub struct RegistryService {
    registry: Registry,
}

impl RegistryService {
    /// Serves `registry`.
    pub fn new(registry: Registry) -> Self {
        Self { registry }
    }
}

#[tonic::async_trait]
impl registry_server::Registry for RegistryService {
    async fn register(
        &self,
        request: Request<internal::RegisterRequest>,
    ) -> Result<Response<internal::RegisterResponse>, Status> {
        let reg = Registration::try_from(request.into_inner())?;
        let (id, role, address, blocks) = (
            reg.id.clone(),
            reg.role,
            reg.grpc_address.clone(),
            reg.snapshot.blocks.len(),
        );
        self.registry
            .register(reg, Instant::now())
            .inspect_err(|e| tracing::warn!(worker = %id, error = %e, "registration refused"))?;
        tracing::info!(worker = %id, %role, %address, cached_blocks = blocks, "worker registered");
        let interval = self.registry.heartbeat_interval().as_millis();
        Ok(Response::new(internal::RegisterResponse {
            heartbeat_interval_ms: u32::try_from(interval).unwrap_or(u32::MAX),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<internal::HeartbeatRequest>,
    ) -> Result<Response<internal::HeartbeatResponse>, Status> {
        let req = request.into_inner();
        let id = worker_id(req.worker_id)?;
        let load = req.load.map(WorkerLoad::from).unwrap_or_default();
        let known = self
            .registry
            .heartbeat(&id, req.instance_id, load, Instant::now());
        if !known {
            tracing::debug!(worker = %id, "heartbeat from an unknown worker");
        }
        let live = self.registry.live_ids(Role::Prefill, Instant::now());
        Ok(Response::new(internal::HeartbeatResponse {
            known,
            live_prefill_workers: Some(internal::LivePrefillWorkers { worker_ids: live }),
        }))
    }

    async fn publish_kv_events(
        &self,
        request: Request<internal::KvEventBatch>,
    ) -> Result<Response<internal::KvEventAck>, Status> {
        let batch = request.into_inner();
        let id = worker_id(batch.worker_id)?;
        let events = batch
            .events
            .into_iter()
            .map(KvEvent::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        let in_sync = match self.registry.publish(&id, batch.instance_id, &events) {
            Ok(()) => true,
            Err(e @ OutOfSync::Gap { .. }) => {
                tracing::warn!(worker = %id, error = %e, "KV events out of sync; asking for a snapshot");
                false
            }
            Err(e) => {
                tracing::debug!(worker = %id, error = %e, "KV events refused");
                false
            }
        };
        Ok(Response::new(internal::KvEventAck { in_sync }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::FlatIndex;

    fn registry() -> Registry {
        Registry::new(RegistryParams {
            index: Arc::new(FlatIndex::new()),
            heartbeat_timeout: Duration::from_millis(100),
            page_size: 4,
            cluster_token: None,
        })
    }

    fn reg(id: &str, role: Role, blocks: &[u64]) -> Registration {
        Registration {
            id: WorkerId::from(id),
            role,
            grpc_address: "127.0.0.1:1".into(),
            page_size: 4,
            total_blocks: 100,
            snapshot: Snapshot {
                blocks: blocks.iter().copied().map(BlockHash).collect(),
                last_event: EventId(3),
            },
            instance: 7,
            transports: Transports::TCP,
        }
    }

    #[tokio::test]
    async fn register_heartbeat_reap() {
        let r = registry();
        let t0 = Instant::now();
        r.register(reg("d0", Role::Decode, &[1, 2]), t0)
            .expect("valid");
        r.register(reg("p0", Role::Prefill, &[]), t0)
            .expect("valid");
        assert_eq!(r.count(Role::Decode, t0), 1);
        let d0 = WorkerId::from("d0");
        assert_eq!(
            r.index().matched_blocks(&d0, &[BlockHash(1), BlockHash(2)]),
            2
        );

        let t1 = t0 + Duration::from_millis(80);
        assert!(r.heartbeat(&d0, 7, WorkerLoad::default(), t1));
        let t2 = t0 + Duration::from_millis(150);
        assert_eq!(r.healthy_workers(t2).len(), 1, "p0 is stale, d0 is not");
        assert_eq!(r.reap(t2), vec![WorkerId::from("p0")]);
        assert!(!r.heartbeat(&WorkerId::from("p0"), 7, WorkerLoad::default(), t2));

        let t3 = t1 + Duration::from_millis(101);
        assert_eq!(r.reap(t3), vec![d0.clone()]);
        assert_eq!(
            r.index().matched_blocks(&d0, &[BlockHash(1)]),
            0,
            "index cleared"
        );
    }

    #[tokio::test]
    async fn a_worker_marked_down_is_gone_until_it_registers_again() {
        let r = registry();
        let t0 = Instant::now();
        r.register(reg("d0", Role::Decode, &[1]), t0)
            .expect("valid");
        r.register(reg("p0", Role::Prefill, &[]), t0)
            .expect("valid");
        let d0 = WorkerId::from("d0");
        assert!(!r.mark_down(&d0, "127.0.0.1:2"), "another address: kept");
        assert_eq!(r.count(Role::Decode, t0), 1);
        assert!(r.mark_down(&d0, "127.0.0.1:1"));
        assert_eq!(r.count(Role::Decode, t0), 0, "not offered, not counted");
        assert_eq!(r.index().matched_blocks(&d0, &[BlockHash(1)]), 0);
        assert!(
            !r.heartbeat(&d0, 7, WorkerLoad::default(), t0),
            "its heartbeat asks it to register again"
        );
        assert_eq!(r.live_ids(Role::Prefill, t0), vec!["p0".to_string()]);
        r.register(reg("d0", Role::Decode, &[1]), t0)
            .expect("valid");
        assert_eq!(r.count(Role::Decode, t0), 1, "back after registering");
    }

    #[tokio::test]
    async fn events_need_a_registration_and_no_gaps() {
        let r = registry();
        let d0 = WorkerId::from("d0");
        let ev = |id| KvEvent {
            id: EventId(id),
            data: KvEventData::Stored(vec![BlockHash(9)]),
        };
        assert!(r.publish(&d0, 7, &[ev(1)]).is_err());
        r.register(reg("d0", Role::Decode, &[]), Instant::now())
            .expect("valid");
        assert!(r.publish(&d0, 7, &[ev(4)]).is_ok());
        assert!(matches!(
            r.publish(&d0, 7, &[ev(6)]),
            Err(OutOfSync::Gap { .. })
        ));
        r.register(reg("d0", Role::Decode, &[9]), Instant::now())
            .expect("valid");
        assert!(r.publish(&d0, 7, &[ev(4)]).is_ok());
    }

    #[tokio::test]
    async fn a_live_id_cannot_be_claimed_from_another_address() {
        let r = registry();
        let t0 = Instant::now();
        let d0 = WorkerId::from("d0");
        r.register(reg("d0", Role::Decode, &[1]), t0)
            .expect("valid");

        // The hijack: the same id, another address, another instance → refused, not applied.
        let mut hijack = reg("d0", Role::Decode, &[]);
        hijack.grpc_address = "10.9.9.9:1".into();
        hijack.instance = 666;
        let err = r.register(hijack.clone(), t0).expect_err("claimed");
        assert!(matches!(err, RegistryError::Claimed { .. }), "{err}");
        assert_eq!(Status::from(err).code(), tonic::Code::AlreadyExists);
        let healthy = r.healthy_workers(t0);
        assert_eq!(healthy[0].grpc_address, "127.0.0.1:1", "address unchanged");
        assert_eq!(r.index().matched_blocks(&d0, &[BlockHash(1)]), 1);
        // The hijacker's heartbeats and events are not the registered instance's.
        assert!(!r.heartbeat(&d0, 666, WorkerLoad::default(), t0));
        assert!(r.publish(&d0, 666, &[]).is_err());
        assert!(r.heartbeat(&d0, 7, WorkerLoad::default(), t0));

        // A restart in place (same address, new instance) replaces the old process, whose
        // heartbeats are then refused so it would register again.
        let mut restarted = reg("d0", Role::Decode, &[]);
        restarted.instance = 8;
        r.register(restarted, t0).expect("same address");
        assert!(!r.heartbeat(&d0, 7, WorkerLoad::default(), t0));
        assert!(r.heartbeat(&d0, 8, WorkerLoad::default(), t0));

        // Once the live worker stops heartbeating, its id is free for another address.
        let later = t0 + Duration::from_millis(150);
        r.register(hijack, later).expect("the old worker is gone");
        assert_eq!(r.healthy_workers(later)[0].grpc_address, "10.9.9.9:1");
    }

    #[tokio::test]
    async fn wrong_page_size_and_bad_wire_fields_are_refused() {
        let r = registry();
        let mut bad = reg("d0", Role::Decode, &[]);
        bad.page_size = 64;
        let err = r.register(bad, Instant::now()).expect_err("page size");
        assert!(err.to_string().contains("`page_size`"), "{err}");

        let wire = internal::RegisterRequest {
            worker_id: "x".into(),
            role: 0,
            grpc_address: "127.0.0.1:1".into(),
            ..Default::default()
        };
        let err = Registration::try_from(wire).expect_err("role unspecified");
        assert!(err.to_string().contains("`role`"), "{err}");
        let err = KvEvent::try_from(internal::KvEvent {
            event_id: 1,
            data: None,
        })
        .expect_err("no data");
        assert!(err.to_string().contains("events.data"), "{err}");
    }
}
