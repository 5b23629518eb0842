//! The HTTP server under a runner and a model router alike: binding the port with its request
//! policy (`bind`), the thread and runtime it runs on (`ServerThread`), and the accept loop
//! (`serve_http`).
//!
//! Connections are accepted here rather than by `axum::serve`, for the limits it lacks: at most
//! `max_connections` at once (more wait in the kernel's listen backlog), `header_timeout` to
//! send a request's headers (from the connection's start or the request's first byte), and
//! `idle_timeout` for a keep-alive connection between requests. Stopping drains: the port
//! closes, running requests get `shutdown_timeout` to finish, then `shutdown` cancels the rest.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{watch, Notify, Semaphore};
use tower::ServiceExt;

use crate::config::{ConfigError, RunnerConfig};
use crate::http::middleware::HttpPolicy;

/// Why a runner could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The model file is missing or not GGUF.
    #[error("{0}")]
    Model(String),
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// host:port
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A thread or runtime could not be created.
    #[error("cannot start: {0}")]
    Io(#[from] std::io::Error),
    /// The metrics could not be defined (a bug).
    #[error("cannot define the metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

/// How long the connections left after `shutdown_timeout` get to write the errors the engine
/// ends their requests with.
const CANCEL_GRACE: Duration = Duration::from_secs(2);

/// The connection-level limits, from the configuration.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Most connections at once.
    max_connections: u32,
    /// Time to send a request's headers.
    header: Duration,
    /// Time a keep-alive connection may wait for its next request.
    idle: Duration,
    /// Time running requests get to finish when the server stops.
    drain: Duration,
}

impl ConnLimits {
    pub fn new(config: &RunnerConfig) -> Self {
        // validate_http() has checked that these are finite and in range.
        let seconds = |s: f64| Duration::try_from_secs_f64(s).unwrap_or(Duration::ZERO);
        Self {
            max_connections: config.max_connections,
            header: seconds(config.header_timeout),
            idle: seconds(config.idle_timeout),
            drain: seconds(config.shutdown_timeout),
        }
    }
}

/// A bound port and the request policy for it.
pub struct Bound {
    /// The listening socket (non-blocking, for tokio).
    pub listener: TcpListener,
    /// The address it is bound to.
    pub local: SocketAddr,
    /// Keys, hosts, origins and limits, as the configuration and the address call for.
    pub policy: HttpPolicy,
    /// The URL clients reach it on.
    pub url: String,
}

/// Binds `config`'s host and port and builds its request policy; warns when a non-loopback
/// address serves `what` ("the model", "the models") without an API key.
pub fn bind(config: &RunnerConfig, what: &str) -> Result<Bound, StartError> {
    let addr = format!("{}:{}", config.host, config.port);
    let listener = TcpListener::bind(&addr).map_err(|source| StartError::Bind {
        addr: addr.clone(),
        source,
    })?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    let loopback = local.ip().is_loopback();
    let policy = HttpPolicy::from_config(config, loopback)?;
    if !loopback && !policy.requires_key() {
        tracing::warn!(
            "listening on {local}, which is not a loopback address, without an API key: \
             anyone who can reach this port can use {what} (set --api-key or --api-key-file)"
        );
    }
    Ok(Bound {
        listener,
        local,
        policy,
        url: base_url(local),
    })
}

/// The thread an HTTP server runs on, with its tokio runtime (2 workers named `name`, the
/// thread `{name}-main`). Dropping it does not stop it: `stop` does.
#[derive(Debug)]
pub struct ServerThread {
    stop: Option<watch::Sender<bool>>,
    thread: Option<JoinHandle<()>>,
}

