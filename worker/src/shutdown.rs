//! Process shutdown: Ctrl-C, SIGTERM, or (for children of `ferry up`) stdin reaching EOF.

use std::io::Read;

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
            let (closed, on_close) = tokio::sync::oneshot::channel::<()>();
            // A plain thread, not `tokio::io::stdin`: that reads on the runtime's blocking
            // pool, and dropping the runtime waits for the read — so a process whose start-up
            // failed (say, its port was taken) hung, unreported, until its parent closed stdin.
            // A thread blocked here does not keep the process from exiting.
            let watcher = std::thread::Builder::new()
                .name("stdin-watch".into())
                .spawn(move || {
                    let mut buf = [0u8; 64];
                    let mut stdin = std::io::stdin().lock();
                    loop {
                        match stdin.read(&mut buf) {
                            Ok(0) => break,
                            Err(e) if e.kind() != std::io::ErrorKind::Interrupted => break,
                            _ => {}
                        }
                    }
                    let _ = closed.send(());
                });
            match watcher {
                Ok(_) => {
                    let _ = on_close.await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch stdin: the parent going away will not stop this process");
                    std::future::pending::<()>().await
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
