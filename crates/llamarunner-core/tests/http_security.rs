//! Security and limits of the HTTP layer, against the fake engine: API keys in every dialect,
//! `Host` and `Origin` checks, CORS, the body limit (through the router), and over real TCP
//! the header and idle timeouts, the connection cap, graceful shutdown and a dead engine.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use llamarunner_core::backend::fake::{FakeBackend, FakeConfig};
use llamarunner_core::engine::Engine;
use llamarunner_core::http::middleware::HttpPolicy;
use llamarunner_core::http::AppState;
use llamarunner_core::protocol::{EngineHandle, LoadState};
use llamarunner_core::routes::router;
use llamarunner_core::{Runner, RunnerConfig};
use serde_json::Value;
use tower::ServiceExt;

// --- through the router ---------------------------------------------------------------------

/// The router over a ready fake engine, under `policy`.
fn guarded(policy: HttpPolicy) -> (axum::Router, EngineHandle) {
    let (handle, inbox) = EngineHandle::new(8);
    std::thread::spawn(move || {
        Engine::with_backend(FakeBackend::new(FakeConfig::default()), 2, inbox).run()
    });
    while handle.health.state() != LoadState::Ready {
        std::thread::yield_now();
    }
    let state = AppState::new(handle.clone(), "fake").with_policy(policy);
    (router(state), handle)
}

