//! The Ollama dialect (`/api`): generate and chat as NDJSON streams (or one object with
//! `"stream": false`), embeddings, and the model listing endpoints, with errors as
//! `{"error": "..."}`. One model is served; it is always loaded, so `keep_alive` is accepted and
//! has nothing to do.
//!
//! - `mod.rs`: the routes of generate, chat and the embeddings, their requests read and
//!   checked, and what `routing_key` reads of them;
//! - `answer.rs`: generate's and chat's answers, whole or streamed;
//! - `models.rs`: `/api/tags`, `/api/ps`, `/api/show`, `/api/pull` and `/api/version`, and
//!   the listing entries a router shares;
//! - `wire.rs`: the answers as serde types.

use std::convert::Infallible;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::openai::MAX_TOP_LOGPROBS;
use crate::chat::ChatMessage;
use crate::http::error::{ApiError, OllamaError};
use crate::http::state::AppState;
use crate::protocol::nanos;
use crate::protocol::params::SamplingParams;
use crate::requests::common::{
    chat_prompt, check_dimensions, check_model, embed_all, l2_normalize, model_info, parse_json,
    parse_messages,
};
use crate::requests::format::grammar_for_format;
use crate::requests::image_prompt::{self, Prompt};
use crate::requests::keyed::{Keyed, Piece};
use crate::requests::options::Options;
use crate::requests::tool_calls::{self, ToolRequest};

mod answer;
mod models;
mod wire;

use answer::{respond, respond_chat, Meta};
pub use models::{ps, pull, show, tags, version, OLLAMA_API_VERSION};
pub(crate) use models::{Listed, KEPT_LOADED};
pub(crate) use wire::{Details, ModelEntry, Models};
use wire::{Embed, Embedding};

/// Fields `/api/generate` and `/api/chat` share.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct OllamaRequest {
    model: Option<String>,
    // generate
    prompt: Option<String>,
    suffix: Option<String>,
    system: Option<String>,
    template: Option<String>,
    raw: Option<bool>,
    images: Option<Vec<Value>>,
    // chat
    messages: Option<Vec<Value>>,
    tools: Option<Vec<Value>>,
    // both
    stream: Option<bool>,
    format: Option<Value>,
    options: Option<Options>,
    think: Option<Value>,
    logprobs: Option<bool>,
    top_logprobs: Option<u32>,
    /// true: the output must depend on the request alone (`--deterministic`), else 400.
    deterministic: Option<bool>,
}

impl OllamaRequest {
    fn check(&self, state: &AppState) -> Result<(), ApiError> {
        required_model(state, self.model.as_deref())?;
        self.think()?;
        if self.template.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(ApiError::field(
                "template", " overrides are not supported (Ollama's Go templates); start the server with --chat-template",
            ));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::field(
                "suffix",
                " (fill-in-the-middle) is not supported",
            ));
        }
        Ok(())
    }

    /// `think` (`requests::thinking::parse_think`); absent: as the template is (a thinking
    /// model's template thinks).
    fn think(&self) -> Result<Option<bool>, ApiError> {
        crate::requests::thinking::parse_think(self.think.as_ref())
    }

    fn params(&self) -> Result<SamplingParams, ApiError> {
        let mut params = self.options.clone().unwrap_or_default().into_params();
        params.grammar = grammar_for_format(self.format.as_ref().unwrap_or(&Value::Null))
            .map_err(ApiError::invalid)?;
        params.logprobs = match (self.logprobs, self.top_logprobs) {
            (_, Some(n)) if n > MAX_TOP_LOGPROBS => {
                return Err(ApiError::field(
                    "top_logprobs",
                    format!(" must be between 0 and {MAX_TOP_LOGPROBS}"),
                ))
            }
            (Some(true), n) => Some(n.unwrap_or(0) as usize),
            (_, Some(n)) if n > 0 => {
                return Err(ApiError::field("top_logprobs", " needs logprobs: true"))
            }
            _ => None,
        };
        params.deterministic = self.deterministic.unwrap_or(false);
        Ok(params)
    }
}

