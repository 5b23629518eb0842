//! llama-server's formats: detection, defaults, timings, biases, answers.

use super::timings::timings_of;
use super::*;
use serde_json::json;

/// Timings as the JSON object they are written as, to read by key.
fn value(t: Timings) -> Value {
    serde_json::to_value(t).unwrap()
}

#[test]
fn the_body_s_fields_choose_the_format() {
    for (body, llama_server) in [
        (r#"{"prompt": "hi", "n_predict": 8}"#, true),
        (r#"{"prompt": "hi", "stream": true}"#, true),
        (r#"{"prompt": [1, 2], "temperature": 0}"#, true),
        (r#"{"Prompt": "hi", "N_Predict": 8}"#, true),
        // A prompt of token ids alone: the runner's prompt is text.
        (r#"{"prompt": [1, 2]}"#, true),
        (r#"{"prompt": {"prompt_string": "hi"}}"#, true),
        (r#"{"prompt": "hi", "logit_bias": [[1, false]]}"#, true),
        (r#"{"prompt": "hi", "max_tokens": 4}"#, true),
        (r#"{"prompt": "hi", "dry_multiplier": 0.5}"#, true),
        (r#"{"prompt": "hi", "n_cmpl": 2}"#, true),
        // The Ollama runner's: options, or nothing llama-server's.
        (r#"{"prompt": "hi"}"#, false),
        (r#"{"prompt": "hi", "options": {"num_predict": 2}}"#, false),
        (r#"{"prompt": "hi", "Options": {}, "stream": true}"#, false),
        (r#"{"messages": [], "think": true}"#, false),
        // The runner's messages, even beside a field of llama-server's.
        (r#"{"messages": [], "stream": true}"#, false),
        (
            r#"{"prompt": "hi", "lora": [], "cache_prompt": false}"#,
            false,
        ),
        ("not json", false),
        ("[1, 2]", false),
    ] {
        assert_eq!(
            is_llama_server_body(body.as_bytes()),
            llama_server,
            "{body}"
        );
    }
}

#[test]
fn params_take_llama_server_s_defaults_and_refuse_what_is_not_given() {
    let (engine, _inbox) = crate::protocol::EngineHandle::new(4);
    let state = AppState::new(engine, "m");
    let req: CompletionRequest = serde_json::from_str(r#"{"prompt": "hi"}"#).unwrap();
    let p = req.params(&state).unwrap();
    assert_eq!((p.top_p, p.min_p, p.repeat_penalty), (0.95, 0.05, 1.0));
    assert_eq!(p.num_predict, -1);
    let req: CompletionRequest =
        serde_json::from_str(r#"{"prompt": "hi", "n_predict": 3, "temperature": 0}"#).unwrap();
    let p = req.params(&state).unwrap();
    assert_eq!((p.num_predict, p.temperature), (3, 0.0));
    for (body, logprobs) in [
        (r#"{"n_probs": 2}"#, Some(2)),
        (r#"{"return_tokens": true}"#, Some(0)),
        (r#"{"n_probs": 3, "return_tokens": true}"#, Some(3)),
        (r#"{"n_probs": 0, "return_tokens": false}"#, None),
    ] {
        let req: CompletionRequest = serde_json::from_str(body).unwrap();
        assert_eq!(req.params(&state).unwrap().logprobs, logprobs, "{body}");
    }
    let req: CompletionRequest =
        serde_json::from_str(r#"{"n_probs": 2, "post_sampling_probs": true}"#).unwrap();
    assert!(req.params(&state).unwrap().post_sampling_probs);
    for (body, wanted) in [
        (r#"{"n_probs": 21}"#, "n_probs must be at most 20"),
        (r#"{"n_cmpl": 2}"#, "n_cmpl"),
        (
            r#"{"grammar": "root ::= \"a\"", "json_schema": {}}"#,
            "one constraint",
        ),
        (r#"{"json_schema": 3}"#, "json_schema must be an object"),
    ] {
        let req: CompletionRequest = serde_json::from_str(body).unwrap();
        let err = req.params(&state).unwrap_err().to_string();
        assert!(err.contains(wanted), "{body}: {err}");
    }
}

#[test]
fn a_stream_s_clock_counts_its_tokens_and_times_its_parts() {
    let mut clock = StreamClock::admitted(10, 4);
    let t = value(clock.timings());
    assert_eq!(
        (t["cache_n"].as_u64(), t["prompt_n"].as_u64()),
        (Some(4), Some(6))
    );
    assert_eq!(t["predicted_n"], 0);
    std::thread::sleep(std::time::Duration::from_millis(5));
    clock.text(0); // one event, no token count: one token
    clock.text(3); // three tokens' log-probabilities
    std::thread::sleep(std::time::Duration::from_millis(5));
    let t = value(clock.timings());
    assert_eq!(t["predicted_n"], 4);
    assert!(t["prompt_ms"].as_f64().unwrap() >= 5.0, "{t}");
    assert!(t["predicted_ms"].as_f64().unwrap() >= 5.0, "{t}");
    assert!(t["predicted_per_second"].as_f64().unwrap() > 0.0, "{t}");
}

#[test]
fn logit_bias_is_read_in_both_of_llama_server_s_shapes() {
    let read = |v: Value| LogitBias::read(&v).map_err(|e| e.to_string());
    let pairs = read(json!([[15, -100], [" the ", false], [7, 2.5]])).unwrap();
    assert_eq!(pairs.ids, [(15, -100.0), (7, 2.5)]);
    assert_eq!(pairs.texts, [(" the ".to_string(), f32::NEG_INFINITY)]);
    let object = read(json!({"15": -100, " the ": -1})).unwrap();
    assert_eq!(object.ids, [(15, -100.0)]);
    assert_eq!(object.texts, [(" the ".to_string(), -1.0)]);
    assert_eq!(read(Value::Null).unwrap(), LogitBias::default());
    for bad in [
        json!(3),
        json!([[1]]),
        json!([[1, true]]),
        json!([[1, "x"]]),
        json!([[-1, 1]]),
        json!([[[1], 1]]),
        json!({"a": null}),
    ] {
        assert!(
            read(bad.clone()).unwrap_err().contains("logit_bias"),
            "{bad}"
        );
    }
    let many: Vec<Value> = (0..4097).map(|i| json!([i, 1])).collect();
    assert!(read(Value::Array(many))
        .unwrap_err()
        .contains("at most 4096"));
}

#[test]
fn stop_types_name_why_it_ended() {
    let done = |done_reason, stop: Option<&str>| Completion {
        done_reason,
        prompt_eval_count: 3,
        prompt_cached_count: 0,
        queue_duration_ns: 0,
        prompt_eval_duration_ns: 0,
        eval_count: 1,
        eval_duration_ns: 0,
        truncated: false,
        draft_count: 0,
        draft_accepted_count: 0,
        stop_string: stop.map(String::from),
    };
    assert_eq!(stop_type(&done(DoneReason::Stop, None)), "eos");
    assert_eq!(stop_type(&done(DoneReason::Stop, Some("\n"))), "word");
    assert_eq!(stop_type(&done(DoneReason::Length, None)), "limit");
    assert_eq!(stop_type(&done(DoneReason::Timeout, None)), "limit");
}

#[test]
fn the_generation_rate_is_over_its_decode_steps() {
    let one = value(timings_of(2, 8, 4.0, 1, 0.0));
    assert_eq!(one["predicted_per_second"], 0.0);
    assert_eq!(one["predicted_per_token_ms"], 0.0);
    assert_eq!(one["prompt_per_token_ms"], 0.5);
    assert_eq!(one["prompt_per_second"], 2000.0);
    let many = value(timings_of(0, 8, 4.0, 16, 30.0));
    assert_eq!(many["predicted_per_token_ms"], 2.0);
    assert_eq!(many["predicted_per_second"], 500.0);
    let nothing = value(timings_of(0, 0, 0.0, 0, 0.0));
    for (key, value) in nothing.as_object().unwrap() {
        assert!(value.as_f64().is_some_and(|v| v == 0.0), "{key}: {value}");
    }
    let p = crate::protocol::PromptProgress {
        total: 40,
        cache: 8,
        processed: 24,
        time_ms: 16,
    };
    let t = value(progress_timings(&p));
    assert_eq!(
        (t["cache_n"].clone(), t["prompt_n"].clone()),
        (json!(8), json!(16))
    );
    assert_eq!(t["predicted_n"], 0);
}
