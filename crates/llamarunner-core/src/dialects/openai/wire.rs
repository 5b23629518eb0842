//! OpenAI's answers as they go on the wire: a chat or text completion (whole, or one streamed
//! chunk), its choices, messages, deltas, tool calls, logprobs and usage; the embeddings
//! answer; the model list; a prompt's token count. Fields are declared in the order they are
//! written (the workspace's serde_json keeps object keys in insertion order); a field written as
//! `null` is an `Option` without `skip_serializing_if`. Floats the engine keeps as `f32` are
//! written as `f64` (as `json!` wrote them: `0.1f32` is `0.10000000149011612`).

use std::borrow::Cow;

use serde::Serialize;
use serde_json::{Map, Value};

use crate::dialects::llama_server::{Answer, PromptProgress, Timings};

/// A completion answer (`chat.completion`, `text_completion`) or one streamed chunk
/// (`chat.completion.chunk`, `text_completion`).
#[derive(Debug, Serialize)]
pub(super) struct Body<'a> {
    /// `chatcmpl-` or `cmpl-` and the request's id; the same in every chunk.
    pub(super) id: &'a str,
    /// What the object is: `chat.completion`, `chat.completion.chunk` or `text_completion`.
    pub(super) object: &'static str,
    /// When the request came, in Unix seconds.
    pub(super) created: u64,
    /// The model's name as served.
    pub(super) model: &'a str,
    /// `llamarunner-` and the crate's version.
    pub(super) system_fingerprint: &'static str,
    /// The choices (one per chunk; none in a usage or progress chunk).
    pub(super) choices: Vec<Choice<'a>>,
    /// llama-server's `return_progress`: how far the prompt's decode is (a progress chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) prompt_progress: Option<PromptProgress>,
    /// The tokens read and written: left out unless the answer is whole or the stream asked
    /// for it (`include_usage`), then null in every chunk but the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) usage: Option<Option<Usage>>,
    /// llama-server's timings of the answer (`dialects/llama_server/timings.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) timings: Option<Timings>,
    /// llama-server's debug object (`verbose`): the prompt, settings and answer.
    #[serde(rename = "__verbose", skip_serializing_if = "Option::is_none")]
    pub(super) verbose: Option<Answer<'a>>,
}

/// One entry of `choices`.
#[derive(Debug, Serialize)]
pub(super) struct Choice<'a> {
    /// Which choice (`n` > 1 gives several).
    pub(super) index: usize,
    /// The tokens' log-probabilities when asked for, else null.
    pub(super) logprobs: Option<Logprobs>,
    /// Why it ended (`stop`, `length`, `tool_calls`); null until the last chunk.
    pub(super) finish_reason: Option<&'static str>,
    /// What it says: a chat chunk's `delta`, a whole chat answer's `message`, or `text`.
    #[serde(flatten)]
    pub(super) says: Says<'a>,
}

/// What a choice says, under the key that names it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Says<'a> {
    /// A chat chunk's change.
    Delta(Delta<'a>),
    /// A whole chat answer.
    Message(Message<'a>),
    /// A text completion's text (or its chunk's part).
    Text(&'a str),
}

/// A chat chunk's `delta`: what the answer gains (`{}` in the last chunk).
#[derive(Debug, Default, Serialize)]
pub(super) struct Delta<'a> {
    /// `assistant`, in the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) role: Option<&'static str>,
    /// Text added (null in the first chunk, as llama-server sends it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) content: Option<Option<Cow<'a, str>>>,
    /// Thinking added.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reasoning_content: Option<Cow<'a, str>>,
    /// A call, whole (one per chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tool_calls: Option<Vec<ToolCall<'a>>>,
}

/// A whole chat answer's `message`.
#[derive(Debug, Serialize)]
pub(super) struct Message<'a> {
    /// Always `assistant`.
    pub(super) role: &'static str,
    /// The answer's text; null when it only calls.
    pub(super) content: Option<&'a str>,
    /// The calls, when it made any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) tool_calls: Option<Vec<ToolCall<'a>>>,
    /// The model's thinking, when it thought.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reasoning_content: Option<&'a str>,
}

/// One tool call.
#[derive(Debug, Serialize)]
pub(super) struct ToolCall<'a> {
    /// The call's place among a streamed piece's calls (left out of a whole message).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) index: Option<usize>,
    /// `call_` and 24 letters and digits.
    pub(super) id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    /// The function called.
    pub(super) function: FunctionCall<'a>,
}

/// The function of a tool call.
#[derive(Debug, Serialize)]
pub(super) struct FunctionCall<'a> {
    /// The tool's name.
    pub(super) name: Cow<'a, str>,
    /// The arguments as JSON text.
    pub(super) arguments: String,
}

