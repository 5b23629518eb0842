//! Reranking inputs (`POST /v1/rerank`), checked and fitted before the queue, by the model's
//! kind (`Reranker`):
//!
//! - a reranker (llama.cpp's rank pooling) embeds each document paired with the query as it
//!   was trained to read them (`RerankFormat`, llama-server's layout); the first value of the
//!   pooled output is the document's relevance score;
//! - a generative model is asked, through its chat template, whether the document meets the
//!   query (Qwen3-Reranker's prompt, which any instruction-tuned model can follow): the score
//!   is its probability of answering yes rather than no, read from its logits at the answer
//!   (`judge_score`). llama-server, given a generative model with `--reranking`, scores the
//!   hidden state of the pair's first token, which is no relevance.
//!
//! An embedding model (a GGUF that names its pooling, other than rank) cannot judge: refused.

use std::sync::Arc;

use futures_util::{StreamExt, TryStreamExt};

use crate::chat::ChatMessage;
use crate::http::error::ApiError;
use crate::http::AppState;
use crate::kv;
use crate::protocol::model::{ModelInfo, RerankFormat, TextModel};
use crate::protocol::params::SamplingParams;
use crate::protocol::{BackendError, Token, TopLogprob};
use crate::requests::common::{collect, render_chat, start_generation, PromptSource};
use crate::requests::thinking::TemplateArgs;
use crate::requests::validate;

/// How the served model scores a document.
#[derive(Debug, PartialEq, Eq)]
pub enum Reranker<'a> {
    /// A reranker: its rank pooling over the pair.
    Pooled(&'a RerankFormat),
    /// A generative model: its yes against its no when asked.
    Judge,
}

/// How `info`'s model reranks; a clear 400 for an embedding model, which can do neither.
pub fn reranker(info: &ModelInfo) -> Result<Reranker<'_>, ApiError> {
    if let Some(format) = &info.rerank {
        return Ok(Reranker::Pooled(format));
    }
    let pooling_key = format!("{}.pooling_type", info.architecture);
    if info.metadata.iter().any(|(key, _)| *key == pooling_key) {
        // The model is named by its architecture only: its file path is the server's own.
        return Err(ApiError::invalid(format!(
            "this model ({}) is an embedding model: reranking needs a reranker (a GGUF whose \
             pooling is rank, such as bge-reranker or Qwen3-Reranker) or a generative model",
            info.architecture
        )));
    }
    Ok(Reranker::Judge)
}

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

/// What a generative model is told when it judges (Qwen3-Reranker's system prompt).
const JUDGE_SYSTEM: &str = "Judge whether the Document meets the requirements based on the \
    Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".";

/// The task it judges for (Qwen3-Reranker's default instruction).
const JUDGE_INSTRUCT: &str =
    "Given a web search query, retrieve relevant passages that answer the query";

/// The conversation that asks whether `document` meets `query`.
pub fn judge_messages(query: &str, document: &str) -> Vec<ChatMessage> {
    let message = |role: &str, content: String| ChatMessage {
        role: role.into(),
        content,
        ..ChatMessage::default()
    };
    vec![
        message("system", JUDGE_SYSTEM.into()),
        message(
            "user",
            format!("<Instruct>: {JUDGE_INSTRUCT}\n<Query>: {query}\n<Document>: {document}"),
        ),
    ]
}

/// The spellings of the two answers whose first tokens are read.
const YES: [&str; 4] = ["yes", "Yes", " yes", " Yes"];
const NO: [&str; 4] = ["no", "No", " no", " No"];

/// The token that begins each spelling of yes and of no (each list without repeats; a token
/// that begins both is in neither). A tokenizer that opens all text alike (SentencePiece's
/// space marker, as bytes where the vocabulary lacks it) opens every spelling with the same
/// tokens: those are skipped, and the first token that tells the spellings apart is read.
pub fn answer_tokens(model: &dyn TextModel) -> Result<(Vec<Token>, Vec<Token>), BackendError> {
    let spelled = |words: &[&str]| -> Result<Vec<Vec<Token>>, BackendError> {
        words.iter().map(|w| model.tokenize_literal(w)).collect()
    };
    let (yes_tokens, no_tokens) = (spelled(&YES)?, spelled(&NO)?);
    let all: Vec<&Vec<Token>> = yes_tokens.iter().chain(&no_tokens).collect();
    let shortest = all.iter().map(|t| t.len()).min().unwrap_or(0);
    let common = (0..shortest)
        .take_while(|&i| all.iter().all(|t| t[i] == all[0][i]))
        .count();
    let firsts = |spellings: &[Vec<Token>]| -> Vec<Token> {
        let mut out = Vec::new();
        for t in spellings.iter().filter_map(|t| t.get(common)) {
            if !out.contains(t) {
                out.push(*t);
            }
        }
        out
    };
    let (mut yes, mut no) = (firsts(&yes_tokens), firsts(&no_tokens));
    let both: Vec<Token> = yes.iter().copied().filter(|t| no.contains(t)).collect();
    yes.retain(|t| !both.contains(t));
    no.retain(|t| !both.contains(t));
    Ok((yes, no))
}

