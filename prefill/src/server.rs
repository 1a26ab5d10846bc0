//! Starting a prefill worker.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, ValueEnum};
use ferry_model::engine::EngineHandle;
use ferry_proto::internal::prefill_worker_server::PrefillWorkerServer;
use ferry_proto::internal::WorkerRole;
use ferry_worker::args::WorkerArgs;
use ferry_worker::metrics::{MetricsListener, WorkerMetrics};
use ferry_worker::registration::{self, RegistrationConfig};
use ferry_worker::serve::{base_routes, serve, ServeError};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::metrics::PrefillMetrics;
use crate::service::PrefillService;

/// Flags of `ferry prefill`.
#[derive(Debug, Clone, Args)]
pub struct PrefillArgs {
    #[command(flatten)]
    pub worker: WorkerArgs,
    /// Compute the drafter's context for each prompt and ship it with the KV to decode workers
    /// that ask for it (effective only when a drafter is configured).
    #[arg(long, value_enum, default_value_t = Switch::On, env = "FERRY_SPECULATIVE")]
    pub speculative: Switch,
    /// DSpark drafter directory; the embedded drafter when the target is the embedded model.
    #[arg(long, env = "FERRY_DRAFTER")]
    pub drafter: Option<PathBuf>,
}

/// `on` / `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    /// Enabled.
    On,
    /// Disabled.
    Off,
}

impl PrefillArgs {
    /// The drafter whose context this worker computes and ships, if any.
    pub fn drafter_dir(&self, model_dir: &std::path::Path) -> Option<PathBuf> {
        match self.speculative {
            Switch::Off => None,
            Switch::On => self
                .drafter
                .clone()
                .or_else(|| ferry_model::drafter::default_for(model_dir)),
        }
    }
}

/// Loads the target and the drafter `args` select, and starts the engine, off the runtime.
async fn load_engine(args: &PrefillArgs, model_dir: PathBuf) -> Result<EngineHandle, ServeError> {
    let drafter = args.drafter_dir(&model_dir);
    if let Some(d) = &drafter {
        info!(drafter = %d.display(), "shipping drafter context with the KV");
    }
    let config = args.worker.engine_config();
    tokio::task::spawn_blocking(move || {
        EngineHandle::load(&model_dir, drafter.as_deref(), config)
            .map_err(|e| ServeError::Model(format!("{}: {e}", model_dir.display())))
    })
    .await
    .map_err(|e| ServeError::Model(e.to_string()))?
}

/// A bound, ready prefill worker.
pub struct PrefillServer {
    args: PrefillArgs,
    listener: TcpListener,
    addr: SocketAddr,
    service: PrefillService,
    worker_id: String,
    metrics: Arc<WorkerMetrics>,
    metrics_listener: MetricsListener,
}

impl PrefillServer {
    /// Loads the model from `model_dir`, starts the engine and binds the gRPC listener.
    pub async fn bind(args: PrefillArgs, model_dir: PathBuf) -> Result<Self, ServeError> {
        let engine = load_engine(&args, model_dir).await?;
        let listener = TcpListener::bind(args.worker.grpc_addr)
            .await
            .map_err(|e| ServeError::Transport(format!("{}: {e}", args.worker.grpc_addr)))?;
        let addr = listener
            .local_addr()
            .map_err(|e| ServeError::Transport(e.to_string()))?;
        let worker_id = args
            .worker
            .worker_id
            .clone()
            .unwrap_or_else(|| format!("prefill-{}", addr.port()));
        let metrics = WorkerMetrics::new(WorkerRole::Prefill, &worker_id)?;
        let prefill_metrics = PrefillMetrics::register(metrics.registry())
            .map_err(|e| ServeError::Metrics(e.to_string()))?;
        let metrics_listener = MetricsListener::bind(args.worker.metrics_addr).await?;
        let service = PrefillService::new(worker_id.clone(), engine, prefill_metrics);
        Ok(Self {
            args,
            listener,
            addr,
            service,
            worker_id,
            metrics: Arc::new(metrics),
            metrics_listener,
        })
    }

    /// The bound gRPC address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bound Prometheus `/metrics` address.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_listener.local_addr()
    }

    /// Registers with the router and serves until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ServeError> {
        let (reporter, routes) = base_routes()?;
        reporter
            .set_serving::<PrefillWorkerServer<PrefillService>>()
            .await;
        let agent = registration::spawn(
            RegistrationConfig {
                router: self.args.worker.router_uri(),
                worker_id: self.worker_id.clone(),
                role: WorkerRole::Prefill,
                advertise: self.addr.to_string(),
                heartbeat: self.args.worker.heartbeat(),
            },
            self.service.engine_handle(),
            shutdown.clone(),
        );
        let metrics_addr = self.metrics_listener.local_addr();
        let metrics_server = self.metrics_listener.spawn(
            self.metrics,
            self.service.engine_handle(),
            shutdown.clone(),
        );
        info!(
            worker = %self.worker_id,
            addr = %self.addr,
            metrics = %format!("http://{metrics_addr}/metrics"),
            device = %self.service.engine_handle().device(),
            "prefill worker serving"
        );
        let routes = routes.add_service(PrefillWorkerServer::new(self.service));
        let result = serve(routes, self.listener, shutdown.clone()).await;
        reporter
            .set_not_serving::<PrefillWorkerServer<PrefillService>>()
            .await;
        shutdown.cancel();
        let _ = agent.await;
        let _ = metrics_server.await;
        result
    }
}
