//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the
//! request read into the chat path every dialect shares (template, tools, reasoning), the
//! answer written back as content blocks (`thinking`, `text`, `tool_use`), whole or as
//! Anthropic's event stream, with errors in Anthropic's shape. What the API has and a local
//! runner cannot honour (server tools, documents, citations) is refused with a 400 naming it.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::http::error::{AnthropicError, ApiError};
use crate::http::state::AppState;
use crate::protocol::params::SamplingParams;
use crate::protocol::{Completion, DoneReason, Event};
use crate::requests::common::{
    collect, count_prompt_tokens, model_info, parse_json, parse_messages, start_generation, Chat,
};
use crate::requests::image_prompt::{self, Prompt};
use crate::requests::keyed::Keyed;
use crate::requests::tool_calls::{self, ChatOutput, OutPiece, ToolRequest};
use crate::requests::validate;

/// Body of `/v1/messages` (and of `count_tokens`, which ignores the generation fields).
/// Unknown fields are ignored, as Anthropic-compatible servers do.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct MessagesRequest {
    model: Option<String>,
    messages: Option<Vec<Value>>,
    system: Option<Value>,
    max_tokens: Option<i64>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i32>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    thinking: Option<Value>,
    /// `{"format": {"type": "json_schema", "schema"}, "effort"}`.
    output_config: Option<Value>,
    /// The structured-outputs beta's name for `output_config.format`.
    output_format: Option<Value>,
    // llama.cpp-style extras, as the OpenAI dialect takes them.
    min_p: Option<f32>,
    seed: Option<i64>,
    repeat_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    lora: Option<Value>,
    cache_prompt: Option<bool>,
    /// DRY, XTC, top-n-sigma, dynamic temperature (llama-server's fields).
    #[serde(flatten)]
    samplers: crate::requests::options::SamplerFields,
}

