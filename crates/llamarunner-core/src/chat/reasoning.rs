//! Reasoning output: models that think in `<think>...</think>` before answering (Qwen3,
//! DeepSeek-R1 and their distillations) get the thinking split from the answer, whole or as it
//! streams. A template that opens the think block in the generation prompt (the output then
//! starts inside it) is handled by starting inside.

/// Opens a think block.
pub const THINK_OPEN: &str = "<think>";
/// Closes it.
pub const THINK_CLOSE: &str = "</think>";

/// Where a piece of output belongs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Thinking.
    Reasoning(String),
    /// The answer.
    Content(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace seen yet: a think block may still open.
    Start,
    /// Just after `<think>` in the output: whitespace before the thinking is dropped (however
    /// the stream is cut).
    Opened,
    /// Inside the think block.
    Thinking,
    /// Just after it: whitespace before the answer is dropped.
    AfterThink,
    /// After it (or there was none): everything is content.
    Answer,
}

/// Splits output into reasoning and content as it arrives; text that may be the start of a
/// tag is held back until the next piece tells.
#[derive(Clone, Debug)]
pub struct ThinkSplitter {
    state: State,
    held: String,
}

/// Whether output that follows `prompt` starts inside a think block (the template opened it).
pub fn opens_thinking(prompt: &str) -> bool {
    prompt.trim_end().ends_with(THINK_OPEN)
}

impl ThinkSplitter {
    /// A splitter for output that follows `prompt` (inside the think block when the prompt
    /// ends by opening one).
    pub fn new(prompt: &str) -> Self {
        Self {
            state: if opens_thinking(prompt) {
                State::Thinking
            } else {
                State::Start
            },
            held: String::new(),
        }
    }

    /// Takes the next piece of output; returns what can be said of it now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let trimmed = self.held.trim_start();
                    if trimmed.is_empty() {
                        return out;
                    }
                    if let Some(rest) = trimmed.strip_prefix(THINK_OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Opened;
                    } else if THINK_OPEN.starts_with(trimmed) {
                        return out;
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking => {
                    if let Some(at) = self.held.find(THINK_CLOSE) {
                        let thought = self.held[..at].to_string();
                        let rest = self.held[at + THINK_CLOSE.len()..].to_string();
                        push(&mut out, Piece::Reasoning(thought));
                        self.held = rest;
                        self.state = State::AfterThink;
                    } else {
                        let keep = partial_suffix(&self.held, THINK_CLOSE);
                        let ready = self.held[..self.held.len() - keep].to_string();
                        self.held.drain(..self.held.len() - keep);
                        push(&mut out, Piece::Reasoning(ready));
                        return out;
                    }
                }
                State::Opened | State::AfterThink => {
                    self.held = self.held.trim_start().to_string();
                    if self.held.is_empty() {
                        return out;
                    }
                    self.state = if self.state == State::Opened {
                        State::Thinking
                    } else {
                        State::Answer
                    };
                }
                State::Answer => {
                    let text = std::mem::take(&mut self.held);
                    push(&mut out, Piece::Content(text));
                    return out;
                }
            }
        }
    }

    /// The end of the output: whatever was held back.
    pub fn finish(&mut self) -> Vec<Piece> {
        let text = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        match self.state {
            State::Thinking => push(&mut out, Piece::Reasoning(text)),
            // Only whitespace is held after a tag.
            State::Opened => {}
            State::Start | State::AfterThink | State::Answer => {
                push(&mut out, Piece::Content(text))
            }
        }
        out
    }

    /// Splits a whole output: (reasoning, content).
    pub fn split(prompt: &str, text: &str) -> (String, String) {
        let mut s = Self::new(prompt);
        let mut pieces = s.push(text);
        pieces.extend(s.finish());
        let (mut reasoning, mut content) = (String::new(), String::new());
        for p in pieces {
            match p {
                Piece::Reasoning(t) => reasoning.push_str(&t),
                Piece::Content(t) => content.push_str(&t),
            }
        }
        (reasoning.trim_end().to_string(), content)
    }
}

fn push(out: &mut Vec<Piece>, piece: Piece) {
    match &piece {
        Piece::Reasoning(t) | Piece::Content(t) if t.is_empty() => {}
        _ => out.push(piece),
    }
}

