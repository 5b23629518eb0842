//! How a Responses request is read: the body of `POST /v1/responses` (`ResponsesRequest`), its
//! sampling parameters, `text.format` and `reasoning`, its function tools, its `metadata`, and
//! its `instructions` put before the conversation.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::http::error::ApiError;
use crate::protocol::params::SamplingParams;
use crate::requests::tool_calls::ToolRequest;
use crate::requests::validate;

/// Body of `POST /v1/responses`. Unknown fields are ignored, as OpenAI-compatible servers do.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct ResponsesRequest {
    pub(super) model: Option<String>,
    pub(super) input: Option<Value>,
    pub(super) instructions: Option<String>,
    pub(super) previous_response_id: Option<String>,
    pub(super) store: Option<bool>,
    pub(super) stream: Option<bool>,
    pub(super) max_output_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    pub(super) tools: Option<Vec<Value>>,
    pub(super) tool_choice: Option<Value>,
    pub(super) parallel_tool_calls: Option<bool>,
    pub(super) text: Option<Value>,
    pub(super) reasoning: Option<Value>,
    pub(super) truncation: Option<String>,
    pub(super) metadata: Option<Value>,
    background: Option<bool>,
    conversation: Option<Value>,
    top_logprobs: Option<u32>,
    // llama.cpp-style extras, as the chat endpoint takes them.
    top_k: Option<i32>,
    min_p: Option<f32>,
    seed: Option<i64>,
    repeat_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    pub(super) lora: Option<Value>,
    cache_prompt: Option<bool>,
    /// true: the output must depend on the request alone (`--deterministic`), else 400.
    deterministic: Option<bool>,
    /// llama-server's `return_progress`: a streamed answer reports the prompt's decode.
    return_progress: Option<bool>,
    /// llama-server's `timings_per_token`: a streamed answer's text deltas carry the timings
    /// so far.
    pub(super) timings_per_token: Option<bool>,
    /// DRY, XTC, top-n-sigma, dynamic temperature (llama-server's fields).
    #[serde(flatten)]
    samplers: crate::requests::options::SamplerFields,
}

impl ResponsesRequest {
    pub(super) fn params(&self) -> Result<SamplingParams, ApiError> {
        if self.background == Some(true) {
            return Err(ApiError::field(
                "background",
                ": background responses are not supported",
            ));
        }
        if self.conversation.as_ref().is_some_and(|c| !c.is_null()) {
            return Err(ApiError::field(
                "conversation",
                ": conversations are not supported; continue one with \
                 previous_response_id",
            ));
        }
        if self.top_logprobs.is_some_and(|n| n > 0) {
            return Err(ApiError::field(
                "top_logprobs",
                ": not supported on /v1/responses",
            ));
        }
        if self.max_output_tokens.is_some_and(|m| m < 1) {
            return Err(ApiError::field("max_output_tokens", " must be at least 1"));
        }
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(ApiError::field(
                    "temperature",
                    format!(" must be between 0 and 2, got {t}"),
                ));
            }
        }
        let truncate = match self.truncation.as_deref() {
            None | Some("disabled") => false,
            Some("auto") => true,
            Some(other) => {
                return Err(ApiError::field(
                    "truncation",
                    format!(" must be \"auto\" or \"disabled\", got {other:?}"),
                ))
            }
        };
        let defaults = SamplingParams::default();
        let mut p = SamplingParams {
            num_predict: self.max_output_tokens.unwrap_or(-1),
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(defaults.top_k),
            min_p: self.min_p.unwrap_or(0.0),
            repeat_penalty: self.repeat_penalty.unwrap_or(1.0),
            seed: self.seed.unwrap_or(-1),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            cache_prompt: self.cache_prompt.unwrap_or(true),
            deterministic: self.deterministic.unwrap_or(false),
            // Reports only a stream can carry.
            return_progress: self.return_progress == Some(true) && self.stream == Some(true),
            samplers: self.samplers.samplers(),
            ..defaults
        };
        validate::check_options(&p).map_err(|e| e.top_level(&[]))?;
        p.truncate = truncate;
        p.grammar = self.format_grammar()?;
        Ok(p)
    }

    /// `text.format`: `text`, `json_object`, or `json_schema` with its `schema`.
    fn format_grammar(&self) -> Result<Option<crate::constrain::Grammar>, ApiError> {
        let Some(format) = self
            .text
            .as_ref()
            .filter(|t| !t.is_null())
            .and_then(|t| t.get("format"))
            .filter(|f| !f.is_null())
        else {
            return Ok(None);
        };
        crate::requests::format::response_format(format, "text.format")
            .map_err(ApiError::InvalidField)
    }

    /// `reasoning`: `{"effort": "none"}` asks the template not to think, any other effort to
    /// think; absent, the template's default.
    pub(super) fn think(&self) -> Result<Option<bool>, ApiError> {
        let Some(r) = self.reasoning.as_ref().filter(|r| !r.is_null()) else {
            return Ok(None);
        };
        if !r.is_object() {
            return Err(ApiError::field("reasoning", " must be an object"));
        }
        match r.get("effort") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(e)) if e == "none" => Ok(Some(false)),
            Some(Value::String(e))
                if ["minimal", "low", "medium", "high", "xhigh"].contains(&e.as_str()) =>
            {
                Ok(Some(true))
            }
            Some(_) => Err(ApiError::field(
                "reasoning.effort",
                " must be none, minimal, low, medium, high or xhigh",
            )),
        }
    }
}

