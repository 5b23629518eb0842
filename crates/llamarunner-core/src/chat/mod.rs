//! Chat templates: turning a conversation into the prompt text a model was trained on.
//!
//! A GGUF usually carries its Hugging Face Jinja template in `tokenizer.chat_template`; it is
//! rendered with minijinja (with Python string methods, `raise_exception` and `strftime_now`, as
//! Hugging Face's `apply_chat_template` offers). Many GGUFs carry none (the default model is a
//! base model without one), so a small set of known family templates is built in and picked by
//! architecture and vocabulary; `--chat-template NAME|FILE` overrides both.

mod dates;
pub mod reasoning;
pub mod tools;
pub mod utf8;

use minijinja::value::Serde;
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

pub(crate) use dates::civil_from_days;

/// Gemma (1, 2, 3): `<start_of_turn>user ... <end_of_turn>`, the system prompt folded into the
/// first user turn, the assistant called "model".
const GEMMA: &str = r#"{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set first_user_prefix = '' -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + (message['content'] | trim) + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"#;

/// ChatML (Qwen, Hermes, SmolLM, many fine-tunes).
const CHATML: &str = r#"{%- for message in messages -%}
  {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"#;

/// Llama 3.x.
const LLAMA3: &str = r#"{{- bos_token -}}
{%- for message in messages -%}
  {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | trim) + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"#;

/// Phi-3 / Phi-3.5.
const PHI3: &str = r#"{%- for message in messages -%}
  {{- '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"#;

/// Mistral / Mixtral instruct (`[INST] ... [/INST]`), the system prompt folded into the first
/// user turn.
const MISTRAL: &str = r#"{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system = messages[0]['content'] + '\n\n' -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set system = '' -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- if message['role'] == 'user' -%}
    {{- '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' -}}
  {%- else -%}
    {{- message['content'] + eos_token -}}
  {%- endif -%}
{%- endfor -%}"#;

/// Cohere Command R (llama.cpp's built-in `command-r`): each turn's text trimmed.
const COMMAND_R: &str = r#"{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}{%- set role = '<|SYSTEM_TOKEN|>' -%}
  {%- elif message['role'] == 'user' -%}{%- set role = '<|USER_TOKEN|>' -%}
  {%- elif message['role'] == 'assistant' -%}{%- set role = '<|CHATBOT_TOKEN|>' -%}
  {%- else -%}{%- set role = '' -%}{%- endif -%}
  {%- if role -%}
    {{- '<|START_OF_TURN_TOKEN|>' + role + (message['content'] | trim) + '<|END_OF_TURN_TOKEN|>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' -}}{%- endif -%}"#;

/// End-of-turn markers of the common template families. A chat request stops at the ones its
/// template writes: llama.cpp already ends generation at such a marker when the vocabulary has
/// it as an end-of-generation token, but a model without that token (a fallback template on a
/// base model) would otherwise write the marker as text and carry on with the next turn.
const TURN_ENDS: &[&str] = &[
    "<end_of_turn>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<|endoftext|>",
    "<｜end▁of▁sentence｜>",
    "<|END_OF_TURN_TOKEN|>",
];

/// The built-in templates, by the name `--chat-template` accepts.
pub const BUILTIN: &[(&str, &str)] = &[
    ("gemma", GEMMA),
    ("chatml", CHATML),
    ("llama3", LLAMA3),
    ("phi3", PHI3),
    ("mistral", MISTRAL),
    ("command-r", COMMAND_R),
];

/// The source of a built-in template.
pub fn builtin(name: &str) -> Option<&'static str> {
    BUILTIN.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// What the vocabulary tells about the model's family, for picking a built-in template.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Vocabulary {
    /// `general.architecture`.
    pub architecture: String,
    /// The vocabulary has `<start_of_turn>` as one token.
    pub start_of_turn: bool,
    /// ... `<|start_header_id|>`.
    pub start_header_id: bool,
    /// ... `<|im_start|>`.
    pub im_start: bool,
    /// ... `<|assistant|>` and `<|end|>`.
    pub phi_turns: bool,
    /// ... `[INST]`.
    pub inst: bool,
}

/// The built-in template for a model without its own: by architecture first, then by the
/// turn markers its vocabulary has; ChatML when nothing matches.
pub fn family_template(vocab: &Vocabulary) -> &'static str {
    let arch = vocab.architecture.as_str();
    if arch.starts_with("gemma") || vocab.start_of_turn {
        "gemma"
    } else if vocab.start_header_id {
        "llama3"
    } else if vocab.im_start {
        "chatml"
    } else if arch == "phi3" || vocab.phi_turns {
        "phi3"
    } else if vocab.inst || arch == "mistral" {
        "mistral"
    } else {
        "chatml"
    }
}

/// One chat message as the templates see it. `content` is always text (the text parts of an
/// OpenAI content array joined by a line break, as llama-server and vLLM join them); other
/// fields (`name`, `tool_calls`, ...) pass through.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// "system", "user", "assistant", "tool", ...
    pub role: String,
    /// The text.
    pub content: String,
    /// Anything else the client sent with the message.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
    /// The texts of a content array of text parts only, as sent (empty otherwise): an
    /// assistant message the answer continues joins them with a blank line, as llama-server
    /// does (`requests::common::split_prefill`). Templates never see it.
    #[serde(skip)]
    pub parts: Vec<String>,
}

