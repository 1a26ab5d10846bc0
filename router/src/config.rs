//! The router's configuration: one struct, parsed by clap (flags and `FERRY_ROUTER_*`
//! environment variables, read by clap in the CLI, never by this library) or deserialized, and
//! checked once by [`RouterConfig::check`] before anything starts.
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use ferry_proto::auth::ClusterToken;

use crate::error::RouterError;

/// Which routing policy picks the (prefill, decode) pair of each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Rotate through the workers of each role; ignores load and cache.
    RoundRobin,
    /// Fewest queued prefill blocks on P, fewest active requests on D; ignores the cache.
    LeastLoaded,
    /// Cost in blocks: queued + uncached prefill work on P, active blocks on D.
    #[default]
    CacheAware,
    /// Mooncake's Conductor: least estimated TTFT on P (queued + uncached prefill through a
    /// per-token cost model with an attention term), D as cache_aware.
    Mooncake,
}

impl PolicyKind {
    /// Every policy, in declaration order.
    pub const ALL: [PolicyKind; 4] = [
        Self::RoundRobin,
        Self::LeastLoaded,
        Self::CacheAware,
        Self::Mooncake,
    ];

    /// The snake_case name used on the command line and in config files.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RoundRobin => "round_robin",
            Self::LeastLoaded => "least_loaded",
            Self::CacheAware => "cache_aware",
            Self::Mooncake => "mooncake",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                format!("unknown policy `{s}`; expected round_robin, least_loaded, cache_aware or mooncake")
            })
    }
}

