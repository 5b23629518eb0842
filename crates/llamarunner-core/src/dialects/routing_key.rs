//! The routing key of a request: text whose prefixes follow the prompt's, so that a router in
//! front of many servers (Ray's, `python/llamarunner/ray/`) sends a conversation's next turn to
//! the server that holds its prefix in cache.
//!
//! The key is built from each dialect's own reading of the body (the same functions its
//! handler calls: `parse_json` into its request type, then its conversion to chat messages or
//! text), so every dialect is keyed as the server parses it. It is not the prompt (that needs
//! the model's chat template); it only has to grow the same way:
//!
//! - the model the request names leads (`model` SEP name MSG_SEP, the name cut to
//!   `MAX_MODEL_CHARS`): on servers of many models, one model's cache is no use to another;
//! - a conversation is its messages in order, each `role` SEP `content` [EXTRA_SEP the
//!   message's other fields as JSON] MSG_SEP (images are the markers their parts become), so
//!   the next turn's key has this turn's as its prefix;
//! - a text prompt is its text; Ollama's `/api/generate` its system message then its text;
//!   embeddings their texts, MSG_SEP between; `/infill` its files, prefix, suffix and prompt;
//! - `/v1/responses`: its `instructions` as a system message, then its `input`'s messages; a
//!   request that continues a stored response (`previous_response_id`) has that id after the
//!   model (`previous_response_id` SEP id MSG_SEP), and the id is returned apart: the router
//!   must send it to the server that stored the response (it learns which from the
//!   `RESPONSE_ID_HEADER` of the answer that made it), or it is a 404;
//! - at most `MAX_KEY_CHARS` characters;
//! - none for a request that generates nothing (a route without a prompt, Ollama's load
//!   request, an empty prompt), a body that is not JSON or nests too deep to parse.
//!
//! A body its dialect refuses (the server answers it a 400 and caches nothing) is keyed by its
//! fields' plain text (`lenient`): any replica answers it the same, and the key only keeps
//! requests that differ by a token id or a mistyped field near their neighbours.

use serde_json::Value;

use crate::http::error::ApiError;
use crate::requests::keyed::{Keyed, Piece};

use super::{anthropic, infill, native, ollama, openai, responses};

pub use super::responses::RESPONSE_ID_HEADER;

/// Keys are cut to this many characters (Unicode scalar values): prompts that agree this far
/// share a server, and a router's table stays bounded (keys per server x this).
pub const MAX_KEY_CHARS: usize = 1 << 15;
/// The model's name is cut to this many characters in a key.
pub const MAX_MODEL_CHARS: usize = 256;

/// Between a message's role and its content.
const ROLE_SEP: char = '\x1f';
/// After each message (and between texts).
const MSG_SEP: char = '\x1e';
/// Between a message's content and its other fields.
const EXTRA_SEP: char = '\x1d';
/// Deepest nesting `lenient` reads (no prompt is shaped so).
const MAX_LENIENT_DEPTH: usize = 32;

/// Where a request should go: its routing key, and the stored response it continues (which
/// only one server holds).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Route {
    /// The routing key (see the module's doc); None: the request has no prompt.
    pub key: Option<String>,
    /// `/v1/responses`' `previous_response_id`, when the body names one and parses.
    pub previous_response_id: Option<String>,
}

/// The dialect's reading of a POST to `path` (`None`: the route generates nothing).
type Reader = fn(&[u8]) -> Result<Keyed, ApiError>;

/// The reader of each route that generates or embeds (the route table's paths).
fn reader(path: &str) -> Option<Reader> {
    Some(match path {
        "/completion" => native::completion_keyed,
        "/embedding" => native::embedding_keyed,
        "/infill" => infill::keyed,
        "/v1/chat/completions" => openai::chat_keyed,
        "/v1/completions" => openai::completions_keyed,
        "/v1/embeddings" => openai::embeddings_keyed,
        "/v1/responses" => responses::keyed,
        "/v1/messages" => anthropic::keyed,
        "/api/generate" => ollama::generate_keyed,
        "/api/chat" => ollama::chat_keyed,
        "/api/embed" => ollama::embed_keyed,
        "/api/embeddings" => ollama::embeddings_keyed,
        _ => return None,
    })
}

/// The route of a POST to `path` (no query string) with `body`. Never panics: a hostile body
/// is a body without a key.
pub fn route(path: &str, body: &[u8]) -> Route {
    let Some(read) = reader(path) else {
        return Route::default();
    };
    match read(body) {
        Ok(keyed) => Route {
            key: key_of(&keyed),
            previous_response_id: keyed.previous_response_id.filter(|id| !id.is_empty()),
        },
        // Not JSON, not an object, or nested past serde_json's limit: no key, as the server
        // parses nothing.
        Err(_) => Route {
            key: serde_json::from_slice::<Value>(body)
                .ok()
                .filter(Value::is_object)
                .and_then(|value| lenient(path, &value)),
            previous_response_id: None,
        },
    }
}

