//! LoRA scale sets in the loop, against the fake backend, which marks every KV cell with the
//! set it was decoded under: a sequence decoded in a batch of another set, or reusing a prefix
//! cached under another set, answers differently than the reference computed here.

use super::*;
use crate::protocol::LoraScales;
use crate::sched::lora::run_lengths;

fn set(scales: &[f32]) -> LoraScales {
    LoraScales::new(scales.to_vec())
}

fn greedy_under(n: i64, lora: &LoraScales) -> SamplingParams {
    SamplingParams {
        lora: Some(lora.clone()),
        ..greedy(n)
    }
}

/// What the fake generates greedily for `prompt` decoded wholly under `lora`.
fn expected_under(prompt: &str, n: usize, lora: &LoraScales) -> String {
    let mark = FakeBackend::lora_mark(lora);
    let mut history: Vec<Token> = vec![BOS | mark];
    history.extend(prompt.bytes().map(|b| Token::from(b) | mark));
    let mut out = String::new();
    for _ in 0..n {
        let t = FakeBackend::next_token(&history, 0);
        out.push(char::from(u8::try_from(t).unwrap()));
        history.push(t | mark);
    }
    out
}

#[test]
fn the_reference_tells_the_sets_apart() {
    // Otherwise the tests below could not fail.
    let base = expected_under("hello", 12, &LoraScales::base());
    assert_eq!(base, expected("hello", 12));
    assert_ne!(expected_under("hello", 12, &set(&[1.0])), base);
    assert_ne!(
        expected_under("hello", 12, &set(&[1.0])),
        expected_under("hello", 12, &set(&[0.5]))
    );
    assert_ne!(
        expected_under("hello", 12, &set(&[1.0, 1.0])),
        expected_under("hello", 12, &set(&[1.0]))
    );
}

#[test]
fn mixed_sets_never_share_a_batch_and_each_answers_as_alone() {
    let (h, go) = Harness::held(
        FakeConfig {
            decode_delay: Duration::from_micros(200),
            ..FakeConfig::default()
        },
        4,
    );
    let sets = [set(&[]), set(&[1.0]), set(&[0.0, 0.5]), set(&[1.0])];
    let rxs: Vec<_> = sets
        .iter()
        .enumerate()
        .map(|(i, s)| h.submit(&format!("prompt {i}"), greedy_under(16, s)))
        .collect();
    go.send(()).expect("engine thread waits");
    for (i, mut rx) in rxs.into_iter().enumerate() {
        let (text, done) = collect(&mut rx);
        assert_eq!(done.eval_count, 16);
        assert_eq!(
            text,
            expected_under(&format!("prompt {i}"), 16, &sets[i]),
            "{i}"
        );
    }
    // Every set ran, and sequences of one set shared batches (slots 1 and 3).
    let log = h.log.lock().unwrap();
    let lora_log = h.lora_log.lock().unwrap();
    for s in &sets {
        assert!(lora_log.contains(s), "{s:?} never ran");
    }
    assert!(log
        .iter()
        .any(|b| b.iter().any(|t| t.seq == 1) && b.iter().any(|t| t.seq == 3)));
    // Slots 0 and 1 (different sets) never shared one.
    assert!(!log
        .iter()
        .any(|b| b.iter().any(|t| t.seq == 0) && b.iter().any(|t| t.seq == 1)));
}

/// Two sets, A (the base) and B, two requests each of `n` greedy tokens on 4 slots of the fake
/// with `config`: every text is its set's text decoded alone, and B started before A was done.
/// The sets decoded from B's first batch to A's last (both busy).
fn two_sets_busy(config: FakeConfig, n: usize) -> Vec<LoraScales> {
    let h = Harness::new(config, 4);
    let (a, b) = (set(&[]), set(&[1.0]));
    let sets = [&a, &b, &a, &b];
    let steps = i64::try_from(n).unwrap();
    let rxs: Vec<_> = sets
        .iter()
        .enumerate()
        .map(|(i, s)| h.submit(&format!("turn {i}"), greedy_under(steps, s)))
        .collect();
    let texts: Vec<String> = rxs.into_iter().map(|mut rx| collect(&mut rx).0).collect();
    for (i, s) in sets.iter().enumerate() {
        assert_eq!(texts[i], expected_under(&format!("turn {i}"), n, s));
    }
    let lora_log = h.lora_log.lock().unwrap();
    let first_b = lora_log.iter().position(|s| *s == b).unwrap();
    let last_a = lora_log.iter().rposition(|s| *s == a).unwrap();
    assert!(
        first_b < last_a,
        "B only ran after A was done: {lora_log:?}"
    );
    lora_log[first_b..=last_a].to_vec()
}

