//! Multi-head latent attention (MLA) over a paged latent cache, in both forms.
//!
//! | module | owns |
//! |---|---|
//! | this file | shapes ([`MlaDims`]), the paged cache view ([`LatentPages`], [`SeqAttn`], [`LatentContext`]) and their validation |
//! | [`mha`] | the decompressed (MHA) form: expand every key with `kv_b_proj`, ordinary causal attention |
//! | [`absorbed`] | the absorbed (MQA) form: fold `W_UK` into queries, attend against the latent, apply `W_UV`; the padding dispatcher; a naive reference |
//! | [`tiled`] | the tiled absorbed kernel: 16-row head tiles, pages streamed once per tile, online softmax |
//!
//! The cache holds, per token, one row `[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]`: the
//! RMS-normalised compressed KV and the rotary key part after RoPE. It has no head axis, so
//! every head of every rank attends to the same rows (`shared/reference/mla.md`).
//!
//! Key position `p` of a sequence lives in block `block_table[p / page_size]`, row
//! `p % page_size`. Query `i` has absolute position `start_pos + i` and attends causally to
//! keys `0..=start_pos + i`; the caller has already written the new tokens' rows.

pub mod absorbed;
pub mod mha;
pub mod tiled;

pub use absorbed::{
    absorb_queries, mla_absorbed_attention, mla_absorbed_form, mla_absorbed_reference,
    unabsorb_outputs,
};
pub use mha::mla_mha_attention;
pub use tiled::mla_absorbed_tiled;

use crate::error::KernelError;

/// Dimensions of one MLA layer (per local rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaDims {
    /// Query heads on this rank.
    pub heads: usize,
    /// Width of the compressed KV latent (512 for the DeepSeek-V3 family).
    pub kv_lora_rank: usize,
    /// Per-head query/key width without position information (128).
    pub qk_nope_head_dim: usize,
    /// Per-head rotary query/key width, shared by all heads on the key side (64).
    pub qk_rope_head_dim: usize,
    /// Per-head value width (128).
    pub v_head_dim: usize,
}

impl MlaDims {
    /// Per-head query/key width in the MHA form: `qk_nope + qk_rope` (192).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Width of one cached latent row and of one absorbed query: `kv_lora + qk_rope` (576).
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Rows of `kv_b_proj` per head: `qk_nope + v` (256).
    pub fn kv_b_rows_per_head(&self) -> usize {
        self.qk_nope_head_dim + self.v_head_dim
    }

    /// Checks every dimension is non-zero and `kv_b_proj` is `[heads·(nope+v)][kv_lora]`.
    pub(crate) fn check(
        &self,
        op: &'static str,
        kv_b_rows: usize,
        kv_b_cols: usize,
    ) -> Result<(), KernelError> {
        let fields = [
            ("heads", self.heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
        ];
        for (field, value) in fields {
            if value == 0 {
                return Err(KernelError::InvalidParam {
                    op,
                    field,
                    limit: "> 0",
                    value: "0".into(),
                });
            }
        }
        check_len(
            op,
            "kv_b_proj.rows",
            self.heads * self.kv_b_rows_per_head(),
            kv_b_rows,
        )?;
        check_len(op, "kv_b_proj.cols", self.kv_lora_rank, kv_b_cols)
    }
}

/// One layer's latent pages: `[num_blocks][page_size][width]` f32, where each token row is
/// `[normalised compressed kv (kv_lora_rank) | k_pe after RoPE (qk_rope_head_dim)]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatentPages<'a> {
    /// The whole pool for this layer.
    pub data: &'a [f32],
    /// Tokens per block.
    pub page_size: usize,
    /// Floats per token row (`kv_lora_rank + qk_rope_head_dim`).
    pub width: usize,
}

impl LatentPages<'_> {
    /// Blocks in the pool (`data.len() / (page_size · width)`; 0 for a degenerate geometry).
    pub fn num_blocks(&self) -> usize {
        self.data
            .len()
            .checked_div(self.page_size * self.width)
            .unwrap_or(0)
    }
}

/// One sequence's view of the cache: its block table and how many queries it brings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqAttn<'a> {
    /// Block ids into the pool, in position order.
    pub block_table: &'a [u32],
    /// Tokens already cached before these queries (position of the first query).
    pub start_pos: usize,
    /// New tokens, i.e. query rows; their latent rows are already in the pages.
    pub num_queries: usize,
}

impl SeqAttn<'_> {
    /// Keys the last query sees: `start_pos + num_queries`.
    pub fn context_len(&self) -> usize {
        self.start_pos + self.num_queries
    }
}

/// What a batch of queries attends to: the cache pages, the sequence's view, and the softmax
/// scale (`qk_head_dim^-0.5`, times the YaRN multiplier where the model has one).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatentContext<'a> {
    /// The layer's latent pages.
    pub pages: LatentPages<'a>,
    /// The sequence's block table and query span.
    pub seq: SeqAttn<'a>,
    /// Multiplier applied to every `q · k` score before the softmax.
    pub scale: f32,
}

/// A validated way to read key rows by absolute position.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyRows<'a> {
    data: &'a [f32],
    page_size: usize,
    width: usize,
    blocks: &'a [u32],
}

impl<'a> KeyRows<'a> {
    /// Checks the page geometry and that the block table covers `context_len` positions with
    /// in-range block ids.
    pub(crate) fn new(op: &'static str, ctx: &LatentContext<'a>) -> Result<Self, KernelError> {
        let LatentPages {
            data,
            page_size,
            width,
        } = ctx.pages;
        for (field, value) in [("pages.page_size", page_size), ("pages.width", width)] {
            if value == 0 {
                return Err(KernelError::InvalidParam {
                    op,
                    field,
                    limit: "> 0",
                    value: "0".into(),
                });
            }
        }
        if data.len() % (page_size * width) != 0 {
            return Err(KernelError::NotDivisible {
                op,
                what: "pages.data",
                len: data.len(),
                width: page_size * width,
            });
        }
        let needed_tokens = ctx.seq.context_len();
        let needed_blocks = needed_tokens.div_ceil(page_size);
        let table = ctx.seq.block_table;
        if table.len() < needed_blocks {
            return Err(KernelError::BlockTableTooShort {
                op,
                blocks: table.len(),
                page_size,
                needed_tokens,
            });
        }
        let num_blocks = ctx.pages.num_blocks();
        let blocks = &table[..needed_blocks];
        if let Some(&bad) = blocks.iter().find(|&&b| b as usize >= num_blocks) {
            return Err(KernelError::IndexOutOfRange {
                op,
                what: "block_table entry",
                index: bad as usize,
                len: num_blocks,
            });
        }
        Ok(Self {
            data,
            page_size,
            width,
            blocks,
        })
    }

    /// Floats per row.
    pub(crate) fn width(&self) -> usize {
        self.width
    }

    /// Tokens per page.
    pub(crate) fn page_size(&self) -> usize {
        self.page_size
    }

    /// The contiguous rows of page `page` (the `page`-th entry of the block table), all
    /// `page_size` of them.
    pub(crate) fn page(&self, page: usize) -> &'a [f32] {
        let block = self.blocks[page] as usize;
        let len = self.page_size * self.width;
        &self.data[block * len..(block + 1) * len]
    }

    /// The row of absolute position `pos`.
    pub(crate) fn row(&self, pos: usize) -> &'a [f32] {
        let r = pos % self.page_size;
        &self.page(pos / self.page_size)[r * self.width..(r + 1) * self.width]
    }
}

pub(crate) use super::gemm::check_len;
