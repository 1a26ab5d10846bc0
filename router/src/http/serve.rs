//! The HTTP accept loop (hyper-util's auto HTTP/1 + HTTP/2 server under the axum app), in
//! place of `axum::serve`, for the timeouts it lacks:
//!
//! ```text
//! accept ── TCP_NODELAY ── spawn one task per connection (owned by a JoinSet: dropped, they end)
//!   connection: [TLS handshake] → hyper → app
//!     first request head    must arrive whole within header_timeout of the accept (TLS
//!                           handshake and HTTP/2 preface included), else the socket is closed
//!     later HTTP/1 heads    hyper's header_read_timeout: within header_timeout of the previous
//!                           response, so an idle keep-alive connection is closed after it too
//!     HTTP/2                PING every H2_KEEPALIVE; no answer within H2_KEEPALIVE_TIMEOUT closes
//! stop cancelled ── stop accepting, drop the listener, graceful_shutdown() on every connection
//!                   (open requests finish, idle connections close) ── return once all are closed
//! ```
//!
//! Returning only when every connection has closed keeps `BoundRouter::run`'s drain: it waits
//! for this future until its deadline, ends the open streams, then aborts it, which drops the
//! `JoinSet` and with it every connection still open.
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// How often an HTTP/2 connection is pinged.
pub const H2_KEEPALIVE: Duration = Duration::from_secs(20);

/// How long an HTTP/2 ping may go unanswered before the connection is closed.
pub const H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// After an accept error that is not about one connection (e.g. out of file descriptors), how
/// long to wait before accepting again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// What the accept loop serves and how.
pub struct HttpServer {
    /// The bound listener.
    pub listener: TcpListener,
    /// The app (`http::app`).
    pub app: axum::Router,
    /// TLS, when on.
    pub tls: Option<TlsAcceptor>,
    /// `--http-header-timeout-ms`.
    pub header_timeout: Duration,
}

/// What every connection task shares.
struct Shared {
    app: axum::Router,
    tls: Option<TlsAcceptor>,
    header_timeout: Duration,
    builder: auto::Builder<TokioExecutor>,
}

impl HttpServer {
    /// Serves until `stop` is cancelled, then shuts every connection down gracefully and
    /// returns once all have closed (see the module docs).
    pub async fn serve(self, stop: CancellationToken) -> std::io::Result<()> {
        let Self {
            listener,
            app,
            tls,
            header_timeout,
        } = self;
        let shared = Arc::new(Shared {
            app,
            tls,
            header_timeout,
            builder: builder(header_timeout),
        });
        let mut connections = JoinSet::new();
        loop {
            let accepted = tokio::select! {
                _ = stop.cancelled() => break,
                Some(_) = connections.join_next(), if !connections.is_empty() => continue,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((tcp, peer)) => {
                    if let Err(e) = tcp.set_nodelay(true) {
                        tracing::debug!(error = %e, "set_nodelay failed");
                    }
                    connections.spawn(connection(tcp, peer, shared.clone(), stop.clone()));
                }
                Err(e) if is_connection_error(&e) => {
                    tracing::debug!(error = %e, "accept: connection failed");
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed; retrying shortly");
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                    }
                }
            }
        }
        drop(listener);
        while connections.join_next().await.is_some() {}
        Ok(())
    }
}

/// hyper's server settings: HTTP/1 header timeout with keep-alive, HTTP/2 keep-alive pings.
fn builder(header_timeout: Duration) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .keep_alive(true)
        .header_read_timeout(header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(H2_KEEPALIVE)
        .keep_alive_timeout(H2_KEEPALIVE_TIMEOUT);
    builder
}

/// Errors of one incoming connection, not of the listener.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        e.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    )
}

/// One connection: the TLS handshake (if on) and HTTP, with the first-request deadline.
async fn connection(
    tcp: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    let deadline = Instant::now() + shared.header_timeout;
    match &shared.tls {
        None => http(tcp, peer, &shared, deadline, stop).await,
        Some(acceptor) => {
            let tls = tokio::select! {
                _ = stop.cancelled() => return,
                tls = tokio::time::timeout_at(deadline, acceptor.accept(tcp)) => tls,
            };
            match tls {
                Ok(Ok(tls)) => http(tls, peer, &shared, deadline, stop).await,
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
        }
    }
}

/// Serves HTTP on `io` until the connection ends; closes it at `deadline` if no request head
/// has arrived by then; shuts it down gracefully when `stop` is cancelled.
async fn http<IO>(
    io: IO,
    peer: SocketAddr,
    shared: &Shared,
    deadline: Instant,
    stop: CancellationToken,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let requested = Arc::new(AtomicBool::new(false));
    let seen = requested.clone();
    let app = shared.app.clone();
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        seen.store(true, Ordering::Relaxed);
        tower::ServiceExt::oneshot(app.clone(), request)
    });
    let conn = shared.builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let first_deadline = tokio::time::sleep_until(deadline);
    tokio::pin!(first_deadline);
    let (mut waiting_first, mut stopping) = (true, false);
    loop {
        tokio::select! {
            done = conn.as_mut() => {
                if let Err(e) = done {
                    tracing::debug!(%peer, error = %e, "HTTP connection ended with an error");
                }
                return;
            }
            _ = &mut first_deadline, if waiting_first => {
                if !requested.load(Ordering::Relaxed) {
                    tracing::debug!(%peer, "no request head within the header timeout; closing");
                    return;
                }
                waiting_first = false;
            }
            _ = stop.cancelled(), if !stopping => {
                conn.as_mut().graceful_shutdown();
                stopping = true;
            }
        }
    }
}
