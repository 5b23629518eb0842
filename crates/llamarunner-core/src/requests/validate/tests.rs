//! The checks of `requests::validate`, on the fake backend's model.

use super::*;

fn info() -> ModelInfo {
    crate::backend::fake::model_info(64)
}

fn params() -> SamplingParams {
    SamplingParams::default()
}

#[test]
fn meaningless_values_name_the_option() {
    for (p, name) in [
        (
            SamplingParams {
                num_predict: -2,
                ..params()
            },
            "num_predict",
        ),
        (
            SamplingParams {
                num_keep: -5,
                ..params()
            },
            "num_keep",
        ),
        (
            SamplingParams {
                top_p: 1.5,
                ..params()
            },
            "top_p",
        ),
        (
            SamplingParams {
                min_p: -0.1,
                ..params()
            },
            "min_p",
        ),
        (
            SamplingParams {
                typical_p: f32::NAN,
                ..params()
            },
            "typical_p",
        ),
        (
            SamplingParams {
                temperature: -1.0,
                ..params()
            },
            "temperature",
        ),
        (
            SamplingParams {
                temperature: f32::INFINITY,
                ..params()
            },
            "temperature",
        ),
        (
            SamplingParams {
                top_k: -1,
                ..params()
            },
            "top_k",
        ),
        (
            SamplingParams {
                mirostat: 3,
                ..params()
            },
            "mirostat",
        ),
        (
            SamplingParams {
                repeat_last_n: -2,
                ..params()
            },
            "repeat_last_n",
        ),
        (
            SamplingParams {
                stop: vec![String::new()],
                ..params()
            },
            "stop",
        ),
        (
            SamplingParams {
                stop: vec!["x".into(); MAX_STOP_STRINGS + 1],
                ..params()
            },
            "stop",
        ),
        (
            SamplingParams {
                stop: vec!["x".repeat(MAX_STOP_BYTES + 1)],
                ..params()
            },
            "stop",
        ),
    ] {
        let err = check_options(&p).unwrap_err();
        let err = err.to_string();
        assert!(err.contains(&format!("options.{name}")), "{name}: {err}");
    }
    assert_eq!(check_options(&params()), Ok(()));
    let edge = SamplingParams {
        stop: vec!["x".repeat(MAX_STOP_BYTES); MAX_STOP_STRINGS],
        num_keep: -1,
        repeat_last_n: -1,
        num_predict: -1,
        ..params()
    };
    assert_eq!(check_options(&edge), Ok(()));
}

#[test]
fn option_errors_render_under_each_dialects_names() {
    let p = SamplingParams {
        stop: vec![String::new()],
        ..params()
    };
    let e = check_options(&p).unwrap_err();
    assert_eq!(e.field, "stop");
    assert_eq!(e.to_string(), "options.stop must not contain empty strings");
    assert_eq!(
        e.top_level(&[]).to_string(),
        "stop must not contain empty strings"
    );
    assert_eq!(
        e.top_level(&[("stop", "stop_sequences")]).to_string(),
        "stop_sequences must not contain empty strings"
    );
    let p = SamplingParams {
        top_p: 2.0,
        ..params()
    };
    assert_eq!(
        check_options(&p)
            .unwrap_err()
            .top_level(&[("stop", "stop_sequences")])
            .to_string(),
        "top_p must be between 0 and 1, got 2"
    );
}

#[test]
fn repeat_last_n_is_clamped_to_the_slot() {
    for (given, want) in [
        (i32::MAX, 64),
        (-1, 64),
        (65, 64),
        (64, 64),
        (10, 10),
        (0, 0),
    ] {
        let mut p = SamplingParams {
            repeat_last_n: given,
            ..params()
        };
        check_for_model(&mut p, &info(), &Limits::default()).unwrap();
        assert_eq!(p.repeat_last_n, want, "{given}");
    }
}

