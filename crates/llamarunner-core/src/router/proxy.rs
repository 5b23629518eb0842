//! Passing a request to a model's engine process under its lease, and its answer back,
//! streamed as it comes (the connection itself: `engine_client.rs`). An engine that dies mid-answer ends the stream with an error line in the
//! dialect's shape, never a silent cut. A client that stops taking its answer gives up the
//! model's lease after `CLIENT_STALL_LIMIT`, so it cannot keep the model loaded for ever.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::header::{self, HeaderName, HeaderValue};
use axum::http::request::Parts;
use axum::http::Request;
use axum::response::Response;
use http_body_util::{BodyExt, Full};
use serde_json::json;

use super::engine_client;
use super::registry::Lease;
use crate::http::error::{ApiError, Dialect};

/// How long an answer's bytes may wait for its client to take them before the request's lease
/// on its model ends: the model counts as idle again, so it can be unloaded (its keep-alive, a
/// `POST /models/unload`) or make room for another model. Longer than the engine's own limit
/// for a client that does not read (`sched::PAUSE_LIMIT`, 30 s), which frees the slot first.
pub const CLIENT_STALL_LIMIT: Duration = Duration::from_secs(60);

/// A streamed answer's hold on its model (`T`: its `Lease`), shared by the stream and its
/// stall watchdog.
struct Held<T> {
    lease: Mutex<Option<T>>,
    started: Instant,
    /// Milliseconds after `started` when the stream last handed bytes on and waits for the
    /// client to ask for more; `u64::MAX` while it waits for the engine.
    handed_at: AtomicU64,
}

impl<T> Held<T> {
    fn new(lease: T) -> Self {
        Held {
            lease: Mutex::new(Some(lease)),
            started: Instant::now(),
            handed_at: AtomicU64::new(u64::MAX),
        }
    }

    /// The stream handed bytes on: from now it waits for the client.
    fn handed(&self) {
        self.handed_at.store(self.millis(), Ordering::Relaxed);
    }

    /// The stream was asked for more: it waits for the engine.
    fn asked(&self) {
        self.handed_at.store(u64::MAX, Ordering::Relaxed);
    }

