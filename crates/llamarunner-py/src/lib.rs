//! `llamarunner._core`: the Python face of `llamarunner-core`. It holds a `Runner` (HTTP server
//! and engine on their own threads); every blocking call releases the GIL.

mod log_writer;

use std::sync::{Mutex, Once};

use llamarunner_core::config::LogFormat;
use llamarunner_core::dialects::routing_key;
use llamarunner_core::router::{ModelRouter, RouterConfig};
use llamarunner_core::{Runner, RunnerConfig, StartError};
use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

create_exception!(
    _core,
    ModelLoadError,
    PyRuntimeError,
    "The model could not be loaded."
);

/// The log filter when `LLAMARUNNER_LOG` sets none: our own info logs (the access lines
/// among them) and llama.cpp's warnings and errors; with `verbose`, our debug logs and
/// llama.cpp's own messages (target `llama-cpp-2`) down to its info chatter.
fn default_filter(verbose: bool) -> &'static str {
    if verbose {
        "info,llamarunner_core=debug,llama-cpp-2=info"
    } else {
        "info,llama-cpp-2=warn"
    }
}

/// Installs the log subscriber once per process (the first server's `verbose` and
/// `log_format` decide). `LLAMARUNNER_LOG` (an `EnvFilter` string) overrides the filter.
/// JSON: one object per line with the event's fields at the top level (`message`,
/// `request_id`, `status`, ...) and the request's span (`span.request_id`).
fn init_logging(verbose: bool, format: LogFormat) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = std::env::var("LLAMARUNNER_LOG")
            .unwrap_or_else(|_| default_filter(verbose).to_string());
        let filter = tracing_subscriber::EnvFilter::new(filter);
        let _ = match format {
            LogFormat::Text => tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(log_writer::StderrLines::new())
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_target(false)
                .try_init(),
            LogFormat::Json => tracing_subscriber::fmt()
                .json()
                .flatten_event(true)
                .with_current_span(true)
                .with_span_list(false)
                .with_env_filter(filter)
                .with_writer(log_writer::StderrLines::new())
                .try_init(),
        };
    });
}

fn start_error(e: StartError) -> PyErr {
    match e {
        StartError::Config(e) => PyValueError::new_err(e.to_string()),
        StartError::Model(m) => ModelLoadError::new_err(m),
        StartError::Bind { .. } | StartError::Io(_) => PyOSError::new_err(e.to_string()),
        StartError::Metrics(_) => PyRuntimeError::new_err(e.to_string()),
    }
}

/// A running server (HTTP + engine). Created by `start`.
/// What a `NativeServer` runs: one model's runner, or a router over several models' engines.
enum Served {
    Runner(Runner),
    Router(ModelRouter),
}

impl Served {
    fn stop(&mut self) {
        match self {
            Served::Runner(r) => r.stop(),
            Served::Router(r) => r.stop(),
        }
    }
}

#[pyclass(module = "llamarunner._core")]
struct NativeServer {
    runner: Mutex<Option<Served>>,
    url: String,
}

#[pymethods]
impl NativeServer {
    /// Base URL, e.g. `http://127.0.0.1:8080`.
    #[getter]
    fn url(&self) -> String {
        self.url.clone()
    }

    /// `(status, progress, error, busy_slots, total_slots)`; status is "loading", "ready",
    /// "error" or "stopped".
    fn health(&self) -> (String, f32, Option<String>, u32, u32) {
        let guard = self.runner.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref() {
            None => ("stopped".into(), 0.0, None, 0, 0),
            // The router serves while it runs; its models' states are in its `GET /models`.
            Some(Served::Router(_)) => ("ready".into(), 1.0, None, 0, 0),
            Some(Served::Runner(r)) => {
                let h = r.health();
                let (busy, total) = h.slots();
                (
                    h.state().as_str().into(),
                    h.progress(),
                    h.error(),
                    busy,
                    total,
                )
            }
        }
    }

