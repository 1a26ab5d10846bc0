//! A cache's element type, and one layer's rows as the cache holds them: what a prefill job's
//! layer sink reads ([`crate::engine::LayerSinkFn`]).
//!
//! A [`LayerRows`] is a read-only view of whole blocks of one layer, in the cache's own dtype
//! (little-endian bytes): on the CPU the host pool's layer itself, on a GPU the page-locked
//! staging slot the layer's shipped blocks were copied into behind its compute — never widened
//! or copied again on the way to the sink. A sink that must send another dtype converts there
//! (the prefill worker converts to the destination's dtype, `ferry_kvtransfer::convert`).

use std::fmt;

use super::{BlockId, KvPool};
use crate::ModelError;

// The views hand out the in-memory bytes of f32 rows as the little-endian wire format.
#[cfg(not(target_endian = "little"))]
compile_error!("ferry's KV rows are shipped as their in-memory bytes: little-endian targets only");

/// How a KV cache stores its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 32-bit float: the host pool, and a GPU cache in exact mode.
    F32,
    /// bfloat16 with the row's last `rope` elements (the rotary key) as a bf16 hi/lo pair
    /// after the row, `[latent | hi | lo]`: a GPU cache in fast mode. The pair keeps ~16
    /// mantissa bits of the RoPE key, which the RoPE half of an MLA score needs
    /// (`ferry_kvtransfer::Dtype::Bf16Split` is the same format on the wire; docs/gpu.md).
    Bf16Split {
        /// Trailing elements of each row stored as a pair (`qk_rope_head_dim`).
        rope: usize,
    },
}

impl KvDtype {
    /// Bytes per stored element.
    pub const fn elem_size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16Split { .. } => 2,
        }
    }

    /// Stored elements of one row of `width` logical elements.
    pub const fn row_elems(self, width: usize) -> usize {
        match self {
            KvDtype::F32 => width,
            KvDtype::Bf16Split { rope } => width + rope,
        }
    }

    /// Bytes of one row of `width` logical elements.
    pub const fn row_bytes(self, width: usize) -> usize {
        self.row_elems(width) * self.elem_size()
    }

    /// Bytes of one block of `layout` stored as this dtype.
    pub const fn block_bytes(self, layout: &super::KvLayout) -> usize {
        layout.page_size * self.row_bytes(layout.width)
    }

    /// Widens `bytes` (whole stored rows of `width` logical elements) into `dst`, `width` f32
    /// per row: exact for f32, `hi + lo` for a split pair (exact in f32); the row counts must
    /// agree.
    pub fn widen_into(self, bytes: &[u8], width: usize, dst: &mut [f32]) -> Result<(), ModelError> {
        let row = self.row_bytes(width);
        let rows = dst.len() / width.max(1);
        if width == 0 || dst.len() % width != 0 || bytes.len() != rows * row {
            return Err(ModelError::Kv(format!(
                "{} bytes of {self} are not rows of {width} for {} elements",
                bytes.len(),
                dst.len()
            )));
        }
        let bf = |c: &[u8]| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
        for (src, out) in bytes.chunks_exact(row).zip(dst.chunks_exact_mut(width)) {
            match self {
                KvDtype::F32 => {
                    for (d, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                }
                KvDtype::Bf16Split { rope } => {
                    // `width` bf16 (the his), then the lo halves of the last `rope` elements.
                    let (hi, lo) = src.split_at(2 * width);
                    for (d, c) in out.iter_mut().zip(hi.chunks_exact(2)) {
                        *d = bf(c);
                    }
                    let split = width.saturating_sub(rope);
                    for (d, c) in out[split..].iter_mut().zip(lo.chunks_exact(2)) {
                        *d += bf(c);
                    }
                }
            }
        }
        Ok(())
    }

    /// `bytes` (whole stored rows of `width` elements) widened to f32.
    pub fn widen(self, bytes: &[u8], width: usize) -> Result<Vec<f32>, ModelError> {
        let rows = bytes.len() / self.row_bytes(width).max(1);
        let mut out = vec![0.0f32; rows * width];
        self.widen_into(bytes, width, &mut out)?;
        Ok(out)
    }

    /// Encodes f32 `rows` (whole rows of `width`) as this dtype's bytes, appended to `out`:
    /// a split pair is `hi = bf16(x)`, `lo = bf16(x − hi)`, as the fast-mode cache writes it.
    /// The bytes are sized once and filled in place (a push per element cost ~3.5 ns of a
    /// prefill worker's drafter shipping, session 41).
    pub fn encode_into(self, rows: &[f32], width: usize, out: &mut Vec<u8>) {
        let width = width.max(1);
        let n = rows.len() / width;
        let start = out.len();
        out.resize(start + n * self.row_bytes(width), 0);
        let dst = &mut out[start..];
        let bf16 = |x: f32| half::bf16::from_f32(x).to_bits().to_le_bytes();
        match self {
            KvDtype::F32 => {
                for (x, o) in rows.iter().zip(dst.chunks_exact_mut(4)) {
                    o.copy_from_slice(&x.to_le_bytes());
                }
            }
            KvDtype::Bf16Split { rope } => {
                let split = width.saturating_sub(rope);
                for (row, o) in rows
                    .chunks_exact(width)
                    .zip(dst.chunks_exact_mut(self.row_bytes(width)))
                {
                    let (hi, lo) = o.split_at_mut(2 * width);
                    for (&x, o) in row.iter().zip(hi.chunks_exact_mut(2)) {
                        o.copy_from_slice(&bf16(x));
                    }
                    for (&x, o) in row[split..].iter().zip(lo.chunks_exact_mut(2)) {
                        o.copy_from_slice(&bf16(x - half::bf16::from_f32(x).to_f32()));
                    }
                }
            }
        }
    }
}

