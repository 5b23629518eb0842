//! Anthropic's answers as they go on the wire: the message object, its content blocks and
//! usage, and the events of a streamed answer. Fields are declared in the order they are
//! written (the workspace's serde_json keeps object keys in insertion order); a field written
//! as `null` is an `Option` without `skip_serializing_if`.

use std::borrow::Cow;

use serde::Serialize;
use serde_json::Value;

/// A message: the whole answer of `POST /v1/messages`, and (empty, with no stop reason yet)
/// the `message` of the stream's `message_start`.
#[derive(Debug, Serialize)]
pub(super) struct Message<'a> {
    /// `msg_` and the request's id.
    pub(super) id: &'a str,
    /// Always `message`.
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    /// Always `assistant`.
    pub(super) role: &'static str,
    /// The model's name as served.
    pub(super) model: &'a str,
    /// The answer's blocks: thinking, text, tool uses (none in `message_start`).
    pub(super) content: Vec<ContentBlock<'a>>,
    /// Why the turn ended (`end_turn`, `max_tokens`, `stop_sequence`, `tool_use`); null while
    /// it streams.
    pub(super) stop_reason: Option<&'static str>,
    /// The request's stop sequence that ended the turn (the client's own string), else null.
    pub(super) stop_sequence: Value,
    /// The tokens read and written.
    pub(super) usage: Usage,
}

impl<'a> Message<'a> {
    /// An assistant message with these parts.
    pub(super) fn new(
        id: &'a str,
        model: &'a str,
        content: Vec<ContentBlock<'a>>,
        stop: Option<(&'static str, Value)>,
        usage: Usage,
    ) -> Self {
        let (stop_reason, stop_sequence) = match stop {
            Some((reason, sequence)) => (Some(reason), sequence),
            None => (None, Value::Null),
        };
        Self {
            id,
            kind: "message",
            role: "assistant",
            model,
            content,
            stop_reason,
            stop_sequence,
            usage,
        }
    }
}

/// Anthropic's usage. `input_tokens` are the prompt tokens decoded; those reused from the
/// cache are `cache_read_input_tokens` (the prompt is their sum, as Anthropic counts it).
#[derive(Debug, Serialize)]
pub(super) struct Usage {
    /// Prompt tokens decoded (not read from the cache).
    pub(super) input_tokens: usize,
    /// Tokens generated.
    pub(super) output_tokens: usize,
    /// Prompt tokens reused from the cache (left out of `message_start`'s usage).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) cache_read_input_tokens: Option<usize>,
    /// Prompt tokens written to a cache: always 0 (left out of `message_start`'s usage).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) cache_creation_input_tokens: Option<usize>,
}

/// One content block, named by its `type`.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum ContentBlock<'a> {
    /// The model's thinking (`""` when a streamed block opens).
    Thinking {
        /// The thinking text.
        thinking: &'a str,
        /// Anthropic's signature of the thinking: always `""` (nothing is signed here).
        signature: &'static str,
    },
    /// Answer text (`""` when a streamed block opens).
    Text {
        /// The text.
        text: &'a str,
    },
    /// A tool call.
    ToolUse {
        /// `toolu_` and 24 letters and digits.
        id: String,
        /// The tool's name.
        name: &'a str,
        /// The call's arguments as a JSON object (`{}` when a streamed block opens: they follow
        /// as an `input_json_delta`).
        input: Cow<'a, Value>,
    },
}

/// The change a `content_block_delta` event carries, named by its `type` (the variant's name
/// and `_delta`).
#[derive(Debug, Serialize)]
#[serde(tag = "type")]
pub(super) enum Delta<'a> {
    /// More thinking text.
    #[serde(rename = "thinking_delta")]
    Thinking {
        /// The text added.
        thinking: &'a str,
    },
    /// More answer text.
    #[serde(rename = "text_delta")]
    Text {
        /// The text added.
        text: &'a str,
    },
    /// A tool call's arguments, here always whole.
    #[serde(rename = "input_json_delta")]
    InputJson {
        /// The arguments as JSON text.
        partial_json: String,
    },
}

/// The `delta` of `message_delta`: how the turn ended.
#[derive(Debug, Serialize)]
pub(super) struct StopDelta {
    /// Why the turn ended (as the message's `stop_reason`).
    pub(super) stop_reason: &'static str,
    /// The request's stop sequence that ended it, else null.
    pub(super) stop_sequence: Value,
}

/// One event of a streamed answer, named by its `type` (also the server-sent event's name).
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum StreamEvent<'a> {
    /// The stream's first event: the message, with no content yet.
    MessageStart {
        /// The message so far (its usage: the prompt's tokens and 0 written).
        message: Message<'a>,
    },
    /// Keeps a quiet stream alive.
    Ping,
    /// A content block opens.
    ContentBlockStart {
        /// The block's place in the message's `content`.
        index: usize,
        /// The block, empty.
        content_block: ContentBlock<'a>,
    },
    /// The open block grows.
    ContentBlockDelta {
        /// The block's place in the message's `content`.
        index: usize,
        /// What it gains.
        delta: Delta<'a>,
    },
    /// The open block closes.
    ContentBlockStop {
        /// The block's place in the message's `content`.
        index: usize,
    },
    /// The turn ended: why, and the whole usage.
    MessageDelta {
        /// The stop reason and sequence.
        delta: StopDelta,
        /// The tokens read and written.
        usage: Usage,
    },
    /// The stream's last event.
    MessageStop,
}

impl StreamEvent<'_> {
    /// The event's `type`, which names its server-sent event too.
    pub(super) fn name(&self) -> &'static str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::Ping => "ping",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop => "message_stop",
        }
    }
}

/// The answer of `POST /v1/messages/count_tokens`.
#[derive(Debug, Serialize)]
pub(super) struct TokenCount {
    /// The prompt's tokens, as the request would be rendered.
    pub(super) input_tokens: usize,
}
