//! `RunnerConfig`: every knob of the runner, deserialized once (from the Python side's JSON or
//! from tests) and validated once. Nothing else in the crate reads the environment.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

mod sampling;
mod validate;

/// Flash attention policy, as llama.cpp understands it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlashAttn {
    /// Let llama.cpp decide per backend.
    #[default]
    Auto,
    /// Always on.
    On,
    /// Always off.
    Off,
}

/// How a model is spread over several GPUs (llama.cpp's `--split-mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SplitMode {
    /// One GPU (`--main-gpu`) holds every offloaded layer.
    None,
    /// Whole layers (and their KV cache) go to the GPUs in proportion to their free memory.
    #[default]
    Layer,
    /// Layers split by rows across GPUs, where the backend supports it (CUDA, SYCL).
    Row,
}

impl SplitMode {
    /// Its name on the command line and in `/props`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Layer => "layer",
            Self::Row => "row",
        }
    }
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One line of text per event, for people.
    #[default]
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

/// What chat answers do with a model's `<think>...</think>` reasoning.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReasoningFormat {
    /// Split it out (`reasoning_content` in OpenAI's dialect, `thinking` in Ollama's) when the
    /// chat template is a thinking model's (it mentions `<think>`).
    #[default]
    Auto,
    /// Leave the text as the model wrote it.
    None,
}

/// How an embedding input's per-token outputs become its embedding (`--pooling`,
/// llama-server's flag).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The model's own (a GGUF's `pooling_type`), else the mean of the tokens'.
    #[default]
    Auto,
    /// The mean of the tokens' outputs.
    Mean,
    /// The first token's output.
    Cls,
    /// The last token's output.
    Last,
    /// None: every token's output, one vector each (served by `/embedding` alone).
    None,
}

/// Whether chat templates are asked to think (`--reasoning`, llama-server's flag): the
/// `enable_thinking` a chat request's template gets when the request does not say (Ollama's
/// `think`, `chat_template_kwargs.enable_thinking`, `reasoning_effort`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reasoning {
    /// True for a template that reads `enable_thinking` (a thinking model's); others see it
    /// as none.
    #[default]
    Auto,
    /// True for every template, and `<think>` reasoning read out of every chat answer.
    On,
    /// False: thinking templates close the block before the answer.
    Off,
}

impl Reasoning {
    /// The `enable_thinking` of a request that does not set it, for `template`.
    pub fn default_thinking(self, template: &crate::chat::ChatTemplate) -> Option<bool> {
        match self {
            Self::On => Some(true),
            Self::Off => Some(false),
            Self::Auto => template.reads_enable_thinking().then_some(true),
        }
    }
}

