//! The router's errors and their one mapping to wire codes.
//!
//! | type | raised by | wire |
//! |---|---|---|
//! | [`RequestError`] | one client request (validation, admission, dispatch) | [`RequestError::code`] → `tonic::Status` here, HTTP status in `http/error.rs` from the same code |
//! | [`RegistryError`] | one worker's Registry call | INVALID_ARGUMENT; ALREADY_EXISTS for a live id claimed from another address |
//! | [`RouterError`] | starting or running the router | none: returned to the CLI |
//!
//! What a failed request answers, by cause ([`RequestError::code`], then `http/error.rs`):
//!
//! | cause | variant | gRPC | HTTP |
//! |---|---|---|---|
//! | bad input (names the field) | `Invalid` | INVALID_ARGUMENT | 400 |
//! | no API key, a malformed one, or an unknown one (keys on) | `Unauthenticated` | UNAUTHENTICATED | 401 |
//! | the key at its `max_concurrent` | `KeyConcurrency` | RESOURCE_EXHAUSTED + `retry-after` | 429 + `Retry-After` |
//! | the key's `tokens_per_minute` spent for now | `KeyRate` | RESOURCE_EXHAUSTED + `retry-after` | 429 + `Retry-After` |
//! | prompt + `max_tokens` above the key's whole `tokens_per_minute` (can never pass) | `OverKeyBudget` | INVALID_ARGUMENT | 400 |
//! | the router at `max_concurrent_requests` | `Overloaded` | RESOURCE_EXHAUSTED + `retry-after` | 429 + `Retry-After` |
//! | the estimated TTFT exceeds `--ttft-slo-ms` (`mooncake` policy) | `TtftSlo` | RESOURCE_EXHAUSTED + `retry-after` | 429 + `Retry-After` |
//! | no healthy decode worker registered | `NoDecodeWorker` | UNAVAILABLE | 503 |
//! | the router shutting down | `ShuttingDown` | UNAVAILABLE | 503 |
//! | a decode worker refused or failed | `Worker` | its INVALID_ARGUMENT, RESOURCE_EXHAUSTED, INTERNAL, CANCELLED, OUT_OF_RANGE kept; anything else (UNAVAILABLE, a broken stream, …) UNAVAILABLE | from the code |
//! | a bug in the router | `Internal` | INTERNAL | 500 |
//!
//! `Retry-After` (HTTP header) and `retry-after` (gRPC metadata) carry whole seconds, rounded
//! up, at least 1 ([`RequestError::retry_after_secs`]): the token limiter's wait for
//! `KeyRate`, [`RETRY_AFTER_BUSY`] for the others.
//!
//! A worker's INTERNAL is passed on as INTERNAL: the router cannot tell what caused it. (A
//! failed prefill peer under `--on-prefill-failure fail` arrives that way today.)
//!
//! `From` impls never log: errors are logged once, at the edge, in the request span, by
//! [`log_failure`].
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use ferry_proto::ids::WorkerId;
use tonic::{Code, Status};

use crate::auth::{AuthError, KeysFileError};
use crate::validate::ValidationError;

/// What a 429 for a busy router or key (not a spent token budget) tells the client to wait:
/// load changes quickly, so a short pause.
pub const RETRY_AFTER_BUSY: Duration = Duration::from_secs(1);

