//! Tool calling by template family: how a family's models write a call, how the tools are put
//! into the prompt when the chat template does not do it itself, the grammar that makes a call
//! well-formed, and the parser that reads calls back out of the generated text.
//!
//! A family is detected from the chat template's source, as the turn markers are. Adding one:
//! a `ToolFormat` variant, its line in `detect`, its call text in `call_text` / `instructions`,
//! its wrapper in `wrap_grammar` and trigger in `trigger`, and its case in `parse`.

use serde_json::{Map, Value};

use super::reasoning::partial_suffix;
use super::ChatMessage;

/// How a model family writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// Any model: the answer is a JSON object `{"name": ..., "arguments": {...}}` (one per
    /// line for several calls), as the system prompt instructs.
    Generic,
    /// Hermes / Qwen 2.5+: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Hermes,
    /// Llama 3.x: a JSON object `{"name": ..., "parameters": {...}}`.
    Llama3,
    /// Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
    Mistral,
}

/// Every family, for documentation and tests.
pub const FORMATS: &[ToolFormat] = &[
    ToolFormat::Generic,
    ToolFormat::Hermes,
    ToolFormat::Llama3,
    ToolFormat::Mistral,
];

/// One function a request offers.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    /// The function's name.
    pub name: String,
    /// What it does (may be empty).
    pub description: String,
    /// JSON schema of its arguments (an object schema).
    pub parameters: Value,
}

/// One call read from the output.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// The function called.
    pub name: String,
    /// Its arguments (a JSON object).
    pub arguments: Value,
}

/// What the model wrote, split into text and calls.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parsed {
    /// Text outside the calls (trimmed); empty when there is none.
    pub content: String,
    /// The calls, in order.
    pub calls: Vec<ToolCall>,
}

impl ToolFormat {
    /// The family of a chat template, from the markers its source writes.
    pub fn detect(template_source: &str) -> Self {
        if template_source.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if template_source.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if template_source.contains("<|start_header_id|>") {
            ToolFormat::Llama3
        } else {
            ToolFormat::Generic
        }
    }

