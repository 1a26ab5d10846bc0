//! The prefill worker.
//!
//! | module | owns |
//! |---|---|
//! | [`service`] | `PrefillWorker` gRPC: validate, connect to the destination, run the prefill job, report |
//! | [`push`] | the per-layer hook that hands each finished layer's blocks to a transfer stream |
//! | [`server`] | [`server::PrefillServer`]: load the model, start the engine, bind, register, serve |
//! | [`metrics`] | the prefill worker's Prometheus series (requests, KV transfer bytes and duration) |
//!
//! A prefill request names the decode worker's blocks. The engine reuses this worker's own
//! prefix cache, computes the rest, and after every layer the hook hands that layer's blocks
//! (from the destination's first missing block on) to a `LayerStreamer`, so the transfer
//! overlaps the remaining layers. The response (first token, counts, bytes) is sent only after
//! the transport confirmed every write landed.
//!
//! Two `unsafe` blocks (`push.rs`) hand the engine's leased cache to the transport to read in
//! place: device-cache addresses as a `DeviceBatch`, host rows as in-place `Payload`s; the
//! rest of the crate is safe code.
#![deny(unsafe_code)]

pub mod metrics;
pub mod push;
pub mod server;
pub mod service;

pub use server::{PrefillArgs, PrefillServer};
