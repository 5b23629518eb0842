//! The server's sampling defaults (llama-server's `--temp`, `--top-k`, `--repeat-penalty`,
//! `--mirostat`, `--dry-multiplier`, `--xtc-probability`... flags): checked at start by the rules a request's own values keep
//! (`requests::validate::check_options`), so that no default can make every request fail, and
//! handed to the dialects as `SamplingDefaults`.

use super::{ConfigError, RunnerConfig};
use crate::protocol::params::SamplingDefaults;

impl RunnerConfig {
    /// Checks the sampling defaults (`validate`): the first one out of its range is the error.
    pub(super) fn validate_sampling(&self) -> Result<(), ConfigError> {
        let unit = |v: f32| (0.0..=1.0).contains(&v);
        let non_negative = |v: f32| v.is_finite() && v >= 0.0;
        let up_to = |max: f32| move |v: f32| (0.0..=max).contains(&v);
        // Each default: its flag, whether it keeps its rule, its value as given, the rule.
        let checks = [
            (
                "temp",
                self.temp.is_none_or(non_negative),
                given(self.temp),
                "a number >= 0",
            ),
            (
                "top-p",
                self.top_p.is_none_or(unit),
                given(self.top_p),
                "between 0 and 1",
            ),
            (
                "min-p",
                self.min_p.is_none_or(unit),
                given(self.min_p),
                "between 0 and 1",
            ),
            (
                "typical",
                self.typical.is_none_or(unit),
                given(self.typical),
                "between 0 and 1",
            ),
            (
                "repeat-penalty",
                self.repeat_penalty.is_none_or(non_negative),
                given(self.repeat_penalty),
                "a number >= 0",
            ),
            (
                "presence-penalty",
                self.presence_penalty.is_none_or(f32::is_finite),
                given(self.presence_penalty),
                "a finite number",
            ),
            (
                "frequency-penalty",
                self.frequency_penalty.is_none_or(f32::is_finite),
                given(self.frequency_penalty),
                "a finite number",
            ),
            (
                "mirostat-lr",
                self.mirostat_lr.is_none_or(non_negative),
                given(self.mirostat_lr),
                "a number >= 0",
            ),
            (
                "mirostat-ent",
                self.mirostat_ent.is_none_or(non_negative),
                given(self.mirostat_ent),
                "a number >= 0",
            ),
            (
                "n-predict",
                self.n_predict.is_none_or(|n| n >= -1),
                given(self.n_predict),
                "-1 (no default) or more",
            ),
            (
                "top-k",
                self.top_k.is_none_or(|k| k >= 0),
                given(self.top_k),
                "0 (off) or more",
            ),
            (
                "repeat-last-n",
                self.repeat_last_n.is_none_or(|n| n >= -1),
                given(self.repeat_last_n),
                "-1 (the slot) or more",
            ),
            (
                "mirostat",
                self.mirostat.is_none_or(|m| (0..=2).contains(&m)),
                given(self.mirostat),
                "0 (off), 1 or 2",
            ),
            (
                "dry-multiplier",
                self.dry_multiplier.is_none_or(up_to(100.0)),
                given(self.dry_multiplier),
                "between 0 and 100",
            ),
            (
                "dry-base",
                self.dry_base.is_none_or(up_to(100.0)),
                given(self.dry_base),
                "between 0 and 100",
            ),
            (
                "dry-allowed-length",
                self.dry_allowed_length.is_none_or(|n| n >= 0),
                given(self.dry_allowed_length),
                "0 or more",
            ),
            (
                "dry-penalty-last-n",
                self.dry_penalty_last_n.is_none_or(|n| n >= -1),
                given(self.dry_penalty_last_n),
                "-1 (the slot) or more",
            ),
            (
                "xtc-probability",
                self.xtc_probability.is_none_or(unit),
                given(self.xtc_probability),
                "between 0 and 1",
            ),
            (
                "xtc-threshold",
                self.xtc_threshold.is_none_or(unit),
                given(self.xtc_threshold),
                "between 0 and 1",
            ),
            (
                "top-n-sigma",
                self.top_n_sigma.is_none_or(|v| v.is_finite() && v <= 100.0),
                given(self.top_n_sigma),
                "at most 100 (0 or less: off)",
            ),
            (
                "dynatemp-range",
                self.dynatemp_range.is_none_or(up_to(10.0)),
                given(self.dynatemp_range),
                "between 0 and 10",
            ),
            (
                "dynatemp-exp",
                self.dynatemp_exp.is_none_or(up_to(100.0)),
                given(self.dynatemp_exp),
                "between 0 and 100",
            ),
        ];
        match checks.into_iter().find(|(_, ok, _, _)| !ok) {
            Some((name, _, value, rule)) => Err(ConfigError::BadSampling { name, rule, value }),
            None => Ok(()),
        }
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
            dry_multiplier: self.dry_multiplier,
            dry_base: self.dry_base,
            dry_allowed_length: self.dry_allowed_length,
            dry_penalty_last_n: self.dry_penalty_last_n,
            xtc_probability: self.xtc_probability,
            xtc_threshold: self.xtc_threshold,
            top_n_sigma: self.top_n_sigma,
            dynatemp_range: self.dynatemp_range,
            dynatemp_exponent: self.dynatemp_exp,
            n_predict: self.n_predict.filter(|n| *n >= 0).map(i64::from),
            shift: (!self.context_shift).then_some(false),
        }
    }
}

/// A default's value as an error message gives it (unset ones are never out of range).
fn given<T: std::fmt::Display + Default>(v: Option<T>) -> String {
    v.unwrap_or_default().to_string()
}
