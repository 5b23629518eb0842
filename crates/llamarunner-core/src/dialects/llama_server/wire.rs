//! llama-server's answers as they go on the wire: a `POST /completion` answer (whole, the
//! last event of a stream, or one of several prompts' answers) and a streamed chunk (text or
//! prompt progress), with their `completion_probabilities`, the sampling settings
//! (`generation_settings`, also `GET /props`'s `params`), `prompt_progress` and `timings`
//! (also on OpenAI's and Responses' answers). Fields are declared in the order they are
//! written (the workspace's serde_json keeps object keys in insertion order); what the answer
//! leaves out is an `Option` with `skip_serializing_if`. Floats the engine keeps as `f32` are
//! written as `f64` (as `json!` wrote them: `0.1f32` is `0.10000000149011612`).

use std::borrow::Cow;

use serde::Serialize;

use crate::protocol::params::SamplingParams;
use crate::protocol::{Token, TokenLogprob, TopLogprob};

/// The whole answer of `POST /completion`, the last event of its stream (no text, no tokens)
/// or one prompt's answer among several (each with its `index`); also OpenAI's `__verbose`.
#[derive(Debug, Serialize)]
pub(crate) struct Answer<'a> {
    /// Which prompt it answers (0 but among several prompts).
    pub(super) index: usize,
    /// The text generated (empty on a stream's last event).
    pub(super) content: &'a str,
    /// The generated tokens' ids with `return_tokens`, else empty.
    pub(super) tokens: Vec<Token>,
    /// Always -1: no slot is named.
    pub(super) id_slot: i64,
    /// Always true.
    pub(super) stop: bool,
    /// The model's name as served.
    pub(super) model: &'a str,
    /// Tokens generated.
    pub(super) tokens_predicted: usize,
    /// Prompt tokens, cached ones included.
    pub(super) tokens_evaluated: usize,
    /// The sampling it ran with.
    pub(super) generation_settings: &'a Settings,
    /// The prompt as text (empty for token ids given alone).
    pub(super) prompt: &'a str,
    /// Whether the generation wrote a new line.
    pub(super) has_new_line: bool,
    /// Whether the prompt was cut to fit.
    pub(super) truncated: bool,
    /// Why it ended: `eos`, `word` or `limit` (`stop_type`).
    pub(super) stop_type: &'static str,
    /// The stop string that ended it, else empty.
    pub(super) stopping_word: &'a str,
    /// Prompt and generated tokens, all in the cache now.
    pub(super) tokens_cached: usize,
    /// The engine's counts and times.
    pub(super) timings: Timings,
    /// With `n_probs`: each generated token's probability and the likeliest at its position.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) completion_probabilities: Option<Vec<Probability<'a>>>,
}

/// One streamed chunk that is not the last: some text, or how far the prompt's decode is
/// (`return_progress`).
#[derive(Debug, Serialize)]
pub(super) struct Chunk<'a> {
    /// Always 0: a stream has one prompt.
    pub(super) index: usize,
    /// The text added (empty on a progress chunk).
    pub(super) content: &'a str,
    /// With `return_tokens`: the ids of the tokens added, else empty.
    pub(super) tokens: Vec<Token>,
    /// Always false.
    pub(super) stop: bool,
    /// Always -1: no slot is named.
    pub(super) id_slot: i64,
    /// Tokens generated so far.
    pub(super) tokens_predicted: usize,
    /// Prompt tokens, cached ones included.
    pub(super) tokens_evaluated: usize,
    /// On a progress chunk: how far the prompt's decode is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) prompt_progress: Option<PromptProgress>,
    /// With `n_probs`: the added tokens' probabilities.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) completion_probabilities: Option<Vec<Probability<'a>>>,
    /// With `timings_per_token`: the timings so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) timings: Option<Timings>,
}