/// Why one client request failed.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The request is malformed or out of limits; names the field.
    #[error(transparent)]
    Invalid(#[from] ValidationError),

    /// Too many requests in flight.
    #[error("the router is at its limit of {limit} concurrent requests; retry later")]
    Overloaded {
        /// `max_concurrent_requests`.
        limit: usize,
    },

    /// The policy estimates this request would miss the TTFT SLO on the best worker (early
    /// rejection: better refused now than served late).
    #[error(
        "estimated time to first token {estimated_ms} ms exceeds the {slo_ms} ms SLO; retry later"
    )]
    TtftSlo {
        /// The policy's estimate on the best worker.
        estimated_ms: u64,
        /// `ttft_slo_ms`.
        slo_ms: u64,
    },

    /// API keys are on and the request has no valid one.
    #[error(transparent)]
    Unauthenticated(#[from] AuthError),

    /// The API key has `max_concurrent` requests in flight already.
    #[error("API key `{key}` is at its limit of {limit} concurrent requests; retry later")]
    KeyConcurrency {
        /// The key's name (never the key).
        key: String,
        /// Its `max_concurrent`.
        limit: usize,
    },

    /// The API key's `tokens_per_minute` is spent for now.
    #[error(
        "API key `{key}` is over its {per_minute} tokens per minute: this request needs {cost} \
         (prompt + `max_tokens`); retry in {}s", .retry_after.as_secs_f64().ceil().max(1.0)
    )]
    KeyRate {
        /// The key's name.
        key: String,
        /// Its `tokens_per_minute`.
        per_minute: u32,
        /// What this request is charged.
        cost: u64,
        /// When the budget will have refilled enough.
        retry_after: Duration,
    },

    /// The request costs more than the API key's whole per-minute budget: waiting never helps.
    #[error(
        "prompt + `max_tokens` = {cost} tokens exceeds API key `{key}`'s whole \
         budget of {per_minute} tokens per minute, so it can never be admitted; lower `max_tokens`"
    )]
    OverKeyBudget {
        /// The key's name.
        key: String,
        /// Its `tokens_per_minute`.
        per_minute: u32,
        /// What this request would be charged.
        cost: u64,
    },

    /// No decode worker is registered and healthy.
    #[error("no healthy decode worker is registered")]
    NoDecodeWorker,

    /// A decode worker refused or failed the request.
    #[error("decode worker `{worker}` failed: {message}")]
    Worker {
        /// The worker.
        worker: WorkerId,
        /// The code the worker answered with (or UNAVAILABLE for a broken stream).
        code: Code,
        /// The worker's message.
        message: String,
    },

    /// The router is shutting down and ended the stream.
    #[error("the router is shutting down")]
    ShuttingDown,

    /// A bug or an unexpected failure inside the router (e.g. the tokenizer failed on valid
    /// input).
    #[error("internal error: {0}")]
    Internal(String),
}

impl RequestError {
    /// A worker failure from a tonic status.
    pub fn worker(worker: &WorkerId, status: &Status) -> Self {
        Self::Worker {
            worker: worker.clone(),
            code: status.code(),
            message: status.message().to_string(),
        }
    }

    /// The gRPC code of this error; HTTP statuses derive from it (`http/error.rs`).
    pub fn code(&self) -> Code {
        match self {
            Self::Invalid(_) | Self::OverKeyBudget { .. } => Code::InvalidArgument,
            Self::Unauthenticated(_) => Code::Unauthenticated,
            Self::Overloaded { .. }
            | Self::TtftSlo { .. }
            | Self::KeyConcurrency { .. }
            | Self::KeyRate { .. } => Code::ResourceExhausted,
            Self::NoDecodeWorker | Self::ShuttingDown => Code::Unavailable,
            Self::Worker { code, .. } => match code {
                Code::InvalidArgument
                | Code::ResourceExhausted
                | Code::Internal
                | Code::Cancelled
                | Code::OutOfRange => *code,
                _ => Code::Unavailable,
            },
            Self::Internal(_) => Code::Internal,
        }
    }

