//! Tool calls and reasoning on the server side, for both chat dialects: the request's `tools`
//! and `tool_choice` checked and compiled into a grammar before the queue (every schema is
//! converted here, so a bad one is a 400 naming it), the conversation prepared for the
//! template, and the generated text split back into reasoning, content and calls, whole or as
//! it streams.

use serde_json::Value;

use crate::chat::reasoning::{Piece, ThinkSplitter};
use crate::chat::tools::{self, Parsed, Tool, ToolCall, ToolFormat};
use crate::chat::{ChatMessage, RenderExtras};
use crate::constrain::{Compiler, Grammar, GrammarSource};
use crate::http::error::{quoted, ApiError};
use crate::http::state::AppState;
use crate::protocol::params::SamplingParams;
use crate::protocol::ModelInfo;
use crate::requests::format::check_schema_bounds;
use crate::requests::thinking::{reasoning_enabled, TemplateArgs};
use crate::requests::validate;

/// Most tools one request may offer.
pub const MAX_TOOLS: usize = 128;
/// Longest function name (OpenAI's limit).
pub const MAX_TOOL_NAME: usize = 64;

/// What the model may do with the tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// Answer or call, as it likes (a lazy grammar constrains a call once one starts).
    Auto,
    /// Never call: the tools are not shown.
    None,
    /// Must call one of the tools (the whole answer is constrained to calls).
    Required,
    /// Must call this function.
    Named(String),
}

/// A request's tools, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolRequest {
    /// The functions offered.
    pub tools: Vec<Tool>,
    /// What the model may do.
    pub choice: ToolChoice,
    /// Several calls in one answer.
    pub parallel: bool,
}

impl ToolRequest {
    /// Reads `tools` (OpenAI's and Ollama's shape: `{"type": "function", "function": {"name",
    /// "description", "parameters"}}`), `tool_choice` and `parallel_tool_calls`. None when the
    /// request offers no tools and asks for none.
    pub fn parse(
        tools: Option<&[Value]>,
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Self>, ApiError> {
        let tools = tools.unwrap_or_default();
        if tools.len() > MAX_TOOLS {
            return Err(ApiError::field(
                "tools",
                format!(
                    ": at most {MAX_TOOLS} tools per request, got {}",
                    tools.len()
                ),
            ));
        }
        let tools: Vec<Tool> = tools
            .iter()
            .enumerate()
            .map(|(i, t)| parse_tool(i, t))
            .collect::<Result<_, _>>()?;
        for (i, t) in tools.iter().enumerate() {
            if tools[..i].iter().any(|u| u.name == t.name) {
                return Err(ApiError::invalid(format!(
                    "tools[{i}].function.name: {:?} is offered twice",
                    t.name
                )));
            }
        }
        let choice = parse_choice(choice, &tools)?;
        if tools.is_empty() {
            return match choice {
                ToolChoice::Auto | ToolChoice::None => Ok(None),
                _ => Err(ApiError::field(
                    "tool_choice",
                    ": \"required\" or a named function needs tools",
                )),
            };
        }
        Ok(Some(Self {
            tools,
            choice,
            parallel: parallel.unwrap_or(true),
        }))
    }
}

fn parse_tool(i: usize, t: &Value) -> Result<Tool, ApiError> {
    let at = |field: &str, what: &str| ApiError::invalid(format!("tools[{i}]{field} {what}"));
    let Value::Object(t) = t else {
        return Err(at("", "must be an object"));
    };
    match t.get("type") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "function" => {}
        Some(other) => {
            return Err(at(
                ".type",
                &format!(
                    "must be \"function\" (the only tool type supported), got {}",
                    quoted(other)
                ),
            ))
        }
    }
    let Some(Value::Object(f)) = t.get("function") else {
        return Err(at(".function", "is required and must be an object"));
    };
    let name = match f.get("name") {
        Some(Value::String(n)) => n.clone(),
        _ => return Err(at(".function.name", "is required and must be a string")),
    };
    if name.is_empty()
        || name.len() > MAX_TOOL_NAME
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
    {
        return Err(at(
            ".function.name",
            &format!("must be 1 to {MAX_TOOL_NAME} letters, digits, '_', '-' or '.', got {name:?}"),
        ));
    }
    let description = match f.get("description") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(d)) => d.clone(),
        Some(_) => return Err(at(".function.description", "must be a string")),
    };
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => serde_json::json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(m)) => {
            match m.get("type") {
                None => {}
                Some(Value::String(s)) if s == "object" => {}
                Some(other) => {
                    return Err(at(
                        ".function.parameters.type",
                        &format!(
                            "must be \"object\" (arguments are an object), got {}",
                            quoted(other)
                        ),
                    ))
                }
            }
            check_schema_bounds(p)
                .map_err(|e| at(".function.parameters:", &e.replace(" in format", "")))?;
            p.clone()
        }
        Some(_) => return Err(at(".function.parameters", "must be a JSON schema object")),
    };
    Ok(Tool {
        name,
        description,
        parameters,
    })
}

