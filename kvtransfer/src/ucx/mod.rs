//! The UCX transport: one-sided puts straight into the receiver's registered memory.
//!
//! The receiver registers each layer of a region with `ucp_mem_map` (host memory, or CUDA
//! memory where the loaded UCX has CUDA support) and packs a remote key per layer. A writer
//! connects to the receiver's UCP *worker address* (the registration's address, hex-encoded;
//! it travels in the prefill request, so no listener or port is involved), receives the region's
//! layout, memory addresses and remote keys in the hello ack, then writes each block with
//! `ucp_put_nbx` from its own buffer to `base + block × block_bytes`. Nothing on the receiving
//! side runs per block: no receive buffer, no copy, no callback. A flush is `ucp_ep_flush_nbx`
//! (every put has landed in remote memory), then a flush message the receiver acknowledges with
//! the bytes written, which is the writer's completion.
//!
//! Layers the region does not expose ([`LayerMemory::Staged`](crate::LayerMemory::Staged)), and
//! device layers when the loaded UCX cannot register CUDA memory (Debian's UCX has no CUDA
//! modules), go as active messages whose bytes the receiver lands through
//! [`KvRegion::write`](crate::KvRegion::write), checking each one like TCP does; the fallback is
//! logged at registration.
//!
//! ```text
//!  writer (prefill)                              receiver (decode)
//!  ep = ucp_ep_create(worker address)
//!  HELLO(conn, key, layout, fence, token) ────►  token? key? layouts compatible?
//!               ◄────────────────────────────── HELLO_ACK(conn, session, layout, bases, rkeys)
//!  ucp_put_nbx(block bytes → base + b × bb) ══►  (lands in the pool; no receiver code runs)
//!  DATA(session, layer, block) + bytes ──────►  staged layers only: admit, region.write
//!  ucp_ep_flush_nbx, then FLUSH(session, conn, n) ►
//!               ◄────────────────────────────── FLUSH_ACK(conn, bytes) | FAILURE(conn, kind)
//!  BYE(session) on drop ─────────────────────►  session freed
//! ```
//!
//! ## Device memory
//!
//! With a CUDA-enabled UCX on both ends (PyPI's `libucx-cu13`; `cuda_copy` and `cuda_ipc`), the
//! receiver registers its device cache's layers as CUDA memory and a writer puts **from its own
//! device cache** ([`DeviceBatch`], [`RemoteWriter::puts_from_device`]): between two processes
//! on one GPU, or two GPUs joined by NVLink, `cuda_ipc` maps the receiver's memory into the
//! writer's process and copies device to device; a NIC with GPUDirect RDMA does the same over
//! the network. No host memory is involved on either side. Host bytes written to a device layer
//! (a writer whose rows are on the host) go as staged messages; the receiver copies them in.
//! The progress thread makes the device's primary CUDA context current before it touches device
//! memory (`cuda.rs`).
//!
//! The control messages are active messages whose data (not their header, which UCX bounds to
//! its eager segment) is `u64 id | protobuf`
//! (`transfer.proto`'s `TransferHello`, `TransferHelloAck`, `TransferFlushAck`,
//! `TransferFailure`), sent eagerly so they arrive whole.
//!
//! ## Threads
//!
//! A UCP worker is single-threaded, so one thread per [`UcxTransport`] owns the context, the
//! worker, every endpoint and registration, and runs the progress loop; the async side sends it
//! commands and awaits one-shot replies, and wakes it with `ucp_worker_signal`. The thread sleeps
//! on the worker's event fd when idle. A writer's further lanes (below) are threads of the same
//! kind that only connect and write.
//!
//! ## Lanes
//!
//! Posting a put costs host time: 4.5–6.5 µs each in UCX 1.22's `cuda_ipc` (context check, IPC
//! mapping lookup, `cuMemcpyDtoDAsync`, event record; BENCHMARKS.md), so one thread posting a
//! 61-layer transfer spends about as long as the device copies themselves take at 1k–8k
//! tokens. With [`UcxOptions::lanes`] > 1 (`FERRY_UCX_LANES`), a writer opens one connection
//! per lane: lane 0 is the transport's own thread, the others are writer-only progress threads,
//! each with its own UCP context, worker and endpoint to the receiver, started on the first
//! connect. Layer `l`'s writes go over lane `l mod lanes`; the flush flushes every lane and
//! sums their acknowledged bytes. The receiver sees one session per lane, each checked as any
//! writer is (token, key, fence, layout).
//!
//! ## Fences and one-sided puts
//!
//! A put cannot be checked on arrival, so the receiver's reservation fence
//! ([`KvRegion::admit`](crate::KvRegion::admit)) applies to staged blocks only; the writer checks
//! every put against the region's layout, and only writes the blocks its request names. The
//! decode worker keeps the blocks of an abandoned transfer out of reuse until its writer is
//! known to have stopped (`docs/transfer.md`).
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`UcxTransport`] and its [`RemoteWriter`] |
//! | `worker.rs` | the progress thread: endpoints, registrations, sessions, messages |
//! | `sys.rs` | the `ucp` C API, loaded at run time |
//! | `cuda.rs` | the CUDA driver calls that give the progress thread a device context |

