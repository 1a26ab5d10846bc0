//! Starting a decode worker.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use ferry_kvtransfer::{TcpTransport, Transport, UcxTransport};
use ferry_model::engine::HostKvMemory;
use ferry_proto::auth::AttachToken;
use ferry_proto::internal::decode_worker_server::DecodeWorkerServer;
use ferry_proto::internal::WorkerRole;
use ferry_worker::args::{TransportKind, WorkerArgs};
use ferry_worker::registration::PrefillView;
use ferry_worker::serve::{ServeError, WorkerServer};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::DecodeMetrics;
use crate::region::{EngineRegion, TransportRows};
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
    /// Address the KV transfer listener binds (peers write prompt KV here; TCP transport only:
    /// UCX needs no listener, its address travels in each prefill request).
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
    base: WorkerServer,
    service: DecodeService,
    /// The transport prefill peers write into (its TCP listener, or its UCX worker and
    /// registered memory); lives as long as the server.
    transport: Arc<dyn Transport>,
}

impl DecodeServer {
    /// Loads the model, starts the engine, the transfer listener and binds the gRPC listener.
    pub async fn bind(args: DecodeArgs, model_dir: PathBuf) -> Result<Self, ServeError> {
        let (view_tx, view_rx) = watch::channel(PrefillView::default());
        let kind = args.worker.transport;
        let base = WorkerServer::bind(WorkerRole::Decode, &args.worker)
            .await?
            .with_prefill_view(view_tx)
            .with_transports(vec![kind.as_str().to_owned()]);
        let token = base.cluster_token().cloned();
        let transport: Arc<dyn Transport> = match kind {
            TransportKind::Tcp => Arc::new(
                TcpTransport::bind_with_token(args.transfer_addr, token.clone())
                    .map_err(|e| ServeError::Transport(format!("{}: {e}", args.transfer_addr)))?,
            ),
            TransportKind::Ucx => Arc::new(
                UcxTransport::with_token(token.clone())
                    .map_err(|e| ServeError::Transport(format!("--transport ucx: {e}")))?,
            ),
        };
        // A CPU engine's KV rows live in the transport's memory (UCX: shared memory that a
        // prefill worker on this machine copies into directly).
        let mut config = args.worker.engine_config();
        config.host_kv_memory = Some(HostKvMemory(Arc::new(TransportRows(transport.clone()))));
        let engine = load_engine(model_dir.clone(), &args.spec, config).await?;
        let grammar = ferry_worker::grammar::load_compiler(&model_dir, engine.model_config()).await;
        let region = Arc::new(EngineRegion::new(engine.clone()));
        let layout = ferry_kvtransfer::KvRegion::layout(region.as_ref());
        let registration = transport
            .register(region)
            .await
            .map_err(|e| ServeError::Transport(e.to_string()))?;
        let decode_metrics = DecodeMetrics::register(base.registry())
            .map_err(|e| ServeError::Metrics(e.to_string()))?;
        let service = DecodeService::new(
            base.worker_id().to_string(),
            engine,
            KvTarget {
                registration,
                layout,
            },
            DecodePolicy {
                local_prefill_threshold: args.local_prefill_threshold,
                on_failure: args.on_prefill_failure,
                prefill_timeout: Duration::from_secs(args.prefill_timeout_s.max(1)),
                peer_auth: AttachToken::new(token),
            },
            decode_metrics,
        )
        .with_prefill_view(view_rx)
        .with_grammar(grammar);
        Ok(Self {
            base,
            service,
            transport,
        })
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
        let Self {
            base,
            service,
            transport,
        } = self;
        let engine = service.engine_handle();
        let result = base
            .run(DecodeWorkerServer::new(service), engine, shutdown)
            .await;
        drop(transport);
        result
    }
}
