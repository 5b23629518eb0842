//! The OpenAI dialect (`/v1`): chat and text completions (JSON or server-sent events ending in
//! `data: [DONE]`), embeddings and the model list, with errors in OpenAI's shape. What OpenAI
//! has and a local runner cannot honour (`n` > 1, echo, ...) is refused with a 400 naming the
//! parameter, never silently ignored. Tool calls and reasoning are read by `tool_calls.rs`;
//! this file only puts them in OpenAI's shape.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};

use super::llama_server::timings;
use crate::http::error::{ApiError, OpenAiError};
use crate::http::state::AppState;
use crate::protocol::params::SamplingParams;
use crate::protocol::{Completion, DoneReason, Event, TokenLogprob};
use crate::requests::common::{
    check_dimensions, check_model, collect, count_prompt_tokens, embed_inputs, l2_normalize,
    model_info, parse_json, parse_messages, start_generation, unix_seconds, Chat, EmbedInput,
    PromptSource,
};
use crate::requests::image_prompt::{self, Prompt};
use crate::requests::infill;
use crate::requests::keyed::Keyed;
use crate::requests::thinking::TemplateArgs;
use crate::requests::tool_calls::{self, Answer, ChatOutput, OutPiece, ToolRequest};

/// Most choices `n` may ask for: each is a sequence in a slot of its own.
pub(crate) const MAX_CHOICES: u32 = 8;

/// Most alternatives `top_logprobs` may ask for (OpenAI's limit; Ollama's API has the same).
pub(crate) const MAX_TOP_LOGPROBS: u32 = 20;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamOptions {
    include_usage: bool,
}

/// Body of `/v1/chat/completions` and `/v1/completions` (the fields of both; each handler
/// checks which apply). Unknown fields are ignored, as OpenAI-compatible servers do.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct OpenAiRequest {
    model: Option<String>,
    messages: Option<Vec<Value>>,
    /// vLLM's and transformers' template switches (llama-server reads them too).
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    prompt: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    stop: Option<Value>,
    seed: Option<i64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    logit_bias: Option<HashMap<String, f32>>,
    n: Option<u32>,
    response_format: Option<Value>,
    /// llama-server's top-level JSON schema constraint.
    #[serde(default)]
    json_schema: Option<Value>,
    logprobs: Option<Value>,
    top_logprobs: Option<u32>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    echo: Option<bool>,
    suffix: Option<String>,
    best_of: Option<u32>,
    // llama.cpp-style extras.
    top_k: Option<i32>,
    min_p: Option<f32>,
    typical_p: Option<f32>,
    repeat_penalty: Option<f32>,
    repeat_last_n: Option<i32>,
    mirostat: Option<i32>,
    mirostat_tau: Option<f32>,
    mirostat_eta: Option<f32>,
    ignore_eos: Option<bool>,
    grammar: Option<String>,
    /// LoRA adapter scales, as llama-server's (`requests/lora.rs`).
    lora: Option<Value>,
    speculative: Option<bool>,
    /// false: decode the whole prompt, reusing no cached prefix (llama-server's field).
    cache_prompt: Option<bool>,
    /// llama-server's `return_progress`: a streamed answer reports the prompt's decode.
    return_progress: Option<bool>,
    /// Template variables (llama-server's and vLLM's; `enable_thinking` among them).
    chat_template_kwargs: Option<Value>,
    /// OpenAI's reasoning level; `"none"` turns a thinking template's thinking off.
    reasoning_effort: Option<Value>,
    /// DRY, XTC, top-n-sigma, dynamic temperature (llama-server's fields).
    #[serde(flatten)]
    samplers: crate::requests::options::SamplerFields,
}

impl OpenAiRequest {
    /// The chat template's switches: `chat_template_kwargs` and `reasoning_effort`.
    fn template_args(&self) -> Result<TemplateArgs, ApiError> {
        TemplateArgs::read(
            None,
            self.chat_template_kwargs.as_ref(),
            self.reasoning_effort.as_ref(),
        )
    }

