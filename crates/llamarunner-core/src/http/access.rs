//! The outermost layer, around every request: its id (`X-Request-Id`), its log span, its
//! outcome and its access log line.
//!
//! - **Request ids.** A client's `X-Request-Id` is kept when it is 1 to 128 characters of
//!   `A-Z a-z 0-9 - _ . : / + =`; otherwise (absent, too long, anything else: a header meant
//!   to forge log lines) the request gets a fresh UUID v4. The id is echoed in the response's
//!   `X-Request-Id` on every answer, errors included, names the request's span (every log line
//!   about it, the engine's included, carries `request_id`), becomes the OpenAI `id`
//!   (`chatcmpl-<id>`) and is shown by `GET /slots` for the slot the request holds.
//! - **The record.** Handlers reach the request's `Record` through a task-local (`current`)
//!   and note what happened: a generation started, its final statistics, an error. When the
//!   response ends (its body was sent, or the client left), the record is finished exactly
//!   once: its `Outcome` is counted (`Metrics::record`) and one access line is logged.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::Response;
use axum::Router;
use hyper::body::{Frame, SizeHint};
use tracing::Instrument;

use crate::http::metrics::{rejection_reason, Metrics, Outcome};
use crate::protocol::Completion;

/// The request id header, read and echoed.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest request id kept from a client.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// Longest unmatched path written in an access line.
const MAX_LOGGED_PATH: usize = 128;

/// Whether a client's request id may be kept: 1 to `MAX_REQUEST_ID_LEN` bytes, each a letter,
/// a digit or one of `-_.:/+=` (UUIDs, ULIDs, hex and base64 ids, trace ids). Nothing that
/// could break a log line, a JSON string or a header.
pub fn valid_request_id(id: &[u8]) -> bool {
    (1..=MAX_REQUEST_ID_LEN).contains(&id.len())
        && id
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/+=".contains(b))
}

/// A fresh request id: a random UUID (version 4).
pub fn new_request_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// The id of a request that came with `given` as its `X-Request-Id`: that, when it is valid,
/// else a fresh one.
pub fn request_id(given: Option<&HeaderValue>) -> String {
    match given {
        Some(v) if valid_request_id(v.as_bytes()) => {
            // Valid ids are ASCII.
            String::from_utf8_lossy(v.as_bytes()).into_owned()
        }
        _ => new_request_id(),
    }
}

tokio::task_local! {
    /// The record of the request whose handler runs in this task.
    static CURRENT: Arc<Record>;
}

/// The record of the request being handled, inside the access layer.
pub fn current() -> Option<Arc<Record>> {
    CURRENT.try_with(Arc::clone).ok()
}

/// The id of the request being handled (a fresh one outside the access layer).
pub fn current_id() -> String {
    current().map_or_else(new_request_id, |r| r.id.clone())
}

/// Notes that the request is answered with an error of this type (`ApiError`'s `kind`).
pub(crate) fn note_error(kind: &'static str) {
    if let Some(record) = current() {
        record.update(|s| s.error_kind = Some(kind));
    }
}

/// What one request did, noted by its handler and read when its response ends.
#[derive(Debug)]
pub struct Record {
    id: String,
    started: Instant,
    state: Mutex<RecordState>,
}

#[derive(Debug, Default)]
struct RecordState {
    /// The response's status, once the handler answered.
    status: Option<StatusCode>,
    /// The type of the error answered, if one was.
    error_kind: Option<&'static str>,
    /// A generation got its slot (its answer is a stream of engine events).
    generating: bool,
    /// Its final statistics, once they passed through the HTTP side.
    done: Option<Completion>,
    /// The rejection reason of an error event in the middle of a stream.
    stream_error: Option<&'static str>,
    /// Tokens of an embedding request's inputs.
    embedded_tokens: Option<usize>,
}

impl Record {
    fn new(id: String) -> Self {
        Self {
            id,
            started: Instant::now(),
            state: Mutex::default(),
        }
    }

    /// The request's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    fn update(&self, f: impl FnOnce(&mut RecordState)) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut state);
    }

    /// A generation got its slot; its events now flow to the client.
    pub(crate) fn generation_started(&self) {
        self.update(|s| s.generating = true);
    }

    /// The generation's final statistics reached the HTTP side.
    pub(crate) fn finished(&self, done: &Completion) {
        self.update(|s| s.done = Some(done.clone()));
    }

    /// The generation ended with an error answered with this status and type.
    pub(crate) fn failed(&self, status: StatusCode, kind: &'static str) {
        self.update(|s| s.stream_error = Some(rejection_reason(status.as_u16(), Some(kind))));
    }

    /// An embedding request's inputs were embedded: `tokens` in all.
    pub(crate) fn embedded(&self, tokens: usize) {
        self.update(|s| s.embedded_tokens = Some(tokens));
    }

    /// What the request came to, its response body `complete` (sent to its end) or not.
    fn outcome(&self, complete: bool) -> (Outcome, Option<StatusCode>, Option<usize>) {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let outcome = if let Some(done) = &s.done {
            Outcome::Finished(done.clone())
        } else {
            match s.status {
                // The client left before the handler answered.
                None => Outcome::Rejected("cancelled"),
                Some(status) if status.as_u16() >= 400 => {
                    Outcome::Rejected(rejection_reason(status.as_u16(), s.error_kind))
                }
                Some(_) => match s.stream_error {
                    Some(reason) => Outcome::Rejected(reason),
                    // The stream closed without its final message: the engine went away.
                    None if s.generating && complete => Outcome::Rejected("error"),
                    None if s.generating => Outcome::Rejected("cancelled"),
                    None => Outcome::Served,
                },
            }
        };
        (outcome, s.status, s.embedded_tokens)
    }
}

