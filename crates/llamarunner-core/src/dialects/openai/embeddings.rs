//! `POST /v1/embeddings`: its body, the inputs it takes (text, token ids or a mix), its routing
//! key, and the vectors as floats or base64 (the answer's wire types are in `wire.rs`).

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::Value;

use super::wire::{Embedding, EmbeddingUsage, Embeddings, Vector};

use crate::http::error::{ApiError, OpenAiError};
use crate::http::state::AppState;
use crate::requests::common::{
    check_dimensions, embed_inputs, l2_normalize, model_info, parse_json, EmbedInput,
};
use crate::requests::keyed::Keyed;

/// OpenAI's `input` to embed: a string, an array of token ids (one input), or an array whose
/// items are strings or arrays of token ids (llama-server takes the mix too).
pub(super) fn embedding_inputs(input: Option<Value>) -> Result<Vec<EmbedInput>, ApiError> {
    let ids = |items: &[Value]| -> Option<Vec<i64>> { items.iter().map(Value::as_i64).collect() };
    let shape = "input must be a string, an array of token ids, or an array of strings and token \
                 id arrays";
    match input {
        Some(Value::String(s)) => Ok(vec![EmbedInput::Text(s)]),
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_number) => {
            Ok(vec![EmbedInput::Tokens(ids(&items).ok_or_else(|| {
                ApiError::field("input", ": token ids must be integers")
            })?)])
        }
        Some(Value::Array(items)) if !items.is_empty() => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(EmbedInput::Text(s)),
                Value::Array(a) => ids(&a).map(EmbedInput::Tokens).ok_or_else(|| {
                    ApiError::invalid(format!("input[{i}]: token ids must be integers"))
                }),
                _ => Err(ApiError::invalid(format!("input[{i}]: {shape}"))),
            })
            .collect(),
        _ => Err(ApiError::field("input", format!(" is required: {shape}"))),
    }
}

/// Body of `POST /v1/embeddings`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct EmbeddingsRequest {
    model: Option<String>,
    input: Option<Value>,
    encoding_format: Option<String>,
    dimensions: Option<u32>,
}

/// `/v1/embeddings` as `routing_key` reads it: as `embeddings` does.
pub(crate) fn embeddings_keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let req: EmbeddingsRequest = parse_json(body)?;
    // Token ids as the comma list the key writes them as (a token prefix is a text prefix).
    let inputs = embedding_inputs(req.input)?
        .into_iter()
        .map(|input| match input {
            EmbedInput::Text(text) => text,
            EmbedInput::Tokens(ids) => ids.iter().map(|id| format!("{id},")).collect(),
        })
        .collect();
    Ok(Keyed::texts(req.model, inputs))
}

/// `POST /v1/embeddings`: L2-normalized vectors, as floats or base64 (the `openai` client asks
/// for base64 by default).
pub async fn embeddings(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let info = model_info(&state)?;
    let req: EmbeddingsRequest = parse_json(&body)?;
    let inputs = embedding_inputs(req.input)?;
    check_dimensions(&info, req.dimensions)?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::field(
                "encoding_format",
                format!(" must be float or base64, got {other:?}"),
            )
            .into())
        }
    };
    let embeddings = embed_inputs(&state, inputs, false).await?;
    let tokens: usize = embeddings.iter().map(|e| e.prompt_eval_count).sum();
    let data = embeddings
        .into_iter()
        .enumerate()
        .map(|(index, e)| {
            let v = l2_normalize(e.vector);
            let embedding = if base64 {
                Vector::Base64(base64_f32(&v))
            } else {
                Vector::Floats(v)
            };
            Embedding {
                object: "embedding",
                index,
                embedding,
            }
        })
        .collect();
    Ok(Json(Embeddings {
        object: "list",
        data,
        model: state.model_name.as_ref(),
        usage: EmbeddingUsage {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
    })
    .into_response())
}

/// Little-endian f32s, base64-encoded (standard alphabet, padded).
pub(super) fn base64_f32(v: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> shift) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}
