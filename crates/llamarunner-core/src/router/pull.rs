//! `POST /api/pull` (Ollama's): a model the router serves answers `success` at once; on a
//! router started with `--allow-pull`, any other name is fetched by the pull command (`python
//! -m llamarunner._pull NAME`: the model resolver, `llamarunner.sources`), whose progress
//! lines, in Ollama's format, stream to the client; the model it fetched then joins the
//! registry and loads on its first request. A request of another route that names a model
//! not served yet pulls it first, the same way (`fetch`). One pull runs at a time; a client
//! that leaves stops its pull. `GET /models` lists each pull running with its progress.
//! `DELETE /api/delete` (same routers) removes a model the pull command fetched into the
//! Hugging Face cache, and stops serving it; never a model of Ollama's store or a file.

use std::process::Stdio;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;

use super::registry::Registry;
use super::ModelSpec;
use crate::http::error::{ApiError, OllamaError};

/// The longest line a pull command may write (its progress lines are ~150 bytes; the last
/// holds the model's configuration, with a system prompt of up to 1 MiB escaped).
const MAX_LINE: usize = 16 << 20;

/// How a router pulls models (`--allow-pull`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PullConfig {
    /// The program and its arguments; the model's name is added last.
    pub command: Vec<String>,
    /// What the command reads on its standard input: the settings a pulled model is served
    /// with (the router's own, as JSON).
    pub input: String,
}

/// One pull at a time: two pulls would race for the disk the first one checked.
static PULLING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

/// One line of the pull's stream, as Ollama's other streams write theirs (U+2028 and the
/// like escaped: a client name echoed in an error cannot split the line).
fn ndjson(v: &Value) -> Bytes {
    let Ok(line) = crate::dialects::ollama::ndjson_line(v.clone());
    line
}

/// The name a pull body gives (`model`, or `name` as Ollama's older clients say).
fn requested_name(body: &Bytes) -> Result<(String, bool), ApiError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    let name = v
        .get("model")
        .or_else(|| v.get("name"))
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty() && n.len() <= 256 && !n.chars().any(char::is_control))
        .ok_or_else(|| ApiError::invalid("give the model to pull as {\"model\": NAME}"))?;
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(true);
    Ok((name.to_string(), stream))
}

/// `POST /api/pull`.
pub async fn handler(State(registry): State<Arc<Registry>>, body: Bytes) -> Response {
    let (name, stream) = match requested_name(&body) {
        Ok(x) => x,
        Err(e) => return OllamaError(e).into_response(),
    };
    if registry.find(Some(&name)).is_ok() {
        return finished(stream, vec![json!({"status": "success"})]);
    }
    let Some(config) = registry.pull_config().cloned() else {
        return OllamaError(ApiError::ModelNotFound(format!(
            "model '{name}' is not served here and this server does not pull models: fetch it \
             with `llamarunner pull {name}` and serve it, or start the server with --allow-pull"
        )))
        .into_response();
    };
    let (tx, rx) = mpsc::channel::<Value>(64);
    tokio::spawn(run(registry, config, name, tx));
    if stream {
        let lines = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|v| (Ok::<_, std::convert::Infallible>(ndjson(&v)), rx))
        });
        return (
            [(header::CONTENT_TYPE, "application/x-ndjson")],
            Body::from_stream(lines),
        )
            .into_response();
    }
    let mut rx = rx;
    let mut lines = Vec::new();
    while let Some(v) = rx.recv().await {
        lines.push(v);
    }
    finished(false, lines)
}

