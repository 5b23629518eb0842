//! GBNF grammars: the bounds a grammar must keep before llama.cpp's parser sees it (the parser
//! recurses once per nesting level on whatever thread compiles it), and an explanation of why
//! llama.cpp refused one (its parser prints the reason to stderr only).

/// Most bytes a grammar may have.
pub const MAX_GRAMMAR_BYTES: usize = 128 * 1024;
/// Deepest nesting of parentheses a grammar may have.
pub const MAX_GRAMMAR_DEPTH: usize = 64;

/// Checks a grammar's size and nesting depth without recursing (so it cannot itself overflow
/// a stack): parentheses inside strings, character classes and comments do not count.
pub fn check_bounds(text: &str) -> Result<(), String> {
    if text.len() > MAX_GRAMMAR_BYTES {
        return Err(format!(
            "invalid grammar: it has {} bytes, more than the {MAX_GRAMMAR_BYTES} allowed",
            text.len()
        ));
    }
    let s = text.as_bytes();
    let (mut i, mut depth) = (0, 0usize);
    while i < s.len() {
        match s[i] {
            q @ (b'"' | b'[') => {
                let close = if q == b'"' { b'"' } else { b']' };
                i += 1;
                while i < s.len() && s[i] != close {
                    i += if s[i] == b'\\' { 2 } else { 1 };
                }
            }
            b'#' => {
                while i < s.len() && s[i] != b'\n' {
                    i += 1;
                }
            }
            b'(' => {
                depth += 1;
                if depth > MAX_GRAMMAR_DEPTH {
                    return Err(format!(
                        "invalid grammar: parentheses nest deeper than {MAX_GRAMMAR_DEPTH} levels"
                    ));
                }
            }
            b')' => depth = depth.saturating_sub(1),
            b'{' => {
                let end = s[i..]
                    .iter()
                    .position(|&c| c == b'}')
                    .map_or(s.len(), |p| i + p);
                check_repetition(&text[i + 1..end])?;
                i = end;
            }
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

/// Most repetitions `{m,n}` may ask for (llama.cpp's own threshold).
pub const MAX_GRAMMAR_REPETITION: usize = 2000;

/// Checks the inside of a `{m}`, `{m,}`, `{,n}` or `{m,n}` repetition: llama.cpp expands
/// `{m,n}` with `n < m` into an endless loop that allocates until the process dies.
fn check_repetition(inside: &str) -> Result<(), String> {
    let mut parts = inside.splitn(2, ',').map(str::trim);
    let bound = |p: Option<&str>| -> Result<Option<usize>, String> {
        match p {
            None | Some("") => Ok(None),
            Some(n) => n
                .parse::<usize>()
                .map(Some)
                .map_err(|_| format!("invalid grammar: repetition {{{inside}}} is not {{m,n}}")),
        }
    };
    let min = bound(parts.next())?;
    let max = bound(parts.next())?;
    if let (Some(lo), Some(hi)) = (min, max) {
        if hi < lo {
            return Err(format!(
                "invalid grammar: repetition {{{inside}}} has its maximum below its minimum"
            ));
        }
    }
    if min.max(max).is_some_and(|n| n > MAX_GRAMMAR_REPETITION) {
        return Err(format!(
            "invalid grammar: repetition {{{inside}}} exceeds {MAX_GRAMMAR_REPETITION}"
        ));
    }
    Ok(())
}

/// Converts a JSON schema to GBNF with llama.cpp's converter.
#[cfg(feature = "llama")]
pub fn schema_to_gbnf(schema: &str) -> Result<String, String> {
    llama_cpp_2::json_schema_to_grammar(schema).map_err(|e| e.to_string())
}

/// Without llama.cpp there is no converter.
#[cfg(not(feature = "llama"))]
pub fn schema_to_gbnf(_schema: &str) -> Result<String, String> {
    Err("JSON schema formats need the llama feature".into())
}

/// Says what is wrong with a GBNF grammar that llama.cpp refused (its parser prints the reason
/// to stderr only). Consulted only after llama.cpp failed, so it can never reject a grammar
/// llama.cpp accepts; `None` when it finds nothing.
pub fn explain_gbnf_error(text: &str) -> Option<String> {
    if let Err(e) = check_bounds(text) {
        return Some(e);
    }
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
    fn bounds_refuse_deep_nesting_and_size_but_not_quoted_parentheses() {
        let deep = format!("root ::= {}\"a\"{}", "(".repeat(50_000), ")".repeat(50_000));
        assert!(check_bounds(&deep).unwrap_err().contains("nest deeper"));
        assert!(explain_gbnf_error(&deep).unwrap().contains("nest deeper"));
        let ok = format!("root ::= {}\"a\"{}", "(".repeat(64), ")".repeat(64));
        assert_eq!(check_bounds(&ok), Ok(()));
        let too_deep = format!("root ::= {}\"a\"{}", "(".repeat(65), ")".repeat(65));
        assert!(check_bounds(&too_deep).is_err());
        let quoted = format!(
            "root ::= \"{}\" [(((] # {}\n",
            "(".repeat(100),
            "(".repeat(100)
        );
        assert_eq!(check_bounds(&quoted), Ok(()));
        for bad in [
            "root ::= \"a\"{2,1}",
            "root ::= \"a\"{x}",
            "root ::= \"a\"{1,2001}",
        ] {
            assert!(check_bounds(bad).is_err(), "{bad}");
        }
        for good in [
            "root ::= \"a\"{2,3}",
            "root ::= \"a\"{2}",
            "root ::= \"a\"{2,}",
            "root ::= \"{2,1}\" [{]",
        ] {
            assert_eq!(check_bounds(good), Ok(()), "{good}");
        }
        let big = format!("root ::= \"{}\"", "a".repeat(MAX_GRAMMAR_BYTES));
        assert!(check_bounds(&big).unwrap_err().contains("bytes"));
    }

    #[test]
    fn finds_nothing_in_valid_grammars() {
        assert_eq!(
            explain_gbnf_error(crate::server::format::JSON_OBJECT_GBNF),
            None
        );
        assert_eq!(explain_gbnf_error("root ::= \"yes\" | \"no\""), None);
        let multi = "# comment\nroot ::= item+ ( \",\" item )*\nitem ::= [a-z\\]]{1,3} .\n";
        assert_eq!(explain_gbnf_error(multi), None);
    }
}
