//! The text of a step's first token assembled on the thread that sampled it (`Pick::give_text`,
//! `presample`) or on the engine thread (`sample_one`): the same output, token for token,
//! whatever ends the request (a stop string, EOG, `ignore_eos`, `num_predict`, a context
//! shift, a grammar's end) and with drafts, log-probabilities and characters split between
//! tokens (a grammar makes the fake write "é", two byte tokens). A token the sampling thread
//! pushed that `sample_one` never took (an EOG the hook should have left alone) trips the
//! scheduler's debug assertion when its sequence finishes.

use proptest::prelude::*;

use super::speculative::{job, run_all, speculating, Run, SPEC};
use super::*;

/// The jobs run on a harness whose backend gives each pick's text (`on_engine` false) or
/// leaves it to the engine thread.
fn runs(
    config: &FakeConfig,
    on_engine: bool,
    drafts: bool,
    jobs: &[(String, SamplingParams)],
) -> Vec<Run> {
    let config = FakeConfig {
        text_on_engine: on_engine,
        ..config.clone()
    };
    let h = if drafts {
        speculating(config, 3, SPEC)
    } else {
        Harness::new(config, 3)
    };
    let out = run_all(&h, jobs);
    h.settled();
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn text_assembled_where_it_was_sampled_is_the_text_assembled_on_the_engine(
        prompts in prop::collection::vec("[a-e \u{e9}]{1,10}", 1..6),
        stop_at in 0usize..40,
        stop_len in 1usize..4,
        n in 1i64..70,
        ignore_eos in any::<bool>(),
        eos_at in prop::option::of(4usize..60),
        markov in prop::option::of(1usize..3),
        drafts in any::<bool>(),
        logprobs in any::<bool>(),
        seeded in any::<bool>(),
        slot_ctx in 24usize..96,
        constrained in any::<bool>(),
    ) {
        let config = FakeConfig { eos_at, markov, slot_ctx, ..FakeConfig::default() };
        let grammar = constrained.then(|| {
            let compiler = crate::constrain::Compiler::new(|| {
                use crate::protocol::TextModel;
                crate::backend::fake::FakeText.vocabulary()
            });
            let mut grammar = crate::constrain::Grammar::new(crate::constrain::GrammarSource::Gbnf(
                r#"root ::= [a-e]+ "é" [a-c]*"#.into(),
            ));
            compiler.compile_into(&mut grammar).expect("compiles");
            grammar
        });
        let params = |i: usize, stop: Vec<String>| SamplingParams {
            num_predict: n,
            ignore_eos,
            stop,
            logprobs: logprobs.then_some(2),
            seed: 5 + i as i64,
            temperature: if seeded { 0.8 } else { 0.0 },
            grammar: grammar.clone(),
            ..SamplingParams::default()
        };
        // A stop string from the output itself (so that it is met), else one never met.
        let plain: Vec<(String, SamplingParams)> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| job(p, params(i, Vec::new())))
            .collect();
        let first = runs(&config, true, false, &plain[..1]);
        let stop = first[0]
            .0
            .get(stop_at..stop_at + stop_len)
            .unwrap_or("never")
            .to_string();
        let jobs: Vec<(String, SamplingParams)> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| job(p, params(i, vec![stop.clone()])))
            .collect();
        let on_engine = runs(&config, true, drafts, &jobs);
        let on_pool = runs(&config, false, drafts, &jobs);
        for ((e, p), (prompt, _)) in on_engine.iter().zip(&on_pool).zip(&jobs) {
            prop_assert_eq!(&e.0, &p.0, "text of {:?}", prompt);
            prop_assert_eq!(&e.1, &p.1, "logprobs of {:?}", prompt);
            prop_assert_eq!(e.2.eval_count, p.2.eval_count, "{:?}", prompt);
            prop_assert_eq!(e.2.done_reason, p.2.done_reason, "{:?}", prompt);
            prop_assert_eq!(&e.2.stop_string, &p.2.stop_string, "{:?}", prompt);
        }
    }
}
