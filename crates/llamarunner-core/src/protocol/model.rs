//! What the HTTP side knows of the engine: the loaded model's description, its load state and
//! the slot table, published by the engine thread.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::chat::ChatTemplate;
use crate::protocol::{BackendError, Token};

/// What the HTTP side may do with the loaded model off the engine thread (llama.cpp's
/// vocabulary is read-only once loaded, so these are safe from any thread): tokenize, and
/// list the vocabulary for the grammar compiler (`constrain`).
pub trait TextModel: Send + Sync + std::fmt::Debug {
    /// Tokenizes as every prompt is: BOS added when the model wants it, special tokens parsed.
    fn tokenize(&self, text: &str) -> Result<Vec<Token>, BackendError> {
        self.tokenize_with(text, true)
    }
    /// Tokenizes with special tokens parsed; `add_special` adds BOS (and EOS) when the model
    /// wants them, as `tokenize` always does.
    fn tokenize_with(&self, text: &str, add_special: bool) -> Result<Vec<Token>, BackendError>;
    /// Tokenizes text as text: special tokens written in it (`<|fim_middle|>` in a file of
    /// code) stay text, and no BOS is added. The fake's tokenizer parses nothing anyway.
    fn tokenize_literal(&self, text: &str) -> Result<Vec<Token>, BackendError> {
        self.tokenize_with(text, false)
    }
    /// The bytes a token renders to, special tokens as their text (`<s>`); may be part of a
    /// UTF-8 character. The token must be inside the vocabulary (`0..n_vocab`): llama.cpp does
    /// not check.
    fn piece(&self, token: Token) -> Vec<u8>;
    /// Every token's text and kind, for the grammar compiler.
    fn vocabulary(&self) -> crate::constrain::Vocabulary;
}

/// The grammar compiler of a model, over its vocabulary (built on first use).
pub fn compiler_for(text: &Arc<dyn TextModel>) -> Arc<crate::constrain::Compiler> {
    let text = text.clone();
    Arc::new(crate::constrain::Compiler::new(move || text.vocabulary()))
}

/// One slot, as `GET /slots` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SlotInfo {
    /// Slot id (= llama.cpp sequence id).
    pub id: i32,
    /// Whether a request holds it.
    pub busy: bool,
    /// Tokens in its KV cache.
    pub cached_tokens: usize,
    /// When it was last released or taken, ms since the Unix epoch (0 = never).
    pub last_used_ms: u64,
    /// The id of the request that holds it (`X-Request-Id`); None when it is free.
    pub request_id: Option<String>,
    /// What its request is doing.
    #[serde(flatten)]
    pub activity: SlotActivity,
}

/// What a slot's request is doing, as `GET /slots` shows it (all zero when idle).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SlotActivity {
    /// The request's phase.
    pub phase: SlotPhase,
    /// Its prompt's tokens (after truncation), cached ones included.
    pub prompt_tokens: usize,
    /// Prompt tokens reused from the slot's cache.
    pub prompt_cached_tokens: usize,
    /// Prompt tokens decoded so far (cached ones included).
    pub prompt_processed_tokens: usize,
    /// Tokens generated so far.
    pub generated_tokens: usize,
    /// Generation waits for a client that does not read its stream.
    pub paused: bool,
}

/// A slot's phase.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SlotPhase {
    /// No request holds it.
    #[default]
    Idle,
    /// Its prompt is being decoded.
    Prefill,
    /// It generates, one token per step.
    Decode,
    /// After a context shift the cache could not do in place, the kept tokens are decoded
    /// again.
    Reprocess,
}

/// Model load state, shared between the engine thread and the HTTP side.
#[derive(Debug, Default)]
pub struct Health {
    state: AtomicU8,
    progress: AtomicU32,
    error: Mutex<Option<String>>,
    /// The engine died after it was serving (not a load failure).
    stopped: std::sync::atomic::AtomicBool,
    busy_slots: AtomicU32,
    total_slots: AtomicU32,
    /// KV cells held by the requests in busy slots (for `kv_cache_usage_perc`).
    busy_cells: AtomicU64,
    slots: Mutex<Vec<SlotInfo>>,
    model: OnceLock<Arc<ModelInfo>>,
    /// When the engine started (this was made just before its thread).
    created: Created,
    /// How long the engine took from its start to ready.
    load_time: OnceLock<Duration>,
}

/// The moment a `Health` was made.
#[derive(Debug)]
struct Created(Instant);

impl Default for Created {
    fn default() -> Self {
        Self(Instant::now())
    }
}