fn keyed() -> HttpPolicy {
    HttpPolicy::new(&["secret-1".into(), "secret-2".into()], &[], true, 1 << 20)
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

async fn send(app: &axum::Router, req: Request<Body>) -> Answer {
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// A request with a JSON body for POST, none for GET, and these headers.
fn request(method: &str, path: &str, body: &str, headers: &[(&str, &str)]) -> Request<Body> {
    let mut b = Request::builder().method(method).uri(path);
    for (name, value) in headers {
        b = b.header(*name, *value);
    }
    if method == "POST" {
        b = b.header("content-type", "application/json");
    }
    b.body(Body::from(body.to_string())).unwrap()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Shape {
    Native,
    OpenAi,
    Ollama,
}

/// Asserts the error body has the dialect's shape, with our `kind` and OpenAI's `openai_type`.
fn assert_error_shape(answer: &Answer, shape: Shape, kind: &str, openai_type: &str) {
    let v = answer.json();
    match shape {
        Shape::Native => {
            assert_eq!(v["error"]["type"], kind, "{}", answer.body);
            assert!(v["error"]["message"].is_string());
        }
        Shape::OpenAi => {
            assert_eq!(v["error"]["type"], openai_type, "{}", answer.body);
            assert_eq!(v["error"]["code"], kind, "{}", answer.body);
            assert!(v["error"]["message"].is_string());
        }
        Shape::Ollama => assert!(v["error"].is_string(), "{}", answer.body),
    }
}

/// One route of each kind in each dialect, with a body that the handler accepts.
const ROUTES: [(&str, &str, &str, Shape); 8] = [
    ("GET", "/slots", "", Shape::Native),
    (
        "POST",
        "/completion",
        r#"{"prompt":"hi","options":{"num_predict":2}}"#,
        Shape::Native,
    ),
    ("GET", "/v1/models", "", Shape::OpenAi),
    (
        "POST",
        "/v1/completions",
        r#"{"model":"fake","prompt":"hi","max_tokens":2}"#,
        Shape::OpenAi,
    ),
    ("GET", "/api/tags", "", Shape::Ollama),
    (
        "POST",
        "/api/generate",
        r#"{"model":"fake","prompt":"hi","stream":false,"options":{"num_predict":2}}"#,
        Shape::Ollama,
    ),
    ("GET", "/api/version", "", Shape::Ollama),
    // An unknown route needs a key too (no probing for routes).
    ("GET", "/no/such/route", "", Shape::Native),
];

/// The browser page's files need no key (they hold no data; the page asks for the key), and
/// no spelling of a path opens anything else.
#[tokio::test]
async fn the_page_needs_no_key_and_opens_nothing_else() {
    let (app, handle) = guarded(keyed());
    for path in [
        "/",
        "/dashboard",
        "/ui/index.html",
        "/ui/app.js",
        "/ui/app.css",
    ] {
        let a = send(&app, request("GET", path, "", &[("accept", "text/html")])).await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
        assert!(a.headers.contains_key("content-security-policy"), "{path}");
    }
    // API clients get the plain line at / (no key needed either).
    let a = send(&app, request("GET", "/", "", &[])).await;
    assert_eq!(
        (a.status, a.body.as_str()),
        (StatusCode::OK, "llamarunner is running")
    );
    // Another name under /ui/ is not open.
    let a = send(&app, request("GET", "/ui/nothing.js", "", &[])).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    for path in [
        "/ui/../slots",
        "/ui/%2e%2e/slots",
        "//slots",
        "/dashboard/../slots",
        "/ui//metrics",
    ] {
        let a = send(&app, request("GET", path, "", &[])).await;
        assert!(
            a.status == StatusCode::UNAUTHORIZED || a.status == StatusCode::NOT_FOUND,
            "{path}: {}",
            a.status
        );
        assert!(!a.body.contains("\"slots\""), "{path}");
    }
    for (method, path) in [
        ("POST", "/"),
        ("POST", "/dashboard"),
        ("POST", "/ui/app.js"),
    ] {
        let a = send(&app, request(method, path, "{}", &[])).await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{method} {path}");
    }
    handle.shutdown();
}

#[tokio::test]
async fn every_route_but_health_needs_a_key_in_every_dialect() {
    let (app, handle) = guarded(keyed());
    for (method, path, body, shape) in ROUTES {
        for headers in [
            vec![],
            vec![("authorization", "Bearer wrong")],
            vec![("x-api-key", "wrong")],
            vec![("authorization", "secret-1")],
            vec![("authorization", "Basic secret-1")],
        ] {
            let a = send(&app, request(method, path, body, &headers)).await;
            assert_eq!(
                a.status,
                StatusCode::UNAUTHORIZED,
                "{method} {path} {headers:?}"
            );
            assert_eq!(a.headers["www-authenticate"], "Bearer", "{path}");
            assert_error_shape(&a, shape, "unauthorized", "authentication_error");
        }
        for headers in [
            [("authorization", "Bearer secret-1")],
            [("authorization", "bearer secret-2")],
            [("x-api-key", "secret-2")],
        ] {
            let a = send(&app, request(method, path, body, &headers)).await;
            let expected = if path == "/no/such/route" {
                StatusCode::NOT_FOUND
            } else {
                StatusCode::OK
            };
            assert_eq!(
                a.status, expected,
                "{method} {path} {headers:?}: {}",
                a.body
            );
        }
    }
    // Probes need no key.
    let a = send(&app, request("GET", "/health", "", &[])).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.json()["status"], "ready");
    // ... but only GET /health: other methods on it are not a way around the key.
    let a = send(&app, request("POST", "/health", "{}", &[])).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    handle.shutdown();
}

#[tokio::test]
async fn without_keys_every_route_is_open() {
    let (app, handle) = guarded(HttpPolicy::default());
    for (method, path, body, _) in ROUTES {
        let a = send(&app, request(method, path, body, &[])).await;
        assert_ne!(a.status, StatusCode::UNAUTHORIZED, "{path}");
        assert!(a.headers.get("www-authenticate").is_none());
    }
    handle.shutdown();
}

#[tokio::test]
async fn a_loopback_server_refuses_foreign_hosts() {
    let (app, handle) = guarded(HttpPolicy::default());
    for host in [
        "localhost",
        "localhost:8080",
        "127.0.0.1:8080",
        "[::1]:8080",
        "x.localhost",
    ] {
        let a = send(&app, request("GET", "/slots", "", &[("host", host)])).await;
        assert_eq!(a.status, StatusCode::OK, "{host}");
    }
    for (path, shape) in [
        ("/slots", Shape::Native),
        ("/v1/models", Shape::OpenAi),
        ("/api/tags", Shape::Ollama),
    ] {
        for host in [
            "evil.example",
            "evil.example:8080",
            "192.168.1.10:8080",
            "localhost.evil.example",
        ] {
            let a = send(&app, request("GET", path, "", &[("host", host)])).await;
            assert_eq!(a.status, StatusCode::FORBIDDEN, "{host} {path}");
            assert_error_shape(&a, shape, "forbidden", "permission_error");
        }
    }
    // Not even /health answers a rebinding page.
    let a = send(
        &app,
        request("GET", "/health", "", &[("host", "evil.example")]),
    )
    .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    handle.shutdown();

    // A server bound to a routable address is reached by any name.
    let (app, handle) = guarded(HttpPolicy::new(&[], &[], false, 1 << 20));
    let a = send(
        &app,
        request("GET", "/slots", "", &[("host", "llm.example:8080")]),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);
    handle.shutdown();
}

#[tokio::test]
async fn foreign_origins_are_refused_local_and_listed_ones_get_cors() {
    let policy = HttpPolicy::new(&[], &["https://app.example.com".into()], false, 1 << 20);
    let (app, handle) = guarded(policy);
    for origin in [
        "http://localhost:5173",
        "http://127.0.0.1:3000",
        "https://app.example.com",
        "tauri://localhost",
    ] {
        let a = send(
            &app,
            request("GET", "/v1/models", "", &[("origin", origin)]),
        )
        .await;
        assert_eq!(a.status, StatusCode::OK, "{origin}");
        assert_eq!(a.headers["access-control-allow-origin"], origin);
        assert_eq!(a.headers["access-control-allow-credentials"], "true");
    }
    for (path, shape) in [
        ("/completion", Shape::Native),
        ("/v1/completions", Shape::OpenAi),
        ("/api/generate", Shape::Ollama),
    ] {
        for origin in [
            "https://evil.example",
            "null",
            "http://localhost.evil.example",
        ] {
            let a = send(&app, request("POST", path, "{}", &[("origin", origin)])).await;
            assert_eq!(a.status, StatusCode::FORBIDDEN, "{origin} {path}");
            assert_error_shape(&a, shape, "forbidden", "permission_error");
            assert!(a.headers.get("access-control-allow-origin").is_none());
        }
    }
    // No Origin (curl, SDKs): no CORS headers, no refusal.
    let a = send(&app, request("GET", "/v1/models", "", &[])).await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(a.headers.get("access-control-allow-origin").is_none());
    handle.shutdown();

    let (app, handle) = guarded(HttpPolicy::new(&[], &["*".into()], true, 1 << 20));
    let a = send(
        &app,
        request("GET", "/api/tags", "", &[("origin", "https://any.example")]),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK);
    handle.shutdown();
}

#[tokio::test]
async fn preflight_is_answered_without_a_key_and_errors_carry_cors() {
    let (app, handle) = guarded(keyed());
    let preflight = |origin: &'static str| {
        request(
            "OPTIONS",
            "/v1/chat/completions",
            "",
            &[
                ("origin", origin),
                ("access-control-request-method", "POST"),
                (
                    "access-control-request-headers",
                    "authorization, content-type",
                ),
            ],
        )
    };
    let a = send(&app, preflight("http://localhost:5173")).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(
        a.headers["access-control-allow-origin"],
        "http://localhost:5173"
    );
    let methods = a.headers["access-control-allow-methods"].to_str().unwrap();
    assert!(
        methods.contains("POST") && methods.contains("DELETE"),
        "{methods}"
    );
    let allowed = a.headers["access-control-allow-headers"]
        .to_str()
        .unwrap()
        .to_lowercase();
    assert!(allowed.contains("authorization"), "{allowed}");
    assert_eq!(a.headers["access-control-allow-credentials"], "true");

    // A foreign page's preflight: 200 without CORS headers (its browser stops the call, as
    // llama-server's answer makes it), and the call itself, made anyway, is a 403.
    let a = send(&app, preflight("https://evil.example")).await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(
        !a.headers
            .keys()
            .any(|k| k.as_str().starts_with("access-control-")),
        "{:?}",
        a.headers
    );
    let a = send(
        &app,
        request(
            "POST",
            "/v1/chat/completions",
            "{}",
            &[("origin", "https://evil.example")],
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);

    // A page on localhost without the key can read why it was refused.
    let a = send(
        &app,
        request(
            "GET",
            "/v1/models",
            "",
            &[("origin", "http://localhost:5173")],
        ),
    )
    .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        a.headers["access-control-allow-origin"],
        "http://localhost:5173"
    );
    handle.shutdown();
}

#[tokio::test]
async fn wrong_methods_get_405_in_the_dialects_shape() {
    let (app, handle) = guarded(HttpPolicy::default());
    for (method, path, shape) in [
        ("POST", "/health", Shape::Native),
        ("GET", "/completion", Shape::Native),
        ("DELETE", "/", Shape::Native),
        ("GET", "/v1/chat/completions", Shape::OpenAi),
        ("PUT", "/v1/models", Shape::OpenAi),
        ("GET", "/api/generate", Shape::Ollama),
        // OPTIONS without a preflight's headers is an ordinary request.
        ("OPTIONS", "/api/chat", Shape::Ollama),
    ] {
        let a = send(&app, request(method, path, "", &[])).await;
        assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        assert_error_shape(&a, shape, "method_not_allowed", "invalid_request_error");
        assert!(a.headers.contains_key("allow"), "{method} {path}");
    }
    handle.shutdown();
}

#[tokio::test]
async fn bodies_over_the_limit_get_413_in_the_dialects_shape() {
    let (app, handle) = guarded(HttpPolicy::new(&[], &[], true, 1000));
    let big = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(2000));
    for (path, shape) in [
        ("/completion", Shape::Native),
        ("/embedding", Shape::Native),
        ("/v1/chat/completions", Shape::OpenAi),
        ("/v1/embeddings", Shape::OpenAi),
        ("/api/chat", Shape::Ollama),
        ("/api/show", Shape::Ollama),
    ] {
        // With a Content-Length ...
        let a = send(&app, request("POST", path, &big, &[])).await;
        assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE, "{path}");
        assert_error_shape(&a, shape, "payload_too_large", "invalid_request_error");
        // ... and chunked, without one.
        let chunks: Vec<Result<String, std::io::Error>> =
            (0..20).map(|_| Ok("x".repeat(100))).collect();
        let req = Request::post(path)
            .body(Body::from_stream(futures_util::stream::iter(chunks)))
            .unwrap();
        let a = send(&app, req).await;
        assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE, "{path} chunked");
        assert_error_shape(&a, shape, "payload_too_large", "invalid_request_error");
    }
    // Exactly at the limit is fine.
    let (head, tail) = (r#"{"prompt":""#, r#"","options":{"num_predict":1}}"#);
    let at_limit = format!("{head}{}{tail}", "y".repeat(1000 - head.len() - tail.len()));
    assert_eq!(at_limit.len(), 1000);
    let a = send(&app, request("POST", "/completion", &at_limit, &[])).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    handle.shutdown();
}

