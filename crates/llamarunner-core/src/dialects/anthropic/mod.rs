//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the
//! request read into the chat path every dialect shares (template, tools, reasoning), the
//! answer written back as content blocks (`thinking`, `text`, `tool_use`), whole or as
//! Anthropic's event stream, with errors in Anthropic's shape. What the API has and a local
//! runner cannot honour (server tools, documents, citations) is refused with a 400 naming it.
//!
//! This file holds the routes (and fills a whole answer); the request's fields and sampling
//! parameters are in `request.rs`, its messages and tools as the chat path reads them in
//! `conversation.rs`, what every part of an answer repeats in `answer.rs`, the event stream in
//! `events.rs`, and the answer's wire types (message, content blocks, usage, stream events),
//! which serde writes, in `wire.rs`.

mod answer;
mod conversation;
mod events;
mod request;
mod wire;

use std::borrow::Cow;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{stream, StreamExt};

use crate::http::error::{AnthropicError, ApiError};
use crate::http::state::AppState;
use crate::protocol::params::SamplingParams;
use crate::requests::common::{
    collect, count_prompt_tokens, model_info, parse_json, start_generation,
};
use crate::requests::image_prompt::Prompt;
use crate::requests::keyed::Keyed;
use crate::requests::tool_calls::{self, ChatOutput};

use answer::{tool_use_id, usage, Meta};
use conversation::{conversation, tool_request};
use events::{event, Blocks};
use request::{parse_request, MessagesRequest};
use wire::{ContentBlock, Message, StreamEvent, TokenCount, Usage};

/// `/v1/messages` as `routing_key` reads it: as `messages` does.
pub(crate) fn keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: MessagesRequest = parse_json(body)?;
    let chat = conversation(&req)?;
    Ok(Keyed::chat(req.model, chat.messages))
}

/// A request read: the prompt (rendered, with its images) and how to read the answer.
async fn prepare(
    state: &AppState,
    req: &MessagesRequest,
    params: &mut SamplingParams,
) -> Result<(Prompt, ChatOutput), ApiError> {
    let chat = conversation(req)?;
    let tools = tool_request(req.tools.as_deref(), req.tool_choice.as_ref())?;
    tool_calls::chat_prompt(state, chat, tools, params, req.think()?.into()).await
}

/// `POST /v1/messages`.
pub async fn messages(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, AnthropicError> {
    let req = parse_request(&state, &body)?;
    let mut params = req.params()?;
    state
        .sampling_defaults
        .fill_left_out(&mut params, &body, false);
    params.lora = state.lora.for_request(req.lora.as_ref())?;
    let (prompt, output) = prepare(&state, &req, &mut params).await?;
    let meta = Arc::new(Meta {
        id: format!("msg_{}", crate::http::access::current_id().replace('-', "")),
        model: state.model_name.to_string(),
        stop_sequences: req.stop_sequences.clone().unwrap_or_default(),
    });
    let rx = start_generation(&state, prompt, params).await?;
    if req.stream != Some(true) {
        let all = collect(rx).await?;
        let answer = output.read_all(&all.text);
        let mut content = Vec::new();
        if !answer.reasoning.is_empty() {
            content.push(ContentBlock::Thinking {
                thinking: &answer.reasoning,
                signature: "",
            });
        }
        if !answer.content.is_empty() {
            content.push(ContentBlock::Text {
                text: &answer.content,
            });
        }
        for call in &answer.calls {
            content.push(ContentBlock::ToolUse {
                id: tool_use_id(),
                name: &call.name,
                input: Cow::Borrowed(&call.arguments),
            });
        }
        let stop = meta.stop_reason(&all.done, !answer.calls.is_empty());
        let message = Message::new(&meta.id, &meta.model, content, Some(stop), usage(&all.done));
        return Ok(Json(message).into_response());
    }
    let start = StreamEvent::MessageStart {
        message: Message::new(
            &meta.id,
            &meta.model,
            Vec::new(),
            None,
            Usage {
                input_tokens: rx.prompt_tokens,
                output_tokens: 0,
                cache_read_input_tokens: None,
                cache_creation_input_tokens: None,
            },
        ),
    };
    let head = [event(&start), event(&StreamEvent::Ping)];
    let mut writer = Blocks::new(meta, output);
    let events = rx.flat_map(move |e| stream::iter(writer.on(e)));
    let body = stream::iter(head).chain(events).map(Ok::<_, Infallible>);
    // A call is held back until it is whole: pings keep a quiet stream alive, as Anthropic's.
    let ping = SseEvent::default().event("ping").data(r#"{"type":"ping"}"#);
    Ok(Sse::new(body)
        .keep_alive(KeepAlive::new().event(ping))
        .into_response())
}

/// Body of `POST /v1/messages/count_tokens`' answer: the prompt's tokens, as the request
/// would be rendered (system, tools, images included).
pub async fn count_tokens(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, AnthropicError> {
    let req = parse_request(&state, &body)?;
    model_info(&state)?;
    let mut params = SamplingParams::default();
    let (prompt, _) = prepare(&state, &req, &mut params).await?;
    let n = count_prompt_tokens(&state, prompt).await?;
    Ok(Json(TokenCount { input_tokens: n }).into_response())
}

#[cfg(test)]
mod tests;
