//! What the loop reports to its observer (the metrics).

use super::*;

/// Records what the engine reports, in order.
#[derive(Debug, Default)]
struct Recorder(Mutex<Vec<String>>);

impl Recorder {
    fn push(&self, what: String) {
        self.0.lock().unwrap().push(what);
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl EngineObserver for Recorder {
    fn admitted(&self, queued: Duration, prompt: usize, cached: usize, truncated: bool) {
        assert!(queued < Duration::from_secs(60));
        self.push(format!("admitted {prompt} {cached} {truncated}"));
    }

    fn first_token(&self, _since_arrival: Duration) {
        self.push("first".into());
    }

    fn next_token(&self, _gap: Duration) {
        self.push("next".into());
    }

    fn context_shift(&self) {
        self.push("shift".into());
    }

    fn embedded(&self, tokens: usize) {
        self.push(format!("embedded {tokens}"));
    }
}

#[test]
fn the_observer_sees_admissions_tokens_shifts_truncations_and_embeddings() {
    let recorder = Arc::new(Recorder::default());
    let ctx = 32;
    let h = Harness::observed(
        FakeConfig {
            slot_ctx: ctx,
            ..FakeConfig::default()
        },
        1,
        64,
        recorder.clone(),
        |s| s,
    );
    // 5 tokens: admitted with its 4 prompt tokens (BOS + "abc"), a first token, 4 more.
    let (_, done) = collect(&mut h.submit("abc", greedy(5)));
    assert_eq!(done.eval_count, 5);
    assert!(done.queue_duration_ns <= done.prompt_eval_duration_ns + 60_000_000_000);
    let mut want = vec!["admitted 4 0 false".to_string(), "first".into()];
    want.extend(std::iter::repeat_n("next".to_string(), 4));
    assert_eq!(recorder.take(), want);

    // The same prompt again: all but its last token come from the cache.
    collect(&mut h.submit("abc", greedy(1)));
    assert_eq!(recorder.take(), ["admitted 4 3 false", "first"]);

    // A prompt longer than the slot is cut (the engine tokenizes this text itself).
    let long = "y".repeat(40);
    let (_, done) = collect(&mut h.submit(&long, greedy(1)));
    assert!(done.truncated);
    let events = recorder.take();
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(events[0].ends_with(" true"), "{events:?}");

    // 100 tokens in a 32-token slot: as many shifts as the slot filled, each counted once.
    let params = params_with(|p| {
        p.num_predict = 100;
        p.num_keep = 0;
    });
    let (_, done) = collect(&mut h.submit("shift", params));
    assert_eq!(done.eval_count, 100);
    let keep = 1; // BOS
    let (mut cached, mut shifts) = (6, 0); // BOS + "shift"
    for generated in 1..=100 {
        if generated == 100 {
            break; // the last token ends the sequence before any shift
        }
        if cached >= ctx {
            cached -= crate::kv::shift_discard(ctx, keep, cached);
            shifts += 1;
        }
        cached += 1;
    }
    assert!(shifts >= 2);
    let events = recorder.take();
    assert_eq!(events.iter().filter(|e| *e == "shift").count(), shifts);
    assert_eq!(events.iter().filter(|e| *e == "next").count(), 99);

    // An embedding's tokens.
    let e = embed(&h, "hello", false).unwrap();
    assert_eq!(
        recorder.take(),
        [format!("embedded {}", e.prompt_eval_count)]
    );
}
