//! The runner's native API, the Ollama runner's wire format: `POST /completion` (NDJSON stream)
//! and `POST /embedding`. Health, props, slots and the tokenizer routes are in `ops/`. The
//! answers are serde types (at the end of this file), their fields declared in the order they
//! are written.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

use crate::config::Pooling;
use crate::http::error::ApiError;
use crate::http::AppState;
use crate::protocol::Event;
use crate::requests::common::{
    chat_prompt, check_embedder, embed_all, embed_tokens, ensure_ready, model_info, parse_json,
    parse_messages, start_generation, Chat, MAX_UNPOOLED_VALUES,
};
use crate::requests::format::grammar_for_format;
use crate::requests::image_prompt::{self, Prompt};
use crate::requests::keyed::Keyed;
use crate::requests::options::Options;
use crate::requests::tool_calls::{self, ChatOutput, OutPiece};
use crate::requests::validate;

/// Body of `POST /completion`. Unknown fields are ignored, as in the Ollama runner; the Go
/// runner's capitalized keys are accepted too.
#[derive(Debug, Deserialize)]
struct CompletionRequest {
    /// The model: any name is the one model here (`requests::common::check_model`); the
    /// routing key leads with it, and a router picks the engine by it.
    #[serde(default, alias = "Model")]
    model: Option<String>,
    #[serde(default, alias = "Prompt")]
    prompt: Option<String>,
    /// A conversation, rendered with the model's chat template, instead of `prompt`.
    #[serde(default)]
    messages: Option<Vec<serde_json::Value>>,
    /// With `messages`: Ollama's `think` (true, false, "high"/"medium"/"low"). Given, the
    /// template is asked to think (or not) and a thinking model's `<think>` reasoning comes
    /// apart from the content, in `thinking` (as `/api/chat` splits it); absent, the text is
    /// as generated.
    #[serde(default)]
    think: Option<serde_json::Value>,
    #[serde(default, alias = "Options")]
    options: Option<Options>,
    #[serde(default, alias = "Grammar")]
    grammar: Option<String>,
    #[serde(default, alias = "Format")]
    format: Option<serde_json::Value>,
    #[serde(default, alias = "Images")]
    images: Option<Vec<serde_json::Value>>,
    #[serde(default, alias = "Shift")]
    shift: Option<bool>,
    #[serde(default, alias = "Truncate")]
    truncate: Option<bool>,
    /// LoRA adapter scales, as llama-server's (`requests/lora.rs`); also taken from `options`.
    #[serde(default)]
    lora: Option<serde_json::Value>,
    /// Speculative decoding on or off for this request (also accepted in `options`).
    #[serde(default)]
    speculative: Option<bool>,
    /// false: decode the whole prompt, reusing no cached prefix (llama-server's field).
    #[serde(default)]
    cache_prompt: Option<bool>,
    /// true: the output must depend on the request alone (`--deterministic`), else 400.
    #[serde(default)]
    deterministic: Option<bool>,
}

/// A text field that must be present and non-empty.
fn required(name: &str, value: Option<String>) -> Result<String, ApiError> {
    value.filter(|v| !v.is_empty()).ok_or_else(|| {
        ApiError::InvalidRequest(format!("{name} is required and must not be empty"))
    })
}

/// What `/completion` is asked to continue: a conversation or a text.
enum Input {
    Chat(Chat),
    Text(String),
}

/// The request's `messages` (parsed) or its `prompt` (non-empty), one and not both; images
/// go in the messages when there are messages.
fn input(
    prompt: Option<String>,
    messages: Option<Vec<serde_json::Value>>,
    images: Option<&[serde_json::Value]>,
) -> Result<Input, ApiError> {
    match messages {
        Some(_) if prompt.as_ref().is_some_and(|p| !p.is_empty()) => Err(ApiError::InvalidRequest(
            "give either prompt or messages, not both".into(),
        )),
        Some(messages) => {
            if images.is_some_and(|i| !i.is_empty()) {
                return Err(ApiError::InvalidImage(
                    "with messages, images go in the messages (their images or image_url parts)"
                        .into(),
                ));
            }
            Ok(Input::Chat(parse_messages(messages)?))
        }
        None => Ok(Input::Text(required("prompt", prompt)?)),
    }
}

