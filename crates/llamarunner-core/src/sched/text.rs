//! Turns token bytes into the text a client may see: whole UTF-8 characters only, stop strings
//! cut out, and text that could still become a stop string held back until it cannot.

/// Per-sequence output text state.
#[derive(Debug, Default)]
pub struct TextStream {
    /// Bytes of a UTF-8 character whose remaining bytes have not arrived yet.
    partial: Vec<u8>,
    /// Decoded text not yet released (it may be the start of a stop string).
    held: String,
    stops: Vec<String>,
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
        self.decode_partial();
        if let Some(at) = self.earliest_stop() {
            self.held.truncate(at);
            self.partial.clear();
            return Pushed {
                text: std::mem::take(&mut self.held),
                stopped: true,
            };
        }
        let keep = self.stop_prefix_len();
        let release = self.held.len() - keep;
        let rest = self.held.split_off(release);
        let text = std::mem::replace(&mut self.held, rest);
        Pushed {
            text,
            stopped: false,
        }
    }

    /// Releases everything held back (the sequence ended for another reason). An incomplete
    /// character at the very end becomes U+FFFD so the output stays valid UTF-8.
    pub fn finish(&mut self) -> String {
        if !self.partial.is_empty() {
            self.held
                .push_str(&String::from_utf8_lossy(&std::mem::take(&mut self.partial)));
        }
        std::mem::take(&mut self.held)
    }

    /// Moves the complete characters of `partial` into `held`; invalid bytes become U+FFFD,
    /// an incomplete character at the end stays in `partial`.
    fn decode_partial(&mut self) {
        let mut rest: &[u8] = &self.partial;
        let mut consumed = 0;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    self.held.push_str(s);
                    consumed += rest.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: from_utf8 just told us this prefix is valid.
                    self.held
                        .push_str(std::str::from_utf8(&rest[..valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            self.held.push(char::REPLACEMENT_CHARACTER);
                            consumed += valid + bad;
                            rest = &rest[valid + bad..];
                        }
                        None => {
                            consumed += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.partial.drain(..consumed);
    }

    /// Byte offset in `held` of the earliest stop string, if any.
    fn earliest_stop(&self) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
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
