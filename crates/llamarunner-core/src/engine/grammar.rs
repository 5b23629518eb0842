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
    check_fanout(text)
}

/// Most grammar stacks one position of a grammar may expand into. llama.cpp keeps one stack
/// per way the grammar can continue, and nullable rules referring to each other multiply them
/// (`l0 ::= l1 l1 | ""`, `l1 ::= l2 l2 | ""`, ... has 2^depth): compiling such a grammar, or
/// sampling with it (each stack is checked against the whole vocabulary for every token), would
/// stall the server.
pub const MAX_GRAMMAR_FANOUT: u64 = 2048;

/// A sequence: its items, each with whether a postfix operator lets it match nothing.
type Seq = Vec<(Item, bool)>;
/// A rule: its name and alternatives.
type Rule = (String, Vec<Seq>);

/// One element of a sequence, for the fan-out estimate.
enum Item {
    /// A literal, character class or token: `nullable` when it can match nothing (`""`).
    Term { nullable: bool },
    /// A rule reference, with the byte offset where it stands.
    Ref(String, usize),
    /// A parenthesized group of alternatives.
    Group(Vec<Seq>),
}

/// Checks that no position of the grammar expands into more than `MAX_GRAMMAR_FANOUT`
/// stacks: an upper bound from the grammar's structure (how many ways each element can start,
/// summed over the elements that may be skipped because the ones before them match nothing).
/// The grammar must have passed the nesting bound (groups recurse here). Grammars this parser
/// cannot read are left to llama.cpp's parser.
pub fn check_fanout(text: &str) -> Result<(), String> {
    let Ok(rules) = Parser::new(text).grammar() else {
        return Ok(());
    };
    let index: std::collections::HashMap<&str, usize> = rules
        .iter()
        .enumerate()
        .map(|(i, (name, _))| (name.as_str(), i))
        .collect();
    let cap = MAX_GRAMMAR_FANOUT + 1;
    let mut fan = vec![0u64; rules.len()];
    let mut nullable = vec![false; rules.len()];
    // Fixpoint over a worklist: a rule is evaluated again only when a rule it refers to
    // changed. Values only grow and are capped, so this ends, in about one evaluation per rule
    // for ordinary grammars whatever order their rules are written in.
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); rules.len()];
    for (r, (_, alts)) in rules.iter().enumerate() {
        let mut refs = Vec::new();
        collect_refs(alts, &mut refs);
        for (name, _) in refs {
            if let Some(&target) = index.get(name) {
                users[target].push(r);
            }
        }
    }
    let mut queue: std::collections::VecDeque<usize> = (0..rules.len()).rev().collect();
    let mut queued = vec![true; rules.len()];
    while let Some(r) = queue.pop_front() {
        queued[r] = false;
        let (e, n) = alternatives(&rules[r].1, &index, &fan, &nullable, cap);
        if e != fan[r] || n != nullable[r] {
            fan[r] = e;
            nullable[r] = n;
            for &u in &users[r] {
                if !queued[u] {
                    queued[u] = true;
                    queue.push_back(u);
                }
            }
        }
    }
    let mut worst = 0;
    for (_, alts) in &rules {
        worst = worst.max(worst_suffix(alts, &index, &fan, &nullable, cap));
    }
    if worst > MAX_GRAMMAR_FANOUT {
        return Err(format!(
            "invalid grammar: too ambiguous (one position can continue in more than \
             {MAX_GRAMMAR_FANOUT} ways; nullable rules nest too deeply)"
        ));
    }
    Ok(())
}

/// The rule references in these alternatives, groups included, with where each stands.
fn collect_refs<'a>(alts: &'a [Seq], out: &mut Vec<(&'a str, usize)>) {
    for seq in alts {
        for (item, _) in seq {
            match item {
                Item::Ref(name, at) => out.push((name, *at)),
                Item::Group(inner) => collect_refs(inner, out),
                Item::Term { .. } => {}
            }
        }
    }
}

type Fan<'a> = (
    &'a std::collections::HashMap<&'a str, usize>,
    &'a [u64],
    &'a [bool],
    u64,
);

