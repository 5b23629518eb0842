//! Unit tests of the Anthropic dialect: parameters, thinking, structured output, conversations
//! and tools as the chat path reads them, and stop reasons.

use serde_json::{json, Value};

use super::answer::Meta;
use super::conversation::{chat_messages, tool_request};
use super::request::MessagesRequest;
use crate::protocol::{Completion, DoneReason};
use crate::requests::tool_calls;

fn req(body: Value) -> MessagesRequest {
    serde_json::from_value(body).unwrap()
}

#[test]
fn params_follow_anthropic_and_refuse_what_it_refuses() {
    let p = req(json!({"max_tokens": 7, "stop_sequences": ["x", ""], "top_k": 3}))
        .params()
        .unwrap();
    assert_eq!(
        (p.num_predict, p.temperature, p.top_p, p.top_k),
        (7, 1.0, 1.0, 3)
    );
    assert_eq!(p.stop, vec!["x"]);
    assert!(!p.truncate);
    for body in [
        json!({}),
        json!({"max_tokens": 0}),
        json!({"max_tokens": 5, "temperature": 1.5}),
        json!({"max_tokens": 5, "top_k": -1}),
    ] {
        assert!(req(body.clone()).params().is_err(), "{body} was accepted");
    }
}

#[test]
fn thinking_is_enabled_disabled_or_the_templates_default() {
    let think = |t: Value| req(json!({"max_tokens": 4096, "thinking": t})).think();
    assert_eq!(think(Value::Null).unwrap(), None);
    assert_eq!(think(json!({"type": "disabled"})).unwrap(), Some(false));
    assert_eq!(
        think(json!({"type": "enabled", "budget_tokens": 2048})).unwrap(),
        Some(true)
    );
    for bad in [
        json!({"type": "enabled"}),
        json!({"type": "enabled", "budget_tokens": 0}),
        json!({"type": "enabled", "budget_tokens": -5}),
        json!({"type": "enabled", "budget_tokens": 5000}),
        json!({"type": "sometimes"}),
    ] {
        assert!(think(bad.clone()).is_err(), "{bad} was accepted");
    }
    assert_eq!(think(json!({"type": "adaptive"})).unwrap(), None);
    // Below Anthropic's 1024, as llama-server takes it.
    assert_eq!(
        think(json!({"type": "enabled", "budget_tokens": 50})).unwrap(),
        Some(true)
    );
}

