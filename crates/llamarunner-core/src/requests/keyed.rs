//! What a request asks the model for, as its dialect reads it (before the model's template
//! renders it): the model it names, its prompt's pieces, the stored response it continues.
//! Each dialect's reader (`*_keyed` in `dialects/`) gives one, from the same functions its
//! handler calls; `dialects/routing_key.rs` makes a request's routing key of it.

use crate::chat::ChatMessage;

/// A piece of a request's prompt, as its dialect reads it.
#[derive(Debug)]
pub enum Piece {
    /// A chat message, as the template is given it.
    Message(ChatMessage),
    /// Text as it is (a completion's prompt, an input to embed).
    Text(String),
}

/// What a request asks the model for, as its dialect reads it.
#[derive(Debug, Default)]
pub struct Keyed {
    /// The model it names.
    pub model: Option<String>,
    /// The stored response it continues (`/v1/responses`).
    pub previous_response_id: Option<String>,
    /// Its prompt; empty: it generates nothing.
    pub pieces: Vec<Piece>,
}

impl Keyed {
    /// A request for `model` with these pieces.
    pub fn new(model: Option<String>, pieces: Vec<Piece>) -> Self {
        Keyed {
            model,
            previous_response_id: None,
            pieces,
        }
    }

    /// A conversation's request.
    pub fn chat(model: Option<String>, messages: Vec<ChatMessage>) -> Self {
        Keyed::new(model, messages.into_iter().map(Piece::Message).collect())
    }

    /// A text prompt's request.
    pub fn texts(model: Option<String>, texts: Vec<String>) -> Self {
        Keyed::new(model, texts.into_iter().map(Piece::Text).collect())
    }
}