impl MessagesRequest {
    /// Sampling parameters with Anthropic's defaults (temperature 1, no nucleus cut).
    fn params(&self) -> Result<SamplingParams, ApiError> {
        let max = self
            .max_tokens
            .ok_or_else(|| ApiError::invalid("max_tokens: Field required"))?;
        if max < 1 {
            return Err(ApiError::invalid("max_tokens: must be at least 1"));
        }
        if let Some(t) = self.temperature {
            if !(0.0..=1.0).contains(&t) {
                return Err(ApiError::invalid(format!(
                    "temperature: must be between 0 and 1, got {t}"
                )));
            }
        }
        if self.top_k.is_some_and(|k| k < 0) {
            return Err(ApiError::invalid("top_k: must be at least 0"));
        }
        let defaults = SamplingParams::default();
        let mut p = SamplingParams {
            num_predict: max,
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(defaults.top_k),
            min_p: self.min_p.unwrap_or(0.0),
            repeat_penalty: self.repeat_penalty.unwrap_or(1.0),
            seed: self.seed.unwrap_or(-1),
            stop: self
                .stop_sequences
                .iter()
                .flatten()
                .filter(|s| !s.is_empty())
                .cloned()
                .collect(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            cache_prompt: self.cache_prompt.unwrap_or(true),
            samplers: self.samplers.samplers(),
            ..defaults
        };
        validate::check_options(&p)
            .map_err(|e| ApiError::invalid(e.top_level(&[("stop", "stop_sequences")])))?;
        // As Anthropic's API: a prompt that does not fit is an error, not silently cut.
        p.truncate = false;
        p.grammar = self.output_grammar()?;
        Ok(p)
    }

    /// Structured output: `output_config.format` (or the beta's `output_format`), a JSON
    /// schema, through the grammar path. `output_config.effort` is checked and has no effect
    /// here (no template takes a level).
    fn output_grammar(&self) -> Result<Option<crate::constrain::Grammar>, ApiError> {
        let config = self.output_config.as_ref().filter(|c| !c.is_null());
        if let Some(config) = config {
            if !config.is_object() {
                return Err(ApiError::invalid("output_config: must be an object"));
            }
            match config.get("effort") {
                None | Some(Value::Null) => {}
                Some(Value::String(e))
                    if ["low", "medium", "high", "xhigh", "max"].contains(&e.as_str()) => {}
                Some(_) => {
                    return Err(ApiError::invalid(
                        "output_config.effort: must be low, medium, high, xhigh or max",
                    ))
                }
            }
        }
        let (format, at) = match (config.and_then(|c| c.get("format")), &self.output_format) {
            (Some(f), _) if !f.is_null() => (f, "output_config.format"),
            (_, Some(f)) if !f.is_null() => (f, "output_format"),
            _ => return Ok(None),
        };
        if format.get("type").and_then(Value::as_str) != Some("json_schema") {
            return Err(ApiError::invalid(format!(
                "{at}.type: must be \"json_schema\""
            )));
        }
        crate::requests::format::response_format(format, at).map_err(ApiError::invalid)
    }

    /// `thinking`: `{"type": "enabled", "budget_tokens": N}` turns the template's reasoning on
    /// (the budget must be at least 1024 and below `max_tokens`, as Anthropic's API checks;
    /// the thinking is bounded by `max_tokens`), `{"type": "disabled"}` off; `adaptive`,
    /// `between_tools` or absent: the template's default.
    fn think(&self) -> Result<Option<bool>, ApiError> {
        let Some(thinking) = self.thinking.as_ref().filter(|t| !t.is_null()) else {
            return Ok(None);
        };
        match thinking.get("type").and_then(Value::as_str) {
            Some("disabled") => Ok(Some(false)),
            // The model decides: the template's default.
            Some("adaptive" | "between_tools") => Ok(None),
            Some("enabled") => {
                let budget = thinking
                    .get("budget_tokens")
                    .and_then(Value::as_i64)
                    .ok_or_else(|| {
                        ApiError::invalid("thinking.budget_tokens: Field required (an integer)")
                    })?;
                if budget < 1024 {
                    return Err(ApiError::invalid(
                        "thinking.budget_tokens: must be at least 1024",
                    ));
                }
                if self.max_tokens.is_some_and(|m| budget >= m) {
                    return Err(ApiError::invalid(
                        "thinking.budget_tokens: must be less than max_tokens",
                    ));
                }
                Ok(Some(true))
            }
            _ => Err(ApiError::invalid(
                "thinking.type must be \"enabled\", \"disabled\", \"adaptive\" or \
                 \"between_tools\"",
            )),
        }
    }
}

/// Reads a request for the served model.
fn parse_request(state: &AppState, body: &[u8]) -> Result<MessagesRequest, ApiError> {
    model_info(state)?;
    let req: MessagesRequest = parse_json(body)?;
    Ok(req)
}

/// The request's conversation in the shape the chat path reads (OpenAI's messages): the
/// system prompt first, a user message's `tool_result` blocks as `tool` messages, an assistant
/// message's `tool_use` blocks as its `tool_calls`, images as `image_url` parts with a data URL.
fn chat_messages(system: Option<&Value>, messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::with_capacity(messages.len() + 1);
    match system {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push(json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) => {
            let text = text_blocks(blocks, "system")?;
            out.push(json!({"role": "system", "content": text}));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "system: must be a string or an array of text blocks",
            ))
        }
    }
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages: at least one message is required",
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages.{i}");
        let role = m.get("role").and_then(Value::as_str);
        let blocks = match m.get("content") {
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(blocks)) => blocks.clone(),
            _ => {
                return Err(ApiError::invalid(format!(
                    "{at}.content: must be a string or an array of content blocks"
                )))
            }
        };
        match role {
            Some("user") => user_message(&at, &blocks, &mut out)?,
            Some("assistant") => out.push(assistant_message(&at, &blocks)?),
            _ => {
                return Err(ApiError::invalid(format!(
                    "{at}.role: must be \"user\" or \"assistant\" (the system prompt is the \
                     top-level system field)"
                )))
            }
        }
    }
    Ok(out)
}

