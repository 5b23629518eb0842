//! llama-server's own formats, for the clients written against it (Ollama's among them, which
//! now starts llama-server and sends it these): `POST /completion` in llama-server's format
//! (told from the Ollama runner's by its fields: `is_llama_server_body`), its sampling
//! defaults, and the `timings` of a finished answer (also on OpenAI's answers, as
//! llama-server adds them) and of a stream so far (`timings_per_token`, in `timings.rs`). The
//! answers' wire types are in `wire.rs`; the request's `prompt` is read in `prompt.rs` and its
//! `logit_bias` in `logit_bias.rs`.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::Value;

use super::stream_json::to_line;
use crate::constrain::{Grammar, GrammarSource};
use crate::http::error::ApiError;
use crate::http::AppState;
use crate::protocol::params::SamplingParams;
use crate::protocol::{Completion, DoneReason, Event, Token, TokenLogprob};
use crate::requests::common::{collect, model_info, parse_json, start_generation};
use crate::requests::format::json_schema;
use crate::requests::options::SamplerFields;
use crate::requests::validate::MAX_TOP_LOGPROBS;

mod logit_bias;
mod prompt;
mod timings;
mod wire;

use logit_bias::LogitBias;
use prompt::OnePrompt;
use timings::progress_timings;
pub(crate) use timings::{timings, StreamClock};
pub(crate) use wire::{Answer, PromptProgress, Settings, Timings};
use wire::{Chunk, Probability};

/// The top-level fields by which a `POST /completion` body is llama-server's: its sampling
/// fields and switches, which the Ollama runner's format keeps in `options` or lacks (fields
/// both formats have, `prompt`, `grammar`, `lora`, `cache_prompt`, tell nothing).
const LLAMA_SERVER_FIELDS: &[&str] = &[
    "stream",
    "n_predict",
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "seed",
    "stop",
    "n_probs",
    "post_sampling_probs",
    "n_keep",
    "json_schema",
    "return_tokens",
    "id_slot",
    "timings_per_token",
    "response_fields",
    "ignore_eos",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "xtc_probability",
    "xtc_threshold",
    "top_n_sigma",
    "dynatemp_range",
    "dynatemp_exponent",
    "samplers",
    "n_indent",
    "t_max_predict_ms",
    "n_cmpl",
    "logit_bias",
    "return_progress",
];

/// Whether a `POST /completion` body is in llama-server's format rather than the Ollama
/// runner's: it has none of the runner's own fields (`options`, `messages`) and either a prompt
/// that is not text (token ids, several prompts, `{"prompt_string"}`: the runner's is text) or
/// one of llama-server's top-level fields (`n_predict`,
/// `stream`, `temperature`...). A body with neither (`{"prompt"}`) keeps the runner's format.
/// Keys are compared as the runner reads them, without case.
pub(crate) fn is_llama_server_body(body: &[u8]) -> bool {
    let Ok(Value::Object(fields)) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    let field = |name: &str| {
        fields
            .iter()
            .find_map(|(k, v)| k.eq_ignore_ascii_case(name).then_some(v))
    };
    if field("options").is_some() || field("messages").is_some() {
        return false;
    }
    matches!(field("prompt"), Some(Value::Array(_) | Value::Object(_)))
        || LLAMA_SERVER_FIELDS.iter().any(|f| field(f).is_some())
}

/// The sampling a llama-server-format request gets for what it leaves out: llama-server's
/// defaults (top_p 0.95, min_p 0.05, no repetition penalty; a random seed), which `GET /props`
/// reports as `default_generation_settings.params`.
pub(crate) fn default_params() -> SamplingParams {
    SamplingParams {
        top_p: 0.95,
        min_p: 0.05,
        repeat_penalty: 1.0,
        ..SamplingParams::default()
    }
}

