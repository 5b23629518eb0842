//! llama-server's `POST /infill`, the route editor plugins (llama.vim, llama.vscode) complete
//! code through: `input_prefix`, `input_suffix`, `input_extra` and `prompt`, laid out with the
//! model's fill-in-the-middle tokens (`requests/infill.rs`), sampled with llama-server's
//! option names at the top level. The answer is llama-server's completion object (`content`,
//! `stop`, `tokens_predicted`, `timings`...), or its SSE stream with `stream: true`, written
//! from serde types (at the end of this file) whose fields are declared in the order they are
//! written.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::http::error::ApiError;
use crate::http::AppState;
use crate::protocol::{Completion, DoneReason, Event};
use crate::requests::common::{
    collect, ensure_ready, model_info, parse_json, start_generation, PromptSource,
};
use crate::requests::infill::{self, ExtraFile, Parts};
use crate::requests::keyed::Keyed;
use crate::requests::options::Options;
use crate::requests::validate;

/// Body of `POST /infill`. Unknown fields (llama.vim's `t_max_prompt_ms`, `samplers`,
/// `id_slot`...) are ignored.
#[derive(Debug, Deserialize)]
struct InfillRequest {
    #[serde(default)]
    input_prefix: Option<String>,
    #[serde(default)]
    input_suffix: Option<String>,
    #[serde(default)]
    input_extra: Option<Vec<ExtraFile>>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    /// Tokens to generate (llama-server's name); `num_predict` is taken too.
    #[serde(default)]
    n_predict: Option<i64>,
    #[serde(default)]
    cache_prompt: Option<bool>,
    /// true: the output must depend on the request alone (`--deterministic`), else 400.
    #[serde(default)]
    deterministic: Option<bool>,
    #[serde(default)]
    grammar: Option<String>,
    /// Sampling, under llama-server's names (which Ollama's options share).
    #[serde(flatten)]
    options: Options,
}

/// `POST /infill`.
pub async fn infill(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    ensure_ready(&state)?;
    // `model` is read by a router to pick the engine; a server of one model ignores it here,
    // as llama-server does (editor plugins send placeholders).
    let req = request_with_defaults(parse_json(&body)?)?;
    let info = model_info(&state)?;
    infill::fim_of(&info)?;
    let lora = state.lora.for_request(req.options.lora.as_ref())?;
    let mut params = req.options.into_params();
    state
        .sampling_defaults
        .fill_left_out(&mut params, &body, false);
    if let Some(n) = req.n_predict {
        params.num_predict = n;
    }
    params.lora = lora;
    params.cache_prompt = req.cache_prompt.unwrap_or(true);
    params.deterministic = req.deterministic.unwrap_or(false);
    // The cursor's context is laid out to fit; a cut of it would drop the FIM markers.
    params.truncate = false;
    params.grammar = req
        .grammar
        .filter(|g| !g.trim().is_empty())
        .map(|g| crate::constrain::Grammar::new(crate::constrain::GrammarSource::Gbnf(g)));
    let parts = parts_of(
        req.input_prefix,
        req.input_suffix,
        req.prompt,
        req.input_extra,
    );
    // The options' refusals come before the cost of tokenizing.
    validate::check_options(&params).map_err(|e| e.under_options())?;
    let tokens = infill::tokens(&info, parts, params.num_predict).await?;
    let model = state.model_name.to_string();
    let generation = start_generation(&state, PromptSource::Tokens(tokens), params).await?;
    if req.stream != Some(true) {
        let all = collect(generation).await?;
        return Ok(Json(final_fields(&model, &all.text, &all.done)).into_response());
    }
    let events = generation.map(move |event| {
        let data = match event {
            Event::Text { text, .. } => super::stream_json::to_line(&Chunk {
                content: &text,
                stop: false,
            }),
            Event::Done(c) => super::stream_json::to_line(&final_fields(&model, "", &c)),
            Event::Error(e) => super::stream_json::to_line(&ApiError::from(e).body()),
            Event::Started { .. } | Event::Progress(_) => super::stream_json::to_line(&Chunk {
                content: "",
                stop: false,
            }),
        };
        Ok::<_, Infallible>(SseEvent::default().data(data))
    });
    Ok(Sse::new(events).into_response())
}

/// The parts of the cursor's context.
fn parts_of(
    prefix: Option<String>,
    suffix: Option<String>,
    prompt: Option<String>,
    extra: Option<Vec<ExtraFile>>,
) -> Parts {
    Parts {
        prefix: prefix.unwrap_or_default(),
        suffix: suffix.unwrap_or_default(),
        prompt: prompt.unwrap_or_default(),
        extra: extra.unwrap_or_default(),
    }
}

/// `/infill` as `routing_key` reads it: as `infill` does, the parts whose tokens lead the
/// prompt (the other files, then the code before the cursor: the suffix and the typed text
/// come after it, so an edit there would not extend the key as it extends the cached
/// prefix); the model is the body's `model`, which a router of many models picks the engine
/// by.
pub(crate) fn keyed(body: &[u8]) -> Result<Keyed, ApiError> {
    let value: Value = parse_json(body)?;
    let model = value
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string);
    let req = request_with_defaults(value)?;
    let parts = parts_of(
        req.input_prefix,
        req.input_suffix,
        req.prompt,
        req.input_extra,
    );
    let mut texts: Vec<String> = parts.extra.into_iter().map(|f| f.text).collect();
    texts.push(parts.prefix);
    Ok(Keyed::texts(model, texts))
}

