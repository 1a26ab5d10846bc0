//! KV-cache movement between workers: a prefill worker writes a prompt's latent KV blocks,
//! layer by layer, straight into a decode worker's KV pool.
//!
//! | module | owns |
//! |---|---|
//! | `lib.rs` | the layout ([`KvLayoutDesc`], [`Dtype`]), keys, fences, and the three traits: [`KvRegion`] (the receiving memory), [`Transport`] (register / connect), [`RemoteWriter`] (write / flush) |
//! | [`memory`] | [`LayerMemory`]: where a region's blocks live (host, CUDA, staged); [`HostMemory`] |
//! | [`descriptor`] | [`WriteBatch`] / [`BlockWrite`]: which runs of blocks of which layer go where, and their validation |
//! | [`handshake`] | [`check_compatible`]: layout compatibility with an explicit mismatch error |
//! | [`convert`] | rows from one [`Dtype`] to another (a writer whose cache dtype is not the destination's) |
//! | [`tcp`] | [`TcpTransport`], the default: one listener per process, length-prefixed frames |
//! | [`ucx`] | [`UcxTransport`]: one-sided puts into registered memory, over the machine's UCX (loaded at run time) |
//! | [`local`] | [`LocalTransport`]: in-process, for tests and single-process clusters |
//! | [`layerwise`] | [`LayerStreamer`] / [`LayerSink`]: send each layer as soon as it is computed |
//! | [`error`] | [`TransferError`] |
//!
//! The model is one-sided RDMA: the decode worker *registers* its pool as a [`KvRegion`], whose
//! layers are registered memory ([`LayerMemory`]), and gets a [`Registration`] (address +
//! [`RemoteKey`]), which travels to the prefill worker inside the prefill request with the
//! request's [`Fence`]. The prefill worker *connects* to that address and key with its own
//! layout (the layout handshake runs here, and a mismatch fails the connect), then *writes*
//! batches and *flushes*: a flush returns once every earlier write has landed in the region.
//! UCX puts the bytes into the region's memory from the writer's side; TCP and in-process copy
//! them there on the receiving side (docs/transfer.md).
//!
//! ```text
//!  prefill engine thread          tokio (prefill)                 tokio (decode)
//!  layer 0 done ─ sink.send ─►  LayerStreamer task ─ write ──►  the region's memory (put, or
//!  layer 1 done ─ sink.send ─►       (in order)    ─ write ──►  the receiver's copy)
//!  ...                          finish: flush ───────────────►  ack(total bytes)
//! ```
//!
//! ## The dtype on the wire
//!
//! **The wire carries the destination cache's dtype.** A receiver advertises the dtype its
//! cache holds (`ferry_decode::region`: f32 for a CPU engine and a GPU engine in exact mode,
//! [`Dtype::Bf16Split`] for a GPU engine in fast mode: bf16 rows whose RoPE key is kept as a
//! bf16 hi/lo pair), and a writer sends rows in exactly that dtype, converting only when its own
//! cache's dtype differs ([`convert`], row by row: a split row widens to f32 as `hi + lo`, an
//! f32 row splits as the device cache writes it, f32 → bf16 rounds to nearest even). So a fast
//! cache ships to a fast cache untouched, at (width + rope) bf16 per row instead of width f32,
//! and mixed pairs keep working. The handshake ([`check_compatible`]) still requires the same dtype on both ends of
//! the connection: the writer connects with the dtype it will put on the wire, never one it
//! merely holds, and a mismatch is refused before any byte moves. Every layer of a transfer
//! (a drafter's context layers after the target's included) uses that one dtype.
//!
//! ## Example
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use ferry_kvtransfer::*;
//!
//! /// The decode worker's pool (a real one forwards into its engine's KV pool, without blocking).
//! struct Pool { layout: KvLayoutDesc, bytes: Mutex<Vec<u8>> }
//!
//! impl KvRegion for Pool {
//!     fn layout(&self) -> KvLayoutDesc { self.layout }
//!     fn write(&self, layer: u32, block: u32, data: &[u8]) -> Result<(), TransferError> {
//!         // The transport has checked layer, block and length against `layout()`.
//!         let start = (layer * self.layout.num_blocks + block) as usize * data.len();
//!         self.bytes.lock().unwrap()[start..start + data.len()].copy_from_slice(data);
//!         Ok(())
//!     }
//! }
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let layout = KvLayoutDesc {
//!     num_layers: 2, page_size: 64, latent_width: 576, dtype: Dtype::Bf16, num_blocks: 8,
//! };
//! // `TcpTransport::bind(addr)?` across processes; one transport per process.
//! let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
//!
//! // Decode worker: register the pool once; `reg` travels in each prefill request.
//! let bytes = vec![0; 2 * 8 * layout.block_bytes()];
//! let reg = transport.register(Arc::new(Pool { layout, bytes: Mutex::new(bytes) })).await?;
//!
//! // Prefill worker: connect (runs the layout handshake), then hand over each layer as soon
//! // as it is computed (`sink.send` never blocks; call it from the engine thread).
//! let writer = transport.connect(&reg.address, reg.key, Fence::NONE, &layout).await?;
//! let (sink, streamer) = LayerStreamer::spawn(writer);
//! for layer in 0..layout.num_layers {
//!     let data = vec![1; layout.block_bytes()].into();
//!     sink.send(WriteBatch { layer, writes: vec![BlockWrite { block: 5, data }] })?;
//! }
//! // Every batch has landed once `finish` returns.
//! let total = streamer.finish(sink).await?;
//! assert_eq!(total, 2 * layout.block_bytes() as u64);
//! # Ok::<(), TransferError>(())
//! # }).unwrap();
//! ```

#![warn(missing_docs)]
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use async_trait::async_trait;
use ferry_proto::internal::KvLayout;

pub mod convert;
pub mod descriptor;
pub mod error;
pub mod handshake;
pub mod layerwise;
pub mod local;
pub mod memory;
mod registry;
pub mod tcp;
pub mod ucx;
mod wire;

pub use convert::{convert, convert_into};
pub use descriptor::{
    check_run, check_write, BlockWrite, DeviceBatch, DeviceRun, Payload, WriteBatch, MAX_RUN_BYTES,
};
pub use error::{ParseDtypeError, TransferError};
pub use handshake::check_compatible;
pub use layerwise::{LayerSink, LayerStreamer};
pub use local::LocalTransport;
pub use memory::{HostMemory, LayerMemory, Span};
pub use tcp::TcpTransport;
pub use ucx::{UcxOptions, UcxTransport};

/// How a KV pool's rows are stored: the element type, and for fast-mode GPU caches where the
/// RoPE key sits.
///
/// [`Dtype::Bf16Split`] is the fast-mode cache format: bf16 rows whose last `rope` elements (the
/// rotary key `k_pe`) are kept as a bf16 *pair*, `hi = bf16(x)` and `lo = bf16(x − hi)`, stored
/// after the row: `[latent (width − rope) | hi (rope) | lo (rope)]`, `width + rope` bf16 per
/// row. The pair carries ~16 mantissa bits, which the RoPE half of an MLA score needs: its
/// terms are large enough that one bf16 rounding moves attention rows by whole logits
/// (docs/gpu.md, "Fast mode's precision"), while the latent half is fine in bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// bfloat16 with the row's last `rope` elements as a bf16 hi/lo pair (see the type's docs).
    Bf16Split {
        /// Trailing elements of each row stored as a pair.
        rope: u32,
    },
}

