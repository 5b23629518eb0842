//! The wire form of generation options (`options` in native and Ollama requests).

use serde::{Deserialize, Deserializer};

use crate::protocol::params::{ExtraSamplers, SamplingParams};

/// The `options` object of native and Ollama requests: Ollama's names and defaults. Unknown
/// fields (Ollama's load-time options such as `num_ctx`) are ignored.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
pub struct Options {
    /// Tokens to generate; -1 = until EOG or the slot is full.
    pub num_predict: i64,
    /// Prompt tokens kept on truncation/shift; -1 = all.
    pub num_keep: i64,
    /// Softmax temperature; 0 = greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: i32,
    /// Nucleus sampling threshold; 1 = off.
    pub top_p: f32,
    /// Minimum probability relative to the best token; 0 = off.
    pub min_p: f32,
    /// Locally typical sampling; 1 = off.
    pub typical_p: f32,
    /// Window of recent tokens for the penalties; -1 = the whole context.
    pub repeat_last_n: i32,
    /// Multiplicative repetition penalty; 1 = off.
    pub repeat_penalty: f32,
    /// Additive penalty for tokens present in the window.
    pub presence_penalty: f32,
    /// Additive penalty per occurrence in the window.
    pub frequency_penalty: f32,
    /// 0 = off, 1 = mirostat, 2 = mirostat v2.
    pub mirostat: i32,
    /// Mirostat target entropy.
    pub mirostat_tau: f32,
    /// Mirostat learning rate.
    pub mirostat_eta: f32,
    /// RNG seed; -1 = random.
    pub seed: i64,
    /// Strings that end generation; never part of the output.
    #[serde(deserialize_with = "one_or_many")]
    pub stop: Vec<String>,
    /// Keep generating after an end-of-generation token (benchmarks).
    pub ignore_eos: bool,
    /// LoRA adapter scales (`[{"id", "scale"}]`, `requests/lora.rs`), checked by the handler
    /// against the loaded adapters; the Ollama API's way to give them.
    pub lora: Option<serde_json::Value>,
    /// Draft tokens by prompt lookup (speculative decoding); None: the server's default.
    pub speculative: Option<bool>,
    /// DRY, XTC, top-n-sigma, dynamic temperature.
    #[serde(flatten)]
    pub samplers: SamplerFields,
}

/// llama-server's sampler fields (`dry_*`, `xtc_*`, `top_n_sigma`, `dynatemp_*`), as every
/// dialect takes them (flattened into its request or `options`); absent ones are off.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SamplerFields {
    dry_multiplier: Option<f32>,
    dry_base: Option<f32>,
    dry_allowed_length: Option<i32>,
    dry_penalty_last_n: Option<i32>,
    dry_sequence_breakers: Option<Vec<String>>,
    xtc_probability: Option<f32>,
    xtc_threshold: Option<f32>,
    top_n_sigma: Option<f32>,
    dynatemp_range: Option<f32>,
    dynatemp_exponent: Option<f32>,
}

