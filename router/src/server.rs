//! Starting and stopping a router: [`Router`] (loaded), [`BoundRouter`] (listening), [`serve`].
//!
//! ```text
//! Router::load(config)   check config, load tokenizer + config.json (blocking pool)
//!   .bind()              bind the public gRPC and HTTP listeners and the internal one
//!                        (port 0 works: read the addresses back)
//!   .run(shutdown)       serve until `shutdown` is cancelled:
//!       public gRPC:   Inference + grpc.health.v1 (Inference SERVING) + reflection v1 and
//!                      v1alpha advertising Inference and health (ferry_proto::reflection)
//!       HTTP:          the OpenAI-compatible app, through the accept loop of `http/serve.rs`
//!                      (header-read and idle timeouts)
//!       both public:   TLS with `--tls-cert` / `--tls-key` (`tls.rs`); API keys in `AppState`
//!       internal gRPC: Registry (cluster token required) + grpc.health.v1 — never public
//!       reaper: removes workers that missed their heartbeats
//!   on shutdown          health NOT_SERVING → stop accepting → drain open requests until the
//!                        deadline → end the streams still open with an error → abort leftovers
//! ```
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_proto::internal::registry_server::RegistryServer;
use ferry_proto::v1::inference_server::InferenceServer;
use tokio::net::TcpListener;
use tokio::task::JoinError;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;

use crate::config::RouterConfig;
use crate::error::RouterError;
use crate::grpc::InferenceService;
use crate::http::serve::HttpServer;
use crate::registry::RegistryService;
use crate::state::AppState;
use crate::tls::Tls;

/// After the drain deadline ends the open streams, how long the servers get to close.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// A router with its model loaded, not yet listening.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    state: Arc<AppState>,
    tls: Option<Tls>,
}

impl Router {
    /// Checks `config` and loads the tokenizer and model config from `config.model_dir`, the
    /// API keys file and the TLS certificate and key, if given.
    pub async fn load(config: RouterConfig) -> Result<Self, RouterError> {
        let state = AppState::load(&config).await?;
        let tls = match config.tls_files() {
            None => None,
            Some((cert, key)) => {
                let (cert, key) = (cert.to_path_buf(), key.to_path_buf());
                let timeout = config.http_header_timeout();
                let loaded = tokio::task::spawn_blocking(move || Tls::load(&cert, &key, timeout));
                Some(
                    loaded
                        .await
                        .map_err(|e| RouterError::Task(format!("TLS loading: {e}")))??,
                )
            }
        };
        Ok(Self { config, state, tls })
    }

    /// The shared state (registry, validator, dispatcher, model info).
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// The HTTP app, for serving it elsewhere or testing it with `oneshot`.
    pub fn http_app(&self) -> axum::Router {
        crate::http::app(self.state.clone())
    }

    /// Binds both listeners; with port 0 the OS picks, and [`BoundRouter`] tells which.
    pub async fn bind(self) -> Result<BoundRouter, RouterError> {
        let (grpc, grpc_addr) = listen("grpc", self.config.grpc_addr).await?;
        let (http, http_addr) = listen("http", self.config.http_addr).await?;
        let (internal, internal_addr) = listen("internal", self.config.internal_addr).await?;
        Ok(BoundRouter {
            config: self.config,
            state: self.state,
            tls: self.tls,
            grpc,
            http,
            internal,
            grpc_addr,
            http_addr,
            internal_addr,
        })
    }
}

async fn listen(
    server: &'static str,
    addr: SocketAddr,
) -> Result<(TcpListener, SocketAddr), RouterError> {
    let bind_error = |source| RouterError::Bind {
        server,
        addr,
        source,
    };
    let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
    let local = listener.local_addr().map_err(bind_error)?;
    Ok((listener, local))
}

/// A router whose listeners are bound.
#[derive(Debug)]
pub struct BoundRouter {
    config: RouterConfig,
    state: Arc<AppState>,
    tls: Option<Tls>,
    grpc: TcpListener,
    http: TcpListener,
    internal: TcpListener,
    grpc_addr: SocketAddr,
    http_addr: SocketAddr,
    internal_addr: SocketAddr,
}

