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
//!   embeddings their texts, MSG_SEP between; `/infill` its files and the code before the
//!   cursor (what its cached tokens start with);
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
        "/v1/chat/completions" | "/chat/completions" => openai::chat_keyed,
        "/v1/completions" | "/completions" => openai::completions_keyed,
        "/v1/embeddings" | "/embeddings" => openai::embeddings_keyed,
        "/v1/responses" | "/responses" => responses::keyed,
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
    if let Some(id) = keyed
        .previous_response_id
        .as_deref()
        .filter(|i| !i.is_empty())
    {
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

#[cfg(test)]
mod tests {
    use super::{route, routing_key, MAX_KEY_CHARS};
    use proptest::prelude::*;
    use serde_json::{json, Value};

    fn key(path: &str, body: &Value) -> Option<String> {
        routing_key(path, body.to_string().as_bytes())
    }

    /// Two turns of one conversation and a turn of another, in each dialect's shape.
    fn turns(path: &str, topic: &str) -> (Value, Value) {
        let user = format!("tell me about {topic}");
        match path {
            "/v1/chat/completions" | "/api/chat" | "/completion" => {
                let first = json!([{"role": "system", "content": "brief"}, {"role": "user", "content": user}]);
                let mut second = first.clone();
                if let Some(list) = second.as_array_mut() {
                    list.push(json!({"role": "assistant", "content": "it is"}));
                    list.push(
                        json!({"role": "user", "content": [{"type": "text", "text": "more"}]}),
                    );
                }
                (
                    json!({"model": "m", "messages": first}),
                    json!({"model": "m", "messages": second}),
                )
            }
            "/v1/messages" => (
                json!({"model": "m", "system": "brief", "max_tokens": 8,
                       "messages": [{"role": "user", "content": user}]}),
                json!({"model": "m", "system": "brief", "max_tokens": 8, "messages": [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": [{"type": "text", "text": "it is"}]},
                    {"role": "user", "content": [{"type": "text", "text": "more"}]}]}),
            ),
            "/v1/responses" => (
                json!({"model": "m", "instructions": "brief", "input": user}),
                json!({"model": "m", "instructions": "brief", "input": [
                    {"role": "user", "content": user},
                    {"type": "message", "role": "assistant",
                     "content": [{"type": "output_text", "text": "it is"}]},
                    {"role": "user", "content": [{"type": "input_text", "text": "more"}]}]}),
            ),
            // Text prompts: the next one continues the text.
            "/v1/completions" | "/api/generate" => (
                json!({"model": "m", "prompt": user}),
                json!({"model": "m", "prompt": format!("{user} it is. more")}),
            ),
            "/infill" => (
                json!({"model": "m", "input_extra": [{"filename": "a.py", "text": user}],
                       "input_prefix": "def f("}),
                json!({"model": "m", "input_extra": [{"filename": "a.py", "text": user}],
                       "input_prefix": "def f(x):\n", "input_suffix": "\n"}),
            ),
            _ => unreachable!("no such dialect in the test"),
        }
    }

    #[test]
    fn every_dialects_next_turn_extends_its_key_and_conversations_differ() {
        for path in [
            "/completion",
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/messages",
            "/api/generate",
            "/api/chat",
            "/infill",
        ] {
            let (first, second) = turns(path, "cats");
            let (k1, k2) = (key(path, &first), key(path, &second));
            let (Some(k1), Some(k2)) = (k1, k2) else {
                panic!("{path}: no key for {first} or {second}");
            };
            assert!(k2.starts_with(&k1) && k2 != k1, "{path}: {k1:?} / {k2:?}");
            assert!(k1.starts_with("model\x1fm\x1e"), "{path}: {k1:?}");
            let other = key(path, &turns(path, "dogs").0).unwrap_or_default();
            assert!(!other.starts_with(&k1) && !k2.starts_with(&other), "{path}");
        }
    }

    #[test]
    fn the_same_conversation_keys_alike_across_chat_dialects() {
        // A conversation is its messages, whichever dialect carries it.
        let messages =
            json!([{"role": "system", "content": "brief"}, {"role": "user", "content": "hi"}]);
        let openai = key(
            "/v1/chat/completions",
            &json!({"model": "m", "messages": messages}),
        );
        let ollama = key("/api/chat", &json!({"model": "m", "messages": messages}));
        let anthropic = key(
            "/v1/messages",
            &json!({"model": "m", "system": "brief", "messages": [{"role": "user", "content": "hi"}]}),
        );
        let responses = key(
            "/v1/responses",
            &json!({"model": "m", "instructions": "brief", "input": "hi"}),
        );
        assert!(openai.is_some());
        assert_eq!(openai, ollama);
        assert_eq!(openai, anthropic);
        assert_eq!(openai, responses);
    }

    #[test]
    fn a_response_that_continues_another_names_it() {
        let body = json!({"model": "m", "previous_response_id": "resp_1", "input": "more"});
        let found = route("/v1/responses", body.to_string().as_bytes());
        assert_eq!(found.previous_response_id.as_deref(), Some("resp_1"));
        assert_eq!(
            found.key.as_deref(),
            Some("model\x1fm\x1eprevious_response_id\x1fresp_1\x1euser\x1fmore\x1e")
        );
        // No input: the stored conversation is the prompt; the id still routes it.
        let body = json!({"previous_response_id": "resp_1"});
        let found = route("/v1/responses", body.to_string().as_bytes());
        assert_eq!(found.previous_response_id.as_deref(), Some("resp_1"));
        assert_eq!(found.key, None);
        let none = route(
            "/v1/responses",
            br#"{"input": "x", "previous_response_id": ""}"#,
        );
        assert_eq!(none.previous_response_id, None);
    }

    #[test]
    fn requests_that_generate_nothing_have_no_key() {
        for (path, body) in [
            ("/api/generate", json!({"model": "m"})),
            ("/api/chat", json!({"model": "m", "messages": []})),
            ("/api/embeddings", json!({"model": "m", "prompt": ""})),
            ("/infill", json!({})),
            ("/tokenize", json!({"content": "x"})),
            ("/v1/rerank", json!({"query": "q", "documents": ["d"]})),
            (
                "/v1/messages/count_tokens",
                json!({"messages": [{"role": "user", "content": "x"}]}),
            ),
        ] {
            assert_eq!(key(path, &body), None, "{path} {body}");
        }
        for body in [&b""[..], b"not json", b"[1]", b"\"s\"", b"{}", b"\xff"] {
            assert_eq!(routing_key("/v1/chat/completions", body), None);
        }
    }

    #[test]
    fn embeddings_are_keyed_by_their_texts() {
        assert_eq!(
            key("/v1/embeddings", &json!({"input": ["a", "b"]})).as_deref(),
            Some("a\x1eb")
        );
        assert_eq!(
            key("/api/embed", &json!({"input": "a"})).as_deref(),
            Some("a")
        );
        assert_eq!(
            key("/api/embeddings", &json!({"prompt": "a"})).as_deref(),
            Some("a")
        );
        assert_eq!(
            key("/embedding", &json!({"content": "a"})).as_deref(),
            Some("a")
        );
    }

    #[test]
    fn keys_are_bounded() {
        let long = "é".repeat(MAX_KEY_CHARS * 2);
        let k = key(
            "/v1/chat/completions",
            &json!({"model": long, "messages": [{"role": "user", "content": long}]}),
        );
        assert_eq!(k.map(|k| k.chars().count()), Some(MAX_KEY_CHARS));
        let k = key(
            "/completion",
            &json!({"prompt": (0..100_000).collect::<Vec<_>>()}),
        );
        assert_eq!(k.map(|k| k.chars().count()), Some(MAX_KEY_CHARS));
        let deep = format!(
            "{{\"prompt\": {}{}}}",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert_eq!(routing_key("/completion", deep.as_bytes()), None);
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            "[a-z\u{1f}\u{1e} é]{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(5, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map(
                    prop_oneof![
                        Just("role".to_string()),
                        Just("content".to_string()),
                        Just("type".to_string()),
                        Just("text".to_string()),
                        Just("messages".to_string()),
                        Just("input".to_string()),
                        Just("prompt".to_string()),
                        Just("model".to_string()),
                        Just("system".to_string()),
                        Just("image_url".to_string()),
                        Just("previous_response_id".to_string()),
                        "[a-z_]{1,8}",
                    ],
                    inner,
                    0..6
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    const PATHS: [&str; 12] = [
        "/completion",
        "/embedding",
        "/infill",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/api/generate",
        "/api/chat",
        "/api/embed",
        "/api/embeddings",
    ];

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, rng_seed: proptest::test_runner::RngSeed::Fixed(39), ..ProptestConfig::default() })]

        /// Any body, well-formed or not: a bounded key or none, led by the model when the
        /// model is a string; never a panic.
        #[test]
        fn hostile_bodies_give_a_bounded_key_or_none(path in prop::sample::select(&PATHS[..]), body in json_value(), cut in 0usize..64) {
            let text = body.to_string();
            for bytes in [text.as_bytes(), &text.as_bytes()[..cut.min(text.len())]] {
                let found = route(path, bytes);
                if let Some(k) = &found.key {
                    prop_assert!(!k.is_empty() && k.chars().count() <= MAX_KEY_CHARS);
                    if let Some(model) = body.get("model").and_then(Value::as_str).filter(|m| !m.is_empty()) {
                        let lead = format!("model\x1f{model}\x1e");
                        prop_assert!(k.starts_with(&lead));
                    }
                }
                if found.previous_response_id.is_some() {
                    prop_assert_eq!(path, "/v1/responses");
                }
            }
        }
    }
}
