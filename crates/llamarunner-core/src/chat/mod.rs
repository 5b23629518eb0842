//! Chat templates: turning a conversation into the prompt text a model was trained on.
//!
//! A GGUF usually carries its Hugging Face Jinja template in `tokenizer.chat_template`; it is
//! rendered with minijinja (with Python string methods, `raise_exception` and `strftime_now`, as
//! Hugging Face's `apply_chat_template` offers). Many GGUFs carry none (the default model is a
//! base model without one), so a small set of known family templates is built in and picked by
//! architecture and vocabulary; `--chat-template NAME|FILE` overrides both.

pub mod reasoning;
pub mod tools;
pub mod utf8;

use minijinja::value::Serde;
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

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
];

/// The built-in templates, by the name `--chat-template` accepts.
pub const BUILTIN: &[(&str, &str)] = &[
    ("gemma", GEMMA),
    ("chatml", CHATML),
    ("llama3", LLAMA3),
    ("phi3", PHI3),
    ("mistral", MISTRAL),
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

/// One chat message as the templates see it. `content` is always text (the parts of an OpenAI
/// content array are joined); other fields (`name`, `tool_calls`, ...) pass through.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// "system", "user", "assistant", "tool", ...
    pub role: String,
    /// The text.
    pub content: String,
    /// Anything else the client sent with the message.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
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
    /// Qwen3-style thinking switch (Ollama's `think`).
    pub enable_thinking: Option<bool>,
}

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
        env.add_function("strftime_now", strftime_now);
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

    /// `render`, with the request's tools and thinking switch for templates that read them
    /// (`tools`, `enable_thinking`; left undefined when absent).
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extras: &RenderExtras,
    ) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Render(e.to_string()))?;
        let base = minijinja::context! {
            messages => Value::from(Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone(),
            eos_token => self.eos_token.clone(),
        };
        let tools = extras.tools.as_ref().map(|t| Value::from(Serde(t)));
        let ctx = minijinja::context! {
            tools => tools,
            enable_thinking => extras.enable_thinking,
            ..base
        };
        let text = template.render(ctx).map_err(|e| {
            let mut reason = e.to_string();
            if e.kind() == ErrorKind::InvalidOperation {
                if let Some(detail) = e.detail() {
                    reason = detail.to_string();
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

/// English month names, as `%B` prints them (`%b`: their first three letters).
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// `strftime_now(format)`, as Hugging Face's renderer offers (Llama 3.1+ templates print the
/// date). Supports the directives those templates use.
fn strftime_now(format: String) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime_at(&format, now)
}

/// `format` printed for the moment `unix_secs` (UTC): what `strftime_now` prints, for a clock
/// given explicitly.
fn strftime_at(format: &str, unix_secs: u64) -> String {
    let (year, month, day) = civil_from_days((unix_secs / 86_400) as i64);
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month, day) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
pub(crate) fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
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

    /// (year, month, day) of day `days` since 1970-01-01, counted one day at a time from the
    /// epoch: an independent check of `civil_from_days`.
    fn walk_calendar(from: i64, to: i64) -> Vec<(i64, u32, u32)> {
        let leap = |y: i64| (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
        let month_len = |y: i64, m: u32| match m {
            2 if leap(y) => 29,
            2 => 28,
            4 | 6 | 9 | 11 => 30,
            _ => 31,
        };
        assert!(from <= 0 && to >= 0);
        let mut forward = vec![(1970, 1, 1)];
        let (mut y, mut m, mut d) = (1970_i64, 1_u32, 1_u32);
        for _ in 0..to {
            d += 1;
            if d > month_len(y, m) {
                d = 1;
                m += 1;
                if m > 12 {
                    m = 1;
                    y += 1;
                }
            }
            forward.push((y, m, d));
        }
        let mut backward = Vec::new();
        let (mut y, mut m, mut d) = (1970_i64, 1_u32, 1_u32);
        for _ in from..0 {
            if d == 1 {
                if m == 1 {
                    m = 12;
                    y -= 1;
                } else {
                    m -= 1;
                }
                d = month_len(y, m);
            } else {
                d -= 1;
            }
            backward.push((y, m, d));
        }
        backward.reverse();
        backward.extend(forward);
        backward
    }

    #[test]
    fn civil_from_days_matches_the_calendar() {
        // Fixed dates, leap days and century rules included.
        for (days, date) in [
            (0, (1970, 1, 1)),
            (-1, (1969, 12, 31)),
            (59, (1970, 3, 1)),
            (11_016, (2000, 2, 29)),
            (11_017, (2000, 3, 1)),
            (20_088, (2024, 12, 31)),
            (47_541, (2100, 3, 1)),
            (-25_508, (1900, 3, 1)),
            (-135_081, (1600, 2, 29)),
        ] {
            assert_eq!(civil_from_days(days), date, "day {days}");
        }
        // Every day from 1696 to 2243.
        let (from, to) = (-100_000, 100_000);
        for (i, date) in walk_calendar(from, to).into_iter().enumerate() {
            let days = from + i as i64;
            assert_eq!(civil_from_days(days), date, "day {days}");
        }
    }

    /// What `strftime_now(format)` must give on day `days` since the epoch.
    fn expected_strftime(days: i64) -> String {
        let (y, m, d) = walk_calendar(0, days)[days as usize];
        let name = MONTHS[m as usize - 1];
        format!(
            "{d:02}|{m:02}|{y}|{:02}|{name}|{}|%|%Q|%",
            y % 100,
            &name[..3]
        )
    }

    fn today() -> i64 {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        (secs / 86_400) as i64
    }

    #[test]
    fn strftime_at_a_fixed_clock() {
        // 2024-07-26 13:05:09 UTC, the date Llama 3.1's template example prints.
        let t = 1_722_000_309;
        assert_eq!(
            strftime_at("%d|%m|%Y|%y|%B|%b|%%|%Q|%", t),
            "26|07|2024|24|July|Jul|%|%Q|%"
        );
        assert_eq!(
            strftime_at("Today Date: %d %b %Y", 0),
            "Today Date: 01 Jan 1970"
        );
        // A leap day, and the last second before a new year.
        assert_eq!(strftime_at("%d %B %Y", 1_709_164_800), "29 February 2024");
        assert_eq!(strftime_at("%d %m %Y", 1_735_689_599), "31 12 2024");
        for days in [0i64, 59, 365, 11_016, 19_930, 20_000] {
            let secs = u64::try_from(days).unwrap() * 86_400 + 86_399;
            let format = "%d|%m|%Y|%y|%B|%b|%%|%Q|%";
            assert_eq!(
                strftime_at(format, secs),
                expected_strftime(days),
                "day {days}"
            );
        }
    }

    #[test]
    fn strftime_now_prints_the_current_date_in_every_directive() {
        // The clock is read inside strftime_now: bracket the call (a day may turn meanwhile)
        // and compare with a calendar walked from the epoch.
        let format = "%d|%m|%Y|%y|%B|%b|%%|%Q|%";
        let before = today();
        let got = strftime_now(format.into());
        let after = today();
        let candidates: Vec<String> = (before..=after).map(expected_strftime).collect();
        assert!(
            candidates.contains(&got),
            "{got:?} is none of {candidates:?}"
        );
        // Through a template, as Llama 3.1's prints "Today Date: 26 Jul 2024".
        let t = ChatTemplate::new("t", "{{ strftime_now('%d %b %Y') }}", "", "").unwrap();
        let before = today();
        let text = t.render(&[], true).unwrap();
        let after = today();
        let candidates: Vec<String> = (before..=after)
            .map(|day| {
                let e = expected_strftime(day);
                let parts: Vec<&str> = e.split('|').collect();
                format!("{} {} {}", parts[0], parts[5], parts[2])
            })
            .collect();
        assert!(
            candidates.contains(&text),
            "{text:?} is none of {candidates:?}"
        );
    }
}