/// Adds the access layer around `router` (every route and layer already in place), counting
/// outcomes into `metrics` when they are on.
pub fn layer(router: Router, metrics: Option<Arc<Metrics>>) -> Router {
    router.layer(from_fn_with_state(metrics, track))
}

/// The route's pattern (`/v1/models/{*model}`), or the path of a request no route matched.
fn route_of(req: &Request) -> String {
    match req.extensions().get::<MatchedPath>() {
        Some(p) => p.as_str().to_string(),
        None => super::text::truncated(req.uri().path(), MAX_LOGGED_PATH).to_string(),
    }
}

async fn track(State(metrics): State<Option<Arc<Metrics>>>, req: Request, next: Next) -> Response {
    let id = request_id(req.headers().get(&REQUEST_ID));
    let record = Arc::new(Record::new(id.clone()));
    let span = tracing::info_span!("request", request_id = %id);
    // Finishes the record if the client leaves before the handler answers (this future is
    // dropped); otherwise the response body carries it to the end.
    let finish = Finish {
        record: record.clone(),
        metrics,
        method: req.method().clone(),
        route: route_of(&req),
        finished: false,
    };
    let response = CURRENT
        .scope(record.clone(), next.run(req))
        .instrument(span.clone())
        .await;
    record.update(|s| s.status = Some(response.status()));
    let (mut parts, body) = response.into_parts();
    if let Ok(value) = HeaderValue::from_str(&id) {
        parts.headers.insert(REQUEST_ID, value);
    }
    Response::from_parts(
        parts,
        Body::new(AccessBody {
            inner: body,
            span,
            finish,
        }),
    )
}

/// Counts the request's outcome and writes its access line, once.
struct Finish {
    record: Arc<Record>,
    metrics: Option<Arc<Metrics>>,
    method: Method,
    route: String,
    finished: bool,
}

impl Finish {
    fn finish(&mut self, complete: bool) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let elapsed = self.record.started.elapsed();
        let (outcome, status, embedded) = self.record.outcome(complete);
        if let Some(metrics) = &self.metrics {
            metrics.record(&outcome, elapsed);
        }
        self.log(&outcome, status, embedded, elapsed);
    }

    /// The access line: at info, but at debug for probes and scrapes (`GET /health`,
    /// `GET /metrics`), which would otherwise drown the log.
    fn log(
        &self,
        outcome: &Outcome,
        status: Option<StatusCode>,
        embedded: Option<usize>,
        elapsed: Duration,
    ) {
        // Milliseconds, to the microsecond.
        let ms = |ns: u64| (ns / 1_000) as f64 / 1e3;
        let done = match outcome {
            Outcome::Finished(done) => Some(done),
            _ => None,
        };
        let (finish_reason, error) = match outcome {
            Outcome::Finished(done) => (Some(done.done_reason.as_str()), None),
            Outcome::Rejected("cancelled") => (Some("cancelled"), None),
            Outcome::Rejected(reason) => (None, Some(*reason)),
            Outcome::Served => (None, None),
        };
        let prompt_tokens = done.map(|d| d.prompt_eval_count).or(embedded);
        let cached_tokens = done.map(|d| d.prompt_cached_count);
        let generated_tokens = done.map(|d| d.eval_count);
        let queue_ms = done.map(|d| ms(d.queue_duration_ns));
        let ttft_ms = done.filter(|d| d.eval_count > 0).map(|d| {
            ms(d.queue_duration_ns
                .saturating_add(d.prompt_eval_duration_ns))
        });
        let total_ms = ms(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX));
        let status = status.map(|s| s.as_u16());
        let method = self.method.as_str();
        let route = self.route.as_str();
        let request_id = self.record.id.as_str();
        macro_rules! access {
            ($level:expr) => {
                tracing::event!(
                    $level,
                    method,
                    route,
                    status,
                    request_id,
                    prompt_tokens,
                    cached_tokens,
                    generated_tokens,
                    queue_ms,
                    ttft_ms,
                    total_ms,
                    finish_reason,
                    error,
                    "access"
                )
            };
        }
        let probe = self.method == Method::GET && matches!(route, "/health" | "/metrics");
        if probe {
            access!(tracing::Level::DEBUG);
        } else {
            access!(tracing::Level::INFO);
        }
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        self.finish(false);
    }
}

