//! Geometry of the latent KV pool.

use crate::ModelError;

/// Default tokens per block (one page).
pub const DEFAULT_PAGE_SIZE: usize = 64;

/// Shape of a latent KV pool: `[layer][block][page][width]` floats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Attention layers with a latent cache.
    pub num_layers: usize,
    /// Blocks per layer.
    pub num_blocks: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// Floats per token row (`kv_lora_rank + qk_rope_head_dim`).
    pub width: usize,
}

impl KvLayout {
    /// The pool a model of `config` needs: one latent row per token and layer.
    pub fn for_model(
        config: &crate::config::ModelConfig,
        num_blocks: usize,
        page_size: usize,
    ) -> Self {
        Self {
            num_layers: config.num_hidden_layers,
            num_blocks,
            page_size,
            width: config.latent_width(),
        }
    }

    /// Checks every dimension is positive and the pool is addressable with `u32` block ids.
    pub fn validate(&self) -> Result<(), ModelError> {
        for (field, v) in [
            ("num_layers", self.num_layers),
            ("num_blocks", self.num_blocks),
            ("page_size", self.page_size),
            ("width", self.width),
        ] {
            if v == 0 {
                return Err(ModelError::Kv(format!("`{field}` must be > 0, got 0")));
            }
        }
        if u32::try_from(self.num_blocks).is_err() {
            return Err(ModelError::Kv(format!(
                "`num_blocks` must fit in u32, got {}",
                self.num_blocks
            )));
        }
        Ok(())
    }

    /// Floats in one block of one layer.
    pub fn block_floats(&self) -> usize {
        self.page_size * self.width
    }

    /// That `rows` f32 are exactly `blocks` whole blocks of layer `l` (a multi-block write).
    pub fn check_block_rows(&self, l: usize, blocks: usize, rows: usize) -> Result<(), ModelError> {
        let want = blocks * self.block_floats();
        if rows == want {
            Ok(())
        } else {
            Err(ModelError::Kv(format!(
                "writing {blocks} blocks of layer {l} takes {want} floats, got {rows}"
            )))
        }
    }

    /// Floats in one layer's region.
    pub fn layer_floats(&self) -> usize {
        self.num_blocks * self.block_floats()
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_size)
    }
}
