//! A Responses request's `input` as chat messages: message items with their parts, the
//! assistant's `function_call`s and their `function_call_output`s.

use serde_json::{json, Value};

use crate::http::error::ApiError;

/// `input` as chat messages: a string is one user message; items are messages (`developer`
/// reads as `system`), `function_call`s (the assistant's calls) and `function_call_output`s
/// (`tool` messages); `reasoning` items are dropped (the template gets the answer, not the
/// thinking, as OpenAI's models do).
#[cfg(test)]
pub(super) fn input_messages(input: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    input_messages_after(Vec::new(), input)
}

/// `input_messages` appended to `out` (the conversation a previous response ended): a call
/// the client sends again right after the turn that made it is not repeated.
pub(super) fn input_messages_after(
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
            return Err(ApiError::field(
                "input",
                " must be a string or an array of input items",
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
