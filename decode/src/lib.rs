//! The decode worker.
//!
//! | module | owns |
//! |---|---|
//! | [`service`] | `DecodeWorker` gRPC: validate, submit to the engine, stream tokens, cancel on disconnect (or one sample on `CancelSample`) |
//! | [`samples`] | the samples of running `n` > 1 calls by call id: `CancelSample` stops one, the others go on |
//! | [`remote_prefill`] | asking the prefill peer to fill reserved blocks; the `recompute` / `fail` policy |
//! | [`region`] | the KV region peers write into (forwarded to the engine thread) |
//! | [`server`] | [`server::DecodeServer`]: load, start the engine and the transfer listener, register, serve |
//! | [`spec`] | speculative-decoding flags (`--speculative`, `--drafter`, `--verify-len`) and loading the drafter |
//! | [`metrics`] | the decode worker's Prometheus series (TTFT, inter-token latency, end to end, remote prefill, speculative acceptance) |
//!
//! For a request with a prefill peer the engine reserves the prompt's blocks (reusing this
//! worker's own cached prefix), the peer computes the rest and writes it straight into those
//! blocks, and decoding starts when the peer answers. A short uncached part is prefilled here
//! instead (`--local-prefill-threshold`). If the peer or the transfer fails, the request is
//! recomputed here (`--on-prefill-failure recompute`, the default) or failed (`fail`).
// One exception, in `region.rs`: exposing the engine's host rows to the transport as
// registered memory is a promise about who writes them, which only `unsafe` can state.
#![deny(unsafe_code)]

pub mod metrics;
pub mod region;
pub mod remote_prefill;
pub mod samples;
pub mod server;
pub mod service;
pub mod spec;

pub use server::{DecodeArgs, DecodeServer, FailurePolicy};
