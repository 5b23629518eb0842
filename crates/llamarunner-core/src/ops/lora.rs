//! LoRA adapters over HTTP: `GET /lora-adapters` and `POST /lora-adapters` on the table of
//! loaded adapters (`protocol/lora.rs`); the per-request `lora` field
//! (`[{"id": 0, "scale": 0.5}]`, as llama-server's) is checked in `requests/lora.rs`.
//!
//! A request's list sets the scale of every adapter it names; those it does not name are off
//! (0), as in llama-server. A request without the field (or with `null`) uses the defaults.
//! `POST /lora-adapters` takes the same list and makes it the defaults.

use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use crate::http::error::ApiError;
use crate::http::state::AppState;
use crate::protocol::lora::LoraTable;
use crate::requests::common::{ensure_ready, parse_json};

impl LoraTable {
    /// `GET /lora-adapters`'s answer.
    fn listing(&self) -> Value {
        let scales = self.default_scales();
        Value::Array(
            self.names
                .iter()
                .enumerate()
                .map(|(id, path)| {
                    json!({"id": id, "path": path, "scale": scales.get(id).copied().unwrap_or(0.0)})
                })
                .collect(),
        )
    }
}

/// `GET /lora-adapters`: `[{"id", "path", "scale"}]`, the scale being the default.
pub async fn list(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    ensure_ready(&state)?;
    Ok(Json(state.lora.listing()))
}

/// `POST /lora-adapters` with `[{"id", "scale"}]`: the new default scales (adapters not named
/// are off); answers the new listing.
pub async fn set(State(state): State<AppState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    ensure_ready(&state)?;
    let value: Value = parse_json(&body)?;
    let scales = state.lora.parse(&value, "body")?;
    match state.lora.defaults.write() {
        Ok(mut d) => *d = scales,
        Err(e) => *e.into_inner() = scales,
    }
    tracing::info!(adapters = ?state.lora.listing(), "default LoRA scales set");
    Ok(Json(state.lora.listing()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::protocol::{LoraScales, LoraSpec};

    fn table(n: usize) -> Arc<LoraTable> {
        let specs: Vec<LoraSpec> = (0..n)
            .map(|i| LoraSpec::parse(&format!("/d/a{i}.gguf:0.5")).unwrap())
            .collect();
        LoraTable::new(&specs)
    }

    #[test]
    fn good_lists_set_the_named_scales_and_turn_the_others_off() {
        let t = table(3);
        let v = json!([{"id": 2, "scale": 1.5}, {"id": 0, "scale": -1}]);
        assert_eq!(t.parse(&v, "lora").unwrap(), vec![-1.0, 0.0, 1.5]);
        assert_eq!(t.parse(&json!([]), "lora").unwrap(), vec![0.0; 3]);
        assert_eq!(t.for_request(None).unwrap(), None);
        assert_eq!(t.for_request(Some(&Value::Null)).unwrap(), None);
        assert_eq!(t.defaults(), LoraScales::new(vec![0.5; 3]));
        assert_eq!(
            t.listing()[1],
            json!({"id": 1, "path": "a1.gguf", "scale": 0.5})
        );
    }

    #[test]
    fn bad_lists_are_invalid_lora() {
        let t = table(2);
        for v in [
            json!({"id": 0, "scale": 1}),
            json!("0:1"),
            json!([0.5]),
            json!([{"id": 2, "scale": 1}]),
            json!([{"id": -1, "scale": 1}]),
            json!([{"id": 0.5, "scale": 1}]),
            json!([{"id": "0", "scale": 1}]),
            json!([{"id": 0}]),
            json!([{"scale": 1}]),
            json!([{"id": 0, "scale": "1"}]),
            json!([{"id": 0, "scale": null}]),
            json!([{"id": 0, "scale": 11}]),
            json!([{"id": 0, "scale": 1e300}]),
            json!([{"id": 0, "scale": 1, "extra": 1}]),
            json!([{"id": 0, "scale": 1}, {"id": 0, "scale": 1}]),
            json!([{"id": 18446744073709551615u64, "scale": 1}]),
        ] {
            let err = t.parse(&v, "lora").unwrap_err();
            assert_eq!(err.kind(), "invalid_lora", "{v}");
            assert_eq!(err.status(), 400, "{v}");
        }
        assert!(table(0)
            .parse(&json!([{"id": 0, "scale": 1}]), "lora")
            .unwrap_err()
            .to_string()
            .contains("has none"));
    }
}