    /// Sampling parameters with OpenAI's defaults (temperature 1, top_p 1, no repetition
    /// penalty; Ollama's top_k 40 unless given).
    fn params(&self, chat: bool) -> Result<SamplingParams, ApiError> {
        if self.n.is_some_and(|n| n == 0 || n > MAX_CHOICES) {
            return Err(ApiError::invalid(format!(
                "n must be between 1 and {MAX_CHOICES}"
            )));
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("best_of: only 1 is supported"));
        }
        let max = self.max_completion_tokens.or(self.max_tokens);
        if max.is_some_and(|m| m < 0) {
            return Err(ApiError::invalid("max_tokens must be >= 0"));
        }
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(ApiError::invalid(format!(
                    "temperature must be between 0 and 2, got {t}"
                )));
            }
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if v.is_some_and(|v| !(-2.0..=2.0).contains(&v)) {
                return Err(ApiError::invalid(format!(
                    "{name} must be between -2 and 2"
                )));
            }
        }
        let defaults = SamplingParams::default();
        let mut p = SamplingParams {
            num_predict: max.unwrap_or(-1),
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(defaults.top_k),
            min_p: self.min_p.unwrap_or(0.0),
            typical_p: self.typical_p.unwrap_or(1.0),
            repeat_penalty: self.repeat_penalty.unwrap_or(1.0),
            repeat_last_n: self.repeat_last_n.unwrap_or(defaults.repeat_last_n),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            mirostat: self.mirostat.unwrap_or(0),
            mirostat_tau: self.mirostat_tau.unwrap_or(defaults.mirostat_tau),
            mirostat_eta: self.mirostat_eta.unwrap_or(defaults.mirostat_eta),
            seed: self.seed.unwrap_or(-1),
            stop: stop_list(self.stop.as_ref())?,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            speculative: self.speculative,
            cache_prompt: self.cache_prompt.unwrap_or(true),
            // Reports only a stream can carry.
            return_progress: self.return_progress == Some(true) && self.stream == Some(true),
            samplers: self.samplers.samplers(),
            ..defaults
        };
        crate::requests::validate::check_options(&p)
            .map_err(|e| ApiError::invalid(e.top_level(&[])))?;
        // As OpenAI's API: a prompt that does not fit is an error, not silently cut.
        p.truncate = false;
        p.logit_bias = logit_bias(self.logit_bias.as_ref())?;
        p.logprobs = self.logprobs(chat)?;
        p.grammar = constraint(self)?;
        Ok(p)
    }

    /// Alternatives to report per token: chat has `logprobs: bool` + `top_logprobs`, text
    /// completions `logprobs: int`.
    fn logprobs(&self, chat: bool) -> Result<Option<usize>, ApiError> {
        let top = if chat {
            match &self.logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => {
                    if self.top_logprobs.is_some_and(|n| n > 0) {
                        return Err(ApiError::invalid("top_logprobs needs logprobs: true"));
                    }
                    return Ok(None);
                }
                Some(Value::Bool(true)) => self.top_logprobs.unwrap_or(0),
                Some(_) => return Err(ApiError::invalid("logprobs must be true or false")),
            }
        } else {
            match &self.logprobs {
                None | Some(Value::Null) => return Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| ApiError::invalid("logprobs must be an integer from 0 to 20"))?,
            }
        };
        if top > MAX_TOP_LOGPROBS {
            return Err(ApiError::invalid(format!(
                "top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}"
            )));
        }
        Ok(Some(top as usize))
    }

    fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

fn stop_list(stop: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list = match stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::invalid("stop must be a string or an array of strings"))?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop must be a string or an array of strings",
            ))
        }
    };
    Ok(list.into_iter().filter(|s| !s.is_empty()).collect())
}

fn logit_bias(bias: Option<&HashMap<String, f32>>) -> Result<Vec<(i32, f32)>, ApiError> {
    let Some(bias) = bias else {
        return Ok(Vec::new());
    };
    bias.iter()
        .map(|(token, &value)| {
            let id = token.parse::<i32>().map_err(|_| {
                ApiError::invalid(format!("logit_bias: keys must be token ids, got {token:?}"))
            })?;
            if !(-100.0..=100.0).contains(&value) {
                return Err(ApiError::invalid(format!(
                    "logit_bias: values must be between -100 and 100, got {value}"
                )));
            }
            Ok((id, value))
        })
        .collect()
}

/// The request's constraint: `grammar` (GBNF), `json_schema` (llama-server's top-level
/// schema) or `response_format`; at most one of them, since one would otherwise be dropped.
fn constraint(req: &OpenAiRequest) -> Result<Option<crate::constrain::Grammar>, ApiError> {
    use crate::constrain::{Grammar, GrammarSource};
    let grammar = req.grammar.as_deref().filter(|g| !g.trim().is_empty());
    let schema = req.json_schema.as_ref().filter(|s| !s.is_null());
    let format = crate::requests::format::response_format(
        req.response_format.as_ref().unwrap_or(&Value::Null),
        "response_format",
    )
    .map_err(ApiError::invalid)?;
    let given = [grammar.is_some(), schema.is_some(), format.is_some()];
    if given.iter().filter(|&&g| g).count() > 1 {
        return Err(ApiError::invalid(
            "grammar, json_schema and response_format are alternatives: give one of them",
        ));
    }
    if let Some(g) = grammar {
        return Ok(Some(Grammar::new(GrammarSource::Gbnf(g.to_string()))));
    }
    if let Some(schema) = schema {
        return crate::requests::format::json_schema(schema, "json_schema")
            .map_err(ApiError::invalid);
    }
    Ok(format)
}

