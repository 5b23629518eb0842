//! Starting and stopping a whole runner: the port is bound first (so `/health` shows load
//! progress), the HTTP server runs on a small tokio runtime on its own thread, the engine on
//! another.
//!
//! Connections are accepted here rather than by `axum::serve`, for the limits it lacks: at most
//! `max_connections` at once (more wait in the kernel's listen backlog), `header_timeout` to
//! send a request's headers (from the connection's start or the request's first byte), and
//! `idle_timeout` for a keep-alive connection between requests. Stopping drains: the port
//! closes, running requests get `shutdown_timeout` to finish, then the engine cancels the rest.

use std::any::Any;
use std::convert::Infallible;
use std::io;
use std::net::TcpListener;
use std::panic::AssertUnwindSafe;
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
use crate::http::metrics::Metrics;
use crate::http::middleware::HttpPolicy;
use crate::http::AppState;
use crate::http::Limits;
use crate::protocol::{EngineHandle, EngineInbox, Health, LoadState};
use crate::routes::router;

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

/// A running server. Dropping it stops it.
#[derive(Debug)]
pub struct Runner {
    url: String,
    engine: EngineHandle,
    stop_http: Option<watch::Sender<bool>>,
    http_thread: Option<JoinHandle<()>>,
    engine_thread: Option<JoinHandle<()>>,
}

/// How long the connections left after `shutdown_timeout` get to write the errors the engine
/// ends their requests with.
const CANCEL_GRACE: Duration = Duration::from_secs(2);

/// The connection-level limits, from the configuration.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnLimits {
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
    pub(crate) fn new(config: &RunnerConfig) -> Self {
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

impl Runner {
    /// Starts a runner for the model in `config`, with llama.cpp.
    #[cfg(feature = "llama")]
    pub fn start(config: RunnerConfig) -> Result<Self, StartError> {
        config.validate()?;
        check_gguf(&config.model)?;
        if let Some(mmproj) = &config.mmproj {
            check_gguf_file(mmproj, "vision projector (--mmproj)")?;
        }
        for warning in config.unsupported_settings() {
            tracing::warn!("{warning}");
        }
        let engine_config = config.clone();
        Self::start_with(&config, move |inbox| {
            crate::engine::run(&engine_config, inbox)
        })
    }

    /// Starts a runner whose engine thread runs `engine` (the llama.cpp one, or a fake). The
    /// model is not checked here; the HTTP settings are.
    pub fn start_with<F>(config: &RunnerConfig, engine: F) -> Result<Self, StartError>
    where
        F: FnOnce(EngineInbox) + Send + 'static,
    {
        config.validate_http()?;
        let slot_save_path = match &config.slot_save_path {
            None => None,
            Some(dir) => Some(crate::ops::slots::prepare_dir(dir).map_err(|reason| {
                ConfigError::SlotSavePath {
                    path: dir.display().to_string(),
                    reason,
                }
            })?),
        };
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
                 anyone who can reach this port can use the model (set --api-key or \
                 --api-key-file)"
            );
        }
        let url = base_url(local);

        let metrics = if config.no_metrics {
            None
        } else {
            Some(Arc::new(Metrics::new(
                &config.model_name(),
                config.ctx_size as usize,
            )?))
        };
        let (handle, inbox) = match &metrics {
            Some(m) => EngineHandle::with_observer(config.max_queue as usize, m.clone()),
            None => EngineHandle::new(config.max_queue as usize),
        };
        let engine_thread = std::thread::Builder::new()
            .name("llamarunner-engine".into())
            // Grammar matchers recurse along rule references (a chain of rules is as deep as
            // it is long); the stack is reserved, not touched, until used.
            .stack_size(crate::constrain::GRAMMAR_STACK)
            .spawn(move || run_engine(engine, inbox))?;

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("llamarunner-http")
            .enable_all()
            .build()?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let limits = Limits {
            max_tokens: config.max_tokens,
            timeout: (config.timeout > 0.0).then(|| Duration::from_secs_f64(config.timeout)),
        };
        let mut state = AppState::new(handle.clone(), config.model_name())
            .with_policy(policy)
            .with_limits(limits)
            .with_slot_save_path(slot_save_path)
            .with_lora(crate::protocol::lora::LoraTable::new(&config.lora))
            .with_reasoning_format(config.reasoning_format);
        if let Some(m) = metrics {
            state = state.with_metrics(m);
        }
        let app = router(state);
        let conn_limits = ConnLimits::new(config);
        let engine_for_http = handle.clone();
        let http_thread = std::thread::Builder::new()
            .name("llamarunner-http-main".into())
            .spawn(move || {
                runtime.block_on(serve_http(listener, app, conn_limits, stop_rx, move || {
                    engine_for_http.shutdown()
                }));
                runtime.shutdown_timeout(Duration::from_secs(1));
            })?;
        tracing::info!(%url, "listening");
        Ok(Self {
            url,
            engine: handle,
            stop_http: Some(stop_tx),
            http_thread: Some(http_thread),
            engine_thread: Some(engine_thread),
        })
    }

    /// Base URL, e.g. `http://127.0.0.1:8080`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Load state and slot gauges.
    pub fn health(&self) -> &Health {
        &self.engine.health
    }

    /// Whether the engine thread has ended (load failure, engine failure or shutdown).
    pub fn engine_finished(&self) -> bool {
        self.engine_thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Stops serving: the port closes at once, running requests get `shutdown_timeout` seconds
    /// to finish (streams included), then the rest end with an error and the model is freed.
    pub fn stop(&mut self) {
        if let Some(tx) = self.stop_http.take() {
            let _ = tx.send(true);
        }
        if let Some(t) = self.http_thread.take() {
            let _ = t.join();
        }
        // The HTTP side has already stopped the engine after draining; this covers an HTTP
        // thread that failed early.
        self.engine.shutdown();
        if let Some(t) = self.engine_thread.take() {
            if t.join().is_err() {
                tracing::error!("the engine thread panicked");
            }
        }
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs the engine on this thread. If it panics, or returns without being asked to stop, the
/// health says so (`/health` answers 500), so that the server does not look alive while
/// nothing serves its requests.
fn run_engine<F: FnOnce(EngineInbox)>(engine: F, inbox: EngineInbox) {
    let health = inbox.health.clone();
    let stopping = inbox.shutdown.clone();
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(move || engine(inbox)));
    let asked_to_stop = stopping.load(Ordering::Acquire);
    if let Some(reason) = engine_stop_reason(outcome, asked_to_stop, health.state()) {
        tracing::error!("{reason}");
        health.set_stopped(reason);
    }
}

/// Why the engine's end is a failure, or None when it is not (a requested stop, or a load
/// failure the engine has reported itself).
fn engine_stop_reason(
    outcome: Result<(), Box<dyn Any + Send>>,
    asked_to_stop: bool,
    state: LoadState,
) -> Option<String> {
    match outcome {
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".into());
            Some(format!("the engine stopped: it panicked: {message}"))
        }
        Ok(()) if asked_to_stop || state == LoadState::Error => None,
        Ok(()) => Some("the engine stopped: its thread returned unexpectedly".into()),
    }
}

