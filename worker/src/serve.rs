//! The serving sequence shared by the workers: bind the gRPC and `/metrics` listeners, serve
//! `grpc.health.v1` and server reflection next to the worker's own service, register with the
//! router and heartbeat, and shut down in order ([`WorkerServer`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_model::engine::EngineHandle;
use ferry_proto::auth::{ClusterToken, RequireToken};
use ferry_proto::internal::WorkerRole;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::codegen::{http, Service};
use tonic::server::NamedService;
use tonic::service::interceptor::InterceptedService;
use tonic::service::Routes;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;
use tracing::info;

use crate::args::WorkerArgs;
use crate::events::{self, EventsAgentConfig};
use crate::metrics::{MetricsListener, WorkerMetrics};
use crate::registration::{self, RegistrationConfig};

/// Errors starting the extras.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The reflection service could not be built from the descriptors.
    #[error("reflection: {0}")]
    Reflection(String),
    /// The model could not be loaded or its engine started.
    #[error("model: {0}")]
    Model(String),
    /// Binding or serving failed.
    #[error("serving: {0}")]
    Transport(String),
    /// A metric could not be registered (a duplicate name: a bug).
    #[error("metrics: {0}")]
    Metrics(String),
    /// A flag's value is unusable (e.g. the cluster token file).
    #[error("config: {0}")]
    Config(String),
}

/// Health and reflection (v1 and v1alpha, advertising `service` and health only) routes; add
/// the worker's service, named `service`, and serve them together. The reporter marks the
/// worker's service SERVING once it is ready and NOT_SERVING on shutdown.
pub fn base_routes(service: &str) -> Result<(HealthReporter, Routes), ServeError> {
    let (reporter, health) = tonic_health::server::health_reporter();
    let routes = ferry_proto::reflection::routes(&[service])
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    Ok((reporter, routes.add_service(health)))
}

/// Loads a model and starts its engine, off the async runtime.
pub async fn load_engine(
    model_dir: std::path::PathBuf,
    config: ferry_model::engine::EngineConfig,
) -> Result<ferry_model::engine::EngineHandle, ServeError> {
    tokio::task::spawn_blocking(move || {
        ferry_model::engine::EngineHandle::load(&model_dir, None, config)
            .map_err(|e| ServeError::Model(format!("{}: {e}", model_dir.display())))
    })
    .await
    .map_err(|e| ServeError::Model(e.to_string()))?
}

/// Accepted connections with `TCP_NODELAY` set. tonic sets it only on listeners it binds
/// itself; without it a streamed token can wait for the peer's delayed ACK (~40 ms on Linux),
/// which showed up as router TTFT well above the decode worker's.
pub fn nodelay_incoming(
    listener: tokio::net::TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt as _;
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|conn| {
        conn.inspect(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "set_nodelay failed");
            }
        })
    })
}

/// Serves `routes` on `listener` until `shutdown`, then marks health NOT_SERVING and drains.
pub async fn serve(
    routes: Routes,
    listener: tokio::net::TcpListener,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), ServeError> {
    tonic::transport::Server::builder()
        .add_routes(routes)
        .serve_with_incoming_shutdown(nodelay_incoming(listener), shutdown.cancelled_owned())
        .await
        .map_err(|e| ServeError::Transport(e.to_string()))
}

/// The name of `role` in ids, logs and metric labels.
pub fn role_name(role: WorkerRole) -> &'static str {
    match role {
        WorkerRole::Prefill => "prefill",
        WorkerRole::Decode => "decode",
        _ => "worker",
    }
}

/// Health, reflection and the role's service, and the name the role's service reports its
/// health under.
struct Served {
    routes: Routes,
    health: HealthReporter,
    name: &'static str,
}

/// Where a worker makes itself known.
#[derive(Debug, Clone)]
enum Plane {
    /// Registers with the one router at this URI (the default).
    Router(String),
    /// Publishes on the events plane, heard by every router ([`crate::events`]).
    Events(ferry_events::EventsUrl),
}

/// What every worker binds the same way before it builds its own gRPC service: the gRPC
/// listener, its id, its metrics registry and `/metrics` listener, and where the router is.
/// [`WorkerServer::run`] then registers, heartbeats, serves and shuts down, the same for both
/// roles.
///
/// ```text
/// bind(role, args)     gRPC listener → worker id (default `{role}-{port}`) → metrics
/// (role)               registers its metrics in registry(), builds its service
/// run(service, engine) health SERVING → registration agent → /metrics → serve
///                      … shutdown → health NOT_SERVING → stop agent and /metrics
/// ```
#[derive(Debug)]
pub struct WorkerServer {
    role: WorkerRole,
    listener: TcpListener,
    addr: SocketAddr,
    worker_id: String,
    plane: Plane,
    heartbeat: Duration,
    token: Option<ClusterToken>,
    metrics: WorkerMetrics,
    metrics_listener: MetricsListener,
    prefill_view: Option<tokio::sync::watch::Sender<registration::PrefillView>>,
    transports: Vec<String>,
}