fn parse_choice(choice: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let named = |name: &str| {
        if tools.iter().any(|t| t.name == name) {
            Ok(ToolChoice::Named(name.to_string()))
        } else {
            Err(ApiError::field(
                "tool_choice",
                format!(" names the function {name:?}, which is not among the request's tools"),
            ))
        }
    };
    match choice {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" | "any" => Ok(ToolChoice::Required),
            other => Err(ApiError::field(
                "tool_choice",
                format!(
                    " must be \"auto\", \"none\", \"required\" or \
                 {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {other:?}"
                ),
            )),
        },
        Some(Value::Object(m)) => {
            match m.get("type") {
                None => {}
                Some(Value::String(s)) if s == "function" => {}
                Some(other) => {
                    return Err(ApiError::field(
                        "tool_choice.type",
                        format!(" must be \"function\", got {}", quoted(other)),
                    ))
                }
            }
            match m.get("function").and_then(|f| f.get("name")) {
                Some(Value::String(name)) => named(name),
                _ => Err(ApiError::field(
                    "tool_choice.function.name",
                    " is required and must be a string",
                )),
            }
        }
        Some(other) => Err(ApiError::field(
            "tool_choice",
            format!(" must be a string or an object, got {}", quoted(other)),
        )),
    }
}

/// What the output of a chat request is read for.
#[derive(Clone, Debug)]
pub struct OutputPlan {
    /// Calls in the model family's format (None: no tools, or `tool_choice: "none"`).
    pub tools: Option<ToolParse>,
    /// Split `<think>` blocks out of the answer.
    pub reasoning: bool,
}

/// How to find calls in the output.
#[derive(Clone, Debug)]
pub struct ToolParse {
    /// The family's format.
    pub format: ToolFormat,
    /// The functions that may be called.
    pub names: Vec<String>,
    /// The whole answer is calls (`required` or a named function).
    pub forced: bool,
}

/// A chat request prepared: the messages for the template, its extra variables, and how to
/// read the output. The grammar (if any) is set in `params`.
#[derive(Debug)]
pub struct Prepared {
    /// The conversation, rewritten for the template.
    pub messages: Vec<ChatMessage>,
    /// `tools` / `enable_thinking` for the template.
    pub extras: RenderExtras,
    /// How to read the output.
    pub output: OutputPlan,
}

