//! The runner's native API, the Ollama runner's wire format: `POST /completion` (NDJSON stream),
//! `GET /health`.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::json;

use super::common::{
    chat_prompt, embed_all, ensure_ready, parse_json, parse_messages, render_chat, start_generation,
};
use super::error::ApiError;
use super::format::grammar_for_format;
use super::options::Options;
use super::AppState;
use crate::engine::{Event, LoadState};

/// Body of `POST /completion`. Unknown fields are ignored, as in the Ollama runner; the Go
/// runner's capitalized keys are accepted too.
#[derive(Debug, Deserialize)]
struct CompletionRequest {
    #[serde(default, alias = "Prompt")]
    prompt: Option<String>,
    /// A conversation, rendered with the model's chat template, instead of `prompt`.
    #[serde(default)]
    messages: Option<Vec<serde_json::Value>>,
    #[serde(default, alias = "Options")]
    options: Option<Options>,
    #[serde(default, alias = "Grammar")]
    grammar: Option<String>,
    #[serde(default, alias = "Format")]
    format: Option<serde_json::Value>,
    #[serde(default, alias = "Images")]
    images: Option<Vec<serde_json::Value>>,
    #[serde(default, alias = "Shift")]
    shift: Option<bool>,
    #[serde(default, alias = "Truncate")]
    truncate: Option<bool>,
}

/// A text field that must be present and non-empty.
fn required(name: &str, value: Option<String>) -> Result<String, ApiError> {
    value.filter(|v| !v.is_empty()).ok_or_else(|| {
        ApiError::InvalidRequest(format!("{name} is required and must not be empty"))
    })
}

/// `POST /completion`.
pub async fn completion(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    ensure_ready(&state)?;
    let req: CompletionRequest = parse_json(&body)?;
    if req.images.as_ref().is_some_and(|i| !i.is_empty()) {
        return Err(ApiError::InvalidRequest(
            "images are not supported: no multimodal projector is loaded".into(),
        ));
    }
    let mut params = req.options.unwrap_or_default().into_params();
    params.shift = req.shift.unwrap_or(true);
    params.truncate = req.truncate.unwrap_or(true);
    params.grammar = match req.grammar.filter(|g| !g.trim().is_empty()) {
        Some(g) => Some(g),
        None => {
            grammar_for_format(&req.format.unwrap_or_default()).map_err(ApiError::InvalidRequest)?
        }
    };
    let prompt = match req.messages {
        Some(_) if req.prompt.as_ref().is_some_and(|p| !p.is_empty()) => {
            return Err(ApiError::InvalidRequest(
                "give either prompt or messages, not both".into(),
            ))
        }
        Some(messages) => chat_prompt(&state, parse_messages(messages)?, &mut params).await?,
        None => required("prompt", req.prompt)?,
    };

    let generation = start_generation(&state, prompt, params).await?;
    let lines = generation.map(|event| Ok::<_, Infallible>(Bytes::from(ndjson(&event))));
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response())
}

/// One NDJSON line for an engine event.
fn ndjson(event: &Event) -> String {
    let value = match event {
        Event::Text { text, .. } => json!({"content": text, "done": false}),
        Event::Done(c) => json!({
            "content": "",
            "done": true,
            "done_reason": c.done_reason.as_str(),
            "prompt_eval_count": c.prompt_eval_count,
            "prompt_eval_duration": c.prompt_eval_duration_ns,
            "prompt_cached_count": c.prompt_cached_count,
            "eval_count": c.eval_count,
            "eval_duration": c.eval_duration_ns,
            "truncated": c.truncated,
        }),
        Event::Error(e) => {
            let err = ApiError::from(e.clone());
            json!({"done": true, "done_reason": "error", "error": err.body()["error"]})
        }
        Event::Started => json!({"content": "", "done": false}),
    };
    let mut line = value.to_string();
    line.push('\n');
    line
}

/// Body of `POST /embedding`.
#[derive(Debug, Deserialize)]
struct EmbeddingRequest {
    #[serde(default, alias = "Content")]
    content: Option<String>,
    #[serde(default, alias = "Truncate")]
    truncate: Option<bool>,
}

/// `POST /embedding`: `{"content"}` -> `{"embedding", "prompt_eval_count"}` (not normalized).
pub async fn embedding(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    ensure_ready(&state)?;
    let req: EmbeddingRequest = parse_json(&body)?;
    let content = required("content", req.content)?;
    let embedding = embed_all(&state, vec![content], req.truncate.unwrap_or(false))
        .await?
        .pop()
        .ok_or_else(|| ApiError::Internal("no embedding returned".into()))?;
    Ok(Json(json!({
        "embedding": embedding.vector,
        "prompt_eval_count": embedding.prompt_eval_count,
        "truncated": embedding.truncated,
    }))
    .into_response())
}

/// `GET /slots`: each slot's id, busy flag, cached token count and last use (for debugging).
pub async fn slots(State(state): State<AppState>) -> Response {
    Json(json!({ "slots": state.engine.health.slot_table() })).into_response()
}

/// `GET /health`: 200 when ready, 503 while loading, 500 when the model failed to load.
pub async fn health(State(state): State<AppState>) -> Response {
    let h = &state.engine.health;
    let load = h.state();
    let (busy, total) = h.slots();
    let mut body = json!({
        "status": load.as_str(),
        "progress": h.progress(),
        "slots_idle": total.saturating_sub(busy),
        "slots_processing": busy,
    });
    if let Some(e) = h.error() {
        body["error"] = json!(e);
    }
    let status = match load {
        LoadState::Ready => StatusCode::OK,
        LoadState::Loading => StatusCode::SERVICE_UNAVAILABLE,
        LoadState::Error => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, Json(body)).into_response()
}

/// Body of `POST /apply-template`.
#[derive(Debug, Deserialize)]
struct ApplyTemplateRequest {
    #[serde(default)]
    messages: Option<Vec<serde_json::Value>>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
}

/// `POST /apply-template`: `{"messages"}` -> `{"prompt"}`, the text the chat endpoints would
/// generate from (without the BOS the tokenizer adds), as llama-server's endpoint of that name.
pub async fn apply_template(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, ApiError> {
    ensure_ready(&state)?;
    let req: ApplyTemplateRequest = parse_json(&body)?;
    let messages = parse_messages(req.messages.unwrap_or_default())?;
    let prompt = render_chat(&state, messages, req.add_generation_prompt.unwrap_or(true)).await?;
    Ok(Json(json!({ "prompt": prompt })).into_response())
}