/// A choice's `logprobs`, in the chat's or the legacy completions' shape.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(super) enum Logprobs {
    /// Chat: one entry per token.
    Chat {
        /// The tokens' entries.
        content: Vec<LogprobEntry>,
    },
    /// Legacy completions: parallel arrays.
    Completion {
        /// Each token's text.
        tokens: Vec<String>,
        /// Each token's log-probability.
        token_logprobs: Vec<f64>,
        /// Each token's alternatives, text to log-probability (tokens whose texts are the same,
        /// as invalid UTF-8 pieces are, share one key: the last one's value, the first one's
        /// place).
        top_logprobs: Vec<Map<String, Value>>,
        /// Each token's offset in characters from the start of the whole completion.
        text_offset: Vec<usize>,
    },
}

/// One token's entry as OpenAI's chat (and Ollama's API) write it.
#[derive(Debug, Serialize)]
pub(crate) struct LogprobEntry {
    /// Its text (invalid UTF-8 replaced).
    pub(crate) token: String,
    /// Its log-probability.
    pub(crate) logprob: f64,
    /// Its bytes.
    pub(crate) bytes: Vec<u8>,
    /// The most likely tokens at its place, best first (none below an alternative).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) top_logprobs: Option<Vec<LogprobEntry>>,
}

/// OpenAI's usage.
#[derive(Debug, Serialize)]
pub(super) struct Usage {
    /// Prompt tokens, cached ones included.
    pub(super) prompt_tokens: usize,
    /// Tokens generated.
    pub(super) completion_tokens: usize,
    /// Their sum.
    pub(super) total_tokens: usize,
    /// What the prompt's tokens were.
    pub(super) prompt_tokens_details: PromptDetails,
    /// What the generated tokens were.
    pub(super) completion_tokens_details: CompletionDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Serialize)]
pub(super) struct PromptDetails {
    /// Prompt tokens reused from the cache.
    pub(super) cached_tokens: usize,
}

/// `usage.completion_tokens_details`: OpenAI's names for a prediction's tokens (here: the
/// prompt-lookup and draft-model drafts).
#[derive(Debug, Serialize)]
pub(super) struct CompletionDetails {
    /// Drafted tokens accepted.
    pub(super) accepted_prediction_tokens: usize,
    /// Drafted tokens rejected.
    pub(super) rejected_prediction_tokens: usize,
}

/// The answer of `POST /v1/embeddings`.
#[derive(Debug, Serialize)]
pub(super) struct Embeddings<'a> {
    /// Always `list`.
    pub(super) object: &'static str,
    /// One vector per input, in order.
    pub(super) data: Vec<Embedding>,
    /// The model's name as served.
    pub(super) model: &'a str,
    /// The tokens embedded.
    pub(super) usage: EmbeddingUsage,
}

/// One vector of `data`.
#[derive(Debug, Serialize)]
pub(super) struct Embedding {
    /// Always `embedding`.
    pub(super) object: &'static str,
    /// Its input's place.
    pub(super) index: usize,
    /// The L2-normalized vector.
    pub(super) embedding: Vector,
}

/// A vector as floats or as base64 text.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(super) enum Vector {
    /// Floats (written as `f64`).
    Floats(#[serde(serialize_with = "crate::dialects::floats::f32s_as_f64s")] Vec<f32>),
    /// Little-endian `f32`s, base64-encoded.
    Base64(String),
}

/// An embeddings answer's usage.
#[derive(Debug, Serialize)]
pub(super) struct EmbeddingUsage {
    /// The inputs' tokens.
    pub(super) prompt_tokens: usize,
    /// The same.
    pub(super) total_tokens: usize,
}

/// The answer of `GET /v1/models`.
#[derive(Debug, Serialize)]
pub(super) struct ModelList<'a> {
    /// Always `list`.
    pub(super) object: &'static str,
    /// The one model served.
    pub(super) data: [Model<'a>; 1],
}

/// A model, in `GET /v1/models` and as `GET /v1/models/{model}`.
#[derive(Debug, Serialize)]
pub(super) struct Model<'a> {
    /// The model's name as served.
    pub(super) id: &'a str,
    /// Always `model`.
    pub(super) object: &'static str,
    /// The GGUF file's modification time in Unix seconds (0 when unknown).
    pub(super) created: u64,
    /// Always `llamarunner`.
    pub(super) owned_by: &'static str,
    /// llama-server's facts of the model, under its names (clients written for it read the
    /// context size here).
    pub(super) meta: ModelMeta,
}

/// `meta` of a model entry, as llama-server gives it.
#[derive(Debug, Serialize)]
pub(super) struct ModelMeta {
    /// The vocabulary's size.
    pub(super) n_vocab: u32,
    /// The context of one slot, in tokens.
    pub(super) n_ctx: usize,
    /// The context the model was trained with.
    pub(super) n_ctx_train: u32,
    /// The embedding width.
    pub(super) n_embd: u32,
    /// The parameter count.
    pub(super) n_params: u64,
    /// The GGUF file's size in bytes.
    pub(super) size: u64,
}

/// The answer of `POST /v1/chat/completions/input_tokens`.
#[derive(Debug, Serialize)]
pub(super) struct InputTokens {
    /// Always `response.input_tokens`.
    pub(super) object: &'static str,
    /// The prompt's tokens.
    pub(super) input_tokens: usize,
}
