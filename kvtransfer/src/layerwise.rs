//! Layer-wise streaming: the prefill engine hands over each layer's blocks as soon as that layer
//! is computed, so the transfer of layer `l` overlaps the compute of layer `l + 1`.
//!
//! ```text
//!  engine std::thread                  tokio task (owns the RemoteWriter)
//!  sink.send(layer 0) ──┐  unbounded   ┌─► writer.write(layer 0)
//!  sink.send(layer 1) ──┼──  mpsc  ────┼─► writer.write(layer 1)      (in order)
//!  ...                  │              │
//!  finish(sink) ── Finish marker ──────┴─► writer.flush() ─► total bytes ─► finish returns
//! ```
//!
//! [`LayerSink::send`] never blocks and never awaits, so the engine thread never waits on the
//! network; memory in flight is bounded by the prompt's KV, which the engine already holds. The
//! first error stops the task: [`LayerStreamer::finish`] reports it and later sends return
//! [`TransferError::Closed`]. Dropping the [`LayerStreamer`] without finishing aborts the task
//! and closes the connection (a cancelled request leaves nothing running).

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::{DeviceBatch, RemoteWriter, TransferError, WriteBatch};

enum Msg {
    Batch(WriteBatch),
    Device(DeviceBatch),
    Finish,
}

/// Cheap, cloneable handle the engine thread sends finished layers through.
#[derive(Clone)]
pub struct LayerSink {
    tx: mpsc::UnboundedSender<Msg>,
}

impl LayerSink {
    /// Queues `batch` for sending; returns at once (callable from any thread, no runtime
    /// needed). [`TransferError::Closed`] once the streamer has failed, finished or been dropped.
    pub fn send(&self, batch: WriteBatch) -> Result<(), TransferError> {
        self.tx
            .send(Msg::Batch(batch))
            .map_err(|_| TransferError::Closed)
    }

    /// Queues a batch read from device memory, like [`LayerSink::send`]; only for a writer
    /// that [puts from device memory](crate::RemoteWriter::puts_from_device) into that layer.
    /// The batch (and so its source's lease) is dropped once written, or when refused.
    pub fn send_device(&self, batch: DeviceBatch) -> Result<(), TransferError> {
        self.tx
            .send(Msg::Device(batch))
            .map_err(|_| TransferError::Closed)
    }

    /// True once sends can no longer succeed (the streamer failed, finished or was dropped):
    /// lets the engine stop producing early.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

impl std::fmt::Debug for LayerSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerSink")
            .field("closed", &self.is_closed())
            .finish()
    }
}

/// Owns the task that writes queued batches, in order, through one [`RemoteWriter`].
pub struct LayerStreamer {
    tx: mpsc::UnboundedSender<Msg>,
    task: Option<JoinHandle<Result<u64, TransferError>>>,
}

impl LayerStreamer {
    /// Spawns the writing task on the current tokio runtime (panics outside one, like
    /// `tokio::spawn`) and returns the sink to feed it and the handle to finish it.
    pub fn spawn(writer: Box<dyn RemoteWriter>) -> (LayerSink, LayerStreamer) {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(writer, rx));
        (
            LayerSink { tx: tx.clone() },
            LayerStreamer {
                tx,
                task: Some(task),
            },
        )
    }

    /// Drops `sink`, waits until every batch sent before this call is written, flushes, and
    /// returns the total bytes landed; or the first error. Batches sent through other clones
    /// after this call are refused with [`TransferError::Closed`].
    pub async fn finish(mut self, sink: LayerSink) -> Result<u64, TransferError> {
        drop(sink);
        // A send error means the task already ended (with an error); the join reports it.
        let _ = self.tx.send(Msg::Finish);
        let Some(task) = self.task.take() else {
            return Err(TransferError::Closed);
        };
        match task.await {
            Ok(result) => result,
            Err(e) => Err(TransferError::Protocol(format!(
                "layer streamer task failed: {e}"
            ))),
        }
    }
}

impl Drop for LayerStreamer {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl std::fmt::Debug for LayerStreamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerStreamer")
            .field("running", &self.task.is_some())
            .finish()
    }
}

async fn run(
    mut writer: Box<dyn RemoteWriter>,
    mut rx: mpsc::UnboundedReceiver<Msg>,
) -> Result<u64, TransferError> {
    while let Some(msg) = rx.recv().await {
        match msg {
            Msg::Batch(batch) => {
                if let Err(e) = writer.write(batch).await {
                    // Refuse further sends right away, not when the receiver is dropped.
                    rx.close();
                    return Err(e);
                }
            }
            Msg::Device(batch) => {
                if let Err(e) = writer.write_device(batch).await {
                    rx.close();
                    return Err(e);
                }
            }
            Msg::Finish => {
                rx.close();
                return writer.flush().await;
            }
        }
    }
    Err(TransferError::Closed)
}
