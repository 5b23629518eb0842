//! A streamed Anthropic answer: its server-sent events, and `Blocks`, which writes the answer
//! as content blocks opened, filled by deltas and closed (the events' wire types are in
//! `wire.rs`).

use std::borrow::Cow;
use std::sync::Arc;

use axum::response::sse::Event as SseEvent;
use serde::Serialize;
use serde_json::Value;

use super::answer::{tool_use_id, usage, Meta};
use super::wire::{ContentBlock, Delta, StopDelta, StreamEvent};
use crate::dialects::blocks::{Kind, Step};
use crate::http::error::ApiError;
use crate::protocol::Event;
use crate::requests::tool_calls::{ChatOutput, OutPiece};

/// One server-sent event named by its `type`, as Anthropic sends them.
pub(super) fn event(data: &StreamEvent) -> SseEvent {
    named(data.name(), data)
}

/// One server-sent event with this name and data.
fn named(name: &str, data: &(impl Serialize + ?Sized)) -> SseEvent {
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
                let (stop_reason, stop_sequence) = self.meta.stop_reason(&done, self.called);
                out.push(event(&StreamEvent::MessageDelta {
                    delta: StopDelta {
                        stop_reason,
                        stop_sequence,
                    },
                    usage: usage(&done),
                }));
                out.push(event(&StreamEvent::MessageStop));
            }
            Event::Error(e) => {
                self.close(&mut out);
                // The error body is `http/error.rs`' (`{"type": "error", ...}`).
                out.push(named("error", &ApiError::from(e).anthropic_body()));
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
                let content_block = match kind {
                    Kind::Reasoning => ContentBlock::Thinking {
                        thinking: "",
                        signature: "",
                    },
                    Kind::Text => ContentBlock::Text { text: "" },
                };
                out.push(event(&StreamEvent::ContentBlockStart {
                    index,
                    content_block,
                }));
            }
            Step::Delta(Kind::Reasoning, t) => {
                out.push(self.delta(Delta::Thinking { thinking: &t }));
            }
            Step::Delta(Kind::Text, t) => {
                out.push(self.delta(Delta::Text { text: &t }));
            }
            Step::Close(..) => {
                out.push(event(&StreamEvent::ContentBlockStop { index }));
                self.next += 1;
            }
            Step::Call(call) => {
                self.called = true;
                out.push(event(&StreamEvent::ContentBlockStart {
                    index,
                    content_block: ContentBlock::ToolUse {
                        id: tool_use_id(),
                        name: &call.name,
                        input: Cow::Owned(Value::Object(Default::default())),
                    },
                }));
                out.push(event(&StreamEvent::ContentBlockDelta {
                    index,
                    delta: Delta::InputJson {
                        partial_json: call.arguments.to_string(),
                    },
                }));
                out.push(event(&StreamEvent::ContentBlockStop { index }));
                self.next += 1;
            }
        }
    }

    fn delta(&self, delta: Delta) -> SseEvent {
        event(&StreamEvent::ContentBlockDelta {
            index: self.next,
            delta,
        })
    }
}
