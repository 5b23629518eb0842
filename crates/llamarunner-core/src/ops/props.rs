//! What the server is and how it is doing: `GET /health` (load state and busy slots) and
//! `GET /props` (the model, its context, slots, template, build).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::http::error::ApiError;
use crate::http::AppState;
use crate::protocol::params::SamplingParams;
use crate::protocol::{LoadState, Token, LLAMA_CPP_2_VERSION};
use crate::requests::common::model_info;

/// `GET /health`: 200 when ready, 503 while loading, 500 when the model failed to load.
pub async fn health(State(state): State<AppState>) -> Response {
    let h = &state.engine.health;
    let load = h.state();
    let (busy, total) = h.slots();
    let mut body = json!({
        "status": load.as_str(),
        "progress": h.progress(),
        "slots_idle": total.saturating_sub(busy),
        "slots_processing": busy,
    });
    if let Some(e) = h.error() {
        body["error"] = json!(e);
    }
    let status = match load {
        LoadState::Ready => StatusCode::OK,
        LoadState::Loading => StatusCode::SERVICE_UNAVAILABLE,
        LoadState::Error => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, Json(body)).into_response()
}

/// `GET /props`: what this server serves and how (llama-server's key names where it has
/// them): the model, context per slot, slots, chat template, BOS/EOS, build.
pub async fn props(State(state): State<AppState>) -> Result<Response, ApiError> {
    let info = model_info(&state)?;
    let (_, total) = state.engine.health.slots();
    let special = |token: Option<Token>| {
        token.map(|t| String::from_utf8_lossy(&info.text.piece(t)).into_owned())
    };
    let file = info
        .path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned());
    let version = env!("CARGO_PKG_VERSION");
    Ok(Json(json!({
        "model_alias": state.model_name.as_ref(),
        // The file's name only: an absolute path tells clients about the server's disk.
        "model_path": file,
        "total_slots": total,
        "n_ctx": info.slot_ctx,
        // A shared cache (`--kv-unified`) is all there is; else each slot has its own.
        "n_ctx_total": info
            .shared_cells
            .unwrap_or_else(|| info.slot_ctx.saturating_mul(total as usize)),
        // As llama-server's: the context per slot and the sampling a request gets for the
        // fields it leaves out (llama-server's format's defaults, with `--temp`, `--top-k`,
        // `--top-p`, `--min-p` and `--seed` where the server sets them; seed -1: a random seed
        // per request).
        "default_generation_settings": {
            "n_ctx": info.slot_ctx,
            "params": default_params(&state),
        },
        "chat_template": info.template.source,
        "chat_template_name": info.template.name,
        "bos_token": special(info.bos),
        "bos_token_id": info.bos,
        "eos_token": special(info.eos),
        "eos_token_id": info.eos,
        "model": {
            "architecture": info.architecture,
            "quantization": info.quantization,
            "n_params": info.n_params,
            "n_vocab": info.n_vocab,
            "n_ctx_train": info.n_ctx_train,
            "n_embd": info.n_embd,
            "n_layer": info.n_layer,
            "size": info.file_size,
        },
        "slot_save": state.slot_save_path.is_some(),
        // `--deterministic`: every request's output depends on the request alone (each
        // answer says so in its `Llamarunner-Deterministic` header).
        "deterministic": info.deterministic,
        // As llama-server: whether requests may carry images (`--mmproj`) or audio (never).
        "modalities": {"vision": info.vision.is_some(), "audio": false},
        "build_info": format!("llamarunner {version} (llama-cpp-2 {LLAMA_CPP_2_VERSION})"),
        "version": version,
        "llama_cpp_2_version": LLAMA_CPP_2_VERSION,
        "system_info": info.system_info,
        // Where the model runs: every device llama.cpp found, the backend of the offloaded
        // layers and how many went there.
        "devices": info.devices,
    }))
    .into_response())
}

/// The sampling defaults of a llama-server-format request, under llama-server's names.
fn default_params(state: &AppState) -> crate::dialects::llama_server::Settings {
    let mut params = SamplingParams {
        seed: state.default_seed,
        ..crate::dialects::llama_server::default_params()
    };
    state.sampling_defaults.fill(&mut params, |_| false);
    crate::dialects::llama_server::Settings::from(&params)
}
