//! HTTP serving (axum). Handlers parse and validate, then talk to the engine through
//! `EngineHandle`; they never touch llama.cpp. Errors are mapped to HTTP in `error.rs` only.

pub mod error;
pub mod native;

use axum::routing::{get, post};
use axum::Router;

use crate::engine::EngineHandle;
use error::ApiError;

/// What every handler can reach.
#[derive(Clone, Debug)]
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
}

/// All routes.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/completion", post(native::completion))
        .route("/embedding", post(native::embedding))
        .route("/health", get(native::health))
        .route("/slots", get(native::slots))
        .fallback(not_found)
        .with_state(state)
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::NotFound(format!("no route for {uri}"))
}
