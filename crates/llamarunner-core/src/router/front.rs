//! The router's own routes: the model listings of every dialect (`/v1/models`, `/api/tags`,
//! `/api/ps`, llama-server's `GET /models`), `POST /models/load` and `/models/unload`,
//! `POST /api/pull` and `DELETE /api/delete` (`pull.rs`),
//! `/health`, `/metrics` (every loaded engine's, merged); every other request goes to the engine of the model it names (the body's
//! `model`, or `?model=` on a GET), loaded first if it is not.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::proxy;
use super::registry::{Registry, Status};
use crate::dialects::ollama;
use crate::http::error::{ApiError, Dialect};
use crate::http::fallback::{method_not_allowed, not_found};
use crate::http::middleware::{self, HttpPolicy};
use crate::http::{access, ui};

type Shared = State<Arc<Registry>>;

/// The front's route table, behind the request policy and the access log.
pub fn router(registry: Arc<Registry>, policy: Arc<HttpPolicy>, metrics: bool) -> Router {
    let mut routes = Router::new();
    if metrics {
        routes = routes.route("/metrics", get(super::metrics::handler));
    }
    let routes = routes
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/models", get(models))
        .route("/models/load", post(load))
        .route("/models/unload", post(unload))
        .route("/v1/models", get(openai_models))
        .route("/v1/models/{*model}", get(openai_model))
        .route("/api/tags", get(tags))
        .route("/api/ps", get(ps))
        .route("/api/pull", post(super::pull::handler))
        .route(
            "/api/delete",
            delete(super::pull::delete).post(super::pull::delete),
        )
        .route("/api/version", get(ollama::version))
        .route("/", get(ui::root))
        .route("/dashboard", get(ui::dashboard))
        .route("/ui/{name}", get(ui::file))
        .fallback(forward)
        .with_state(registry);
    access::layer(middleware::apply(routes, policy), None)
}

/// `GET /health`: the router is up (200) while it serves, whatever its models do; each
/// model's status is listed, failures with their error.
async fn health(State(registry): Shared) -> Response {
    let all = registry.models();
    let models: Vec<_> = all
        .iter()
        .map(|m| {
            let mut v = json!({"id": m.name, "status": m.status().as_str()});
            if let Status::Failed { error } = m.status() {
                v["error"] = json!(error);
            }
            v
        })
        .collect();
    Json(json!({"status": "ready", "role": "router", "models": models})).into_response()
}