mod cuda;
mod sys;
mod worker;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ferry_proto::auth::ClusterToken;
use ferry_proto::internal::TransferHello;
use tokio::sync::oneshot;
use tracing::{info, warn};

use crate::registry::Registry;
use crate::HostMemory;
use crate::{
    DeviceBatch, Fence, KvLayoutDesc, KvRegion, Registration, RemoteKey, RemoteWriter,
    TransferError, Transport, WriteBatch,
};
use worker::{Cmd, WorkerHandle};

/// How long a connect waits for the receiver's hello ack. A receiver that is gone may not be
/// detected by the transport at all (shared memory has no connection to break), so the wait is
/// bounded.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a flush waits for the receiver's acknowledgement after its puts completed: the
/// same bound, for a receiver that dies mid-transfer.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(60);

/// Registration addresses of this transport start with this prefix (then the hex-encoded UCP
/// worker address), so a UCX address is never mistaken for a `host:port`.
pub const ADDRESS_PREFIX: &str = "ucx:";

/// The UCX transport; see the module docs. Dropping the last clone's resources (the transport
/// and every writer it made) stops the progress threads and releases every UCX resource.
pub struct UcxTransport {
    shared: Arc<Shared>,
}

/// How a [`UcxTransport`] is made.
#[derive(Debug, Clone)]
pub struct UcxOptions {
    /// The cluster token: the receiver accepts only writers that present it in their hello,
    /// and this transport's writers present it.
    pub token: Option<ClusterToken>,
    /// Progress threads a writer spreads a transfer's layers over (see the module docs),
    /// 1 to [`MAX_LANES`].
    pub lanes: usize,
}

impl Default for UcxOptions {
    fn default() -> Self {
        Self {
            token: None,
            lanes: DEFAULT_LANES,
        }
    }
}

/// The environment variable [`UcxTransport::new`] and [`UcxTransport::with_token`] read the
/// number of lanes from (default [`DEFAULT_LANES`]).
pub const LANES_VAR: &str = "FERRY_UCX_LANES";

/// Lanes a writer uses unless told otherwise. Two, because two measured faster than one
/// everywhere and more than two did not add (BENCHMARKS.md, issue 14): `cuda_ipc` puts on an
/// H100, 1k / 8k / 32k tokens, 48–37 % → 54–59 %, 61–67 % → 78–86 % and 82 % → 92–95 % of a
/// device copy (connect included); host copies into a shared-memory pool on a 2-core VM +41 %
/// at 8k and +23 % at 32k. The cost is one more progress thread, UCP context and endpoint per
/// writing process, started on its first connect.
pub const DEFAULT_LANES: usize = 2;

