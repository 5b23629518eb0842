//! A streamed OpenAI answer: the server-sent chunks of each engine event (text, progress, a
//! chat answer's reasoning and tool-call deltas), the last chunks and `data: [DONE]` (the
//! chunks' wire types are in `wire.rs`).

use std::borrow::Cow;

use axum::response::sse::Event as SseEvent;
use serde::Serialize;

use super::answer::{finish_reason, tool_call, usage, Meta};
use super::wire::{Body, Delta, Says, Usage};
use crate::dialects::llama_server::{timings, PromptProgress, Timings};
use crate::http::error::ApiError;
use crate::protocol::{Completion, Event, TokenLogprob};
use crate::requests::tool_calls::{ChatOutput, OutPiece};

/// One server-sent event with this JSON as its data.
pub(super) fn sse(value: &impl Serialize) -> SseEvent {
    SseEvent::default().data(crate::dialects::stream_json::to_line(value))
}

/// With `include_usage`, every chunk carries `"usage": null` until the last, as OpenAI's do.
pub(super) fn with_usage_null<'a>(meta: &Meta, mut body: Body<'a>) -> Body<'a> {
    if meta.include_usage {
        body.usage = Some(None);
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
            body.prompt_progress = Some(PromptProgress::from(&p));
            vec![sse(&with_usage_null(meta, body))]
        }
        Event::Text { text, logprobs } => {
            let choice = meta.choice(Some(&text), &logprobs, want_logprobs, None, true);
            vec![sse(&with_usage_null(meta, meta.body(true, vec![choice])))]
        }
        Event::Done(done) => done_chunks(meta, &done, finish_reason(done.done_reason)),
        Event::Error(e) => vec![sse(&ApiError::from(e).openai_body())],
    }
}

/// The last chunks: the finish reason, the usage when asked for, `[DONE]`.
fn done_chunks(meta: &Meta, done: &Completion, finish: &'static str) -> Vec<SseEvent> {
    let text = if meta.chat { None } else { Some("") };
    let choice = meta.choice(text, &[], false, Some(finish), true);
    let mut out = vec![sse(&with_usage_null(meta, meta.body(true, vec![choice])))];
    if meta.ends_stream {
        out.extend(stream_end(meta, Some(usage(done)), Some(timings(done))));
    }
    out
}

/// The stream's last events: the usage when asked for (with the answer's `timings` when there
/// is one answer), `[DONE]`. A usage of None is written as null.
pub(super) fn stream_end(
    meta: &Meta,
    usage: Option<Usage>,
    timings: Option<Timings>,
) -> Vec<SseEvent> {
    let mut out = Vec::new();
    if meta.include_usage {
        let mut last = meta.body(true, Vec::new());
        last.usage = Some(usage);
        last.timings = timings;
        out.push(sse(&last));
    }
    out.push(SseEvent::default().data("[DONE]"));
    out
}

/// The deltas of one piece of a chat answer: text, reasoning, or one delta per call (its id,
/// name and whole arguments), as OpenAI streams them.
fn piece_deltas(piece: OutPiece) -> Vec<Delta<'static>> {
    match piece {
        OutPiece::Content(t) => vec![Delta {
            content: Some(Some(Cow::Owned(t))),
            ..Delta::default()
        }],
        OutPiece::Reasoning(t) => vec![Delta {
            reasoning_content: Some(Cow::Owned(t)),
            ..Delta::default()
        }],
        OutPiece::Calls(calls) => calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| Delta {
                tool_calls: Some(vec![tool_call(Some(i), Cow::Owned(c.name), &c.arguments)]),
                ..Delta::default()
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
    let mut deltas: Vec<Delta> = Vec::new();
    for piece in pieces {
        *called |= matches!(piece, OutPiece::Calls(_));
        deltas.extend(piece_deltas(piece));
    }
    if deltas.is_empty() && want_logprobs && !logprobs.is_empty() {
        // Held-back text still reports its tokens' log-probabilities.
        deltas.push(Delta {
            content: Some(Some(Cow::Borrowed(""))),
            ..Delta::default()
        });
    }
    let mut out: Vec<SseEvent> = deltas
        .into_iter()
        .enumerate()
        .map(|(i, delta)| {
            let lp: &[TokenLogprob] = if i == 0 { &logprobs } else { &[] };
            let mut choice = meta.choice(None, lp, want_logprobs && i == 0, None, true);
            choice.says = Says::Delta(delta);
            sse(&with_usage_null(meta, meta.body(true, vec![choice])))
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
