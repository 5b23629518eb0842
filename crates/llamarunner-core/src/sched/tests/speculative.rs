//! Speculative decoding against the fake backend: whatever is drafted, the output is the output
//! without speculation, token for token, and stop strings, EOG, `num_predict`, logprobs, context
//! shifts and sliding-window caches behave as without it.

use super::*;
use crate::sched::adaptive::StepCost;
use crate::sched::speculative::SpecConfig;

pub(super) const SPEC: SpecConfig = SpecConfig {
    draft_max: 8,
    draft_min: 1,
    ngram: 3,
    cost: StepCost::FREE,
    measure: false,
    always: false,
};

/// A harness whose scheduler drafts with `spec`.
pub(super) fn speculating(config: FakeConfig, slots: usize, spec: SpecConfig) -> Harness {
    Harness::with_scheduler(config, slots, 64, move |s| s.with_speculation(spec))
}

/// Runs every (prompt, params) at once on `slots` slots; returns each one's text, logprob
/// entries and final stats, in order.
pub(super) type Run = (String, Vec<crate::protocol::TokenLogprob>, Completion);

pub(super) fn run_all(h: &Harness, jobs: &[(String, SamplingParams)]) -> Vec<Run> {
    let mut rxs: Vec<_> = jobs
        .iter()
        .map(|(p, params)| h.submit(p, params.clone()))
        .collect();
    rxs.iter_mut()
        .map(|rx| {
            let mut text = String::new();
            let mut entries = Vec::new();
            assert!(matches!(rx.blocking_recv(), Some(Event::Started { .. })));
            loop {
                match rx.blocking_recv().expect("stream ended without Done") {
                    Event::Text { text: t, logprobs } => {
                        text.push_str(&t);
                        entries.extend(logprobs);
                    }
                    Event::Done(c) => return (text, entries, c),
                    other => panic!("unexpected event {other:?}"),
                }
            }
        })
        .collect()
}

/// The same jobs without and with speculation: the texts, logprobs, token counts and finish
/// reasons must be equal. Returns the runs with speculation and its batch log.
pub(super) fn same_as_without(
    config: FakeConfig,
    slots: usize,
    spec: SpecConfig,
    jobs: &[(String, SamplingParams)],
) -> (Vec<Run>, Vec<Vec<BatchToken>>) {
    let plain = run_all(&Harness::new(config.clone(), slots), jobs);
    let h = speculating(config, slots, spec);
    let drafted = run_all(&h, jobs);
    for ((p, q), (prompt, _)) in plain.iter().zip(&drafted).zip(jobs) {
        assert_eq!(p.0, q.0, "text of {prompt:?}");
        assert_eq!(p.1, q.1, "logprobs of {prompt:?}");
        assert_eq!(p.2.eval_count, q.2.eval_count, "{prompt:?}");
        assert_eq!(p.2.done_reason, q.2.done_reason, "{prompt:?}");
        assert_eq!(p.2.draft_count, 0);
        assert!(q.2.draft_accepted_count <= q.2.draft_count);
    }
    h.settled();
    let log = h.log.lock().unwrap().clone();
    (drafted, log)
}

pub(super) fn looping(markov: usize) -> FakeConfig {
    FakeConfig {
        markov: Some(markov),
        ..FakeConfig::default()
    }
}

pub(super) fn job(prompt: &str, params: SamplingParams) -> (String, SamplingParams) {
    (prompt.to_string(), params)
}