/// `/completion` as `routing_key` reads it: as `completion` does.
pub(crate) fn completion_keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: CompletionRequest = parse_json(body)?;
    Ok(
        match input(req.prompt, req.messages, req.images.as_deref())? {
            Input::Chat(chat) => Keyed::chat(req.model, chat.messages),
            Input::Text(text) => Keyed::texts(req.model, vec![text]),
        },
    )
}

/// `POST /completion`: the Ollama runner's format, or llama-server's for a body in it
/// (`llama_server::is_llama_server_body`).
pub async fn completion(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    ensure_ready(&state)?;
    if super::llama_server::is_llama_server_body(&body) {
        return super::llama_server::completion(state, &body).await;
    }
    let req: CompletionRequest = parse_json(&body)?;
    let info = model_info(&state)?;
    let think = crate::requests::thinking::parse_think(req.think.as_ref())?;
    let options = req.options.unwrap_or_default();
    let lora = state
        .lora
        .for_request(req.lora.as_ref().or(options.lora.as_ref()))?;
    let mut params = options.into_params();
    state
        .sampling_defaults
        .fill_left_out(&mut params, &body, true);
    params.lora = lora;
    params.shift = req.shift.unwrap_or(true);
    params.truncate = req.truncate.unwrap_or(true);
    params.speculative = req.speculative.or(params.speculative);
    params.cache_prompt = req.cache_prompt.unwrap_or(true);
    params.deterministic = req.deterministic.unwrap_or(false);
    params.grammar = match req.grammar.filter(|g| !g.trim().is_empty()) {
        Some(g) => Some(crate::constrain::Grammar::new(
            crate::constrain::GrammarSource::Gbnf(g),
        )),
        None => {
            grammar_for_format(&req.format.unwrap_or_default()).map_err(ApiError::InvalidRequest)?
        }
    };
    // The reader of the answer's reasoning, when the request asks for it (`think`).
    let mut output: Option<ChatOutput> = None;
    let prompt = match input(req.prompt, req.messages, req.images.as_deref())? {
        Input::Chat(chat) => {
            image_prompt::check_images(&info, chat.images.len())?;
            let text = if think.is_some() {
                // The chat dialects' path: the template's thinking switch, and the output
                // read for reasoning (no tools: the native API offers none).
                let (text, reader) = tool_calls::chat_request(
                    &state,
                    chat.messages,
                    None,
                    &mut params,
                    think.into(),
                )
                .await?;
                output = Some(reader);
                text
            } else {
                chat_prompt(&state, chat.messages, &mut params).await?
            };
            Prompt {
                text,
                images: chat.images,
            }
        }
        Input::Text(_) if think == Some(true) => {
            return Err(ApiError::field(
                "think",
                ": thinking is split out of a conversation (messages); a prompt is \
                 completed as it is",
            ))
        }
        Input::Text(prompt) => image_prompt::native_prompt(&info, prompt, req.images)?,
    };

    let generation = start_generation(&state, prompt, params).await?;
    let lines = generation.flat_map(move |event| {
        let lines = match output.as_mut() {
            Some(output) => split_lines(output, &event),
            None => vec![ndjson(&event)],
        };
        futures_util::stream::iter(
            lines
                .into_iter()
                .map(|line| Ok::<_, Infallible>(Bytes::from(line))),
        )
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response())
}

/// The lines of an engine event of a chat whose reasoning is split out: the text's pieces as
/// `{"content"}` or `{"content": "", "thinking"}` lines (text that may be a tag is held back
/// until the next piece tells), what is held at the end before the final line.
fn split_lines(output: &mut ChatOutput, event: &Event) -> Vec<String> {
    let pieces = match event {
        Event::Text { text, .. } => output.push(text),
        Event::Done(_) => output.finish(),
        Event::Started { .. } | Event::Progress(_) | Event::Error(_) => return vec![ndjson(event)],
    };
    let mut lines: Vec<String> = pieces
        .into_iter()
        .filter_map(|piece| {
            let value = match &piece {
                OutPiece::Content(t) => TextLine::text(t),
                OutPiece::Reasoning(t) => TextLine {
                    content: "",
                    thinking: Some(t.as_str()),
                    done: false,
                },
                // The native API offers no tools, so an answer holds no calls.
                OutPiece::Calls(_) => return None,
            };
            Some(line(&value))
        })
        .collect();
    if matches!(event, Event::Done(_)) {
        lines.push(ndjson(event));
    }
    lines
}

/// One NDJSON line for an engine event.
fn ndjson(event: &Event) -> String {
    match event {
        Event::Text { text, .. } => line(&TextLine::text(text)),
        Event::Done(c) => line(&DoneLine {
            content: "",
            done: true,
            done_reason: c.done_reason.as_str(),
            prompt_eval_count: c.prompt_eval_count,
            prompt_eval_duration: c.prompt_eval_duration_ns,
            prompt_cached_count: c.prompt_cached_count,
            eval_count: c.eval_count,
            eval_duration: c.eval_duration_ns,
            truncated: c.truncated,
            draft_count: c.draft_count,
            draft_accepted_count: c.draft_accepted_count,
        }),
        Event::Error(e) => {
            let err = ApiError::from(e.clone());
            line(&ErrorLine {
                done: true,
                done_reason: "error",
                error: ErrorBody {
                    message: err.to_string(),
                    kind: err.kind(),
                },
            })
        }
        Event::Started { .. } | Event::Progress(_) => line(&TextLine::text("")),
    }
}

/// A value as one NDJSON line.
fn line<T: Serialize>(value: &T) -> String {
    let mut line = super::stream_json::to_line(value);
    line.push('\n');
    line
}

/// Body of `POST /embedding`.
#[derive(Debug, Deserialize)]
struct EmbeddingRequest {
    /// Not checked (any name is the one model); the routing key leads with it.
    #[serde(default, alias = "Model")]
    model: Option<String>,
    #[serde(default, alias = "Content")]
    content: Option<String>,
    #[serde(default, alias = "Truncate")]
    truncate: Option<bool>,
}

/// `/embedding` as `routing_key` reads it: as `embedding` does.
pub(crate) fn embedding_keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: EmbeddingRequest = parse_json(body)?;
    Ok(Keyed::texts(
        req.model,
        vec![required("content", req.content)?],
    ))
}

