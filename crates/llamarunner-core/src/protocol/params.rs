//! Generation controls of one request, with the Ollama runner's names and defaults. A plain
//! struct: the wire forms live in `dialects/` and `requests::validate` checks every value before a
//! request reaches the engine.

/// Without `--max-tokens`, a request generates at most this many slot contexts' worth of tokens
/// (with `num_predict` -1, or any larger number, which `requests::validate` caps): a model stuck
/// in a loop with context shift, or a request for 2^31 tokens with `ignore_eos`, cannot hold its
/// slot for good.
pub const UNCAPPED_SLOT_CONTEXTS: usize = 10;

/// The server's sampling defaults (llama-server's `--temp`, `--top-k`, `--top-p`, `--min-p`,
/// the penalties', Mirostat's and typical sampling's):
/// what a request that leaves a field out gets, in every dialect, before the dialect's own
/// default. None: the dialect's default.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_k: Option<i32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    /// `--repeat-penalty`, `--repeat-last-n`, `--presence-penalty`, `--frequency-penalty`,
    /// `--mirostat`, `--mirostat-lr` (eta), `--mirostat-ent` (tau), `--typical`.
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub mirostat: Option<i32>,
    pub mirostat_eta: Option<f32>,
    pub mirostat_tau: Option<f32>,
    pub typical_p: Option<f32>,
    /// `--dry-multiplier`, `--dry-base`, `--dry-allowed-length`, `--dry-penalty-last-n`,
    /// `--xtc-probability`, `--xtc-threshold`, `--top-n-sigma`, `--dynatemp-range`,
    /// `--dynatemp-exp` (`ExtraSamplers`).
    pub dry_multiplier: Option<f32>,
    pub dry_base: Option<f32>,
    pub dry_allowed_length: Option<i32>,
    pub dry_penalty_last_n: Option<i32>,
    pub xtc_probability: Option<f32>,
    pub xtc_threshold: Option<f32>,
    pub top_n_sigma: Option<f32>,
    pub dynatemp_range: Option<f32>,
    pub dynatemp_exponent: Option<f32>,
    /// Tokens to generate (`--n-predict`), for a request that names no limit.
    pub n_predict: Option<i64>,
    /// Context shift (`--no-context-shift`: false), for a request that does not say (`shift`,
    /// at the body's top level in every format; `fill_left_out` only).
    pub shift: Option<bool>,
}

/// The names a request's limit on generated tokens has in the dialects: OpenAI's (and
/// Anthropic's) `max_tokens` and `max_completion_tokens`, llama-server's `n_predict`,
/// Ollama's `num_predict`, the Responses API's `max_output_tokens`.
const LIMIT_FIELDS: [&str; 5] = [
    "max_tokens",
    "max_completion_tokens",
    "n_predict",
    "num_predict",
    "max_output_tokens",
];