/// What every response of one request repeats.
struct Meta {
    id: String,
    created: u64,
    model: String,
    chat: bool,
    include_usage: bool,
    /// The choice's `index` (`n` > 1 gives several).
    index: usize,
    /// Whether this choice's end ends the stream (usage, `[DONE]`): false for the choices of
    /// `n` > 1, whose stream ends after the last of them.
    ends_stream: bool,
    /// Where the next token's text starts in the whole completion (`text_offset`), carried
    /// from one streamed chunk to the next.
    offsets: std::sync::Mutex<TextOffsets>,
}

/// Character offsets of tokens in a completion's text. A token may carry part of a UTF-8
/// character: its offset is that character's, and the character is counted once complete.
#[derive(Debug, Default)]
struct TextOffsets {
    /// Characters complete so far.
    chars: usize,
    /// Bytes of a character not yet complete.
    tail: Vec<u8>,
}

impl TextOffsets {
    /// The offset of a token with these bytes, which then count towards the next ones.
    fn next(&mut self, bytes: &[u8]) -> usize {
        let at = self.chars;
        self.tail.extend_from_slice(bytes);
        let mut complete = String::new();
        let used = crate::chat::utf8::decode_utf8(&self.tail, &mut complete);
        self.chars += complete.chars().count();
        self.tail.drain(..used);
        at
    }
}

impl Meta {
    fn new(state: &AppState, chat: bool, include_usage: bool) -> Self {
        Self {
            // `chatcmpl-<request id>`: the response names the request in the logs.
            id: format!(
                "{}-{}",
                if chat { "chatcmpl" } else { "cmpl" },
                crate::http::access::current_id()
            ),
            created: unix_seconds(SystemTime::now()),
            model: state.model_name.to_string(),
            chat,
            include_usage,
            index: 0,
            ends_stream: true,
            offsets: std::sync::Mutex::default(),
        }
    }

    /// The description of choice `index` of several, in the same response.
    fn for_choice(&self, index: usize) -> Self {
        Self {
            id: self.id.clone(),
            created: self.created,
            model: self.model.clone(),
            chat: self.chat,
            include_usage: self.include_usage,
            index,
            ends_stream: false,
            offsets: std::sync::Mutex::default(),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        }
    }

    /// One `choices[0]` entry: text (or a delta), logprobs, finish reason.
    fn choice(
        &self,
        text: Option<&str>,
        logprobs: &[TokenLogprob],
        want_logprobs: bool,
        finish: Option<&str>,
        chunk: bool,
    ) -> Value {
        let logprobs = if want_logprobs {
            if self.chat {
                json!({"content": logprobs.iter().map(chat_logprob).collect::<Vec<_>>()})
            } else {
                let mut offsets = self.offsets.lock().unwrap_or_else(|p| p.into_inner());
                completion_logprobs(logprobs, &mut offsets)
            }
        } else {
            Value::Null
        };
        let mut choice =
            json!({"index": self.index, "logprobs": logprobs, "finish_reason": finish});
        match (self.chat, chunk) {
            (true, true) => {
                choice["delta"] = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                }
            }
            (true, false) => {
                choice["message"] = json!({"role": "assistant", "content": text.unwrap_or("")})
            }
            (false, _) => choice["text"] = json!(text.unwrap_or("")),
        }
        choice
    }

    fn body(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": concat!("llamarunner-", env!("CARGO_PKG_VERSION")),
            "choices": choices,
        })
    }
}

fn usage(done: &Completion) -> Value {
    json!({
        "prompt_tokens": done.prompt_eval_count,
        "completion_tokens": done.eval_count,
        "total_tokens": done.prompt_eval_count + done.eval_count,
        "prompt_tokens_details": {"cached_tokens": done.prompt_cached_count},
        // OpenAI's names for the tokens of a prediction (here: the prompt-lookup drafts).
        "completion_tokens_details": {
            "accepted_prediction_tokens": done.draft_accepted_count,
            "rejected_prediction_tokens": done.draft_count.saturating_sub(done.draft_accepted_count),
        },
    })
}