/// One token's entry in `completion_probabilities`: the token and the most likely tokens at
/// its position, as log-probabilities of the model's distribution (`top_logprobs`) or, with
/// `post_sampling_probs`, as probabilities of the sampler chain's (`top_probs`).
#[derive(Debug, Serialize)]
pub(super) struct Probability<'a> {
    /// The sampled token.
    #[serde(flatten)]
    pub(super) sampled: TokenProbability<'a>,
    /// The most likely tokens at its position, best first (the model's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) top_logprobs: Option<Vec<TokenProbability<'a>>>,
    /// The most probable tokens the sampler chain left, best first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) top_probs: Option<Vec<TokenProbability<'a>>>,
}

impl<'a> Probability<'a> {
    /// `l` as the model's log-probabilities, or (`post_sampling`) as the chain's
    /// probabilities.
    pub(super) fn new(l: &'a TokenLogprob, post_sampling: bool) -> Self {
        let entry = |t: &'a TopLogprob| TokenProbability::new(t, post_sampling);
        let top: Vec<TokenProbability<'a>> = l.top.iter().map(entry).collect();
        let (top_logprobs, top_probs) = if post_sampling {
            (None, Some(top))
        } else {
            (Some(top), None)
        };
        Self {
            sampled: entry(&l.sampled),
            top_logprobs,
            top_probs,
        }
    }
}

/// A token with its log-probability (or probability).
#[derive(Debug, Serialize)]
pub(super) struct TokenProbability<'a> {
    /// The token's id.
    pub(super) id: Token,
    /// Its text (lossy where it is part of a character).
    pub(super) token: Cow<'a, str>,
    /// The bytes it renders to.
    pub(super) bytes: &'a [u8],
    /// Natural log of its probability (the model's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) logprob: Option<f64>,
    /// Its probability (the sampler chain's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) prob: Option<f64>,
}

impl<'a> TokenProbability<'a> {
    fn new(t: &'a TopLogprob, as_probability: bool) -> Self {
        let logprob = f64::from(t.logprob);
        Self {
            id: t.token,
            token: String::from_utf8_lossy(&t.bytes),
            bytes: &t.bytes,
            logprob: (!as_probability).then_some(logprob),
            prob: as_probability.then(|| logprob.exp()),
        }
    }
}

/// The sampling a request runs with, under llama-server's names (`generation_settings`, and
/// `GET /props`'s `default_generation_settings.params`).
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Settings {
    /// Most tokens to generate (-1: no limit).
    pub(super) n_predict: i64,
    /// Prompt tokens kept when the context shifts.
    pub(super) n_keep: i64,
    /// The sampler's seed (-1: random).
    pub(super) seed: i64,
    /// Temperature.
    pub(super) temperature: f64,
    /// Top-k (0: off).
    pub(super) top_k: i32,
    /// Top-p.
    pub(super) top_p: f64,
    /// Min-p.
    pub(super) min_p: f64,
    /// Typical-p.
    pub(super) typical_p: f64,
    /// Tokens the repetition penalties look back over.
    pub(super) repeat_last_n: i32,
    /// Repetition penalty (1: off).
    pub(super) repeat_penalty: f64,
    /// Presence penalty.
    pub(super) presence_penalty: f64,
    /// Frequency penalty.
    pub(super) frequency_penalty: f64,
    /// Mirostat version (0: off).
    pub(super) mirostat: i32,
    /// Mirostat's target entropy.
    pub(super) mirostat_tau: f64,
    /// Mirostat's learning rate.
    pub(super) mirostat_eta: f64,
    /// DRY's strength (0: off), base, allowed length and window (-1: the slot).
    pub(super) dry_multiplier: f64,
    pub(super) dry_base: f64,
    pub(super) dry_allowed_length: i32,
    pub(super) dry_penalty_last_n: i32,
    /// XTC's probability (0: off) and threshold.
    pub(super) xtc_probability: f64,
    pub(super) xtc_threshold: f64,
    /// Top-n-sigma (0 or less: off).
    pub(super) top_n_sigma: f64,
    /// The dynamic temperature's range (0: off) and exponent.
    pub(super) dynatemp_range: f64,
    pub(super) dynatemp_exponent: f64,
    /// Whether the end-of-generation token is ignored.
    pub(super) ignore_eos: bool,
    /// The stop strings.
    pub(super) stop: Vec<String>,
    /// Whether a cached prefix of the prompt is reused.
    pub(super) cache_prompt: bool,
}

