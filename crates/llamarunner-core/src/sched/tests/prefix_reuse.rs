//! Prefix reuse: a slot's own cache, a prefix forked from another slot, and what a cut or
//! fork leaves of a sliding window.

use super::*;

#[test]
fn second_identical_prompt_reuses_the_cache() {
    let h = Harness::new(FakeConfig::default(), 1);
    let (a, first) = collect(&mut h.submit("the same prompt", greedy(5)));
    assert_eq!(first.prompt_cached_count, 0);
    let (b, second) = collect(&mut h.submit("the same prompt", greedy(5)));
    assert_eq!(a, b);
    // All but one prompt token come from the cache.
    assert_eq!(second.prompt_cached_count, second.prompt_eval_count - 1);
}

#[test]
fn after_a_stop_the_cache_holds_only_the_returned_text() {
    let h = Harness::new(FakeConfig::default(), 1);
    let full = expected("cache trim", 30);
    let stop = full[10..12].to_string();
    let cut = full.find(&stop).unwrap();
    let params = SamplingParams {
        stop: vec![stop],
        ..greedy(30)
    };
    let (text, done) = collect(&mut h.submit("cache trim", params));
    assert_eq!(text, full[..cut]);
    assert_eq!(done.done_reason, DoneReason::Stop);
    // The follow-up prompt is the old prompt + exactly the returned text: all of it is cached
    // but the one token that is always decoded again.
    let follow = format!("cache trim{text}");
    let (_, second) = collect(&mut h.submit(&follow, greedy(1)));
    assert_eq!(second.prompt_cached_count, second.prompt_eval_count - 1);
}

#[test]
fn multiuser_cache_forks_a_shared_prefix_into_another_slot() {
    let h = Harness::with_scheduler(
        FakeConfig {
            decode_delay: std::time::Duration::from_micros(300),
            ..FakeConfig::default()
        },
        2,
        64,
        |s| s.with_multiuser_cache(true),
    );
    let forks = h.forks.clone();
    let system = "You are a helpful assistant. Answer briefly. ";
    // User A fills slot 0 with the system prompt and keeps generating (busy).
    let mut a = h.submit(&format!("{system}user A"), greedy(-1));
    assert!(matches!(a.blocking_recv(), Some(Event::Started { .. })));
    assert!(matches!(a.blocking_recv(), Some(Event::Text { .. })));
    // User B: the shared prefix is forked from A's busy slot into slot 1.
    let (text, done) = collect(&mut h.submit(&format!("{system}user B"), greedy(5)));
    let shared = 1 + system.len() + "user ".len();
    assert_eq!(done.prompt_cached_count, shared);
    assert_eq!(
        text,
        expected(&format!("{system}user B"), 5),
        "forked KV is exact"
    );
    assert_eq!(forks.lock().unwrap().as_slice(), &[(0, 1, shared)]);
    drop(a);
}

#[test]
fn without_partial_removal_the_slot_is_cleared_and_the_prompt_decoded_again() {
    let h = Harness::new(
        FakeConfig {
            partial_remove: false,
            ..FakeConfig::default()
        },
        1,
    );
    let (a, _) = collect(&mut h.submit("recurrent model", greedy(5)));
    let (b, second) = collect(&mut h.submit("recurrent model", greedy(5)));
    assert_eq!(a, b);
    assert_eq!(second.prompt_cached_count, 0);
}

#[test]
fn a_cut_past_a_sliding_window_decodes_the_prompt_again_and_a_continuation_reuses_it() {
    let h = Harness::new(
        FakeConfig {
            window: Some(4),
            ..FakeConfig::default()
        },
        1,
    );
    let (answer, first) = collect(&mut h.submit("window test", greedy(20)));
    assert_eq!(first.prompt_cached_count, 0);
    // Only the start is shared: cut back 20 tokens, the window before the cut is gone.
    let (text, cut) = collect(&mut h.submit("window other", greedy(6)));
    assert_eq!(
        cut.prompt_cached_count, 0,
        "a lost window must not be reused"
    );
    assert_eq!(text, expected("window other", 6));
    // A conversation that goes on from where the slot is keeps its cache.
    collect(&mut h.submit("window again", greedy(3)));
    let follow = format!("window again{}", expected("window again", 3));
    let (text, next) = collect(&mut h.submit(&follow, greedy(4)));
    assert_eq!(text, expected(&follow, 4));
    assert!(next.prompt_cached_count > "window again".len(), "{next:?}");
    drop(answer);
}

#[test]
fn a_fork_that_would_lose_a_sliding_window_decodes_the_prompt_in_full() {
    let h = Harness::with_scheduler(
        FakeConfig {
            window: Some(4),
            ..FakeConfig::default()
        },
        2,
        64,
        |s| s.with_multiuser_cache(true),
    );
    let forks = h.forks.clone();
    // Slot 0 holds "shared prefix, user A" and 30 generated tokens past it.
    let (_, a) = collect(&mut h.submit("shared prefix, user A", greedy(30)));
    assert_eq!(a.eval_count, 30);
    // User B shares only the prefix: forking it would cut 30+ tokens back past the window.
    let (text, b) = collect(&mut h.submit("shared prefix, user B", greedy(5)));
    assert_eq!(
        text,
        expected("shared prefix, user B", 5),
        "exact after the failed fork"
    );
    assert_eq!(b.prompt_cached_count, 0);
    assert!(forks.lock().unwrap().is_empty());
}

/// 45 tokens: longer than the fake's batch of 32.
const LONG_PROMPT: &str = "a seeded prompt that is longer than one chunk.";

/// Sampling at temperature 1 with seed 5, `n` tokens.
fn seeded(n: i64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed: 5,
        num_predict: n,
        ..SamplingParams::default()
    }
}

#[test]
fn a_seeded_request_sent_again_decodes_its_last_chunk_again() {
    // Capacity 32: a 45-token prompt is decoded in chunks [0, 32) and [32, 45) when fresh.
    let h = Harness::new(FakeConfig::default(), 1);
    let (prompt, seeded) = (LONG_PROMPT, seeded(4));
    let (a, first) = collect(&mut h.submit(prompt, seeded.clone()));
    assert_eq!(first.prompt_cached_count, 0);
    let (b, second) = collect(&mut h.submit(prompt, seeded.clone()));
    assert_eq!(a, b);
    let n = second.prompt_eval_count;
    assert!(n > 32, "{n} prompt tokens");
    // The last chunk again, from where a fresh decode began it.
    assert_eq!(
        second.prompt_cached_count,
        crate::kv::chunk_start(n - 1, 32)
    );
    // Unseeded sampling keeps all but one token.
    let unseeded = SamplingParams { seed: -1, ..seeded };
    let (_, third) = collect(&mut h.submit(prompt, unseeded));
    assert_eq!(third.prompt_cached_count, n - 1);
}

#[test]
fn a_seeded_repeat_keeps_its_cache_where_the_cut_would_lose_a_sliding_window() {
    // Window 4: after 45 prompt tokens and 4 generated ones, cutting back to the last chunk's
    // start (32) would lose cells the window needs, so the repeat reuses all but one token.
    let h = Harness::new(
        FakeConfig {
            window: Some(4),
            ..FakeConfig::default()
        },
        1,
    );
    let (prompt, seeded) = (LONG_PROMPT, seeded(4));
    let (a, _) = collect(&mut h.submit(prompt, seeded.clone()));
    let (b, second) = collect(&mut h.submit(prompt, seeded));
    assert_eq!(a, b);
    assert_eq!(second.prompt_cached_count, second.prompt_eval_count - 1);
}