/// Everything the runner needs to start. Field names match the CLI flags (`--ctx-size` is
/// `ctx_size`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunnerConfig {
    /// Path of the GGUF model file.
    pub model: PathBuf,
    /// Address to bind.
    pub host: String,
    /// Port to bind; 0 picks a free one.
    pub port: u16,
    /// Number of sequences served at once (llama.cpp sequence ids / KV slots).
    pub parallel: u32,
    /// Context size of each slot, in tokens (the context holds `ctx_size * parallel` cells).
    pub ctx_size: u32,
    /// Most tokens decoded in one step, across all sequences (also llama.cpp's `n_ubatch`).
    pub batch_size: u32,
    /// CPU threads for decoding; 0 = every available core.
    pub threads: u32,
    /// Threads a step's sequences are sampled on, in parallel; 0 = every available core, but
    /// no more than `parallel` (1: on the engine thread, one after another).
    pub sampling_threads: u32,
    /// For benchmarks: decodes compute nothing and give synthetic logits of the model's
    /// vocabulary, so that the server's own work per token is measured alone.
    pub null_decode: bool,
    /// llama-server's `--backend-sampling`: a request whose sampler chain needs only the best
    /// `k` logits of a position (its first cut a top-k or greedy, nothing changed before it but
    /// bans, no log-probabilities asked for) has a top-k computed in the decode's graph, on the
    /// device of the model's output layer, so that a few hundred candidates per position come
    /// back instead of the whole vocabulary's logits (`backend/llama/device_cut.rs`).
    pub backend_sampling: bool,
    /// Deterministic mode (`--deterministic`): a request's output depends only on the request,
    /// not on what else shares its batch, how its prompt was chunked or whether it came from a
    /// cache. The model runs on the CPU with kernels whose rows compute the same for every
    /// batch shape (`backend::invariant_batch` says which and how).
    pub deterministic: bool,
    /// Layers to offload to the GPU; -1 = as many as fit (all, with `fit` off).
    pub n_gpu_layers: i32,
    /// GPU used for the model when it is not split (an index among the GPUs found).
    pub main_gpu: i32,
    /// How the model is spread over several GPUs.
    pub split_mode: SplitMode,
    /// Fit before load: with a GPU present, choose the layers offloaded so that the weights,
    /// the KV cache of every slot and the compute buffers fit each GPU's free memory less
    /// `fit_target` (and refuse a `n_gpu_layers` that cannot fit).
    pub fit: bool,
    /// MiB of each GPU's free memory the fit leaves unused.
    pub fit_target: u64,
    /// Flash attention policy.
    pub flash_attn: FlashAttn,
    /// KV cache element type: f16, q8_0 or q4_0.
    pub kv_cache_type: String,
    /// Read the whole model into memory instead of mapping it.
    pub no_mmap: bool,
    /// Lock the model in RAM.
    pub mlock: bool,
    /// Share of the model per GPU, comma separated (`backend::llama::placement` says what of
    /// it the bindings reach).
    pub tensor_split: Option<String>,
    /// LoRA adapters to load, each `PATH[:SCALE]` (`engine::LoraSpec`: the scale, 1 unless
    /// given, applies to requests that name none; `POST /lora-adapters` changes it).
    pub lora: Vec<crate::protocol::LoraSpec>,
    /// Vision projector GGUF (`--mmproj`), loaded with the model: requests may then carry
    /// images (`protocol/vision.rs`).
    pub mmproj: Option<PathBuf>,
    /// Share cached prefixes between users (forking, `kv::choose_slot_multiuser` with
    /// `sched::MIN_SHARE_GAIN`), instead of one user's cache per slot; on by default.
    pub multiuser_cache: bool,
    /// Host-memory prompt cache, MiB: the KV states of sequences that leave their slot are
    /// kept in RAM and restored for prompts that start like them; 0 = off, -1 = a quarter of
    /// the machine's memory, at most 8 GiB (`cache_ram_bytes`); below -1 or above
    /// `MAX_CACHE_RAM_MIB` is refused (`validate`).
    pub cache_ram: i64,
    /// Sliding-window attention layers (Gemma, ...) keep every cell of the context instead of
    /// just their window: more memory, and any cached prefix stays reusable however far back.
    pub swa_full: bool,
    /// One KV cache the slots share (llama-server's `--kv-unified`): `ctx_size * parallel`
    /// cells, of which one sequence may take all; when the sequences together need more, the
    /// scheduler swaps some out to RAM (`sched/shared_cache.rs`). Off: each slot owns
    /// `ctx_size` cells.
    pub kv_unified: bool,
    /// Checkpoints of the sliding-window cells kept per slot (`--ctx-checkpoints`): a
    /// sequence cut back, or a shared prefix forked, goes back to the last one before the cut
    /// instead of decoding the whole prompt again (`kv/checkpoints.rs`); 0 = none. Only
    /// models with sliding-window layers and no `swa_full` take them, within the `cache_ram`
    /// budget.
    pub ctx_checkpoints: i64,
    /// Speculative decoding by prompt lookup: most tokens drafted per sequence and step;
    /// 0 = off.
    pub draft_max: u32,
    /// Fewest tokens worth drafting: a shorter lookup is not verified.
    pub draft_min: u32,
    /// Longest tail of a sequence looked up in its prompt and output (then shorter ones, down
    /// to 2 tokens).
    pub spec_ngram: u32,
    /// Verify every draft found, whatever it costs: no adaptation of the draft lengths to how
    /// often drafts are accepted and what a step costs.
    pub draft_always: bool,
    /// A draft model for speculative decoding (same vocabulary as the model): drafts come from
    /// it instead of prompt lookup.
    pub draft_model: Option<PathBuf>,
    /// Log llama.cpp's own messages too, and answer OpenAI requests with llama-server's
    /// `__verbose` debug object (the rendered prompt among it) unless a request says not to.
    pub verbose: bool,
    /// How log lines are written: text, or JSON objects (read by `llamarunner-py`, which
    /// installs the log subscriber).
    pub log_format: LogFormat,
    /// Do not serve `GET /metrics` (it answers 404) and count nothing.
    pub no_metrics: bool,
    /// Requests that may wait for a slot before new ones are refused with 429.
    pub max_queue: u32,
    /// The name clients use for the model (`/v1/models`, the `model` field); default: the file
    /// name without `.gguf`.
    pub alias: Option<String>,
    /// Chat template: a built-in name (gemma, chatml, llama3, phi3, mistral, command-r) or a Jinja file;
    /// default: the GGUF's own, else the family's built-in one.
    pub chat_template: Option<String>,
    /// The system message of a conversation that has none (`--system-prompt`; a model of
    /// Ollama's store brings its own).
    pub system_prompt: Option<String>,
    /// `<think>` reasoning in chat answers: split out (auto) or left in the text (none).
    pub reasoning_format: ReasoningFormat,
    /// Whether chat templates think by default (`--reasoning on|off|auto`).
    pub reasoning: Reasoning,
    /// How embeddings pool the tokens' outputs (`--pooling`).
    pub pooling: Pooling,
    /// API keys; with any (here or in `api_key_file`), every route but `GET /health` needs one.
    pub api_key: Vec<String>,
    /// A file of API keys, one per line (blank lines and `#` comments ignored).
    pub api_key_file: Option<PathBuf>,
    /// Browser origins allowed besides the loopback ones (`*` = any).
    pub allow_origin: Vec<String>,
    /// Largest request body, in bytes.
    pub max_body: u64,
    /// Most connections served at once; more wait in the listen backlog.
    pub max_connections: u32,
    /// Seconds a client may take to send a request's headers.
    pub header_timeout: f64,
    /// Seconds an idle keep-alive connection is kept open.
    pub idle_timeout: f64,
    /// Seconds running requests get to finish when the server stops.
    pub shutdown_timeout: f64,
    /// Most tokens one request may generate; 0 = no server cap.
    pub max_tokens: u32,
    /// Whether a sequence that fills its slot drops its oldest tokens and goes on (a context
    /// shift), for requests that do not say (`shift`); off (llama-server's default), it ends
    /// with "length" there.
    pub context_shift: bool,
    /// The tokens a request that sets no limit generates (llama-server's `--n-predict`);
    /// None or -1: each dialect's own (until the end, or the context is full).
    pub n_predict: Option<i32>,
    /// The seed of requests that give none (llama-server's `--seed`); -1: a random seed per
    /// request.
    pub seed: i64,
    /// The temperature of requests that give none (llama-server's `--temp`); None: each
    /// dialect's default.
    pub temp: Option<f32>,
    /// The top-k of requests that give none (`--top-k`); None: each dialect's default.
    pub top_k: Option<i32>,
    /// The top-p of requests that give none (`--top-p`); None: each dialect's default.
    pub top_p: Option<f32>,
    /// The min-p of requests that give none (`--min-p`); None: each dialect's default.
    pub min_p: Option<f32>,
    /// The repetition penalty of requests that give none (`--repeat-penalty`).
    pub repeat_penalty: Option<f32>,
    /// The penalties' window of requests that give none (`--repeat-last-n`; -1: the slot).
    pub repeat_last_n: Option<i32>,
    /// The presence penalty of requests that give none (`--presence-penalty`).
    pub presence_penalty: Option<f32>,
    /// The frequency penalty of requests that give none (`--frequency-penalty`).
    pub frequency_penalty: Option<f32>,
    /// The Mirostat version of requests that give none (`--mirostat`: 0 off, 1, 2).
    pub mirostat: Option<i32>,
    /// Mirostat's learning rate (eta) for requests that give none (`--mirostat-lr`).
    pub mirostat_lr: Option<f32>,
    /// Mirostat's target entropy (tau) for requests that give none (`--mirostat-ent`).
    pub mirostat_ent: Option<f32>,
    /// The locally typical sampling of requests that give none (`--typical`; 1: off).
    pub typical: Option<f32>,
    /// DRY's strength for requests that give none (`--dry-multiplier`; 0: off).
    pub dry_multiplier: Option<f32>,
    /// DRY's base (`--dry-base`).
    pub dry_base: Option<f32>,
    /// The repeat length DRY lets pass (`--dry-allowed-length`).
    pub dry_allowed_length: Option<i32>,
    /// The tokens DRY looks back over (`--dry-penalty-last-n`; -1: the slot).
    pub dry_penalty_last_n: Option<i32>,
    /// How often XTC acts (`--xtc-probability`; 0: off).
    pub xtc_probability: Option<f32>,
    /// XTC's threshold (`--xtc-threshold`).
    pub xtc_threshold: Option<f32>,
    /// Top-n-sigma (`--top-n-sigma`; <= 0: off).
    pub top_n_sigma: Option<f32>,
    /// The dynamic temperature's range (`--dynatemp-range`; 0: off).
    pub dynatemp_range: Option<f32>,
    /// The dynamic temperature's exponent (`--dynatemp-exp`).
    pub dynatemp_exp: Option<f32>,
    /// Wall-time limit of one request, in seconds; 0 = none.
    pub timeout: f64,
    /// Directory of slot files (`POST /slots/{id}?action=save|restore`), made if missing;
    /// None: saving and restoring slots is off.
    pub slot_save_path: Option<PathBuf>,
}