/// The probability of yes against no, from the answer position's log-probabilities of the
/// `asked` tokens: P(yes) / (P(yes) + P(no)), each summed over its spellings. 0.5 when the
/// model gives neither any probability.
pub fn judge_score(asked: &[TopLogprob], yes: &[Token], no: &[Token]) -> f32 {
    let log_sum = |tokens: &[Token]| -> f64 {
        let lps: Vec<f64> = asked
            .iter()
            .filter(|a| tokens.contains(&a.token))
            .map(|a| f64::from(a.logprob))
            .collect();
        let max = lps.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if max == f64::NEG_INFINITY {
            return max;
        }
        max + lps.iter().map(|l| (l - max).exp()).sum::<f64>().ln()
    };
    let (y, n) = (log_sum(yes), log_sum(no));
    match (y.is_finite(), n.is_finite()) {
        (false, false) => 0.5,
        (true, false) => 1.0,
        (false, true) => 0.0,
        // sigmoid(y - n), written so that neither side overflows.
        (true, true) => (1.0 / (1.0 + (n - y).exp())) as f32,
    }
}

/// Scores each document by the generative model's judgement (`judge_messages`), as many at
/// once as the server has slots, in the documents' order; also the prompt tokens read. Each
/// judgement is a one-token generation (greedy, its end-of-generation tokens banned so that
/// it always answers), queued and bounded as any request is. Every judgement's prompt is
/// rendered, tokenized and checked against the slot before the first is queued, so that a
/// document too long is refused before any work is done.
pub async fn judge(
    state: &AppState,
    info: &Arc<ModelInfo>,
    query: &str,
    documents: &[String],
) -> Result<(Vec<f32>, usize), ApiError> {
    check_documents(documents.len())?;
    let model = info.text.clone();
    let (yes, no) = validate::blocking(move || answer_tokens(model.as_ref()))
        .await?
        .map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
    let params = SamplingParams {
        num_predict: 1,
        temperature: 0.0,
        ignore_eos: true,
        truncate: false,
        shift: false,
        logprobs: Some(0),
        logprobs_of: yes.iter().chain(&no).copied().collect(),
        ..SamplingParams::default()
    };
    let mut prompts = Vec::with_capacity(documents.len());
    for document in documents {
        let messages = judge_messages(query, document);
        let think = TemplateArgs::from(Some(false));
        let prompt = render_chat(state, messages, true, think).await?;
        let valid =
            validate::generation(info, &state.limits, prompt, Vec::new(), params.clone()).await?;
        prompts.push(valid.tokens);
    }
    let answers = Arc::new((yes, no));
    let (_, slots) = state.engine.health.slots();
    let at_once = usize::try_from(slots).unwrap_or(1).max(1);
    // Each judgement owns what it reads (a stream of futures that borrow is not `Send` for
    // every lifetime axum's handlers need).
    let judgements: Vec<_> = prompts
        .into_iter()
        .map(|tokens| {
            let (state, answers, params) = (state.clone(), answers.clone(), params.clone());
            async move {
                let prompt = PromptSource::Tokens(tokens);
                let answer = collect(start_generation(&state, prompt, params).await?).await?;
                let first = answer.logprobs.first().ok_or_else(|| {
                    ApiError::Internal("the model's judgement gave no token".into())
                })?;
                let (yes, no) = &*answers;
                Ok::<_, ApiError>((
                    judge_score(&first.asked, yes, no),
                    answer.done.prompt_eval_count,
                ))
            }
        })
        .collect();
    let judged: Vec<(f32, usize)> = futures_util::stream::iter(judgements)
        .buffered(at_once)
        .try_collect()
        .await?;
    let tokens = judged.iter().map(|&(_, n)| n).sum();
    Ok((judged.into_iter().map(|(score, _)| score).collect(), tokens))
}

