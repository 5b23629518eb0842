//! What a turn of the scheduler returns, driven directly (no engine thread): the step's plain
//! outcome.

use super::*;
use crate::protocol::handle::QueueGauge;
use crate::sched::{SequenceStep, StepOutcome};

/// A scheduler of one slot on the fake backend, driven by the test.
fn one_slot() -> Scheduler<FakeBackend> {
    Scheduler::new(
        FakeBackend::new(FakeConfig::default()),
        1,
        Arc::new(NoObserver),
        Arc::new(QueueGauge::default()),
    )
}

/// A request for `prompt` whose events go to `events`.
fn request(
    id: &str,
    prompt: &str,
    params: SamplingParams,
    events: crate::protocol::EventSink,
) -> Request {
    Request {
        id: id.into(),
        prompt: prompt.into(),
        params,
        truncated: false,
        events,
        received: Instant::now(),
        deadline: None,
        images: Vec::new(),
    }
}

#[test]
fn a_turn_says_what_its_step_decoded() {
    let capacity = FakeConfig::default().batch_capacity;
    let mut sched = one_slot();
    // Nothing to do: nothing decoded, nothing stalled.
    assert_eq!(sched.turn(), StepOutcome::default());
    let prompt = "x".repeat(capacity + 8);
    let (tx, mut rx) = crate::protocol::EventSink::channel();
    sched.enqueue(request("outcome", &prompt, greedy(2), tx));
    // BOS and the prompt's bytes, more than one batch: a full chunk without logits first.
    let first = sched.turn();
    assert_eq!((first.batch_tokens, first.outputs), (capacity, 0));
    assert_eq!(first.admitted, vec![0]);
    assert_eq!(
        first.sequences,
        vec![SequenceStep {
            slot: 0,
            prompt_tokens: capacity,
            ..SequenceStep::default()
        }]
    );
    // The rest of the prompt, its last position with logits (the first token is sampled).
    let rest = prompt.len() + 1 - capacity;
    let second = sched.turn();
    assert_eq!((second.batch_tokens, second.outputs), (rest, 1));
    assert!(second.admitted.is_empty());
    assert_eq!(
        second.sequences,
        vec![SequenceStep {
            slot: 0,
            prompt_tokens: rest,
            generated: 1,
            ..SequenceStep::default()
        }]
    );
    // The sampled token decoded, the second sampled: num_predict 2 ends it.
    let third = sched.turn();
    assert_eq!(
        (third.batch_tokens, third.outputs, third.drafted),
        (1, 1, 0)
    );
    assert!(!third.stalled && !third.failed && !third.images);
    assert_eq!(
        third.sequences,
        vec![SequenceStep {
            slot: 0,
            decode_tokens: 1,
            generated: 1,
            finished: Some(DoneReason::Length),
            ..SequenceStep::default()
        }]
    );
    assert_eq!(third.finished, vec![(0, DoneReason::Length)]);
    assert!(sched.idle());
    // The scheduler sent the text as it came and handed the request's end to the engine: its
    // last events, in order, to deliver.
    let mut endings = sched.take_endings();
    assert_eq!(endings.len(), 1);
    assert!(sched.take_endings().is_empty(), "taken once");
    let ending = endings.remove(0);
    assert!(matches!(ending.events.back(), Some(Event::Done(done)) if done.eval_count == 2));
    let mut deliveries = crate::engine::Deliveries::default();
    deliveries.deliver(ending);
    assert!(deliveries.is_empty());
    let (_, done) = collect(&mut rx);
    assert_eq!(done.eval_count, 2);
}

#[test]
fn a_refused_request_ends_with_its_error_for_the_engine_to_deliver() {
    let mut sched = one_slot();
    let (tx, mut rx) = crate::protocol::EventSink::channel();
    let mut params = greedy(2);
    params.truncate = false;
    sched.enqueue(request("too-long", &"x".repeat(100_000), params, tx));
    assert_eq!(sched.turn(), StepOutcome::default());
    assert!(
        rx.try_recv().is_err(),
        "nothing sent before the engine delivers"
    );
    let endings = sched.take_endings();
    assert_eq!(endings.len(), 1);
    assert!(matches!(endings[0].events.front(), Some(Event::Error(_))));
}

#[test]
fn a_request_that_asks_hears_how_far_its_prompt_is() {
    let capacity = FakeConfig::default().batch_capacity;
    let mut sched = one_slot();
    let prompt = "x".repeat(capacity + 8);
    let (tx, mut rx) = crate::protocol::EventSink::channel();
    let mut params = greedy(1);
    params.return_progress = true;
    sched.enqueue(request("progress", &prompt, params, tx));
    while !sched.idle() {
        sched.turn();
    }
    let mut deliveries = crate::engine::Deliveries::default();
    for ending in sched.take_endings() {
        deliveries.deliver(ending);
    }
    let mut progress = Vec::new();
    let mut text_before_done = false;
    while let Ok(event) = rx.try_recv() {
        match event {
            Event::Progress(p) => {
                assert!(!text_before_done, "progress after text");
                progress.push((p.total, p.cache, p.processed));
            }
            Event::Text { .. } => text_before_done = true,
            _ => {}
        }
    }
    // BOS and the prompt's bytes: one report at admission, one a chunk (two chunks).
    let total = prompt.len() + 1;
    assert_eq!(
        progress,
        vec![(total, 0, 0), (total, 0, capacity), (total, 0, total)]
    );
}

