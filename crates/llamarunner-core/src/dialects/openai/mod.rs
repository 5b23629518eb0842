//! The OpenAI dialect (`/v1`): chat and text completions (JSON or server-sent events ending in
//! `data: [DONE]`), embeddings and the model list, with errors in OpenAI's shape. What OpenAI
//! has and a local runner cannot honour (`n` > 1, echo, ...) is refused with a 400 naming the
//! parameter, never silently ignored. Tool calls and reasoning are read by `tool_calls.rs`;
//! this module only puts them in OpenAI's shape.
//!
//! This file holds the completion and model routes and the limits the dialect checks; the
//! request's reading is in `request.rs`, the answer's JSON in `answer.rs`, the streamed chunks
//! in `chunks.rs`, `/v1/embeddings` in `embeddings.rs`, and the answers' wire types (the
//! completion and its chunks, choices, messages, deltas, logprobs, usage, embeddings, models),
//! which serde writes, in `wire.rs`.

mod answer;
mod chunks;
mod embeddings;
mod request;
mod wire;

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{stream, StreamExt};
use serde_json::Value;

use crate::dialects::llama_server::{self, timings};
use crate::http::error::{ApiError, OpenAiError};
use crate::http::state::AppState;
use crate::protocol::params::SamplingParams;
use crate::protocol::{Completion, Event, ModelInfo};
use crate::requests::common::{
    check_model, collect, count_prompt_tokens, model_info, start_generation, unix_seconds,
    PromptSource,
};
use crate::requests::image_prompt::Prompt;
use crate::requests::infill;
use crate::requests::tool_calls::{self, Answer, ChatOutput, ToolRequest};

pub(crate) use answer::chat_logprob;
use answer::{chat_message, finish_reason, usage, usage_of_choices, Meta};
use chunks::{chat_chunks, chunks_for, sse, stream_end, with_usage_null};
pub use embeddings::embeddings;
pub(crate) use embeddings::embeddings_keyed;
pub(crate) use request::{chat_keyed, completions_keyed};
use request::{chat_of, check_continuation, completion_prompt, parse_request, OpenAiRequest};
pub(crate) use wire::LogprobEntry;
use wire::{Delta, InputTokens, Model, ModelList, ModelMeta, Says};

/// Most choices `n` may ask for: each is a sequence in a slot of its own.
pub(crate) const MAX_CHOICES: u32 = 8;

/// Most alternatives `top_logprobs` may ask for (OpenAI's limit; Ollama's API has the same).
pub(crate) const MAX_TOP_LOGPROBS: u32 = 20;

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let req = parse_request(&state, &body)?;
    let (prompt, mut params, output) = chat_prompt_of(&state, &req).await?;
    state
        .sampling_defaults
        .fill_left_out(&mut params, &body, false);
    respond(state, &req, prompt.into(), params, Some(output)).await
}

/// The prompt a chat request generates from (its conversation rendered with its tools), its
/// parameters and the reader of its answer: what `chat_completions` and
/// `POST /v1/chat/completions/input_tokens` both build.
async fn chat_prompt_of(
    state: &AppState,
    req: &OpenAiRequest,
) -> Result<(Prompt, SamplingParams, ChatOutput), ApiError> {
    let chat = chat_of(req)?;
    check_continuation(req, &chat.messages)?;
    let mut params = req.params(true)?;
    params.lora = state.lora.for_request(req.lora.as_ref())?;
    let tools = ToolRequest::parse(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )?;
    let (prompt, output) =
        tool_calls::chat_prompt(state, chat, tools, &mut params, req.template_args()?).await?;
    Ok((prompt, params, output))
}

/// `POST /v1/chat/completions/input_tokens` (llama-server's): the tokens the request's prompt
/// would have, `{"object": "response.input_tokens", "input_tokens": N}`.
pub async fn chat_input_tokens(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let req = parse_request(&state, &body)?;
    let (prompt, _, _) = chat_prompt_of(&state, &req).await?;
    let n = count_prompt_tokens(&state, prompt).await?;
    Ok(Json(InputTokens {
        object: "response.input_tokens",
        input_tokens: n,
    })
    .into_response())
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let req = parse_request(&state, &body)?;
    let prompt = completion_prompt(&req)?;
    let mut params = req.params(false)?;
    state
        .sampling_defaults
        .fill_left_out(&mut params, &body, false);
    params.lora = state.lora.for_request(req.lora.as_ref())?;
    // With a suffix, the prompt is the code before the cursor (`requests/infill.rs`).
    let prompt = match req.suffix.clone().filter(|s| !s.is_empty()) {
        Some(suffix) => {
            let info = model_info(&state)?;
            let parts = infill::Parts {
                prefix: prompt,
                suffix,
                ..infill::Parts::default()
            };
            params.truncate = false;
            crate::requests::validate::check_options(&params).map_err(|e| e.top_level(&[]))?;
            PromptSource::Tokens(infill::tokens(&info, parts, params.num_predict).await?)
        }
        None => prompt.into(),
    };
    respond(state, &req, prompt, params, None).await
}

