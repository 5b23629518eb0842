//! What every part of an Anthropic answer repeats (`Meta`: its id, model and stop reason),
//! Anthropic's usage, and tool_use ids. The wire types they fill are in `wire.rs`.

use serde_json::Value;

use super::wire::Usage;

use crate::protocol::{Completion, DoneReason};
use crate::requests::tool_calls;

/// What every event of one answer repeats.
pub(super) struct Meta {
    pub(super) id: String,
    pub(super) model: String,
    /// The request's own stop strings (the template's end-of-turn markers are stops too, but
    /// one of those ends a turn).
    pub(super) stop_sequences: Vec<String>,
}

impl Meta {
    /// `stop_reason` and `stop_sequence`: `tool_use` when the answer called, `stop_sequence`
    /// with the string when one of the request's ended it, `max_tokens` when cut, else
    /// `end_turn`. The sequence is the client's own string (or null), echoed.
    pub(super) fn stop_reason(&self, done: &Completion, called: bool) -> (&'static str, Value) {
        if called {
            return ("tool_use", Value::Null);
        }
        match done.done_reason {
            DoneReason::Length | DoneReason::Timeout => ("max_tokens", Value::Null),
            DoneReason::Stop => match &done.stop_string {
                Some(s) if self.stop_sequences.contains(s) => {
                    ("stop_sequence", Value::String(s.clone()))
                }
                _ => ("end_turn", Value::Null),
            },
        }
    }
}

/// Anthropic's usage: `input_tokens` are the prompt tokens decoded, those reused from the
/// cache are `cache_read_input_tokens` (the prompt is their sum, as Anthropic counts it).
pub(super) fn usage(done: &Completion) -> Usage {
    Usage {
        input_tokens: done
            .prompt_eval_count
            .saturating_sub(done.prompt_cached_count),
        output_tokens: done.eval_count,
        cache_read_input_tokens: Some(done.prompt_cached_count),
        cache_creation_input_tokens: Some(0),
    }
}

/// A tool_use id as Anthropic writes them: `toolu_` and 24 letters and digits.
pub(super) fn tool_use_id() -> String {
    tool_calls::call_id_with("toolu")
}
