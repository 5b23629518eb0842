//! The Responses API's answers as they go on the wire: the response object, its output items
//! and usage, and the payloads of the `response.*` stream events. Fields are declared in the
//! order they are written (the workspace's serde_json keeps object keys in insertion order); a
//! field written as `null` is an `Option` without `skip_serializing_if`. The request's own
//! settings are echoed as given (`serde_json::Value` where the client wrote JSON).

use serde::{Serialize, Serializer};
use serde_json::Value;

use crate::dialects::llama_server::{PromptProgress, Timings};

/// The response object: a whole answer, each stream event's `response`, and what
/// `GET /v1/responses/{id}` answers (kept as JSON in the store).
#[derive(Debug, Serialize)]
pub(super) struct Response<'a> {
    /// `resp_` and 32 hex digits.
    pub(super) id: &'a str,
    /// Always `response`.
    pub(super) object: &'static str,
    /// When the request came, in Unix seconds.
    pub(super) created_at: u64,
    /// The model's name as served.
    pub(super) model: &'a str,
    /// The output items so far.
    pub(super) output: &'a [OutputItem],
    /// Why it failed; null unless it did.
    pub(super) error: Option<ResponseError>,
    /// Why it is incomplete; null unless it is.
    pub(super) incomplete_details: Option<IncompleteDetails>,
    /// The tokens read and written; null until it ends.
    pub(super) usage: Option<Usage>,
    /// `in_progress`, `completed`, `incomplete` or `failed`.
    pub(super) status: &'static str,
    /// The request's settings, echoed.
    #[serde(flatten)]
    pub(super) echo: &'a Echo,
}

/// A failed response's `error`.
#[derive(Debug, Serialize)]
pub(super) struct ResponseError {
    /// Among those OpenAI's `ResponseError` names (`server_error`, `invalid_image`, ...).
    pub(super) code: &'static str,
    /// A sentence for the user.
    pub(super) message: String,
}

/// An incomplete response's `incomplete_details`.
#[derive(Debug, Serialize)]
pub(super) struct IncompleteDetails {
    /// Always `max_output_tokens` (a cut answer).
    pub(super) reason: &'static str,
}

/// The request's settings as a response echoes them (each defaulted as OpenAI does).
#[derive(Debug, Serialize)]
pub(super) struct Echo {
    /// The request's system text, or null.
    pub(super) instructions: Option<String>,
    /// The request's token limit, or null.
    pub(super) max_output_tokens: Option<i64>,
    /// Whether several calls may come at once (default true).
    pub(super) parallel_tool_calls: bool,
    /// The response this one continues, or null.
    pub(super) previous_response_id: Option<String>,
    /// The temperature sampled with (an `f32` written as `f64`, as `json!` wrote it).
    pub(super) temperature: f64,
    /// The top-p sampled with (the same).
    pub(super) top_p: f64,
    /// The request's `tool_choice` as given (default `auto`).
    pub(super) tool_choice: Value,
    /// The request's tools as given.
    pub(super) tools: Vec<Value>,
    /// The request's `text` (its format) as given (default a text format).
    pub(super) text: Value,
    /// The request's `reasoning` as given (default effort and summary null).
    pub(super) reasoning: Value,
    /// Whether the response is kept (default true).
    pub(super) store: bool,
    /// The request's `truncation` (default `disabled`).
    pub(super) truncation: String,
    /// The request's metadata as given (default `{}`).
    pub(super) metadata: Value,
}

/// The Responses API's usage.
#[derive(Debug, Serialize)]
pub(super) struct Usage {
    /// Prompt tokens, cached ones included.
    pub(super) input_tokens: usize,
    /// What the prompt's tokens were.
    pub(super) input_tokens_details: InputDetails,
    /// Tokens generated.
    pub(super) output_tokens: usize,
    /// What the generated tokens were.
    pub(super) output_tokens_details: OutputDetails,
    /// Their sum.
    pub(super) total_tokens: usize,
}

/// `usage.input_tokens_details`.
#[derive(Debug, Serialize)]
pub(super) struct InputDetails {
    /// Prompt tokens reused from the cache.
    pub(super) cached_tokens: usize,
    /// Prompt tokens written to a cache: always 0.
    pub(super) cache_write_tokens: usize,
}

/// `usage.output_tokens_details`.
#[derive(Debug, Serialize)]
pub(super) struct OutputDetails {
    /// Always 0 (the thinking is counted with the output).
    pub(super) reasoning_tokens: usize,
}

/// One output item, named by its `type`.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum OutputItem {
    /// The answer's text.
    Message {
        /// `msg_` and 32 hex digits.
        id: String,
        /// `in_progress` while it streams, `completed`, or `incomplete` when cut.
        status: &'static str,
        /// Always `assistant`.
        role: &'static str,
        /// Its one text part (none while it streams).
        content: Vec<OutputText>,
    },
    /// The model's thinking.
    Reasoning {
        /// `rs_` and 32 hex digits.
        id: String,
        /// Always empty (no summaries are written).
        summary: EmptyList,
        /// Its one text part (none while it streams).
        content: Vec<ReasoningText>,
    },
    /// A tool call.
    FunctionCall {
        /// `fc_` and 32 hex digits.
        id: String,
        /// `call_` and 24 letters and digits: what the tool's output names.
        call_id: String,
        /// The tool's name.
        name: String,
        /// The arguments as JSON text (`""` while it streams).
        arguments: String,
        /// `in_progress` while it streams, then `completed`.
        status: &'static str,
    },
}

