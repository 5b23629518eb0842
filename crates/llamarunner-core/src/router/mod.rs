//! One endpoint, many models (`serve --models-dir DIR`, or several `MODEL`s): the front
//! process routes each request by its `model` to that model's engine, a `llamarunner` server
//! in its own process on a loopback port (a llama.cpp abort takes down that model only).
//!
//! - `registry/`: the models and their states; loading on demand (once), `--models-max`
//!   (least recently used idle model out), keep-alive expiry, leases held by running requests;
//! - `engine_process.rs`: starting and following one engine process;
//! - `engine_client.rs`: the HTTP client to an engine (requests, its `/health`, `/metrics`);
//! - `proxy.rs`: a request forwarded under its lease, and its streamed answer back;
//! - `pull.rs`: `POST /api/pull`, and the models it fetches (`--allow-pull`);
//! - `front.rs`: the front's routes (listings, `/models/load|unload`, `/health`) and the
//!   forwarding of everything else.
//!
//! The front enforces the request policy (API keys, hosts, origins, the body limit) once; the
//! engines accept only the router's own key. With one model and none of these flags there is
//! no router: `Runner` serves the model directly.

pub mod engine_client;
pub mod engine_process;
mod front;
mod metrics;
pub mod proxy;
pub mod pull;
pub mod registry;

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::config::{ConfigError, RunnerConfig};
use crate::http::server::{serve_http, ConnLimits, ServerThread, StartError};
use registry::Registry;

/// One model a router serves.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The name requests use (`model`).
    pub name: String,
    /// The GGUF file.
    pub path: String,
    /// The engine's configuration (a `RunnerConfig`; host, port, keys and alias are the
    /// router's).
    pub config: serde_json::Value,
}

/// What a router needs.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterConfig {
    /// The front's HTTP settings (host, port, keys, origins, limits); its model is unused.
    pub front: RunnerConfig,
    /// The models, in listing order.
    pub models: Vec<ModelSpec>,
    /// Most models loaded at once (`--models-max`).
    pub models_max: usize,
    /// The most memory, in MiB, the loaded models' estimates may add up to
    /// (`--models-memory`); 0: no budget.
    #[serde(default)]
    pub models_memory: u64,
    /// Seconds a model stays loaded once idle (`--keep-alive`); negative: until the server
    /// stops; 0: unloaded after each request.
    pub keep_alive: f64,
    /// How an engine process is started (the program and its arguments); its configuration
    /// goes in the `LLAMARUNNER_ENGINE_CONFIG` environment variable.
    pub engine_command: Vec<String>,
    /// How models are pulled (`--allow-pull`); None: `POST /api/pull` fetches nothing.
    #[serde(default)]
    pub pull: Option<pull::PullConfig>,
}

/// Checks one model of a router (given at start, or pulled since).
pub fn validate_spec(m: &ModelSpec) -> Result<(), ConfigError> {
    let invalid = |message: String| ConfigError::Router(message);
    if m.name.trim().is_empty() || m.name.len() > 256 {
        return Err(invalid(format!(
            "model name {:?}: 1 to 256 characters",
            m.name
        )));
    }
    let config: RunnerConfig = serde_json::from_value(m.config.clone())
        .map_err(|e| invalid(format!("model '{}': {e}", m.name)))?;
    config.validate_http()
}

/// Longest wait for a model to load when `--timeout` is 0.
const DEFAULT_LOAD_TIMEOUT: Duration = Duration::from_secs(600);

impl RouterConfig {
    /// Parses a router configuration from JSON.
    pub fn from_json(json: &str) -> Result<Self, String> {
        let de = &mut serde_json::Deserializer::from_str(json);
        serde_path_to_error::deserialize(de).map_err(|e| format!("{}: {}", e.path(), e.inner()))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |message: String| ConfigError::Router(message);
        if self.models.is_empty() && self.pull.is_none() {
            return Err(invalid(
                "no models to serve (the models directory holds no .gguf file)".into(),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for m in &self.models {
            validate_spec(m)?;
            if !seen.insert(m.name.as_str()) {
                return Err(invalid(format!(
                    "two models are named '{}': give one an alias",
                    m.name
                )));
            }
        }
        if let Some(p) = &self.pull {
            if p.command.is_empty() {
                return Err(invalid("no pull command".into()));
            }
        }
        if self.models_max == 0 || self.models_max > 1024 {
            return Err(invalid(format!(
                "--models-max {}: must be 1 to 1024",
                self.models_max
            )));
        }
        if !self.keep_alive.is_finite() {
            return Err(invalid("--keep-alive must be a number of seconds".into()));
        }
        if self.engine_command.is_empty() {
            return Err(invalid("no engine command".into()));
        }
        self.front.validate_http()
    }
}

/// A running router. Dropping it stops it and its engines.
#[derive(Debug)]
pub struct ModelRouter {
    url: String,
    registry: Arc<Registry>,
    http: ServerThread,
}

impl ModelRouter {
    /// Binds the port and serves; models load on their first request.
    pub fn start(config: RouterConfig) -> Result<Self, StartError> {
        config.validate()?;
        let front = &config.front;
        let bound = crate::http::server::bind(front, "the models")?;
        let url = bound.url.clone();
        let policy = Arc::new(bound.policy);
        // At most 100 years: an idle clock's end must fit an Instant and a SystemTime.
        let keep_alive = (config.keep_alive >= 0.0)
            .then(|| Duration::from_secs_f64(config.keep_alive.min(100.0 * 365.0 * 86400.0)));
        let load_timeout = if front.timeout > 0.0 {
            Duration::try_from_secs_f64(front.timeout).unwrap_or(DEFAULT_LOAD_TIMEOUT)
        } else {
            DEFAULT_LOAD_TIMEOUT
        };
        let registry = Registry::new(
            &config.models,
            config.models_max,
            config.models_memory.saturating_mul(1 << 20),
            keep_alive,
            config.engine_command.clone(),
            load_timeout,
        );
        if let Some(p) = &config.pull {
            registry.allow_pull(p.clone());
        }
        let app = front::router(registry.clone(), policy, !front.no_metrics);
        let limits = ConnLimits::new(front);
        let for_thread = registry.clone();
        let listener = bound.listener;
        let http =
            ServerThread::spawn("llamarunner-router", Duration::from_secs(2), move |stop| {
                async move {
                    let reaper = {
                        let registry = for_thread.clone();
                        tokio::spawn(async move {
                            let mut tick = tokio::time::interval(Duration::from_millis(500));
                            loop {
                                tick.tick().await;
                                registry.expire_idle();
                            }
                        })
                    };
                    let registry = for_thread.clone();
                    serve_http(listener, app, limits, stop, move || registry.unload_all()).await;
                    reaper.abort();
                    for_thread.unload_all();
                    // Let the kills reach the processes.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })?;
        tracing::info!(%url, models = config.models.len(), "listening (model router)");
        Ok(Self {
            url,
            registry,
            http,
        })
    }

    /// Base URL, e.g. `http://127.0.0.1:8080`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The models and their states.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Stops serving: the port closes, running requests get `shutdown_timeout` to finish, the
    /// engines are stopped.
    pub fn stop(&mut self) {
        self.http.stop();
    }
}

impl Drop for ModelRouter {
    fn drop(&mut self) {
        self.stop();
    }
}