/// Body of `POST /completion` in llama-server's format. Unknown fields are ignored, as there.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct CompletionRequest {
    model: Option<String>,
    /// A text, or the token ids of one prompt.
    prompt: Option<Value>,
    stream: Option<bool>,
    #[serde(alias = "max_tokens")]
    n_predict: Option<i64>,
    n_keep: Option<i64>,
    temperature: Option<f32>,
    top_k: Option<i32>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    typical_p: Option<f32>,
    repeat_penalty: Option<f32>,
    repeat_last_n: Option<i32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    mirostat: Option<i32>,
    mirostat_tau: Option<f32>,
    mirostat_eta: Option<f32>,
    seed: Option<i64>,
    stop: Option<Vec<String>>,
    ignore_eos: Option<bool>,
    grammar: Option<String>,
    json_schema: Option<Value>,
    cache_prompt: Option<bool>,
    /// true: the output must depend on the request alone (`--deterministic`), else 400.
    deterministic: Option<bool>,
    lora: Option<Value>,
    /// Biases by token id or by text (`LogitBias`).
    logit_bias: Option<Value>,
    return_progress: Option<bool>,
    /// The most likely tokens at each position, with the sampled one's probability
    /// (`completion_probabilities`).
    n_probs: Option<u32>,
    /// `completion_probabilities` after the sampler chain (`prob`, `top_probs`) instead of
    /// the model's (`logprob`, `top_logprobs`).
    post_sampling_probs: Option<bool>,
    /// The generated tokens' ids in `tokens`.
    return_tokens: Option<bool>,
    /// Timings on every streamed event: text (`StreamClock`) and prompt progress.
    timings_per_token: Option<bool>,
    /// Completions of the prompt (llama-server answers several in an array): one here.
    n_cmpl: Option<u64>,
    #[serde(flatten)]
    samplers: SamplerFields,
}

impl CompletionRequest {
    /// The sampling parameters: the request's, llama-server's defaults for the rest.
    fn params(&self, state: &AppState) -> Result<SamplingParams, ApiError> {
        if self.n_cmpl.is_some_and(|n| n != 1) {
            return Err(ApiError::field(
                "n_cmpl",
                ": one completion per request here; send several requests",
            ));
        }
        let n_probs = self.n_probs.unwrap_or(0) as usize;
        if n_probs > MAX_TOP_LOGPROBS {
            return Err(ApiError::field(
                "n_probs",
                format!(" must be at most {MAX_TOP_LOGPROBS}"),
            ));
        }
        let d = default_params();
        let mut p = SamplingParams {
            num_predict: self.n_predict.unwrap_or(d.num_predict),
            num_keep: self.n_keep.unwrap_or(d.num_keep),
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            typical_p: self.typical_p.unwrap_or(d.typical_p),
            repeat_penalty: self.repeat_penalty.unwrap_or(d.repeat_penalty),
            repeat_last_n: self.repeat_last_n.unwrap_or(d.repeat_last_n),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            mirostat: self.mirostat.unwrap_or(d.mirostat),
            mirostat_tau: self.mirostat_tau.unwrap_or(d.mirostat_tau),
            mirostat_eta: self.mirostat_eta.unwrap_or(d.mirostat_eta),
            seed: self.seed.unwrap_or(d.seed),
            stop: self.stop.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            cache_prompt: self.cache_prompt.unwrap_or(true),
            deterministic: self.deterministic.unwrap_or(false),
            return_progress: self.return_progress == Some(true) && self.stream == Some(true),
            samplers: self.samplers.samplers(),
            // The engine reports each sampled token (and n_probs alternatives) when asked:
            // what completion_probabilities and tokens are made of.
            logprobs: (n_probs > 0 || self.return_tokens == Some(true)).then_some(n_probs),
            post_sampling_probs: self.post_sampling_probs == Some(true),
            ..d
        };
        p.lora = state.lora.for_request(self.lora.as_ref())?;
        let gbnf = self.grammar.as_ref().filter(|g| !g.trim().is_empty());
        let schema = self.json_schema.as_ref().filter(|s| !s.is_null());
        p.grammar = match (gbnf, schema) {
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    "give one constraint: grammar or json_schema, not both",
                ))
            }
            (Some(g), None) => Some(Grammar::new(GrammarSource::Gbnf(g.clone()))),
            (None, Some(s)) => json_schema(s, "json_schema").map_err(ApiError::InvalidField)?,
            (None, None) => None,
        };
        Ok(p)
    }
}