/// Prepares a chat request's tools: the family's format from the template, the messages,
/// and the grammar (compiled from the tools' schemas on the blocking pool; a schema that does
/// not convert is a 400 naming its tool). `reasoning`: split thinking from the answer.
pub async fn prepare(
    info: &ModelInfo,
    request: Option<ToolRequest>,
    messages: Vec<ChatMessage>,
    params: &mut SamplingParams,
    reasoning: bool,
) -> Result<Prepared, ApiError> {
    let source = info.template.source.as_str();
    let format = ToolFormat::detect(source);
    let renders_tools = tools::template_renders_tools(source);
    let request = request.filter(|r| r.choice != ToolChoice::None);
    let Some(request) = request else {
        // No tools (or "none"): earlier calls and results still render.
        let messages = tools::prepare_messages(format, renders_tools, None, messages);
        return Ok(Prepared {
            messages,
            extras: RenderExtras::default(),
            output: OutputPlan {
                tools: None,
                reasoning,
            },
        });
    };
    if params.grammar.is_some() {
        return Err(ApiError::field(
            "tools",
            " cannot be combined with a grammar, format or response_format: the tool \
             calls have their own",
        ));
    }
    let selected: Vec<Tool> = match &request.choice {
        ToolChoice::Named(name) => request
            .tools
            .iter()
            .filter(|t| &t.name == name)
            .cloned()
            .collect(),
        _ => request.tools.clone(),
    };
    let forced = request.choice != ToolChoice::Auto;
    let parallel = request.parallel;
    let compiler = info.constraints.clone();
    let mut grammar =
        validate::blocking(move || call_grammar(&compiler, format, &selected, parallel)).await??;
    if !forced {
        grammar.triggers = vec![format.trigger()];
    }
    params.grammar = Some(grammar);
    let extras = RenderExtras {
        tools: renders_tools.then(|| tools::template_tools(&request.tools)),
        ..RenderExtras::default()
    };
    let messages = tools::prepare_messages(format, renders_tools, Some(&request.tools), messages);
    Ok(Prepared {
        messages,
        extras,
        output: OutputPlan {
            tools: Some(ToolParse {
                format,
                names: request.tools.iter().map(|t| t.name.clone()).collect(),
                forced,
            }),
            reasoning,
        },
    })
}

/// A chat request's conversation as the engine's prompt: its images checked against the
/// model, its messages rendered with its tools and template switches (`chat_request`), and
/// the reader of its answer. What every chat dialect builds.
pub async fn chat_prompt(
    state: &AppState,
    chat: crate::requests::common::Chat,
    tools: Option<ToolRequest>,
    params: &mut SamplingParams,
    args: TemplateArgs,
) -> Result<(crate::requests::image_prompt::Prompt, ChatOutput), ApiError> {
    let info = crate::requests::common::model_info(state)?;
    crate::requests::image_prompt::check_images(&info, chat.images.len())?;
    let (text, output) = chat_request(state, chat.messages, tools, params, args).await?;
    let prompt = crate::requests::image_prompt::Prompt {
        text,
        images: chat.images,
    };
    Ok((prompt, output))
}

/// The prompt of a chat request with its tools and template switches (`args`: its thinking
/// switch and other template kwargs), and the reader of its output; the grammar and stop
/// strings go into `params`.
pub async fn chat_request(
    state: &AppState,
    messages: Vec<ChatMessage>,
    tools: Option<ToolRequest>,
    params: &mut SamplingParams,
    args: TemplateArgs,
) -> Result<(String, ChatOutput), ApiError> {
    let info = crate::requests::common::model_info(state)?;
    let switches = args.extras(state, &info);
    let reasoning = reasoning_enabled(state, &info, switches.enable_thinking);
    let mut prepared = prepare(&info, tools, messages, params, reasoning).await?;
    prepared.extras.enable_thinking = switches.enable_thinking;
    prepared.extras.kwargs = switches.kwargs;
    let prompt = crate::requests::common::chat_prompt_with(
        state,
        prepared.messages,
        params,
        prepared.extras,
    )
    .await?;
    let thinking_first = prepared.output.tools.is_none()
        && prepared.output.reasoning
        && crate::chat::reasoning::opens_thinking(&prompt);
    if thinking_first {
        if let Some(grammar) = params.grammar.take() {
            let compiler = info.constraints.clone();
            params.grammar =
                Some(validate::blocking(move || after_thinking(&compiler, grammar)).await?);
        }
    }
    let output = ChatOutput::new(&prepared.output, &prompt);
    Ok((prompt, output))
}

