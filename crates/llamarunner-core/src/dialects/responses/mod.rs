//! OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`): the
//! input items read into the chat path every dialect shares (template, function tools,
//! reasoning, schemas), the answer written back as output items (`reasoning`, `message`,
//! `function_call`), whole or as the `response.*` event stream. `previous_response_id` continues
//! a conversation kept in a bounded in-memory store (`response_store.rs`); `store: false` keeps
//! nothing. What the API has and a local runner cannot honour (built-in tools, files,
//! conversations, background mode) is refused with a 400 naming it.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderName, HeaderValue};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::http::error::{ApiError, OpenAiError};
use crate::http::response_store::{ResponseStore, Stored};
use crate::http::state::AppState;
use crate::protocol::params::SamplingParams;
use crate::protocol::{Completion, DoneReason, Event};
use crate::requests::common::{
    collect, count_prompt_tokens, model_info, parse_json, parse_messages, start_generation,
    unix_seconds,
};
use crate::requests::image_prompt::{self, Prompt};
use crate::requests::keyed::{Keyed, Piece};
use crate::requests::tool_calls::{self, ChatOutput, OutPiece, ToolRequest};
use crate::requests::validate;

/// Body of `POST /v1/responses`. Unknown fields are ignored, as OpenAI-compatible servers do.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ResponsesRequest {
    model: Option<String>,
    input: Option<Value>,
    instructions: Option<String>,
    previous_response_id: Option<String>,
    store: Option<bool>,
    stream: Option<bool>,
    max_output_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    text: Option<Value>,
    reasoning: Option<Value>,
    truncation: Option<String>,
    metadata: Option<Value>,
    background: Option<bool>,
    conversation: Option<Value>,
    top_logprobs: Option<u32>,
    // llama.cpp-style extras, as the chat endpoint takes them.
    top_k: Option<i32>,
    min_p: Option<f32>,
    seed: Option<i64>,
    repeat_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    lora: Option<Value>,
    cache_prompt: Option<bool>,
    /// llama-server's `return_progress`: a streamed answer reports the prompt's decode.
    return_progress: Option<bool>,
    /// DRY, XTC, top-n-sigma, dynamic temperature (llama-server's fields).
    #[serde(flatten)]
    samplers: crate::requests::options::SamplerFields,
}

impl ResponsesRequest {
    fn params(&self) -> Result<SamplingParams, ApiError> {
        if self.background == Some(true) {
            return Err(ApiError::invalid(
                "background: background responses are not supported",
            ));
        }
        if self.conversation.as_ref().is_some_and(|c| !c.is_null()) {
            return Err(ApiError::invalid(
                "conversation: conversations are not supported; continue one with \
                 previous_response_id",
            ));
        }
        if self.top_logprobs.is_some_and(|n| n > 0) {
            return Err(ApiError::invalid(
                "top_logprobs: not supported on /v1/responses",
            ));
        }
        if self.max_output_tokens.is_some_and(|m| m < 1) {
            return Err(ApiError::invalid("max_output_tokens must be at least 1"));
        }
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(ApiError::invalid(format!(
                    "temperature must be between 0 and 2, got {t}"
                )));
            }
        }
        let truncate = match self.truncation.as_deref() {
            None | Some("disabled") => false,
            Some("auto") => true,
            Some(other) => {
                return Err(ApiError::invalid(format!(
                    "truncation must be \"auto\" or \"disabled\", got {other:?}"
                )))
            }
        };
        let defaults = SamplingParams::default();
        let mut p = SamplingParams {
            num_predict: self.max_output_tokens.unwrap_or(-1),
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(defaults.top_k),
            min_p: self.min_p.unwrap_or(0.0),
            repeat_penalty: self.repeat_penalty.unwrap_or(1.0),
            seed: self.seed.unwrap_or(-1),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            cache_prompt: self.cache_prompt.unwrap_or(true),
            // Reports only a stream can carry.
            return_progress: self.return_progress == Some(true) && self.stream == Some(true),
            samplers: self.samplers.samplers(),
            ..defaults
        };
        validate::check_options(&p).map_err(|e| ApiError::invalid(e.top_level(&[])))?;
        p.truncate = truncate;
        p.grammar = self.format_grammar()?;
        Ok(p)
    }

    /// `text.format`: `text`, `json_object`, or `json_schema` with its `schema`.
    fn format_grammar(&self) -> Result<Option<crate::constrain::Grammar>, ApiError> {
        let Some(format) = self
            .text
            .as_ref()
            .filter(|t| !t.is_null())
            .and_then(|t| t.get("format"))
            .filter(|f| !f.is_null())
        else {
            return Ok(None);
        };
        crate::requests::format::response_format(format, "text.format").map_err(ApiError::invalid)
    }

    /// `reasoning`: `{"effort": "none"}` asks the template not to think, any other effort to
    /// think; absent, the template's default.
    fn think(&self) -> Result<Option<bool>, ApiError> {
        let Some(r) = self.reasoning.as_ref().filter(|r| !r.is_null()) else {
            return Ok(None);
        };
        if !r.is_object() {
            return Err(ApiError::invalid("reasoning must be an object"));
        }
        match r.get("effort") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(e)) if e == "none" => Ok(Some(false)),
            Some(Value::String(e))
                if ["minimal", "low", "medium", "high", "xhigh"].contains(&e.as_str()) =>
            {
                Ok(Some(true))
            }
            Some(_) => Err(ApiError::invalid(
                "reasoning.effort must be none, minimal, low, medium, high or xhigh",
            )),
        }
    }
}

