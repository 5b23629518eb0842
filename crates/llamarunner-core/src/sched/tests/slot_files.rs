//! Slot save, restore and erase (`POST /slots/{id}`), and the slot table.

use super::*;

use crate::protocol::{SlotAction, SlotOutcome, SlotPhase};

/// Saves slot `slot` and returns its tokens and state.
fn save(h: &Harness, slot: usize) -> (Vec<Token>, Vec<u8>) {
    match h.slot(slot, SlotAction::Save) {
        Ok(SlotOutcome::Saved { tokens, state, .. }) => (tokens, state),
        other => panic!("save failed: {other:?}"),
    }
}

#[test]
fn a_restored_slot_serves_the_same_prefix_from_its_cache_after_a_restart() {
    let prompt = "a long system prompt, then a question";
    let first = Harness::new(FakeConfig::default(), 2);
    let (text, done) = collect(&mut first.submit(prompt, greedy(6)));
    assert_eq!(done.prompt_cached_count, 0);
    let cached = first.settled_slot(0).cached_tokens;
    let (tokens, state) = save(&first, 0);
    // The cache holds the prompt (with BOS) and every generated token but the last.
    assert_eq!(tokens.len(), cached);
    assert_eq!(tokens.len(), 1 + prompt.len() + 5);
    assert_eq!(tokens[0], BOS);
    drop(first);

    // A new engine (a restarted server): restore into slot 1, so that reuse proves the
    // restore (slot 0 is as empty as slot 1 was).
    let second = Harness::new(FakeConfig::default(), 2);
    let n = tokens.len();
    assert_eq!(
        second.slot(
            1,
            SlotAction::Restore {
                tokens,
                state,
                lora: LoraScales::base(),
            }
        ),
        Ok(SlotOutcome::Restored(n))
    );
    assert_eq!(second.settled_slot(1).cached_tokens, n);
    let (again, done) = collect(&mut second.submit(prompt, greedy(6)));
    // Every prompt token but the last (re-decoded for logits) came from the restored cache,
    // and the fake's output, a hash of the KV it holds, is the same.
    assert_eq!(done.prompt_cached_count, done.prompt_eval_count - 1);
    assert_eq!(done.prompt_eval_count, 1 + prompt.len());
    assert_eq!(again, text);
    // A longer prompt that starts with the saved one reuses all of it.
    let longer = format!("{prompt}{text} and more");
    let (_, done) = collect(&mut second.submit(&longer, greedy(2)));
    assert_eq!(done.prompt_cached_count, n);
}

#[test]
fn erase_empties_the_slot_so_nothing_is_reused() {
    let h = Harness::new(FakeConfig::default(), 1);
    let (_, _) = collect(&mut h.submit("erase me", greedy(3)));
    let cached = h.settled_slot(0).cached_tokens;
    assert!(cached > 0);
    assert_eq!(
        h.slot(0, SlotAction::Erase),
        Ok(SlotOutcome::Erased(cached))
    );
    assert_eq!(h.settled_slot(0).cached_tokens, 0);
    let (text, done) = collect(&mut h.submit("erase me", greedy(3)));
    assert_eq!(done.prompt_cached_count, 0);
    assert_eq!(text, expected("erase me", 3));
    let (tokens, state) = save(&h, 0);
    assert!(!tokens.is_empty() && state.len() == 4 * tokens.len());
}

