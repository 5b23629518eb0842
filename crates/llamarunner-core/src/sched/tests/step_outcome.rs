//! What a turn of the scheduler returns, driven directly (no engine thread): the step's plain
//! outcome.

use super::*;
use crate::protocol::handle::QueueGauge;
use crate::sched::StepOutcome;

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
    // The rest of the prompt, its last position with logits (the first token is sampled).
    let rest = prompt.len() + 1 - capacity;
    let second = sched.turn();
    assert_eq!((second.batch_tokens, second.outputs), (rest, 1));
    // The sampled token decoded, the second sampled: num_predict 2 ends it.
    let third = sched.turn();
    assert_eq!(
        (third.batch_tokens, third.outputs, third.drafted),
        (1, 1, 0)
    );
    assert!(!third.stalled && !third.failed && !third.images);
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
