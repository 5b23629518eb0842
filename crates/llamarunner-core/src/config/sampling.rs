//! The server's sampling defaults (llama-server's `--temp`, `--top-k`, `--repeat-penalty`,
//! `--mirostat`... flags): checked at start by the rules a request's own values keep
//! (`requests::validate::check_options`), so that no default can make every request fail, and
//! handed to the dialects as `SamplingDefaults`.

use super::{ConfigError, RunnerConfig};
use crate::protocol::params::SamplingDefaults;

impl RunnerConfig {
    /// Checks the sampling defaults (`validate`).
    pub(super) fn validate_sampling(&self) -> Result<(), ConfigError> {
        let unit = |v: f32| (0.0..=1.0).contains(&v);
        let non_negative = |v: f32| v.is_finite() && v >= 0.0;
        for (name, value, ok, rule) in [
            (
                "temp",
                self.temp,
                self.temp.is_none_or(|t| t.is_finite() && t >= 0.0),
                "a number >= 0",
            ),
            (
                "top-p",
                self.top_p,
                self.top_p.is_none_or(unit),
                "between 0 and 1",
            ),
            (
                "min-p",
                self.min_p,
                self.min_p.is_none_or(unit),
                "between 0 and 1",
            ),
            (
                "typical",
                self.typical,
                self.typical.is_none_or(unit),
                "between 0 and 1",
            ),
            (
                "repeat-penalty",
                self.repeat_penalty,
                self.repeat_penalty.is_none_or(non_negative),
                "a number >= 0",
            ),
            (
                "presence-penalty",
                self.presence_penalty,
                self.presence_penalty.is_none_or(f32::is_finite),
                "a finite number",
            ),
            (
                "frequency-penalty",
                self.frequency_penalty,
                self.frequency_penalty.is_none_or(f32::is_finite),
                "a finite number",
            ),
            (
                "mirostat-lr",
                self.mirostat_lr,
                self.mirostat_lr.is_none_or(non_negative),
                "a number >= 0",
            ),
            (
                "mirostat-ent",
                self.mirostat_ent,
                self.mirostat_ent.is_none_or(non_negative),
                "a number >= 0",
            ),
        ] {
            if !ok {
                return Err(ConfigError::BadSampling {
                    name,
                    rule,
                    value: format!("{}", value.unwrap_or_default()),
                });
            }
        }
        if self.n_predict.is_some_and(|n| n < -1) {
            return Err(ConfigError::BadSampling {
                name: "n-predict",
                rule: "-1 (no default) or more",
                value: format!("{}", self.n_predict.unwrap_or_default()),
            });
        }
        if self.top_k.is_some_and(|k| k < 0) {
            return Err(ConfigError::BadSampling {
                name: "top-k",
                rule: "0 (off) or more",
                value: format!("{}", self.top_k.unwrap_or_default()),
            });
        }
        for (name, value, ok, rule) in [
            (
                "repeat-last-n",
                self.repeat_last_n,
                self.repeat_last_n.is_none_or(|n| n >= -1),
                "-1 (the slot) or more",
            ),
            (
                "mirostat",
                self.mirostat,
                self.mirostat.is_none_or(|m| (0..=2).contains(&m)),
                "0 (off), 1 or 2",
            ),
        ] {
            if !ok {
                return Err(ConfigError::BadSampling {
                    name,
                    rule,
                    value: format!("{}", value.unwrap_or_default()),
                });
            }
        }
        Ok(())
    }

    /// The sampling defaults of requests that leave fields out (`--temp`, `--top-k`...).
    pub fn sampling_defaults(&self) -> SamplingDefaults {
        SamplingDefaults {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            mirostat: self.mirostat,
            mirostat_eta: self.mirostat_lr,
            mirostat_tau: self.mirostat_ent,
            typical_p: self.typical,
            n_predict: self.n_predict.filter(|n| *n >= 0).map(i64::from),
            shift: (!self.context_shift).then_some(false),
        }
    }
}
