//! What prefill and decode workers share, written once.
//!
//! | module | owns |
//! |---|---|
//! | [`args`] | flags every worker takes, and validation of peer requests |
//! | [`grammar`] | structured output: the worker's grammar compiler (built once from the tokenizer) and wire response formats → compiled per-request grammars, off the runtime |
//! | [`registration`] | the agent that registers with the router (with a KV snapshot), heartbeats load, publishes KV events, and re-registers when the router lost track |
//! | [`events`] | the same agent's job on the events plane (`--events nats://…`): snapshot and events on the KV stream, heartbeats every router hears, snapshots on request, live prefill peers from their heartbeats |
//! | [`stats`] | engine counters → wire messages |
//! | [`shutdown`] | signals (Ctrl-C, SIGTERM, stdin closed by a parent) → one cancellation token |
//! | [`serve`] | [`serve::WorkerServer`]: the listeners, id and metrics every worker binds, and the one serve sequence (health + reflection next to the role's service, registration and heartbeats, `/metrics`, graceful shutdown) |
//! | [`metrics`] | the Prometheus registry and `/metrics` listener every worker serves, engine-derived series, queue time |
#![forbid(unsafe_code)]

pub mod args;
pub mod events;
pub mod grammar;
pub mod metrics;
pub mod registration;
pub mod serve;
pub mod shutdown;
pub mod stats;