    /// The family's name, as logs and docs say it.
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Generic => "generic",
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3 => "llama3",
            ToolFormat::Mistral => "mistral",
        }
    }

    /// The key the family writes the arguments under.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3 => "parameters",
            _ => "arguments",
        }
    }

    /// The text of calls as this family writes them (for earlier turns rendered by a template
    /// that does not know tool calls, and for the instructions' example).
    pub fn call_text(self, calls: &[ToolCall]) -> String {
        // Written by hand: `name` first, as the models write it (a JSON map sorts its keys).
        let object = |c: &ToolCall| {
            format!(
                "{{\"name\": {}, \"{}\": {}}}",
                Value::String(c.name.clone()),
                self.arguments_key(),
                c.arguments
            )
        };
        match self {
            ToolFormat::Generic | ToolFormat::Llama3 => {
                calls.iter().map(object).collect::<Vec<_>>().join("\n")
            }
            ToolFormat::Hermes => calls
                .iter()
                .map(|c| format!("<tool_call>\n{}\n</tool_call>", object(c)))
                .collect::<Vec<_>>()
                .join("\n"),
            ToolFormat::Mistral => format!(
                "[TOOL_CALLS][{}]",
                calls.iter().map(object).collect::<Vec<_>>().join(", ")
            ),
        }
    }

    /// The system prompt text that introduces the tools, for a template that does not render
    /// them itself.
    pub fn instructions(self, tools: &[Tool]) -> String {
        let list: Vec<String> = tools
            .iter()
            .map(|t| {
                format!(
                    "{{\"name\": {}, \"description\": {}, \"parameters\": {}}}",
                    Value::String(t.name.clone()),
                    Value::String(t.description.clone()),
                    t.parameters
                )
            })
            .collect();
        let example = self.call_text(&[ToolCall {
            name: "function_name".into(),
            arguments: serde_json::json!({"argument": "value"}),
        }]);
        format!(
            "You can call these functions:\n{}\n\nTo call a function, answer with only this, \
             and nothing else:\n{example}\nThe arguments must follow the function's parameters \
             schema. If no function fits, answer the user normally.",
            list.join("\n")
        )
    }

    /// Where the grammar of a call starts constraining in "auto" mode. The families that
    /// answer with a bare JSON object must start with it (leading whitespace aside), so JSON
    /// inside free text stays free.
    pub fn trigger(self) -> crate::constrain::Trigger {
        use crate::constrain::Trigger;
        match self {
            ToolFormat::Generic | ToolFormat::Llama3 => Trigger::Leading {
                opener: '{',
                key: "\"name\"".into(),
            },
            ToolFormat::Hermes => Trigger::Literal("<tool_call>".into()),
            ToolFormat::Mistral => Trigger::Literal("[TOOL_CALLS]".into()),
        }
    }

    /// Where calls start in the text, if they do: the trigger's position.
    pub fn call_start(self, text: &str) -> Option<usize> {
        match self {
            ToolFormat::Generic | ToolFormat::Llama3 => leading_call(text, &['{']),
            ToolFormat::Hermes => text.find("<tool_call>"),
            // `[TOOL_CALLS]` is a control token in Mistral's vocabularies, which the output
            // text leaves out: a list of calls at the start counts too.
            ToolFormat::Mistral => text
                .find("[TOOL_CALLS]")
                .or_else(|| leading_call(text, &['[', '{'])),
        }
    }

    /// The longest suffix of `text` that could be the start of the trigger (held back while
    /// streaming, until it is known whether a call starts there). Zero when none.
    pub fn partial_trigger(self, text: &str) -> usize {
        match self {
            ToolFormat::Generic | ToolFormat::Llama3 => leading_partial(text, &['{']),
            ToolFormat::Hermes => partial_suffix(text, "<tool_call>"),
            ToolFormat::Mistral => {
                partial_suffix(text, "[TOOL_CALLS]").max(leading_partial(text, &['[', '{']))
            }
        }
    }

    /// Splits generated text into content and calls. Only calls of known tools whose
    /// arguments are JSON objects count; anything else stays text.
    pub fn parse(self, text: &str, known: &[&str]) -> Parsed {
        let Some(start) = self.call_start(text) else {
            return Parsed {
                content: text.trim().to_string(),
                calls: Vec::new(),
            };
        };
        let body = &text[start..];
        let objects = match self {
            ToolFormat::Generic | ToolFormat::Llama3 => json_values(body),
            ToolFormat::Hermes => body
                .split("<tool_call>")
                .skip(1)
                .flat_map(|part| json_values(part.split("</tool_call>").next().unwrap_or("")))
                .collect(),
            ToolFormat::Mistral => json_values(body.strip_prefix("[TOOL_CALLS]").unwrap_or(body))
                .into_iter()
                .flat_map(|v| match v {
                    Value::Array(items) => items,
                    other => vec![other],
                })
                .collect(),
        };
        let calls: Vec<ToolCall> = objects
            .into_iter()
            .filter_map(|v| self.call_of(v, known))
            .collect();
        if calls.is_empty() {
            return Parsed {
                content: text.trim().to_string(),
                calls,
            };
        }
        Parsed {
            content: text[..start].trim().to_string(),
            calls,
        }
    }

    fn call_of(self, v: Value, known: &[&str]) -> Option<ToolCall> {
        let Value::Object(mut m) = v else {
            return None;
        };
        let name = m.remove("name")?.as_str()?.to_string();
        if !known.contains(&name.as_str()) {
            return None;
        }
        let arguments = m
            .remove(self.arguments_key())
            .or_else(|| m.remove("arguments"))
            .or_else(|| m.remove("parameters"))
            .unwrap_or_else(|| Value::Object(Map::new()));
        // Some models write the arguments as a JSON string.
        let arguments = match arguments {
            Value::String(s) => serde_json::from_str(&s).ok()?,
            other => other,
        };
        arguments
            .is_object()
            .then_some(ToolCall { name, arguments })
    }

    /// The grammar (llguidance's Lark syntax) of a whole answer made of calls, around the rule
    /// `call` (one call object): with `parallel`, several calls. `control` gives the id of a
    /// control token with that text, when the vocabulary has one (Mistral's `[TOOL_CALLS]`):
    /// the grammar then takes the token as well as the text.
    pub fn wrap_grammar(self, parallel: bool, control: impl Fn(&str) -> Option<u32>) -> String {
        let lit = |text: &str| crate::constrain::lark_literal(text, control(text));
        let more = |sep: &str, item: &str| {
            if parallel {
                format!(" ({sep} {item}){{0,{MAX_PARALLEL_CALLS}}}")
            } else {
                String::new()
            }
        };
        match self {
            ToolFormat::Generic | ToolFormat::Llama3 => {
                format!("start: call{}\n", more("\"\\n\"", "call"))
            }
            ToolFormat::Hermes => format!(
                "start: hermes_call{}\nhermes_call: {} \"\\n\" call {}\n",
                more("\"\\n\"", "hermes_call"),
                lit("<tool_call>"),
                lit("</tool_call>")
            ),
            ToolFormat::Mistral => format!(
                "start: {} \"[\" call{} \"]\"\n",
                lit("[TOOL_CALLS]"),
                more("\", \"", "call")
            ),
        }
    }
}