/// Parses and checks a generate or chat request.
fn prepare(
    state: &AppState,
    body: &[u8],
    chat: bool,
) -> Result<(OllamaRequest, SamplingParams, Meta), ApiError> {
    let started = Instant::now();
    model_info(state)?;
    let req: OllamaRequest = parse_json(body)?;
    req.check(state)?;
    let mut params = req.params()?;
    state
        .sampling_defaults
        .fill_left_out(&mut params, body, true);
    params.lora = state
        .lora
        .for_request(req.options.as_ref().and_then(|o| o.lora.as_ref()))?;
    let meta = Meta {
        model: req.model.clone().unwrap_or_default(),
        chat,
        started,
    };
    Ok((req, params, meta))
}

/// `POST /api/generate`.
pub async fn generate(State(state): State<AppState>, body: Bytes) -> Result<Response, OllamaError> {
    let (req, mut params, meta) = prepare(&state, &body, false)?;
    if req.think()? == Some(true) {
        return Err(ApiError::field(
            "think",
            ": thinking is split out on /api/chat; /api/generate answers the text as is",
        )
        .into());
    }
    let Some((system, prompt)) = generate_parts(&req) else {
        return Ok(Json(meta.loaded()).into_response());
    };
    // The images take their places in the user's text (`requests::image_prompt::ollama_generate`).
    let user = image_prompt::ollama_generate(&*model_info(&state)?, prompt, req.images.clone())?;
    let text = match system {
        None => user.text,
        Some(system) => {
            let mut messages = system_message(system);
            messages.push(message("user", user.text));
            chat_prompt(&state, messages, &mut params).await?
        }
    };
    let prompt = Prompt {
        text,
        images: user.images,
    };
    respond(state, prompt, params, meta, req.stream.unwrap_or(true)).await
}

/// A generate request's system prompt (None: `raw`, no template) and prompt; None when it
/// asks for nothing (Ollama's way to load a model).
fn generate_parts(req: &OllamaRequest) -> Option<(Option<String>, String)> {
    let prompt = req.prompt.clone().unwrap_or_default();
    let system = req.system.clone().unwrap_or_default();
    if prompt.is_empty() && system.is_empty() && req.images.as_ref().is_none_or(Vec::is_empty) {
        return None;
    }
    let system = (req.raw != Some(true)).then_some(system);
    Some((system, prompt))
}

/// The system message of a generate request, if it has one.
fn system_message(system: String) -> Vec<ChatMessage> {
    if system.is_empty() {
        Vec::new()
    } else {
        vec![message("system", system)]
    }
}

/// `/api/generate` as `routing_key` reads it: as `generate` does (the system message, then
/// the prompt's text, which the template puts in a user message after it).
pub(crate) fn generate_keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: OllamaRequest = parse_json(body)?;
    let Some((system, prompt)) = generate_parts(&req) else {
        return Ok(Keyed::new(req.model, Vec::new()));
    };
    let mut pieces: Vec<Piece> = system_message(system.unwrap_or_default())
        .into_iter()
        .map(Piece::Message)
        .collect();
    pieces.push(Piece::Text(prompt));
    Ok(Keyed::new(req.model, pieces))
}

/// `/api/chat` as `routing_key` reads it: as `chat` does.
pub(crate) fn chat_keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: OllamaRequest = parse_json(body)?;
    let raw_messages = req.messages.unwrap_or_default();
    if raw_messages.is_empty() {
        return Ok(Keyed::new(req.model, Vec::new()));
    }
    Ok(Keyed::chat(
        req.model,
        parse_messages(raw_messages)?.messages,
    ))
}

fn message(role: &str, content: String) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content,
        extra: serde_json::Map::new(),
        ..ChatMessage::default()
    }
}

