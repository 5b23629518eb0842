//! HTTP serving (axum). Handlers parse and validate, then talk to the engine through
//! `EngineHandle`; they never touch llama.cpp. Errors are mapped to HTTP in `error.rs` only.

pub mod access;
pub mod common;
pub mod error;
pub mod format;
pub mod image_prompt;
pub mod images;
pub mod lora;
pub mod metrics;
pub mod middleware;
pub mod native;
pub mod ollama;
pub mod openai;
pub mod options;
pub mod slot_file;
pub mod slots;
pub mod tool_calls;
pub mod validate;

use std::path::Path;
use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;

use crate::engine::EngineHandle;
use error::{ApiError, Dialect};
use metrics::Metrics;
use middleware::HttpPolicy;

/// What every handler can reach.
#[derive(Clone, Debug)]
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
    /// The model's public name (`--alias`, default the file stem).
    pub model_name: Arc<str>,
    /// Per-request limits (`--max-tokens`, `--timeout`).
    pub limits: validate::Limits,
    /// API keys, allowed hosts and origins, the body limit (`middleware.rs`).
    pub policy: Arc<HttpPolicy>,
    /// The Prometheus metrics (`GET /metrics`); None with `--no-metrics`.
    pub metrics: Option<Arc<Metrics>>,
    /// Where slot files are saved and restored from (`--slot-save-path`); None: off.
    pub slot_save_path: Option<Arc<Path>>,
    /// The `--lora` adapters and their default scales (`lora.rs`).
    pub lora: Arc<lora::LoraTable>,
    /// `<think>` reasoning in chat answers (`--reasoning-format`).
    pub reasoning_format: crate::config::ReasoningFormat,
    /// Images being decoded, tokenized or queued, at most `image_prompt::IMAGES_IN_FLIGHT`:
    /// each holds its pixels, then the projector's preprocessed input, until its request has
    /// a slot.
    pub images_in_flight: Arc<tokio::sync::Semaphore>,
}

impl AppState {
    /// State for an engine serving the model called `model_name`.
    pub fn new(engine: EngineHandle, model_name: impl Into<Arc<str>>) -> Self {
        Self {
            engine,
            model_name: model_name.into(),
            limits: validate::Limits::default(),
            policy: Arc::new(HttpPolicy::default()),
            metrics: None,
            slot_save_path: None,
            lora: Arc::default(),
            reasoning_format: crate::config::ReasoningFormat::Auto,
            images_in_flight: Arc::new(tokio::sync::Semaphore::new(image_prompt::IMAGES_IN_FLIGHT)),
        }
    }

    /// The same state serving these LoRA adapters (the engine must have loaded the same).
    pub fn with_lora(mut self, table: Arc<lora::LoraTable>) -> Self {
        self.lora = table;
        self
    }

    /// The same state, exporting these metrics at `GET /metrics` and counting outcomes into
    /// them (the engine should report to them too: `EngineHandle::with_observer`).
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The same state saving and restoring slot files in `dir` (an existing directory;
    /// `slots::prepare_dir` makes one).
    pub fn with_slot_save_path(mut self, dir: Option<Arc<Path>>) -> Self {
        self.slot_save_path = dir;
        self
    }

    /// The same state with this treatment of `<think>` reasoning.
    pub fn with_reasoning_format(mut self, format: crate::config::ReasoningFormat) -> Self {
        self.reasoning_format = format;
        self
    }

    /// The same state under this request policy (the default: no API key, loopback hosts and
    /// origins only, 8 MiB bodies).
    pub fn with_policy(mut self, policy: HttpPolicy) -> Self {
        self.policy = Arc::new(policy);
        self
    }

    /// The same state with these per-request limits.
    pub fn with_limits(mut self, limits: validate::Limits) -> Self {
        self.limits = limits;
        self
    }
}

/// All routes, behind the request policy's layers (`middleware.rs`), all behind the access
/// layer (`access.rs`: request ids, outcomes, access lines).
pub fn router(state: AppState) -> Router {
    let policy = state.policy.clone();
    let metrics = state.metrics.clone();
    let mut routes = Router::new();
    if metrics.is_some() {
        routes = routes.route("/metrics", get(metrics::handler));
    }
    let routes = routes
        .route("/completion", post(native::completion))
        .route("/embedding", post(native::embedding))
        .route("/health", get(native::health))
        .route("/slots", get(native::slots))
        .route("/slots/{id}", post(slots::action))
        .route("/tokenize", post(native::tokenize))
        .route("/detokenize", post(native::detokenize))
        .route("/props", get(native::props))
        .route("/lora-adapters", get(lora::list).post(lora::set))
        .route("/apply-template", post(native::apply_template))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{*model}", get(openai::model))
        .route("/api/generate", post(ollama::generate))
        .route("/api/chat", post(ollama::chat))
        .route("/api/embed", post(ollama::embed))
        .route("/api/embeddings", post(ollama::embeddings))
        .route("/api/tags", get(ollama::tags))
        .route("/api/show", post(ollama::show))
        .route("/api/ps", get(ollama::ps))
        .route("/api/version", get(ollama::version))
        .route("/", get(ollama::root))
        // Keep this after the last route: it applies to the routes registered before it.
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .with_state(state);
    access::layer(middleware::apply(routes, policy), metrics)
}

/// Unknown routes: a 404 in the shape of the dialect the path belongs to.
async fn not_found(method: axum::http::Method, uri: axum::http::Uri) -> axum::response::Response {
    use axum::response::IntoResponse;
    let path = uri.path();
    if path.starts_with("/api/") {
        let why = if matches!(
            path,
            "/api/pull" | "/api/push" | "/api/create" | "/api/copy" | "/api/delete"
        ) {
            "; llamarunner serves the one model it was started with and cannot pull, push, \
             create, copy or delete models"
        } else {
            ""
        };
        return error::OllamaError(ApiError::NotFound(format!(
            "no route for {method} {path}{why}"
        )))
        .into_response();
    }
    Dialect::of_path(path).respond(ApiError::NotFound(format!("no route for {method} {path}")))
}

/// A route asked with a method it does not serve: a 405 in the dialect's shape (axum adds the
/// `Allow` header).
async fn method_not_allowed(
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> axum::response::Response {
    let path = uri.path();
    Dialect::of_path(path).respond(ApiError::MethodNotAllowed(format!(
        "{path} does not accept {method}"
    )))
}