/// Most calls after the first in one answer with `parallel_tool_calls`.
pub const MAX_PARALLEL_CALLS: usize = 15;

/// The JSON schema of one call object of this family: `name` one of the tools' names, the
/// arguments the chosen tool's parameters, `name` first (JSON objects keep their order, and
/// so does the compiled grammar). A tool's parameters that refer to parts of themselves
/// (`{"$ref": "#/$defs/Address"}`, as Pydantic writes nested models) are kept whole under the
/// call schema's `$defs`, with their local references rebased there, since `#` is now the
/// call schema.
pub fn call_schema(format: ToolFormat, tools: &[&Tool]) -> Value {
    let key = format.arguments_key();
    let mut defs = Map::new();
    let mut alternatives: Vec<Value> = tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut parameters = t.parameters.clone();
            let name = format!("llamarunner_tool_{i}");
            if rebase_local_refs(&mut parameters, &format!("#/$defs/{name}")) {
                defs.insert(name.clone(), parameters);
                parameters = serde_json::json!({ "$ref": format!("#/$defs/{name}") });
            }
            let mut properties = Map::new();
            properties.insert("name".into(), serde_json::json!({"const": t.name}));
            properties.insert(key.into(), parameters);
            serde_json::json!({
                "type": "object",
                "properties": properties,
                "required": ["name", key],
                "additionalProperties": false,
            })
        })
        .collect();
    let mut schema = if alternatives.len() == 1 {
        alternatives.remove(0)
    } else {
        serde_json::json!({ "anyOf": alternatives })
    };
    if !defs.is_empty() {
        schema["$defs"] = Value::Object(defs);
    }
    schema
}

/// Keywords whose values are data, not schemas: a `$ref` inside them is not a reference.
const DATA_KEYWORDS: [&str; 4] = ["const", "enum", "default", "examples"];

/// Rewrites every local reference `#PATH` in `schema` to `{base}PATH` (the schema moves to
/// `base` in a larger document); whether there was one.
fn rebase_local_refs(schema: &mut Value, base: &str) -> bool {
    match schema {
        Value::Object(map) => {
            let mut found = false;
            for (k, v) in map.iter_mut() {
                found |= match (k.as_str(), v) {
                    ("$ref", Value::String(r)) if r.starts_with('#') => {
                        *r = format!("{base}{}", &r[1..]);
                        true
                    }
                    (k, _) if DATA_KEYWORDS.contains(&k) => false,
                    (_, v) => rebase_local_refs(v, base),
                };
            }
            found
        }
        Value::Array(items) => items
            .iter_mut()
            .fold(false, |found, v| rebase_local_refs(v, base) | found),
        _ => false,
    }
}

/// Where a call written as bare JSON starts: `text` begins (whitespace aside, and between
/// them) with the `openers` and then `"name"`.
fn leading_call(text: &str, openers: &[char]) -> Option<usize> {
    let trimmed = text.trim_start();
    let mut rest = trimmed;
    for &c in openers {
        rest = rest.strip_prefix(c)?.trim_start();
    }
    rest.starts_with("\"name\"")
        .then_some(text.len() - trimmed.len())
}

/// All of `text` when it may still become the start of a bare-JSON call (`leading_call`),
/// else zero.
fn leading_partial(text: &str, openers: &[char]) -> usize {
    let mut rest = text.trim_start();
    for &c in openers {
        if rest.is_empty() {
            return text.len();
        }
        match rest.strip_prefix(c) {
            Some(r) => rest = r.trim_start(),
            None => return 0,
        }
    }
    if "\"name\"".starts_with(rest) {
        text.len()
    } else {
        0
    }
}