/// A response body that finishes its request's record when it ends or is dropped, and polls
/// the inner body inside the request's span.
struct AccessBody {
    inner: Body,
    span: tracing::Span,
    finish: Finish,
}

impl hyper::body::Body for AccessBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let polled = {
            let _in_span = this.span.enter();
            Pin::new(&mut this.inner).poll_frame(cx)
        };
        match &polled {
            Poll::Ready(None) => this.finish.finish(true),
            Poll::Ready(Some(Err(_))) => this.finish.finish(false),
            // A body that knows it has ended (a whole JSON answer) may not be polled again.
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.finish.finish(true),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for AccessBody {
    fn drop(&mut self) {
        // An empty body is never polled.
        let complete = hyper::body::Body::is_end_stream(&self.inner);
        self.finish.finish(complete);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_ids_are_kept_only_when_short_and_plain() {
        for ok in [
            "abc",
            "0f8e4c1a-7f3b-4d2a-9c1e-2b3a4c5d6e7f",
            "01ARZ3NDEKTSV4RRFFQ69G5FAV",
            "Root=1-5759e988-bd862e3fe1be46a994272793",
            "a.b:c/d+e_f",
        ] {
            let v = HeaderValue::from_str(ok).unwrap();
            assert_eq!(request_id(Some(&v)), ok);
        }
        let long = "x".repeat(MAX_REQUEST_ID_LEN + 1);
        for bad in [
            "",
            "with space",
            "quote\"d",
            "new\\nline",
            "semi;colon",
            "<script>",
            "é",
            long.as_str(),
        ] {
            let v = HeaderValue::from_bytes(bad.as_bytes()).unwrap();
            let id = request_id(Some(&v));
            assert_ne!(id, bad);
            assert!(uuid::Uuid::parse_str(&id).is_ok(), "{id}");
        }
        let v = HeaderValue::from_bytes(b"ctl\x7f\x01").unwrap_or(HeaderValue::from_static("x y"));
        assert!(uuid::Uuid::parse_str(&request_id(Some(&v))).is_ok());
        assert_eq!(
            request_id(Some(&HeaderValue::from_str(&"x".repeat(128)).unwrap())).len(),
            128
        );
    }

    #[test]
    fn fresh_ids_are_random_uuid_v4() {
        let a = uuid::Uuid::parse_str(&request_id(None)).unwrap();
        let b = uuid::Uuid::parse_str(&request_id(None)).unwrap();
        assert_eq!(a.get_version_num(), 4);
        assert_ne!(a, b);
    }

    #[test]
    fn outcomes_follow_what_the_handler_noted() {
        use crate::protocol::DoneReason;
        let done = Completion {
            done_reason: DoneReason::Stop,
            prompt_eval_count: 3,
            prompt_cached_count: 1,
            queue_duration_ns: 0,
            prompt_eval_duration_ns: 0,
            eval_count: 2,
            eval_duration_ns: 0,
            truncated: false,
            draft_count: 0,
            draft_accepted_count: 0,
            stop_string: None,
        };
        let record = |f: &dyn Fn(&mut RecordState)| {
            let r = Record::new("id".into());
            r.update(f);
            r
        };
        let ok = Some(StatusCode::OK);
        // The client left before any answer.
        assert_eq!(
            record(&|_| {}).outcome(false).0,
            Outcome::Rejected("cancelled")
        );
        // An error answer, by status and type.
        let r = record(&|s| {
            s.status = Some(StatusCode::TOO_MANY_REQUESTS);
            s.error_kind = Some("overloaded");
        });
        assert_eq!(r.outcome(true).0, Outcome::Rejected("queue_full"));
        // A stream that ran to its end, even if the client left after its last message.
        let r = record(&|s| {
            s.status = ok;
            s.generating = true;
            s.done = Some(done.clone());
        });
        assert_eq!(r.outcome(false).0, Outcome::Finished(done.clone()));
        // A stream the client left.
        let r = record(&|s| {
            s.status = ok;
            s.generating = true;
        });
        assert_eq!(r.outcome(false).0, Outcome::Rejected("cancelled"));
        assert_eq!(r.outcome(true).0, Outcome::Rejected("error"));
        // An error event in the stream.
        let r = record(&|s| {
            s.status = ok;
            s.generating = true;
        });
        r.failed(StatusCode::SERVICE_UNAVAILABLE, "unavailable");
        assert_eq!(r.outcome(false).0, Outcome::Rejected("unavailable"));
        // Anything else is served, not counted.
        assert_eq!(record(&|s| s.status = ok).outcome(false).0, Outcome::Served);
    }
}