/// `GET /models` (llama-server's router): every model with its status, memory and expiry,
/// then the pulls running (`--allow-pull`) with their progress.
async fn models(State(registry): Shared) -> Response {
    let mut data: Vec<Value> = registry
        .models()
        .iter()
        .map(|m| registry.describe(m))
        .collect();
    for (name, line) in registry.pulls() {
        let mut status = json!({"value": "pulling", "detail": line["status"]});
        if let (Some(done), Some(total)) = (line["completed"].as_u64(), line["total"].as_u64()) {
            status["completed"] = json!(done);
            status["total"] = json!(total);
            if total > 0 {
                status["progress"] = json!(done as f64 / total as f64);
            }
        }
        data.push(
            json!({"id": name, "object": "model", "owned_by": "llamarunner", "status": status}),
        );
    }
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models`: every model the router serves, loaded or not.
async fn openai_models(State(registry): Shared) -> Response {
    models(State(registry)).await
}

/// `GET /v1/models/{model}`.
async fn openai_model(
    State(registry): Shared,
    name: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Response {
    let found = name
        .map_err(|e| ApiError::invalid(format!("model name: {e}")))
        .and_then(|Path(name)| registry.find(Some(&name)));
    match found {
        Ok(m) => Json(registry.describe(&m)).into_response(),
        Err(e) => Dialect::OpenAi.respond(e),
    }
}

/// `GET /api/tags`: every model.
async fn tags(State(registry): Shared) -> Response {
    let all = registry.models();
    let models: Vec<_> = all
        .iter()
        .map(|m| registry.ollama_entry(m, false))
        .collect();
    Json(ollama::Models { models }).into_response()
}

/// `GET /api/ps`: the loaded models, with their expiry.
async fn ps(State(registry): Shared) -> Response {
    let all = registry.models();
    let models: Vec<_> = all
        .iter()
        .filter(|m| matches!(m.status(), Status::Loaded { .. }))
        .map(|m| registry.ollama_entry(m, true))
        .collect();
    Json(ollama::Models { models }).into_response()
}

/// The model a `/models/load|unload` body names.
fn named_model(registry: &Registry, body: &Bytes) -> Result<Arc<super::registry::Model>, ApiError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    match v.get("model") {
        Some(Value::String(name)) if !name.is_empty() => registry.find(Some(name)),
        _ => Err(ApiError::invalid(format!(
            "give the model to act on as {{\"model\": NAME}}; the models are: {}",
            registry.names()
        ))),
    }
}

/// `POST /models/load {"model"}`: loads the model (answers once it is loaded, or failed).
async fn load(State(registry): Shared, body: Bytes) -> Response {
    let model = match named_model(&registry, &body) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    match registry.lease(&model).await {
        Ok(lease) => {
            lease.release_quietly();
            Json(json!({"success": true})).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// `POST /models/unload {"model"}`: unloads the model now (requests running on it end with
/// an error).
async fn unload(State(registry): Shared, body: Bytes) -> Response {
    match named_model(&registry, &body) {
        Ok(model) => {
            registry.unload(&model, "POST /models/unload");
            Json(json!({"success": true})).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// Ollama's `keep_alive`: a number of seconds or a Go duration (`"5m"`, `"1h30m"`, `"-1"`);
/// negative: for ever (None); Err when it is neither.
pub fn parse_keep_alive(value: &Value) -> Result<Option<Duration>, String> {
    let seconds = match value {
        Value::Number(n) => n.as_f64().unwrap_or(f64::NAN),
        Value::String(s) => go_duration(s.trim())
            .or_else(|| s.trim().parse::<f64>().ok())
            .ok_or_else(|| format!("keep_alive {s:?}: not a duration (\"5m\", \"30s\", -1)"))?,
        other => {
            return Err(format!(
                "keep_alive {other}: not a duration (\"5m\", \"30s\", -1)"
            ))
        }
    };
    if !seconds.is_finite() {
        return Err("keep_alive: not a finite duration".into());
    }
    if seconds < 0.0 {
        return Ok(None);
    }
    Ok(Some(Duration::from_secs_f64(
        seconds.min(100.0 * 365.0 * 86_400.0),
    )))
}

/// Seconds of a Go duration string (`"1h30m"`, `"300ms"`, `"-5m"`), None when it is not one.
fn go_duration(s: &str) -> Option<f64> {
    let (sign, mut rest) = match s.strip_prefix('-') {
        Some(r) => (-1.0, r),
        None => (1.0, s.strip_prefix('+').unwrap_or(s)),
    };
    if rest == "0" {
        return Some(0.0);
    }
    if rest.is_empty() {
        return None;
    }
    let mut total = 0.0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter(|&i| i > 0)?;
        let number: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        total += number * scale;
        rest = &rest[unit_len..];
    }
    Some(sign * total)
}

/// Every other route: to the named model's engine, loaded first when it is not.
async fn forward(State(registry): Shared, request: Request) -> Response {
    let dialect = Dialect::of_path(request.uri().path());
    let (parts, body) = request.into_parts();
    // The policy layer has bounded the body already (`--max-body`).
    let body = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(e) => {
            return dialect.respond(ApiError::RequestTimeout(format!("reading the body: {e}")))
        }
    };
    let mut name: Option<String> = None;
    let mut keep_alive = None;
    let mut unload_only = false;
    let posted = parts.method == Method::POST;
    if posted && !crate::routes::is_model_post(parts.uri.path()) {
        // No engine serves it: answered here, without loading the model it names (405 for
        // the engine's routes that only read).
        if crate::routes::is_model_read(parts.uri.path()) {
            return method_not_allowed(parts.method, parts.uri).await;
        }
        return not_found(parts.method, parts.uri).await;
    }
    let path = parts.uri.path();
    if !posted && !crate::routes::is_model_read(path) && !crate::routes::is_model_post(path) {
        // No engine has the route: a 404, whatever model it would name.
        return not_found(parts.method, parts.uri).await;
    }
    let mut posted_json: Option<Value> = None;
    if posted && !body.is_empty() {
        let v: Value = match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => return dialect.respond(ApiError::InvalidJson(e.to_string())),
        };
        unload_only = is_ollama_unload(parts.uri.path(), &v);
        // `/api/show` and Ollama's older clients say `name`.
        name = v
            .get("model")
            .or_else(|| v.get("name"))
            .and_then(Value::as_str)
            .map(str::to_string);
        if let Some(k) = v.get("keep_alive").filter(|k| !k.is_null()) {
            match parse_keep_alive(k) {
                Ok(k) => keep_alive = Some(k),
                Err(e) => return dialect.respond(ApiError::invalid(e)),
            }
        }
        posted_json = Some(v);
    }
    let named_in_body = name.is_some();
    if name.is_none() {
        // `?model=` names it on a GET, and on a POST whose body names none (llama-server's
        // `POST /slots/{id}?action=…&model=…`).
        if let Ok(Query(q)) = Query::<HashMap<String, String>>::try_from_uri(&parts.uri) {
            name = q.get("model").cloned();
        }
    }
    let model = match registry.find(name.as_deref()) {
        Ok(m) => m,
        // `--allow-pull`: a model not served yet is pulled first (a request that would run
        // it: not a read, not Ollama's unload, not `/api/show`, which Ollama answers 404).
        Err(ApiError::ModelNotFound(_))
            if posted
                && !unload_only
                && parts.uri.path() != "/api/show"
                && registry.pull_config().is_some() =>
        {
            let Some(name) = name.as_deref() else {
                return dialect.respond(ApiError::invalid("name a model"));
            };
            match super::pull::fetch(&registry, name).await {
                Ok(m) => m,
                Err(e) => return dialect.respond(e),
            }
        }
        Err(e) => return dialect.respond(e),
    };
    // A model found by another name (the name a pull was asked by) is named as its engine
    // serves it.
    let body = match posted_json {
        Some(mut v) if named_in_body && name.as_deref().is_some_and(|n| registry.is_alias(n)) => {
            let key = if v.get("model").is_some() {
                "model"
            } else {
                "name"
            };
            v[key] = Value::String(model.name.clone());
            Bytes::from(v.to_string())
        }
        _ => body,
    };
    if unload_only && keep_alive == Some(Some(Duration::ZERO)) {
        // Ollama's `ollama stop`: unloads without loading first.
        registry.unload(&model, "keep_alive 0 with nothing to generate");
        return Json(ollama_unloaded(parts.uri.path(), &model.name)).into_response();
    }
    // A slot's save or erase acts on a loaded model's slot: it loads none (a new engine's slot
    // is empty, and a save would overwrite the file with nothing). A restore may load it.
    let slot_action = parts.uri.path().starts_with("/slots/");
    let restore = parts
        .uri
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "action=restore"));
    let loads = posted && (!slot_action || restore);
    let key = registry.engine_key();
    // A request that can run again: not a GET (it loads no model), nor a slot action (a new
    // engine's slot is empty: a save would overwrite the file with nothing).
    let repeatable = posted && !slot_action;
    let mut tried = false;
    loop {
        let lease = match lease_for(&registry, &model, loads, posted, keep_alive).await {
            Ok(l) => l,
            Err(e) => return dialect.respond(e),
        };
        let unanswered = match proxy::forward(lease, &parts, body.clone(), key).await {
            Ok(response) => return response,
            Err(unanswered) => unanswered,
        };
        // No answer began: the engine's process has died (killed, crashed), perhaps just
        // before the request came, with its exit not seen yet. Once it is, a repeatable
        // request is sent once more, to the model started again: what the dead engine did
        // with it died with it. A model unloaded on purpose is not loaded back, and a second
        // failure is the client's error.
        if tried
            || !repeatable
            || !registry
                .engine_died(&unanswered.lease, ENGINE_EXIT_WAIT)
                .await
        {
            return dialect.respond(ApiError::Unavailable(unanswered.error));
        }
        tried = true;
        drop(unanswered.lease);
        tracing::warn!(
            model = %model.name,
            error = %unanswered.error,
            "a model's engine died before answering; sending the request to the model started again"
        );
    }
}

/// A lease on `model` for a request: loading it when needed if `loads`; else only if it is
/// loaded. A GET (`/props`, `/slots`, `/metrics?model=`) loads none, so that a web page's
/// `<img src>` cannot cycle models through memory; nor does a slot's save or erase.
async fn lease_for(
    registry: &Arc<Registry>,
    model: &Arc<super::registry::Model>,
    loads: bool,
    posted: bool,
    keep_alive: Option<Option<Duration>>,
) -> Result<super::registry::Lease, ApiError> {
    let mut lease = if loads {
        registry.lease(model).await?
    } else {
        registry.lease_if_loaded(model).ok_or_else(|| {
            let what = if posted {
                "a slot's save or erase acts on a loaded model's slot and loads none"
            } else {
                "a GET loads none"
            };
            ApiError::Unavailable(format!(
                "model '{}' is not loaded, and {what}: POST /models/load, or send it a request",
                model.name
            ))
        })?
    };
    if let Some(k) = keep_alive {
        lease.keep_alive(k);
    }
    Ok(lease)
}

/// How long a request its engine did not answer waits for that engine's exit to be seen.
const ENGINE_EXIT_WAIT: Duration = Duration::from_secs(2);

/// Ollama's unload request: `/api/generate` with no prompt or `/api/chat` with no messages
/// (its keep_alive, 0, is checked by the caller).
fn is_ollama_unload(path: &str, body: &Value) -> bool {
    let empty = |field: &str| match body.get(field) {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        Some(_) => false,
    };
    match path {
        "/api/generate" => empty("prompt") && empty("images"),
        "/api/chat" => empty("messages"),
        _ => false,
    }
}

/// Ollama's answer to an unload request.
fn ollama_unloaded(path: &str, model: &str) -> Value {
    let created_at = crate::requests::common::rfc3339(std::time::SystemTime::now());
    let mut v = json!({"model": model, "created_at": created_at, "done": true,
                       "done_reason": "unload"});
    if path == "/api/chat" {
        v["message"] = json!({"role": "assistant", "content": ""});
    } else {
        v["response"] = json!("");
    }
    v
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::parse_keep_alive;

    #[test]
    fn keep_alive_takes_seconds_and_go_durations() {
        let d = |s: f64| Ok(Some(std::time::Duration::from_secs_f64(s)));
        assert_eq!(parse_keep_alive(&json!(300)), d(300.0));
        assert_eq!(parse_keep_alive(&json!("5m")), d(300.0));
        assert_eq!(parse_keep_alive(&json!("1h30m")), d(5400.0));
        assert_eq!(parse_keep_alive(&json!("1.5s")), d(1.5));
        assert_eq!(parse_keep_alive(&json!("300ms")), d(0.3));
        assert_eq!(parse_keep_alive(&json!("0")), d(0.0));
        assert_eq!(parse_keep_alive(&json!(0)), d(0.0));
        assert_eq!(parse_keep_alive(&json!("45")), d(45.0));
        assert_eq!(parse_keep_alive(&json!(-1)), Ok(None));
        assert_eq!(parse_keep_alive(&json!("-1m")), Ok(None));
        for bad in [
            json!("5 minutes"),
            json!("m"),
            json!(""),
            json!("1x"),
            json!(true),
            json!([]),
        ] {
            assert!(parse_keep_alive(&bad).is_err(), "{bad}");
        }
    }
}