    fn release(&self) -> Option<T> {
        self.lease.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn released(&self) -> bool {
        self.lease
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    fn millis(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }
}

/// Ends the lease of an answer whose client has not asked for its next bytes for `limit`;
/// returns when the answer ends (its stream is dropped) or the lease is gone.
async fn stall_watchdog<T>(held: Weak<Held<T>>, limit: Duration, tick: Duration) {
    let limit_ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
    loop {
        tokio::time::sleep(tick).await;
        let Some(held) = held.upgrade() else { return };
        let handed_at = held.handed_at.load(Ordering::Relaxed);
        if handed_at != u64::MAX && held.millis().saturating_sub(handed_at) >= limit_ms {
            if let Some(lease) = held.release() {
                tracing::warn!(
                    limit = ?limit,
                    "a client has not read its answer; its model is no longer held for it"
                );
                drop(lease);
            }
            return;
        }
        if held.released() {
            return;
        }
    }
}

/// Headers that belong to one connection, not to the request (RFC 9110 §7.6.1), and the ones
/// the router sets itself.
const NOT_FORWARDED: [HeaderName; 8] = [
    header::CONNECTION,
    header::HOST,
    header::TRANSFER_ENCODING,
    header::TE,
    header::UPGRADE,
    header::CONTENT_LENGTH,
    header::AUTHORIZATION,
    header::PROXY_AUTHORIZATION,
];

/// A request its engine did not answer (no response head came): the lease it had, and why.
pub struct Unanswered {
    /// The lease on the engine that did not answer.
    pub lease: Lease,
    /// The connection's error.
    pub error: String,
}

/// Sends the request (`parts`, `body`) to the leased engine and streams its answer back; the
/// lease is held until the answer's last byte, or until its client has not asked for more for
/// `CLIENT_STALL_LIMIT`. Err when no answer began: the engine refused the connection or
/// closed it first (it died; the caller decides whether to send the request again).
pub async fn forward(
    lease: Lease,
    parts: &Parts,
    body: Bytes,
    key: &str,
) -> Result<Response, Unanswered> {
    let dialect = Dialect::of_path(parts.uri.path());
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let mut builder = Request::builder().method(parts.method.clone()).uri(&path);
    for (name, value) in &parts.headers {
        if !NOT_FORWARDED.contains(name) && name != "x-api-key" {
            builder = builder.header(name, value);
        }
    }
    let request = builder
        .header(header::HOST, format!("127.0.0.1:{}", lease.port))
        .header(header::AUTHORIZATION, format!("Bearer {key}"))
        .header(header::CONTENT_LENGTH, body.len())
        .body(Full::new(body));
    let request = match request {
        Ok(r) => r,
        Err(e) => return Ok(dialect.respond(ApiError::invalid(format!("cannot forward: {e}")))),
    };
    let response = match engine_client::send(lease.port, request).await {
        Ok(r) => r,
        Err(error) => return Err(Unanswered { lease, error }),
    };
    let (mut head, incoming) = response.into_parts();
    let event_stream = head
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    head.headers.remove(header::CONTENT_LENGTH);
    head.headers.remove(header::TRANSFER_ENCODING);
    head.headers.remove(header::CONNECTION);
    let held = Arc::new(Held::new(lease));
    tokio::spawn(stall_watchdog(
        Arc::downgrade(&held),
        CLIENT_STALL_LIMIT,
        Duration::from_secs(5),
    ));
    let stream = futures_util::stream::unfold(Some((incoming, held)), move |state| async move {
        let (mut incoming, held) = state?;
        held.asked();
        loop {
            match incoming.frame().await {
                None => {
                    drop(held.release());
                    return None;
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        held.handed();
                        return Some((
                            Ok::<_, std::convert::Infallible>(data),
                            Some((incoming, held)),
                        ));
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "a model's engine ended an answer early");
                    drop(held.release());
                    let line = broken_stream_line(dialect, event_stream);
                    return Some((Ok(line), None));
                }
            }
        }
    });
    let mut out = Response::from_parts(head, Body::from_stream(stream));
    out.headers_mut()
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-cache"));
    Ok(out)
}

/// The last line of an answer whose engine died: an error in the stream's own shape.
fn broken_stream_line(dialect: Dialect, event_stream: bool) -> Bytes {
    let message = "the model's engine stopped while answering; retry (the model is loaded again)";
    let err = ApiError::Internal(message.into());
    if event_stream && dialect == Dialect::Anthropic {
        let body = err.anthropic_body();
        return Bytes::from(format!("event: error\ndata: {body}\n\n"));
    }
    if event_stream {
        let body = err.openai_body();
        return Bytes::from(format!("data: {body}\n\n"));
    }
    let line = match dialect {
        Dialect::Ollama => json!({"error": message}),
        Dialect::Anthropic => err.anthropic_body(),
        _ => json!({"done": true, "done_reason": "error", "error": err.body()["error"]}),
    };
    Bytes::from(format!("{line}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: Duration = Duration::from_millis(10);

    /// A watchdog over `held` with this `limit`, ticking every `TICK`.
    fn watch(held: &Arc<Held<&'static str>>, limit: Duration) -> tokio::task::JoinHandle<()> {
        tokio::spawn(stall_watchdog(Arc::downgrade(held), limit, TICK))
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_loses_the_lease_after_the_limit() {
        let held = Arc::new(Held::new("lease"));
        let watchdog = watch(&held, Duration::from_millis(100));
        // Waiting on the engine (a long queue, a slow prompt) is not the client's stall.
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(!held.released());
        // Bytes handed on and taken again and again: still held.
        for _ in 0..10 {
            held.handed();
            tokio::time::sleep(Duration::from_millis(20)).await;
            held.asked();
        }
        assert!(!held.released());
        // Handed on and never asked for again: the lease ends.
        held.handed();
        tokio::time::timeout(Duration::from_secs(5), watchdog)
            .await
            .expect("the watchdog ends")
            .expect("it does not panic");
        assert!(held.released());
    }

    #[tokio::test]
    async fn the_watchdog_ends_with_its_answer() {
        let held = Arc::new(Held::new("lease"));
        let watchdog = watch(&held, Duration::from_secs(3600));
        let _ = held.release(); // the answer's last byte
        tokio::time::timeout(Duration::from_secs(5), watchdog)
            .await
            .expect("ends once the lease is gone")
            .unwrap();
        let held = Arc::new(Held::new("lease"));
        let watchdog = watch(&held, Duration::from_secs(3600));
        drop(held); // the client left: the response body is dropped
        tokio::time::timeout(Duration::from_secs(5), watchdog)
            .await
            .expect("ends once the stream is gone")
            .unwrap();
    }
}