/// Function tools (`{"type": "function", "name", "description", "parameters"}`) and
/// `tool_choice` in the chat path's shape; built-in tools are refused.
pub(super) fn tool_request(req: &ResponsesRequest) -> Result<Option<ToolRequest>, ApiError> {
    let tools = req
        .tools
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, t)| {
            let kind = t.get("type").and_then(Value::as_str);
            if kind != Some("function") {
                return Err(ApiError::invalid(format!(
                    "tools[{i}].type: only function tools are supported, got {}",
                    kind.map_or_else(|| "none".to_string(), |k| format!("{k:?}"))
                )));
            }
            let mut function = json!({"name": t.get("name").cloned().unwrap_or(Value::Null)});
            for key in ["description", "parameters"] {
                if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
                    function[key] = v.clone();
                }
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let choice = match req.tool_choice.as_ref().filter(|c| !c.is_null()) {
        None => None,
        Some(Value::String(s)) => Some(json!(s)),
        Some(c) if c.get("type").and_then(Value::as_str) == Some("function") => Some(
            json!({"type": "function", "function": {"name": c.get("name").cloned().unwrap_or(Value::Null)}}),
        ),
        Some(_) => {
            return Err(ApiError::field(
                "tool_choice",
                " must be \"auto\", \"none\", \"required\" or {\"type\": \
                 \"function\", \"name\": ...}",
            ))
        }
    };
    ToolRequest::parse(Some(&tools), choice.as_ref(), req.parallel_tool_calls)
}

/// `metadata` as OpenAI bounds it: an object of at most 16 string values of at most 512
/// characters, under keys of at most 64 (it is echoed in the response and kept with it).
pub(super) fn check_metadata(metadata: Option<&Value>) -> Result<(), ApiError> {
    let Some(metadata) = metadata.filter(|m| !m.is_null()) else {
        return Ok(());
    };
    let Value::Object(map) = metadata else {
        return Err(ApiError::field("metadata", " must be an object of strings"));
    };
    if map.len() > 16 {
        return Err(ApiError::field(
            "metadata",
            format!(" has {} keys; at most 16", map.len()),
        ));
    }
    for (key, value) in map {
        if key.chars().count() > 64 {
            return Err(ApiError::field(
                "metadata",
                ": a key is longer than 64 characters",
            ));
        }
        match value {
            Value::String(v) if v.chars().count() <= 512 => {}
            Value::String(_) => {
                return Err(ApiError::invalid(format!(
                    "metadata[{key:?}] is longer than 512 characters"
                )))
            }
            _ => {
                return Err(ApiError::invalid(format!(
                    "metadata[{key:?}] must be a string"
                )))
            }
        }
    }
    Ok(())
}

/// The conversation the template is given: `instructions` as a system message, then the
/// conversation (the stored one continued, then the input).
pub(super) fn with_instructions(req: &ResponsesRequest, history: &[Value]) -> Vec<Value> {
    let mut messages = Vec::with_capacity(history.len() + 1);
    if let Some(instructions) = req.instructions.as_deref().filter(|s| !s.is_empty()) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    messages.extend(history.iter().cloned());
    messages
}
