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

/// Element type of a KV cache's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 32-bit float: the host pool, and a CUDA cache in exact mode.
    F32,
    /// bfloat16: a CUDA cache in fast mode.
    Bf16,
}

impl KvDtype {
    /// Bytes per element.
    pub const fn elem_size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }

    /// `"f32"` or `"bf16"` (the transfer wire's names).
    pub const fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
        }
    }

    /// Widens `bytes` (whole little-endian elements of this dtype) into `dst`, one f32 per
    /// element (exact for both dtypes); the lengths must agree.
    pub fn widen_into(self, bytes: &[u8], dst: &mut [f32]) -> Result<(), ModelError> {
        if bytes.len() != dst.len() * self.elem_size() {
            return Err(ModelError::Kv(format!(
                "{} bytes of {self} are not {} elements",
                bytes.len(),
                dst.len()
            )));
        }
        match self {
            KvDtype::F32 => {
                for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            KvDtype::Bf16 => {
                for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
        }
        Ok(())
    }

    /// `bytes` (whole elements of this dtype) widened to f32.
    pub fn widen(self, bytes: &[u8]) -> Result<Vec<f32>, ModelError> {
        let mut out = vec![0.0f32; bytes.len() / self.elem_size()];
        self.widen_into(bytes, &mut out)?;
        Ok(out)
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whole blocks of one layer in the cache's dtype, read-only.
#[derive(Debug, Clone, Copy)]
pub struct LayerRows<'a> {
    layer: usize,
    dtype: KvDtype,
    block_bytes: usize,
    bytes: &'a [u8],
    /// `None`: `bytes` is the whole layer, block `b` at `b · block_bytes`. `Some(ids)`: the
    /// blocks `ids` (sorted, distinct), `ids[i]` at `i · block_bytes`.
    ids: Option<&'a [BlockId]>,
}

impl<'a> LayerRows<'a> {
    /// Layer `layer` of the host pool (f32). An ids-only pool ([`KvPool::without_rows`]) has
    /// no rows to view: an error saying so.
    pub fn pool(pool: &'a KvPool, layer: usize) -> Result<Self, ModelError> {
        let rows = pool.layer(layer)?;
        Ok(Self {
            layer,
            dtype: KvDtype::F32,
            block_bytes: pool.layout().block_floats() * 4,
            bytes: bytemuck::cast_slice(rows),
            ids: None,
        })
    }

    /// The blocks `ids` (sorted, distinct) of layer `layer`, `block_bytes` each, back to back
    /// in `bytes` (a staging buffer's slot).
    pub fn staged(
        layer: usize,
        dtype: KvDtype,
        block_bytes: usize,
        ids: &'a [BlockId],
        bytes: &'a [u8],
    ) -> Result<Self, ModelError> {
        if bytes.len() != ids.len() * block_bytes || block_bytes % dtype.elem_size() != 0 {
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
            block_bytes,
            bytes,
            ids: Some(ids),
        })
    }

    /// The layer these rows belong to.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The rows' element type (the cache's).
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Bytes of one block (`page_size × width × dtype size`).
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
            ModelError::Kv(format!(
                "{block} of layer {} is not among these rows",
                self.layer
            ))
        })
    }

    /// Block `block`'s rows widened to f32 (exact).
    pub fn block_f32(&self, block: BlockId) -> Result<Vec<f32>, ModelError> {
        self.dtype.widen(self.block(block)?)
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
        let bits = |v: &[f32]| -> Vec<u8> {
            v.iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
                .collect()
        };
        let mut bytes = bits(&[1.0, 2.0, 3.0, 4.0]);
        bytes.extend(bits(&[-1.0, -2.0, -3.0, -4.0]));
        let ids = [BlockId(4), BlockId(9)];
        let rows = LayerRows::staged(0, KvDtype::Bf16, 8, &ids, &bytes).unwrap();
        assert_eq!(rows.block(BlockId(9)).unwrap(), &bytes[8..]);
        assert_eq!(rows.block_f32(BlockId(4)).unwrap(), [1.0, 2.0, 3.0, 4.0]);
        let e = rows.block(BlockId(5)).unwrap_err().to_string();
        assert!(e.contains("block#5"), "{e}");
        assert!(LayerRows::staged(0, KvDtype::Bf16, 8, &ids, &bytes[1..]).is_err());
        let unsorted = [BlockId(9), BlockId(4)];
        assert!(LayerRows::staged(0, KvDtype::Bf16, 8, &unsorted, &bytes).is_err());
    }
}