impl SamplingDefaults {
    /// Whether no default is set.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Fills what a request left out of its sampling: `body` is the request's JSON, the
    /// fields at its top level, or in its `options` for the Ollama formats (`in_options`). A
    /// field sent as null counts as left out. The body is read only when a default is set.
    pub fn fill_left_out(&self, p: &mut SamplingParams, body: &[u8], in_options: bool) {
        if self.is_empty() {
            return;
        }
        let Ok(serde_json::Value::Object(fields)) = serde_json::from_slice(body) else {
            return;
        };
        if let Some(shift) = self.shift {
            if fields.get("shift").is_none_or(serde_json::Value::is_null) {
                p.shift = shift;
            }
        }
        let scope = if in_options {
            fields
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case("options"))
                .and_then(|(_, v)| v.as_object())
        } else {
            Some(&fields)
        };
        self.fill(p, |name| {
            scope.is_some_and(|m| {
                m.iter().any(|(k, v)| {
                    k.eq_ignore_ascii_case(name)
                        // llama-server's `n_predict: -1` asks for the server's default (an
                        // Ollama `num_predict` of -1 means no limit: the request's own).
                        && !(v.is_null() || name == "n_predict" && v.as_i64() == Some(-1))
                })
            })
        });
    }

    /// Sets in `p` each default the request left out (`given(field)`: whether it sent it,
    /// under the wire names every dialect shares: temperature, top_k, top_p, min_p,
    /// repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, mirostat,
    /// mirostat_eta, mirostat_tau, typical_p, the DRY, XTC, top-n-sigma and dynamic
    /// temperature fields, shift, and the limit's names in `LIMIT_FIELDS`).
    pub fn fill(&self, p: &mut SamplingParams, given: impl Fn(&str) -> bool) {
        let floats = [
            (self.temperature, "temperature", &mut p.temperature),
            (self.top_p, "top_p", &mut p.top_p),
            (self.min_p, "min_p", &mut p.min_p),
            (self.repeat_penalty, "repeat_penalty", &mut p.repeat_penalty),
            (
                self.presence_penalty,
                "presence_penalty",
                &mut p.presence_penalty,
            ),
            (
                self.frequency_penalty,
                "frequency_penalty",
                &mut p.frequency_penalty,
            ),
            (self.mirostat_eta, "mirostat_eta", &mut p.mirostat_eta),
            (self.mirostat_tau, "mirostat_tau", &mut p.mirostat_tau),
            (self.typical_p, "typical_p", &mut p.typical_p),
            (
                self.dry_multiplier,
                "dry_multiplier",
                &mut p.samplers.dry_multiplier,
            ),
            (self.dry_base, "dry_base", &mut p.samplers.dry_base),
            (
                self.xtc_probability,
                "xtc_probability",
                &mut p.samplers.xtc_probability,
            ),
            (
                self.xtc_threshold,
                "xtc_threshold",
                &mut p.samplers.xtc_threshold,
            ),
            (self.top_n_sigma, "top_n_sigma", &mut p.samplers.top_n_sigma),
            (
                self.dynatemp_range,
                "dynatemp_range",
                &mut p.samplers.dynatemp_range,
            ),
            (
                self.dynatemp_exponent,
                "dynatemp_exponent",
                &mut p.samplers.dynatemp_exponent,
            ),
        ];
        for (default, name, field) in floats {
            if let (Some(v), false) = (default, given(name)) {
                *field = v;
            }
        }
        let ints = [
            (self.top_k, "top_k", &mut p.top_k),
            (self.repeat_last_n, "repeat_last_n", &mut p.repeat_last_n),
            (self.mirostat, "mirostat", &mut p.mirostat),
            (
                self.dry_allowed_length,
                "dry_allowed_length",
                &mut p.samplers.dry_allowed_length,
            ),
            (
                self.dry_penalty_last_n,
                "dry_penalty_last_n",
                &mut p.samplers.dry_penalty_last_n,
            ),
        ];
        for (default, name, field) in ints {
            if let (Some(v), false) = (default, given(name)) {
                *field = v;
            }
        }
        if let Some(v) = self
            .n_predict
            .filter(|_| !LIMIT_FIELDS.iter().any(|f| given(f)))
        {
            p.num_predict = v;
        }
    }
}

/// Sampling and stopping parameters of one request, as the engine receives them: validated
/// and clamped by `requests::validate` (the wire form is `requests::options::Options`).
#[derive(Clone, Debug, PartialEq)]
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
    pub stop: Vec<String>,
    /// Keep generating after an end-of-generation token (benchmarks).
    pub ignore_eos: bool,
    /// The grammar constraining the output (the request's `grammar`, `format`,
    /// `response_format` or tools), compiled by the validation layer.
    pub grammar: Option<crate::constrain::Grammar>,
    /// Shift the context when the slot fills (the request's top-level `shift`); false ends the
    /// sequence with "length" instead.
    pub shift: bool,
    /// Truncate a prompt that does not fit the slot (top-level `truncate`); false rejects it.
    pub truncate: bool,
    /// Added to the logits of these tokens before sampling (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(crate::protocol::Token, f32)>,
    /// Report each sampled token's log-probability and this many alternatives (None = off).
    pub logprobs: Option<usize>,
    /// Report them after the sampler chain instead of the model's (llama-server's
    /// `post_sampling_probs`): the sampled token's and the most probable survivors' shares of
    /// the distribution the chain sampled from.
    pub post_sampling_probs: bool,
    /// Tokens whose log-probabilities (the model's) are reported at each position besides
    /// the top ones (`TokenLogprob::asked`): a generative model's "yes" and "no" when it
    /// reranks.
    pub logprobs_of: Vec<crate::protocol::Token>,
    /// LoRA adapter scales (None: the server's defaults, which the HTTP side fills in before
    /// the queue; the engine reads None as the base model).
    pub lora: Option<crate::protocol::LoraScales>,
    /// Draft tokens by prompt lookup (the request's top-level `speculative`); None: the
    /// server's default, on for greedy requests when `--draft-max` is above 0.
    pub speculative: Option<bool>,
    /// Reuse a cached prefix of the prompt (a slot's, a fork's or the prompt cache's); false
    /// decodes the whole prompt (llama-server's `cache_prompt`).
    pub cache_prompt: bool,
    /// The request asks for deterministic output (its `deterministic` field): refused unless
    /// the server runs `--deterministic`, where every request is.
    pub deterministic: bool,
    /// Report the prompt's decode as it goes (`Event::Progress`; llama-server's
    /// `return_progress`).
    pub return_progress: bool,
    /// DRY, XTC, top-n-sigma and dynamic temperature (llama-server's samplers), off by default.
    pub samplers: ExtraSamplers,
}

