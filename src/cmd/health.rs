//! `ferry health`: asks a ferry gRPC server's `grpc.health.v1` service whether it serves, and
//! exits 0 only if it answers SERVING — the container image's `HEALTHCHECK` (Kubernetes uses
//! its own gRPC probes), and a quick check by hand. Plain gRPC to the address (the container's
//! own loopback); no token is needed, as health is open on every ferry server.
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// Flags of `ferry health`.
#[derive(Debug, Args)]
pub struct HealthArgs {
    /// The server's gRPC address (`host:port`): a router's `--grpc-addr` or
    /// `--internal-addr`, or a worker's `--grpc-addr`.
    #[arg(long, env = "FERRY_HEALTH_ADDR")]
    pub addr: String,
    /// The service to ask about; empty = the whole server. Routers serve
    /// `ferry.v1.Inference`, workers `ferry.internal.v1.PrefillWorker` /
    /// `ferry.internal.v1.DecodeWorker`.
    #[arg(long, default_value = "")]
    pub service: String,
    /// Give up after this many milliseconds (connect and answer together).
    #[arg(long, default_value_t = 2000)]
    pub timeout_ms: u64,
}

/// Runs the check: `Ok` only for SERVING.
pub fn run(args: HealthArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let timeout = Duration::from_millis(args.timeout_ms);
    let status = runtime.block_on(async {
        tokio::time::timeout(timeout, check(&args.addr, &args.service))
            .await
            .with_context(|| format!("no answer from {} within {timeout:?}", args.addr))?
    })?;
    let what = if args.service.is_empty() {
        "the server".to_string()
    } else {
        format!("service {:?}", args.service)
    };
    match status {
        ServingStatus::Serving => {
            println!("{}: {what} is SERVING", args.addr);
            Ok(())
        }
        other => bail!("{}: {what} is {}", args.addr, other.as_str_name()),
    }
}

async fn check(addr: &str, service: &str) -> anyhow::Result<ServingStatus> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .with_context(|| format!("--addr {addr:?}"))?;
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .map_err(|s| {
            anyhow::anyhow!(
                "{addr}: service {service:?}: {} ({:?})",
                s.message(),
                s.code()
            )
        })?;
    Ok(ServingStatus::try_from(answer.into_inner().status).unwrap_or(ServingStatus::Unknown))
}
