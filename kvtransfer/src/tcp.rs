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
//! | 1 | hello | writer → receiver | `TransferHello` (writer layout, remote key) |
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
//!  data(l, b, bytes) ────────────────────►  check, region.write(l, b, bytes)
//!  ...                                      ...
//!  flush ────────────────────────────────►  (every earlier frame is applied)
//!                     ◄───────────────────  flush ack(total bytes)
//! ```
//!
//! Writes are applied on the receiving task, in order, by calling [`KvRegion::write`], which
//! therefore must be cheap and non-blocking. On a bad frame or a refused write the receiver
//! sends one failure frame, stops applying writes and discards the rest of the stream until the
//! writer hangs up (so the writer reads the failure, not a connection reset); the writer sees it
//! before its next write or at its flush. The listener and other connections are unaffected.
//!
//! Sockets use `TCP_NODELAY`. Payloads go out in `write_all` calls of at most [`MAX_WRITE`]
//! bytes (single very large socket writes perform badly; see the UCX notes in
//! `environment.md`); the receiver reads each block into one reused buffer.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ferry_proto::internal::{TransferFailure, TransferFlushAck, TransferHello, TransferHelloAck};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::registry::{Entry, Registry};
use crate::{
    check_compatible, check_write, KvLayoutDesc, KvRegion, Registration, RemoteKey, RemoteWriter,
    TransferError, Transport, WriteBatch,
};

/// Largest single socket write of payload bytes (4 MiB).
pub const MAX_WRITE: usize = 4 << 20;

const TAG_HELLO: u8 = 1;
const TAG_HELLO_ACK: u8 = 2;
const TAG_DATA: u8 = 3;
const TAG_FLUSH: u8 = 4;
const TAG_FLUSH_ACK: u8 = 5;
const TAG_FAILURE: u8 = 6;

/// Largest protobuf control frame body either side accepts.
const MAX_CONTROL_FRAME: u32 = 64 << 10;
/// Data frame body before the payload: `u32 layer`, `u32 block`.
const DATA_HEADER: u32 = 8;
/// Receive buffer of a connection.
const READ_BUFFER: usize = 256 << 10;

