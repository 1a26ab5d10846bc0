//! The events plane: what routers and workers exchange on NATS when several routers share one
//! set of workers (`--events nats://host:port`; docs/deploy.md, "Several routers").
//!
//! | module | owns |
//! |---|---|
//! | [`subject`] | every subject and the KV stream's name: the plane's whole address space |
//! | [`EventsUrl`] | the validated `--events` value |
//! | [`Connection`] | a NATS client authenticated with the cluster token, its JetStream context, connection state, and the KV stream |
//!
//! ```text
//!  worker ──WorkerHeartbeat (core, every period)──► ferry.hb.<role>.<w> ──► every router: membership, load
//!         ──KvFeedMessage (JetStream, acked)──────► ferry.kv.<w>  (stream FERRY_KV) ──► every router: exact index
//!         ◄──snapshot request (core)────────────── ferry.ctl.snapshot.<w> ◄── a router that saw a gap
//!  router ──RouterLoad (core, on change)──────────► ferry.load.<r> ──► the other routers: predictive load
//! ```
//!
//! Why JetStream for the KV feed and core NATS for the rest: a router that starts late or
//! restarts must rebuild an exact index, so cache changes are kept (a stream, replayed from its
//! start); liveness and load are only worth their latest value, so they are fire-and-forget.
//! The messages are the protobuf types of `ferry.internal.v1` (`registry.proto`); validating
//! them is the consumer's job, as for the same messages over gRPC.
#![forbid(unsafe_code)]

pub mod subject;

/// A core NATS subscription (a stream of messages).
pub use async_nats::Subscriber;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use async_nats::jetstream;
use ferry_proto::auth::ClusterToken;
use tokio::sync::watch;

/// Errors of the events plane.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// `--events` is not a NATS URL.
    #[error("`events` must be nats://host:port (or tls://host:port), got {0:?}")]
    Url(String),
    /// Connecting failed (only without retrying in the background).
    #[error("connecting to NATS at {url}: {reason}")]
    Connect {
        /// Where.
        url: String,
        /// Why.
        reason: String,
    },
    /// A JetStream call failed (the stream could not be created, a publish was not acked…).
    #[error("NATS JetStream: {0}")]
    JetStream(String),
    /// A core NATS call failed.
    #[error("NATS: {0}")]
    Nats(String),
}

impl EventsError {
    /// Wraps any displayable JetStream error.
    pub fn jetstream(e: impl fmt::Display) -> Self {
        Self::JetStream(e.to_string())
    }

    /// Wraps any displayable core NATS error.
    pub fn nats(e: impl fmt::Display) -> Self {
        Self::Nats(e.to_string())
    }
}

/// A validated `--events` value: a NATS server URL (`nats://`, `tls://`; several servers of a
/// cluster comma-separated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventsUrl(String);

impl FromStr for EventsUrl {
    type Err = EventsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let valid = |one: &str| {
            let Some(host_port) = one
                .strip_prefix("nats://")
                .or_else(|| one.strip_prefix("tls://"))
            else {
                return false;
            };
            let (host, port) = match host_port.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (host_port, None),
            };
            !host.is_empty() && !host.contains('/') && port.is_none_or(|p| p.parse::<u16>().is_ok())
        };
        let ok = !s.is_empty() && s.split(',').all(|one| valid(one.trim()));
        if ok {
            Ok(Self(s.to_string()))
        } else {
            Err(EventsError::Url(s.to_string()))
        }
    }
}

impl fmt::Display for EventsUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How long the KV stream keeps messages, and how large it may grow (oldest dropped first).
/// A router replaying a trimmed stream asks the affected workers for snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLimits {
    /// Age limit.
    pub max_age: Duration,
    /// Size limit in bytes.
    pub max_bytes: i64,
}

impl Default for StreamLimits {
    fn default() -> Self {
        Self {
            max_age: Duration::from_secs(3600),
            max_bytes: 1 << 30,
        }
    }
}

/// A connection to the events plane.
#[derive(Debug, Clone)]
pub struct Connection {
    client: async_nats::Client,
    jetstream: jetstream::Context,
    connected: watch::Receiver<bool>,
    url: EventsUrl,
}

