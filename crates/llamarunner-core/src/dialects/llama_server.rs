//! llama-server's own formats, for the clients written against it (Ollama's among them, which
//! now starts llama-server and sends it these): `POST /completion` in llama-server's format
//! (told from the Ollama runner's by its fields: `is_llama_server_body`), its sampling
//! defaults, and the `timings` of a finished answer (also on OpenAI's answers, as
//! llama-server adds them) and of a stream so far (`timings_per_token`).

use std::convert::Infallible;
use std::time::Instant;

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::constrain::{Grammar, GrammarSource};
use crate::http::error::ApiError;
use crate::http::AppState;
use crate::protocol::params::SamplingParams;
use crate::protocol::{Completion, DoneReason, Event, Token, TokenLogprob, TopLogprob};
use crate::requests::common::{collect, parse_json, start_generation, Generation, PromptSource};
use crate::requests::format::json_schema;
use crate::requests::options::SamplerFields;
use crate::requests::validate::MAX_TOP_LOGPROBS;

/// llama-server's `timings` of a finished answer: the prompt's decoded and cached tokens and the
/// generation, with their times and rates (0 where nothing was timed). The generation's rate
/// is over its decode steps, one fewer than its tokens: the first token comes from the
/// prompt's last decode, and the generation's time starts after it. Clients written for
/// llama-server (its web page among them) show them.
pub(crate) fn timings(done: &Completion) -> Value {
    let ms = |ns: u64| ns as f64 / 1e6;
    let prompt_n = done
        .prompt_eval_count
        .saturating_sub(done.prompt_cached_count);
    let mut t = timings_of(
        done.prompt_cached_count,
        prompt_n,
        ms(done.prompt_eval_duration_ns),
        done.eval_count,
        ms(done.eval_duration_ns),
    );
    if done.draft_count > 0 {
        t["draft_n"] = json!(done.draft_count);
        t["draft_n_accepted"] = json!(done.draft_accepted_count);
    }
    t
}

/// llama-server's `timings_per_token`: the timings of a stream so far, measured here as its
/// events arrive: the prompt's from its admission to its first text, the generation's since.
/// Tokens are counted per text event, or per token where their log-probabilities came with
/// it (a client that reads slowly gets several tokens in one event). The last event's timings
/// are the engine's own (`timings`).
#[derive(Debug)]
pub(crate) struct StreamClock {
    admitted: Instant,
    first_text: Option<Instant>,
    cache_n: usize,
    prompt_n: usize,
    predicted_n: usize,
}

impl StreamClock {
    /// A clock for this generation, started at its admission (now).
    pub(crate) fn new(generation: &Generation) -> Self {
        Self::admitted(generation.prompt_tokens, generation.cached_tokens)
    }

    /// A clock for a prompt of `prompt` tokens, `cached` of them from a cache, admitted now.
    fn admitted(prompt: usize, cached: usize) -> Self {
        Self {
            admitted: Instant::now(),
            first_text: None,
            cache_n: cached,
            prompt_n: prompt.saturating_sub(cached),
            predicted_n: 0,
        }
    }

    /// A text event arrived, completing `tokens` tokens (0: not counted, one event).
    pub(crate) fn text(&mut self, tokens: usize) {
        self.first_text.get_or_insert_with(Instant::now);
        self.predicted_n += tokens.max(1);
    }

    /// The timings so far.
    pub(crate) fn timings(&self) -> Value {
        let now = Instant::now();
        let ms =
            |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64() * 1e3;
        let first = self.first_text.unwrap_or(now);
        let predicted_ms = self.first_text.map_or(0.0, |t| ms(t, now));
        timings_of(
            self.cache_n,
            self.prompt_n,
            ms(self.admitted, first),
            self.predicted_n,
            predicted_ms,
        )
    }
}

/// The `timings` of a prompt's decode so far (`timings_per_token` with `return_progress`).
fn progress_timings(p: &crate::protocol::PromptProgress) -> Value {
    let prompt_n = p.processed.saturating_sub(p.cache);
    timings_of(p.cache, prompt_n, p.time_ms as f64, 0, 0.0)
}

