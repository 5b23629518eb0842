//! Helpers shared by the HTTP test crates (each `tests/*.rs` is its own crate: `mod common;`).

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;

/// Posts a JSON `body` to `path` and reads the whole answer: its status and text.
pub async fn post_to(app: &axum::Router, path: &str, body: &str) -> (StatusCode, String) {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

/// Starts a native `/completion` request and returns its response once the headers arrive
/// (the request has a slot), with the body left unread.
pub async fn open_stream(app: &axum::Router, body: &str) -> axum::response::Response {
    let req = Request::post("/completion")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    app.clone().oneshot(req).await.unwrap()
}
