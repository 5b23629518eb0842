//! A streamed Anthropic answer: its server-sent events, and `Blocks`, which writes the answer
//! as content blocks opened, filled by deltas and closed.

use std::sync::Arc;

use axum::response::sse::Event as SseEvent;
use serde_json::{json, Value};

use super::answer::{tool_use_id, usage, Meta};
use crate::http::error::ApiError;
use crate::protocol::Event;
use crate::requests::tool_calls::{ChatOutput, OutPiece};

/// One server-sent event named by its `type`, as Anthropic sends them.
pub(super) fn event(data: &Value) -> SseEvent {
    let name = data
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("message");
    SseEvent::default()
        .event(name)
        .data(crate::dialects::stream_json::to_line(data))
}

/// The kind of the content block being streamed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Open {
    Thinking,
    Text,
}

/// Writes a streamed answer as content blocks: one thinking block, one text block for each
/// run of text, one tool_use block per call; each opened, filled by deltas, closed.
pub(super) struct Blocks {
    meta: Arc<Meta>,
    output: ChatOutput,
    open: Option<Open>,
    /// Index of the next block.
    next: usize,
    called: bool,
}

impl Blocks {
    pub(super) fn new(meta: Arc<Meta>, output: ChatOutput) -> Self {
        Self {
            meta,
            output,
            open: None,
            next: 0,
            called: false,
        }
    }

    pub(super) fn on(&mut self, e: Event) -> Vec<SseEvent> {
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
