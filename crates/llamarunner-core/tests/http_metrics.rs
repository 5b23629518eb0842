//! `/metrics`, request ids and outcomes against the fake engine: every request counted once,
//! whatever its dialect, streamed or not.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use llamarunner_core::backend::fake::{FakeBackend, FakeConfig};
use llamarunner_core::engine::Engine;
use llamarunner_core::http::metrics::Metrics;
use llamarunner_core::http::middleware::HttpPolicy;
use llamarunner_core::http::AppState;
use llamarunner_core::protocol::{EngineHandle, LoadState};
use llamarunner_core::routes::router;
use serde_json::Value;
use tower::ServiceExt;

/// A router over the fake engine (2 slots) with metrics, under `policy`.
fn app_with(config: FakeConfig, policy: HttpPolicy) -> (axum::Router, EngineHandle) {
    let metrics = Arc::new(Metrics::new("fake", 256).unwrap());
    let (handle, inbox) = EngineHandle::with_observer(8, metrics.clone());
    std::thread::spawn(move || Engine::with_backend(FakeBackend::new(config), 2, inbox).run());
    while handle.health.state() != LoadState::Ready {
        std::thread::yield_now();
    }
    let state = AppState::new(handle.clone(), "fake")
        .with_policy(policy)
        .with_metrics(metrics);
    (router(state), handle)
}

fn app(config: FakeConfig) -> (axum::Router, EngineHandle) {
    app_with(config, HttpPolicy::default())
}

/// Sends a request; returns the status, the `x-request-id` header and the body.
async fn send(
    app: &axum::Router,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (StatusCode, Option<String>, String) {
    let mut req = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let id = resp
        .headers()
        .get("x-request-id")
        .map(|v| v.to_str().unwrap().to_string());
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, id, String::from_utf8(bytes.to_vec()).unwrap())
}

async fn post(app: &axum::Router, path: &str, body: &str) -> (StatusCode, String) {
    let (status, _, text) = send(app, "POST", path, &[], body).await;
    (status, text)
}

/// The samples of `/metrics`, by name and labels as written.
async fn scrape(app: &axum::Router) -> std::collections::HashMap<String, f64> {
    let (status, _, text) = send(app, "GET", "/metrics", &[], "").await;
    assert_eq!(status, StatusCode::OK, "{text}");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse::<f64>().unwrap())
        })
        .collect()
}

fn get(samples: &std::collections::HashMap<String, f64>, key: &str) -> f64 {
    let key = format!("llamarunner:{key}");
    *samples
        .get(&key)
        .unwrap_or_else(|| panic!("no sample {key} in {samples:?}"))
}

const M: &str = r#"model_name="fake""#;