#[test]
fn without_max_tokens_num_predict_is_capped_at_ten_slot_contexts() {
    let cap = i64::try_from(info().slot_ctx * UNCAPPED_SLOT_CONTEXTS).unwrap();
    for (given, want) in [
        (-1, -1),
        (0, 0),
        (50, 50),
        (cap, cap),
        (cap + 1, cap),
        (i64::from(i32::MAX), cap),
        (i64::MAX, cap),
    ] {
        let mut p = SamplingParams {
            num_predict: given,
            ..params()
        };
        check_for_model(&mut p, &info(), &Limits::default()).unwrap();
        assert_eq!(p.num_predict, want, "{given}");
    }
}

#[test]
fn num_predict_is_capped_by_max_tokens() {
    let limits = Limits {
        max_tokens: 100,
        timeout: None,
    };
    for (given, want) in [
        (-1, 100),
        (0, 0),
        (50, 50),
        (100, 100),
        (101, 100),
        (i64::MAX, 100),
    ] {
        let mut p = SamplingParams {
            num_predict: given,
            ..params()
        };
        check_for_model(&mut p, &info(), &limits).unwrap();
        assert_eq!(p.num_predict, want, "{given}");
    }
    let mut p = params();
    check_for_model(&mut p, &info(), &Limits::default()).unwrap();
    assert_eq!(p.num_predict, -1, "no cap without --max-tokens");
}

#[test]
fn logit_bias_ids_and_count_and_top_logprobs_are_checked() {
    let n_vocab = i32::try_from(info().n_vocab).unwrap();
    for bias in [
        vec![(-1, 1.0)],
        vec![(n_vocab, 1.0)],
        vec![(i32::MAX, 1.0)],
        vec![(3, f32::NAN)],
    ] {
        let mut p = SamplingParams {
            logit_bias: bias.clone(),
            ..params()
        };
        let err = check_for_model(&mut p, &info(), &Limits::default()).unwrap_err();
        assert_eq!(err.kind(), "invalid_request", "{bias:?}");
    }
    let mut p = SamplingParams {
        logit_bias: vec![(0, -100.0), (n_vocab - 1, 100.0)],
        ..params()
    };
    assert!(check_for_model(&mut p, &info(), &Limits::default()).is_ok());
    let mut p = SamplingParams {
        logit_bias: vec![(1, 1.0); MAX_LOGIT_BIAS + 1],
        ..params()
    };
    assert!(check_for_model(&mut p, &info(), &Limits::default()).is_err());
    let mut p = SamplingParams {
        logprobs: Some(MAX_TOP_LOGPROBS + 1),
        ..params()
    };
    assert!(check_for_model(&mut p, &info(), &Limits::default()).is_err());
    let mut p = SamplingParams {
        logprobs: Some(MAX_TOP_LOGPROBS),
        ..params()
    };
    assert!(check_for_model(&mut p, &info(), &Limits::default()).is_ok());
}

#[test]
fn huge_grammars_are_refused_before_any_parser_sees_them() {
    let huge = format!("root ::= {}\"a\"{}", "(".repeat(70_000), ")".repeat(70_000));
    let mut p = SamplingParams {
        grammar: Some(crate::constrain::Grammar::new(
            crate::constrain::GrammarSource::Gbnf(huge),
        )),
        ..params()
    };
    let err = check_for_model(&mut p, &info(), &Limits::default()).unwrap_err();
    assert!(err.to_string().contains("bytes"), "{err}");
}

#[test]
fn prompts_are_fitted_into_the_slot_or_refused() {
    let info = info();
    let mut short: Vec<Token> = (0..63).collect();
    assert!(!fit_prompt(&mut short, &params(), &info).unwrap());
    assert_eq!(short.len(), 63);
    let mut long: Vec<Token> = (0..200).collect();
    assert!(fit_prompt(&mut long, &params(), &info).unwrap());
    assert!(long.len() < 64, "{}", long.len());
    assert_eq!(&long[..4], &[0, 1, 2, 3], "num_keep 4 kept the head");
    assert_eq!(long.last(), Some(&199), "the most recent token kept");
    let no = SamplingParams {
        truncate: false,
        ..params()
    };
    let err = fit_prompt(&mut (0..64).collect(), &no, &info).unwrap_err();
    assert_eq!(err.kind(), "context_length_exceeded");
}

