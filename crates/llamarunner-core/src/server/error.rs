//! HTTP errors: every error the API can return, with its status code and stable `type`, mapped
//! in exactly one place.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::engine::{EngineError, EngineErrorKind, SubmitError};

/// An error answered to an HTTP request.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not valid JSON or does not match the request's shape.
    #[error("invalid request body: {0}")]
    InvalidJson(String),
    /// A field has a value the runner cannot use.
    #[error("{0}")]
    InvalidRequest(String),
    /// The prompt does not fit in a slot.
    #[error("{0}")]
    ContextLength(String),
    /// The model is still loading.
    #[error("the model is still loading; retry when /health says ready")]
    Loading,
    /// The model failed to load.
    #[error("the model failed to load: {0}")]
    LoadFailed(String),
    /// Too many requests are waiting.
    #[error("{0}")]
    Overloaded(String),
    /// The engine is stopping or stopped.
    #[error("{0}")]
    Unavailable(String),
    /// No such route.
    #[error("{0}")]
    NotFound(String),
    /// The request names a model this server does not serve.
    #[error("{0}")]
    ModelNotFound(String),
    /// A failure inside the engine.
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 `invalid_request` with this message.
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError::InvalidRequest(message.into())
    }

    /// HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidJson(_) | ApiError::InvalidRequest(_) | ApiError::ContextLength(_) => {
                StatusCode::BAD_REQUEST
            }
            ApiError::Loading | ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::NotFound(_) | ApiError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::LoadFailed(_) | ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Stable machine-readable type.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::InvalidJson(_) => "invalid_json",
            ApiError::InvalidRequest(_) => "invalid_request",
            ApiError::ContextLength(_) => "context_length_exceeded",
            ApiError::Loading => "model_loading",
            ApiError::LoadFailed(_) => "model_load_failed",
            ApiError::Overloaded(_) => "overloaded",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::NotFound(_) => "not_found",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::Internal(_) => "internal_error",
        }
    }

    /// The JSON body: `{"error": {"message", "type"}}`.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.to_string(), "type": self.kind()}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.log();
        (self.status(), Json(self.body())).into_response()
    }
}

impl ApiError {
    fn log(&self) {
        if matches!(self, ApiError::Internal(_)) {
            tracing::error!(error = %self, "request failed");
        }
    }

    /// OpenAI's error class for this status.
    pub fn openai_type(&self) -> &'static str {
        match self.status().as_u16() {
            400 | 404 => "invalid_request_error",
            429 => "rate_limit_error",
            503 => "service_unavailable_error",
            _ => "server_error",
        }
    }

    /// The body in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with our
    /// stable kind as `code`.
    pub fn openai_body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.to_string(),
            "type": self.openai_type(),
            "param": null,
            "code": self.kind(),
        }})
    }
}

/// An error answered in OpenAI's shape (the `/v1` routes).
#[derive(Debug)]
pub struct OpenAiError(pub ApiError);

impl<E: Into<ApiError>> From<E> for OpenAiError {
    fn from(e: E) -> Self {
        Self(e.into())
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        self.0.log();
        (self.0.status(), Json(self.0.openai_body())).into_response()
    }
}

/// An error answered in Ollama's shape, `{"error": "..."}` (the `/api` routes).
#[derive(Debug)]
pub struct OllamaError(pub ApiError);

impl<E: Into<ApiError>> From<E> for OllamaError {
    fn from(e: E) -> Self {
        Self(e.into())
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        self.0.log();
        (self.0.status(), Json(json!({"error": self.0.to_string()}))).into_response()
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e.kind {
            EngineErrorKind::InvalidRequest => ApiError::InvalidRequest(e.message),
            EngineErrorKind::ContextLength => ApiError::ContextLength(e.message),
            EngineErrorKind::ShuttingDown => ApiError::Unavailable(e.message),
            EngineErrorKind::Internal => ApiError::Internal(e.message),
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::QueueFull => ApiError::Overloaded(e.to_string()),
            SubmitError::Stopped => ApiError::Unavailable(e.to_string()),
        }
    }
}