#[test]
fn the_plan_puts_generating_sequences_first_and_keeps_a_place_for_a_prompt() {
    let capacity = FakeConfig::default().batch_capacity;
    let mut sched = Scheduler::new(
        FakeBackend::new(FakeConfig::default()),
        2,
        Arc::new(NoObserver),
        Arc::new(QueueGauge::default()),
    );
    let (tx, _rx) = crate::protocol::EventSink::channel();
    sched.enqueue(request("short", "hi", greedy(50), tx));
    // Its prompt (BOS and two bytes), then its first generated token decoded.
    let first = sched.turn();
    assert_eq!(first.sequences[0].prompt_tokens, 3);
    assert_eq!(first.sequences[0].generated, 1);
    // A long prompt arrives: the generating sequence's next token comes first, the prompt
    // takes the rest of the batch.
    let (tx, _rx2) = crate::protocol::EventSink::channel();
    sched.enqueue(request("long", &"y".repeat(2 * capacity), greedy(1), tx));
    let second = sched.turn();
    assert_eq!(second.admitted, vec![1]);
    assert_eq!(
        second.sequences,
        vec![
            SequenceStep {
                slot: 0,
                decode_tokens: 1,
                generated: 1,
                ..SequenceStep::default()
            },
            SequenceStep {
                slot: 1,
                prompt_tokens: capacity - 1,
                ..SequenceStep::default()
            },
        ]
    );
    assert_eq!(second.batch_tokens, capacity);
    assert!(second.finished.is_empty());
}

#[test]
fn the_outcomes_show_sequences_swapped_out_of_a_shared_cache_and_back() {
    // 4 x (BOS, 1 byte, 30 generated) cells into 64: they cannot all generate at once.
    let config = FakeConfig {
        slot_ctx: 64,
        shared_cells: Some(64),
        batch_capacity: 8,
        ..FakeConfig::default()
    };
    let mut sched = Scheduler::new(
        FakeBackend::new(config),
        4,
        Arc::new(NoObserver),
        Arc::new(QueueGauge::default()),
    );
    let mut sinks = Vec::new();
    for p in ["a", "b", "c", "d"] {
        let (tx, rx) = crate::protocol::EventSink::channel();
        sched.enqueue(request(p, p, greedy(30), tx));
        sinks.push(rx);
    }
    let mut generated = [0usize; 4];
    let mut swaps = 0;
    let mut finished = Vec::new();
    for _ in 0..500 {
        if sched.idle() {
            break;
        }
        let outcome = sched.turn();
        for step in &outcome.sequences {
            generated[usize::try_from(step.slot).expect("a slot id")] += step.generated;
        }
        // A sequence swapped out before the batch was built has no part in it.
        for slot in &outcome.swapped_out {
            assert!(
                outcome.sequences.iter().all(|s| s.slot != *slot),
                "{outcome:?}"
            );
        }
        swaps += outcome.swapped_out.len();
        finished.extend(outcome.finished);
        sched.take_endings();
    }
    assert!(swaps >= 1, "no sequence was swapped out");
    assert!(sched.idle());
    assert_eq!(generated, [30; 4]);
    finished.sort_unstable_by_key(|&(slot, _)| slot);
    assert_eq!(
        finished,
        (0..4).map(|s| (s, DoneReason::Length)).collect::<Vec<_>>()
    );
}

#[test]
fn a_slot_taken_again_in_a_turn_is_not_credited_with_the_last_requests_end() {
    let mut sched = Scheduler::new(
        FakeBackend::new(FakeConfig {
            fail_decode: Some(2),
            ..FakeConfig::default()
        }),
        1,
        Arc::new(NoObserver),
        Arc::new(QueueGauge::default()),
    );
    let (tx, _a) = crate::protocol::EventSink::channel();
    let mut first = request("a", "hi", greedy(100), tx);
    first.deadline = Some(Instant::now() + std::time::Duration::from_millis(50));
    sched.enqueue(first);
    assert_eq!(sched.turn().sequences[0].generated, 1);
    std::thread::sleep(std::time::Duration::from_millis(60));
    let (tx, _b) = crate::protocol::EventSink::channel();
    sched.enqueue(request("b", "ho", greedy(5), tx));
    // The engine's order: the first request times out, then the turn gives its slot to the
    // second, whose prompt's decode fails (an error, not an end with a reason).
    sched.drop_cancelled();
    let outcome = sched.turn();
    assert!(outcome.failed);
    assert_eq!(outcome.admitted, vec![0]);
    assert_eq!(
        outcome.sequences,
        // "ho" after "hi": BOS and "h" are cached.
        vec![SequenceStep {
            slot: 0,
            prompt_tokens: 1,
            ..SequenceStep::default()
        }]
    );
    assert_eq!(outcome.finished, vec![(0, DoneReason::Timeout)]);
}
