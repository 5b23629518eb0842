//! llama-server's metrics under its own names (`llamacpp:prompt_tokens_total`...), beside
//! ours, so that dashboards and alerts written for llama-server work unchanged. Its samples
//! carry no labels, as llama-server's do (a router labels them with the model's name).
//!
//! Where each comes from: prompt, cached and embedded tokens at admission and embedding;
//! every decode step and the slots in it (`EngineObserver::decoded`); the generated tokens as
//! they are sampled; the prompt's and the generation's time from each finished request
//! (`Completion`), the throughput gauges from finished requests alone (tokens and seconds
//! counted together, so that requests under way do not inflate them), and the running and
//! waiting requests read at scrape time.

use std::sync::Mutex;

use prometheus::{Counter, Gauge, IntCounter, IntGauge, Registry};

use crate::protocol::Completion;

/// The prefix of every name here (Prometheus reserves colons for recording rules; llama-server
/// uses one all the same, and it is what its users query).
const PREFIX: &str = "llamacpp:";

/// llama-server's metric families.
#[derive(Debug)]
pub struct LlamaServerMetrics {
    /// Its own registry: no const labels.
    pub(super) registry: Registry,
    prompt_tokens: IntCounter,
    prompt_tokens_cached: IntCounter,
    prompt_seconds: Counter,
    tokens_predicted: IntCounter,
    tokens_predicted_seconds: Counter,
    n_decode: IntCounter,
    n_tokens_max: IntCounter,
    spec_draft_tokens: IntCounter,
    spec_accepted_tokens: IntCounter,
    spec_drafts: IntCounter,
    prompt_tokens_seconds: Gauge,
    predicted_tokens_seconds: Gauge,
    requests_processing: IntGauge,
    requests_deferred: IntGauge,
    n_busy_slots_per_decode: Gauge,
    /// Busy slots summed over decode steps (not exported: the gauge is its mean).
    busy_slot_steps: IntCounter,
    /// Finished requests' decoded prompt tokens, for the prompt rate over `prompt_seconds`.
    finished_prompt_tokens: IntCounter,
    /// Finished requests' tokens that cost a decode step (each request's first token comes with
    /// its prompt), for the generation rate over `tokens_predicted_seconds`.
    generation_steps: IntCounter,
    /// Held while `n_tokens_max` is read and raised, so that two requests finishing at once
    /// cannot both raise it from the same value.
    raising_max: Mutex<()>,
}