/// Failures of template compilation or rendering.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum TemplateError {
    /// The template's source does not compile.
    #[error("chat template {name} does not compile: {reason}")]
    Compile {
        /// Where it came from.
        name: String,
        /// minijinja's explanation.
        reason: String,
    },
    /// Rendering failed (the template raised, or the conversation does not fit it).
    #[error("{0}")]
    Render(String),
}

/// What a request adds to a template's variables besides the messages.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RenderExtras {
    /// The request's tools, in OpenAI's shape (`chat::tools::template_tools`).
    pub tools: Option<serde_json::Value>,
    /// Qwen3-style thinking switch (Ollama's `think`, `chat_template_kwargs.enable_thinking`,
    /// else the server's `--reasoning`).
    pub enable_thinking: Option<bool>,
    /// A request's other `chat_template_kwargs` (llama-server's and vLLM's field), as template
    /// variables; never one of `RESERVED_VARIABLES`.
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

/// The variables a chat template gets from the server, which a request's
/// `chat_template_kwargs` may not replace (`enable_thinking` is read as the thinking switch).
pub const RESERVED_VARIABLES: [&str; 5] = [
    "messages",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "tools",
];

/// A compiled chat template with the model's special tokens.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from ("gguf", a built-in name, or a file path).
    pub name: String,
    /// Its source text.
    pub source: String,
    bos_token: String,
    eos_token: String,
    /// Stop strings for chat requests: the end-of-turn markers the template writes.
    pub stop: Vec<String>,
}

const TEMPLATE_NAME: &str = "chat";

