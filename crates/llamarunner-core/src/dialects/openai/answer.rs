//! The parts of an OpenAI answer, whole or chunk by chunk: what every response of one request
//! repeats (`Meta`), a choice with its logprobs, the usage, a chat answer's message and the
//! finish reason, filled into the wire types of `wire.rs`.

use std::borrow::Cow;
use std::time::SystemTime;

use serde_json::{Map, Value};

use super::wire::{
    Body, Choice, CompletionDetails, Delta, FunctionCall, LogprobEntry, Logprobs, Message,
    PromptDetails, Says, ToolCall, Usage,
};
use crate::http::state::AppState;
use crate::protocol::{Completion, DoneReason, TokenLogprob};
use crate::requests::common::unix_seconds;
use crate::requests::tool_calls::{self, Answer};

/// What every response of one request repeats.
pub(super) struct Meta {
    id: String,
    created: u64,
    model: String,
    pub(super) chat: bool,
    pub(super) include_usage: bool,
    /// The choice's `index` (`n` > 1 gives several).
    index: usize,
    /// Whether this choice's end ends the stream (usage, `[DONE]`): false for the choices of
    /// `n` > 1, whose stream ends after the last of them.
    pub(super) ends_stream: bool,
    /// Where the next token's text starts in the whole completion (`text_offset`), carried
    /// from one streamed chunk to the next.
    offsets: std::sync::Mutex<TextOffsets>,
}

/// Character offsets of tokens in a completion's text. A token may carry part of a UTF-8
/// character: its offset is that character's, and the character is counted once complete.
#[derive(Debug, Default)]
pub(super) struct TextOffsets {
    /// Characters complete so far.
    chars: usize,
    /// Bytes of a character not yet complete.
    tail: Vec<u8>,
}

impl TextOffsets {
    /// The offset of a token with these bytes, which then count towards the next ones.
    pub(super) fn next(&mut self, bytes: &[u8]) -> usize {
        let at = self.chars;
        self.tail.extend_from_slice(bytes);
        let mut complete = String::new();
        let used = crate::chat::utf8::decode_utf8(&self.tail, &mut complete);
        self.chars += complete.chars().count();
        self.tail.drain(..used);
        at
    }
}

impl Meta {
    pub(super) fn new(state: &AppState, chat: bool, include_usage: bool) -> Self {
        Self {
            // `chatcmpl-<request id>`: the response names the request in the logs.
            id: format!(
                "{}-{}",
                if chat { "chatcmpl" } else { "cmpl" },
                crate::http::access::current_id()
            ),
            created: unix_seconds(SystemTime::now()),
            model: state.model_name.to_string(),
            chat,
            include_usage,
            index: 0,
            ends_stream: true,
            offsets: std::sync::Mutex::default(),
        }
    }

    /// The description of choice `index` of several, in the same response.
    pub(super) fn for_choice(&self, index: usize) -> Self {
        Self {
            id: self.id.clone(),
            created: self.created,
            model: self.model.clone(),
            chat: self.chat,
            include_usage: self.include_usage,
            index,
            ends_stream: false,
            offsets: std::sync::Mutex::default(),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        }
    }

    /// One `choices[0]` entry: text (or a delta), logprobs, finish reason. A chat chunk's
    /// delta is the text's (or empty); a whole chat answer's message is the text alone (the
    /// caller puts the answer read for calls and reasoning there: `chat_message`).
    pub(super) fn choice<'a>(
        &self,
        text: Option<&'a str>,
        logprobs: &[TokenLogprob],
        want_logprobs: bool,
        finish: Option<&'static str>,
        chunk: bool,
    ) -> Choice<'a> {
        let logprobs = want_logprobs.then(|| {
            if self.chat {
                Logprobs::Chat {
                    content: logprobs.iter().map(chat_logprob).collect(),
                }
            } else {
                let mut offsets = self.offsets.lock().unwrap_or_else(|p| p.into_inner());
                completion_logprobs(logprobs, &mut offsets)
            }
        });
        let says = match (self.chat, chunk) {
            (true, true) => Says::Delta(Delta {
                content: text.map(|t| Some(Cow::Borrowed(t))),
                ..Delta::default()
            }),
            (true, false) => Says::Message(Message {
                role: "assistant",
                content: Some(text.unwrap_or("")),
                tool_calls: None,
                reasoning_content: None,
            }),
            (false, _) => Says::Text(text.unwrap_or("")),
        };
        Choice {
            index: self.index,
            logprobs,
            finish_reason: finish,
            says,
        }
    }

    /// The answer (or chunk) with these choices; the usage, progress and timings left out.
    pub(super) fn body<'a>(&'a self, chunk: bool, choices: Vec<Choice<'a>>) -> Body<'a> {
        Body {
            id: &self.id,
            object: self.object(chunk),
            created: self.created,
            model: &self.model,
            system_fingerprint: concat!("llamarunner-", env!("CARGO_PKG_VERSION")),
            choices,
            prompt_progress: None,
            usage: None,
            timings: None,
            verbose: None,
        }
    }
}