/// `input` as chat messages: a string is one user message; items are messages (`developer`
/// reads as `system`), `function_call`s (the assistant's calls) and `function_call_output`s
/// (`tool` messages); `reasoning` items are dropped (the template gets the answer, not the
/// thinking, as OpenAI's models do).
#[cfg(test)]
fn input_messages(input: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    input_messages_after(Vec::new(), input)
}

/// `input_messages` appended to `out` (the conversation a previous response ended): a call
/// the client sends again right after the turn that made it is not repeated.
fn input_messages_after(
    mut out: Vec<Value>,
    input: Option<&Value>,
) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        Some(Value::String(s)) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(out);
        }
        Some(Value::Array(items)) => items,
        None | Some(Value::Null) => return Ok(out),
        Some(_) => {
            return Err(ApiError::invalid(
                "input must be a string or an array of input items",
            ))
        }
    };
    out.reserve(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let kind = item.get("type").and_then(Value::as_str);
        match kind {
            None | Some("message") => out.push(message(&at, item)?),
            Some("function_call") => {
                let field = |name: &str| {
                    item.get(name).and_then(Value::as_str).ok_or_else(|| {
                        ApiError::invalid(format!("{at}.{name} is required and must be a string"))
                    })
                };
                let call = json!({
                    "id": field("call_id")?,
                    "type": "function",
                    "function": {"name": field("name")?, "arguments": field("arguments")?},
                });
                // Calls in a row (and a call right after the assistant's text) are one turn.
                match out.last_mut() {
                    Some(last) if last["role"] == "assistant" => {
                        match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                            // A call sent again (a client that re-sends the previous output
                            // with previous_response_id) is that call, once.
                            Some(calls) if calls.iter().any(|c| c["id"] == call["id"]) => {}
                            Some(calls) => calls.push(call),
                            None => last["tool_calls"] = json!([call]),
                        }
                    }
                    _ => {
                        out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]}))
                    }
                }
            }
            Some("function_call_output") => {
                let id = item.get("call_id").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::invalid(format!("{at}.call_id is required and must be a string"))
                })?;
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => parts_text(&format!("{at}.output"), parts)?,
                    _ => {
                        return Err(ApiError::invalid(format!(
                            "{at}.output must be a string or an array of input_text parts"
                        )))
                    }
                };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
            }
            Some("reasoning") => {}
            Some(other) => {
                return Err(ApiError::invalid(format!(
                    "{at}.type: {other:?} items are not supported (message, function_call, \
                     function_call_output and reasoning are)"
                )))
            }
        }
    }
    Ok(out)
}

/// The text of `input_text` / `output_text` parts.
fn parts_text(at: &str, parts: &[Value]) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, p) in parts.iter().enumerate() {
        match (p.get("type").and_then(Value::as_str), p.get("text")) {
            (Some("input_text" | "output_text" | "text"), Some(Value::String(t))) => {
                text.push_str(t)
            }
            _ => {
                return Err(ApiError::invalid(format!(
                    "{at}[{j}]: only input_text parts are supported here"
                )))
            }
        }
    }
    Ok(text)
}

