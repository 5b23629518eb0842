//! The router's HTTP client to its engine processes: one HTTP/1 connection per request to a
//! loopback port (a connect there costs tens of microseconds), and the engine's `/health` and
//! other GETs the router reads (`/metrics`).

use axum::body::Bytes;
use axum::http::header;
use axum::http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use crate::protocol::devices::DeviceFacts;

/// Sends `request` to the engine on `port`; Err when it cannot be reached or does not answer.
pub(super) async fn send(
    port: u16,
    request: Request<Full<Bytes>>,
) -> Result<Response<Incoming>, String> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("cannot reach the model's engine: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| format!("cannot reach the model's engine: {e}"))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "engine connection ended with an error");
        }
    });
    sender
        .send_request(request)
        .await
        .map_err(|e| format!("the model's engine did not answer: {e}"))
}

/// A GET of `path` on the engine: its status and body; None when it does not answer within
/// 2 s.
async fn get(port: u16, key: &str, path: &str) -> Option<(StatusCode, Bytes)> {
    let request = Request::get(path)
        .header(header::HOST, format!("127.0.0.1:{port}"))
        .header(header::AUTHORIZATION, format!("Bearer {key}"))
        .body(Full::new(Bytes::new()))
        .ok()?;
    tokio::time::timeout(std::time::Duration::from_secs(2), async {
        let response = send(port, request).await.ok()?;
        let status = response.status();
        let body = response.into_body().collect().await.ok()?.to_bytes();
        Some((status, body))
    })
    .await
    .ok()?
}

/// The engine's `/health`: (ready, progress, error); None when it does not answer yet.
pub async fn engine_health(port: u16, key: &str) -> Option<(bool, f32, Option<String>)> {
    let (status, body) = get(port, key, "/health").await?;
    let v: serde_json::Value = serde_json::from_slice(&body).ok()?;
    let progress = v["progress"].as_f64().unwrap_or(0.0) as f32;
    let error = v["error"].as_str().map(str::to_string);
    Some((
        status == StatusCode::OK && v["status"] == "ready",
        progress,
        error,
    ))
}

/// The body of a 200 answer to a GET of `path` on the engine, as text.
pub async fn engine_get(port: u16, key: &str, path: &str) -> Option<String> {
    let (status, body) = get(port, key, path).await?;
    (status == StatusCode::OK).then(|| String::from_utf8_lossy(&body).into_owned())
}

/// Where the engine placed its model (`/props`' `devices`); None when it does not say.
pub async fn engine_devices(port: u16, key: &str) -> Option<DeviceFacts> {
    let text = engine_get(port, key, "/props").await?;
    let mut props: serde_json::Value = serde_json::from_str(&text).ok()?;
    serde_json::from_value(props.get_mut("devices")?.take()).ok()
}