/// The routing key of a POST to `path` with `body` (see `route`).
pub fn routing_key(path: &str, body: &[u8]) -> Option<String> {
    route(path, body).key
}

/// A key being written: stops growing at `MAX_KEY_CHARS`.
struct KeyText {
    text: String,
    chars: usize,
}

impl KeyText {
    fn new() -> Self {
        KeyText {
            text: String::new(),
            chars: 0,
        }
    }

    fn full(&self) -> bool {
        self.chars >= MAX_KEY_CHARS
    }

    fn push_str(&mut self, s: &str) {
        for c in s.chars() {
            if self.full() {
                return;
            }
            self.text.push(c);
            self.chars += 1;
        }
    }

    fn push(&mut self, c: char) {
        if !self.full() {
            self.text.push(c);
            self.chars += 1;
        }
    }
}

/// The model's lead of a key.
fn model_lead(out: &mut KeyText, model: Option<&str>) {
    if let Some(model) = model.filter(|m| !m.is_empty()) {
        out.push_str("model");
        out.push(ROLE_SEP);
        out.push_str(&model.chars().take(MAX_MODEL_CHARS).collect::<String>());
        out.push(MSG_SEP);
    }
}

/// The key of a request its dialect read; None when it has no prompt.
fn key_of(keyed: &Keyed) -> Option<String> {
    let asks = keyed.pieces.iter().any(|p| match p {
        Piece::Message(_) => true,
        Piece::Text(t) => !t.is_empty(),
    });
    if !asks {
        return None;
    }
    let mut prompt = KeyText::new();
    let mut after_text = false;
    for piece in &keyed.pieces {
        if prompt.full() {
            break;
        }
        match piece {
            Piece::Message(m) => {
                prompt.push_str(&m.role);
                prompt.push(ROLE_SEP);
                prompt.push_str(&m.content);
                if !m.extra.is_empty() {
                    prompt.push(EXTRA_SEP);
                    // A map of JSON values always serializes; an empty string if not.
                    prompt.push_str(&serde_json::to_string(&m.extra).unwrap_or_default());
                }
                prompt.push(MSG_SEP);
                after_text = false;
            }
            Piece::Text(t) => {
                if after_text {
                    prompt.push(MSG_SEP);
                }
                prompt.push_str(t);
                after_text = true;
            }
        }
    }
    let mut key = KeyText::new();
    model_lead(&mut key, keyed.model.as_deref());
    if let Some(id) = keyed.previous_response_id.as_deref().filter(|i| !i.is_empty()) {
        key.push_str("previous_response_id");
        key.push(ROLE_SEP);
        key.push_str(id);
        key.push(MSG_SEP);
    }
    key.push_str(&prompt.text);
    Some(key.text)
}

/// The key of a body its dialect refuses: its system prompt, then its messages' roles and
/// contents, else its prompt, else (embedding routes) its input or content, as plain text
/// (token ids as a comma list, content parts by their text); the model leads when it is a
/// string.
fn lenient(path: &str, data: &Value) -> Option<String> {
    let mut prompt = KeyText::new();
    if let Some(system) = data.get("system").and_then(Value::as_str) {
        if !system.is_empty() {
            prompt.push_str("system");
            prompt.push(ROLE_SEP);
            prompt.push_str(system);
            prompt.push(MSG_SEP);
        }
    }
    if let Some(messages) = data.get("messages").and_then(Value::as_array) {
        for m in messages.iter().filter(|m| m.is_object()) {
            plain_text(&mut prompt, m.get("role"), 0);
            prompt.push(ROLE_SEP);
            plain_text(&mut prompt, m.get("content"), 0);
            prompt.push(MSG_SEP);
        }
    } else if let Some(p) = data.get("prompt") {
        plain_text(&mut prompt, Some(p), 0);
    } else if path.ends_with("embeddings") || path.ends_with("embedding") || path.ends_with("embed")
    {
        if let Some(v) = data.get("input").or_else(|| data.get("content")) {
            plain_text(&mut prompt, Some(v), 0);
        }
    }
    if prompt.text.is_empty() {
        return None;
    }
    let mut key = KeyText::new();
    model_lead(&mut key, data.get("model").and_then(Value::as_str));
    key.push_str(&prompt.text);
    Some(key.text)
}

/// A value's plain text (see `lenient`); nothing below `MAX_LENIENT_DEPTH` levels.
fn plain_text(out: &mut KeyText, value: Option<&Value>, depth: usize) {
    if depth > MAX_LENIENT_DEPTH || out.full() {
        return;
    }
    match value {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Bool(b)) => out.push_str(if *b { "True" } else { "False" }),
        Some(Value::Number(n)) => {
            out.push_str(&n.to_string());
            out.push(',');
        }
        Some(Value::Object(o)) => match o.get("text") {
            Some(Value::String(t)) => out.push_str(t),
            _ => plain_text(out, o.get("content"), depth + 1),
        },
        Some(Value::Array(items)) => {
            for item in items {
                if out.full() {
                    break;
                }
                plain_text(out, Some(item), depth + 1);
            }
        }
    }
}