impl SamplerFields {
    /// The samplers, defaults where absent (checked later with the other options).
    pub fn samplers(&self) -> ExtraSamplers {
        let d = ExtraSamplers::default();
        ExtraSamplers {
            dry_multiplier: self.dry_multiplier.unwrap_or(d.dry_multiplier),
            dry_base: self.dry_base.unwrap_or(d.dry_base),
            dry_allowed_length: self.dry_allowed_length.unwrap_or(d.dry_allowed_length),
            dry_penalty_last_n: self.dry_penalty_last_n.unwrap_or(d.dry_penalty_last_n),
            dry_sequence_breakers: self
                .dry_sequence_breakers
                .clone()
                .unwrap_or(d.dry_sequence_breakers),
            xtc_probability: self.xtc_probability.unwrap_or(d.xtc_probability),
            xtc_threshold: self.xtc_threshold.unwrap_or(d.xtc_threshold),
            top_n_sigma: self.top_n_sigma.unwrap_or(d.top_n_sigma),
            dynatemp_range: self.dynatemp_range.unwrap_or(d.dynatemp_range),
            dynatemp_exponent: self.dynatemp_exponent.unwrap_or(d.dynatemp_exponent),
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options::from(SamplingParams::default())
    }
}

impl From<SamplingParams> for Options {
    fn from(p: SamplingParams) -> Self {
        Self {
            num_predict: p.num_predict,
            num_keep: p.num_keep,
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            typical_p: p.typical_p,
            repeat_last_n: p.repeat_last_n,
            repeat_penalty: p.repeat_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            mirostat: p.mirostat,
            mirostat_tau: p.mirostat_tau,
            mirostat_eta: p.mirostat_eta,
            seed: p.seed,
            stop: p.stop,
            ignore_eos: p.ignore_eos,
            lora: None,
            speculative: p.speculative,
            samplers: SamplerFields::default(),
        }
    }
}

impl Options {
    /// The engine's parameters with these options (grammar, shift, truncate and the rest at
    /// their defaults; the caller sets them from the request's top-level fields).
    pub fn into_params(self) -> SamplingParams {
        SamplingParams {
            num_predict: self.num_predict,
            num_keep: self.num_keep,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            typical_p: self.typical_p,
            repeat_last_n: self.repeat_last_n,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            mirostat: self.mirostat,
            mirostat_tau: self.mirostat_tau,
            mirostat_eta: self.mirostat_eta,
            seed: self.seed,
            stop: self.stop,
            ignore_eos: self.ignore_eos,
            speculative: self.speculative,
            samplers: self.samplers.samplers(),
            ..SamplingParams::default()
        }
    }
}

fn one_or_many<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
        Null(()),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
        OneOrMany::Null(()) => Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_default_is_ollamas() {
        let o: Options = serde_json::from_str("{}").unwrap();
        let expected = [
            ("num_predict", o.num_predict as f64, -1.0),
            ("num_keep", o.num_keep as f64, 4.0),
            ("temperature", o.temperature.into(), 0.8),
            ("top_k", o.top_k.into(), 40.0),
            ("top_p", o.top_p.into(), 0.9),
            ("min_p", o.min_p.into(), 0.0),
            ("typical_p", o.typical_p.into(), 1.0),
            ("repeat_last_n", o.repeat_last_n.into(), 64.0),
            ("repeat_penalty", o.repeat_penalty.into(), 1.1),
            ("presence_penalty", o.presence_penalty.into(), 0.0),
            ("frequency_penalty", o.frequency_penalty.into(), 0.0),
            ("mirostat", o.mirostat.into(), 0.0),
            ("mirostat_tau", o.mirostat_tau.into(), 5.0),
            ("mirostat_eta", o.mirostat_eta.into(), 0.1),
            ("seed", o.seed as f64, -1.0),
        ];
        for (name, got, want) in expected {
            assert!((got - want).abs() < 1e-6, "{name}: {got} != {want}");
        }
        assert!(o.stop.is_empty() && !o.ignore_eos && o.speculative.is_none());
        let p = o.into_params();
        assert!(p.shift && p.truncate && p.grammar.is_none() && p.logprobs.is_none());
    }