/// A JSON schema's grammar for output that starts inside a think block (the template opened
/// it): free thinking, then `</think>`, then the JSON, as llama.cpp does for such templates.
/// The grammar is lazy, from the block's end on; constrained from the first token, the
/// model's thinking would be the JSON and its answer empty. Other grammars are kept as they
/// are (a GBNF grammar is the whole output, as the client wrote it).
fn after_thinking(compiler: &Compiler, grammar: Grammar) -> Grammar {
    let schema = match grammar.source.as_ref() {
        GrammarSource::JsonSchema(schema) => schema.clone(),
        GrammarSource::JsonObject => serde_json::json!({"type": "object"}),
        _ => return grammar,
    };
    let close = crate::chat::reasoning::THINK_CLOSE;
    let close_rule = crate::constrain::lark_literal(close, compiler.control_token(close));
    let lark = format!(
        "start: {close_rule} /[ \\t\\n]{{0,8}}/ answer\nanswer: %json {}\n",
        crate::constrain::with_json_options(schema)
    );
    let mut lazy = Grammar::new(GrammarSource::Lark(lark));
    lazy.triggers = vec![crate::constrain::Trigger::Literal(close.to_string())];
    lazy
}

/// The grammar of an answer made of calls to `selected`, in `format`, compiled: each call a
/// JSON object whose `name` is one of the tools' and whose arguments follow its parameters.
/// When it does not compile, each tool's schema is compiled alone to name the bad one.
fn call_grammar(
    compiler: &Compiler,
    format: ToolFormat,
    selected: &[Tool],
    parallel: bool,
) -> Result<Grammar, ApiError> {
    let invalid = |t: &Tool, reason: String| {
        ApiError::field(
            "tools",
            format!(
                ": the parameters schema of {:?} is invalid: {reason}",
                t.name
            ),
        )
    };
    for t in selected {
        check_schema_bounds(&t.parameters).map_err(|e| invalid(t, e))?;
    }
    let refs: Vec<&Tool> = selected.iter().collect();
    let wrapper = format.wrap_grammar(parallel, |text| compiler.control_token(text));
    let lark = format!(
        "{wrapper}call: %json {}\n",
        crate::constrain::with_json_options(tools::call_schema(format, &refs))
    );
    let mut grammar = Grammar::new(GrammarSource::Lark(lark));
    let Err(combined) = compiler.compile_into(&mut grammar) else {
        return Ok(grammar);
    };
    for t in selected {
        if let Err(e) = compiler.compile(&GrammarSource::JsonSchema(t.parameters.clone())) {
            let why = crate::constrain::explain_schema_error(&t.parameters, "parameters");
            return Err(invalid(t, why.unwrap_or(e)));
        }
    }
    Err(ApiError::field(
        "tools",
        format!(": the tools' schemas do not combine into a grammar ({combined})"),
    ))
}

/// A piece of a chat answer, dialect-neutral.
#[derive(Clone, Debug, PartialEq)]
pub enum OutPiece {
    /// Thinking.
    Reasoning(String),
    /// Answer text.
    Content(String),
    /// Calls (at the end).
    Calls(Vec<ToolCall>),
}

/// Reads a chat answer as it streams: thinking, then text, then calls. Text that may start a
/// call is held back until it is known; once a call starts, the rest is read at the end.
#[derive(Clone, Debug)]
pub struct ChatOutput {
    think: Option<ThinkSplitter>,
    tools: Option<ToolParse>,
    /// Answer text seen so far (when reading for calls).
    content: String,
    /// Bytes of `content` already given out.
    emitted: usize,
    /// Where the calls start in `content`, once they do.
    calls_at: Option<usize>,
}

impl ChatOutput {
    /// A reader for the output of a prompt.
    pub fn new(plan: &OutputPlan, prompt: &str) -> Self {
        let calls_at = plan.tools.as_ref().filter(|t| t.forced).map(|_| 0);
        // A forced call is the whole answer (the grammar leaves no room to think), even after
        // a prompt that opens a think block.
        Self {
            think: (plan.reasoning && calls_at.is_none()).then(|| ThinkSplitter::new(prompt)),
            tools: plan.tools.clone(),
            content: String::new(),
            emitted: 0,
            calls_at,
        }
    }

    /// The next generated text.
    pub fn push(&mut self, text: &str) -> Vec<OutPiece> {
        let pieces = match &mut self.think {
            Some(t) => t.push(text),
            None => vec![Piece::Content(text.to_string())],
        };
        self.route(pieces)
    }

