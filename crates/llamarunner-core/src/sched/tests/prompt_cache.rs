//! The host-memory prompt cache in the loop, against the fake backend (whose sequence state is
//! its KV cells, each marked with the LoRA set it was decoded under): a conversation that left
//! its slot is restored rather than decoded again, and gives the text a fresh decode gives.

use super::*;
use crate::protocol::LoraScales;

/// The fake's state is 4 bytes per cached token.
const BYTES_PER_TOKEN: usize = 4;

fn caching(slots: usize, budget: usize) -> Harness {
    Harness::with_scheduler(FakeConfig::default(), slots, 64, move |s| {
        s.with_prompt_cache(budget)
    })
}

/// A prompt of about 120 tokens, distinct per `name`.
fn conversation(name: &str) -> String {
    format!("{name}: ").repeat(120 / (name.len() + 2))
}

#[test]
fn a_conversation_that_left_its_slot_is_restored_and_gives_the_same_text() {
    let h = caching(1, 1 << 20);
    let a = conversation("alice");
    let (answer, first) = collect(&mut h.submit(&a, greedy(8)));
    assert_eq!(first.prompt_cached_count, 0);
    // Another conversation takes the only slot: alice's sequence goes to RAM.
    let b = conversation("bob");
    let (_, other) = collect(&mut h.submit(&b, greedy(8)));
    assert_eq!(other.prompt_cached_count, 1, "only BOS is shared");
    // Alice's next turn starts with her whole history: restored, not decoded.
    let follow = format!("{a}{answer} and then?");
    let (text, next) = collect(&mut h.submit(&follow, greedy(8)));
    // The prompt and every generated token but the last were in the slot (the last was
    // sampled, never decoded).
    assert_eq!(next.prompt_cached_count, 1 + a.len() + answer.len() - 1);
    assert_eq!(
        text,
        expected(&follow, 8),
        "the restored cells are the computed ones"
    );
    // Without the cache the same turn decodes everything after BOS.
    let plain = Harness::new(FakeConfig::default(), 1);
    collect(&mut plain.submit(&a, greedy(8)));
    collect(&mut plain.submit(&b, greedy(8)));
    let (again, cold) = collect(&mut plain.submit(&follow, greedy(8)));
    assert_eq!(cold.prompt_cached_count, 1);
    assert_eq!(again, text);
}

#[test]
fn the_least_recently_stored_leave_first_within_the_budget() {
    // Room for two ~130-token states, not three.
    let budget = 2 * 140 * BYTES_PER_TOKEN;
    let h = caching(1, budget);
    let names = ["ann", "ben", "cat", "dan"];
    for name in names {
        collect(&mut h.submit(&conversation(name), greedy(4)));
    }
    // Stored as each was pushed out: ann, ben, cat; ann left to make room for cat. dan is in
    // the slot. Asking for cat restores cat (the slot's dan goes to RAM, pushing ben out)...
    let (_, cat) = collect(&mut h.submit(&conversation("cat"), greedy(4)));
    assert_eq!(cat.prompt_cached_count, cat.prompt_eval_count - 1);
    // ...dan comes back from RAM...
    let (_, dan) = collect(&mut h.submit(&conversation("dan"), greedy(4)));
    assert_eq!(dan.prompt_cached_count, dan.prompt_eval_count - 1);
    // ...and ann and ben, pushed out, are decoded again.
    for name in ["ann", "ben"] {
        let (_, cold) = collect(&mut h.submit(&conversation(name), greedy(4)));
        assert_eq!(cold.prompt_cached_count, 1, "{name}");
    }
}

#[test]
fn an_entry_serves_only_prompts_under_its_lora_set() {
    let h = caching(1, 1 << 20);
    let lora = LoraScales::new(vec![1.0]);
    let a = conversation("alice");
    let under = SamplingParams {
        lora: Some(lora.clone()),
        ..greedy(6)
    };
    collect(&mut h.submit(&a, under.clone()));
    collect(&mut h.submit(&conversation("bob"), greedy(6)));
    // The same prompt under the base model: alice's cells were decoded under the adapter.
    let (text, base) = collect(&mut h.submit(&a, greedy(6)));
    assert_eq!(base.prompt_cached_count, 1);
    assert_eq!(text, expected(&a, 6));
    // Under the adapter it is restored (from RAM: the slot now holds the base decode).
    let (_, again) = collect(&mut h.submit(&a, under));
    assert_eq!(again.prompt_cached_count, again.prompt_eval_count - 1);
}

/// Records the prompt cache's reports.
#[derive(Debug, Default)]
struct CacheLog(Mutex<Vec<(usize, usize, usize)>>);

impl EngineObserver for CacheLog {
    fn prompt_cache(&self, bytes: usize, entries: usize, restored: usize) {
        self.0.lock().unwrap().push((bytes, entries, restored));
    }
}

#[test]
fn a_conversation_is_stored_once_however_many_turns_it_had() {
    let log = Arc::new(CacheLog::default());
    let h = Harness::observed(FakeConfig::default(), 1, 64, log.clone(), |s| {
        s.with_prompt_cache(1 << 20)
    });
    let mut history = conversation("alice");
    for turn in 0..4 {
        let (answer, done) = collect(&mut h.submit(&history, greedy(6)));
        if turn > 0 {
            // Restored from RAM: everything but the last token of the previous turn.
            assert_eq!(
                done.prompt_cached_count,
                1 + history.len() - 1 - " next".len()
            );
        }
        history = format!("{history}{answer} next");
        // Another conversation pushes alice out between her turns.
        collect(&mut h.submit(&conversation(&format!("bob{turn}")), greedy(6)));
    }
    let reports = log.0.lock().unwrap().clone();
    let (bytes, entries, _) = *reports.last().expect("the cache reported");
    // Alice once (her last turn: each restore took her earlier turn out of RAM) and bob0 to
    // bob2, separate conversations pushed out in turn; bob3 is in the slot.
    assert_eq!(entries, 1 + 3, "{reports:?}");
    let restored: usize = reports.iter().map(|r| r.2).sum();
    assert!(restored > 3 * 120, "{reports:?}");
    assert!(bytes > 0);
}

#[test]
fn cache_prompt_false_decodes_the_whole_prompt() {
    let h = caching(1, 1 << 20);
    let a = conversation("alice");
    let (first, _) = collect(&mut h.submit(&a, greedy(6)));
    let no_cache = SamplingParams {
        cache_prompt: false,
        ..greedy(6)
    };
    // The slot holds the prompt, but the request wants none of it.
    let (again, done) = collect(&mut h.submit(&a, no_cache.clone()));
    assert_eq!(done.prompt_cached_count, 0);
    assert_eq!(again, first);
    // Nor from RAM: alice went there when bob took the slot.
    collect(&mut h.submit(&conversation("bob"), greedy(6)));
    let (_, cold) = collect(&mut h.submit(&a, no_cache));
    assert_eq!(cold.prompt_cached_count, 0);
    // A request that allows it gets it.
    collect(&mut h.submit(&conversation("bob"), greedy(6)));
    let (_, warm) = collect(&mut h.submit(&a, greedy(6)));
    assert_eq!(warm.prompt_cached_count, warm.prompt_eval_count - 1);
}
