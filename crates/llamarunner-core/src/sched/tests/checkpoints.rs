//! Window checkpoints in the loop, against the fake backend's sliding window (which panics
//! when a sequence whose window was lost is decoded, or rewound with another sequence's
//! checkpoint): a cut back or a fork past the window goes back to the last checkpoint before
//! the cut, and gives the text a fresh decode gives.

use super::*;

const WINDOW: usize = 4;

fn windowed(batch_capacity: usize, slots: usize, multiuser: bool, cache: usize) -> Harness {
    Harness::with_scheduler(
        FakeConfig {
            window: Some(WINDOW),
            batch_capacity,
            ..FakeConfig::default()
        },
        slots,
        64,
        move |s| {
            s.with_multiuser_cache(multiuser)
                .with_prompt_cache(cache)
                .with_checkpoints(8, 1 << 30)
        },
    )
}

#[test]
fn a_cut_back_past_the_window_goes_back_to_the_checkpoint_at_the_prompt_end() {
    let h = windowed(32, 1, false, 0);
    let prompt = "a prompt of twenty!!";
    let (answer, _) = collect(&mut h.submit(prompt, greedy(20)));
    // The next prompt keeps half the answer: a cut 10 tokens back, past the window.
    let next = format!("{prompt}{} and more", &answer[..10]);
    let (text, done) = collect(&mut h.submit(&next, greedy(6)));
    assert_eq!(
        text,
        expected(&next, 6),
        "the rewound cells are the computed ones"
    );
    // BOS and the prompt came back from the checkpoint; the kept answer was decoded again.
    assert_eq!(done.prompt_cached_count, 1 + prompt.len());
    // Without checkpoints, the same cut decodes everything.
    let plain = Harness::new(
        FakeConfig {
            window: Some(WINDOW),
            ..FakeConfig::default()
        },
        1,
    );
    collect(&mut plain.submit(prompt, greedy(20)));
    let (again, cold) = collect(&mut plain.submit(&next, greedy(6)));
    assert_eq!(cold.prompt_cached_count, 0);
    assert_eq!(again, text);
}

#[test]
fn a_fork_of_a_shared_prefix_goes_back_to_a_checkpoint_inside_it() {
    // 8-token prompt chunks: checkpoints every 8 positions and at the prompt's end.
    let h = windowed(8, 2, true, 0);
    let a = "a shared system prompt, long enough to be worth a fork!! user A asks";
    let (_, first) = collect(&mut h.submit(a, greedy(30)));
    assert_eq!(first.eval_count, 30);
    // B shares BOS and 62 bytes with A, whose slot moved 30 tokens on: the fork lacks the
    // window, and goes back to the checkpoint at 56.
    let b = "a shared system prompt, long enough to be worth a fork!! user B asks";
    let shared = 1 + crate::kv::common_prefix(
        &a.bytes().map(Token::from).collect::<Vec<_>>(),
        &b.bytes().map(Token::from).collect::<Vec<_>>(),
    );
    assert_eq!(shared, 63);
    let (text, done) = collect(&mut h.submit(b, greedy(5)));
    assert_eq!(text, expected(b, 5));
    assert_eq!(done.prompt_cached_count, 56);
    assert_eq!(
        h.forks.lock().unwrap().len(),
        0,
        "the copy lacked the window"
    );
}

#[test]
fn a_fork_that_a_checkpoint_cannot_make_worth_it_is_not_made() {
    // One 64-token chunk: the checkpoints are at 64 and at A's prompt end, past the 63 tokens
    // B shares, so a fork would give nothing: B takes the other slot without one (no copy),
    // and A's stays whole.
    let h = windowed(64, 2, true, 0);
    let a = "a shared system prompt, long enough to be worth a fork!! user A asks";
    collect(&mut h.submit(a, greedy(30)));
    let b = "a shared system prompt, long enough to be worth a fork!! user B asks";
    let (text, done) = collect(&mut h.submit(b, greedy(5)));
    assert_eq!(text, expected(b, 5));
    assert_eq!(done.prompt_cached_count, 0);
    let table = h.settled();
    assert!(
        table.iter().any(|s| s.cached_tokens == a.len() + 30),
        "A's slot was kept: {table:?}"
    );
}

