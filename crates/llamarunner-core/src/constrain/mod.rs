//! Constrained decoding. Every grammar a request brings (GBNF `grammar`, `format: "json"`,
//! JSON schemas from all three dialects, the tool-call grammars) is compiled by llguidance:
//! Rust code with fuel and size limits on compilation and on each token's mask, made for
//! untrusted grammars. No request data reaches llama.cpp's grammar parser or JSON-schema
//! converter.
//!
//! - `gbnf`: GBNF read and written out as llguidance's Lark syntax.
//! - `vocab`: the model's vocabulary as llguidance sees it.
//! - `guide`: one sequence's matcher on the engine thread: checks the sampled token first and
//!   computes the mask of allowed tokens only when that token is not allowed.
//! - `trigger`: lazy grammars (tool calls in "auto" mode) that start at a trigger in the output.
//!
//! The HTTP side compiles (`Compiler::compile`, on the bounded blocking pool); the engine
//! thread receives a ready matcher and never compiles.

pub mod gbnf;
pub mod guide;
pub mod stats;
pub mod trigger;
pub mod vocab;

use std::sync::{Arc, OnceLock};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

pub use guide::Guide;
pub use trigger::Trigger;
pub use vocab::{VocabToken, Vocabulary};

/// What a request asks its output to follow.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSource {
    /// llama.cpp's GBNF (the request's `grammar` field).
    Gbnf(String),
    /// A JSON schema (`format`, `response_format`, a tool's parameters).
    JsonSchema(Value),
    /// Any JSON object (`format: "json"`, `response_format: json_object`).
    JsonObject,
    /// A grammar in llguidance's Lark syntax that the server wrote (tool calls).
    Lark(String),
}

/// A request's grammar: its source, where it starts, and (once the validation layer compiled
/// it) its matcher.
#[derive(Clone)]
pub struct Grammar {
    /// What the output must follow.
    pub source: Arc<GrammarSource>,
    /// Triggers at whose first match in the output the grammar starts constraining (from the
    /// match on); empty: from the first token. Set by the server only (tool calls in "auto"
    /// mode), never from a request's text.
    pub triggers: Vec<Trigger>,
    /// The compiled matcher, set by `Compiler::compile_into` on the HTTP side.
    pub compiled: Option<Compiled>,
}

impl Grammar {
    /// A grammar constraining from the first token.
    pub fn new(source: GrammarSource) -> Self {
        Self {
            source: Arc::new(source),
            triggers: Vec::new(),
            compiled: None,
        }
    }

    /// The GBNF text, when that is what the request sent.
    pub fn gbnf(&self) -> Option<&str> {
        match &*self.source {
            GrammarSource::Gbnf(g) => Some(g),
            _ => None,
        }
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("source", &self.source)
            .field("triggers", &self.triggers)
            .field("compiled", &self.compiled.is_some())
            .finish()
    }
}

impl PartialEq for Grammar {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source && self.triggers == other.triggers
    }
}

/// A grammar compiled against the model's vocabulary: a fresh matcher (each request gets its
/// own copy; the lexer caches are shared).
#[derive(Clone)]
pub struct Compiled {
    pub(crate) matcher: Matcher,
    /// The vocabulary's end-of-generation tokens (none when it has none: llguidance's own EOS
    /// id is a stand-in then).
    pub(crate) eog: Arc<[u32]>,
}

/// Stack of the threads that compile and run grammars (reserved address space; only what a
/// grammar's depth needs is touched).
pub const GRAMMAR_STACK: usize = 256 << 20;

/// Whitespace a JSON value may have between its items: one space, or a line break or two and
/// an indent of at most 20, as llama.cpp's converter allows; bounded, so that a model cannot
/// loop in whitespace.
const JSON_WHITESPACE: &str = r"( |\n{1,2}[ \t]{0,20})";

/// What the compiler builds from the vocabulary on first use: llguidance's factory (the token
/// trie and its lexer caches) and the end-of-generation tokens.
type Prepared = (ParserFactory, Arc<[u32]>);