    /// A stable snake_case name, for metrics labels and the `code` of HTTP error bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Invalid(e) => e.kind(),
            Self::Unauthenticated(_) => "invalid_api_key",
            Self::KeyConcurrency { .. } => "concurrency_limited",
            Self::KeyRate { .. } => "rate_limited",
            Self::OverKeyBudget { .. } => "exceeds_key_budget",
            Self::Overloaded { .. } => "overloaded",
            Self::TtftSlo { .. } => "ttft_slo",
            Self::NoDecodeWorker => "no_decode_worker",
            Self::Worker { .. } => "worker_failed",
            Self::ShuttingDown => "shutting_down",
            Self::Internal(_) => "internal",
        }
    }

    /// The request field at fault, for validation errors.
    pub fn param(&self) -> Option<&str> {
        match self {
            Self::Invalid(e) => Some(&e.field),
            Self::OverKeyBudget { .. } => Some("max_tokens"),
            _ => None,
        }
    }

    /// How long the client should wait before retrying, for the 429s that a retry can cure.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::KeyRate { retry_after, .. } => Some(*retry_after),
            Self::Overloaded { .. } | Self::TtftSlo { .. } | Self::KeyConcurrency { .. } => {
                Some(RETRY_AFTER_BUSY)
            }
            _ => None,
        }
    }

    /// [`Self::retry_after`] in whole seconds as `Retry-After` carries it: rounded up, >= 1.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after()
            .map(|d| d.as_secs() + u64::from(d.subsec_nanos() > 0))
            .map(|s| s.max(1))
    }
}

/// Logs a failed request once (call it at the edge, inside the request span), at a level by
/// its kind: client mistakes at debug, overload at info, the rest at warn.
pub fn log_failure(e: &RequestError) {
    match e.code() {
        Code::InvalidArgument => tracing::debug!(error = %e, kind = e.kind(), "request rejected"),
        Code::ResourceExhausted | Code::Unauthenticated => {
            tracing::info!(error = %e, kind = e.kind(), "request rejected")
        }
        _ => tracing::warn!(error = %e, kind = e.kind(), "request failed"),
    }
}

/// The gRPC metadata key that carries [`RequestError::retry_after_secs`].
pub const RETRY_AFTER_METADATA: &str = "retry-after";

impl From<RequestError> for Status {
    fn from(e: RequestError) -> Self {
        let mut status = Status::new(e.code(), e.to_string());
        if let Some(secs) = e.retry_after_secs() {
            status.metadata_mut().insert(
                RETRY_AFTER_METADATA,
                tonic::metadata::MetadataValue::from(secs),
            );
        }
        status
    }
}

/// Why a worker's Registry call was refused.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// A field of the worker's message is missing or out of limits.
    #[error("`{field}` {message}")]
    Invalid {
        /// The message field, as spelled in registry.proto.
        field: &'static str,
        /// The limit and the value.
        message: String,
    },
    /// The id belongs to a live worker at another address: refused, not applied, so nobody
    /// can redirect a worker's traffic by registering its id.
    #[error(
        "worker `{id}` is live at {registered}; a registration from {claimed} is refused until it \
         stops heartbeating"
    )]
    Claimed {
        /// The id.
        id: WorkerId,
        /// Where the live worker is.
        registered: String,
        /// Where the refused registration said it is.
        claimed: String,
    },
}

impl RegistryError {
    /// An [`RegistryError::Invalid`] for `field`.
    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid {
            field,
            message: message.into(),
        }
    }
}

impl From<RegistryError> for Status {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::Invalid { .. } => Status::invalid_argument(e.to_string()),
            RegistryError::Claimed { .. } => Status::already_exists(e.to_string()),
        }
    }
}

