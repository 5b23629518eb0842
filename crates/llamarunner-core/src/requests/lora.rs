//! A request's `lora` field (`[{"id": 0, "scale": 0.5}]`, as llama-server's) and
//! `POST /lora-adapters`'s body, checked against the loaded adapters before the queue.

use serde_json::Value;

use crate::http::error::ApiError;
use crate::protocol::lora::{scale_problem, LoraTable};
use crate::protocol::LoraScales;

impl LoraTable {
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
}