/// Default `max_body`: 8 MiB.
pub const DEFAULT_MAX_BODY: u64 = 8 << 20;

impl Default for RunnerConfig {
    fn default() -> Self {
        Self {
            model: PathBuf::new(),
            host: "127.0.0.1".into(),
            port: 8080,
            parallel: 1,
            ctx_size: 4096,
            batch_size: 512,
            threads: 0,
            sampling_threads: 0,
            null_decode: false,
            backend_sampling: false,
            deterministic: false,
            n_gpu_layers: -1,
            main_gpu: 0,
            split_mode: SplitMode::Layer,
            fit: true,
            fit_target: 1024,
            flash_attn: FlashAttn::Auto,
            kv_cache_type: "f16".into(),
            no_mmap: false,
            mlock: false,
            tensor_split: None,
            lora: Vec::new(),
            mmproj: None,
            multiuser_cache: true,
            cache_ram: -1,
            swa_full: false,
            kv_unified: false,
            ctx_checkpoints: 8,
            draft_max: 16,
            draft_min: 1,
            spec_ngram: 6,
            draft_model: None,
            draft_always: false,
            verbose: false,
            log_format: LogFormat::Text,
            no_metrics: false,
            max_queue: 256,
            alias: None,
            system_prompt: None,
            chat_template: None,
            reasoning_format: ReasoningFormat::Auto,
            reasoning: Reasoning::Auto,
            pooling: Pooling::Auto,
            api_key: Vec::new(),
            api_key_file: None,
            allow_origin: Vec::new(),
            max_body: DEFAULT_MAX_BODY,
            max_connections: 1024,
            header_timeout: 10.0,
            idle_timeout: 60.0,
            shutdown_timeout: 10.0,
            max_tokens: 0,
            n_predict: None,
            context_shift: true,
            seed: -1,
            temp: None,
            top_k: None,
            top_p: None,
            min_p: None,
            repeat_penalty: None,
            repeat_last_n: None,
            presence_penalty: None,
            frequency_penalty: None,
            mirostat: None,
            mirostat_lr: None,
            mirostat_ent: None,
            typical: None,
            dry_multiplier: None,
            dry_base: None,
            dry_allowed_length: None,
            dry_penalty_last_n: None,
            xtc_probability: None,
            xtc_threshold: None,
            top_n_sigma: None,
            dynatemp_range: None,
            dynatemp_exp: None,
            timeout: 0.0,
            slot_save_path: None,
        }
    }
}

