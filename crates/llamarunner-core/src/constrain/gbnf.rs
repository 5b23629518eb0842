//! GBNF, llama.cpp's grammar format (the native `grammar` field, OpenAI's `grammar`), read
//! and written out as llguidance's Lark syntax, so that no request text reaches llama.cpp's
//! grammar parser. The reader follows llama.cpp's `grammar-parser`: rules `name ::= ...` end
//! at a newline outside parentheses, literals `"..."` and classes `[...]` take the escapes
//! `\x.. \u.... \U........ \t \n \r \\ \" \[ \]`, `.` is any character, postfix `* + ? {m}
//! {m,} {m,n} {,n}`, `#` comments; a rule defined twice keeps its last definition. Token
//! references (`<...>`, `<[id]>`) are refused with a 400 that names them.
//!
//! Nesting is bounded here (the reader recurses once per parenthesis), whatever bounds the
//! caller checked.

use std::collections::HashMap;
use std::fmt::Write as _;

/// Most bytes a grammar may have.
pub const MAX_GRAMMAR_BYTES: usize = 128 * 1024;

/// Checks a grammar's size, before anything reads it.
pub fn check_size(text: &str) -> Result<(), String> {
    if text.len() > MAX_GRAMMAR_BYTES {
        return Err(format!(
            "invalid grammar: it has {} bytes, more than the {MAX_GRAMMAR_BYTES} allowed",
            text.len()
        ));
    }
    Ok(())
}

/// Deepest nesting of parentheses the reader follows.
pub const MAX_DEPTH: usize = 64;
/// Most repetitions `{m,n}` may ask for (llama.cpp's own threshold).
pub const MAX_REPETITION: u32 = 2000;

/// How often an element may repeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rep {
    One,
    Star,
    Plus,
    Opt,
    Range(u32, Option<u32>),
}

#[derive(Debug)]
enum Node {
    Lit(String),
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    Any,
    Ref(String, usize),
    Group(Vec<Vec<(Node, Rep)>>),
}

type Alts = Vec<Vec<(Node, Rep)>>;

/// Translates a GBNF grammar (root rule `root`) to Lark; the error says what is wrong and
/// where.
pub fn to_lark(text: &str) -> Result<String, String> {
    let rules = Reader::new(text).grammar()?;
    let mut names: HashMap<&str, String> = HashMap::new();
    for (i, (name, _, _)) in rules.iter().enumerate() {
        let lark = if name == "root" {
            "start".to_string()
        } else {
            let clean: String = name
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() {
                        c.to_ascii_lowercase()
                    } else {
                        '_'
                    }
                })
                .collect();
            format!("r{i}_{clean}")
        };
        names.insert(name.as_str(), lark);
    }
    if !names.contains_key("root") {
        return Err("the grammar has no `root` rule".into());
    }
    let reader = Reader::new(text);
    let mut out = String::with_capacity(text.len() * 2);
    for (name, alts, _) in &rules {
        let _ = write!(out, "{}: ", names[name.as_str()]);
        write_alts(&mut out, alts, &names, &reader)?;
        out.push('\n');
    }
    Ok(out)
}

fn write_alts(
    out: &mut String,
    alts: &Alts,
    names: &HashMap<&str, String>,
    reader: &Reader<'_>,
) -> Result<(), String> {
    for (i, seq) in alts.iter().enumerate() {
        if i > 0 {
            out.push_str(" | ");
        }
        if seq.is_empty() {
            out.push_str("\"\"");
        }
        for (j, (node, rep)) in seq.iter().enumerate() {
            if j > 0 {
                out.push(' ');
            }
            match node {
                Node::Lit(s) => write_literal(out, s),
                Node::Class { negated, ranges } => write_class(out, *negated, ranges),
                Node::Any => out.push_str("/(?s:.)/"),
                Node::Ref(name, at) => match names.get(name.as_str()) {
                    Some(n) => out.push_str(n),
                    None => {
                        return Err(format!(
                            "undefined rule `{name}` at {}",
                            reader.position(*at)
                        ))
                    }
                },
                Node::Group(inner) => {
                    out.push('(');
                    write_alts(out, inner, names, reader)?;
                    out.push(')');
                }
            }
            match rep {
                Rep::One => {}
                Rep::Star => out.push('*'),
                Rep::Plus => out.push('+'),
                Rep::Opt => out.push('?'),
                Rep::Range(m, None) => {
                    let _ = write!(out, "{{{m},}}");
                }
                Rep::Range(m, Some(n)) => {
                    let _ = write!(out, "{{{m},{n}}}");
                }
            }
        }
    }
    Ok(())
}