/// A non-empty list of at most `MAX_EMBED_INPUTS` documents.
fn check_documents(n: usize) -> Result<(), ApiError> {
    if n == 0 {
        return Err(ApiError::field("documents", " must be a non-empty array"));
    }
    if n > validate::MAX_EMBED_INPUTS {
        return Err(ApiError::invalid(format!(
            "at most {} documents per request, got {n}",
            validate::MAX_EMBED_INPUTS,
        )));
    }
    Ok(())
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
    check_documents(documents.len())?;
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
    fn a_model_reranks_by_its_kind() {
        let mut info = crate::backend::fake::model_info(64);
        let err = format_of(&info).unwrap_err();
        assert_eq!(err.kind(), "invalid_request");
        assert!(err.to_string().contains("not a reranker"), "{err}");
        // A generative model judges; a reranker pools; an embedding model can do neither.
        assert_eq!(reranker(&info).unwrap(), Reranker::Judge);
        let key = format!("{}.pooling_type", info.architecture);
        info.metadata.push((key, "1".into()));
        let err = reranker(&info).unwrap_err();
        assert_eq!(err.kind(), "invalid_request");
        assert!(err.to_string().contains("embedding model"), "{err}");
        info.rerank = Some(RerankFormat::default());
        assert!(matches!(reranker(&info), Ok(Reranker::Pooled(_))));
    }

    /// A tokenizer that opens all text with the same marker, as SentencePiece's space does.
    #[derive(Debug)]
    struct Marked;

    impl TextModel for Marked {
        fn tokenize_with(&self, text: &str, _: bool) -> Result<Vec<Token>, BackendError> {
            let mut out = vec![1000, 1001];
            out.extend(FakeText.tokenize_with(text, false)?);
            Ok(out)
        }
        fn piece(&self, token: Token) -> Vec<u8> {
            FakeText.piece(token)
        }
        fn vocabulary(&self) -> crate::constrain::Vocabulary {
            FakeText.vocabulary()
        }
    }

    #[test]
    fn the_answers_are_the_tokens_that_tell_their_spellings_apart() {
        let b = |c: char| c as Token;
        // One token per byte: y, Y for yes; n, N for no; the space that begins " yes" and
        // " no" begins both, so it is neither.
        let expected = (vec![b('y'), b('Y')], vec![b('n'), b('N')]);
        assert_eq!(answer_tokens(&FakeText).unwrap(), expected);
        assert_eq!(answer_tokens(&Marked).unwrap(), expected);
    }

    #[test]
    fn the_score_is_yes_against_no_over_their_spellings() {
        let lp = |token: Token, logprob: f32| TopLogprob {
            token,
            bytes: Vec::new(),
            logprob,
        };
        let (yes, no) = (vec![1, 2], vec![3]);
        let half = 0.5f32.ln();
        // P(yes) = 0.25 + 0.25, P(no) = 0.25: 2/3.
        let asked = [
            lp(1, 0.25f32.ln()),
            lp(2, 0.25f32.ln()),
            lp(3, 0.25f32.ln()),
        ];
        assert!((judge_score(&asked, &yes, &no) - 2.0 / 3.0).abs() < 1e-6);
        assert!((judge_score(&[lp(1, half), lp(3, half)], &yes, &no) - 0.5).abs() < 1e-6);
        // Far apart, without overflow either way.
        let apart = [lp(1, -1.0), lp(3, -2000.0)];
        assert_eq!(judge_score(&apart, &yes, &no), 1.0);
        let apart = [lp(1, -2000.0), lp(3, -1.0)];
        assert_eq!(judge_score(&apart, &yes, &no), 0.0);
        // Neither has any probability, or neither was asked about.
        let none = [lp(1, f32::NEG_INFINITY), lp(3, f32::NEG_INFINITY)];
        assert_eq!(judge_score(&none, &yes, &no), 0.5);
        assert_eq!(judge_score(&[], &yes, &no), 0.5);
        assert_eq!(judge_score(&[lp(3, -1.0)], &yes, &no), 0.0);
    }

    #[test]
    fn the_judgement_names_the_query_and_the_document() {
        let m = judge_messages("cats?", "a cat sat");
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].role.as_str(), m[1].role.as_str()), ("system", "user"));
        assert!(m[0].content.contains("\"yes\" or \"no\""));
        assert!(m[1]
            .content
            .ends_with("<Query>: cats?\n<Document>: a cat sat"));
    }
}
