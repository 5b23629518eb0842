//! `AppState`: what every handler can reach (the engine's handle, the model's name, the
//! request limits and policy, metrics, slot files, the LoRA table, the image budget).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::metrics::Metrics;
use super::middleware::HttpPolicy;
use crate::protocol::EngineHandle;

/// Server-wide limits on one request (`--max-tokens`, `--timeout`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Limits {
    /// Most tokens one request may generate; 0 = no cap (beyond ten slot contexts).
    pub max_tokens: u32,
    /// Wall time a request may take from arrival, queueing included; None = no limit.
    pub timeout: Option<Duration>,
}

/// Images the server holds at once between a request's arrival and its admission into a slot
/// (decoded pixels, then the projector's preprocessed input, which is float and can be larger):
/// with the per-request pixel bound, this bounds what clients sending images in parallel can
/// make the server hold. A request that would pass it is refused with a 429 (`overloaded`),
/// as a full queue is.
pub const IMAGES_IN_FLIGHT: usize = 32;

/// What every handler can reach.
#[derive(Clone, Debug)]
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
    /// The model's public name (`--alias`, default the file stem).
    pub model_name: Arc<str>,
    /// Per-request limits (`--max-tokens`, `--timeout`).
    pub limits: Limits,
    /// API keys, allowed hosts and origins, the body limit (`middleware.rs`).
    pub policy: Arc<HttpPolicy>,
    /// The Prometheus metrics (`GET /metrics`); None with `--no-metrics`.
    pub metrics: Option<Arc<Metrics>>,
    /// Where slot files are saved and restored from (`--slot-save-path`); None: off.
    pub slot_save_path: Option<Arc<Path>>,
    /// The `--lora` adapters and their default scales (`lora.rs`).
    pub lora: Arc<crate::protocol::lora::LoraTable>,
    /// `<think>` reasoning in chat answers (`--reasoning-format`).
    pub reasoning_format: crate::config::ReasoningFormat,
    /// Whether templates think when a request does not say (`--reasoning`).
    pub reasoning: crate::config::Reasoning,
    /// Images being decoded, tokenized or queued, at most `IMAGES_IN_FLIGHT`:
    /// each holds its pixels, then the projector's preprocessed input, until its request has
    /// a slot.
    pub images_in_flight: Arc<tokio::sync::Semaphore>,
    /// The responses `POST /v1/responses` keeps for `previous_response_id`.
    pub responses: Arc<super::response_store::ResponseStore>,
    /// Whether OpenAI answers carry llama-server's `__verbose` debug object when the request
    /// does not say (`--verbose`, as llama-server's).
    pub verbose_answers: bool,
    /// The seed of requests that give none (`--seed`); -1: random per request.
    pub default_seed: i64,
    /// The sampling of requests that leave fields out (`--temp`, `--top-k`...).
    pub sampling_defaults: crate::protocol::params::SamplingDefaults,
    /// The system message of a conversation that has none (`--system-prompt`).
    pub system_prompt: Option<Arc<str>>,
    /// How embeddings pool the tokens' outputs (`--pooling`): with none, only `/embedding`
    /// serves them (one vector per token).
    pub pooling: crate::config::Pooling,
}

impl AppState {
    /// State for an engine serving the model called `model_name`.
    pub fn new(engine: EngineHandle, model_name: impl Into<Arc<str>>) -> Self {
        Self {
            engine,
            model_name: model_name.into(),
            limits: Limits::default(),
            policy: Arc::new(HttpPolicy::default()),
            metrics: None,
            slot_save_path: None,
            lora: Arc::default(),
            reasoning_format: crate::config::ReasoningFormat::Auto,
            reasoning: crate::config::Reasoning::Auto,
            images_in_flight: Arc::new(tokio::sync::Semaphore::new(IMAGES_IN_FLIGHT)),
            responses: Arc::default(),
            verbose_answers: false,
            default_seed: -1,
            sampling_defaults: Default::default(),
            system_prompt: None,
            pooling: crate::config::Pooling::Auto,
        }
    }

    /// The same state giving conversations without a system message this one.
    pub fn with_system_prompt(mut self, prompt: Option<&str>) -> Self {
        self.system_prompt = prompt.filter(|p| !p.is_empty()).map(Arc::from);
        self
    }

    /// The same state filling what requests leave out of their sampling with `defaults`.
    pub fn with_sampling_defaults(
        mut self,
        defaults: crate::protocol::params::SamplingDefaults,
    ) -> Self {
        self.sampling_defaults = defaults;
        self
    }

    /// The same state seeding requests that give no seed with `seed` (-1: random).
    pub fn with_default_seed(mut self, seed: i64) -> Self {
        self.default_seed = seed;
        self
    }

    /// The same state answering with llama-server's `__verbose` debug object by default.
    pub fn with_verbose_answers(mut self, verbose: bool) -> Self {
        self.verbose_answers = verbose;
        self
    }

    /// The same state serving these LoRA adapters (the engine must have loaded the same).
    pub fn with_lora(mut self, table: Arc<crate::protocol::lora::LoraTable>) -> Self {
        self.lora = table;
        self
    }

    /// The same state, exporting these metrics at `GET /metrics` and counting outcomes into
    /// them (the engine should report to them too: `EngineHandle::with_observer`).
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The same state saving and restoring slot files in `dir` (an existing directory;
    /// `ops::slots::prepare_dir` makes one).
    pub fn with_slot_save_path(mut self, dir: Option<Arc<Path>>) -> Self {
        self.slot_save_path = dir;
        self
    }

    /// The same state with this treatment of `<think>` reasoning: how answers are read
    /// (`--reasoning-format`) and whether templates think by default (`--reasoning`).
    pub fn with_reasoning(
        mut self,
        format: crate::config::ReasoningFormat,
        reasoning: crate::config::Reasoning,
    ) -> Self {
        self.reasoning_format = format;
        self.reasoning = reasoning;
        self
    }

    /// The same state with embeddings pooled this way (`--pooling`).
    pub fn with_pooling(mut self, pooling: crate::config::Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// The same state under this request policy (the default: no API key, loopback hosts and
    /// origins only, 8 MiB bodies).
    pub fn with_policy(mut self, policy: HttpPolicy) -> Self {
        self.policy = Arc::new(policy);
        self
    }

    /// The same state with these per-request limits.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }
}