fn item_fan(item: &(Item, bool), f: Fan<'_>) -> (u64, bool) {
    let (index, fan, nullable, cap) = f;
    let (e, n) = match &item.0 {
        Item::Term { nullable } => (u64::from(!nullable), *nullable),
        Item::Ref(name, _) => index
            .get(name.as_str())
            .map_or((1, false), |&r| (fan[r], nullable[r])),
        Item::Group(alts) => alternatives(alts, index, fan, nullable, cap),
    };
    (e.min(cap), n || item.1)
}

fn sequence(
    seq: &[(Item, bool)],
    index: &std::collections::HashMap<&str, usize>,
    fan: &[u64],
    nullable: &[bool],
    cap: u64,
) -> (u64, bool) {
    let mut total = 0u64;
    for item in seq {
        let (e, n) = item_fan(item, (index, fan, nullable, cap));
        total = total.saturating_add(e).min(cap);
        if !n {
            return (total, false);
        }
    }
    (total, true)
}

fn alternatives(
    alts: &[Seq],
    index: &std::collections::HashMap<&str, usize>,
    fan: &[u64],
    nullable: &[bool],
    cap: u64,
) -> (u64, bool) {
    let mut total = 0u64;
    let mut any_null = false;
    for seq in alts {
        let (e, n) = sequence(seq, index, fan, nullable, cap);
        total = total.saturating_add(e).min(cap);
        any_null |= n;
    }
    (total, any_null)
}

/// The largest fan-out of any suffix of any sequence, groups included.
fn worst_suffix(
    alts: &[Seq],
    index: &std::collections::HashMap<&str, usize>,
    fan: &[u64],
    nullable: &[bool],
    cap: u64,
) -> u64 {
    let mut worst = 0;
    for seq in alts {
        for k in 0..seq.len() {
            worst = worst.max(sequence(&seq[k..], index, fan, nullable, cap).0);
            if let Item::Group(inner) = &seq[k].0 {
                worst = worst.max(worst_suffix(inner, index, fan, nullable, cap));
            }
        }
    }
    worst
}

