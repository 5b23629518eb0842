//! `GET /metrics`: every Prometheus metric the runner exports, defined here and nowhere else,
//! in the text format (the `prometheus` crate's registry and encoder).
//!
//! Names mirror vLLM's under the `llamarunner:` prefix, and every sample carries vLLM's
//! `model_name` label, so that a dashboard query written for vLLM works after renaming
//! `vllm:` to `llamarunner:`. The Gateway API Inference Extension's model-server protocol
//! reads queue depth, running requests and KV-cache utilization under vLLM's names
//! (`num_requests_waiting`, `num_requests_running`, `kv_cache_usage_perc`): those are
//! published under our prefix too (docs/operations.md shows the gateway's configuration).
//!
//! Where each value comes from, so that every request is counted once in every dialect:
//! - the engine loop reports token and latency facts as they happen (`EngineObserver`):
//!   queue time, prompt and cached tokens and truncations at admission, time to first token
//!   and every inter-token gap as tokens are sampled, context shifts, embedded tokens;
//! - the request's outcome (finished with a reason, or rejected with a reason) is decided once
//!   per HTTP request when its response ends (`http/access.rs`, `Metrics::record`), with
//!   the end-to-end latency and the per-request token histograms;
//! - gauges (running, waiting, KV usage, slots) are read at scrape time from atomics the
//!   engine publishes (`Health`, `QueueGauge`): a scrape never waits for the engine thread.
//!
//! Counters only ever grow: rates are Prometheus's job (`rate()`), not the server's.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

use crate::protocol::{Completion, EngineHandle, EngineObserver};

/// The prefix of every metric name.
pub const PREFIX: &str = "llamarunner:";

/// `finished_reason` values of `request_success_total`, exported from the start at 0.
pub const FINISHED_REASONS: [&str; 3] = ["stop", "length", "timeout"];

/// `reason` values of `requests_rejected_total`, exported from the start at 0.
pub const REJECTED_REASONS: [&str; 11] = [
    "invalid",
    "unauthorized",
    "forbidden",
    "not_found",
    "body_timeout",
    "too_large",
    "queue_full",
    "timeout",
    "unavailable",
    "error",
    "cancelled",
];

/// Time to first token, seconds: vLLM's buckets.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// Inter-token latency, seconds: vLLM's buckets, with three below 10 ms for small models.
const ITL_BUCKETS: [f64; 22] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];

/// End-to-end latency and queue time, seconds: vLLM's request-latency buckets, with four
/// below 300 ms.
const LATENCY_BUCKETS: [f64; 25] = [
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
];

/// Why a request ended, as counted: decided once per HTTP request (`http/access.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A generation ran to its end (its final statistics).
    Finished(Completion),
    /// Refused or cut short; the `reason` label of `requests_rejected_total`.
    Rejected(&'static str),
    /// Answered, and neither of those (an embedding, `/health`, ...): not counted.
    Served,
}

/// The `reason` of a rejection answered with this HTTP status and error type.
pub fn rejection_reason(status: u16, kind: Option<&str>) -> &'static str {
    match status {
        400 => "invalid",
        401 => "unauthorized",
        403 => "forbidden",
        404 | 405 => "not_found",
        408 => "body_timeout",
        413 => "too_large",
        429 => "queue_full",
        503 if kind == Some("timeout") => "timeout",
        503 => "unavailable",
        _ => "error",
    }
}

/// `1, 2, 5, 10, 20, 50, ...` up to `max` (at least `1, 2, 5`): vLLM's token-count buckets.
fn buckets_1_2_5(max: usize) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale = 1u64;
    'outer: loop {
        for m in [1u64, 2, 5] {
            let b = m.saturating_mul(scale);
            if b > max as u64 && out.len() >= 3 {
                break 'outer;
            }
            out.push(b as f64);
        }
        match scale.checked_mul(10) {
            Some(s) => scale = s,
            None => break,
        }
    }
    out
}

