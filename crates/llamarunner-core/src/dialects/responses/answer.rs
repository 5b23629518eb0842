//! The parts of a response: the response object (`Meta`, its status from `Finished`, usage,
//! error code), its output items, and the conversation kept with a finished response, filled
//! into the wire types of `wire.rs`.

use std::time::SystemTime;

use serde::Serialize;
use serde_json::{json, Value};

use super::request::ResponsesRequest;
use super::wire::{
    Echo, EmptyList, IncompleteDetails, InputDetails, OutputDetails, OutputItem, OutputText,
    ReasoningText, Response, ResponseError, Usage,
};
use crate::http::error::ApiError;
use crate::http::response_store::{ResponseStore, Stored};
use crate::http::state::AppState;
use crate::protocol::params::SamplingParams;
use crate::protocol::{Completion, DoneReason};
use crate::requests::common::unix_seconds;
use crate::requests::tool_calls::{self, OutPiece};

/// Keeps a response with its conversation: the history it continued, then its output as the
/// assistant's turn (a chat message, as the template reads it). The response is kept as JSON.
pub(super) fn keep_response(
    store: &ResponseStore,
    id: &str,
    mut messages: Vec<Value>,
    items: &[OutputItem],
    response: &impl Serialize,
) {
    let mut text = String::new();
    let mut calls = Vec::new();
    for item in items {
        match item {
            OutputItem::Message { content, .. } => {
                if let Some(part) = content.first() {
                    text.push_str(&part.text);
                }
            }
            OutputItem::FunctionCall {
                call_id,
                name,
                arguments,
                ..
            } => calls.push(json!({
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            })),
            OutputItem::Reasoning { .. } => {}
        }
    }
    let mut turn = json!({"role": "assistant", "content": text});
    if !calls.is_empty() {
        turn["tool_calls"] = Value::Array(calls);
    }
    messages.push(turn);
    // Plain fields: serde_json cannot fail to write them (null if it ever did).
    let response = serde_json::to_value(response).unwrap_or_default();
    store.put(id.to_string(), Stored { messages, response });
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
    echo: Echo,
}

impl Meta {
    pub(super) fn new(state: &AppState, req: &ResponsesRequest, params: &SamplingParams) -> Self {
        // The request's own tools, choice, format and reasoning, echoed as given (read once,
        // with the request).
        let echo = Echo {
            instructions: req.instructions.clone(),
            max_output_tokens: req.max_output_tokens,
            parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
            previous_response_id: req.previous_response_id.clone(),
            temperature: f64::from(params.temperature),
            top_p: f64::from(params.top_p),
            tool_choice: req
                .tool_choice
                .clone()
                .filter(|v| !v.is_null())
                .unwrap_or(json!("auto")),
            tools: req.tools.clone().unwrap_or_default(),
            text: req
                .text
                .clone()
                .filter(Value::is_object)
                .unwrap_or(json!({"format": {"type": "text"}})),
            reasoning: req
                .reasoning
                .clone()
                .filter(Value::is_object)
                .unwrap_or(json!({"effort": null, "summary": null})),
            store: req.store != Some(false),
            truncation: req.truncation.as_deref().unwrap_or("disabled").to_string(),
            metadata: req
                .metadata
                .clone()
                .filter(Value::is_object)
                .unwrap_or(json!({})),
        };
        Self {
            id: new_id("resp"),
            created_at: unix_seconds(SystemTime::now()),
            model: state.model_name.to_string(),
            echo,
        }
    }

    /// The response object with this status and output.
    pub(super) fn object<'a>(
        &'a self,
        finished: &Finished,
        output: &'a [OutputItem],
    ) -> Response<'a> {
        let mut error = None;
        let mut incomplete_details = None;
        let (status, usage) = match finished {
            Finished::InProgress => ("in_progress", None),
            Finished::Failed(e) => {
                error = Some(ResponseError {
                    code: response_error_code(e),
                    message: e.to_string(),
                });
                ("failed", None)
            }
            Finished::Done(done) => {
                let status = match done.done_reason {
                    DoneReason::Length | DoneReason::Timeout => {
                        incomplete_details = Some(IncompleteDetails {
                            reason: "max_output_tokens",
                        });
                        "incomplete"
                    }
                    DoneReason::Stop => "completed",
                };
                (status, Some(usage(done)))
            }
        };
        Response {
            id: &self.id,
            object: "response",
            created_at: self.created_at,
            model: &self.model,
            output,
            error,
            incomplete_details,
            usage,
            status,
            echo: &self.echo,
        }
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

fn usage(done: &Completion) -> Usage {
    Usage {
        input_tokens: done.prompt_eval_count,
        input_tokens_details: InputDetails {
            cached_tokens: done.prompt_cached_count,
            cache_write_tokens: 0,
        },
        output_tokens: done.eval_count,
        output_tokens_details: OutputDetails {
            reasoning_tokens: 0,
        },
        total_tokens: done.prompt_eval_count + done.eval_count,
    }
}

/// A message item with its one text part.
pub(super) fn message_item(
    id: impl Into<String>,
    text: impl Into<String>,
    status: &'static str,
) -> OutputItem {
    OutputItem::Message {
        id: id.into(),
        status,
        role: "assistant",
        content: vec![OutputText {
            text: text.into(),
            annotations: EmptyList,
            logprobs: Some(EmptyList),
        }],
    }
}

/// A reasoning item with its one text part.
pub(super) fn reasoning_item(id: impl Into<String>, text: impl Into<String>) -> OutputItem {
    OutputItem::Reasoning {
        id: id.into(),
        summary: EmptyList,
        content: vec![ReasoningText { text: text.into() }],
    }
}

/// A function call item.
pub(super) fn call_item(
    id: impl Into<String>,
    call_id: impl Into<String>,
    name: impl Into<String>,
    arguments: impl Into<String>,
    status: &'static str,
) -> OutputItem {
    OutputItem::FunctionCall {
        id: id.into(),
        call_id: call_id.into(),
        name: name.into(),
        arguments: arguments.into(),
        status,
    }
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
pub(super) fn whole_items(piece: OutPiece, status: &'static str) -> Vec<OutputItem> {
    match piece {
        OutPiece::Reasoning(t) => vec![reasoning_item(new_id("rs"), t)],
        OutPiece::Content(t) => vec![message_item(new_id("msg"), t, status)],
        OutPiece::Calls(calls) => calls
            .into_iter()
            .map(|c| {
                call_item(
                    new_id("fc"),
                    tool_calls::call_id(),
                    c.name,
                    c.arguments.to_string(),
                    "completed",
                )
            })
            .collect(),
    }
}
