//! How an OpenAI request is read: the body of `/v1/chat/completions` and `/v1/completions`
//! (`OpenAiRequest`), its sampling parameters, stops, logit bias and constraint, a chat's
//! conversation and a completion's prompt, and their routing keys.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::Value;

use super::{MAX_CHOICES, MAX_TOP_LOGPROBS};
use crate::http::error::ApiError;
use crate::http::state::AppState;
use crate::protocol::params::SamplingParams;
use crate::requests::common::{model_info, parse_json, parse_messages, Chat};
use crate::requests::keyed::Keyed;
use crate::requests::thinking::TemplateArgs;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamOptions {
    include_usage: bool,
}

/// Body of `/v1/chat/completions` and `/v1/completions` (the fields of both; each handler
/// checks which apply). Unknown fields are ignored, as OpenAI-compatible servers do.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct OpenAiRequest {
    model: Option<String>,
    messages: Option<Vec<Value>>,
    /// vLLM's and transformers' template switches (llama-server reads them too).
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    prompt: Option<Value>,
    pub(super) stream: Option<bool>,
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
    pub(super) n: Option<u32>,
    response_format: Option<Value>,
    /// llama-server's top-level JSON schema constraint.
    #[serde(default)]
    json_schema: Option<Value>,
    logprobs: Option<Value>,
    top_logprobs: Option<u32>,
    pub(super) tools: Option<Vec<Value>>,
    pub(super) tool_choice: Option<Value>,
    pub(super) parallel_tool_calls: Option<bool>,
    echo: Option<bool>,
    pub(super) suffix: Option<String>,
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
    pub(super) lora: Option<Value>,
    speculative: Option<bool>,
    /// false: decode the whole prompt, reusing no cached prefix (llama-server's field).
    cache_prompt: Option<bool>,
    /// true: the output must depend on the request alone (`--deterministic`), else 400.
    deterministic: Option<bool>,
    /// llama-server's `return_progress`: a streamed answer reports the prompt's decode.
    return_progress: Option<bool>,
    /// llama-server's `verbose`: a whole answer carries `__verbose` (the answer in its native
    /// format, the rendered prompt among it); absent, as the server's `--verbose`.
    verbose: Option<bool>,
    /// Template variables (llama-server's and vLLM's; `enable_thinking` among them).
    chat_template_kwargs: Option<Value>,
    /// OpenAI's reasoning level; `"none"` turns a thinking template's thinking off.
    reasoning_effort: Option<Value>,
    /// DRY, XTC, top-n-sigma, dynamic temperature (llama-server's fields).
    #[serde(flatten)]
    samplers: crate::requests::options::SamplerFields,
}

impl OpenAiRequest {
    /// Whether the answer carries llama-server's `__verbose` object.
    pub(super) fn verbose(&self, state: &AppState) -> bool {
        self.verbose.unwrap_or(state.verbose_answers)
    }

    /// The chat template's switches: `chat_template_kwargs` and `reasoning_effort`.
    pub(super) fn template_args(&self) -> Result<TemplateArgs, ApiError> {
        TemplateArgs::read(
            None,
            self.chat_template_kwargs.as_ref(),
            self.reasoning_effort.as_ref(),
        )
    }

