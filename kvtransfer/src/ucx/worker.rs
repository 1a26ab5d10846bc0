//! The progress thread of a [`UcxTransport`](super::UcxTransport): the one owner of the UCP
//! context, worker, endpoints, memory registrations and receiver sessions.
//!
//! Each loop turn progresses the worker (which runs the active-message callbacks: they only copy
//! the message into the inbox), handles the inbox, runs the commands the async side sent,
//! and checks outstanding requests. When a turn moved nothing, the thread keeps polling while
//! requests are in flight and for a short window after the last activity ([`Idle`]); past
//! that it arms the worker and sleeps on its event fd (the async side wakes it with
//! `ucp_worker_signal`).

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_int, c_void};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use ferry_proto::auth::ClusterToken;
use ferry_proto::internal::{
    LayerMemoryDesc, TransferFailure, TransferFlushAck, TransferHello, TransferHelloAck,
};
use prost::Message;
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::sys::{self, Ucp};
use crate::registry::{Access, Entry, Registry};
use crate::wire::{accepted_layout, from_failure, to_failure};
use crate::{
    check_compatible, DeviceBatch, Fence, KvLayoutDesc, LayerMemory, RemoteKey, TransferError,
    WriteBatch,
};

/// Active message ids.
const AM_HELLO: u32 = 1;
const AM_HELLO_ACK: u32 = 2;
const AM_DATA: u32 = 3;
const AM_FLUSH: u32 = 4;
const AM_FLUSH_ACK: u32 = 5;
const AM_FAILURE: u32 = 6;
const AM_BYE: u32 = 7;
const AM_IDS: [u32; 7] = [
    AM_HELLO,
    AM_HELLO_ACK,
    AM_DATA,
    AM_FLUSH,
    AM_FLUSH_ACK,
    AM_FAILURE,
    AM_BYE,
];

/// `LayerMemoryDesc.kind` values.
const KIND_STAGED: u32 = 0;
const KIND_HOST: u32 = 1;
const KIND_CUDA: u32 = 2;

/// Idle endpoints kept open for later connections (see [`Peer`]).
const MAX_IDLE_PEERS: usize = 64;

/// Remote keys of mapped shared memory kept per endpoint ([`Peer::mapped`]); beyond it, the
/// ones no connection uses are released.
const MAX_MAPPED_KEYS: usize = 16;

/// `madvise` advice that faults pages in writable without touching them (Linux 5.14+).
const MADV_POPULATE_WRITE: c_int = 23;

/// Most receiver sessions kept at once; the oldest is dropped beyond (a writer that died
/// without saying goodbye leaves one behind).
const MAX_SESSIONS: usize = 4096;

type Reply<T> = oneshot::Sender<Result<T, TransferError>>;

/// How the progress thread waits when a loop turn moved nothing.
///
/// Arming the worker is not free while CUDA puts are in flight: UCX's CUDA transports then
/// queue a host callback (`cuLaunchHostFunc`) on every stream with pending copies so that
/// their completion wakes the event fd, and a host callback blocks the copies posted behind
/// it on that stream until it has run on the driver's thread. A layer-by-layer transfer armed
/// between its puts so stalled its own copies once per layer. So the thread polls instead
/// while any request is in flight (for at most [`Idle::INFLIGHT_MAX`] without progress, then
/// it sleeps as before), and for `spin` after the last activity, which also answers the next
/// message of an exchange (a flush after the last put, its acknowledgement) without a wake-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Idle {
    /// Polling window after the last activity; zero: arm as soon as a turn moved nothing
    /// (the behaviour before, kept for A/B runs).
    spin: Duration,
}

impl Idle {
    /// Default polling window after the last activity.
    const SPIN: Duration = Duration::from_micros(1000);
    /// Longest stretch polled for in-flight requests that make no progress (a peer that
    /// stopped answering): beyond it the thread sleeps on the event fd.
    const INFLIGHT_MAX: Duration = Duration::from_millis(20);

    /// `FERRY_UCX_SPIN_US` (microseconds; 0 turns polling off), else [`Idle::SPIN`].
    fn from_env() -> Self {
        let spin = match std::env::var("FERRY_UCX_SPIN_US") {
            Ok(v) => match v.trim().parse::<u64>() {
                Ok(us) => Duration::from_micros(us),
                Err(_) => {
                    warn!(value = %v, "kvtransfer: FERRY_UCX_SPIN_US is not a number of microseconds; using the default");
                    Self::SPIN
                }
            },
            Err(_) => Self::SPIN,
        };
        Self { spin }
    }

    /// Whether to poll again rather than arm and sleep, `since` the last turn that moved
    /// something, with requests `in_flight` or not.
    fn keep_polling(self, since: Duration, in_flight: bool) -> bool {
        if self.spin.is_zero() {
            return false;
        }
        since < self.spin || (in_flight && since < Self::INFLIGHT_MAX)
    }
}

/// An open connection: its id, the destination's layout, and per destination layer whether
/// puts from this process's device memory land there.
pub(super) type Opened = (u64, KvLayoutDesc, Vec<bool>);

/// What the async side asks the thread to do.
pub(super) enum Cmd {
    Register {
        key: RemoteKey,
        entry: Arc<Entry>,
        done: Reply<()>,
    },
    Deregister {
        key: RemoteKey,
        done: Reply<()>,
    },
    Connect {
        address: Vec<u8>,
        hello: TransferHello,
        key: RemoteKey,
        writer_layout: KvLayoutDesc,
        done: Reply<Opened>,
    },
    /// Posted without a reply: an error fails the connection, and its flush reports it.
    Write {
        conn: u64,
        batch: WriteBatch,
    },
    /// As `Write`.
    WriteDevice {
        conn: u64,
        batch: DeviceBatch,
    },
    Flush {
        conn: u64,
        done: Reply<u64>,
    },
    Close {
        conn: u64,
    },
    /// Allocates host memory for a region ([`State::alloc`]).
    Alloc {
        len: usize,
        done: mpsc::Sender<Result<Allocated, TransferError>>,
    },
    /// Frees an allocation made by `Alloc` (its address); no reply.
    Free {
        addr: u64,
    },
    Shutdown,
}

/// Host memory the thread allocated with `ucp_mem_map`: the address, the length, and
/// whether it is a shared mapping (System V or POSIX shared memory, which writers on this
/// machine map and copy into) rather than private memory (UCX fell back to the heap).
#[derive(Debug, Clone, Copy)]
pub(super) struct Allocated {
    pub addr: u64,
    pub len: usize,
    pub shared: bool,
}

/// The worker pointer, for `ucp_worker_signal` from other threads (documented thread-safe).
pub(super) struct WorkerHandle {
    ucp: &'static Ucp,
    worker: sys::ucp_worker_h,
    /// Endpoints the thread holds open (written by the thread).
    pub(super) endpoints: Arc<std::sync::atomic::AtomicUsize>,
    /// Receivers' memory mapped into this process (written by the thread).
    pub(super) mapped: Arc<std::sync::atomic::AtomicUsize>,
    /// Write commands (host or device batches) the thread has handled.
    pub(super) writes: Arc<std::sync::atomic::AtomicUsize>,
}

// SAFETY: only `ucp_worker_signal` is called through it, which UCX documents as callable from
// any thread; the worker outlives every handle (the thread destroys it only after `Shared`,
// which owns the handle, sent `Shutdown` and is joining).
unsafe impl Send for WorkerHandle {}
// SAFETY: as above.
unsafe impl Sync for WorkerHandle {}

impl WorkerHandle {
    pub(super) fn signal(&self) {
        // SAFETY: see the type's Send/Sync note.
        unsafe { (self.ucp.worker_signal)(self.worker) };
    }
}