/// One message item: its role, and its content as a string or chat parts.
fn message(at: &str, item: &Value) -> Result<Value, ApiError> {
    let role = match item.get("role").and_then(Value::as_str) {
        Some("developer" | "system") => "system",
        Some("user") => "user",
        Some("assistant") => "assistant",
        _ => {
            return Err(ApiError::invalid(format!(
                "{at}.role must be user, assistant, system or developer"
            )))
        }
    };
    let content = match item.get("content") {
        Some(Value::String(s)) => json!(s),
        Some(Value::Array(parts)) => {
            let mut out = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let at = format!("{at}.content[{j}]");
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text") => match p.get("text") {
                        Some(Value::String(t)) => out.push(json!({"type": "text", "text": t})),
                        _ => {
                            return Err(ApiError::invalid(format!(
                                "{at}.text is required and must be a string"
                            )))
                        }
                    },
                    Some("refusal") => {
                        let t = p.get("refusal").and_then(Value::as_str).unwrap_or("");
                        out.push(json!({"type": "text", "text": t}));
                    }
                    Some("input_image") => match p.get("image_url") {
                        Some(Value::String(url)) => {
                            out.push(json!({"type": "image_url", "image_url": {"url": url}}))
                        }
                        _ => {
                            return Err(ApiError::InvalidImage(format!(
                                "{at}: give an input_image as image_url (a data: URL); file ids \
                                 are not supported"
                            )))
                        }
                    },
                    other => {
                        return Err(ApiError::invalid(format!(
                            "{at}.type: {} parts are not supported (input_text, output_text, \
                             refusal and input_image are)",
                            other.map_or_else(|| "untyped".to_string(), |k| format!("{k:?}"))
                        )))
                    }
                }
            }
            Value::Array(out)
        }
        _ => {
            return Err(ApiError::invalid(format!(
                "{at}.content must be a string or an array of parts"
            )))
        }
    };
    Ok(json!({"role": role, "content": content}))
}

/// Function tools (`{"type": "function", "name", "description", "parameters"}`) and
/// `tool_choice` in the chat path's shape; built-in tools are refused.
fn tool_request(req: &ResponsesRequest) -> Result<Option<ToolRequest>, ApiError> {
    let tools = req
        .tools
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, t)| {
            let kind = t.get("type").and_then(Value::as_str);
            if kind != Some("function") {
                return Err(ApiError::invalid(format!(
                    "tools[{i}].type: only function tools are supported, got {}",
                    kind.map_or_else(|| "none".to_string(), |k| format!("{k:?}"))
                )));
            }
            let mut function = json!({"name": t.get("name").cloned().unwrap_or(Value::Null)});
            for key in ["description", "parameters"] {
                if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
                    function[key] = v.clone();
                }
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let choice = match req.tool_choice.as_ref().filter(|c| !c.is_null()) {
        None => None,
        Some(Value::String(s)) => Some(json!(s)),
        Some(c) if c.get("type").and_then(Value::as_str) == Some("function") => Some(
            json!({"type": "function", "function": {"name": c.get("name").cloned().unwrap_or(Value::Null)}}),
        ),
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \
                 \"function\", \"name\": ...}",
            ))
        }
    };
    ToolRequest::parse(Some(&tools), choice.as_ref(), req.parallel_tool_calls)
}

/// `metadata` as OpenAI bounds it: an object of at most 16 string values of at most 512
/// characters, under keys of at most 64 (it is echoed in the response and kept with it).
fn check_metadata(metadata: Option<&Value>) -> Result<(), ApiError> {
    let Some(metadata) = metadata.filter(|m| !m.is_null()) else {
        return Ok(());
    };
    let Value::Object(map) = metadata else {
        return Err(ApiError::invalid("metadata must be an object of strings"));
    };
    if map.len() > 16 {
        return Err(ApiError::invalid(format!(
            "metadata has {} keys; at most 16",
            map.len()
        )));
    }
    for (key, value) in map {
        if key.chars().count() > 64 {
            return Err(ApiError::invalid(
                "metadata: a key is longer than 64 characters",
            ));
        }
        match value {
            Value::String(v) if v.chars().count() <= 512 => {}
            Value::String(_) => {
                return Err(ApiError::invalid(format!(
                    "metadata[{key:?}] is longer than 512 characters"
                )))
            }
            _ => {
                return Err(ApiError::invalid(format!(
                    "metadata[{key:?}] must be a string"
                )))
            }
        }
    }
    Ok(())
}

/// The answer header of `POST /v1/responses` that names the response it stored (absent when
/// the request asked it not be stored): a router of many servers learns there which one a
/// follow-up's `previous_response_id` must reach (`routing_key.rs`).
pub const RESPONSE_ID_HEADER: &str = "x-llamarunner-response-id";

/// What a Responses request generates from: the prompt (the previous response's conversation,
/// then this input, rendered with its tools), its parameters, the reader of its answer and
/// the conversation to keep with it.
struct Prepared {
    prompt: Prompt,
    params: SamplingParams,
    output: ChatOutput,
    history: Vec<Value>,
}