/// Most lanes a writer may use.
pub const MAX_LANES: usize = 16;

/// The lanes `value` (of [`LANES_VAR`]) asks for: [`DEFAULT_LANES`] when unset, an error
/// naming the variable when it is not a whole number from 1 to [`MAX_LANES`].
fn lanes_from(value: Option<String>) -> Result<usize, TransferError> {
    let Some(v) = value else {
        return Ok(DEFAULT_LANES);
    };
    match v.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_LANES).contains(&n) => Ok(n),
        _ => Err(TransferError::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "{LANES_VAR}={v}: the number of UCX lanes is a whole number from 1 to {MAX_LANES}"
            ),
        ))),
    }
}

/// One progress thread (`worker.rs`): its command queue, and its worker's handle, which wakes
/// it. Dropping it stops the thread.
struct Lane {
    cmds: mpsc::Sender<Cmd>,
    handle: WorkerHandle,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Lane {
    /// Starts a thread with its own context and worker; returns it and the worker's address.
    fn start(
        ucp: &'static sys::Ucp,
        registry: Arc<Registry>,
        token: Option<ClusterToken>,
    ) -> Result<(Lane, Vec<u8>), TransferError> {
        let (cmds, rx) = mpsc::channel();
        let (handle, address, thread) = worker::spawn(ucp, registry, token, rx)?;
        Ok((
            Lane {
                cmds,
                handle,
                thread: Some(thread),
            },
            address,
        ))
    }

    fn send(&self, cmd: Cmd) -> Result<(), TransferError> {
        self.cmds.send(cmd).map_err(|_| TransferError::Closed)?;
        self.handle.signal();
        Ok(())
    }

    /// Sends the command `make` builds around a reply channel, and the reply's receiver.
    fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, TransferError>>) -> Cmd,
    ) -> Result<oneshot::Receiver<Result<T, TransferError>>, TransferError> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx))?;
        Ok(rx)
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, TransferError>>) -> Cmd,
    ) -> Result<T, TransferError> {
        self.ask(make)?.await.map_err(|_| TransferError::Closed)?
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        let _ = self.cmds.send(Cmd::Shutdown);
        self.handle.signal();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The reply to a command sent with [`Lane::ask`], awaited until `deadline` (then an I/O
/// error naming `what`, as a receiver that does not answer gets).
async fn reply_by<T>(
    rx: oneshot::Receiver<Result<T, TransferError>>,
    deadline: tokio::time::Instant,
    limit: Duration,
    what: &str,
) -> Result<T, TransferError> {
    match tokio::time::timeout_at(deadline, rx).await {
        Ok(reply) => reply.map_err(|_| TransferError::Closed)?,
        Err(_) => Err(TransferError::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("UCX {what}: no answer from the receiver within {limit:?}"),
        ))),
    }
}

/// What the transport and its writers share.
struct Shared {
    /// The transport's own thread: registrations, sessions, lane 0 of every writer.
    main: Lane,
    /// Writers' further lanes (`lanes − 1` of them), started by the first connect.
    extra: tokio::sync::OnceCell<Arc<[Lane]>>,
    lanes: usize,
    ucp: &'static sys::Ucp,
    registry: Arc<Registry>,
    token: Option<ClusterToken>,
    /// `ADDRESS_PREFIX` + hex worker address.
    address: String,
    version: (u32, u32, u32),
}