/// A Lark string literal: JSON string syntax, with every control character and DEL escaped
/// (Lark's lexer takes neither raw).
fn write_literal(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A one-character regular expression: every member written as `\x{..}`, so that no
/// character of the class can be read as regex syntax.
fn write_class(out: &mut String, negated: bool, ranges: &[(char, char)]) {
    if ranges.is_empty() {
        // `[^]` is any character; `[]` none (a class nothing matches).
        out.push_str(if negated {
            "/(?s:.)/"
        } else {
            "/[^\\x{0}-\\x{10FFFF}]/"
        });
        return;
    }
    out.push_str(if negated { "/[^" } else { "/[" });
    for &(lo, hi) in ranges {
        let _ = write!(out, "\\x{{{:x}}}", lo as u32);
        if hi != lo {
            let _ = write!(out, "-\\x{{{:x}}}", hi as u32);
        }
    }
    out.push_str("]/");
}

/// llama.cpp's GBNF reader, by characters, recursing once per parenthesis (bounded).
struct Reader<'a> {
    src: &'a str,
    pos: usize,
    depth: usize,
}

impl<'a> Reader<'a> {
    fn new(src: &'a str) -> Self {
        Self {
            src,
            pos: 0,
            depth: 0,
        }
    }

    fn position(&self, at: usize) -> String {
        let before = &self.src[..at.min(self.src.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        format!("line {line}, column {column}")
    }

    fn err(&self, what: &str) -> String {
        format!("{what} at {}", self.position(self.pos))
    }

    fn peek(&self) -> Option<char> {
        self.src[self.pos..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn eat(&mut self, s: &str) -> bool {
        if self.src[self.pos..].starts_with(s) {
            self.pos += s.len();
            true
        } else {
            false
        }
    }

    /// Skips spaces, tabs and comments, and newlines when `newlines`.
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.pos += 1,
                '#' => {
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.bump();
                    }
                }
                '\r' | '\n' if newlines => self.pos += 1,
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            self.pos += 1;
        }
        (self.pos > start).then(|| self.src[start..self.pos].to_string())
    }

    /// Rules in order of first definition; a later definition replaces an earlier one.
    fn grammar(mut self) -> Result<Vec<(String, Alts, usize)>, String> {
        let mut rules: Vec<(String, Alts, usize)> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        self.space(true);
        while self.pos < self.src.len() {
            let at = self.pos;
            let name = self
                .name()
                .ok_or_else(|| self.err("expected a rule name"))?;
            self.space(false);
            if !self.eat("::=") {
                return Err(self.err("expected `::=`"));
            }
            self.space(true);
            let alts = self.alternatives(false)?;
            match index.get(&name) {
                Some(&i) => rules[i].1 = alts,
                None => {
                    index.insert(name.clone(), rules.len());
                    rules.push((name, alts, at));
                }
            }
            match self.peek() {
                None => {}
                Some('\r' | '\n') => self.space(true),
                Some(_) => return Err(self.err("expected the end of the rule")),
            }
        }
        if rules.is_empty() {
            return Err("the grammar is empty".into());
        }
        Ok(rules)
    }

    fn alternatives(&mut self, nested: bool) -> Result<Alts, String> {
        let mut alts = vec![self.sequence(nested)?];
        while self.eat("|") {
            self.space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(alts)
    }

    fn sequence(&mut self, nested: bool) -> Result<Vec<(Node, Rep)>, String> {
        let mut seq = Vec::new();
        loop {
            let node = match self.peek() {
                Some('"') => {
                    let at = self.pos;
                    self.pos += 1;
                    let mut s = String::new();
                    loop {
                        match self.peek() {
                            None => {
                                return Err(format!("unterminated string at {}", self.position(at)))
                            }
                            Some('"') => {
                                self.pos += 1;
                                break;
                            }
                            Some(_) => s.push(self.char_in(false)?),
                        }
                    }
                    Node::Lit(s)
                }
                Some('[') => {
                    let at = self.pos;
                    self.pos += 1;
                    let negated = self.eat("^");
                    let mut ranges = Vec::new();
                    loop {
                        match self.peek() {
                            None => {
                                return Err(format!(
                                    "unterminated character class at {}",
                                    self.position(at)
                                ))
                            }
                            Some(']') => {
                                self.pos += 1;
                                break;
                            }
                            Some(_) => {
                                let lo = self.char_in(true)?;
                                let hi = if self.src[self.pos..].starts_with('-')
                                    && !self.src[self.pos + 1..].starts_with(']')
                                {
                                    self.pos += 1;
                                    if self.peek().is_none() {
                                        return Err(self.err("unterminated character class"));
                                    }
                                    self.char_in(true)?
                                } else {
                                    lo
                                };
                                if hi < lo {
                                    return Err(self.err("a class range ends below its start"));
                                }
                                ranges.push((lo, hi));
                            }
                        }
                    }
                    Node::Class { negated, ranges }
                }
                Some('.') => {
                    self.pos += 1;
                    Node::Any
                }
                Some('(') => {
                    self.pos += 1;
                    self.depth += 1;
                    if self.depth > MAX_DEPTH {
                        return Err(format!("parentheses nest deeper than {MAX_DEPTH} levels"));
                    }
                    self.space(true);
                    let inner = self.alternatives(true)?;
                    if !self.eat(")") {
                        return Err(self.err("expected `)`"));
                    }
                    self.depth -= 1;
                    Node::Group(inner)
                }
                Some('<') => return Err(self.err("token references (`<...>`) are not supported")),
                Some(c) if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                    let at = self.pos;
                    let name = self.name().unwrap_or_default();
                    // The next rule's name, at the start of a line inside parentheses, is a
                    // mistake llama.cpp reports the same way.
                    let save = self.pos;
                    self.space(false);
                    if self.src[self.pos..].starts_with("::=") {
                        return Err(self.err("expected the end of the rule before"));
                    }
                    self.pos = save;
                    Node::Ref(name, at)
                }
                _ => break,
            };
            let rep = self.repetition()?;
            seq.push((node, rep));
            self.space(nested);
        }
        Ok(seq)
    }

    fn repetition(&mut self) -> Result<Rep, String> {
        let rep = match self.peek() {
            Some('*') => Rep::Star,
            Some('+') => Rep::Plus,
            Some('?') => Rep::Opt,
            Some('{') => {
                self.pos += 1;
                self.space(false);
                let min = self.number()?;
                self.space(false);
                let rep = if self.eat(",") {
                    self.space(false);
                    let max = self.number()?;
                    Rep::Range(min.unwrap_or(0), max)
                } else {
                    let Some(n) = min else {
                        return Err(self.err("expected a number in the repetition"));
                    };
                    Rep::Range(n, Some(n))
                };
                self.space(false);
                if !self.eat("}") {
                    return Err(self.err("expected `}` after the repetition"));
                }
                if let Rep::Range(m, max) = rep {
                    if max.is_some_and(|n| n < m) {
                        return Err(self.err("the repetition's maximum is below its minimum"));
                    }
                    if m.max(max.unwrap_or(0)) > MAX_REPETITION {
                        return Err(self.err(&format!("the repetition exceeds {MAX_REPETITION}")));
                    }
                }
                return Ok(rep);
            }
            _ => return Ok(Rep::One),
        };
        self.pos += 1;
        Ok(rep)
    }

    fn number(&mut self) -> Result<Option<u32>, String> {
        let start = self.pos;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.pos += 1;
        }
        if self.pos == start {
            return Ok(None);
        }
        self.src[start..self.pos]
            .parse()
            .map(Some)
            .map_err(|_| self.err(&format!("the repetition exceeds {MAX_REPETITION}")))
    }