impl LlamaServerMetrics {
    /// The families, registered.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let name = |n: &str| format!("{PREFIX}{n}");
        let int_counter = |n: &str, help: &str| -> Result<IntCounter, prometheus::Error> {
            let c = IntCounter::new(name(n), help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let counter = |n: &str, help: &str| -> Result<Counter, prometheus::Error> {
            let c = Counter::new(name(n), help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let gauge = |n: &str, help: &str| -> Result<Gauge, prometheus::Error> {
            let g = Gauge::new(name(n), help)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let int_gauge = |n: &str, help: &str| -> Result<IntGauge, prometheus::Error> {
            let g = IntGauge::new(name(n), help)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let internal = |n: &str| IntCounter::new(name(n), "internal");
        Ok(Self {
            prompt_tokens: int_counter(
                "prompt_tokens_total",
                "Number of prompt tokens processed (decoded; cached ones apart).",
            )?,
            prompt_tokens_cached: int_counter(
                "prompt_tokens_cached_total",
                "Number of prompt tokens reused from a cache, costing no decode.",
            )?,
            prompt_seconds: counter("prompt_seconds_total", "Prompt process time, in seconds.")?,
            tokens_predicted: int_counter(
                "tokens_predicted_total",
                "Number of generation tokens processed.",
            )?,
            tokens_predicted_seconds: counter(
                "tokens_predicted_seconds_total",
                "Predict process time, in seconds.",
            )?,
            n_decode: int_counter("n_decode_total", "Total number of llama_decode() calls.")?,
            n_tokens_max: int_counter(
                "n_tokens_max",
                "Largest observed n_tokens (a sequence's prompt and generated tokens).",
            )?,
            spec_draft_tokens: int_counter(
                "spec_decode_num_draft_tokens_total",
                "Number of tokens drafted by speculative decoding.",
            )?,
            spec_accepted_tokens: int_counter(
                "spec_decode_num_accepted_tokens_total",
                "Number of drafted tokens accepted.",
            )?,
            spec_drafts: int_counter(
                "spec_decode_num_drafts_total",
                "Number of drafts (steps of a sequence that drafted tokens).",
            )?,
            prompt_tokens_seconds: gauge(
                "prompt_tokens_seconds",
                "Average prompt throughput in tokens/s.",
            )?,
            predicted_tokens_seconds: gauge(
                "predicted_tokens_seconds",
                "Average generation throughput in tokens/s.",
            )?,
            requests_processing: int_gauge(
                "requests_processing",
                "Number of requests processing.",
            )?,
            requests_deferred: int_gauge("requests_deferred", "Number of requests deferred.")?,
            n_busy_slots_per_decode: gauge(
                "n_busy_slots_per_decode",
                "Average number of busy slots per llama_decode() call.",
            )?,
            busy_slot_steps: internal("busy_slot_steps")?,
            finished_prompt_tokens: internal("finished_prompt_tokens")?,
            generation_steps: internal("generation_steps")?,
            raising_max: Mutex::new(()),
            registry,
        })
    }

    /// A request got a slot with `prompt` tokens, `cached` of them from a cache.
    pub(super) fn admitted(&self, prompt: usize, cached: usize) {
        self.prompt_tokens
            .inc_by(prompt.saturating_sub(cached) as u64);
        self.prompt_tokens_cached.inc_by(cached as u64);
    }

    /// A token was sampled.
    pub(super) fn token(&self) {
        self.tokens_predicted.inc();
    }

    /// A decode step over `sequences` busy slots.
    pub(super) fn decoded(&self, sequences: usize) {
        self.n_decode.inc();
        self.busy_slot_steps.inc_by(sequences as u64);
    }

    /// An embedding input of `tokens` tokens was embedded.
    pub(super) fn embedded(&self, tokens: usize) {
        self.prompt_tokens.inc_by(tokens as u64);
    }

    /// Tokens drafted for a sequence in one step, and those accepted.
    pub(super) fn speculated(&self, drafted: usize, accepted: usize) {
        if drafted > 0 {
            self.spec_drafts.inc();
        }
        self.spec_draft_tokens.inc_by(drafted as u64);
        self.spec_accepted_tokens.inc_by(accepted as u64);
    }

    /// A request finished: its prompt's and generation's times, and its length.
    pub(super) fn finished(&self, done: &Completion) {
        self.prompt_seconds
            .inc_by(done.prompt_eval_duration_ns as f64 / 1e9);
        self.tokens_predicted_seconds
            .inc_by(done.eval_duration_ns as f64 / 1e9);
        self.finished_prompt_tokens.inc_by(
            done.prompt_eval_count
                .saturating_sub(done.prompt_cached_count) as u64,
        );
        self.generation_steps
            .inc_by(done.eval_count.saturating_sub(1) as u64);
        let n_tokens = (done.prompt_eval_count + done.eval_count) as u64;
        let _raising = self.raising_max.lock().unwrap_or_else(|e| e.into_inner());
        let max = self.n_tokens_max.get();
        if n_tokens > max {
            self.n_tokens_max.inc_by(n_tokens - max);
        }
    }

    /// The gauges, at scrape time: `busy` requests in slots, `waiting` in the queue.
    pub(super) fn publish(&self, busy: i64, waiting: i64) {
        self.requests_processing.set(busy);
        self.requests_deferred.set(waiting);
        let rate = |n: u64, seconds: f64| {
            if seconds > 0.0 {
                n as f64 / seconds
            } else {
                0.0
            }
        };
        self.prompt_tokens_seconds.set(rate(
            self.finished_prompt_tokens.get(),
            self.prompt_seconds.get(),
        ));
        self.predicted_tokens_seconds.set(rate(
            self.generation_steps.get(),
            self.tokens_predicted_seconds.get(),
        ));
        let decodes = self.n_decode.get();
        self.n_busy_slots_per_decode.set(if decodes > 0 {
            self.busy_slot_steps.get() as f64 / decodes as f64
        } else {
            0.0
        });
    }
}
