//! The runner's native API, the Ollama runner's wire format: `POST /completion` (NDJSON stream),
//! `GET /health`; and llama-server's tokenizer and property routes (`POST /tokenize`,
//! `POST /detokenize`, `GET /props`).

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::json;

use crate::http::error::ApiError;
use crate::http::AppState;
use crate::protocol::{Event, LoadState, Token, LLAMA_CPP_2_VERSION};
use crate::requests::common::{
    chat_prompt, embed_all, ensure_ready, model_info, parse_json, parse_messages, render_chat,
    start_generation,
};
use crate::requests::format::grammar_for_format;
use crate::requests::image_prompt::{self, Prompt};
use crate::requests::options::Options;
use crate::requests::tool_calls::ToolRequest;
use crate::requests::validate;

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
    /// LoRA adapter scales, as llama-server's (`server/lora.rs`); also taken from `options`.
    #[serde(default)]
    lora: Option<serde_json::Value>,
    /// Speculative decoding on or off for this request (also accepted in `options`).
    #[serde(default)]
    speculative: Option<bool>,
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
    let info = model_info(&state)?;
    let options = req.options.unwrap_or_default();
    let lora = state
        .lora
        .for_request(req.lora.as_ref().or(options.lora.as_ref()))?;
    let mut params = options.into_params();
    params.lora = lora;
    params.shift = req.shift.unwrap_or(true);
    params.truncate = req.truncate.unwrap_or(true);
    params.speculative = req.speculative.or(params.speculative);
    params.grammar = match req.grammar.filter(|g| !g.trim().is_empty()) {
        Some(g) => Some(crate::constrain::Grammar::new(
            crate::constrain::GrammarSource::Gbnf(g),
        )),
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
        Some(messages) => {
            if req.images.as_ref().is_some_and(|i| !i.is_empty()) {
                return Err(ApiError::InvalidImage(
                    "with messages, images go in the messages (their images or image_url parts)"
                        .into(),
                ));
            }
            let chat = parse_messages(messages)?;
            image_prompt::check_images(&info, chat.images.len())?;
            Prompt {
                text: chat_prompt(&state, chat.messages, &mut params).await?,
                images: chat.images,
            }
        }
        None => image_prompt::native_prompt(&info, required("prompt", req.prompt)?, req.images)?,
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
            "draft_count": c.draft_count,
            "draft_accepted_count": c.draft_accepted_count,
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

/// `GET /slots`: each slot's id, busy flag, cached tokens and last use, and what its request is
/// doing: phase, prompt tokens (cached, processed), tokens generated, paused for its client.
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
    #[serde(default)]
    tools: Option<Vec<serde_json::Value>>,
    #[serde(default)]
    tool_choice: Option<serde_json::Value>,
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
    let history = messages
        .iter()
        .any(|m| m.role == "tool" || m.extra.contains_key("tool_calls"));
    if tools.is_some() || history {
        // As the chat endpoints prepare it: tools in the prompt, earlier calls and results.
        let mut params = crate::protocol::params::SamplingParams::default();
        let (prompt, _) =
            crate::requests::tool_calls::chat_request(&state, messages, tools, &mut params, None)
                .await?;
        return Ok(Json(json!({ "prompt": prompt })).into_response());
    }
    let prompt = render_chat(&state, messages, req.add_generation_prompt.unwrap_or(true)).await?;
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
        .ok_or_else(|| ApiError::invalid("content is required"))?;
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
/// 400; at most `validate::max_detokenize_tokens` ids.
pub async fn detokenize(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let info = model_info(&state)?;
    let req: DetokenizeRequest = parse_json(&body)?;
    let ids = req
        .tokens
        .ok_or_else(|| ApiError::invalid("tokens is required"))?;
    let tokens: Vec<Token> = validate::check_token_ids(&ids, &info)?;
    let text = info.text.clone();
    let content = validate::blocking(move || {
        let bytes: Vec<u8> = tokens.iter().flat_map(|&t| text.piece(t)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    })
    .await?;
    Ok(Json(json!({ "content": content })).into_response())
}

/// `GET /props`: what this server serves and how (llama-server's key names where it has
/// them): the model, context per slot, slots, chat template, BOS/EOS, build.
pub async fn props(State(state): State<AppState>) -> Result<Response, ApiError> {
    let info = model_info(&state)?;
    let (_, total) = state.engine.health.slots();
    let special = |token: Option<Token>| {
        token.map(|t| String::from_utf8_lossy(&info.text.piece(t)).into_owned())
    };
    let file = info
        .path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned());
    let version = env!("CARGO_PKG_VERSION");
    Ok(Json(json!({
        "model_alias": state.model_name.as_ref(),
        // The file's name only: an absolute path tells clients about the server's disk.
        "model_path": file,
        "total_slots": total,
        "n_ctx": info.slot_ctx,
        "n_ctx_total": info.slot_ctx.saturating_mul(total as usize),
        "default_generation_settings": {"n_ctx": info.slot_ctx},
        "chat_template": info.template.source,
        "chat_template_name": info.template.name,
        "bos_token": special(info.bos),
        "bos_token_id": info.bos,
        "eos_token": special(info.eos),
        "eos_token_id": info.eos,
        "model": {
            "architecture": info.architecture,
            "quantization": info.quantization,
            "n_params": info.n_params,
            "n_vocab": info.n_vocab,
            "n_ctx_train": info.n_ctx_train,
            "n_embd": info.n_embd,
            "n_layer": info.n_layer,
            "size": info.file_size,
        },
        "slot_save": state.slot_save_path.is_some(),
        // As llama-server: whether requests may carry images (`--mmproj`) or audio (never).
        "modalities": {"vision": info.vision.is_some(), "audio": false},
        "build_info": format!("llamarunner {version} (llama-cpp-2 {LLAMA_CPP_2_VERSION})"),
        "version": version,
        "llama_cpp_2_version": LLAMA_CPP_2_VERSION,
        "system_info": info.system_info,
    }))
    .into_response())
}