impl Dtype {
    /// Size of one stored element in bytes (a split row's pair counts as two elements).
    pub const fn elem_size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::Bf16Split { .. } => 2,
        }
    }

    /// Stored elements of one row of `width` logical elements.
    pub const fn row_elems(self, width: usize) -> usize {
        match self {
            Dtype::F32 | Dtype::Bf16 => width,
            Dtype::Bf16Split { rope } => width + rope as usize,
        }
    }

    /// Bytes of one row of `width` logical elements.
    pub const fn row_bytes(self, width: usize) -> usize {
        self.row_elems(width) * self.elem_size()
    }
}

impl fmt::Display for Dtype {
    /// The wire / config name: `f32`, `bf16`, or `bf16-split<rope>` (e.g. `bf16-split64`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dtype::F32 => f.write_str("f32"),
            Dtype::Bf16 => f.write_str("bf16"),
            Dtype::Bf16Split { rope } => write!(f, "bf16-split{rope}"),
        }
    }
}

impl FromStr for Dtype {
    type Err = ParseDtypeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(Dtype::F32),
            "bf16" => Ok(Dtype::Bf16),
            other => other
                .strip_prefix("bf16-split")
                .and_then(|n| n.parse::<u32>().ok())
                .filter(|&rope| rope > 0)
                .map(|rope| Dtype::Bf16Split { rope })
                .ok_or_else(|| ParseDtypeError { got: other.into() }),
        }
    }
}

