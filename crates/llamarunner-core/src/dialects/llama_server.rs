//! llama-server's own formats, for the clients written against it: the `timings` of a
//! finished answer (also on OpenAI's answers, as llama-server adds them).

use serde_json::{json, Value};

use crate::protocol::Completion;

/// llama-server's `timings` of a finished answer: the prompt's decoded and cached tokens and the
/// generation, with their times and rates (0 where nothing was timed). Clients written for
/// llama-server (its web page among them) show them.
pub(crate) fn timings(done: &Completion) -> Value {
    let ms = |ns: u64| ns as f64 / 1e6;
    let per_token = |ms: f64, n: usize| if n > 0 { ms / n as f64 } else { 0.0 };
    let per_second = |ms: f64, n: usize| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
    let prompt_n = done
        .prompt_eval_count
        .saturating_sub(done.prompt_cached_count);
    let (prompt_ms, predicted_ms) = (ms(done.prompt_eval_duration_ns), ms(done.eval_duration_ns));
    json!({
        "cache_n": done.prompt_cached_count,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": per_token(prompt_ms, prompt_n),
        "prompt_per_second": per_second(prompt_ms, prompt_n),
        "predicted_n": done.eval_count,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": per_token(predicted_ms, done.eval_count),
        "predicted_per_second": per_second(predicted_ms, done.eval_count),
    })
}
