//! The HTTP layer against the fake engine: status codes, error types, the NDJSON stream.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use llamarunner_core::engine::fake::{FakeBackend, FakeConfig};
use llamarunner_core::engine::EngineHandle;
use llamarunner_core::sched::Scheduler;
use llamarunner_core::server::{router, AppState};
use serde_json::Value;
use tower::ServiceExt;

fn app(config: FakeConfig) -> (axum::Router, EngineHandle) {
    let (handle, inbox) = EngineHandle::new(8);
    std::thread::spawn(move || Scheduler::new(FakeBackend::new(config), inbox, 2).run());
    while handle.health.state() != llamarunner_core::engine::LoadState::Ready {
        std::thread::yield_now();
    }
    (router(AppState::new(handle.clone(), "fake")), handle)
}

async fn post(app: &axum::Router, body: &str) -> (StatusCode, String) {
    let req = Request::post("/completion")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
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
    let lines: Vec<Value> = body
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
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
            "invalid_request",
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
    handle.health.set_ready(1);
    let app = router(AppState::new(handle.clone(), "fake"));
    let first = tokio::spawn({
        let app = app.clone();
        async move { post(&app, r#"{"prompt":"x"}"#).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let (status, text) = post(&app, r#"{"prompt":"y"}"#).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert!(text.contains("overloaded"));
    first.abort();
}
