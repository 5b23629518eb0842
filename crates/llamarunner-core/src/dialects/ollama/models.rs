//! The served model as Ollama lists and shows it (`/api/tags`, `/api/ps`, `/api/show`), the
//! digest and entries a router's listings share, `/api/pull` on a server of one model and
//! `/api/version`.

use std::path::Path;
use std::time::{Duration, SystemTime};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::Value;

use super::wire::{Details, ModelDetails, ModelEntry, Models, PullStatus, Show, Version};
use crate::http::error::{ApiError, OllamaError};
use crate::http::state::AppState;
use crate::protocol::ModelInfo;
use crate::requests::common::{model_info, model_matches, parse_json, rfc3339};

/// The Ollama API version this dialect follows (what `/api/version` answers).
pub const OLLAMA_API_VERSION: &str = "0.12.0";

/// "268.10M", "8.0B": Ollama's way of writing a parameter count.
fn parameter_size(n: u64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.1}B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2}M", n / 1e6)
    } else {
        format!("{:.2}K", n / 1e3)
    }
}

fn details(info: &ModelInfo) -> Details {
    Details::Known(ModelDetails {
        parent_model: "",
        format: "gguf",
        family: info.architecture.clone(),
        families: [info.architecture.clone()],
        parameter_size: parameter_size(info.n_params),
        quantization_level: info.quantization.clone(),
    })
}

/// An identifier for a model file in Ollama's `sha256:` digest form. It is derived from the
/// path, size and modification time, not the file's contents (hashing gigabytes at every
/// start would be too slow), so it changes when the file does. The router's listings and an
/// engine's give a model the same one.
pub(crate) fn digest(path: &Path, size: u64, modified: SystemTime) -> String {
    use std::hash::{Hash, Hasher};
    let mut words = [0u64; 4];
    for (i, word) in words.iter_mut().enumerate() {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (i, path, size, modified).hash(&mut h);
        *word = h.finish();
    }
    words.iter().map(|w| format!("{w:016x}")).collect()
}

/// How long `/api/ps` says a model stays loaded when nothing unloads it: a far future, as
/// Ollama reports for `keep_alive: -1`.
pub(crate) const KEPT_LOADED: Duration = Duration::from_secs(100 * 365 * 86_400);

/// A model file as Ollama's `/api/tags` and `/api/ps` list it, on an engine and a router alike.
pub(crate) struct Listed<'a> {
    pub name: &'a str,
    pub path: &'a Path,
    pub size: u64,
    pub modified: SystemTime,
    /// `details`: the model's family, size and quantization where known.
    pub details: &'a Details,
}

impl<'a> Listed<'a> {
    /// `/api/tags`' entry.
    pub(crate) fn tags_entry(&self) -> ModelEntry<'a> {
        ModelEntry {
            name: self.name,
            model: self.name,
            size: self.size,
            modified_at: rfc3339(self.modified),
            digest: digest(self.path, self.size, self.modified),
            details: self.details,
            expires_at: None,
            size_vram: None,
            context_length: None,
        }
    }

    /// `/api/ps`' entry: a loaded model's, with its expiry and its bytes in device memory.
    pub(crate) fn ps_entry(&self, expires: SystemTime, size_vram: u64) -> ModelEntry<'a> {
        ModelEntry {
            expires_at: Some(rfc3339(expires)),
            size_vram: Some(size_vram),
            ..self.tags_entry()
        }
    }
}

/// The served model, as listed.
fn listed<'a>(state: &'a AppState, info: &'a ModelInfo, details: &'a Details) -> Listed<'a> {
    Listed {
        name: state.model_name.as_ref(),
        path: &info.path,
        size: info.file_size,
        modified: info.modified.unwrap_or(SystemTime::UNIX_EPOCH),
        details,
    }
}

/// `GET /api/tags`: the served model.
pub async fn tags(State(state): State<AppState>) -> Result<Response, OllamaError> {
    let info = model_info(&state)?;
    let details = details(&info);
    let entry = listed(&state, &info, &details).tags_entry();
    Ok(Json(Models {
        models: vec![entry],
    })
    .into_response())
}