/// Everything the router needs to start.
#[derive(Debug, Clone, PartialEq, clap::Args, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// Address of the public gRPC server (ferry.v1.Inference, health, reflection).
    #[arg(
        long,
        env = "FERRY_ROUTER_GRPC_ADDR",
        default_value = "127.0.0.1:50051"
    )]
    pub grpc_addr: SocketAddr,

    /// Address of the OpenAI-compatible HTTP server.
    #[arg(long, env = "FERRY_ROUTER_HTTP_ADDR", default_value = "127.0.0.1:8000")]
    pub http_addr: SocketAddr,

    /// Address of the internal gRPC server (the Registry workers register and heartbeat with,
    /// and health). Never the public address; off loopback it needs a cluster token.
    #[arg(
        long,
        env = "FERRY_ROUTER_INTERNAL_ADDR",
        default_value = "127.0.0.1:50052"
    )]
    pub internal_addr: SocketAddr,

    /// File whose first line is the cluster token every internal call must carry (the same
    /// file or `FERRY_CLUSTER_TOKEN` on every worker). Without a token the internal plane is
    /// unauthenticated, which is allowed on a loopback `--internal-addr` only.
    #[arg(long, env = "FERRY_CLUSTER_TOKEN_FILE")]
    pub cluster_token_file: Option<PathBuf>,

    /// The cluster token itself; set `FERRY_CLUSTER_TOKEN` rather than the flag, which other
    /// local users can read in the process list.
    #[arg(long, env = "FERRY_CLUSTER_TOKEN", hide = true, hide_env_values = true)]
    #[serde(skip)]
    pub cluster_token: Option<ClusterToken>,

    /// Model directory (tokenizer.json, tokenizer_config.json, config.json); the router reads
    /// only the tokenizer and the config, never the weights.
    #[arg(long = "model", env = "FERRY_MODEL", default_value_os_t = ferry_modelcard::embedded::default_model_dir())]
    pub model_dir: PathBuf,

    /// Name clients use in `model`; empty means the model directory's name.
    #[arg(long, env = "FERRY_SERVED_MODEL_NAME", default_value = "")]
    pub served_model_name: String,

    /// Routing policy.
    #[arg(long, env = "FERRY_ROUTER_POLICY", value_enum, default_value_t = PolicyKind::CacheAware)]
    pub policy: PolicyKind,

    /// A worker whose last heartbeat is older than this is dropped from routing and removed.
    #[arg(
        long,
        env = "FERRY_ROUTER_HEARTBEAT_TIMEOUT_MS",
        default_value_t = 3000
    )]
    pub heartbeat_timeout_ms: u64,

    /// Tokens per KV block; must equal every worker's page size (block hashes depend on it).
    #[arg(long, env = "FERRY_PAGE_SIZE", default_value_t = 64)]
    pub page_size: usize,

    /// Requests in flight at most; beyond it RESOURCE_EXHAUSTED (gRPC) / 429 (HTTP).
    #[arg(
        long,
        env = "FERRY_ROUTER_MAX_CONCURRENT_REQUESTS",
        default_value_t = 256
    )]
    pub max_concurrent_requests: usize,

    /// On shutdown, how long open streams may run before they are ended with an error.
    #[arg(long, env = "FERRY_ROUTER_DRAIN_TIMEOUT_MS", default_value_t = 5000)]
    pub drain_timeout_ms: u64,

    /// Time-to-first-token SLO: with the `mooncake` policy, a request whose estimated TTFT on
    /// the best worker exceeds it is rejected at once with RESOURCE_EXHAUSTED (gRPC) / 429
    /// (HTTP) instead of queueing (Mooncake's early rejection). Unset: never.
    #[arg(long, env = "FERRY_ROUTER_TTFT_SLO_MS")]
    pub ttft_slo_ms: Option<u64>,

    /// API keys of the public plane, one per line with optional `name=`, `max_concurrent=`
    /// and `tokens_per_minute=` (docs/security.md). Unset: no authentication.
    #[arg(long, env = "FERRY_ROUTER_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,

    /// An HTTP/1 request head must arrive whole within this many ms of the connection being
    /// ready for it (on accept, TLS handshake included, and after each response, which also
    /// closes idle keep-alive connections).
    #[arg(
        long,
        env = "FERRY_ROUTER_HTTP_HEADER_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub http_header_timeout_ms: u64,

    /// PEM certificate chain for TLS on both public listeners (with `--tls-key`).
    #[arg(long, env = "FERRY_ROUTER_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key for TLS on both public listeners (with `--tls-cert`).
    #[arg(long, env = "FERRY_ROUTER_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Request migration: when a decode worker fails mid-stream (broken connection,
    /// UNAVAILABLE, a stream that ends without a finish reason), resume the request on another
    /// decode worker with the prompt and the tokens already streamed, at most this many times
    /// per request (with `n` > 1: per sample, each resumed on its own); the client's stream
    /// continues without an error. 0 turns it off.
    #[arg(long, env = "FERRY_ROUTER_MAX_MIGRATIONS", default_value_t = 3)]
    pub max_migrations: u32,

    /// The events plane: a NATS server (`nats://host:port`, JetStream enabled) where workers
    /// started with the same `--events` publish their heartbeats and KV caches, so that every
    /// router there routes to every worker with an exact prefix index, and routers share
    /// their predictive load (docs/deploy.md, "Several routers"). Workers may still register
    /// directly as well. Unset: direct registration only.
    #[arg(long, env = "FERRY_EVENTS")]
    pub events: Option<String>,

    /// This router's name on the events plane; must differ between routers (default: random
    /// per start).
    #[arg(long, env = "FERRY_ROUTER_ID", default_value = "")]
    pub router_id: String,

    /// With `--events`: publish this router's predictive load and add the other routers' to
    /// its own, so that routers do not herd onto the worker that looked idle at the last
    /// heartbeat (off only to measure the difference).
    #[arg(long, env = "FERRY_ROUTER_SHARE_LOAD", default_value_t = true, action = clap::ArgAction::Set)]
    pub share_load: bool,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            grpc_addr: SocketAddr::from(([127, 0, 0, 1], 50051)),
            http_addr: SocketAddr::from(([127, 0, 0, 1], 8000)),
            internal_addr: SocketAddr::from(([127, 0, 0, 1], 50052)),
            cluster_token_file: None,
            cluster_token: None,
            model_dir: ferry_modelcard::embedded::default_model_dir(),
            served_model_name: String::new(),
            policy: PolicyKind::CacheAware,
            heartbeat_timeout_ms: 3000,
            page_size: 64,
            max_concurrent_requests: 256,
            drain_timeout_ms: 5000,
            ttft_slo_ms: None,
            api_keys_file: None,
            http_header_timeout_ms: 10_000,
            tls_cert: None,
            tls_key: None,
            max_migrations: 3,
            events: None,
            router_id: String::new(),
            share_load: true,
        }
    }
}

