//! The prompts of a `POST /completion` in llama-server's format, in each shape it takes: a
//! text; token ids; token ids and texts mixed in one sequence; `{"prompt_string": ...}`; or an
//! array of those, several prompts answered together.

use std::sync::Arc;

use serde_json::Value;

use crate::http::error::ApiError;
use crate::protocol::{ModelInfo, Token};
use crate::requests::common::PromptSource;
use crate::requests::validate::{blocking, max_text_bytes};

/// Most prompts one request may give (each takes a slot, as `n` choices do).
pub(super) const MAX_PROMPTS: usize = crate::dialects::openai::MAX_CHOICES as usize;

/// One prompt: a text, or a sequence of token ids and texts.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum OnePrompt {
    Text(String),
    Mixed(Vec<Piece>),
}

/// A piece of a mixed prompt.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Piece {
    Id(Token),
    Text(String),
}

fn bad() -> ApiError {
    ApiError::field(
        "prompt",
        " must be a non-empty text, token ids (with texts among them), an object with \
         prompt_string, or an array of those (several prompts)",
    )
}

/// Whether an array is one prompt (it holds a number: ids, texts among them) rather than
/// several, as llama-server tells them apart.
fn is_one_sequence(items: &[Value]) -> bool {
    items.iter().any(Value::is_number)
}

/// One prompt in any of its shapes but an array of several.
fn one(value: &Value) -> Result<OnePrompt, ApiError> {
    match value {
        Value::String(text) if !text.is_empty() => Ok(OnePrompt::Text(text.clone())),
        Value::Array(items) if !items.is_empty() && is_one_sequence(items) => items
            .iter()
            .map(|item| match item {
                Value::String(text) => Ok(Piece::Text(text.clone())),
                Value::Number(n) => n
                    .as_u64()
                    .and_then(|id| Token::try_from(id).ok())
                    .map(Piece::Id)
                    .ok_or_else(|| {
                        ApiError::field("prompt", ": a token id is a non-negative integer")
                    }),
                _ => Err(bad()),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(OnePrompt::Mixed),
        Value::Object(fields) => {
            if fields.contains_key("multimodal_data") {
                return Err(ApiError::ImagesNotSupported(
                    "prompt.multimodal_data: send images in a chat request \
                     (/v1/chat/completions, /api/chat) to a server with a projector"
                        .into(),
                ));
            }
            // A text or a sequence (`one` refuses anything else in it).
            match fields.get("prompt_string") {
                Some(inner @ (Value::String(_) | Value::Array(_))) => one(inner),
                _ => Err(bad()),
            }
        }
        _ => Err(bad()),
    }
}

/// The request's prompts: one, or several (an array whose items are prompts).
pub(super) fn read(prompt: Option<&Value>) -> Result<Vec<OnePrompt>, ApiError> {
    let Some(prompt) = prompt else {
        return Err(bad());
    };
    let prompts = match prompt {
        Value::Array(items) if !items.is_empty() && !is_one_sequence(items) => {
            items.iter().map(one).collect::<Result<Vec<_>, _>>()?
        }
        other => vec![one(other)?],
    };
    if prompts.len() > MAX_PROMPTS {
        return Err(ApiError::field(
            "prompt",
            format!(": at most {MAX_PROMPTS} prompts in one request; send more as more requests"),
        ));
    }
    Ok(prompts)
}

impl OnePrompt {
    /// The prompt's text, as the answer's `prompt` echoes it (none for token ids).
    pub(super) fn text(&self) -> String {
        match self {
            OnePrompt::Text(text) => text.clone(),
            OnePrompt::Mixed(_) => String::new(),
        }
    }

    /// What the engine is given: a text as it is; a sequence as token ids, its texts tokenized
    /// in one task on the blocking pool (a text that opens the sequence with the model's
    /// special tokens, as a text prompt gets them; its texts together at most the bytes a
    /// text prompt may have).
    pub(super) async fn source(self, info: &Arc<ModelInfo>) -> Result<PromptSource, ApiError> {
        let pieces = match self {
            OnePrompt::Text(text) => return Ok(PromptSource::from(text)),
            OnePrompt::Mixed(pieces) => pieces,
        };
        let text_bytes: usize = pieces
            .iter()
            .map(|p| match p {
                Piece::Text(t) => t.len(),
                Piece::Id(_) => 0,
            })
            .sum();
        let max = max_text_bytes(info);
        if text_bytes > max || pieces.len() > max {
            return Err(ApiError::ContextLength(format!(
                "the input length exceeds the context length: the prompt has {} pieces and \
                 {text_bytes} bytes of text, at most {max} of each are read for a slot of {} \
                 tokens",
                pieces.len(),
                info.slot_ctx
            )));
        }
        let model = info.text.clone();
        let tokens = blocking(move || {
            let mut tokens = Vec::new();
            for (i, piece) in pieces.into_iter().enumerate() {
                match piece {
                    Piece::Id(id) => tokens.push(id),
                    Piece::Text(text) => tokens.extend(model.tokenize_with(&text, i == 0)?),
                }
            }
            Ok::<_, crate::protocol::BackendError>(tokens)
        })
        .await?
        .map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
        Ok(PromptSource::Tokens(tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_shape_llama_server_takes_is_read() {
        let text = |t: &str| OnePrompt::Text(t.into());
        assert_eq!(read(Some(&json!("hi"))).unwrap(), [text("hi")]);
        assert_eq!(
            read(Some(&json!([1, 2]))).unwrap(),
            [OnePrompt::Mixed(vec![Piece::Id(1), Piece::Id(2)])]
        );
        assert_eq!(
            read(Some(&json!([1, "a", 2]))).unwrap(),
            [OnePrompt::Mixed(vec![
                Piece::Id(1),
                Piece::Text("a".into()),
                Piece::Id(2)
            ])]
        );
        assert_eq!(
            read(Some(&json!({"prompt_string": "hi"}))).unwrap(),
            [text("hi")]
        );
        assert_eq!(
            read(Some(&json!({"prompt_string": [3, "a"]}))).unwrap(),
            [OnePrompt::Mixed(vec![
                Piece::Id(3),
                Piece::Text("a".into())
            ])]
        );
        // Several: texts, ids, objects.
        let several = read(Some(&json!([[1, 2], "hi", {"prompt_string": "x"}]))).unwrap();
        assert_eq!(several.len(), 3);
        assert_eq!(several[1], text("hi"));
        assert_eq!(
            read(Some(&json!(["a", "b"]))).unwrap(),
            [text("a"), text("b")]
        );
        for bad in [
            json!(""),
            json!([]),
            json!(null),
            json!(3),
            json!([1, -2]),
            json!([1, [2]]),
            json!({"other": 1}),
            json!([[]]),
            json!(["a", ""]),
            json!({"prompt_string": ["a", "b"]}),
            json!({"prompt_string": [1, [2]]}),
            json!({"prompt_string": {"prompt_string": "x"}}),
        ] {
            let err = read(Some(&bad)).unwrap_err();
            assert_eq!(err.kind(), "invalid_request", "{bad}");
        }
        assert!(read(None).is_err());
        let err = read(Some(&json!({"prompt_string": "x", "multimodal_data": []}))).unwrap_err();
        assert_eq!(err.kind(), "images_not_supported", "{err}");
        let many = Value::Array((0..=MAX_PROMPTS).map(|_| json!("a")).collect());
        assert!(read(Some(&many))
            .unwrap_err()
            .to_string()
            .contains("at most"));
    }
}
