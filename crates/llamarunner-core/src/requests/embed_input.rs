//! What `/v1/embeddings` may embed besides text: inputs given as token ids (OpenAI's API and
//! llama-server take them), checked against the vocabulary before they reach the queue.

use crate::http::error::ApiError;
use crate::kv;
use crate::protocol::{ModelInfo, Token};

/// One input to embed: text, or its token ids (OpenAI's `input` allows both).
#[derive(Clone, Debug, PartialEq)]
pub enum EmbedInput {
    /// Text, tokenized here.
    Text(String),
    /// Token ids, checked against the vocabulary.
    Tokens(Vec<i64>),
}

/// Validates one embedding input given as token ids (OpenAI's and llama-server's token
/// arrays): each inside the vocabulary, fitted as `validate::embedding_input` fits text.
pub fn token_input(
    info: &ModelInfo,
    ids: &[i64],
    truncate: bool,
) -> Result<(Vec<Token>, bool), ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid("an input to embed must not be empty"));
    }
    let n_vocab = i64::from(info.n_vocab);
    let mut tokens = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            (0..n_vocab)
                .contains(&id)
                .then(|| Token::try_from(id).ok())
                .flatten()
                .ok_or_else(|| {
                    ApiError::field(
                        "input",
                        format!(" token {i}: {id} is not in the vocabulary (0..{n_vocab})"),
                    )
                })
        })
        .collect::<Result<Vec<Token>, ApiError>>()?;
    let cut = kv::fit_input(&mut tokens, truncate, info.embed_ctx)?;
    Ok((tokens, cut))
}