/// The JSON values at the start of `text`, one after another (whitespace, `;` or `,`
/// between them); stops at the first thing that is not JSON.
fn json_values(text: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ';' || c == ',');
        if rest.is_empty() {
            break;
        }
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        match stream.next() {
            Some(Ok(v)) => {
                out.push(v);
                rest = &rest[stream.byte_offset()..];
            }
            _ => break,
        }
    }
    out
}

/// Whether a template renders the request's tools itself (it reads a `tools` variable).
pub fn template_renders_tools(template_source: &str) -> bool {
    template_source.contains("tools")
}

/// Prepares a conversation for a template. `tools` (when the template does not render them)
/// go into the system prompt as instructions. Earlier calls and tool results: a template that
/// renders tools gets assistant `tool_calls` with object arguments (as Hugging Face templates
/// read them); one that does not gets the calls as the family's text and the results as user
/// turns.
pub fn prepare_messages(
    format: ToolFormat,
    template_renders_tools: bool,
    tools: Option<&[Tool]>,
    messages: Vec<ChatMessage>,
) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    // Call ids to function names, for naming tool results.
    let mut names: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    for mut m in messages {
        let calls = m.extra.remove("tool_calls");
        if let Some(Value::Array(calls)) = calls {
            let mut parsed = Vec::new();
            let mut normalized = Vec::new();
            for mut call in calls {
                let id = call.get("id").and_then(Value::as_str).map(str::to_string);
                let mut none = Value::Null;
                let function = match call.get_mut("function") {
                    Some(f) if f.is_object() => f,
                    _ => &mut none,
                };
                if let Some(Value::String(s)) = function.get("arguments") {
                    if let Ok(v) = serde_json::from_str::<Value>(s) {
                        function["arguments"] = v;
                    }
                }
                let name = function
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                if let Some(id) = id {
                    names.entry(id).or_insert_with(|| name.clone());
                }
                let arguments = function.get("arguments").cloned().unwrap_or(Value::Null);
                parsed.push(ToolCall { name, arguments });
                normalized.push(call);
            }
            if template_renders_tools {
                m.extra
                    .insert("tool_calls".into(), Value::Array(normalized));
            } else {
                let text = format.call_text(&parsed);
                m.content = if m.content.is_empty() {
                    text
                } else {
                    format!("{}\n{text}", m.content)
                };
            }
        } else if let Some(other) = calls {
            m.extra.insert("tool_calls".into(), other);
        }
        if m.role == "tool" && !template_renders_tools {
            let name = m
                .extra
                .get("tool_call_id")
                .and_then(Value::as_str)
                .and_then(|id| names.get(id).cloned())
                .or_else(|| {
                    m.extra
                        .get("tool_name")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                })
                .or_else(|| {
                    m.extra
                        .get("name")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                });
            m.role = "user".into();
            m.content = match name {
                Some(n) => format!("Result of {n}: {}", m.content),
                None => format!("Tool result: {}", m.content),
            };
        }
        out.push(m);
    }
    if let Some(tools) = tools.filter(|t| !t.is_empty() && !template_renders_tools) {
        let text = format.instructions(tools);
        match out.first_mut().filter(|m| m.role == "system") {
            Some(system) => system.content = format!("{}\n\n{text}", system.content),
            None => out.insert(
                0,
                ChatMessage {
                    role: "system".into(),
                    content: text,
                    extra: Map::new(),
                    ..ChatMessage::default()
                },
            ),
        }
    }
    out
}