impl fmt::Display for KvDtype {
    /// The transfer wire's name: `f32` or `bf16-split<rope>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvDtype::F32 => f.write_str("f32"),
            KvDtype::Bf16Split { rope } => write!(f, "bf16-split{rope}"),
        }
    }
}

/// Whole blocks of one layer in the cache's dtype, read-only.
#[derive(Debug, Clone, Copy)]
pub struct LayerRows<'a> {
    layer: usize,
    dtype: KvDtype,
    width: usize,
    block_bytes: usize,
    bytes: &'a [u8],
    /// `None`: `bytes` is the whole layer, block `b` at `b · block_bytes`. `Some(ids)`: the
    /// blocks `ids` (sorted, distinct), `ids[i]` at `i · block_bytes`.
    ids: Option<&'a [BlockId]>,
    /// Rows left in device memory (no host bytes): where each block is.
    device: Option<DeviceRows<'a>>,
    /// Host rows a transport may read in place after the hook returns: the engine waits for
    /// every lease from here before it lets anything write them ([`Self::host_lease`]).
    host_leases: Option<&'a super::Leases>,
}

/// A layer's shipped blocks where they are in a GPU cache, for a transport that reads device
/// memory itself (a prefill job that asked for them: `PrefillJob::rows_on_device`).
///
/// The bytes are valid (the layer's compute has finished) and stay unchanged while any
/// [`Lease`](super::Lease) from [`DeviceRows::lease`] is held: the engine waits for every
/// lease of a forward before later work may write those blocks.
#[derive(Debug, Clone, Copy)]
pub struct DeviceRows<'a> {
    /// CUDA device ordinal.
    pub device: i32,
    /// Runs of consecutive blocks: `(first block, blocks, device address of the first)`.
    pub runs: &'a [(BlockId, usize, u64)],
    leases: &'a super::Leases,
}

impl<'a> DeviceRows<'a> {
    /// Rows in device memory at `runs` on `device`, leased through `leases`.
    pub fn new(device: i32, runs: &'a [(BlockId, usize, u64)], leases: &'a super::Leases) -> Self {
        Self {
            device,
            runs,
            leases,
        }
    }

