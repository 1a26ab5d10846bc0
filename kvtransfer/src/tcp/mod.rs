//! The default transport: plain TCP with length-prefixed frames.
//!
//! One [`TcpTransport`] per process binds one listener; its task accepts connections for every
//! region registered on it and spawns one receiving task per connection. Writers connect with
//! [`Transport::connect`] (any `TcpTransport`, including a listener-less [`TcpTransport::client`]).
//!
//! ## Wire format
//!
//! Every frame is `u32 length (big endian) | u8 tag | body`, `length` counting tag and body
//! (the messages are in `proto/ferry/internal/v1/transfer.proto`):
//!
//! | tag | frame | direction | body |
//! |---|---|---|---|
//! | 1 | hello | writer → receiver | `TransferHello` (writer layout, remote key, fence, W3C trace context) |
//! | 2 | hello ack | receiver → writer | `TransferHelloAck` (region layout; error + kind on refusal) |
//! | 3 | data | writer → receiver | `u32 layer`, `u32 block` (big endian), then exactly `block_bytes` raw bytes |
//! | 4 | flush | writer → receiver | empty |
//! | 5 | flush ack | receiver → writer | `TransferFlushAck` (bytes applied on this connection) |
//! | 6 | failure | receiver → writer | `TransferFailure` (kind, message, offending write) |
//!
//! ```text
//!  writer                                   receiver task
//!  hello(layout, key) ───────────────────►  key known? layouts compatible?
//!                     ◄───────────────────  ack(region layout | error, kind)   (refused: close)
//!  data(l, b, bytes) ────────────────────►  check, admit(b, fence), copy into the region's memory
//!  ...                                      ...
//!  flush ────────────────────────────────►  (every earlier frame is applied)
//!                     ◄───────────────────  flush ack(total bytes)
//! ```
//!
//! Writes are applied on the receiving task, in order: each block is checked against the layout
//! and admitted by the region under the hello's fence ([`KvRegion::admit`]), then read into
//! the layer's registered host memory, or passed to [`KvRegion::write`] for a layer the region
//! does not expose in host memory (which therefore must be cheap and non-blocking). On a bad frame or a refused write the receiver
//! sends one failure frame, stops applying writes and discards the rest of the stream until the
//! writer hangs up (so the writer reads the failure, not a connection reset); the writer sees it
//! before its next write or at its flush. The listener and other connections are unaffected.
//!
//! Sockets use `TCP_NODELAY`. A batch's frames go out in vectored writes of at most
//! [`MAX_WRITE`] bytes straight from the batch's buffers (single very large socket writes
//! perform badly; see the UCX notes in `environment.md`). The receiver admits a run's blocks
//! when its header arrives and reads a host layer's payload straight into the region's memory;
//! staged and device layers go through one reused buffer to [`KvRegion::write`].
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`TcpTransport`]: bind, register, connect (the writer half of the handshake) |
//! | `writer.rs` | the [`RemoteWriter`] of one connection |
//! | `receiver.rs` | the listener task and one task per connection |
//! | `frame.rs` | framing, and failures to and from their wire form |

mod frame;
mod receiver;
mod writer;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;
use ferry_proto::auth::ClusterToken;
use ferry_proto::internal::{TransferHello, TransferHelloAck};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::registry::Registry;
use crate::wire::accepted_layout;
use crate::{
    Fence, KvLayoutDesc, KvRegion, Registration, RemoteKey, RemoteWriter, TransferError, Transport,
};
use frame::{read_control, read_header, unexpected, write_control, TAG_HELLO, TAG_HELLO_ACK};

pub use frame::MAX_WRITE;

/// TCP transport; see the module docs for the protocol.
///
/// Dropping it stops the listener and closes every connection it accepted.
pub struct TcpTransport {
    registry: Arc<Registry>,
    listener: Option<Listener>,
    /// Sent in every hello this transport writes; [`TcpTransport::bind_with_token`] makes its
    /// listener refuse hellos without it.
    token: Option<ClusterToken>,
}

struct Listener {
    local_addr: SocketAddr,
    advertised: String,
    cancel: CancellationToken,
    _task: JoinHandle<()>,
}

impl TcpTransport {
    /// Binds `addr` (port 0 picks a free port) and spawns the one listener task on the current
    /// tokio runtime. Registrations advertise the bound address; see
    /// [`TcpTransport::with_advertised_address`] when binding a wildcard address.
    ///
    /// Must be called inside a tokio runtime with I/O enabled (an error otherwise).
    pub fn bind(addr: SocketAddr) -> Result<Self, TransferError> {
        Self::bind_with_token(addr, None)
    }

