//! Reranking inputs (`POST /v1/rerank`): each document paired with the query as the model was
//! trained to read them (`RerankFormat`, llama-server's layout), checked and fitted before the
//! queue. The engine embeds each pair with the model's rank pooling; the first value of the
//! pooled output is the document's relevance score.

use std::sync::Arc;

use crate::http::error::ApiError;
use crate::kv;
use crate::protocol::model::{ModelInfo, RerankFormat, TextModel};
use crate::protocol::{BackendError, Token};
use crate::requests::validate;

/// The model's reranking layout; a clear 400 for a model that is no reranker.
pub fn format_of(info: &ModelInfo) -> Result<&RerankFormat, ApiError> {
    info.rerank.as_ref().ok_or_else(|| {
        // The model is named by its architecture only: its file path is the server's own.
        ApiError::invalid(format!(
            "this model is not a reranker: reranking needs a model whose pooling is rank (a \
             GGUF with {}.pooling_type = 4, such as bge-reranker or Qwen3-Reranker)",
            info.architecture
        ))
    })
}

/// One query-document pair as tokens: the model's `rerank` template with `{query}` and
/// `{document}` replaced (special tokens in the template parsed, none added), else
/// `[BOS] query [EOS] [SEP] document [EOS]` with the query and document tokenized as text.
pub fn pair_tokens(
    model: &dyn TextModel,
    format: &RerankFormat,
    query: &str,
    document: &str,
) -> Result<Vec<Token>, BackendError> {
    if let Some(template) = &format.template {
        let prompt = template
            .replace("{query}", query)
            .replace("{document}", document);
        return model.tokenize_with(&prompt, false);
    }
    let mut tokens = Vec::new();
    tokens.extend(format.bos);
    tokens.extend(model.tokenize_literal(query)?);
    tokens.extend(format.eos);
    tokens.extend(format.sep);
    tokens.extend(model.tokenize_literal(document)?);
    tokens.extend(format.eos);
    Ok(tokens)
}

/// Every document's pair, tokenized on the blocking pool and fitted into the embedding
/// context: each pair's text is bounded as any prompt's is, an empty pair is refused, and a
/// pair longer than a slot is cut at its end when `truncate`, refused otherwise. Also whether
/// each was cut.
pub async fn pairs(
    info: &Arc<ModelInfo>,
    query: String,
    documents: Vec<String>,
    truncate: bool,
) -> Result<Vec<(Vec<Token>, bool)>, ApiError> {
    let format = format_of(info)?.clone();
    if documents.is_empty() {
        return Err(ApiError::field("documents", " must be a non-empty array"));
    }
    if documents.len() > validate::MAX_EMBED_INPUTS {
        return Err(ApiError::invalid(format!(
            "at most {} documents per request, got {}",
            validate::MAX_EMBED_INPUTS,
            documents.len()
        )));
    }
    let max = validate::max_text_bytes(info);
    for (i, doc) in documents.iter().enumerate() {
        let bytes = query.len().saturating_add(doc.len());
        if bytes > max {
            return Err(ApiError::ContextLength(format!(
                "the input length exceeds the context length: the query and document {i} have \
                 {bytes} bytes of text, at most {max} are read for a slot of {} tokens (raise \
                 --ctx-size)",
                info.embed_ctx
            )));
        }
    }
    let model = info.text.clone();
    let tokenized = validate::blocking(move || {
        documents
            .iter()
            .map(|doc| pair_tokens(model.as_ref(), &format, &query, doc))
            .collect::<Result<Vec<_>, _>>()
    })
    .await?
    .map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
    let mut out = Vec::with_capacity(tokenized.len());
    for (i, mut tokens) in tokenized.into_iter().enumerate() {
        if tokens.is_empty() {
            return Err(ApiError::invalid(format!(
                "the query and document {i} have no tokens"
            )));
        }
        let cut = kv::fit_input(&mut tokens, truncate, info.embed_ctx)?;
        out.push((tokens, cut));
    }
    Ok(out)
}

/// Result indices ordered by score, best first (a NaN score last), ties in input order;
/// at most `top_n`.
pub fn ranked(scores: &[f32], top_n: Option<usize>) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    let key = |i: usize| {
        let s = scores[i];
        if s.is_nan() {
            f32::NEG_INFINITY
        } else {
            s
        }
    };
    order.sort_by(|&a, &b| key(b).total_cmp(&key(a)));
    order.truncate(top_n.unwrap_or(scores.len()));
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fake::{FakeText, BOS, EOS};

    #[test]
    fn pairs_take_the_markers_the_vocabulary_adds() {
        let format = RerankFormat {
            template: None,
            bos: Some(BOS),
            eos: Some(EOS),
            sep: Some(7),
        };
        let tokens = pair_tokens(&FakeText, &format, "ab", "c").unwrap();
        assert_eq!(tokens, vec![BOS, 97, 98, EOS, 7, 99, EOS]);
        let bare = RerankFormat::default();
        assert_eq!(
            pair_tokens(&FakeText, &bare, "ab", "c").unwrap(),
            vec![97, 98, 99]
        );
    }

    #[test]
    fn a_template_replaces_both_placeholders_and_adds_nothing() {
        let format = RerankFormat {
            template: Some("q={query};d={document};q={query}".into()),
            bos: Some(BOS),
            ..RerankFormat::default()
        };
        let tokens = pair_tokens(&FakeText, &format, "x", "y").unwrap();
        assert_eq!(
            tokens,
            "q=x;d=y;q=x".bytes().map(Token::from).collect::<Vec<_>>()
        );
    }

    #[test]
    fn ranking_is_by_score_then_input_order_and_nan_last() {
        assert_eq!(ranked(&[0.1, 0.9, 0.5], None), vec![1, 2, 0]);
        assert_eq!(ranked(&[0.5, 0.5, 0.7], Some(2)), vec![2, 0]);
        assert_eq!(ranked(&[f32::NAN, 0.1, -3.0], None), vec![1, 2, 0]);
        assert_eq!(ranked(&[1.0], Some(5)), vec![0]);
        assert!(ranked(&[], None).is_empty());
    }

    #[test]
    fn a_model_without_rank_pooling_is_refused() {
        let info = crate::backend::fake::model_info(64);
        let err = format_of(&info).unwrap_err();
        assert_eq!(err.kind(), "invalid_request");
        assert!(err.to_string().contains("not a reranker"), "{err}");
    }
}