fn token_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// One token's entry as OpenAI's chat (and Ollama's API) write it: its text, log-probability,
/// bytes and the top alternatives.
pub(crate) fn chat_logprob(l: &TokenLogprob) -> Value {
    json!({
        "token": token_text(&l.sampled.bytes),
        "logprob": l.sampled.logprob,
        "bytes": l.sampled.bytes,
        "top_logprobs": l.top.iter().map(|t| json!({
            "token": token_text(&t.bytes),
            "logprob": t.logprob,
            "bytes": t.bytes,
        })).collect::<Vec<_>>(),
    })
}

/// Legacy completions' `logprobs`; `text_offset` counts characters from the start of the whole
/// completion, across streamed chunks.
fn completion_logprobs(entries: &[TokenLogprob], at: &mut TextOffsets) -> Value {
    let offsets: Vec<usize> = entries.iter().map(|l| at.next(&l.sampled.bytes)).collect();
    json!({
        "tokens": entries.iter().map(|l| token_text(&l.sampled.bytes)).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|l| l.sampled.logprob).collect::<Vec<_>>(),
        "top_logprobs": entries.iter().map(|l| {
            l.top.iter().map(|t| (token_text(&t.bytes), json!(t.logprob))).collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

/// Parses a completion request for the served model.
fn parse_request(state: &AppState, body: &[u8]) -> Result<OpenAiRequest, ApiError> {
    model_info(state)?;
    parse_json(body)
}

/// A chat request's conversation.
fn chat_of(req: &OpenAiRequest) -> Result<Chat, ApiError> {
    parse_messages(
        req.messages
            .clone()
            .ok_or_else(|| ApiError::invalid("messages is required"))?,
    )
}

/// `/v1/chat/completions` as `routing_key` reads it: as `chat_completions` does.
pub(crate) fn chat_keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: OpenAiRequest = parse_json(body)?;
    let chat = chat_of(&req)?;
    Ok(Keyed::chat(req.model, chat.messages))
}

/// A completion request's prompt: one text (empty only with a suffix).
fn completion_prompt(req: &OpenAiRequest) -> Result<String, ApiError> {
    if req.echo == Some(true) {
        return Err(ApiError::invalid("echo is not supported"));
    }
    let prompt = match &req.prompt {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            items[0].as_str().unwrap_or_default().to_string()
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "prompt: only one text prompt per request is supported (token arrays and batches are not)",
            ))
        }
        _ => return Err(ApiError::invalid("prompt is required and must be a string")),
    };
    if prompt.is_empty() && req.suffix.as_ref().is_none_or(|s| s.is_empty()) {
        return Err(ApiError::invalid("prompt must not be empty"));
    }
    Ok(prompt)
}

/// `/v1/completions` as `routing_key` reads it: as `completions` does (the prompt; with a
/// suffix, the code before the cursor, which the cached tokens start with too).
pub(crate) fn completions_keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: OpenAiRequest = parse_json(body)?;
    let prompt = completion_prompt(&req)?;
    Ok(Keyed::texts(req.model, vec![prompt]))
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let req = parse_request(&state, &body)?;
    let (prompt, params, output) = chat_prompt_of(&state, &req).await?;
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
    image_prompt::check_images(&*model_info(state)?, chat.images.len())?;
    let mut params = req.params(true)?;
    params.lora = state.lora.for_request(req.lora.as_ref())?;
    let tools = ToolRequest::parse(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )?;
    let (text, output) = tool_calls::chat_request(
        state,
        chat.messages,
        tools,
        &mut params,
        req.template_args()?,
    )
    .await?;
    let prompt = Prompt {
        text,
        images: chat.images,
    };
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
    Ok(Json(json!({"object": "response.input_tokens", "input_tokens": n})).into_response())
}

/// OpenAI's `input` to embed: a string, an array of token ids (one input), or an array whose
/// items are strings or arrays of token ids (llama-server takes the mix too).
fn embedding_inputs(input: Option<Value>) -> Result<Vec<EmbedInput>, ApiError> {
    let ids = |items: &[Value]| -> Option<Vec<i64>> { items.iter().map(Value::as_i64).collect() };
    let shape = "input must be a string, an array of token ids, or an array of strings and token \
                 id arrays";
    match input {
        Some(Value::String(s)) => Ok(vec![EmbedInput::Text(s)]),
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_number) => {
            Ok(vec![EmbedInput::Tokens(ids(&items).ok_or_else(|| {
                ApiError::invalid("input: token ids must be integers")
            })?)])
        }
        Some(Value::Array(items)) if !items.is_empty() => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(EmbedInput::Text(s)),
                Value::Array(a) => ids(&a).map(EmbedInput::Tokens).ok_or_else(|| {
                    ApiError::invalid(format!("input[{i}]: token ids must be integers"))
                }),
                _ => Err(ApiError::invalid(format!("input[{i}]: {shape}"))),
            })
            .collect(),
        _ => Err(ApiError::invalid(format!("input is required: {shape}"))),
    }
}