impl ServerThread {
    /// Starts `serve` (given the stop signal) on a new runtime; the runtime is given
    /// `runtime_grace` to end its tasks once `serve` returns.
    pub fn spawn<F, Fut>(name: &str, runtime_grace: Duration, serve: F) -> Result<Self, StartError>
    where
        F: FnOnce(watch::Receiver<bool>) -> Fut + Send + 'static,
        Fut: Future<Output = ()>,
    {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(name)
            .enable_all()
            .build()?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let thread = std::thread::Builder::new()
            .name(format!("{name}-main"))
            .spawn(move || {
                runtime.block_on(serve(stop_rx));
                runtime.shutdown_timeout(runtime_grace);
            })?;
        Ok(Self {
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// Tells the server to stop and waits for its thread (the drain included).
    pub fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(true);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The URL clients reach a listener on (`127.0.0.1` for an unspecified address).
pub fn base_url(local: std::net::SocketAddr) -> String {
    let host = if local.ip().is_unspecified() {
        "127.0.0.1".to_string()
    } else if local.is_ipv6() {
        format!("[{}]", local.ip())
    } else {
        local.ip().to_string()
    };
    format!("http://{host}:{}", local.port())
}

/// The HTTP server: accepts connections until told to stop, then drains them and calls
/// `shutdown` (which stops the engine, or a router's engines).
pub async fn serve_http(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    mut stop: watch::Receiver<bool>,
    shutdown: impl FnOnce(),
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "cannot use the listening socket");
            return;
        }
    };
    let slots = Arc::new(Semaphore::new(limits.max_connections as usize));
    let mut http = http1::Builder::new();
    // Our own timers (`Activity`) replace hyper's header timeout, which also cuts keep-alive
    // connections that are merely idle.
    http.keep_alive(true).header_read_timeout(None::<Duration>);
    // Header names go out in title case ("Content-Type", "Process-Start-Time-Unix"), as
    // llama-server and most servers write them: HTTP does not care, but some clients compare
    // them as written.
    http.title_case_headers(true);
    loop {
        // Over the cap, connections are not accepted: they wait in the listen backlog.
        let permit = tokio::select! {
            biased;
            _ = stop.changed() => break,
            p = slots.clone().acquire_owned() => p.expect("the connection semaphore is never closed"),
        };
        let tcp = tokio::select! {
            biased;
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                // The client gave up before we got to it.
                Err(e) if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
                ) => continue,
                Err(e) => {
                    // Out of file descriptors, usually: wait for some to close.
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        // Tokens are small writes: without TCP_NODELAY, Nagle's algorithm and the client's
        // delayed ACK hold them back by up to 40 ms each.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let conn = serve_connection(tcp, app.clone(), http.clone(), limits, stop.clone());
        tokio::spawn(async move {
            conn.await;
            drop(permit);
        });
    }
    drop(listener);
    let all = limits.max_connections;
    if tokio::time::timeout(limits.drain, slots.acquire_many(all))
        .await
        .is_err()
    {
        let busy = all as usize - slots.available_permits();
        tracing::warn!(
            "{busy} connection(s) still busy after the shutdown timeout; cancelling their requests"
        );
    }
    shutdown();
    // Requests the engine cancels end with an error event: let their connections write it.
    let _ = tokio::time::timeout(CANCEL_GRACE, slots.acquire_many(all)).await;
}

/// Serves one connection until it closes, times out, or the server stops.
async fn serve_connection(
    tcp: TcpStream,
    app: Router,
    http: http1::Builder,
    limits: ConnLimits,
    mut stop: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched {
        inner: tcp,
        activity: activity.clone(),
    });
    let service = {
        let activity = activity.clone();
        hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let guard = RequestGuard::begin(&activity);
            let app = app.clone();
            async move {
                let response = app.oneshot(req).await?;
                Ok::<_, Infallible>(response.map(|body| Tracked {
                    body,
                    _guard: guard,
                }))
            }
        })
    };
    let conn = http.serve_connection(io, service);
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            ended = conn.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            why = activity.expired(limits) => {
                tracing::debug!("closing a connection: {why}");
                return;
            }
            _ = stop.changed(), if !stopping => {
                stopping = true;
                if activity.untouched() {
                    return;
                }
                // Finishes the request in progress (or the response being written), then closes.
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// No request position: `Activity::reading_since` when no request is being received.
const NOT_READING: u64 = u64::MAX;

/// What a connection is doing, for its timeouts. Times are milliseconds since `epoch`.
#[derive(Debug)]
struct Activity {
    /// When the connection was accepted.
    epoch: Instant,
    /// Requests handed to the router whose response has not finished.
    in_flight: AtomicUsize,
    /// Whether any request has been handed to the router.
    served: AtomicBool,
    /// When the connection was accepted or its last response finished.
    idle_since: AtomicU64,
    /// When the first byte of the next request arrived (`NOT_READING`: none yet).
    reading_since: AtomicU64,
    /// Signalled on every change above.
    changed: Notify,
}

impl Activity {
    fn new() -> Self {
        Self {
            epoch: Instant::now(),
            in_flight: AtomicUsize::new(0),
            served: AtomicBool::new(false),
            idle_since: AtomicU64::new(0),
            reading_since: AtomicU64::new(NOT_READING),
            changed: Notify::new(),
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    /// Bytes arrived: between requests, that starts the next one's header timeout.
    fn on_read(&self) {
        if self.in_flight.load(Ordering::Acquire) == 0
            && self
                .reading_since
                .compare_exchange(NOT_READING, self.now(), Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            self.changed.notify_one();
        }
    }

    /// Nothing was ever received on this connection.
    fn untouched(&self) -> bool {
        !self.served.load(Ordering::Acquire)
            && self.reading_since.load(Ordering::Acquire) == NOT_READING
    }

    /// Resolves when the connection has waited too long: for a request's headers (counted
    /// from its first byte, or from the connection's start for the first request), or idle
    /// between requests. Never while a request is in flight.
    async fn expired(&self, limits: ConnLimits) -> &'static str {
        loop {
            let changed = self.changed.notified();
            if self.in_flight.load(Ordering::Acquire) > 0 {
                changed.await;
                continue;
            }
            let reading = self.reading_since.load(Ordering::Acquire);
            let idle = self.idle_since.load(Ordering::Acquire);
            let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX / 2);
            let (deadline, why) = if reading != NOT_READING {
                (reading.saturating_add(ms(limits.header)), "header timeout")
            } else if !self.served.load(Ordering::Acquire) {
                (
                    idle.saturating_add(ms(limits.header)),
                    "no request within the header timeout",
                )
            } else {
                (idle.saturating_add(ms(limits.idle)), "idle timeout")
            };
            let now = self.now();
            if now >= deadline {
                return why;
            }
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep(Duration::from_millis(deadline - now)) => {}
            }
        }
    }
}

/// One request in flight on a connection, from its dispatch to the end of its response body.
#[derive(Debug)]
struct RequestGuard(Arc<Activity>);

impl RequestGuard {
    fn begin(activity: &Arc<Activity>) -> Self {
        activity.in_flight.fetch_add(1, Ordering::AcqRel);
        activity.served.store(true, Ordering::Release);
        activity.changed.notify_one();
        Self(activity.clone())
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        let a = &self.0;
        if a.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            a.idle_since.store(a.now(), Ordering::Release);
            a.reading_since.store(NOT_READING, Ordering::Release);
        }
        a.changed.notify_one();
    }
}

/// A response body that holds its request's `RequestGuard` until hyper is done with it.
struct Tracked {
    body: Body,
    _guard: RequestGuard,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The TCP stream, telling `Activity` when bytes arrive.
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.on_read();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