impl Shared {
    /// The further lanes of a writer, started by the first connect that needs them (each a
    /// UCP context and worker of its own: milliseconds, more with a CUDA-enabled UCX, so on a
    /// blocking thread; concurrent connects wait for the same start, and a failed start is
    /// tried again by the next connect).
    async fn extra_lanes(&self) -> Result<Arc<[Lane]>, TransferError> {
        if self.lanes <= 1 {
            return Ok(Arc::from(Vec::new()));
        }
        let start = || async {
            let (ucp, token, n) = (self.ucp, self.token.clone(), self.lanes - 1);
            let lanes = tokio::task::spawn_blocking(move || {
                (0..n)
                    .map(|_| {
                        // A lane only writes: no region is ever registered with it.
                        Lane::start(ucp, Arc::new(Registry::new()), token.clone())
                            .map(|(lane, _)| lane)
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .await
            .map_err(|_| TransferError::Closed)??;
            info!(
                lanes = self.lanes,
                "kvtransfer: UCX writer lanes started; each transfer's layers are spread over them"
            );
            Ok::<_, TransferError>(Arc::from(lanes))
        };
        self.extra.get_or_try_init(start).await.cloned()
    }

    /// `count` summed over the lanes started so far.
    fn sum(&self, count: impl Fn(&WorkerHandle) -> usize) -> usize {
        let extra = self.extra.get();
        count(&self.main.handle)
            + extra
                .iter()
                .flat_map(|lanes| lanes.iter())
                .map(|l| count(&l.handle))
                .sum::<usize>()
    }
}

/// The environment variables that set the shared-memory transports' segment size.
const SEGMENT_VARS: [&str; 4] = [
    "UCX_MM_SEG_SIZE",
    "UCX_POSIX_SEG_SIZE",
    "UCX_SYSV_SEG_SIZE",
    "UCX_XPMEM_SEG_SIZE",
];

/// The largest shared-memory segment UCX can carry intact: its shared-memory FIFO records a
/// message's length in 16 bits (`uct_mm_fifo_element_t::length`, UCX 1.13 through today's
/// master) while a message may be as long as the segment. Larger segments wrap the length and
/// land wrong bytes without an error (measured: `ferry bench-transfer` with
/// `UCX_MM_SEG_SIZE=65536` or `262144` fails its check of the receiver's pool; 49152 passes).
pub const MAX_SEGMENT_BYTES: u64 = u16::MAX as u64;

/// Refuses a segment size UCX would silently corrupt KV with (see [`MAX_SEGMENT_BYTES`]).
/// Values UCX's memory-units syntax allows that this does not parse are left to UCX.
fn check_segment_settings(var: impl Fn(&str) -> Option<String>) -> Result<(), TransferError> {
    for name in SEGMENT_VARS {
        let Some(value) = var(name) else { continue };
        if parse_memunits(&value).is_some_and(|b| b > MAX_SEGMENT_BYTES) {
            return Err(TransferError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{name}={value}: UCX's shared-memory transports record a message's length \
                     in 16 bits, so segments over {MAX_SEGMENT_BYTES} bytes corrupt KV \
                     transfers; unset it (UCX's default is 8256) or use at most \
                     {MAX_SEGMENT_BYTES}"
                ),
            )));
        }
    }
    Ok(())
}

/// A byte count in UCX's memory units (`8256`, `64k`, `1M`, `2mb`; binary multiples).
fn parse_memunits(value: &str) -> Option<u64> {
    let v = value.trim().to_ascii_lowercase();
    let v = v.strip_suffix('b').unwrap_or(&v);
    let (digits, scale) = match v.char_indices().last()? {
        (i, 'k') => (&v[..i], 1u64 << 10),
        (i, 'm') => (&v[..i], 1 << 20),
        (i, 'g') => (&v[..i], 1 << 30),
        _ => (v, 1),
    };
    digits.parse::<u64>().ok()?.checked_mul(scale)
}

impl UcxTransport {
    /// Loads UCX (see `sys.rs` for where from), creates a context and a worker with RMA and
    /// active messages, and starts the progress thread. Transports and devices follow UCX's
    /// environment (`UCX_TLS`, `UCX_NET_DEVICES`, ...); the number of lanes follows
    /// [`LANES_VAR`].
    pub fn new() -> Result<Self, TransferError> {
        Self::with_token(None)
    }

    /// [`UcxTransport::new`] whose receiver accepts only writers that present `token` (the
    /// cluster token) in their hello, and whose own writers present it.
    pub fn with_token(token: Option<ClusterToken>) -> Result<Self, TransferError> {
        let lanes = lanes_from(std::env::var(LANES_VAR).ok())?;
        Self::with_options(UcxOptions { token, lanes })
    }

    /// A transport made as `options` say (the environment's [`LANES_VAR`] is not read).
    pub fn with_options(options: UcxOptions) -> Result<Self, TransferError> {
        let UcxOptions { token, lanes } = options;
        if !(1..=MAX_LANES).contains(&lanes) {
            return Err(TransferError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{lanes} UCX lanes: a writer uses 1 to {MAX_LANES}"),
            )));
        }
        check_segment_settings(|name| std::env::var(name).ok())?;
        let ucp = sys::ucp().map_err(TransferError::Protocol)?;
        let registry = Arc::new(Registry::new());
        let (main, address) = Lane::start(ucp, registry.clone(), token.clone())?;
        Ok(UcxTransport {
            shared: Arc::new(Shared {
                main,
                extra: tokio::sync::OnceCell::new(),
                lanes,
                ucp,
                registry,
                token,
                address: format!("{ADDRESS_PREFIX}{}", hex(&address)),
                version: ucp.version,
            }),
        })
    }