/// The answer of a pull that has ended: its lines streamed, or its last line alone (an error
/// line with the status Ollama gives it).
fn finished(stream: bool, lines: Vec<Value>) -> Response {
    if stream {
        let body: Vec<u8> = lines.iter().flat_map(|v| ndjson(v).to_vec()).collect();
        return ([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response();
    }
    let last = lines
        .last()
        .cloned()
        .unwrap_or_else(|| json!({"error": "the pull said nothing"}));
    let status = if last.get("error").is_some() {
        match last.get("type").and_then(Value::as_str) {
            Some("not_found" | "no_file" | "offline" | "bad_name") => StatusCode::NOT_FOUND,
            Some("unauthorized") => StatusCode::UNAUTHORIZED,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    } else {
        StatusCode::OK
    };
    (status, Json(last)).into_response()
}

/// `DELETE /api/delete` (Ollama's; `POST` too) on a router with `--allow-pull`: the model
/// is unloaded (refused while a request runs on it), its files removed from the Hugging Face
/// cache by the pull command (`--delete`), and it is no longer served.
pub async fn delete(State(registry): State<Arc<Registry>>, body: Bytes) -> Response {
    let (name, _) = match requested_name(&body) {
        Ok(x) => x,
        Err(e) => return OllamaError(e).into_response(),
    };
    let Some(config) = registry.pull_config().cloned() else {
        return OllamaError(ApiError::NotFound(
            "this server does not delete models (start it with --allow-pull)".into(),
        ))
        .into_response();
    };
    let model = match registry.find(Some(&name)) {
        Ok(m) => m,
        Err(e) => return OllamaError(e).into_response(),
    };
    if !registry.remove(&model) {
        return OllamaError(ApiError::Overloaded(format!(
            "model '{}' is running requests; delete it once they end",
            model.name
        )))
        .into_response();
    }
    let Some((program, args)) = config.command.split_first() else {
        return OllamaError(ApiError::Internal("no pull command".into())).into_response();
    };
    let output = tokio::process::Command::new(program)
        .args(args)
        .arg("--delete")
        .arg(&model.name)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .output()
        .await;
    let last: Value = match &output {
        Ok(o) => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .next_back()
            .unwrap_or_else(|| json!({"error": "the delete said nothing"})),
        Err(e) => json!({"error": format!("the delete command did not start: {e}")}),
    };
    if let Some(error) = last.get("error").and_then(Value::as_str) {
        // Not ours to delete (Ollama's store, a file): it stays served.
        registry.add(&model.spec_of());
        let e = match last.get("type").and_then(Value::as_str) {
            Some("not_ours" | "not_found") => ApiError::invalid(error.to_string()),
            _ => ApiError::Internal(error.to_string()),
        };
        return OllamaError(e).into_response();
    }
    tracing::info!(model = %model.name, "deleted");
    StatusCode::OK.into_response()
}

/// Pulls `name` without streaming (a request that names a model not served yet, on a router
/// with `--allow-pull`): the model once it is in the registry, or the pull's error.
pub async fn fetch(
    registry: &Arc<Registry>,
    name: &str,
) -> Result<Arc<super::registry::Model>, ApiError> {
    let Some(config) = registry.pull_config().cloned() else {
        return registry.find(Some(name));
    };
    let (tx, mut rx) = mpsc::channel::<Value>(64);
    tokio::spawn(run(registry.clone(), config, name.to_string(), tx));
    let mut last = None;
    while let Some(v) = rx.recv().await {
        last = Some(v);
    }
    match last {
        Some(v) if v.get("error").is_some() => {
            let error = v["error"].as_str().unwrap_or("the pull failed").to_string();
            Err(match v.get("type").and_then(Value::as_str) {
                Some("not_found" | "no_file" | "offline" | "bad_name") => {
                    ApiError::ModelNotFound(error)
                }
                _ => ApiError::LoadFailed(error),
            })
        }
        _ => registry.find(Some(name)),
    }
}

/// Runs the pull command for `name`, sending its lines to `tx` (the spec line as `success`,
/// once the model is in the registry). Stops the command when the client has left.
async fn run(registry: Arc<Registry>, config: PullConfig, name: String, tx: mpsc::Sender<Value>) {
    let Ok(_turn) = PULLING.acquire().await else {
        return;
    };
    if registry.find(Some(&name)).is_ok() {
        let _ = tx.send(json!({"status": "success"})).await;
        return;
    }
    let fail = |error: String| json!({"error": error, "type": "pull_failed"});
    let Some((program, args)) = config.command.split_first() else {
        let _ = tx.send(fail("no pull command".into())).await;
        return;
    };
    let child = tokio::process::Command::new(program)
        .args(args)
        .arg(&name)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            let _ = tx
                .send(fail(format!("the pull command did not start: {e}")))
                .await;
            return;
        }
    };
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(config.input.as_bytes()).await;
    }
    let Some(stdout) = child.stdout.take() else {
        return;
    };
    let mut lines = BufReader::new(stdout).take(64 << 20).lines();
    let mut ended = false;
    loop {
        let line = tokio::select! {
            line = lines.next_line() => line,
            () = tx.closed() => {
                // The client left: dropping the child kills it.
                registry.pull_progress(&name, None);
                return;
            }
        };
        let Ok(Some(line)) = line else { break };
        if line.len() > MAX_LINE {
            break;
        }
        let Ok(mut v) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if let Some(spec) = v.get_mut("spec").map(Value::take) {
            let added = serde_json::from_value::<ModelSpec>(spec)
                .map_err(|e| e.to_string())
                .and_then(|spec| {
                    super::validate_spec(&spec)
                        .map(|()| spec)
                        .map_err(|e| e.to_string())
                });
            v = match added {
                Ok(spec) => {
                    let model = registry.add(&spec);
                    registry.alias(&name, &model);
                    tracing::info!(model = %model.name, asked = %name, path = %spec.path, "pulled");
                    json!({"status": "success"})
                }
                Err(e) => fail(format!("the pulled model cannot be served: {e}")),
            };
            ended = true;
        } else if v.get("error").is_some() {
            ended = true;
        }
        registry.pull_progress(&name, (!ended).then_some(&v));
        if tx.send(v).await.is_err() {
            registry.pull_progress(&name, None);
            return;
        }
        if ended {
            break;
        }
    }
    if !ended {
        // Stopped reading (an unreadable or overlong line): the child must not block on a
        // full pipe.
        let _ = child.start_kill();
    }
    registry.pull_progress(&name, None);
    let status = child.wait().await;
    if !ended {
        let why = status.map_or_else(|e| e.to_string(), |s| s.to_string());
        let _ = tx.send(fail(format!("the pull stopped ({why})"))).await;
    }
}