    /// Sampling parameters with OpenAI's defaults (temperature 1, top_p 1, no repetition
    /// penalty; Ollama's top_k 40 unless given).
    pub(super) fn params(&self, chat: bool) -> Result<SamplingParams, ApiError> {
        if self.n.is_some_and(|n| n == 0 || n > MAX_CHOICES) {
            return Err(ApiError::field(
                "n",
                format!(" must be between 1 and {MAX_CHOICES}"),
            ));
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(ApiError::field("best_of", ": only 1 is supported"));
        }
        let (max, max_field) = match self.max_completion_tokens {
            Some(m) => (Some(m), "max_completion_tokens"),
            None => (self.max_tokens, "max_tokens"),
        };
        if max.is_some_and(|m| m < 0) {
            return Err(ApiError::field(max_field, " must be >= 0"));
        }
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(ApiError::field(
                    "temperature",
                    format!(" must be between 0 and 2, got {t}"),
                ));
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
            deterministic: self.deterministic.unwrap_or(false),
            // Reports only a stream can carry.
            return_progress: self.return_progress == Some(true) && self.stream == Some(true),
            samplers: self.samplers.samplers(),
            ..defaults
        };
        crate::requests::validate::check_options(&p).map_err(|e| e.top_level(&[]))?;
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
                        return Err(ApiError::field("top_logprobs", " needs logprobs: true"));
                    }
                    return Ok(None);
                }
                Some(Value::Bool(true)) => self.top_logprobs.unwrap_or(0),
                Some(_) => return Err(ApiError::field("logprobs", " must be true or false")),
            }
        } else {
            match &self.logprobs {
                None | Some(Value::Null) => return Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| {
                        ApiError::field("logprobs", " must be an integer from 0 to 20")
                    })?,
            }
        };
        if top > MAX_TOP_LOGPROBS {
            return Err(ApiError::field(
                if chat { "top_logprobs" } else { "logprobs" },
                format!(" must be between 0 and {MAX_TOP_LOGPROBS}"),
            ));
        }
        Ok(Some(top as usize))
    }

    pub(super) fn include_usage(&self) -> bool {
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
            .ok_or_else(|| ApiError::field("stop", " must be a string or an array of strings"))?,
        Some(_) => {
            return Err(ApiError::field(
                "stop",
                " must be a string or an array of strings",
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
                ApiError::field(
                    "logit_bias",
                    format!(": keys must be token ids, got {token:?}"),
                )
            })?;
            if !(-100.0..=100.0).contains(&value) {
                return Err(ApiError::field(
                    "logit_bias",
                    format!(": values must be between -100 and 100, got {value}"),
                ));
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
    .map_err(ApiError::InvalidField)?;
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
            .map_err(ApiError::InvalidField);
    }
    Ok(format)
}

/// Parses a completion request for the served model.
pub(super) fn parse_request(state: &AppState, body: &[u8]) -> Result<OpenAiRequest, ApiError> {
    model_info(state)?;
    parse_json(body)
}

/// A chat request's conversation.
pub(super) fn chat_of(req: &OpenAiRequest) -> Result<Chat, ApiError> {
    parse_messages(
        req.messages
            .clone()
            .ok_or_else(|| ApiError::field("messages", " is required"))?,
    )
}

/// `/v1/chat/completions` as `routing_key` reads it: as `chat_completions` does.
pub(crate) fn chat_keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: OpenAiRequest = parse_json(body)?;
    let chat = chat_of(&req)?;
    Ok(Keyed::chat(req.model, chat.messages))
}

/// A completion request's prompt: one text (empty only with a suffix).
pub(super) fn completion_prompt(req: &OpenAiRequest) -> Result<String, ApiError> {
    if req.echo == Some(true) {
        return Err(ApiError::field("echo", " is not supported"));
    }
    let prompt = match &req.prompt {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            items[0].as_str().unwrap_or_default().to_string()
        }
        Some(Value::Array(_)) => return Err(ApiError::field(
            "prompt",
            ": only one text prompt per request is supported (token arrays and batches are not)",
        )),
        _ => {
            return Err(ApiError::field(
                "prompt",
                " is required and must be a string",
            ))
        }
    };
    if prompt.is_empty() && req.suffix.as_ref().is_none_or(|s| s.is_empty()) {
        return Err(ApiError::field("prompt", " must not be empty"));
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

/// `add_generation_prompt` and `continue_final_message`: a conversation that ends with an
/// assistant's text is continued (`requests::common::split_prefill`), which is what
/// `continue_final_message: true` (with `add_generation_prompt` false or absent) asks; both
/// true contradict each other, and an answer cannot be continued without one to continue or
/// a conversation rendered without the assistant's opening here: each is a 400, never a
/// switch ignored.
pub(super) fn check_continuation(
    req: &OpenAiRequest,
    messages: &[crate::chat::ChatMessage],
) -> Result<(), ApiError> {
    let continues = req.continue_final_message == Some(true);
    if continues && req.add_generation_prompt == Some(true) {
        return Err(ApiError::field(
            "add_generation_prompt",
            " and continue_final_message cannot both be true",
        ));
    }
    let last_is_answer = messages
        .last()
        .is_some_and(|m| m.role == "assistant" && !m.content.is_empty());
    if continues && !last_is_answer {
        return Err(ApiError::field(
            "continue_final_message",
            ": the last message must be an assistant's text",
        ));
    }
    if req.add_generation_prompt == Some(false) && !last_is_answer {
        return Err(ApiError::field(
            "add_generation_prompt",
            ": false is only supported to continue a final assistant \
             message (continue_final_message)",
        ));
    }
    Ok(())
}