async fn prepare(state: &AppState, req: &ResponsesRequest) -> Result<Prepared, ApiError> {
    check_metadata(req.metadata.as_ref())?;
    let mut params = req.params()?;
    params.lora = state.lora.for_request(req.lora.as_ref())?;
    // The conversation: the previous response's, then this input.
    let history = match req.previous_response_id.as_deref() {
        None | Some("") => Vec::new(),
        Some(id) => {
            state
                .responses
                .get(id)
                .ok_or_else(|| {
                    ApiError::NotFound(format!("Previous response with id {id:?} not found."))
                })?
                .messages
        }
    };
    let history = input_messages_after(history, req.input.as_ref())?;
    if history.is_empty() {
        return Err(ApiError::invalid("input is required"));
    }
    let chat = parse_messages(with_instructions(req, &history))?;
    image_prompt::check_images(&*model_info(state)?, chat.images.len())?;
    let tools = tool_request(req)?;
    let (text, output) = tool_calls::chat_request(
        state,
        chat.messages,
        tools,
        &mut params,
        req.think()?.into(),
    )
    .await?;
    let prompt = Prompt {
        text,
        images: chat.images,
    };
    Ok(Prepared {
        prompt,
        params,
        output,
        history,
    })
}

/// `POST /v1/responses/input_tokens` (OpenAI's and llama-server's): the tokens the request's
/// prompt would have, `{"object": "response.input_tokens", "input_tokens": N}`.
pub async fn input_tokens(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    model_info(&state)?;
    let req: ResponsesRequest = parse_json(&body)?;
    let prepared = prepare(&state, &req).await?;
    let n = count_prompt_tokens(&state, prepared.prompt).await?;
    Ok(Json(json!({"object": "response.input_tokens", "input_tokens": n})).into_response())
}

/// `POST /v1/responses`.
pub async fn create(State(state): State<AppState>, body: Bytes) -> Result<Response, OpenAiError> {
    model_info(&state)?;
    let req: ResponsesRequest = parse_json(&body)?;
    let Prepared {
        prompt,
        params,
        output,
        history,
    } = prepare(&state, &req).await?;
    let meta = Arc::new(Meta::new(&state, &req, &params));
    let rx = start_generation(&state, prompt, params).await?;
    let keep = req.store != Some(false);
    let store = keep.then(|| (state.responses.clone(), history));
    if req.stream != Some(true) {
        let all = collect(rx).await?;
        let answer = output.read_all(&all.text);
        let mut pieces = Vec::new();
        if !answer.reasoning.is_empty() {
            pieces.push(OutPiece::Reasoning(answer.reasoning));
        }
        if !answer.content.is_empty() {
            pieces.push(OutPiece::Content(answer.content));
        }
        if !answer.calls.is_empty() {
            pieces.push(OutPiece::Calls(answer.calls));
        }
        let status = item_status(&all.done);
        let items: Vec<Value> = pieces
            .into_iter()
            .flat_map(|p| whole_items(p, status))
            .collect();
        let response = meta.object(&Finished::from(&all.done), &items);
        if let Some((store, history)) = store {
            keep_response(&store, &meta.id, history, &items, &response);
        }
        return Ok(named(Json(response).into_response(), &meta.id, keep));
    }
    let mut writer = Items::new(meta.clone(), output, store);
    let created = meta.object(&Finished::InProgress, &[]);
    let head = [
        writer.event("response.created", json!({"response": created.clone()})),
        writer.event("response.in_progress", json!({"response": created})),
    ];
    let events = rx.flat_map(move |e| stream::iter(writer.on(e)));
    let body = stream::iter(head).chain(events).map(Ok::<_, Infallible>);
    Ok(named(Sse::new(body).into_response(), &meta.id, keep))
}

/// The conversation the template is given: `instructions` as a system message, then the
/// conversation (the stored one continued, then the input).
fn with_instructions(req: &ResponsesRequest, history: &[Value]) -> Vec<Value> {
    let mut messages = Vec::with_capacity(history.len() + 1);
    if let Some(instructions) = req.instructions.as_deref().filter(|s| !s.is_empty()) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    messages.extend(history.iter().cloned());
    messages
}

/// An answer that stores its response names it in `RESPONSE_ID_HEADER`, so that a router of
/// many servers learns which one holds it (a follow-up's `previous_response_id` must go there;
/// `dialects/routing_key.rs`).
fn named(mut response: Response, id: &str, stored: bool) -> Response {
    if let (true, Ok(value)) = (stored, HeaderValue::from_str(id)) {
        response
            .headers_mut()
            .insert(HeaderName::from_static(RESPONSE_ID_HEADER), value);
    }
    response
}

