//! OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`): the
//! input items read into the chat path every dialect shares (template, function tools,
//! reasoning, schemas), the answer written back as output items (`reasoning`, `message`,
//! `function_call`), whole or as the `response.*` event stream. `previous_response_id` continues
//! a conversation kept in a bounded in-memory store (`response_store.rs`); `store: false` keeps
//! nothing. What the API has and a local runner cannot honour (built-in tools, files,
//! conversations, background mode) is refused with a 400 naming it.
//!
//! This file holds the routes and how a request is prepared; the request's fields, parameters,
//! tools and metadata are in `request.rs`, its input items as chat messages in `input.rs`, the
//! response object and its output items in `answer.rs`, the event stream in `events.rs`, and
//! the answers' wire types (response object, output items, usage, event payloads), which serde
//! writes, in `wire.rs`.

mod answer;
mod events;
mod input;
mod request;
mod wire;

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderName, HeaderValue};
use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{stream, StreamExt};
use serde_json::Value;

use crate::dialects::llama_server::StreamClock;
use crate::http::error::{ApiError, OpenAiError};
use crate::http::state::AppState;
use crate::protocol::params::SamplingParams;
use crate::requests::common::{
    collect, count_prompt_tokens, model_info, parse_json, parse_messages, start_generation,
};
use crate::requests::image_prompt::Prompt;
use crate::requests::keyed::{Keyed, Piece};
use crate::requests::tool_calls::{self, ChatOutput, OutPiece};

use answer::{item_status, keep_response, whole_items, Finished, Meta};
use events::Items;
use input::input_messages_after;
use request::{check_metadata, tool_request, with_instructions, ResponsesRequest};
use wire::{Deleted, InputTokens, OutputItem, ResponseEvent};

/// The answer header of `POST /v1/responses` that names the response it stored (absent when
/// the request asked it not be stored): a router of many servers learns there which one a
/// follow-up's `previous_response_id` must reach (`routing_key.rs`).
pub const RESPONSE_ID_HEADER: &str = "x-llamarunner-response-id";

/// What a Responses request generates from: the prompt (the previous response's conversation,
/// then this input, rendered with its tools), its parameters, the reader of its answer and
/// the conversation to keep with it.
struct Prepared {
    prompt: Prompt,
    params: SamplingParams,
    output: ChatOutput,
    history: Vec<Value>,
}

async fn prepare(state: &AppState, req: &ResponsesRequest) -> Result<Prepared, ApiError> {
    check_metadata(req.metadata.as_ref())?;
    let mut params = req.params()?;
    params.lora = state.lora.for_request(req.lora.as_ref())?;
    // The conversation: the previous response's, then this input.
    let history = match req.previous_response_id.as_deref() {
        None | Some("") => Vec::new(),
        Some(id) => {
            state
                .responses
                .get(id)
                .ok_or_else(|| {
                    ApiError::NotFound(format!("Previous response with id {id:?} not found."))
                })?
                .messages
        }
    };
    let history = input_messages_after(history, req.input.as_ref())?;
    if history.is_empty() {
        return Err(ApiError::field("input", " is required"));
    }
    let chat = parse_messages(with_instructions(req, &history))?;
    let tools = tool_request(req)?;
    let (prompt, output) =
        tool_calls::chat_prompt(state, chat, tools, &mut params, req.think()?.into()).await?;
    Ok(Prepared {
        prompt,
        params,
        output,
        history,
    })
}

/// `POST /v1/responses/input_tokens` (OpenAI's and llama-server's): the tokens the request's
/// prompt would have, `{"object": "response.input_tokens", "input_tokens": N}`.
pub async fn input_tokens(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    model_info(&state)?;
    let req: ResponsesRequest = parse_json(&body)?;
    let prepared = prepare(&state, &req).await?;
    let n = count_prompt_tokens(&state, prepared.prompt).await?;
    Ok(Json(InputTokens {
        object: "response.input_tokens",
        input_tokens: n,
    })
    .into_response())
}