#[tokio::test]
async fn the_default_limit_is_8_mib_not_axums_2_mb() {
    let (app, handle) = guarded(HttpPolicy::default());
    // 3 MB of valid JSON whose prompt is not a string: the handler sees it (400), no 413.
    let body = format!(r#"{{"prompt":1,"pad":"{}"}}"#, "x".repeat(3 << 20));
    let a = send(&app, request("POST", "/completion", &body, &[])).await;
    assert_eq!(
        a.status,
        StatusCode::BAD_REQUEST,
        "{}",
        &a.body[..a.body.len().min(200)]
    );
    assert_eq!(a.json()["error"]["type"], "invalid_json");
    let body = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(9 << 20));
    let a = send(&app, request("POST", "/completion", &body, &[])).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    handle.shutdown();
}

// --- over TCP, with a whole runner ------------------------------------------------------------

/// A runner on a free loopback port over the fake engine.
fn runner(config: RunnerConfig, fake: FakeConfig) -> Runner {
    let config = RunnerConfig { port: 0, ..config };
    let runner = Runner::start_with(&config, move |inbox| {
        Engine::with_backend(FakeBackend::new(fake), 2, inbox).run()
    })
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while runner.health().state() != LoadState::Ready {
        assert!(Instant::now() < deadline, "the fake engine did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
    runner
}

fn addr(runner: &Runner) -> String {
    runner.url().trim_start_matches("http://").to_string()
}

fn connect(runner: &Runner) -> TcpStream {
    let s = TcpStream::connect(addr(runner)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// A whole request, keep-alive.
fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n")
}

/// Reads one response with a Content-Length body; returns (status, body).
fn read_response(s: &mut TcpStream) -> (u16, String) {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        assert_eq!(
            s.read(&mut byte).unwrap(),
            1,
            "connection closed in the head"
        );
        buf.push(byte[0]);
    }
    let head = String::from_utf8(buf).unwrap();
    let status = head[9..12].parse().unwrap();
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().unwrap())
        })
        .expect("a content-length");
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).unwrap();
    (status, String::from_utf8(body).unwrap())
}

