//! HTTP errors: every error the API can return, with its status code and stable `type`, mapped
//! in exactly one place.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::protocol::{EngineError, EngineErrorKind, SubmitError};

/// An error answered to an HTTP request.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not valid JSON or does not match the request's shape.
    #[error("invalid request body: {0}")]
    InvalidJson(String),
    /// A value the runner cannot use, or a request it cannot serve, where no one field is to
    /// blame.
    #[error("{0}")]
    InvalidRequest(String),
    /// A field of the request has a value the runner cannot use: which field (as the dialect
    /// names it) and what is wrong with it. OpenAI-shaped answers give the field as `param`.
    #[error("{0}")]
    InvalidField(FieldError),
    /// A LoRA field or `POST /lora-adapters` body names an adapter or scale that cannot be
    /// applied.
    #[error("{0}")]
    InvalidLora(String),
    /// The prompt does not fit in a slot.
    #[error("{0}")]
    ContextLength(String),
    /// A prompt of `n_prompt_tokens` does not fit a slot of `n_ctx` (and may not be cut): a
    /// `context_length_exceeded` whose sizes OpenAI-shaped answers give, as llama-server does.
    #[error("{message}")]
    PromptTooLong {
        /// What the error says.
        message: String,
        /// The prompt's tokens.
        n_prompt_tokens: usize,
        /// A slot's cells.
        n_ctx: usize,
    },
    /// An image that cannot be used: undecodable, too large, too many, a remote URL, or a
    /// reference to an image the request does not give.
    #[error("{0}")]
    InvalidImage(String),
    /// Images sent to a server without a vision projector (`--mmproj`).
    #[error("{0}")]
    ImagesNotSupported(String),
    /// A request asks for deterministic output from a server that cannot give it
    /// (`--deterministic` is chosen when the model loads).
    #[error("{0}")]
    DeterministicUnavailable(String),
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
    /// The request waited longer than the server's time limit (`--timeout`).
    #[error("{0}")]
    Timeout(String),
    /// No API key, or a wrong one, on a server that requires one.
    #[error(
        "a valid API key is required: send it as `Authorization: Bearer KEY` or `X-Api-Key: KEY`"
    )]
    Unauthorized,
    /// Refused whoever asks (a foreign `Host` or `Origin`).
    #[error("{0}")]
    Forbidden(String),
    /// The request body is larger than `--max-body`.
    #[error("{0}")]
    PayloadTooLarge(String),
    /// The body did not arrive in time.
    #[error("{0}")]
    RequestTimeout(String),
    /// The route exists, but not with this method.
    #[error("{0}")]
    MethodNotAllowed(String),
    /// A slot operation named a slot this server does not have.
    #[error("{0}")]
    SlotNotFound(String),
    /// A slot operation found the slot serving a request.
    #[error("{0}")]
    SlotBusy(String),
    /// A slot file to restore does not exist.
    #[error("{0}")]
    FileNotFound(String),
    /// A slot file to restore is corrupt, of another model, or refused by llama.cpp.
    #[error("{0}")]
    InvalidSlotFile(String),
    /// A feature this server was not started with (`--slot-save-path`).
    #[error("{0}")]
    NotSupported(String),
    /// A model larger than the memory it may take (`--models-memory`).
    #[error("{0}")]
    InsufficientMemory(String),
}

/// A request field with a value the runner cannot use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// The field, as the request's dialect names it (`top_p`, `response_format.type`).
    pub field: String,
    /// What is wrong, to follow the field's name (` must be >= 0`, `: Field required`).
    pub problem: String,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.field, self.problem)
    }
}

/// Most characters of a client's value an error message quotes.
const QUOTED_CHARS: usize = 60;