/// Starts the thread; returns its handle, the worker's address and the join handle once the
/// context and worker exist (or the error creating them).
pub(super) fn spawn(
    ucp: &'static Ucp,
    registry: Arc<Registry>,
    token: Option<ClusterToken>,
    cmds: mpsc::Receiver<Cmd>,
) -> Result<(WorkerHandle, Vec<u8>, std::thread::JoinHandle<()>), TransferError> {
    let (ready_tx, ready_rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("ferry-ucx".into())
        .spawn(move || match State::new(ucp, registry, token) {
            Ok(state) => {
                let worker = WorkerHandle {
                    ucp,
                    worker: state.worker,
                    endpoints: state.endpoints.clone(),
                    mapped: state.mapped_count.clone(),
                    writes: state.writes.clone(),
                };
                let address = state.address.clone();
                if ready_tx.send(Ok((worker, address))).is_ok() {
                    state.run(cmds);
                }
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        })?;
    match ready_rx.recv() {
        Ok(Ok((handle, address))) => Ok((handle, address, thread)),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => Err(TransferError::Protocol(
            "the UCX thread ended while starting".into(),
        )),
    }
}

/// What a callback saw, handled after progress returns.
enum Incoming {
    Am {
        id: u32,
        header: Vec<u8>,
        data: Vec<u8>,
        rndv: bool,
        reply_ep: sys::ucp_ep_h,
    },
    EpFailed {
        peer: u64,
        status: sys::ucs_status_t,
    },
}

type Inbox = RefCell<Vec<Incoming>>;

/// A callback's argument: where to put what it saw, and for which id / connection.
struct CallbackArg {
    inbox: *const Inbox,
    id: u64,
}

/// A region registered with UCX: one memory handle per exposed layer (none for layers inside
/// an allocation of this thread's, which has its own handle and key).
struct Registered {
    memhs: Vec<sys::ucp_mem_h>,
    descs: Vec<LayerMemoryDesc>,
}

/// The receiver's side of one writer's connection.
struct Session {
    entry: Arc<Entry>,
    key: RemoteKey,
    fence: Fence,
    reply_ep: sys::ucp_ep_h,
    /// The writer's id for the connection, named in every reply.
    conn: u64,
    /// Staged bytes landed.
    applied: u64,
    failed: Option<TransferError>,
}

/// A remote layer as the writer sees it.
enum RemoteLayer {
    /// Registered memory: host (`cuda: false`) or device.
    Put {
        base: u64,
        rkey: sys::ucp_rkey_h,
        cuda: bool,
        /// Host memory UCX maps into this process (the receiver's shared memory, through
        /// `ucp_rkey_ptr`): the layer's first byte here. Writes are copies to it, and the
        /// key belongs to the peer's [`Peer::mapped`] cache, not to the connection.
        mapped: Option<*mut u8>,
    },
    Staged,
}

/// A remote key whose memory is mapped into this process, kept for the endpoint's later
/// connections: unpacking it again would attach the receiver's segment anew and fault every
/// page of it in on the first copy (a 576 MB pool copied at a third of memcpy's rate).
struct MappedKey {
    rkey: sys::ucp_rkey_h,
    /// Open connections using it.
    users: usize,
}

/// An endpoint to one receiver's worker, kept open and shared by the connections (one per
/// transfer) to that worker: a new endpoint costs a wireup exchange and its close a flush,
/// which at ~1 ms were more than a GPU transfer's puts.
struct Peer {
    ep: sys::ucp_ep_h,
    /// The worker address it was made for (its key in `State::peers`).
    address: Vec<u8>,
    /// The error callback's argument (`id` = this peer's id), alive until the endpoint closes.
    err_arg: Box<CallbackArg>,
    /// Open connections using it.
    conns: usize,
    /// No new connection may use it (it failed, or a connection on it did); closed once idle.
    retired: bool,
    /// It or a connection on it failed: closed forcibly (a failed endpoint cannot flush).
    broken: bool,
    /// Mapped remote keys by their packed bytes (see [`MappedKey`]); destroyed before the
    /// endpoint closes.
    mapped: HashMap<Vec<u8>, MappedKey>,
}

/// The writer's side of one connection.
struct Conn {
    ep: sys::ucp_ep_h,
    /// The [`Peer`] whose endpoint it uses.
    peer: u64,
    key: RemoteKey,
    phase: Phase,
    failed: Option<TransferError>,
    put_bytes: u64,
    clock: PutClock,
    /// The [`Peer::mapped`] keys it uses (one use each), given back when it closes.
    mapped_keys: Vec<Vec<u8>>,
}

/// Where a connection's time went from its hello to its flush acknowledgement, logged
/// (debug) when the acknowledgement arrives: what the transfer benchmark's breakdown reads.
#[derive(Default)]
struct PutClock {
    /// The connect command handled (the hello posted).
    hello: Option<Instant>,
    /// The receiver's acknowledgement arrived, and the connection opened (remote keys unpacked).
    hello_acked: Option<Instant>,
    opened: Option<Instant>,
    puts: u32,
    /// Time spent inside `ucp_put_nbx`.
    posting: Duration,
    first_put: Option<Instant>,
    flush_posted: Option<Instant>,
    /// Every put completed locally (the endpoint's flush).
    flushed: Option<Instant>,
}

impl PutClock {
    fn log(&self, conn: u64) {
        let (Some(first), Some(posted), Some(flushed)) =
            (self.first_put, self.flush_posted, self.flushed)
        else {
            return;
        };
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let span = |a: Option<Instant>, b: Option<Instant>| match (a, b) {
            (Some(a), Some(b)) => us(b.saturating_duration_since(a)),
            _ => f64::NAN,
        };
        debug!(
            conn,
            hello_to_ack_us = span(self.hello, self.hello_acked),
            open_us = span(self.hello_acked, self.opened),
            puts = self.puts,
            posting_us = us(self.posting),
            first_put_to_flush_us = us(posted.saturating_duration_since(first)),
            flush_to_completion_us = us(flushed.saturating_duration_since(posted)),
            completion_to_ack_us = us(flushed.elapsed()),
            "kvtransfer: UCX transfer flushed"
        );
    }
}

enum Phase {
    Connecting {
        writer_layout: KvLayoutDesc,
        done: Reply<Opened>,
    },
    Open {
        session: u64,
        layout: KvLayoutDesc,
        layers: Vec<RemoteLayer>,
        flush: Option<Reply<u64>>,
    },
    /// Refused, or failed while connecting.
    Closed,
}

/// What an outstanding request keeps alive until it completes (never read: held, then dropped).
enum Keep {
    Nothing,
    Batch(#[allow(dead_code)] Arc<WriteBatch>),
    /// A device batch: its source stays leased until the last put reading it completes.
    Device(#[allow(dead_code)] Arc<DeviceBatch>),
    Header(#[allow(dead_code)] Vec<u8>),
    HeaderAndBatch(
        #[allow(dead_code)] Vec<u8>,
        #[allow(dead_code)] Arc<WriteBatch>,
    ),
    /// A closing endpoint's error-callback argument.
    ErrArg(#[allow(dead_code)] Box<CallbackArg>),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Put,
    Send,
    Flush,
    Close,
}

struct InFlight {
    req: *mut c_void,
    conn: Option<u64>,
    op: Op,
    _keep: Keep,
}

struct State {
    ucp: &'static Ucp,
    context: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    address: Vec<u8>,
    efd: c_int,
    registry: Arc<Registry>,
    token: Option<ClusterToken>,
    inbox: Box<Inbox>,
    /// Boxed: the worker holds their addresses.
    #[allow(clippy::vec_box)]
    _handler_args: Vec<Box<CallbackArg>>,
    regions: HashMap<RemoteKey, Registered>,
    sessions: HashMap<u64, Session>,
    next_session: u64,
    conns: HashMap<u64, Conn>,
    next_conn: u64,
    /// Endpoints by peer id, and the live one for each worker address.
    peers: HashMap<u64, Peer>,
    peer_by_address: HashMap<Vec<u8>, u64>,
    next_peer: u64,
    /// `peers.len()`, for [`UcxTransport::endpoints`](super::UcxTransport::endpoints).
    endpoints: Arc<std::sync::atomic::AtomicUsize>,
    /// Mapped keys over all peers, for [`UcxTransport::mapped`](super::UcxTransport::mapped).
    mapped_count: Arc<std::sync::atomic::AtomicUsize>,
    /// For [`UcxTransport::writes_per_lane`](super::UcxTransport::writes_per_lane).
    writes: Arc<std::sync::atomic::AtomicUsize>,
    inflight: Vec<InFlight>,
    /// Whether endpoints are still created with peer-failure detection (cleared the first
    /// time the transports refuse it).
    peer_failure_detection: bool,
    /// Whether the loaded UCX handles CUDA memory (`ucp_context_query`'s memory types).
    cuda: bool,
    /// The CUDA contexts this thread made current (device memory registered or read).
    cuda_contexts: super::cuda::Contexts,
    /// Host memory allocated for regions (`Cmd::Alloc`), by address.
    allocations: BTreeMap<u64, Allocation>,
    /// Whether a writer copies into remote memory UCX maps here (`ucp_rkey_ptr`) instead of
    /// putting (`FERRY_UCX_RKEY_PTR=0` turns it off, for comparison).
    rkey_ptr: bool,
    /// Batches already copied out, freed once no flush is waiting: freeing a transfer's
    /// source buffers (hundreds of MB) is not on the way to its acknowledgement.
    copied: Vec<Arc<WriteBatch>>,
}

/// One `Cmd::Alloc` allocation.
struct Allocation {
    len: usize,
    memh: sys::ucp_mem_h,
    /// Its packed remote key, for every layer registered inside it.
    rkey: Vec<u8>,
}

fn ucx_error(ucp: &Ucp, what: &str, status: sys::ucs_status_t) -> TransferError {
    TransferError::Io(std::io::Error::other(format!(
        "UCX {what}: {}",
        ucp.describe(status)
    )))
}

/// `id | protobuf` header.
fn frame(id: u64, msg: &impl Message) -> Vec<u8> {
    let mut v = id.to_le_bytes().to_vec();
    msg.encode(&mut v).unwrap_or_default();
    v
}

fn unframe<M: Message + Default>(h: &[u8], what: &str) -> Result<(u64, M), TransferError> {
    let (id, body) =
        split_u64(h).ok_or_else(|| TransferError::Protocol(format!("{what}: header too short")))?;
    let m = M::decode(body).map_err(|e| TransferError::Protocol(format!("{what}: {e}")))?;
    Ok((id, m))
}

fn split_u64(h: &[u8]) -> Option<(u64, &[u8])> {
    let (a, rest) = h.split_first_chunk::<8>()?;
    Some((u64::from_le_bytes(*a), rest))
}

impl State {
    fn new(
        ucp: &'static Ucp,
        registry: Arc<Registry>,
        token: Option<ClusterToken>,
    ) -> Result<State, TransferError> {
        // SAFETY: plain UCP setup calls with valid out-pointers; every handle made here is
        // released in `Drop for State` (or below, on failure).
        unsafe {
            let mut config = std::ptr::null_mut();
            let s = (ucp.config_read)(std::ptr::null(), std::ptr::null(), &mut config);
            if s != sys::UCS_OK {
                return Err(ucx_error(ucp, "reading the configuration", s));
            }
            let mut params = sys::ucp_params_t::zeroed();
            params.field_mask = sys::UCP_PARAM_FIELD_FEATURES;
            params.features = sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP;
            let mut context = std::ptr::null_mut();
            let s = (ucp.init_version)(sys::API.0, sys::API.1, &params, config, &mut context);
            (ucp.config_release)(config);
            if s != sys::UCS_OK {
                return Err(ucx_error(ucp, "creating a context", s));
            }
            let mut wparams = sys::ucp_worker_params_t::zeroed();
            wparams.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE;
            wparams.thread_mode = sys::UCS_THREAD_MODE_SINGLE;
            let mut worker = std::ptr::null_mut();
            let s = (ucp.worker_create)(context, &wparams, &mut worker);
            if s != sys::UCS_OK {
                (ucp.cleanup)(context);
                return Err(ucx_error(ucp, "creating a worker", s));
            }
            let mut state = State {
                ucp,
                context,
                worker,
                address: Vec::new(),
                efd: -1,
                registry,
                token,
                inbox: Box::new(RefCell::new(Vec::new())),
                _handler_args: Vec::new(),
                regions: HashMap::new(),
                sessions: HashMap::new(),
                next_session: 1,
                conns: HashMap::new(),
                next_conn: 1,
                peers: HashMap::new(),
                peer_by_address: HashMap::new(),
                next_peer: 1,
                endpoints: Arc::default(),
                mapped_count: Arc::default(),
                writes: Arc::default(),
                inflight: Vec::new(),
                peer_failure_detection: true,
                cuda: false,
                cuda_contexts: Default::default(),
                allocations: BTreeMap::new(),
                rkey_ptr: std::env::var("FERRY_UCX_RKEY_PTR").map_or(true, |v| v != "0"),
                copied: Vec::new(),
            };
            let mut addr = std::ptr::null_mut();
            let mut len = 0usize;
            let s = (ucp.worker_get_address)(worker, &mut addr, &mut len);
            if s != sys::UCS_OK {
                return Err(ucx_error(ucp, "reading the worker address", s));
            }
            state.address = std::slice::from_raw_parts(addr as *const u8, len).to_vec();
            (ucp.worker_release_address)(worker, addr);
            let s = (ucp.worker_get_efd)(worker, &mut state.efd);
            if s != sys::UCS_OK {
                return Err(ucx_error(ucp, "reading the worker's event fd", s));
            }
            for id in AM_IDS {
                let arg = Box::new(CallbackArg {
                    inbox: &*state.inbox,
                    id: u64::from(id),
                });
                let mut p = sys::ucp_am_handler_param_t::zeroed();
                p.field_mask = sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG;
                p.id = id;
                p.flags = sys::UCP_AM_FLAG_WHOLE_MSG;
                p.cb = Some(on_am);
                p.arg = &*arg as *const CallbackArg as *mut c_void;
                let s = (ucp.worker_set_am_recv_handler)(worker, &p);
                if s != sys::UCS_OK {
                    return Err(ucx_error(ucp, "setting a message handler", s));
                }
                state._handler_args.push(arg);
            }
            let mut attr = sys::ucp_context_attr_t::zeroed();
            attr.field_mask = sys::UCP_ATTR_FIELD_MEMORY_TYPES;
            if (ucp.context_query)(context, &mut attr) == sys::UCS_OK {
                state.cuda = attr.memory_types & (1 << sys::UCS_MEMORY_TYPE_CUDA) != 0;
            }
            info!(
                version = %format!("{}.{}.{}", ucp.version.0, ucp.version.1, ucp.version.2),
                cuda = state.cuda,
                "kvtransfer: UCX worker started"
            );
            Ok(state)
        }
    }

    fn run(mut self, cmds: mpsc::Receiver<Cmd>) {
        let idle = Idle::from_env();
        let mut last_busy = Instant::now();
        loop {
            let mut busy = false;
            // SAFETY: our worker, on its thread.
            while unsafe { (self.ucp.worker_progress)(self.worker) } != 0 {
                busy = true;
            }
            let incoming = std::mem::take(&mut *self.inbox.borrow_mut());
            busy |= !incoming.is_empty();
            for m in incoming {
                self.handle(m);
            }
            loop {
                match cmds.try_recv() {
                    Ok(Cmd::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => {
                        // Frees already sent are honoured; allocations still held elsewhere
                        // stay mapped (leaked) rather than pulled from under their holders.
                        while let Ok(cmd) = cmds.try_recv() {
                            if let Cmd::Free { addr } = cmd {
                                self.free(addr);
                            }
                        }
                        return;
                    }
                    Ok(cmd) => {
                        busy = true;
                        let host_write = matches!(cmd, Cmd::Write { .. });
                        self.command(cmd);
                        if host_write {
                            // Progress between host writes: a transfer's batches arrive
                            // together, and the puts of one must start moving (UCX's software
                            // RMA sends them as messages) before the next is posted. Posting a
                            // whole 8k-token transfer first took it from 36-64 % of memcpy to
                            // 16 % on a 2-core machine. (Device puts are copies the GPU runs
                            // on its own; they are posted back to back, as measured.)
                            break;
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            busy |= self.poll_requests();
            self.reap_abandoned();
            if !busy {
                self.free_copied();
            }
            if busy {
                last_busy = Instant::now();
                continue;
            }
            if idle.keep_polling(last_busy.elapsed(), !self.inflight.is_empty()) {
                // Polling, but giving the core away when another thread wants it (a machine
                // with fewer cores than busy threads).
                std::thread::yield_now();
                continue;
            }
            // SAFETY: our worker.
            match unsafe { (self.ucp.worker_arm)(self.worker) } {
                sys::UCS_OK => {
                    // Outstanding requests: wake soon even without an event.
                    let timeout = if self.inflight.is_empty() { 100 } else { 1 };
                    let mut fd = libc::pollfd {
                        fd: self.efd,
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: one valid pollfd.
                    unsafe { libc::poll(&mut fd, 1, timeout) };
                }
                sys::UCS_ERR_BUSY => {}
                s => {
                    warn!(status = %self.ucp.describe(s), "kvtransfer: UCX worker arm failed");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register { key, entry, done } => {
                let _ = done.send(self.register(key, &entry));
            }
            Cmd::Deregister { key, done } => {
                self.unmap(key);
                let _ = done.send(Ok(()));
            }
            Cmd::Connect {
                address,
                hello,
                key,
                writer_layout,
                done,
            } => self.connect(&address, hello, key, writer_layout, done),
            Cmd::Write { conn, batch } => {
                self.writes
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if let Err(e) = self.write(conn, batch) {
                    self.fail(conn, e);
                }
            }
            Cmd::WriteDevice { conn, batch } => {
                self.writes
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if let Err(e) = self.write_device(conn, batch) {
                    self.fail(conn, e);
                }
            }
            Cmd::Flush { conn, done } => self.flush(conn, done),
            Cmd::Close { conn } => self.close(conn),
            Cmd::Alloc { len, done } => {
                let _ = done.send(self.alloc(len));
            }
            Cmd::Free { addr } => self.free(addr),
            Cmd::Shutdown => {}
        }
    }

    // ---- receiver side -------------------------------------------------------------------

    fn register(&mut self, key: RemoteKey, entry: &Entry) -> Result<(), TransferError> {
        let mut reg = Registered {
            memhs: Vec::new(),
            descs: Vec::new(),
        };
        let mut staged_cuda = 0;
        let device = entry.memory.iter().find_map(|m| match m {
            LayerMemory::Cuda { device, .. } => Some(*device),
            _ => None,
        });
        let cuda_ready = match device {
            Some(d) if self.cuda => match self.cuda_contexts.make_current(d) {
                Ok(()) => true,
                Err(e) => {
                    warn!(error = %e, "kvtransfer: no CUDA context for registering device memory");
                    false
                }
            },
            _ => false,
        };
        for (layer, m) in entry.memory.iter().enumerate() {
            let (span, memory_type, kind) = match m {
                LayerMemory::Host(s) => (*s, sys::UCS_MEMORY_TYPE_HOST, KIND_HOST),
                LayerMemory::Cuda { .. } if !cuda_ready => {
                    staged_cuda += 1;
                    reg.descs.push(LayerMemoryDesc::default());
                    continue;
                }
                LayerMemory::Cuda { span, .. } => (*span, sys::UCS_MEMORY_TYPE_CUDA, KIND_CUDA),
                LayerMemory::Staged => {
                    reg.descs.push(LayerMemoryDesc::default());
                    continue;
                }
            };
            if kind == KIND_HOST {
                if let Some(rkey) = self.allocation_key(span.addr(), span.len()) {
                    reg.descs.push(LayerMemoryDesc {
                        kind,
                        base: span.addr(),
                        len: span.len() as u64,
                        rkey,
                    });
                    continue;
                }
            }
            match self.map(span.addr(), span.len(), memory_type) {
                Ok((memh, rkey)) => {
                    reg.memhs.push(memh);
                    reg.descs.push(LayerMemoryDesc {
                        kind,
                        base: span.addr(),
                        len: span.len() as u64,
                        rkey,
                    });
                }
                Err(e) if kind == KIND_CUDA => {
                    // No CUDA support in this UCX: the layer's blocks come as messages and
                    // the region copies them to the device.
                    debug!(layer, error = %e, "kvtransfer: UCX cannot register CUDA memory");
                    staged_cuda += 1;
                    reg.descs.push(LayerMemoryDesc::default());
                }
                Err(e) => {
                    self.release(reg);
                    return Err(e);
                }
            }
        }
        if staged_cuda > 0 {
            warn!(
                ucx_cuda = self.cuda,
                layers = staged_cuda,
                "kvtransfer: the loaded UCX cannot register CUDA memory (no cuda_copy/cuda_ipc); \
                 those layers are staged through host memory and copied to the device on arrival"
            );
        } else if device.is_some() {
            info!("kvtransfer: device KV layers registered with UCX: peers put into GPU memory");
        }
        self.regions.insert(key, reg);
        Ok(())
    }

    /// `ucp_mem_map` + `ucp_rkey_pack` of one span.
    fn map(
        &self,
        addr: u64,
        len: usize,
        memory_type: c_int,
    ) -> Result<(sys::ucp_mem_h, Vec<u8>), TransferError> {
        let mut p = sys::ucp_mem_map_params_t::zeroed();
        p.field_mask = sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | sys::UCP_MEM_MAP_PARAM_FIELD_PROT
            | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        p.address = addr as *mut c_void;
        p.length = len;
        p.prot = sys::UCP_MEM_MAP_PROT_LOCAL_READ
            | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE
            | sys::UCP_MEM_MAP_PROT_REMOTE_WRITE;
        p.memory_type = memory_type;
        let mut memh = std::ptr::null_mut();
        // SAFETY: the span is memory the region promised valid while registered
        // (`LayerMemory::host` / `cuda`); the entry (and so the region) outlives the mapping.
        let s = unsafe { (self.ucp.mem_map)(self.context, &p, &mut memh) };
        if s != sys::UCS_OK {
            return Err(ucx_error(self.ucp, "registering memory", s));
        }
        let rkey = self.pack_key(memh)?;
        Ok((memh, rkey))
    }

    /// The packed remote key of `memh`, a handle just mapped; on failure the handle is
    /// unmapped (it was the caller's only use).
    fn pack_key(&self, memh: sys::ucp_mem_h) -> Result<Vec<u8>, TransferError> {
        let mut buf = std::ptr::null_mut();
        let mut blen = 0usize;
        // SAFETY: a handle just mapped; the packed buffer is copied and released.
        unsafe {
            let s = (self.ucp.rkey_pack)(self.context, memh, &mut buf, &mut blen);
            if s != sys::UCS_OK {
                (self.ucp.mem_unmap)(self.context, memh);
                return Err(ucx_error(self.ucp, "packing a remote key", s));
            }
            let rkey = std::slice::from_raw_parts(buf as *const u8, blen).to_vec();
            (self.ucp.rkey_buffer_release)(buf);
            Ok(rkey)
        }
    }

    /// Allocates `len` bytes of host memory with `ucp_mem_map(ALLOCATE)` and packs its key:
    /// UCX takes it from the first memory domain of `UCX_ALLOC_PRIO` that can allocate
    /// (System V, then POSIX shared memory by default), so writers on this machine can map it
    /// and copy into it. Memory UCX took from the heap instead is zeroed here (shared memory
    /// is zero-filled by the kernel).
    fn alloc(&mut self, len: usize) -> Result<Allocated, TransferError> {
        let mut p = sys::ucp_mem_map_params_t::zeroed();
        p.field_mask = sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS
            | sys::UCP_MEM_MAP_PARAM_FIELD_PROT;
        p.length = len.max(1);
        p.flags = sys::UCP_MEM_MAP_ALLOCATE;
        p.prot = sys::UCP_MEM_MAP_PROT_LOCAL_READ
            | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE
            | sys::UCP_MEM_MAP_PROT_REMOTE_WRITE;
        let mut memh = std::ptr::null_mut();
        // SAFETY: UCX allocates; the handle is unmapped once (`free`, or below on failure).
        let s = unsafe { (self.ucp.mem_map)(self.context, &p, &mut memh) };
        if s != sys::UCS_OK {
            return Err(ucx_error(self.ucp, "allocating host memory", s));
        }
        let mut attr = sys::ucp_mem_attr_t::zeroed();
        attr.field_mask = sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH;
        // SAFETY: a handle just mapped, a valid out-struct.
        let s = unsafe { (self.ucp.mem_query)(memh, &mut attr) };
        let addr = attr.address as u64;
        let aligned = addr % crate::memory::PAGE as u64 == 0;
        if s != sys::UCS_OK || attr.address.is_null() || attr.length < len || !aligned {
            // SAFETY: mapped above, unmapped once.
            unsafe { (self.ucp.mem_unmap)(self.context, memh) };
            return Err(TransferError::Protocol(format!(
                "UCX allocated {} bytes at {addr:#x} for {len} page-aligned bytes ({})",
                attr.length,
                self.ucp.describe(s)
            )));
        }
        let rkey = self.pack_key(memh)?;
        let shared = is_shared_mapping(addr);
        if !shared {
            // SAFETY: `len` bytes UCX just allocated for us; nothing else refers to them yet.
            unsafe { std::ptr::write_bytes(attr.address as *mut u8, 0, len) };
        }
        self.allocations
            .insert(addr, Allocation { len, memh, rkey });
        Ok(Allocated { addr, len, shared })
    }

    fn free(&mut self, addr: u64) {
        if let Some(a) = self.allocations.remove(&addr) {
            // SAFETY: mapped by `alloc`, unmapped once; its holder has dropped it.
            unsafe { (self.ucp.mem_unmap)(self.context, a.memh) };
        }
    }

    /// The packed key of the allocation holding `addr..addr + len`, if one does.
    fn allocation_key(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let (&start, a) = self.allocations.range(..=addr).next_back()?;
        let end = addr.checked_add(len as u64)?;
        (end <= start + a.len as u64).then(|| a.rkey.clone())
    }

    fn release(&self, reg: Registered) {
        for memh in reg.memhs {
            // SAFETY: mapped by `map` on this context, unmapped once.
            unsafe { (self.ucp.mem_unmap)(self.context, memh) };
        }
    }

    fn unmap(&mut self, key: RemoteKey) {
        // Sessions stay (their next flush must be answered), refusing from now on.
        for s in self.sessions.values_mut().filter(|s| s.key == key) {
            s.failed.get_or_insert(TransferError::UnknownRegion(key));
        }
        if let Some(reg) = self.regions.remove(&key) {
            self.release(reg);
        }
    }

    fn on_hello(&mut self, header: &[u8], reply_ep: sys::ucp_ep_h) {
        let (conn, hello) = match unframe::<TransferHello>(header, "UCX hello") {
            Ok(v) => v,
            Err(e) => {
                warn!(error = %e, "kvtransfer: bad UCX hello");
                return;
            }
        };
        match self.accept(&hello) {
            Ok((entry, descs)) => {
                if self.sessions.len() >= MAX_SESSIONS {
                    if let Some(&oldest) = self.sessions.keys().min() {
                        self.sessions.remove(&oldest);
                    }
                }
                let session = self.next_session;
                self.next_session += 1;
                let ack = TransferHelloAck {
                    layout: Some(entry.layout.into()),
                    memory: descs,
                    session,
                    ..Default::default()
                };
                self.sessions.insert(
                    session,
                    Session {
                        entry,
                        key: RemoteKey(hello.remote_key),
                        fence: Fence(hello.fence),
                        reply_ep,
                        conn,
                        applied: 0,
                        failed: None,
                    },
                );
                self.send(reply_ep, AM_HELLO_ACK, frame(conn, &ack), None);
            }
            Err((e, layout)) => {
                let ack = TransferHelloAck {
                    error: e.to_string(),
                    layout: layout.map(Into::into),
                    kind: e.kind().to_owned(),
                    ..Default::default()
                };
                debug!(error = %e, "kvtransfer: refused a UCX writer");
                self.send(reply_ep, AM_HELLO_ACK, frame(conn, &ack), None);
            }
        }
    }

    /// The hello's checks, in TCP's order: the token first (an outsider learns nothing), then
    /// the key, then the layouts.
    #[allow(clippy::type_complexity)]
    fn accept(
        &self,
        hello: &TransferHello,
    ) -> Result<(Arc<Entry>, Vec<LayerMemoryDesc>), (TransferError, Option<KvLayoutDesc>)> {
        if let Some(token) = &self.token {
            if !token.matches(hello.cluster_token.as_bytes()) {
                return Err((TransferError::Unauthenticated, None));
            }
        }
        let key = RemoteKey(hello.remote_key);
        let entry = self.registry.get(key).map_err(|e| (e, None))?;
        let descs = match self.regions.get(&key) {
            Some(r) => r.descs.clone(),
            None => return Err((TransferError::UnknownRegion(key), None)),
        };
        hello
            .layout
            .as_ref()
            .ok_or_else(|| TransferError::Protocol("TransferHello: `layout` is missing".into()))
            .and_then(KvLayoutDesc::try_from)
            .and_then(|theirs| check_compatible(&entry.layout, &theirs))
            .map_err(|e| (e, Some(entry.layout)))?;
        Ok((entry, descs))
    }

    fn on_data(&mut self, header: &[u8], data: &[u8], rndv: bool) {
        let Some((session, rest)) = split_u64(header) else {
            return;
        };
        let Some(s) = self.sessions.get_mut(&session) else {
            return;
        };
        if s.failed.is_some() {
            return;
        }
        let landed = match rest.split_first_chunk::<8>() {
            _ if rndv => Err(TransferError::Protocol(
                "a staged block arrived by rendezvous; writers send them eagerly".into(),
            )),
            Some((lb, _)) => {
                let layer = u32::from_le_bytes([lb[0], lb[1], lb[2], lb[3]]);
                let block = u32::from_le_bytes([lb[4], lb[5], lb[6], lb[7]]);
                let access = Access {
                    key: s.key,
                    fence: s.fence,
                };
                s.entry.land(access, layer, block, data)
            }
            None => Err(TransferError::Protocol("UCX data header too short".into())),
        };
        match landed {
            Ok(()) => s.applied += data.len() as u64,
            Err(e) => {
                let (ep, conn) = (s.reply_ep, s.conn);
                let msg = frame(conn, &to_failure(&e));
                s.failed = Some(e);
                self.send(ep, AM_FAILURE, msg, None);
            }
        }
    }

    /// FLUSH: `session | conn | put bytes`.
    fn on_flush(&mut self, header: &[u8], reply_ep: sys::ucp_ep_h) {
        let words: Vec<u64> = header
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        let &[session, conn, put] = words.as_slice() else {
            return;
        };
        let Some(s) = self.sessions.get(&session) else {
            // Dropped (too many sessions): the writer must not wait for an ack.
            if !reply_ep.is_null() {
                let f = to_failure(&TransferError::Closed);
                self.send(reply_ep, AM_FAILURE, frame(conn, &f), None);
            }
            return;
        };
        let (ep, conn) = (s.reply_ep, s.conn);
        let failure = match &s.failed {
            Some(e) => Some(to_failure(e)),
            None if !s.entry.is_live() => Some(to_failure(&TransferError::UnknownRegion(s.key))),
            None => None,
        };
        match failure {
            Some(f) => self.send(ep, AM_FAILURE, frame(conn, &f), None),
            None => {
                let ack = TransferFlushAck {
                    bytes_applied: s.applied + put,
                };
                self.send(ep, AM_FLUSH_ACK, frame(conn, &ack), None);
            }
        }
    }

    // ---- writer side ---------------------------------------------------------------------

    #[allow(clippy::too_many_arguments)] // the fields of `Cmd::Connect`
    fn connect(
        &mut self,
        address: &[u8],
        hello: TransferHello,
        key: RemoteKey,
        writer_layout: KvLayoutDesc,
        done: Reply<Opened>,
    ) {
        let id = self.next_conn;
        self.next_conn += 1;
        let peer = match self.peer_by_address.get(address) {
            Some(&p) => p,
            None => match self.new_peer(address) {
                Ok(p) => p,
                Err(e) => {
                    let _ = done.send(Err(e));
                    return;
                }
            },
        };
        let Some(p) = self.peers.get_mut(&peer) else {
            let _ = done.send(Err(TransferError::Closed));
            return;
        };
        p.conns += 1;
        let ep = p.ep;
        self.conns.insert(
            id,
            Conn {
                ep,
                peer,
                key,
                phase: Phase::Connecting {
                    writer_layout,
                    done,
                },
                failed: None,
                put_bytes: 0,
                clock: PutClock {
                    hello: Some(Instant::now()),
                    ..PutClock::default()
                },
                mapped_keys: Vec::new(),
            },
        );
        self.send(ep, AM_HELLO, frame(id, &hello), Some(id));
    }

    /// A new endpoint to the worker at `address`, kept for later connections to it.
    fn new_peer(&mut self, address: &[u8]) -> Result<u64, TransferError> {
        let peer = self.next_peer;
        self.next_peer += 1;
        let err_arg = Box::new(CallbackArg {
            inbox: &*self.inbox,
            id: peer,
        });
        let create = |mode| {
            let mut p = sys::ucp_ep_params_t::zeroed();
            p.field_mask = sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER;
            p.address = address.as_ptr() as *const c_void;
            p.err_mode = mode;
            p.err_handler = sys::ucp_err_handler_t {
                cb: Some(on_ep_error),
                arg: &*err_arg as *const CallbackArg as *mut c_void,
            };
            let mut ep = std::ptr::null_mut();
            // SAFETY: `address` is a worker address from a registration (UCX validates its
            // contents); the error callback's argument lives in the connection, which
            // outlives the endpoint.
            let s = unsafe { (self.ucp.ep_create)(self.worker, &p, &mut ep) };
            (s, ep)
        };
        // Peer-failure detection where the transports support it; Debian's UCX 1.13 has none
        // for shared memory, where a dead receiver shows as the connect / flush bounds instead.
        // Once refused, not asked again (UCX logs every refusal as an error).
        let (mut s, mut ep) = (sys::UCS_ERR_UNREACHABLE, std::ptr::null_mut());
        if self.peer_failure_detection {
            (s, ep) = create(sys::UCP_ERR_HANDLING_MODE_PEER);
        }
        if s != sys::UCS_OK {
            if self.peer_failure_detection {
                info!(
                    status = %self.ucp.describe(s),
                    "kvtransfer: UCX's transports here cannot detect a failed receiver; \
                     connects and flushes are bounded by time instead"
                );
                self.peer_failure_detection = false;
            }
            (s, ep) = create(sys::UCP_ERR_HANDLING_MODE_NONE);
        }
        if s != sys::UCS_OK {
            return Err(ucx_error(self.ucp, "connecting to the receiver", s));
        }
        self.retire_idle_peers();
        self.peers.insert(
            peer,
            Peer {
                ep,
                address: address.to_vec(),
                err_arg,
                conns: 0,
                retired: false,
                broken: false,
                mapped: HashMap::new(),
            },
        );
        self.peer_by_address.insert(address.to_vec(), peer);
        self.endpoints
            .store(self.peers.len(), std::sync::atomic::Ordering::Relaxed);
        Ok(peer)
    }

    fn on_hello_ack(&mut self, header: &[u8]) {
        let Ok((id, ack)) = unframe::<TransferHelloAck>(header, "UCX hello ack") else {
            return;
        };
        let Some(conn) = self.conns.get(&id) else {
            return;
        };
        let Phase::Connecting { writer_layout, .. } = &conn.phase else {
            return;
        };
        let (peer, key, writer_layout) = (conn.peer, conn.key, *writer_layout);
        let acked = Instant::now();
        let result = self.open(&ack, peer, key, &writer_layout);
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        conn.clock.hello_acked = Some(acked);
        conn.clock.opened = Some(Instant::now());
        let Phase::Connecting { done, .. } = std::mem::replace(&mut conn.phase, Phase::Closed)
        else {
            return;
        };
        match result {
            Ok((layout, layers, mapped_keys)) => {
                conn.mapped_keys = mapped_keys;
                let from_device = layers
                    .iter()
                    .map(|l| self.cuda && matches!(l, RemoteLayer::Put { cuda: true, .. }))
                    .collect();
                conn.phase = Phase::Open {
                    session: ack.session,
                    layout,
                    layers,
                    flush: None,
                };
                let _ = done.send(Ok((id, layout, from_device)));
            }
            Err(e) => {
                let _ = done.send(Err(e));
                conn.failed = Some(TransferError::Closed);
                // The async side never got the connection: close it here.
                self.close(id);
            }
        }
    }

    /// The ack's verdict and, when accepted, the remote layers with their keys unpacked on
    /// `peer`'s endpoint, and the mapped keys of `peer` they use (each counted as one more use).
    #[allow(clippy::type_complexity)]
    fn open(
        &mut self,
        ack: &TransferHelloAck,
        peer: u64,
        key: RemoteKey,
        writer_layout: &KvLayoutDesc,
    ) -> Result<(KvLayoutDesc, Vec<RemoteLayer>, Vec<Vec<u8>>), TransferError> {
        let remote = accepted_layout(ack, key, writer_layout)?;
        let ep = self.peers.get(&peer).ok_or(TransferError::Closed)?.ep;
        if ack.memory.len() != remote.num_layers as usize {
            return Err(TransferError::Protocol(format!(
                "TransferHelloAck: {} memory entries for {} layers",
                ack.memory.len(),
                remote.num_layers
            )));
        }
        let need = remote.num_blocks as u64 * remote.block_bytes() as u64;
        let mut layers = Vec::with_capacity(ack.memory.len());
        let mut used: Vec<Vec<u8>> = Vec::new();
        let mut fresh: Vec<(usize, usize)> = Vec::new();
        for (l, m) in ack.memory.iter().enumerate() {
            if m.kind == KIND_STAGED {
                layers.push(RemoteLayer::Staged);
                continue;
            }
            if m.len < need {
                self.destroy_rkeys(layers);
                return Err(TransferError::Protocol(format!(
                    "TransferHelloAck: layer {l} has {} bytes of memory, its blocks need {need}",
                    m.len
                )));
            }
            if m.kind == KIND_HOST && self.rkey_ptr {
                if let Some((rkey, ptr)) = self.mapped_layer(peer, m, need, &mut fresh) {
                    if !used.contains(&m.rkey) {
                        used.push(m.rkey.clone());
                    }
                    layers.push(RemoteLayer::Put {
                        base: m.base,
                        rkey,
                        cuda: false,
                        mapped: Some(ptr),
                    });
                    continue;
                }
            }
            let rkey = match self.unpack(ep, &m.rkey) {
                Ok(rkey) => rkey,
                Err(e) => {
                    self.destroy_rkeys(layers);
                    return Err(e);
                }
            };
            layers.push(RemoteLayer::Put {
                base: m.base,
                rkey,
                cuda: m.kind == KIND_CUDA,
                mapped: None,
            });
        }
        if let Some(p) = self.peers.get_mut(&peer) {
            for k in &used {
                if let Some(m) = p.mapped.get_mut(k) {
                    m.users += 1;
                }
            }
        }
        if !fresh.is_empty() {
            prefault(fresh);
        }
        Ok((remote, layers, used))
    }

    fn unpack(&self, ep: sys::ucp_ep_h, packed: &[u8]) -> Result<sys::ucp_rkey_h, TransferError> {
        let mut rkey = std::ptr::null_mut();
        // SAFETY: unpacks a buffer UCX packed on the receiver (UCX validates it).
        let s =
            unsafe { (self.ucp.ep_rkey_unpack)(ep, packed.as_ptr() as *const c_void, &mut rkey) };
        if s != sys::UCS_OK {
            return Err(ucx_error(self.ucp, "unpacking a remote key", s));
        }
        Ok(rkey)
    }

    /// Host layer `m` mapped into this process: its key (from `peer`'s cache, or unpacked and
    /// cached) and the local address of its first byte. `None` when UCX cannot map it (a
    /// receiver's heap memory, another machine's memory): the layer is then written by puts.
    /// A key cached here has its layer's range noted in `fresh`, to fault in ahead of use.
    fn mapped_layer(
        &mut self,
        peer: u64,
        m: &LayerMemoryDesc,
        need: u64,
        fresh: &mut Vec<(usize, usize)>,
    ) -> Option<(sys::ucp_rkey_h, *mut u8)> {
        let p = self.peers.get(&peer)?;
        let (ep, cached) = (p.ep, p.mapped.get(&m.rkey).map(|k| k.rkey));
        let rkey = match cached {
            Some(rkey) => rkey,
            None => self.unpack(ep, &m.rkey).ok()?,
        };
        let mut ptr = std::ptr::null_mut();
        // SAFETY: a key unpacked on this endpoint; UCX answers an error for memory it cannot
        // map here.
        let s = unsafe { (self.ucp.rkey_ptr)(rkey, m.base, &mut ptr) };
        let usable = s == sys::UCS_OK && !ptr.is_null() && is_mapped(ptr as usize, need as usize);
        if cached.is_none() {
            if !usable {
                debug!(
                    peer,
                    status = %self.ucp.describe(s),
                    "kvtransfer: a receiver's host memory cannot be mapped here; writes are puts"
                );
                // SAFETY: unpacked above, destroyed once; never cached.
                unsafe { (self.ucp.rkey_destroy)(rkey) };
                return None;
            }
            let p = self.peers.get_mut(&peer)?;
            if p.mapped.len() >= MAX_MAPPED_KEYS {
                let idle: Vec<Vec<u8>> = p
                    .mapped
                    .iter()
                    .filter(|(_, k)| k.users == 0)
                    .map(|(b, _)| b.clone())
                    .collect();
                for b in idle {
                    if let Some(k) = p.mapped.remove(&b) {
                        // SAFETY: no connection uses it; destroyed once.
                        unsafe { (self.ucp.rkey_destroy)(k.rkey) };
                    }
                }
            }
            p.mapped
                .insert(m.rkey.clone(), MappedKey { rkey, users: 0 });
            self.count_mapped();
            fresh.push((ptr as usize, need as usize));
            info!(
                peer,
                layer_bytes = need,
                "kvtransfer: a receiver's KV pool is shared memory, mapped here; writes into it \
                 are copies"
            );
        }
        usable.then_some((rkey, ptr as *mut u8))
    }

    fn count_mapped(&self) {
        let n = self.peers.values().map(|p| p.mapped.len()).sum();
        self.mapped_count
            .store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Destroys a connection's own keys (mapped ones belong to the peer's cache).
    fn destroy_rkeys(&self, layers: Vec<RemoteLayer>) {
        for l in layers {
            if let RemoteLayer::Put {
                rkey, mapped: None, ..
            } = l
            {
                // SAFETY: unpacked once, destroyed once, before its endpoint closes.
                unsafe { (self.ucp.rkey_destroy)(rkey) };
            }
        }
    }

    fn write(&mut self, id: u64, batch: WriteBatch) -> Result<(), TransferError> {
        let Some(conn) = self.conns.get_mut(&id) else {
            return Err(TransferError::Closed);
        };
        if let Some(e) = conn.failed.take() {
            return Err(e);
        }
        let Phase::Open {
            session,
            layout,
            layers,
            ..
        } = &conn.phase
        else {
            return Err(TransferError::Closed);
        };
        batch.validate(layout)?;
        let (ep, session, bb) = (conn.ep, *session, layout.block_bytes() as u64);
        let batch = Arc::new(batch);
        let layer = batch.layer;
        let mut copies = Vec::new();
        let mut puts = Vec::new();
        let mut staged = Vec::new();
        for (i, w) in batch.writes.iter().enumerate() {
            match layers.get(layer as usize) {
                // Host bytes into host memory mapped here: a copy.
                Some(RemoteLayer::Put {
                    mapped: Some(first),
                    cuda: false,
                    ..
                }) => copies.push((i, *first, u64::from(w.block) * bb)),
                // Host bytes into other host memory: a put. Into device memory they go staged
                // (the receiver copies them in): UCX's device paths read device sources.
                Some(RemoteLayer::Put {
                    base,
                    rkey,
                    cuda: false,
                    mapped: None,
                }) => {
                    puts.push((i, base + u64::from(w.block) * bb, *rkey));
                }
                _ => staged.push(i),
            }
        }
        let mut put_bytes = 0;
        let (started, n_copies) = (Instant::now(), copies.len() as u32);
        for (i, first, offset) in copies {
            let data = &batch.writes[i].data;
            // SAFETY: the layer's memory is mapped here from `first` for at least `num_blocks`
            // blocks (`open` checked its length, `mapped_layer` that the range is mapped), and
            // the batch's runs were validated against the layout; the receiver does not touch
            // blocks reserved for this transfer until its flush is acknowledged.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), first.add(offset as usize), data.len())
            };
            put_bytes += data.len() as u64;
        }
        if n_copies > 0 {
            // Buffers of their own are freed later, off the way to a flush's ack; rows read in
            // place go back to their owner now (it waits for them before it writes them, and
            // another connection's pending flush would otherwise keep them).
            if !batch.in_place() {
                self.copied.push(batch.clone());
            }
            if let Some(conn) = self.conns.get_mut(&id) {
                let clock = &mut conn.clock;
                clock.puts += n_copies;
                clock.posting += started.elapsed();
                clock.first_put.get_or_insert(started);
            }
        }
        for (i, remote, rkey) in puts {
            let data = &batch.writes[i].data;
            let p = sys::ucp_request_param_t::zeroed();
            // SAFETY: `data` stays alive until the request completes (the batch is kept with
            // it); the remote range is inside the layer's registered memory (validated block,
            // and `open` checked the memory's length).
            let r = unsafe {
                (self.ucp.put_nbx)(
                    ep,
                    data.as_ptr() as *const c_void,
                    data.len(),
                    remote,
                    rkey,
                    &p,
                )
            };
            self.track(r, Some(id), Op::Put, Keep::Batch(batch.clone()))?;
            put_bytes += data.len() as u64;
        }
        for i in staged {
            let w = &batch.writes[i];
            let mut header = session.to_le_bytes().to_vec();
            header.extend_from_slice(&layer.to_le_bytes());
            header.extend_from_slice(&w.block.to_le_bytes());
            let data = (w.data.as_ptr(), w.data.len());
            self.send_checked(ep, AM_DATA, header, Some((data, batch.clone())), Some(id))?;
        }
        if let Some(conn) = self.conns.get_mut(&id) {
            conn.put_bytes += put_bytes;
        }
        Ok(())
    }

    /// Puts a device batch's runs from this process's CUDA memory into the destination's
    /// device memory; the batch (its source lease) is kept until the last put completes.
    fn write_device(&mut self, id: u64, batch: DeviceBatch) -> Result<(), TransferError> {
        if let Err(e) = self.cuda_contexts.make_current(batch.device) {
            return Err(TransferError::Protocol(format!(
                "no CUDA context for device {}: {e}",
                batch.device
            )));
        }
        let Some(conn) = self.conns.get_mut(&id) else {
            return Err(TransferError::Closed);
        };
        if let Some(e) = conn.failed.take() {
            return Err(e);
        }
        let Phase::Open { layout, layers, .. } = &conn.phase else {
            return Err(TransferError::Closed);
        };
        batch.validate(layout)?;
        let Some(&RemoteLayer::Put {
            base,
            rkey,
            cuda: true,
            ..
        }) = layers.get(batch.layer as usize)
        else {
            return Err(TransferError::Protocol(format!(
                "destination layer {} is not device memory",
                batch.layer
            )));
        };
        let (ep, bb) = (conn.ep, layout.block_bytes() as u64);
        let batch = Arc::new(batch);
        let mut put_bytes = 0;
        let (started, mut puts) = (Instant::now(), 0);
        for run in batch.runs() {
            puts += 1;
            let mut p = sys::ucp_request_param_t::zeroed();
            p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            p.memory_type = sys::UCS_MEMORY_TYPE_CUDA;
            // SAFETY: the source is device memory that stays valid and unwritten until the
            // batch drops (`DeviceBatch::new`'s contract), and the batch is kept with the
            // request; the remote range is inside the layer's registered memory (validated
            // runs, and `open` checked the memory's length).
            let r = unsafe {
                (self.ucp.put_nbx)(
                    ep,
                    run.src as *const c_void,
                    run.len,
                    base + u64::from(run.block) * bb,
                    rkey,
                    &p,
                )
            };
            self.track(r, Some(id), Op::Put, Keep::Device(batch.clone()))?;
            put_bytes += run.len as u64;
        }
        if let Some(conn) = self.conns.get_mut(&id) {
            conn.put_bytes += put_bytes;
            let clock = &mut conn.clock;
            clock.puts += puts;
            clock.posting += started.elapsed();
            clock.first_put.get_or_insert(started);
        }
        Ok(())
    }

    fn flush(&mut self, id: u64, done: Reply<u64>) {
        // Copies into mapped memory are plain stores: visible to the receiver before the
        // flush message that tells it they are done.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let Some(conn) = self.conns.get_mut(&id) else {
            let _ = done.send(Err(TransferError::Closed));
            return;
        };
        if let Some(e) = conn.failed.take() {
            let _ = done.send(Err(e));
            return;
        }
        let Phase::Open { flush, .. } = &mut conn.phase else {
            let _ = done.send(Err(TransferError::Closed));
            return;
        };
        *flush = Some(done);
        conn.clock.flush_posted = Some(Instant::now());
        let ep = conn.ep;
        let p = sys::ucp_request_param_t::zeroed();
        // SAFETY: an open endpoint of this worker.
        let r = unsafe { (self.ucp.ep_flush_nbx)(ep, &p) };
        match self.track(r, Some(id), Op::Flush, Keep::Nothing) {
            Ok(true) => self.flushed(id),
            Ok(false) => {}
            Err(e) => self.fail(id, e),
        }
    }

    /// Every put of `id` has landed remotely: ask the receiver to confirm.
    fn flushed(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        conn.clock.flushed = Some(Instant::now());
        let Phase::Open { session, .. } = &conn.phase else {
            return;
        };
        let mut header = session.to_le_bytes().to_vec();
        header.extend_from_slice(&id.to_le_bytes());
        header.extend_from_slice(&conn.put_bytes.to_le_bytes());
        let ep = conn.ep;
        self.send(ep, AM_FLUSH, header, Some(id));
    }

    fn on_flush_ack(&mut self, header: &[u8]) {
        let Ok((id, ack)) = unframe::<TransferFlushAck>(header, "UCX flush ack") else {
            return;
        };
        if let Some(Conn {
            phase: Phase::Open { flush, .. },
            clock,
            ..
        }) = self.conns.get_mut(&id)
        {
            clock.log(id);
            if let Some(done) = flush.take() {
                let _ = done.send(Ok(ack.bytes_applied));
            }
        }
    }

    fn on_failure(&mut self, header: &[u8]) {
        let Ok((id, f)) = unframe::<TransferFailure>(header, "UCX failure") else {
            return;
        };
        let key = match self.conns.get(&id) {
            Some(c) => c.key,
            None => return,
        };
        self.fail(id, from_failure(f, key));
    }

    /// Poisons connection `id` with `e`: a pending connect or flush gets it now, the next write
    /// or flush otherwise.
    fn fail(&mut self, id: u64, e: TransferError) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        match &mut conn.phase {
            Phase::Connecting { .. } => {
                if let Phase::Connecting { done, .. } =
                    std::mem::replace(&mut conn.phase, Phase::Closed)
                {
                    let _ = done.send(Err(e));
                }
                conn.failed = Some(TransferError::Closed);
                // The async side never got a writer, so no close will come: close it here.
                self.close(id);
            }
            Phase::Open { flush, .. } => match flush.take() {
                Some(done) => {
                    let _ = done.send(Err(e));
                    conn.failed = Some(TransferError::Closed);
                }
                None => {
                    conn.failed.get_or_insert(e);
                }
            },
            Phase::Closed => {
                conn.failed.get_or_insert(e);
            }
        }
    }

    /// Frees the copied batches once no connection waits for a flush acknowledgement.
    fn free_copied(&mut self) {
        let waiting = self
            .conns
            .values()
            .any(|c| matches!(&c.phase, Phase::Open { flush: Some(_), .. }));
        if !waiting {
            self.copied.clear();
        }
    }

    /// Closes connections whose connect the async side stopped waiting for (timed out).
    fn reap_abandoned(&mut self) {
        let gone: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| matches!(&c.phase, Phase::Connecting { done, .. } if done.is_closed()))
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            if let Some(c) = self.conns.get_mut(&id) {
                c.failed.get_or_insert(TransferError::Closed);
            }
            self.close(id);
        }
    }

    /// Ends connection `id`: its keys destroyed, the receiver's session freed (`BYE`), and its
    /// endpoint left open for the next connection to that worker unless the connection failed
    /// (then the endpoint is retired: closed once no connection uses it).
    fn close(&mut self, id: u64) {
        let Some(conn) = self.conns.remove(&id) else {
            return;
        };
        let Conn {
            ep,
            peer,
            phase,
            failed,
            mapped_keys,
            ..
        } = conn;
        if let Some(p) = self.peers.get_mut(&peer) {
            for k in &mapped_keys {
                if let Some(m) = p.mapped.get_mut(k) {
                    m.users = m.users.saturating_sub(1);
                }
            }
        }
        if let Phase::Open {
            session, layers, ..
        } = phase
        {
            self.destroy_rkeys(layers);
            if failed.is_none() && session != 0 {
                self.send(ep, AM_BYE, session.to_le_bytes().to_vec(), None);
            }
        }
        if let Some(p) = self.peers.get_mut(&peer) {
            p.conns = p.conns.saturating_sub(1);
            if failed.is_some() {
                self.retire_peer(peer, true);
            } else if p.retired && p.conns == 0 {
                self.close_peer(peer, false);
            }
        }
    }

    /// No new connection uses `peer`'s endpoint; it is closed now if idle (forcibly when
    /// `force`: a failed endpoint cannot flush), else when its last connection closes.
    fn retire_peer(&mut self, peer: u64, force: bool) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        p.retired = true;
        p.broken |= force;
        if self.peer_by_address.get(&p.address) == Some(&peer) {
            self.peer_by_address.remove(&p.address);
        }
        if p.conns == 0 {
            self.close_peer(peer, force);
        }
    }

    fn close_peer(&mut self, peer: u64, force: bool) {
        let Some(p) = self.peers.remove(&peer) else {
            return;
        };
        self.endpoints
            .store(self.peers.len(), std::sync::atomic::Ordering::Relaxed);
        if self.peer_by_address.get(&p.address) == Some(&peer) {
            self.peer_by_address.remove(&p.address);
        }
        for (_, m) in p.mapped {
            // SAFETY: no connection uses the peer any more; each key destroyed once, before
            // its endpoint closes.
            unsafe { (self.ucp.rkey_destroy)(m.rkey) };
        }
        self.count_mapped();
        let mut params = sys::ucp_request_param_t::zeroed();
        if force || p.broken {
            params.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
            params.flags = sys::UCP_EP_CLOSE_FLAG_FORCE;
        }
        // SAFETY: the endpoint is closed once (its peer entry is gone) and no connection uses
        // it. Its error callback's argument stays alive until the close completes.
        let r = unsafe { (self.ucp.ep_close_nbx)(p.ep, &params) };
        let _ = self.track(r, None, Op::Close, Keep::ErrArg(p.err_arg));
    }

    /// Closes idle endpoints beyond [`MAX_IDLE_PEERS`] (a writer that talked to many decode
    /// workers over time keeps only the most recent ones open).
    fn retire_idle_peers(&mut self) {
        let mut idle: Vec<u64> = self
            .peers
            .iter()
            .filter(|(_, p)| p.conns == 0)
            .map(|(&id, _)| id)
            .collect();
        if idle.len() < MAX_IDLE_PEERS {
            return;
        }
        idle.sort_unstable();
        let excess = idle.len() + 1 - MAX_IDLE_PEERS;
        for id in idle.into_iter().take(excess) {
            self.close_peer(id, false);
        }
    }

    // ---- requests --------------------------------------------------------------------------

    /// Sends a control message: `body` (`u64 id | protobuf`) goes as the message's *data*, not
    /// its header, since UCX bounds an active message's header to its eager segment and a
    /// hello ack carries a remote key per layer (CUDA IPC keys are large: 61 of them exceed it).
    /// A failure poisons `conn` (if any) and is otherwise logged.
    fn send(&mut self, ep: sys::ucp_ep_h, id: u32, body: Vec<u8>, conn: Option<u64>) {
        let result = self.send_body(ep, id, body, conn);
        if let Err(e) = result {
            match conn {
                Some(c) => self.fail(c, e),
                None => debug!(error = %e, am = id, "kvtransfer: UCX reply not sent"),
            }
        }
    }

    /// [`State::send`]'s message, sent eagerly with an empty header.
    fn send_body(
        &mut self,
        ep: sys::ucp_ep_h,
        id: u32,
        body: Vec<u8>,
        conn: Option<u64>,
    ) -> Result<(), TransferError> {
        let mut p = sys::ucp_request_param_t::zeroed();
        p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        p.flags = sys::UCP_AM_SEND_FLAG_EAGER | sys::UCP_AM_SEND_FLAG_REPLY;
        // SAFETY: the body stays alive until the request completes (kept with it).
        let r = unsafe {
            (self.ucp.am_send_nbx)(
                ep,
                id,
                std::ptr::null(),
                0,
                body.as_ptr() as *const c_void,
                body.len(),
                &p,
            )
        };
        self.track(r, conn, Op::Send, Keep::Header(body))
            .map(|_| ())
    }

    #[allow(clippy::too_many_arguments)] // one active message's parts
    fn send_checked(
        &mut self,
        ep: sys::ucp_ep_h,
        id: u32,
        header: Vec<u8>,
        data: Option<((*const u8, usize), Arc<WriteBatch>)>,
        conn: Option<u64>,
    ) -> Result<(), TransferError> {
        let mut p = sys::ucp_request_param_t::zeroed();
        p.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        // Eager, so the receiver's callback gets the whole message; reply, so a hello's
        // receiver gets an endpoint back to the writer.
        p.flags = sys::UCP_AM_SEND_FLAG_EAGER | sys::UCP_AM_SEND_FLAG_REPLY;
        let (ptr, len) = data.as_ref().map(|d| d.0).unwrap_or((std::ptr::null(), 0));
        // SAFETY: header and data stay alive until the request completes (kept with it).
        let r = unsafe {
            (self.ucp.am_send_nbx)(
                ep,
                id,
                header.as_ptr() as *const c_void,
                header.len(),
                ptr as *const c_void,
                len,
                &p,
            )
        };
        let keep = match data {
            Some((_, batch)) => Keep::HeaderAndBatch(header, batch),
            None => Keep::Header(header),
        };
        self.track(r, conn, Op::Send, keep).map(|_| ())
    }

    /// Records an operation's status pointer: `Ok(true)` done now, `Ok(false)` in flight (kept
    /// with what it needs alive), `Err` failed.
    fn track(
        &mut self,
        r: sys::ucs_status_ptr_t,
        conn: Option<u64>,
        op: Op,
        keep: Keep,
    ) -> Result<bool, TransferError> {
        if r.is_null() {
            return Ok(true);
        }
        if sys::ptr_is_err(r) {
            return Err(ucx_error(
                self.ucp,
                "posting an operation",
                sys::ptr_status(r),
            ));
        }
        self.inflight.push(InFlight {
            req: r,
            conn,
            op,
            _keep: keep,
        });
        Ok(false)
    }

    /// Completes finished requests; true if any did.
    fn poll_requests(&mut self) -> bool {
        let mut finished = Vec::new();
        self.inflight.retain(|f| {
            // SAFETY: a live request of this worker.
            let s = unsafe { (self.ucp.request_check_status)(f.req) };
            if s == sys::UCS_INPROGRESS {
                return true;
            }
            // SAFETY: completed; freed once.
            unsafe { (self.ucp.request_free)(f.req) };
            finished.push((f.conn, f.op, s));
            false
        });
        let any = !finished.is_empty();
        for (conn, op, s) in finished {
            let Some(conn) = conn else { continue };
            if s != sys::UCS_OK {
                let e = ucx_error(self.ucp, "transfer", s);
                self.fail(conn, e);
            } else if op == Op::Flush {
                self.flushed(conn);
            }
        }
        any
    }

    fn handle(&mut self, m: Incoming) {
        match m {
            Incoming::Am {
                id,
                header,
                data,
                rndv,
                reply_ep,
            } => match id {
                // Control messages carry their body as data (`State::send`).
                AM_HELLO if !reply_ep.is_null() => self.on_hello(&data, reply_ep),
                AM_HELLO_ACK => self.on_hello_ack(&data),
                AM_DATA => self.on_data(&header, &data, rndv),
                AM_FLUSH => self.on_flush(&data, reply_ep),
                AM_FLUSH_ACK => self.on_flush_ack(&data),
                AM_FAILURE => self.on_failure(&data),
                AM_BYE => {
                    if let Some((session, _)) = split_u64(&data) {
                        self.sessions.remove(&session);
                    }
                }
                other => debug!(am = other, "kvtransfer: unexpected UCX message"),
            },
            Incoming::EpFailed { peer, status } => {
                let e = ucx_error(self.ucp, "connection to the receiver failed", status);
                debug!(peer, error = %e, "kvtransfer: UCX endpoint failed");
                let on_it: Vec<u64> = self
                    .conns
                    .iter()
                    .filter(|(_, c)| c.peer == peer)
                    .map(|(&id, _)| id)
                    .collect();
                for conn in on_it {
                    self.fail(
                        conn,
                        ucx_error(self.ucp, "connection to the receiver failed", status),
                    );
                }
                self.retire_peer(peer, true);
            }
        }
    }
}

impl Drop for State {
    fn drop(&mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            if let Some(c) = self.conns.get_mut(&id) {
                c.failed.get_or_insert(TransferError::Closed);
            }
            self.close(id);
        }
        let peers: Vec<u64> = self.peers.keys().copied().collect();
        for peer in peers {
            self.close_peer(peer, false);
        }
        // Let closes and sends finish, for a bounded time (a dead peer's never do).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while !self.inflight.is_empty() && std::time::Instant::now() < deadline {
            // SAFETY: our worker.
            unsafe { (self.ucp.worker_progress)(self.worker) };
            if !self.poll_requests() {
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
        }
        for f in self.inflight.drain(..) {
            // SAFETY: releasing an unfinished request hands it to UCX, which frees it on
            // completion or with the worker.
            unsafe { (self.ucp.request_free)(f.req) };
        }
        let keys: Vec<RemoteKey> = self.regions.keys().copied().collect();
        for key in keys {
            self.unmap(key);
        }
        self.copied.clear();
        // SAFETY: every endpoint is closed; destroyed once.
        unsafe { (self.ucp.worker_destroy)(self.worker) };
        if !self.allocations.is_empty() {
            // Their holders still use them (a pool outliving its transport): the context
            // stays, so the memory stays mapped until the process exits.
            debug!(
                allocations = self.allocations.len(),
                "kvtransfer: UCX context kept for host memory still in use"
            );
            return;
        }
        // SAFETY: every mapping released; destroyed once.
        unsafe { (self.ucp.cleanup)(self.context) };
    }
}

/// Whether `addr` lies in a shared mapping of this process (`/proc/self/maps`: System V or
/// POSIX shared memory), as opposed to private memory.
fn is_shared_mapping(addr: u64) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    maps.lines().any(|line| {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            return false;
        };
        let Some((start, end)) = range.split_once('-') else {
            return false;
        };
        let parse = |v| u64::from_str_radix(v, 16).ok();
        matches!((parse(start), parse(end)), (Some(s), Some(e)) if s <= addr && addr < e)
            && perms.as_bytes().get(3) == Some(&b's')
    })
}

/// Whether `addr..addr + len` is mapped in this process (`msync` refuses unmapped ranges).
fn is_mapped(addr: usize, len: usize) -> bool {
    let page = crate::memory::PAGE;
    let start = addr & !(page - 1);
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    // SAFETY: `MS_ASYNC` on any range only checks it (nothing is written back or changed).
    unsafe { libc::msync(start as *mut c_void, end - start, libc::MS_ASYNC) == 0 }
}

/// Faults newly mapped ranges in, on a short-lived thread, so the first transfer into a
/// receiver's memory copies at memory speed instead of page-faulting through it.
/// `MADV_POPULATE_WRITE` prepares page tables only (no byte changes); on an older kernel, or
/// a range unmapped meanwhile, it fails and nothing happens.
fn prefault(ranges: Vec<(usize, usize)>) {
    let spawned = std::thread::Builder::new()
        .name("ferry-ucx-prefault".into())
        .spawn(move || {
            for (addr, len) in ranges {
                let start = addr & !(crate::memory::PAGE - 1);
                // SAFETY: advice only; it never changes memory contents.
                unsafe {
                    libc::madvise(
                        start as *mut c_void,
                        addr + len - start,
                        MADV_POPULATE_WRITE,
                    )
                };
            }
        });
    if let Err(e) = spawned {
        debug!(error = %e, "kvtransfer: no thread to fault mapped memory in");
    }
}

/// Active-message callback: copies the message into the inbox (nothing else may run here).
unsafe extern "C" fn on_am(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: `arg` is a `CallbackArg` owned by the state, whose inbox outlives the worker's
    // handlers; header/data are valid for the call (eager, whole message).
    unsafe {
        let arg = &*(arg as *const CallbackArg);
        let bytes = |p: *const c_void, n: usize| {
            if p.is_null() || n == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(p as *const u8, n).to_vec()
            }
        };
        let (recv_attr, reply_ep) = if param.is_null() {
            (0, std::ptr::null_mut())
        } else {
            ((*param).recv_attr, (*param).reply_ep)
        };
        let rndv = recv_attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV != 0;
        let reply_ep = if recv_attr & sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP != 0 {
            reply_ep
        } else {
            std::ptr::null_mut()
        };
        let msg = Incoming::Am {
            id: arg.id as u32,
            header: bytes(header, header_length),
            data: if rndv {
                Vec::new()
            } else {
                bytes(data, length)
            },
            rndv,
            reply_ep,
        };
        if let Ok(mut inbox) = (*arg.inbox).try_borrow_mut() {
            inbox.push(msg);
        }
    }
    sys::UCS_OK
}

/// Endpoint error callback (peer failure): queues the failure for the endpoint's peer.
unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` is the peer's `CallbackArg`, alive until the endpoint is closed.
    unsafe {
        let arg = &*(arg as *const CallbackArg);
        if let Ok(mut inbox) = (*arg.inbox).try_borrow_mut() {
            inbox.push(Incoming::EpFailed {
                peer: arg.id,
                status,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_polls_in_the_window_and_while_requests_are_in_flight() {
        let idle = Idle {
            spin: Duration::from_micros(200),
        };
        assert!(idle.keep_polling(Duration::from_micros(50), false));
        assert!(!idle.keep_polling(Duration::from_micros(300), false));
        // In flight: polled past the window (no host callbacks queued behind the copies) ...
        assert!(idle.keep_polling(Duration::from_millis(5), true));
        // ... but not for ever when nothing progresses.
        assert!(!idle.keep_polling(Idle::INFLIGHT_MAX, true));
    }

    #[test]
    fn idle_without_a_window_arms_at_once() {
        let idle = Idle {
            spin: Duration::ZERO,
        };
        assert!(!idle.keep_polling(Duration::ZERO, true));
        assert!(!idle.keep_polling(Duration::ZERO, false));
    }
}
