//! Output constraints: GBNF grammars, and the request `format` field turned into one.

/// GBNF for any JSON value whose top level is an object (what `format: "json"` asks for).
pub const JSON_OBJECT_GBNF: &str = r#"root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt/] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws     ::= | " " | "\n" [ \t]{0,20}
"#;

/// Turns a request's `format` into a grammar: `null`/`""` = none, `"json"` = any JSON object,
/// an object = that JSON schema. Anything else is an error naming the field.
pub fn grammar_for_format(format: &serde_json::Value) -> Result<Option<String>, String> {
    match format {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(s) if s.is_empty() => Ok(None),
        serde_json::Value::String(s) if s == "json" => Ok(Some(JSON_OBJECT_GBNF.to_string())),
        serde_json::Value::Object(_) => schema_to_grammar(&format.to_string()).map(Some),
        other => Err(format!(
            "invalid format: {other}; expected \"json\" or a JSON schema object"
        )),
    }
}

#[cfg(feature = "llama")]
fn schema_to_grammar(schema: &str) -> Result<String, String> {
    llama_cpp_2::json_schema_to_grammar(schema).map_err(|e| {
        // llama-cpp-2 drops llama.cpp's reason ("ffi error -3"); say what we can find.
        let reason = serde_json::from_str(schema)
            .ok()
            .and_then(|v: serde_json::Value| explain_schema_error(&v, "schema"))
            .unwrap_or_else(|| format!("llama.cpp could not convert it to a grammar ({e})"));
        format!("invalid JSON schema in format: {reason}")
    })
}

/// The JSON Schema types llama.cpp's converter knows.
const SCHEMA_TYPES: &[&str] = &[
    "object", "array", "string", "number", "integer", "boolean", "null",
];

/// Finds the first `type` that is not a JSON Schema type, with its path; consulted only after
/// llama.cpp refused a schema.
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

#[cfg(not(feature = "llama"))]
fn schema_to_grammar(_schema: &str) -> Result<String, String> {
    Err("JSON schema formats need the llama feature".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn format_values() {
        assert_eq!(grammar_for_format(&json!(null)), Ok(None));
        assert_eq!(grammar_for_format(&json!("")), Ok(None));
        assert!(grammar_for_format(&json!("json"))
            .unwrap()
            .unwrap()
            .starts_with("root"));
        assert!(grammar_for_format(&json!("xml"))
            .unwrap_err()
            .contains("invalid format"));
        assert!(grammar_for_format(&json!(5)).is_err());
    }

    #[test]
    fn a_bad_schema_type_is_named_with_its_path() {
        let schema = json!({"type": "object", "properties": {"age": {"type": "banana"}}});
        assert_eq!(
            explain_schema_error(&schema, "schema").unwrap(),
            "schema.properties.age.type: \"banana\" is not a JSON Schema type (one of object, \
             array, string, number, integer, boolean, null)"
        );
        let fine = json!({"type": ["string", "null"], "enum": [{"type": "x"}]});
        assert_eq!(explain_schema_error(&fine, "schema"), None);
    }
}

/// Says what is wrong with a GBNF grammar that llama.cpp refused (its parser prints the reason
/// to stderr only). Consulted only after llama.cpp failed, so it can never reject a grammar
/// llama.cpp accepts; `None` when it finds nothing.
pub fn explain_gbnf_error(text: &str) -> Option<String> {
    let mut p = Gbnf {
        s: text.as_bytes(),
        i: 0,
        defined: Vec::new(),
        used: Vec::new(),
    };
    if let Err(e) = p.grammar() {
        return Some(e);
    }
    if !p.defined.iter().any(|d| d == "root") {
        return Some("the grammar has no `root` rule".into());
    }
    p.used
        .iter()
        .find(|(name, _)| !p.defined.contains(name))
        .map(|(name, at)| format!("undefined rule `{name}` at {}", p.position(*at)))
}

struct Gbnf<'a> {
    s: &'a [u8],
    i: usize,
    defined: Vec<String>,
    used: Vec<(String, usize)>,
}

