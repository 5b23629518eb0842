//! llama-server's `timings`: of a finished answer (the engine's own counts and times), of a
//! prompt's decode so far, and of a stream so far (`timings_per_token`, `StreamClock`); the
//! object written is `wire.rs`'s `Timings`.

use std::time::Instant;

use super::wire::Timings;
use crate::protocol::Completion;
use crate::requests::common::Generation;

/// llama-server's `timings` of a finished answer: the prompt's decoded and cached tokens and the
/// generation, with their times and rates (0 where nothing was timed). The generation's rate
/// is over its decode steps, one fewer than its tokens: the first token comes from the
/// prompt's last decode, and the generation's time starts after it. Clients written for
/// llama-server (its web page among them) show them.
pub(crate) fn timings(done: &Completion) -> Timings {
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
        t.draft_n = Some(done.draft_count);
        t.draft_n_accepted = Some(done.draft_accepted_count);
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
    pub(super) fn admitted(prompt: usize, cached: usize) -> Self {
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
    pub(crate) fn timings(&self) -> Timings {
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
pub(super) fn progress_timings(p: &crate::protocol::PromptProgress) -> Timings {
    let prompt_n = p.processed.saturating_sub(p.cache);
    timings_of(p.cache, prompt_n, p.time_ms as f64, 0, 0.0)
}

/// llama-server's timings object from its counts and times (ms); rates 0 where a divisor is 0.
pub(super) fn timings_of(
    cache_n: usize,
    prompt_n: usize,
    prompt_ms: f64,
    predicted_n: usize,
    predicted_ms: f64,
) -> Timings {
    let per_token = |ms: f64, n: usize| if n > 0 { ms / n as f64 } else { 0.0 };
    let per_second = |ms: f64, n: usize| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
    let steps = predicted_n.saturating_sub(1);
    Timings {
        cache_n,
        prompt_n,
        prompt_ms,
        prompt_per_token_ms: per_token(prompt_ms, prompt_n),
        prompt_per_second: per_second(prompt_ms, prompt_n),
        predicted_n,
        predicted_ms,
        predicted_per_token_ms: per_token(predicted_ms, steps),
        predicted_per_second: per_second(predicted_ms, steps),
        draft_n: None,
        draft_n_accepted: None,
    }
}