#[test]
fn greedy_output_with_drafts_is_the_output_without_and_takes_fewer_steps() {
    let jobs = [job("the cat sat on the mat", greedy(120))];
    let (runs, log) = same_as_without(looping(2), 1, SPEC, &jobs);
    let done = &runs[0].2;
    // An order-2 chain loops, and a loop is what lookup drafts predict.
    assert!(done.draft_accepted_count > 60, "{done:?}");
    // Generation took far fewer decode steps than tokens.
    let steps = log.iter().filter(|b| b.iter().all(|t| t.logits)).count();
    assert!(steps < 60, "{steps} decode steps for 120 tokens");
    // Every drafted position had its logits, and none overflowed the batch.
    assert!(log.iter().all(|b| b.len() <= 32));
    // And it is the chain's own output (not merely equal to a wrong reference).
    let mut history: Vec<Token> = vec![BOS];
    history.extend("the cat sat on the mat".bytes().map(Token::from));
    let mut want = String::new();
    for _ in 0..120 {
        let t = FakeBackend::next_token(&history[history.len() - 2..], 0);
        want.push(char::from(u8::try_from(t).unwrap()));
        history.push(t);
    }
    assert_eq!(runs[0].0, want);
}

#[test]
fn rejected_drafts_are_rolled_back_and_the_output_is_unchanged() {
    // The whole-history hash never loops: lookups from the repetitive prompt propose drafts
    // that are (almost) all rejected; every rejected cell must leave the cache (the fake checks
    // every position against its KV list).
    let prompt = "abcabcabcabc xyzxyz abcabc ".repeat(3);
    let jobs = [
        job(&prompt, greedy(80)),
        job("abab abab abab", greedy(50)),
        job("no repeats here", greedy(30)),
    ];
    for ngram in [1, 2, 3] {
        let spec = SpecConfig { ngram, ..SPEC };
        let (runs, _) = same_as_without(FakeConfig::default(), 3, spec, &jobs);
        assert!(runs[0].2.draft_count > 0, "ngram {ngram}: {:?}", runs[0].2);
        assert!(
            runs[0].2.draft_accepted_count < runs[0].2.draft_count,
            "ngram {ngram}: {:?}",
            runs[0].2
        );
    }
}

#[test]
fn batched_sequences_with_and_without_drafts_match_their_plain_output() {
    // Four slots, ten requests of mixed kinds: greedy (drafts by default), greedy with
    // `speculative: false`, and sampled ones (no drafts by default; with `speculative: true`
    // the sampler still draws every token, so a seeded output is the same).
    let mut jobs = Vec::new();
    for i in 0..10 {
        let prompt = format!("request {i} {}", "ab".repeat(i));
        let params = match i % 4 {
            0 => greedy(40 + i as i64),
            1 => SamplingParams {
                speculative: Some(false),
                ..greedy(30)
            },
            2 => SamplingParams {
                seed: 7 + i as i64,
                num_predict: 35,
                ..SamplingParams::default()
            },
            _ => SamplingParams {
                seed: 11,
                num_predict: 45,
                speculative: Some(true),
                ..SamplingParams::default()
            },
        };
        jobs.push(job(&prompt, params));
    }
    let config = FakeConfig {
        batch_capacity: 24,
        ..looping(1)
    };
    let (runs, log) = same_as_without(config, 4, SPEC, &jobs);
    for (i, (_, _, done)) in runs.iter().enumerate() {
        match i % 4 {
            1 | 2 => assert_eq!(done.draft_count, 0, "request {i}"),
            _ => assert!(done.draft_accepted_count > 0, "request {i}: {done:?}"),
        }
    }
    for b in &log {
        assert!(b.len() <= 24);
        let seqs: Vec<i32> = b.iter().map(|t| t.seq).collect();
        assert!(seqs.windows(2).all(|w| w[0] <= w[1]), "order {seqs:?}");
    }
}

