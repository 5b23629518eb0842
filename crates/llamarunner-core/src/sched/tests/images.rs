//! Images in the loop, against the fake backend: an image's positions hold synthetic ids
//! derived from its hash (`protocol::vision`), the fake's next token depends on them as on text,
//! and its KV bookkeeping asserts that no cut or shift ever falls inside an image.

use super::*;
use crate::backend::fake::FakeVision;
use crate::protocol::vision::{is_image_token, ImageInput, VisionModel};
use crate::protocol::{Input, PromptImage, SlotAction};

/// Positions each fake image takes.
const POSITIONS: usize = 6;

fn image(key: u8) -> ImageInput {
    ImageInput {
        width: 1,
        height: 1,
        rgb: Arc::from(vec![key; 3]),
        hash: [key; 32],
    }
}

/// `text` (with `<__media__>` markers) and images `keys`, tokenized as the HTTP side does.
fn tokenize(text: &str, keys: &[u8]) -> (Vec<Token>, Vec<PromptImage>) {
    let images: Vec<ImageInput> = keys.iter().map(|&k| image(k)).collect();
    FakeVision {
        positions: POSITIONS,
        max_positions: 32,
    }
    .tokenize(text, &images)
    .expect("the fake projector tokenizes")
}

/// What the fake generates greedily after `tokens`, computed without the scheduler.
fn expected_after(tokens: &[Token], n: usize) -> String {
    let mut history = tokens.to_vec();
    let mut out = String::new();
    for _ in 0..n {
        let t = FakeBackend::next_token(&history, 0);
        out.push(char::from(u8::try_from(t).unwrap()));
        history.push(t);
    }
    out
}

impl Harness {
    fn submit_tokens(
        &self,
        tokens: Vec<Token>,
        images: Vec<PromptImage>,
        params: SamplingParams,
    ) -> Receiver<Event> {
        let (tx, rx) = crate::protocol::EventSink::channel();
        self.handle
            .submit(Request {
                id: "test-image".into(),
                prompt: Input::Tokens(tokens),
                params,
                truncated: false,
                events: tx,
                received: Instant::now(),
                deadline: None,
                images,
            })
            .expect("queue has room");
        rx
    }

    fn images_decoded(&self) -> Vec<(i32, usize, usize)> {
        self.image_log.lock().unwrap().clone()
    }
}

/// The error a request ends with.
fn error_of(rx: &mut Receiver<Event>) -> crate::protocol::EngineError {
    loop {
        match rx.blocking_recv().expect("an event") {
            Event::Error(e) => return e,
            Event::Started { .. } | Event::Progress(_) | Event::Text { .. } => {}
            Event::Done(d) => panic!("expected an error, got {d:?}"),
        }
    }
}

#[test]
fn an_image_is_decoded_whole_on_its_own_and_the_answer_depends_on_it() {
    let h = Harness::new(FakeConfig::default(), 1);
    let (t1, im1) = tokenize("look <__media__> at it", &[1]);
    let (t2, _) = tokenize("look <__media__> at it", &[2]);
    // The reference tells the images apart, so the check below could fail.
    assert_ne!(expected_after(&t1, 12), expected_after(&t2, 12));
    let (text, done) = collect(&mut h.submit_tokens(t1.clone(), im1, greedy(12)));
    assert_eq!(text, expected_after(&t1, 12));
    assert_eq!(done.prompt_eval_count, t1.len(), "image positions count");
    // BOS + "look " is 6 tokens: the image takes positions 6..12, in one decode of its own.
    assert_eq!(h.images_decoded(), vec![(0, 6, POSITIONS)]);
    for batch in h.log.lock().unwrap().iter() {
        assert!(batch.iter().all(|t| !is_image_token(t.token)), "{batch:?}");
    }
}