pub(super) fn usage(done: &Completion) -> Usage {
    Usage {
        prompt_tokens: done.prompt_eval_count,
        completion_tokens: done.eval_count,
        total_tokens: done.prompt_eval_count + done.eval_count,
        prompt_tokens_details: PromptDetails {
            cached_tokens: done.prompt_cached_count,
        },
        completion_tokens_details: CompletionDetails {
            accepted_prediction_tokens: done.draft_accepted_count,
            rejected_prediction_tokens: done.draft_count.saturating_sub(done.draft_accepted_count),
        },
    }
}

fn token_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// One token's entry as OpenAI's chat (and Ollama's API) write it: its text, log-probability,
/// bytes and the top alternatives.
pub(crate) fn chat_logprob(l: &TokenLogprob) -> LogprobEntry {
    let entry = |t: &crate::protocol::TopLogprob| LogprobEntry {
        token: token_text(&t.bytes),
        logprob: f64::from(t.logprob),
        bytes: t.bytes.clone(),
        top_logprobs: None,
    };
    LogprobEntry {
        top_logprobs: Some(l.top.iter().map(entry).collect()),
        ..entry(&l.sampled)
    }
}

/// Legacy completions' `logprobs`; `text_offset` counts characters from the start of the whole
/// completion, across streamed chunks.
fn completion_logprobs(entries: &[TokenLogprob], at: &mut TextOffsets) -> Logprobs {
    let text_offset = entries.iter().map(|l| at.next(&l.sampled.bytes)).collect();
    Logprobs::Completion {
        tokens: entries
            .iter()
            .map(|l| token_text(&l.sampled.bytes))
            .collect(),
        token_logprobs: entries
            .iter()
            .map(|l| f64::from(l.sampled.logprob))
            .collect(),
        top_logprobs: entries
            .iter()
            .map(|l| {
                l.top
                    .iter()
                    .map(|t| (token_text(&t.bytes), Value::from(t.logprob)))
                    .collect::<Map<_, _>>()
            })
            .collect(),
        text_offset,
    }
}

/// The usage of several choices of one prompt: the prompt once (the first choice's, which
/// decoded it), the generated tokens of all. None without choices.
pub(super) fn usage_of_choices(dones: &[Completion]) -> Option<Usage> {
    let first = dones.first()?;
    let mut all = first.clone();
    for d in &dones[1..] {
        all.eval_count += d.eval_count;
        all.draft_count += d.draft_count;
        all.draft_accepted_count += d.draft_accepted_count;
    }
    Some(usage(&all))
}

/// OpenAI's `finish_reason`: its clients know "stop" and "length"; a request cut by the
/// server's time limit (`--timeout`) reads as "length" (it was cut, not finished).
pub(super) fn finish_reason(reason: DoneReason) -> &'static str {
    match reason {
        DoneReason::Timeout => "length",
        other => other.as_str(),
    }
}

/// A call as OpenAI writes it: a fresh id, the arguments as a JSON string; `index` in a
/// streamed delta.
pub(super) fn tool_call<'a>(
    index: Option<usize>,
    name: Cow<'a, str>,
    arguments: &Value,
) -> ToolCall<'a> {
    ToolCall {
        index,
        id: tool_calls::call_id(),
        kind: "function",
        function: FunctionCall {
            name,
            arguments: arguments.to_string(),
        },
    }
}

/// A chat answer's message: content (null when there are only calls), `tool_calls` with the
/// arguments as a JSON string, `reasoning_content` when the model thought.
pub(super) fn chat_message(answer: &Answer) -> Message<'_> {
    let called = !answer.calls.is_empty();
    Message {
        role: "assistant",
        content: (!(called && answer.content.is_empty())).then_some(answer.content.as_str()),
        tool_calls: called.then(|| {
            answer
                .calls
                .iter()
                .map(|c| tool_call(None, Cow::Borrowed(&c.name), &c.arguments))
                .collect()
        }),
        reasoning_content: (!answer.reasoning.is_empty()).then_some(answer.reasoning.as_str()),
    }
}