/// `POST /embedding`: `{"content"}` -> `{"embedding", "prompt_eval_count"}` (not normalized).
pub async fn embedding(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    ensure_ready(&state)?;
    let req: EmbeddingRequest = parse_json(&body)?;
    let content = required("content", req.content)?;
    let truncate = req.truncate.unwrap_or(false);
    if state.pooling != Pooling::None {
        let embedding = embed_all(&state, vec![content], truncate)
            .await?
            .pop()
            .ok_or_else(|| ApiError::Internal("no embedding returned".into()))?;
        return Ok(Json(EmbeddingAnswer {
            embedding: Vectors::One(embedding.vector),
            prompt_eval_count: embedding.prompt_eval_count,
            truncated: embedding.truncated,
        })
        .into_response());
    }
    // `--pooling none`: one vector per token, bounded before the queue.
    let info = model_info(&state)?;
    check_embedder(&info)?;
    let (tokens, cut) = validate::embedding_input(&info, content, truncate).await?;
    let width = info.n_embd.max(1) as usize;
    let values = tokens.len().saturating_mul(width);
    if values > MAX_UNPOOLED_VALUES {
        return Err(ApiError::ContextLength(format!(
            "with --pooling none the answer holds a vector of {width} values per token: at \
             most {} tokens, the content has {}",
            MAX_UNPOOLED_VALUES / width,
            tokens.len()
        )));
    }
    let embedding = embed_tokens(&state, vec![(tokens, cut)])
        .await?
        .pop()
        .ok_or_else(|| ApiError::Internal("no embedding returned".into()))?;
    if embedding.vector.len() % width != 0 {
        return Err(ApiError::Internal(format!(
            "{} per-token values are no whole number of {width}-value vectors",
            embedding.vector.len()
        )));
    }
    let rows = embedding
        .vector
        .chunks(width)
        .map(<[f32]>::to_vec)
        .collect();
    Ok(Json(EmbeddingAnswer {
        embedding: Vectors::PerToken(rows),
        prompt_eval_count: embedding.prompt_eval_count,
        truncated: embedding.truncated,
    })
    .into_response())
}