/// The tools as chat templates read them: OpenAI's shape,
/// `[{"type": "function", "function": {"name", "description", "parameters"}}]`.
pub fn template_tools(tools: &[Tool]) -> Value {
    Value::Array(
        tools
            .iter()
            .map(|t| {
                serde_json::json!({"type": "function", "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                }})
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const KNOWN: &[&str] = &["get_weather", "add"];

    fn call(name: &str, args: Value) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: args,
        }
    }

    #[test]
    fn families_are_detected_from_the_template() {
        assert_eq!(
            ToolFormat::detect("{% if tools %}<tool_call>{% endif %}"),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::detect("[TOOL_CALLS] [INST]"),
            ToolFormat::Mistral
        );
        assert_eq!(
            ToolFormat::detect("<|start_header_id|>x<|end_header_id|>"),
            ToolFormat::Llama3
        );
        assert_eq!(ToolFormat::detect("<start_of_turn>"), ToolFormat::Generic);
        assert_eq!(
            ToolFormat::detect(super::super::builtin("gemma").unwrap()),
            ToolFormat::Generic
        );
    }

    #[test]
    fn each_family_parses_what_it_writes() {
        let calls = vec![
            call("get_weather", json!({"city": "Paris", "unit": "celsius"})),
            call("add", json!({"a": 1, "b": 2})),
        ];
        for &f in FORMATS {
            let text = f.call_text(&calls);
            assert_eq!(f.parse(&text, KNOWN).calls, calls, "{f:?}: {text}");
            assert_eq!(f.parse(&text, KNOWN).content, "", "{f:?}");
            let one = f.call_text(&calls[..1]);
            assert_eq!(f.parse(&one, KNOWN).calls, calls[..1], "{f:?}");
        }
    }

    #[test]
    fn free_text_and_unknown_tools_stay_text() {
        for &f in FORMATS {
            let p = f.parse("  Hello there. ", KNOWN);
            assert_eq!(
                p,
                Parsed {
                    content: "Hello there.".into(),
                    calls: vec![]
                }
            );
            let unknown = f.call_text(&[call("rm_rf", json!({}))]);
            let p = f.parse(&unknown, KNOWN);
            assert!(p.calls.is_empty(), "{f:?}");
            assert_eq!(p.content, unknown.trim(), "{f:?}");
            // Cut-off JSON is text too.
            let cut = f.call_text(&[call("add", json!({"a": 1}))]);
            let cut = &cut[..cut.len() - 15];
            assert!(f.parse(cut, KNOWN).calls.is_empty(), "{f:?}: {cut}");
        }
    }

    #[test]
    fn text_before_a_call_is_content() {
        let p = ToolFormat::Hermes.parse(
            "Let me look.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>",
            KNOWN,
        );
        assert_eq!(p.content, "Let me look.");
        assert_eq!(p.calls, vec![call("add", json!({"a": 1}))]);
        // A bare-JSON family only calls at the start.
        let p = ToolFormat::Generic.parse("See {\"name\": \"add\", \"arguments\": {}}", KNOWN);
        assert!(p.calls.is_empty());
        // Arguments written as a JSON string, and Llama's `parameters`.
        let p = ToolFormat::Llama3.parse(
            "{\"name\": \"add\", \"parameters\": \"{\\\"a\\\": 2}\"}",
            KNOWN,
        );
        assert_eq!(p.calls, vec![call("add", json!({"a": 2}))]);
        // An unclosed Hermes call whose JSON is complete still counts.
        let p =
            ToolFormat::Hermes.parse("<tool_call>\n{\"name\": \"add\", \"arguments\": {}}", KNOWN);
        assert_eq!(p.calls, vec![call("add", json!({}))]);
    }

    #[test]
    fn mistral_calls_without_their_control_token_parse() {
        // The output text leaves control tokens out: `[TOOL_CALLS]` may be missing.
        let p =
            ToolFormat::Mistral.parse(" [{\"name\": \"add\", \"arguments\": {\"a\": 1}}]", KNOWN);
        assert_eq!(p.calls, vec![call("add", json!({"a": 1}))]);
        assert!(ToolFormat::Mistral.parse("[1, 2]", KNOWN).calls.is_empty());
    }

    #[test]
    fn partial_triggers_are_held_back() {
        assert_eq!(ToolFormat::Hermes.partial_trigger("abc <tool"), 5);
        assert_eq!(ToolFormat::Hermes.partial_trigger("abc <"), 1);
        assert_eq!(ToolFormat::Hermes.partial_trigger("abc"), 0);
        assert_eq!(ToolFormat::Mistral.partial_trigger("[TOOL_"), 6);
        assert_eq!(ToolFormat::Mistral.partial_trigger(" [ {\"na"), 7);
        assert_eq!(ToolFormat::Mistral.partial_trigger("[1, 2]"), 0);
        assert_eq!(ToolFormat::Generic.partial_trigger("  {\"na"), 6);
        assert_eq!(ToolFormat::Generic.partial_trigger("  "), 2);
        assert_eq!(ToolFormat::Generic.partial_trigger("Hi {"), 0);
        assert_eq!(ToolFormat::Llama3.partial_trigger("{\"x"), 0);
        // Never inside a multi-byte character.
        assert_eq!(ToolFormat::Hermes.partial_trigger("é"), 0);
    }

    #[test]
    fn grammars_wrap_the_call_rule() {
        for &f in FORMATS {
            for parallel in [false, true] {
                let g = f.wrap_grammar(parallel, |_| None);
                assert!(g.starts_with("start: "), "{g}");
                assert_eq!(g.contains("{0,15}"), parallel, "{g}");
            }
        }
        assert_eq!(
            ToolFormat::Hermes.wrap_grammar(false, |_| None),
            "start: hermes_call\nhermes_call: \"<tool_call>\" \"\\n\" call \"</tool_call>\"\n"
        );
        let with_token =
            ToolFormat::Mistral.wrap_grammar(false, |t| (t == "[TOOL_CALLS]").then_some(5));
        assert!(
            with_token.starts_with("start: (\"[TOOL_CALLS]\" | <[5]>) \"[\" call"),
            "{with_token}"
        );
    }

    #[test]
    fn tools_that_refer_to_their_own_parts_are_rebased_under_defs() {
        let address = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let nested = Tool {
            name: "ship".into(),
            description: String::new(),
            parameters: json!({
                "type": "object",
                "$defs": {"Address": address},
                "properties": {
                    "to": {"$ref": "#/$defs/Address"},
                    "tree": {"$ref": "#"},
                    "note": {"const": {"$ref": "#/not/a/reference"}},
                },
            }),
        };
        let plain = Tool {
            name: "plain".into(),
            description: String::new(),
            parameters: json!({"type": "object", "properties": {"x": {"type": "integer"}}}),
        };
        let s = call_schema(ToolFormat::Generic, &[&plain, &nested]);
        // The plain tool is inline; the other is under $defs, referred to.
        assert_eq!(s["anyOf"][0]["properties"]["arguments"], plain.parameters);
        assert_eq!(
            s["anyOf"][1]["properties"]["arguments"],
            json!({"$ref": "#/$defs/llamarunner_tool_1"})
        );
        let moved = &s["$defs"]["llamarunner_tool_1"];
        assert_eq!(
            moved["properties"]["to"]["$ref"],
            "#/$defs/llamarunner_tool_1/$defs/Address"
        );
        assert_eq!(
            moved["properties"]["tree"]["$ref"],
            "#/$defs/llamarunner_tool_1"
        );
        assert_eq!(
            moved["properties"]["note"]["const"]["$ref"],
            "#/not/a/reference"
        );
    }

    #[test]
    fn call_schemas_name_the_tool_first() {
        let t = Tool {
            name: "add".into(),
            description: String::new(),
            parameters: json!({"type": "object"}),
        };
        let s = call_schema(ToolFormat::Llama3, &[&t]).to_string();
        assert_eq!(
            s,
            r#"{"type":"object","properties":{"name":{"const":"add"},"parameters":{"type":"object"}},"required":["name","parameters"],"additionalProperties":false}"#
        );
        let two = call_schema(ToolFormat::Generic, &[&t, &t]).to_string();
        assert!(two.starts_with(r#"{"anyOf":[{"#));
        assert!(serde_json::from_str::<Value>(&two).is_ok());
    }

    fn msg(role: &str, content: &str, extra: Value) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            extra: extra.as_object().cloned().unwrap_or_default(),
            ..ChatMessage::default()
        }
    }

    #[test]
    fn history_is_rewritten_for_templates_without_tools() {
        let tools = [Tool {
            name: "get_weather".into(),
            description: "Weather now".into(),
            parameters: json!({"type": "object"}),
        }];
        let messages = vec![
            msg("user", "Weather in Paris?", json!({})),
            msg(
                "assistant",
                "",
                json!({"tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}),
            ),
            msg("tool", "{\"temp\": 21}", json!({"tool_call_id": "call_1"})),
        ];
        let out = prepare_messages(ToolFormat::Generic, false, Some(&tools), messages.clone());
        assert_eq!(out[0].role, "system");
        assert!(out[0]
            .content
            .contains("{\"name\": \"get_weather\", \"description\": \"Weather now\""));
        assert!(out[0].content.contains("Weather now"));
        assert_eq!(
            out[2].content,
            "{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}"
        );
        assert!(!out[2].extra.contains_key("tool_calls"));
        assert_eq!(out[3].role, "user");
        assert_eq!(out[3].content, "Result of get_weather: {\"temp\": 21}");
        // A template that renders tools gets them untouched, arguments as an object.
        let out = prepare_messages(ToolFormat::Hermes, true, Some(&tools), messages);
        assert_eq!(out.len(), 3);
        assert_eq!(
            out[1].extra["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
        assert_eq!(out[2].role, "tool");
    }
}
