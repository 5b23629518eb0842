//! A KV cache the slots share (`--kv-unified`, `sched/shared_cache.rs`): one sequence may take
//! all of it; sequences that together need more wait swapped out and give the text they give
//! alone; idle slots' cells make room; nothing ever holds more cells than the cache (the fake
//! panics if it does).

use super::*;

fn shared(cells: usize) -> FakeConfig {
    FakeConfig {
        slot_ctx: cells,
        shared_cells: Some(cells),
        batch_capacity: 8,
        ..FakeConfig::default()
    }
}

#[test]
fn one_sequence_may_take_the_whole_shared_cache() {
    // Four slots over 64 cells: a quarter each without `--kv-unified`.
    let h = Harness::new(shared(64), 4);
    let (text, done) = collect(&mut h.submit("hi", greedy(60)));
    assert_eq!(done.eval_count, 60);
    assert_eq!(text, expected("hi", 60));
}

/// Counts the swap-outs the engine reports (`kv_swapped_out_total`).
#[derive(Debug, Default)]
struct Swaps(std::sync::atomic::AtomicUsize);

impl EngineObserver for Swaps {
    fn swapped_out(&self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[test]
fn sequences_that_overflow_the_cache_wait_swapped_out_and_give_their_own_text() {
    // 4 x (3..6 prompt + 30) cells into 64: at most two generate at once.
    let swaps = Arc::new(Swaps::default());
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let h = Harness::observed(shared(64), 4, 64, swaps.clone(), move |s| {
        let _ = wait.recv();
        s
    });
    let prompts = ["a", "bb", "ccc", "dd"];
    let mut rxs: Vec<_> = prompts.iter().map(|p| h.submit(p, greedy(30))).collect();
    drop(go);
    for (p, rx) in prompts.iter().zip(&mut rxs) {
        let (text, done) = collect(rx);
        assert_eq!(done.eval_count, 30, "{p}");
        assert_eq!(text, expected(p, 30), "{p}");
    }
    assert_eq!(h.settled().len(), 4);
    assert!(swaps.0.load(std::sync::atomic::Ordering::Relaxed) >= 1);
}

#[test]
fn prompts_that_fill_the_cache_between_them_do_not_wait_for_each_other() {
    // Four prompts of 40 tokens into 96 cells: admitted together, their chunks fill the cache
    // before any of them generates.
    let (h, go) = Harness::held(shared(96), 4);
    let prompts: Vec<String> = (0..4).map(|i| format!("{i}{}", "x".repeat(39))).collect();
    let mut rxs: Vec<_> = prompts.iter().map(|p| h.submit(p, greedy(8))).collect();
    drop(go);
    for (p, rx) in prompts.iter().zip(&mut rxs) {
        let (text, done) = collect(rx);
        assert_eq!(text, expected(p, 8), "{p}");
        assert_eq!(done.eval_count, 8);
    }
}

#[test]
fn idle_slots_give_their_cells_to_a_new_sequence() {
    let h = Harness::new(shared(48), 2);
    let (_, done) = collect(&mut h.submit(&"a".repeat(20), greedy(10)));
    assert_eq!(done.eval_count, 10);
    let table = h.settled();
    assert!(table.iter().any(|s| s.cached_tokens >= 20), "{table:?}");
    // 30 + 15 cells: the idle slot's cells must go for it to fit.
    let prompt = "b".repeat(30);
    let (text, _) = collect(&mut h.submit(&prompt, greedy(15)));
    assert_eq!(text, expected(&prompt, 15));
    let table = h.settled();
    let held: usize = table.iter().map(|s| s.cached_tokens).sum();
    assert!(held <= 48, "{table:?}");
}

/// Random prompts, limits, cancellations, slot counts and cache sizes: every request ends
/// with its own text (or `CacheFull` when the states swapped out would hold more cells than
/// the cache), the cells never exceed the cache (the fake asserts it), no slot leaks.
#[test]
fn random_loads_on_a_shared_cache_keep_every_text_and_every_slot() {
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
    let mut full = 0;
    let mut done_total = 0;
    for round in 0..12 {
        let cells = 32 + next(96) as usize;
        let slots = 2 + next(4) as usize;
        let (h, go) = Harness::held(shared(cells), slots);
        let mut live = Vec::new();
        for i in 0..(slots * 2) {
            // Each sequence fits its slot (the cache) with no context shift.
            let len = 1 + next((cells / 2 - 8) as u64) as usize;
            let n = 1 + next((cells / 2) as u64) as usize;
            let prompt = format!("{round}-{i}{}", "q".repeat(len));
            let rx = h.submit(&prompt, greedy(n as i64));
            live.push((prompt, n, rx));
        }
        // A few clients leave at once.
        for _ in 0..next(3) {
            let i = next(live.len() as u64) as usize;
            drop(live.swap_remove(i));
        }
        drop(go);
        for (prompt, n, mut rx) in live {
            let mut text = String::new();
            loop {
                match rx.blocking_recv().expect("a request never ended") {
                    Event::Started { .. } => {}
                    Event::Text { text: t, .. } => text.push_str(&t),
                    Event::Done(c) => {
                        assert_eq!(text, expected(&prompt, n), "{prompt}");
                        assert_eq!(c.eval_count, n);
                        done_total += 1;
                        break;
                    }
                    Event::Error(e) => {
                        assert_eq!(e.kind, EngineErrorKind::CacheFull, "{prompt}: {e}");
                        full += 1;
                        break;
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
        h.settled();
    }
    assert!(done_total > 40, "{done_total} done, {full} ended CacheFull");
}
