//! ferry's router and HTTP gateway.
//!
//! Clients speak gRPC (`ferry.v1.Inference`) or the OpenAI HTTP API; workers register, send
//! heartbeats and publish KV events over `ferry.internal.v1.Registry`. For each request the
//! router tokenizes, hashes the prompt's blocks, looks up which workers hold which prefix, picks
//! a (prefill, decode) pair and streams the decode worker's tokens back as text.
//!
//! | module | owns |
//! |---|---|
//! | [`config`] | [`RouterConfig`], [`PolicyKind`] |
//! | [`server`] | [`Router`] → [`BoundRouter`] → `run`, and [`serve`]: listeners, health, reflection, shutdown |
//! | [`state`] | [`state::AppState`], what both front doors share |
//! | [`registry`] | workers, roles, load, heartbeats, the reaper; the `Registry` gRPC service |
//! | [`events`] | the events plane (`--events`): workers heard from NATS, the index rebuilt from the KV stream, routers' shared predictive load |
//! | [`index`] | the KV prefix index built from events, with event-id gap detection |
//! | [`load`] | predictive load charged at dispatch, released by a guard |
//! | [`policy`] | `round_robin`, `least_loaded`, `cache_aware`, `mooncake`: pure choices over a snapshot |
//! | [`select`] | [`select::Selector`]: snapshot + index + policy → a pair and a load guard |
//! | [`dispatch`] | [`dispatch::Dispatcher`]: admission, `Decode` on the worker, one retry, the event stream |
//! | [`output`] | detokenization, stop strings and usage of one request's output |
//! | [`stop`] | stop-string matching across chunks |
//! | [`structured`] | structured output: `response_format` / `text.format` / gRPC shapes → a grammar, checked by compiling it |
//! | [`tools`] | tools whatever the front door: checked definitions and choice, the tool-call grammar, calls parsed from the output |
//! | [`validate`] | the one place requests become [`validate::ValidRequest`] |
//! | [`tokenize`] | tokenization, chat templates and block hashing on the blocking pool |
//! | [`grpc`] | the public `Inference` service |
//! | [`auth`] | API keys: the keys file, authentication by digest, [`auth::Caller`] |
//! | [`limits`] | per-key `max_concurrent` and `tokens_per_minute`, checked at admission |
//! | [`tls`] | the certificate and key of both public listeners |
//! | [`http`] | the OpenAI-compatible HTTP API |
//! | [`error`] | error types and their one mapping to wire codes |
//! | [`metrics`] | Prometheus metrics (`GET /metrics` on the HTTP port) |
//! | [`spans`] | the `request` span and its GenAI semantic-convention attributes |
//! | [`replay`] | trace replay: the policies over a recorded trace on a simulated cluster (`examples/replay_trace.rs`) |
//!
//! Starting one:
//! ```no_run
//! # async fn example() -> Result<(), ferry_router::RouterError> {
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! let bound = ferry_router::Router::load(ferry_router::RouterConfig::ephemeral())
//!     .await?
//!     .bind()
//!     .await?;
//! println!("gRPC on {}, HTTP on {}", bound.grpc_addr(), bound.http_addr());
//! bound.run(shutdown).await
//! # }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod auth;
pub mod config;
pub mod dispatch;
pub mod error;
pub mod events;
pub mod grpc;
pub mod http;
pub mod index;
pub mod limits;
pub mod load;
pub mod metrics;
pub mod output;
pub mod policy;
pub mod registry;
pub mod replay;
pub mod select;
pub mod server;
pub mod spans;
pub mod state;
pub mod stop;
pub mod structured;
pub mod tls;
pub mod tokenize;
pub mod tools;
pub mod validate;

pub use config::{PolicyKind, RouterConfig};
pub use error::{RequestError, RouterError};
pub use server::{serve, BoundRouter, Router};
