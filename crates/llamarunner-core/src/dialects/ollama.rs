//! The Ollama dialect (`/api`): generate and chat as NDJSON streams (or one object with
//! `"stream": false`), embeddings, and the model listing endpoints, with errors as
//! `{"error": "..."}`. One model is served; it is always loaded, so `keep_alive` is accepted and
//! has nothing to do.

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use super::openai::MAX_TOP_LOGPROBS;
use crate::chat::tools::ToolCall;
use crate::chat::ChatMessage;
use crate::http::error::{ApiError, OllamaError};
use crate::http::state::AppState;
use crate::protocol::nanos;
use crate::protocol::params::SamplingParams;
use crate::protocol::{Completion, Event, ModelInfo, TokenLogprob};
use crate::requests::common::{
    chat_prompt, check_dimensions, check_model, collect, embed_all, l2_normalize, model_info,
    model_matches, parse_json, parse_messages, rfc3339, start_generation,
};
use crate::requests::format::grammar_for_format;
use crate::requests::image_prompt::{self, Prompt};
use crate::requests::keyed::{Keyed, Piece};
use crate::requests::options::Options;
use crate::requests::tool_calls::{self, ChatOutput, OutPiece, ToolRequest};

/// The Ollama API version this dialect follows (what `/api/version` answers).
pub const OLLAMA_API_VERSION: &str = "0.12.0";

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

/// `logprobs` of a line: each token's entry (`openai::chat_logprob`'s shape, which Ollama's
/// API shares).
fn logprob_entries(entries: &[TokenLogprob]) -> Value {
    let entries: Vec<_> = entries.iter().map(super::openai::chat_logprob).collect();
    // Plain fields: serde_json cannot fail to write them (null if it ever did).
    serde_json::to_value(entries).unwrap_or_default()
}

/// What a streamed line or the final object needs.
struct Meta {
    model: String,
    chat: bool,
    started: Instant,
}

impl Meta {
    fn line(&self, text: &str) -> Value {
        let mut v = json!({"model": self.model, "created_at": rfc3339(SystemTime::now())});
        if self.chat {
            v["message"] = json!({"role": "assistant", "content": text});
        } else {
            v["response"] = json!(text);
        }
        v["done"] = json!(false);
        v
    }

    /// A line of a chat answer read for thinking and calls.
    fn piece_line(&self, piece: OutPiece) -> Value {
        let mut v = self.line("");
        match piece {
            OutPiece::Content(t) => v["message"]["content"] = json!(t),
            OutPiece::Reasoning(t) => v["message"]["thinking"] = json!(t),
            OutPiece::Calls(calls) => v["message"]["tool_calls"] = ollama_calls(&calls),
        }
        v
    }

    fn done(&self, text: &str, c: &Completion) -> Value {
        let mut v = self.line(text);
        v["done"] = json!(true);
        v["done_reason"] = json!(c.done_reason.as_str());
        v["total_duration"] = json!(nanos(self.started.elapsed()));
        v["load_duration"] = json!(0);
        v["prompt_eval_count"] = json!(c.prompt_eval_count);
        v["prompt_eval_duration"] = json!(c.prompt_eval_duration_ns);
        v["eval_count"] = json!(c.eval_count);
        v["eval_duration"] = json!(c.eval_duration_ns);
        v
    }

    /// What Ollama answers to a request with nothing to generate: it "loads" the model.
    fn loaded(&self) -> Value {
        let mut v = self.line("");
        v["done"] = json!(true);
        v["done_reason"] = json!("load");
        v
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

/// Ollama's `tool_calls`: the arguments as an object.
fn ollama_calls(calls: &[ToolCall]) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| json!({"function": {"index": i, "name": c.name, "arguments": c.arguments}}))
        .collect()
}