/// `POST /v1/responses`.
pub async fn create(State(state): State<AppState>, body: Bytes) -> Result<Response, OpenAiError> {
    model_info(&state)?;
    let req: ResponsesRequest = parse_json(&body)?;
    let Prepared {
        prompt,
        mut params,
        output,
        history,
    } = prepare(&state, &req).await?;
    state
        .sampling_defaults
        .fill_left_out(&mut params, &body, false);
    let meta = Arc::new(Meta::new(&state, &req, &params));
    let rx = start_generation(&state, prompt, params).await?;
    let keep = req.store != Some(false);
    let store = keep.then(|| (state.responses.clone(), history));
    if req.stream != Some(true) {
        let all = collect(rx).await?;
        let answer = output.read_all(&all.text);
        let mut pieces = Vec::new();
        if !answer.reasoning.is_empty() {
            pieces.push(OutPiece::Reasoning(answer.reasoning));
        }
        if !answer.content.is_empty() {
            pieces.push(OutPiece::Content(answer.content));
        }
        if !answer.calls.is_empty() {
            pieces.push(OutPiece::Calls(answer.calls));
        }
        let status = item_status(&all.done);
        let items: Vec<OutputItem> = pieces
            .into_iter()
            .flat_map(|p| whole_items(p, status))
            .collect();
        let response = meta.object(&Finished::from(&all.done), &items);
        if let Some((store, history)) = store {
            keep_response(&store, &meta.id, history, &items, &response);
        }
        return Ok(named(Json(response).into_response(), &meta.id, keep));
    }
    let clock = (req.timings_per_token == Some(true)).then(|| StreamClock::new(&rx));
    let mut writer = Items::new(meta.clone(), output, store, clock);
    let head = ["response.created", "response.in_progress"].map(|kind| {
        let data = ResponseEvent {
            response: meta.object(&Finished::InProgress, &[]),
            prompt_progress: None,
            timings: None,
        };
        writer.event(kind, data)
    });
    let events = rx.flat_map(move |e| stream::iter(writer.on(e)));
    let body = stream::iter(head).chain(events).map(Ok::<_, Infallible>);
    Ok(named(Sse::new(body).into_response(), &meta.id, keep))
}

/// An answer that stores its response names it in `RESPONSE_ID_HEADER`, so that a router of
/// many servers learns which one holds it (a follow-up's `previous_response_id` must go there;
/// `dialects/routing_key.rs`).
fn named(mut response: Response, id: &str, stored: bool) -> Response {
    if let (true, Ok(value)) = (stored, HeaderValue::from_str(id)) {
        response
            .headers_mut()
            .insert(HeaderName::from_static(RESPONSE_ID_HEADER), value);
    }
    response
}

/// `/v1/responses` as `routing_key` reads it: as `create` does, without the stored
/// conversation a `previous_response_id` continues (one server holds it: the id is kept apart
/// for the router).
pub(crate) fn keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: ResponsesRequest = parse_json(body)?;
    let history = input_messages_after(Vec::new(), req.input.as_ref())?;
    let messages = with_instructions(&req, &history);
    let pieces = if messages.is_empty() {
        Vec::new()
    } else {
        parse_messages(messages)?
            .messages
            .into_iter()
            .map(Piece::Message)
            .collect()
    };
    Ok(Keyed {
        model: req.model,
        previous_response_id: req.previous_response_id,
        pieces,
    })
}

/// `GET /v1/responses/{id}`: a kept response.
pub async fn retrieve(
    State(state): State<AppState>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Response, OpenAiError> {
    let Path(id) = id.map_err(|e| ApiError::invalid(format!("response id: {e}")))?;
    let stored = state
        .responses
        .get(&id)
        .ok_or_else(|| ApiError::NotFound(format!("Response with id {id:?} not found.")))?;
    Ok(Json(stored.response).into_response())
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(
    State(state): State<AppState>,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Response, OpenAiError> {
    let Path(id) = id.map_err(|e| ApiError::invalid(format!("response id: {e}")))?;
    if !state.responses.remove(&id) {
        return Err(ApiError::NotFound(format!("Response with id {id:?} not found.")).into());
    }
    Ok(Json(Deleted {
        id: &id,
        object: "response",
        deleted: true,
    })
    .into_response())
}

#[cfg(test)]
mod tests;
