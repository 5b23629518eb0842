//! A streamed response: `Items`, which writes the answer as the `response.*` events (output
//! items added, filled by deltas and done, numbered) and keeps the whole response at the end
//! (the events' wire types are in `wire.rs`).

use std::sync::Arc;

use axum::response::sse::Event as SseEvent;
use serde::Serialize;
use serde_json::Value;

use super::answer::{
    call_item, item_status, keep_response, message_item, new_id, reasoning_item,
    response_error_code, Finished, Meta,
};
use super::wire::{
    ArgumentsDoneEvent, DeltaEvent, EmptyList, ErrorEvent, Event as WireEvent, ItemEvent,
    OutputItem, OutputText, PartEvent, ResponseEvent, TextDoneEvent,
};
use crate::dialects::blocks::{Kind, Step};
use crate::dialects::llama_server::{timings, PromptProgress, StreamClock, Timings};
use crate::http::error::ApiError;
use crate::http::response_store::ResponseStore;
use crate::protocol::Event;
use crate::requests::tool_calls::{self, ChatOutput, OutPiece};

/// Writes a streamed answer as output items, each added, filled by deltas and done, with the
/// events' `sequence_number`s (`dialects/blocks.rs` decides when); at the end, the whole
/// response (kept unless `store: false`).
pub(super) struct Items {
    meta: Arc<Meta>,
    output: ChatOutput,
    blocks: crate::dialects::blocks::Blocks,
    /// The id of the item being streamed.
    open_id: String,
    done: Vec<OutputItem>,
    sequence: u64,
    store: Option<(Arc<ResponseStore>, Vec<Value>)>,
    /// llama-server's `timings_per_token`: the timings the deltas of the text event being
    /// written carry.
    clock: Option<StreamClock>,
    delta_timings: Option<Timings>,
}

impl Items {
    pub(super) fn new(
        meta: Arc<Meta>,
        output: ChatOutput,
        store: Option<(Arc<ResponseStore>, Vec<Value>)>,
        clock: Option<StreamClock>,
    ) -> Self {
        Self {
            meta,
            output,
            blocks: Default::default(),
            open_id: String::new(),
            done: Vec::new(),
            sequence: 0,
            store,
            clock,
            delta_timings: None,
        }
    }

    /// The event `kind` with this payload and the next sequence number (and, on a delta,
    /// the timings of `timings_per_token`).
    pub(super) fn event(&mut self, kind: &str, data: impl Serialize) -> SseEvent {
        let timings = self
            .delta_timings
            .as_ref()
            .filter(|_| kind.ends_with(".delta"));
        let event = WireEvent {
            data,
            kind,
            sequence_number: self.sequence,
            timings,
        };
        let line = crate::dialects::stream_json::to_line(&event);
        self.sequence += 1;
        SseEvent::default().event(kind).data(line)
    }

    pub(super) fn on(&mut self, e: Event) -> Vec<SseEvent> {
        let mut out = Vec::new();
        match e {
            Event::Started { .. } => {}
            // llama-server's `return_progress`: another `response.in_progress` that says how
            // far the prompt's decode is.
            Event::Progress(p) => {
                let meta = self.meta.clone();
                let data = ResponseEvent {
                    response: meta.object(&Finished::InProgress, &[]),
                    prompt_progress: Some(PromptProgress::from(&p)),
                    timings: None,
                };
                out.push(self.event("response.in_progress", data));
            }
            Event::Text { text, logprobs } => {
                self.delta_timings = self.clock.as_mut().map(|clock| {
                    clock.text(logprobs.len());
                    clock.timings()
                });
                for piece in self.output.push(&text) {
                    self.piece(piece, &mut out);
                }
                self.delta_timings = None;
            }
            Event::Done(done) => {
                for piece in self.output.finish() {
                    self.piece(piece, &mut out);
                }
                self.close_as(&mut out, item_status(&done));
                let finished = Finished::from(&done);
                // The answer ends here: its items go to the last response object.
                let meta = self.meta.clone();
                let done_items = std::mem::take(&mut self.done);
                let response = meta.object(&finished, &done_items);
                if let Some((store, history)) = self.store.take() {
                    keep_response(&store, &meta.id, history, &done_items, &response);
                }
                let kind = if response.status == "completed" {
                    "response.completed"
                } else {
                    "response.incomplete"
                };
                // The engine's timings of the whole answer, as llama-server ends with them.
                let data = ResponseEvent {
                    response,
                    prompt_progress: None,
                    timings: Some(timings(&done)),
                };
                out.push(self.event(kind, data));
            }
            Event::Error(e) => {
                self.close(&mut out);
                let e = ApiError::from(e);
                out.push(self.event(
                    "error",
                    ErrorEvent {
                        code: response_error_code(&e),
                        message: e.to_string(),
                        param: None,
                    },
                ));
                let meta = self.meta.clone();
                let done_items = std::mem::take(&mut self.done);
                let data = ResponseEvent {
                    response: meta.object(&Finished::Failed(e), &done_items),
                    prompt_progress: None,
                    timings: None,
                };
                out.push(self.event("response.failed", data));
            }
        }
        out
    }