/// llama-server's timings object from its counts and times (ms); rates 0 where a divisor is 0.
fn timings_of(
    cache_n: usize,
    prompt_n: usize,
    prompt_ms: f64,
    predicted_n: usize,
    predicted_ms: f64,
) -> Value {
    let per_token = |ms: f64, n: usize| if n > 0 { ms / n as f64 } else { 0.0 };
    let per_second = |ms: f64, n: usize| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
    let steps = predicted_n.saturating_sub(1);
    json!({
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": per_token(prompt_ms, prompt_n),
        "prompt_per_second": per_second(prompt_ms, prompt_n),
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": per_token(predicted_ms, steps),
        "predicted_per_second": per_second(predicted_ms, steps),
    })
}

/// llama-server's `prompt_progress` object (`return_progress`).
pub(crate) fn prompt_progress(p: &crate::protocol::PromptProgress) -> Value {
    json!({"total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": p.time_ms})
}

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
    "return_progress",
];

/// Whether a `POST /completion` body is in llama-server's format rather than the Ollama
/// runner's: it has none of the runner's own fields (`options`, `messages`) and either a prompt
/// of token ids (the runner's is text) or one of llama-server's top-level fields (`n_predict`,
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
    matches!(field("prompt"), Some(Value::Array(_)))
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
    lora: Option<Value>,
    return_progress: Option<bool>,
    /// The most likely tokens at each position, with the sampled one's probability
    /// (`completion_probabilities`).
    n_probs: Option<u32>,
    /// Probabilities after the sampler chain (refused: the engine reports the model's).
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
        if self.post_sampling_probs == Some(true) {
            return Err(ApiError::invalid(
                "post_sampling_probs: the probabilities given are the model's, before \
                 sampling; leave it out",
            ));
        }
        if self.n_cmpl.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid(
                "n_cmpl: one completion per request here; send several requests",
            ));
        }
        let n_probs = self.n_probs.unwrap_or(0) as usize;
        if n_probs > MAX_TOP_LOGPROBS {
            return Err(ApiError::invalid(format!(
                "n_probs must be at most {MAX_TOP_LOGPROBS}"
            )));
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
            return_progress: self.return_progress == Some(true) && self.stream == Some(true),
            samplers: self.samplers.samplers(),
            // The engine reports each sampled token (and n_probs alternatives) when asked:
            // what completion_probabilities and tokens are made of.
            logprobs: (n_probs > 0 || self.return_tokens == Some(true)).then_some(n_probs),
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
            (None, Some(s)) => json_schema(s, "json_schema").map_err(ApiError::InvalidRequest)?,
            (None, None) => None,
        };
        Ok(p)
    }

    /// The prompt: a non-empty text, or one prompt's token ids.
    fn prompt(&self) -> Result<PromptSource, ApiError> {
        match &self.prompt {
            Some(Value::String(text)) if !text.is_empty() => Ok(PromptSource::from(text.clone())),
            Some(Value::Array(items)) if !items.is_empty() => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|id| Token::try_from(id).ok())
                        .ok_or_else(|| {
                            ApiError::invalid(
                                "prompt: an array is one prompt's token ids (non-negative \
                                 integers); send several prompts as several requests",
                            )
                        })
                })
                .collect::<Result<Vec<Token>, _>>()
                .map(PromptSource::Tokens),
            _ => Err(ApiError::invalid(
                "prompt is required: a non-empty text or an array of token ids",
            )),
        }
    }
}

/// What every answer of one request carries besides the text.
struct Meta {
    model: String,
    prompt: String,
    settings: Value,
    /// `return_tokens`: the generated tokens' ids in `tokens`.
    return_tokens: bool,
    /// `n_probs` > 0: `completion_probabilities`.
    probabilities: bool,
}

impl Meta {
    /// `tokens` and `completion_probabilities` of these tokens, as the request asked.
    fn add_tokens(&self, body: &mut Value, logprobs: &[TokenLogprob]) {
        if self.return_tokens {
            body["tokens"] = json!(logprobs.iter().map(|l| l.sampled.token).collect::<Vec<_>>());
        }
        if self.probabilities {
            body["completion_probabilities"] =
                Value::Array(logprobs.iter().map(probability).collect());
        }
    }
}