type GrpcJoin = Result<Result<(), tonic::transport::Error>, JoinError>;
type HttpJoin = Result<std::io::Result<()>, JoinError>;

fn grpc_result(r: GrpcJoin) -> Result<(), RouterError> {
    match r {
        Ok(r) => r.map_err(RouterError::Grpc),
        Err(e) if e.is_cancelled() => Ok(()),
        Err(e) => Err(RouterError::Task(format!("gRPC server: {e}"))),
    }
}

fn http_result(r: HttpJoin) -> Result<(), RouterError> {
    match r {
        Ok(r) => r.map_err(RouterError::Http),
        Err(e) if e.is_cancelled() => Ok(()),
        Err(e) => Err(RouterError::Task(format!("HTTP server: {e}"))),
    }
}

impl BoundRouter {
    /// The bound public gRPC address (Inference, health, reflection).
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// The bound internal gRPC address (Registry, health): where workers register.
    pub fn internal_addr(&self) -> SocketAddr {
        self.internal_addr
    }

    /// The bound HTTP address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// The shared state.
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Serves until `shutdown` is cancelled, then shuts down gracefully (see the module docs).
    /// Returns early with the error if a server fails.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), RouterError> {
        let Self {
            config,
            state,
            tls,
            grpc,
            http,
            internal,
            grpc_addr,
            http_addr,
            internal_addr,
        } = self;
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter
            .set_serving::<InferenceServer<InferenceService>>()
            .await;
        let reflection = ferry_proto::reflection::routes(&[
            <InferenceServer<InferenceService> as tonic::server::NamedService>::NAME,
        ])?;
        let mut grpc_builder = tonic::transport::Server::builder();
        if let Some(tls) = &tls {
            grpc_builder = grpc_builder.tls_config(tls.grpc_config())?;
        }
        let stop_accepting = CancellationToken::new();
        let reaper = state.registry.spawn_reaper(shutdown.child_token());
        let events = match config.events_url()? {
            Some(url) => {
                let router_id = if config.router_id.is_empty() {
                    format!("router-{:08x}", rand::random::<u32>())
                } else {
                    config.router_id.clone()
                };
                let connection = ferry_events::Connection::open(
                    &url,
                    config.token()?.as_ref(),
                    &format!("ferry-{router_id}"),
                )
                .await
                .map_err(|e| RouterError::Task(e.to_string()))?;
                tracing::info!(events = %url, router = %router_id, share_load = config.share_load, "on the events plane");
                Some(crate::events::spawn(
                    crate::events::EventsParams {
                        connection,
                        registry: state.registry.clone(),
                        router_id,
                        share_load: config.share_load,
                        metrics: state.metrics.clone(),
                    },
                    shutdown.child_token(),
                ))
            }
            None => None,
        };

        let grpc_server = grpc_builder
            .add_routes(reflection)
            .add_service(health)
            .add_service(InferenceServer::new(InferenceService::new(state.clone())))
            .serve_with_incoming_shutdown(
                nodelay(TcpListenerStream::new(grpc)),
                stop_accepting.clone().cancelled_owned(),
            );
        let mut grpc_task = tokio::spawn(grpc_server);
        let stop_internal = CancellationToken::new();
        let mut internal_task = tokio::spawn(serve_internal(
            state.clone(),
            internal,
            stop_internal.clone(),
        ));
        let http_server = HttpServer {
            listener: http,
            app: crate::http::app(state.clone()),
            tls: tls.as_ref().map(Tls::http_acceptor),
            header_timeout: config.http_header_timeout(),
        };
        let mut http_task = tokio::spawn(http_server.serve(stop_accepting.clone()));
        tracing::info!(
            grpc = %grpc_addr,
            http = %http_addr,
            internal = %internal_addr,
            model = %state.model.name,
            policy = %config.policy,
            api_keys = state.keys.len(),
            tls = tls.is_some(),
            "router listening"
        );
        let loopback = grpc_addr.ip().is_loopback() && http_addr.ip().is_loopback();
        if !state.keys.is_on() && !loopback {
            tracing::warn!(
                grpc = %grpc_addr,
                http = %http_addr,
                "serving a non-loopback address without API keys: anyone who reaches it can \
                 use it (--api-keys-file, docs/security.md)"
            );
        }