/// A configuration that cannot work, with the reason.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// `--tensor-split` is not a list of shares.
    #[error("tensor-split {value:?}: {reason}")]
    TensorSplit {
        /// What was given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A setting `--deterministic` cannot run with.
    #[error("--deterministic cannot run with {0}")]
    Deterministic(&'static str),
    /// A numeric setting is out of range.
    #[error("{name} must be {rule} (got {value})")]
    OutOfRange {
        /// The setting's name, as on the command line.
        name: &'static str,
        /// What it must be.
        rule: &'static str,
        /// What it was.
        value: i64,
    },
    /// The KV cache type is not one llama.cpp supports here.
    #[error("kv-cache-type must be one of f16, q8_0, q4_0 (got {0:?})")]
    KvCacheType(String),
    /// More LoRA adapters than `protocol::lora::MAX_LORA_ADAPTERS`.
    #[error("at most {max} --lora adapters may be loaded (got {0})", max = crate::protocol::lora::MAX_LORA_ADAPTERS)]
    TooManyLoras(usize),
    /// No model path.
    #[error("no model given")]
    NoModel,
    /// `--chat-template` is neither a built-in name nor a readable file.
    #[error("chat-template {0:?} is neither a built-in template (gemma, chatml, llama3, phi3, mistral, command-r) nor a file")]
    ChatTemplate(String),
    /// `--alias` is empty.
    #[error("alias must not be empty")]
    EmptyAlias,
    /// A duration is negative, not a number, or too large.
    #[error("{name} must be {rule} (got {value})")]
    BadSeconds {
        /// The setting's name, as on the command line.
        name: &'static str,
        /// What it must be.
        rule: &'static str,
        /// What it was, as given.
        value: String,
    },
    /// A sampling default outside what a request may ask for.
    #[error("{name} must be {rule} (got {value})")]
    BadSampling {
        /// The setting's name, as on the command line.
        name: &'static str,
        /// What it must be.
        rule: &'static str,
        /// What it was, as given.
        value: String,
    },
    /// An `--api-key` is empty or holds whitespace.
    #[error("api-key must be non-empty and without whitespace")]
    BadApiKey,
    /// `--api-key-file` cannot be read or holds no key.
    #[error("api-key-file {path}: {reason}")]
    ApiKeyFile {
        /// The file, as given.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An `--allow-origin` is empty.
    #[error("allow-origin must not be empty")]
    EmptyOrigin,
    /// A model router's setting (`--models-dir`, `--models-max`, `--keep-alive`, the models'
    /// names) that cannot be used.
    #[error("{0}")]
    Router(String),
    /// `--slot-save-path` is empty, not a directory, or cannot be made.
    #[error("slot-save-path {path}: {reason}")]
    SlotSavePath {
        /// The directory, as given.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// Most tokens `--draft-max` may draft per sequence and step.
pub const MAX_DRAFT: u32 = 64;
/// Longest lookup `--spec-ngram` may ask for.
pub const MAX_SPEC_NGRAM: u32 = 32;

/// Longest accepted duration setting: a day (a larger one is surely a unit mistake, and
/// `Duration::from_secs_f64` must not overflow).
const MAX_SECONDS: f64 = 86_400.0;

/// The most window checkpoints per slot (`--ctx-checkpoints`): each holds a window's cells.
pub const MAX_CTX_CHECKPOINTS: i64 = 64;

/// The largest `--cache-ram`, in MiB (16 TiB): more than any machine's memory, small enough
/// that its bytes fit a u64.
pub const MAX_CACHE_RAM_MIB: i64 = 16 << 20;

/// Most devices llama.cpp places a model on (`llama_max_devices`): the bound of `--main-gpu`
/// and of `--tensor-split`'s shares.
pub const MAX_DEVICES: i64 = 16;

/// Largest `--fit-target`: 1 TiB in MiB.
pub const MAX_FIT_TARGET_MIB: u64 = 1 << 20;

impl RunnerConfig {
    /// The KV cache type the engine runs: `kv_cache_type`, but f16 when flash attention is
    /// off (llama.cpp needs it for a quantized cache).
    pub fn effective_kv_cache_type(&self) -> &str {
        if self.effective_flash_attn() == FlashAttn::Off {
            "f16"
        } else {
            &self.kv_cache_type
        }
    }

    /// Whether sliding-window layers keep every cell: `swa_full`, and always in deterministic
    /// mode (a window's cells reused would sum in another order).
    pub fn effective_swa_full(&self) -> bool {
        self.swa_full || self.deterministic
    }

    /// The flash attention policy the engine runs: `flash_attn`, but off in deterministic mode.
    pub fn effective_flash_attn(&self) -> FlashAttn {
        if self.deterministic {
            FlashAttn::Off
        } else {
            self.flash_attn
        }
    }

    /// How this configuration serves its model, as the memory estimate sizes it (the router's
    /// `--models-memory`, the fit's room for a draft model): context, slots, batch, cache
    /// type, prompt-cache budget, projector file, `--swa-full`.
    pub fn served(&self) -> crate::protocol::memory_estimate::Served<'_> {
        crate::protocol::memory_estimate::Served {
            ctx_size: u64::from(self.ctx_size),
            parallel: u64::from(self.parallel),
            batch_size: u64::from(self.batch_size),
            kv_cache_type: self.effective_kv_cache_type(),
            cache_ram_bytes: self.cache_ram_bytes() as u64,
            extra_files: self.mmproj.iter().map(|p| p.as_path()).collect(),
            swa_full: self.effective_swa_full(),
        }
    }

    /// The prompt cache's budget in bytes: `cache_ram` MiB, or for -1 (and any negative) a
    /// quarter of the machine's memory (`/proc/meminfo`'s MemTotal; 4 GiB where it cannot be
    /// read), at most 8 GiB, llama-server's default `--cache-ram`.
    pub fn cache_ram_bytes(&self) -> usize {
        const MIB: u64 = 1 << 20;
        let bytes = if self.cache_ram >= 0 {
            (self.cache_ram as u64).saturating_mul(MIB)
        } else {
            let total = std::fs::read_to_string("/proc/meminfo")
                .ok()
                .and_then(|m| {
                    m.lines()
                        .find_map(|l| l.strip_prefix("MemTotal:"))
                        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                })
                .map_or(16 * 1024 * MIB, |kib| kib * 1024);
            (total / 4).min(8 * 1024 * MIB)
        };
        usize::try_from(bytes).unwrap_or(usize::MAX)
    }

    /// The model's public name: `alias`, else the file name without its `.gguf` extension.
    pub fn model_name(&self) -> String {
        if let Some(alias) = &self.alias {
            return alias.clone();
        }
        let file = self
            .model
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        match file.strip_suffix(".gguf") {
            Some(stem) if !stem.is_empty() => stem.to_string(),
            _ => file,
        }
    }

    /// Reads a configuration from JSON (the Python side's `ServerConfig.to_json`); an error
    /// names the setting, as its flag (`--draft-max: invalid value: integer `-1`, expected
    /// u32`).
    pub fn from_json(json: &str) -> Result<RunnerConfig, String> {
        let de = &mut serde_json::Deserializer::from_str(json);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path.is_empty() || path == "." {
                inner.to_string()
            } else {
                format!("--{}: {inner}", path.replace('_', "-"))
            }
        })
    }

    /// Sampling threads, resolving 0 to the available cores, but no more than `parallel`
    /// (more threads than sequences would wait).
    pub fn effective_sampling_threads(&self) -> u32 {
        let asked = if self.sampling_threads > 0 {
            self.sampling_threads
        } else {
            available_cores()
        };
        asked.min(self.parallel).max(1)
    }

    /// Decoding threads, resolving 0 to the number of available cores.
    pub fn effective_threads(&self) -> u32 {
        if self.threads > 0 {
            return self.threads;
        }
        available_cores()
    }
}

/// The cores this process may run on (1 when that cannot be told).
fn available_cores() -> u32 {
    std::thread::available_parallelism()
        .map(|n| u32::try_from(n.get()).unwrap_or(1))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests;
