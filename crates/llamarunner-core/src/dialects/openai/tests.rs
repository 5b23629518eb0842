//! Unit tests of the OpenAI dialect: request parameters and refusals, embedding inputs, text
//! offsets and base64 vectors.

use serde_json::{json, Value};

use super::answer::TextOffsets;
use super::embeddings::{base64_f32, embedding_inputs};
use super::request::OpenAiRequest;
use crate::requests::common::EmbedInput;

#[test]
fn embedding_inputs_are_text_token_ids_or_a_mix() {
    use EmbedInput::{Text, Tokens};
    let read = |v: Value| embedding_inputs(Some(v));
    assert_eq!(read(json!("a")).unwrap(), vec![Text("a".into())]);
    assert_eq!(read(json!([1, 2])).unwrap(), vec![Tokens(vec![1, 2])]);
    assert_eq!(
        read(json!(["a", [3, 4], "b"])).unwrap(),
        vec![Text("a".into()), Tokens(vec![3, 4]), Text("b".into())]
    );
    for bad in [
        json!([]),
        json!(5),
        json!([1.5]),
        json!([["x"]]),
        json!([{}]),
        json!(null),
    ] {
        assert!(read(bad.clone()).is_err(), "{bad}");
    }
}

#[test]
fn text_offsets_count_characters_across_chunks() {
    let mut at = TextOffsets::default();
    // "a", "é" split over two tokens, "b", an invalid byte, then "€" whole.
    let tokens: [&[u8]; 6] = [b"a", &[0xC3], &[0xA9], b"b", &[0xFF], "€".as_bytes()];
    let got: Vec<usize> = tokens.iter().map(|t| at.next(t)).collect();
    assert_eq!(got, vec![0, 1, 1, 2, 3, 4]);
    // A second chunk continues where the first ended.
    assert_eq!(at.next(b"x"), 5);
}

#[test]
fn base64_matches_the_standard_encoding() {
    // 1.0f32 = 00 00 80 3f; 2.0f32 = 00 00 00 40.
    assert_eq!(base64_f32(&[1.0]), "AACAPw==");
    assert_eq!(base64_f32(&[1.0, 2.0]), "AACAPwAAAEA=");
    assert_eq!(base64_f32(&[]), "");
}

#[test]
fn openai_defaults_and_refusals() {
    let req: OpenAiRequest = serde_json::from_str("{}").unwrap();
    let p = req.params(true).unwrap();
    assert_eq!((p.temperature, p.top_p, p.repeat_penalty), (1.0, 1.0, 1.0));
    assert_eq!(p.num_predict, -1);
    for body in [
        r#"{"n":0}"#,
        r#"{"n":9}"#,
        r#"{"best_of":2}"#,
        r#"{"temperature":3}"#,
        r#"{"logit_bias":{"x":1}}"#,
        r#"{"logit_bias":{"5":200}}"#,
        r#"{"top_logprobs":3}"#,
        r#"{"logprobs":true,"top_logprobs":21}"#,
        r#"{"response_format":{"type":"xml"}}"#,
        r#"{"response_format":{"type":"json_schema","json_schema":{"name":"x"}}}"#,
        // llama-server's own refusals: a type that is no format, a schema that is no
        // object, and two constraints of which one would be dropped.
        r#"{"response_format":{"type":123}}"#,
        r#"{"response_format":{"type":"sound"}}"#,
        r#"{"response_format":{"type":"json_object","schema":123}}"#,
        r#"{"json_schema":"yes"}"#,
        r#"{"json_schema":{"const":"42"},"grammar":"root ::= \"a\""}"#,
        r#"{"json_schema":{"const":"42"},"response_format":{"type":"json_object"}}"#,
        r#"{"max_tokens":-1}"#,
        r#"{"stop":[1]}"#,
    ] {
        let req: OpenAiRequest = serde_json::from_str(body).unwrap();
        assert!(req.params(true).is_err(), "{body} was accepted");
    }
    let req: OpenAiRequest = serde_json::from_str(
        r#"{"max_tokens":5,"max_completion_tokens":7,"stop":"x","logit_bias":{"3":-100},"logprobs":true,"top_logprobs":2,"seed":4}"#,
    )
    .unwrap();
    let p = req.params(true).unwrap();
    assert_eq!(p.num_predict, 7);
    assert_eq!(p.stop, vec!["x"]);
    assert_eq!(p.logit_bias, vec![(3, -100.0)]);
    assert_eq!(p.logprobs, Some(2));
    assert_eq!(p.seed, 4);
    assert_eq!(p.speculative, None);
    for (body, want) in [
        (r#"{"speculative":true}"#, Some(true)),
        (r#"{"speculative":false}"#, Some(false)),
        (r#"{"speculative":null}"#, None),
    ] {
        let req: OpenAiRequest = serde_json::from_str(body).unwrap();
        assert_eq!(req.params(true).unwrap().speculative, want, "{body}");
    }
    for body in [r#"{"speculative":"yes"}"#, r#"{"speculative":1}"#] {
        assert!(
            serde_json::from_str::<OpenAiRequest>(body).is_err(),
            "{body}"
        );
    }
    let req: OpenAiRequest = serde_json::from_str(r#"{"logprobs":3}"#).unwrap();
    assert_eq!(req.params(false).unwrap().logprobs, Some(3));
}
