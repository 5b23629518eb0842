//! Unit tests of the Responses dialect: input items, refusals, parameters, reasoning, tools,
//! metadata and the conversation kept with a response.

use serde_json::{json, Value};

use super::answer::{call_item, keep_response, message_item, reasoning_item};
use super::input::{input_messages, input_messages_after};
use super::request::{tool_request, ResponsesRequest};
use crate::http::response_store::ResponseStore;
use crate::requests::tool_calls;

#[test]
fn metadata_is_bounded_as_openai_bounds_it() {
    use super::check_metadata;
    let ok = |v: Value| check_metadata(Some(&v)).is_ok();
    assert!(check_metadata(None).is_ok());
    assert!(ok(json!(null)));
    assert!(ok(json!({})));
    assert!(ok(json!({"user": "ann", "k".repeat(64): "v".repeat(512)})));
    let many: serde_json::Map<String, Value> =
        (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    for bad in [
        json!([1]),
        json!("x"),
        json!({"k": 1}),
        json!({"k": ["v"]}),
        json!({"k".repeat(65): "v"}),
        json!({"k": "v".repeat(513)}),
        Value::Object(many),
    ] {
        assert!(!ok(bad.clone()), "{bad}");
    }
}

fn req(body: Value) -> ResponsesRequest {
    serde_json::from_value(body).unwrap()
}

#[test]
fn input_items_become_chat_messages() {
    let got = input_messages(Some(&json!([
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "weather?"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
        ]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "20C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "18C"}]},
    ])))
    .unwrap();
    assert_eq!(
        got,
        vec![
            json!({"role": "system", "content": "Be terse."}),
            json!({"role": "user", "content": [
                {"type": "text", "text": "weather?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ]}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            ]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "20C"}),
            json!({"role": "tool", "tool_call_id": "call_2", "content": "18C"}),
        ]
    );
    // A call re-sent after the turn that made it is that call, once.
    let turn = json!({"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
    let again = input_messages_after(
        vec![turn.clone()],
        Some(&json!([
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
        ])),
    )
    .unwrap();
    assert_eq!(
        again,
        vec![
            turn,
            json!({"role": "tool", "tool_call_id": "call_1", "content": "ok"})
        ]
    );
    assert_eq!(
        input_messages(Some(&json!("hi"))).unwrap(),
        vec![json!({"role": "user", "content": "hi"})]
    );
}

#[test]
fn bad_input_is_refused_naming_the_place() {
    for (input, names) in [
        (json!(5), "input"),
        (json!([{"role": "tool", "content": "x"}]), "input[0].role"),
        (json!([{"role": "user", "content": 3}]), "input[0].content"),
        (
            json!([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
            "input[0].content[0].type",
        ),
        (
            json!([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]),
            "input[0].content[0]",
        ),
        (
            json!([{"type": "function_call", "name": "f", "arguments": "{}"}]),
            "input[0].call_id",
        ),
        (
            json!([{"type": "function_call_output", "call_id": "c", "output": 3}]),
            "input[0].output",
        ),
        (
            json!([{"type": "item_reference", "id": "x"}]),
            "input[0].type",
        ),
    ] {
        let err = input_messages(Some(&input)).unwrap_err().to_string();
        assert!(err.contains(names), "{err:?} does not name {names}");
    }
}

#[test]
fn params_formats_and_refusals() {
    let p = req(json!({"max_output_tokens": 9, "truncation": "auto"}))
        .params()
        .unwrap();
    assert_eq!((p.num_predict, p.temperature, p.top_p), (9, 1.0, 1.0));
    assert!(p.truncate && p.grammar.is_none());
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    for text in [
        json!({"format": {"type": "json_object"}}),
        json!({"format": {"type": "json_schema", "name": "x", "schema": schema}}),
    ] {
        assert!(req(json!({"text": text}))
            .params()
            .unwrap()
            .grammar
            .is_some());
    }
    for body in [
        json!({"max_output_tokens": 0}),
        json!({"temperature": 2.5}),
        json!({"truncation": "sometimes"}),
        json!({"background": true}),
        json!({"conversation": "conv_1"}),
        json!({"top_logprobs": 2}),
        json!({"text": {"format": {"type": "xml"}}}),
        json!({"text": {"format": {"type": "json_schema", "name": "x"}}}),
    ] {
        assert!(req(body.clone()).params().is_err(), "{body} was accepted");
    }
}

#[test]
fn reasoning_effort_switches_thinking() {
    let think = |r: Value| req(json!({"reasoning": r})).think();
    assert_eq!(think(Value::Null).unwrap(), None);
    assert_eq!(think(json!({"effort": "none"})).unwrap(), Some(false));
    assert_eq!(think(json!({"effort": "high"})).unwrap(), Some(true));
    assert_eq!(think(json!({"summary": "auto"})).unwrap(), None);
    assert!(think(json!({"effort": "max"})).is_err());
    assert!(think(json!("high")).is_err());
}

#[test]
fn function_tools_map_and_built_in_tools_are_refused() {
    let t = tool_request(&req(json!({
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "parallel_tool_calls": false,
    })))
    .unwrap()
    .unwrap();
    assert_eq!(t.choice, tool_calls::ToolChoice::Named("f".into()));
    assert!(!t.parallel);
    for body in [
        json!({"tools": [{"type": "web_search"}]}),
        json!({"tools": [{"name": "f"}]}),
        json!({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools"}}),
        json!({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}),
    ] {
        assert!(
            tool_request(&req(body.clone())).is_err(),
            "{body} was accepted"
        );
    }
}

#[test]
fn a_kept_response_holds_its_conversation_and_output_as_the_next_turn() {
    let store = ResponseStore::default();
    let items = vec![
        reasoning_item("rs_1", "hmm"),
        message_item("msg_1", "Checking.", "completed"),
        call_item("fc_1", "call_1", "f", "{\"a\":1}", "completed"),
    ];
    keep_response(
        &store,
        "resp_1",
        vec![json!({"role": "user", "content": "hi"})],
        &items,
        &json!({"id": "resp_1"}),
    );
    let kept = store.get("resp_1").unwrap();
    assert_eq!(
        kept.messages,
        vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}},
            ]}),
        ]
    );
}