/// What the loaded model is, for `/v1/models`, `/api/show`, `/api/tags` and chat rendering.
/// Published by the engine thread once the model is loaded.
#[derive(Debug)]
pub struct ModelInfo {
    /// The GGUF file.
    pub path: std::path::PathBuf,
    /// Its size in bytes.
    pub file_size: u64,
    /// Its modification time.
    pub modified: Option<std::time::SystemTime>,
    /// `general.architecture`.
    pub architecture: String,
    /// Parameter count.
    pub n_params: u64,
    /// Context length the model was trained with.
    pub n_ctx_train: u32,
    /// Embedding width.
    pub n_embd: u32,
    /// Layers.
    pub n_layer: u32,
    /// Vocabulary size (token ids are `0..n_vocab`).
    pub n_vocab: u32,
    /// KV cells per slot (with a shared cache, the whole cache: one sequence may take all).
    pub slot_ctx: usize,
    /// The cells of the KV cache the slots share (`--kv-unified`); None: each slot has
    /// `slot_ctx` of its own.
    pub shared_cells: Option<usize>,
    /// Most tokens of one embedding input: a slot's cells (a slot's share with a shared
    /// cache, so the embedding context is no larger than without one).
    pub embed_ctx: usize,
    /// Quantization of the weights (`general.file_type`), e.g. "Q4_K_M".
    pub quantization: String,
    /// The GGUF's scalar metadata (tokenizer arrays left out), in file order.
    pub metadata: Vec<(String, String)>,
    /// How conversations become prompts.
    pub template: Arc<ChatTemplate>,
    /// The beginning-of-sequence token, when the tokenizer adds one.
    pub bos: Option<Token>,
    /// The end-of-sequence token, when the vocabulary has one.
    pub eos: Option<Token>,
    /// llama.cpp's compute backends and the CPU features its kernels use.
    pub system_info: String,
    /// Tokenizes off the engine thread.
    pub text: Arc<dyn TextModel>,
    /// Compiles requests' grammars against the vocabulary (on the blocking pool).
    pub constraints: Arc<crate::constrain::Compiler>,
    /// Tokenizes prompts with images off the engine thread; None without `--mmproj`.
    pub vision: Option<Arc<dyn super::VisionModel>>,
    /// The fill-in-the-middle tokens, when the vocabulary has them (`/infill`).
    pub fim: Option<FimTokens>,
    /// How a query and a document become one input, when the model is a reranker (its
    /// pooling is llama.cpp's `rank`: `/v1/rerank`); None for every other model.
    pub rerank: Option<RerankFormat>,
    /// The devices it runs on and the layers it placed there.
    pub devices: super::devices::DeviceFacts,
    /// Loaded in deterministic mode (`--deterministic`): a request's output depends only on
    /// the request.
    pub deterministic: bool,
}

/// How a reranker pairs a query with a document (llama-server's layout): the model's own
/// `rerank` template with `{query}` and `{document}` replaced, else
/// `[BOS] query [EOS] [SEP] document [EOS]`, each marker where the vocabulary adds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RerankFormat {
    /// The GGUF's `tokenizer.chat_template.rerank`.
    pub template: Option<String>,
    /// Opens the pair (when the vocabulary adds BOS).
    pub bos: Option<Token>,
    /// Ends the query and the document (EOS, or SEP where the vocabulary has no EOS; when the
    /// vocabulary adds EOS).
    pub eos: Option<Token>,
    /// Between the query and the document (when the vocabulary adds SEP).
    pub sep: Option<Token>,
}

/// A code model's fill-in-the-middle tokens: prefix, suffix and middle markers, and the
/// repository and file separators of models trained on repositories.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FimTokens {
    /// Opens the code before the cursor.
    pub pre: Token,
    /// Opens the code after it.
    pub suf: Token,
    /// Asks for the middle.
    pub mid: Token,
    /// Opens a repository's context (`<|repo_name|>`).
    pub rep: Option<Token>,
    /// Opens one file of it (`<|file_sep|>`).
    pub sep: Option<Token>,
}

/// The three load states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadState {
    /// The model is still loading.
    Loading,
    /// Requests are served.
    Ready,
    /// Loading failed (see `Health::error`) or the engine stopped.
    Error,
}

impl LoadState {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            LoadState::Loading => "loading",
            LoadState::Ready => "ready",
            LoadState::Error => "error",
        }
    }
}