impl From<&SamplingParams> for Settings {
    fn from(p: &SamplingParams) -> Self {
        Self {
            n_predict: p.num_predict,
            n_keep: p.num_keep,
            seed: p.seed,
            temperature: f64::from(p.temperature),
            top_k: p.top_k,
            top_p: f64::from(p.top_p),
            min_p: f64::from(p.min_p),
            typical_p: f64::from(p.typical_p),
            repeat_last_n: p.repeat_last_n,
            repeat_penalty: f64::from(p.repeat_penalty),
            presence_penalty: f64::from(p.presence_penalty),
            frequency_penalty: f64::from(p.frequency_penalty),
            mirostat: p.mirostat,
            mirostat_tau: f64::from(p.mirostat_tau),
            mirostat_eta: f64::from(p.mirostat_eta),
            dry_multiplier: f64::from(p.samplers.dry_multiplier),
            dry_base: f64::from(p.samplers.dry_base),
            dry_allowed_length: p.samplers.dry_allowed_length,
            dry_penalty_last_n: p.samplers.dry_penalty_last_n,
            xtc_probability: f64::from(p.samplers.xtc_probability),
            xtc_threshold: f64::from(p.samplers.xtc_threshold),
            top_n_sigma: f64::from(p.samplers.top_n_sigma),
            dynatemp_range: f64::from(p.samplers.dynatemp_range),
            dynatemp_exponent: f64::from(p.samplers.dynatemp_exponent),
            ignore_eos: p.ignore_eos,
            stop: p.stop.clone(),
            cache_prompt: p.cache_prompt,
        }
    }
}

/// llama-server's `prompt_progress` object (`return_progress`): how far a prompt's decode is.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct PromptProgress {
    /// The prompt's tokens.
    pub(super) total: usize,
    /// Of those, the ones found in a cache.
    pub(super) cache: usize,
    /// Of those, the ones in the slot so far (the cached ones included).
    pub(super) processed: usize,
    /// Milliseconds since the sequence was admitted.
    pub(super) time_ms: u64,
}

impl From<&crate::protocol::PromptProgress> for PromptProgress {
    fn from(p: &crate::protocol::PromptProgress) -> Self {
        Self {
            total: p.total,
            cache: p.cache,
            processed: p.processed,
            time_ms: p.time_ms,
        }
    }
}

/// llama-server's `timings`: the prompt's cached and decoded tokens and the generation, with
/// their times (ms) and rates (`timings.rs` computes them).
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Timings {
    /// Prompt tokens found in a cache.
    pub(super) cache_n: usize,
    /// Prompt tokens decoded.
    pub(super) prompt_n: usize,
    /// Milliseconds decoding the prompt.
    pub(super) prompt_ms: f64,
    /// Milliseconds per prompt token (0: none decoded).
    pub(super) prompt_per_token_ms: f64,
    /// Prompt tokens per second (0: no time).
    pub(super) prompt_per_second: f64,
    /// Tokens generated.
    pub(super) predicted_n: usize,
    /// Milliseconds generating.
    pub(super) predicted_ms: f64,
    /// Milliseconds per generation step (0: none).
    pub(super) predicted_per_token_ms: f64,
    /// Generation steps per second (0: no time).
    pub(super) predicted_per_second: f64,
    /// Tokens drafted (speculative decoding), when any were.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) draft_n: Option<usize>,
    /// Drafted tokens accepted, when any were drafted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) draft_n_accepted: Option<usize>,
}