/// llama-server's sampling defaults where Ollama's (which `Options` has) differ: no
/// repetition penalty, top_p 0.95, min_p 0.05. A code completion repeats its context by
/// nature, and the same prompt on both servers should sample alike.
const LLAMA_SERVER_DEFAULTS: [(&str, f64); 3] =
    [("repeat_penalty", 1.0), ("top_p", 0.95), ("min_p", 0.05)];

/// The request, llama-server's defaults filled in for the fields it leaves out.
fn request_with_defaults(mut body: Value) -> Result<InfillRequest, ApiError> {
    let Some(fields) = body.as_object_mut() else {
        return Err(ApiError::InvalidJson(
            "the body must be a JSON object".into(),
        ));
    };
    // Counted before the files become structs (an 8 MiB body holds millions of `{}`).
    if let Some(files) = fields.get("input_extra").and_then(Value::as_array) {
        if files.len() > infill::MAX_EXTRA_FILES {
            return Err(ApiError::field(
                "input_extra",
                format!(
                    ": at most {} files, got {}",
                    infill::MAX_EXTRA_FILES,
                    files.len()
                ),
            ));
        }
    }
    for (name, value) in LLAMA_SERVER_DEFAULTS {
        fields.entry(name).or_insert(json!(value));
    }
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        ApiError::InvalidJson(format!("{path}: {}", e.into_inner()))
    })
}

/// The last object (a stream's, its content empty) or the whole answer: the text, why it
/// stopped, the counts and the timings.
fn final_fields<'a>(model: &'a str, content: &'a str, c: &Completion) -> Answer<'a> {
    let ms = |ns: u64| ns as f64 / 1e6;
    let per_second = |n: usize, ns: u64| {
        if ns == 0 {
            0.0
        } else {
            n as f64 * 1e9 / ns as f64
        }
    };
    let prompt_n = c.prompt_eval_count.saturating_sub(c.prompt_cached_count);
    let stop_type = match (c.done_reason, &c.stop_string) {
        (DoneReason::Stop, Some(_)) => "word",
        (DoneReason::Stop, None) => "eos",
        _ => "limit",
    };
    Answer {
        content,
        stop: true,
        model,
        stop_type,
        stopping_word: c.stop_string.clone().unwrap_or_default(),
        tokens_predicted: c.eval_count,
        tokens_evaluated: c.prompt_eval_count,
        tokens_cached: c.prompt_cached_count,
        truncated: c.truncated,
        timings: Timings {
            cache_n: c.prompt_cached_count,
            prompt_n,
            prompt_ms: ms(c.prompt_eval_duration_ns),
            prompt_per_second: per_second(prompt_n, c.prompt_eval_duration_ns),
            predicted_n: c.eval_count,
            predicted_ms: ms(c.eval_duration_ns),
            predicted_per_second: per_second(c.eval_count, c.eval_duration_ns),
        },
    }
}

/// A streamed piece of the text.
#[derive(Debug, Serialize)]
struct Chunk<'a> {
    /// The text added (empty while the prompt is read).
    content: &'a str,
    /// Always false.
    stop: bool,
}

/// The whole answer, or a stream's last event (its text empty).
#[derive(Debug, Serialize)]
struct Answer<'a> {
    /// The text generated.
    content: &'a str,
    /// Always true.
    stop: bool,
    /// The model's name as served.
    model: &'a str,
    /// Why it stopped: `eos`, `word` (a stop string) or `limit`.
    stop_type: &'static str,
    /// The stop string that ended it, else empty.
    stopping_word: String,
    /// Tokens generated.
    tokens_predicted: usize,
    /// Prompt tokens, cached ones included.
    tokens_evaluated: usize,
    /// Prompt tokens reused from the cache.
    tokens_cached: usize,
    /// Whether the prompt was cut to fit.
    truncated: bool,
    /// The counts, times and rates.
    timings: Timings,
}

/// llama-server's `timings`, as `/infill` writes them (no per-token times).
#[derive(Debug, Serialize)]
struct Timings {
    /// Prompt tokens reused from the cache.
    cache_n: usize,
    /// Prompt tokens decoded.
    prompt_n: usize,
    /// Milliseconds spent decoding the prompt.
    prompt_ms: f64,
    /// Prompt tokens decoded per second (0 when untimed).
    prompt_per_second: f64,
    /// Tokens generated.
    predicted_n: usize,
    /// Milliseconds spent generating.
    predicted_ms: f64,
    /// Tokens generated per second (0 when untimed).
    predicted_per_second: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_server_defaults_fill_only_what_is_absent() {
        let req = request_with_defaults(json!({"top_p": 0.5, "input_prefix": "a"})).unwrap();
        assert_eq!(req.options.top_p, 0.5);
        assert_eq!(req.options.repeat_penalty, 1.0);
        assert!((req.options.min_p - 0.05).abs() < 1e-6);
        for bad in [
            json!([]),
            json!("x"),
            json!({"top_p": "high"}),
            json!({"input_extra": 1}),
        ] {
            assert_eq!(
                request_with_defaults(bad.clone()).unwrap_err().kind(),
                "invalid_json",
                "{bad}"
            );
        }
    }
}
