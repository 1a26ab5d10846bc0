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

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Runs a router until Ctrl-C / SIGTERM.
pub fn router(mut args: RouterArgs) -> anyhow::Result<()> {
    // The clap default is the source checkout's copy; a binary elsewhere uses its embedded one.
    if args.config.model_dir == ferry_model::embedded::default_model_dir() {
        args.config.model_dir = embedded::model_dir(None)?;
        if args.config.served_model_name.is_empty() {
            args.config.served_model_name = embedded::EMBEDDED_MODEL_NAME.into();
        }
    }
    runtime()?.block_on(async move {
        let shutdown = shutdown_token(args.exit_on_stdin_close);
        let bound = Router::load(args.config).await?.bind().await?;
        bound.run(shutdown).await?;
        Ok(())
    })
}

/// Runs a prefill worker until Ctrl-C / SIGTERM.
pub fn prefill(args: PrefillArgs) -> anyhow::Result<()> {
    let dir = embedded::model_dir(args.worker.model.as_deref())?;
    runtime()?.block_on(async move {
        let shutdown = shutdown_token(args.worker.exit_on_stdin_close);
        let server = PrefillServer::bind(args, dir).await?;
        server.run(shutdown).await?;
        Ok(())
    })
}

/// Runs a decode worker until Ctrl-C / SIGTERM.
pub fn decode(args: DecodeArgs) -> anyhow::Result<()> {
    let dir = embedded::model_dir(args.worker.model.as_deref())?;
    runtime()?.block_on(async move {
        let shutdown = shutdown_token(args.worker.exit_on_stdin_close);
        let server = DecodeServer::bind(args, dir).await?;
        server.run(shutdown).await?;
        Ok(())
    })
}
