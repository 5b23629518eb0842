//! Starting and stopping a whole runner: the port is bound first (so `/health` shows load
//! progress), the HTTP server (`http/server.rs`) runs on a small tokio runtime on its own
//! thread, the engine on another. Stopping drains the HTTP side, then stops the engine.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::config::{ConfigError, RunnerConfig};
use crate::http::metrics::Metrics;
use crate::http::server::{serve_http, ConnLimits, ServerThread};
use crate::http::AppState;
use crate::http::Limits;
use crate::protocol::{EngineHandle, EngineInbox, Health, LoadState};
use crate::routes::router;

pub use crate::http::server::StartError;

/// A running server. Dropping it stops it.
#[derive(Debug)]
pub struct Runner {
    url: String,
    engine: EngineHandle,
    http: ServerThread,
    engine_thread: Option<JoinHandle<()>>,
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
        let bound = crate::http::server::bind(config, "the model")?;
        let url = bound.url.clone();

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

        let limits = Limits {
            max_tokens: config.max_tokens,
            timeout: (config.timeout > 0.0).then(|| Duration::from_secs_f64(config.timeout)),
        };
        let mut state = AppState::new(handle.clone(), config.model_name())
            .with_policy(bound.policy)
            .with_limits(limits)
            .with_slot_save_path(slot_save_path)
            .with_lora(crate::protocol::lora::LoraTable::new(&config.lora))
            .with_reasoning(config.reasoning_format, config.reasoning)
            .with_verbose_answers(config.verbose)
            .with_default_seed(config.seed)
            .with_sampling_defaults(config.sampling_defaults())
            .with_system_prompt(config.system_prompt.as_deref())
            .with_pooling(config.pooling);
        if let Some(m) = metrics {
            state = state.with_metrics(m);
        }
        let app = router(state);
        let conn_limits = ConnLimits::new(config);
        let engine_for_http = handle.clone();
        let listener = bound.listener;
        let http = ServerThread::spawn("llamarunner-http", Duration::from_secs(1), move |stop| {
            serve_http(listener, app, conn_limits, stop, move || {
                engine_for_http.shutdown()
            })
        })?;
        tracing::info!(%url, "listening");
        Ok(Self {
            url,
            engine: handle,
            http,
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
        self.http.stop();
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
