//! The model's tokenizer and chat template over HTTP: `POST /tokenize`, `POST /detokenize` and
//! `POST /apply-template` (llama-server's routes of those names).

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use crate::http::error::ApiError;
use crate::http::AppState;
use crate::protocol::Token;
use crate::requests::common::{ensure_ready, model_info, parse_json, parse_messages, render_chat};
use crate::requests::thinking::{parse_think, TemplateArgs};
use crate::requests::tool_calls::ToolRequest;
use crate::requests::validate;

/// Body of `POST /apply-template`.
#[derive(Debug, Deserialize)]
struct ApplyTemplateRequest {
    #[serde(default)]
    messages: Option<Vec<serde_json::Value>>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    tools: Option<Vec<serde_json::Value>>,
    #[serde(default)]
    tool_choice: Option<serde_json::Value>,
    /// Template variables, `enable_thinking` among them (`requests::thinking`).
    #[serde(default)]
    chat_template_kwargs: Option<serde_json::Value>,
    #[serde(default)]
    reasoning_effort: Option<serde_json::Value>,
    /// Ollama's and the native chat's thinking switch.
    #[serde(default)]
    think: Option<serde_json::Value>,
}

/// `POST /apply-template`: `{"messages"}` -> `{"prompt"}`, the text the chat endpoints would
/// generate from (without the BOS the tokenizer adds), as llama-server's endpoint of that name.
pub async fn apply_template(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, ApiError> {
    ensure_ready(&state)?;
    let req: ApplyTemplateRequest = parse_json(&body)?;
    let messages = parse_messages(req.messages.unwrap_or_default())?.messages;
    let tools = ToolRequest::parse(req.tools.as_deref(), req.tool_choice.as_ref(), None)?;
    let args = TemplateArgs::read(
        parse_think(req.think.as_ref())?,
        req.chat_template_kwargs.as_ref(),
        req.reasoning_effort.as_ref(),
    )?;
    let history = messages
        .iter()
        .any(|m| m.role == "tool" || m.extra.contains_key("tool_calls"));
    if tools.is_some() || history {
        // As the chat endpoints prepare it: tools in the prompt, earlier calls and results.
        let mut params = crate::protocol::params::SamplingParams::default();
        let (prompt, _) =
            crate::requests::tool_calls::chat_request(&state, messages, tools, &mut params, args)
                .await?;
        return Ok(Json(json!({ "prompt": prompt })).into_response());
    }
    let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
    let prompt = render_chat(&state, messages, add_generation_prompt, args).await?;
    Ok(Json(json!({ "prompt": prompt })).into_response())
}

/// Body of `POST /tokenize`.
#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    content: Option<String>,
    /// Add BOS (and EOS) when the model wants them, as prompts get (default false, as
    /// llama-server).
    #[serde(default)]
    add_special: Option<bool>,
    /// Return `{"id", "piece"}` objects instead of ids.
    #[serde(default)]
    with_pieces: Option<bool>,
}

/// A token's piece for JSON: a string when it is valid UTF-8, else its bytes (a piece may be
/// part of a character), as llama-server answers.
fn piece_json(bytes: Vec<u8>) -> serde_json::Value {
    match String::from_utf8(bytes) {
        Ok(text) => json!(text),
        Err(e) => json!(e.into_bytes()),
    }
}

/// `POST /tokenize`: `{"content", "add_special"?, "with_pieces"?}` -> `{"tokens": [id]}` or,
/// with pieces, `{"tokens": [{"id", "piece"}]}`. Special tokens in the text are parsed. The
/// text is bounded as a prompt is and tokenized on the blocking pool.
pub async fn tokenize(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let info = model_info(&state)?;
    let req: TokenizeRequest = parse_json(&body)?;
    let content = req
        .content
        .ok_or_else(|| ApiError::field("content", " is required"))?;
    let tokens =
        validate::tokenize_text(&info, content, req.add_special.unwrap_or(false), "content")
            .await?;
    if !req.with_pieces.unwrap_or(false) {
        return Ok(Json(json!({ "tokens": tokens })).into_response());
    }
    let text = info.text.clone();
    let pieces = validate::blocking(move || {
        tokens
            .iter()
            .map(|&id| json!({"id": id, "piece": piece_json(text.piece(id))}))
            .collect::<Vec<_>>()
    })
    .await?;
    Ok(Json(json!({ "tokens": pieces })).into_response())
}

/// Body of `POST /detokenize`.
#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    #[serde(default)]
    tokens: Option<Vec<i64>>,
}

/// `POST /detokenize`: `{"tokens": [id]}` -> `{"content"}`, the pieces joined (special tokens
/// as their text; bytes that are not UTF-8 become U+FFFD). Ids outside the vocabulary are a
/// 400; at most `requests::validate::max_detokenize_tokens` ids.
pub async fn detokenize(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let info = model_info(&state)?;
    let req: DetokenizeRequest = parse_json(&body)?;
    let ids = req
        .tokens
        .ok_or_else(|| ApiError::field("tokens", " is required"))?;
    let tokens: Vec<Token> = validate::check_token_ids(&ids, &info)?;
    let text = info.text.clone();
    let content = validate::blocking(move || {
        let bytes: Vec<u8> = tokens.iter().flat_map(|&t| text.piece(t)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    })
    .await?;
    Ok(Json(json!({ "content": content })).into_response())
}