impl RouterConfig {
    /// A config for tests: both servers on `127.0.0.1:0` (ephemeral ports), the rest default.
    pub fn ephemeral() -> Self {
        Self {
            grpc_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            http_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            internal_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            ..Self::default()
        }
    }

    /// Checks the values that have limits; the error names the field, the limit and the value.
    pub fn check(&self) -> Result<(), RouterError> {
        let positive = [
            ("heartbeat_timeout_ms", self.heartbeat_timeout_ms),
            ("page_size", self.page_size as u64),
            ("http_header_timeout_ms", self.http_header_timeout_ms),
            (
                "max_concurrent_requests",
                self.max_concurrent_requests as u64,
            ),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(RouterError::Config {
                    field,
                    message: "must be >= 1, got 0".into(),
                });
            }
        }
        if self.max_concurrent_requests > tokio::sync::Semaphore::MAX_PERMITS {
            return Err(RouterError::Config {
                field: "max_concurrent_requests",
                message: format!(
                    "must be <= {}, got {}",
                    tokio::sync::Semaphore::MAX_PERMITS,
                    self.max_concurrent_requests
                ),
            });
        }
        let public = [self.grpc_addr, self.http_addr];
        if self.internal_addr.port() != 0 && public.contains(&self.internal_addr) {
            return Err(RouterError::Config {
                field: "internal_addr",
                message: format!(
                    "must differ from the public addresses, got {}",
                    self.internal_addr
                ),
            });
        }
        let has_token = self.cluster_token_file.is_some() || self.cluster_token.is_some();
        if !self.internal_addr.ip().is_loopback() && !has_token {
            return Err(RouterError::Config {
                field: "internal_addr",
                message: format!(
                    "{} is not a loopback address: give a cluster token \
                     (--cluster-token-file or FERRY_CLUSTER_TOKEN) so that only the cluster's \
                     workers can register",
                    self.internal_addr
                ),
            });
        }
        self.events_url()?;
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => Err(RouterError::Config {
                field: "tls_key",
                message: "must be given with `tls_cert`, got only `tls_cert`".into(),
            }),
            (None, Some(_)) => Err(RouterError::Config {
                field: "tls_cert",
                message: "must be given with `tls_key`, got only `tls_key`".into(),
            }),
            _ => Ok(()),
        }
    }

    /// The certificate and key files, when TLS is on (call after [`Self::check`]).
    pub fn tls_files(&self) -> Option<(&std::path::Path, &std::path::Path)> {
        Some((self.tls_cert.as_deref()?, self.tls_key.as_deref()?))
    }

    /// `http_header_timeout_ms` as a duration.
    pub fn http_header_timeout(&self) -> Duration {
        Duration::from_millis(self.http_header_timeout_ms)
    }

    /// The cluster token (read from `cluster_token_file` if set), `None` without one.
    pub fn token(&self) -> Result<Option<ClusterToken>, RouterError> {
        ClusterToken::resolve(
            self.cluster_token_file.as_deref(),
            self.cluster_token.as_ref(),
        )
        .map_err(|e| RouterError::Config {
            field: "cluster_token_file",
            message: e.to_string(),
        })
    }

    /// The name clients must use: `served_model_name`, or the model directory's last
    /// component when that is empty (`"ferry"` if the directory has no name).
    pub fn model_name(&self) -> String {
        if !self.served_model_name.is_empty() {
            return self.served_model_name.clone();
        }
        self.model_dir
            .components()
            .filter_map(|c| match c {
                std::path::Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
                _ => None,
            })
            .next_back()
            .unwrap_or_else(|| "ferry".to_string())
    }

    /// The events plane's URL, if one is set.
    pub fn events_url(&self) -> Result<Option<ferry_events::EventsUrl>, RouterError> {
        self.events.as_deref().map(str::parse).transpose().map_err(
            |e: ferry_events::EventsError| RouterError::Config {
                field: "events",
                message: e.to_string(),
            },
        )
    }

    /// `heartbeat_timeout_ms` as a duration.
    pub fn heartbeat_timeout(&self) -> Duration {
        Duration::from_millis(self.heartbeat_timeout_ms)
    }

    /// `drain_timeout_ms` as a duration.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        router: RouterConfig,
    }

    #[test]
    fn clap_defaults_match_default_impl() {
        let cli = Cli::try_parse_from(["x"]).expect("defaults parse");
        assert_eq!(cli.router, RouterConfig::default());
    }

    #[test]
    fn policy_names_round_trip() {
        for kind in PolicyKind::ALL {
            assert_eq!(kind.to_string().parse::<PolicyKind>(), Ok(kind));
        }
        let cli = Cli::try_parse_from(["x", "--policy", "least_loaded"]).expect("parses");
        assert_eq!(cli.router.policy, PolicyKind::LeastLoaded);
        let cli = Cli::try_parse_from(["x", "--policy", "mooncake"]).expect("parses");
        assert_eq!(cli.router.policy, PolicyKind::Mooncake);
        let err = "nope".parse::<PolicyKind>().expect_err("unknown");
        assert!(err.contains("mooncake"), "{err}");
        assert!("nope".parse::<PolicyKind>().is_err());
    }

    #[test]
    fn model_name_falls_back_to_dir_name() {
        let config = RouterConfig::default();
        assert_eq!(config.model_name(), "tiny-k3");
        let named = RouterConfig {
            served_model_name: "kimi".into(),
            ..RouterConfig::default()
        };
        assert_eq!(named.model_name(), "kimi");
    }

    #[test]
    fn the_internal_plane_is_its_own_address_and_needs_a_token_off_loopback() {
        let same = RouterConfig {
            internal_addr: RouterConfig::default().grpc_addr,
            ..RouterConfig::default()
        };
        let err = same.check().expect_err("shared with the public port");
        assert!(err.to_string().contains("`internal_addr`"), "{err}");

        let exposed = RouterConfig {
            internal_addr: "0.0.0.0:50052".parse().expect("addr"),
            ..RouterConfig::default()
        };
        let err = exposed.check().expect_err("no token off loopback");
        assert!(err.to_string().contains("cluster token"), "{err}");
        let with_token = RouterConfig {
            cluster_token: Some("0123456789abcdef".parse().expect("token")),
            ..exposed
        };
        with_token.check().expect("a token makes it fine");
        assert!(!format!("{with_token:?}").contains("0123456789abcdef"));
    }

    #[test]
    fn zero_limits_are_rejected_with_the_field() {
        let config = RouterConfig {
            page_size: 0,
            ..RouterConfig::default()
        };
        let err = config.check().expect_err("page_size 0");
        assert!(err.to_string().contains("`page_size`"), "{err}");
    }

    #[test]
    fn tls_needs_both_files() {
        let cli = Cli::try_parse_from(["x", "--tls-cert", "c.pem"]).expect("parses");
        let err = cli.router.check().expect_err("cert without key");
        assert!(err.to_string().contains("`tls_key`"), "{err}");
        let cli = Cli::try_parse_from(["x", "--tls-key", "k.pem"]).expect("parses");
        let err = cli.router.check().expect_err("key without cert");
        assert!(err.to_string().contains("`tls_cert`"), "{err}");
        let cli = Cli::try_parse_from(["x", "--tls-cert", "c.pem", "--tls-key", "k.pem"])
            .expect("parses");
        cli.router.check().expect("both");
        assert!(cli.router.tls_files().is_some());
    }
}
