//! The request `format` field (Ollama's `"json"` or a JSON schema, OpenAI's `response_format`)
//! turned into a grammar for the constraint compiler (`constrain`), with the bounds a schema
//! must keep before it is compiled.

use crate::constrain::{Grammar, GrammarSource};
use crate::http::error::FieldError;

/// Turns a request's `format` into a grammar: `null`/`""` = none, `"json"` = any JSON object,
/// an object = that JSON schema. Anything else is an error naming the field.
pub fn grammar_for_format(format: &serde_json::Value) -> Result<Option<Grammar>, String> {
    match format {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(s) if s.is_empty() => Ok(None),
        serde_json::Value::String(s) if s == "json" => {
            Ok(Some(Grammar::new(GrammarSource::JsonObject)))
        }
        serde_json::Value::Object(_) => {
            check_schema_bounds(format)?;
            Ok(Some(Grammar::new(GrammarSource::JsonSchema(
                format.clone(),
            ))))
        }
        other => Err(format!(
            "invalid format: {other}; expected \"json\" or a JSON schema object"
        )),
    }
}

/// A JSON schema given as the field `at` (`json_schema`, `response_format.schema`, ...): an
/// object, compiled into a grammar; anything else is an error naming the field.
pub fn json_schema(schema: &serde_json::Value, at: &str) -> Result<Option<Grammar>, FieldError> {
    let error = |problem: String| FieldError {
        field: at.to_string(),
        problem,
    };
    if !schema.is_object() {
        return Err(error(" must be an object".into()));
    }
    grammar_for_format(schema).map_err(|e| error(format!(": {e}")))
}

/// OpenAI's `response_format` (chat completions; `text.format` of the Responses API, and
/// Anthropic's `output_config.format`, whose callers check the types they allow), read once
/// for every dialect: `text` = none; `json_object` = any JSON object, or its `schema` when
/// given (llama-server's extension); `json_schema` = its schema, under `json_schema.schema`
/// (chat completions) or `schema` (Responses, Anthropic, llama-server). A field that does not
/// fit is an error naming it (`at` is the field's path), never a constraint dropped.
pub fn response_format(
    format: &serde_json::Value,
    at: &str,
) -> Result<Option<Grammar>, FieldError> {
    use serde_json::Value;
    if format.is_null() {
        return Ok(None);
    }
    let schema_at = |schema: &Value, path: &str| json_schema(schema, &format!("{at}.{path}"));
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => match format.get("schema").filter(|s| !s.is_null()) {
            Some(schema) => schema_at(schema, "schema"),
            None => Ok(Some(Grammar::new(GrammarSource::JsonObject))),
        },
        Some("json_schema") => match format.get("json_schema").and_then(|j| j.get("schema")) {
            Some(schema) => schema_at(schema, "json_schema.schema"),
            None => schema_at(format.get("schema").unwrap_or(&Value::Null), "schema"),
        },
        _ => Err(FieldError {
            field: format!("{at}.type"),
            problem: " must be text, json_object or json_schema".into(),
        }),
    }
}

/// Most values (objects, arrays, scalars) a JSON schema may have.
pub const MAX_SCHEMA_NODES: usize = 4096;
/// Most properties one schema object may list.
pub const MAX_SCHEMA_PROPERTIES: usize = 512;
/// Deepest nesting of a JSON schema.
pub const MAX_SCHEMA_DEPTH: usize = 32;

/// Checks a schema's size before it is compiled, without recursing.
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn format_values() {
        assert_eq!(grammar_for_format(&json!(null)), Ok(None));
        assert_eq!(grammar_for_format(&json!("")), Ok(None));
        assert_eq!(
            grammar_for_format(&json!("json")),
            Ok(Some(Grammar::new(GrammarSource::JsonObject)))
        );
        assert!(grammar_for_format(&json!("xml"))
            .unwrap_err()
            .contains("invalid format"));
        assert!(grammar_for_format(&json!(5)).is_err());
    }

    #[test]
    fn response_formats_of_every_dialect() {
        use crate::constrain::GrammarSource::{JsonObject, JsonSchema};
        let schema = json!({"const": "42"});
        let source = |v: serde_json::Value| {
            response_format(&v, "response_format").map(|g| g.map(|g| (*g.source).clone()))
        };
        assert_eq!(source(json!(null)), Ok(None));
        assert_eq!(source(json!({"type": "text"})), Ok(None));
        assert_eq!(source(json!({"type": "json_object"})), Ok(Some(JsonObject)));
        for v in [
            json!({"type": "json_object", "schema": schema}),
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
            json!({"type": "json_schema", "schema": schema}),
        ] {
            assert_eq!(source(v), Ok(Some(JsonSchema(schema.clone()))));
        }
        for (v, says) in [
            (json!({"type": 123}), "response_format.type"),
            (json!({"type": "sound"}), "response_format.type"),
            (json!({}), "response_format.type"),
            (
                json!({"type": "json_object", "schema": 123}),
                "response_format.schema",
            ),
            (json!({"type": "json_schema"}), "response_format.schema"),
            (
                json!({"type": "json_schema", "json_schema": {"schema": []}}),
                "response_format.json_schema.schema",
            ),
        ] {
            let err = source(v.clone()).expect_err(&v.to_string());
            assert!(err.to_string().starts_with(says), "{v}: {err}");
            assert_eq!(err.field, says, "{v}");
        }
    }

    #[test]
    fn oversized_schemas_are_refused_before_compilation() {
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
}