/// Whether the server closes `s` within `within`: true on EOF or reset.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 256];
    match s.read(&mut buf) {
        Ok(0) => true,
        Ok(n) => panic!("unexpected data: {:?}", String::from_utf8_lossy(&buf[..n])),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => true,
        Err(e) => {
            assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
                "{e}"
            );
            false
        }
    }
}

#[test]
fn a_half_sent_header_is_cut_after_the_header_timeout_idle_keep_alive_lasts_longer() {
    let config = RunnerConfig {
        header_timeout: 0.5,
        idle_timeout: 2.0,
        ..RunnerConfig::default()
    };
    let r = runner(config, FakeConfig::default());

    // Slowloris: half a header, then nothing.
    let mut slow = connect(&r);
    let start = Instant::now();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: loc")
        .unwrap();
    assert!(closed_within(&mut slow, Duration::from_secs(3)));
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(400), "{took:?}");

    // A connection that never sends anything is cut the same way.
    let mut silent = connect(&r);
    assert!(closed_within(&mut silent, Duration::from_secs(3)));

    // Between requests, a keep-alive connection waits the idle timeout, not the header one.
    let mut kept = connect(&r);
    kept.write_all(get("/health").as_bytes()).unwrap();
    assert_eq!(read_response(&mut kept).0, 200);
    assert!(!closed_within(&mut kept, Duration::from_millis(1200)));
    kept.write_all(get("/slots").as_bytes()).unwrap();
    assert_eq!(read_response(&mut kept).0, 200);
    let start = Instant::now();
    assert!(closed_within(&mut kept, Duration::from_secs(5)));
    let idle = start.elapsed();
    assert!(idle >= Duration::from_millis(1500), "{idle:?}");
}

