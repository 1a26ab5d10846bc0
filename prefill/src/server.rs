//! Starting a prefill worker.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;
use ferry_model::engine::EngineHandle;
use ferry_proto::internal::prefill_worker_server::PrefillWorkerServer;
use ferry_proto::internal::WorkerRole;
use ferry_worker::args::{DrafterArgs, TransportKind, WorkerArgs};
use ferry_worker::serve::{ServeError, WorkerServer};
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::metrics::PrefillMetrics;
use crate::service::{Outbound, PrefillService};

/// Flags of `ferry prefill`.
#[derive(Debug, Clone, Args)]
pub struct PrefillArgs {
    #[command(flatten)]
    pub worker: WorkerArgs,
    /// The drafter whose context this worker computes for each prompt and ships with the KV
    /// to decode workers that ask for it.
    #[command(flatten)]
    pub spec: DrafterArgs,
}

/// Loads the target and the drafter `args` select, and starts the engine, off the runtime.
async fn load_engine(args: &PrefillArgs, model_dir: PathBuf) -> Result<EngineHandle, ServeError> {
    let device = args
        .worker
        .device
        .resolve()
        .map_err(|e| ServeError::Config(format!("--device: {e}")))?;
    let drafter = args.spec.resolve_for(&model_dir, device)?;
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
    base: WorkerServer,
    service: PrefillService,
}

impl PrefillServer {
    /// Loads the model from `model_dir`, starts the engine and binds the gRPC listener.
    pub async fn bind(args: PrefillArgs, model_dir: PathBuf) -> Result<Self, ServeError> {
        let engine = load_engine(&args, model_dir.clone()).await?;
        let grammar = ferry_worker::grammar::load_compiler(&model_dir, engine.model_config()).await;
        let outbound = Outbound::new(
            WorkerArgs::cluster_token(&args.worker)?,
            args.worker.transport == TransportKind::Ucx,
        )
        .map_err(|e| ServeError::Transport(format!("--transport ucx: {e}")))?;
        let base = WorkerServer::bind(WorkerRole::Prefill, &args.worker)
            .await?
            .with_transports(outbound.names());
        let prefill_metrics = PrefillMetrics::register(base.registry())
            .map_err(|e| ServeError::Metrics(e.to_string()))?;
        let service = PrefillService::new(
            base.worker_id().to_string(),
            engine,
            prefill_metrics,
            outbound,
        )
        .with_grammar(grammar);
        Ok(Self { base, service })
    }

    /// The bound gRPC address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.base.grpc_addr()
    }

    /// The bound Prometheus `/metrics` address.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.base.metrics_addr()
    }

    /// Registers with the router and serves until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ServeError> {
        let engine = self.service.engine_handle();
        self.base
            .run(PrefillWorkerServer::new(self.service), engine, shutdown)
            .await
    }
}
