//! Generation controls of one request, with the Ollama runner's option names and defaults.

use serde::{Deserialize, Deserializer};

/// Sampling and stopping parameters (`options` of a completion request).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
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
    /// GBNF grammar constraining the output (the request's top-level `grammar` or `format`).
    #[serde(skip)]
    pub grammar: Option<String>,
    /// Shift the context when the slot fills (the request's top-level `shift`); false ends the
    /// sequence with "length" instead.
    #[serde(skip)]
    pub shift: bool,
    /// Truncate a prompt that does not fit the slot (top-level `truncate`); false rejects it.
    #[serde(skip)]
    pub truncate: bool,
    /// Added to the logits of these tokens before sampling (OpenAI's `logit_bias`).
    #[serde(skip)]
    pub logit_bias: Vec<(crate::engine::Token, f32)>,
    /// Report each sampled token's log-probability and this many alternatives (None = off).
    #[serde(skip)]
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            num_predict: -1,
            num_keep: 4,
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.0,
            typical_p: 1.0,
            repeat_last_n: 64,
            repeat_penalty: 1.1,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            mirostat: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
            seed: -1,
            stop: Vec::new(),
            ignore_eos: false,
            grammar: None,
            shift: true,
            truncate: true,
            logit_bias: Vec::new(),
            logprobs: None,
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

impl SamplingParams {
    /// Checks the values that have no meaning; returns a sentence naming the option.
    pub fn validate(&self) -> Result<(), String> {
        if self.num_predict < -1 {
            return Err(format!(
                "options.num_predict must be -1 (unlimited) or >= 0, got {}",
                self.num_predict
            ));
        }
        let finite = [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("typical_p", self.typical_p),
            ("repeat_penalty", self.repeat_penalty),
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
            ("mirostat_tau", self.mirostat_tau),
            ("mirostat_eta", self.mirostat_eta),
        ];
        for (name, v) in finite {
            if !v.is_finite() {
                return Err(format!("options.{name} must be a finite number"));
            }
        }
        if self.temperature < 0.0 {
            return Err("options.temperature must be >= 0".into());
        }
        for (name, v) in [
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("typical_p", self.typical_p),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("options.{name} must be between 0 and 1, got {v}"));
            }
        }
        if self.top_k < 0 {
            return Err("options.top_k must be >= 0".into());
        }
        if !(0..=2).contains(&self.mirostat) {
            return Err("options.mirostat must be 0, 1 or 2".into());
        }
        if self.repeat_last_n < -1 {
            return Err("options.repeat_last_n must be -1 or >= 0".into());
        }
        if self.stop.iter().any(String::is_empty) {
            return Err("options.stop must not contain empty strings".into());
        }
        Ok(())
    }

    /// Whether sampling is deterministic argmax.
    pub fn greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// The seed llama.cpp's samplers get: a random one for -1.
    pub fn effective_seed(&self) -> u32 {
        if self.seed < 0 {
            rand::random()
        } else {
            // Seeds above u32::MAX wrap, as in Ollama (which passes uint32(seed)).
            (self.seed as u64 & 0xFFFF_FFFF) as u32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_ollama() {
        let p: SamplingParams = serde_json::from_str("{}").unwrap();
        assert_eq!(p, SamplingParams::default());
        assert_eq!(p.temperature, 0.8);
        assert_eq!(p.top_k, 40);
        assert_eq!(p.num_predict, -1);
    }

    #[test]
    fn stop_accepts_a_string_or_a_list() {
        let p: SamplingParams = serde_json::from_str(r#"{"stop":"x"}"#).unwrap();
        assert_eq!(p.stop, vec!["x"]);
        let p: SamplingParams = serde_json::from_str(r#"{"stop":["a","b"]}"#).unwrap();
        assert_eq!(p.stop, vec!["a", "b"]);
    }

    #[test]
    fn bad_values_name_the_option() {
        let p = SamplingParams {
            num_predict: -2,
            ..Default::default()
        };
        assert!(p.validate().unwrap_err().contains("num_predict"));
        let p = SamplingParams {
            top_p: 1.5,
            ..Default::default()
        };
        assert!(p.validate().unwrap_err().contains("top_p"));
        assert!(serde_json::from_str::<SamplingParams>(r#"{"top_k":"x"}"#).is_err());
    }
}