    /// Device address of block `block`'s rows, given `block_bytes` per block.
    pub fn addr(&self, block: BlockId, block_bytes: usize) -> Option<u64> {
        self.runs.iter().find_map(|&(first, n, addr)| {
            let i = block.0.checked_sub(first.0)? as usize;
            (i < n).then(|| addr + (i * block_bytes) as u64)
        })
    }

    /// A lease that keeps these blocks unchanged until dropped.
    pub fn lease(&self) -> super::Lease {
        self.leases.lease()
    }
}

impl<'a> LayerRows<'a> {
    /// Layer `layer` of the host pool (f32). An ids-only pool ([`KvPool::without_rows`]) has
    /// no rows to view: an error saying so.
    pub fn pool(pool: &'a KvPool, layer: usize) -> Result<Self, ModelError> {
        let rows = pool.layer(layer)?;
        Ok(Self {
            layer,
            dtype: KvDtype::F32,
            width: pool.layout().width,
            block_bytes: pool.layout().block_floats() * 4,
            bytes: bytemuck::cast_slice(rows),
            ids: None,
            device: None,
            host_leases: None,
        })
    }

    /// [`Self::pool`] whose rows a transport may go on reading after the hook returns, under a
    /// [`Self::host_lease`]: the engine that hands it out waits for every lease from `leases`
    /// before anything writes the layer's rows again.
    pub fn pool_leased(
        pool: &'a KvPool,
        layer: usize,
        leases: &'a super::Leases,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            host_leases: Some(leases),
            ..Self::pool(pool, layer)?
        })
    }

    /// The blocks `ids` (sorted, distinct) of layer `layer`, `block_bytes` each (whole rows of
    /// `width` logical elements), back to back in `bytes` (a staging buffer's slot).
    pub fn staged(
        layer: usize,
        (dtype, width): (KvDtype, usize),
        block_bytes: usize,
        ids: &'a [BlockId],
        bytes: &'a [u8],
    ) -> Result<Self, ModelError> {
        let row = dtype.row_bytes(width);
        if bytes.len() != ids.len() * block_bytes || row == 0 || block_bytes % row != 0 {
            return Err(ModelError::Kv(format!(
                "{} staged bytes are not {} whole blocks of {block_bytes} bytes of {dtype}",
                bytes.len(),
                ids.len()
            )));
        }
        if ids.windows(2).any(|w| w[0] >= w[1]) {
            return Err(ModelError::Kv(
                "staged block ids must be sorted and distinct".into(),
            ));
        }
        Ok(Self {
            layer,
            dtype,
            width,
            block_bytes,
            bytes,
            ids: Some(ids),
            device: None,
            host_leases: None,
        })
    }

    /// The blocks `ids` (sorted, distinct) of layer `layer`, left in device memory at
    /// `device`'s runs: no host bytes ([`Self::block`] is an error; [`Self::on_device`] says
    /// where they are).
    pub fn device(
        layer: usize,
        (dtype, width): (KvDtype, usize),
        block_bytes: usize,
        ids: &'a [BlockId],
        device: DeviceRows<'a>,
    ) -> Self {
        Self {
            layer,
            dtype,
            width,
            block_bytes,
            bytes: &[],
            ids: Some(ids),
            device: Some(device),
            host_leases: None,
        }
    }

    /// Where the rows are when they were left in device memory.
    pub fn on_device(&self) -> Option<&DeviceRows<'a>> {
        self.device.as_ref()
    }

    /// A lease under which a transport may read these host rows ([`Self::block`]'s bytes) in
    /// place after the hook returns, until it drops the lease; `None` when the rows are only
    /// valid during the hook (a staging slot, or an engine that does not wait for leases).
    pub fn host_lease(&self) -> Option<super::Lease> {
        self.host_leases.map(super::Leases::lease)
    }

    /// The layer these rows belong to.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The rows' element type (the cache's).
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Logical elements per row (the cache's latent width).
    pub fn width(&self) -> usize {
        self.width
    }

    /// Bytes of one block (`page_size` rows of [`KvDtype::row_bytes`]).
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Block `block`'s rows, `[page][width]` little-endian elements of [`Self::dtype`].
    pub fn block(&self, block: BlockId) -> Result<&'a [u8], ModelError> {
        let i = match self.ids {
            None => Some(block.0 as usize),
            Some(ids) => ids.binary_search(&block).ok(),
        };
        i.and_then(|i| {
            self.bytes
                .get(i * self.block_bytes..(i + 1) * self.block_bytes)
        })
        .ok_or_else(|| {
            let on = if self.device.is_some() {
                " (they are in device memory)"
            } else {
                ""
            };
            ModelError::Kv(format!(
                "{block} of layer {} is not among these rows{on}",
                self.layer
            ))
        })
    }

    /// Block `block`'s rows widened to f32 (a split pair as `hi + lo`).
    pub fn block_f32(&self, block: BlockId) -> Result<Vec<f32>, ModelError> {
        self.dtype.widen(self.block(block)?, self.width)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvLayout;

    const LAYOUT: KvLayout = KvLayout {
        num_layers: 2,
        num_blocks: 3,
        page_size: 2,
        width: 2,
    };

    #[test]
    fn a_pool_view_gives_each_block_s_f32_bytes() {
        let mut pool = KvPool::new(LAYOUT).unwrap();
        pool.block_mut(1, BlockId(2))
            .unwrap()
            .copy_from_slice(&[1.0, -2.0, 0.5, 3.0]);
        let rows = LayerRows::pool(&pool, 1).unwrap();
        assert_eq!(
            (rows.layer(), rows.dtype(), rows.block_bytes()),
            (1, KvDtype::F32, 16)
        );
        let want: Vec<u8> = [1.0f32, -2.0, 0.5, 3.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(rows.block(BlockId(2)).unwrap(), want.as_slice());
        assert_eq!(rows.block_f32(BlockId(2)).unwrap(), [1.0, -2.0, 0.5, 3.0]);
        assert!(rows.block(BlockId(3)).is_err());
        assert!(LayerRows::pool(&pool, 2).is_err());
    }

    #[test]
    fn a_staged_view_finds_blocks_by_id() {
        // Blocks of two rows of width 2, the last element of each row split (3 bf16 per row).
        let dt = KvDtype::Bf16Split { rope: 1 };
        let fine = 1.0 + 2f32.powi(-12);
        let mut bytes = Vec::new();
        dt.encode_into(&[1.0, fine, 3.0, 4.0], 2, &mut bytes);
        dt.encode_into(&[-1.0, -2.0, -3.0, -4.0], 2, &mut bytes);
        assert_eq!(bytes.len(), 2 * 12);
        let ids = [BlockId(4), BlockId(9)];
        let rows = LayerRows::staged(0, (dt, 2), 12, &ids, &bytes).unwrap();
        assert_eq!(rows.block(BlockId(9)).unwrap(), &bytes[12..]);
        // The split element keeps what bf16 alone would round away.
        assert_eq!(rows.block_f32(BlockId(4)).unwrap(), [1.0, fine, 3.0, 4.0]);
        let e = rows.block(BlockId(5)).unwrap_err().to_string();
        assert!(e.contains("block#5"), "{e}");
        assert!(LayerRows::staged(0, (dt, 2), 12, &ids, &bytes[1..]).is_err());
        assert!(LayerRows::staged(0, (dt, 2), 8, &ids[..1], &bytes[..8]).is_err());
        let unsorted = [BlockId(9), BlockId(4)];
        assert!(LayerRows::staged(0, (dt, 2), 12, &unsorted, &bytes).is_err());
    }
}
