//! The paged latent KV cache: one pool per engine, shared by every sequence it serves.
//!
//! | file | owns |
//! |---|---|
//! | [`layout`] | pool geometry: layers × blocks × page × latent width |
//! | [`pool`] | the latent storage (one contiguous region per layer; none in an ids-only pool, a GPU engine's) and the ref-counted block allocator |
//! | [`rows`] | [`KvDtype`] (a cache's element type) and [`LayerRows`]: one layer's rows in that dtype, what a prefill job's layer sink reads |
//! | [`cache`] | [`KvMut`] / [`KvRef`]: the latent rows a forward runs against, on the host or a device; [`KvStore`]: rows owned on a backend (a drafter's context) |
//! | [`table`] | a sequence's block table: which blocks hold which positions |
//! | [`hash`] | prefix identity: chained XXH3-64 hashes of full blocks, shared with the router |
//! | [`prefix`] | the prefix cache: hash → block, one cache reference per block, LRU of evictable blocks |
//! | [`events`] | `Stored` / `Removed` events with per-worker monotonic [`EventId`]s |
//! | [`manager`] | [`KvManager`]: the one owner of a worker's pool, cache and events |
//!
//! MLA caches one 576-wide latent row per token per layer (512 compressed + 64 rope for the
//! DeepSeek-V3 family), with no head axis. Pages of `page_size` tokens (64 by default) form a
//! block; a block is shared between sequences by reference count, which is how a cached prompt
//! prefix is reused without copying. Each layer's region is contiguous so a transport can
//! register it once and ship it layer by layer.
//!
//! Full blocks are named by chained hashes and kept in a prefix cache after their sequence ends,
//! until the pool needs them back; the worker announces what it caches and evicts as events so
//! the router can send a prompt where its prefix already is. Both workers go through
//! [`KvManager`] for all of it.
pub mod cache;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod device;
pub mod events;
pub mod fences;
/// Prefix identity (chained block hashes), owned by the wire contract it is part of.
pub use ferry_proto::block_hash as hash;
pub mod layout;
pub mod lease;
pub mod manager;
pub mod pool;
pub mod prefix;
pub mod rows;
pub mod table;

pub use cache::{KvMut, KvRef, KvRows, KvStore};
pub use events::{EventLog, KvEvent, KvEventData};
pub use fences::RemoteFences;
pub use ferry_proto::ids::{BlockHash, EventId};
pub use hash::{block_hashes, chain_hash, BLOCK_HASH_SEED};
pub use layout::KvLayout;
pub use lease::{Lease, Leases, LEASE_TIMEOUT};
pub use manager::KvManager;
pub use pool::{block_runs, BlockId, HostRows, KvPool, RowBuffer, RowMemory};
pub use prefix::PrefixCache;
pub use rows::{DeviceRows, KvDtype, LayerRows};
pub use table::BlockTable;