/// Geometry and dtype of a paged latent KV pool, `[layer][block][page][latent]`.
///
/// The domain form of the wire [`KvLayout`]; convert with `KvLayout::from` / `KvLayoutDesc::try_from`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayoutDesc {
    /// Attention layers with a KV cache.
    pub num_layers: u32,
    /// Tokens per block (page).
    pub page_size: u32,
    /// Latent width per token (576 for DeepSeek-V3 MLA: 512 compressed + 64 rope).
    pub latent_width: u32,
    /// Element type.
    pub dtype: Dtype,
    /// Blocks per layer in this pool (may differ between peers).
    pub num_blocks: u32,
}

impl KvLayoutDesc {
    /// Bytes of one block of one layer: `page_size` rows of [`Dtype::row_bytes`]
    /// (saturating, so an absurd peer layout cannot overflow).
    pub fn block_bytes(&self) -> usize {
        let row = (self.latent_width as usize)
            .saturating_add(match self.dtype {
                Dtype::Bf16Split { rope } => rope as usize,
                _ => 0,
            })
            .saturating_mul(self.dtype.elem_size());
        (self.page_size as usize).saturating_mul(row)
    }
}

impl From<&KvLayoutDesc> for KvLayout {
    fn from(d: &KvLayoutDesc) -> Self {
        KvLayout {
            num_layers: d.num_layers,
            page_size: d.page_size,
            latent_width: d.latent_width,
            dtype: d.dtype.to_string(),
            num_blocks: d.num_blocks,
        }
    }
}

impl From<KvLayoutDesc> for KvLayout {
    fn from(d: KvLayoutDesc) -> Self {
        KvLayout::from(&d)
    }
}

impl TryFrom<&KvLayout> for KvLayoutDesc {
    type Error = TransferError;

    /// Parses a wire layout: `dtype` must name a [`Dtype`], `num_layers`, `page_size` and
    /// `latent_width` must be > 0, and a split dtype's pair must lie inside the row; otherwise
    /// [`TransferError::Protocol`] naming the field.
    fn try_from(w: &KvLayout) -> Result<Self, Self::Error> {
        let dtype = w
            .dtype
            .parse::<Dtype>()
            .map_err(|e| TransferError::Protocol(format!("KvLayout: {e}")))?;
        for (name, value) in [
            ("num_layers", w.num_layers),
            ("page_size", w.page_size),
            ("latent_width", w.latent_width),
        ] {
            if value == 0 {
                return Err(TransferError::Protocol(format!(
                    "KvLayout: `{name}` must be > 0, got 0"
                )));
            }
        }
        if let Dtype::Bf16Split { rope } = dtype {
            if rope > w.latent_width {
                return Err(TransferError::Protocol(format!(
                    "KvLayout: `dtype` {dtype} splits more than the row's {} elements",
                    w.latent_width
                )));
            }
        }
        Ok(KvLayoutDesc {
            num_layers: w.num_layers,
            page_size: w.page_size,
            latent_width: w.latent_width,
            dtype,
            num_blocks: w.num_blocks,
        })
    }
}

impl TryFrom<KvLayout> for KvLayoutDesc {
    type Error = TransferError;

    fn try_from(w: KvLayout) -> Result<Self, Self::Error> {
        KvLayoutDesc::try_from(&w)
    }
}

/// Names a registered [`KvRegion`] within a transport's address (like an RDMA rkey).
///
/// Keys are unpredictable per process start (seeded from time and pid), so a stale writer from
/// before a receiver restart does not find the new region under an old key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct RemoteKey(pub u64);

impl fmt::Display for RemoteKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#018x}", self.0)
    }
}

/// What a writer needs to reach a registered region: sent to the prefill worker in the
/// prefill request (`KvDestination.transfer_address` / `remote_key`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The transport that made it ([`Transport::name`]; `KvDestination.transport`).
    pub transport: &'static str,
    /// Transport-specific address (`"host:port"` for TCP, `"ucx:<hex worker address>"` for
    /// UCX, `"local"` in-process).
    pub address: String,
    /// The region's key at that address.
    pub key: RemoteKey,
}

/// Which reservation a transfer writes under: the destination's generation for one request's
/// blocks, sent in the prefill request (`KvDestination.fence`) and presented at connect.
///
/// A region lands a block only while that block is reserved under the writer's fence
/// ([`KvRegion::admit`]), so a writer that outlived its request (timed out, its peer gave up
/// and reused the blocks) cannot write into someone else's KV. [`Fence::NONE`]: the region does
/// not fence (tests, benchmarks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(transparent)]
pub struct Fence(pub u64);

impl Fence {
    /// No fence.
    pub const NONE: Fence = Fence(0);
}

