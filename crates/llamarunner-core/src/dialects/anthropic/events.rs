//! A streamed Anthropic answer: its server-sent events, and `Blocks`, which writes the answer
//! as content blocks opened, filled by deltas and closed.

use std::sync::Arc;

use axum::response::sse::Event as SseEvent;
use serde_json::{json, Value};

use super::answer::{tool_use_id, usage, Meta};
use crate::dialects::blocks::{Kind, Step};
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

/// Writes a streamed answer as content blocks: one thinking block, one text block for each
/// run of text, one tool_use block per call; each opened, filled by deltas, closed
/// (`dialects/blocks.rs` decides when).
pub(super) struct Blocks {
    meta: Arc<Meta>,
    output: ChatOutput,
    blocks: crate::dialects::blocks::Blocks,
    /// Index of the next block.
    next: usize,
    called: bool,
}

impl Blocks {
    pub(super) fn new(meta: Arc<Meta>, output: ChatOutput) -> Self {
        Self {
            meta,
            output,
            blocks: Default::default(),
            next: 0,
            called: false,
        }
    }

    pub(super) fn on(&mut self, e: Event) -> Vec<SseEvent> {
        let mut out = Vec::new();
        match e {
            Event::Started { .. } | Event::Progress(_) => {}
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
        for step in self.blocks.piece(piece) {
            self.write(step, out);
        }
    }

    fn close(&mut self, out: &mut Vec<SseEvent>) {
        if let Some(step) = self.blocks.close() {
            self.write(step, out);
        }
    }

    /// The events of one step.
    fn write(&mut self, step: Step, out: &mut Vec<SseEvent>) {
        let index = self.next;
        match step {
            Step::Open(kind) => {
                let block = match kind {
                    Kind::Reasoning => json!({"type": "thinking", "thinking": "", "signature": ""}),
                    Kind::Text => json!({"type": "text", "text": ""}),
                };
                out.push(event(&json!({
                    "type": "content_block_start",
                    "index": index,
                    "content_block": block,
                })));
            }
            Step::Delta(Kind::Reasoning, t) => {
                out.push(self.delta(json!({"type": "thinking_delta", "thinking": t})));
            }
            Step::Delta(Kind::Text, t) => {
                out.push(self.delta(json!({"type": "text_delta", "text": t})));
            }
            Step::Close(..) => {
                out.push(event(
                    &json!({"type": "content_block_stop", "index": index}),
                ));
                self.next += 1;
            }
            Step::Call(call) => {
                self.called = true;
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

    fn delta(&self, delta: Value) -> SseEvent {
        event(&json!({"type": "content_block_delta", "index": self.next, "delta": delta}))
    }
}