/// The text of an array of text blocks (`system`, a `tool_result`'s content).
fn text_blocks(blocks: &[Value], at: &str) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, b) in blocks.iter().enumerate() {
        match (b.get("type").and_then(Value::as_str), b.get("text")) {
            (Some("text"), Some(Value::String(t))) => text.push_str(t),
            _ => {
                return Err(ApiError::invalid(format!(
                    "{at}.{j}: only text blocks are supported here"
                )))
            }
        }
    }
    Ok(text)
}

/// A user turn: its `tool_result` blocks become `tool` messages, the other blocks (text and
/// images, in order) user messages between them.
fn user_message(at: &str, blocks: &[Value], out: &mut Vec<Value>) -> Result<(), ApiError> {
    let mut parts: Vec<Value> = Vec::new();
    let flush = |parts: &mut Vec<Value>, out: &mut Vec<Value>| {
        if !parts.is_empty() {
            out.push(json!({"role": "user", "content": std::mem::take(parts)}));
        }
    };
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content.{j}");
        match b.get("type").and_then(Value::as_str) {
            Some("text") => parts.push(text_part(&at, b)?),
            Some("image") => parts.push(image_part(&at, b)?),
            Some("tool_result") => {
                flush(&mut parts, out);
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        ApiError::invalid(format!("{at}.tool_use_id: Field required"))
                    })?;
                let mut content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(inner)) => text_blocks(inner, &format!("{at}.content"))?,
                    Some(_) => {
                        return Err(ApiError::invalid(format!(
                            "{at}.content: must be a string or an array of text blocks"
                        )))
                    }
                };
                if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    content = format!("Error: {content}");
                }
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            other => return Err(unsupported_block(&at, other)),
        }
    }
    flush(&mut parts, out);
    Ok(())
}

/// An assistant turn: text joined, `tool_use` blocks as calls, thinking as
/// `reasoning_content` (templates that show past reasoning read it there).
fn assistant_message(at: &str, blocks: &[Value]) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut thinking = String::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content.{j}");
        match b.get("type").and_then(Value::as_str) {
            Some("text") => {
                if let Some(Value::String(t)) = text_part(&at, b)?.get("text") {
                    text.push_str(t);
                }
            }
            Some("thinking") => {
                if let Some(t) = b.get("thinking").and_then(Value::as_str) {
                    thinking.push_str(t);
                }
            }
            Some("redacted_thinking") => {}
            Some("tool_use") => {
                let id = b.get("id").and_then(Value::as_str);
                let name = b.get("name").and_then(Value::as_str);
                let (Some(id), Some(name)) = (id, name) else {
                    return Err(ApiError::invalid(format!(
                        "{at}: a tool_use block needs id and name"
                    )));
                };
                let input = match b.get("input") {
                    Some(Value::Object(o)) => Value::Object(o.clone()),
                    None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(_) => {
                        return Err(ApiError::invalid(format!("{at}.input: must be an object")))
                    }
                };
                calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": {"name": name, "arguments": input},
                }));
            }
            other => return Err(unsupported_block(&at, other)),
        }
    }
    let mut message = json!({"role": "assistant", "content": text});
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls);
    }
    if !thinking.is_empty() {
        message["reasoning_content"] = json!(thinking);
    }
    Ok(message)
}

fn text_part(at: &str, b: &Value) -> Result<Value, ApiError> {
    match b.get("text") {
        Some(Value::String(t)) => Ok(json!({"type": "text", "text": t})),
        _ => Err(ApiError::invalid(format!(
            "{at}.text: Field required (a string)"
        ))),
    }
}