    /// Stops the server and frees the model; idempotent.
    fn stop(&self, py: Python<'_>) {
        let runner = self.runner.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(mut r) = runner {
            py.detach(move || r.stop());
        }
    }
}

/// Starts a server from a JSON `RunnerConfig`; returns once the port is bound (the model loads
/// in the background: poll `health()`).
#[pyfunction]
fn start(py: Python<'_>, config_json: &str) -> PyResult<NativeServer> {
    let config = RunnerConfig::from_json(config_json)
        .map_err(|e| PyValueError::new_err(format!("invalid configuration: {e}")))?;
    init_logging(config.verbose, config.log_format);
    let runner = py
        .detach(move || Runner::start(config))
        .map_err(start_error)?;
    Ok(NativeServer {
        url: runner.url().to_string(),
        runner: Mutex::new(Some(Served::Runner(runner))),
    })
}

/// Starts a model router from a JSON `RouterConfig`; returns once the port is bound (models
/// load on their first request).
#[pyfunction]
fn start_router(py: Python<'_>, config_json: &str) -> PyResult<NativeServer> {
    let config = RouterConfig::from_json(config_json)
        .map_err(|e| PyValueError::new_err(format!("invalid configuration: {e}")))?;
    init_logging(config.front.verbose, config.front.log_format);
    let router = py
        .detach(move || ModelRouter::start(config))
        .map_err(start_error)?;
    Ok(NativeServer {
        url: router.url().to_string(),
        runner: Mutex::new(Some(Served::Router(router))),
    })
}

/// `RunnerConfig::default()` as JSON: the Rust side's default of every setting (the Python
/// side's defaults are checked against it).
#[pyfunction]
fn default_config() -> PyResult<String> {
    serde_json::to_string(&RunnerConfig::default())
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// `(routing key, previous_response_id)` of a POST to `path` (no query string) with `body`,
/// as the server's dialects read it (`dialects/routing_key.rs`): the key's prefixes follow the
/// prompt's (None: no prompt), and the id names the stored response a `/v1/responses` request
/// continues (None: none), which only the server that stored it holds.
#[pyfunction]
fn route(py: Python<'_>, path: &str, body: &[u8]) -> (Option<String>, Option<String>) {
    let found = py.detach(|| routing_key::route(path, body));
    (found.key, found.previous_response_id)
}

/// Constants of the routing key: `(MAX_KEY_CHARS, RESPONSE_ID_HEADER)`.
#[pyfunction]
fn routing_constants() -> (usize, &'static str) {
    (routing_key::MAX_KEY_CHARS, routing_key::RESPONSE_ID_HEADER)
}

/// Every compute device llama.cpp's backends found, as a JSON array (name, description,
/// backend, kind, memory_free, memory_total), after loading the backend libraries.
#[pyfunction]
fn list_devices(py: Python<'_>) -> PyResult<String> {
    let devices = py
        .detach(llamarunner_core::backend::llama::list_devices)
        .map_err(PyRuntimeError::new_err)?;
    serde_json::to_string(&devices).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// The metadata of a GGUF file, as a JSON object (every key; long arrays as their type and
/// length; `tensor_count`), read without loading the model.
#[pyfunction]
fn gguf_metadata(py: Python<'_>, path: &str) -> PyResult<String> {
    let path = std::path::PathBuf::from(path);
    let meta = py
        .detach(|| llamarunner_core::backend::llama::gguf_metadata(&path))
        .map_err(PyValueError::new_err)?;
    serde_json::to_string(&meta).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// The version of the native module.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(start, m)?)?;
    m.add_function(wrap_pyfunction!(start_router, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(list_devices, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(default_config, m)?)?;
    m.add_function(wrap_pyfunction!(route, m)?)?;
    m.add_function(wrap_pyfunction!(routing_constants, m)?)?;
    m.add_class::<NativeServer>()?;
    m.add("ModelLoadError", m.py().get_type::<ModelLoadError>())?;
    Ok(())
}