#[test]
fn a_sequence_with_an_image_batches_beside_text_only_ones() {
    let h = Harness::new(
        FakeConfig {
            decode_delay: Duration::from_micros(300),
            ..FakeConfig::default()
        },
        2,
    );
    let mut text_rx = h.submit("generating already", greedy(40));
    // Let the text sequence start generating first.
    assert!(matches!(
        text_rx.blocking_recv(),
        Some(Event::Started { .. })
    ));
    let (tokens, images) = tokenize("q <__media__> what is it?", &[3]);
    let (text, _) = collect(&mut h.submit_tokens(tokens.clone(), images, greedy(10)));
    assert_eq!(text, expected_after(&tokens, 10));
    let mut rest = String::new();
    loop {
        match text_rx.blocking_recv().expect("events") {
            Event::Text { text, .. } => rest.push_str(&text),
            Event::Done(_) => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(rest, expected("generating already", 40));
    let log = h.log.lock().unwrap();
    // The image decode (an empty entry in the batch log) came between batches that carried
    // the generating sequence's tokens.
    let at = log.iter().position(Vec::is_empty).expect("an image decode");
    let has_seq0 = |b: &Vec<BatchToken>| b.iter().any(|t| t.seq == 0);
    assert!(log[..at].iter().any(has_seq0) && log[at + 1..].iter().any(has_seq0));
    // And both sequences shared batches.
    assert!(log
        .iter()
        .any(|b| has_seq0(b) && b.iter().any(|t| t.seq == 1)));
}

#[test]
fn a_follow_up_turn_reuses_the_cached_image_and_another_image_does_not() {
    let h = Harness::new(FakeConfig::default(), 1);
    let first = "user: <__media__> describe\nassistant:";
    let (t1, im1) = tokenize(first, &[4]);
    let (answer, _) = collect(&mut h.submit_tokens(t1.clone(), im1, greedy(8)));
    assert_eq!(h.images_decoded().len(), 1);
    let follow = format!("{first}{answer}\nuser: more\nassistant:");
    let (t2, im2) = tokenize(&follow, &[4]);
    let (text, done) = collect(&mut h.submit_tokens(t2.clone(), im2, greedy(8)));
    assert_eq!(text, expected_after(&t2, 8));
    assert!(done.prompt_cached_count >= t1.len(), "{done:?}");
    assert_eq!(
        h.images_decoded().len(),
        1,
        "the image was not encoded again"
    );
    // Another image at the same place: the cache is reused up to the image's start only.
    let (t3, im3) = tokenize(first, &[5]);
    let (text, done) = collect(&mut h.submit_tokens(t3.clone(), im3, greedy(8)));
    assert_eq!(text, expected_after(&t3, 8));
    let start = t3.iter().position(|&t| is_image_token(t)).unwrap();
    assert_eq!(done.prompt_cached_count, start);
    assert_eq!(h.images_decoded().last(), Some(&(0, start, POSITIONS)));
}

#[test]
fn context_shift_never_cuts_an_image_and_reprocessing_decodes_it_again() {
    // keep = num_keep + BOS. With num_keep 3 the kept head would end inside the image
    // (positions 3..9): the image is discarded whole. With num_keep 9 it is kept whole, and
    // a cache that cannot shift decodes it again. The fake asserts every cut and shift.
    for (num_keep, can_shift) in [(3, true), (3, false), (9, true), (9, false), (0, true)] {
        let h = Harness::new(
            FakeConfig {
                slot_ctx: 32,
                can_shift,
                ..FakeConfig::default()
            },
            1,
        );
        let (tokens, images) = tokenize("ab<__media__>cd", &[6]);
        let params = SamplingParams {
            num_keep,
            ..greedy(70)
        };
        let (_, done) = collect(&mut h.submit_tokens(tokens, images, params));
        assert_eq!(done.eval_count, 70, "num_keep {num_keep} shift {can_shift}");
        let decoded = h.images_decoded().len();
        if num_keep == 9 && !can_shift {
            assert!(
                decoded > 1,
                "the kept image is decoded again after each reprocess"
            );
        } else {
            assert_eq!(decoded, 1, "num_keep {num_keep} shift {can_shift}");
        }
    }
}

#[test]
fn a_prompt_may_end_with_an_image_and_answers_from_its_last_position() {
    let h = Harness::new(FakeConfig::default(), 2);
    for (text, keys) in [
        ("a<__media__>", &[9u8][..]),
        ("<__media__>", &[9]),
        ("<__media__><__media__>", &[9, 10]),
    ] {
        let (tokens, images) = tokenize(text, keys);
        let (out, done) = collect(&mut h.submit_tokens(tokens.clone(), images.clone(), greedy(5)));
        assert_eq!(out, expected_after(&tokens, 5), "{text}");
        assert_eq!(done.prompt_eval_count, tokens.len());
        // Again: the whole prompt is cached, and the image is decoded again for its logits.
        let before = h.images_decoded().len();
        let (again, done) = collect(&mut h.submit_tokens(tokens.clone(), images, greedy(5)));
        assert_eq!(again, out);
        assert_eq!(done.prompt_cached_count, tokens.len() - POSITIONS);
        assert_eq!(h.images_decoded().len(), before + 1);
    }
}

#[test]
fn truncation_drops_an_image_whole() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 24,
            ..FakeConfig::default()
        },
        1,
    );
    let text = format!("ab{}<__media__>{}", "c".repeat(6), "d".repeat(20));
    let (tokens, images) = tokenize(&text, &[7]);
    let params = SamplingParams {
        num_keep: 4,
        ..greedy(3)
    };
    let (_, done) = collect(&mut h.submit_tokens(tokens, images, params));
    assert!(done.truncated);
    assert!(done.prompt_eval_count < 24);
    assert!(
        h.images_decoded().is_empty(),
        "the cut took the image whole"
    );
}

