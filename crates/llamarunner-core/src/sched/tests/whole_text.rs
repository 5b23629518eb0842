//! A client that takes the whole text at the end (`TextHold`, a response that is not streamed)
//! gets it in large pieces, the same text and log-probabilities as a stream, and a client that
//! left while its text was held frees its slot at once.

use super::*;
use crate::protocol::TextHold;
use crate::sched::output::WHOLE_TEXT_PIECE;

impl Harness {
    /// Submits a request whose client takes the whole text at the end (said before the engine
    /// sees it, as `collect` says it once the request has a slot).
    fn submit_whole(&self, prompt: &str, params: SamplingParams) -> Receiver<Event> {
        let (tx, rx) = crate::protocol::EventSink::channel();
        let hold: TextHold = tx.text_hold();
        hold.whole();
        self.submit_to(tx, prompt, params, None)
            .expect("queue has room");
        rx
    }
}

/// Reads a request to its end: the text events' (text, log-probability entries), and Done.
fn read_all(rx: &mut Receiver<Event>) -> (Vec<(String, usize)>, Completion) {
    assert!(matches!(rx.blocking_recv(), Some(Event::Started { .. })));
    let mut pieces = Vec::new();
    loop {
        match rx.blocking_recv().expect("the stream ended without Done") {
            Event::Text { text, logprobs } => pieces.push((text, logprobs.len())),
            Event::Done(c) => return (pieces, c),
            other => panic!("unexpected event {other:?}"),
        }
    }
}

#[test]
fn the_whole_text_comes_in_large_pieces_and_is_the_streamed_text() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 16_384,
            ..FakeConfig::default()
        },
        2,
    );
    let n = 10_000;
    for logprobs in [None, Some(2)] {
        let params = params_with(|p| {
            p.num_predict = n as i64;
            p.logprobs = logprobs;
        });
        let (streamed, done) = read_all(&mut h.submit("whole", params.clone()));
        let (whole, done_whole) = read_all(&mut h.submit_whole("whole", params));
        let text =
            |pieces: &[(String, usize)]| pieces.iter().map(|p| p.0.as_str()).collect::<String>();
        let entries = |pieces: &[(String, usize)]| pieces.iter().map(|p| p.1).sum::<usize>();
        assert_eq!(text(&whole), text(&streamed), "logprobs {logprobs:?}");
        assert_eq!(text(&whole), expected("whole", n));
        assert_eq!(entries(&whole), entries(&streamed));
        assert_eq!(entries(&whole), if logprobs.is_some() { n } else { 0 });
        assert_eq!(done_whole.eval_count, done.eval_count);
        // A stream gets a piece per step; the whole text comes in pieces of at least a
        // quarter of the outbox's cap (bytes, or log-probability entries), then the rest.
        assert!(streamed.len() > n / 2, "{} stream pieces", streamed.len());
        let piece = match logprobs {
            None => WHOLE_TEXT_PIECE.0,
            Some(_) => WHOLE_TEXT_PIECE.1,
        };
        assert!(
            whole.len() <= n / piece + 1,
            "{} pieces for {n} one-byte tokens (pieces of {piece})",
            whole.len()
        );
        for (text, entries) in &whole[..whole.len() - 1] {
            assert!(text.len() >= WHOLE_TEXT_PIECE.0 || *entries >= WHOLE_TEXT_PIECE.1);
        }
    }
}

#[test]
fn a_client_that_left_while_its_text_was_held_frees_its_slot_at_once() {
    // A millisecond a step: the next piece would be offered some four seconds on.
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 16_384,
            decode_delay: Duration::from_millis(1),
            ..FakeConfig::default()
        },
        1,
    );
    let mut rx = h.submit_whole("gone", params_with(|p| p.num_predict = 12_000));
    assert!(matches!(rx.blocking_recv(), Some(Event::Started { .. })));
    let steps = || h.log.lock().unwrap().len();
    let before = steps();
    drop(rx);
    h.settled();
    // Noticed at the next turn (`drop_cancelled`), not when the next piece of text is offered
    // (at WHOLE_TEXT_PIECE bytes, thousands of steps later), nor at the end.
    let after = steps() - before;
    assert!(after < 500, "{after} steps after the client left");
    // The slot serves the next request.
    let (text, _) = collect(&mut h.submit("next", greedy(3)));
    assert_eq!(text, expected("next", 3));
}

#[test]
fn tokens_that_render_to_nothing_at_the_end_keep_their_log_probabilities() {
    // The fake's EOS renders to no bytes; under ignore_eos it is generated from the 6th
    // position of the history on: "ab" gives three letters, then EOS to the end.
    let h = Harness::new(
        FakeConfig {
            eos_at: Some(6),
            ..FakeConfig::default()
        },
        1,
    );
    let params = params_with(|p| {
        p.num_predict = 8;
        p.ignore_eos = true;
        p.logprobs = Some(1);
    });
    let (streamed, done) = read_all(&mut h.submit("ab", params.clone()));
    let (whole, _) = read_all(&mut h.submit_whole("ab", params));
    assert_eq!(done.eval_count, 8);
    for pieces in [&streamed, &whole] {
        let entries: usize = pieces.iter().map(|p| p.1).sum();
        assert_eq!(entries, 8, "one entry per generated token: {pieces:?}");
    }
}
