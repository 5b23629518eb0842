//! Starting and stopping a whole runner: the port is bound first (so `/health` shows load
//! progress), the HTTP server runs on a small tokio runtime on its own thread, the engine on
//! another.

use std::net::TcpListener;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::config::{ConfigError, RunnerConfig};
use crate::engine::{EngineHandle, EngineInbox, Health};
use crate::server::{router, AppState};

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
}

/// A running server. Dropping it stops it.
#[derive(Debug)]
pub struct Runner {
    url: String,
    engine: EngineHandle,
    stop_http: Option<tokio::sync::oneshot::Sender<()>>,
    http_thread: Option<JoinHandle<()>>,
    engine_thread: Option<JoinHandle<()>>,
}

impl Runner {
    /// Starts a runner for the model in `config`, with llama.cpp.
    #[cfg(feature = "llama")]
    pub fn start(config: RunnerConfig) -> Result<Self, StartError> {
        config.validate()?;
        check_gguf(&config.model)?;
        for warning in config.unsupported_settings() {
            tracing::warn!("{warning}");
        }
        let engine_config = config.clone();
        Self::start_with(&config, move |inbox| {
            crate::engine::llama::run(&engine_config, inbox)
        })
    }

    /// Starts a runner whose engine thread runs `engine` (the llama.cpp one, or a fake).
    pub fn start_with<F>(config: &RunnerConfig, engine: F) -> Result<Self, StartError>
    where
        F: FnOnce(EngineInbox) + Send + 'static,
    {
        let addr = format!("{}:{}", config.host, config.port);
        let listener = TcpListener::bind(&addr).map_err(|source| StartError::Bind {
            addr: addr.clone(),
            source,
        })?;
        listener.set_nonblocking(true)?;
        let local = listener.local_addr()?;
        let host = if local.ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else if local.is_ipv6() {
            format!("[{}]", local.ip())
        } else {
            local.ip().to_string()
        };
        let url = format!("http://{host}:{}", local.port());

        let (handle, inbox) = EngineHandle::new(config.max_queue as usize);
        let engine_thread = std::thread::Builder::new()
            .name("llamarunner-engine".into())
            .spawn(move || engine(inbox))?;

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("llamarunner-http")
            .enable_all()
            .build()?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let app = router(AppState::new(handle.clone(), config.model_name()));
        let http_thread = std::thread::Builder::new()
            .name("llamarunner-http-main".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, "cannot use the listening socket");
                            return;
                        }
                    };
                    // Tokens are small writes: without TCP_NODELAY, Nagle's algorithm and the
                    // client's delayed ACK hold them back by up to 40 ms each.
                    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                        if let Err(e) = tcp.set_nodelay(true) {
                            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
                        }
                    });
                    let (grace_tx, grace_rx) = tokio::sync::oneshot::channel::<()>();
                    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
                        let _ = stop_rx.await;
                        let _ = grace_tx.send(());
                    });
                    // Open streams end when the engine stops; give them a moment, no more.
                    tokio::select! {
                        r = server => if let Err(e) = r { tracing::error!(error = %e, "http server failed") },
                        _ = async { let _ = grace_rx.await; tokio::time::sleep(Duration::from_secs(3)).await } => {}
                    }
                });
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

    /// Whether the engine thread has ended (load failure or shutdown).
    pub fn engine_finished(&self) -> bool {
        self.engine_thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Stops serving: running requests end with an error, the model is freed, the port closed.
    pub fn stop(&mut self) {
        self.engine.shutdown();
        if let Some(t) = self.engine_thread.take() {
            if t.join().is_err() {
                tracing::error!("the engine thread panicked");
            }
        }
        if let Some(tx) = self.stop_http.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.http_thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Checks that `path` is a readable GGUF file, so that the common mistakes get a clear message
/// before anything starts.
pub fn check_gguf(path: &std::path::Path) -> Result<(), StartError> {
    use std::io::Read;
    let shown = path.display();
    let mut f = std::fs::File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => StartError::Model(format!("model file not found: {shown}")),
        _ => StartError::Model(format!("cannot open model file {shown}: {e}")),
    })?;
    if f.metadata().map(|m| m.is_dir()).unwrap_or(false) {
        return Err(StartError::Model(format!(
            "{shown} is a directory, not a GGUF model file"
        )));
    }
    let mut magic = [0u8; 4];
    if f.read_exact(&mut magic).is_err() || &magic != b"GGUF" {
        return Err(StartError::Model(format!(
            "{shown} is not a GGUF model file (it does not start with the GGUF magic bytes)"
        )));
    }
    Ok(())
}