    fn index(&self) -> usize {
        self.done.len()
    }

    fn piece(&mut self, piece: OutPiece, out: &mut Vec<SseEvent>) {
        for step in self.blocks.piece(piece) {
            self.write(step, out, "completed");
        }
    }

    fn close(&mut self, out: &mut Vec<SseEvent>) {
        self.close_as(out, "completed");
    }

    /// Closes the open item; a message gets `status`.
    fn close_as(&mut self, out: &mut Vec<SseEvent>, status: &'static str) {
        if let Some(step) = self.blocks.close() {
            self.write(step, out, status);
        }
    }

    /// The events of one step; a message closed gets `status`.
    fn write(&mut self, step: Step, out: &mut Vec<SseEvent>, status: &'static str) {
        let index = self.index();
        match step {
            Step::Open(Kind::Reasoning) => {
                let id = new_id("rs");
                let item = OutputItem::Reasoning {
                    id: id.clone(),
                    summary: EmptyList,
                    content: Vec::new(),
                };
                out.push(self.item_event("response.output_item.added", index, &item));
                self.open_id = id;
            }
            Step::Open(Kind::Text) => {
                let id = new_id("msg");
                let item = OutputItem::Message {
                    id: id.clone(),
                    status: "in_progress",
                    role: "assistant",
                    content: Vec::new(),
                };
                out.push(self.item_event("response.output_item.added", index, &item));
                out.push(self.event(
                    "response.content_part.added",
                    PartEvent {
                        item_id: &id,
                        output_index: index,
                        content_index: 0,
                        part: part(String::new()),
                    },
                ));
                self.open_id = id;
            }
            Step::Delta(kind, t) => {
                let (name, logprobs) = match kind {
                    Kind::Reasoning => ("response.reasoning_text.delta", None),
                    Kind::Text => ("response.output_text.delta", Some(EmptyList)),
                };
                let id = std::mem::take(&mut self.open_id);
                out.push(self.event(
                    name,
                    DeltaEvent {
                        item_id: &id,
                        output_index: index,
                        content_index: Some(0),
                        delta: &t,
                        logprobs,
                    },
                ));
                self.open_id = id;
            }
            Step::Close(kind, text) => {
                let id = std::mem::take(&mut self.open_id);
                let (name, logprobs) = match kind {
                    Kind::Reasoning => ("response.reasoning_text.done", None),
                    Kind::Text => ("response.output_text.done", Some(EmptyList)),
                };
                out.push(self.event(
                    name,
                    TextDoneEvent {
                        item_id: &id,
                        output_index: index,
                        content_index: 0,
                        text: &text,
                        logprobs,
                    },
                ));
                if kind == Kind::Text {
                    out.push(self.event(
                        "response.content_part.done",
                        PartEvent {
                            item_id: &id,
                            output_index: index,
                            content_index: 0,
                            part: part(text.clone()),
                        },
                    ));
                }
                let item = match kind {
                    Kind::Reasoning => reasoning_item(id, text),
                    Kind::Text => message_item(id, text, status),
                };
                out.push(self.item_event("response.output_item.done", index, &item));
                self.done.push(item);
            }
            Step::Call(c) => {
                let (id, call_id) = (new_id("fc"), tool_calls::call_id());
                let arguments = c.arguments.to_string();
                let added = call_item(
                    id.clone(),
                    call_id.clone(),
                    c.name.clone(),
                    "",
                    "in_progress",
                );
                out.push(self.item_event("response.output_item.added", index, &added));
                out.push(self.event(
                    "response.function_call_arguments.delta",
                    DeltaEvent {
                        item_id: &id,
                        output_index: index,
                        content_index: None,
                        delta: &arguments,
                        logprobs: None,
                    },
                ));
                out.push(self.event(
                    "response.function_call_arguments.done",
                    ArgumentsDoneEvent {
                        item_id: &id,
                        output_index: index,
                        name: &c.name,
                        arguments: &arguments,
                    },
                ));
                let item = call_item(id, call_id, c.name, arguments, "completed");
                out.push(self.item_event("response.output_item.done", index, &item));
                self.done.push(item);
            }
        }
    }

    /// `response.output_item.added` or `.done`.
    fn item_event(&mut self, kind: &str, output_index: usize, item: &OutputItem) -> SseEvent {
        self.event(kind, ItemEvent { output_index, item })
    }
}

/// A message's text part as the `response.content_part.*` events write it.
fn part(text: String) -> OutputText {
    OutputText {
        text,
        annotations: EmptyList,
        logprobs: None,
    }
}