    /// One character of a literal or class, escapes decoded.
    fn char_in(&mut self, class: bool) -> Result<char, String> {
        let Some(c) = self.bump() else {
            return Err(self.err("unexpected end of the grammar"));
        };
        if c != '\\' {
            return Ok(c);
        }
        let code = match self.bump() {
            Some('x') => self.hex(2)?,
            Some('u') => self.hex(4)?,
            Some('U') => self.hex(8)?,
            Some('t') => 9,
            Some('n') => 10,
            Some('r') => 13,
            Some(c @ ('\\' | '"' | '[' | ']')) => c as u32,
            Some('-') if class => '-' as u32,
            Some('^') if class => '^' as u32,
            _ => return Err(self.err("unknown escape")),
        };
        char::from_u32(code).ok_or_else(|| self.err("the escape is not a Unicode character"))
    }

    fn hex(&mut self, digits: usize) -> Result<u32, String> {
        let mut v = 0u32;
        for _ in 0..digits {
            let d = self
                .peek()
                .and_then(|c| c.to_digit(16))
                .ok_or_else(|| self.err("expected a hexadecimal digit"))?;
            self.pos += 1;
            v = v
                .checked_mul(16)
                .and_then(|v| v.checked_add(d))
                .unwrap_or(u32::MAX);
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn translates_each_construct() {
        let g = to_lark(
            "root ::= \"a\\\"b\\n\" [a-z\\]] [^\"\\\\] . item{2,3} item{,4} item{1,} (x | y)* z?\n\
             item ::= \"i\"\nx ::= \"x\"\ny ::= \"\"\nz ::= \"\\x7F\"",
        )
        .unwrap();
        let root = g.lines().next().unwrap();
        assert!(
            root.starts_with("start: \"a\\\"b\\u000a\" /[\\x{61}-\\x{7a}\\x{5d}]/"),
            "{root}"
        );
        assert!(root.contains("/[^\\x{22}\\x{5c}]/ /(?s:.)/"), "{root}");
        assert!(root.contains("{2,3}") && root.contains("{0,4}") && root.contains("{1,}"));
        assert!(g.contains("\"\\u007f\""), "{g}");
    }

    #[test]
    fn explains_mistakes_with_positions() {
        for (bad, want) in [
            ("root ::= \"yes", "unterminated string at line 1, column 10"),
            ("root ::= foo", "undefined rule `foo`"),
            ("answer ::= \"a\"", "no `root`"),
            ("root ::= (\"a\" | \"b\"", "expected `)`"),
            ("root = \"a\"", "::="),
            ("root ::= \"a\"{2,1}", "below its minimum"),
            ("root ::= \"a\"{1,2001}", "exceeds"),
            ("root ::= \"a\"{99999999999}", "exceeds"),
            ("root ::= <[12]>", "token references"),
            ("root ::= \"\\q\"", "unknown escape"),
            ("root ::= [z-a]", "below its start"),
            ("root ::= \"\\uD800\"", "not a Unicode"),
            ("", "empty"),
        ] {
            let e = to_lark(bad).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
        let deep = format!(
            "root ::= {}\"a\"{}",
            "(".repeat(100_000),
            ")".repeat(100_000)
        );
        assert!(to_lark(&deep).unwrap_err().contains("nest deeper"));
    }

    #[test]
    fn a_later_definition_replaces_an_earlier_one() {
        let g = to_lark("root ::= a\na ::= \"1\"\na ::= \"2\"").unwrap();
        assert!(g.contains("\"2\"") && !g.contains("\"1\""), "{g}");
    }
}
