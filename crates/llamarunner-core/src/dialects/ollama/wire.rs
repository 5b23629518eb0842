//! Ollama's answers as they go on the wire: a generate or chat answer (whole, or one line of
//! its NDJSON stream) with its message, statistics, log-probabilities and tool calls; the
//! embeddings answers; the model listings (`/api/tags`, `/api/ps`) and `/api/show`; the pull
//! status and the API version. Fields are declared in the order they are written (the
//! workspace's serde_json keeps object keys in insertion order); what the answer leaves out is
//! an `Option` with `skip_serializing_if`. Floats the engine keeps as `f32` are written as `f64`
//! (as `json!` wrote them: `0.1f32` is `0.10000000149011612`).

use serde::Serialize;
use serde_json::{Map, Value};

use crate::dialects::openai::LogprobEntry;

/// An answer of `POST /api/generate` or `POST /api/chat`: a streamed line (`done: false`), the
/// last line or the whole answer (`done: true`, with the statistics), or the answer to a
/// request with nothing to generate (`done_reason: "load"`).
#[derive(Debug, Serialize)]
pub(super) struct Answer<'a> {
    /// The model's name as the request gave it.
    pub(super) model: &'a str,
    /// When the line was written (RFC 3339).
    pub(super) created_at: String,
    /// The text: a chat's `message` or generate's `response`.
    #[serde(flatten)]
    pub(super) says: Says<'a>,
    /// Whether this is the last line (or the whole answer).
    pub(super) done: bool,
    /// Why it ended (`stop`, `length`, `load`...), on the last line only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) done_reason: Option<&'a str>,
    /// The counts and times, on the last line of a generation.
    #[serde(flatten)]
    pub(super) stats: Option<Stats>,
    /// The tokens' log-probabilities, when asked for (`logprobs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) logprobs: Option<Vec<LogprobEntry>>,
}

/// What an answer says, under the key that names it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Says<'a> {
    /// A chat's message (or its streamed part).
    Message(Message<'a>),
    /// Generate's text (or its streamed part).
    Response(&'a str),
}

/// A chat answer's `message`.
#[derive(Debug, Serialize)]
pub(super) struct Message<'a> {
    /// Always `assistant`.
    pub(super) role: &'static str,
    /// The text (empty on a line of thinking or calls).
    pub(super) content: &'a str,
    /// The model's thinking, when it thought.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) thinking: Option<&'a str>,
    /// The calls, when it made any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tool_calls: Option<Vec<ToolCall<'a>>>,
}

/// One tool call, Ollama's way: the arguments as an object.
#[derive(Debug, Serialize)]
pub(super) struct ToolCall<'a> {
    /// The function called.
    pub(super) function: FunctionCall<'a>,
}

/// The function of a tool call.
#[derive(Debug, Serialize)]
pub(super) struct FunctionCall<'a> {
    /// The call's place among the answer's (or the line's) calls.
    pub(super) index: usize,
    /// The tool's name.
    pub(super) name: &'a str,
    /// The arguments (a JSON object, as the model wrote them).
    pub(super) arguments: &'a Value,
}

/// The last line's statistics.
#[derive(Debug, Serialize)]
pub(super) struct Stats {
    /// Nanoseconds from the request's arrival to its end.
    pub(super) total_duration: u64,
    /// Nanoseconds spent loading the model: always 0 (it is loaded).
    pub(super) load_duration: u64,
    /// Prompt tokens, cached ones included.
    pub(super) prompt_eval_count: usize,
    /// Nanoseconds spent decoding the prompt.
    pub(super) prompt_eval_duration: u64,
    /// Tokens generated.
    pub(super) eval_count: usize,
    /// Nanoseconds spent generating.
    pub(super) eval_duration: u64,
}

/// A streamed answer's line for an error after its start.
#[derive(Debug, Serialize)]
pub(super) struct ErrorLine {
    /// What went wrong.
    pub(super) error: String,
}