/// `POST /completions` (no `/v1`): llama-server answers its own `/completion` format there,
/// and an OpenAI client given the server's root as its base URL posts OpenAI's. A body that
/// names no `model` (OpenAI's API requires one, and its clients always send it) is
/// llama-server's (`completion` of `dialects/llama_server/`); one that does, OpenAI's.
pub async fn completions_at_root(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let names_model = serde_json::from_slice::<Value>(&body)
        .is_ok_and(|v| v.as_object().is_some_and(|o| o.contains_key("model")));
    if names_model {
        return completions(State(state), body).await;
    }
    Ok(llama_server::completion(state, &body).await?)
}

async fn respond(
    state: AppState,
    req: &OpenAiRequest,
    prompt: PromptSource,
    params: SamplingParams,
    output: Option<ChatOutput>,
) -> Result<Response, OpenAiError> {
    let chat = output.is_some();
    let want_logprobs = params.logprobs.is_some();
    let meta = Arc::new(Meta::new(&state, chat, req.include_usage()));
    let n = req.n.unwrap_or(1) as usize;
    if n > 1 {
        return respond_many(state, req, meta, prompt, params, output, n).await;
    }
    // llama-server's debug object, for a whole answer: its prompt and settings, kept before
    // they go to the queue.
    let verbose = (req.verbose(&state) && req.stream != Some(true)).then(|| {
        let text = match &prompt {
            PromptSource::Text(p) => p.text.clone(),
            PromptSource::Tokens(_) => String::new(),
        };
        (text, llama_server::Settings::from(&params))
    });
    let rx = start_generation(&state, prompt, params).await?;
    if req.stream != Some(true) {
        let all = collect(rx).await?;
        let answer = output.map(|output| output.read_all(&all.text));
        let mut choice = meta.choice(
            Some(&all.text),
            &all.logprobs,
            want_logprobs,
            Some(finish_reason(all.done.done_reason)),
            false,
        );
        if let Some(answer) = &answer {
            put_answer(&mut choice, answer);
        }
        let mut body = meta.body(false, vec![choice]);
        body.usage = Some(Some(usage(&all.done)));
        body.timings = Some(timings(&all.done));
        body.verbose = verbose.as_ref().map(|(prompt, settings)| {
            llama_server::verbose_body(&state.model_name, prompt, settings, &all.text, &all.done)
        });
        return Ok(Json(body).into_response());
    }
    // The first chat chunk names the role, with no content yet (null, as llama-server sends
    // it; OpenAI sends "", and clients read both).
    let first = chat.then(|| first_chunk(&meta));
    let mut output = output;
    let mut called = false;
    let events = rx.flat_map(move |event| {
        stream::iter(match output.as_mut() {
            Some(reader) => chat_chunks(&meta, reader, &mut called, event, want_logprobs),
            None => chunks_for(&meta, event, want_logprobs),
        })
    });
    let body = stream::iter(first).chain(events).map(Ok::<_, Infallible>);
    Ok(Sse::new(body).into_response())
}