/// One token's entry in `completion_probabilities`: its id, text (lossy where it is part of a
/// character), bytes and log-probability, and the most likely tokens at its position.
fn probability(l: &TokenLogprob) -> Value {
    let one = |t: &TopLogprob| {
        json!({
            "id": t.token,
            "token": String::from_utf8_lossy(&t.bytes),
            "bytes": t.bytes,
            "logprob": t.logprob,
        })
    };
    let mut entry = one(&l.sampled);
    entry["top_logprobs"] = Value::Array(l.top.iter().map(one).collect());
    entry
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

/// The last answer (stream) or the whole one: the text and the statistics. `has_new_line`:
/// whether the whole generation wrote one (a stream's last answer carries no text).
fn final_body(meta: &Meta, content: &str, has_new_line: bool, done: &Completion) -> Value {
    json!({
        "index": 0,
        "content": content,
        "tokens": [],
        "id_slot": -1,
        "stop": true,
        "model": meta.model,
        "tokens_predicted": done.eval_count,
        "tokens_evaluated": done.prompt_eval_count,
        "generation_settings": meta.settings,
        "prompt": meta.prompt,
        "has_new_line": has_new_line,
        "truncated": done.truncated,
        "stop_type": stop_type(done),
        "stopping_word": done.stop_string.clone().unwrap_or_default(),
        "tokens_cached": done.prompt_eval_count + done.eval_count,
        "timings": timings(done),
    })
}

/// llama-server's `__verbose` debug object on an OpenAI answer (`verbose`): the answer in its
/// native format, with the prompt as rendered and the settings it ran with.
pub(crate) fn verbose_body(
    model: &str,
    prompt: String,
    settings: Value,
    content: &str,
    done: &Completion,
) -> Value {
    let meta = Meta {
        model: model.to_string(),
        prompt,
        settings,
        return_tokens: false,
        probabilities: false,
    };
    final_body(&meta, content, content.contains('\n'), done)
}

/// The sampling a request runs with, under llama-server's names.
pub(crate) fn settings_json(p: &SamplingParams) -> Value {
    json!({
        "n_predict": p.num_predict,
        "n_keep": p.num_keep,
        "seed": p.seed,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "typical_p": p.typical_p,
        "repeat_last_n": p.repeat_last_n,
        "repeat_penalty": p.repeat_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "mirostat": p.mirostat,
        "mirostat_tau": p.mirostat_tau,
        "mirostat_eta": p.mirostat_eta,
        "ignore_eos": p.ignore_eos,
        "stop": p.stop,
        "cache_prompt": p.cache_prompt,
    })
}

/// `POST /completion` in llama-server's format (`is_llama_server_body`): one JSON answer, or
/// with `"stream": true` server-sent events, each a partial answer (`"stop": false`, its text
/// in `content`) and the last the whole statistics (`"stop": true`, `timings`); no `[DONE]`.
pub async fn completion(state: AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_json(body)?;
    let params = req.params(&state)?;
    let prompt = req.prompt()?;
    let meta = Meta {
        model: state.model_name.to_string(),
        prompt: match &req.prompt {
            Some(Value::String(text)) => text.clone(),
            _ => String::new(),
        },
        settings: settings_json(&params),
        return_tokens: req.return_tokens == Some(true),
        probabilities: req.n_probs.is_some_and(|n| n > 0),
    };
    let generation = start_generation(&state, prompt, params).await?;
    let evaluated = generation.prompt_tokens;
    if req.stream != Some(true) {
        let all = collect(generation).await?;
        let mut body = final_body(&meta, &all.text, all.text.contains('\n'), &all.done);
        meta.add_tokens(&mut body, &all.logprobs);
        return Ok(Json(body).into_response());
    }
    let mut predicted = 0usize;
    let mut has_new_line = false;
    let mut clock = (req.timings_per_token == Some(true)).then(|| StreamClock::new(&generation));
    let events = generation.filter_map(move |event| {
        let value = match event {
            Event::Started { .. } => None,
            Event::Progress(p) => {
                let mut chunk = json!({
                    "index": 0, "content": "", "tokens": [], "stop": false, "id_slot": -1,
                    "tokens_predicted": 0, "tokens_evaluated": evaluated,
                    "prompt_progress": prompt_progress(&p),
                });
                if clock.is_some() {
                    chunk["timings"] = progress_timings(&p);
                }
                Some(chunk)
            }
            Event::Text { text, logprobs } => {
                predicted += logprobs.len().max(1);
                has_new_line |= text.contains('\n');
                let mut chunk = json!({
                    "index": 0, "content": text, "tokens": [], "stop": false, "id_slot": -1,
                    "tokens_predicted": predicted, "tokens_evaluated": evaluated,
                });
                meta.add_tokens(&mut chunk, &logprobs);
                if let Some(clock) = clock.as_mut() {
                    clock.text(logprobs.len());
                    chunk["timings"] = clock.timings();
                }
                Some(chunk)
            }
            // A streamed answer's tokens came with its text: the last event has none.
            Event::Done(done) => Some(final_body(&meta, "", has_new_line, &done)),
            Event::Error(e) => Some(ApiError::from(e).body()),
        };
        std::future::ready(value.map(|v| {
            Ok::<_, Infallible>(SseEvent::default().data(super::stream_json::to_line(&v)))
        }))
    });
    Ok(Sse::new(events).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_s_fields_choose_the_format() {
        for (body, llama_server) in [
            (r#"{"prompt": "hi", "n_predict": 8}"#, true),
            (r#"{"prompt": "hi", "stream": true}"#, true),
            (r#"{"prompt": [1, 2], "temperature": 0}"#, true),
            (r#"{"Prompt": "hi", "N_Predict": 8}"#, true),
            // A prompt of token ids alone: the runner's prompt is text.
            (r#"{"prompt": [1, 2]}"#, true),
            (r#"{"prompt": "hi", "max_tokens": 4}"#, true),
            (r#"{"prompt": "hi", "dry_multiplier": 0.5}"#, true),
            (r#"{"prompt": "hi", "n_cmpl": 2}"#, true),
            // The Ollama runner's: options, or nothing llama-server's.
            (r#"{"prompt": "hi"}"#, false),
            (r#"{"prompt": "hi", "options": {"num_predict": 2}}"#, false),
            (r#"{"prompt": "hi", "Options": {}, "stream": true}"#, false),
            (r#"{"messages": [], "think": true}"#, false),
            // The runner's messages, even beside a field of llama-server's.
            (r#"{"messages": [], "stream": true}"#, false),
            (
                r#"{"prompt": "hi", "lora": [], "cache_prompt": false}"#,
                false,
            ),
            ("not json", false),
            ("[1, 2]", false),
        ] {
            assert_eq!(
                is_llama_server_body(body.as_bytes()),
                llama_server,
                "{body}"
            );
        }
    }

    #[test]
    fn params_take_llama_server_s_defaults_and_refuse_what_is_not_given() {
        let (engine, _inbox) = crate::protocol::EngineHandle::new(4);
        let state = AppState::new(engine, "m");
        let req: CompletionRequest = serde_json::from_str(r#"{"prompt": "hi"}"#).unwrap();
        let p = req.params(&state).unwrap();
        assert_eq!((p.top_p, p.min_p, p.repeat_penalty), (0.95, 0.05, 1.0));
        assert_eq!(p.num_predict, -1);
        let req: CompletionRequest =
            serde_json::from_str(r#"{"prompt": "hi", "n_predict": 3, "temperature": 0}"#).unwrap();
        let p = req.params(&state).unwrap();
        assert_eq!((p.num_predict, p.temperature), (3, 0.0));
        for (body, logprobs) in [
            (r#"{"n_probs": 2}"#, Some(2)),
            (r#"{"return_tokens": true}"#, Some(0)),
            (r#"{"n_probs": 3, "return_tokens": true}"#, Some(3)),
            (r#"{"n_probs": 0, "return_tokens": false}"#, None),
        ] {
            let req: CompletionRequest = serde_json::from_str(body).unwrap();
            assert_eq!(req.params(&state).unwrap().logprobs, logprobs, "{body}");
        }
        for (body, wanted) in [
            (r#"{"n_probs": 21}"#, "n_probs must be at most 20"),
            (r#"{"post_sampling_probs": true}"#, "post_sampling_probs"),
            (r#"{"n_cmpl": 2}"#, "n_cmpl"),
            (
                r#"{"grammar": "root ::= \"a\"", "json_schema": {}}"#,
                "one constraint",
            ),
            (r#"{"json_schema": 3}"#, "json_schema must be an object"),
        ] {
            let req: CompletionRequest = serde_json::from_str(body).unwrap();
            let err = req.params(&state).unwrap_err().to_string();
            assert!(err.contains(wanted), "{body}: {err}");
        }
        for (prompt, ok) in [
            (r#""hi""#, true),
            ("[1, 2, 3]", true),
            (r#""""#, false),
            ("[]", false),
            ("[-1]", false),
            (r#"["a", "b"]"#, false),
            ("[[1]]", false),
            ("null", false),
        ] {
            let req: CompletionRequest =
                serde_json::from_str(&format!(r#"{{"prompt": {prompt}}}"#)).unwrap();
            assert_eq!(req.prompt().is_ok(), ok, "{prompt}");
        }
    }

    #[test]
    fn a_stream_s_clock_counts_its_tokens_and_times_its_parts() {
        let mut clock = StreamClock::admitted(10, 4);
        let t = clock.timings();
        assert_eq!(
            (t["cache_n"].as_u64(), t["prompt_n"].as_u64()),
            (Some(4), Some(6))
        );
        assert_eq!(t["predicted_n"], 0);
        std::thread::sleep(std::time::Duration::from_millis(5));
        clock.text(0); // one event, no token count: one token
        clock.text(3); // three tokens' log-probabilities
        std::thread::sleep(std::time::Duration::from_millis(5));
        let t = clock.timings();
        assert_eq!(t["predicted_n"], 4);
        assert!(t["prompt_ms"].as_f64().unwrap() >= 5.0, "{t}");
        assert!(t["predicted_ms"].as_f64().unwrap() >= 5.0, "{t}");
        assert!(t["predicted_per_second"].as_f64().unwrap() > 0.0, "{t}");
    }

    #[test]
    fn stop_types_name_why_it_ended() {
        let done = |done_reason, stop: Option<&str>| Completion {
            done_reason,
            prompt_eval_count: 3,
            prompt_cached_count: 0,
            queue_duration_ns: 0,
            prompt_eval_duration_ns: 0,
            eval_count: 1,
            eval_duration_ns: 0,
            truncated: false,
            draft_count: 0,
            draft_accepted_count: 0,
            stop_string: stop.map(String::from),
        };
        assert_eq!(stop_type(&done(DoneReason::Stop, None)), "eos");
        assert_eq!(stop_type(&done(DoneReason::Stop, Some("\n"))), "word");
        assert_eq!(stop_type(&done(DoneReason::Length, None)), "limit");
        assert_eq!(stop_type(&done(DoneReason::Timeout, None)), "limit");
    }

    #[test]
    fn the_generation_rate_is_over_its_decode_steps() {
        let one = timings_of(2, 8, 4.0, 1, 0.0);
        assert_eq!(one["predicted_per_second"], 0.0);
        assert_eq!(one["predicted_per_token_ms"], 0.0);
        assert_eq!(one["prompt_per_token_ms"], 0.5);
        assert_eq!(one["prompt_per_second"], 2000.0);
        let many = timings_of(0, 8, 4.0, 16, 30.0);
        assert_eq!(many["predicted_per_token_ms"], 2.0);
        assert_eq!(many["predicted_per_second"], 500.0);
        let nothing = timings_of(0, 0, 0.0, 0, 0.0);
        for (key, value) in nothing.as_object().unwrap() {
            assert!(value.as_f64().is_some_and(|v| v == 0.0), "{key}: {value}");
        }
        let p = crate::protocol::PromptProgress {
            total: 40,
            cache: 8,
            processed: 24,
            time_ms: 16,
        };
        let t = progress_timings(&p);
        assert_eq!(
            (t["cache_n"].clone(), t["prompt_n"].clone()),
            (json!(8), json!(16))
        );
        assert_eq!(t["predicted_n"], 0);
    }
}