#[test]
fn stop_strings_eog_num_predict_and_logprobs_are_unchanged_by_drafts() {
    // Find a stop string inside the looping output, past its first cycle.
    let plain = run_all(
        &Harness::new(looping(2), 1),
        &[job("stop here please", greedy(60))],
    );
    let full = plain[0].0.clone();
    let stop = full[41..44].to_string();
    let mut jobs = Vec::new();
    for n in [1, 2, 3, 9, 17, 60] {
        jobs.push(job("stop here please", greedy(n)));
    }
    jobs.push(job(
        "stop here please",
        SamplingParams {
            stop: vec![stop.clone()],
            logprobs: Some(2),
            ..greedy(60)
        },
    ));
    jobs.push(job(
        "stop here please",
        SamplingParams {
            logprobs: Some(0),
            ..greedy(50)
        },
    ));
    let (runs, _) = same_as_without(looping(2), 2, SPEC, &jobs);
    assert_eq!(runs[6].2.done_reason, DoneReason::Stop);
    assert_eq!(runs[6].0, full[..full.find(&stop).unwrap()]);
    assert_eq!(runs[7].1.len(), 50);
    // EOG in the middle of accepted drafts.
    let config = FakeConfig {
        eos_at: Some(40),
        ..looping(2)
    };
    let jobs = [
        job("stop here please", greedy(-1)),
        job(
            "stop here please",
            SamplingParams {
                ignore_eos: true,
                ..greedy(45)
            },
        ),
    ];
    let (runs, _) = same_as_without(config, 2, SPEC, &jobs);
    assert_eq!(runs[0].2.done_reason, DoneReason::Stop);
    assert_eq!(runs[1].2.done_reason, DoneReason::Length);
}

#[test]
fn after_a_stop_with_drafts_the_cache_holds_only_the_returned_text() {
    let h = speculating(looping(2), 1, SPEC);
    let first = run_all(&h, &[job("cache me", greedy(60))]);
    let stop = first[0].0[30..33].to_string();
    let cut = first[0].0.find(&stop).unwrap();
    let answer = run_all(
        &h,
        &[job(
            "cache me",
            SamplingParams {
                stop: vec![stop],
                ..greedy(60)
            },
        )],
    );
    assert_eq!(answer[0].0, first[0].0[..cut]);
    h.settled();
    // A follow-up (prompt + answer) reuses every cached token but the one re-decoded.
    let follow = format!("cache me{}", answer[0].0);
    let next = run_all(&h, &[job(&follow, greedy(3))]);
    let n_prompt = follow.len() + 1;
    assert_eq!(next[0].2.prompt_cached_count, n_prompt - 1);
}

#[test]
fn drafts_stop_at_the_slot_end_and_context_shifts_behave_as_without() {
    let config = FakeConfig {
        slot_ctx: 48,
        ..looping(2)
    };
    let jobs = [
        job("shift me", greedy(150)),
        job(
            "no shift",
            SamplingParams {
                shift: false,
                ..greedy(150)
            },
        ),
    ];
    let (runs, _) = same_as_without(config.clone(), 2, SPEC, &jobs);
    assert_eq!(runs[0].2.eval_count, 150);
    assert_eq!(runs[1].2.done_reason, DoneReason::Length);
    assert!(runs[0].2.draft_accepted_count > 0);
    // A cache that cannot shift in place: the kept tokens are decoded again.
    let config = FakeConfig {
        can_shift: false,
        ..config
    };
    same_as_without(config, 2, SPEC, &jobs);
}

#[test]
fn a_grammar_sees_each_token_once_when_drafts_meet_the_slot_end() {
    // The grammar allows one next byte at a time ("abcabc...", its newline and end never
    // preferred by the fake over a printable byte), and every draft of the loop is
    // accepted: sampled ahead past the slot's last cell (where a cache that cannot shift is
    // decoded again), a position would be told to the grammar twice and the output would
    // leave the loop.
    let grammar = crate::constrain::Grammar::new(crate::constrain::GrammarSource::Gbnf(
        r#"root ::= ("abc")+ "\n""#.into(),
    ));
    let compiler = crate::constrain::Compiler::new(|| {
        use crate::protocol::TextModel;
        crate::backend::fake::FakeText.vocabulary()
    });
    let mut grammar = grammar;
    compiler.compile_into(&mut grammar).expect("compiles");
    let params = SamplingParams {
        grammar: Some(grammar),
        speculative: Some(true),
        ..greedy(100)
    };
    let jobs = [job("abcabcabc", params)];
    for can_shift in [true, false] {
        let config = FakeConfig {
            slot_ctx: 40,
            can_shift,
            ..looping(2)
        };
        let (runs, _) = same_as_without(config, 1, SPEC, &jobs);
        assert!(runs[0].2.draft_accepted_count > 0, "{:?}", runs[0].2);
        assert_eq!(runs[0].0, "abc".repeat(34)[..100], "can_shift {can_shift}");
    }
}

