//! The paged latent KV cache: one pool per engine, shared by every sequence it serves.
//!
//! | file | owns |
//! |---|---|
//! | [`layout`] | pool geometry: layers × blocks × page × latent width |
//! | [`pool`] | the latent storage (one contiguous region per layer) and the ref-counted block allocator |
//! | [`table`] | a sequence's block table: which blocks hold which positions |
//!
//! MLA caches one 576-wide latent row per token per layer (512 compressed + 64 rope for the
//! DeepSeek-V3 family), with no head axis. Pages of `page_size` tokens (64 by default) form a
//! block; a block is shared between sequences by reference count, which is how a cached prompt
//! prefix is reused without copying. Each layer's region is contiguous so a transport can
//! register it once and ship it layer by layer.
pub mod layout;
pub mod pool;
pub mod table;

pub use layout::KvLayout;
pub use pool::{BlockId, KvPool};
pub use table::BlockTable;
