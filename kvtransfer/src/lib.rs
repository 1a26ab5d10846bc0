//! KV-cache movement between workers (not yet built).
//!
//! This crate will own block descriptors, the layout handshake (layers, page size, latent width,
//! dtype), the `Transport` trait shaped for one-sided RDMA writes into registered remote memory,
//! and its TCP, in-process and UCX implementations, including layer-by-layer streaming so a
//! prefill worker's transfer overlaps its compute. See `docs/architecture.md`.
