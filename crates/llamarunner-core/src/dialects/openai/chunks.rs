//! A streamed OpenAI answer: the server-sent chunks of each engine event (text, progress, a
//! chat answer's reasoning and tool-call deltas), the last chunks and `data: [DONE]`.

use axum::response::sse::Event as SseEvent;
use serde_json::{json, Value};

use super::answer::{finish_reason, usage, Meta};
use crate::dialects::llama_server::{prompt_progress, timings};
use crate::http::error::ApiError;
use crate::protocol::{Completion, Event, TokenLogprob};
use crate::requests::tool_calls::{self, ChatOutput, OutPiece};

pub(super) fn sse(value: Value) -> SseEvent {
    SseEvent::default().data(crate::dialects::stream_json::to_line(&value))
}

/// With `include_usage`, every chunk carries `"usage": null` until the last, as OpenAI's do.
pub(super) fn with_usage_null(meta: &Meta, mut body: Value) -> Value {
    if meta.include_usage {
        body["usage"] = Value::Null;
    }
    body
}

/// The SSE events for one engine event.
pub(super) fn chunks_for(meta: &Meta, event: Event, want_logprobs: bool) -> Vec<SseEvent> {
    match event {
        Event::Started { .. } => Vec::new(),
        // llama-server's `return_progress`: a chunk without choices that says how far the
        // prompt's decode is.
        Event::Progress(p) => {
            let mut body = meta.body(true, Vec::new());
            body["prompt_progress"] = prompt_progress(&p);
            vec![sse(with_usage_null(meta, body))]
        }
        Event::Text { text, logprobs } => {
            let choice = meta.choice(Some(&text), &logprobs, want_logprobs, None, true);
            vec![sse(with_usage_null(meta, meta.body(true, vec![choice])))]
        }
        Event::Done(done) => done_chunks(meta, &done, finish_reason(done.done_reason)),
        Event::Error(e) => vec![sse(ApiError::from(e).openai_body())],
    }
}

/// The last chunks: the finish reason, the usage when asked for, `[DONE]`.
fn done_chunks(meta: &Meta, done: &Completion, finish: &str) -> Vec<SseEvent> {
    let text = if meta.chat { None } else { Some("") };
    let choice = meta.choice(text, &[], false, Some(finish), true);
    let mut out = vec![sse(with_usage_null(meta, meta.body(true, vec![choice])))];
    if meta.ends_stream {
        out.extend(stream_end(meta, usage(done), Some(timings(done))));
    }
    out
}

/// The stream's last events: the usage when asked for (with the answer's `timings` when there
/// is one answer), `[DONE]`.
pub(super) fn stream_end(meta: &Meta, usage: Value, timings: Option<Value>) -> Vec<SseEvent> {
    let mut out = Vec::new();
    if meta.include_usage {
        let mut last = meta.body(true, Vec::new());
        last["usage"] = usage;
        if let Some(timings) = timings {
            last["timings"] = timings;
        }
        out.push(sse(last));
    }
    out.push(SseEvent::default().data("[DONE]"));
    out
}

/// The deltas of one piece of a chat answer: text, reasoning, or one delta per call (its id,
/// name and whole arguments), as OpenAI streams them.
fn piece_deltas(piece: OutPiece) -> Vec<Value> {
    match piece {
        OutPiece::Content(t) => vec![json!({"content": t})],
        OutPiece::Reasoning(t) => vec![json!({"reasoning_content": t})],
        OutPiece::Calls(calls) => calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"tool_calls": [{
                    "index": i,
                    "id": tool_calls::call_id(),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments.to_string()},
                }]})
            })
            .collect(),
    }
}

/// The SSE events of one engine event of a chat answer read for calls or reasoning.
pub(super) fn chat_chunks(
    meta: &Meta,
    reader: &mut ChatOutput,
    called: &mut bool,
    event: Event,
    want_logprobs: bool,
) -> Vec<SseEvent> {
    let (pieces, logprobs, done) = match event {
        Event::Text { text, logprobs } => (reader.push(&text), logprobs, None),
        Event::Done(done) => (reader.finish(), Vec::new(), Some(done)),
        other => return chunks_for(meta, other, want_logprobs),
    };
    let mut deltas: Vec<Value> = Vec::new();
    for piece in pieces {
        *called |= matches!(piece, OutPiece::Calls(_));
        deltas.extend(piece_deltas(piece));
    }
    if deltas.is_empty() && want_logprobs && !logprobs.is_empty() {
        // Held-back text still reports its tokens' log-probabilities.
        deltas.push(json!({"content": ""}));
    }
    let mut out: Vec<SseEvent> = deltas
        .into_iter()
        .enumerate()
        .map(|(i, delta)| {
            let lp: &[TokenLogprob] = if i == 0 { &logprobs } else { &[] };
            let mut choice = meta.choice(None, lp, want_logprobs && i == 0, None, true);
            choice["delta"] = delta;
            sse(with_usage_null(meta, meta.body(true, vec![choice])))
        })
        .collect();
    if let Some(done) = done {
        let finish = if *called {
            "tool_calls"
        } else {
            finish_reason(done.done_reason)
        };
        out.extend(done_chunks(meta, &done, finish));
    }
    out
}
