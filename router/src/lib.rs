//! The router and HTTP gateway (not yet built).
//!
//! This crate will own the worker registry, the KV prefix index built from worker events, the
//! routing policies (`round_robin`, `least_loaded`, `cache_aware`, `mooncake`), the public gRPC
//! API and the OpenAI-compatible HTTP API. See `docs/architecture.md`.
#![forbid(unsafe_code)]
