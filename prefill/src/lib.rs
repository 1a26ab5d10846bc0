//! The prefill worker (not yet built).
//!
//! This crate will own prefill batching up to a token budget, chunking, reuse of the worker's
//! own prefix cache, and pushing each finished layer's KV blocks to the decode worker that asked
//! for them. See `docs/architecture.md`.
#![forbid(unsafe_code)]
