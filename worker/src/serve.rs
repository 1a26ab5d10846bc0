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