#[test]
fn busy_sets_take_turns_so_none_starves() {
    // A change costs nothing here, so turns are short (how short is `lora.rs`'s unit tests':
    // here it follows the noise in the fake's decode times).
    let both = two_sets_busy(
        FakeConfig {
            decode_delay: Duration::from_micros(500),
            ..FakeConfig::default()
        },
        24,
    );
    let runs = run_lengths(&both);
    assert!(runs.len() >= 2, "the sets did not take turns: {both:?}");
}

#[test]
fn where_a_change_of_set_is_slow_the_sets_take_longer_turns_and_none_starves() {
    // Steps of 1 ms, a change of set 4 ms more: turns of about 20 ms, some 15 steps (fewer
    // where the machine is busy and steps take longer).
    let both = two_sets_busy(
        FakeConfig {
            decode_delay: Duration::from_millis(1),
            lora_change_delay: Duration::from_millis(4),
            ..FakeConfig::default()
        },
        120,
    );
    // While both were busy: fewer changes than steps (alternating would change at every
    // step).
    let runs = run_lengths(&both);
    let steps: usize = runs.iter().sum();
    assert!(runs.len() >= 2, "{runs:?}");
    assert!(runs.len() * 2 <= steps, "turns too short: {runs:?}");
}

#[test]
fn a_prefix_cached_under_another_set_is_not_reused() {
    let h = Harness::new(FakeConfig::default(), 2);
    let (a, b) = (set(&[0.5]), set(&[1.0, -1.0]));
    let prompt = "a shared beginning and more";
    let run = |lora: &LoraScales| collect(&mut h.submit(prompt, greedy_under(6, lora)));
    let (text, first) = run(&a);
    assert_eq!(text, expected_under(prompt, 6, &a));
    assert_eq!(first.prompt_cached_count, 0);
    let (text, again) = run(&a);
    assert_eq!(again.prompt_cached_count, prompt.len());
    assert_eq!(text, expected_under(prompt, 6, &a));
    // A slot holds the prompt under A: B decodes it afresh.
    let (text, other) = run(&b);
    assert_eq!(other.prompt_cached_count, 0);
    assert_eq!(text, expected_under(prompt, 6, &b));
    let (text, again) = run(&b);
    assert_eq!(again.prompt_cached_count, prompt.len());
    assert_eq!(text, expected_under(prompt, 6, &b));
    // All-zero scales are the base model, whichever way they are written.
    let (text, base) = run(&LoraScales::base());
    assert_eq!(base.prompt_cached_count, 0);
    assert_eq!(text, expected(prompt, 6));
    let (text, zeros) = run(&set(&[0.0, -0.0]));
    assert_eq!(zeros.prompt_cached_count, prompt.len());
    assert_eq!(text, expected(prompt, 6));
}

#[test]
fn a_one_slot_server_switching_sets_decodes_the_prompt_again() {
    let h = Harness::new(FakeConfig::default(), 1);
    let prompt = "one slot only";
    for lora in [set(&[1.0]), set(&[]), set(&[1.0])] {
        let (text, done) = collect(&mut h.submit(prompt, greedy_under(5, &lora)));
        assert_eq!(done.prompt_cached_count, 0, "{lora:?}");
        assert_eq!(text, expected_under(prompt, 5, &lora));
    }
}

#[test]
fn multiuser_cache_forks_only_between_slots_of_one_set() {
    let h = Harness::with_scheduler(
        FakeConfig {
            decode_delay: Duration::from_micros(300),
            ..FakeConfig::default()
        },
        3,
        64,
        |s| s.with_multiuser_cache(true),
    );
    let forks = h.forks.clone();
    let (a, b) = (set(&[1.0]), set(&[0.25]));
    let system = "You are a helpful assistant. Answer briefly. ";
    // User A fills slot 0 under set A and keeps generating.
    let mut busy = h.submit(&format!("{system}user A"), greedy_under(-1, &a));
    assert!(matches!(busy.blocking_recv(), Some(Event::Started { .. })));
    assert!(matches!(busy.blocking_recv(), Some(Event::Text { .. })));
    // Under set B nothing is forked: the prompt is decoded in full.
    let prompt = format!("{system}user B");
    let (text, done) = collect(&mut h.submit(&prompt, greedy_under(5, &b)));
    assert_eq!(done.prompt_cached_count, 0);
    assert_eq!(text, expected_under(&prompt, 5, &b));
    assert!(forks.lock().unwrap().is_empty());
    // Under set A the shared prefix is forked from slot 0.
    let prompt = format!("{system}user C");
    let (text, done) = collect(&mut h.submit(&prompt, greedy_under(5, &a)));
    let shared = 1 + system.len() + "user ".len();
    assert_eq!(done.prompt_cached_count, shared);
    assert_eq!(text, expected_under(&prompt, 5, &a));
    assert_eq!(forks.lock().unwrap().len(), 1);
    assert_eq!(forks.lock().unwrap()[0].0, 0);
    drop(busy);
}
