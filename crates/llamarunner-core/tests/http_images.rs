//! Images through the HTTP layer against the fake engine with the fake projector (each image
//! takes `POSITIONS` positions): where each dialect puts them, what they count, the prefix
//! cache across turns, and every refusal before the queue.

use std::io::Cursor;
use std::sync::Arc;

use axum::http::StatusCode;
use base64::Engine as _;
use llamarunner_core::backend::fake::FakeVision;
use llamarunner_core::backend::fake::{FakeBackend, FakeConfig};
use llamarunner_core::engine::Engine;
use llamarunner_core::http::AppState;
use llamarunner_core::protocol::EngineHandle;
use llamarunner_core::routes::router;
use serde_json::{json, Value};

mod common;
use common::{open_stream, post_to};

const POSITIONS: usize = 6;

fn app() -> (axum::Router, EngineHandle) {
    app_with(FakeConfig::default())
}

fn app_with(config: FakeConfig) -> (axum::Router, EngineHandle) {
    let (handle, inbox) = EngineHandle::new(8);
    let mut info = llamarunner_core::backend::fake::model_info(config.slot_ctx);
    info.vision = Some(Arc::new(FakeVision {
        positions: POSITIONS,
        max_positions: config.batch_capacity,
    }));
    handle.health.set_model_info(info);
    std::thread::spawn(move || Engine::with_backend(FakeBackend::new(config), 2, inbox).run());
    while handle.health.state() != llamarunner_core::protocol::LoadState::Ready {
        std::thread::yield_now();
    }
    (router(AppState::new(handle.clone(), "fake")), handle)
}

/// A one-colour PNG, base64.
fn png(rgb: [u8; 3]) -> String {
    let img = image::RgbImage::from_pixel(8, 6, image::Rgb(rgb));
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    base64::engine::general_purpose::STANDARD.encode(out.into_inner())
}

async fn post(app: &axum::Router, path: &str, body: &Value) -> (StatusCode, String) {
    post_to(app, path, &body.to_string()).await
}

