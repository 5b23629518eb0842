//! The HTTP layer against the fake engine: status codes, error types, the NDJSON stream.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use llamarunner_core::backend::fake::{FakeBackend, FakeConfig};
use llamarunner_core::engine::Engine;
use llamarunner_core::http::AppState;
use llamarunner_core::protocol::EngineHandle;
use llamarunner_core::routes::router;
use serde_json::{json, Value};
use tower::ServiceExt;

mod common;
use common::{open_stream, post_to};

fn app(config: FakeConfig) -> (axum::Router, EngineHandle) {
    let (handle, inbox) = EngineHandle::new(8);
    std::thread::spawn(move || Engine::with_backend(FakeBackend::new(config), 2, inbox).run());
    while handle.health.state() != llamarunner_core::protocol::LoadState::Ready {
        std::thread::yield_now();
    }
    (router(AppState::new(handle.clone(), "fake")), handle)
}

async fn post(app: &axum::Router, body: &str) -> (StatusCode, String) {
    post_to(app, "/completion", body).await
}

#[tokio::test]
async fn completion_streams_ndjson_with_a_final_message() {
    let (app, handle) = app(FakeConfig::default());
    let (status, body) = post(
        &app,
        r#"{"prompt":"hi","options":{"num_predict":5,"temperature":0}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let lines = ndjson_lines(&body);
    let last = lines.last().unwrap();
    assert_eq!(last["done"], true);
    assert_eq!(last["done_reason"], "length");
    assert_eq!(last["eval_count"], 5);
    assert_eq!(last["prompt_eval_count"], 3);
    let text: String = lines[..lines.len() - 1]
        .iter()
        .map(|l| l["content"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text.len(), 5);
    handle.shutdown();
}

#[tokio::test]
async fn bad_requests_get_400_with_a_type() {
    let (app, handle) = app(FakeConfig::default());
    for (body, kind) in [
        ("{", "invalid_json"),
        (r#"{"prompt":""}"#, "invalid_request"),
        (
            r#"{"prompt":"x","options":{"num_predict":-5}}"#,
            "invalid_request",
        ),
        (r#"{"prompt":"x","options":{"seed":"abc"}}"#, "invalid_json"),
        (
            r#"{"prompt":"x","images":[{"data":"","id":0}]}"#,
            "images_not_supported",
        ),
    ] {
        let (status, text) = post(&app, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["type"], kind, "{body}");
    }
    handle.shutdown();
}

#[tokio::test]
async fn too_long_prompt_is_context_length_exceeded() {
    let (app, handle) = app(FakeConfig {
        slot_ctx: 16,
        ..FakeConfig::default()
    });
    let body = format!(r#"{{"prompt":"{}","truncate":false}}"#, "x".repeat(40));
    let (status, text) = post(&app, &body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["type"], "context_length_exceeded");
    handle.shutdown();
}

#[tokio::test]
async fn loading_and_failed_models_are_reported() {
    let (handle, _inbox) = EngineHandle::new(8);
    let app = router(AppState::new(handle.clone(), "fake"));
    let health = |app: axum::Router| async move {
        let resp = app
            .oneshot(Request::get("/health").body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice::<Value>(&bytes).unwrap())
    };
    handle.health.set_progress(0.5);
    let (status, body) = health(app.clone()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["status"], "loading");
    assert_eq!(body["progress"], 0.5);
    let (status, text) = post(&app, r#"{"prompt":"x"}"#).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(text.contains("model_loading"));

    handle.health.set_error("bad tensor");
    let (status, body) = health(app.clone()).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(body["error"], "bad tensor");
    let (status, text) = post(&app, r#"{"prompt":"x"}"#).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(text.contains("model_load_failed"));
}

#[tokio::test]
async fn a_full_queue_is_429() {
    // No engine thread drains the queue (capacity 1): the second request finds it full.
    let (handle, _inbox) = EngineHandle::new(1);
    handle
        .health
        .set_model_info(llamarunner_core::backend::fake::model_info(64));
    handle.health.set_ready(1);
    let app = router(AppState::new(handle.clone(), "fake"));
    let first = tokio::spawn({
        let app = app.clone();
        async move { post(&app, r#"{"prompt":"x"}"#).await }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while handle.queue.waiting() < 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the first request never queued"
        );
        tokio::task::yield_now().await;
    }
    let (status, text) = post(&app, r#"{"prompt":"y"}"#).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(text.contains("overloaded"));
    first.abort();
}

/// The objects of a JSON-lines stream.
fn ndjson_lines(body: &str) -> Vec<Value> {
    body.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The `data:` payloads of a server-sent event stream.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn openai_chat_streams_sse_ending_with_done() {
    let (app, handle) = app(FakeConfig::default());
    let (status, body) = post_to(
        &app,
        "/v1/chat/completions",
        r#"{"model":"fake","messages":[{"role":"user","content":"hi"}],"max_tokens":4,
            "temperature":0,"stream":true,"stream_options":{"include_usage":true}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let data = sse_data(&body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text.len(), 4);
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 4);
    // ChatML fallback: the fake tokenizes bytes, so the prompt is the rendered text + BOS.
    let rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(usage["prompt_tokens"], rendered.len() + 1);
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    handle.shutdown();
}

#[tokio::test]
async fn openai_errors_have_openai_shape() {
    let (app, handle) = app(FakeConfig {
        slot_ctx: 64,
        ..FakeConfig::default()
    });
    let long = "x".repeat(100);
    let cases = [
        (r#"{"prompt":"x","n":9}"#, 400, "invalid_request"),
        (r#"{"prompt":"x","echo":true}"#, 400, "invalid_request"),
        (r#"{"prompt":"x","suffix":"y"}"#, 400, "invalid_request"),
        (r#"{"prompt":[1,2,3]}"#, 400, "invalid_request"),
        (r#"{"prompt":"x","logprobs":50}"#, 400, "invalid_request"),
        (
            r#"{"prompt":"x","logit_bias":{"99999":5}}"#,
            400,
            "invalid_request",
        ),
        (r#"{"prompt":"x","top_p":"high"}"#, 400, "invalid_json"),
        (r#"{"max_tokens":3}"#, 400, "invalid_request"),
    ];
    for (body, status, code) in cases {
        let (s, text) = post_to(&app, "/v1/completions", body).await;
        assert_eq!(s.as_u16(), status, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], code, "{body}: {text}");
        assert!(v["error"]["type"].is_string() && v["error"]["message"].is_string());
    }
    // Any model name is the one model, as on llama-server, and the answer names it; without
    // `/v1` too.
    for path in ["/v1/completions", "/completions"] {
        let (s, text) = post_to(
            &app,
            path,
            r#"{"model":"gpt-4o","prompt":"x","max_tokens":2}"#,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{path}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["model"], "fake", "{text}");
        // llama-server's timings beside OpenAI's usage.
        assert_eq!(
            v["timings"]["predicted_n"], v["usage"]["completion_tokens"],
            "{text}"
        );
        assert!(
            v["timings"]["prompt_per_second"].as_f64() >= Some(0.0),
            "{text}"
        );
    }
    // Ollama's routes keep the 404 its clients pull a model on.
    let (s, text) = post_to(&app, "/api/generate", r#"{"model":"other","prompt":"x"}"#).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{text}");
    let body = format!(r#"{{"prompt":"{long}"}}"#);
    let (s, text) = post_to(&app, "/v1/completions", &body).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{text}");
    // llama-server's type and sizes, for the clients written for it.
    assert_eq!(v["error"]["type"], "exceed_context_size_error", "{text}");
    assert_eq!(v["error"]["n_ctx"], 64, "{text}");
    assert!(v["error"]["n_prompt_tokens"].as_u64() > Some(64), "{text}");
    let (s, text) = post_to(
        &app,
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}"#,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(text.contains("tools"), "{text}");
    handle.shutdown();
}

#[tokio::test]
async fn openai_errors_name_the_field_at_fault_as_param() {
    let (app, handle) = app(FakeConfig::default());
    let cases = [
        ("/v1/completions", r#"{"prompt":"x","n":9}"#, json!("n")),
        (
            "/v1/completions",
            r#"{"prompt":"x","echo":true}"#,
            json!("echo"),
        ),
        (
            "/v1/completions",
            r#"{"prompt":"x","top_p":2}"#,
            json!("top_p"),
        ),
        (
            "/v1/completions",
            r#"{"prompt":"x","logprobs":50}"#,
            json!("logprobs"),
        ),
        ("/v1/completions", r#"{"max_tokens":3}"#, json!("prompt")),
        (
            "/v1/completions",
            r#"{"prompt":"x","max_completion_tokens":-1}"#,
            json!("max_completion_tokens"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[]}"#,
            json!("messages"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"x"}],"temperature":-1}"#,
            json!("temperature"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"hiccup"}}"#,
            json!("response_format.type"),
        ),
        // Not one field's fault: no param.
        (
            "/v1/completions",
            r#"{"prompt":"x","top_p":"high"}"#,
            Value::Null,
        ),
    ];
    for (path, body, param) in cases {
        let (s, text) = post_to(&app, path, body).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], param, "{body}: {text}");
        assert_eq!(
            v["error"]["type"], "invalid_request_error",
            "{body}: {text}"
        );
        if let Some(field) = param.as_str() {
            let message = v["error"]["message"].as_str().unwrap_or_default();
            assert!(message.starts_with(field), "{body}: {text}");
        }
    }
    // Ollama's answer is its message alone, the option named as the native API names it.
    let (s, text) = post_to(
        &app,
        "/api/generate",
        r#"{"model":"fake","prompt":"x","options":{"top_p":2}}"#,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{text}");
    assert!(text.contains("options.top_p must be"), "{text}");
    handle.shutdown();
}

#[tokio::test]
async fn a_decode_failure_mid_stream_is_an_error_event_in_each_dialect() {
    for (path, body, marker) in [
        (
            "/v1/completions",
            r#"{"prompt":"hello","max_tokens":20,"stream":true}"#,
            "data: {\"error\"",
        ),
        (
            "/api/generate",
            r#"{"model":"fake","prompt":"hello","raw":true,"options":{"num_predict":20}}"#,
            "{\"error\":\"",
        ),
    ] {
        // The prompt decodes in the first call; the third call fails.
        let (app, handle) = app(FakeConfig {
            fail_decode: Some(3),
            ..FakeConfig::default()
        });
        let (status, text) = post_to(&app, path, body).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert!(text.contains(marker), "{path}: {text}");
        assert!(!text.contains("[DONE]"), "{path}: {text}");
        handle.shutdown();
    }
}

#[tokio::test]
async fn ollama_answers_ndjson_and_plain_errors() {
    let (app, handle) = app(FakeConfig::default());
    let (status, body) = post_to(
        &app,
        "/api/chat",
        r#"{"model":"fake:latest","messages":[{"role":"user","content":"hi"}],
            "options":{"num_predict":3,"temperature":0}}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let lines = ndjson_lines(&body);
    let last = lines.last().unwrap();
    assert_eq!(last["done"], true);
    assert_eq!(last["done_reason"], "length");
    assert_eq!(last["eval_count"], 3);
    assert!(last["created_at"].as_str().unwrap().ends_with('Z'));
    for (path, body, status) in [
        ("/api/chat", r#"{"model":"nope","messages":[]}"#, 404),
        ("/api/generate", r#"{"prompt":"x"}"#, 400),
        (
            "/api/generate",
            r#"{"model":"fake","prompt":"x","think":true}"#,
            400,
        ),
        (
            "/api/generate",
            r#"{"model":"fake","prompt":"x","template":"{{ .Prompt }}"}"#,
            400,
        ),
        (
            "/api/generate",
            r#"{"model":"fake","prompt":"x","suffix":"y"}"#,
            400,
        ),
        (
            "/api/generate",
            r#"{"model":"fake","prompt":"x","images":["AAAA"]}"#,
            400,
        ),
        (
            "/api/chat",
            r#"{"model":"fake","messages":[{"role":"user","content":"x"}],"tools":[{}]}"#,
            400,
        ),
        (
            "/api/generate",
            r#"{"model":"fake","prompt":"x","options":{"top_k":-3}}"#,
            400,
        ),
        ("/api/embed", r#"{"model":"fake","input":[1]}"#, 400),
        ("/api/show", r#"{"model":"nope"}"#, 404),
    ] {
        let (s, text) = post_to(&app, path, body).await;
        assert_eq!(s.as_u16(), status, "{path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(v["error"].is_string(), "{text}");
    }
    handle.shutdown();
}

#[tokio::test]
async fn unknown_routes_are_404_in_their_dialect() {
    let (app, handle) = app(FakeConfig::default());
    let (s, text) = post_to(&app, "/api/copy", r#"{"model":"llama3"}"#).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("cannot push, create, copy"),
        "{text}"
    );
    // A pull of a model not served here says how to get it.
    let (s, text) = post_to(&app, "/api/pull", r#"{"model":"llama3"}"#).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(text.contains("llamarunner pull NAME"), "{text}");
    let (s, text) = post_to(&app, "/v1/assistants", "{}").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["code"], "not_found");
    let (s, text) = post_to(&app, "/nothing", "{}").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["type"], "not_found");
    handle.shutdown();
}

#[tokio::test]
async fn bad_requests_get_their_400_at_once_while_every_slot_is_busy() {
    let (app, handle) = app(FakeConfig {
        decode_delay: std::time::Duration::from_millis(5),
        ..FakeConfig::default()
    });
    let endless = r#"{"prompt":"busy","options":{"num_predict":-1}}"#;
    let busy = [
        open_stream(&app, endless).await,
        open_stream(&app, endless).await,
    ];
    assert!(busy.iter().all(|r| r.status() == StatusCode::OK));
    let long = format!(r#"{{"prompt":"{}","truncate":false}}"#, "x".repeat(300));
    let deep = format!(
        r#"{{"prompt":"x","grammar":"root ::= {}\"a\"{}"}}"#,
        "(".repeat(50_000),
        ")".repeat(50_000)
    );
    for (path, body, status, kind) in [
        ("/completion", long.as_str(), 400, "context_length_exceeded"),
        (
            "/completion",
            r#"{"prompt":"x","grammar":"root ::= foo"}"#,
            400,
            "invalid_request",
        ),
        ("/completion", deep.as_str(), 400, "invalid_request"),
        (
            "/v1/completions",
            r#"{"prompt":"x","logit_bias":{"99999999":1}}"#,
            400,
            "invalid_request",
        ),
        ("/embedding", r#"{"content":"hello"}"#, 200, ""),
    ] {
        let answer =
            tokio::time::timeout(std::time::Duration::from_secs(2), post_to(&app, path, body))
                .await;
        let (got, text) = answer.unwrap_or_else(|_| panic!("{path} waited for a slot"));
        assert_eq!(got.as_u16(), status, "{path} {text}");
        if !kind.is_empty() {
            let v: Value = serde_json::from_str(&text).unwrap();
            let found = v["error"]["code"].as_str().or(v["error"]["type"].as_str());
            assert_eq!(found, Some(kind), "{text}");
        }
    }
    drop(busy);
    handle.shutdown();
}

#[tokio::test]
async fn streamed_text_offsets_continue_across_chunks() {
    let (app, handle) = app(FakeConfig::default());
    let (status, body) = post_to(
        &app,
        "/v1/completions",
        r#"{"prompt":"hi","max_tokens":6,"temperature":0,"logprobs":1,"stream":true}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let mut offsets = Vec::new();
    let mut text = String::new();
    for data in sse_data(&body) {
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&data).unwrap();
        let choice = &v["choices"][0];
        text.push_str(choice["text"].as_str().unwrap_or(""));
        if let Some(o) = choice["logprobs"]["text_offset"].as_array() {
            offsets.extend(o.iter().map(|x| x.as_u64().unwrap()));
        }
    }
    // One ASCII character per fake token: each token starts where the previous ended.
    assert_eq!(text.len(), 6);
    assert_eq!(offsets, (0..6).collect::<Vec<u64>>());
    handle.shutdown();
}

#[tokio::test]
async fn the_routers_route_lists_are_the_engines_routes() {
    // Many models' router loads a model only for a POST to one of `model_posts`: each must
    // be served (an empty body is a 400 or 422 there, never the fallback's 404 or 405).
    let (app, handle) = app(FakeConfig::default());
    for pattern in llamarunner_core::routes::model_posts() {
        let path = pattern.replace("{id}", "0");
        assert!(llamarunner_core::routes::is_model_post(&path), "{path}");
        let (s, text) = post_to(&app, &path, "{}").await;
        assert!(
            s != StatusCode::NOT_FOUND && s != StatusCode::METHOD_NOT_ALLOWED,
            "{path}: {s} {text}"
        );
    }
    // And `model_reads` are the engine's routes that a POST does not take: 405, not 404.
    for pattern in llamarunner_core::routes::model_reads() {
        let path = pattern.replace("{id}", "resp_0");
        assert!(llamarunner_core::routes::is_model_read(&path), "{path}");
        let (s, text) = post_to(&app, &path, "{}").await;
        assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED, "{path}: {text}");
    }
    handle.shutdown();
}

#[tokio::test]
async fn input_tokens_count_what_a_generation_would_decode() {
    let (app, handle) = app(FakeConfig::default());
    let chat = r#"{"model":"any","messages":[{"role":"user","content":"hello there"}]}"#;
    let mut counts = Vec::new();
    for path in [
        "/v1/chat/completions/input_tokens",
        "/chat/completions/input_tokens",
    ] {
        let (s, text) = post_to(&app, path, chat).await;
        assert_eq!(s, StatusCode::OK, "{path}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["object"], "response.input_tokens", "{text}");
        counts.push(v["input_tokens"].as_u64().unwrap());
    }
    // The same conversation as a generation: its usage counts the same prompt.
    let (s, text) = post_to(
        &app,
        "/v1/chat/completions",
        &chat.replace("}]}", r#"}],"max_tokens":1}"#),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    counts.push(v["usage"]["prompt_tokens"].as_u64().unwrap());
    assert!(
        counts.iter().all(|&n| n == counts[0] && n > 0),
        "{counts:?}"
    );
    for path in ["/v1/responses/input_tokens", "/responses/input_tokens"] {
        let (s, text) = post_to(&app, path, r#"{"input":"hello there"}"#).await;
        assert_eq!(s, StatusCode::OK, "{path}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(v["input_tokens"].as_u64() > Some(0), "{text}");
    }
    // A bad request is the generation's 400.
    let (s, _) = post_to(
        &app,
        "/v1/chat/completions/input_tokens",
        r#"{"messages":5}"#,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    handle.shutdown();
}

#[tokio::test]
async fn deterministic_output_is_refused_where_the_server_cannot_give_it_and_said_where_not() {
    let (app, handle) = app(FakeConfig::default());
    // Every dialect's generation route, with the field set.
    for (path, body) in [
        ("/completion", r#"{"prompt":"x","deterministic":true}"#),
        (
            "/completion",
            r#"{"prompt":"x","n_predict":2,"deterministic":true}"#,
        ),
        (
            "/api/generate",
            r#"{"model":"fake","prompt":"x","deterministic":true}"#,
        ),
        (
            "/api/chat",
            r#"{"model":"fake","messages":[{"role":"user","content":"x"}],"deterministic":true}"#,
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"x"}],"deterministic":true}"#,
        ),
        ("/v1/completions", r#"{"prompt":"x","deterministic":true}"#),
        (
            "/v1/messages",
            r#"{"model":"fake","max_tokens":4,"messages":[{"role":"user","content":"x"}],"deterministic":true}"#,
        ),
        ("/v1/responses", r#"{"input":"x","deterministic":true}"#),
    ] {
        let (status, text) = post_to(&app, path, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {text}");
        assert!(text.contains("--deterministic"), "{path}: {text}");
        // Asking for none, or not asking, is served, and the answer says it was not.
        let plain = body.replace(r#","deterministic":true"#, r#","deterministic":false"#);
        let req = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(plain.clone()))
            .unwrap();
        let resp = app.clone().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{path} {plain}");
        assert_eq!(
            resp.headers()["llamarunner-deterministic"],
            "false",
            "{path}"
        );
        let _ = resp.into_body().collect().await;
    }
    let (_, text) = post_to(
        &app,
        "/completion",
        r#"{"prompt":"x","deterministic":true}"#,
    )
    .await;
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["type"], "deterministic_unavailable", "{text}");
    let req = Request::get("/props").body(Body::empty()).unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let props: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(props["deterministic"], false);
    handle.shutdown();
}

/// A generative model reranks by judging each document (one single-token generation each,
/// as many at once as there are slots): every document scored once, in (0, 1), best first,
/// the same scores for the same request, the prompts' tokens counted; an empty query or no
/// documents is a 400.
#[tokio::test]
async fn a_generative_model_reranks_by_judging_each_document() {
    // One token per byte: a judgement's prompt is a few hundred.
    let (app, handle) = app(FakeConfig {
        slot_ctx: 1024,
        ..FakeConfig::default()
    });
    let docs = [
        "the cat",
        "a dog",
        "hello world",
        "the cat and the dog",
        "of",
    ];
    let body = json!({"query": "cat", "documents": docs}).to_string();
    let (status, text) = post_to(&app, "/v1/rerank", &body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let results = v["results"].as_array().unwrap();
    let mut indices: Vec<u64> = results
        .iter()
        .map(|r| r["index"].as_u64().unwrap())
        .collect();
    let scores: Vec<f64> = results
        .iter()
        .map(|r| r["relevance_score"].as_f64().unwrap())
        .collect();
    assert!(scores.iter().all(|s| (0.0..=1.0).contains(s)), "{scores:?}");
    assert!(scores.windows(2).all(|w| w[0] >= w[1]), "{scores:?}");
    let tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        tokens > docs.iter().map(|d| d.len() as u64).sum::<u64>(),
        "{v}"
    );
    indices.sort_unstable();
    assert_eq!(indices, vec![0, 1, 2, 3, 4]);
    // Greedy judgements: the same request, the same scores; top_n and TEI's shape.
    let (_, again) = post_to(&app, "/v1/rerank", &body).await;
    let again: Value = serde_json::from_str(&again).unwrap();
    assert_eq!(again["results"], v["results"]);
    let top = json!({"query": "cat", "documents": docs, "top_n": 2}).to_string();
    let (_, text) = post_to(&app, "/rerank", &top).await;
    let top: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(top["results"].as_array().unwrap()[..], results[..2]);
    let tei = json!({"query": "cat", "texts": docs}).to_string();
    let (status, text) = post_to(&app, "/rerank", &tei).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text)
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        5
    );
    // A judgement longer than a slot is refused, whatever `truncate` says.
    let long = json!({"query": "cat", "documents": ["a dog", "x".repeat(2000)], "truncate": true});
    let (status, text) = post_to(&app, "/v1/rerank", &long.to_string()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert!(text.contains("exceed_context_size_error"), "{text}");
    for bad in [
        json!({"query": "cat", "documents": []}),
        json!({"documents": docs}),
        json!({"query": "cat", "documents": [1, 2]}),
    ] {
        let (status, text) = post_to(&app, "/v1/rerank", &bad.to_string()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad} {text}");
    }
    handle.shutdown();
}

/// `--pooling none`: `/embedding` answers one vector per token; the routes whose clients read
/// one vector per input refuse it; an input whose vectors would pass `MAX_UNPOOLED_VALUES` is
/// refused before the queue.
#[tokio::test]
async fn unpooled_embeddings_are_per_token_and_bounded() {
    let (handle, inbox) = EngineHandle::new(8);
    let config = FakeConfig {
        slot_ctx: (1 << 20) + 64,
        ..FakeConfig::default()
    };
    std::thread::spawn(move || Engine::with_backend(FakeBackend::new(config), 1, inbox).run());
    while handle.health.state() != llamarunner_core::protocol::LoadState::Ready {
        std::thread::yield_now();
    }
    let state =
        AppState::new(handle.clone(), "fake").with_pooling(llamarunner_core::config::Pooling::None);
    let app = router(state);
    let (status, text) = post_to(&app, "/embedding", r#"{"content":"hello"}"#).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    // The fake gives 8 values in all: one row of its 8 dimensions.
    let rows = v["embedding"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{v}");
    assert_eq!(rows[0].as_array().unwrap().len(), 8, "{v}");
    for (path, body) in [
        ("/v1/embeddings", r#"{"input":"hello"}"#),
        ("/embeddings", r#"{"input":"hello"}"#),
        ("/api/embed", r#"{"model":"fake","input":"hello"}"#),
        ("/api/embeddings", r#"{"model":"fake","prompt":"hello"}"#),
    ] {
        let (status, text) = post_to(&app, path, body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {text}");
        assert!(text.contains("--pooling none"), "{path} {text}");
    }
    // 8 dimensions × (2^20 + 1) tokens (BOS and a byte each) is past 8 Mi values.
    let long = json!({"content": "x".repeat(1 << 20)}).to_string();
    let (status, text) = post_to(&app, "/embedding", &long).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
    assert!(text.contains("--pooling none"), "{text}");
    handle.shutdown();
}
