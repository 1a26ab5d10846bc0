//! gRPC server reflection as grpcurl, Postman and Python's `grpcio-reflection` expect it:
//! both protocol versions, the health service included, and only the services a listener
//! really serves.
//!
//! | what | why |
//! |---|---|
//! | `grpc.reflection.v1` and `v1alpha` | newer clients ask v1; grpcurl up to 1.8 and `grpcio-reflection` ask only v1alpha |
//! | `grpc.health.v1.Health` advertised, its descriptors served | clients can discover and call the health check |
//! | only the names given | each listener lists what it answers: the router's public port lists `ferry.v1.Inference`, not the workers' services it answers UNIMPLEMENTED to |
//!
//! Descriptors of every ferry package are registered everywhere (a listed service's types may
//! live in another file); only the *list* of services differs per listener.
use tonic::service::Routes;
use tonic_reflection::server::{Builder, Error};

/// `grpc.health.v1.Health`.
pub const HEALTH_SERVICE: &str = tonic_health::pb::health_server::SERVICE_NAME;
/// `grpc.reflection.v1.ServerReflection`.
pub const REFLECTION_V1_SERVICE: &str =
    tonic_reflection::pb::v1::server_reflection_server::SERVICE_NAME;
/// `grpc.reflection.v1alpha.ServerReflection`.
pub const REFLECTION_V1ALPHA_SERVICE: &str =
    tonic_reflection::pb::v1alpha::server_reflection_server::SERVICE_NAME;

/// Reflection services (v1 and v1alpha) advertising `services`, `grpc.health.v1.Health` and
/// reflection itself. Add the services and the health service next to these routes.
///
/// ```
/// let routes = ferry_proto::reflection::routes(&["ferry.v1.Inference"])?;
/// # let _ = routes;
/// # Ok::<(), tonic_reflection::server::Error>(())
/// ```
pub fn routes(services: &[&str]) -> Result<Routes, Error> {
    let v1 = builder(services).build_v1()?;
    let v1alpha = builder(services).build_v1alpha()?;
    Ok(Routes::new(v1).add_service(v1alpha))
}

fn builder(services: &[&str]) -> Builder<'static> {
    let builder = Builder::configure()
        .register_encoded_file_descriptor_set(crate::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name(HEALTH_SERVICE)
        .with_service_name(REFLECTION_V1_SERVICE)
        .with_service_name(REFLECTION_V1ALPHA_SERVICE);
    services
        .iter()
        .fold(builder, |b, name| b.with_service_name(*name))
}
