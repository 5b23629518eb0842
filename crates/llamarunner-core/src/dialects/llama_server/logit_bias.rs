//! llama-server's `logit_bias`, in both of its shapes, with texts as keys.

use serde_json::{json, Value};

use crate::http::error::ApiError;
use crate::protocol::Token;

/// llama-server's `logit_bias`: `[[key, bias], ...]` or `{"key": bias}`, each key a token id
/// or a text whose every token gets the bias; a bias is a number, or `false` (never sampled).
#[derive(Debug, Default, PartialEq)]
pub(super) struct LogitBias {
    pub(super) ids: Vec<(Token, f32)>,
    pub(super) texts: Vec<(String, f32)>,
}

impl LogitBias {
    pub(super) fn read(value: &Value) -> Result<Self, ApiError> {
        let bad = || {
            ApiError::field(
                "logit_bias",
                " must be [[token or text, bias], ...] or {\"token or text\": bias}, \
                 a bias a number or false",
            )
        };
        let entries: Vec<(Value, &Value)> = match value {
            Value::Null => Vec::new(),
            Value::Array(pairs) => pairs
                .iter()
                .map(|pair| match pair.as_array().map(Vec::as_slice) {
                    Some([key, bias]) => Ok((key.clone(), bias)),
                    _ => Err(bad()),
                })
                .collect::<Result<_, _>>()?,
            Value::Object(map) => map
                .iter()
                .map(|(key, bias)| {
                    let key = key
                        .parse::<i64>()
                        .map_or_else(|_| json!(key), |id| json!(id));
                    (key, bias)
                })
                .collect(),
            _ => return Err(bad()),
        };
        if entries.len() > crate::requests::validate::MAX_LOGIT_BIAS {
            return Err(ApiError::field(
                "logit_bias",
                format!(
                    ": at most {} entries",
                    crate::requests::validate::MAX_LOGIT_BIAS
                ),
            ));
        }
        let mut bias = Self::default();
        for (key, value) in entries {
            let b = match value {
                Value::Bool(false) => f32::NEG_INFINITY,
                Value::Number(n) => n.as_f64().filter(|b| b.is_finite()).ok_or_else(bad)? as f32,
                _ => return Err(bad()),
            };
            match key {
                Value::String(text) => bias.texts.push((text, b)),
                Value::Number(n) => {
                    let id = n.as_u64().and_then(|id| Token::try_from(id).ok());
                    bias.ids.push((id.ok_or_else(bad)?, b));
                }
                _ => return Err(bad()),
            }
        }
        Ok(bias)
    }

    /// The biases by token id: the texts tokenized as plain text (special tokens stay text,
    /// no BOS), in one task on the blocking pool; the ids and their count checked later with
    /// the other options.
    pub(super) async fn tokens(
        self,
        info: &std::sync::Arc<crate::protocol::ModelInfo>,
    ) -> Result<Vec<(Token, f32)>, ApiError> {
        let mut out = self.ids;
        if self.texts.is_empty() {
            return Ok(out);
        }
        let bytes: usize = self.texts.iter().map(|(t, _)| t.len()).sum();
        let max = crate::requests::validate::max_text_bytes(info);
        if bytes > max {
            return Err(ApiError::field(
                "logit_bias",
                format!(": its texts have {bytes} bytes, at most {max}"),
            ));
        }
        let model = info.text.clone();
        let texts = self.texts;
        let biased = crate::requests::validate::blocking(move || {
            let mut biased = Vec::new();
            for (text, b) in texts {
                biased.extend(model.tokenize_literal(&text)?.into_iter().map(|t| (t, b)));
            }
            Ok::<_, crate::protocol::BackendError>(biased)
        })
        .await?
        .map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
        out.extend(biased);
        Ok(out)
    }
}
