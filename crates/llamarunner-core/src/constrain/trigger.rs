//! Lazy grammars: a tool-call grammar in "auto" mode constrains only from where a call starts
//! in the output. The watch is incremental and bounded: a leading trigger is looked for only
//! while the output is short, a literal one only in the text the last token completed.

/// Where a lazy grammar starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// The output starts, after at most `MAX_LEADING_SPACE` whitespace characters, with
    /// `opener`, whitespace, then `key` (a bare JSON call `{"name": ...`); the grammar starts
    /// at the opener.
    Leading {
        /// The first character of a call.
        opener: char,
        /// What follows it (whitespace between them allowed).
        key: String,
    },
    /// This text anywhere in the output; the grammar starts at it.
    Literal(String),
}

/// What the watch found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// The grammar starts at this byte of the output.
    At(usize),
    /// Not yet; more output may match.
    NotYet,
    /// Never: a leading trigger past the start.
    Never,
}

/// Most whitespace before and inside a leading trigger (llama.cpp's bound was the same).
pub const MAX_LEADING_SPACE: usize = 32;

impl Trigger {
    /// Where the grammar starts in `text` (all the output so far, of which the last `fresh`
    /// bytes are new), if the trigger has matched by now.
    pub fn find(&self, text: &[u8], fresh: usize) -> Found {
        self.search(text, fresh).unwrap_or(Found::Never)
    }

    fn search(&self, text: &[u8], fresh: usize) -> Result<Found, ()> {
        match self {
            Trigger::Leading { opener, key } => {
                let limit = 2 * MAX_LEADING_SPACE + opener.len_utf8() + key.len();
                let lead = text.iter().take_while(|b| b.is_ascii_whitespace()).count();
                if lead > MAX_LEADING_SPACE {
                    return Err(());
                }
                let rest = &text[lead..];
                let mut buf = [0u8; 4];
                let opener = opener.encode_utf8(&mut buf).as_bytes();
                let Some(after) = prefix_or_partial(rest, opener)? else {
                    return Ok(Found::NotYet);
                };
                let inner = rest[after..]
                    .iter()
                    .take_while(|b| b.is_ascii_whitespace())
                    .count();
                if inner > MAX_LEADING_SPACE {
                    return Err(());
                }
                match prefix_or_partial(&rest[after + inner..], key.as_bytes())? {
                    Some(_) => Ok(Found::At(lead)),
                    None if text.len() > limit => Err(()),
                    None => Ok(Found::NotYet),
                }
            }
            Trigger::Literal(lit) => {
                let lit = lit.as_bytes();
                if lit.is_empty() {
                    return Ok(Found::At(text.len()));
                }
                // Only where the new bytes could complete it.
                let from = text.len().saturating_sub(fresh + lit.len() - 1);
                Ok(text[from..]
                    .windows(lit.len())
                    .position(|w| w == lit)
                    .map_or(Found::NotYet, |p| Found::At(from + p)))
            }
        }
    }
}

/// `Some(len)` when `text` starts with `want`; `None` when it is a proper prefix of `want`
/// (more output may complete it); `Err(())` when it differs.
#[allow(clippy::result_unit_err)]
fn prefix_or_partial(text: &[u8], want: &[u8]) -> Result<Option<usize>, ()> {
    if text.starts_with(want) {
        Ok(Some(want.len()))
    } else if want.starts_with(text) {
        Ok(None)
    } else {
        Err(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call() -> Trigger {
        Trigger::Leading {
            opener: '{',
            key: "\"name\"".into(),
        }
    }

    #[test]
    fn leading_triggers_match_only_at_the_start() {
        assert_eq!(call().find(b"  {\n \"name\": 1", 3), Found::At(2));
        assert_eq!(call().find(b"  {\n \"na", 3), Found::NotYet);
        assert_eq!(call().find(b" ", 1), Found::NotYet);
        assert_eq!(call().find(b"Hi {\"name\"", 3), Found::Never);
        assert_eq!(call().find(b"{\"other\"", 3), Found::Never);
        let spaces = vec![b' '; MAX_LEADING_SPACE + 1];
        assert_eq!(call().find(&spaces, 1), Found::Never);
    }

    #[test]
    fn literal_triggers_look_only_at_what_the_last_token_completed() {
        let t = Trigger::Literal("<tool_call>".into());
        assert_eq!(t.find(b"abc <tool_call>", 4), Found::At(4));
        assert_eq!(t.find(b"abc <tool_", 4), Found::NotYet);
        // An earlier occurrence was found when it was completed; it is not searched again.
        let long = format!("<tool_call>{}", "x".repeat(100));
        assert_eq!(t.find(long.as_bytes(), 1), Found::NotYet);
    }
}