/// Memory that remote writers may write whole blocks into: the decode worker's KV pool.
///
/// A region is **registered memory**: [`KvRegion::memory`] says where each layer's blocks live,
/// and transports put bytes there themselves (UCX one-sidedly from the writer's process, TCP and
/// in-process by copying what they received), checking each write against the layout and
/// [`KvRegion::admit`] first where they see it. Layers whose memory a transport cannot reach
/// ([`LayerMemory::Staged`], or device memory without a CUDA-capable UCX) arrive through
/// [`KvRegion::write`], which must be cheap and never block: copy the bytes, or hand them to
/// the engine thread over a non-blocking channel.
///
/// A writer's flush ([`RemoteWriter::flush`]) returns once every earlier write has landed, in
/// memory or through `write`; the region's owner treats blocks as filled only after that
/// completion reaches it (for the decode worker: the prefill peer's reply, sent after flushing).
///
/// Transports validate every write against [`KvRegion::layout`] (`layer < num_layers`,
/// `block < num_blocks`, `data.len() == block_bytes()`); the layout and the memory must not
/// change while the region is registered.
pub trait KvRegion: Send + Sync + 'static {
    /// The pool's layout (read at registration and at each connection).
    fn layout(&self) -> KvLayoutDesc;

    /// Where `layer`'s blocks live (read once, at registration). The default exposes nothing:
    /// every block arrives through [`KvRegion::write`].
    fn memory(&self, layer: u32) -> LayerMemory {
        let _ = layer;
        LayerMemory::Staged
    }

    /// Whether a writer holding `fence` may write `block` now (it is reserved for that
    /// writer's request). Transports that see each write (TCP, in-process, UCX's staged path)
    /// call it before landing the block; a one-sided put cannot be checked on arrival, so UCX
    /// checks the fence at connect and the region's owner keeps the blocks of an abandoned
    /// transfer out of reuse until its writer has stopped. The default admits everything.
    fn admit(&self, block: u32, fence: Fence) -> Result<(), TransferError> {
        let _ = (block, fence);
        Ok(())
    }

    /// Stores one whole block of a layer that is not written in memory (see the trait docs).
    /// The default refuses: a region that exposes every layer never receives a call.
    fn write(&self, layer: u32, block: u32, data: &[u8]) -> Result<(), TransferError> {
        let _ = data;
        Err(TransferError::Region(format!(
            "layer {layer} block {block}: this region takes writes only into its registered memory"
        )))
    }

    /// Stores a run of whole consecutive blocks `first, first + 1, …` of a layer that is not
    /// written in memory, as a receiver gets them (already admitted). The default hands them to
    /// [`KvRegion::write`] one by one; a region whose store has a per-call cost (a copy to a
    /// device, a hop to another thread) takes the run at once.
    fn write_run(&self, layer: u32, first: u32, data: &[u8]) -> Result<(), TransferError> {
        let bb = self.layout().block_bytes();
        (first..)
            .zip(data.chunks(bb.max(1)))
            .try_for_each(|(b, bytes)| self.write(layer, b, bytes))
    }
}

/// A way to move KV blocks into remote memory: TCP, in-process, UCX.
///
/// The receiving side [`register`](Transport::register)s its pool; the sending side
/// [`connect`](Transport::connect)s to the returned address and key. One transport value
/// serves both roles.
#[async_trait]
pub trait Transport: Send + Sync {
    /// Short name, as in `KvDestination.transport`: `"tcp"`, `"ucx"`, `"local"`.
    fn name(&self) -> &'static str;

    /// `len` zeroed bytes of host memory for a region this transport will register: the memory
    /// its writers reach fastest. UCX allocates shared memory (System V or POSIX) when its
    /// shared-memory transports are enabled, which a writer on the same machine copies into
    /// directly ([`UcxTransport`]); the default, and the other transports, use the heap
    /// ([`HostMemory::zeroed`]). Blocks briefly (an allocation on the transport's thread).
    fn alloc_host(&self, len: usize) -> Result<HostMemory, TransferError> {
        Ok(HostMemory::zeroed(len))
    }

    /// Makes `region` writable by remote writers; returns where and under which key.
    async fn register(&self, region: Arc<dyn KvRegion>) -> Result<Registration, TransferError>;

    /// Stops accepting connections and writes for `key`
    /// ([`TransferError::UnknownRegion`] if it is not registered).
    ///
    /// A write already past its checks may still land; deregister a pool only once nothing
    /// is being written into it.
    async fn deregister(&self, key: RemoteKey) -> Result<(), TransferError>;