#[test]
fn output_config_format_is_a_grammar_and_its_mistakes_are_refused() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    for body in [
        json!({"max_tokens": 5, "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}}),
        json!({"max_tokens": 5, "output_format": {"type": "json_schema", "schema": schema}}),
    ] {
        assert!(
            req(body.clone()).params().unwrap().grammar.is_some(),
            "{body}"
        );
    }
    let p = req(json!({"max_tokens": 5, "output_config": {"effort": "high"}})).params();
    assert!(p.unwrap().grammar.is_none());
    for body in [
        json!({"max_tokens": 5, "output_config": 3}),
        json!({"max_tokens": 5, "output_config": {"effort": "extreme"}}),
        json!({"max_tokens": 5, "output_config": {"format": {"type": "json_object"}}}),
        json!({"max_tokens": 5, "output_config": {"format": {"type": "json_schema"}}}),
        json!({"max_tokens": 5, "output_format": {"type": "json_schema", "schema": []}}),
    ] {
        assert!(req(body.clone()).params().is_err(), "{body} was accepted");
    }
}

#[test]
fn a_conversation_with_tools_becomes_chat_messages() {
    let messages = chat_messages(
        Some(&json!([{"type": "text", "text": "Be terse."}])),
        &[
            json!({"role": "user", "content": "weather in Paris?"}),
            json!({"role": "assistant", "content": [
                {"type": "thinking", "thinking": "use the tool", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ]}),
            json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "20C"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": true},
                {"type": "text", "text": "and tomorrow?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"}},
            ]}),
        ],
    )
    .unwrap();
    assert_eq!(
        messages,
        vec![
            json!({"role": "system", "content": "Be terse."}),
            json!({"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]}),
            json!({"role": "assistant", "content": "Checking.", "reasoning_content": "use the tool",
                   "tool_calls": [{"id": "toolu_1", "type": "function",
                                   "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}),
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": "20C"}),
            json!({"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"}),
            json!({"role": "user", "content": [
                {"type": "text", "text": "and tomorrow?"},
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}},
            ]}),
        ]
    );
}

#[test]
fn bad_conversations_are_refused_naming_the_place() {
    for (system, messages, names) in [
        (
            json!(5),
            vec![json!({"role": "user", "content": "x"})],
            "system",
        ),
        (
            Value::Null,
            vec![json!({"role": "system", "content": "x"})],
            "messages.0.role",
        ),
        (
            Value::Null,
            vec![json!({"role": "user", "content": 5})],
            "messages.0.content",
        ),
        (
            Value::Null,
            vec![json!({"role": "user", "content": [{"type": "document", "source": {}}]})],
            "messages.0.content.0.type",
        ),
        (
            Value::Null,
            vec![json!({"role": "user", "content": [{"type": "tool_result"}]})],
            "messages.0.content.0.tool_use_id",
        ),
        (
            Value::Null,
            vec![
                json!({"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": 3}]}),
            ],
            "messages.0.content.0.input",
        ),
        (
            Value::Null,
            vec![
                json!({"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}),
            ],
            "messages.0.content.0.source",
        ),
    ] {
        let err = chat_messages(Some(&system), &messages)
            .unwrap_err()
            .to_string();
        assert!(err.contains(names), "{err:?} does not name {names}");
    }
}

#[test]
fn tools_and_tool_choice_map_to_the_chat_path() {
    let tools = [
        json!({"name": "get_weather", "description": "d", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}}}),
    ];
    let t = tool_request(Some(&tools), None).unwrap().unwrap();
    assert_eq!(t.tools[0].name, "get_weather");
    assert_eq!(t.choice, tool_calls::ToolChoice::Auto);
    assert!(t.parallel);
    let t = tool_request(
        Some(&tools),
        Some(&json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true})),
    )
    .unwrap()
    .unwrap();
    assert_eq!(
        t.choice,
        tool_calls::ToolChoice::Named("get_weather".into())
    );
    assert!(!t.parallel);
    let t = tool_request(Some(&tools), Some(&json!({"type": "any"})))
        .unwrap()
        .unwrap();
    assert_eq!(t.choice, tool_calls::ToolChoice::Required);
    for (tools, choice) in [
        (
            vec![json!({"type": "web_search_20250305", "name": "web_search"})],
            Value::Null,
        ),
        (vec![json!({"name": "f"})], Value::Null),
        (tools.to_vec(), json!({"type": "tool"})),
        (tools.to_vec(), json!({"type": "tool", "name": "other"})),
        (tools.to_vec(), json!({"type": "sometimes"})),
    ] {
        assert!(
            tool_request(Some(&tools), Some(&choice)).is_err(),
            "{tools:?} {choice}"
        );
    }
}

#[test]
fn stop_reasons_say_why_the_turn_ended() {
    let meta = Meta {
        id: "msg_x".into(),
        model: "m".into(),
        stop_sequences: vec!["END".into()],
    };
    let done = |reason, stop: Option<&str>| Completion {
        done_reason: reason,
        prompt_eval_count: 3,
        prompt_cached_count: 0,
        queue_duration_ns: 0,
        prompt_eval_duration_ns: 0,
        eval_count: 2,
        eval_duration_ns: 0,
        truncated: false,
        draft_count: 0,
        draft_accepted_count: 0,
        stop_string: stop.map(str::to_string),
    };
    assert_eq!(
        meta.stop_reason(&done(DoneReason::Stop, None), false).0,
        "end_turn"
    );
    assert_eq!(
        meta.stop_reason(&done(DoneReason::Stop, Some("<end_of_turn>")), false)
            .0,
        "end_turn"
    );
    assert_eq!(
        meta.stop_reason(&done(DoneReason::Stop, Some("END")), false),
        ("stop_sequence", json!("END"))
    );
    assert_eq!(
        meta.stop_reason(&done(DoneReason::Length, None), false).0,
        "max_tokens"
    );
    assert_eq!(
        meta.stop_reason(&done(DoneReason::Stop, None), true).0,
        "tool_use"
    );
}