/// `add_generation_prompt` and `continue_final_message`: a conversation that ends with an
/// assistant's text is continued (`requests::common::split_prefill`), which is what
/// `continue_final_message: true` (with `add_generation_prompt` false or absent) asks; both
/// true contradict each other, and an answer cannot be continued without one to continue or
/// a conversation rendered without the assistant's opening here: each is a 400, never a
/// switch ignored.
fn check_continuation(
    req: &OpenAiRequest,
    messages: &[crate::chat::ChatMessage],
) -> Result<(), ApiError> {
    let continues = req.continue_final_message == Some(true);
    if continues && req.add_generation_prompt == Some(true) {
        return Err(ApiError::invalid(
            "add_generation_prompt and continue_final_message cannot both be true",
        ));
    }
    let last_is_answer = messages
        .last()
        .is_some_and(|m| m.role == "assistant" && !m.content.is_empty());
    if continues && !last_is_answer {
        return Err(ApiError::invalid(
            "continue_final_message: the last message must be an assistant's text",
        ));
    }
    if req.add_generation_prompt == Some(false) && !last_is_answer {
        return Err(ApiError::invalid(
            "add_generation_prompt: false is only supported to continue a final assistant \
             message (continue_final_message)",
        ));
    }
    Ok(())
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let req = parse_request(&state, &body)?;
    let prompt = completion_prompt(&req)?;
    let mut params = req.params(false)?;
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
            crate::requests::validate::check_options(&params)
                .map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
            PromptSource::Tokens(infill::tokens(&info, parts, params.num_predict).await?)
        }
        None => prompt.into(),
    };
    respond(state, &req, prompt, params, None).await
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
    let rx = start_generation(&state, prompt, params).await?;
    if req.stream != Some(true) {
        let all = collect(rx).await?;
        let mut choice = meta.choice(
            Some(&all.text),
            &all.logprobs,
            want_logprobs,
            Some(finish_reason(all.done.done_reason)),
            false,
        );
        if let Some(output) = output {
            let answer = output.read_all(&all.text);
            if !answer.calls.is_empty() {
                choice["finish_reason"] = json!("tool_calls");
            }
            choice["message"] = chat_message(&answer);
        }
        let mut body = meta.body(false, vec![choice]);
        body["usage"] = usage(&all.done);
        body["timings"] = timings(&all.done);
        return Ok(Json(body).into_response());
    }
    // The first chat chunk names the role, with no content yet (null, as llama-server sends
    // it; OpenAI sends "", and clients read both).
    let first = chat.then(|| {
        let mut choice = meta.choice(None, &[], false, None, true);
        choice["delta"] = json!({"role": "assistant", "content": null});
        sse(with_usage_null(&meta, meta.body(true, vec![choice])))
    });
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
    let mut first = start_generation(&state, prompt.clone(), params.clone()).await?;
    first.wait_first().await;
    generations.push(first);
    for i in 1..n {
        let mut p = params.clone();
        if p.seed >= 0 {
            p.seed = (p.seed % (1 << 32) + i as i64) % (1 << 32);
        }
        generations.push(start_generation(&state, prompt.clone(), p).await?);
    }
    let metas: Vec<Meta> = (0..n).map(|i| meta.for_choice(i)).collect();
    if req.stream != Some(true) {
        let all = futures_util::future::join_all(generations.into_iter().map(collect)).await;
        let mut choices = Vec::with_capacity(n);
        let mut dones = Vec::with_capacity(n);
        for (i, one) in all.into_iter().enumerate() {
            let one = one?;
            let m = &metas[i];
            let mut choice = m.choice(
                Some(&one.text),
                &one.logprobs,
                want_logprobs,
                Some(finish_reason(one.done.done_reason)),
                false,
            );
            if let Some(output) = output.clone() {
                let answer = output.read_all(&one.text);
                if !answer.calls.is_empty() {
                    choice["finish_reason"] = json!("tool_calls");
                }
                choice["message"] = chat_message(&answer);
            }
            choices.push(choice);
            dones.push(one.done);
        }
        let mut body = meta.body(false, choices);
        body["usage"] = usage_of_choices(&dones);
        return Ok(Json(body).into_response());
    }
    let chat = output.is_some();
    let first_chunks: Vec<SseEvent> = if chat {
        metas
            .iter()
            .map(|m| {
                let mut choice = m.choice(None, &[], false, None, true);
                choice["delta"] = json!({"role": "assistant", "content": null});
                sse(with_usage_null(m, m.body(true, vec![choice])))
            })
            .collect()
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

/// The usage of several choices of one prompt: the prompt once (the first choice's, which
/// decoded it), the generated tokens of all.
fn usage_of_choices(dones: &[Completion]) -> Value {
    let Some(first) = dones.first() else {
        return Value::Null;
    };
    let mut all = first.clone();
    for d in &dones[1..] {
        all.eval_count += d.eval_count;
        all.draft_count += d.draft_count;
        all.draft_accepted_count += d.draft_accepted_count;
    }
    usage(&all)
}

/// OpenAI's `finish_reason`: its clients know "stop" and "length"; a request cut by the
/// server's time limit (`--timeout`) reads as "length" (it was cut, not finished).
fn finish_reason(reason: DoneReason) -> &'static str {
    match reason {
        DoneReason::Timeout => "length",
        other => other.as_str(),
    }
}