    #[test]
    fn stop_accepts_a_string_a_list_or_null() {
        let o: Options = serde_json::from_str(r#"{"stop":"x"}"#).unwrap();
        assert_eq!(o.stop, vec!["x"]);
        let o: Options = serde_json::from_str(r#"{"stop":["a","b"]}"#).unwrap();
        assert_eq!(o.stop, vec!["a", "b"]);
        let o: Options = serde_json::from_str(r#"{"stop":null}"#).unwrap();
        assert!(o.stop.is_empty());
        assert!(serde_json::from_str::<Options>(r#"{"top_k":"x"}"#).is_err());
        let o: Options = serde_json::from_str(r#"{"num_ctx":8192,"top_k":3}"#).unwrap();
        assert_eq!(o.top_k, 3);
    }

    #[test]
    fn llama_servers_samplers_are_read_and_checked() {
        let o: Options = serde_json::from_str(
            r#"{"dry_multiplier":0.8,"dry_sequence_breakers":["\n"],"xtc_probability":0.5,
                "top_n_sigma":1.5,"dynatemp_range":0.3,"top_k":7}"#,
        )
        .unwrap();
        let p = o.into_params();
        assert_eq!(p.top_k, 7);
        let s = &p.samplers;
        assert_eq!(
            (s.dry_multiplier, s.dry_base, s.dry_allowed_length),
            (0.8, 1.75, 2)
        );
        assert_eq!(s.dry_sequence_breakers, vec!["\n"]);
        assert_eq!((s.xtc_probability, s.xtc_threshold), (0.5, 0.1));
        assert_eq!(
            (s.top_n_sigma, s.dynatemp_range, s.dynatemp_exponent),
            (1.5, 0.3, 1.0)
        );
        assert!(s.dry());
        crate::requests::validate::check_options(&p).unwrap();
        let d = Options::default().into_params();
        assert!(!d.samplers.dry() && d.samplers == ExtraSamplers::default());
        for body in [
            r#"{"dry_multiplier":-1}"#,
            r#"{"dry_multiplier":1000}"#,
            r#"{"dry_allowed_length":-1}"#,
            r#"{"dry_penalty_last_n":-2}"#,
            r#"{"dry_sequence_breakers":[""]}"#,
            r#"{"dry_sequence_breakers":["a\u0000b"]}"#,
            r#"{"dry_sequence_breakers":["aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]}"#,
            r#"{"dry_sequence_breakers":["1","2","3","4","5","6","7","8","9","10","11","12","13","14","15","16","17"]}"#,
            r#"{"xtc_probability":1.5}"#,
            r#"{"xtc_threshold":-0.1}"#,
            r#"{"top_n_sigma":1000}"#,
            r#"{"dynatemp_range":-1}"#,
            r#"{"dynatemp_exponent":-1}"#,
        ] {
            let p = serde_json::from_str::<Options>(body).unwrap().into_params();
            assert!(
                crate::requests::validate::check_options(&p).is_err(),
                "{body} was accepted"
            );
        }
        assert!(serde_json::from_str::<Options>(r#"{"dry_sequence_breakers":"x"}"#).is_err());
    }

    #[test]
    fn the_server_s_defaults_fill_only_what_a_request_left_out() {
        use crate::protocol::params::SamplingDefaults;
        let defaults = SamplingDefaults {
            temperature: Some(0.0),
            top_k: Some(7),
            top_p: None,
            min_p: Some(0.2),
            ..SamplingDefaults::default()
        };
        let base = SamplingParams::default();
        let fill = |body: &str, in_options: bool| {
            let mut p = base.clone();
            defaults.fill_left_out(&mut p, body.as_bytes(), in_options);
            (p.temperature, p.top_k, p.top_p, p.min_p)
        };
        // Left out: the server's; sent: the request's (the caller parsed it); top_p has no
        // server default.
        assert_eq!(fill(r#"{"prompt": "x"}"#, false), (0.0, 7, base.top_p, 0.2));
        assert_eq!(
            fill(r#"{"temperature": 0.5, "TOP_K": 3}"#, false),
            (base.temperature, base.top_k, base.top_p, 0.2)
        );
        assert_eq!(
            fill(r#"{"temperature": null}"#, false),
            (0.0, 7, base.top_p, 0.2)
        );
        // The Ollama formats' options.
        assert_eq!(
            fill(r#"{"temperature": 0.5, "options": {"top_k": 3}}"#, true),
            (0.0, base.top_k, base.top_p, 0.2)
        );
        assert_eq!(
            fill("not json", false),
            (base.temperature, base.top_k, base.top_p, base.min_p)
        );
        let mut p = base.clone();
        SamplingDefaults::default().fill_left_out(&mut p, b"{}", false);
        assert_eq!(p, base);
    }

    #[test]
    fn the_penalty_mirostat_and_typical_defaults_fill_what_a_request_left_out() {
        use crate::protocol::params::SamplingDefaults;
        let defaults = SamplingDefaults {
            repeat_penalty: Some(1.3),
            repeat_last_n: Some(16),
            presence_penalty: Some(0.5),
            frequency_penalty: Some(0.25),
            mirostat: Some(2),
            mirostat_eta: Some(0.2),
            mirostat_tau: Some(4.0),
            typical_p: Some(0.9),
            ..SamplingDefaults::default()
        };
        let base = SamplingParams::default();
        let fill = |body: &str, in_options: bool| {
            let mut p = base.clone();
            defaults.fill_left_out(&mut p, body.as_bytes(), in_options);
            p
        };
        let all = fill(r#"{"prompt": "x"}"#, false);
        assert_eq!(
            (all.repeat_penalty, all.repeat_last_n, all.presence_penalty),
            (1.3, 16, 0.5)
        );
        assert_eq!((all.frequency_penalty, all.mirostat), (0.25, 2));
        assert_eq!(
            (all.mirostat_eta, all.mirostat_tau, all.typical_p),
            (0.2, 4.0, 0.9)
        );
        // Each sent (at the top level, or in Ollama's options) keeps the request's value.
        let sent = fill(
            r#"{"options": {"repeat_penalty": 1.0, "mirostat": 0, "typical_p": 1.0}}"#,
            true,
        );
        assert_eq!(
            (sent.repeat_penalty, sent.mirostat, sent.typical_p),
            (base.repeat_penalty, base.mirostat, base.typical_p)
        );
        assert_eq!(sent.presence_penalty, 0.5);
        let sent = fill(r#"{"frequency_penalty": 0, "mirostat_tau": 5}"#, false);
        assert_eq!(
            (sent.frequency_penalty, sent.mirostat_tau),
            (base.frequency_penalty, base.mirostat_tau)
        );
        assert_eq!(sent.repeat_last_n, 16);
    }

    #[test]
    fn the_dry_xtc_sigma_and_dynatemp_defaults_fill_what_a_request_left_out() {
        use crate::protocol::params::SamplingDefaults;
        let defaults = SamplingDefaults {
            dry_multiplier: Some(0.8),
            dry_base: Some(2.0),
            dry_allowed_length: Some(3),
            dry_penalty_last_n: Some(64),
            xtc_probability: Some(0.5),
            xtc_threshold: Some(0.2),
            top_n_sigma: Some(1.5),
            dynatemp_range: Some(0.3),
            dynatemp_exponent: Some(1.5),
            ..SamplingDefaults::default()
        };
        let base = SamplingParams::default();
        let fill = |body: &str, in_options: bool| {
            let mut p = base.clone();
            defaults.fill_left_out(&mut p, body.as_bytes(), in_options);
            p.samplers
        };
        let all = fill(r#"{"prompt": "x"}"#, false);
        assert_eq!(
            (all.dry_multiplier, all.dry_base, all.dry_allowed_length),
            (0.8, 2.0, 3)
        );
        assert_eq!(
            (
                all.dry_penalty_last_n,
                all.xtc_probability,
                all.xtc_threshold
            ),
            (64, 0.5, 0.2)
        );
        assert_eq!(
            (all.top_n_sigma, all.dynatemp_range, all.dynatemp_exponent),
            (1.5, 0.3, 1.5)
        );
        // Each sent keeps the request's value (parsed by the caller: the base's here).
        let d = &base.samplers;
        let sent = fill(
            r#"{"options": {"dry_multiplier": 0, "xtc_threshold": 0.1, "dynatemp_exponent": 1}}"#,
            true,
        );
        assert_eq!(
            (
                sent.dry_multiplier,
                sent.xtc_threshold,
                sent.dynatemp_exponent
            ),
            (d.dry_multiplier, d.xtc_threshold, d.dynatemp_exponent)
        );
        assert_eq!((sent.dry_base, sent.top_n_sigma), (2.0, 1.5));
        let sent = fill(r#"{"dry_allowed_length": 2, "top_n_sigma": null}"#, false);
        assert_eq!(
            (sent.dry_allowed_length, sent.top_n_sigma),
            (d.dry_allowed_length, 1.5)
        );
    }

    #[test]
    fn the_server_s_token_limit_fills_a_request_that_names_none() {
        use crate::protocol::params::SamplingDefaults;
        let defaults = SamplingDefaults {
            n_predict: Some(64),
            ..SamplingDefaults::default()
        };
        let limit = |body: &str, in_options: bool| {
            let mut p = SamplingParams {
                num_predict: 5,
                ..SamplingParams::default()
            };
            defaults.fill_left_out(&mut p, body.as_bytes(), in_options);
            p.num_predict
        };
        assert_eq!(limit(r#"{"prompt": "x"}"#, false), 64);
        // Any dialect's name for the limit is the request's own (the caller parsed it).
        for name in [
            "max_tokens",
            "max_completion_tokens",
            "n_predict",
            "max_output_tokens",
        ] {
            assert_eq!(limit(&format!(r#"{{"{name}": 80}}"#), false), 5, "{name}");
            // Null asks for the server's.
            assert_eq!(
                limit(&format!(r#"{{"{name}": null}}"#), false),
                64,
                "{name}"
            );
        }
        // llama-server's -1 asks for the server's too; Ollama's -1 is "no limit", its own.
        assert_eq!(limit(r#"{"n_predict": -1}"#, false), 64);
        assert_eq!(limit(r#"{"options": {"num_predict": -1}}"#, true), 5);
        assert_eq!(limit(r#"{"options": {"num_predict": 80}}"#, true), 5);
        assert_eq!(limit(r#"{"num_predict": 80}"#, true), 64);
        // `--no-context-shift`: a request that does not say `shift` (at the top level, in
        // every format) does not shift.
        let no_shift = SamplingDefaults {
            shift: Some(false),
            ..SamplingDefaults::default()
        };
        let shift = |body: &str, in_options: bool| {
            let mut p = SamplingParams::default();
            no_shift.fill_left_out(&mut p, body.as_bytes(), in_options);
            p.shift
        };
        assert!(!shift(r#"{"prompt": "x"}"#, false));
        assert!(!shift(r#"{"options": {"shift": true}}"#, true));
        assert!(shift(r#"{"shift": true, "options": {}}"#, true));
        assert!(shift(r#"{"shift": true}"#, false));
        // -1 for a temperature is the request's (it is refused as out of range).
        let mut p = SamplingParams::default();
        SamplingDefaults {
            temperature: Some(0.5),
            ..SamplingDefaults::default()
        }
        .fill_left_out(&mut p, br#"{"temperature": -1}"#, false);
        assert_eq!(p.temperature, SamplingParams::default().temperature);
    }
}