/// An image block: `{"source": {"type": "base64", "media_type", "data"}}` becomes a data URL
/// (decoded and checked with every other image); a `url` source is refused there, as every
/// remote image is.
fn image_part(at: &str, b: &Value) -> Result<Value, ApiError> {
    let source = b.get("source");
    let kind = source.and_then(|s| s.get("type")).and_then(Value::as_str);
    let url = match kind {
        Some("base64") => {
            let media = source
                .and_then(|s| s.get("media_type"))
                .and_then(Value::as_str)
                .unwrap_or("image/png");
            let data = source
                .and_then(|s| s.get("data"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::InvalidImage(format!("{at}.source.data: Field required"))
                })?;
            format!("data:{media};base64,{data}")
        }
        Some("url") => source
            .and_then(|s| s.get("url"))
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::InvalidImage(format!("{at}.source.url: Field required")))?
            .to_string(),
        _ => {
            return Err(ApiError::InvalidImage(format!(
                "{at}.source: an image needs a base64 source (type, media_type, data)"
            )))
        }
    };
    Ok(json!({"type": "image_url", "image_url": {"url": url}}))
}

fn unsupported_block(at: &str, kind: Option<&str>) -> ApiError {
    ApiError::invalid(format!(
        "{at}.type: {} blocks are not supported here (text, image, tool_use, tool_result and \
         thinking are)",
        kind.map_or_else(|| "untyped".to_string(), |k| format!("{k:?}"))
    ))
}

/// `tools` (`{"name", "description", "input_schema"}`) and `tool_choice` (`auto`, `any`,
/// `tool` with its name, `none`; `disable_parallel_tool_use`) as the chat path reads them.
fn tool_request(
    tools: Option<&[Value]>,
    choice: Option<&Value>,
) -> Result<Option<ToolRequest>, ApiError> {
    let tools = tools
        .unwrap_or_default()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let kind = t.get("type").and_then(Value::as_str);
            if !matches!(kind, None | Some("custom")) || t.get("input_schema").is_none() {
                return Err(ApiError::invalid(format!(
                    "tools.{i}: only client tools with an input_schema are supported (server \
                     tools such as {:?} are not)",
                    kind.unwrap_or("(untyped)")
                )));
            }
            let mut function = json!({
                "name": t.get("name").cloned().unwrap_or(Value::Null),
                "parameters": t.get("input_schema").cloned().unwrap_or(Value::Null),
            });
            if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
                function["description"] = d.clone();
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (choice, parallel) = match choice.filter(|c| !c.is_null()) {
        None => (None, None),
        Some(c) => {
            let parallel = c
                .get("disable_parallel_tool_use")
                .and_then(Value::as_bool)
                .map(|d| !d);
            let choice = match c.get("type").and_then(Value::as_str) {
                Some("auto") => json!("auto"),
                Some("any") => json!("required"),
                Some("none") => json!("none"),
                Some("tool") => match c.get("name") {
                    Some(Value::String(name)) => {
                        json!({"type": "function", "function": {"name": name}})
                    }
                    _ => return Err(ApiError::invalid("tool_choice.name: Field required")),
                },
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice.type must be \"auto\", \"any\", \"tool\" or \"none\"",
                    ))
                }
            };
            (Some(choice), parallel)
        }
    };
    ToolRequest::parse(Some(&tools), choice.as_ref(), parallel)
}

/// The request's conversation, as the chat path reads it.
fn conversation(req: &MessagesRequest) -> Result<Chat, ApiError> {
    let messages = chat_messages(
        req.system.as_ref(),
        req.messages.as_deref().unwrap_or_default(),
    )?;
    parse_messages(messages)
}

/// `/v1/messages` as `routing_key` reads it: as `messages` does.
pub(crate) fn keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: MessagesRequest = parse_json(body)?;
    let chat = conversation(&req)?;
    Ok(Keyed::chat(req.model, chat.messages))
}

/// A request read: the prompt (rendered, with its images) and how to read the answer.
async fn prepare(
    state: &AppState,
    req: &MessagesRequest,
    params: &mut SamplingParams,
) -> Result<(Prompt, ChatOutput), ApiError> {
    let chat = conversation(req)?;
    image_prompt::check_images(&*model_info(state)?, chat.images.len())?;
    let tools = tool_request(req.tools.as_deref(), req.tool_choice.as_ref())?;
    let think = req.think()?;
    let (text, output) =
        tool_calls::chat_request(state, chat.messages, tools, params, think.into()).await?;
    Ok((
        Prompt {
            text,
            images: chat.images,
        },
        output,
    ))
}

