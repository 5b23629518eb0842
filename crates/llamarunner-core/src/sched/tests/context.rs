//! A slot's context: prompts truncated or refused, a full slot shifted or ended, and what
//! the cache holds after a shift.

use super::*;

#[test]
fn a_full_slot_ends_with_length() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 20,
            ..FakeConfig::default()
        },
        1,
    );
    let params = params_with(|p| p.shift = false);
    let (text, done) = collect(&mut h.submit("hello", params));
    assert_eq!(done.done_reason, DoneReason::Length);
    // 6 prompt tokens + 14 decoded generated tokens fill 20 cells; the 15th is sampled last.
    assert_eq!(done.eval_count, 15);
    assert_eq!(text.len(), 15);
}

#[test]
fn too_long_prompt_is_a_context_length_error_and_the_slot_survives() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 8,
            ..FakeConfig::default()
        },
        1,
    );
    let params = params_with(|p| p.truncate = false);
    let mut rx = h.submit("much too long", params);
    match rx.blocking_recv() {
        Some(Event::Error(e)) => {
            assert_eq!(e.kind, EngineErrorKind::ContextLength);
            assert!(
                e.message.contains("exceeds the context length"),
                "{}",
                e.message
            );
        }
        other => panic!("expected an error, got {other:?}"),
    }
    let (_, done) = collect(&mut h.submit("ok", greedy(3)));
    assert_eq!(done.eval_count, 3);
}

#[test]
fn long_prompt_is_truncated_keeping_num_keep_and_the_tail() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 64,
            ..FakeConfig::default()
        },
        1,
    );
    let prompt: String = (0..100)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let params = params_with(|p| {
        p.num_keep = 4;
        p.num_predict = 3;
    });
    let (_, done) = collect(&mut h.submit(&prompt, params));
    assert!(done.truncated);
    assert!(done.prompt_eval_count < 64);
    assert_eq!(done.eval_count, 3);
    // The fake's KV holds BOS + the first 4 bytes, then a contiguous tail of the prompt.
    let log = h.log.lock().unwrap();
    let decoded: Vec<Token> = log.iter().flatten().map(|t| t.token).collect();
    assert_eq!(&decoded[..5], &[BOS, 97, 98, 99, 100]);
    assert_eq!(
        decoded[done.prompt_eval_count - 1],
        Token::from(prompt.as_bytes()[99])
    );
}

#[test]
fn long_prompt_without_truncate_is_rejected() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 16,
            ..FakeConfig::default()
        },
        1,
    );
    let params = params_with(|p| p.truncate = false);
    match h.submit(&"x".repeat(40), params).blocking_recv() {
        Some(Event::Error(e)) => assert_eq!(e.kind, EngineErrorKind::ContextLength),
        other => panic!("{other:?}"),
    }
}

#[test]
fn full_slot_shifts_and_keeps_generating() {
    for can_shift in [true, false] {
        let h = Harness::new(
            FakeConfig {
                slot_ctx: 32,
                can_shift,
                ..FakeConfig::default()
            },
            1,
        );
        let params = params_with(|p| {
            p.num_predict = 200;
            p.num_keep = 2;
        });
        let (text, done) = collect(&mut h.submit("shifty", params));
        assert_eq!(done.eval_count, 200, "can_shift={can_shift}");
        assert_eq!(done.done_reason, DoneReason::Length);
        assert_eq!(text.len(), 200);
        // The kept prefix (BOS + "sh") stays at the start of the slot whatever happened.
        let log = h.log.lock().unwrap();
        let first = &log[0];
        assert_eq!(first[0].token, BOS);
        for batch in log.iter() {
            assert!(batch.iter().all(|t| (t.pos as usize) < 32));
        }
    }
}

#[test]
fn full_slot_without_shift_ends_with_length() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 32,
            ..FakeConfig::default()
        },
        1,
    );
    let params = params_with(|p| {
        p.shift = false;
        p.num_predict = 200;
    });
    let (_, done) = collect(&mut h.submit("shifty", params));
    assert_eq!(done.done_reason, DoneReason::Length);
    assert_eq!(done.prompt_eval_count + done.eval_count, 33);
}

#[test]
fn unlimited_generation_stops_at_ten_contexts() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 16,
            ..FakeConfig::default()
        },
        1,
    );
    let (_, done) = collect(&mut h.submit("loop", greedy(-1)));
    assert_eq!(done.done_reason, DoneReason::Length);
    assert_eq!(done.eval_count, 160);
}

#[test]
fn after_a_context_shift_a_stop_string_leaves_the_cache_at_the_returned_text() {
    // Generate past two shifts, then stop at a string found later in the output. The cache
    // must then hold one token more than a twin run that ended (by num_predict) right before
    // the stop string: the returned tokens, with the stop string's tokens trimmed.
    let config = FakeConfig {
        slot_ctx: 16,
        ..FakeConfig::default()
    };
    let keep2 = |n| {
        params_with(|p| {
            p.temperature = 0.0;
            p.num_predict = n;
            p.num_keep = 2;
        })
    };
    let h = Harness::new(config.clone(), 1);
    let (full, _) = collect(&mut h.submit("shift", keep2(40)));
    drop(h);
    let at = 30;
    let stop = full[at..at + 3].to_string();
    let cut = full.find(&stop).unwrap();
    assert!(
        cut > 20,
        "the stop string must come after a shift: {full} {stop}"
    );
    let h = Harness::new(config.clone(), 1);
    let params = SamplingParams {
        stop: vec![stop],
        ..keep2(40)
    };
    let (text, done) = collect(&mut h.submit("shift", params));
    assert_eq!(
        (text.as_str(), done.done_reason),
        (&full[..cut], DoneReason::Stop)
    );
    let with_stop = h.settled()[0].cached_tokens;
    drop(h);
    let twin = Harness::new(config, 1);
    let (_, d) = collect(&mut twin.submit("shift", keep2(i64::try_from(cut).unwrap())));
    assert_eq!(d.done_reason, DoneReason::Length);
    let without = twin.settled()[0].cached_tokens;
    assert_eq!(with_stop, without + 1);
}
