//! JSON for streamed answers, one value per line (NDJSON) or per SSE `data:` field.
//!
//! serde_json writes U+0085, U+2028 and U+2029 inside strings as they are (valid JSON), but
//! many line readers split there: Python's `str.splitlines` and httpx's `iter_lines` (which the
//! official `ollama` client reads our NDJSON with) end a line at each of them, breaking one
//! chunk into two halves that do not parse. A model writes them now and then (a random one
//! often). Written as `\u` escapes, the value is the same and every reader sees one line.
//!
//! `to_line` takes any `Serialize` value: a `serde_json::Value` or a dialect's wire type.

use serde::Serialize;

/// `value` as compact JSON with U+0085, U+2028 and U+2029 escaped (they can only occur inside
/// strings, so replacing them in the text is exact). A value serde cannot write (only a map
/// with keys that are not strings could be one; no wire type has such a map) is logged and
/// written as `null`.
pub fn to_line<T: Serialize + ?Sized>(value: &T) -> String {
    let text = match serde_json::to_string(value) {
        Ok(text) => text,
        Err(e) => {
            tracing::error!("cannot write a JSON line: {e}");
            return "null".to_string();
        }
    };
    if !text.contains(['\u{85}', '\u{2028}', '\u{2029}']) {
        return text;
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        match c {
            '\u{85}' => out.push_str("\\u0085"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::to_line;

    #[test]
    fn line_separators_are_escaped_and_the_value_is_unchanged() {
        let value = json!({"content": "a\u{2028}b\u{2029}c\u{85}d\n\u{2027}é", "done": false});
        let line = to_line(&value);
        assert!(
            !line.contains(['\u{85}', '\u{2028}', '\u{2029}', '\n']),
            "{line}"
        );
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&line).ok(),
            Some(value)
        );
        // Split where str.splitlines would: still one piece.
        assert_eq!(line.lines().count(), 1);
    }

    #[test]
    fn plain_values_are_written_as_serde_json_writes_them() {
        let value = json!({"content": "plain \"text\" \u{1}", "n": 3});
        assert_eq!(to_line(&value), value.to_string());
    }
}
