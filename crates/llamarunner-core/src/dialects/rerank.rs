//! Reranking: `POST /v1/rerank` (and llama-server's aliases `/rerank`, `/reranking`,
//! `/v1/reranking`) for reranker models (llama.cpp's rank pooling). The request and answer are
//! Jina's and Cohere's shape as llama-server serves them (`query`, `documents`, `top_n` ->
//! `results` of `index` and `relevance_score`, best first), or Hugging Face TEI's when the body
//! names its documents `texts` (an array of `index` and `score`). Scores are the model's own
//! (a logit for BERT-style heads, a probability for Qwen3-style ones), not rescaled.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::http::error::{ApiError, Dialect};
use crate::http::AppState;
use crate::requests::common::{embed_tokens, model_info, parse_json};
use crate::requests::rerank;

/// A document as clients send it: a string, or (Jina, Cohere v1) an object with `text`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Document {
    Text(String),
    Object { text: String },
}

impl Document {
    fn into_text(self) -> String {
        match self {
            Document::Text(text) | Document::Object { text } => text,
        }
    }
}

/// Body of `POST /v1/rerank`. Unknown fields (Cohere's `max_tokens_per_doc`, Jina's
/// `return_embeddings`...) are ignored.
#[derive(Debug, Deserialize)]
struct RerankRequest {
    #[serde(default)]
    query: Option<String>,
    #[serde(default)]
    documents: Option<Vec<Document>>,
    /// TEI's name for the documents; its presence selects TEI's answer.
    #[serde(default)]
    texts: Option<Vec<String>>,
    #[serde(default)]
    top_n: Option<i64>,
    /// Jina and Cohere: echo each document in its result.
    #[serde(default)]
    return_documents: Option<bool>,
    /// TEI: echo each text in its result.
    #[serde(default)]
    return_text: Option<bool>,
    /// Cut a pair longer than a slot at its end instead of refusing it (TEI's and Jina's
    /// `truncate`); off by default.
    #[serde(default)]
    truncate: Option<bool>,
}

/// `POST /v1/rerank`; errors in the shape of the path's dialect (OpenAI's under `/v1/`,
/// the native one on llama-server's bare paths).
pub async fn rerank(State(state): State<AppState>, uri: Uri, body: Bytes) -> Response {
    match ranked(&state, &body).await {
        Ok(answer) => answer,
        Err(e) => Dialect::of_path(uri.path()).respond(e),
    }
}

async fn ranked(state: &AppState, body: &Bytes) -> Result<Response, ApiError> {
    let info = model_info(state)?;
    let req: RerankRequest = parse_json(body)?;
    rerank::format_of(&info)?;
    let query = req
        .query
        .ok_or_else(|| ApiError::field("query", " is required: a string"))?;
    let tei = req.texts.is_some();
    let documents: Vec<String> = match (req.documents, req.texts) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "give the documents as documents or as texts, not both",
            ))
        }
        (Some(docs), None) => docs.into_iter().map(Document::into_text).collect(),
        (None, Some(texts)) => texts,
        (None, None) => {
            return Err(ApiError::field(
                "documents",
                " is required: a non-empty array of strings",
            ))
        }
    };
    let top_n = match req.top_n {
        None => None,
        Some(n) if n >= 1 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        Some(n) => {
            return Err(ApiError::field(
                "top_n",
                format!(" must be a positive integer, got {n}"),
            ))
        }
    };
    // The texts are kept for the answer only when it echoes them.
    let echo = if tei {
        req.return_text.unwrap_or(false)
    } else {
        req.return_documents.unwrap_or(false)
    };
    let kept = if echo { documents.clone() } else { Vec::new() };
    let pairs = rerank::pairs(&info, query, documents, req.truncate.unwrap_or(false)).await?;
    let embedded = embed_tokens(state, pairs).await?;
    let tokens: usize = embedded.iter().map(|e| e.prompt_eval_count).sum();
    let scores = embedded
        .iter()
        .map(|e| {
            e.vector
                .first()
                .copied()
                .ok_or_else(|| ApiError::Internal("the reranker gave no score".into()))
        })
        .collect::<Result<Vec<f32>, _>>()?;
    let order = rerank::ranked(&scores, top_n);
    if tei {
        let results: Vec<Value> = order
            .iter()
            .map(|&i| {
                let mut r = json!({"index": i, "score": scores[i]});
                if let Some(text) = kept.get(i) {
                    r["text"] = json!(text);
                }
                r
            })
            .collect();
        return Ok(Json(Value::Array(results)).into_response());
    }
    let results: Vec<Value> = order
        .iter()
        .map(|&i| {
            let mut r = json!({"index": i, "relevance_score": scores[i]});
            if let Some(text) = kept.get(i) {
                r["document"] = json!({"text": text});
            }
            r
        })
        .collect();
    Ok(Json(json!({
        "id": uuid::Uuid::new_v4().to_string(),
        "model": state.model_name.as_ref(),
        "object": "list",
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }))
    .into_response())
}