/// The answer of `POST /api/embed`.
#[derive(Debug, Serialize)]
pub(super) struct Embed<'a> {
    /// The model's name as the request gave it.
    pub(super) model: &'a str,
    /// One L2-normalized vector per input, in order.
    #[serde(serialize_with = "crate::dialects::floats::vectors_as_f64s")]
    pub(super) embeddings: Vec<Vec<f32>>,
    /// Nanoseconds from the request's arrival to its end.
    pub(super) total_duration: u64,
    /// Nanoseconds spent loading the model: always 0.
    pub(super) load_duration: u64,
    /// The inputs' tokens.
    pub(super) prompt_eval_count: usize,
}

/// The answer of `POST /api/embeddings` (Ollama's older endpoint).
#[derive(Debug, Serialize)]
pub(super) struct Embedding {
    /// The prompt's vector, not normalized (empty for an empty prompt).
    #[serde(serialize_with = "crate::dialects::floats::f32s_as_f64s")]
    pub(super) embedding: Vec<f32>,
}

/// The answer of `GET /api/tags` and `GET /api/ps`.
#[derive(Debug, Serialize)]
pub(crate) struct Models<'a> {
    /// The models listed.
    pub(crate) models: Vec<ModelEntry<'a>>,
}

/// A model as `/api/tags` lists it, and (with its expiry and device memory) as `/api/ps` does.
#[derive(Debug, Serialize)]
pub(crate) struct ModelEntry<'a> {
    /// The model's name.
    pub(crate) name: &'a str,
    /// The same.
    pub(crate) model: &'a str,
    /// The GGUF file's size in bytes.
    pub(crate) size: u64,
    /// The file's modification time (RFC 3339).
    pub(crate) modified_at: String,
    /// `sha256:`-like identifier of the file (`digest`).
    pub(crate) digest: String,
    /// The model's family, size and quantization where known.
    pub(crate) details: &'a Details,
    /// `/api/ps`: when the model is unloaded (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) expires_at: Option<String>,
    /// `/api/ps`: its bytes in device memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) size_vram: Option<u64>,
    /// An engine's `/api/ps`: the context of one slot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) context_length: Option<usize>,
}

/// A model's `details`: all of them for the served model, the format only for a model a
/// router lists without loading it.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum Details {
    /// What the loaded model tells of itself.
    Known(ModelDetails),
    /// A file not read: its format only.
    FormatOnly {
        /// Always `gguf`.
        format: &'static str,
    },
}

/// The served model's `details`.
#[derive(Debug, Serialize)]
pub(crate) struct ModelDetails {
    /// Always empty.
    pub(crate) parent_model: &'static str,
    /// Always `gguf`.
    pub(crate) format: &'static str,
    /// The architecture.
    pub(crate) family: String,
    /// The architecture, alone.
    pub(crate) families: [String; 1],
    /// The parameter count, Ollama's way (`268.10M`, `8.0B`).
    pub(crate) parameter_size: String,
    /// The weights' type (`Q4_K_M`, `F16`...).
    pub(crate) quantization_level: String,
}

/// The answer of `POST /api/show`.
#[derive(Debug, Serialize)]
pub(super) struct Show<'a> {
    /// A Modelfile naming the file (its name only, not its path).
    pub(super) modelfile: String,
    /// Always empty.
    pub(super) parameters: &'static str,
    /// The chat template's source.
    pub(super) template: &'a str,
    /// The model's family, size and quantization.
    pub(super) details: Details,
    /// The GGUF's metadata, numbers as numbers, and `general.parameter_count`.
    pub(super) model_info: Map<String, Value>,
    /// Always `["completion"]`.
    pub(super) capabilities: [&'static str; 1],
    /// The file's modification time (RFC 3339).
    pub(super) modified_at: String,
}

/// The answer (or stream line) of `POST /api/pull`.
#[derive(Debug, Serialize)]
pub(super) struct PullStatus {
    /// Always `success`: the model is here.
    pub(super) status: &'static str,
}

/// The answer of `GET /api/version`.
#[derive(Debug, Serialize)]
pub(super) struct Version {
    /// The Ollama API version followed.
    pub(super) version: &'static str,
}