#[test]
fn a_sequence_restored_from_ram_and_cut_back_goes_back_to_its_checkpoint() {
    let h = windowed(32, 1, false, 1 << 20);
    let a = "alice asks something";
    let (answer, _) = collect(&mut h.submit(a, greedy(20)));
    // Bob takes the only slot: alice's sequence goes to RAM.
    collect(&mut h.submit("bob says hello there", greedy(4)));
    // Alice comes back with part of her answer: restored, then cut back past its window.
    let next = format!("{a}{} ok", &answer[..8]);
    let (text, done) = collect(&mut h.submit(&next, greedy(6)));
    assert_eq!(text, expected(&next, 6));
    assert_eq!(done.prompt_cached_count, 1 + a.len());
}

#[test]
fn checkpoints_of_other_tokens_are_never_used() {
    // Many conversations through one slot, each cut back: every rewind is checked by the
    // fake against the tokens it restores (a wrong one panics the engine thread).
    let h = windowed(8, 1, false, 0);
    for i in 0..12 {
        let prompt = format!("conversation {} starts here", i % 3);
        let (answer, _) = collect(&mut h.submit(&prompt, greedy(12)));
        let next = format!("{prompt}{}!", &answer[..3]);
        let (text, _) = collect(&mut h.submit(&next, greedy(4)));
        assert_eq!(text, expected(&next, 4), "{i}");
    }
    h.settled();
}

/// Generated conversations over a windowed cache with every cache feature on (prefix sharing,
/// the prompt cache, checkpoints): random system prompts shared by several conversations,
/// follow-ups that keep a random part of the last answer (a cut back), new conversations and
/// repeats, some running side by side. Every answer must be the fresh decode's, and the fake
/// panics if a sequence whose window was lost is decoded or is rewound with a checkpoint of
/// other tokens.
#[test]
fn generated_conversations_over_a_window_always_answer_as_a_fresh_decode() {
    for (seed, batch) in [(0x9e37_79b9_7f4a_7c15u64, 8), (0x2545_f491_4f6c_dd1d, 16)] {
        let h = windowed(batch, 3, true, 64 * 1024);
        let mut next = xorshift(seed);
        let systems = [
            "You are a terse assistant for a shop. ",
            "Tools: search, read, write. ",
        ];
        let mut histories: Vec<String> = Vec::new();
        for turn in 0..60 {
            let prompt = match next(3) {
                // A new conversation on a shared system prompt.
                0 if histories.len() < 6 => {
                    let s = systems[next(2) as usize].repeat(1 + next(3) as usize);
                    format!("{s}user {turn}: hello?")
                }
                // A follow-up that keeps part of the conversation (cut back anywhere).
                1 if !histories.is_empty() => {
                    let h = &histories[next(histories.len() as u64) as usize];
                    let keep = 1 + next(h.len() as u64) as usize;
                    format!("{} then {turn}?", &h[..keep])
                }
                // A repeat of a history.
                _ if !histories.is_empty() => {
                    histories[next(histories.len() as u64) as usize].clone()
                }
                _ => format!("{}user {turn}", systems[0]),
            };
            let n = 1 + next(20) as usize;
            // Sometimes two at once, so that forks come from busy slots.
            let other = (next(3) == 0).then(|| {
                let p = format!("{}side {turn}", systems[1].repeat(2));
                (h.submit(&p, greedy(8)), p)
            });
            let (text, _) = collect(&mut h.submit(&prompt, greedy(n as i64)));
            assert_eq!(
                text,
                expected(&prompt, n),
                "seed {seed:x} turn {turn}: {prompt:?}"
            );
            if let Some((mut rx, p)) = other {
                let (side, _) = collect(&mut rx);
                assert_eq!(side, expected(&p, 8), "seed {seed:x} turn {turn} (side)");
            }
            let history = format!("{prompt}{text}");
            if histories.len() < 6 {
                histories.push(history);
            } else {
                let i = next(6) as usize;
                histories[i] = history;
            }
        }
        h.settled();
    }
}
