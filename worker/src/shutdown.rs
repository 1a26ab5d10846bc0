//! Process shutdown: Ctrl-C, SIGTERM, or (for children of `ferry up`) stdin reaching EOF.

use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;
use tracing::info;

/// A token cancelled on SIGINT or SIGTERM, and, when `watch_stdin` is set, when standard input
/// closes — `ferry up` holds its children's stdin, so they stop even if the parent is killed.
pub fn shutdown_token(watch_stdin: bool) -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        #[cfg(not(unix))]
        let term = std::future::pending::<()>();
        let stdin = async {
            if !watch_stdin {
                return std::future::pending::<()>().await;
            }
            let mut buf = [0u8; 64];
            let mut stdin = tokio::io::stdin();
            while let Ok(n) = stdin.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        };
        tokio::select! {
            _ = ctrl_c => info!("interrupt: shutting down"),
            _ = term => info!("SIGTERM: shutting down"),
            _ = stdin => info!("parent went away: shutting down"),
        }
        t.cancel();
    });
    token
}