/// `POST /api/chat`.
pub async fn chat(State(state): State<AppState>, body: Bytes) -> Result<Response, OllamaError> {
    let (req, mut params, meta) = prepare(&state, &body, true)?;
    let raw_messages = req.messages.clone().unwrap_or_default();
    if raw_messages.is_empty() {
        return Ok(Json(meta.loaded()).into_response());
    }
    let chat = parse_messages(raw_messages)?;
    let tools = ToolRequest::parse(req.tools.as_deref(), None, None)?;
    let (prompt, output) =
        tool_calls::chat_prompt(&state, chat, tools, &mut params, req.think()?.into()).await?;
    respond_chat(
        state,
        prompt,
        params,
        meta,
        req.stream.unwrap_or(true),
        output,
    )
    .await
}

/// One NDJSON line of a streamed answer (also the router's `/api/pull` lines).
pub(crate) fn ndjson_line<T: Serialize>(v: T) -> Result<Bytes, Infallible> {
    let mut s = super::stream_json::to_line(&v);
    s.push('\n');
    Ok(Bytes::from(s))
}

/// Body of `POST /api/embed` and the older `POST /api/embeddings`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct EmbedRequest {
    model: Option<String>,
    input: Option<Value>,
    prompt: Option<String>,
    truncate: Option<bool>,
    dimensions: Option<u32>,
}

/// `/api/embed`'s texts: `input` a string or a list of strings (none: nothing to embed).
fn embed_inputs(input: Option<Value>) -> Result<Vec<String>, ApiError> {
    match input {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s]),
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                _ => Err(ApiError::field(
                    "input",
                    " must be a string or a list of strings",
                )),
            })
            .collect(),
        Some(_) => Err(ApiError::field(
            "input",
            " must be a string or a list of strings",
        )),
    }
}

/// `/api/embed` as `routing_key` reads it: as `embed` does.
pub(crate) fn embed_keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: EmbedRequest = parse_json(body)?;
    let inputs = embed_inputs(req.input)?;
    Ok(Keyed::texts(req.model, inputs))
}

/// `/api/embeddings` as `routing_key` reads it: as `embeddings` does (an empty prompt embeds
/// nothing).
pub(crate) fn embeddings_keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: EmbedRequest = parse_json(body)?;
    let prompt = req.prompt.filter(|p| !p.is_empty());
    Ok(Keyed::texts(req.model, prompt.into_iter().collect()))
}

/// `POST /api/embed`: `input` a string or a list; normalized `embeddings`.
pub async fn embed(State(state): State<AppState>, body: Bytes) -> Result<Response, OllamaError> {
    let started = Instant::now();
    let info = model_info(&state)?;
    let req: EmbedRequest = parse_json(&body)?;
    let model = required_model(&state, req.model.as_deref())?;
    let inputs = embed_inputs(req.input)?;
    check_dimensions(&info, req.dimensions)?;
    let embeddings = embed_all(&state, inputs, req.truncate.unwrap_or(true)).await?;
    let count: usize = embeddings.iter().map(|e| e.prompt_eval_count).sum();
    let vectors: Vec<Vec<f32>> = embeddings
        .into_iter()
        .map(|e| l2_normalize(e.vector))
        .collect();
    Ok(Json(Embed {
        model: &model,
        embeddings: vectors,
        total_duration: nanos(started.elapsed()),
        load_duration: 0,
        prompt_eval_count: count,
    })
    .into_response())
}

/// `POST /api/embeddings` (Ollama's older endpoint): `prompt` -> `embedding`, not normalized.
pub async fn embeddings(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, OllamaError> {
    model_info(&state)?;
    let req: EmbedRequest = parse_json(&body)?;
    required_model(&state, req.model.as_deref())?;
    let prompt = req.prompt.unwrap_or_default();
    if prompt.is_empty() {
        return Ok(Json(Embedding {
            embedding: Vec::new(),
        })
        .into_response());
    }
    let mut embeddings = embed_all(&state, vec![prompt], true).await?;
    let vector = embeddings.pop().map(|e| e.vector).unwrap_or_default();
    Ok(Json(Embedding { embedding: vector }).into_response())
}

/// The request's `model`, which must name the served one.
fn required_model(state: &AppState, model: Option<&str>) -> Result<String, ApiError> {
    match model {
        None | Some("") => Err(ApiError::field("model", " is required")),
        Some(m) => {
            check_model(state, Some(m))?;
            Ok(m.to_string())
        }
    }
}