    /// Lanes a writer of this transport spreads a transfer over.
    pub fn lanes(&self) -> usize {
        self.shared.lanes
    }

    /// Batches (one layer's blocks each, host or device) each started lane has written, lane
    /// 0 first: how the writers' layers spread.
    pub fn writes_per_lane(&self) -> Vec<usize> {
        let load = |h: &WorkerHandle| h.writes.load(std::sync::atomic::Ordering::Relaxed);
        let extra = self.shared.extra.get();
        std::iter::once(load(&self.shared.main.handle))
            .chain(extra.iter().flat_map(|l| l.iter()).map(|l| load(&l.handle)))
            .collect()
    }

    /// Whether UCX can be loaded on this machine (`Err` says why not).
    pub fn available() -> Result<(u32, u32, u32), String> {
        sys::ucp().map(|u| u.version)
    }

    /// Endpoints this transport holds open to receivers' workers: one per receiver written to
    /// recently, shared by every connection to it (connections come and go per transfer;
    /// endpoints stay, up to 64 idle ones, and are closed when they fail).
    /// With several lanes, each lane holds its own endpoint to each receiver: this is their sum.
    pub fn endpoints(&self) -> usize {
        self.shared
            .sum(|h| h.endpoints.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Receivers' memory regions this transport has mapped into its process (shared-memory
    /// pools on this machine, from [`Transport::alloc_host`]): writes into them are copies.
    /// Kept per receiver endpoint, released when the endpoint closes.
    /// Each lane maps a receiver's memory for itself: this is the sum over lanes.
    pub fn mapped(&self) -> usize {
        self.shared
            .sum(|h| h.mapped.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// The loaded UCX's version.
    pub fn version(&self) -> (u32, u32, u32) {
        self.shared.version
    }
}

impl std::fmt::Debug for UcxTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxTransport")
            .field("version", &self.shared.version)
            .finish_non_exhaustive()
    }
}

/// How long an allocation waits for the progress thread.
const ALLOC_TIMEOUT: Duration = Duration::from_secs(30);

/// Frees a [`UcxTransport::alloc_host`] allocation when its [`HostMemory`] drops: a command
/// to the progress thread, handled on its next turn. If the thread has ended, the memory
/// stays mapped until the process exits (never freed from under a holder).
struct UcxAllocation {
    addr: u64,
    cmds: mpsc::Sender<Cmd>,
}

impl Drop for UcxAllocation {
    fn drop(&mut self) {
        let _ = self.cmds.send(Cmd::Free { addr: self.addr });
    }
}

impl UcxTransport {
    fn alloc_ucx(&self, len: usize) -> Result<(HostMemory, bool), TransferError> {
        let (tx, rx) = mpsc::channel();
        self.shared.main.send(Cmd::Alloc { len, done: tx })?;
        let a = rx
            .recv_timeout(ALLOC_TIMEOUT)
            .map_err(|_| TransferError::Closed)??;
        let owner = UcxAllocation {
            addr: a.addr,
            cmds: self.shared.main.cmds.clone(),
        };
        let ptr = std::ptr::NonNull::new(a.addr as *mut u8).ok_or(TransferError::Closed)?;
        // SAFETY: `len` zeroed, page-aligned bytes that UCX allocated (`State::alloc` checked
        // both) and unmaps only after the owner's `Free`.
        let memory = unsafe { HostMemory::from_owner(ptr, a.len, Box::new(owner)) };
        Ok((memory, a.shared))
    }
}

#[async_trait]
impl Transport for UcxTransport {
    fn name(&self) -> &'static str {
        "ucx"
    }

    /// Host memory from `ucp_mem_map(ALLOCATE)`: shared memory (System V or POSIX, UCX's
    /// `UCX_ALLOC_PRIO`) when those transports are enabled, which a writer on this machine
    /// maps and copies into at memory speed (`ucp_rkey_ptr`) instead of putting through UCX's
    /// software RMA; otherwise whatever UCX allocates (still registered, written by puts).
    /// Falls back to the heap, with a warning, if UCX cannot allocate.
    fn alloc_host(&self, len: usize) -> Result<HostMemory, TransferError> {
        match self.alloc_ucx(len) {
            Ok((memory, shared)) => {
                if shared {
                    info!(bytes = len, "kvtransfer: KV pool in UCX shared memory");
                } else {
                    info!(
                        bytes = len,
                        "kvtransfer: UCX allocated the KV pool outside shared memory (no \
                         sysv/posix transport): writers on this machine put into it"
                    );
                }
                Ok(memory)
            }
            Err(e) => {
                warn!(error = %e, bytes = len, "kvtransfer: UCX could not allocate the KV pool; \
                      using the heap");
                Ok(HostMemory::zeroed(len))
            }
        }
    }

    async fn register(&self, region: Arc<dyn KvRegion>) -> Result<Registration, TransferError> {
        let key = self.shared.registry.insert(region);
        let entry = self.shared.registry.get(key)?;
        let mapped = self
            .shared
            .main
            .call(|done| Cmd::Register { key, entry, done })
            .await;
        if let Err(e) = mapped {
            let _ = self.shared.registry.remove(key);
            return Err(e);
        }
        Ok(Registration {
            transport: "ucx",
            address: self.shared.address.clone(),
            key,
        })
    }

    async fn deregister(&self, key: RemoteKey) -> Result<(), TransferError> {
        self.shared.registry.remove(key)?;
        self.shared
            .main
            .call(|done| Cmd::Deregister { key, done })
            .await
    }

    async fn connect(
        &self,
        address: &str,
        key: RemoteKey,
        fence: Fence,
        writer_layout: &KvLayoutDesc,
    ) -> Result<Box<dyn RemoteWriter>, TransferError> {
        let worker_address = address
            .strip_prefix(ADDRESS_PREFIX)
            .and_then(unhex)
            .filter(|a| !a.is_empty())
            .ok_or_else(|| {
                TransferError::Protocol(format!(
                    "a UCX address is {ADDRESS_PREFIX:?} and a hex-encoded worker address, got {:?}",
                    address.chars().take(40).collect::<String>()
                ))
            })?;
        let hello = TransferHello {
            layout: Some(writer_layout.into()),
            remote_key: key.0,
            trace_context: ferry_proto::trace_ctx::to_carrier(&tracing::Span::current()),
            cluster_token: self
                .shared
                .token
                .as_ref()
                .map(|t| t.expose().to_string())
                .unwrap_or_default(),
            fence: fence.0,
        };
        // One connection per lane, their hellos in flight together.
        let extra = self.shared.extra_lanes().await?;
        let mut writer = UcxWriter {
            shared: self.shared.clone(),
            extra,
            conns: Vec::new(),
            remote: *writer_layout,
            from_device: Vec::new(),
            failed: false,
        };
        let (mut pending, mut first_error) = (Vec::with_capacity(self.shared.lanes), None);
        for lane in 0..self.shared.lanes {
            let rx = writer.lane(lane).ask(|done| Cmd::Connect {
                address: worker_address.clone(),
                hello: hello.clone(),
                key,
                writer_layout: *writer_layout,
                done,
            });
            match rx {
                Ok(rx) => pending.push((lane, rx)),
                Err(e) => {
                    first_error = Some(e);
                    break;
                }
            }
        }
        // Every reply is awaited (by one deadline) so that no lane's connection is left open
        // behind an error; dropping `writer` closes those that opened.
        let deadline = tokio::time::Instant::now() + CONNECT_TIMEOUT;
        for (lane, rx) in pending {
            match reply_by(rx, deadline, CONNECT_TIMEOUT, "connect").await {
                Ok((conn, remote, from_device)) => {
                    if writer.conns.is_empty() {
                        (writer.remote, writer.from_device) = (remote, from_device);
                    } else if remote != writer.remote || from_device != writer.from_device {
                        first_error.get_or_insert(TransferError::Protocol(
                            "the receiver described its region differently to two lanes".into(),
                        ));
                    }
                    writer.conns.push((lane, conn));
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(Box::new(writer)),
        }
    }
}

/// One transfer's writer: a connection on each lane, puts (or staged messages) on the lanes'
/// progress threads.
struct UcxWriter {
    shared: Arc<Shared>,
    /// Lanes 1.. (empty with one lane).
    extra: Arc<[Lane]>,
    /// (lane, connection) for every lane, in lane order: layer `l` goes over
    /// `conns[l % conns.len()]`.
    conns: Vec<(usize, u64)>,
    remote: KvLayoutDesc,
    /// Per destination layer: puts from this process's device memory land there.
    from_device: Vec<bool>,
    failed: bool,
}

impl UcxWriter {
    fn lane(&self, lane: usize) -> &Lane {
        match lane.checked_sub(1) {
            None => &self.shared.main,
            Some(i) => &self.extra[i],
        }
    }

    /// Sends `make(conn)` to the lane that carries `layer`'s writes.
    fn post(&mut self, layer: u32, make: impl FnOnce(u64) -> Cmd) -> Result<(), TransferError> {
        let Some(&(lane, conn)) = self.conns.get(layer as usize % self.conns.len().max(1)) else {
            return Err(TransferError::Closed);
        };
        let r = self.lane(lane).send(make(conn));
        self.failed = r.is_err();
        r
    }
}

#[async_trait]
impl RemoteWriter for UcxWriter {
    async fn write(&mut self, batch: WriteBatch) -> Result<(), TransferError> {
        if self.failed {
            return Err(TransferError::Closed);
        }
        batch.validate(&self.remote)?;
        // Posted without waiting for the progress thread, as device batches are: the batch is
        // checked above, and an error there fails the connection, reported by the next write
        // or flush. Waiting for each batch's reply cost a thread round trip per layer (~40 ms
        // of a 90 ms 8k-token transfer on a 2-core machine, the copies themselves ~50 ms).
        self.post(batch.layer, |conn| Cmd::Write { conn, batch })
    }

    /// Copies into a mapped pool and puts read the rows on the progress thread as they come.
    fn reads_in_place(&self) -> bool {
        true
    }

    fn puts_from_device(&self, layer: u32) -> bool {
        self.from_device
            .get(layer as usize)
            .copied()
            .unwrap_or(false)
    }

    async fn write_device(&mut self, batch: DeviceBatch) -> Result<(), TransferError> {
        if self.failed {
            return Err(TransferError::Closed);
        }
        batch.validate(&self.remote)?;
        if !self.puts_from_device(batch.layer) {
            return Err(TransferError::Protocol(format!(
                "destination layer {} does not take puts from device memory",
                batch.layer
            )));
        }
        // Posted without waiting for the progress thread (device batches are checked above
        // and need no copy): the puts of consecutive layers go out back to back, and an error
        // there fails the connection, reported by the next flush.
        self.post(batch.layer, |conn| Cmd::WriteDevice { conn, batch })
    }

    /// Flushes every lane at once; the bytes the receiver acknowledged, summed.
    async fn flush(&mut self) -> Result<u64, TransferError> {
        if self.failed {
            return Err(TransferError::Closed);
        }
        let mut pending = Vec::with_capacity(self.conns.len());
        for &(lane, conn) in &self.conns {
            match self.lane(lane).ask(|done| Cmd::Flush { conn, done }) {
                Ok(rx) => pending.push(rx),
                Err(e) => {
                    self.failed = true;
                    return Err(e);
                }
            }
        }
        let deadline = tokio::time::Instant::now() + FLUSH_TIMEOUT;
        let (mut bytes, mut first_error) = (0, None);
        for rx in pending {
            match reply_by(rx, deadline, FLUSH_TIMEOUT, "flush").await {
                Ok(b) => bytes += b,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => {
                self.failed = true;
                Err(e)
            }
            None => Ok(bytes),
        }
    }
}

impl Drop for UcxWriter {
    fn drop(&mut self) {
        for &(lane, conn) in &self.conns {
            let _ = self.lane(lane).send(Cmd::Close { conn });
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        let b = vec![0u8, 1, 0xab, 0xff];
        assert_eq!(unhex(&hex(&b)), Some(b));
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("zz"), None);
    }

    #[test]
    fn lanes_come_from_the_variable_or_are_two() {
        assert_eq!(lanes_from(None).unwrap(), DEFAULT_LANES);
        assert_eq!(DEFAULT_LANES, 2);
        assert_eq!(lanes_from(Some("1".into())).unwrap(), 1);
        assert_eq!(lanes_from(Some(" 4 ".into())).unwrap(), 4);
        assert_eq!(lanes_from(Some("16".into())).unwrap(), MAX_LANES);
        for bad in ["0", "17", "two", ""] {
            let e = lanes_from(Some(bad.into())).unwrap_err().to_string();
            assert!(e.contains(&format!("{LANES_VAR}={bad}")), "{e}");
        }
    }

    #[test]
    fn memory_units_parse_as_ucx_writes_them() {
        assert_eq!(parse_memunits("8256"), Some(8256));
        assert_eq!(parse_memunits("64k"), Some(65536));
        assert_eq!(parse_memunits(" 1M "), Some(1 << 20));
        assert_eq!(parse_memunits("2mb"), Some(2 << 20));
        assert_eq!(parse_memunits("auto"), None);
        assert_eq!(parse_memunits(""), None);
    }

    /// The environment `pairs` sets, as `check_segment_settings` reads it.
    fn env_of<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn a_segment_size_ucx_would_corrupt_is_refused_by_name() {
        assert!(check_segment_settings(env_of(&[])).is_ok());
        assert!(check_segment_settings(env_of(&[("UCX_MM_SEG_SIZE", "49152")])).is_ok());
        assert!(check_segment_settings(env_of(&[("UCX_POSIX_SEG_SIZE", "65535")])).is_ok());
        for (name, value) in [
            ("UCX_MM_SEG_SIZE", "65536"),
            ("UCX_SYSV_SEG_SIZE", "256k"),
            ("UCX_POSIX_SEG_SIZE", "1m"),
        ] {
            let err = check_segment_settings(env_of(&[(name, value)]))
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("{name}={value}")), "{err}");
            assert!(err.contains("65535"), "{err}");
        }
    }
}