#[test]
fn an_options_request_with_a_late_body_leaves_the_connection_usable() {
    let r = runner(RunnerConfig::default(), FakeConfig::default());
    let mut s = connect(&r);
    s.write_all(
        b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n\
          Content-Type: application/json\r\nContent-Length: 2\r\n\r\n",
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    s.write_all(b"{}").unwrap();
    assert_eq!(read_response(&mut s).0, 405);
    s.write_all(get("/health").as_bytes()).unwrap();
    assert_eq!(read_response(&mut s).0, 200);
}

#[test]
fn connections_over_the_cap_wait_to_be_accepted() {
    let config = RunnerConfig {
        max_connections: 1,
        header_timeout: 5.0,
        ..RunnerConfig::default()
    };
    let r = runner(config, FakeConfig::default());
    let mut first = connect(&r);
    first.write_all(get("/health").as_bytes()).unwrap();
    assert_eq!(read_response(&mut first).0, 200);

    // The kernel completes the handshake, but nothing reads the request while `first` lives.
    let mut second = connect(&r);
    second.write_all(get("/health").as_bytes()).unwrap();
    second
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut byte = [0u8; 1];
    let e = second.read(&mut byte).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
        "{e}"
    );
    drop(first);
    second
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert_eq!(read_response(&mut second).0, 200);
}