/// A client's JSON value as an error message quotes it: whole when short, else its first
/// characters and an ellipsis, so that a huge value is not echoed back (nor logged) whole.
pub fn quoted(value: &serde_json::Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(QUOTED_CHARS) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

impl ApiError {
    /// A 400 `invalid_request` with this message.
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError::InvalidRequest(message.into())
    }

    /// A 400 `invalid_request` that names the field at fault; the message is the field's name
    /// followed by `problem`.
    pub fn field(field: impl Into<String>, problem: impl Into<String>) -> Self {
        ApiError::InvalidField(FieldError {
            field: field.into(),
            problem: problem.into(),
        })
    }

    /// The request field at fault, when the error names one.
    pub fn param(&self) -> Option<&str> {
        match self {
            ApiError::InvalidField(e) => Some(&e.field),
            _ => None,
        }
    }

    /// HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidJson(_)
            | ApiError::InvalidRequest(_)
            | ApiError::InvalidField(_)
            | ApiError::InvalidLora(_)
            | ApiError::ContextLength(_)
            | ApiError::PromptTooLong { .. }
            | ApiError::InvalidImage(_)
            | ApiError::ImagesNotSupported(_)
            | ApiError::DeterministicUnavailable(_)
            | ApiError::InvalidSlotFile(_) => StatusCode::BAD_REQUEST,
            ApiError::Loading | ApiError::Unavailable(_) | ApiError::Timeout(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::NotFound(_)
            | ApiError::ModelNotFound(_)
            | ApiError::SlotNotFound(_)
            | ApiError::FileNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::SlotBusy(_) => StatusCode::CONFLICT,
            ApiError::NotSupported(_) => StatusCode::NOT_IMPLEMENTED,
            ApiError::InsufficientMemory(_) => StatusCode::INSUFFICIENT_STORAGE,
            ApiError::LoadFailed(_) | ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
        }
    }

    /// Stable machine-readable type.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::InvalidJson(_) => "invalid_json",
            ApiError::InvalidRequest(_) | ApiError::InvalidField(_) => "invalid_request",
            ApiError::InvalidLora(_) => "invalid_lora",
            ApiError::ContextLength(_) | ApiError::PromptTooLong { .. } => {
                "context_length_exceeded"
            }
            ApiError::InvalidImage(_) => "invalid_image",
            ApiError::ImagesNotSupported(_) => "images_not_supported",
            ApiError::DeterministicUnavailable(_) => "deterministic_unavailable",
            ApiError::Loading => "model_loading",
            ApiError::LoadFailed(_) => "model_load_failed",
            ApiError::Overloaded(_) => "overloaded",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::NotFound(_) => "not_found",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::Internal(_) => "internal_error",
            ApiError::Timeout(_) => "timeout",
            ApiError::Unauthorized => "unauthorized",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::PayloadTooLarge(_) => "payload_too_large",
            ApiError::RequestTimeout(_) => "request_timeout",
            ApiError::MethodNotAllowed(_) => "method_not_allowed",
            ApiError::SlotNotFound(_) => "slot_not_found",
            ApiError::SlotBusy(_) => "slot_busy",
            ApiError::FileNotFound(_) => "file_not_found",
            ApiError::InvalidSlotFile(_) => "invalid_slot_file",
            ApiError::NotSupported(_) => "not_supported",
            ApiError::InsufficientMemory(_) => "insufficient_memory",
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
    /// Every error answered passes here (in each dialect's shape): the request's record notes
    /// its type, and internal errors are logged.
    fn log(&self) {
        crate::http::access::note_error(self.kind());
        if matches!(self, ApiError::Internal(_)) {
            tracing::error!(error = %self, "request failed");
        }
    }

    /// OpenAI's error class for this status.
    pub fn openai_type(&self) -> &'static str {
        match self.status().as_u16() {
            400 | 404 | 405 | 408 | 409 | 413 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            429 => "rate_limit_error",
            503 => "service_unavailable_error",
            _ => "server_error",
        }
    }

    /// The body in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with our
    /// stable kind as `code` and the field at fault, if the error names one, as `param`. A prompt too long also has llama-server's type
    /// (`exceed_context_size_error`) and sizes (`n_prompt_tokens`, `n_ctx`), which clients
    /// written for it read; `code` stays OpenAI's `context_length_exceeded`.
    pub fn openai_body(&self) -> serde_json::Value {
        if let ApiError::PromptTooLong {
            n_prompt_tokens,
            n_ctx,
            ..
        } = self
        {
            return json!({"error": {
                "message": self.to_string(),
                "type": "exceed_context_size_error",
                "param": null,
                "code": self.kind(),
                "n_prompt_tokens": n_prompt_tokens,
                "n_ctx": n_ctx,
            }});
        }
        json!({"error": {
            "message": self.to_string(),
            "type": self.openai_type(),
            "param": self.param(),
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

impl ApiError {
    /// Anthropic's error type for this status.
    pub fn anthropic_type(&self) -> &'static str {
        match self.status().as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            504 => "timeout_error",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        }
    }

    /// The body in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, with
    /// our stable kind as `error.code`.
    pub fn anthropic_body(&self) -> serde_json::Value {
        json!({"type": "error", "error": {
            "type": self.anthropic_type(),
            "message": self.to_string(),
            "code": self.kind(),
        }})
    }
}

/// An error answered in Anthropic's shape (`/v1/messages`).
#[derive(Debug)]
pub struct AnthropicError(pub ApiError);

impl<E: Into<ApiError>> From<E> for AnthropicError {
    fn from(e: E) -> Self {
        Self(e.into())
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        self.0.log();
        (self.0.status(), Json(self.0.anthropic_body())).into_response()
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

/// The API a path belongs to, which decides the shape of its errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// The native API (`/completion`, `/health`, ...) and every path outside the other two
    /// (`/` included): `{"error": {"message", "type"}}`.
    Native,
    /// OpenAI's, under `/v1/`.
    OpenAi,
    /// Anthropic's, `/v1/messages` and below: `{"type": "error", "error": {...}}`.
    Anthropic,
    /// Ollama's, under `/api/`: `{"error": "..."}`.
    Ollama,
}

impl Dialect {
    /// The dialect of a request path. OpenAI's routes are served without `/v1` too (as
    /// llama-server serves them, `routes.rs`), and answer in OpenAI's shape there as well.
    pub fn of_path(path: &str) -> Self {
        // (`/models/...` stays the many-model router's own: `/models/load`, `/models/unload`.)
        const OPENAI_WITHOUT_V1: [&str; 4] = [
            "/chat/completions",
            "/completions",
            "/embeddings",
            "/responses",
        ];
        let under = |root: &str| {
            path.strip_prefix(root)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        };
        if under("/v1/messages") {
            Dialect::Anthropic
        } else if path.starts_with("/v1/")
            || path == "/models"
            || OPENAI_WITHOUT_V1.iter().any(|root| under(root))
        {
            Dialect::OpenAi
        } else if path.starts_with("/api/") {
            Dialect::Ollama
        } else {
            Dialect::Native
        }
    }

    /// `err` as this dialect answers it.
    pub fn respond(self, err: ApiError) -> Response {
        match self {
            Dialect::Native => err.into_response(),
            Dialect::OpenAi => OpenAiError(err).into_response(),
            Dialect::Anthropic => AnthropicError(err).into_response(),
            Dialect::Ollama => OllamaError(err).into_response(),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e.kind {
            EngineErrorKind::InvalidRequest => ApiError::InvalidRequest(e.message),
            EngineErrorKind::ContextLength => ApiError::ContextLength(e.message),
            EngineErrorKind::ShuttingDown => ApiError::Unavailable(e.message),
            EngineErrorKind::Timeout => ApiError::Timeout(e.message),
            EngineErrorKind::Internal => ApiError::Internal(e.message),
            EngineErrorKind::SlotNotFound => ApiError::SlotNotFound(e.message),
            EngineErrorKind::SlotBusy => ApiError::SlotBusy(e.message),
            EngineErrorKind::InvalidSlotState => ApiError::InvalidSlotFile(e.message),
            EngineErrorKind::CacheFull => ApiError::Unavailable(e.message),
        }
    }
}

impl From<crate::kv::TooLong> for ApiError {
    fn from(e: crate::kv::TooLong) -> Self {
        ApiError::PromptTooLong {
            message: e.to_string(),
            n_prompt_tokens: e.tokens,
            n_ctx: e.capacity,
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

#[cfg(test)]
mod tests {
    use super::Dialect;

    #[test]
    fn a_quoted_value_is_cut_after_its_first_characters() {
        use serde_json::json;
        assert_eq!(super::quoted(&json!({"a": 1})), r#"{"a":1}"#);
        let long = super::quoted(&json!("é".repeat(500)));
        assert_eq!(long.chars().count(), super::QUOTED_CHARS + 3);
        assert!(long.starts_with("\"éé") && long.ends_with("..."), "{long}");
    }

    #[test]
    fn each_path_answers_errors_in_its_api_s_shape() {
        for (path, dialect) in [
            ("/v1/messages", Dialect::Anthropic),
            ("/v1/messages/count_tokens", Dialect::Anthropic),
            ("/v1/messagesx", Dialect::OpenAi),
            ("/v1/chat/completions", Dialect::OpenAi),
            ("/chat/completions", Dialect::OpenAi),
            ("/chat/completions/input_tokens", Dialect::OpenAi),
            ("/completions", Dialect::OpenAi),
            ("/embeddings", Dialect::OpenAi),
            ("/responses/resp_1", Dialect::OpenAi),
            ("/models", Dialect::OpenAi),
            ("/completion", Dialect::Native),
            ("/completionsx", Dialect::Native),
            ("/embedding", Dialect::Native),
            ("/models/load", Dialect::Native),
            ("/api/chat", Dialect::Ollama),
            ("/", Dialect::Native),
        ] {
            assert_eq!(Dialect::of_path(path), dialect, "{path}");
        }
    }
}