/// A line of text (or of thinking) of a `/completion` stream, not the last.
#[derive(Debug, Serialize)]
struct TextLine<'a> {
    /// The text generated (empty on a line of thinking, and on a line that only says the
    /// prompt is being read).
    content: &'a str,
    /// The thinking generated, when the request asked for it apart (`think`).
    #[serde(skip_serializing_if = "Option::is_none")]
    thinking: Option<&'a str>,
    /// Always false.
    done: bool,
}

impl<'a> TextLine<'a> {
    /// A line of this text.
    fn text(content: &'a str) -> Self {
        Self {
            content,
            thinking: None,
            done: false,
        }
    }
}

/// The last line of a `/completion` stream: why it ended, the counts and the times.
#[derive(Debug, Serialize)]
struct DoneLine {
    /// Always empty.
    content: &'static str,
    /// Always true.
    done: bool,
    /// Why it ended (`stop`, `length`...).
    done_reason: &'static str,
    /// Prompt tokens, cached ones included.
    prompt_eval_count: usize,
    /// Nanoseconds spent decoding the prompt.
    prompt_eval_duration: u64,
    /// Prompt tokens reused from the cache.
    prompt_cached_count: usize,
    /// Tokens generated.
    eval_count: usize,
    /// Nanoseconds spent generating.
    eval_duration: u64,
    /// Whether the prompt was cut to fit.
    truncated: bool,
    /// Tokens drafted (speculative decoding).
    draft_count: usize,
    /// Drafted tokens accepted.
    draft_accepted_count: usize,
}

/// The last line of a `/completion` stream that failed after its start.
#[derive(Debug, Serialize)]
struct ErrorLine {
    /// Always true.
    done: bool,
    /// Always `error`.
    done_reason: &'static str,
    /// What went wrong, as the error answers write it.
    error: ErrorBody,
}

/// An error: its message and type (`ApiError::body`'s `error`).
#[derive(Debug, Serialize)]
struct ErrorBody {
    /// What went wrong.
    message: String,
    /// Its kind (`ApiError::kind`).
    #[serde(rename = "type")]
    kind: &'static str,
}

/// The answer of `POST /embedding`.
#[derive(Debug, Serialize)]
struct EmbeddingAnswer {
    /// The vector (with `--pooling none`, one per token), not normalized.
    embedding: Vectors,
    /// The content's tokens.
    prompt_eval_count: usize,
    /// Whether the content was cut to fit.
    truncated: bool,
}

/// One embedding, or one per token (`--pooling none`).
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Vectors {
    /// The input's.
    One(#[serde(serialize_with = "crate::dialects::floats::f32s_as_f64s")] Vec<f32>),
    /// Each token's, in order.
    PerToken(#[serde(serialize_with = "crate::dialects::floats::vectors_as_f64s")] Vec<Vec<f32>>),
}