/// Starts a streamed completion of `n` tokens on a new connection; returns it once the first
/// bytes of the answer arrived.
fn start_stream(r: &Runner, n: u32) -> TcpStream {
    let mut s = connect(r);
    let body = format!(r#"{{"prompt":"hi","options":{{"num_predict":{n},"temperature":0}}}}"#);
    let req = format!(
        "POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut first = [0u8; 1];
    s.read_exact(&mut first).unwrap();
    s
}

fn read_to_end(mut s: TcpStream) -> String {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn stopping_lets_running_streams_finish_and_closes_the_port() {
    let fake = FakeConfig {
        decode_delay: Duration::from_millis(20),
        ..FakeConfig::default()
    };
    let mut r = runner(RunnerConfig::default(), fake);
    let address = addr(&r);
    let stream = start_stream(&r, 30);
    // An idle keep-alive connection must not hold the stop up.
    let mut idle = connect(&r);
    idle.write_all(get("/health").as_bytes()).unwrap();
    assert_eq!(read_response(&mut idle).0, 200);

    let reader = std::thread::spawn(move || read_to_end(stream));
    let start = Instant::now();
    r.stop();
    let stopped_after = start.elapsed();
    let text = reader.join().unwrap();
    assert!(text.contains(r#""done":true"#), "{text}");
    assert!(text.contains(r#""eval_count":30"#), "{text}");
    assert!(!text.contains(r#""error""#), "{text}");
    assert!(stopped_after < Duration::from_secs(5), "{stopped_after:?}");
    assert!(
        TcpStream::connect(&address).is_err(),
        "the port is still open"
    );
}

#[test]
fn streams_still_running_after_the_shutdown_timeout_are_cancelled() {
    let config = RunnerConfig {
        shutdown_timeout: 0.3,
        ..RunnerConfig::default()
    };
    let fake = FakeConfig {
        decode_delay: Duration::from_millis(20),
        ..FakeConfig::default()
    };
    let mut r = runner(config, fake);
    let stream = start_stream(&r, 2000);
    let reader = std::thread::spawn(move || read_to_end(stream));
    let start = Instant::now();
    r.stop();
    let stopped_after = start.elapsed();
    assert!(
        stopped_after >= Duration::from_millis(250),
        "{stopped_after:?}"
    );
    assert!(stopped_after < Duration::from_secs(4), "{stopped_after:?}");
    let text = reader.join().unwrap();
    // The stream ends with the engine's error, not its normal end.
    assert!(text.contains(r#""error""#), "{text}");
    assert!(!text.contains(r#""done_reason":"length""#), "{text}");
}

/// `/health` over TCP.
fn health(r: &Runner) -> (u16, Value) {
    let mut s = connect(r);
    s.write_all(get("/health").as_bytes()).unwrap();
    let (status, body) = read_response(&mut s);
    (status, serde_json::from_str(&body).unwrap())
}

fn wait_for_health_error(r: &Runner) -> (u16, Value) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = health(r);
        if body["status"] == "error" || Instant::now() > deadline {
            return (status, body);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn an_engine_that_panics_or_returns_shows_in_health() {
    let config = RunnerConfig {
        port: 0,
        ..RunnerConfig::default()
    };
    let ready_then = |end: fn()| {
        move |inbox: llamarunner_core::protocol::EngineInbox| {
            inbox
                .health
                .set_model_info(llamarunner_core::backend::fake::model_info(64));
            inbox.health.set_ready(1);
            std::thread::sleep(Duration::from_millis(200));
            end();
            drop(inbox);
        }
    };
    let r = Runner::start_with(&config, ready_then(|| panic!("boom in decode"))).unwrap();
    let (status, body) = wait_for_health_error(&r);
    assert_eq!(status, 500, "{body}");
    assert_eq!(
        body["error"],
        "the engine stopped: it panicked: boom in decode"
    );
    // Requests after it are 503 `unavailable`, not the 500 of a model that failed to load.
    let mut s = connect(&r);
    s.write_all(get("/v1/models").as_bytes()).unwrap();
    let (status, body) = read_response(&mut s);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("\"code\":\"unavailable\""), "{body}");
    assert!(r.engine_finished());
    drop(r);

    let r = Runner::start_with(&config, ready_then(|| {})).unwrap();
    let (status, body) = wait_for_health_error(&r);
    assert_eq!(status, 500, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .starts_with("the engine stopped"),
        "{body}"
    );
}

#[test]
fn a_bad_http_setting_or_key_file_fails_the_start() {
    let config = RunnerConfig {
        port: 0,
        header_timeout: -1.0,
        ..RunnerConfig::default()
    };
    let e = Runner::start_with(&config, |_| {}).unwrap_err().to_string();
    assert!(e.starts_with("header-timeout must be"), "{e}");
    let config = RunnerConfig {
        port: 0,
        api_key_file: Some("/no/such/keys".into()),
        ..RunnerConfig::default()
    };
    let e = Runner::start_with(&config, |_| {}).unwrap_err().to_string();
    assert!(
        e.starts_with("api-key-file /no/such/keys: cannot read"),
        "{e}"
    );
}

/// The chat page reached at a LAN address calls back with its own origin: allowed when the
/// server requires a key (a rebinding page cannot have it), refused when it does not.
#[tokio::test]
async fn a_page_of_the_servers_own_origin_may_call_when_a_key_is_required() {
    let lan = |keys: &[String]| HttpPolicy::new(keys, &[], false, 1 << 20);
    let own = [
        ("host", "192.168.1.5:8080"),
        ("origin", "http://192.168.1.5:8080"),
        ("authorization", "Bearer secret-1"),
    ];
    let (app, handle) = guarded(lan(&["secret-1".into()]));
    let a = send(&app, request("GET", "/v1/models", "", &own)).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(
        a.headers["access-control-allow-origin"],
        "http://192.168.1.5:8080"
    );
    // Without the key: 401, not 403 (the page then asks for it).
    let a = send(&app, request("GET", "/v1/models", "", &own[..2])).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    for (host, origin) in [
        ("192.168.1.5:8080", "http://192.168.1.5:9090"),
        ("192.168.1.5:8080", "http://192.168.1.6:8080"),
        ("192.168.1.5:8080", "ftp://192.168.1.5:8080"),
        ("192.168.1.5:8080", "http://"),
        ("", "http://"),
    ] {
        let headers = [
            ("host", host),
            ("origin", origin),
            ("authorization", "Bearer secret-1"),
        ];
        let a = send(&app, request("GET", "/v1/models", "", &headers)).await;
        assert_eq!(a.status, StatusCode::FORBIDDEN, "{host} {origin}");
    }
    handle.shutdown();
    let (app, handle) = guarded(lan(&[]));
    let a = send(&app, request("GET", "/v1/models", "", &own[..2])).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    handle.shutdown();
}