/// Compiles grammars against one model's vocabulary. The vocabulary's trie is built on first
/// use (on the blocking pool), so that servers that never constrain never pay for it.
pub struct Compiler {
    vocabulary: Box<dyn Fn() -> Vocabulary + Send + Sync>,
    factory: OnceLock<Result<Prepared, String>>,
}

impl std::fmt::Debug for Compiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Compiler")
    }
}

impl Compiler {
    /// A compiler over the vocabulary `vocabulary` returns (called once, on first use).
    pub fn new(vocabulary: impl Fn() -> Vocabulary + Send + Sync + 'static) -> Self {
        Self {
            vocabulary: Box::new(vocabulary),
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<&Prepared, String> {
        self.factory
            .get_or_init(|| {
                let vocabulary = (self.vocabulary)();
                let env = vocabulary.tok_env()?;
                let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
                factory.quiet();
                *factory.limits_mut() = limits();
                Ok((factory, vocabulary.eog().into()))
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The id of the control token whose text is `name`, if the vocabulary has one.
    pub fn control_token(&self, name: &str) -> Option<u32> {
        let (factory, _) = self.factory().ok()?;
        factory.tok_env().tok_trie().get_special_token(name)
    }

    /// Compiles `source`; the error is a sentence for a 400. Runs on a thread of its own with
    /// a deep stack: llguidance recurses along rule references, and a GBNF chain of thousands
    /// of rules would overflow a blocking-pool thread's.
    pub fn compile(&self, source: &GrammarSource) -> Result<Compiled, String> {
        let started = std::time::Instant::now();
        let compiled = std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("llamarunner-grammar".into())
                .stack_size(GRAMMAR_STACK)
                .spawn_scoped(scope, || self.compile_here(source))
                .map_err(|e| format!("could not start the grammar compiler: {e}"))?
                .join()
                .map_err(|_| "the grammar compiler failed".to_string())?
        });
        stats::stats().compiled(started.elapsed(), compiled.is_ok());
        compiled
    }

    fn compile_here(&self, source: &GrammarSource) -> Result<Compiled, String> {
        let (factory, eog) = self.factory()?;
        let (grammar, what) = match source {
            GrammarSource::Gbnf(text) => {
                let lark = gbnf::to_lark(text).map_err(|e| format!("invalid grammar: {e}"))?;
                (TopLevelGrammar::from_lark(lark), "grammar")
            }
            GrammarSource::JsonSchema(schema) => (
                TopLevelGrammar::from_json_schema(with_json_options(schema.clone())),
                "JSON schema",
            ),
            GrammarSource::JsonObject => (
                TopLevelGrammar::from_json_schema(with_json_options(
                    serde_json::json!({"type": "object"}),
                )),
                "JSON schema",
            ),
            GrammarSource::Lark(text) => (TopLevelGrammar::from_lark(text.clone()), "grammar"),
        };
        let explain = |e: &str| {
            // A bad `type` is named with its path (consulted only after a failure, so that
            // a property called "type" is never mistaken for one).
            let why = match source {
                GrammarSource::JsonSchema(schema) => explain_schema_error(schema, "schema"),
                _ => None,
            };
            format!("invalid {what}: {}", why.unwrap_or_else(|| clean_error(e)))
        };
        let parser = factory
            .create_parser(grammar)
            .map_err(|e| explain(&e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(explain(&e));
        }
        // A grammar whose start allows no token and no end matches no text (a rule or `$ref`
        // that only leads back to itself): a 400 now, not an empty answer that says "stop".
        // (llguidance may also fail to find a first token of such a grammar.)
        let mut probe = matcher.clone();
        let nothing = "it matches no text (a rule or $ref that only leads back to itself, or \
                       text no token can write)";
        match probe.compute_mask() {
            Ok(first) if first.is_zero() && !probe.is_accepting().unwrap_or(false) => {
                return Err(format!("invalid {what}: {nothing}"));
            }
            Ok(_) => {}
            Err(e) => {
                return Err(format!(
                    "invalid {what}: {nothing}; its first token cannot be found ({})",
                    clean_error(&e.to_string())
                ))
            }
        }
        Ok(Compiled {
            matcher,
            eog: eog.clone(),
        })
    }

    /// Compiles a request's grammar in place (a no-op when it is compiled already).
    pub fn compile_into(&self, grammar: &mut Grammar) -> Result<(), String> {
        if grammar.compiled.is_none() {
            grammar.compiled = Some(self.compile(&grammar.source)?);
        }
        Ok(())
    }
}

/// The bounds every grammar is compiled and run under: llguidance's defaults (about 20 ms of
/// lexer construction, a few ms per token's mask at most), without the grammar echoed in
/// errors.
fn limits() -> ParserLimits {
    ParserLimits {
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

/// A Lark literal for `text`: the text, or the vocabulary's control token of that text
/// (`control`) when it has one, which a model writes in one piece.
pub fn lark_literal(text: &str, control: Option<u32>) -> String {
    let quoted = Value::String(text.to_string()).to_string();
    match control {
        Some(id) => format!("({quoted} | <[{id}]>)"),
        None => quoted,
    }
}

/// The schema with our JSON layout options (bounded whitespace), replacing any `x-guidance`
/// a request sent (it could ask for unbounded whitespace or lenient parsing), and its objects
/// closed where it does not say (`close_objects`).
pub(crate) fn with_json_options(mut schema: Value) -> Value {
    close_objects(&mut schema);
    let options = serde_json::json!({
        "whitespace_flexible": false,
        "whitespace_pattern": JSON_WHITESPACE,
        "item_separator": ",",
        "key_separator": ":",
    });
    match schema {
        Value::Object(mut map) => {
            map.insert("x-guidance".into(), options);
            Value::Object(map)
        }
        // `true`/`false` schemas and the like: llguidance says what it thinks of them.
        other => other,
    }
}

/// The JSON Schema types.
const SCHEMA_TYPES: &[&str] = &[
    "object", "array", "string", "number", "integer", "boolean", "null",
];

/// Finds the first `type` that is not a JSON Schema type, with its path; consulted only after
/// the compiler refused a schema, so that the 400 names where the bad type is.
pub fn explain_schema_error(schema: &serde_json::Value, path: &str) -> Option<String> {
    use serde_json::Value;
    let Value::Object(map) = schema else {
        if let Value::Array(items) = schema {
            return items
                .iter()
                .enumerate()
                .find_map(|(i, v)| explain_schema_error(v, &format!("{path}[{i}]")));
        }
        return None;
    };
    if let Some(t) = map.get("type") {
        let names: Vec<&Value> = match t {
            Value::Array(v) => v.iter().collect(),
            other => vec![other],
        };
        for name in names {
            if !name.as_str().is_some_and(|n| SCHEMA_TYPES.contains(&n)) {
                return Some(format!(
                    "{path}.type: {name} is not a JSON Schema type (one of {})",
                    SCHEMA_TYPES.join(", ")
                ));
            }
        }
    }
    map.iter()
        .filter(|(k, _)| k.as_str() != "enum" && k.as_str() != "const" && k.as_str() != "default")
        .find_map(|(k, v)| explain_schema_error(v, &format!("{path}.{k}")))
}

/// An object schema that lists `properties` but says nothing of `additionalProperties` (or
/// `patternProperties`) gets `"additionalProperties": false`, as llama.cpp's converter and
/// OpenAI's strict structured outputs treat it: the model writes the properties it was given,
/// not arbitrary keys (a small model otherwise wanders into a key that never ends). The output
/// still validates against the schema as sent. Walks the schema's subschemas only (never
/// `enum`/`const` values), without recursing.
fn close_objects(schema: &mut Value) {
    let mut stack = vec![schema];
    while let Some(node) = stack.pop() {
        let Value::Object(map) = node else {
            continue;
        };
        if map.get("properties").is_some_and(Value::is_object)
            && !map.contains_key("additionalProperties")
            && !map.contains_key("patternProperties")
            && !map.contains_key("unevaluatedProperties")
        {
            map.insert("additionalProperties".into(), Value::Bool(false));
        }
        for (key, child) in map.iter_mut() {
            match key.as_str() {
                "properties" | "patternProperties" | "$defs" | "definitions"
                | "dependentSchemas" => {
                    if let Value::Object(members) = child {
                        stack.extend(members.values_mut());
                    }
                }
                "items"
                | "additionalProperties"
                | "not"
                | "if"
                | "then"
                | "else"
                | "contains"
                | "propertyNames"
                | "additionalItems"
                | "unevaluatedItems" => match child {
                    Value::Array(items) => stack.extend(items.iter_mut()),
                    other => stack.push(other),
                },
                "anyOf" | "oneOf" | "allOf" | "prefixItems" => {
                    if let Value::Array(items) = child {
                        stack.extend(items.iter_mut());
                    }
                }
                _ => {}
            }
        }
    }
}

/// llguidance's message without its internal context lines.
fn clean_error(e: &str) -> String {
    let first = e.lines().find(|l| !l.trim().is_empty()).unwrap_or(e).trim();
    let mut s: String = first.chars().take(400).collect();
    if s.len() < first.len() {
        s.push_str("...");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::TextModel;

    fn compiler() -> Compiler {
        Compiler::new(|| crate::backend::fake::FakeText.vocabulary())
    }

    /// Whether the grammar takes exactly `text` (byte tokens, as the fake's) and then may end.
    fn accepts(c: &Compiler, source: &GrammarSource, text: &str) -> bool {
        let mut m = c.compile(source).expect("compiles").matcher;
        for b in text.bytes() {
            if m.validate_tokens(&[u32::from(b)]).ok() != Some(1) {
                return false;
            }
            if m.consume_token(u32::from(b)).is_err() {
                return false;
            }
        }
        m.is_accepting().unwrap_or(false)
    }

    #[test]
    fn gbnf_keeps_llama_cpp_semantics() {
        let c = compiler();
        let g = |s: &str| GrammarSource::Gbnf(s.to_string());
        let cases: &[(&str, &[&str], &[&str])] = &[
            (
                "root ::= \"yes\" | \"no\"",
                &["yes", "no"],
                &["y", "yesno", ""],
            ),
            ("root ::= [a-c]{2,3}", &["ab", "abc"], &["a", "abca", "ad"]),
            ("root ::= \"x\"{2,}", &["xx", "xxxxx"], &["x"]),
            ("root ::= \"x\"{,2}", &["", "x", "xx"], &["xxx"]),
            ("root ::= (\"a\" | \"\") \"b\"", &["ab", "b"], &["a"]),
            ("root ::= [^\"\\\\]* \"\\\"\"", &["abc\"", "\""], &["a\\\""]),
            ("root ::= . .", &["ab", "\n\t"], &["a"]),
            (
                "root ::= item+\nitem ::= [0-9] \",\"?",
                &["1,2,3", "12"],
                &[",", ""],
            ),
            (
                "root ::= \"a\" (\n  \"b\" |\n  \"c\"\n)",
                &["ab", "ac"],
                &["a"],
            ),
            ("root ::= x\nx ::= \"\\x41\\u00e9\"", &["Aé"], &["A"]),
        ];
        for (grammar, good, bad) in cases {
            for t in *good {
                assert!(accepts(&c, &g(grammar), t), "{grammar:?} should take {t:?}");
            }
            for t in *bad {
                assert!(
                    !accepts(&c, &g(grammar), t),
                    "{grammar:?} should refuse {t:?}"
                );
            }
        }
    }

    #[test]
    fn hostile_grammars_and_schemas_are_errors_not_crashes() {
        let c = compiler();
        let wide = format!("root ::= ({})*", vec!["\"a\""; 2000].join(" | "));
        for source in [
            GrammarSource::JsonSchema(serde_json::json!({"type": "string", "pattern": "^*$"})),
            GrammarSource::JsonSchema(serde_json::json!({"$ref": "#/nowhere"})),
            GrammarSource::JsonSchema(serde_json::json!({"type": "banana"})),
            GrammarSource::Gbnf("root ::= (".into()),
        ] {
            assert!(c.compile(&source).is_err(), "{source:?}");
        }
        // These may compile; each step of their matchers then answers in bounded time.
        let cycle = serde_json::json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}});
        let endless = GrammarSource::Gbnf("root ::= a\na ::= a".into());
        for source in [
            GrammarSource::Gbnf(wide),
            GrammarSource::JsonSchema(cycle),
            endless,
        ] {
            if let Ok(mut m) = c.compile(&source).map(|c| c.matcher) {
                let start = std::time::Instant::now();
                for _ in 0..20 {
                    let _ = m.compute_mask();
                    let _ = m.consume_token(u32::from(b'a'));
                }
                assert!(
                    start.elapsed() < std::time::Duration::from_secs(20),
                    "{source:?}"
                );
            }
        }
    }

    #[test]
    fn grammars_that_match_no_text_are_errors() {
        let c = compiler();
        for source in [
            GrammarSource::JsonSchema(serde_json::json!({"$ref": "#"})),
            GrammarSource::JsonSchema(serde_json::json!({
                "$ref": "#/$defs/a",
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            })),
            GrammarSource::Gbnf("root ::= a\na ::= b\nb ::= a".into()),
            GrammarSource::Gbnf("root ::= root".into()),
        ] {
            let e = c.compile(&source).err();
            assert!(
                e.as_deref().is_some_and(|e| e.contains("matches no text")),
                "{source:?}: {e:?}"
            );
        }
        // An empty match is a match; so is recursion with a way out.
        for source in [
            GrammarSource::Gbnf("root ::= \"\"".into()),
            GrammarSource::Gbnf("root ::= \"(\" root \")\" | \"x\"".into()),
            GrammarSource::JsonSchema(serde_json::json!({
                "anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}}],
            })),
        ] {
            assert!(c.compile(&source).is_ok(), "{source:?}");
        }
    }

    #[test]
    fn schema_properties_keep_their_order() {
        let c = compiler();
        let schema = GrammarSource::JsonSchema(serde_json::json!({
            "type": "object",
            "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "boolean"}},
            "required": ["zeta", "alpha"],
            "additionalProperties": false
        }));
        assert!(accepts(&c, &schema, "{\"zeta\":1,\"alpha\":true}"));
        assert!(accepts(&c, &schema, "{\n  \"zeta\": 1, \"alpha\": true}"));
        assert!(!accepts(&c, &schema, "{\"zeta\":1,   \"alpha\":true}"));
        // Objects that do not say are closed; the properties named "properties" and "type"
        // are properties, not keywords.
        let open = GrammarSource::JsonSchema(serde_json::json!({
            "type": "object",
            "properties": {"properties": {"type": "object", "properties": {"type": {"type": "integer"}}}},
            "required": ["properties"]
        }));
        assert!(accepts(&c, &open, "{\"properties\":{\"type\":1}}"));
        assert!(!accepts(&c, &open, "{\"properties\":{\"type\":1},\"x\":1}"));
        assert!(!accepts(&c, &open, "{\"properties\":{\"type\":1,\"x\":1}}"));
        assert!(!accepts(&c, &schema, "{\"alpha\":true,\"zeta\":1}"));
        // A request's own layout options are replaced: whitespace stays bounded.
        let loose = GrammarSource::JsonSchema(serde_json::json!({
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "x-guidance": {"whitespace_pattern": "[ ]*", "lenient": true}
        }));
        assert!(accepts(&c, &loose, "{\"a\": 1}"));
        assert!(!accepts(
            &c,
            &loose,
            &format!("{{{}\"a\":1}}", " ".repeat(30))
        ));
        let long_enum: Vec<String> = (0..3000).map(|i| format!("value-{i}")).collect();
        let e = GrammarSource::JsonSchema(serde_json::json!({"enum": long_enum}));
        assert!(accepts(&c, &e, "\"value-2999\""));
        assert!(!accepts(&c, &e, "\"value-3000\""));
    }
}
