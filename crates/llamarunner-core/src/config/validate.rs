//! The checks of a `RunnerConfig` (`validate`, run once at start): every setting in its range,
//! the combinations `--deterministic` cannot take, the HTTP limits, the API keys and
//! `--tensor-split`'s shares. The sampling defaults' checks are in `sampling.rs`.

use super::{
    ConfigError, FlashAttn, RunnerConfig, MAX_CACHE_RAM_MIB, MAX_CTX_CHECKPOINTS, MAX_DEVICES,
    MAX_DRAFT, MAX_FIT_TARGET_MIB, MAX_SECONDS, MAX_SPEC_NGRAM,
};

impl RunnerConfig {
    /// Checks every setting; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.model.as_os_str().is_empty() {
            return Err(ConfigError::NoModel);
        }
        let ranges: [(&'static str, i64, i64, i64, &'static str); 9] = [
            (
                "ctx-checkpoints",
                self.ctx_checkpoints,
                0,
                MAX_CTX_CHECKPOINTS,
                "between 0 (none) and 64",
            ),
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
            (
                "draft-max",
                self.draft_max.into(),
                0,
                MAX_DRAFT.into(),
                "between 0 (off) and 64",
            ),
            (
                "draft-min",
                self.draft_min.into(),
                0,
                self.draft_max.max(1).into(),
                "between 0 and draft-max",
            ),
            (
                "spec-ngram",
                self.spec_ngram.into(),
                1,
                MAX_SPEC_NGRAM.into(),
                "between 1 and 32",
            ),
            (
                "cache-ram",
                self.cache_ram,
                -1,
                MAX_CACHE_RAM_MIB,
                "-1 (a quarter of the memory), 0 (off) or MiB up to 16 TiB",
            ),
            (
                "seed",
                self.seed,
                -1,
                u32::MAX.into(),
                "-1 (random) or between 0 and 4294967295",
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
                rule: "-1 (as many as fit) or a layer count",
                value: self.n_gpu_layers.into(),
            });
        }
        if !(0..MAX_DEVICES).contains(&i64::from(self.main_gpu)) {
            return Err(ConfigError::OutOfRange {
                name: "main-gpu",
                rule: "the index of a GPU, from 0",
                value: self.main_gpu.into(),
            });
        }
        if self.fit_target > MAX_FIT_TARGET_MIB {
            return Err(ConfigError::OutOfRange {
                name: "fit-target",
                rule: "MiB up to 1 TiB",
                value: i64::try_from(self.fit_target).unwrap_or(i64::MAX),
            });
        }
        self.tensor_split_values()?;
        self.validate_deterministic()?;
        if !matches!(self.kv_cache_type.as_str(), "f16" | "q8_0" | "q4_0") {
            return Err(ConfigError::KvCacheType(self.kv_cache_type.clone()));
        }
        if self.lora.len() > crate::protocol::lora::MAX_LORA_ADAPTERS {
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
        self.validate_sampling()?;
        self.validate_http()?;
        self.api_keys().map(|_| ())
    }

    /// What `--deterministic` cannot be combined with: the kernels it chooses are the CPU's,
    /// without flash attention (its tiled and split paths depend on the batch's rows), and
    /// each sequence's rows are padded to a multiple of four.
    fn validate_deterministic(&self) -> Result<(), ConfigError> {
        if !self.deterministic {
            return Ok(());
        }
        let conflict = if self.flash_attn == FlashAttn::On {
            Some("--flash-attn on (its kernels differ by batch shape; leave it auto or off)")
        } else if self.n_gpu_layers > 0 {
            Some("--n-gpu-layers above 0 (it covers the CPU backend only)")
        } else if self.tensor_split.is_some() {
            Some("--tensor-split (it covers the CPU backend only)")
        } else if self.mmproj.is_some() {
            Some("--mmproj (images are decoded by the projector's own batches)")
        } else if self.batch_size < 4 {
            Some("--batch-size below 4 (each sequence's rows are padded to a multiple of four)")
        } else if self.null_decode {
            Some("--null-decode")
        } else if self.backend_sampling {
            Some("--backend-sampling (its top-k runs in the decode's own graph)")
        } else if self.kv_cache_type != "f16" {
            Some("a quantized --kv-cache-type (it needs flash attention)")
        } else if self.kv_unified {
            Some("--kv-unified (a slot's cells must stay at its positions' indices)")
        } else {
            None
        };
        conflict.map_or(Ok(()), |c| Err(ConfigError::Deterministic(c)))
    }

    /// The HTTP limits and timeouts (all `Runner::start_with` needs checked).
    pub(crate) fn validate_http(&self) -> Result<(), ConfigError> {
        if self.max_body == 0 {
            return Err(ConfigError::OutOfRange {
                name: "max-body",
                rule: "at least 1 (bytes)",
                value: 0,
            });
        }
        if self.max_connections == 0 {
            return Err(ConfigError::OutOfRange {
                name: "max-connections",
                rule: "at least 1",
                value: 0,
            });
        }
        let seconds: [(&'static str, f64, bool); 4] = [
            ("header-timeout", self.header_timeout, false),
            ("idle-timeout", self.idle_timeout, false),
            ("shutdown-timeout", self.shutdown_timeout, true),
            ("timeout", self.timeout, true),
        ];
        for (name, value, zero_ok) in seconds {
            let ok = value.is_finite()
                && value <= MAX_SECONDS
                && if zero_ok { value >= 0.0 } else { value > 0.0 };
            if !ok {
                return Err(ConfigError::BadSeconds {
                    name,
                    rule: if zero_ok {
                        "between 0 and 86400 seconds"
                    } else {
                        "more than 0 and at most 86400 seconds"
                    },
                    value: value.to_string(),
                });
            }
        }
        if self.allow_origin.iter().any(|o| o.trim().is_empty()) {
            return Err(ConfigError::EmptyOrigin);
        }
        if let Some(dir) = &self.slot_save_path {
            let bad = |reason: &str| ConfigError::SlotSavePath {
                path: dir.display().to_string(),
                reason: reason.into(),
            };
            if dir.as_os_str().is_empty() {
                return Err(bad("must not be empty"));
            }
            if dir.exists() && !dir.is_dir() {
                return Err(bad("not a directory"));
            }
        }
        Ok(())
    }

    /// Every API key: `api_key`, then those in `api_key_file`. Empty = no authentication.
    pub fn api_keys(&self) -> Result<Vec<String>, ConfigError> {
        let valid = |k: &str| !k.is_empty() && !k.chars().any(char::is_whitespace);
        let mut keys = Vec::new();
        for key in &self.api_key {
            if !valid(key) {
                return Err(ConfigError::BadApiKey);
            }
            keys.push(key.clone());
        }
        if let Some(path) = &self.api_key_file {
            let shown = path.display().to_string();
            let bad = |reason: String| ConfigError::ApiKeyFile {
                path: shown.clone(),
                reason,
            };
            let text =
                std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read: {e}")))?;
            let before = keys.len();
            for line in text.lines().map(str::trim) {
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                if !valid(line) {
                    return Err(bad("a key holds whitespace".into()));
                }
                keys.push(line.to_string());
            }
            if keys.len() == before {
                return Err(bad("no key in it".into()));
            }
        }
        Ok(keys)
    }

    /// `--tensor-split` as numbers, one per GPU (None when not given): each finite and not
    /// negative, at most `MAX_DEVICES` of them, not all zero.
    pub fn tensor_split_values(&self) -> Result<Option<Vec<f32>>, ConfigError> {
        let Some(text) = &self.tensor_split else {
            return Ok(None);
        };
        let bad = |why: &str| ConfigError::TensorSplit {
            value: text.clone(),
            reason: why.to_string(),
        };
        let values = text
            .split([',', '/'])
            .map(|part| {
                let part = part.trim();
                let value: f32 = part
                    .parse()
                    .map_err(|_| bad(&format!("{part:?} is not a number")))?;
                if !value.is_finite() || value < 0.0 {
                    return Err(bad(&format!("{part} is not a finite share of 0 or more")));
                }
                Ok(value)
            })
            .collect::<Result<Vec<f32>, ConfigError>>()?;
        if values.len() > usize::try_from(MAX_DEVICES).unwrap_or(usize::MAX) {
            return Err(bad(&format!("at most {MAX_DEVICES} devices")));
        }
        if values.iter().all(|v| *v == 0.0) {
            return Err(bad("at least one share must be above 0"));
        }
        Ok(Some(values))
    }
}