/// `/v1/responses` as `routing_key` reads it: as `create` does, without the stored
/// conversation a `previous_response_id` continues (one server holds it: the id is kept apart
/// for the router).
pub(crate) fn keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: ResponsesRequest = parse_json(body)?;
    let history = input_messages_after(Vec::new(), req.input.as_ref())?;
    let messages = with_instructions(&req, &history);
    let pieces = if messages.is_empty() {
        Vec::new()
    } else {
        parse_messages(messages)?
            .messages
            .into_iter()
            .map(Piece::Message)
            .collect()
    };
    Ok(Keyed {
        model: req.model,
        previous_response_id: req.previous_response_id,
        pieces,
    })
}

/// `GET /v1/responses/{id}`: a kept response.
pub async fn retrieve(
    State(state): State<AppState>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Response, OpenAiError> {
    let Path(id) = id.map_err(|e| ApiError::invalid(format!("response id: {e}")))?;
    let stored = state
        .responses
        .get(&id)
        .ok_or_else(|| ApiError::NotFound(format!("Response with id {id:?} not found.")))?;
    Ok(Json(stored.response).into_response())
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(
    State(state): State<AppState>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Response, OpenAiError> {
    let Path(id) = id.map_err(|e| ApiError::invalid(format!("response id: {e}")))?;
    if !state.responses.remove(&id) {
        return Err(ApiError::NotFound(format!("Response with id {id:?} not found.")).into());
    }
    Ok(Json(json!({"id": id, "object": "response", "deleted": true})).into_response())
}

/// Keeps a response with its conversation: the history it continued, then its output as the
/// assistant's turn.
fn keep_response(
    store: &ResponseStore,
    id: &str,
    mut messages: Vec<Value>,
    items: &[Value],
    response: &Value,
) {
    let mut text = String::new();
    let mut calls = Vec::new();
    for item in items {
        match item["type"].as_str() {
            Some("message") => {
                if let Some(t) = item["content"][0]["text"].as_str() {
                    text.push_str(t);
                }
            }
            Some("function_call") => calls.push(json!({
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            })),
            _ => {}
        }
    }
    let mut turn = json!({"role": "assistant", "content": text});
    if !calls.is_empty() {
        turn["tool_calls"] = Value::Array(calls);
    }
    messages.push(turn);
    store.put(
        id.to_string(),
        Stored {
            messages,
            response: response.clone(),
        },
    );
}

/// How a response ended, for its `status`.
enum Finished {
    InProgress,
    Done(Completion),
    Failed(ApiError),
}

impl From<&Completion> for Finished {
    fn from(done: &Completion) -> Self {
        Finished::Done(done.clone())
    }
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// What every event of one response repeats: the request's settings, echoed.
struct Meta {
    id: String,
    created_at: u64,
    model: String,
    echo: Value,
}

impl Meta {
    fn new(state: &AppState, req: &ResponsesRequest, params: &SamplingParams) -> Self {
        // The request's own tools, choice, format and reasoning, echoed as given (read once,
        // with the request).
        let echo = json!({
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
            "previous_response_id": req.previous_response_id,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "tool_choice": req.tool_choice.clone().filter(|v| !v.is_null()).unwrap_or(json!("auto")),
            "tools": req.tools.clone().unwrap_or_default(),
            "text": req.text.clone().filter(Value::is_object).unwrap_or(json!({"format": {"type": "text"}})),
            "reasoning": req.reasoning.clone().filter(Value::is_object).unwrap_or(json!({"effort": null, "summary": null})),
            "store": req.store != Some(false),
            "truncation": req.truncation.as_deref().unwrap_or("disabled"),
            "metadata": req.metadata.clone().filter(Value::is_object).unwrap_or(json!({})),
        });
        Self {
            id: new_id("resp"),
            created_at: unix_seconds(SystemTime::now()),
            model: state.model_name.to_string(),
            echo,
        }
    }

    /// The response object with this status and output.
    fn object(&self, finished: &Finished, output: &[Value]) -> Value {
        let mut r = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "output": output,
            "error": null,
            "incomplete_details": null,
            "usage": null,
        });
        let (status, usage) = match finished {
            Finished::InProgress => ("in_progress", None),
            Finished::Failed(e) => {
                r["error"] = json!({"code": response_error_code(e), "message": e.to_string()});
                ("failed", None)
            }
            Finished::Done(done) => {
                let status = match done.done_reason {
                    DoneReason::Length | DoneReason::Timeout => {
                        r["incomplete_details"] = json!({"reason": "max_output_tokens"});
                        "incomplete"
                    }
                    DoneReason::Stop => "completed",
                };
                (status, Some(usage(done)))
            }
        };
        r["status"] = json!(status);
        if let Some(u) = usage {
            r["usage"] = u;
        }
        if let (Value::Object(r), Value::Object(echo)) = (&mut r, &self.echo) {
            for (k, v) in echo {
                r.insert(k.clone(), v.clone());
            }
        }
        r
    }
}

/// A failed response's `error.code`, among those OpenAI's `ResponseError` names.
fn response_error_code(e: &ApiError) -> &'static str {
    match e {
        ApiError::InvalidImage(_) | ApiError::ImagesNotSupported(_) => "invalid_image",
        ApiError::Overloaded(_) => "rate_limit_exceeded",
        _ => "server_error",
    }
}

fn usage(done: &Completion) -> Value {
    json!({
        "input_tokens": done.prompt_eval_count,
        "input_tokens_details": {"cached_tokens": done.prompt_cached_count, "cache_write_tokens": 0},
        "output_tokens": done.eval_count,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": done.prompt_eval_count + done.eval_count,
    })
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "message",
        "id": id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    })
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({
        "type": "reasoning",
        "id": id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    })
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({
        "type": "function_call",
        "id": id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    })
}

