//! The operator routes against the fake engine: `POST /tokenize`, `POST /detokenize`,
//! `GET /props`, `GET /slots` and `POST /slots/{id}?action=save|restore|erase`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use llamarunner_core::backend::fake::{FakeBackend, FakeConfig};
use llamarunner_core::engine::Engine;
use llamarunner_core::http::AppState;
use llamarunner_core::ops::slots;
use llamarunner_core::protocol::EngineHandle;
use llamarunner_core::routes::router;
use serde_json::{json, Value};
use tower::ServiceExt;

/// A router over a fake engine with two slots; slot files in `dir` when given.
fn app(config: FakeConfig, dir: Option<&Path>) -> (axum::Router, EngineHandle) {
    let (handle, inbox) = EngineHandle::new(8);
    std::thread::spawn(move || Engine::with_backend(FakeBackend::new(config), 2, inbox).run());
    while handle.health.state() != llamarunner_core::protocol::LoadState::Ready {
        std::thread::yield_now();
    }
    let dir = dir.map(|d| slots::prepare_dir(d).unwrap());
    let state = AppState::new(handle.clone(), "fake").with_slot_save_path(dir);
    (router(state), handle)
}

async fn call(app: &axum::Router, method: &str, path: &str, body: &str) -> (StatusCode, Value) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    // A completion answers NDJSON: its last line is the final message.
    let last = text.lines().last().unwrap_or("null");
    (
        status,
        serde_json::from_str(last).unwrap_or(Value::String(text)),
    )
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "llamarunner-http-ops-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[tokio::test]
async fn tokenize_and_detokenize_round_trip_with_pieces_and_bounds() {
    let (app, handle) = app(FakeConfig::default(), None);
    let (status, v) = call(&app, "POST", "/tokenize", r#"{"content":"hi"}"#).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v, json!({"tokens": [104, 105]}));
    let (_, v) = call(
        &app,
        "POST",
        "/tokenize",
        r#"{"content":"hi","add_special":true}"#,
    )
    .await;
    assert_eq!(v, json!({"tokens": [257, 104, 105]}));
    let (_, v) = call(&app, "POST", "/tokenize", r#"{"content":""}"#).await;
    assert_eq!(v, json!({"tokens": []}));
    // Pieces: strings when valid UTF-8, else byte lists (the fake's tokens are bytes).
    let (_, v) = call(
        &app,
        "POST",
        "/tokenize",
        r#"{"content":"a\u00e9","add_special":true,"with_pieces":true}"#,
    )
    .await;
    assert_eq!(
        v,
        json!({"tokens": [
            {"id": 257, "piece": "<s>"},
            {"id": 97, "piece": "a"},
            {"id": 0xc3, "piece": [0xc3]},
            {"id": 0xa9, "piece": [0xa9]},
        ]})
    );
    let (status, v) = call(
        &app,
        "POST",
        "/detokenize",
        r#"{"tokens":[257,97,195,169,256]}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v, json!({"content": "<s>a\u{e9}</s>"}));
    // A lone continuation byte is not UTF-8: replaced, never a failure.
    let (_, v) = call(&app, "POST", "/detokenize", r#"{"tokens":[169]}"#).await;
    assert_eq!(v, json!({"content": "\u{fffd}"}));
    let (_, v) = call(&app, "POST", "/detokenize", r#"{"tokens":[]}"#).await;
    assert_eq!(v, json!({"content": ""}));

    for (path, body, status, kind) in [
        (
            "/detokenize",
            r#"{"tokens":[1,258]}"#,
            400,
            "invalid_request",
        ),
        ("/detokenize", r#"{"tokens":[-1]}"#, 400, "invalid_request"),
        (
            "/detokenize",
            r#"{"tokens":[99999999999999999999]}"#,
            400,
            "invalid_json",
        ),
        ("/detokenize", r#"{"tokens":[1.5]}"#, 400, "invalid_json"),
        ("/detokenize", r#"{"tokens":"1"}"#, 400, "invalid_json"),
        ("/detokenize", r#"{}"#, 400, "invalid_request"),
        ("/tokenize", r#"{}"#, 400, "invalid_request"),
        ("/tokenize", r#"{"content":5}"#, 400, "invalid_json"),
        ("/tokenize", "{", 400, "invalid_json"),
    ] {
        let (got, v) = call(&app, "POST", path, body).await;
        assert_eq!(got.as_u16(), status, "{path} {body}: {v}");
        assert_eq!(v["error"]["type"], kind, "{path} {body}: {v}");
    }
    // Text longer than a prompt may be, and more ids than one call may give.
    let long = json!({"content": "x".repeat(64 * 1024 + 1)}).to_string();
    let (status, v) = call(&app, "POST", "/tokenize", &long).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["type"], "context_length_exceeded");
    let many = json!({ "tokens": vec![1; 65_537] }).to_string();
    let (status, v) = call(&app, "POST", "/detokenize", &many).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["type"], "context_length_exceeded");
    let (status, _) = call(&app, "GET", "/tokenize", "").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    handle.shutdown();
}

#[tokio::test]
async fn props_describe_the_model_and_the_server() {
    let (app, handle) = app(FakeConfig::default(), None);
    let (status, v) = call(&app, "GET", "/props", "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["model_alias"], "fake");
    assert_eq!(v["model_path"], "fake.gguf");
    assert_eq!(v["total_slots"], 2);
    assert_eq!(v["n_ctx"], 256);
    assert_eq!(v["n_ctx_total"], 512);
    assert_eq!(v["default_generation_settings"]["n_ctx"], 256);
    assert_eq!(v["chat_template_name"], "chatml");
    assert!(v["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));
    assert_eq!(
        (&v["bos_token"], &v["bos_token_id"]),
        (&json!("<s>"), &json!(257))
    );
    assert_eq!(
        (&v["eos_token"], &v["eos_token_id"]),
        (&json!("</s>"), &json!(256))
    );
    assert_eq!(v["model"]["n_vocab"], 258);
    assert_eq!(v["slot_save"], false);
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["llama_cpp_2_version"], "0.1.160");
    assert!(v["build_info"]
        .as_str()
        .unwrap()
        .starts_with("llamarunner "));
    handle.shutdown();
}

#[tokio::test]
async fn slots_are_saved_restored_and_erased_and_bad_requests_refused() {
    let dir = temp_dir("slots");
    let (app, handle) = app(FakeConfig::default(), Some(&dir));
    let prompt =
        r#"{"prompt":"a shared system prompt","options":{"num_predict":4,"temperature":0}}"#;
    let (status, first) = call(&app, "POST", "/completion", prompt).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(first["prompt_cached_count"], 0);
    let (status, saved) = call(
        &app,
        "POST",
        "/slots/0?action=save",
        r#"{"filename":"sys.bin"}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{saved}");
    let n = saved["n_saved"].as_u64().unwrap();
    assert_eq!(n, 1 + 22 + 3);
    assert_eq!(saved["id_slot"], 0);
    assert_eq!(saved["filename"], "sys.bin");
    assert_eq!(
        saved["n_written"].as_u64(),
        Some(std::fs::metadata(dir.join("sys.bin")).unwrap().len())
    );

    let (status, erased) = call(&app, "POST", "/slots/0?action=erase", "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(erased, json!({"id_slot": 0, "n_erased": n}));
    let (_, table) = call(&app, "GET", "/slots", "").await;
    assert_eq!(table[0]["cached_tokens"], 0);
    assert_eq!(table[0]["phase"], "idle");

    let (status, restored) = call(
        &app,
        "POST",
        "/slots/1?action=restore",
        r#"{"filename":"sys.bin"}"#,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{restored}");
    assert_eq!(restored["n_restored"], n);
    assert_eq!(restored["n_read"], saved["n_written"]);
    let (_, table) = call(&app, "GET", "/slots", "").await;
    assert_eq!(table[1]["cached_tokens"], n);
    let (_, again) = call(&app, "POST", "/completion", prompt).await;
    assert_eq!(again["prompt_cached_count"], 22, "{again}");

    // Hostile names never reach the file system.
    for name in [
        "../escape.bin",
        "/tmp/x.bin",
        "a\\\\b",
        "..",
        ".hidden",
        "",
        "a\\u0000b",
    ] {
        for action in ["save", "restore"] {
            let body = format!(r#"{{"filename":"{name}"}}"#);
            let (status, v) = call(&app, "POST", &format!("/slots/0?action={action}"), &body).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{action} {name:?}: {v}");
            assert_eq!(v["error"]["type"], "invalid_request", "{name:?}");
        }
    }
    let long = format!(r#"{{"filename":"{}"}}"#, "x".repeat(129));
    let (status, _) = call(&app, "POST", "/slots/0?action=save", &long).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(!dir.parent().unwrap().join("escape.bin").exists());

    // A garbage file, a missing one, an unknown slot, a bad action or id.
    std::fs::write(dir.join("garbage.bin"), b"LLRSLOT\0not really").unwrap();
    for (path, body, status, kind) in [
        (
            "/slots/0?action=restore",
            r#"{"filename":"garbage.bin"}"#,
            400,
            "invalid_slot_file",
        ),
        (
            "/slots/0?action=restore",
            r#"{"filename":"missing.bin"}"#,
            404,
            "file_not_found",
        ),
        ("/slots/2?action=erase", "", 404, "slot_not_found"),
        ("/slots/x?action=erase", "", 400, "invalid_request"),
        ("/slots/0?action=drop", "", 400, "invalid_request"),
        ("/slots/0", "", 400, "invalid_request"),
        ("/slots/0?action=save", "{}", 400, "invalid_request"),
        ("/slots/0?action=save", "[", 400, "invalid_json"),
    ] {
        let (got, v) = call(&app, "POST", path, body).await;
        assert_eq!(got.as_u16(), status, "{path} {body}: {v}");
        assert_eq!(v["error"]["type"], kind, "{path} {body}: {v}");
    }
    // The failed restore left slot 0 empty; the server still serves.
    let (status, _) = call(&app, "POST", "/completion", prompt).await;
    assert_eq!(status, StatusCode::OK);
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
    handle.shutdown();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_busy_slot_is_409_and_slot_files_without_a_directory_are_501() {
    let (app, handle) = app(
        FakeConfig {
            slot_ctx: 100_000,
            decode_delay: std::time::Duration::from_millis(2),
            ..FakeConfig::default()
        },
        None,
    );
    let long = r#"{"prompt":"busy","options":{"num_predict":100000,"temperature":0}}"#;
    let req = Request::post("/completion")
        .header("content-type", "application/json")
        .body(Body::from(long))
        .unwrap();
    // The response head arrives once the request holds a slot.
    let stream = app.clone().oneshot(req).await.unwrap();
    assert_eq!(stream.status(), StatusCode::OK);
    let (status, v) = call(&app, "POST", "/slots/0?action=erase", "").await;
    assert_eq!(status, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"]["type"], "slot_busy");
    let (_, table) = call(&app, "GET", "/slots", "").await;
    let busy = &table[0];
    assert_eq!(busy["busy"], true);
    assert!(["prefill", "decode"].contains(&busy["phase"].as_str().unwrap()));
    assert_eq!(busy["prompt_tokens"], 5);
    for action in ["save", "restore"] {
        let (status, v) = call(
            &app,
            "POST",
            &format!("/slots/1?action={action}"),
            r#"{"filename":"x.bin"}"#,
        )
        .await;
        assert_eq!(status, StatusCode::NOT_IMPLEMENTED, "{v}");
        assert_eq!(v["error"]["type"], "not_supported");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--slot-save-path"));
    }
    drop(stream);
    handle.shutdown();
}

#[tokio::test]
async fn a_slot_file_of_another_model_is_refused() {
    let dir = temp_dir("foreign");
    let prepared: Arc<Path> = slots::prepare_dir(&dir).unwrap();
    let mut other = llamarunner_core::backend::fake::model_info(256);
    other.architecture = "other".into();
    let identity = llamarunner_core::ops::slot_file::model_identity(&other);
    let mut bytes = Vec::new();
    llamarunner_core::ops::slot_file::write(&mut bytes, &identity, &[1, 2], &[0; 8]).unwrap();
    std::fs::write(prepared.join("other.bin"), bytes).unwrap();
    let (app, handle) = app(FakeConfig::default(), Some(&dir));
    let (status, v) = call(
        &app,
        "POST",
        "/slots/0?action=restore",
        r#"{"filename":"other.bin"}"#,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(v["error"]["type"], "invalid_slot_file");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("another model"),
        "{v}"
    );
    handle.shutdown();
    std::fs::remove_dir_all(&dir).unwrap();
}