/// Seconds, for histograms.
fn seconds(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// The registry and every metric in it.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests_running: IntGauge,
    requests_waiting: IntGauge,
    num_requests_running: IntGauge,
    num_requests_waiting: IntGauge,
    kv_cache_usage: Gauge,
    slots_total: IntGauge,
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    prompt_tokens_cached: IntCounter,
    request_success: IntCounterVec,
    requests_rejected: IntCounterVec,
    context_shifts: IntCounter,
    kv_swaps: IntCounter,
    prompt_truncations: IntCounter,
    spec_draft_tokens: IntCounter,
    spec_accepted_tokens: IntCounter,
    prompt_cache_bytes: IntGauge,
    prompt_cache_entries: IntGauge,
    prompt_cache_restored_tokens: IntCounter,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    e2e_latency: Histogram,
    queue_time: Histogram,
    request_prompt_tokens: Histogram,
    request_generation_tokens: Histogram,
    model_load_seconds: Gauge,
    model_info: IntGaugeVec,
    device_memory_total: IntGaugeVec,
    device_memory_free: IntGaugeVec,
    layers_offloaded: IntGauge,
    model_vram_bytes: IntGauge,
    /// Set once the model's description is exported in `model_info`.
    info_published: OnceLock<()>,
    /// The served model's name (`--alias`).
    model_name: String,
    /// llama-server's families under its names (`http/llama_server_metrics.rs`).
    llamacpp: super::llama_server_metrics::LlamaServerMetrics,
}