/// A message's text part, in an item and in `response.content_part.*` events.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "type", rename = "output_text")]
pub(super) struct OutputText {
    /// The text.
    pub(super) text: String,
    /// Always empty.
    pub(super) annotations: EmptyList,
    /// Always empty; left out of the `response.content_part.*` events' part.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) logprobs: Option<EmptyList>,
}

/// A reasoning item's text part.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "type", rename = "reasoning_text")]
pub(super) struct ReasoningText {
    /// The thinking text.
    pub(super) text: String,
}

/// `[]`: a list this server always writes empty.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct EmptyList;

impl Serialize for EmptyList {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(std::iter::empty::<()>())
    }
}

/// One stream event: its payload's fields, then its `type`, its number in the stream and (on
/// a delta of `timings_per_token`) llama-server's timings so far.
#[derive(Debug, Serialize)]
pub(super) struct Event<'a, T> {
    /// The event's own fields.
    #[serde(flatten)]
    pub(super) data: T,
    /// The event's name (`response.output_text.delta`, ...).
    #[serde(rename = "type")]
    pub(super) kind: &'a str,
    /// Its place in the stream, from 0.
    pub(super) sequence_number: u64,
    /// llama-server's timings when the text event that made this delta came.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) timings: Option<&'a Timings>,
}

/// The payload of `response.created`, `.in_progress`, `.completed`, `.incomplete`, `.failed`.
#[derive(Debug, Serialize)]
pub(super) struct ResponseEvent<'a> {
    /// The response as it stands.
    pub(super) response: Response<'a>,
    /// llama-server's `return_progress`: how far the prompt's decode is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) prompt_progress: Option<PromptProgress>,
    /// llama-server's timings of the whole answer (at its end).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) timings: Option<Timings>,
}

/// The payload of `error`.
#[derive(Debug, Serialize)]
pub(super) struct ErrorEvent {
    /// As a failed response's `error.code`.
    pub(super) code: &'static str,
    /// A sentence for the user.
    pub(super) message: String,
    /// Always null.
    pub(super) param: Option<&'static str>,
}

/// The payload of `response.output_item.added` and `.done`.
#[derive(Debug, Serialize)]
pub(super) struct ItemEvent<'a> {
    /// The item's place in `output`.
    pub(super) output_index: usize,
    /// The item (empty when added).
    pub(super) item: &'a OutputItem,
}

/// The payload of `response.content_part.added` and `.done`.
#[derive(Debug, Serialize)]
pub(super) struct PartEvent<'a> {
    /// The message's id.
    pub(super) item_id: &'a str,
    /// The message's place in `output`.
    pub(super) output_index: usize,
    /// Always 0: a message has one part.
    pub(super) content_index: usize,
    /// The part (empty when added).
    pub(super) part: OutputText,
}

/// The payload of a text delta, or of `response.function_call_arguments.delta`.
#[derive(Debug, Serialize)]
pub(super) struct DeltaEvent<'a> {
    /// The item's id.
    pub(super) item_id: &'a str,
    /// The item's place in `output`.
    pub(super) output_index: usize,
    /// Always 0: an item has one part (left out for a call's arguments).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) content_index: Option<usize>,
    /// The text added.
    pub(super) delta: &'a str,
    /// Always empty; written for the answer's text only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) logprobs: Option<EmptyList>,
}

/// The payload of `response.reasoning_text.done` and `response.output_text.done`.
#[derive(Debug, Serialize)]
pub(super) struct TextDoneEvent<'a> {
    /// The item's id.
    pub(super) item_id: &'a str,
    /// The item's place in `output`.
    pub(super) output_index: usize,
    /// Always 0: an item has one part.
    pub(super) content_index: usize,
    /// The whole text.
    pub(super) text: &'a str,
    /// Always empty; written for the answer's text only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) logprobs: Option<EmptyList>,
}

/// The payload of `response.function_call_arguments.done`.
#[derive(Debug, Serialize)]
pub(super) struct ArgumentsDoneEvent<'a> {
    /// The call item's id.
    pub(super) item_id: &'a str,
    /// The item's place in `output`.
    pub(super) output_index: usize,
    /// The tool's name.
    pub(super) name: &'a str,
    /// The whole arguments as JSON text.
    pub(super) arguments: &'a str,
}

/// The answer of `POST /v1/responses/input_tokens`.
#[derive(Debug, Serialize)]
pub(super) struct InputTokens {
    /// Always `response.input_tokens`.
    pub(super) object: &'static str,
    /// The prompt's tokens.
    pub(super) input_tokens: usize,
}

/// The answer of `DELETE /v1/responses/{id}`.
#[derive(Debug, Serialize)]
pub(super) struct Deleted<'a> {
    /// The response's id.
    pub(super) id: &'a str,
    /// Always `response`.
    pub(super) object: &'static str,
    /// Always true.
    pub(super) deleted: bool,
}