fn sse(value: Value) -> SseEvent {
    SseEvent::default().data(super::stream_json::to_line(&value))
}

/// llama-server's `prompt_progress` object.
pub(super) fn prompt_progress(p: &crate::protocol::PromptProgress) -> Value {
    json!({"total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": p.time_ms})
}

/// With `include_usage`, every chunk carries `"usage": null` until the last, as OpenAI's do.
fn with_usage_null(meta: &Meta, mut body: Value) -> Value {
    if meta.include_usage {
        body["usage"] = Value::Null;
    }
    body
}

/// The SSE events for one engine event.
fn chunks_for(meta: &Meta, event: Event, want_logprobs: bool) -> Vec<SseEvent> {
    match event {
        Event::Started => Vec::new(),
        // llama-server's `return_progress`: a chunk without choices that says how far the
        // prompt's decode is.
        Event::Progress(p) => {
            let mut body = meta.body(true, Vec::new());
            body["prompt_progress"] = prompt_progress(&p);
            vec![sse(with_usage_null(meta, body))]
        }
        Event::Text { text, logprobs } => {
            let choice = meta.choice(Some(&text), &logprobs, want_logprobs, None, true);
            vec![sse(with_usage_null(meta, meta.body(true, vec![choice])))]
        }
        Event::Done(done) => done_chunks(meta, &done, finish_reason(done.done_reason)),
        Event::Error(e) => vec![sse(ApiError::from(e).openai_body())],
    }
}

/// The last chunks: the finish reason, the usage when asked for, `[DONE]`.
fn done_chunks(meta: &Meta, done: &Completion, finish: &str) -> Vec<SseEvent> {
    let text = if meta.chat { None } else { Some("") };
    let choice = meta.choice(text, &[], false, Some(finish), true);
    let mut out = vec![sse(with_usage_null(meta, meta.body(true, vec![choice])))];
    if meta.ends_stream {
        out.extend(stream_end(meta, usage(done), Some(timings(done))));
    }
    out
}

/// The stream's last events: the usage when asked for (with the answer's `timings` when there
/// is one answer), `[DONE]`.
fn stream_end(meta: &Meta, usage: Value, timings: Option<Value>) -> Vec<SseEvent> {
    let mut out = Vec::new();
    if meta.include_usage {
        let mut last = meta.body(true, Vec::new());
        last["usage"] = usage;
        if let Some(timings) = timings {
            last["timings"] = timings;
        }
        out.push(sse(last));
    }
    out.push(SseEvent::default().data("[DONE]"));
    out
}

/// A chat answer's message: content (null when there are only calls), `tool_calls` with the
/// arguments as a JSON string, `reasoning_content` when the model thought.
fn chat_message(answer: &Answer) -> Value {
    let mut message = json!({"role": "assistant", "content": answer.content});
    if !answer.calls.is_empty() {
        if answer.content.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = answer
            .calls
            .iter()
            .map(|c| {
                json!({
                    "id": tool_calls::call_id(),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments.to_string()},
                })
            })
            .collect();
    }
    if !answer.reasoning.is_empty() {
        message["reasoning_content"] = json!(answer.reasoning);
    }
    message
}

/// The deltas of one piece of a chat answer: text, reasoning, or one delta per call (its id,
/// name and whole arguments), as OpenAI streams them.
fn piece_deltas(piece: OutPiece) -> Vec<Value> {
    match piece {
        OutPiece::Content(t) => vec![json!({"content": t})],
        OutPiece::Reasoning(t) => vec![json!({"reasoning_content": t})],
        OutPiece::Calls(calls) => calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"tool_calls": [{
                    "index": i,
                    "id": tool_calls::call_id(),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments.to_string()},
                }]})
            })
            .collect(),
    }
}

