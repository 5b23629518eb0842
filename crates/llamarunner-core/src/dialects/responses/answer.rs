//! The JSON of a response: the response object (`Meta`, its status from `Finished`, usage,
//! error code), its output items, and the conversation kept with a finished response.

use std::time::SystemTime;

use serde_json::{json, Value};

use super::request::ResponsesRequest;
use crate::http::error::ApiError;
use crate::http::response_store::{ResponseStore, Stored};
use crate::http::state::AppState;
use crate::protocol::params::SamplingParams;
use crate::protocol::{Completion, DoneReason};
use crate::requests::common::unix_seconds;
use crate::requests::tool_calls::{self, OutPiece};

/// Keeps a response with its conversation: the history it continued, then its output as the
/// assistant's turn.
pub(super) fn keep_response(
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
pub(super) enum Finished {
    InProgress,
    Done(Completion),
    Failed(ApiError),
}

impl From<&Completion> for Finished {
    fn from(done: &Completion) -> Self {
        Finished::Done(done.clone())
    }
}

pub(super) fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// What every event of one response repeats: the request's settings, echoed.
pub(super) struct Meta {
    pub(super) id: String,
    created_at: u64,
    model: String,
    echo: Value,
}

impl Meta {
    pub(super) fn new(state: &AppState, req: &ResponsesRequest, params: &SamplingParams) -> Self {
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
    pub(super) fn object(&self, finished: &Finished, output: &[Value]) -> Value {
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
pub(super) fn response_error_code(e: &ApiError) -> &'static str {
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

pub(super) fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "message",
        "id": id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    })
}

pub(super) fn reasoning_item(id: &str, text: &str) -> Value {
    json!({
        "type": "reasoning",
        "id": id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    })
}

pub(super) fn call_item(
    id: &str,
    call_id: &str,
    name: &str,
    arguments: &str,
    status: &str,
) -> Value {
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
pub(super) fn item_status(done: &Completion) -> &'static str {
    match done.done_reason {
        DoneReason::Stop => "completed",
        DoneReason::Length | DoneReason::Timeout => "incomplete",
    }
}

/// The output items of a piece of a whole answer; a message cut by the token limit is
/// `incomplete` (`status`).
pub(super) fn whole_items(piece: OutPiece, status: &str) -> Vec<Value> {
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