        let early = tokio::select! {
            _ = shutdown.cancelled() => None,
            r = &mut grpc_task => Some(grpc_result(r).and(Err(RouterError::Task("the gRPC server stopped".into())))),
            r = &mut http_task => Some(http_result(r).and(Err(RouterError::Task("the HTTP server stopped".into())))),
            r = &mut internal_task => Some(grpc_result(r).and(Err(RouterError::Task("the internal gRPC server stopped".into())))),
        };
        if let Some(failed) = early {
            stop_accepting.cancel();
            grpc_task.abort();
            http_task.abort();
            internal_task.abort();
            reaper.abort();
            if let Some(events) = &events {
                events.abort();
            }
            return failed;
        }

        tracing::info!("router shutting down: not serving, draining open requests");
        reporter
            .set_not_serving::<InferenceServer<InferenceService>>()
            .await;
        stop_accepting.cancel();
        let aborts = [grpc_task.abort_handle(), http_task.abort_handle()];
        let mut servers = tokio::spawn(async move { (grpc_task.await, http_task.await) });
        let joined = match tokio::time::timeout(config.drain_timeout(), &mut servers).await {
            Ok(joined) => joined,
            Err(_) => {
                tracing::warn!(
                    in_flight = state.dispatcher.in_flight(),
                    "drain deadline passed; ending the open streams"
                );
                state.end_open_streams();
                match tokio::time::timeout(CLOSE_GRACE, &mut servers).await {
                    Ok(joined) => joined,
                    Err(_) => {
                        aborts.iter().for_each(tokio::task::AbortHandle::abort);
                        servers.await
                    }
                }
            }
        };
        // Workers keep registering until the public servers have drained: the streams still
        // open need their decode workers.
        stop_internal.cancel();
        if tokio::time::timeout(CLOSE_GRACE, &mut internal_task)
            .await
            .is_err()
        {
            internal_task.abort();
        }
        let _ = reaper.await;
        if let Some(events) = events {
            events.abort();
        }
        let (grpc_joined, http_joined) =
            joined.map_err(|e| RouterError::Task(format!("shutdown: {e}")))?;
        grpc_result(grpc_joined)?;
        http_result(http_joined)?;
        tracing::info!("router stopped");
        Ok(())
    }
}

/// The internal plane: the Registry, behind the cluster token, and health. No reflection:
/// nothing but ferry's own workers calls it.
async fn serve_internal(
    state: Arc<AppState>,
    listener: TcpListener,
    stop: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<RegistryServer<RegistryService>>()
        .await;
    let registry = RegistryServer::with_interceptor(
        RegistryService::new(state.registry.clone()),
        state.registry.require_token(),
    );
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(registry)
        .serve_with_incoming_shutdown(
            nodelay(TcpListenerStream::new(listener)),
            stop.cancelled_owned(),
        )
        .await
}

/// Accepted connections with `TCP_NODELAY` set (tonic sets it only on listeners it binds
/// itself): a streamed token must not wait for the peer's delayed ACK.
fn nodelay(
    incoming: TcpListenerStream,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt as _;
    incoming.map(|conn| {
        conn.inspect(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "set_nodelay failed");
            }
        })
    })
}

/// Loads, binds and runs a router until `shutdown` is cancelled.
pub async fn serve(config: RouterConfig, shutdown: CancellationToken) -> Result<(), RouterError> {
    Router::load(config)
        .await?
        .bind()
        .await?
        .run(shutdown)
        .await
}
