//! Receiver side: the one listener task and a task per accepted connection, applying data
//! frames to the registered region in order.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_proto::auth::ClusterToken;
use ferry_proto::internal::{TransferFlushAck, TransferHello, TransferHelloAck};
use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::{debug, field, info_span, warn, Instrument};

use super::frame::{
    read_control, read_header, unexpected, write_control, DATA_HEADER, TAG_DATA, TAG_FAILURE,
    TAG_FLUSH, TAG_FLUSH_ACK, TAG_HELLO, TAG_HELLO_ACK,
};
use crate::registry::{Access, Entry, Registry};
use crate::wire::to_failure;
use crate::{check_compatible, Fence, KvLayoutDesc, RemoteKey, TransferError};

/// Receive buffer of a connection.
const READ_BUFFER: usize = 256 << 10;

/// What every connection of one listener checks hellos against.
#[derive(Clone)]
pub(super) struct Accepting {
    pub(super) registry: Arc<Registry>,
    /// The cluster token a hello must carry; `None` accepts any writer.
    pub(super) token: Option<ClusterToken>,
}

pub(super) async fn accept_loop(
    listener: TcpListener,
    accepting: Accepting,
    cancel: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let accepting = accepting.clone();
                let cancel = cancel.child_token();
                tokio::spawn(async move {
                    tokio::select! {
                        () = cancel.cancelled() => {}
                        () = serve_connection(stream, peer, &accepting) => {}
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

async fn serve_connection(stream: TcpStream, peer: SocketAddr, accepting: &Accepting) {
    if let Err(e) = stream.set_nodelay(true) {
        debug!(%peer, error = %e, "kvtransfer: set_nodelay failed");
    }
    let mut conn = BufReader::with_capacity(READ_BUFFER, stream);
    match receive(&mut conn, accepting).await {
        Ok(applied) => debug!(%peer, applied, "kvtransfer: connection closed"),
        Err(e) => warn!(%peer, kind = e.kind(), error = %e, "kvtransfer: connection failed"),
    }
}

type Conn = BufReader<TcpStream>;

/// What one connection delivered, for its span.
struct Received {
    bytes: u64,
    blocks: u64,
    /// Which layers had at least one block.
    layers: Vec<bool>,
}

/// Runs one connection: handshake, then data and flush frames until the writer hangs up, in a
/// `kv_receive` span whose parent is the writer's span (from the hello's trace context).
/// Returns the bytes applied.
async fn receive(conn: &mut Conn, accepting: &Accepting) -> Result<u64, TransferError> {
    let Some((entry, key, fence, trace)) = accept_hello(conn, accepting).await? else {
        return Ok(0);
    };
    let span = info_span!(
        "kv_receive",
        otel.kind = "server",
        ferry.kv_transfer.transport = "tcp",
        ferry.kv_transfer.bytes = field::Empty,
        ferry.kv_transfer.blocks = field::Empty,
        ferry.kv_transfer.layers = field::Empty,
    );
    ferry_proto::trace_ctx::set_parent_from_carrier(&span, &trace);
    let mut got = Received {
        bytes: 0,
        blocks: 0,
        layers: vec![false; entry.layout.num_layers as usize],
    };
    let result = receive_data(conn, &entry, key, fence, &mut got)
        .instrument(span.clone())
        .await;
    // Signed: `tracing` hands unsigned fields to OpenTelemetry as strings.
    let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    span.record("ferry.kv_transfer.bytes", int(got.bytes));
    span.record("ferry.kv_transfer.blocks", int(got.blocks));
    let layers = got.layers.iter().filter(|&&l| l).count() as u64;
    span.record("ferry.kv_transfer.layers", int(layers));
    if let Err(e) = &result {
        ferry_proto::trace_ctx::set_error(&span, e.to_string());
    }
    result
}

async fn receive_data(
    conn: &mut Conn,
    entry: &Entry,
    key: RemoteKey,
    fence: Fence,
    got: &mut Received,
) -> Result<u64, TransferError> {
    let mut buf = Vec::new();
    loop {
        let Some((tag, len)) = read_header(conn).await? else {
            return Ok(got.bytes);
        };
        let outcome = match tag {
            TAG_DATA => apply_data(conn, entry, Access { key, fence }, len, &mut buf).await,
            TAG_FLUSH if len == 0 => {
                let ack = TransferFlushAck {
                    bytes_applied: got.bytes,
                };
                write_control(conn.get_mut(), TAG_FLUSH_ACK, &ack).await?;
                continue;
            }
            other => Err(unexpected(other, len, "a data or flush frame")),
        };
        match outcome {
            Ok((layer, n)) => {
                got.bytes += n;
                got.blocks += 1;
                if let Some(seen) = got.layers.get_mut(layer as usize) {
                    *seen = true;
                }
            }
            Err(e @ TransferError::Io(_)) => return Err(e),
            Err(e) => {
                fail(conn, &e).await;
                return Err(e);
            }
        }
    }
}

/// The region a hello names, its key, the writer's fence and trace context.
type Accepted = (Arc<Entry>, RemoteKey, Fence, HashMap<String, String>);

/// Reads the hello, answers it, and returns the region on success (`None`: the peer hung up).
/// The cluster token is checked first, so an outsider learns nothing about the regions.
async fn accept_hello(
    conn: &mut Conn,
    accepting: &Accepting,
) -> Result<Option<Accepted>, TransferError> {
    let Some((tag, len)) = read_header(conn).await? else {
        return Ok(None);
    };
    if tag != TAG_HELLO {
        return Err(unexpected(tag, len, "a hello"));
    }
    let hello: TransferHello = read_control(conn, len, "TransferHello").await?;
    if let Some(token) = &accepting.token {
        if !token.matches(hello.cluster_token.as_bytes()) {
            let e = TransferError::Unauthenticated;
            reject(conn, &e, None).await?;
            return Err(e);
        }
    }
    let key = RemoteKey(hello.remote_key);
    let entry = match accepting.registry.get(key) {
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
        memory: Vec::new(),
        session: 0,
    };
    write_control(conn.get_mut(), TAG_HELLO_ACK, &ack).await?;
    Ok(Some((entry, key, Fence(hello.fence), hello.trace_context)))
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
        memory: Vec::new(),
        session: 0,
    };
    write_control(conn.get_mut(), TAG_HELLO_ACK, &ack).await
}

/// Applies one data frame whose `u32 layer | u32 block` header and payload follow; returns the
/// layer and the payload length.
async fn apply_data(
    conn: &mut Conn,
    entry: &Entry,
    access: Access,
    len: u32,
    buf: &mut Vec<u8>,
) -> Result<(u32, u64), TransferError> {
    let Some(payload) = len.checked_sub(DATA_HEADER) else {
        return Err(TransferError::Protocol(format!(
            "data frame body of {len} bytes is shorter than its {DATA_HEADER}-byte header"
        )));
    };
    let layer = conn.read_u32().await?;
    let block = conn.read_u32().await?;
    let payload = payload as usize;
    // A host layer's blocks are admitted first and read straight into the region; others go
    // through a buffer to `KvRegion::write` (the run was checked against the layout and the
    // registration either way, so the buffer's size is bounded).
    if let Some(dst) = entry.host_destination(access, layer, block, payload)? {
        conn.read_exact(dst).await?;
        return Ok((layer, payload as u64));
    }
    buf.resize(payload, 0);
    conn.read_exact(buf).await?;
    entry.land(access, layer, block, buf)?;
    Ok((layer, payload as u64))
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
