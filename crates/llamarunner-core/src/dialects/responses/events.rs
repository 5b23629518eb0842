//! A streamed response: `Items`, which writes the answer as the `response.*` events (output
//! items added, filled by deltas and done, numbered) and keeps the whole response at the end.

use std::sync::Arc;

use axum::response::sse::Event as SseEvent;
use serde_json::{json, Value};

use super::answer::{
    call_item, item_status, keep_response, message_item, new_id, reasoning_item,
    response_error_code, Finished, Meta,
};
use crate::dialects::blocks::{Kind, Step};
use crate::dialects::llama_server::{timings, StreamClock};
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
    done: Vec<Value>,
    sequence: u64,
    store: Option<(Arc<ResponseStore>, Vec<Value>)>,
    /// llama-server's `timings_per_token`: the timings the deltas of the text event being
    /// written carry.
    clock: Option<StreamClock>,
    delta_timings: Option<Value>,
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

    pub(super) fn event(&mut self, kind: &str, mut data: Value) -> SseEvent {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        if let (true, Some(t)) = (kind.ends_with(".delta"), &self.delta_timings) {
            data["timings"] = t.clone();
        }
        self.sequence += 1;
        SseEvent::default()
            .event(kind)
            .data(crate::dialects::stream_json::to_line(&data))
    }

    pub(super) fn on(&mut self, e: Event) -> Vec<SseEvent> {
        let mut out = Vec::new();
        match e {
            Event::Started { .. } => {}
            // llama-server's `return_progress`: another `response.in_progress` that says how
            // far the prompt's decode is.
            Event::Progress(p) => {
                let response = self.meta.object(&Finished::InProgress, &[]);
                let data = json!({
                    "response": response,
                    "prompt_progress": crate::dialects::llama_server::prompt_progress(&p),
                });
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
                let response = self.meta.object(&finished, &self.done);
                if let Some((store, history)) = self.store.take() {
                    keep_response(&store, &self.meta.id, history, &self.done, &response);
                }
                let kind = if response["status"] == "completed" {
                    "response.completed"
                } else {
                    "response.incomplete"
                };
                // The engine's timings of the whole answer, as llama-server ends with them.
                let data = json!({"response": response, "timings": timings(&done)});
                out.push(self.event(kind, data));
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
        for step in self.blocks.piece(piece) {
            self.write(step, out, "completed");
        }
    }

    fn close(&mut self, out: &mut Vec<SseEvent>) {
        self.close_as(out, "completed");
    }

    /// Closes the open item; a message gets `status`.
    fn close_as(&mut self, out: &mut Vec<SseEvent>, status: &str) {
        if let Some(step) = self.blocks.close() {
            self.write(step, out, status);
        }
    }

    /// The events of one step; a message closed gets `status`.
    fn write(&mut self, step: Step, out: &mut Vec<SseEvent>, status: &str) {
        let index = self.index();
        match step {
            Step::Open(Kind::Reasoning) => {
                let id = new_id("rs");
                let item = json!({"type": "reasoning", "id": id, "summary": [], "content": []});
                out.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                ));
                self.open_id = id;
            }
            Step::Open(Kind::Text) => {
                let id = new_id("msg");
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
                self.open_id = id;
            }
            Step::Delta(Kind::Reasoning, t) => {
                let id = self.open_id.clone();
                out.push(self.event(
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t}),
                ));
            }
            Step::Delta(Kind::Text, t) => {
                let id = self.open_id.clone();
                out.push(self.event(
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "delta": t, "logprobs": []}),
                ));
            }
            Step::Close(kind, text) => {
                let id = std::mem::take(&mut self.open_id);
                let item = match kind {
                    Kind::Reasoning => {
                        out.push(self.event(
                            "response.reasoning_text.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0,
                                   "text": text}),
                        ));
                        reasoning_item(&id, &text)
                    }
                    Kind::Text => {
                        out.push(self.event(
                            "response.output_text.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0,
                                   "text": text, "logprobs": []}),
                        ));
                        out.push(self.event(
                            "response.content_part.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0,
                                   "part": {"type": "output_text", "text": text,
                                            "annotations": []}}),
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
            Step::Call(c) => {
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
