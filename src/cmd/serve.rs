//! `ferry router`, `ferry prefill`, `ferry decode`: one cluster role per process.

use anyhow::Context;
use clap::Args;
use ferry_decode::{DecodeArgs, DecodeServer};
use ferry_prefill::{PrefillArgs, PrefillServer};
use ferry_router::config::RouterConfig;
use ferry_router::server::Router;
use ferry_worker::shutdown::shutdown_token;

use crate::embedded;

/// Flags of `ferry router`.
#[derive(Debug, Args)]
pub struct RouterArgs {
    #[command(flatten)]
    pub config: RouterConfig,
    /// Stop when standard input closes (set by `ferry up` for its children).
    #[arg(long, hide = true)]
    pub exit_on_stdin_close: bool,
}

/// Runs `role` (a role's whole life: start-up, serving, shutdown) on a multi-threaded runtime.
/// Once it returns, the process is done: work still on the runtime's blocking pool gets
/// [`BLOCKING_GRACE`], not a wait without end, so a role that failed at start-up exits and
/// says why.
fn run_role(role: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(role);
    runtime.shutdown_timeout(BLOCKING_GRACE);
    result
}

/// How long a finished role waits for its blocking pool's tasks before it exits.
const BLOCKING_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs a router until Ctrl-C / SIGTERM.
pub fn router(mut args: RouterArgs) -> anyhow::Result<()> {
    // The clap default is the source checkout's copy; a binary elsewhere uses its embedded one.
    if args.config.model_dir == ferry_model::embedded::default_model_dir() {
        args.config.model_dir = embedded::model_dir(None)?;
        if args.config.served_model_name.is_empty() {
            args.config.served_model_name = embedded::EMBEDDED_MODEL_NAME.into();
        }
    }
    run_role(async move {
        let shutdown = shutdown_token(args.exit_on_stdin_close);
        let bound = Router::load(args.config).await?.bind().await?;
        bound.run(shutdown).await?;
        Ok(())
    })
}

/// Runs a prefill worker until Ctrl-C / SIGTERM.
pub fn prefill(args: PrefillArgs) -> anyhow::Result<()> {
    let dir = embedded::model_dir(args.worker.model.as_deref())?;
    run_role(async move {
        let shutdown = shutdown_token(args.worker.exit_on_stdin_close);
        let server = PrefillServer::bind(args, dir).await?;
        server.run(shutdown).await?;
        Ok(())
    })
}

/// Runs a decode worker until Ctrl-C / SIGTERM.
pub fn decode(args: DecodeArgs) -> anyhow::Result<()> {
    let dir = embedded::model_dir(args.worker.model.as_deref())?;
    run_role(async move {
        let shutdown = shutdown_token(args.worker.exit_on_stdin_close);
        let server = DecodeServer::bind(args, dir).await?;
        server.run(shutdown).await?;
        Ok(())
    })
}
