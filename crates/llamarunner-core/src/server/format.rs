//! The request `format` field (Ollama's `"json"` or a JSON schema, OpenAI's `response_format`)
//! turned into a GBNF grammar.

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
        serde_json::Value::Object(_) => {
            check_schema_bounds(format)?;
            schema_to_grammar(&format.to_string()).map(Some)
        }
        other => Err(format!(
            "invalid format: {other}; expected \"json\" or a JSON schema object"
        )),
    }
}

/// Most values (objects, arrays, scalars) a JSON schema may have.
pub const MAX_SCHEMA_NODES: usize = 4096;
/// Most properties one schema object may list. llama.cpp's converter builds the optional
/// properties of an object in time cubic in their number, on the thread that converts.
pub const MAX_SCHEMA_PROPERTIES: usize = 128;
/// Deepest nesting of a JSON schema.
pub const MAX_SCHEMA_DEPTH: usize = 32;

/// Checks a schema's size before llama.cpp's converter sees it, without recursing.
pub fn check_schema_bounds(schema: &serde_json::Value) -> Result<(), String> {
    use serde_json::Value;
    let mut stack = vec![(schema, 1usize)];
    let mut nodes = 0usize;
    while let Some((v, depth)) = stack.pop() {
        nodes += 1;
        if nodes > MAX_SCHEMA_NODES {
            return Err(format!(
                "invalid JSON schema in format: more than {MAX_SCHEMA_NODES} values"
            ));
        }
        if depth > MAX_SCHEMA_DEPTH {
            return Err(format!(
                "invalid JSON schema in format: nested deeper than {MAX_SCHEMA_DEPTH} levels"
            ));
        }
        match v {
            Value::Object(map) => {
                if map
                    .get("properties")
                    .and_then(Value::as_object)
                    .is_some_and(|p| p.len() > MAX_SCHEMA_PROPERTIES)
                {
                    return Err(format!(
                        "invalid JSON schema in format: an object lists more than \
                         {MAX_SCHEMA_PROPERTIES} properties"
                    ));
                }
                stack.extend(map.values().map(|c| (c, depth + 1)));
            }
            Value::Array(items) => stack.extend(items.iter().map(|c| (c, depth + 1))),
            _ => {}
        }
    }
    Ok(())
}

fn schema_to_grammar(schema: &str) -> Result<String, String> {
    crate::engine::grammar::schema_to_gbnf(schema).map_err(|e| {
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
    fn oversized_schemas_are_refused_before_conversion() {
        let many: serde_json::Map<String, serde_json::Value> = (0..=MAX_SCHEMA_PROPERTIES)
            .map(|i| (format!("p{i}"), json!({})))
            .collect();
        let err = grammar_for_format(&json!({"type": "object", "properties": many})).unwrap_err();
        assert!(err.contains("properties"), "{err}");
        let mut deep = json!({"type": "string"});
        for _ in 0..MAX_SCHEMA_DEPTH {
            deep = json!({"type": "array", "items": deep});
        }
        assert!(check_schema_bounds(&deep).unwrap_err().contains("deeper"));
        let wide = json!({"enum": vec![1; MAX_SCHEMA_NODES]});
        assert!(check_schema_bounds(&wide).unwrap_err().contains("values"));
        let fine: serde_json::Map<String, serde_json::Value> = (0..MAX_SCHEMA_PROPERTIES)
            .map(|i| (format!("p{i}"), json!({"type": "integer"})))
            .collect();
        assert_eq!(
            check_schema_bounds(&json!({"type": "object", "properties": fine})),
            Ok(())
        );
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