/// Why the router could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// A config value is out of limits.
    #[error("config `{field}` {message}")]
    Config {
        /// The config field.
        field: &'static str,
        /// The limit and the value.
        message: String,
    },

    /// The tokenizer or `config.json` could not be loaded.
    #[error("cannot load the model from `{}`: {source}", dir.display())]
    Model {
        /// The model directory.
        dir: PathBuf,
        /// What failed.
        #[source]
        source: ferry_modelcard::CardError,
    },

    /// A listening socket could not be bound.
    #[error("cannot bind the {server} server to {addr}")]
    Bind {
        /// `grpc` or `http`.
        server: &'static str,
        /// The address asked for.
        addr: SocketAddr,
        /// The operating-system error.
        #[source]
        source: std::io::Error,
    },

    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),

    /// The HTTP server failed.
    #[error("HTTP server: {0}")]
    Http(#[source] std::io::Error),

    /// The reflection service could not be built from the descriptor set.
    #[error("gRPC reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),

    /// The API keys file is unreadable or invalid (names the line and field).
    #[error(transparent)]
    ApiKeys(#[from] KeysFileError),

    /// The TLS certificate or key could not be loaded.
    #[error("TLS: cannot use `{}`: {message}", path.display())]
    Tls {
        /// The certificate or key file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },

    /// A server task panicked or was cancelled.
    #[error("server task: {0}")]
    Task(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_mapped_once() {
        let invalid =
            RequestError::Invalid(ValidationError::new("max_tokens", "must be >= 1, got 0"));
        assert_eq!(invalid.code(), Code::InvalidArgument);
        assert_eq!(invalid.param(), Some("max_tokens"));
        let status = Status::from(invalid);
        assert_eq!(status.message(), "`max_tokens` must be >= 1, got 0");
        assert_eq!(
            RequestError::Overloaded { limit: 1 }.code(),
            Code::ResourceExhausted
        );
        assert_eq!(RequestError::NoDecodeWorker.code(), Code::Unavailable);
        let broken = RequestError::worker(&WorkerId::from("d0"), &Status::unknown("reset"));
        assert_eq!(broken.code(), Code::Unavailable);
    }

    #[test]
    fn a_worker_code_is_kept_by_class() {
        let d0 = WorkerId::from("d0");
        let cases = [
            (Code::InvalidArgument, Code::InvalidArgument),
            (Code::ResourceExhausted, Code::ResourceExhausted),
            (Code::Internal, Code::Internal),
            (Code::Cancelled, Code::Cancelled),
            (Code::OutOfRange, Code::OutOfRange),
            (Code::Unavailable, Code::Unavailable),
            (Code::DeadlineExceeded, Code::Unavailable),
            (Code::Aborted, Code::Unavailable),
            (Code::FailedPrecondition, Code::Unavailable),
            (Code::Unknown, Code::Unavailable),
        ];
        for (worker, client) in cases {
            let e = RequestError::worker(&d0, &Status::new(worker, "cause"));
            assert_eq!(e.code(), client, "worker answered {worker:?}");
            assert_eq!(e.kind(), "worker_failed");
            assert_eq!(e.to_string(), "decode worker `d0` failed: cause");
        }
        assert_eq!(RequestError::ShuttingDown.code(), Code::Unavailable);
        assert_eq!(RequestError::Internal("bug".into()).code(), Code::Internal);
    }

    #[test]
    fn retry_after_rounds_up_and_reaches_grpc_metadata() {
        let rate = |ms| RequestError::KeyRate {
            key: "a".into(),
            per_minute: 60,
            cost: 10,
            retry_after: Duration::from_millis(ms),
        };
        assert_eq!(rate(1).retry_after_secs(), Some(1));
        assert_eq!(rate(2000).retry_after_secs(), Some(2));
        assert_eq!(rate(2001).retry_after_secs(), Some(3));
        assert_eq!(rate(0).retry_after_secs(), Some(1));
        assert_eq!(
            RequestError::Overloaded { limit: 1 }.retry_after_secs(),
            Some(1)
        );
        assert_eq!(RequestError::NoDecodeWorker.retry_after_secs(), None);
        let status = Status::from(rate(2500));
        assert_eq!(status.code(), Code::ResourceExhausted);
        let header = status
            .metadata()
            .get(RETRY_AFTER_METADATA)
            .expect("retry-after");
        assert_eq!(header.to_str().ok(), Some("3"));
        let status = Status::from(RequestError::Invalid(ValidationError::new("x", "bad")));
        assert!(status.metadata().get(RETRY_AFTER_METADATA).is_none());
    }
}