/// The samplers llama-server has beyond Ollama's, under its names and defaults; each is off at
/// its default.
#[derive(Clone, Debug, PartialEq)]
pub struct ExtraSamplers {
    /// DRY ("don't repeat yourself") penalty strength; 0 = off.
    pub dry_multiplier: f32,
    /// DRY's base: the penalty grows as base^(repeat length - allowed length).
    pub dry_base: f32,
    /// Repeats up to this length are not penalized.
    pub dry_allowed_length: i32,
    /// Tokens DRY looks back over; -1 = the slot (clamped to it).
    pub dry_penalty_last_n: i32,
    /// Strings a repeat does not extend across.
    pub dry_sequence_breakers: Vec<String>,
    /// XTC ("exclude top choices"): how often it acts; 0 = off.
    pub xtc_probability: f32,
    /// XTC removes every token above this probability but the least likely of them.
    pub xtc_threshold: f32,
    /// Keep tokens within n standard deviations of the best logit; <= 0 = off.
    pub top_n_sigma: f32,
    /// Dynamic temperature: the temperature ranges over temperature ± this by the entropy;
    /// 0 = off.
    pub dynatemp_range: f32,
    /// How the entropy maps onto that range.
    pub dynatemp_exponent: f32,
}

impl Default for ExtraSamplers {
    fn default() -> Self {
        Self {
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: -1,
            dry_sequence_breakers: ["\n", ":", "\"", "*"].map(String::from).to_vec(),
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            top_n_sigma: -1.0,
            dynatemp_range: 0.0,
            dynatemp_exponent: 1.0,
        }
    }
}

impl ExtraSamplers {
    /// DRY acts (llama.cpp's own conditions).
    pub fn dry(&self) -> bool {
        self.dry_multiplier > 0.0 && self.dry_base >= 1.0 && self.dry_penalty_last_n != 0
    }
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
            post_sampling_probs: false,
            logprobs_of: Vec::new(),
            lora: None,
            speculative: None,
            cache_prompt: true,
            deterministic: false,
            return_progress: false,
            samplers: ExtraSamplers::default(),
        }
    }
}

impl SamplingParams {
    /// Whether sampling is deterministic argmax.
    pub fn greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// The seed llama.cpp's samplers get: a random one for -1.
    pub fn effective_seed(&self) -> u32 {
        if self.seed < 0 {
            rand::random()
        } else {
            // Seeds above u32::MAX wrap, as in Ollama (which passes uint32(seed)). The one
            // value llama.cpp reads as "random" (LLAMA_DEFAULT_SEED, 0xFFFFFFFF) becomes its
            // neighbour, so every explicit seed is repeatable.
            match (self.seed as u64 & 0xFFFF_FFFF) as u32 {
                u32::MAX => u32::MAX - 1,
                s => s,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_wrap_like_ollama_and_minus_one_is_random() {
        let p = |seed| SamplingParams {
            seed,
            ..Default::default()
        };
        assert_eq!(p(7).effective_seed(), 7);
        assert_eq!(p((1 << 32) + 5).effective_seed(), 5);
        // llama.cpp's "random" seed is never passed for an explicit one.
        assert_eq!(p(u32::MAX as i64).effective_seed(), u32::MAX - 1);
        assert_eq!(p(i64::MAX).effective_seed(), u32::MAX - 1);
        assert_eq!(p(u32::MAX as i64 - 1).effective_seed(), u32::MAX - 1);
        // Two random seeds differing is overwhelmingly likely; equal would be a constant.
        let a: Vec<u32> = (0..4).map(|_| p(-1).effective_seed()).collect();
        assert!(a.windows(2).any(|w| w[0] != w[1]), "{a:?}");
    }
}