/// `n` > 1 choices of one prompt. The first is started alone and, once its first token is
/// out (its prompt is in its slot's cache), the others, which then fork that prompt from its
/// slot (prefix sharing between slots, `--multiuser-cache`) rather than decode it again. A
/// seeded request gives choice `i` the seed + `i`, so that the choices differ. `usage` counts
/// the prompt once and every choice's tokens.
async fn respond_many(
    state: AppState,
    req: &OpenAiRequest,
    meta: Arc<Meta>,
    prompt: PromptSource,
    params: SamplingParams,
    output: Option<ChatOutput>,
    n: usize,
) -> Result<Response, OpenAiError> {
    let want_logprobs = params.logprobs.is_some();
    let mut generations = Vec::with_capacity(n);
    let whole = req.stream != Some(true);
    let mut first = start_generation(&state, prompt.clone(), params.clone()).await?;
    first.wait_first().await;
    // Read only at the end, after the others start: held meanwhile (the first once its first
    // token, which starts the others, is out).
    if whole {
        first.read_whole();
    }
    generations.push(first);
    for i in 1..n {
        let mut p = params.clone();
        if p.seed < 0 {
            p.seed = state.default_seed;
        }
        if p.seed >= 0 {
            p.seed = (p.seed % (1 << 32) + i as i64) % (1 << 32);
        }
        let generation = start_generation(&state, prompt.clone(), p).await?;
        if whole {
            generation.read_whole();
        }
        generations.push(generation);
    }
    let metas: Vec<Meta> = (0..n).map(|i| meta.for_choice(i)).collect();
    if whole {
        let all = futures_util::future::join_all(generations.into_iter().map(collect)).await;
        let all = all.into_iter().collect::<Result<Vec<_>, _>>()?;
        let answers: Vec<Option<Answer>> = all
            .iter()
            .map(|one| output.clone().map(|output| output.read_all(&one.text)))
            .collect();
        let mut choices = Vec::with_capacity(n);
        for ((one, answer), m) in all.iter().zip(&answers).zip(&metas) {
            let mut choice = m.choice(
                Some(&one.text),
                &one.logprobs,
                want_logprobs,
                Some(finish_reason(one.done.done_reason)),
                false,
            );
            if let Some(answer) = answer {
                put_answer(&mut choice, answer);
            }
            choices.push(choice);
        }
        let dones: Vec<Completion> = all.iter().map(|one| one.done.clone()).collect();
        let mut body = meta.body(false, choices);
        body.usage = Some(usage_of_choices(&dones));
        return Ok(Json(body).into_response());
    }
    let chat = output.is_some();
    let first_chunks: Vec<SseEvent> = if chat {
        metas.iter().map(first_chunk).collect()
    } else {
        Vec::new()
    };
    let mut readers: Vec<Option<ChatOutput>> = vec![output; n];
    let mut called = vec![false; n];
    // By choice, so that the usage's prompt is the first choice's.
    let mut dones: Vec<Option<Completion>> = vec![None; n];
    let mut ended = 0;
    let merged = stream::select_all(
        generations
            .into_iter()
            .enumerate()
            .map(|(i, g)| g.map(move |event| (i, event)).boxed()),
    );
    let events = merged.flat_map(move |(i, event)| {
        let finished = matches!(event, Event::Done(_) | Event::Error(_));
        if let Event::Done(done) = &event {
            dones[i] = Some(done.clone());
        }
        let m = &metas[i];
        let mut out = match readers[i].as_mut() {
            Some(reader) => chat_chunks(m, reader, &mut called[i], event, want_logprobs),
            None => chunks_for(m, event, want_logprobs),
        };
        ended += usize::from(finished);
        if finished && ended == n {
            let dones: Vec<Completion> = dones.iter().flatten().cloned().collect();
            out.extend(stream_end(&meta, usage_of_choices(&dones), None));
        }
        stream::iter(out)
    });
    let body = stream::iter(first_chunks)
        .chain(events)
        .map(Ok::<_, Infallible>);
    Ok(Sse::new(body).into_response())
}

/// A whole chat answer in its choice: the message read for calls and reasoning, and
/// `tool_calls` as the finish reason when it called.
fn put_answer<'a>(choice: &mut wire::Choice<'a>, answer: &'a Answer) {
    if !answer.calls.is_empty() {
        choice.finish_reason = Some("tool_calls");
    }
    choice.says = Says::Message(chat_message(answer));
}

/// A chat stream's first chunk: the role, with no content yet (null, as llama-server sends
/// it; OpenAI sends "", and clients read both).
fn first_chunk(meta: &Meta) -> SseEvent {
    let mut choice = meta.choice(None, &[], false, None, true);
    choice.says = Says::Delta(Delta {
        role: Some("assistant"),
        content: Some(None),
        ..Delta::default()
    });
    sse(&with_usage_null(meta, meta.body(true, vec![choice])))
}

fn model_entry<'a>(state: &'a AppState, info: &ModelInfo) -> Model<'a> {
    Model {
        id: state.model_name.as_ref(),
        object: "model",
        created: info.modified.map_or(0, unix_seconds),
        owned_by: "llamarunner",
        meta: ModelMeta {
            n_vocab: info.n_vocab,
            n_ctx: info.slot_ctx,
            n_ctx_train: info.n_ctx_train,
            n_embd: info.n_embd,
            n_params: info.n_params,
            size: info.file_size,
        },
    }
}

/// `GET /v1/models`: the one model served, under its alias.
pub async fn models(State(state): State<AppState>) -> Result<Response, OpenAiError> {
    let info = model_info(&state)?;
    Ok(Json(ModelList {
        object: "list",
        data: [model_entry(&state, &info)],
    })
    .into_response())
}

/// `GET /v1/models/{model}`.
pub async fn model(
    State(state): State<AppState>,
    name: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Response, OpenAiError> {
    let info = model_info(&state)?;
    // A name that is not valid UTF-8 once decoded (`%ff`) is an error in OpenAI's shape too.
    let Path(name) = name.map_err(|e| ApiError::invalid(format!("model name: {e}")))?;
    check_model(&state, Some(&name))?;
    Ok(Json(model_entry(&state, &info)).into_response())
}

#[cfg(test)]
mod tests;