impl WorkerServer {
    /// Binds the gRPC listener (`args.grpc_addr`) and the metrics listener
    /// (`args.metrics_addr`) and creates the metrics registry labelled with the worker's id.
    pub async fn bind(role: WorkerRole, args: &WorkerArgs) -> Result<Self, ServeError> {
        let token = args.cluster_token()?;
        let listener = TcpListener::bind(args.grpc_addr)
            .await
            .map_err(|e| ServeError::Transport(format!("{}: {e}", args.grpc_addr)))?;
        let addr = listener
            .local_addr()
            .map_err(|e| ServeError::Transport(e.to_string()))?;
        let worker_id = args
            .worker_id
            .clone()
            .unwrap_or_else(|| format!("{}-{}", role_name(role), addr.port()));
        let metrics = WorkerMetrics::new(role, &worker_id)?;
        let metrics_listener = MetricsListener::bind(args.metrics_addr).await?;
        Ok(Self {
            role,
            listener,
            addr,
            worker_id,
            plane: match &args.events {
                Some(url) => Plane::Events(url.clone()),
                None => Plane::Router(args.router_uri()),
            },
            heartbeat: args.heartbeat(),
            token,
            metrics,
            metrics_listener,
            prefill_view: None,
            transports: vec!["tcp".into()],
        })
    }

    /// Publishes the router's list of live prefill workers on `tx` after every heartbeat
    /// (decode workers use it to give up on remote prefills whose peer was dropped).
    pub fn with_prefill_view(
        self,
        tx: tokio::sync::watch::Sender<registration::PrefillView>,
    ) -> Self {
        Self {
            prefill_view: Some(tx),
            ..self
        }
    }

    /// Advertises `transports` (KV transfer transport names) at registration instead of
    /// `["tcp"]`.
    pub fn with_transports(self, transports: Vec<String>) -> Self {
        Self { transports, ..self }
    }

    /// This worker's id.
    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// The bound gRPC address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The cluster token: required on this worker's service, sent to the router and peers.
    pub fn cluster_token(&self) -> Option<&ClusterToken> {
        self.token.as_ref()
    }

    /// The bound Prometheus `/metrics` address.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_listener.local_addr()
    }

    /// The registry the role registers its own metrics in.
    pub fn registry(&self) -> &prometheus::Registry {
        self.metrics.registry()
    }

    /// Serves `service` (the role's gRPC service over `engine`) next to health and reflection,
    /// registered with the router and heartbeating, until `shutdown`; then marks health
    /// NOT_SERVING, drains, and stops the agent and the metrics endpoint.
    pub async fn run<S>(
        self,
        service: S,
        engine: EngineHandle,
        shutdown: CancellationToken,
    ) -> Result<(), ServeError>
    where
        S: Service<
                http::Request<tonic::body::Body>,
                Response = http::Response<tonic::body::Body>,
                Error = std::convert::Infallible,
            > + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        let (health, routes) = base_routes(S::NAME)?;
        let service = InterceptedService::new(service, RequireToken::new(self.token.clone()));
        let served = Served {
            routes: routes.add_service(service),
            health,
            name: S::NAME,
        };
        self.run_routes(served, engine, shutdown).await
    }

    /// [`WorkerServer::run`] once the role's service is among the routes (not generic).
    async fn run_routes(
        self,
        served: Served,
        engine: EngineHandle,
        shutdown: CancellationToken,
    ) -> Result<(), ServeError> {
        let Served {
            routes,
            health,
            name,
        } = served;
        health
            .set_service_status(name, ServingStatus::Serving)
            .await;
        let agent = match self.plane {
            Plane::Router(router) => registration::spawn(
                RegistrationConfig {
                    router,
                    worker_id: self.worker_id.clone(),
                    role: self.role,
                    advertise: self.addr.to_string(),
                    heartbeat: self.heartbeat,
                    token: self.token.clone(),
                    prefill_view: self.prefill_view,
                    transports: self.transports,
                },
                engine.clone(),
                shutdown.clone(),
            ),
            Plane::Events(url) => {
                let connection = ferry_events::Connection::open(
                    &url,
                    self.token.as_ref(),
                    &format!("ferry-{}-{}", role_name(self.role), self.worker_id),
                )
                .await
                .map_err(|e| ServeError::Transport(e.to_string()))?;
                events::spawn(
                    EventsAgentConfig {
                        connection,
                        worker_id: self.worker_id.clone(),
                        role: self.role,
                        advertise: self.addr.to_string(),
                        heartbeat: self.heartbeat,
                        prefill_view: self.prefill_view,
                        peer_timeout: (self.heartbeat * 15).max(Duration::from_secs(3)),
                        transports: self.transports,
                    },
                    engine.clone(),
                    shutdown.clone(),
                )
            }
        };
        let metrics_addr = self.metrics_listener.local_addr();
        let metrics_server =
            self.metrics_listener
                .spawn(Arc::new(self.metrics), engine.clone(), shutdown.clone());
        info!(
            worker = %self.worker_id,
            addr = %self.addr,
            metrics = %format!("http://{metrics_addr}/metrics"),
            device = %engine.device(),
            "{} worker serving",
            role_name(self.role),
        );
        let result = serve(routes, self.listener, shutdown.clone()).await;
        health
            .set_service_status(name, ServingStatus::NotServing)
            .await;
        shutdown.cancel();
        let _ = agent.await;
        let _ = metrics_server.await;
        result
    }
}