    /// Connects to the region `key` at `address` and runs the layout handshake: the region's
    /// layout must be compatible with `writer_layout` ([`check_compatible`]), else
    /// [`TransferError::LayoutMismatch`] with `ours` = the writer's value. An unknown key is
    /// [`TransferError::UnknownRegion`]. Writes go out under `fence` ([`KvRegion::admit`]).
    async fn connect(
        &self,
        address: &str,
        key: RemoteKey,
        fence: Fence,
        writer_layout: &KvLayoutDesc,
    ) -> Result<Box<dyn RemoteWriter>, TransferError>;
}

/// A connection that writes into one remote region.
///
/// Writes are applied in order. A batch is validated as a whole against the destination layout
/// before any of it is sent, so an [`TransferError::OutOfRange`] from `write` sends nothing and
/// leaves the writer usable. Any other error (the destination refused a write, the connection
/// broke) poisons the writer: later calls return [`TransferError::Closed`]. Dropping the writer
/// closes the connection.
#[async_trait]
pub trait RemoteWriter: Send {
    /// Sends one batch. It may not have landed yet when this returns; see [`RemoteWriter::flush`].
    async fn write(&mut self, batch: WriteBatch) -> Result<(), TransferError>;

    /// Completion: returns once every write so far has landed in the remote region, with the
    /// total block bytes written on this connection.
    async fn flush(&mut self) -> Result<u64, TransferError>;

    /// Whether this writer reads host batches' [`Payload::in_place`] rows without waiting on
    /// the destination's pace (copies into mapped memory, one-sided puts, in-process copies).
    /// The rows' owner waits for them before it computes anything else, so a writer that would
    /// hold them while a socket drains says no, and gets buffers of their own. Default: no.
    fn reads_in_place(&self) -> bool {
        false
    }

    /// Whether destination layer `layer` takes [`DeviceBatch`]es: one-sided puts from this
    /// process's CUDA memory into the destination's device memory (UCX with CUDA support on
    /// both ends, the destination layer registered as [`LayerMemory::Cuda`]). Known once the
    /// connection is open; the default is no.
    fn puts_from_device(&self, layer: u32) -> bool {
        let _ = layer;
        false
    }

    /// Sends one batch read from device memory (see [`RemoteWriter::puts_from_device`]); the
    /// batch is dropped once the transport no longer reads its source. The default refuses
    /// with [`TransferError::Protocol`] (and drops the batch).
    async fn write_device(&mut self, batch: DeviceBatch) -> Result<(), TransferError> {
        Err(TransferError::Protocol(format!(
            "this transport cannot read device memory (layer {})",
            batch.layer
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_round_trips_and_sizes() {
        for d in [Dtype::F32, Dtype::Bf16, Dtype::Bf16Split { rope: 64 }] {
            assert_eq!(d.to_string().parse::<Dtype>(), Ok(d));
        }
        assert_eq!(Dtype::Bf16Split { rope: 64 }.to_string(), "bf16-split64");
        assert_eq!(Dtype::F32.row_bytes(576), 2304);
        assert_eq!(Dtype::Bf16.row_bytes(576), 1152);
        assert_eq!(Dtype::Bf16Split { rope: 64 }.row_bytes(576), 1280);
        for bad in ["fp8", "bf16-split", "bf16-split0", "bf16-splitx"] {
            let err = bad.parse::<Dtype>().unwrap_err();
            assert!(err.to_string().contains(&format!("\"{bad}\"")), "{err}");
        }
    }

    #[test]
    fn layout_round_trips_through_the_wire_form() {
        let d = KvLayoutDesc {
            num_layers: 61,
            page_size: 64,
            latent_width: 576,
            dtype: Dtype::Bf16,
            num_blocks: 4096,
        };
        assert_eq!(d.block_bytes(), 64 * 576 * 2);
        let wire = KvLayout::from(&d);
        assert_eq!(wire.dtype, "bf16");
        assert_eq!(KvLayoutDesc::try_from(wire).unwrap(), d);
    }

    #[test]
    fn bad_wire_layouts_name_the_field() {
        let good = KvLayout::from(KvLayoutDesc {
            num_layers: 1,
            page_size: 1,
            latent_width: 1,
            dtype: Dtype::F32,
            num_blocks: 1,
        });
        let bad_dtype = KvLayout {
            dtype: "int4".into(),
            ..good.clone()
        };
        let e = KvLayoutDesc::try_from(&bad_dtype).unwrap_err();
        assert!(
            matches!(&e, TransferError::Protocol(m) if m.contains("`dtype`") && m.contains("int4"))
        );
        let zero = KvLayout {
            page_size: 0,
            ..good
        };
        let e = KvLayoutDesc::try_from(&zero).unwrap_err();
        assert!(matches!(&e, TransferError::Protocol(m) if m.contains("`page_size`")));
    }
}