impl Health {
    /// Current state.
    pub fn state(&self) -> LoadState {
        match self.state.load(Ordering::Acquire) {
            0 => LoadState::Loading,
            1 => LoadState::Ready,
            _ => LoadState::Error,
        }
    }
    /// Load progress in 0..=1.
    pub fn progress(&self) -> f32 {
        f32::from_bits(self.progress.load(Ordering::Relaxed))
    }
    /// Records load progress.
    pub fn set_progress(&self, p: f32) {
        self.progress
            .store(p.clamp(0.0, 1.0).to_bits(), Ordering::Relaxed);
    }
    /// Marks the model ready, with the number of slots.
    pub fn set_ready(&self, slots: u32) {
        let _ = self.load_time.set(self.created.0.elapsed());
        self.total_slots.store(slots, Ordering::Relaxed);
        self.set_progress(1.0);
        self.state.store(1, Ordering::Release);
    }
    /// Marks the engine failed, with the reason.
    pub fn set_error(&self, message: impl Into<String>) {
        if let Ok(mut e) = self.error.lock() {
            *e = Some(message.into());
        }
        self.state.store(2, Ordering::Release);
    }
    /// Marks the engine dead while it was serving (a panic, or its thread ended unasked):
    /// the state is an error, as for a load failure, and `engine_stopped` tells them apart.
    pub fn set_stopped(&self, message: impl Into<String>) {
        self.stopped.store(true, Ordering::Release);
        self.set_error(message);
    }
    /// Whether the engine died after it was serving.
    pub fn engine_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }
    /// Why the engine failed, if it did.
    pub fn error(&self) -> Option<String> {
        self.error.lock().ok().and_then(|e| e.clone())
    }
    /// Records how many slots are busy.
    pub fn set_busy_slots(&self, n: u32) {
        self.busy_slots.store(n, Ordering::Relaxed);
    }
    /// Publishes the slot table.
    pub fn set_slots(&self, slots: Vec<SlotInfo>) {
        let busy = slots.iter().filter(|s| s.busy).count();
        self.set_busy_slots(u32::try_from(busy).unwrap_or(u32::MAX));
        let cells: usize = slots
            .iter()
            .filter(|s| s.busy)
            .map(|s| s.cached_tokens)
            .sum();
        self.busy_cells
            .store(u64::try_from(cells).unwrap_or(u64::MAX), Ordering::Relaxed);
        if let Ok(mut s) = self.slots.lock() {
            *s = slots;
        }
    }
    /// The slot table as last published.
    pub fn slot_table(&self) -> Vec<SlotInfo> {
        self.slots.lock().map(|s| s.clone()).unwrap_or_default()
    }
    /// Publishes what the loaded model is (once; later calls are ignored).
    pub fn set_model_info(&self, info: ModelInfo) {
        let _ = self.model.set(Arc::new(info));
    }
    /// What the loaded model is, once it is loaded.
    pub fn model_info(&self) -> Option<Arc<ModelInfo>> {
        self.model.get().cloned()
    }
    /// KV cells held by the requests in busy slots, as last published (the prefixes idle
    /// slots keep for reuse are not counted: any new request may take them).
    pub fn busy_cells(&self) -> u64 {
        self.busy_cells.load(Ordering::Relaxed)
    }
    /// How long the engine took from its start to ready (None until it is ready).
    pub fn load_time(&self) -> Option<Duration> {
        self.load_time.get().copied()
    }
    /// (busy slots, total slots).
    pub fn slots(&self) -> (u32, u32) {
        (
            self.busy_slots.load(Ordering::Relaxed),
            self.total_slots.load(Ordering::Relaxed),
        )
    }
}

/// The name of a GGUF `general.file_type` (llama.cpp's `llama_ftype`), e.g. 15 -> "Q4_K_M".
pub fn file_type_name(file_type: u32) -> &'static str {
    const NAMES: &[(u32, &str)] = &[
        (0, "F32"),
        (1, "F16"),
        (2, "Q4_0"),
        (3, "Q4_1"),
        (7, "Q8_0"),
        (8, "Q5_0"),
        (9, "Q5_1"),
        (10, "Q2_K"),
        (11, "Q3_K_S"),
        (12, "Q3_K_M"),
        (13, "Q3_K_L"),
        (14, "Q4_K_S"),
        (15, "Q4_K_M"),
        (16, "Q5_K_S"),
        (17, "Q5_K_M"),
        (18, "Q6_K"),
        (19, "IQ2_XXS"),
        (20, "IQ2_XS"),
        (21, "Q2_K_S"),
        (22, "IQ3_XS"),
        (23, "IQ3_XXS"),
        (24, "IQ1_S"),
        (25, "IQ4_NL"),
        (26, "IQ3_S"),
        (27, "IQ3_M"),
        (28, "IQ2_S"),
        (29, "IQ2_M"),
        (30, "IQ4_XS"),
        (31, "IQ1_M"),
        (32, "BF16"),
        (36, "TQ1_0"),
        (37, "TQ2_0"),
        (38, "MXFP4"),
    ];
    NAMES
        .iter()
        .find(|(n, _)| *n == file_type)
        .map_or("unknown", |(_, name)| name)
}