#[tokio::test]
async fn text_too_long_to_tokenize_is_refused_before_tokenizing() {
    let info = Arc::new(info());
    let max = max_text_bytes(&info);
    let err = tokenize(&info, "a".repeat(max + 1), "prompt")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "context_length_exceeded");
    assert!(err.to_string().contains("bytes of text"), "{err}");
    let tokens = tokenize(&info, "a".repeat(max), "prompt").await.unwrap();
    assert_eq!(tokens.len(), max + 1);
}

#[tokio::test]
async fn tokenizing_text_may_skip_bos_and_give_nothing() {
    let info = Arc::new(info());
    assert_eq!(
        tokenize_text(&info, "hi".into(), false, "content")
            .await
            .unwrap(),
        [104, 105]
    );
    assert_eq!(
        tokenize_text(&info, "hi".into(), true, "content")
            .await
            .unwrap(),
        [257, 104, 105]
    );
    assert!(tokenize_text(&info, String::new(), false, "content")
        .await
        .unwrap()
        .is_empty());
    let max = max_text_bytes(&info);
    let err = tokenize_text(&info, "a".repeat(max + 1), false, "content")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "context_length_exceeded");
}

#[test]
fn token_ids_to_detokenize_are_inside_the_vocabulary_and_bounded() {
    let info = info();
    assert_eq!(
        check_token_ids(&[0, 104, 257], &info).unwrap(),
        [0, 104, 257]
    );
    assert!(check_token_ids(&[], &info).unwrap().is_empty());
    for bad in [-1, 258, i64::from(i32::MAX) + 1, i64::MIN, i64::MAX] {
        let err = check_token_ids(&[1, bad], &info).unwrap_err();
        assert_eq!(err.kind(), "invalid_request", "{bad}");
        assert!(err.to_string().starts_with("tokens[1]: "), "{err}");
    }
    let max = max_detokenize_tokens(&info);
    assert_eq!(max, MIN_DETOKENIZE_TOKENS);
    assert!(check_token_ids(&vec![1; max], &info).is_ok());
    let err = check_token_ids(&vec![1; max + 1], &info).unwrap_err();
    assert_eq!(err.kind(), "context_length_exceeded");
}

#[tokio::test]
async fn a_client_s_token_ids_outside_the_vocabulary_are_its_error() {
    let info = Arc::new(info());
    let limits = Limits::default();
    for (tokens, wanted) in [
        (
            vec![1, 258],
            "prompt token 1: 258 is not in the vocabulary (0..258)",
        ),
        (vec![-3], "prompt token 0: -3 is not in the vocabulary"),
        (vec![], "the prompt must not be empty"),
    ] {
        let err = generation_tokens(&info, &limits, tokens, params())
            .await
            .unwrap_err();
        assert_eq!(err.kind(), "invalid_request", "{err}");
        assert!(err.to_string().contains(wanted), "{err}");
    }
    let valid = generation_tokens(&info, &limits, vec![257, 104], params())
        .await
        .unwrap();
    assert_eq!(valid.tokens, [257, 104]);
}

#[tokio::test]
async fn embedding_inputs_are_cut_or_refused() {
    let info = Arc::new(info());
    let long = "x".repeat(100);
    let (tokens, cut) = embedding_input(&info, long.clone(), true).await.unwrap();
    assert!(cut && tokens.len() == 64);
    let err = embedding_input(&info, long, false).await.unwrap_err();
    assert_eq!(err.kind(), "context_length_exceeded");
    assert!(embedding_input(&info, String::new(), true).await.is_err());
}