/// The output items of a piece of a whole answer.
/// An answer's last message item's status: `incomplete` when the answer was cut.
fn item_status(done: &Completion) -> &'static str {
    match done.done_reason {
        DoneReason::Stop => "completed",
        DoneReason::Length | DoneReason::Timeout => "incomplete",
    }
}

/// The output items of a piece of a whole answer; a message cut by the token limit is
/// `incomplete` (`status`).
fn whole_items(piece: OutPiece, status: &str) -> Vec<Value> {
    match piece {
        OutPiece::Reasoning(t) => vec![reasoning_item(&new_id("rs"), &t)],
        OutPiece::Content(t) => vec![message_item(&new_id("msg"), &t, status)],
        OutPiece::Calls(calls) => calls
            .into_iter()
            .map(|c| {
                call_item(
                    &new_id("fc"),
                    &tool_calls::call_id(),
                    &c.name,
                    &c.arguments.to_string(),
                    "completed",
                )
            })
            .collect(),
    }
}

/// The item being streamed.
enum Open {
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
}

/// Writes a streamed answer as output items, each added, filled by deltas and done, with the
/// events' `sequence_number`s; at the end, the whole response (kept unless `store: false`).
struct Items {
    meta: Arc<Meta>,
    output: ChatOutput,
    open: Option<Open>,
    done: Vec<Value>,
    sequence: u64,
    store: Option<(Arc<ResponseStore>, Vec<Value>)>,
}

impl Items {
    fn new(
        meta: Arc<Meta>,
        output: ChatOutput,
        store: Option<(Arc<ResponseStore>, Vec<Value>)>,
    ) -> Self {
        Self {
            meta,
            output,
            open: None,
            done: Vec::new(),
            sequence: 0,
            store,
        }
    }

    fn event(&mut self, kind: &str, mut data: Value) -> SseEvent {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        SseEvent::default()
            .event(kind)
            .data(super::stream_json::to_line(&data))
    }

    fn on(&mut self, e: Event) -> Vec<SseEvent> {
        let mut out = Vec::new();
        match e {
            Event::Started => {}
            // llama-server's `return_progress`: another `response.in_progress` that says how
            // far the prompt's decode is.
            Event::Progress(p) => {
                let response = self.meta.object(&Finished::InProgress, &[]);
                let data = json!({
                    "response": response,
                    "prompt_progress": super::openai::prompt_progress(&p),
                });
                out.push(self.event("response.in_progress", data));
            }
            Event::Text { text, .. } => {
                for piece in self.output.push(&text) {
                    self.piece(piece, &mut out);
                }
            }
            Event::Done(done) => {
                for piece in self.output.finish() {
                    self.piece(piece, &mut out);
                }
                self.close_as(&mut out, item_status(&done));
                let finished = Finished::from(&done);
                let response = self.meta.object(&finished, &self.done);
                if let Some((store, history)) = self.store.take() {
                    keep_response(&store, &self.meta.id, history, &self.done, &response);
                }
                let kind = if response["status"] == "completed" {
                    "response.completed"
                } else {
                    "response.incomplete"
                };
                out.push(self.event(kind, json!({"response": response})));
            }
            Event::Error(e) => {
                self.close(&mut out);
                let e = ApiError::from(e);
                out.push(self.event(
                    "error",
                    json!({"code": response_error_code(&e), "message": e.to_string(), "param": null}),
                ));
                let response = self.meta.object(&Finished::Failed(e), &self.done);
                out.push(self.event("response.failed", json!({"response": response})));
            }
        }
        out
    }

    fn index(&self) -> usize {
        self.done.len()
    }

