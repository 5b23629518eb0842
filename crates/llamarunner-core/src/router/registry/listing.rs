//! How the router lists its models: llama-server's router shape for `GET /models` and
//! `/health`, and Ollama's `/api/tags` and `/api/ps` entries.

use std::time::SystemTime;

use serde_json::{json, Value};

use crate::dialects::ollama;

use super::{Model, Registry, Status};

impl Registry {
    /// `GET /models` and `/health`'s view of one model (llama-server's router shape, with
    /// our fields beside).
    pub fn describe(&self, model: &Model) -> Value {
        let inner = model.lock();
        let (size, _) = model.file_facts();
        let mut status = json!({"value": inner.status.as_str()});
        match &inner.status {
            Status::Loading { since, progress } => {
                status["progress"] = json!(progress);
                status["loading_s"] = json!(since.elapsed().as_secs_f64());
            }
            Status::Failed { error } => {
                status["failed"] = json!(true);
                status["error"] = json!(error);
            }
            _ => {}
        }
        if matches!(inner.status, Status::Loaded { .. }) {
            status["requests"] = json!(inner.in_flight);
            if let Some(k) = inner.keep_alive {
                let left = k.saturating_sub(inner.last_used.elapsed());
                status["expires_in_s"] = json!(if inner.in_flight > 0 {
                    k.as_secs_f64()
                } else {
                    left.as_secs_f64()
                });
            }
            if let Some(p) = &inner.process {
                status["pid"] = json!(p.pid);
                if let Some(rss) = p.rss_bytes() {
                    status["memory_bytes"] = json!(rss);
                }
            }
        }
        if let (true, Some(estimate)) = (inner.status.occupies(), inner.estimate) {
            status["memory_estimate_bytes"] = json!(estimate);
        }
        json!({
            "id": model.name,
            "object": "model",
            "owned_by": "llamarunner",
            "path": model.spec.path,
            "size": size,
            "status": status,
        })
    }

    /// Ollama's `/api/tags` entry of a model (`loaded`: `/api/ps`'s, with its expiry), as
    /// an engine lists its own (`dialects::ollama::Listed`).
    pub(crate) fn ollama_entry<'a>(
        &self,
        model: &'a Model,
        loaded: bool,
    ) -> ollama::ModelEntry<'a> {
        /// A file the router has not read: its format only.
        const DETAILS: ollama::Details = ollama::Details::FormatOnly { format: "gguf" };
        let (size, modified) = model.file_facts();
        let listed = ollama::Listed {
            name: &model.name,
            path: std::path::Path::new(&model.spec.path),
            size,
            modified,
            details: &DETAILS,
        };
        if !loaded {
            return listed.tags_entry();
        }
        let inner = model.lock();
        let expires = match inner.keep_alive {
            Some(k) => SystemTime::now() + k.saturating_sub(inner.last_used.elapsed()),
            None => SystemTime::now() + ollama::KEPT_LOADED,
        };
        listed.ps_entry(expires, inner.vram_bytes)
    }
}