impl Gbnf<'_> {
    fn position(&self, at: usize) -> String {
        let before = &self.s[..at.min(self.s.len())];
        let line = before.iter().filter(|&&c| c == b'\n').count() + 1;
        let col = before.iter().rev().take_while(|&&c| c != b'\n').count() + 1;
        format!("line {line}, column {col}")
    }
    fn err<T>(&self, what: &str) -> Result<T, String> {
        Err(format!("{what} at {}", self.position(self.i)))
    }
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }
    /// Skips spaces and comments; newlines too when `newlines`.
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                b' ' | b'\t' | b'\r' => self.i += 1,
                b'\n' if newlines => self.i += 1,
                b'#' => {
                    while self.peek().is_some_and(|c| c != b'\n') {
                        self.i += 1;
                    }
                }
                _ => break,
            }
        }
    }
    fn name(&mut self) -> Option<String> {
        let start = self.i;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        {
            self.i += 1;
        }
        (self.i > start).then(|| String::from_utf8_lossy(&self.s[start..self.i]).into_owned())
    }
    fn grammar(&mut self) -> Result<(), String> {
        self.space(true);
        while self.peek().is_some() {
            let Some(name) = self.name() else {
                return self.err("expected a rule name");
            };
            self.space(false);
            if !self.s[self.i..].starts_with(b"::=") {
                return self.err("expected `::=`");
            }
            self.i += 3;
            self.space(true);
            self.alternatives(false)?;
            self.defined.push(name);
            self.space(true);
        }
        Ok(())
    }
    fn alternatives(&mut self, nested: bool) -> Result<(), String> {
        self.sequence(nested)?;
        while self.peek() == Some(b'|') {
            self.i += 1;
            self.space(true);
            self.sequence(nested)?;
        }
        Ok(())
    }
    fn sequence(&mut self, nested: bool) -> Result<(), String> {
        loop {
            match self.peek() {
                Some(b'"') => self.literal(b'"')?,
                Some(b'[') => self.literal(b']')?,
                Some(b'.') => self.i += 1,
                Some(b'(') => {
                    self.i += 1;
                    self.space(true);
                    self.alternatives(true)?;
                    if self.peek() != Some(b')') {
                        return self.err("expected `)`");
                    }
                    self.i += 1;
                }
                Some(c) if c.is_ascii_alphanumeric() || c == b'-' || c == b'_' => {
                    let at = self.i;
                    let name = self.name().unwrap_or_default();
                    self.used.push((name, at));
                }
                Some(b'*' | b'+' | b'?') => {
                    return self.err("a repetition operator needs something before it")
                }
                _ => return Ok(()),
            }
            // Postfix operators.
            match self.peek() {
                Some(b'*' | b'+' | b'?') => self.i += 1,
                Some(b'{') => {
                    while self.peek().is_some_and(|c| c != b'}') {
                        self.i += 1;
                    }
                    if self.peek().is_none() {
                        return self.err("unterminated `{`");
                    }
                    self.i += 1;
                }
                _ => {}
            }
            self.space(nested);
        }
    }
    /// A `"string"` or a `[class]`; `close` is the closing byte.
    fn literal(&mut self, close: u8) -> Result<(), String> {
        let start = self.i;
        self.i += 1;
        while let Some(c) = self.peek() {
            self.i += 1;
            if c == b'\\' {
                self.i += 1;
            } else if c == close {
                return Ok(());
            } else if c == b'\n' && close == b'"' {
                break;
            }
        }
        self.i = start;
        self.err(if close == b'"' {
            "unterminated string"
        } else {
            "unterminated character class"
        })
    }
}

#[cfg(test)]
mod gbnf_tests {
    use super::*;

    #[test]
    fn explains_common_mistakes() {
        let e = explain_gbnf_error("root ::= \"yes").unwrap();
        assert!(
            e.contains("unterminated string") && e.contains("line 1, column 10"),
            "{e}"
        );
        let e = explain_gbnf_error("root ::= foo").unwrap();
        assert!(e.contains("undefined rule `foo`"), "{e}");
        let e = explain_gbnf_error("answer ::= \"a\"").unwrap();
        assert!(e.contains("no `root`"), "{e}");
        let e = explain_gbnf_error("root ::= (\"a\" | \"b\"").unwrap();
        assert!(e.contains("expected `)`"), "{e}");
        let e = explain_gbnf_error("root = \"a\"").unwrap();
        assert!(e.contains("::="), "{e}");
    }

    #[test]
    fn finds_nothing_in_valid_grammars() {
        assert_eq!(explain_gbnf_error(JSON_OBJECT_GBNF), None);
        assert_eq!(explain_gbnf_error("root ::= \"yes\" | \"no\""), None);
        let multi = "# comment\nroot ::= item+ ( \",\" item )*\nitem ::= [a-z\\]]{1,3} .\n";
        assert_eq!(explain_gbnf_error(multi), None);
    }
}