/// A chat answer, with its thinking (`message.thinking`) and calls (`message.tool_calls`)
/// split out; streamed, each piece is a line, as Ollama streams them.
async fn respond_chat(
    state: AppState,
    prompt: Prompt,
    params: SamplingParams,
    meta: Meta,
    streaming: bool,
    mut output: ChatOutput,
) -> Result<Response, OllamaError> {
    let want_logprobs = params.logprobs.is_some();
    let rx = start_generation(&state, prompt, params).await?;
    if !streaming {
        let all = collect(rx).await?;
        let answer = output.read_all(&all.text);
        let mut v = meta.done(&answer.content, &all.done);
        if want_logprobs {
            v["logprobs"] = logprob_entries(&all.logprobs);
        }
        if !answer.reasoning.is_empty() {
            v["message"]["thinking"] = json!(answer.reasoning);
        }
        if !answer.calls.is_empty() {
            v["message"]["tool_calls"] = ollama_calls(&answer.calls);
        }
        return Ok(Json(v).into_response());
    }
    let meta = Arc::new(meta);
    let lines = rx.flat_map(move |event| {
        let lines: Vec<Value> = match event {
            Event::Started { .. } | Event::Progress(_) => Vec::new(),
            Event::Text { text, logprobs } => {
                let mut lines: Vec<Value> = output
                    .push(&text)
                    .into_iter()
                    .map(|p| meta.piece_line(p))
                    .collect();
                if want_logprobs && !logprobs.is_empty() {
                    // Held-back text still reports its tokens, on a line of its own.
                    if lines.is_empty() {
                        lines.push(meta.line(""));
                    }
                    lines[0]["logprobs"] = logprob_entries(&logprobs);
                }
                lines
            }
            Event::Done(c) => {
                let mut lines: Vec<Value> = output
                    .finish()
                    .into_iter()
                    .map(|p| meta.piece_line(p))
                    .collect();
                lines.push(meta.done("", &c));
                lines
            }
            Event::Error(e) => vec![json!({"error": ApiError::from(e).to_string()})],
        };
        futures_util::stream::iter(lines.into_iter().map(ndjson_line))
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response())
}

async fn respond(
    state: AppState,
    prompt: Prompt,
    params: SamplingParams,
    meta: Meta,
    streaming: bool,
) -> Result<Response, OllamaError> {
    let want_logprobs = params.logprobs.is_some();
    let rx = start_generation(&state, prompt, params).await?;
    if !streaming {
        let all = collect(rx).await?;
        let mut v = meta.done(&all.text, &all.done);
        if want_logprobs {
            v["logprobs"] = logprob_entries(&all.logprobs);
        }
        return Ok(Json(v).into_response());
    }
    let meta = Arc::new(meta);
    let lines = rx.filter_map(move |event| {
        let line = match event {
            Event::Started { .. } | Event::Progress(_) => None,
            Event::Text { text, logprobs } => {
                let mut line = meta.line(&text);
                if want_logprobs {
                    line["logprobs"] = logprob_entries(&logprobs);
                }
                Some(line)
            }
            Event::Done(c) => Some(meta.done("", &c)),
            Event::Error(e) => Some(json!({"error": ApiError::from(e).to_string()})),
        };
        futures_util::future::ready(line.map(ndjson_line))
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response())
}

/// One NDJSON line of a streamed answer (also the router's `/api/pull` lines).
pub(crate) fn ndjson_line(v: Value) -> Result<Bytes, Infallible> {
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
    Ok(Json(json!({
        "model": model,
        "embeddings": vectors,
        "total_duration": nanos(started.elapsed()),
        "load_duration": 0,
        "prompt_eval_count": count,
    }))
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
        return Ok(Json(json!({"embedding": []})).into_response());
    }
    let mut embeddings = embed_all(&state, vec![prompt], true).await?;
    let vector = embeddings.pop().map(|e| e.vector).unwrap_or_default();
    Ok(Json(json!({ "embedding": vector })).into_response())
}

fn required_model(state: &AppState, model: Option<&str>) -> Result<String, ApiError> {
    match model {
        None | Some("") => Err(ApiError::field("model", " is required")),
        Some(m) => {
            check_model(state, Some(m))?;
            Ok(m.to_string())
        }
    }
}

/// "268.10M", "8.0B": Ollama's way of writing a parameter count.
fn parameter_size(n: u64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.1}B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2}M", n / 1e6)
    } else {
        format!("{:.2}K", n / 1e3)
    }
}

fn details(info: &ModelInfo) -> Value {
    json!({
        "parent_model": "",
        "format": "gguf",
        "family": info.architecture,
        "families": [info.architecture],
        "parameter_size": parameter_size(info.n_params),
        "quantization_level": info.quantization,
    })
}

/// An identifier for a model file in Ollama's `sha256:` digest form. It is derived from the
/// path, size and modification time, not the file's contents (hashing gigabytes at every
/// start would be too slow), so it changes when the file does. The router's listings and an
/// engine's give a model the same one.
pub(crate) fn digest(path: &Path, size: u64, modified: SystemTime) -> String {
    use std::hash::{Hash, Hasher};
    let mut words = [0u64; 4];
    for (i, word) in words.iter_mut().enumerate() {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (i, path, size, modified).hash(&mut h);
        *word = h.finish();
    }
    words.iter().map(|w| format!("{w:016x}")).collect()
}

/// How long `/api/ps` says a model stays loaded when nothing unloads it: a far future, as
/// Ollama reports for `keep_alive: -1`.
pub(crate) const KEPT_LOADED: Duration = Duration::from_secs(100 * 365 * 86_400);

/// A model file as Ollama's `/api/tags` and `/api/ps` list it, on an engine and a router alike.
pub(crate) struct Listed<'a> {
    pub name: &'a str,
    pub path: &'a Path,
    pub size: u64,
    pub modified: SystemTime,
    /// `details`: the model's family, size and quantization where known.
    pub details: Value,
}