impl Metrics {
    /// Every metric, for the model served as `model_name` (the `model_name` label of every
    /// sample) with `ctx_size` tokens per slot (the top of the token-count buckets).
    pub fn new(model_name: &str, ctx_size: usize) -> Result<Self, prometheus::Error> {
        let labels = HashMap::from([("model_name".to_string(), model_name.to_string())]);
        let registry = Registry::new_custom(None, Some(labels))?;
        let name = |n: &str| format!("{PREFIX}{n}");
        let int_gauge = |n: &str, help: &str| -> Result<IntGauge, prometheus::Error> {
            let g = IntGauge::new(name(n), help)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let gauge = |n: &str, help: &str| -> Result<Gauge, prometheus::Error> {
            let g = Gauge::new(name(n), help)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let counter = |n: &str, help: &str| -> Result<IntCounter, prometheus::Error> {
            let c = IntCounter::new(name(n), help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let counter_vec = |n: &str,
                           help: &str,
                           label: &str,
                           values: &[&str]|
         -> Result<IntCounterVec, prometheus::Error> {
            let c = IntCounterVec::new(Opts::new(name(n), help), &[label])?;
            for v in values {
                c.with_label_values(&[*v]);
            }
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let histogram =
            |n: &str, help: &str, buckets: Vec<f64>| -> Result<Histogram, prometheus::Error> {
                let h = Histogram::with_opts(HistogramOpts::new(name(n), help).buckets(buckets))?;
                registry.register(Box::new(h.clone()))?;
                Ok(h)
            };
        let model_info = IntGaugeVec::new(
            Opts::new(
                name("model_info"),
                "The served model and its settings, as labels (value 1; exported once loaded).",
            ),
            &[
                "model",
                "file",
                "architecture",
                "quantization",
                "ctx_size",
                "parallel",
                "version",
            ],
        )?;
        registry.register(Box::new(model_info.clone()))?;
        let device_gauge = |n: &str, help: &str| -> Result<IntGaugeVec, prometheus::Error> {
            let g = IntGaugeVec::new(Opts::new(name(n), help), &["device", "backend", "kind"])?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let device_memory_total = device_gauge(
            "device_memory_total_bytes",
            "Memory of each compute device llama.cpp found (the CPU's is the host's memory).",
        )?;
        let device_memory_free = device_gauge(
            "device_memory_free_bytes",
            "Free memory of each compute device when the model was loaded.",
        )?;
        crate::constrain::stats::stats().register(&registry)?;
        Ok(Self {
            requests_running: int_gauge(
                "requests_running",
                "Requests holding a slot (generating, or decoding their prompt).",
            )?,
            requests_waiting: int_gauge("requests_waiting", "Requests waiting for a free slot.")?,
            num_requests_running: int_gauge(
                "num_requests_running",
                "Requests holding a slot: requests_running under vLLM's name (Inference \
                 Extension TotalRunningRequests).",
            )?,
            num_requests_waiting: int_gauge(
                "num_requests_waiting",
                "Requests waiting for a free slot: requests_waiting under vLLM's name \
                 (Inference Extension TotalQueuedRequests).",
            )?,
            kv_cache_usage: gauge(
                "kv_cache_usage_perc",
                "Fraction (0..1) of the KV cache's cells, over all slots, held by running \
                 requests (Inference Extension KVCacheUtilization).",
            )?,
            slots_total: int_gauge("slots_total", "KV slots: sequences served at once.")?,
            layers_offloaded: int_gauge(
                "model_layers_offloaded",
                "The model's layers placed on GPUs (0 on the CPU alone).",
            )?,
            model_vram_bytes: int_gauge(
                "model_vram_bytes",
                "Bytes of the model's weights on GPUs (in proportion to the layers offloaded).",
            )?,
            device_memory_total,
            device_memory_free,
            prompt_tokens: counter(
                "prompt_tokens_total",
                "Prompt tokens of admitted generations (cached ones included) and of embedded \
                 inputs.",
            )?,
            generation_tokens: counter("generation_tokens_total", "Tokens generated.")?,
            prompt_tokens_cached: counter(
                "prompt_tokens_cached_total",
                "Prompt tokens reused from a slot's KV cache instead of computed.",
            )?,
            request_success: counter_vec(
                "request_success_total",
                "Generations that ran to their end, by finish reason.",
                "finished_reason",
                &FINISHED_REASONS,
            )?,
            requests_rejected: counter_vec(
                "requests_rejected_total",
                "Requests refused or cut short, by reason (HTTP 4xx/5xx, or cancelled: the \
                 client left first).",
                "reason",
                &REJECTED_REASONS,
            )?,
            context_shifts: counter(
                "context_shifts_total",
                "Times a slot filled while generating and half of its unkept tokens were \
                 discarded.",
            )?,
            kv_swaps: counter(
                "kv_swapped_out_total",
                "Sequences swapped out of the KV cache the slots share (--kv-unified) to wait \
                 in RAM for room.",
            )?,
            prompt_truncations: counter(
                "prompt_truncations_total",
                "Prompts cut to fit a slot (counted when their request got its slot).",
            )?,
            spec_draft_tokens: counter(
                "spec_decode_num_draft_tokens_total",
                "Tokens drafted by prompt lookup and verified (speculative decoding).",
            )?,
            spec_accepted_tokens: counter(
                "spec_decode_num_accepted_tokens_total",
                "Drafted tokens the sampler agreed with: decode steps saved.",
            )?,
            prompt_cache_bytes: int_gauge(
                "prompt_cache_bytes",
                "Bytes of sequence state held in the host-memory prompt cache (--cache-ram).",
            )?,
            prompt_cache_entries: int_gauge(
                "prompt_cache_entries",
                "Sequences held in the host-memory prompt cache.",
            )?,
            prompt_cache_restored_tokens: counter(
                "prompt_cache_restored_tokens_total",
                "Prompt tokens restored from the host-memory prompt cache instead of decoded.",
            )?,
            time_to_first_token: histogram(
                "time_to_first_token_seconds",
                "Time from a request's arrival to its first generated token.",
                TTFT_BUCKETS.to_vec(),
            )?,
            inter_token_latency: histogram(
                "inter_token_latency_seconds",
                "Time between two consecutive generated tokens of a request.",
                ITL_BUCKETS.to_vec(),
            )?,
            e2e_latency: histogram(
                "e2e_request_latency_seconds",
                "Time from a finished generation's arrival to the end of its response.",
                LATENCY_BUCKETS.to_vec(),
            )?,
            queue_time: histogram(
                "request_queue_time_seconds",
                "Time from a request's arrival to its admission into a slot.",
                LATENCY_BUCKETS.to_vec(),
            )?,
            request_prompt_tokens: histogram(
                "request_prompt_tokens",
                "Prompt tokens of each finished generation.",
                buckets_1_2_5(ctx_size),
            )?,
            request_generation_tokens: histogram(
                "request_generation_tokens",
                "Tokens generated by each finished generation.",
                buckets_1_2_5(ctx_size.saturating_mul(10)),
            )?,
            model_load_seconds: gauge(
                "model_load_seconds",
                "Time the engine took from its start to ready: model file, context, template.",
            )?,
            model_info,
            info_published: OnceLock::new(),
            model_name: model_name.to_string(),
            llamacpp: super::llama_server_metrics::LlamaServerMetrics::new()?,
            registry,
        })
    }

    /// Counts a request's outcome; `elapsed`: from its arrival to the end of its response.
    pub fn record(&self, outcome: &Outcome, elapsed: Duration) {
        match outcome {
            Outcome::Finished(done) => {
                self.request_success
                    .with_label_values(&[done.done_reason.as_str()])
                    .inc();
                self.e2e_latency.observe(seconds(elapsed));
                self.request_prompt_tokens
                    .observe(done.prompt_eval_count as f64);
                self.request_generation_tokens
                    .observe(done.eval_count as f64);
                self.llamacpp.finished(done);
            }
            Outcome::Rejected(reason) => {
                self.requests_rejected.with_label_values(&[*reason]).inc();
            }
            Outcome::Served => {}
        }
    }

    /// Reads the gauges from what the engine publishes, then writes every metric in the
    /// Prometheus text format.
    pub fn render(&self, engine: &EngineHandle) -> Result<String, prometheus::Error> {
        let health = &engine.health;
        let (busy, total) = health.slots();
        let waiting = i64::try_from(engine.queue.waiting()).unwrap_or(i64::MAX);
        self.requests_running.set(i64::from(busy));
        self.num_requests_running.set(i64::from(busy));
        self.requests_waiting.set(waiting);
        self.num_requests_waiting.set(waiting);
        self.llamacpp.publish(i64::from(busy), waiting);
        self.slots_total.set(i64::from(total));
        if let Some(info) = health.model_info() {
            let cells = info
                .shared_cells
                .map_or(info.slot_ctx as f64 * f64::from(total), |c| c as f64);
            let usage = if cells > 0.0 {
                (health.busy_cells() as f64 / cells).clamp(0.0, 1.0)
            } else {
                0.0
            };
            self.kv_cache_usage.set(usage);
            if self.info_published.set(()).is_ok() {
                let file = info
                    .path
                    .file_name()
                    .map(|f| f.to_string_lossy().into_owned())
                    .unwrap_or_default();
                self.model_info
                    .with_label_values(&[
                        self.model_name.as_str(),
                        file.as_str(),
                        info.architecture.as_str(),
                        info.quantization.as_str(),
                        info.slot_ctx.to_string().as_str(),
                        total.to_string().as_str(),
                        env!("CARGO_PKG_VERSION"),
                    ])
                    .set(1);
                self.publish_devices(&info.devices);
            }
        }
        if let Some(t) = health.load_time() {
            self.model_load_seconds.set(seconds(t));
        }
        let mut out = Vec::new();
        let mut families = self.registry.gather();
        families.extend(self.llamacpp.registry.gather());
        TextEncoder::new().encode(&families, &mut out)?;
        String::from_utf8(out).map_err(|e| prometheus::Error::Msg(e.to_string()))
    }

    /// The devices' memory and the model's placement, once the model is loaded.
    fn publish_devices(&self, facts: &crate::protocol::devices::DeviceFacts) {
        let bytes = |b: u64| i64::try_from(b).unwrap_or(i64::MAX);
        for device in &facts.devices {
            let labels = [
                device.name.as_str(),
                device.backend.as_str(),
                device.kind.as_str(),
            ];
            self.device_memory_total
                .with_label_values(&labels)
                .set(bytes(device.memory_total));
            self.device_memory_free
                .with_label_values(&labels)
                .set(bytes(device.memory_free));
        }
        self.layers_offloaded.set(i64::from(facts.layers_offloaded));
        self.model_vram_bytes.set(bytes(facts.vram_bytes));
    }
}

impl EngineObserver for Metrics {
    fn admitted(&self, queued: Duration, prompt: usize, cached: usize, truncated: bool) {
        self.queue_time.observe(seconds(queued));
        self.prompt_tokens.inc_by(prompt as u64);
        self.prompt_tokens_cached.inc_by(cached as u64);
        self.llamacpp.admitted(prompt, cached);
        if truncated {
            self.prompt_truncations.inc();
        }
    }

    fn first_token(&self, since_arrival: Duration) {
        self.generation_tokens.inc();
        self.llamacpp.token();
        self.time_to_first_token.observe(seconds(since_arrival));
    }

    fn next_token(&self, gap: Duration) {
        self.generation_tokens.inc();
        self.llamacpp.token();
        self.inter_token_latency.observe(seconds(gap));
    }

    fn context_shift(&self) {
        self.context_shifts.inc();
    }

    fn swapped_out(&self) {
        self.kv_swaps.inc();
    }

    fn speculated(&self, drafted: usize, accepted: usize) {
        self.spec_draft_tokens.inc_by(drafted as u64);
        self.spec_accepted_tokens.inc_by(accepted as u64);
        self.llamacpp.speculated(drafted, accepted);
    }

    fn decoded(&self, sequences: usize) {
        self.llamacpp.decoded(sequences);
    }

    fn embedded(&self, tokens: usize) {
        self.prompt_tokens.inc_by(tokens as u64);
        self.llamacpp.embedded(tokens);
    }

    fn prompt_cache(&self, bytes: usize, entries: usize, restored: usize) {
        self.prompt_cache_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        self.prompt_cache_entries
            .set(i64::try_from(entries).unwrap_or(i64::MAX));
        self.prompt_cache_restored_tokens.inc_by(restored as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::DoneReason;

    fn done(reason: DoneReason, prompt: usize, generated: usize) -> Completion {
        Completion {
            done_reason: reason,
            prompt_eval_count: prompt,
            prompt_cached_count: 0,
            queue_duration_ns: 0,
            prompt_eval_duration_ns: 0,
            eval_count: generated,
            eval_duration_ns: 0,
            truncated: false,
            draft_count: 0,
            draft_accepted_count: 0,
            stop_string: None,
        }
    }

    /// The value of the sample `name{labels}` in `text` (labels as written, in order).
    fn sample(text: &str, name_and_labels: &str) -> Option<f64> {
        text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            (key == name_and_labels).then(|| value.parse().ok())?
        })
    }

    #[test]
    fn token_buckets_follow_1_2_5_up_to_the_context() {
        assert_eq!(
            buckets_1_2_5(512),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0]
        );
        assert_eq!(buckets_1_2_5(0), vec![1.0, 2.0, 5.0]);
        assert_eq!(buckets_1_2_5(usize::MAX).len(), 60);
    }

    #[test]
    fn rejections_are_named_by_status_and_type() {
        assert_eq!(rejection_reason(429, Some("overloaded")), "queue_full");
        assert_eq!(rejection_reason(400, Some("invalid_json")), "invalid");
        assert_eq!(rejection_reason(401, None), "unauthorized");
        assert_eq!(rejection_reason(503, Some("timeout")), "timeout");
        assert_eq!(rejection_reason(503, Some("model_loading")), "unavailable");
        assert_eq!(rejection_reason(500, Some("internal_error")), "error");
        for r in [400, 401, 403, 404, 408, 413, 429, 503, 500] {
            assert!(REJECTED_REASONS.contains(&rejection_reason(r, None)), "{r}");
        }
    }

    #[test]
    fn llama_server_s_families_are_unlabelled_and_add_up() {
        let m = Metrics::new("m", 64).unwrap();
        let (engine, _inbox) = EngineHandle::new(4);
        // Two requests: 10 prompt tokens (4 cached), then 3 tokens; 6 tokens, then 1.
        m.admitted(Duration::ZERO, 10, 4, false);
        m.decoded(2);
        m.first_token(Duration::ZERO);
        m.next_token(Duration::ZERO);
        m.decoded(1);
        m.next_token(Duration::ZERO);
        m.decoded(1);
        m.admitted(Duration::ZERO, 6, 0, false);
        m.first_token(Duration::ZERO);
        m.speculated(4, 1);
        m.embedded(5);
        let mut first = done(DoneReason::Length, 10, 3);
        first.prompt_cached_count = 4;
        first.prompt_eval_duration_ns = 500_000_000;
        first.eval_duration_ns = 1_000_000_000;
        m.record(&Outcome::Finished(first), Duration::ZERO);
        let mut second = done(DoneReason::Stop, 6, 1);
        second.prompt_eval_duration_ns = 500_000_000;
        m.record(&Outcome::Finished(second), Duration::ZERO);
        // A third, under way: its tokens count, but not in the rates until it finishes.
        m.admitted(Duration::ZERO, 50, 0, false);
        m.first_token(Duration::ZERO);
        m.next_token(Duration::ZERO);
        m.next_token(Duration::ZERO);
        let text = m.render(&engine).unwrap();
        for (name, want) in [
            // Decoded prompt tokens: 6 + 6 + 50, and the embedding's 5.
            ("prompt_tokens_total", 67.0),
            ("prompt_tokens_cached_total", 4.0),
            ("prompt_seconds_total", 1.0),
            ("tokens_predicted_total", 7.0),
            ("tokens_predicted_seconds_total", 1.0),
            ("n_decode_total", 3.0),
            ("n_tokens_max", 13.0),
            ("spec_decode_num_draft_tokens_total", 4.0),
            ("spec_decode_num_accepted_tokens_total", 1.0),
            ("spec_decode_num_drafts_total", 1.0),
            // The finished requests' decoded prompt tokens (6 + 6) over their second.
            ("prompt_tokens_seconds", 12.0),
            // Of the finished requests' tokens, two cost a decode step each (the first ones
            // came with their prompts).
            ("predicted_tokens_seconds", 2.0),
            ("n_busy_slots_per_decode", 4.0 / 3.0),
            ("requests_processing", 0.0),
            ("requests_deferred", 0.0),
        ] {
            let full = format!("llamacpp:{name}");
            assert_eq!(sample(&text, &full), Some(want), "{full}\n{text}");
            assert!(text.contains(&format!("# HELP {full} ")), "{full}");
        }
        assert!(!text.contains("llamacpp:busy_slot_steps"), "{text}");
    }

    #[test]
    fn outcomes_and_engine_events_move_their_metrics_and_never_reset() {
        let m = Metrics::new("m", 64).unwrap();
        let (engine, _inbox) = EngineHandle::new(4);
        m.admitted(Duration::from_millis(30), 10, 4, true);
        m.first_token(Duration::from_millis(50));
        m.next_token(Duration::from_millis(2));
        m.next_token(Duration::from_millis(3));
        m.context_shift();
        m.swapped_out();
        m.speculated(5, 3);
        m.speculated(2, 0);
        m.embedded(7);
        m.record(
            &Outcome::Finished(done(DoneReason::Length, 10, 3)),
            Duration::from_millis(80),
        );
        m.record(&Outcome::Rejected("queue_full"), Duration::ZERO);
        m.record(&Outcome::Served, Duration::ZERO);
        for _ in 0..2 {
            // A scrape changes nothing: counters are never reset.
            let text = m.render(&engine).unwrap();
            let get = |name: &str| sample(&text, name).unwrap_or(f64::NAN);
            let cases = [
                (r#"prompt_tokens_total{model_name="m"}"#, 17.0),
                (r#"prompt_tokens_cached_total{model_name="m"}"#, 4.0),
                (r#"generation_tokens_total{model_name="m"}"#, 3.0),
                (r#"context_shifts_total{model_name="m"}"#, 1.0),
                (r#"kv_swapped_out_total{model_name="m"}"#, 1.0),
                (r#"prompt_truncations_total{model_name="m"}"#, 1.0),
                (r#"spec_decode_num_draft_tokens_total{model_name="m"}"#, 7.0),
                (
                    r#"spec_decode_num_accepted_tokens_total{model_name="m"}"#,
                    3.0,
                ),
                (
                    r#"request_success_total{finished_reason="length",model_name="m"}"#,
                    1.0,
                ),
                (
                    r#"request_success_total{finished_reason="stop",model_name="m"}"#,
                    0.0,
                ),
                (
                    r#"requests_rejected_total{reason="queue_full",model_name="m"}"#,
                    1.0,
                ),
                (
                    r#"requests_rejected_total{reason="cancelled",model_name="m"}"#,
                    0.0,
                ),
                (r#"inter_token_latency_seconds_count{model_name="m"}"#, 2.0),
                (
                    r#"inter_token_latency_seconds_bucket{model_name="m",le="0.0025"}"#,
                    1.0,
                ),
                (r#"time_to_first_token_seconds_count{model_name="m"}"#, 1.0),
                (r#"e2e_request_latency_seconds_count{model_name="m"}"#, 1.0),
                (r#"request_generation_tokens_sum{model_name="m"}"#, 3.0),
                (r#"request_prompt_tokens_count{model_name="m"}"#, 1.0),
                (r#"request_queue_time_seconds_count{model_name="m"}"#, 1.0),
                (r#"requests_waiting{model_name="m"}"#, 0.0),
            ];
            for (name, want) in cases {
                assert_eq!(get(&format!("{PREFIX}{name}")), want, "{name}\n{text}");
            }
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let m = Metrics::new("a\"b\nc", 64).unwrap();
        let (engine, _inbox) = EngineHandle::new(4);
        let text = m.render(&engine).unwrap();
        assert!(
            text.contains(r#"llamarunner:slots_total{model_name="a\"b\nc"} 0"#),
            "{text}"
        );
    }
}