#[test]
fn cancelling_a_sequence_with_an_image_frees_its_slot() {
    let h = Harness::new(
        FakeConfig {
            decode_delay: Duration::from_millis(5),
            ..FakeConfig::default()
        },
        1,
    );
    let (tokens, images) = tokenize(&format!("{}<__media__>x", "p".repeat(40)), &[8]);
    let mut rx = h.submit_tokens(tokens, images, greedy(50));
    assert!(matches!(rx.blocking_recv(), Some(Event::Started { .. })));
    drop(rx);
    let (text, _) = collect(&mut h.submit("next", greedy(4)));
    assert_eq!(text, expected("next", 4));
    assert!(!h.settled()[0].busy);
}

#[test]
fn images_the_engine_cannot_serve_are_refused_and_a_slot_with_one_is_not_saved() {
    let h = Harness::new(FakeConfig::default(), 1);
    // Image positions without their image.
    let (tokens, _) = tokenize("a<__media__>b", &[9]);
    let e = error_of(&mut h.submit_tokens(tokens, Vec::new(), greedy(2)));
    assert_eq!(e.kind, EngineErrorKind::InvalidRequest);
    // A served image: its slot cannot go to a slot file.
    let (tokens, images) = tokenize("a<__media__>b", &[9]);
    collect(&mut h.submit_tokens(tokens, images, greedy(2)));
    let e = h.slot(0, SlotAction::Save).unwrap_err();
    assert!(e.message.contains("image"), "{e}");
    // Once erased, it can.
    h.slot(0, SlotAction::Erase).unwrap();
    assert!(h.slot(0, SlotAction::Save).is_ok());
}

#[test]
fn a_shared_prefix_with_an_image_is_forked_whole_in_multiuser_mode() {
    let h = Harness::with_scheduler(FakeConfig::default(), 2, 64, |s| {
        s.with_multiuser_cache(true)
    });
    let (a, images_a) = tokenize(
        "system: you are a careful assistant who looks at images <__media__> first question",
        &[11],
    );
    let (text_a, _) = collect(&mut h.submit_tokens(a.clone(), images_a, greedy(6)));
    assert_eq!(text_a, expected_after(&a, 6));
    // Another question about the same image: its prefix (through the image) is forked from
    // slot 0, which holds more than that prefix, into the other slot.
    let (b, images_b) = tokenize(
        "system: you are a careful assistant who looks at images <__media__> other question",
        &[11],
    );
    let (text_b, done) = collect(&mut h.submit_tokens(b.clone(), images_b, greedy(6)));
    assert_eq!(text_b, expected_after(&b, 6));
    let image_end = b.iter().rposition(|&t| is_image_token(t)).unwrap() + 1;
    assert!(done.prompt_cached_count >= image_end, "{done:?}");
    assert_eq!(h.forks.lock().unwrap().len(), 1);
    assert_eq!(
        h.images_decoded().len(),
        1,
        "the forked image was not decoded again"
    );
}

#[test]
fn a_failed_image_decode_ends_that_sequence_only_and_frees_its_slot() {
    // Decode 1 is the prompt's BOS, decode 2 the image: it fails.
    let h = Harness::new(
        FakeConfig {
            fail_decode: Some(2),
            ..FakeConfig::default()
        },
        1,
    );
    let (tokens, images) = tokenize("<__media__>x", &[12]);
    let e = error_of(&mut h.submit_tokens(tokens, images, greedy(3)));
    assert_eq!(e.kind, EngineErrorKind::Internal);
    assert!(e.message.contains("image"), "{e}");
    let (text, _) = collect(&mut h.submit("after", greedy(3)));
    assert_eq!(text, expected("after", 3));
}

#[test]
fn in_a_shared_cache_an_image_gets_the_idle_slots_cells_it_needs() {
    // 24 cells for two slots. A finished conversation keeps 20 of them in its idle slot: an
    // image of 6 positions fits only once they go (one free cell for a text token is not
    // room for it). Multi-user (the server's default): the new conversation takes the other
    // slot, so the idle one keeps its cells until they are needed.
    let h = Harness::with_scheduler(
        FakeConfig {
            slot_ctx: 24,
            shared_cells: Some(24),
            ..FakeConfig::default()
        },
        2,
        64,
        |s| s.with_multiuser_cache(true),
    );
    let (_, done) = collect(&mut h.submit(&"a".repeat(16), greedy(4)));
    assert_eq!(done.eval_count, 4);
    let (tokens, images) = tokenize("<__media__> x", &[5]);
    let mut rx = h.submit_tokens(tokens.clone(), images, greedy(3));
    let mut text = String::new();
    loop {
        match recv_within(&mut rx, Duration::from_secs(5)) {
            Event::Text { text: t, .. } => text.push_str(&t),
            Event::Done(_) => break,
            Event::Started { .. } | Event::Progress(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(text, expected_after(&tokens, 3));
}