#[test]
fn busy_and_unknown_slots_are_refused_and_the_running_request_is_untouched() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 100_000,
            decode_delay: Duration::from_millis(1),
            ..FakeConfig::default()
        },
        2,
    );
    let mut rx = h.submit("busy", greedy(200));
    assert!(matches!(rx.blocking_recv(), Some(Event::Started { .. })));
    // The request holds slot 0 (the lowest free one).
    for action in [
        SlotAction::Save,
        SlotAction::Erase,
        SlotAction::Restore {
            tokens: vec![],
            state: vec![],
            lora: LoraScales::base(),
        },
    ] {
        let err = h.slot(0, action).unwrap_err();
        assert_eq!(err.kind, EngineErrorKind::SlotBusy, "{err}");
    }
    let err = h.slot(2, SlotAction::Erase).unwrap_err();
    assert_eq!(err.kind, EngineErrorKind::SlotNotFound);
    assert!(err.message.contains("0..2"), "{err}");
    // The free slot can be saved meanwhile.
    assert!(h.slot(1, SlotAction::Save).is_ok());
    let mut text = String::new();
    loop {
        match rx.blocking_recv().expect("the stream ends with Done") {
            Event::Text { text: t, .. } => text.push_str(&t),
            Event::Done(c) => {
                assert_eq!(c.eval_count, 200);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(text, expected("busy", 200));
}

#[test]
fn a_state_the_backend_refuses_leaves_the_slot_empty_and_the_engine_serving() {
    let h = Harness::new(FakeConfig::default(), 1);
    let (_, _) = collect(&mut h.submit("kept", greedy(3)));
    let (tokens, state) = save(&h, 0);
    for (tokens, state, why) in [
        // Not a whole number of cells.
        (tokens.clone(), vec![1, 2, 3], "whole number"),
        // Cells that do not match the tokens named.
        (
            tokens.clone(),
            state[..state.len() - 4].to_vec(),
            "positions",
        ),
    ] {
        let err = h
            .slot(
                0,
                SlotAction::Restore {
                    tokens,
                    state,
                    lora: LoraScales::base(),
                },
            )
            .unwrap_err();
        assert_eq!(err.kind, EngineErrorKind::InvalidSlotState, "{err}");
        assert!(err.message.contains(why), "{err}");
        assert_eq!(h.settled_slot(0).cached_tokens, 0);
        let (text, done) = collect(&mut h.submit("kept", greedy(3)));
        assert_eq!(done.prompt_cached_count, 0);
        assert_eq!(text, expected("kept", 3));
    }
    let too_many = vec![1; 257];
    let err = h
        .slot(
            0,
            SlotAction::Restore {
                tokens: too_many,
                state: vec![0; 257 * 4],
                lora: LoraScales::base(),
            },
        )
        .unwrap_err();
    assert_eq!(err.kind, EngineErrorKind::ContextLength);
}

/// Restores into slot `slot` the state `state` with a cell at a position no removal by range
/// reaches after its cells (the fake's `STUCK_CELL`: what a slot file whose checksum holds
/// can carry); the restore is refused.
fn restore_with_stuck_cell(h: &Harness, slot: usize, tokens: Vec<Token>, state: &[u8]) {
    let mut state = state.to_vec();
    state.extend(crate::backend::fake::STUCK_CELL.to_le_bytes());
    let err = h
        .slot(
            slot,
            SlotAction::Restore {
                tokens,
                state,
                lora: LoraScales::base(),
            },
        )
        .unwrap_err();
    assert_eq!(err.kind, EngineErrorKind::InvalidSlotState, "{err}");
}

#[test]
fn a_restored_cell_no_range_removes_empties_the_whole_cache_and_every_slot_serves_again() {
    let h = Harness::new(FakeConfig::default(), 2);
    let (_, _) = collect(&mut h.submit("kept", greedy(3)));
    let (tokens, state) = save(&h, 0);
    // Slot 1 holds a copy of it.
    let n = tokens.len();
    let copy = SlotAction::Restore {
        tokens: tokens.clone(),
        state: state.clone(),
        lora: LoraScales::base(),
    };
    assert_eq!(h.slot(1, copy), Ok(SlotOutcome::Restored(n)));
    restore_with_stuck_cell(&h, 0, tokens, &state);
    // Only emptying the whole cache removed the stuck cell: no slot holds anything now, and
    // both serve (the fake refuses to decode a sequence with a stuck cell).
    for i in 0..2 {
        assert_eq!(h.settled_slot(i).cached_tokens, 0);
    }
    let a = h.submit("kept", greedy(3));
    let b = h.submit("a second conversation", greedy(3));
    for (mut rx, prompt) in [(a, "kept"), (b, "a second conversation")] {
        let (text, done) = collect(&mut rx);
        assert_eq!(done.prompt_cached_count, 0);
        assert_eq!(text, expected(prompt, 3));
    }
}

#[test]
fn a_request_served_while_the_whole_cache_is_emptied_ends_with_an_error() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 100_000,
            decode_delay: Duration::from_millis(1),
            ..FakeConfig::default()
        },
        2,
    );
    let (_, _) = collect(&mut h.submit("kept", greedy(3)));
    let (tokens, state) = save(&h, 0);
    // A long request on slot 0 (the restore goes to the idle slot 1).
    let mut rx = h.submit("busy", greedy(5_000));
    assert!(matches!(rx.blocking_recv(), Some(Event::Started { .. })));
    restore_with_stuck_cell(&h, 1, tokens, &state);
    let ended = loop {
        match rx.blocking_recv().expect("the stream ends") {
            Event::Text { .. } => {}
            Event::Error(e) => break e,
            other => panic!("the request went on after its cells were cleared: {other:?}"),
        }
    };
    assert!(ended.message.contains("KV cache was cleared"), "{ended}");
    assert_eq!(ended.kind, EngineErrorKind::CacheFull, "{ended}");
    let (text, _) = collect(&mut h.submit("busy", greedy(3)));
    assert_eq!(text, expected("busy", 3));
}

#[test]
fn the_slot_table_shows_what_each_request_is_doing() {
    let h = Harness::new(
        FakeConfig {
            slot_ctx: 100_000,
            decode_delay: Duration::from_millis(1),
            ..FakeConfig::default()
        },
        2,
    );
    let idle = h.settled_slot(1);
    assert_eq!(idle.activity, crate::protocol::SlotActivity::default());
    let mut rx = h.submit("watch this", greedy(100_000));
    assert!(matches!(rx.blocking_recv(), Some(Event::Started { .. })));
    let mut received = 0;
    while received < 5 {
        if let Some(Event::Text { text, .. }) = rx.blocking_recv() {
            received += text.len();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    let busy = loop {
        let table = h.handle.health.slot_table();
        if let Some(s) = table
            .iter()
            .find(|s| s.busy && s.activity.generated_tokens >= 5)
        {
            break s.clone();
        }
        assert!(Instant::now() < deadline, "{table:?}");
        std::thread::yield_now();
    };
    let a = &busy.activity;
    assert_eq!(a.phase, SlotPhase::Decode);
    assert_eq!(a.prompt_tokens, 1 + "watch this".len());
    assert_eq!(a.prompt_processed_tokens, a.prompt_tokens);
    assert_eq!(a.prompt_cached_tokens, 0);
    assert!(!a.paused);
    drop(rx);
    assert_eq!(h.settled_slot(busy.id).activity.phase, SlotPhase::Idle);
}
