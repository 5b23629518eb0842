//! HTTP serving (axum). Handlers parse and validate, then talk to the engine through
//! `EngineHandle`; they never touch llama.cpp. Errors are mapped to HTTP in `error.rs` only.

pub mod common;
pub mod error;
pub mod native;
pub mod ollama;
pub mod openai;

use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;

use crate::engine::EngineHandle;
use error::ApiError;

/// What every handler can reach.
#[derive(Clone, Debug)]
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
    /// The model's public name (`--alias`, default the file stem).
    pub model_name: Arc<str>,
}

impl AppState {
    /// State for an engine serving the model called `model_name`.
    pub fn new(engine: EngineHandle, model_name: impl Into<Arc<str>>) -> Self {
        Self {
            engine,
            model_name: model_name.into(),
        }
    }
}

/// All routes.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/completion", post(native::completion))
        .route("/embedding", post(native::embedding))
        .route("/health", get(native::health))
        .route("/slots", get(native::slots))
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
        .fallback(not_found)
        .with_state(state)
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
    let err = ApiError::NotFound(format!("no route for {method} {path}"));
    if path.starts_with("/v1/") {
        error::OpenAiError(err).into_response()
    } else {
        err.into_response()
    }
}