    /// The end of the output.
    pub fn finish(&mut self) -> Vec<OutPiece> {
        let pieces = self
            .think
            .as_mut()
            .map(ThinkSplitter::finish)
            .unwrap_or_default();
        let mut out = self.route(pieces);
        let Some(tools) = &self.tools else {
            return out;
        };
        match self.calls_at {
            Some(at) => {
                let names: Vec<&str> = tools.names.iter().map(String::as_str).collect();
                let Parsed { content, calls } = tools.format.parse(&self.content[at..], &names);
                if calls.is_empty() {
                    push_content(&mut out, self.content[self.emitted..].to_string());
                } else {
                    push_content(&mut out, content);
                    out.push(OutPiece::Calls(calls));
                }
            }
            None => push_content(&mut out, self.content[self.emitted..].to_string()),
        }
        self.emitted = self.content.len();
        out
    }

    fn route(&mut self, pieces: Vec<Piece>) -> Vec<OutPiece> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Reasoning(t) => out.push(OutPiece::Reasoning(t)),
                Piece::Content(t) => match &self.tools {
                    None => out.push(OutPiece::Content(t)),
                    Some(tools) => {
                        self.content.push_str(&t);
                        if self.calls_at.is_some() {
                            continue;
                        }
                        let format = tools.format;
                        if let Some(at) = format.call_start(&self.content) {
                            let text = self.content[self.emitted..at].to_string();
                            push_content(&mut out, text);
                            self.emitted = at;
                            self.calls_at = Some(at);
                        } else {
                            let hold = format.partial_trigger(&self.content);
                            let end = (self.content.len() - hold).max(self.emitted);
                            let text = self.content[self.emitted..end].to_string();
                            push_content(&mut out, text);
                            self.emitted = end;
                        }
                    }
                },
            }
        }
        out
    }
}

fn push_content(out: &mut Vec<OutPiece>, text: String) {
    if !text.is_empty() {
        out.push(OutPiece::Content(text));
    }
}

/// A whole answer, read at once.
#[derive(Debug, Default, PartialEq)]
pub struct Answer {
    /// Thinking (empty when none).
    pub reasoning: String,
    /// Text.
    pub content: String,
    /// Calls.
    pub calls: Vec<ToolCall>,
}

impl ChatOutput {
    /// Reads a whole answer.
    pub fn read_all(mut self, text: &str) -> Answer {
        let mut pieces = self.push(text);
        pieces.extend(self.finish());
        let mut answer = Answer::default();
        for p in pieces {
            match p {
                OutPiece::Reasoning(t) => answer.reasoning.push_str(&t),
                OutPiece::Content(t) => answer.content.push_str(&t),
                OutPiece::Calls(c) => answer.calls.extend(c),
            }
        }
        answer.reasoning = answer.reasoning.trim_end().to_string();
        if !answer.calls.is_empty() {
            answer.content = answer.content.trim().to_string();
        }
        answer
    }
}

/// A call id as OpenAI writes them: `call_` and 24 letters and digits.
pub fn call_id() -> String {
    call_id_with("call")
}