/// `GET /api/ps`: the served model, always loaded.
pub async fn ps(State(state): State<AppState>) -> Result<Response, OllamaError> {
    let info = model_info(&state)?;
    let details = details(&info);
    // Loaded until the server stops.
    let expires = SystemTime::now() + KEPT_LOADED;
    let entry = ModelEntry {
        context_length: Some(info.slot_ctx),
        ..listed(&state, &info, &details).ps_entry(expires, info.devices.vram_bytes)
    };
    Ok(Json(Models {
        models: vec![entry],
    })
    .into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ShowRequest {
    model: Option<String>,
    name: Option<String>,
}

/// A GGUF metadata value as JSON: numbers as numbers, the rest as text.
fn metadata_value(text: &str) -> Value {
    if let Ok(i) = text.parse::<i64>() {
        return Value::from(i);
    }
    if let Ok(f) = text.parse::<f64>() {
        if f.is_finite() {
            return Value::from(f);
        }
    }
    match text {
        "true" => Value::Bool(true),
        "false" => Value::Bool(false),
        _ => Value::from(text),
    }
}

#[derive(Deserialize)]
struct PullRequest {
    model: Option<String>,
    name: Option<String>,
    stream: Option<bool>,
    #[allow(dead_code)]
    insecure: Option<bool>,
}

/// `POST /api/pull` on a server of one model: its own model is there already (`success`, as
/// Ollama answers for a model it holds); another is a 404 that says how to get it. A router
/// with `--allow-pull` pulls (`router/pull.rs`).
pub async fn pull(State(state): State<AppState>, body: Bytes) -> Result<Response, OllamaError> {
    let req: PullRequest = parse_json(&body)?;
    let name = req.model.as_deref().or(req.name.as_deref());
    match name {
        None | Some("") => return Err(ApiError::field("model", " is required").into()),
        Some(m) if !model_matches(&state, m) => {
            return Err(ApiError::ModelNotFound(format!(
                "model '{}' is not served here (this server serves '{}' only); fetch it with \
                 `llamarunner pull NAME`, or serve many models with --allow-pull",
                m.chars().take(200).collect::<String>(),
                state.model_name
            ))
            .into())
        }
        Some(_) => {}
    }
    let success = PullStatus { status: "success" };
    if req.stream.unwrap_or(true) {
        let Ok(line) = super::ndjson_line(success);
        return Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], line).into_response());
    }
    Ok(Json(success).into_response())
}

/// `POST /api/show`: details, metadata and the chat template of the served model.
pub async fn show(State(state): State<AppState>, body: Bytes) -> Result<Response, OllamaError> {
    let info = model_info(&state)?;
    let req: ShowRequest = parse_json(&body)?;
    super::required_model(&state, req.model.as_deref().or(req.name.as_deref()))?;
    let mut model_info: serde_json::Map<String, Value> = info
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), metadata_value(v)))
        .collect();
    model_info.insert("general.parameter_count".into(), Value::from(info.n_params));
    Ok(Json(Show {
        // The file name only: an absolute path tells a client about the server's file system.
        modelfile: format!(
            "# served by llamarunner\nFROM {}\n",
            info.path.file_name().map_or_else(
                || state.model_name.to_string(),
                |f| f.to_string_lossy().into_owned()
            )
        ),
        parameters: "",
        template: &info.template.source,
        details: details(&info),
        model_info,
        capabilities: ["completion"],
        modified_at: rfc3339(info.modified.unwrap_or(SystemTime::UNIX_EPOCH)),
    })
    .into_response())
}

/// `GET /api/version`.
pub async fn version() -> Response {
    Json(Version {
        version: OLLAMA_API_VERSION,
    })
    .into_response()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn parameter_sizes_read_like_ollama() {
        assert_eq!(parameter_size(268_098_176), "268.10M");
        assert_eq!(parameter_size(8_030_261_248), "8.0B");
    }

    #[test]
    fn metadata_values_keep_their_type() {
        assert_eq!(metadata_value("32768"), json!(32768));
        assert_eq!(metadata_value("1e-06"), json!(1e-6));
        assert_eq!(metadata_value("gemma3"), json!("gemma3"));
    }
}
