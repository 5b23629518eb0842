//! `RunnerConfig`: every knob of the runner, deserialized once (from the Python side's JSON or
//! from tests) and validated once. Nothing else in the crate reads the environment.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Flash attention policy, as llama.cpp understands it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlashAttn {
    /// Let llama.cpp decide per backend.
    #[default]
    Auto,
    /// Always on.
    On,
    /// Always off.
    Off,
}

/// Everything the runner needs to start. Field names match the CLI flags (`--ctx-size` is
/// `ctx_size`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunnerConfig {
    /// Path of the GGUF model file.
    pub model: PathBuf,
    /// Address to bind.
    pub host: String,
    /// Port to bind; 0 picks a free one.
    pub port: u16,
    /// Number of sequences served at once (llama.cpp sequence ids / KV slots).
    pub parallel: u32,
    /// Context size of each slot, in tokens (the context holds `ctx_size * parallel` cells).
    pub ctx_size: u32,
    /// Most tokens decoded in one step, across all sequences (also llama.cpp's `n_ubatch`).
    pub batch_size: u32,
    /// CPU threads for decoding; 0 = every available core.
    pub threads: u32,
    /// Layers to offload to the GPU; -1 = all.
    pub n_gpu_layers: i32,
    /// GPU used for the model when it is not split.
    pub main_gpu: i32,
    /// Flash attention policy.
    pub flash_attn: FlashAttn,
    /// KV cache element type: f16, q8_0 or q4_0.
    pub kv_cache_type: String,
    /// Read the whole model into memory instead of mapping it.
    pub no_mmap: bool,
    /// Lock the model in RAM.
    pub mlock: bool,
    /// Fraction of the model per GPU, comma separated (not supported yet).
    pub tensor_split: Option<String>,
    /// LoRA adapters to apply (one is supported).
    pub lora: Vec<PathBuf>,
    /// Multimodal projector (not supported yet).
    pub mmproj: Option<PathBuf>,
    /// Share cached prefixes between users (forking), instead of one user's cache per slot.
    pub multiuser_cache: bool,
    /// Log llama.cpp's own messages too.
    pub verbose: bool,
    /// Requests that may wait for a slot before new ones are refused with 429.
    pub max_queue: u32,
    /// The name clients use for the model (`/v1/models`, the `model` field); default: the file
    /// name without `.gguf`.
    pub alias: Option<String>,
    /// Chat template: a built-in name (gemma, chatml, llama3, phi3, mistral) or a Jinja file;
    /// default: the GGUF's own, else the family's built-in one.
    pub chat_template: Option<String>,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        Self {
            model: PathBuf::new(),
            host: "127.0.0.1".into(),
            port: 8080,
            parallel: 1,
            ctx_size: 4096,
            batch_size: 512,
            threads: 0,
            n_gpu_layers: -1,
            main_gpu: 0,
            flash_attn: FlashAttn::Auto,
            kv_cache_type: "f16".into(),
            no_mmap: false,
            mlock: false,
            tensor_split: None,
            lora: Vec::new(),
            mmproj: None,
            multiuser_cache: false,
            verbose: false,
            max_queue: 256,
            alias: None,
            chat_template: None,
        }
    }
}

/// A configuration that cannot work, with the reason.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// A numeric setting is out of range.
    #[error("{name} must be {rule} (got {value})")]
    OutOfRange {
        /// The setting's name, as on the command line.
        name: &'static str,
        /// What it must be.
        rule: &'static str,
        /// What it was.
        value: i64,
    },
    /// The KV cache type is not one llama.cpp supports here.
    #[error("kv-cache-type must be one of f16, q8_0, q4_0 (got {0:?})")]
    KvCacheType(String),
    /// More than one LoRA adapter.
    #[error("only one --lora adapter is supported (got {0})")]
    TooManyLoras(usize),
    /// No model path.
    #[error("no model given")]
    NoModel,
    /// `--chat-template` is neither a built-in name nor a readable file.
    #[error("chat-template {0:?} is neither a built-in template (gemma, chatml, llama3, phi3, mistral) nor a file")]
    ChatTemplate(String),
    /// `--alias` is empty.
    #[error("alias must not be empty")]
    EmptyAlias,
}