/// The SSE events of one engine event of a chat answer read for calls or reasoning.
fn chat_chunks(
    meta: &Meta,
    reader: &mut ChatOutput,
    called: &mut bool,
    event: Event,
    want_logprobs: bool,
) -> Vec<SseEvent> {
    let (pieces, logprobs, done) = match event {
        Event::Text { text, logprobs } => (reader.push(&text), logprobs, None),
        Event::Done(done) => (reader.finish(), Vec::new(), Some(done)),
        other => return chunks_for(meta, other, want_logprobs),
    };
    let mut deltas: Vec<Value> = Vec::new();
    for piece in pieces {
        *called |= matches!(piece, OutPiece::Calls(_));
        deltas.extend(piece_deltas(piece));
    }
    if deltas.is_empty() && want_logprobs && !logprobs.is_empty() {
        // Held-back text still reports its tokens' log-probabilities.
        deltas.push(json!({"content": ""}));
    }
    let mut out: Vec<SseEvent> = deltas
        .into_iter()
        .enumerate()
        .map(|(i, delta)| {
            let lp: &[TokenLogprob] = if i == 0 { &logprobs } else { &[] };
            let mut choice = meta.choice(None, lp, want_logprobs && i == 0, None, true);
            choice["delta"] = delta;
            sse(with_usage_null(meta, meta.body(true, vec![choice])))
        })
        .collect();
    if let Some(done) = done {
        let finish = if *called {
            "tool_calls"
        } else {
            finish_reason(done.done_reason)
        };
        out.extend(done_chunks(meta, &done, finish));
    }
    out
}

/// Body of `POST /v1/embeddings`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct EmbeddingsRequest {
    model: Option<String>,
    input: Option<Value>,
    encoding_format: Option<String>,
    dimensions: Option<u32>,
}

/// `/v1/embeddings` as `routing_key` reads it: as `embeddings` does.
pub(crate) fn embeddings_keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: EmbeddingsRequest = parse_json(body)?;
    // Token ids as the comma list the key writes them as (a token prefix is a text prefix).
    let inputs = embedding_inputs(req.input)?
        .into_iter()
        .map(|input| match input {
            EmbedInput::Text(text) => text,
            EmbedInput::Tokens(ids) => ids.iter().map(|id| format!("{id},")).collect(),
        })
        .collect();
    Ok(Keyed::texts(req.model, inputs))
}