/// A GBNF reader, after llama.cpp's parser: it builds what the fan-out estimate needs and says
/// where a grammar goes wrong. It recurses once per level of parentheses, so it only reads
/// grammars that passed the nesting bound.
struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Parser<'a> {
    fn new(text: &'a str) -> Self {
        Self {
            s: text.as_bytes(),
            i: 0,
        }
    }
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
    /// The rules, alternatives of a name defined twice merged.
    fn grammar(mut self) -> Result<Vec<Rule>, String> {
        let mut rules: Vec<Rule> = Vec::new();
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
            let alts = self.alternatives(false)?;
            match rules.iter_mut().find(|(n, _)| *n == name) {
                Some((_, existing)) => existing.extend(alts),
                None => rules.push((name, alts)),
            }
            self.space(true);
        }
        Ok(rules)
    }
    fn alternatives(&mut self, nested: bool) -> Result<Vec<Seq>, String> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek() == Some(b'|') {
            self.i += 1;
            self.space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(alts)
    }
    /// A `"string"`, `[class]` or `<token>`; `close` is its closing byte. Returns whether it
    /// was empty.
    fn literal(&mut self, close: u8) -> Result<bool, String> {
        let start = self.i;
        self.i += 1;
        while let Some(c) = self.peek() {
            self.i += 1;
            if c == b'\\' {
                self.i += 1;
            } else if c == close {
                return Ok(self.i == start + 2);
            } else if c == b'\n' && close == b'"' {
                break;
            }
        }
        self.i = start;
        self.err(match close {
            b'"' => "unterminated string",
            b']' => "unterminated character class",
            _ => "unterminated token",
        })
    }
    fn sequence(&mut self, nested: bool) -> Result<Seq, String> {
        let mut seq = Vec::new();
        loop {
            let item = match self.peek() {
                Some(b'"') => Item::Term {
                    nullable: self.literal(b'"')?,
                },
                Some(b'[') => {
                    self.literal(b']')?;
                    Item::Term { nullable: false }
                }
                Some(b'<') => {
                    self.literal(b'>')?;
                    Item::Term { nullable: false }
                }
                Some(b'!') => {
                    self.i += 1;
                    if self.peek() != Some(b'<') {
                        return self.err("expected `<` after `!`");
                    }
                    self.literal(b'>')?;
                    Item::Term { nullable: false }
                }
                Some(b'.') => {
                    self.i += 1;
                    Item::Term { nullable: false }
                }
                Some(b'(') => {
                    self.i += 1;
                    self.space(true);
                    let alts = self.alternatives(true)?;
                    if self.peek() != Some(b')') {
                        return self.err("expected `)`");
                    }
                    self.i += 1;
                    Item::Group(alts)
                }
                Some(c) if c.is_ascii_alphanumeric() || c == b'-' || c == b'_' => {
                    let at = self.i;
                    Item::Ref(self.name().unwrap_or_default(), at)
                }
                Some(b'*' | b'+' | b'?') => {
                    return self.err("a repetition operator needs something before it")
                }
                _ => return Ok(seq),
            };
            // Postfix operators: whether they let the item match nothing.
            let skippable = match self.peek() {
                Some(b'*' | b'?') => {
                    self.i += 1;
                    true
                }
                Some(b'+') => {
                    self.i += 1;
                    false
                }
                Some(b'{') => {
                    let Some(len) = self.s[self.i..].iter().position(|&c| c == b'}') else {
                        return self.err("unterminated `{`");
                    };
                    let inside = String::from_utf8_lossy(&self.s[self.i + 1..self.i + len]);
                    let min_zero = inside
                        .split(',')
                        .next()
                        .map(str::trim)
                        .is_none_or(|m| m.is_empty() || m == "0");
                    self.i += len + 1;
                    min_zero
                }
                _ => false,
            };
            seq.push((item, skippable));
            self.space(nested);
        }
    }
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
    let rules = match Parser::new(text).grammar() {
        Ok(rules) => rules,
        Err(e) => return Some(e),
    };
    if !rules.iter().any(|(name, _)| name == "root") {
        return Some("the grammar has no `root` rule".into());
    }
    let mut refs = Vec::new();
    for (_, alts) in &rules {
        collect_refs(alts, &mut refs);
    }
    refs.into_iter()
        .filter(|(name, _)| !rules.iter().any(|(n, _)| n == name))
        .min_by_key(|&(_, at)| at)
        .map(|(name, at)| {
            format!(
                "undefined rule `{name}` at {}",
                Parser::new(text).position(at)
            )
        })
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
    fn nested_nullable_rules_are_refused_as_too_ambiguous() {
        let chain = |depth: usize| {
            let mut g = String::from("root ::= l0\n");
            for i in 0..depth {
                g.push_str(&format!("l{i} ::= l{} l{} | \"\"\n", i + 1, i + 1));
            }
            g.push_str(&format!("l{depth} ::= \"x\" | \"\"\n"));
            g
        };
        assert!(check_bounds(&chain(24)).unwrap_err().contains("ambiguous"));
        assert!(check_bounds(&chain(12)).unwrap_err().contains("ambiguous"));
        assert_eq!(check_bounds(&chain(4)), Ok(()));
        // Behind a literal the fan-out is the same when generation reaches it.
        let later = format!("root ::= \"a\" l0\n{}", &chain(24)["root ::= l0\n".len()..]);
        assert!(check_bounds(&later).is_err());
        // Optional groups, repetitions and classes count as nullable where they are.
        let opt = "root ::= (\"a\"? \"b\"* [c]{0,3})* \"d\"";
        assert_eq!(check_bounds(opt), Ok(()));
        assert_eq!(
            check_bounds(crate::server::format::JSON_OBJECT_GBNF),
            Ok(())
        );
        // Long chains are accepted whichever way round they are written (the worklist
        // evaluates each rule about once; a pass-until-stable loop would take n passes here).
        let n = 6000;
        let mut leaf_first = format!("r{n} ::= \"a\"\n");
        for i in (0..n).rev() {
            leaf_first.push_str(&format!("r{i} ::= r{}\n", i + 1));
        }
        leaf_first.push_str("root ::= r0\n");
        assert_eq!(check_fanout(&leaf_first), Ok(()));
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
