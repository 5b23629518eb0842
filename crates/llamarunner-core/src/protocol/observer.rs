//! What the engine thread reports as it works, for the metrics: a narrow seam so that the
//! engine knows nothing of Prometheus (`http/metrics.rs` implements it) and the scheduler's
//! tests run without it. Every call is made on the engine thread, between decode steps:
//! implementations must be cheap (atomic updates) and must never block.

use std::time::Duration;

/// Events of the engine loop that the metrics count. Every method does nothing by default.
pub trait EngineObserver: Send + Sync + std::fmt::Debug {
    /// A request got a slot, after waiting `queued` since it arrived, with `prompt` tokens of
    /// which `cached` were reused from the slot's KV cache; `truncated`: its prompt was cut
    /// to fit the slot (here or on the HTTP side).
    fn admitted(&self, queued: Duration, prompt: usize, cached: usize, truncated: bool) {
        let _ = (queued, prompt, cached, truncated);
    }

    /// A request's first token was sampled, `since_arrival` after it arrived.
    fn first_token(&self, since_arrival: Duration) {
        let _ = since_arrival;
    }

    /// Another token of a request was sampled, `gap` after its previous one.
    fn next_token(&self, gap: Duration) {
        let _ = gap;
    }

    /// The prompt cache (`--cache-ram`) changed: it holds `bytes` in `entries` sequences, and
    /// a restore just saved decoding `restored` prompt tokens (0 when a sequence was stored).
    fn prompt_cache(&self, bytes: usize, entries: usize, restored: usize) {
        let _ = (bytes, entries, restored);
    }

    /// `drafted` tokens were drafted for a sequence in one step and `accepted` of them kept.
    fn speculated(&self, drafted: usize, accepted: usize) {
        let _ = (drafted, accepted);
    }

    /// The model decoded a batch (a `llama_decode` call) holding positions of `sequences`
    /// sequences (1 for an embedding input's piece).
    fn decoded(&self, sequences: usize) {
        let _ = sequences;
    }

    /// A slot filled while generating and half of its unkept tokens were discarded.
    fn context_shift(&self) {}

    /// A sequence was swapped out of the KV cache the slots share (`--kv-unified`) to wait in
    /// RAM for room (`sched/shared_cache.rs`).
    fn swapped_out(&self) {}

    /// An embedding input of `tokens` tokens was embedded.
    fn embedded(&self, tokens: usize) {
        let _ = tokens;
    }
}

/// The observer that counts nothing (tests, and `--no-metrics`).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoObserver;

impl EngineObserver for NoObserver {}
