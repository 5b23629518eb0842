//! How an Anthropic request is read: the body of `/v1/messages` (`MessagesRequest`), its
//! sampling parameters with Anthropic's defaults and checks, its structured output and its
//! `thinking` switch.

use serde::Deserialize;
use serde_json::Value;

use crate::http::error::ApiError;
use crate::http::state::AppState;
use crate::protocol::params::SamplingParams;
use crate::requests::common::{model_info, parse_json};
use crate::requests::validate;

/// Body of `/v1/messages` (and of `count_tokens`, which ignores the generation fields).
/// Unknown fields are ignored, as Anthropic-compatible servers do.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct MessagesRequest {
    pub(super) model: Option<String>,
    pub(super) messages: Option<Vec<Value>>,
    pub(super) system: Option<Value>,
    max_tokens: Option<i64>,
    pub(super) stop_sequences: Option<Vec<String>>,
    pub(super) stream: Option<bool>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i32>,
    pub(super) tools: Option<Vec<Value>>,
    pub(super) tool_choice: Option<Value>,
    thinking: Option<Value>,
    /// `{"format": {"type": "json_schema", "schema"}, "effort"}`.
    output_config: Option<Value>,
    /// The structured-outputs beta's name for `output_config.format`.
    output_format: Option<Value>,
    // llama.cpp-style extras, as the OpenAI dialect takes them.
    min_p: Option<f32>,
    seed: Option<i64>,
    repeat_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    pub(super) lora: Option<Value>,
    cache_prompt: Option<bool>,
    /// true: the output must depend on the request alone (`--deterministic`), else 400.
    deterministic: Option<bool>,
    /// DRY, XTC, top-n-sigma, dynamic temperature (llama-server's fields).
    #[serde(flatten)]
    samplers: crate::requests::options::SamplerFields,
}

impl MessagesRequest {
    /// Sampling parameters with Anthropic's defaults (temperature 1, no nucleus cut).
    pub(super) fn params(&self) -> Result<SamplingParams, ApiError> {
        let max = self
            .max_tokens
            .ok_or_else(|| ApiError::field("max_tokens", ": Field required"))?;
        if max < 1 {
            return Err(ApiError::field("max_tokens", ": must be at least 1"));
        }
        if let Some(t) = self.temperature {
            if !(0.0..=1.0).contains(&t) {
                return Err(ApiError::field(
                    "temperature",
                    format!(": must be between 0 and 1, got {t}"),
                ));
            }
        }
        if self.top_k.is_some_and(|k| k < 0) {
            return Err(ApiError::field("top_k", ": must be at least 0"));
        }
        let defaults = SamplingParams::default();
        let mut p = SamplingParams {
            num_predict: max,
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(defaults.top_k),
            min_p: self.min_p.unwrap_or(0.0),
            repeat_penalty: self.repeat_penalty.unwrap_or(1.0),
            seed: self.seed.unwrap_or(-1),
            stop: self
                .stop_sequences
                .iter()
                .flatten()
                .filter(|s| !s.is_empty())
                .cloned()
                .collect(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            cache_prompt: self.cache_prompt.unwrap_or(true),
            deterministic: self.deterministic.unwrap_or(false),
            samplers: self.samplers.samplers(),
            ..defaults
        };
        validate::check_options(&p).map_err(|e| e.top_level(&[("stop", "stop_sequences")]))?;
        // As Anthropic's API: a prompt that does not fit is an error, not silently cut.
        p.truncate = false;
        p.grammar = self.output_grammar()?;
        Ok(p)
    }

    /// Structured output: `output_config.format` (or the beta's `output_format`), a JSON
    /// schema, through the grammar path. `output_config.effort` is checked and has no effect
    /// here (no template takes a level).
    fn output_grammar(&self) -> Result<Option<crate::constrain::Grammar>, ApiError> {
        let config = self.output_config.as_ref().filter(|c| !c.is_null());
        if let Some(config) = config {
            if !config.is_object() {
                return Err(ApiError::field("output_config", ": must be an object"));
            }
            match config.get("effort") {
                None | Some(Value::Null) => {}
                Some(Value::String(e))
                    if ["low", "medium", "high", "xhigh", "max"].contains(&e.as_str()) => {}
                Some(_) => {
                    return Err(ApiError::field(
                        "output_config.effort",
                        ": must be low, medium, high, xhigh or max",
                    ))
                }
            }
        }
        let (format, at) = match (config.and_then(|c| c.get("format")), &self.output_format) {
            (Some(f), _) if !f.is_null() => (f, "output_config.format"),
            (_, Some(f)) if !f.is_null() => (f, "output_format"),
            _ => return Ok(None),
        };
        if format.get("type").and_then(Value::as_str) != Some("json_schema") {
            return Err(ApiError::field(
                format!("{at}.type"),
                ": must be \"json_schema\"",
            ));
        }
        crate::requests::format::response_format(format, at).map_err(ApiError::InvalidField)
    }

    /// `thinking`: `{"type": "enabled", "budget_tokens": N}` turns the template's reasoning on
    /// (the budget must be positive and below `max_tokens`; Anthropic's API also wants 1024,
    /// llama-server does not;
    /// the thinking is bounded by `max_tokens`), `{"type": "disabled"}` off; `adaptive`,
    /// `between_tools` or absent: the template's default.
    pub(super) fn think(&self) -> Result<Option<bool>, ApiError> {
        let Some(thinking) = self.thinking.as_ref().filter(|t| !t.is_null()) else {
            return Ok(None);
        };
        match thinking.get("type").and_then(Value::as_str) {
            Some("disabled") => Ok(Some(false)),
            // The model decides: the template's default.
            Some("adaptive" | "between_tools") => Ok(None),
            Some("enabled") => {
                let budget = thinking
                    .get("budget_tokens")
                    .and_then(Value::as_i64)
                    .ok_or_else(|| {
                        ApiError::field("thinking.budget_tokens", ": Field required (an integer)")
                    })?;
                // Anthropic's API wants at least 1024; llama-server takes any, and a small
                // model's thinking needs no such floor.
                if budget < 1 {
                    return Err(ApiError::field(
                        "thinking.budget_tokens",
                        ": must be a positive integer",
                    ));
                }
                if self.max_tokens.is_some_and(|m| budget >= m) {
                    return Err(ApiError::field(
                        "thinking.budget_tokens",
                        ": must be less than max_tokens",
                    ));
                }
                Ok(Some(true))
            }
            _ => Err(ApiError::field(
                "thinking.type",
                " must be \"enabled\", \"disabled\", \"adaptive\" or \
                 \"between_tools\"",
            )),
        }
    }
}

/// Reads a request for the served model.
pub(super) fn parse_request(state: &AppState, body: &[u8]) -> Result<MessagesRequest, ApiError> {
    model_info(state)?;
    let req: MessagesRequest = parse_json(body)?;
    Ok(req)
}