/// The length of the longest suffix of `text` that is a proper prefix of `marker` (text held
/// back while streaming, in case the marker completes; also used for tool-call triggers).
pub(crate) fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&n| {
            text.len() >= n && text.is_char_boundary(text.len() - n) && text.ends_with(&marker[..n])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_outputs_split() {
        assert_eq!(
            ThinkSplitter::split("", "<think>\nHmm, 2+2.\n</think>\n\nIt is 4."),
            ("Hmm, 2+2.".into(), "It is 4.".into())
        );
        assert_eq!(
            ThinkSplitter::split("", "It is 4."),
            (String::new(), "It is 4.".into())
        );
        // The prompt opened the block.
        assert_eq!(
            ThinkSplitter::split("<|im_start|>assistant\n<think>\n", "a</think>b"),
            ("a".into(), "b".into())
        );
        // Never closed: all of it is thinking.
        assert_eq!(
            ThinkSplitter::split("", "<think>still going"),
            ("still going".into(), String::new())
        );
        // A tag later in the answer is content.
        assert_eq!(
            ThinkSplitter::split("", "Use <think> tags."),
            (String::new(), "Use <think> tags.".into())
        );
    }

    #[test]
    fn any_split_of_the_stream_gives_the_same_result() {
        let text = "  <think>I should say hi.</think>\nHi <b>there</b>!";
        let whole = ThinkSplitter::split("", text);
        for cut in 0..text.len() {
            for cut2 in cut..text.len() {
                let mut s = ThinkSplitter::new("");
                let mut pieces = s.push(&text[..cut]);
                pieces.extend(s.push(&text[cut..cut2]));
                pieces.extend(s.push(&text[cut2..]));
                pieces.extend(s.finish());
                let (mut r, mut c) = (String::new(), String::new());
                for p in pieces {
                    match p {
                        Piece::Reasoning(t) => r.push_str(&t),
                        Piece::Content(t) => c.push_str(&t),
                    }
                }
                assert_eq!((r.trim_end().to_string(), c), whole, "cuts {cut} {cut2}");
            }
        }
    }

    /// The pieces of `parts` pushed one after another, runs of the same kind joined, as
    /// (is reasoning, text).
    fn split_all(parts: &[&str]) -> Vec<(bool, String)> {
        let mut s = ThinkSplitter::new("");
        let mut pieces: Vec<Piece> = parts.iter().flat_map(|p| s.push(p)).collect();
        pieces.extend(s.finish());
        let mut out: Vec<(bool, String)> = Vec::new();
        for p in pieces {
            let (reasoning, text) = match p {
                Piece::Reasoning(t) => (true, t),
                Piece::Content(t) => (false, t),
            };
            match out.last_mut() {
                Some((r, t)) if *r == reasoning => t.push_str(&text),
                _ => out.push((reasoning, text)),
            }
        }
        out
    }

    /// The terminal chat's cases (it reads the split from the server since it lost its own
    /// splitter): the same pieces whole, one character at a time, and cut anywhere in two.
    #[test]
    fn the_split_does_not_depend_on_how_the_output_streams() {
        let cases: [(&str, &[(bool, &str)]); 5] = [
            (
                "<think>\nhmm, 2+2</think>\n\nIt is 4.",
                &[(true, "hmm, 2+2"), (false, "It is 4.")],
            ),
            ("  <think>a < b</thin", &[(true, "a < b</thin")]),
            (
                "No <think> here</think>",
                &[(false, "No <think> here</think>")],
            ),
            ("<thin", &[(false, "<thin")]),
            ("<think></think>", &[]),
        ];
        for (text, expected) in cases {
            let expected: Vec<(bool, String)> =
                expected.iter().map(|(r, t)| (*r, t.to_string())).collect();
            assert_eq!(split_all(&[text]), expected, "{text:?}");
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
            assert_eq!(split_all(&chars), expected, "{text:?} by character");
            for cut in 0..text.len() {
                assert_eq!(
                    split_all(&[&text[..cut], &text[cut..]]),
                    expected,
                    "{text:?} cut at {cut}"
                );
            }
        }
    }
}
