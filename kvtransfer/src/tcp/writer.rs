//! Writer side of a TCP connection: batches out as data frames, failures and flush acks in.

use std::io::{self, IoSlice};

use async_trait::async_trait;
use ferry_proto::internal::{TransferFailure, TransferFlushAck};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::frame::{
    data_header, read_control, read_header, unexpected, MAX_WRITE, TAG_FAILURE, TAG_FLUSH,
    TAG_FLUSH_ACK,
};
use crate::wire::from_failure;
use crate::{KvLayoutDesc, RemoteKey, RemoteWriter, TransferError, WriteBatch};

/// One connection writing into one remote region.
pub(super) struct TcpWriter {
    stream: TcpStream,
    key: RemoteKey,
    /// The destination's layout, from the hello ack: every batch is checked against it.
    remote: KvLayoutDesc,
    /// Block bytes sent so far.
    sent: u64,
    failed: bool,
}

impl TcpWriter {
    /// A writer on a connection whose handshake succeeded against `remote`.
    pub(super) fn new(stream: TcpStream, key: RemoteKey, remote: KvLayoutDesc) -> Self {
        TcpWriter {
            stream,
            key,
            remote,
            sent: 0,
            failed: false,
        }
    }

    /// Sends the batch's data frames with vectored writes straight from the batch's buffers
    /// (headers and payloads side by side, no copy into a frame buffer), at most
    /// [`MAX_WRITE`] bytes per write call.
    async fn send_batch(&mut self, batch: &WriteBatch) -> Result<(), TransferError> {
        self.check_incoming().await?;
        let headers = batch
            .writes
            .iter()
            .map(|w| data_header(batch.layer, w.block, w.data.len()))
            .collect::<Result<Vec<_>, _>>()?;
        let mut slices: Vec<IoSlice<'_>> = Vec::new();
        let mut pending = 0usize;
        for (header, w) in headers.iter().zip(&batch.writes) {
            slices.push(IoSlice::new(header));
            pending += header.len();
            for piece in w.data.chunks(MAX_WRITE) {
                if pending + piece.len() > MAX_WRITE || slices.len() >= MAX_SLICES {
                    write_all_vectored(&mut self.stream, &mut slices).await?;
                    pending = 0;
                }
                slices.push(IoSlice::new(piece));
                pending += piece.len();
            }
        }
        write_all_vectored(&mut self.stream, &mut slices).await?;
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

/// Slices per vectored write (Linux's `IOV_MAX` is 1,024).
const MAX_SLICES: usize = 512;

/// Writes every byte of `slices`, then empties it.
async fn write_all_vectored(
    stream: &mut TcpStream,
    slices: &mut Vec<IoSlice<'_>>,
) -> io::Result<()> {
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = stream.write_vectored(rest).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut rest, n);
    }
    slices.clear();
    Ok(())
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