/// `POST /v1/embeddings`: L2-normalized vectors, as floats or base64 (the `openai` client asks
/// for base64 by default).
pub async fn embeddings(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let info = model_info(&state)?;
    let req: EmbeddingsRequest = parse_json(&body)?;
    let inputs = embedding_inputs(req.input)?;
    check_dimensions(&info, req.dimensions)?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "encoding_format must be float or base64, got {other:?}"
            ))
            .into())
        }
    };
    let embeddings = embed_inputs(&state, inputs, false).await?;
    let tokens: usize = embeddings.iter().map(|e| e.prompt_eval_count).sum();
    let data: Vec<Value> = embeddings
        .into_iter()
        .enumerate()
        .map(|(i, e)| {
            let v = l2_normalize(e.vector);
            let embedding = if base64 {
                json!(base64_f32(&v))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": state.model_name.as_ref(),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response())
}

/// Little-endian f32s, base64-encoded (standard alphabet, padded).
fn base64_f32(v: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> shift) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn model_entry(state: &AppState) -> Value {
    let created = state
        .engine
        .health
        .model_info()
        .and_then(|m| m.modified)
        .map_or(0, unix_seconds);
    json!({
        "id": state.model_name.as_ref(),
        "object": "model",
        "created": created,
        "owned_by": "llamarunner",
    })
}

/// `GET /v1/models`: the one model served, under its alias.
pub async fn models(State(state): State<AppState>) -> Result<Response, OpenAiError> {
    model_info(&state)?;
    Ok(Json(json!({"object": "list", "data": [model_entry(&state)]})).into_response())
}

/// `GET /v1/models/{model}`.
pub async fn model(
    State(state): State<AppState>,
    name: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Response, OpenAiError> {
    model_info(&state)?;
    // A name that is not valid UTF-8 once decoded (`%ff`) is an error in OpenAI's shape too.
    let Path(name) = name.map_err(|e| ApiError::invalid(format!("model name: {e}")))?;
    check_model(&state, Some(&name))?;
    Ok(Json(model_entry(&state)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedding_inputs_are_text_token_ids_or_a_mix() {
        use EmbedInput::{Text, Tokens};
        let read = |v: Value| embedding_inputs(Some(v));
        assert_eq!(read(json!("a")).unwrap(), vec![Text("a".into())]);
        assert_eq!(read(json!([1, 2])).unwrap(), vec![Tokens(vec![1, 2])]);
        assert_eq!(
            read(json!(["a", [3, 4], "b"])).unwrap(),
            vec![Text("a".into()), Tokens(vec![3, 4]), Text("b".into())]
        );
        for bad in [
            json!([]),
            json!(5),
            json!([1.5]),
            json!([["x"]]),
            json!([{}]),
            json!(null),
        ] {
            assert!(read(bad.clone()).is_err(), "{bad}");
        }
    }

    #[test]
    fn text_offsets_count_characters_across_chunks() {
        let mut at = TextOffsets::default();
        // "a", "é" split over two tokens, "b", an invalid byte, then "€" whole.
        let tokens: [&[u8]; 6] = [b"a", &[0xC3], &[0xA9], b"b", &[0xFF], "€".as_bytes()];
        let got: Vec<usize> = tokens.iter().map(|t| at.next(t)).collect();
        assert_eq!(got, vec![0, 1, 1, 2, 3, 4]);
        // A second chunk continues where the first ended.
        assert_eq!(at.next(b"x"), 5);
    }

    #[test]
    fn base64_matches_the_standard_encoding() {
        // 1.0f32 = 00 00 80 3f; 2.0f32 = 00 00 00 40.
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, 2.0]), "AACAPwAAAEA=");
        assert_eq!(base64_f32(&[]), "");
    }

    #[test]
    fn openai_defaults_and_refusals() {
        let req: OpenAiRequest = serde_json::from_str("{}").unwrap();
        let p = req.params(true).unwrap();
        assert_eq!((p.temperature, p.top_p, p.repeat_penalty), (1.0, 1.0, 1.0));
        assert_eq!(p.num_predict, -1);
        for body in [
            r#"{"n":0}"#,
            r#"{"n":9}"#,
            r#"{"best_of":2}"#,
            r#"{"temperature":3}"#,
            r#"{"logit_bias":{"x":1}}"#,
            r#"{"logit_bias":{"5":200}}"#,
            r#"{"top_logprobs":3}"#,
            r#"{"logprobs":true,"top_logprobs":21}"#,
            r#"{"response_format":{"type":"xml"}}"#,
            r#"{"response_format":{"type":"json_schema","json_schema":{"name":"x"}}}"#,
            // llama-server's own refusals: a type that is no format, a schema that is no
            // object, and two constraints of which one would be dropped.
            r#"{"response_format":{"type":123}}"#,
            r#"{"response_format":{"type":"sound"}}"#,
            r#"{"response_format":{"type":"json_object","schema":123}}"#,
            r#"{"json_schema":"yes"}"#,
            r#"{"json_schema":{"const":"42"},"grammar":"root ::= \"a\""}"#,
            r#"{"json_schema":{"const":"42"},"response_format":{"type":"json_object"}}"#,
            r#"{"max_tokens":-1}"#,
            r#"{"stop":[1]}"#,
        ] {
            let req: OpenAiRequest = serde_json::from_str(body).unwrap();
            assert!(req.params(true).is_err(), "{body} was accepted");
        }
        let req: OpenAiRequest = serde_json::from_str(
            r#"{"max_tokens":5,"max_completion_tokens":7,"stop":"x","logit_bias":{"3":-100},"logprobs":true,"top_logprobs":2,"seed":4}"#,
        )
        .unwrap();
        let p = req.params(true).unwrap();
        assert_eq!(p.num_predict, 7);
        assert_eq!(p.stop, vec!["x"]);
        assert_eq!(p.logit_bias, vec![(3, -100.0)]);
        assert_eq!(p.logprobs, Some(2));
        assert_eq!(p.seed, 4);
        assert_eq!(p.speculative, None);
        for (body, want) in [
            (r#"{"speculative":true}"#, Some(true)),
            (r#"{"speculative":false}"#, Some(false)),
            (r#"{"speculative":null}"#, None),
        ] {
            let req: OpenAiRequest = serde_json::from_str(body).unwrap();
            assert_eq!(req.params(true).unwrap().speculative, want, "{body}");
        }
        for body in [r#"{"speculative":"yes"}"#, r#"{"speculative":1}"#] {
            assert!(
                serde_json::from_str::<OpenAiRequest>(body).is_err(),
                "{body}"
            );
        }
        let req: OpenAiRequest = serde_json::from_str(r#"{"logprobs":3}"#).unwrap();
        assert_eq!(req.params(false).unwrap().logprobs, Some(3));
    }
}