impl RunnerConfig {
    /// Checks every setting; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.model.as_os_str().is_empty() {
            return Err(ConfigError::NoModel);
        }
        let ranges: [(&'static str, i64, i64, i64, &'static str); 3] = [
            (
                "parallel",
                self.parallel.into(),
                1,
                256,
                "between 1 and 256",
            ),
            ("ctx-size", self.ctx_size.into(), 16, 1 << 24, "at least 16"),
            (
                "batch-size",
                self.batch_size.into(),
                1,
                1 << 20,
                "at least 1",
            ),
        ];
        for (name, value, lo, hi, rule) in ranges {
            if value < lo || value > hi {
                return Err(ConfigError::OutOfRange { name, rule, value });
            }
        }
        if self.n_gpu_layers < -1 {
            return Err(ConfigError::OutOfRange {
                name: "n-gpu-layers",
                rule: "-1 (all) or a layer count",
                value: self.n_gpu_layers.into(),
            });
        }
        if !matches!(self.kv_cache_type.as_str(), "f16" | "q8_0" | "q4_0") {
            return Err(ConfigError::KvCacheType(self.kv_cache_type.clone()));
        }
        if self.lora.len() > 1 {
            return Err(ConfigError::TooManyLoras(self.lora.len()));
        }
        if let Some(t) = &self.chat_template {
            if crate::chat::builtin(t).is_none() && !std::path::Path::new(t).is_file() {
                return Err(ConfigError::ChatTemplate(t.clone()));
            }
        }
        if self.alias.as_ref().is_some_and(|a| a.trim().is_empty()) {
            return Err(ConfigError::EmptyAlias);
        }
        Ok(())
    }

    /// The model's public name: `alias`, else the file name without its `.gguf` extension.
    pub fn model_name(&self) -> String {
        if let Some(alias) = &self.alias {
            return alias.clone();
        }
        let file = self
            .model
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        match file.strip_suffix(".gguf") {
            Some(stem) if !stem.is_empty() => stem.to_string(),
            _ => file,
        }
    }

    /// Decoding threads, resolving 0 to the number of available cores.
    pub fn effective_threads(&self) -> u32 {
        if self.threads > 0 {
            return self.threads;
        }
        std::thread::available_parallelism()
            .map(|n| u32::try_from(n.get()).unwrap_or(1))
            .unwrap_or(1)
    }

    /// Settings that are accepted but have no effect yet, each with a sentence saying so.
    pub fn unsupported_settings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.tensor_split.is_some() {
            out.push(
                "--tensor-split is not supported yet (llama-cpp-2 has no setter); ignored".into(),
            );
        }
        if self.mmproj.is_some() {
            out.push(
                "--mmproj: multimodal input is not supported yet; the projector is not loaded"
                    .into(),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_model() -> RunnerConfig {
        RunnerConfig {
            model: "m.gguf".into(),
            ..RunnerConfig::default()
        }
    }

    #[test]
    fn defaults_are_valid_once_a_model_is_set() {
        assert_eq!(
            RunnerConfig::default().validate(),
            Err(ConfigError::NoModel)
        );
        assert_eq!(with_model().validate(), Ok(()));
    }

    #[test]
    fn out_of_range_values_are_named() {
        let cfg = RunnerConfig {
            parallel: 0,
            ..with_model()
        };
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("parallel"), "{err}");
        let cfg = RunnerConfig {
            kv_cache_type: "q5".into(),
            ..with_model()
        };
        assert!(matches!(cfg.validate(), Err(ConfigError::KvCacheType(_))));
    }

    #[test]
    fn model_name_is_the_alias_or_the_file_stem() {
        let cfg = RunnerConfig {
            model: "/models/gemma-3-270m-q4_k_m.gguf".into(),
            ..RunnerConfig::default()
        };
        assert_eq!(cfg.model_name(), "gemma-3-270m-q4_k_m");
        let cfg = RunnerConfig {
            alias: Some("gemma".into()),
            ..cfg
        };
        assert_eq!(cfg.model_name(), "gemma");
    }

    #[test]
    fn chat_template_must_be_builtin_or_a_file() {
        let cfg = RunnerConfig {
            chat_template: Some("gemma".into()),
            ..with_model()
        };
        assert_eq!(cfg.validate(), Ok(()));
        let cfg = RunnerConfig {
            chat_template: Some("/no/such/template.jinja".into()),
            ..with_model()
        };
        assert!(matches!(cfg.validate(), Err(ConfigError::ChatTemplate(_))));
    }

    #[test]
    fn unknown_json_fields_are_rejected() {
        let r: Result<RunnerConfig, _> = serde_json::from_str(r#"{"model":"m","bogus":1}"#);
        assert!(r.is_err());
        let r: RunnerConfig = serde_json::from_str(r#"{"model":"m","flash_attn":"on"}"#).unwrap();
        assert_eq!(r.flash_attn, FlashAttn::On);
        assert_eq!(r.parallel, 1);
    }
}
