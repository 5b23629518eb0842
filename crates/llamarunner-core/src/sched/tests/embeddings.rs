//! Embeddings on the engine loop: pieces between decode steps, never waiting for a slot.

use super::*;

#[test]
fn embeddings_share_the_loop_and_never_crash_on_long_input() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 32,
            ..FakeConfig::default()
        },
        1,
    );
    // Beside a running completion.
    let mut running = h.submit("gen", params_with(|p| p.num_predict = 20));
    let e = embed(&h, "hello", false).unwrap();
    assert_eq!(e.prompt_eval_count, 6);
    assert_eq!(e.vector.len(), 8);
    assert_eq!(embed(&h, "hello", false).unwrap(), e, "deterministic");
    let (_, done) = collect(&mut running);
    assert_eq!(done.eval_count, 20);
    // Too long: an error, or truncated when asked.
    let long = "x".repeat(100);
    let err = embed(&h, &long, false).unwrap_err();
    assert_eq!(err.kind, EngineErrorKind::ContextLength);
    let cut = embed(&h, &long, true).unwrap();
    assert!(cut.truncated);
    assert_eq!(cut.prompt_eval_count, 32);
}

#[test]
fn embeddings_never_wait_for_a_generation_slot() {
    let slow = FakeConfig {
        decode_delay: Duration::from_millis(2),
        ..FakeConfig::default()
    };
    let h = Harness::new(slow, 1);
    let mut running = h.submit("busy", greedy(-1));
    assert_eq!(
        recv_within(&mut running, Duration::from_secs(5)),
        Event::Started { cached: 0 }
    );
    // A queued completion too: the embedding must not wait behind it either.
    let mut queued = h.submit("waiting", greedy(1));
    // The running request never ends on its own (num_predict -1) and holds the only slot, so
    // an embedding that waited for a slot would never be answered (`embed` blocks).
    let e = embed(&h, "hello", false).unwrap();
    assert_eq!(e.prompt_eval_count, 6);
    // Answered while the generation was still running and the queued one still waiting.
    loop {
        match running.try_recv() {
            Ok(Event::Text { .. }) => {}
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => break,
            other => panic!("the running generation ended before the embedding: {other:?}"),
        }
    }
    assert!(
        matches!(
            queued.try_recv(),
            Err(tokio::sync::mpsc::error::TryRecvError::Empty)
        ),
        "the queued request got a slot before the embedding was answered"
    );
}

#[test]
fn a_long_embedding_is_decoded_in_pieces_between_decode_steps() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 256,
            embed_piece: 8,
            decode_delay: Duration::from_millis(1),
            ..FakeConfig::default()
        },
        1,
    );
    let mut running = h.submit("gen", params_with(|p| p.num_predict = 400));
    assert_eq!(
        recv_within(&mut running, Duration::from_secs(5)),
        Event::Started { cached: 0 }
    );
    let steps_before = h.log.lock().unwrap().len();
    let long = "y".repeat(99); // BOS + 99 = 100 tokens: 13 pieces of at most 8
    let e = embed(&h, &long, false).unwrap();
    let steps_after = h.log.lock().unwrap().len();
    assert_eq!(e.prompt_eval_count, 100);
    let pieces = h.embed_log.lock().unwrap().clone();
    assert_eq!(pieces.iter().sum::<usize>(), 100);
    assert!(pieces.iter().all(|&n| n <= 8), "{pieces:?}");
    // The generation kept stepping while the embedding was decoded, a step per piece.
    assert!(
        steps_after - steps_before >= pieces.len() - 1,
        "{} decode steps during {} pieces",
        steps_after - steps_before,
        pieces.len()
    );
    // The same vector as an input decoded in one piece.
    let one = Harness::new(
        FakeConfig {
            slot_ctx: 256,
            embed_piece: 1000,
            ..FakeConfig::default()
        },
        1,
    );
    assert_eq!(embed(&one, &long, false).unwrap(), e);
    loop {
        match running.blocking_recv().expect("Done") {
            Event::Done(done) => {
                assert_eq!(done.eval_count, 400);
                break;
            }
            Event::Text { .. } => {}
            other => panic!("{other:?}"),
        }
    }
}