/// What tells Firefunction v2's template (llama.cpp detects it by the same text).
const FIREFUNCTION_MARK: &str = " functools[";

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the texts of the model's special tokens.
    pub fn new(
        name: impl Into<String>,
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, TemplateError> {
        let name = name.into();
        let source = source.into();
        let mut env = Environment::new();
        // The same errors in every build (minijinja's debug mode, on in debug builds, words
        // some of them otherwise); an undefined variable is named by `render_with` itself.
        env.set_debug(false);
        // Hugging Face renders chat templates with trim_blocks and lstrip_blocks on.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TemplateError::Compile {
                name: name.clone(),
                reason: e.to_string(),
            })?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", dates::strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| TemplateError::Compile {
                name: name.clone(),
                reason: e.to_string(),
            })?;
        let stop = TURN_ENDS
            .iter()
            .filter(|m| source.contains(*m))
            .map(|m| (*m).to_string())
            .collect();
        Ok(Self {
            env,
            stop,
            name,
            source,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// Renders a conversation. The leading BOS the template writes is removed, because the
    /// tokenizer adds BOS itself (and a doubled BOS degrades the output).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with(messages, add_generation_prompt, &RenderExtras::default())
    }

    /// Whether the template reads the `enable_thinking` switch (Qwen3's, DeepSeek-R1's and
    /// Command R7B's as llama.cpp ships them).
    pub fn reads_enable_thinking(&self) -> bool {
        self.source.contains("enable_thinking")
    }

    /// `render`, with the request's tools and thinking switch for templates that read them
    /// (`tools`, `enable_thinking`: none when absent), its other template kwargs, and today's
    /// date (`chat/dates.rs`).
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extras: &RenderExtras,
    ) -> Result<String, TemplateError> {
        // An empty conversation (Anthropic's `messages: []`, which llama-server takes) is
        // rendered with lookups on undefined values chained, as llama.cpp's Jinja does them:
        // templates read `messages[0]['role']` unguarded. Any other conversation keeps
        // Python Jinja's rules.
        let chainable;
        let env = if messages.is_empty() {
            let mut env = self.env.clone();
            env.set_undefined_behavior(minijinja::UndefinedBehavior::Chainable);
            chainable = env;
            &chainable
        } else {
            &self.env
        };
        let template = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        // Today's date first (a request's kwargs may set its own), then the request's template
        // kwargs, then what every template reads (kwargs never name these: the requests
        // refuse them).
        let mut vars: std::collections::BTreeMap<String, Value> = dates::date_variables()
            .into_iter()
            .map(|(name, value)| (name.to_string(), Value::from(value)))
            .collect();
        if self.source.contains(FIREFUNCTION_MARK) {
            // Firefunction v2's template prints `functions` (the tools as indented JSON, empty
            // without tools), which llama.cpp gives it (`common/chat.cpp`).
            let functions = extras
                .tools
                .as_ref()
                .filter(|t| t.as_array().is_none_or(|a| !a.is_empty()))
                .and_then(|t| serde_json::to_string_pretty(t).ok())
                .unwrap_or_default();
            vars.insert("functions".into(), Value::from(functions));
        }
        for (name, value) in &extras.kwargs {
            vars.insert(name.clone(), Value::from(Serde(value)));
        }
        let tools = extras.tools.as_ref().map(|t| Value::from(Serde(t)));
        for (name, value) in [
            ("messages", Value::from(Serde(messages))),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("bos_token", Value::from(self.bos_token.clone())),
            ("eos_token", Value::from(self.eos_token.clone())),
            ("tools", tools.unwrap_or(Value::from(()))),
            ("enable_thinking", Value::from(extras.enable_thinking)),
        ] {
            vars.insert(name.to_string(), value);
        }
        let given: Vec<String> = vars.keys().cloned().collect();
        let ctx = Value::from(vars);
        let text = template.render(ctx).map_err(|e| {
            let mut reason = e.to_string();
            if e.kind() == ErrorKind::InvalidOperation {
                if let Some(detail) = e.detail() {
                    reason = detail.to_string();
                }
            }
            if reason.contains("undefined") {
                // Name what the template reads that neither the server nor it defines
                // (Firefunction v2's `functions`), as Python's Jinja does.
                let mut missing: Vec<String> = template
                    .undeclared_variables(false)
                    .into_iter()
                    .filter(|v| !given.contains(v) && !env.globals().any(|(g, _)| g == v))
                    .collect();
                missing.sort();
                if !missing.is_empty() {
                    let names: Vec<String> = missing.iter().map(|v| format!("`{v}`")).collect();
                    reason = format!("{reason} ({} is undefined)", names.join(", "));
                }
            }
            TemplateError::Render(format!(
                "the chat template could not render the messages: {reason}"
            ))
        })?;
        Ok(match text.strip_prefix(self.bos_token.as_str()) {
            Some(rest) if !self.bos_token.is_empty() => rest.to_string(),
            _ => text,
        })
    }
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }

    fn conversation() -> Vec<ChatMessage> {
        vec![
            msg("system", "Be brief."),
            msg("user", "Hi"),
            msg("assistant", "Hello!"),
            msg("user", "Name a colour."),
        ]
    }

    #[test]
    fn gemma_folds_the_system_prompt_and_strips_bos() {
        let t = ChatTemplate::new("gemma", GEMMA, "<bos>", "<eos>").unwrap();
        let text = t.render(&conversation(), true).unwrap();
        assert_eq!(
            text,
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
             <start_of_turn>model\nHello!<end_of_turn>\n\
             <start_of_turn>user\nName a colour.<end_of_turn>\n\
             <start_of_turn>model\n"
        );
        let no_prompt = t.render(&conversation()[1..2], false).unwrap();
        assert_eq!(no_prompt, "<start_of_turn>user\nHi<end_of_turn>\n");
        // No messages at all (its `messages[0]['role']` is undefined, not an error).
        assert_eq!(t.render(&[], true).unwrap(), "<start_of_turn>model\n");
    }

    /// The exact text of every built-in template for the whole conversation, with and without
    /// the generation prompt, and for one padded user turn (which shows who trims content).
    /// Every entry of `BUILTIN` must have a row here.
    #[test]
    fn every_builtin_renders_exactly() {
        struct Row {
            name: &'static str,
            bos: &'static str,
            eos: &'static str,
            with_prompt: &'static str,
            without_prompt: &'static str,
            padded: &'static str,
        }
        let rows = [
            Row {
                name: "gemma",
                bos: "<bos>",
                eos: "<eos>",
                with_prompt: "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
                              <start_of_turn>model\nHello!<end_of_turn>\n\
                              <start_of_turn>user\nName a colour.<end_of_turn>\n\
                              <start_of_turn>model\n",
                without_prompt: "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
                                 <start_of_turn>model\nHello!<end_of_turn>\n\
                                 <start_of_turn>user\nName a colour.<end_of_turn>\n",
                padded: "<start_of_turn>user\nx<end_of_turn>\n<start_of_turn>model\n",
            },
            Row {
                name: "chatml",
                bos: "",
                eos: "<|im_end|>",
                with_prompt: "<|im_start|>system\nBe brief.<|im_end|>\n\
                              <|im_start|>user\nHi<|im_end|>\n\
                              <|im_start|>assistant\nHello!<|im_end|>\n\
                              <|im_start|>user\nName a colour.<|im_end|>\n\
                              <|im_start|>assistant\n",
                without_prompt: "<|im_start|>system\nBe brief.<|im_end|>\n\
                                 <|im_start|>user\nHi<|im_end|>\n\
                                 <|im_start|>assistant\nHello!<|im_end|>\n\
                                 <|im_start|>user\nName a colour.<|im_end|>\n",
                padded: "<|im_start|>user\n  x \n<|im_end|>\n<|im_start|>assistant\n",
            },
            Row {
                name: "llama3",
                bos: "<|begin_of_text|>",
                eos: "<|eot_id|>",
                with_prompt: "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
                              <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
                              <|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>\
                              <|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>\
                              <|start_header_id|>assistant<|end_header_id|>\n\n",
                without_prompt: "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
                                 <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
                                 <|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>\
                                 <|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>",
                padded: "<|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|>\
                         <|start_header_id|>assistant<|end_header_id|>\n\n",
            },
            Row {
                name: "phi3",
                bos: "<s>",
                eos: "<|endoftext|>",
                with_prompt: "<|system|>\nBe brief.<|end|>\n\
                              <|user|>\nHi<|end|>\n\
                              <|assistant|>\nHello!<|end|>\n\
                              <|user|>\nName a colour.<|end|>\n\
                              <|assistant|>\n",
                without_prompt: "<|system|>\nBe brief.<|end|>\n\
                                 <|user|>\nHi<|end|>\n\
                                 <|assistant|>\nHello!<|end|>\n\
                                 <|user|>\nName a colour.<|end|>\n",
                padded: "<|user|>\n  x \n<|end|>\n<|assistant|>\n",
            },
            Row {
                name: "mistral",
                bos: "<s>",
                eos: "</s>",
                // No generation prompt of its own: the last [/INST] is where the answer goes.
                with_prompt: "[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] Name a colour. [/INST]",
                without_prompt: "[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] Name a colour. [/INST]",
                padded: "[INST]   x \n [/INST]",
            },
            Row {
                name: "command-r",
                bos: "<BOS_TOKEN>",
                eos: "<|END_OF_TURN_TOKEN|>",
                with_prompt: "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|>\
                              <|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|>\
                              <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello!<|END_OF_TURN_TOKEN|>\
                              <|START_OF_TURN_TOKEN|><|USER_TOKEN|>Name a colour.<|END_OF_TURN_TOKEN|>\
                              <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
                without_prompt: "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|>\
                                 <|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|>\
                                 <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello!<|END_OF_TURN_TOKEN|>\
                                 <|START_OF_TURN_TOKEN|><|USER_TOKEN|>Name a colour.<|END_OF_TURN_TOKEN|>",
                padded: "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>x<|END_OF_TURN_TOKEN|>\
                         <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
            },
        ];
        let mut names: Vec<&str> = rows.iter().map(|r| r.name).collect();
        let mut builtins: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
        names.sort_unstable();
        builtins.sort_unstable();
        assert_eq!(names, builtins, "one row per built-in template");
        for row in rows {
            let t =
                ChatTemplate::new(row.name, builtin(row.name).unwrap(), row.bos, row.eos).unwrap();
            assert_eq!(
                t.render(&conversation(), true).unwrap(),
                row.with_prompt,
                "{} with the generation prompt",
                row.name
            );
            assert_eq!(
                t.render(&conversation(), false).unwrap(),
                row.without_prompt,
                "{} without the generation prompt",
                row.name
            );
            assert_eq!(
                t.render(&[msg("user", "  x \n")], true).unwrap(),
                row.padded,
                "{} with padded content",
                row.name
            );
        }
    }

    #[test]
    fn only_a_leading_bos_text_is_removed() {
        // The template writes BOS itself; the tokenizer adds it again, so the text loses it.
        let t = ChatTemplate::new("t", "{{ bos_token }}[{{ messages[0].content }}]", "<s>", "")
            .unwrap();
        assert_eq!(t.render(&[msg("user", "<s>a")], true).unwrap(), "[<s>a]");
        // A BOS that is not at the start stays, and an empty BOS removes nothing.
        let t = ChatTemplate::new("t", "[{{ messages[0].content }}]", "<s>", "").unwrap();
        assert_eq!(t.render(&[msg("user", "<s>a")], true).unwrap(), "[<s>a]");
        let t = ChatTemplate::new("t", "<s>{{ messages[0].content }}", "", "").unwrap();
        assert_eq!(t.render(&[msg("user", "a")], true).unwrap(), "<s>a");
    }

    #[test]
    fn templates_stop_at_their_turn_markers() {
        let stop = |name: &str| {
            ChatTemplate::new(name, builtin(name).unwrap(), "", "")
                .unwrap()
                .stop
        };
        assert_eq!(stop("gemma"), vec!["<end_of_turn>"]);
        assert_eq!(stop("chatml"), vec!["<|im_end|>"]);
        assert_eq!(stop("llama3"), vec!["<|eot_id|>"]);
        assert_eq!(stop("phi3"), vec!["<|end|>"]);
        assert!(stop("mistral").is_empty());
        assert_eq!(stop("command-r"), vec!["<|END_OF_TURN_TOKEN|>"]);
    }

    #[test]
    fn command_r_skips_roles_it_has_no_token_for() {
        // llama.cpp's built-in `command-r` writes system, user and assistant turns only.
        let t = ChatTemplate::new("command-r", builtin("command-r").unwrap(), "", "").unwrap();
        let text = t
            .render(&[msg("user", "Hi"), msg("tool", "x")], false)
            .unwrap();
        assert_eq!(
            text,
            "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|>"
        );
    }

    #[test]
    fn every_builtin_compiles_and_renders() {
        for (name, source) in BUILTIN {
            let t = ChatTemplate::new(*name, *source, "<s>", "</s>").unwrap();
            let text = t.render(&conversation(), true).unwrap();
            assert!(text.contains("Name a colour."), "{name}: {text}");
        }
    }

    #[test]
    fn hugging_face_idioms_work() {
        // A typical HF template: python string methods, raise_exception, namespace, loop
        // controls, tojson.
        let source = r#"{% set ns = namespace(n=0) %}
{% for m in messages %}
{% if m.role not in ['user', 'assistant', 'system'] %}{{ raise_exception('Unknown role ' + m.role) }}{% endif %}
{% set ns.n = ns.n + 1 %}
[{{ m.role.upper() }}] {{ m.content.strip() }}{% if m.content.startswith('Hi') %}!{% endif %}
{% if loop.index > 10 %}{% break %}{% endif %}
{% endfor %}
{{ ns.n }} {{ {'a': 1} | tojson }}"#;
        let t = ChatTemplate::new("hf", source, "", "").unwrap();
        let text = t.render(&conversation()[1..2], true).unwrap();
        // trim_blocks eats the newline after `{% endif %}`; tojson spaces like json.dumps.
        assert_eq!(text, "[USER] Hi!1 {\"a\": 1}");
        let err = t.render(&[msg("robot", "x")], true).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the chat template could not render the messages: Unknown role robot"
        );
    }

    #[test]
    fn idioms_of_real_gguf_templates_work() {
        // What Mistral, DeepSeek, Phi and Qwen templates lean on: `is string`, selectattr,
        // dict.get/items, slicing, split, `in`, iterating an absent field, tojson, length.
        let source = r#"{%- set users = messages | selectattr("role", "equalto", "user") | list -%}
{%- for m in messages -%}
{%- if m.content is string and not m.get("tool_calls") -%}
{%- set c = m.content.split('</think>')[-1] if '</think>' in m.content else m.content -%}
{{ m.role[:1] }}:{{ c }}{% if m == users[-1] %}*{% endif %}|
{%- endif -%}
{%- for call in m.tool_calls %}{{ call }}{% endfor -%}
{%- endfor -%}
{%- for k, v in {'n': users | length}.items() %}{{ k }}={{ v | tojson }}{% endfor -%}
{%- if tools is not defined or tools is none %};no tools{% endif -%}"#;
        let t = ChatTemplate::new("real", source, "", "").unwrap();
        let messages = vec![
            msg("user", "a"),
            msg("assistant", "<think>hmm</think>b"),
            msg("user", "c"),
        ];
        assert_eq!(
            t.render(&messages, true).unwrap(),
            "u:a|a:b|u:c*|n=2;no tools"
        );
    }

    #[test]
    fn a_template_that_does_not_compile_says_so() {
        let err = ChatTemplate::new("x.jinja", "{% for %}", "", "").unwrap_err();
        assert!(err
            .to_string()
            .starts_with("chat template x.jinja does not compile"));
    }

    #[test]
    fn family_is_picked_by_architecture_then_vocabulary() {
        let v = |arch: &str| Vocabulary {
            architecture: arch.into(),
            ..Default::default()
        };
        assert_eq!(family_template(&v("gemma3")), "gemma");
        assert_eq!(family_template(&v("llama")), "chatml");
        assert_eq!(
            family_template(&Vocabulary {
                start_header_id: true,
                ..v("llama")
            }),
            "llama3"
        );
        assert_eq!(
            family_template(&Vocabulary {
                im_start: true,
                ..v("qwen2")
            }),
            "chatml"
        );
        assert_eq!(family_template(&v("phi3")), "phi3");
        assert_eq!(
            family_template(&Vocabulary {
                inst: true,
                ..v("llama")
            }),
            "mistral"
        );
    }

    #[test]
    fn template_kwargs_and_the_thinking_switch_reach_the_template() {
        let t = ChatTemplate::new(
            "t",
            "{{ enable_thinking }}|{{ effort | default('-') }}|{{ date_string }}",
            "",
            "",
        )
        .unwrap();
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("effort".into(), serde_json::json!("high"));
        kwargs.insert("date_string".into(), serde_json::json!("1 Jan 2000"));
        let extras = RenderExtras {
            tools: None,
            enable_thinking: Some(false),
            kwargs,
        };
        assert_eq!(
            t.render_with(&[], true, &extras).unwrap(),
            "False|high|1 Jan 2000"
        );
        let text = t.render(&[], true).unwrap();
        assert!(text.starts_with("None|-|"), "{text}");
    }

    #[test]
    fn an_undefined_variable_joined_to_text_is_a_clear_error() {
        // A template that joins a variable nobody defines to text: Python's Jinja refuses that
        // too (llama.cpp's renderer prints nothing).
        let t = ChatTemplate::new("t", "{{ 'a' + functions + 'b' }}", "", "").unwrap();
        let err = t.render(&[], true).unwrap_err().to_string();
        assert!(err.contains("`functions` is undefined"), "{err}");
    }

    #[test]
    fn firefunction_s_template_gets_its_functions() {
        // Firefunction v2's system prompt ends with `functions`: the tools as indented JSON,
        // as llama.cpp gave it before its renderer rewrite (the current one prints nothing).
        let t = ChatTemplate::new(
            "t",
            "{{ 'prefix with functools[...]\n' + functions + '|' + datetime }}",
            "",
            "",
        )
        .unwrap();
        let text = t.render(&[], true).unwrap();
        assert!(text.starts_with("prefix with functools[...]\n|"), "{text}");
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
        let extras = RenderExtras {
            tools: Some(tools.clone()),
            ..RenderExtras::default()
        };
        let text = t.render_with(&[], true, &extras).unwrap();
        let expected = format!("\n{}|", serde_json::to_string_pretty(&tools).unwrap());
        assert!(text.contains(&expected), "{text}");
        let empty = RenderExtras {
            tools: Some(serde_json::json!([])),
            ..RenderExtras::default()
        };
        assert!(t.render_with(&[], true, &empty).unwrap().contains("]\n|"));
    }
}
