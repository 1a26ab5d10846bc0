//! Starting and stopping a router: [`Router`] (loaded), [`BoundRouter`] (listening), [`serve`].
//!
//! ```text
//! Router::load(config)   check config, load tokenizer + config.json (blocking pool)
//!   .bind()              bind gRPC and HTTP listeners (port 0 works: read the addresses back)
//!   .run(shutdown)       serve until `shutdown` is cancelled:
//!       gRPC: Inference + Registry + grpc.health.v1 (Inference SERVING) + reflection v1 and
//!             v1alpha advertising Inference and health (ferry_proto::reflection)
//!       HTTP: the OpenAI-compatible app
//!       reaper: removes workers that missed their heartbeats
//!   on shutdown          health NOT_SERVING → stop accepting → drain open requests until the
//!                        deadline → end the streams still open with an error → abort leftovers
//! ```
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt as _;
use ferry_proto::internal::registry_server::RegistryServer;
use ferry_proto::v1::inference_server::InferenceServer;
use tokio::net::TcpListener;
use tokio::task::JoinError;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;

use crate::config::RouterConfig;
use crate::error::RouterError;
use crate::grpc::InferenceService;
use crate::registry::RegistryService;
use crate::state::AppState;

/// After the drain deadline ends the open streams, how long the servers get to close.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// A router with its model loaded, not yet listening.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    state: Arc<AppState>,
}

impl Router {
    /// Checks `config` and loads the tokenizer and model config from `config.model_dir`.
    pub async fn load(config: RouterConfig) -> Result<Self, RouterError> {
        let state = AppState::load(&config).await?;
        Ok(Self { config, state })
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
        Ok(BoundRouter {
            config: self.config,
            state: self.state,
            grpc,
            http,
            grpc_addr,
            http_addr,
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
    grpc: TcpListener,
    http: TcpListener,
    grpc_addr: SocketAddr,
    http_addr: SocketAddr,
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
    /// The bound gRPC address (Inference, Registry, health, reflection).
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
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
            grpc,
            http,
            grpc_addr,
            http_addr,
        } = self;
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter
            .set_serving::<InferenceServer<InferenceService>>()
            .await;
        let reflection = ferry_proto::reflection::routes(&[
            <InferenceServer<InferenceService> as tonic::server::NamedService>::NAME,
        ])?;
        let stop_accepting = CancellationToken::new();
        let reaper = state.registry.spawn_reaper(shutdown.child_token());

        let grpc_server = tonic::transport::Server::builder()
            .add_routes(reflection)
            .add_service(health)
            .add_service(InferenceServer::new(InferenceService::new(state.clone())))
            .add_service(RegistryServer::new(RegistryService::new(
                state.registry.clone(),
            )))
            .serve_with_incoming_shutdown(
                nodelay(TcpListenerStream::new(grpc)),
                stop_accepting.clone().cancelled_owned(),
            );
        let mut grpc_task = tokio::spawn(grpc_server);
        let http = http.tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "set_nodelay failed");
            }
        });
        let http_server = axum::serve(http, crate::http::app(state.clone()))
            .with_graceful_shutdown(stop_accepting.clone().cancelled_owned());
        let mut http_task = tokio::spawn(http_server.into_future());
        tracing::info!(
            grpc = %grpc_addr,
            http = %http_addr,
            model = %state.model.name,
            policy = %config.policy,
            "router listening"
        );

        let early = tokio::select! {
            _ = shutdown.cancelled() => None,
            r = &mut grpc_task => Some(grpc_result(r).and(Err(RouterError::Task("the gRPC server stopped".into())))),
            r = &mut http_task => Some(http_result(r).and(Err(RouterError::Task("the HTTP server stopped".into())))),
        };
        if let Some(failed) = early {
            stop_accepting.cancel();
            grpc_task.abort();
            http_task.abort();
            reaper.abort();
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
        let _ = reaper.await;
        let (grpc_joined, http_joined) =
            joined.map_err(|e| RouterError::Task(format!("shutdown: {e}")))?;
        grpc_result(grpc_joined)?;
        http_result(http_joined)?;
        tracing::info!("router stopped");
        Ok(())
    }
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
