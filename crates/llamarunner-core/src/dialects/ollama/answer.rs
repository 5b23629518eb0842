//! Generate's and chat's answers: one object (`"stream": false`) or NDJSON lines, each text
//! piece a line and the last with the statistics; a chat's thinking and calls split out.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;

use super::wire::{Answer, ErrorLine, FunctionCall, Message, Says, Stats, ToolCall};
use crate::chat::tools;
use crate::dialects::openai::{chat_logprob, LogprobEntry};
use crate::http::error::{ApiError, OllamaError};
use crate::http::state::AppState;
use crate::protocol::nanos;
use crate::protocol::params::SamplingParams;
use crate::protocol::{Completion, Event, TokenLogprob};
use crate::requests::common::{collect, rfc3339, start_generation};
use crate::requests::image_prompt::Prompt;
use crate::requests::tool_calls::{ChatOutput, OutPiece};

/// `logprobs` of a line: each token's entry (`dialects::openai::chat_logprob`'s shape, which
/// Ollama's API shares).
fn logprob_entries(entries: &[TokenLogprob]) -> Vec<LogprobEntry> {
    entries.iter().map(chat_logprob).collect()
}

/// What a streamed line or the final object needs.
pub(super) struct Meta {
    pub(super) model: String,
    pub(super) chat: bool,
    pub(super) started: Instant,
}

impl Meta {
    /// A line of text, not the last.
    fn line<'a>(&'a self, text: &'a str) -> Answer<'a> {
        let says = if self.chat {
            Says::Message(Message {
                role: "assistant",
                content: text,
                thinking: None,
                tool_calls: None,
            })
        } else {
            Says::Response(text)
        };
        Answer {
            model: &self.model,
            created_at: rfc3339(SystemTime::now()),
            says,
            done: false,
            done_reason: None,
            stats: None,
            logprobs: None,
        }
    }

    /// A line of a chat answer read for thinking and calls.
    fn piece_line<'a>(&'a self, piece: &'a OutPiece) -> Answer<'a> {
        let mut line = self.line("");
        if let Says::Message(message) = &mut line.says {
            match piece {
                OutPiece::Content(t) => message.content = t,
                OutPiece::Reasoning(t) => message.thinking = Some(t),
                OutPiece::Calls(calls) => message.tool_calls = Some(ollama_calls(calls)),
            }
        }
        line
    }

    /// The last line, or the whole answer.
    fn done<'a>(&'a self, text: &'a str, c: &Completion) -> Answer<'a> {
        Answer {
            done: true,
            done_reason: Some(c.done_reason.as_str()),
            stats: Some(Stats {
                total_duration: nanos(self.started.elapsed()),
                load_duration: 0,
                prompt_eval_count: c.prompt_eval_count,
                prompt_eval_duration: c.prompt_eval_duration_ns,
                eval_count: c.eval_count,
                eval_duration: c.eval_duration_ns,
            }),
            ..self.line(text)
        }
    }

    /// What Ollama answers to a request with nothing to generate: it "loads" the model.
    pub(super) fn loaded(&self) -> Answer<'_> {
        Answer {
            done: true,
            done_reason: Some("load"),
            ..self.line("")
        }
    }
}

/// Ollama's `tool_calls`: the arguments as an object.
fn ollama_calls(calls: &[tools::ToolCall]) -> Vec<ToolCall<'_>> {
    calls
        .iter()
        .enumerate()
        .map(|(index, c)| ToolCall {
            function: FunctionCall {
                index,
                name: &c.name,
                arguments: &c.arguments,
            },
        })
        .collect()
}

/// A streamed line for an engine error.
fn error_line(e: crate::protocol::EngineError) -> Result<Bytes, Infallible> {
    super::ndjson_line(ErrorLine {
        error: ApiError::from(e).to_string(),
    })
}

/// The NDJSON response of these lines.
fn ndjson_response(
    lines: impl futures_util::Stream<Item = Result<Bytes, Infallible>> + Send + 'static,
) -> Result<Response, OllamaError> {
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response())
}

/// A chat answer, with its thinking (`message.thinking`) and calls (`message.tool_calls`)
/// split out; streamed, each piece is a line, as Ollama streams them.
pub(super) async fn respond_chat(
    state: AppState,
    prompt: Prompt,
    params: SamplingParams,
    meta: Meta,
    streaming: bool,
    mut output: ChatOutput,
) -> Result<Response, OllamaError> {
    let want_logprobs = params.logprobs.is_some();
    let rx = start_generation(&state, prompt, params).await?;
    if !streaming {
        let all = collect(rx).await?;
        let answer = output.read_all(&all.text);
        let mut v = meta.done(&answer.content, &all.done);
        if want_logprobs {
            v.logprobs = Some(logprob_entries(&all.logprobs));
        }
        if let Says::Message(message) = &mut v.says {
            if !answer.reasoning.is_empty() {
                message.thinking = Some(&answer.reasoning);
            }
            if !answer.calls.is_empty() {
                message.tool_calls = Some(ollama_calls(&answer.calls));
            }
        }
        return Ok(Json(v).into_response());
    }
    let meta = Arc::new(meta);
    let lines = rx.flat_map(move |event| {
        let lines: Vec<Result<Bytes, Infallible>> = match event {
            Event::Started { .. } | Event::Progress(_) => Vec::new(),
            Event::Text { text, logprobs } => {
                let pieces = output.push(&text);
                let mut lines: Vec<Answer> = pieces.iter().map(|p| meta.piece_line(p)).collect();
                if want_logprobs && !logprobs.is_empty() {
                    // Held-back text still reports its tokens, on a line of its own.
                    if lines.is_empty() {
                        lines.push(meta.line(""));
                    }
                    if let Some(first) = lines.first_mut() {
                        first.logprobs = Some(logprob_entries(&logprobs));
                    }
                }
                lines.into_iter().map(super::ndjson_line).collect()
            }
            Event::Done(c) => {
                let pieces = output.finish();
                let mut lines: Vec<Answer> = pieces.iter().map(|p| meta.piece_line(p)).collect();
                lines.push(meta.done("", &c));
                lines.into_iter().map(super::ndjson_line).collect()
            }
            Event::Error(e) => vec![error_line(e)],
        };
        futures_util::stream::iter(lines)
    });
    ndjson_response(lines)
}

/// A generate answer: the text as generated.
pub(super) async fn respond(
    state: AppState,
    prompt: Prompt,
    params: SamplingParams,
    meta: Meta,
    streaming: bool,
) -> Result<Response, OllamaError> {
    let want_logprobs = params.logprobs.is_some();
    let rx = start_generation(&state, prompt, params).await?;
    if !streaming {
        let all = collect(rx).await?;
        let mut v = meta.done(&all.text, &all.done);
        if want_logprobs {
            v.logprobs = Some(logprob_entries(&all.logprobs));
        }
        return Ok(Json(v).into_response());
    }
    let meta = Arc::new(meta);
    let lines = rx.filter_map(move |event| {
        let line = match event {
            Event::Started { .. } | Event::Progress(_) => None,
            Event::Text { text, logprobs } => {
                let mut line = meta.line(&text);
                if want_logprobs {
                    line.logprobs = Some(logprob_entries(&logprobs));
                }
                Some(super::ndjson_line(line))
            }
            Event::Done(c) => Some(super::ndjson_line(meta.done("", &c))),
            Event::Error(e) => Some(error_line(e)),
        };
        futures_util::future::ready(line)
    });
    ndjson_response(lines)
}