/// A call id with this prefix and 24 letters and digits (Anthropic's are `toolu_…`).
pub fn call_id_with(prefix: &str) -> String {
    let hex = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}_{}", &hex[..24])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::tools::FORMATS;
    use serde_json::json;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}})
    }

    fn parse(tools: Value, choice: Value) -> Result<Option<ToolRequest>, String> {
        let tools = tools.as_array().cloned();
        let choice = (!choice.is_null()).then_some(choice);
        ToolRequest::parse(tools.as_deref(), choice.as_ref(), None).map_err(|e| e.to_string())
    }

    #[test]
    fn tool_requests_are_read() {
        let r = parse(json!([weather()]), json!(null)).unwrap().unwrap();
        assert_eq!(r.choice, ToolChoice::Auto);
        assert!(r.parallel);
        assert_eq!(r.tools[0].name, "get_weather");
        let r = parse(
            json!([weather()]),
            json!({"type": "function", "function": {"name": "get_weather"}}),
        );
        assert_eq!(
            r.unwrap().unwrap().choice,
            ToolChoice::Named("get_weather".into())
        );
        assert_eq!(
            parse(json!([weather()]), json!("required"))
                .unwrap()
                .unwrap()
                .choice,
            ToolChoice::Required
        );
        assert_eq!(
            parse(json!([weather()]), json!("none"))
                .unwrap()
                .unwrap()
                .choice,
            ToolChoice::None
        );
        // No tools, nothing asked: no tool request. A function without parameters takes {}.
        assert_eq!(parse(json!([]), json!("auto")).unwrap(), None);
        assert_eq!(parse(json!(null), json!(null)).unwrap(), None);
        let r = parse(
            json!([{"type": "function", "function": {"name": "now"}}]),
            json!(null),
        );
        assert_eq!(r.unwrap().unwrap().tools[0].parameters["type"], "object");
    }

    #[test]
    fn bad_tool_requests_name_the_problem() {
        let cases = [
            (
                json!([weather()]),
                json!("sometimes"),
                "tool_choice must be",
            ),
            (
                json!([weather()]),
                json!({"type": "function", "function": {"name": "nope"}}),
                "\"nope\", which is not among",
            ),
            (
                json!([weather()]),
                json!({"function": {}}),
                "tool_choice.function.name",
            ),
            (
                json!([weather()]),
                json!(5),
                "tool_choice must be a string or an object",
            ),
            (json!([]), json!("required"), "needs tools"),
            (json!([5]), json!(null), "tools[0] must be an object"),
            (
                json!([{"type": "retrieval"}]),
                json!(null),
                "tools[0].type must be \"function\"",
            ),
            (
                json!([{"type": "function"}]),
                json!(null),
                "tools[0].function is required",
            ),
            (
                json!([{"function": {"name": 3}}]),
                json!(null),
                "tools[0].function.name is required",
            ),
            (
                json!([{"function": {"name": "a b"}}]),
                json!(null),
                "tools[0].function.name must be",
            ),
            (
                json!([{"function": {"name": ""}}]),
                json!(null),
                "tools[0].function.name must be",
            ),
            (
                json!([{"function": {"name": "x".repeat(65)}}]),
                json!(null),
                "tools[0].function.name must be",
            ),
            (
                json!([{"function": {"name": "a", "description": 1}}]),
                json!(null),
                "description must be a string",
            ),
            (
                json!([{"function": {"name": "a", "parameters": "x"}}]),
                json!(null),
                "parameters must be a JSON schema object",
            ),
            (
                json!([{"function": {"name": "a", "parameters": {"type": "array"}}}]),
                json!(null),
                "parameters.type must be \"object\"",
            ),
            (
                json!([weather(), weather()]),
                json!(null),
                "tools[1].function.name: \"get_weather\" is offered twice",
            ),
        ];
        for (tools, choice, expected) in cases {
            let err = parse(tools.clone(), choice.clone()).unwrap_err();
            assert!(err.contains(expected), "{tools} {choice}: {err}");
        }
        let many: Vec<Value> = (0..=MAX_TOOLS)
            .map(|i| json!({"function": {"name": format!("f{i}")}}))
            .collect();
        assert!(parse(json!(many), json!(null))
            .unwrap_err()
            .contains("at most"));
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({"type": "object", "properties": {"a": deep}});
        }
        let err = parse(
            json!([{"function": {"name": "a", "parameters": deep}}]),
            json!(null),
        );
        assert!(err.unwrap_err().contains("deeper"));
    }

    fn plan(format: ToolFormat, forced: bool, reasoning: bool) -> OutputPlan {
        OutputPlan {
            tools: Some(ToolParse {
                format,
                names: vec!["get_weather".into(), "add".into()],
                forced,
            }),
            reasoning,
        }
    }

    /// Feeds `text` cut at `cuts` and joins what comes out, as a streaming client does.
    fn streamed(plan: &OutputPlan, text: &str, cuts: &[usize]) -> Answer {
        let mut out = ChatOutput::new(plan, "");
        let mut pieces = Vec::new();
        let mut from = 0;
        for &c in cuts.iter().chain([text.len()].iter()) {
            pieces.extend(out.push(&text[from..c]));
            from = c;
        }
        pieces.extend(out.finish());
        let mut a = Answer::default();
        for p in pieces {
            match p {
                OutPiece::Reasoning(t) => a.reasoning.push_str(&t),
                OutPiece::Content(t) => a.content.push_str(&t),
                OutPiece::Calls(c) => a.calls.extend(c),
            }
        }
        a.reasoning = a.reasoning.trim_end().to_string();
        if !a.calls.is_empty() {
            a.content = a.content.trim().to_string();
        }
        a
    }

    #[test]
    fn streamed_answers_reassemble_into_the_whole_one() {
        let calls = vec![
            ToolCall {
                name: "get_weather".into(),
                arguments: json!({"city": "Paris", "unit": "celsius"}),
            },
            ToolCall {
                name: "add".into(),
                arguments: json!({"a": 1}),
            },
        ];
        for &f in FORMATS {
            let call_text = f.call_text(&calls);
            let texts = [
                format!("<think>Weather, so a call.</think>\n{call_text}"),
                call_text.clone(),
                "Just text, no call.".to_string(),
                "<think>no</think>Text { \"name\" later".to_string(),
            ];
            for text in &texts {
                for forced in [false, true] {
                    if forced && text.starts_with("<think>") {
                        // A forced answer is a call from its first token: never thinking.
                        continue;
                    }
                    let p = plan(f, forced, true);
                    let whole = ChatOutput::new(&p, "").read_all(text);
                    if text.contains("\"name\": \"get_weather\"") {
                        assert_eq!(whole.calls, calls, "{f:?} {text}");
                    } else {
                        assert!(whole.calls.is_empty(), "{f:?} {text}");
                    }
                    if text.starts_with("<think>") {
                        assert!(!whole.reasoning.is_empty());
                    }
                    for a in 0..text.len() {
                        if !text.is_char_boundary(a) {
                            continue;
                        }
                        for b in [a, (a + 3).min(text.len()), (a + 11).min(text.len())] {
                            assert_eq!(streamed(&p, text, &[a, b]), whole, "{f:?} {text} {a} {b}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_forced_call_after_a_prompt_that_opens_a_think_block_is_a_call() {
        let p = plan(ToolFormat::Hermes, true, true);
        let a = ChatOutput::new(&p, "<|im_start|>assistant\n<think>\n")
            .read_all("<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>");
        assert_eq!(a.calls.len(), 1);
        assert_eq!(a.reasoning, "");
        // In auto mode the same prompt starts inside the block.
        let p = plan(ToolFormat::Hermes, false, true);
        let a = ChatOutput::new(&p, "<think>\n").read_all("hm</think>Hi");
        assert_eq!((a.reasoning.as_str(), a.content.as_str()), ("hm", "Hi"));
    }

    #[test]
    fn free_text_streams_before_the_end_in_auto_mode() {
        let p = plan(ToolFormat::Hermes, false, false);
        let mut out = ChatOutput::new(&p, "");
        assert_eq!(out.push("Hello "), vec![OutPiece::Content("Hello ".into())]);
        // A possible trigger is held, then let go when it is not one.
        assert_eq!(out.push("<tool"), vec![]);
        assert_eq!(
            out.push("box>"),
            vec![OutPiece::Content("<toolbox>".into())]
        );
        assert_eq!(
            out.push("<tool_call>\n{\"name\": \"add\", \"arguments\": {}}"),
            vec![]
        );
        assert_eq!(
            out.finish(),
            vec![OutPiece::Calls(vec![ToolCall {
                name: "add".into(),
                arguments: json!({})
            }])]
        );
        // Forced mode holds everything; a failed parse gives the text back.
        let p = plan(ToolFormat::Generic, true, false);
        let mut out = ChatOutput::new(&p, "");
        assert_eq!(out.push("{\"name\": \"add\", \"argu"), vec![]);
        assert_eq!(
            out.finish(),
            vec![OutPiece::Content("{\"name\": \"add\", \"argu".into())]
        );
    }
}