#[test]
fn a_rollback_past_a_sliding_window_decodes_the_slot_again() {
    // A window of 2 keeps 4 positions: rejecting more than 2 drafts loses cells the next
    // position needs, and the slot is decoded again instead of running on a broken cache.
    // (Single-token lookups draft often; the whole-history hash rejects nearly every draft.)
    let config = FakeConfig {
        window: Some(2),
        ..FakeConfig::default()
    };
    let spec = SpecConfig { ngram: 1, ..SPEC };
    let jobs = [job("abcdefgh abcdefgh", greedy(40))];
    let (runs, log) = same_as_without(config, 1, spec, &jobs);
    assert!(runs[0].2.draft_count > runs[0].2.draft_accepted_count + 2);
    // Some batch after the prompt's starts the slot again at position 0.
    let restarts = log
        .iter()
        .filter(|b| b.first().is_some_and(|t| t.pos == 0))
        .count();
    assert!(restarts > 1, "no re-decode happened");
}

#[test]
fn drafts_never_take_the_place_of_a_waiting_prompt_or_another_sequence() {
    let config = FakeConfig {
        batch_capacity: 6,
        ..looping(1)
    };
    let h = speculating(config, 3, SPEC);
    let a = h.submit("aaaa", greedy(40));
    // Let the first sequence start drafting, then bring a long prompt and another sequence.
    std::thread::sleep(Duration::from_millis(20));
    let long = "z".repeat(120);
    let b = h.submit(&long, greedy(10));
    let c = h.submit("cccc", greedy(40));
    for mut rx in [a, b, c] {
        let (_, done) = collect(&mut rx);
        assert_eq!(done.done_reason, DoneReason::Length);
    }
    let log = h.log.lock().unwrap();
    for batch in log.iter() {
        assert!(batch.len() <= 6);
    }
    // The long prompt advanced in every batch it was waiting in: each batch between its first
    // and last chunk carries some of its tokens.
    // (Its chunks are the only tokens without logits that are "z": whichever slot it took.)
    let z = Token::from(b'z');
    let holds_long = |b: &Vec<BatchToken>| b.iter().any(|t| t.token == z && !t.logits);
    let first = log.iter().position(holds_long).unwrap();
    let last = log.iter().rposition(holds_long).unwrap();
    assert!(log[first..=last].iter().all(holds_long));
}

#[test]
fn sampled_requests_draft_only_when_they_ask_and_draft_min_is_respected() {
    let h = speculating(looping(1), 1, SPEC);
    let sampled = SamplingParams {
        seed: 3,
        num_predict: 40,
        ..SamplingParams::default()
    };
    let runs = run_all(&h, &[job("x", sampled.clone())]);
    assert_eq!(runs[0].2.draft_count, 0);
    let runs = run_all(
        &h,
        &[job(
            "x",
            SamplingParams {
                speculative: Some(true),
                ..sampled
            },
        )],
    );
    assert!(runs[0].2.draft_count > 0);
    // With draft_min above what lookups can give near the start, drafts come only in full.
    let spec = SpecConfig {
        draft_min: 8,
        ..SPEC
    };
    let (_, log) = same_as_without(looping(1), 1, spec, &[job("yy", greedy(60))]);
    for b in log.iter().skip(1) {
        assert!(b.len() == 1 || b.len() == 9, "batch of {}", b.len());
    }
}

/// A step cost where each position costs half what a one-token step costs (about what the
/// default model's extra positions cost on a small CPU).
fn costly() -> StepCost {
    StepCost::linear(500, 500)
}

