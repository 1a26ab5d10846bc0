//! The decode worker (not yet built).
//!
//! This crate will own continuous batching, remote-prefill requests to a prefill peer with the
//! `recompute`/`fail` failure policy, local-prefill fallback, and DSpark speculative decoding with
//! lossless verification. See `docs/architecture.md`.
#![forbid(unsafe_code)]
