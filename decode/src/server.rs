//! Starting a decode worker.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use ferry_kvtransfer::{TcpTransport, Transport};
use ferry_proto::internal::decode_worker_server::DecodeWorkerServer;
use ferry_proto::internal::WorkerRole;
use ferry_worker::args::WorkerArgs;
use ferry_worker::metrics::{MetricsListener, WorkerMetrics};
use ferry_worker::registration::{self, RegistrationConfig};
use ferry_worker::serve::{base_routes, serve, ServeError};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::metrics::DecodeMetrics;
use crate::region::EngineRegion;
use crate::service::{DecodePolicy, DecodeService, KvTarget};
use crate::spec::{load_engine, SpecArgs};

/// What a failed remote prefill leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FailurePolicy {
    /// Prefill the prompt here instead (the request still completes).
    Recompute,
    /// Fail the request.
    Fail,
}

/// Flags of `ferry decode`.
#[derive(Debug, Clone, Args)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub worker: WorkerArgs,
    /// Address the KV transfer listener binds (peers write prompt KV here).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub transfer_addr: SocketAddr,
    /// Prefill here when at most this many prompt tokens are not cached here.
    #[arg(long, default_value_t = 32)]
    pub local_prefill_threshold: usize,
    /// When the prefill peer or the transfer fails: recompute here, or fail the request.
    #[arg(long, value_enum, default_value_t = FailurePolicy::Recompute)]
    pub on_prefill_failure: FailurePolicy,
    /// Seconds a prefill peer may take before the failure policy applies.
    #[arg(long, default_value_t = 60)]
    pub prefill_timeout_s: u64,
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// A bound, ready decode worker.
pub struct DecodeServer {
    args: DecodeArgs,
    listener: TcpListener,
    addr: SocketAddr,
    service: DecodeService,
    worker_id: String,
    _transport: Arc<TcpTransport>,
    metrics: Arc<WorkerMetrics>,
    metrics_listener: MetricsListener,
}

impl DecodeServer {
    /// Loads the model, starts the engine, the transfer listener and binds the gRPC listener.
    pub async fn bind(args: DecodeArgs, model_dir: PathBuf) -> Result<Self, ServeError> {
        let engine = load_engine(model_dir, &args.spec, args.worker.engine_config()).await?;
        let transport = Arc::new(
            TcpTransport::bind(args.transfer_addr)
                .map_err(|e| ServeError::Transport(format!("{}: {e}", args.transfer_addr)))?,
        );
        let region = Arc::new(EngineRegion::new(engine.clone()));
        let layout = ferry_kvtransfer::KvRegion::layout(region.as_ref());
        let registration = transport
            .register(region)
            .await
            .map_err(|e| ServeError::Transport(e.to_string()))?;
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
            .unwrap_or_else(|| format!("decode-{}", addr.port()));
        let metrics = WorkerMetrics::new(WorkerRole::Decode, &worker_id)?;
        let decode_metrics = DecodeMetrics::register(metrics.registry())
            .map_err(|e| ServeError::Metrics(e.to_string()))?;
        let metrics_listener = MetricsListener::bind(args.worker.metrics_addr).await?;
        let service = DecodeService::new(
            worker_id.clone(),
            engine,
            KvTarget {
                registration,
                layout,
            },
            DecodePolicy {
                local_prefill_threshold: args.local_prefill_threshold,
                on_failure: args.on_prefill_failure,
                prefill_timeout: Duration::from_secs(args.prefill_timeout_s.max(1)),
            },
            decode_metrics,
        );
        Ok(Self {
            args,
            listener,
            addr,
            service,
            worker_id,
            _transport: transport,
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
            .set_serving::<DecodeWorkerServer<DecodeService>>()
            .await;
        let agent = registration::spawn(
            RegistrationConfig {
                router: self.args.worker.router_uri(),
                worker_id: self.worker_id.clone(),
                role: WorkerRole::Decode,
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
            "decode worker serving"
        );
        let routes = routes.add_service(DecodeWorkerServer::new(self.service));
        let result = serve(routes, self.listener, shutdown.clone()).await;
        reporter
            .set_not_serving::<DecodeWorkerServer<DecodeService>>()
            .await;
        shutdown.cancel();
        let _ = agent.await;
        let _ = metrics_server.await;
        result
    }
}