impl Listed<'_> {
    /// `/api/tags`' entry.
    pub(crate) fn tags_entry(&self) -> Value {
        json!({
            "name": self.name,
            "model": self.name,
            "size": self.size,
            "modified_at": rfc3339(self.modified),
            "digest": digest(self.path, self.size, self.modified),
            "details": self.details,
        })
    }

    /// `/api/ps`' entry: a loaded model's, with its expiry and its bytes in device memory.
    pub(crate) fn ps_entry(&self, expires: SystemTime, size_vram: u64) -> Value {
        let mut entry = self.tags_entry();
        entry["expires_at"] = json!(rfc3339(expires));
        entry["size_vram"] = json!(size_vram);
        entry
    }
}

/// The served model, as listed.
fn listed<'a>(state: &'a AppState, info: &'a ModelInfo) -> Listed<'a> {
    Listed {
        name: state.model_name.as_ref(),
        path: &info.path,
        size: info.file_size,
        modified: info.modified.unwrap_or(SystemTime::UNIX_EPOCH),
        details: details(info),
    }
}

/// `GET /api/tags`: the served model.
pub async fn tags(State(state): State<AppState>) -> Result<Response, OllamaError> {
    let info = model_info(&state)?;
    let entry = listed(&state, &info).tags_entry();
    Ok(Json(json!({ "models": [entry] })).into_response())
}

/// `GET /api/ps`: the served model, always loaded.
pub async fn ps(State(state): State<AppState>) -> Result<Response, OllamaError> {
    let info = model_info(&state)?;
    // Loaded until the server stops.
    let expires = SystemTime::now() + KEPT_LOADED;
    let mut entry = listed(&state, &info).ps_entry(expires, info.devices.vram_bytes);
    entry["context_length"] = json!(info.slot_ctx);
    Ok(Json(json!({ "models": [entry] })).into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ShowRequest {
    model: Option<String>,
    name: Option<String>,
}

/// A GGUF metadata value as JSON: numbers as numbers, the rest as text.
fn metadata_value(text: &str) -> Value {
    if let Ok(i) = text.parse::<i64>() {
        return json!(i);
    }
    if let Ok(f) = text.parse::<f64>() {
        if f.is_finite() {
            return json!(f);
        }
    }
    match text {
        "true" => json!(true),
        "false" => json!(false),
        _ => json!(text),
    }
}

#[derive(Deserialize)]
struct PullRequest {
    model: Option<String>,
    name: Option<String>,
    stream: Option<bool>,
    #[allow(dead_code)]
    insecure: Option<bool>,
}

/// `POST /api/pull` on a server of one model: its own model is there already (`success`, as
/// Ollama answers for a model it holds); another is a 404 that says how to get it. A router
/// with `--allow-pull` pulls (`router/pull.rs`).
pub async fn pull(State(state): State<AppState>, body: Bytes) -> Result<Response, OllamaError> {
    let req: PullRequest = parse_json(&body)?;
    let name = req.model.as_deref().or(req.name.as_deref());
    match name {
        None | Some("") => return Err(ApiError::field("model", " is required").into()),
        Some(m) if !model_matches(&state, m) => {
            return Err(ApiError::ModelNotFound(format!(
                "model '{}' is not served here (this server serves '{}' only); fetch it with \
                 `llamarunner pull NAME`, or serve many models with --allow-pull",
                m.chars().take(200).collect::<String>(),
                state.model_name
            ))
            .into())
        }
        Some(_) => {}
    }
    let success = json!({"status": "success"});
    if req.stream.unwrap_or(true) {
        let Ok(line) = ndjson_line(success);
        return Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], line).into_response());
    }
    Ok(Json(success).into_response())
}

/// `POST /api/show`: details, metadata and the chat template of the served model.
pub async fn show(State(state): State<AppState>, body: Bytes) -> Result<Response, OllamaError> {
    let info = model_info(&state)?;
    let req: ShowRequest = parse_json(&body)?;
    required_model(&state, req.model.as_deref().or(req.name.as_deref()))?;
    let mut model_info: serde_json::Map<String, Value> = info
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), metadata_value(v)))
        .collect();
    model_info.insert("general.parameter_count".into(), json!(info.n_params));
    Ok(Json(json!({
        // The file name only: an absolute path tells a client about the server's file system.
        "modelfile": format!(
            "# served by llamarunner\nFROM {}\n",
            info.path
                .file_name()
                .map_or_else(|| state.model_name.to_string(), |f| f.to_string_lossy().into_owned())
        ),
        "parameters": "",
        "template": info.template.source,
        "details": details(&info),
        "model_info": model_info,
        "capabilities": ["completion"],
        "modified_at": rfc3339(info.modified.unwrap_or(SystemTime::UNIX_EPOCH)),
    }))
    .into_response())
}

/// `GET /api/version`.
pub async fn version() -> Response {
    Json(json!({"version": OLLAMA_API_VERSION})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_sizes_read_like_ollama() {
        assert_eq!(parameter_size(268_098_176), "268.10M");
        assert_eq!(parameter_size(8_030_261_248), "8.0B");
    }

    #[test]
    fn metadata_values_keep_their_type() {
        assert_eq!(metadata_value("32768"), json!(32768));
        assert_eq!(metadata_value("1e-06"), json!(1e-6));
        assert_eq!(metadata_value("gemma3"), json!("gemma3"));
    }
}
