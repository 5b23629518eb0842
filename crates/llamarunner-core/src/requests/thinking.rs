//! Whether a chat request thinks: the switches a request may send (Ollama's `think`,
//! llama-server's and vLLM's `chat_template_kwargs`, OpenAI's `reasoning_effort`), checked
//! before the queue, and the server's `--reasoning` default for what a request leaves out.
//! The result is the template's `enable_thinking` and whether the answer's `<think>` reasoning
//! is read out of the text.

use serde_json::{Map, Value};

use crate::chat::reasoning::THINK_OPEN;
use crate::chat::{RenderExtras, RESERVED_VARIABLES};
use crate::config::ReasoningFormat;
use crate::http::error::{quoted, ApiError};
use crate::http::state::AppState;
use crate::protocol::ModelInfo;

/// What a chat request asks of its template besides the conversation and tools.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TemplateArgs {
    /// `enable_thinking` as the request sets it; None: the server's `--reasoning` decides.
    pub think: Option<bool>,
    /// The rest of `chat_template_kwargs`, as template variables.
    pub kwargs: Map<String, Value>,
}

impl From<Option<bool>> for TemplateArgs {
    fn from(think: Option<bool>) -> Self {
        Self {
            think,
            kwargs: Map::new(),
        }
    }
}

impl TemplateArgs {
    /// Reads a request's switches: `think` (already parsed), `chat_template_kwargs` (an object
    /// of template variables; its `enable_thinking` a boolean) and `reasoning_effort` (`"none"`
    /// turns thinking off, another level is passed to the template as `reasoning_effort`, as
    /// llama-server does). The later of them wins where they disagree.
    pub fn read(
        think: Option<bool>,
        chat_template_kwargs: Option<&Value>,
        reasoning_effort: Option<&Value>,
    ) -> Result<Self, ApiError> {
        let mut args = Self::from(think);
        match chat_template_kwargs {
            None | Some(Value::Null) => {}
            Some(Value::Object(kwargs)) => {
                for (name, value) in kwargs {
                    if RESERVED_VARIABLES.contains(&name.as_str()) {
                        return Err(ApiError::field(
                            "chat_template_kwargs",
                            format!(
                                ": {name} is the server's to set (the request's \
                             own fields set it)"
                            ),
                        ));
                    }
                    if name == "enable_thinking" {
                        args.think = match value {
                            Value::Null => args.think,
                            Value::Bool(b) => Some(*b),
                            other => {
                                return Err(ApiError::field(
                                    "chat_template_kwargs.enable_thinking",
                                    format!(
                                        " must be a boolean, \
                                     got {}",
                                        quoted(other)
                                    ),
                                ))
                            }
                        };
                    } else {
                        args.kwargs.insert(name.clone(), value.clone());
                    }
                }
            }
            Some(other) => {
                return Err(ApiError::field(
                    "chat_template_kwargs",
                    format!(" must be an object, got {}", quoted(other)),
                ))
            }
        }
        match reasoning_effort {
            None | Some(Value::Null) => {}
            Some(Value::String(level)) if level == "none" => args.think = Some(false),
            Some(Value::String(level))
                if ["minimal", "low", "medium", "high", "xhigh"].contains(&level.as_str()) =>
            {
                args.kwargs
                    .insert("reasoning_effort".into(), Value::String(level.clone()));
            }
            Some(other) => {
                return Err(ApiError::field(
                    "reasoning_effort",
                    format!(
                        " must be none, minimal, low, medium, high or xhigh, got \
                     {}",
                        quoted(other)
                    ),
                ))
            }
        }
        Ok(args)
    }

    /// The template's variables for a request on this server: `enable_thinking` as the
    /// request sets it, else as `--reasoning` decides for this template.
    pub fn extras(self, state: &AppState, info: &ModelInfo) -> RenderExtras {
        RenderExtras {
            tools: None,
            enable_thinking: self
                .think
                .or_else(|| state.reasoning.default_thinking(&info.template)),
            kwargs: self.kwargs,
        }
    }
}

/// A request's `think` (Ollama's field, also the native chat's): true, false, or a level
/// ("high", "medium", "low": thinking on); absent or null: None (as the server decides).
pub fn parse_think(think: Option<&Value>) -> Result<Option<bool>, ApiError> {
    match think {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(Value::String(s)) if matches!(s.as_str(), "high" | "medium" | "low") => Ok(Some(true)),
        Some(other) => Err(ApiError::field(
            "think",
            format!(
                " must be true, false, \"high\", \"medium\" or \"low\", got {}",
                quoted(other)
            ),
        )),
    }
}

/// Whether a chat answer's `<think>` reasoning is split out: not with `--reasoning-format
/// none`; else as the template's `enable_thinking` says (the request's, or `--reasoning`'s),
/// or, where neither says, when the template is a thinking model's (it mentions `<think>`).
pub fn reasoning_enabled(state: &AppState, info: &ModelInfo, thinking: Option<bool>) -> bool {
    state.reasoning_format != ReasoningFormat::None
        && thinking.unwrap_or_else(|| info.template.source.contains(THINK_OPEN))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(kwargs: Value, effort: Value) -> Result<TemplateArgs, String> {
        TemplateArgs::read(None, Some(&kwargs), Some(&effort)).map_err(|e| e.to_string())
    }

    #[test]
    fn kwargs_and_effort_set_the_switch_and_the_variables() {
        let args = read(json!({"enable_thinking": false, "x": [1]}), Value::Null).unwrap();
        assert_eq!(args.think, Some(false));
        assert_eq!(Value::Object(args.kwargs), json!({"x": [1]}));
        let args = read(json!({}), json!("none")).unwrap();
        assert_eq!(args.think, Some(false));
        let args = read(json!({"enable_thinking": true}), json!("high")).unwrap();
        assert_eq!(args.think, Some(true));
        assert_eq!(
            Value::Object(args.kwargs),
            json!({"reasoning_effort": "high"})
        );
        // think as sent, when nothing else says.
        let args = TemplateArgs::read(Some(true), None, None).unwrap();
        assert_eq!(args, TemplateArgs::from(Some(true)));
        let args = read(json!({"enable_thinking": null}), Value::Null).unwrap();
        assert_eq!(args.think, None);
    }

    #[test]
    fn bad_switches_are_refused_naming_the_field() {
        for (kwargs, effort, field) in [
            (
                json!([1]),
                Value::Null,
                "chat_template_kwargs must be an object",
            ),
            (
                json!("x"),
                Value::Null,
                "chat_template_kwargs must be an object",
            ),
            (
                json!({"enable_thinking": "true"}),
                Value::Null,
                "enable_thinking must be a boolean",
            ),
            (
                json!({"enable_thinking": 1}),
                Value::Null,
                "enable_thinking must be a boolean",
            ),
            (
                json!({"messages": []}),
                Value::Null,
                "messages is the server's",
            ),
            (json!({"tools": []}), Value::Null, "tools is the server's"),
            (
                json!({"bos_token": ""}),
                Value::Null,
                "bos_token is the server's",
            ),
            (json!({}), json!("max"), "reasoning_effort must be"),
            (json!({}), json!(3), "reasoning_effort must be"),
        ] {
            let err = read(kwargs.clone(), effort).unwrap_err();
            assert!(err.contains(field), "{kwargs}: {err}");
        }
    }
}