/// `POST /v1/messages`.
pub async fn messages(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, AnthropicError> {
    let req = parse_request(&state, &body)?;
    let mut params = req.params()?;
    params.lora = state.lora.for_request(req.lora.as_ref())?;
    let (prompt, output) = prepare(&state, &req, &mut params).await?;
    let meta = Arc::new(Meta {
        id: format!("msg_{}", crate::http::access::current_id().replace('-', "")),
        model: state.model_name.to_string(),
        stop_sequences: req.stop_sequences.clone().unwrap_or_default(),
    });
    let rx = start_generation(&state, prompt, params).await?;
    if req.stream != Some(true) {
        let all = collect(rx).await?;
        let answer = output.read_all(&all.text);
        let mut content = Vec::new();
        if !answer.reasoning.is_empty() {
            content
                .push(json!({"type": "thinking", "thinking": answer.reasoning, "signature": ""}));
        }
        if !answer.content.is_empty() {
            content.push(json!({"type": "text", "text": answer.content}));
        }
        for call in &answer.calls {
            content.push(json!({
                "type": "tool_use",
                "id": tool_use_id(),
                "name": call.name,
                "input": call.arguments,
            }));
        }
        let (reason, sequence) = meta.stop_reason(&all.done, !answer.calls.is_empty());
        return Ok(Json(json!({
            "id": meta.id,
            "type": "message",
            "role": "assistant",
            "model": meta.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(&all.done),
        }))
        .into_response());
    }
    let start = json!({"type": "message_start", "message": {
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": [],
        "stop_reason": null,
        "stop_sequence": null,
        "usage": {"input_tokens": rx.prompt_tokens, "output_tokens": 0},
    }});
    let head = [event(&start), event(&json!({"type": "ping"}))];
    let mut writer = Blocks::new(meta, output);
    let events = rx.flat_map(move |e| stream::iter(writer.on(e)));
    let body = stream::iter(head).chain(events).map(Ok::<_, Infallible>);
    // A call is held back until it is whole: pings keep a quiet stream alive, as Anthropic's.
    let ping = SseEvent::default().event("ping").data(r#"{"type":"ping"}"#);
    Ok(Sse::new(body)
        .keep_alive(KeepAlive::new().event(ping))
        .into_response())
}

/// Body of `POST /v1/messages/count_tokens`' answer: the prompt's tokens, as the request
/// would be rendered (system, tools, images included).
pub async fn count_tokens(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, AnthropicError> {
    let req = parse_request(&state, &body)?;
    model_info(&state)?;
    let mut params = SamplingParams::default();
    let (prompt, _) = prepare(&state, &req, &mut params).await?;
    let n = count_prompt_tokens(&state, prompt).await?;
    Ok(Json(json!({"input_tokens": n})).into_response())
}

/// What every event of one answer repeats.
struct Meta {
    id: String,
    model: String,
    /// The request's own stop strings (the template's end-of-turn markers are stops too, but
    /// one of those ends a turn).
    stop_sequences: Vec<String>,
}

impl Meta {
    /// `stop_reason` and `stop_sequence`: `tool_use` when the answer called, `stop_sequence`
    /// with the string when one of the request's ended it, `max_tokens` when cut, else
    /// `end_turn`.
    fn stop_reason(&self, done: &Completion, called: bool) -> (&'static str, Value) {
        if called {
            return ("tool_use", Value::Null);
        }
        match done.done_reason {
            DoneReason::Length | DoneReason::Timeout => ("max_tokens", Value::Null),
            DoneReason::Stop => match &done.stop_string {
                Some(s) if self.stop_sequences.contains(s) => ("stop_sequence", json!(s)),
                _ => ("end_turn", Value::Null),
            },
        }
    }
}

/// Anthropic's usage: `input_tokens` are the prompt tokens decoded, those reused from the
/// cache are `cache_read_input_tokens` (the prompt is their sum, as Anthropic counts it).
fn usage(done: &Completion) -> Value {
    json!({
        "input_tokens": done.prompt_eval_count.saturating_sub(done.prompt_cached_count),
        "output_tokens": done.eval_count,
        "cache_read_input_tokens": done.prompt_cached_count,
        "cache_creation_input_tokens": 0,
    })
}

/// A tool_use id as Anthropic writes them: `toolu_` and 24 letters and digits.
fn tool_use_id() -> String {
    tool_calls::call_id_with("toolu")
}

/// One server-sent event named by its `type`, as Anthropic sends them.
fn event(data: &Value) -> SseEvent {
    let name = data
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("message");
    SseEvent::default()
        .event(name)
        .data(super::stream_json::to_line(data))
}

/// The kind of the content block being streamed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Open {
    Thinking,
    Text,
}

/// Writes a streamed answer as content blocks: one thinking block, one text block for each
/// run of text, one tool_use block per call; each opened, filled by deltas, closed.
struct Blocks {
    meta: Arc<Meta>,
    output: ChatOutput,
    open: Option<Open>,
    /// Index of the next block.
    next: usize,
    called: bool,
}

impl Blocks {
    fn new(meta: Arc<Meta>, output: ChatOutput) -> Self {
        Self {
            meta,
            output,
            open: None,
            next: 0,
            called: false,
        }
    }

    fn on(&mut self, e: Event) -> Vec<SseEvent> {
        let mut out = Vec::new();
        match e {
            Event::Started | Event::Progress(_) => {}
            Event::Text { text, .. } => {
                for piece in self.output.push(&text) {
                    self.piece(piece, &mut out);
                }
            }
            Event::Done(done) => {
                for piece in self.output.finish() {
                    self.piece(piece, &mut out);
                }
                self.close(&mut out);
                let (reason, sequence) = self.meta.stop_reason(&done, self.called);
                out.push(event(&json!({
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(&done),
                })));
                out.push(event(&json!({"type": "message_stop"})));
            }
            Event::Error(e) => {
                self.close(&mut out);
                out.push(event(&ApiError::from(e).anthropic_body()));
            }
        }
        out
    }

    fn piece(&mut self, piece: OutPiece, out: &mut Vec<SseEvent>) {
        match piece {
            OutPiece::Reasoning(t) => {
                self.ensure(Open::Thinking, out);
                out.push(self.delta(json!({"type": "thinking_delta", "thinking": t})));
            }
            OutPiece::Content(t) if t.is_empty() => {}
            OutPiece::Content(t) => {
                self.ensure(Open::Text, out);
                out.push(self.delta(json!({"type": "text_delta", "text": t})));
            }
            OutPiece::Calls(calls) => {
                self.close(out);
                self.called |= !calls.is_empty();
                for call in calls {
                    let index = self.next;
                    out.push(event(&json!({
                        "type": "content_block_start",
                        "index": index,
                        "content_block": {
                            "type": "tool_use", "id": tool_use_id(), "name": call.name, "input": {},
                        },
                    })));
                    out.push(event(&json!({
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": call.arguments.to_string()},
                    })));
                    out.push(event(
                        &json!({"type": "content_block_stop", "index": index}),
                    ));
                    self.next += 1;
                }
            }
        }
    }

    /// Opens a block of `kind` unless one is open (closing another kind first).
    fn ensure(&mut self, kind: Open, out: &mut Vec<SseEvent>) {
        if self.open == Some(kind) {
            return;
        }
        self.close(out);
        let block = match kind {
            Open::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            Open::Text => json!({"type": "text", "text": ""}),
        };
        out.push(event(&json!({
            "type": "content_block_start",
            "index": self.next,
            "content_block": block,
        })));
        self.open = Some(kind);
    }

    fn delta(&self, delta: Value) -> SseEvent {
        event(&json!({"type": "content_block_delta", "index": self.next, "delta": delta}))
    }

    fn close(&mut self, out: &mut Vec<SseEvent>) {
        if self.open.take().is_some() {
            out.push(event(
                &json!({"type": "content_block_stop", "index": self.next}),
            ));
            self.next += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(body: Value) -> MessagesRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn params_follow_anthropic_and_refuse_what_it_refuses() {
        let p = req(json!({"max_tokens": 7, "stop_sequences": ["x", ""], "top_k": 3}))
            .params()
            .unwrap();
        assert_eq!(
            (p.num_predict, p.temperature, p.top_p, p.top_k),
            (7, 1.0, 1.0, 3)
        );
        assert_eq!(p.stop, vec!["x"]);
        assert!(!p.truncate);
        for body in [
            json!({}),
            json!({"max_tokens": 0}),
            json!({"max_tokens": 5, "temperature": 1.5}),
            json!({"max_tokens": 5, "top_k": -1}),
        ] {
            assert!(req(body.clone()).params().is_err(), "{body} was accepted");
        }
    }

    #[test]
    fn thinking_is_enabled_disabled_or_the_templates_default() {
        let think = |t: Value| req(json!({"max_tokens": 4096, "thinking": t})).think();
        assert_eq!(think(Value::Null).unwrap(), None);
        assert_eq!(think(json!({"type": "disabled"})).unwrap(), Some(false));
        assert_eq!(
            think(json!({"type": "enabled", "budget_tokens": 2048})).unwrap(),
            Some(true)
        );
        for bad in [
            json!({"type": "enabled"}),
            json!({"type": "enabled", "budget_tokens": 100}),
            json!({"type": "enabled", "budget_tokens": 5000}),
            json!({"type": "sometimes"}),
        ] {
            assert!(think(bad.clone()).is_err(), "{bad} was accepted");
        }
        assert_eq!(think(json!({"type": "adaptive"})).unwrap(), None);
    }

    #[test]
    fn output_config_format_is_a_grammar_and_its_mistakes_are_refused() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        for body in [
            json!({"max_tokens": 5, "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}}),
            json!({"max_tokens": 5, "output_format": {"type": "json_schema", "schema": schema}}),
        ] {
            assert!(
                req(body.clone()).params().unwrap().grammar.is_some(),
                "{body}"
            );
        }
        let p = req(json!({"max_tokens": 5, "output_config": {"effort": "high"}})).params();
        assert!(p.unwrap().grammar.is_none());
        for body in [
            json!({"max_tokens": 5, "output_config": 3}),
            json!({"max_tokens": 5, "output_config": {"effort": "extreme"}}),
            json!({"max_tokens": 5, "output_config": {"format": {"type": "json_object"}}}),
            json!({"max_tokens": 5, "output_config": {"format": {"type": "json_schema"}}}),
            json!({"max_tokens": 5, "output_format": {"type": "json_schema", "schema": []}}),
        ] {
            assert!(req(body.clone()).params().is_err(), "{body} was accepted");
        }
    }

    #[test]
    fn a_conversation_with_tools_becomes_chat_messages() {
        let messages = chat_messages(
            Some(&json!([{"type": "text", "text": "Be terse."}])),
            &[
                json!({"role": "user", "content": "weather in Paris?"}),
                json!({"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "use the tool", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ]}),
                json!({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "20C"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": true},
                    {"type": "text", "text": "and tomorrow?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"}},
                ]}),
            ],
        )
        .unwrap();
        assert_eq!(
            messages,
            vec![
                json!({"role": "system", "content": "Be terse."}),
                json!({"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]}),
                json!({"role": "assistant", "content": "Checking.", "reasoning_content": "use the tool",
                       "tool_calls": [{"id": "toolu_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}),
                json!({"role": "tool", "tool_call_id": "toolu_1", "content": "20C"}),
                json!({"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"}),
                json!({"role": "user", "content": [
                    {"type": "text", "text": "and tomorrow?"},
                    {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}},
                ]}),
            ]
        );
    }

    #[test]
    fn bad_conversations_are_refused_naming_the_place() {
        for (system, messages, names) in [
            (Value::Null, vec![], "messages"),
            (
                json!(5),
                vec![json!({"role": "user", "content": "x"})],
                "system",
            ),
            (
                Value::Null,
                vec![json!({"role": "system", "content": "x"})],
                "messages.0.role",
            ),
            (
                Value::Null,
                vec![json!({"role": "user", "content": 5})],
                "messages.0.content",
            ),
            (
                Value::Null,
                vec![json!({"role": "user", "content": [{"type": "document", "source": {}}]})],
                "messages.0.content.0.type",
            ),
            (
                Value::Null,
                vec![json!({"role": "user", "content": [{"type": "tool_result"}]})],
                "messages.0.content.0.tool_use_id",
            ),
            (
                Value::Null,
                vec![
                    json!({"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": 3}]}),
                ],
                "messages.0.content.0.input",
            ),
            (
                Value::Null,
                vec![
                    json!({"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}),
                ],
                "messages.0.content.0.source",
            ),
        ] {
            let err = chat_messages(Some(&system), &messages)
                .unwrap_err()
                .to_string();
            assert!(err.contains(names), "{err:?} does not name {names}");
        }
    }

    #[test]
    fn tools_and_tool_choice_map_to_the_chat_path() {
        let tools = [
            json!({"name": "get_weather", "description": "d", "input_schema": {
            "type": "object", "properties": {"city": {"type": "string"}}}}),
        ];
        let t = tool_request(Some(&tools), None).unwrap().unwrap();
        assert_eq!(t.tools[0].name, "get_weather");
        assert_eq!(t.choice, tool_calls::ToolChoice::Auto);
        assert!(t.parallel);
        let t = tool_request(
            Some(&tools),
            Some(
                &json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true}),
            ),
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            t.choice,
            tool_calls::ToolChoice::Named("get_weather".into())
        );
        assert!(!t.parallel);
        let t = tool_request(Some(&tools), Some(&json!({"type": "any"})))
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, tool_calls::ToolChoice::Required);
        for (tools, choice) in [
            (
                vec![json!({"type": "web_search_20250305", "name": "web_search"})],
                Value::Null,
            ),
            (vec![json!({"name": "f"})], Value::Null),
            (tools.to_vec(), json!({"type": "tool"})),
            (tools.to_vec(), json!({"type": "tool", "name": "other"})),
            (tools.to_vec(), json!({"type": "sometimes"})),
        ] {
            assert!(
                tool_request(Some(&tools), Some(&choice)).is_err(),
                "{tools:?} {choice}"
            );
        }
    }

    #[test]
    fn stop_reasons_say_why_the_turn_ended() {
        let meta = Meta {
            id: "msg_x".into(),
            model: "m".into(),
            stop_sequences: vec!["END".into()],
        };
        let done = |reason, stop: Option<&str>| Completion {
            done_reason: reason,
            prompt_eval_count: 3,
            prompt_cached_count: 0,
            queue_duration_ns: 0,
            prompt_eval_duration_ns: 0,
            eval_count: 2,
            eval_duration_ns: 0,
            truncated: false,
            draft_count: 0,
            draft_accepted_count: 0,
            stop_string: stop.map(str::to_string),
        };
        assert_eq!(
            meta.stop_reason(&done(DoneReason::Stop, None), false).0,
            "end_turn"
        );
        assert_eq!(
            meta.stop_reason(&done(DoneReason::Stop, Some("<end_of_turn>")), false)
                .0,
            "end_turn"
        );
        assert_eq!(
            meta.stop_reason(&done(DoneReason::Stop, Some("END")), false),
            ("stop_sequence", json!("END"))
        );
        assert_eq!(
            meta.stop_reason(&done(DoneReason::Length, None), false).0,
            "max_tokens"
        );
        assert_eq!(
            meta.stop_reason(&done(DoneReason::Stop, None), true).0,
            "tool_use"
        );
    }
}