/// What every answer of one request carries besides the text.
struct Meta {
    model: String,
    prompt: String,
    settings: Settings,
    /// `return_tokens`: the generated tokens' ids in `tokens`.
    return_tokens: bool,
    /// `n_probs` > 0: `completion_probabilities`.
    probabilities: bool,
    /// `post_sampling_probs`: they are the sampler chain's probabilities.
    post_sampling: bool,
}

impl Meta {
    /// The `tokens` of these tokens: their ids when the request asked, else none.
    fn tokens(&self, logprobs: &[TokenLogprob]) -> Vec<Token> {
        if self.return_tokens {
            logprobs.iter().map(|l| l.sampled.token).collect()
        } else {
            Vec::new()
        }
    }

    /// The `completion_probabilities` of these tokens, when the request asked: each one's id,
    /// text (lossy where it is part of a character), bytes and log-probability, and the most
    /// likely tokens at its position.
    fn probabilities<'a>(&self, logprobs: &'a [TokenLogprob]) -> Option<Vec<Probability<'a>>> {
        self.probabilities.then(|| {
            logprobs
                .iter()
                .map(|l| Probability::new(l, self.post_sampling))
                .collect()
        })
    }

    /// A whole answer (`index`: its prompt's place among several) with the `tokens` and
    /// `completion_probabilities` the request asked for.
    fn answer<'a>(
        &'a self,
        index: usize,
        all: &'a crate::requests::common::Collected,
    ) -> Answer<'a> {
        let mut body = self.last(&all.text, all.text.contains('\n'), &all.done);
        body.index = index;
        body.tokens = self.tokens(&all.logprobs);
        body.completion_probabilities = self.probabilities(&all.logprobs);
        body
    }

    /// The last answer (stream) or the whole one, without tokens (`final_body`).
    fn last<'a>(
        &'a self,
        content: &'a str,
        has_new_line: bool,
        done: &'a Completion,
    ) -> Answer<'a> {
        final_body(
            &self.model,
            &self.prompt,
            &self.settings,
            content,
            has_new_line,
            done,
        )
    }
}

/// llama-server's `stop_type`: why the generation ended.
fn stop_type(done: &Completion) -> &'static str {
    match (done.done_reason, &done.stop_string) {
        (DoneReason::Stop, Some(_)) => "word",
        (DoneReason::Stop, None) => "eos",
        // A time limit is a limit too (llama-server's t_max_predict_ms ends as "limit").
        (DoneReason::Length | DoneReason::Timeout, _) => "limit",
    }
}

/// The last answer (stream) or the whole one: the text and the statistics, with no tokens
/// (the whole answer adds those the request asked for: `Meta::answer`). `has_new_line`:
/// whether the whole generation wrote one (a stream's last answer carries no text).
fn final_body<'a>(
    model: &'a str,
    prompt: &'a str,
    settings: &'a Settings,
    content: &'a str,
    has_new_line: bool,
    done: &'a Completion,
) -> Answer<'a> {
    Answer {
        index: 0,
        content,
        tokens: Vec::new(),
        id_slot: -1,
        stop: true,
        model,
        tokens_predicted: done.eval_count,
        tokens_evaluated: done.prompt_eval_count,
        generation_settings: settings,
        prompt,
        has_new_line,
        truncated: done.truncated,
        stop_type: stop_type(done),
        stopping_word: done.stop_string.as_deref().unwrap_or_default(),
        tokens_cached: done.prompt_eval_count + done.eval_count,
        timings: timings(done),
        completion_probabilities: None,
    }
}

/// llama-server's `__verbose` debug object on an OpenAI answer (`verbose`): the answer in its
/// native format, with the prompt as rendered and the settings it ran with.
pub(crate) fn verbose_body<'a>(
    model: &'a str,
    prompt: &'a str,
    settings: &'a Settings,
    content: &'a str,
    done: &'a Completion,
) -> Answer<'a> {
    final_body(
        model,
        prompt,
        settings,
        content,
        content.contains('\n'),
        done,
    )
}