/// The final NDJSON line of a native answer.
async fn native(app: &axum::Router, body: Value) -> Value {
    let (status, text) = post(app, "/completion", &body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    serde_json::from_str(text.lines().last().unwrap()).unwrap()
}

#[tokio::test]
async fn native_images_count_their_positions_and_are_cached_across_turns() {
    let (app, handle) = app();
    let opts = json!({"num_predict": 3, "temperature": 0});
    let red = png([200, 0, 0]);
    let text = native(&app, json!({"prompt": "look  here", "options": opts})).await;
    let one = native(
        &app,
        json!({"prompt": "look [img-0] here", "images": [{"id": 0, "data": red}], "options": opts}),
    )
    .await;
    assert_eq!(
        one["prompt_eval_count"].as_u64().unwrap(),
        text["prompt_eval_count"].as_u64().unwrap() + POSITIONS as u64
    );
    // The same image again: everything but the last token is cached, the image included.
    let again = native(
        &app,
        json!({"prompt": "look [img-0] here", "images": [{"id": 0, "data": red}], "options": opts}),
    )
    .await;
    let n = again["prompt_eval_count"].as_u64().unwrap();
    assert!(
        again["prompt_cached_count"].as_u64().unwrap() >= n - 1,
        "{again}"
    );
    // Another image at the same place: cached only up to it.
    let blue = native(
        &app,
        json!({"prompt": "look [img-0] here", "images": [{"id": 0, "data": png([0, 0, 200])}], "options": opts}),
    )
    .await;
    assert_eq!(blue["prompt_cached_count"], 6, "BOS + 'look ': {blue}");
    handle.shutdown();
}

#[tokio::test]
async fn every_dialect_places_its_images() {
    let (app, handle) = app();
    let url = format!("data:image/png;base64,{}", png([1, 2, 3]));
    let parts = |with_image: bool| {
        // Text parts are joined by a line break, but not beside an image: without the image,
        // the same text is one part.
        let content = if with_image {
            vec![
                json!({"type": "text", "text": "what is "}),
                json!({"type": "image_url", "image_url": {"url": url}}),
                json!({"type": "text", "text": "?"}),
            ]
        } else {
            vec![json!({"type": "text", "text": "what is ?"})]
        };
        json!({"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0})
    };
    let usage = |text: &str| -> u64 {
        let v: Value = serde_json::from_str(text).unwrap();
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let (s0, plain) = post(&app, "/v1/chat/completions", &parts(false)).await;
    let (s1, with) = post(&app, "/v1/chat/completions", &parts(true)).await;
    assert_eq!((s0, s1), (StatusCode::OK, StatusCode::OK), "{plain} {with}");
    assert_eq!(usage(&with), usage(&plain) + POSITIONS as u64);
    let b64 = png([9, 9, 9]);
    for (path, body) in [
        (
            "/api/generate",
            json!({"model": "fake", "prompt": "hi", "images": [b64], "stream": false}),
        ),
        (
            "/api/generate",
            json!({"model": "fake", "prompt": "a [img-1] b [img-0]", "images": [b64, b64], "raw": true, "stream": false}),
        ),
        (
            "/api/chat",
            json!({"model": "fake", "messages": [{"role": "user", "content": "hi", "images": [b64]}], "stream": false}),
        ),
    ] {
        let (status, text) = post(&app, path, &body).await;
        assert_eq!(status, StatusCode::OK, "{path}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(
            v["prompt_eval_count"].as_u64().unwrap() > POSITIONS as u64,
            "{path}: {v}"
        );
    }
    handle.shutdown();
}

#[tokio::test]
async fn bad_images_are_400s_before_the_queue() {
    let (app, handle) = app();
    let ok = png([5, 5, 5]);
    let many: Vec<Value> = (0..17).map(|i| json!({"id": i, "data": ok})).collect();
    let tags: String = (0..17).map(|i| format!("[img-{i}]")).collect();
    for (path, body, kind) in [
        (
            "/completion",
            json!({"prompt": "[img-3]", "images": [{"id": 0, "data": ok}]}),
            "invalid_image",
        ),
        (
            "/completion",
            json!({"prompt": "[img-0]", "images": [{"id": 0, "data": ok}, {"id": 1, "data": ok}]}),
            "invalid_image",
        ),
        (
            "/completion",
            json!({"prompt": "[img-0]", "images": [{"id": 0, "data": "bm90IGFuIGltYWdl"}]}),
            "invalid_image",
        ),
        (
            "/completion",
            json!({"prompt": "[img-0]", "images": [{"id": 0, "data": 7}]}),
            "invalid_image",
        ),
        (
            "/completion",
            json!({"prompt": tags, "images": many}),
            "invalid_image",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}),
            "invalid_image",
        ),
        (
            "/api/chat",
            json!({"model": "fake", "messages": [{"role": "user", "content": "x", "images": ["%%%"]}]}),
            "invalid_image",
        ),
    ] {
        let (status, text) = post(&app, path, &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let got = match path {
            "/v1/chat/completions" => v["error"]["code"].clone(),
            "/api/chat" => json!(if v["error"].is_string() { kind } else { "?" }),
            _ => v["error"]["type"].clone(),
        };
        assert_eq!(got, kind, "{path} {body}: {text}");
    }
    // Nothing was queued: both slots are free and nothing is cached.
    let table = handle.health.slot_table();
    assert!(
        table.iter().all(|s| !s.busy && s.cached_tokens == 0),
        "{table:?}"
    );
    handle.shutdown();
}

#[tokio::test]
async fn images_waiting_for_a_slot_are_bounded_and_a_request_past_that_is_a_429() {
    use llamarunner_core::http::IMAGES_IN_FLIGHT;
    let (app, handle) = app_with(FakeConfig {
        slot_ctx: 512,
        batch_capacity: 128,
        decode_delay: std::time::Duration::from_millis(5),
        ..FakeConfig::default()
    });
    let endless = json!({"prompt": "busy", "options": {"num_predict": -1}});
    let busy = [
        open_stream(&app, &endless.to_string()).await,
        open_stream(&app, &endless.to_string()).await,
    ];
    assert!(busy.iter().all(|r| r.status() == StatusCode::OK));
    // Requests of 16 images each wait in the queue, holding their images, until the images
    // in flight reach the bound.
    let per = 16;
    let img = png([9, 9, 9]);
    let images: Vec<Value> = (0..per).map(|_| json!(img)).collect();
    let waiting_body = json!({"model": "fake", "prompt": "x", "images": images, "stream": false,
        "options": {"num_predict": 2}});
    let mut waiting = Vec::new();
    for _ in 0..IMAGES_IN_FLIGHT / per {
        let app = app.clone();
        let body = waiting_body.clone();
        waiting.push(tokio::spawn(async move {
            post(&app, "/api/generate", &body).await
        }));
    }
    // Until they are all queued, a one-image request may still pass: wait for the queue.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while handle.queue.waiting() < IMAGES_IN_FLIGHT / per {
        assert!(
            std::time::Instant::now() < deadline,
            "the requests were not queued"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let one = json!({"model": "fake", "prompt": "x", "images": [img], "stream": false});
    let (status, text) = post(&app, "/api/generate", &one).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{text}");
    assert!(text.contains("images"), "{text}");
    // Freeing the slots lets the waiting requests in, which gives their images back.
    drop(busy);
    for w in waiting {
        let (status, text) = w.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{text}");
    }
    let (status, text) = post(&app, "/api/generate", &one).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    handle.shutdown();
}