impl Connection {
    /// Connects as `name` (shown by the server's monitoring), authenticating with the cluster
    /// token when there is one (the server is then started with that token: `ferry up`
    /// does so). Returns at once; the client connects, and reconnects after losing the server,
    /// in the background, and [`Connection::connected`] tells which state it is in.
    pub async fn open(
        url: &EventsUrl,
        token: Option<&ClusterToken>,
        name: &str,
    ) -> Result<Self, EventsError> {
        let (tx, connected) = watch::channel(false);
        let mut options = async_nats::ConnectOptions::new()
            .name(name)
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(2))
            .ping_interval(Duration::from_secs(2))
            .reconnect_delay_callback(|attempt| {
                Duration::from_millis(50u64.saturating_mul(1 << attempt.min(5)))
            })
            .event_callback(move |event| {
                let tx = tx.clone();
                async move {
                    match event {
                        async_nats::Event::Connected => {
                            tx.send_replace(true);
                        }
                        async_nats::Event::Disconnected | async_nats::Event::Closed => {
                            tx.send_replace(false);
                        }
                        other => tracing::debug!(event = %other, "NATS event"),
                    }
                }
            });
        if let Some(token) = token {
            options = options.token(token.expose().to_string());
        }
        let client = options
            .connect(url.0.as_str())
            .await
            .map_err(|e| EventsError::Connect {
                url: url.to_string(),
                reason: e.to_string(),
            })?;
        let jetstream = jetstream::new(client.clone());
        Ok(Self {
            client,
            jetstream,
            connected,
            url: url.clone(),
        })
    }

    /// The core NATS client.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The JetStream context.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.jetstream
    }

    /// Whether the client is connected right now; changes as it loses and finds the server.
    pub fn connected(&self) -> watch::Receiver<bool> {
        self.connected.clone()
    }

    /// The server URL.
    pub fn url(&self) -> &EventsUrl {
        &self.url
    }

    /// The KV stream, created with `limits` if it does not exist (an existing stream keeps
    /// the limits it was created with).
    pub async fn kv_stream(
        &self,
        limits: StreamLimits,
    ) -> Result<jetstream::stream::Stream, EventsError> {
        self.jetstream
            .get_or_create_stream(jetstream::stream::Config {
                name: subject::KV_STREAM.to_string(),
                description: Some(
                    "ferry: workers' KV cache snapshots and events, per worker subject".into(),
                ),
                subjects: vec![subject::KV_ALL.to_string()],
                max_age: limits.max_age,
                max_bytes: limits.max_bytes,
                discard: jetstream::stream::DiscardPolicy::Old,
                storage: jetstream::stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(EventsError::jetstream)
    }

    /// Publishes `message` on the KV stream subject of `worker` and waits for the server's
    /// acknowledgement (so a worker knows the stream holds it, in order, before the next one).
    pub async fn publish_kv(
        &self,
        worker: &str,
        message: &ferry_proto::internal::KvFeedMessage,
    ) -> Result<(), EventsError> {
        let payload = prost::Message::encode_to_vec(message);
        self.jetstream
            .publish(subject::kv(worker), payload.into())
            .await
            .map_err(EventsError::jetstream)?
            .await
            .map_err(EventsError::jetstream)?;
        Ok(())
    }

    /// Publishes `message` on core NATS (fire-and-forget; buffered while disconnected).
    pub async fn publish<M: prost::Message>(
        &self,
        subject: String,
        message: &M,
    ) -> Result<(), EventsError> {
        self.client
            .publish(subject, message.encode_to_vec().into())
            .await
            .map_err(EventsError::nats)
    }

    /// Subscribes to `subject` (wildcards allowed) on core NATS.
    pub async fn subscribe(&self, subject: String) -> Result<async_nats::Subscriber, EventsError> {
        self.client
            .subscribe(subject)
            .await
            .map_err(EventsError::nats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        for ok in [
            "nats://127.0.0.1:4222",
            "tls://nats.example:4222",
            "nats://a:1,nats://b:2",
            "nats://nats",
        ] {
            assert!(ok.parse::<EventsUrl>().is_ok(), "{ok}");
        }
        for bad in [
            "",
            "127.0.0.1:4222",
            "http://x:1",
            "nats://",
            "nats://x:port",
            "nats://x/y",
        ] {
            let err = bad.parse::<EventsUrl>().expect_err(bad);
            assert!(err.to_string().contains("`events`"), "{err}");
        }
    }
}