/// TCP transport; see the module docs for the protocol.
///
/// Dropping it stops the listener and closes every connection it accepted.
pub struct TcpTransport {
    registry: Arc<Registry>,
    listener: Option<Listener>,
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
        let task = runtime.spawn(accept_loop(listener, registry.clone(), cancel.clone()));
        debug!(%local_addr, "kvtransfer: tcp listener started");
        Ok(TcpTransport {
            registry,
            listener: Some(Listener {
                local_addr,
                advertised: local_addr.to_string(),
                cancel,
                _task: task,
            }),
        })
    }

    /// A transport that only connects to others: no listener, `register` fails.
    pub fn client() -> Self {
        TcpTransport {
            registry: Arc::new(Registry::new()),
            listener: None,
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
        writer_layout: &KvLayoutDesc,
    ) -> Result<Box<dyn RemoteWriter>, TransferError> {
        let mut stream = TcpStream::connect(address).await?;
        stream.set_nodelay(true)?;
        let hello = TransferHello {
            layout: Some(writer_layout.into()),
            remote_key: key.0,
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
        let remote = ack
            .layout
            .as_ref()
            .map(KvLayoutDesc::try_from)
            .transpose()?;
        if !ack.error.is_empty() {
            return Err(refusal(&ack, key, writer_layout, remote));
        }
        let remote = remote.ok_or_else(|| {
            TransferError::Protocol("TransferHelloAck: `layout` is missing".into())
        })?;
        check_compatible(writer_layout, &remote)?;
        debug!(address, %key, "kvtransfer: tcp writer connected");
        Ok(Box::new(TcpWriter {
            stream,
            key,
            remote,
            sent: 0,
            wbuf: Vec::new(),
            failed: false,
        }))
    }
}

/// Rebuilds the receiver's refusal as the error the writer would have computed itself.
fn refusal(
    ack: &TransferHelloAck,
    key: RemoteKey,
    writer_layout: &KvLayoutDesc,
    remote: Option<KvLayoutDesc>,
) -> TransferError {
    match (ack.kind.as_str(), remote) {
        ("unknown_region", _) => TransferError::UnknownRegion(key),
        ("layout_mismatch", Some(remote)) => check_compatible(writer_layout, &remote)
            .err()
            .unwrap_or_else(|| TransferError::Protocol(ack.error.clone())),
        (kind, _) => TransferError::Protocol(format!(
            "receiver refused the connection ({kind}): {}",
            ack.error
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Writer side.

/// One connection writing into one remote region.
struct TcpWriter {
    stream: TcpStream,
    key: RemoteKey,
    /// The destination's layout, from the hello ack: every batch is checked against it.
    remote: KvLayoutDesc,
    /// Block bytes sent so far.
    sent: u64,
    /// Reused frame buffer.
    wbuf: Vec<u8>,
    failed: bool,
}

impl TcpWriter {
    async fn send_batch(&mut self, batch: &WriteBatch) -> Result<(), TransferError> {
        self.check_incoming().await?;
        let mut wbuf = std::mem::take(&mut self.wbuf);
        wbuf.clear();
        for w in &batch.writes {
            let header = data_header(batch.layer, w.block, w.data.len())?;
            if !wbuf.is_empty() && wbuf.len() + header.len() + w.data.len() > MAX_WRITE {
                self.stream.write_all(&wbuf).await?;
                wbuf.clear();
            }
            wbuf.extend_from_slice(&header);
            if w.data.len() <= MAX_WRITE {
                wbuf.extend_from_slice(&w.data);
            } else {
                self.stream.write_all(&wbuf).await?;
                wbuf.clear();
                for chunk in w.data.chunks(MAX_WRITE) {
                    self.stream.write_all(chunk).await?;
                }
            }
        }
        if !wbuf.is_empty() {
            self.stream.write_all(&wbuf).await?;
        }
        self.wbuf = wbuf;
        Ok(())
    }

    /// Without waiting: has the receiver sent a failure (or hung up) since the last call?
    async fn check_incoming(&mut self) -> Result<(), TransferError> {
        let mut first = [0u8; 64];
        match self.stream.try_read(&mut first) {
            Ok(0) => Err(TransferError::Closed),
            Ok(n) => {
                let head = first.get(..n).unwrap_or_default();
                let mut reader = head.chain(&mut self.stream);
                Err(read_failure(&mut reader, self.key).await)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn flush_inner(&mut self) -> Result<u64, TransferError> {
        let mut frame = [0u8; 5];
        frame[..4].copy_from_slice(&1u32.to_be_bytes());
        frame[4] = TAG_FLUSH;
        self.stream.write_all(&frame).await?;
        let Some((tag, len)) = read_header(&mut self.stream).await? else {
            return Err(TransferError::Closed);
        };
        match tag {
            TAG_FLUSH_ACK => {
                let ack: TransferFlushAck =
                    read_control(&mut self.stream, len, "TransferFlushAck").await?;
                if ack.bytes_applied != self.sent {
                    return Err(TransferError::Protocol(format!(
                        "flush ack reports {} bytes applied, {} were sent",
                        ack.bytes_applied, self.sent
                    )));
                }
                Ok(self.sent)
            }
            TAG_FAILURE => Err(failure_body(&mut self.stream, len, self.key).await),
            other => Err(unexpected(other, len, "a flush ack")),
        }
    }
}

#[async_trait]
impl RemoteWriter for TcpWriter {
    async fn write(&mut self, batch: WriteBatch) -> Result<(), TransferError> {
        if self.failed {
            return Err(TransferError::Closed);
        }
        batch.validate(&self.remote)?;
        if let Err(e) = self.send_batch(&batch).await {
            self.failed = true;
            return Err(e);
        }
        self.sent += batch.bytes();
        Ok(())
    }

    async fn flush(&mut self) -> Result<u64, TransferError> {
        if self.failed {
            return Err(TransferError::Closed);
        }
        let result = self.flush_inner().await;
        if result.is_err() {
            self.failed = true;
        }
        result
    }
}

/// Reads one frame that must be a failure and turns it into the error it reports.
async fn read_failure<R: AsyncRead + Unpin>(r: &mut R, key: RemoteKey) -> TransferError {
    match read_header(r).await {
        Ok(Some((TAG_FAILURE, len))) => failure_body(r, len, key).await,
        Ok(Some((tag, len))) => unexpected(tag, len, "a failure"),
        Ok(None) => TransferError::Closed,
        Err(e) => e,
    }
}

async fn failure_body<R: AsyncRead + Unpin>(r: &mut R, len: u32, key: RemoteKey) -> TransferError {
    match read_control::<TransferFailure, _>(r, len, "TransferFailure").await {
        Ok(f) => from_failure(f, key),
        Err(e) => e,
    }
}

fn from_failure(f: TransferFailure, key: RemoteKey) -> TransferError {
    match f.kind.as_str() {
        "out_of_range" => TransferError::OutOfRange {
            layer: f.layer,
            block: f.block,
            len: usize::try_from(f.len).unwrap_or(usize::MAX),
        },
        "unknown_region" => TransferError::UnknownRegion(key),
        "region" => TransferError::Region(f.message),
        "closed" => TransferError::Closed,
        kind => TransferError::Protocol(format!("receiver failed ({kind}): {}", f.message)),
    }
}

fn to_failure(e: &TransferError) -> TransferFailure {
    let mut f = TransferFailure {
        kind: e.kind().to_owned(),
        ..TransferFailure::default()
    };
    match e {
        TransferError::OutOfRange { layer, block, len } => {
            f.layer = *layer;
            f.block = *block;
            f.len = *len as u64;
            f.message = e.to_string();
        }
        TransferError::Region(m) | TransferError::Protocol(m) => f.message = m.clone(),
        other => f.message = other.to_string(),
    }
    f
}

fn data_header(layer: u32, block: u32, len: usize) -> Result<[u8; 13], TransferError> {
    let frame_len = u32::try_from(len)
        .ok()
        .and_then(|n| n.checked_add(1 + DATA_HEADER))
        .ok_or_else(|| {
            TransferError::Protocol(format!(
                "a block of {len} bytes does not fit one data frame (max {} bytes)",
                u32::MAX - 1 - DATA_HEADER
            ))
        })?;
    let mut h = [0u8; 13];
    h[..4].copy_from_slice(&frame_len.to_be_bytes());
    h[4] = TAG_DATA;
    h[5..9].copy_from_slice(&layer.to_be_bytes());
    h[9..13].copy_from_slice(&block.to_be_bytes());
    Ok(h)
}

// ---------------------------------------------------------------------------------------------
// Receiver side.

async fn accept_loop(listener: TcpListener, registry: Arc<Registry>, cancel: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let registry = registry.clone();
                let cancel = cancel.child_token();
                tokio::spawn(async move {
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        () = serve_connection(stream, peer, &registry) => {}
                    }
                });
            }
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning.
                warn!(error = %e, "kvtransfer: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn serve_connection(stream: TcpStream, peer: SocketAddr, registry: &Registry) {
    if let Err(e) = stream.set_nodelay(true) {
        debug!(%peer, error = %e, "kvtransfer: set_nodelay failed");
    }
    let mut conn = BufReader::with_capacity(READ_BUFFER, stream);
    match receive(&mut conn, registry).await {
        Ok(applied) => debug!(%peer, applied, "kvtransfer: connection closed"),
        Err(e) => warn!(%peer, kind = e.kind(), error = %e, "kvtransfer: connection failed"),
    }
}

type Conn = BufReader<TcpStream>;

/// Runs one connection: handshake, then data and flush frames until the writer hangs up.
/// Returns the bytes applied.
async fn receive(conn: &mut Conn, registry: &Registry) -> Result<u64, TransferError> {
    let Some((entry, key)) = accept_hello(conn, registry).await? else {
        return Ok(0);
    };
    let mut applied: u64 = 0;
    let mut buf = Vec::new();
    loop {
        let Some((tag, len)) = read_header(conn).await? else {
            return Ok(applied);
        };
        let outcome = match tag {
            TAG_DATA => apply_data(conn, &entry, key, len, &mut buf).await,
            TAG_FLUSH if len == 0 => {
                let ack = TransferFlushAck {
                    bytes_applied: applied,
                };
                write_control(conn.get_mut(), TAG_FLUSH_ACK, &ack).await?;
                continue;
            }
            other => Err(unexpected(other, len, "a data or flush frame")),
        };
        match outcome {
            Ok(n) => applied += n,
            Err(e @ TransferError::Io(_)) => return Err(e),
            Err(e) => {
                fail(conn, &e).await;
                return Err(e);
            }
        }
    }
}

/// Reads the hello, answers it, and returns the region on success (`None`: the peer hung up).
async fn accept_hello(
    conn: &mut Conn,
    registry: &Registry,
) -> Result<Option<(Arc<Entry>, RemoteKey)>, TransferError> {
    let Some((tag, len)) = read_header(conn).await? else {
        return Ok(None);
    };
    if tag != TAG_HELLO {
        return Err(unexpected(tag, len, "a hello"));
    }
    let hello: TransferHello = read_control(conn, len, "TransferHello").await?;
    let key = RemoteKey(hello.remote_key);
    let entry = match registry.get(key) {
        Ok(entry) => entry,
        Err(e) => {
            reject(conn, &e, None).await?;
            return Err(e);
        }
    };
    let verdict = hello
        .layout
        .as_ref()
        .ok_or_else(|| TransferError::Protocol("TransferHello: `layout` is missing".into()))
        .and_then(KvLayoutDesc::try_from)
        .and_then(|theirs| check_compatible(&entry.layout, &theirs));
    if let Err(e) = verdict {
        reject(conn, &e, Some(&entry.layout)).await?;
        return Err(e);
    }
    let ack = TransferHelloAck {
        error: String::new(),
        layout: Some(entry.layout.into()),
        kind: String::new(),
    };
    write_control(conn.get_mut(), TAG_HELLO_ACK, &ack).await?;
    Ok(Some((entry, key)))
}

async fn reject(
    conn: &mut Conn,
    e: &TransferError,
    layout: Option<&KvLayoutDesc>,
) -> Result<(), TransferError> {
    let ack = TransferHelloAck {
        error: e.to_string(),
        layout: layout.map(Into::into),
        kind: e.kind().to_owned(),
    };
    write_control(conn.get_mut(), TAG_HELLO_ACK, &ack).await
}

/// Applies one data frame whose `u32 layer | u32 block` header and payload follow; returns the
/// payload length.
async fn apply_data(
    conn: &mut Conn,
    entry: &Entry,
    key: RemoteKey,
    len: u32,
    buf: &mut Vec<u8>,
) -> Result<u64, TransferError> {
    let Some(payload) = len.checked_sub(DATA_HEADER) else {
        return Err(TransferError::Protocol(format!(
            "data frame body of {len} bytes is shorter than its {DATA_HEADER}-byte header"
        )));
    };
    let layer = conn.read_u32().await?;
    let block = conn.read_u32().await?;
    let payload = payload as usize;
    check_write(&entry.layout, layer, block, payload)?;
    if !entry.is_live() {
        return Err(TransferError::UnknownRegion(key));
    }
    buf.resize(payload, 0);
    conn.read_exact(buf).await?;
    entry.region.write(layer, block, buf)?;
    Ok(payload as u64)
}

/// Tells the writer why this connection stopped applying writes, then discards its stream until
/// it hangs up, so it reads the failure instead of a connection reset.
async fn fail(conn: &mut Conn, e: &TransferError) {
    if write_control(conn.get_mut(), TAG_FAILURE, &to_failure(e))
        .await
        .is_ok()
    {
        let _ = tokio::io::copy(conn, &mut tokio::io::sink()).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Framing shared by both sides.

/// Reads a frame header: `Some((tag, body length))`, or `None` on a clean end of stream.
async fn read_header<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<(u8, u32)>, TransferError> {
    let mut hdr = [0u8; 5];
    let n = r.read(&mut hdr).await?;
    if n == 0 {
        return Ok(None);
    }
    if let Some(rest) = hdr.get_mut(n..) {
        r.read_exact(rest).await?;
    }
    let [a, b, c, d, tag] = hdr;
    let len = u32::from_be_bytes([a, b, c, d]);
    let Some(body) = len.checked_sub(1) else {
        return Err(TransferError::Protocol(
            "frame length 0 (it must count the tag byte)".into(),
        ));
    };
    Ok(Some((tag, body)))
}

async fn read_control<M: Message + Default, R: AsyncRead + Unpin>(
    r: &mut R,
    len: u32,
    what: &str,
) -> Result<M, TransferError> {
    if len > MAX_CONTROL_FRAME {
        return Err(TransferError::Protocol(format!(
            "{what} frame of {len} bytes exceeds the {MAX_CONTROL_FRAME}-byte limit"
        )));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await?;
    M::decode(body.as_slice())
        .map_err(|e| TransferError::Protocol(format!("malformed {what}: {e}")))
}

async fn write_control<W: AsyncWrite + Unpin, M: Message>(
    w: &mut W,
    tag: u8,
    msg: &M,
) -> Result<(), TransferError> {
    let body = msg.encode_to_vec();
    let len = u32::try_from(body.len() + 1)
        .map_err(|_| TransferError::Protocol("control frame too large".into()))?;
    let mut frame = Vec::with_capacity(body.len() + 5);
    frame.extend_from_slice(&len.to_be_bytes());
    frame.push(tag);
    frame.extend_from_slice(&body);
    w.write_all(&frame).await?;
    w.flush().await?;
    Ok(())
}

fn unexpected(tag: u8, len: u32, expected: &str) -> TransferError {
    TransferError::Protocol(format!(
        "expected {expected} frame, got tag {tag} with a {len}-byte body"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_round_trip_their_kind() {
        let key = RemoteKey(9);
        let cases = [
            TransferError::OutOfRange {
                layer: 1,
                block: 2,
                len: 3,
            },
            TransferError::Region("pool gone".into()),
            TransferError::UnknownRegion(key),
            TransferError::Closed,
        ];
        for e in cases {
            let back = from_failure(to_failure(&e), key);
            assert_eq!(back.kind(), e.kind());
            assert_eq!(back.to_string(), e.to_string());
        }
    }

    #[tokio::test]
    async fn headers_round_trip_and_eof_is_clean() {
        let h = data_header(5, 6, 7).unwrap();
        let mut r = &h[..];
        assert_eq!(
            read_header(&mut r).await.unwrap(),
            Some((TAG_DATA, DATA_HEADER + 7))
        );
        let mut empty: &[u8] = &[];
        assert_eq!(read_header(&mut empty).await.unwrap(), None);
        let mut zero: &[u8] = &[0, 0, 0, 0, 1];
        assert!(matches!(
            read_header(&mut zero).await,
            Err(TransferError::Protocol(_))
        ));
    }
}