/// `POST /completion` in llama-server's format (`is_llama_server_body`): one JSON answer, or
/// with `"stream": true` server-sent events, each a partial answer (`"stop": false`, its text
/// in `content`) and the last the whole statistics (`"stop": true`, `timings`); no `[DONE]`.
pub async fn completion(state: AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_json(body)?;
    let mut params = req.params(&state)?;
    state
        .sampling_defaults
        .fill_left_out(&mut params, body, false);
    let prompts = prompt::read(req.prompt.as_ref())?;
    let info = model_info(&state)?;
    if let Some(bias) = &req.logit_bias {
        params.logit_bias = LogitBias::read(bias)?.tokens(&info).await?;
    }
    let settings = Settings::from(&params);
    let meta_of = |p: &OnePrompt| Meta {
        model: state.model_name.to_string(),
        prompt: p.text(),
        settings: settings.clone(),
        return_tokens: req.return_tokens == Some(true),
        probabilities: req.n_probs.is_some_and(|n| n > 0),
        post_sampling: req.post_sampling_probs == Some(true),
    };
    if prompts.len() > 1 {
        if req.stream == Some(true) {
            return Err(ApiError::field(
                "stream",
                ": one prompt per streamed request; send the others as requests of \
                 their own, or leave stream out to have every answer at once",
            ));
        }
        // Several prompts: each read and tokenized first (a bad one fails the request before
        // any is queued), then queued one after another (each once it has a slot, as `n`
        // choices are), generated side by side and answered in one array in their order. An
        // error drops the generations started, which frees their slots.
        let mut sources = Vec::with_capacity(prompts.len());
        for p in prompts {
            let meta = meta_of(&p);
            sources.push((meta, p.source(&info).await?));
        }
        let mut generations = Vec::with_capacity(sources.len());
        for (meta, source) in sources {
            let generation = start_generation(&state, source, params.clone()).await?;
            generation.read_whole();
            generations.push((meta, generation));
        }
        let finished = generations
            .into_iter()
            .map(|(meta, generation)| async move {
                Ok::<_, ApiError>((meta, collect(generation).await?))
            });
        let finished = futures_util::future::try_join_all(finished).await?;
        let answers: Vec<Answer> = finished
            .iter()
            .enumerate()
            .map(|(index, (meta, all))| meta.answer(index, all))
            .collect();
        return Ok(Json(answers).into_response());
    }
    let Some(p) = prompts.into_iter().next() else {
        return Err(ApiError::field("prompt", " is required"));
    };
    let meta = meta_of(&p);
    let prompt = p.source(&info).await?;
    let generation = start_generation(&state, prompt, params).await?;
    let evaluated = generation.prompt_tokens;
    if req.stream != Some(true) {
        let all = collect(generation).await?;
        return Ok(Json(meta.answer(0, &all)).into_response());
    }
    let mut predicted = 0usize;
    let mut has_new_line = false;
    let mut clock = (req.timings_per_token == Some(true)).then(|| StreamClock::new(&generation));
    let events = generation.filter_map(move |event| {
        let line = match event {
            Event::Started { .. } => None,
            Event::Progress(p) => Some(to_line(&Chunk {
                index: 0,
                content: "",
                tokens: Vec::new(),
                stop: false,
                id_slot: -1,
                tokens_predicted: 0,
                tokens_evaluated: evaluated,
                prompt_progress: Some(PromptProgress::from(&p)),
                completion_probabilities: None,
                timings: clock.is_some().then(|| progress_timings(&p)),
            })),
            Event::Text { text, logprobs } => {
                predicted += logprobs.len().max(1);
                has_new_line |= text.contains('\n');
                let timings = clock.as_mut().map(|clock| {
                    clock.text(logprobs.len());
                    clock.timings()
                });
                Some(to_line(&Chunk {
                    index: 0,
                    content: &text,
                    tokens: meta.tokens(&logprobs),
                    stop: false,
                    id_slot: -1,
                    tokens_predicted: predicted,
                    tokens_evaluated: evaluated,
                    prompt_progress: None,
                    completion_probabilities: meta.probabilities(&logprobs),
                    timings,
                }))
            }
            // A streamed answer's tokens came with its text: the last event has none.
            Event::Done(done) => Some(to_line(&meta.last("", has_new_line, &done))),
            Event::Error(e) => Some(to_line(&ApiError::from(e).body())),
        };
        std::future::ready(line.map(|line| Ok::<_, Infallible>(SseEvent::default().data(line))))
    });
    Ok(Sse::new(events).into_response())
}

#[cfg(test)]
mod tests;