    /// [`TcpTransport::bind`] whose listener accepts only writers that present `token` (the
    /// cluster token) in their hello, and whose own writers present it.
    pub fn bind_with_token(
        addr: SocketAddr,
        token: Option<ClusterToken>,
    ) -> Result<Self, TransferError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
            TransferError::Io(io::Error::other(format!(
                "TcpTransport::bind needs a tokio runtime: {e}"
            )))
        })?;
        let std_listener = std::net::TcpListener::bind(addr)?;
        std_listener.set_nonblocking(true)?;
        let _entered = runtime.enter();
        let listener = TcpListener::from_std(std_listener)?;
        let local_addr = listener.local_addr()?;
        let registry = Arc::new(Registry::new());
        let cancel = CancellationToken::new();
        let task = runtime.spawn(receiver::accept_loop(
            listener,
            receiver::Accepting {
                registry: registry.clone(),
                token: token.clone(),
            },
            cancel.clone(),
        ));
        debug!(%local_addr, "kvtransfer: tcp listener started");
        Ok(TcpTransport {
            registry,
            listener: Some(Listener {
                local_addr,
                advertised: local_addr.to_string(),
                cancel,
                _task: task,
            }),
            token,
        })
    }

    /// A transport that only connects to others: no listener, `register` fails.
    pub fn client() -> Self {
        Self::client_with_token(None)
    }

    /// [`TcpTransport::client`] presenting `token` (the cluster token) in every hello.
    pub fn client_with_token(token: Option<ClusterToken>) -> Self {
        TcpTransport {
            registry: Arc::new(Registry::new()),
            listener: None,
            token,
        }
    }

    /// Sets the `"host:port"` that registrations return (e.g. the pod IP when bound to
    /// `0.0.0.0`). No effect on a [`TcpTransport::client`].
    pub fn with_advertised_address(mut self, address: impl Into<String>) -> Self {
        if let Some(listener) = &mut self.listener {
            listener.advertised = address.into();
        }
        self
    }

    /// The bound address; `None` for a [`TcpTransport::client`].
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.as_ref().map(|l| l.local_addr)
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        if let Some(listener) = &self.listener {
            listener.cancel.cancel();
        }
    }
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("local_addr", &self.local_addr())
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    async fn register(&self, region: Arc<dyn KvRegion>) -> Result<Registration, TransferError> {
        let Some(listener) = &self.listener else {
            return Err(TransferError::Protocol(
                "this TcpTransport was created with `client()` and has no listener; use `bind`"
                    .into(),
            ));
        };
        let key = self.registry.insert(region);
        Ok(Registration {
            transport: "tcp",
            address: listener.advertised.clone(),
            key,
        })
    }

    async fn deregister(&self, key: RemoteKey) -> Result<(), TransferError> {
        self.registry.remove(key)
    }

    async fn connect(
        &self,
        address: &str,
        key: RemoteKey,
        fence: Fence,
        writer_layout: &KvLayoutDesc,
    ) -> Result<Box<dyn RemoteWriter>, TransferError> {
        let mut stream = TcpStream::connect(address).await?;
        stream.set_nodelay(true)?;
        let hello = TransferHello {
            layout: Some(writer_layout.into()),
            remote_key: key.0,
            // The receiver's `kv_receive` span joins the trace of the span connecting here.
            trace_context: ferry_proto::trace_ctx::to_carrier(&tracing::Span::current()),
            cluster_token: self
                .token
                .as_ref()
                .map(|t| t.expose().to_string())
                .unwrap_or_default(),
            fence: fence.0,
        };
        write_control(&mut stream, TAG_HELLO, &hello).await?;
        let Some((tag, len)) = read_header(&mut stream).await? else {
            return Err(TransferError::Protocol(
                "receiver closed the connection before acknowledging the hello".into(),
            ));
        };
        if tag != TAG_HELLO_ACK {
            return Err(unexpected(tag, len, "a hello ack"));
        }
        let ack: TransferHelloAck = read_control(&mut stream, len, "TransferHelloAck").await?;
        let remote = accepted_layout(&ack, key, writer_layout)?;
        debug!(address, %key, "kvtransfer: tcp writer connected");
        Ok(Box::new(writer::TcpWriter::new(stream, key, remote)))
    }
}