    fn piece(&mut self, piece: OutPiece, out: &mut Vec<SseEvent>) {
        match piece {
            OutPiece::Reasoning(t) => {
                if !matches!(self.open, Some(Open::Reasoning { .. })) {
                    self.close(out);
                    let id = new_id("rs");
                    let item = json!({"type": "reasoning", "id": id, "summary": [], "content": []});
                    let index = self.index();
                    out.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": index, "item": item}),
                    ));
                    self.open = Some(Open::Reasoning {
                        id,
                        text: String::new(),
                    });
                }
                let index = self.index();
                if let Some(Open::Reasoning { id, text }) = &mut self.open {
                    text.push_str(&t);
                    let id = id.clone();
                    out.push(self.event(
                        "response.reasoning_text.delta",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t}),
                    ));
                }
            }
            OutPiece::Content(t) if t.is_empty() => {}
            OutPiece::Content(t) => {
                if !matches!(self.open, Some(Open::Message { .. })) {
                    self.close(out);
                    let id = new_id("msg");
                    let index = self.index();
                    let item = json!({"type": "message", "id": id, "status": "in_progress",
                                      "role": "assistant", "content": []});
                    out.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": index, "item": item}),
                    ));
                    out.push(self.event(
                        "response.content_part.added",
                        json!({"item_id": id, "output_index": index, "content_index": 0,
                               "part": {"type": "output_text", "text": "", "annotations": []}}),
                    ));
                    self.open = Some(Open::Message {
                        id,
                        text: String::new(),
                    });
                }
                let index = self.index();
                if let Some(Open::Message { id, text }) = &mut self.open {
                    text.push_str(&t);
                    let id = id.clone();
                    out.push(self.event(
                        "response.output_text.delta",
                        json!({"item_id": id, "output_index": index, "content_index": 0,
                               "delta": t, "logprobs": []}),
                    ));
                }
            }
            OutPiece::Calls(calls) => {
                self.close(out);
                for c in calls {
                    let index = self.index();
                    let (id, call_id) = (new_id("fc"), tool_calls::call_id());
                    let arguments = c.arguments.to_string();
                    out.push(self.event(
                        "response.output_item.added",
                        json!({"output_index": index,
                               "item": call_item(&id, &call_id, &c.name, "", "in_progress")}),
                    ));
                    out.push(self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": index, "delta": arguments}),
                    ));
                    out.push(self.event(
                        "response.function_call_arguments.done",
                        json!({"item_id": id, "output_index": index, "name": c.name,
                               "arguments": arguments}),
                    ));
                    let item = call_item(&id, &call_id, &c.name, &arguments, "completed");
                    out.push(self.event(
                        "response.output_item.done",
                        json!({"output_index": index, "item": item.clone()}),
                    ));
                    self.done.push(item);
                }
            }
        }
    }

    fn close(&mut self, out: &mut Vec<SseEvent>) {
        self.close_as(out, "completed");
    }

    /// Closes the open item; a message gets `status`.
    fn close_as(&mut self, out: &mut Vec<SseEvent>, status: &str) {
        let index = self.index();
        let item = match self.open.take() {
            None => return,
            Some(Open::Reasoning { id, text }) => {
                out.push(self.event(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                ));
                reasoning_item(&id, &text)
            }
            Some(Open::Message { id, text }) => {
                out.push(self.event(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "text": text, "logprobs": []}),
                ));
                out.push(self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "part": {"type": "output_text", "text": text, "annotations": []}}),
                ));
                message_item(&id, &text, status)
            }
        };
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item.clone()}),
        ));
        self.done.push(item);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn metadata_is_bounded_as_openai_bounds_it() {
        use super::check_metadata;
        let ok = |v: Value| check_metadata(Some(&v)).is_ok();
        assert!(check_metadata(None).is_ok());
        assert!(ok(json!(null)));
        assert!(ok(json!({})));
        assert!(ok(json!({"user": "ann", "k".repeat(64): "v".repeat(512)})));
        let many: serde_json::Map<String, Value> =
            (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
        for bad in [
            json!([1]),
            json!("x"),
            json!({"k": 1}),
            json!({"k": ["v"]}),
            json!({"k".repeat(65): "v"}),
            json!({"k": "v".repeat(513)}),
            Value::Object(many),
        ] {
            assert!(!ok(bad.clone()), "{bad}");
        }
    }

    use super::*;

    fn req(body: Value) -> ResponsesRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn input_items_become_chat_messages() {
        let got = input_messages(Some(&json!([
            {"role": "developer", "content": "Be terse."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "weather?"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
            ]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "20C"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "18C"}]},
        ])))
        .unwrap();
        assert_eq!(
            got,
            vec![
                json!({"role": "system", "content": "Be terse."}),
                json!({"role": "user", "content": [
                    {"type": "text", "text": "weather?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ]}),
                json!({"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
                ]}),
                json!({"role": "tool", "tool_call_id": "call_1", "content": "20C"}),
                json!({"role": "tool", "tool_call_id": "call_2", "content": "18C"}),
            ]
        );
        // A call re-sent after the turn that made it is that call, once.
        let turn = json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
        let again = input_messages_after(
            vec![turn.clone()],
            Some(&json!([
                {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
            ])),
        )
        .unwrap();
        assert_eq!(
            again,
            vec![
                turn,
                json!({"role": "tool", "tool_call_id": "call_1", "content": "ok"})
            ]
        );
        assert_eq!(
            input_messages(Some(&json!("hi"))).unwrap(),
            vec![json!({"role": "user", "content": "hi"})]
        );
    }

    #[test]
    fn bad_input_is_refused_naming_the_place() {
        for (input, names) in [
            (json!(5), "input"),
            (json!([{"role": "tool", "content": "x"}]), "input[0].role"),
            (json!([{"role": "user", "content": 3}]), "input[0].content"),
            (
                json!([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
                "input[0].content[0].type",
            ),
            (
                json!([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]),
                "input[0].content[0]",
            ),
            (
                json!([{"type": "function_call", "name": "f", "arguments": "{}"}]),
                "input[0].call_id",
            ),
            (
                json!([{"type": "function_call_output", "call_id": "c", "output": 3}]),
                "input[0].output",
            ),
            (
                json!([{"type": "item_reference", "id": "x"}]),
                "input[0].type",
            ),
        ] {
            let err = input_messages(Some(&input)).unwrap_err().to_string();
            assert!(err.contains(names), "{err:?} does not name {names}");
        }
    }

    #[test]
    fn params_formats_and_refusals() {
        let p = req(json!({"max_output_tokens": 9, "truncation": "auto"}))
            .params()
            .unwrap();
        assert_eq!((p.num_predict, p.temperature, p.top_p), (9, 1.0, 1.0));
        assert!(p.truncate && p.grammar.is_none());
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        for text in [
            json!({"format": {"type": "json_object"}}),
            json!({"format": {"type": "json_schema", "name": "x", "schema": schema}}),
        ] {
            assert!(req(json!({"text": text}))
                .params()
                .unwrap()
                .grammar
                .is_some());
        }
        for body in [
            json!({"max_output_tokens": 0}),
            json!({"temperature": 2.5}),
            json!({"truncation": "sometimes"}),
            json!({"background": true}),
            json!({"conversation": "conv_1"}),
            json!({"top_logprobs": 2}),
            json!({"text": {"format": {"type": "xml"}}}),
            json!({"text": {"format": {"type": "json_schema", "name": "x"}}}),
        ] {
            assert!(req(body.clone()).params().is_err(), "{body} was accepted");
        }
    }

    #[test]
    fn reasoning_effort_switches_thinking() {
        let think = |r: Value| req(json!({"reasoning": r})).think();
        assert_eq!(think(Value::Null).unwrap(), None);
        assert_eq!(think(json!({"effort": "none"})).unwrap(), Some(false));
        assert_eq!(think(json!({"effort": "high"})).unwrap(), Some(true));
        assert_eq!(think(json!({"summary": "auto"})).unwrap(), None);
        assert!(think(json!({"effort": "max"})).is_err());
        assert!(think(json!("high")).is_err());
    }

    #[test]
    fn function_tools_map_and_built_in_tools_are_refused() {
        let t = tool_request(&req(json!({
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "parallel_tool_calls": false,
        })))
        .unwrap()
        .unwrap();
        assert_eq!(t.choice, tool_calls::ToolChoice::Named("f".into()));
        assert!(!t.parallel);
        for body in [
            json!({"tools": [{"type": "web_search"}]}),
            json!({"tools": [{"name": "f"}]}),
            json!({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools"}}),
            json!({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}),
        ] {
            assert!(
                tool_request(&req(body.clone())).is_err(),
                "{body} was accepted"
            );
        }
    }

    #[test]
    fn a_kept_response_holds_its_conversation_and_output_as_the_next_turn() {
        let store = super::ResponseStore::default();
        let items = vec![
            reasoning_item("rs_1", "hmm"),
            message_item("msg_1", "Checking.", "completed"),
            call_item("fc_1", "call_1", "f", "{\"a\":1}", "completed"),
        ];
        keep_response(
            &store,
            "resp_1",
            vec![json!({"role": "user", "content": "hi"})],
            &items,
            &json!({"id": "resp_1"}),
        );
        let kept = store.get("resp_1").unwrap();
        assert_eq!(
            kept.messages,
            vec![
                json!({"role": "user", "content": "hi"}),
                json!({"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}},
                ]}),
            ]
        );
    }
}
