//! LoRA adapters over HTTP: the table of loaded adapters with their default scales,
//! `GET /lora-adapters`, `POST /lora-adapters`, and the per-request `lora` field
//! (`[{"id": 0, "scale": 0.5}]`, as llama-server's), checked here before the queue.
//!
//! A request's list sets the scale of every adapter it names; those it does not name are off
//! (0), as in llama-server. A request without the field (or with `null`) uses the defaults.
//! `POST /lora-adapters` takes the same list and makes it the defaults.

use std::sync::{Arc, RwLock};

use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::common::{ensure_ready, parse_json};
use super::error::ApiError;
use super::AppState;
use crate::engine::lora::scale_problem;
use crate::engine::{LoraScales, LoraSpec};

/// The adapters this server loaded (`--lora`), by id, and their current default scales.
#[derive(Debug, Default)]
pub struct LoraTable {
    /// Each adapter's file name (not its directories: a client learns nothing of the file
    /// system), by id.
    names: Vec<String>,
    /// The scales of requests that name none.
    defaults: RwLock<Vec<f32>>,
}

impl LoraTable {
    /// The table for these `--lora` specs.
    pub fn new(specs: &[LoraSpec]) -> Arc<Self> {
        let names = specs
            .iter()
            .map(|s| {
                s.path.file_name().map_or_else(
                    || s.path.display().to_string(),
                    |f| f.to_string_lossy().into_owned(),
                )
            })
            .collect();
        Arc::new(Self {
            names,
            defaults: RwLock::new(specs.iter().map(|s| s.scale).collect()),
        })
    }

    /// How many adapters are loaded.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The scales of requests that name none.
    pub fn defaults(&self) -> LoraScales {
        LoraScales::new(self.default_scales())
    }

    fn default_scales(&self) -> Vec<f32> {
        self.defaults
            .read()
            .map_or_else(|e| e.into_inner().clone(), |d| d.clone())
    }

    /// The scales a `lora` list asks for (`what` names the field in messages): every entry an
    /// object `{"id", "scale"}` with a loaded adapter's id, given once, and a finite scale
    /// within `MAX_LORA_SCALE`; adapters not named are off.
    pub fn parse(&self, value: &Value, what: &str) -> Result<Vec<f32>, ApiError> {
        let bad = |why: String| ApiError::InvalidLora(format!("{what}: {why}"));
        let entries = value.as_array().ok_or_else(|| {
            bad(r#"must be an array of {"id": <adapter id>, "scale": <number>} objects"#.into())
        })?;
        let n = self.names.len();
        let mut scales = vec![0.0f32; n];
        let mut seen = vec![false; n];
        for (i, entry) in entries.iter().enumerate() {
            let object = entry
                .as_object()
                .ok_or_else(|| bad(format!(r#"entry {i} must be an object {{"id", "scale"}}"#)))?;
            if let Some(key) = object
                .keys()
                .find(|k| !matches!(k.as_str(), "id" | "scale"))
            {
                return Err(bad(format!(
                    "entry {i} has an unknown field {key:?} (only \"id\" and \"scale\")"
                )));
            }
            let id = object.get("id").and_then(Value::as_u64).ok_or_else(|| {
                bad(format!(
                    "entry {i}: \"id\" must be an adapter id (0, 1, ...)"
                ))
            })?;
            let id = usize::try_from(id)
                .ok()
                .filter(|&id| id < n)
                .ok_or_else(|| {
                    bad(if n == 0 {
                        format!("no LoRA adapter {id}: this server has none (start it with --lora)")
                    } else {
                        format!("no LoRA adapter {id}: this server has adapters 0..{n}")
                    })
                })?;
            if std::mem::replace(&mut seen[id], true) {
                return Err(bad(format!("adapter {id} is given twice")));
            }
            let scale = object
                .get("scale")
                .and_then(Value::as_f64)
                .ok_or_else(|| bad(format!("entry {i}: \"scale\" must be a number")))?;
            // An f64 beyond f32's range becomes infinite here and is refused below.
            #[allow(clippy::cast_possible_truncation)]
            let scale = scale as f32;
            if let Some(why) = scale_problem(scale) {
                return Err(bad(format!("adapter {id}: {why}")));
            }
            scales[id] = scale;
        }
        Ok(scales)
    }

    /// A request's `lora` field as the engine's scale set; `None` (absent or `null`): the
    /// defaults, filled in later.
    pub fn for_request(&self, value: Option<&Value>) -> Result<Option<LoraScales>, ApiError> {
        match value {
            None | Some(Value::Null) => Ok(None),
            Some(v) => self.parse(v, "lora").map(|s| Some(LoraScales::new(s))),
        }
    }

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
    use super::*;

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