#[test]
fn drafts_that_keep_being_rejected_stop_when_they_cost() {
    // The whole-history hash never loops: lookups propose drafts that are almost all rejected.
    let prompt = "abcabcabcabc xyzxyz abcabc ".repeat(3);
    let jobs = [job(&prompt, greedy(120))];
    let always = SpecConfig {
        always: true,
        ..SPEC
    };
    let (free, _) = same_as_without(FakeConfig::default(), 1, always, &jobs);
    let costly = SpecConfig {
        cost: costly(),
        ..SPEC
    };
    let (adaptive, _) = same_as_without(FakeConfig::default(), 1, costly, &jobs);
    let (f, a) = (&free[0].2, &adaptive[0].2);
    assert!(f.draft_count > 100, "{f:?}");
    // The first rejections and the wrong guesses after them stop the drafts: no probes.
    assert!(a.draft_count * 10 < f.draft_count, "{a:?} vs {f:?}");
}

#[test]
fn a_sequence_drafts_again_once_its_guesses_come_true() {
    // An order-3 chain over 26 letters wanders before it falls into a loop: lookups guess
    // wrong, then right. The wrong guesses stop the drafts; the right ones restart them, with
    // no draft spent on probing.
    let jobs = [job("q", greedy(400))];
    let costly = SpecConfig {
        cost: costly(),
        ..SPEC
    };
    let (runs, log) = same_as_without(looping(3), 1, costly, &jobs);
    let done = &runs[0].2;
    assert!(done.draft_accepted_count > 100, "{done:?}");
    // The widths of its decode steps (1: no draft): before the loop, a few short drafts
    // at most; in it, full drafts (8 tokens) step after step.
    let widths: Vec<usize> = log
        .iter()
        .filter(|b| b.iter().all(|t| t.logits))
        .map(|b| b.len())
        .collect();
    let (before, after) = widths.split_at(widths.len() / 2);
    assert!(before.iter().filter(|&&n| n > 1).count() <= 5, "{widths:?}");
    assert!(
        after.iter().filter(|&&n| n == 9).count() >= 10,
        "{widths:?}"
    );
}

#[test]
fn accepted_drafts_stay_long_when_they_cost() {
    let jobs = [job("the cat sat on the mat", greedy(120))];
    let costly = SpecConfig {
        cost: costly(),
        ..SPEC
    };
    let (runs, log) = same_as_without(looping(2), 1, costly, &jobs);
    let done = &runs[0].2;
    assert!(done.draft_accepted_count > 60, "{done:?}");
    // Drafts of several tokens: a step carries more than next token + one draft.
    assert!(log.iter().any(|b| b.len() > 3), "no long draft");
}

#[test]
fn a_fuller_batch_drafts_less_when_positions_cost() {
    // Sequences in loops (drafts accepted), where a position costs a tenth of a one-token
    // step: one alone drafts in full, four in one step draft less each (the step is wide
    // already, so a drafted position must be surer to pay), and the output is unchanged.
    let per_step = |slots: usize| {
        let jobs: Vec<_> = (0..slots)
            .map(|i| job(&format!("{i} the cat sat on the mat"), greedy(60)))
            .collect();
        let cheap = SpecConfig {
            cost: StepCost::linear(900, 100),
            ..SPEC
        };
        let (_, log) = same_as_without(looping(2), slots, cheap, &jobs);
        // Drafted positions per sequence in each step where every sequence is generating.
        let widths: Vec<usize> = log
            .iter()
            .filter(|b| b.iter().all(|t| t.logits))
            .map(|b| b.len())
            .collect();
        let full: Vec<f64> = widths
            .iter()
            .filter(|&&w| w >= slots)
            .map(|&w| (w - slots) as f64 / slots as f64)
            .collect();
        full.iter().copied().fold(0.0, f64::max)
    };
    let one = per_step(1);
    let four = per_step(4);
    assert_eq!(one, 8.0, "1 slot: {one} drafted per step");
    assert!(
        four > 0.0 && four < one,
        "4 slots: {four} drafted per sequence and step, 1 slot: {one}"
    );
}
