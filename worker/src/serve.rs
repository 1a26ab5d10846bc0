//! gRPC server bootstrap shared by the workers: `grpc.health.v1` and server reflection next
//! to the worker's own service.

use tonic::service::Routes;
use tonic_health::server::HealthReporter;

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
}

/// Health and reflection routes; add the worker's service and serve them together. The
/// reporter marks the worker's service SERVING once it is ready and NOT_SERVING on shutdown.
pub fn base_routes() -> Result<(HealthReporter, Routes), ServeError> {
    let (reporter, health) = tonic_health::server::health_reporter();
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ferry_proto::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    Ok((reporter, Routes::new(health).add_service(reflection)))
}

/// Loads a model and starts its engine, off the async runtime.
pub async fn load_engine(
    model_dir: std::path::PathBuf,
    config: ferry_model::engine::EngineConfig,
) -> Result<ferry_model::engine::EngineHandle, ServeError> {
    tokio::task::spawn_blocking(move || {
        let model = ferry_model::deepseek::DeepseekModel::load(&model_dir)
            .map_err(|e| ServeError::Model(format!("{}: {e}", model_dir.display())))?;
        ferry_model::engine::EngineHandle::spawn(model, config)
            .map_err(|e| ServeError::Model(e.to_string()))
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
