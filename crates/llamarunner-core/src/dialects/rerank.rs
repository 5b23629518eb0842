//! Reranking: `POST /v1/rerank` (and llama-server's aliases `/rerank`, `/reranking`,
//! `/v1/reranking`) by a reranker model (llama.cpp's rank pooling) or a generative model's
//! judgement (`requests/rerank.rs`). The request and answer are
//! Jina's and Cohere's shape as llama-server serves them (`query`, `documents`, `top_n` ->
//! `results` of `index` and `relevance_score`, best first), or Hugging Face TEI's when the body
//! names its documents `texts` (an array of `index` and `score`). Scores are the model's own
//! (a logit for BERT-style heads, a probability for Qwen3-style ones), not rescaled; a
//! generative model's are its probability of yes against no. The
//! answers are serde types (at the end of this file), their fields declared in the order they
//! are written; scores, `f32`s, are written as `f64`s as `json!` wrote them.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use crate::http::error::{ApiError, Dialect};
use crate::http::AppState;
use crate::requests::common::{embed_tokens, model_info, parse_json};
use crate::requests::rerank::{self, Reranker};

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
    let method = rerank::reranker(&info)?;
    if matches!(method, Reranker::Pooled(_)) && state.pooling != crate::config::Pooling::Auto {
        return Err(ApiError::invalid(
            "this server embeds with --pooling other than auto: a reranker's scores come from \
             its own rank pooling, which that flag replaces",
        ));
    }
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
    let (scores, tokens) = match method {
        Reranker::Pooled(_) => {
            let truncate = req.truncate.unwrap_or(false);
            let pairs = rerank::pairs(&info, query, documents, truncate).await?;
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
            (scores, tokens)
        }
        // A judgement that does not fit a slot is refused (`truncate` cuts a reranker's pair,
        // where the end of a document is what goes; here it would be the question).
        Reranker::Judge => rerank::judge(state, &info, &query, &documents).await?,
    };
    let order = rerank::ranked(&scores, top_n);
    if tei {
        let results: Vec<TeiResult> = order
            .iter()
            .map(|&i| TeiResult {
                index: i,
                score: f64::from(scores[i]),
                text: kept.get(i).map(String::as_str),
            })
            .collect();
        return Ok(Json(results).into_response());
    }
    let results: Vec<RankedResult> = order
        .iter()
        .map(|&i| RankedResult {
            index: i,
            relevance_score: f64::from(scores[i]),
            document: kept.get(i).map(|text| EchoedDocument { text }),
        })
        .collect();
    Ok(Json(Ranked {
        id: uuid::Uuid::new_v4().to_string(),
        model: state.model_name.as_ref(),
        object: "list",
        usage: Usage {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
        results,
    })
    .into_response())
}

/// One entry of TEI's answer (an array of them, best first).
#[derive(Debug, Serialize)]
struct TeiResult<'a> {
    /// The text's place in the request.
    index: usize,
    /// The model's score.
    score: f64,
    /// The text, when the request asked for it back (`return_text`).
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
}

/// Jina's and Cohere's answer.
#[derive(Debug, Serialize)]
struct Ranked<'a> {
    /// A UUID of the answer.
    id: String,
    /// The model's name as served.
    model: &'a str,
    /// Always `list`.
    object: &'static str,
    /// The tokens read.
    usage: Usage,
    /// The documents ranked, best first (`top_n` of them when given).
    results: Vec<RankedResult<'a>>,
}

/// The tokens a rerank read: every query and document pair's.
#[derive(Debug, Serialize)]
struct Usage {
    /// The pairs' tokens.
    prompt_tokens: usize,
    /// The same.
    total_tokens: usize,
}

/// One entry of `results`.
#[derive(Debug, Serialize)]
struct RankedResult<'a> {
    /// The document's place in the request.
    index: usize,
    /// The model's score.
    relevance_score: f64,
    /// The document, when the request asked for it back (`return_documents`).
    #[serde(skip_serializing_if = "Option::is_none")]
    document: Option<EchoedDocument<'a>>,
}

/// A document echoed in its result.
#[derive(Debug, Serialize)]
struct EchoedDocument<'a> {
    /// Its text.
    text: &'a str,
}
