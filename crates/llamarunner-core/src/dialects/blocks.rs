//! A streamed chat answer as blocks, for the dialects that stream one that way (Anthropic's
//! content blocks, the Responses API's output items): reasoning and text each in a block that
//! its first piece opens, deltas fill and another kind of piece (or the end) closes; each tool
//! call a whole block of its own. `Blocks` decides the steps; each dialect writes its events
//! for them.

use crate::chat::tools::ToolCall;
use crate::requests::tool_calls::OutPiece;

/// What a text block holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The model's thinking.
    Reasoning,
    /// The answer's text.
    Text,
}

/// One step of the answer's blocks.
#[derive(Debug, PartialEq)]
pub enum Step {
    /// A block of this kind opens.
    Open(Kind),
    /// Text for the open block.
    Delta(Kind, String),
    /// The open block closes, with its whole text.
    Close(Kind, String),
    /// A tool call, a block of its own (any open block closed before it).
    Call(ToolCall),
}

/// The open block, if any, and its text so far.
#[derive(Debug, Default)]
pub struct Blocks {
    open: Option<(Kind, String)>,
}

impl Blocks {
    /// The steps of the answer's next piece. Empty text opens nothing.
    pub fn piece(&mut self, piece: OutPiece) -> Vec<Step> {
        let mut steps = Vec::new();
        match piece {
            OutPiece::Reasoning(t) => self.text(Kind::Reasoning, t, &mut steps),
            OutPiece::Content(t) if t.is_empty() => {}
            OutPiece::Content(t) => self.text(Kind::Text, t, &mut steps),
            OutPiece::Calls(calls) => {
                self.close_into(&mut steps);
                steps.extend(calls.into_iter().map(Step::Call));
            }
        }
        steps
    }

    /// The step that closes the open block, if one is open (at the end of the answer).
    pub fn close(&mut self) -> Option<Step> {
        self.open.take().map(|(kind, text)| Step::Close(kind, text))
    }

    fn text(&mut self, kind: Kind, t: String, steps: &mut Vec<Step>) {
        if self.open.as_ref().map(|(k, _)| *k) != Some(kind) {
            self.close_into(steps);
            steps.push(Step::Open(kind));
            self.open = Some((kind, String::new()));
        }
        if let Some((_, text)) = &mut self.open {
            text.push_str(&t);
        }
        steps.push(Step::Delta(kind, t));
    }

    fn close_into(&mut self, steps: &mut Vec<Step>) {
        steps.extend(self.close());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: serde_json::json!({}),
        }
    }

    #[test]
    fn blocks_open_fill_and_close_by_kind() {
        let mut b = Blocks::default();
        let mut steps = Vec::new();
        for piece in [
            OutPiece::Reasoning("hm".into()),
            OutPiece::Reasoning("m".into()),
            OutPiece::Content(String::new()),
            OutPiece::Content("Hi".into()),
            OutPiece::Content("!".into()),
            OutPiece::Calls(vec![call("a"), call("b")]),
            OutPiece::Calls(vec![]),
            OutPiece::Content("after".into()),
        ] {
            steps.extend(b.piece(piece));
        }
        steps.extend(b.close());
        assert_eq!(b.close(), None);
        use Kind::{Reasoning, Text};
        assert_eq!(
            steps,
            vec![
                Step::Open(Reasoning),
                Step::Delta(Reasoning, "hm".into()),
                Step::Delta(Reasoning, "m".into()),
                Step::Close(Reasoning, "hmm".into()),
                Step::Open(Text),
                Step::Delta(Text, "Hi".into()),
                Step::Delta(Text, "!".into()),
                Step::Close(Text, "Hi!".into()),
                Step::Call(call("a")),
                Step::Call(call("b")),
                Step::Open(Text),
                Step::Delta(Text, "after".into()),
                Step::Close(Text, "after".into()),
            ]
        );
    }
}
