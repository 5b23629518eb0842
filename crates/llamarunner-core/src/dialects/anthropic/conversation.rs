//! An Anthropic request's conversation as the chat path reads it: the system prompt and the
//! messages' content blocks (text, images, `tool_use`, `tool_result`, thinking) as chat
//! messages, and `tools` / `tool_choice` as a tool request.

use serde_json::{json, Map, Value};

use super::request::MessagesRequest;
use crate::http::error::ApiError;
use crate::requests::common::{parse_messages, Chat};
use crate::requests::tool_calls::ToolRequest;

/// The request's conversation in the shape the chat path reads (OpenAI's messages): the
/// system prompt first, a user message's `tool_result` blocks as `tool` messages, an assistant
/// message's `tool_use` blocks as its `tool_calls`, images as `image_url` parts with a data URL.
pub(super) fn chat_messages(
    system: Option<&Value>,
    messages: &[Value],
) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::with_capacity(messages.len() + 1);
    match system {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push(json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) => {
            let text = text_blocks(blocks, "system")?;
            out.push(json!({"role": "system", "content": text}));
        }
        Some(_) => {
            return Err(ApiError::field(
                "system",
                ": must be a string or an array of text blocks",
            ))
        }
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
pub(super) fn tool_request(
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
                    _ => return Err(ApiError::field("tool_choice.name", ": Field required")),
                },
                _ => {
                    return Err(ApiError::field(
                        "tool_choice.type",
                        " must be \"auto\", \"any\", \"tool\" or \"none\"",
                    ))
                }
            };
            (Some(choice), parallel)
        }
    };
    ToolRequest::parse(Some(&tools), choice.as_ref(), parallel)
}

/// The request's conversation, as the chat path reads it. `messages` is required; an empty one
/// is taken, as llama-server takes it (Anthropic's API refuses it): the template renders the
/// system prompt, if any, and the generation prompt.
pub(super) fn conversation(req: &MessagesRequest) -> Result<Chat, ApiError> {
    let given = req
        .messages
        .as_deref()
        .ok_or_else(|| ApiError::field("messages", ": Field required"))?;
    let messages = chat_messages(req.system.as_ref(), given)?;
    if messages.is_empty() {
        return Ok(Chat {
            messages: Vec::new(),
            images: Vec::new(),
        });
    }
    parse_messages(messages)
}