#[tokio::test]
async fn every_generation_is_counted_once_in_every_dialect() {
    let (app, handle) = app(FakeConfig::default());
    let before = scrape(&app).await;
    assert_eq!(
        get(&before, &format!("generation_tokens_total{{{M}}}")),
        0.0
    );
    assert_eq!(get(&before, &format!("slots_total{{{M}}}")), 2.0);

    // (prompt tokens, generated tokens) of each finished generation, as each answer reports.
    let mut seen: Vec<(f64, f64)> = Vec::new();
    let (s, body) = post(
        &app,
        "/completion",
        r#"{"prompt":"hello","options":{"num_predict":5}}"#,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let last: Value = serde_json::from_str(body.lines().last().unwrap()).unwrap();
    seen.push((
        last["prompt_eval_count"].as_f64().unwrap(),
        last["eval_count"].as_f64().unwrap(),
    ));
    let (s, body) = post(
        &app,
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":3}"#,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    seen.push((
        v["usage"]["prompt_tokens"].as_f64().unwrap(),
        v["usage"]["completion_tokens"].as_f64().unwrap(),
    ));
    let (s, body) = post(
        &app,
        "/v1/completions",
        r#"{"prompt":"abc","max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}"#,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let usage: Value = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|v| v["usage"].is_object())
        .unwrap();
    seen.push((
        usage["usage"]["prompt_tokens"].as_f64().unwrap(),
        usage["usage"]["completion_tokens"].as_f64().unwrap(),
    ));
    for stream in [true, false] {
        let body = format!(
            r#"{{"model":"fake","prompt":"hey","raw":true,"stream":{stream},"options":{{"num_predict":2}}}}"#
        );
        let (s, body) = post(&app, "/api/generate", &body).await;
        assert_eq!(s, StatusCode::OK, "{body}");
        let last: Value = serde_json::from_str(body.lines().last().unwrap()).unwrap();
        seen.push((
            last["prompt_eval_count"].as_f64().unwrap(),
            last["eval_count"].as_f64().unwrap(),
        ));
    }
    // Not generations: an embedding (its tokens count as prompt tokens), a 400.
    let (s, body) = post(&app, "/embedding", r#"{"content":"four"}"#).await;
    assert_eq!(s, StatusCode::OK);
    let embedded = serde_json::from_str::<Value>(&body).unwrap()["prompt_eval_count"]
        .as_f64()
        .unwrap();
    let (s, _) = post(&app, "/completion", r#"{"prompt":""}"#).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, _) = post(&app, "/v1/completions", r#"{"prompt":"x","n":9}"#).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);

    let after = scrape(&app).await;
    let n = seen.len() as f64;
    let prompt: f64 = seen.iter().map(|s| s.0).sum();
    let generated: f64 = seen.iter().map(|s| s.1).sum();
    assert_eq!(generated, 5.0 + 3.0 + 4.0 + 2.0 + 2.0);
    let delta = |key: &str| get(&after, key) - get(&before, key);
    assert_eq!(delta(&format!("generation_tokens_total{{{M}}}")), generated);
    assert_eq!(
        delta(&format!("prompt_tokens_total{{{M}}}")),
        prompt + embedded
    );
    assert_eq!(
        delta(&format!(
            "request_success_total{{finished_reason=\"length\",{M}}}"
        )),
        n
    );
    assert_eq!(
        delta(&format!(
            "request_success_total{{finished_reason=\"stop\",{M}}}"
        )),
        0.0
    );
    for h in [
        "time_to_first_token_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
        "request_prompt_tokens_count",
        "request_generation_tokens_count",
    ] {
        assert_eq!(delta(&format!("{h}{{{M}}}")), n, "{h}");
    }
    assert_eq!(
        delta(&format!("inter_token_latency_seconds_count{{{M}}}")),
        generated - n
    );
    assert_eq!(
        delta(&format!("request_generation_tokens_sum{{{M}}}")),
        generated
    );
    assert_eq!(
        delta(&format!(
            "requests_rejected_total{{reason=\"invalid\",{M}}}"
        )),
        2.0
    );
    assert_eq!(
        delta(&format!(
            "requests_rejected_total{{reason=\"cancelled\",{M}}}"
        )),
        0.0
    );
    assert_eq!(get(&after, &format!("requests_running{{{M}}}")), 0.0);
    assert_eq!(get(&after, &format!("kv_cache_usage_perc{{{M}}}")), 0.0);
    let info: Vec<&String> = after
        .keys()
        .filter(|k| k.starts_with("llamarunner:model_info{"))
        .collect();
    assert_eq!(info.len(), 1, "{after:?}");
    for label in [
        r#"model="fake""#,
        r#"file="fake.gguf""#,
        r#"quantization="F32""#,
        r#"ctx_size="256""#,
        r#"parallel="2""#,
        r#"model_name="fake""#,
    ] {
        assert!(info[0].contains(label), "{label} not in {}", info[0]);
    }
    assert_eq!(after[info[0]], 1.0);
    handle.shutdown();
}

/// Waits until `/metrics` shows `key` at `want`.
async fn wait_for_sample(app: &axum::Router, key: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let samples = scrape(app).await;
        if get(&samples, key) == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{key} never reached {want}: {samples:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn busy_slots_show_their_request_id_and_a_client_that_leaves_is_cancelled() {
    let (app, handle) = app(FakeConfig {
        decode_delay: Duration::from_millis(5),
        ..FakeConfig::default()
    });
    let req = Request::post("/completion")
        .header("x-request-id", "stream-one")
        .body(Body::from(
            r#"{"prompt":"busy","options":{"num_predict":-1}}"#,
        ))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["x-request-id"], "stream-one");
    // The slot table is published after each engine step.
    let deadline = Instant::now() + Duration::from_secs(10);
    let slots = loop {
        let (_, _, slots) = send(&app, "GET", "/slots", &[], "").await;
        let slots: Value = serde_json::from_str(&slots).unwrap();
        if slots
            .as_array()
            .is_some_and(|a| a.iter().any(|s| s["busy"] == true))
        {
            break slots;
        }
        assert!(Instant::now() < deadline, "no busy slot: {slots}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let busy: Vec<&Value> = slots
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["busy"] == true)
        .collect();
    assert_eq!(busy.len(), 1, "{slots}");
    assert_eq!(busy[0]["request_id"], "stream-one");
    assert!(slots
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["busy"] == false && s["request_id"].is_null()));
    let running = scrape(&app).await;
    assert_eq!(get(&running, &format!("requests_running{{{M}}}")), 1.0);
    let usage = get(&running, &format!("kv_cache_usage_perc{{{M}}}"));
    assert!(usage > 0.0 && usage <= 0.5, "{usage}");

    drop(resp); // the client leaves
    wait_for_sample(
        &app,
        &format!("requests_rejected_total{{reason=\"cancelled\",{M}}}"),
        1.0,
    )
    .await;
    wait_for_sample(&app, &format!("requests_running{{{M}}}"), 0.0).await;
    let after = scrape(&app).await;
    assert_eq!(
        get(
            &after,
            &format!("request_success_total{{finished_reason=\"length\",{M}}}")
        ),
        0.0
    );
    handle.shutdown();
}

#[tokio::test]
async fn request_ids_are_echoed_on_every_answer_or_replaced_when_hostile() {
    let keys = ["secret".to_string()];
    let (app, handle) = app_with(
        FakeConfig::default(),
        HttpPolicy::new(&keys, &[], true, 1 << 20),
    );
    let auth = ("authorization", "Bearer secret");
    let (s, id, body) = send(
        &app,
        "POST",
        "/v1/chat/completions",
        &[auth, ("x-request-id", "given-42")],
        r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
    assert_eq!(id.as_deref(), Some("given-42"));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["id"], "chatcmpl-given-42");
    let (_, id, body) = send(
        &app,
        "POST",
        "/v1/completions",
        &[auth, ("x-request-id", "c-1")],
        r#"{"prompt":"x","max_tokens":1}"#,
    )
    .await;
    assert_eq!(id.as_deref(), Some("c-1"));
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["id"],
        "cmpl-c-1"
    );

    // Errors carry it too: 401, 404, 400.
    for (path, headers, status) in [
        ("/completion", vec![("x-request-id", "e-401")], 401),
        ("/nowhere", vec![auth, ("x-request-id", "e-404")], 404),
        ("/completion", vec![auth, ("x-request-id", "e-400")], 400),
    ] {
        let (s, id, _) = send(&app, "POST", path, &headers, "{").await;
        assert_eq!(s.as_u16(), status, "{path}");
        assert_eq!(id.as_deref(), headers.last().map(|h| h.1), "{path}");
    }
    // Absent or hostile: a fresh UUID, never the header's text.
    let hostile = format!("x\" injected=1 {}", "y".repeat(200));
    for given in [None, Some("a b"), Some(hostile.as_str()), Some("")] {
        let mut headers = vec![auth];
        if let Some(g) = given {
            headers.push(("x-request-id", g));
        }
        let (_, id, _) = send(&app, "GET", "/v1/models", &headers, "").await;
        let id = id.unwrap();
        assert_eq!(id.len(), 36, "{id}");
        assert_eq!(id.as_bytes()[14], b'4', "{id} is not a UUID v4");
        assert_ne!(Some(id.as_str()), given);
    }
    let samples = scrape_with_key(&app).await;
    assert_eq!(
        get(
            &samples,
            &format!("requests_rejected_total{{reason=\"unauthorized\",{M}}}")
        ),
        1.0
    );
    assert_eq!(
        get(
            &samples,
            &format!("requests_rejected_total{{reason=\"not_found\",{M}}}")
        ),
        1.0
    );
    handle.shutdown();
}

/// `/metrics` behind the API key "secret".
async fn scrape_with_key(app: &axum::Router) -> std::collections::HashMap<String, f64> {
    let (status, _, text) = send(
        app,
        "GET",
        "/metrics",
        &[("authorization", "Bearer secret")],
        "",
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse::<f64>().unwrap())
        })
        .collect()
}

#[tokio::test]
async fn a_full_queue_counts_as_queue_full() {
    // No engine thread drains the queue (capacity 1): the second request finds it full.
    let metrics = Arc::new(Metrics::new("fake", 64).unwrap());
    let (handle, _inbox) = EngineHandle::with_observer(1, metrics.clone());
    handle
        .health
        .set_model_info(llamarunner_core::backend::fake::model_info(64));
    handle.health.set_ready(1);
    let app = router(AppState::new(handle.clone(), "fake").with_metrics(metrics));
    let first = tokio::spawn({
        let app = app.clone();
        async move { post(&app, "/completion", r#"{"prompt":"x"}"#).await }
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while handle.queue.waiting() < 1 {
        assert!(Instant::now() < deadline, "the first request never queued");
        tokio::task::yield_now().await;
    }
    let (status, _) = post(&app, "/completion", r#"{"prompt":"y"}"#).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let samples = scrape(&app).await;
    assert_eq!(get(&samples, &format!("requests_waiting{{{M}}}")), 1.0);
    assert_eq!(get(&samples, &format!("num_requests_waiting{{{M}}}")), 1.0);
    assert_eq!(
        get(
            &samples,
            &format!("requests_rejected_total{{reason=\"queue_full\",{M}}}")
        ),
        1.0
    );
    first.abort();
    // The queued request's client left (its task was aborted).
    wait_for_sample(
        &app,
        &format!("requests_rejected_total{{reason=\"cancelled\",{M}}}"),
        1.0,
    )
    .await;
}

#[tokio::test]
async fn without_metrics_the_route_is_a_501_as_llama_server_s() {
    let (handle, _inbox) = EngineHandle::new(1);
    let app = router(AppState::new(handle, "fake"));
    let (status, id, _) = send(&app, "GET", "/metrics", &[], "").await;
    assert_eq!(status, StatusCode::NOT_IMPLEMENTED);
    assert!(id.is_some());
}

#[tokio::test]
async fn a_scrape_says_when_the_process_started() {
    let (app, handle) = app(FakeConfig::default());
    let req = Request::builder()
        .uri("/metrics")
        .body(Body::empty())
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    // As llama-server's header: seconds since the epoch, not in the future.
    let start: u64 = resp.headers()["process-start-time-unix"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(start > 1_600_000_000 && start <= now, "{start}");
    handle.shutdown();
}
