//! Drafts from a draft model (the fake's: it predicts as the model's greedy choice, or as a
//! different model), inside the continuous batching: the output is the output without drafts,
//! token for token, single and batched, through stops, EOG, `num_predict`, logprobs, context
//! shifts, catch-ups longer than a batch, and failed draft decodes.

use super::speculative::{job, looping, run_all, same_as_without, speculating, SPEC};
use super::*;

/// The fake with a draft model drafting as `offset` (0: the model's own greedy choice).
fn with_draft(offset: u64) -> FakeConfig {
    FakeConfig {
        draft: Some(offset),
        ..FakeConfig::default()
    }
}

#[test]
fn a_draft_of_the_same_weights_is_always_accepted_and_the_output_is_unchanged() {
    // The whole-history hash never repeats, so prompt lookup finds nothing; the draft model
    // predicts every token.
    for slots in [1, 4] {
        let jobs: Vec<_> = (0..slots)
            .map(|i| job(&format!("draft me {i}"), greedy(50 + i as i64)))
            .collect();
        let (runs, log) = same_as_without(with_draft(0), slots, SPEC, &jobs);
        for (_, _, done) in &runs {
            assert!(done.draft_count > 30, "{slots} slots: {done:?}");
            assert_eq!(done.draft_accepted_count, done.draft_count, "{done:?}");
        }
        // Far fewer decode steps than tokens.
        let steps = log.iter().filter(|b| b.iter().all(|t| t.logits)).count();
        assert!(steps * 3 < 50 * slots, "{steps} steps");
    }
}

#[test]
fn a_draft_of_other_weights_is_mostly_rejected_and_the_output_is_unchanged() {
    for slots in [1, 4] {
        let jobs: Vec<_> = (0..slots)
            .map(|i| job(&format!("other weights {i}"), greedy(40)))
            .collect();
        let (runs, _) = same_as_without(with_draft(7), slots, SPEC, &jobs);
        for (_, _, done) in &runs {
            assert!(done.draft_count > 0, "{done:?}");
            assert!(done.draft_accepted_count * 4 < done.draft_count, "{done:?}");
        }
    }
}

#[test]
fn one_batched_draft_pass_per_step_with_one_token_per_sequence_after_the_catch_up() {
    let h = speculating(with_draft(0), 4, SPEC);
    let jobs: Vec<_> = (0..4)
        .map(|i| job(&format!("batched {i}"), greedy(30)))
        .collect();
    run_all(&h, &jobs);
    h.settled();
    let drafts = h.draft_log.lock().unwrap().clone();
    assert!(!drafts.is_empty());
    for b in &drafts {
        // Within one draft decode, a sequence carries either its catch-up (the prompt, the
        // tokens accepted since) or exactly one drafted token; all of them each time it has
        // logits for one position only.
        let mut seqs: Vec<i32> = b.iter().filter(|t| t.logits).map(|t| t.seq).collect();
        let n = seqs.len();
        seqs.dedup();
        assert_eq!(seqs.len(), n, "two logits for one sequence: {b:?}");
    }
    // Some draft decodes carried several sequences at once.
    assert!(drafts
        .iter()
        .any(|b| b.iter().filter(|t| t.logits).count() > 1));
}

#[test]
fn stops_eog_num_predict_and_logprobs_are_unchanged_by_model_drafts() {
    let plain = run_all(
        &Harness::new(FakeConfig::default(), 1),
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
    let (runs, _) = same_as_without(with_draft(0), 2, SPEC, &jobs);
    assert_eq!(runs[6].2.done_reason, DoneReason::Stop);
    assert_eq!(runs[6].0, full[..full.find(&stop).unwrap()]);
    assert_eq!(runs[5].2.eval_count, 60);
    let config = FakeConfig {
        eos_at: Some(40),
        ..with_draft(0)
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
fn context_shifts_and_catch_ups_longer_than_a_batch_resync_the_draft_cache() {
    // A 48-cell slot shifts several times in 150 tokens; a batch of 8 takes a 30-token prompt
    // in pieces, on the model and on the draft model (which catches up over several steps).
    let config = FakeConfig {
        slot_ctx: 48,
        batch_capacity: 8,
        ..looping(3)
    };
    let config = FakeConfig {
        draft: Some(0),
        ..config
    };
    let jobs = [
        job("a prompt of thirty characters.", greedy(150)),
        job("short", greedy(120)),
    ];
    let (runs, _) = same_as_without(config, 2, SPEC, &jobs);
    assert!(runs[0].2.draft_accepted_count > 20, "{:?}", runs[0].2);
}

#[test]
fn a_failed_draft_decode_drops_that_steps_drafts_only() {
    let config = FakeConfig {
        fail_draft_decode: Some(3),
        ..with_draft(0)
    };
    let jobs = [job("fail once", greedy(40)), job("and go on", greedy(40))];
    let (runs, _) = same_as_without(config, 2, SPEC, &jobs);
    for (_, _, done) in &runs {
        assert_eq!(done.done_reason, DoneReason::Length);
        assert!(done.draft_accepted_count > 10, "{done:?}");
    }
}

#[test]
fn unsure_drafts_and_requests_that_do_not_speculate_draft_nothing() {
    // Every drafted token below p_min: no draft.
    let config = FakeConfig {
        draft_p: 0.5,
        ..with_draft(0)
    };
    let (runs, _) = same_as_without(config, 1, SPEC, &[job("unsure", greedy(20))]);
    assert_eq!(runs[0].2.draft_count, 0);
    let h = speculating(with_draft(0), 1, SPEC);
    let off = SamplingParams {
        speculative: Some(false),
        ..greedy(20)
    };
    let runs = run_all(&h, &[job("no thanks", off)]);
    assert_eq!(runs[0].2.draft_count, 0);
    h.settled();
    assert!(h.draft_log.lock().unwrap().is_empty());
}
