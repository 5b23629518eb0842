//! Turns token bytes into the text a client may see: whole UTF-8 characters only, stop strings
//! cut out, and text that could still become a stop string held back until it cannot.

use crate::chat::utf8::decode_utf8;

/// Per-sequence output text state.
#[derive(Debug, Default)]
pub struct TextStream {
    /// Bytes of a UTF-8 character whose remaining bytes have not arrived yet.
    partial: Vec<u8>,
    /// Decoded text not yet released (it may be the start of a stop string).
    held: String,
    stops: Vec<String>,
    /// Bytes of text decoded so far (released or held).
    decoded: usize,
    /// Bytes of text released so far.
    released: usize,
    /// `decoded` after each pushed token.
    token_ends: Vec<usize>,
    /// How many of `token_ends` are at or before `released` (advanced as text is released, so
    /// counting returned tokens stays linear over a whole generation).
    returned: usize,
    /// The index in `stops` of the stop string that ended the text.
    stopped_by: Option<usize>,
}

/// What pushing one token's bytes produced.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pushed {
    /// Text that may be sent now.
    pub text: String,
    /// A stop string was found; `text` ends right before it and the sequence must end.
    pub stopped: bool,
}

impl TextStream {
    /// A stream that stops at any of `stops`.
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            ..Self::default()
        }
    }

    /// Adds one token's bytes.
    pub fn push(&mut self, bytes: &[u8]) -> Pushed {
        self.partial.extend_from_slice(bytes);
        let before = self.held.len();
        self.decode_partial();
        self.decoded += self.held.len() - before;
        self.token_ends.push(self.decoded);
        if let Some((at, which)) = self.earliest_stop() {
            self.stopped_by = Some(which);
            self.held.truncate(at);
            self.partial.clear();
            return Pushed {
                text: self.release_all(),
                stopped: true,
            };
        }
        let keep = self.stop_prefix_len();
        let release = self.held.len() - keep;
        let rest = self.held.split_off(release);
        let text = std::mem::replace(&mut self.held, rest);
        self.release(text.len());
        Pushed {
            text,
            stopped: false,
        }
    }

    /// How many of the pushed tokens were returned whole (after a stop, the tokens from the
    /// one where the stop string starts are not): the slot's cache keeps only those.
    pub fn tokens_returned(&self) -> usize {
        self.returned
    }

    fn release(&mut self, bytes: usize) {
        self.released += bytes;
        while self
            .token_ends
            .get(self.returned)
            .is_some_and(|&end| end <= self.released)
        {
            self.returned += 1;
        }
    }

    fn release_all(&mut self) -> String {
        let text = std::mem::take(&mut self.held);
        self.release(text.len());
        text
    }

    /// Releases everything held back (the sequence ended for another reason). An incomplete
    /// character at the very end becomes U+FFFD so the output stays valid UTF-8.
    pub fn finish(&mut self) -> String {
        if !self.partial.is_empty() {
            self.held
                .push_str(&String::from_utf8_lossy(&std::mem::take(&mut self.partial)));
        }
        self.release_all()
    }

    /// Moves the complete characters of `partial` into `held`; invalid bytes become U+FFFD,
    /// an incomplete character at the end stays in `partial`.
    fn decode_partial(&mut self) {
        let used = decode_utf8(&self.partial, &mut self.held);
        self.partial.drain(..used);
    }

    /// The stop string that ended the text, if one did.
    pub fn stopped_by(&self) -> Option<&str> {
        self.stopped_by
            .and_then(|i| self.stops.get(i))
            .map(String::as_str)
    }

    /// Byte offset in `held` of the earliest stop string, if any, and its index in `stops`
    /// (the first listed, of two found at the same offset).
    fn earliest_stop(&self) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|at| (at, i)))
            .min()
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn stop_prefix_len(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            let max = stop.len().saturating_sub(1).min(self.held.len());
            for len in (best + 1..=max).rev() {
                let start = self.held.len() - len;
                if self.held.is_char_boundary(start)
                    && stop.as_bytes().starts_with(&self.held.as_bytes()[start..])
                {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&[u8]]) -> (Vec<String>, bool, String) {
        let mut s = TextStream::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for p in pieces {
            let r = s.push(p);
            out.push(r.text);
            if r.stopped {
                return (out, true, String::new());
            }
        }
        let tail = s.finish();
        (out, false, tail)
    }

    /// Pushes token pieces until a stop; returns (text returned, stopped, whole tokens returned).
    fn stop_table(stops: &[&str], pieces: &[&str]) -> (String, bool, usize) {
        let mut s = TextStream::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = s.push(p.as_bytes());
            out.push_str(&r.text);
            if r.stopped {
                return (out, true, s.tokens_returned());
            }
        }
        out.push_str(&s.finish());
        (out, false, s.tokens_returned())
    }

    /// Ollama's `TestTruncateStop` table: `(pieces, stop) -> (kept pieces, truncated)`. Kept
    /// text is the same here; "whole tokens returned" is kept pieces minus the truncated one.
    #[test]
    fn ollama_truncate_stop_table() {
        let cases: &[(&[&str], &str, &str, usize)] = &[
            // [hello, world] / world -> [hello], not truncated
            (&["hello", "world"], "world", "hello", 1),
            // [hello, wor] / or -> [hello, w], truncated
            (&["hello", "wor"], "or", "hellow", 1),
            // [Hello, " the", "re!"] / there! -> [Hello, " "], truncated
            (&["Hello", " the", "re!"], "there!", "Hello ", 1),
            // [hello] / hello -> [], not truncated
            (&["hello"], "hello", "", 0),
            // [hello, world] / "lo wo" does not appear (no space) -> everything
            (&["hello", "world"], "lo wo", "helloworld", 2),
            // [hel, lo, wor, ld] / "low" -> [hel, lo], not truncated
            (&["hel", "lo", "wor", "ld"], "low", "hel", 1),
        ];
        for &(pieces, stop, text, whole) in cases {
            let (out, _, returned) = stop_table(&[stop], pieces);
            assert_eq!(out, text, "{pieces:?} / {stop}");
            assert_eq!(returned, whole, "{pieces:?} / {stop}");
        }
    }

    /// Ollama's `TestIncompleteUnicode` table: incomplete characters are held back, complete
    /// ones released at once.
    #[test]
    fn ollama_incomplete_unicode_table() {
        let cases: &[(&[u8], bool)] = &[
            (b"hi\xc2", true),
            (b"hi\xe0\xa0", true),
            (b"hi\xf0\x92\x8a", true),
            (b"hi\xc2\xa3", false),
            (b"hi\xe0\xa0\x80", false),
            (b"hi\xf0\x92\x8a\xb7", false),
            (b"hi", false),
        ];
        for &(bytes, incomplete) in cases {
            let mut s = TextStream::new(Vec::new());
            let released = s.push(bytes).text;
            assert_eq!(released.len() < bytes.len(), incomplete, "{bytes:x?}");
            assert!(released.starts_with("hi"));
        }
    }

    #[test]
    fn stop_spanning_tokens_is_cut_out() {
        let (out, stopped, _) = run(&["world"], &[b"hello ", b"wor", b"ld!"]);
        assert!(stopped);
        assert_eq!(out.concat(), "hello ");
        // "wor" was held back, never sent.
        assert_eq!(out[1], "");
    }

    #[test]
    fn held_text_is_released_when_it_cannot_be_a_stop() {
        let (out, stopped, tail) = run(&["there!"], &[b"Hello", b" the", b"re you"]);
        assert!(!stopped);
        assert_eq!(out, vec!["Hello", " ", "there you"]);
        assert_eq!(tail, "");
    }

    #[test]
    fn held_text_is_flushed_at_the_end() {
        let (out, stopped, tail) = run(&["STOP"], &[b"abc ST"]);
        assert!(!stopped);
        assert_eq!(out, vec!["abc "]);
        assert_eq!(tail, "ST");
    }

    #[test]
    fn earliest_stop_wins() {
        let (out, stopped, _) = run(&["c", "a"], &[b"xabc"]);
        assert!(stopped);
        assert_eq!(out.concat(), "x");
    }

    #[test]
    fn the_stop_string_that_ended_the_text_is_known() {
        let mut s = TextStream::new(vec!["c".into(), "ab".into()]);
        assert_eq!(s.stopped_by(), None);
        assert!(!s.push(b"xa").stopped);
        assert_eq!(s.stopped_by(), None);
        assert!(s.push(b"bc").stopped);
        assert_eq!(s.stopped_by(), Some("ab"));
        let mut s = TextStream::new(vec!["q".into()]);
        s.push(b"no stop here");
        s.finish();
        assert_eq!(s.stopped_by(), None);
    }

    #[test]
    fn split_utf8_is_held_until_complete() {
        // "£" = c2 a3, "€" = e2 82 ac, "💷" = f0 9f 92 b7
        let (out, _, tail) = run(
            &[],
            &[b"hi\xc2", b"\xa3\xe2\x82", b"\xac\xf0\x9f", b"\x92\xb7"],
        );
        assert_eq!(out, vec!["hi", "£", "€", "💷"]);
        assert_eq!(tail, "");
        for chunk in &out {
            assert!(std::str::from_utf8(chunk.as_bytes()).is_ok());
        }
    }

    #[test]
    fn incomplete_utf8_at_the_end_becomes_replacement() {
        let (out, _, tail) = run(&[], &[b"hi\xe0\xa0"]);
        assert_eq!(out, vec!["hi"]);
        assert_eq!(tail, "\u{FFFD}");
    }

    #[test]
    fn invalid_bytes_become_replacement_and_do_not_block() {
        let (out, _, _) = run(&[], &[b"a\xffb"]);
        assert_eq!(out, vec!["a\u{FFFD}b"]);
    }

    #[test]
    fn stop_prefix_respects_char_boundaries() {
        let (out, stopped, tail) = run(&["é!"], &["café".as_bytes(), b"?"]);
        assert!(!stopped);
        assert_eq!(out, vec!["caf", "é?"]);
        assert_eq!(tail, "");
    }
}