/// The URL clients reach a listener on (`127.0.0.1` for an unspecified address).
pub(crate) fn base_url(local: std::net::SocketAddr) -> String {
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
pub(crate) async fn serve_http(
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

/// Checks that `path` is a readable GGUF file, so that the common mistakes get a clear message
/// before anything starts.
pub fn check_gguf(path: &std::path::Path) -> Result<(), StartError> {
    check_gguf_file(path, "model")
}

/// `check_gguf` for a GGUF file of another kind, `what` naming it in the messages.
pub fn check_gguf_file(path: &std::path::Path, what: &str) -> Result<(), StartError> {
    use std::io::Read;
    let shown = path.display();
    let mut f = std::fs::File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => {
            StartError::Model(format!("{what} file not found: {shown}"))
        }
        _ => StartError::Model(format!("cannot open {what} file {shown}: {e}")),
    })?;
    if f.metadata().map(|m| m.is_dir()).unwrap_or(false) {
        return Err(StartError::Model(format!(
            "{shown} is a directory, not a GGUF {what} file"
        )));
    }
    let mut magic = [0u8; 4];
    if f.read_exact(&mut magic).is_err() || &magic != b"GGUF" {
        return Err(StartError::Model(format!(
            "{shown} is not a GGUF {what} file (it does not start with the GGUF magic bytes)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_end_is_a_failure_unless_asked_for_or_already_reported() {
        let panic = |p: Box<dyn Any + Send>| engine_stop_reason(Err(p), false, LoadState::Ready);
        assert_eq!(
            panic(Box::new("index out of bounds")).as_deref(),
            Some("the engine stopped: it panicked: index out of bounds")
        );
        assert_eq!(
            panic(Box::new(String::from("decode failed"))).as_deref(),
            Some("the engine stopped: it panicked: decode failed")
        );
        assert_eq!(
            panic(Box::new(7)).as_deref(),
            Some("the engine stopped: it panicked: no message")
        );
        assert_eq!(
            engine_stop_reason(Ok(()), false, LoadState::Ready).as_deref(),
            Some("the engine stopped: its thread returned unexpectedly")
        );
        assert_eq!(
            engine_stop_reason(Ok(()), false, LoadState::Loading).as_deref(),
            Some("the engine stopped: its thread returned unexpectedly")
        );
        // Asked to stop, or a load failure the engine reported itself: nothing to add.
        assert_eq!(engine_stop_reason(Ok(()), true, LoadState::Ready), None);
        assert_eq!(engine_stop_reason(Ok(()), false, LoadState::Error), None);
    }
}
