//! The engine: the one OS thread that owns llama.cpp, and the handle the HTTP side uses to reach
//! it. `Backend` is the narrow surface the scheduler needs from llama.cpp, so that `sched/` can
//! be tested against `fake::FakeBackend`. Only `llama.rs` touches `llama-cpp-2`.

pub mod fake;
pub mod grammar;
#[cfg(feature = "llama")]
pub mod llama;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use crate::chat::ChatTemplate;
use crate::sched::params::SamplingParams;

/// A vocabulary token id.
pub type Token = i32;

/// One token placed in a decode batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchToken {
    /// The token.
    pub token: Token,
    /// Its position in its sequence.
    pub pos: u32,
    /// The llama.cpp sequence id (= slot id).
    pub seq: i32,
    /// Whether logits are needed for this position.
    pub logits: bool,
}

/// Failures of the llama.cpp layer.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum BackendError {
    /// The text could not be tokenized.
    #[error("tokenization failed: {0}")]
    Tokenize(String),
    /// The sampler could not be built from the request's parameters.
    #[error("{0}")]
    Sampler(String),
    /// llama.cpp found no room in the KV cache for the batch.
    #[error("no KV cache slot available for the batch")]
    NoKvSlot,
    /// Any other decode failure.
    #[error("llama_decode failed: {0}")]
    Decode(String),
}

/// What the scheduler needs from a model + context. Implementations live on the engine thread
/// only, so nothing here is `Send`.
pub trait Backend {
    /// Per-request sampler state.
    type Sampler;

    /// Cells of KV cache available to each slot.
    fn slot_ctx(&self) -> usize;
    /// Most tokens one `decode` call may carry.
    fn batch_capacity(&self) -> usize;
    /// Tokenizes a prompt, adding BOS when the model wants it and parsing special tokens.
    fn tokenize(&self, text: &str) -> Result<Vec<Token>, BackendError>;
    /// Log-probabilities at batch position `index` (raw logits, before any sampler): the
    /// sampled `token`'s and the `top` most likely ones.
    fn logprobs(&self, index: usize, token: Token, top: usize) -> TokenLogprob;
    /// The bytes a token renders to (may be a partial UTF-8 character).
    fn token_bytes(&self, token: Token) -> Vec<u8>;
    /// Whether the token ends generation (EOS, EOT, ...).
    fn is_eog(&self, token: Token) -> bool;
    /// Builds a sampler for a request; `history` seeds the repetition penalties.
    fn new_sampler(
        &self,
        params: &SamplingParams,
        history: &[Token],
    ) -> Result<Self::Sampler, BackendError>;
    /// Decodes one batch.
    fn decode(&mut self, batch: &[BatchToken]) -> Result<(), BackendError>;
    /// Samples (and accepts) the next token from the logits of batch position `index`.
    fn sample(&mut self, sampler: &mut Self::Sampler, index: usize) -> Token;
    /// Removes positions `from..` of a sequence from the KV cache; false when the cache cannot
    /// remove part of a sequence (the caller then clears all of it).
    fn kv_truncate(&mut self, seq: i32, from: usize) -> bool;
    /// Context shift: removes positions `keep..keep + discard` and moves the rest down by
    /// `discard`. False when the model's cache cannot shift (the caller then re-decodes).
    fn kv_shift(&mut self, seq: i32, keep: usize, discard: usize) -> bool;
    /// Makes sequence `dst` hold the first `len` cached tokens of sequence `src` (a fork for
    /// multi-user prefix sharing). False when the cache cannot copy.
    fn kv_fork(&mut self, src: i32, dst: i32, len: usize) -> bool;
    /// The beginning-of-sequence token, if the tokenizer adds one.
    fn bos(&self) -> Option<Token>;
    /// Most tokens one embedding input may have.
    fn embed_capacity(&self) -> usize;
    /// The embedding of a whole input: pooled by the model's pooling type (mean when it has
    /// none), or the last token's when the model does not pool. Not normalized.
    fn embed(&mut self, tokens: &[Token]) -> Result<Vec<f32>, BackendError>;
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
}

/// Model load state, shared between the engine thread and the HTTP side.
#[derive(Debug, Default)]
pub struct Health {
    state: AtomicU8,
    progress: AtomicU32,
    error: Mutex<Option<String>>,
    busy_slots: AtomicU32,
    total_slots: AtomicU32,
    slots: Mutex<Vec<SlotInfo>>,
    model: OnceLock<Arc<ModelInfo>>,
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
    /// Vocabulary size (token ids are `0..n_vocab`).
    pub n_vocab: u32,
    /// KV cells per slot.
    pub slot_ctx: usize,
    /// Quantization of the weights (`general.file_type`), e.g. "Q4_K_M".
    pub quantization: String,
    /// The GGUF's scalar metadata (tokenizer arrays left out), in file order.
    pub metadata: Vec<(String, String)>,
    /// How conversations become prompts.
    pub template: Arc<ChatTemplate>,
    /// Tokenizes off the engine thread; `None` leaves tokenizing to the engine (the fake).
    pub tokenizer: Option<Tokenizer>,
}

impl ModelInfo {
    /// A description for a model without a file (the fake backend), with a ChatML template.
    pub fn placeholder(slot_ctx: usize) -> Self {
        let template = crate::chat::builtin("chatml")
            .and_then(|t| ChatTemplate::new("chatml", t, "", "").ok())
            .expect("the built-in ChatML template compiles");
        Self {
            path: "fake.gguf".into(),
            file_size: 0,
            modified: None,
            architecture: "fake".into(),
            n_params: 0,
            n_ctx_train: u32::try_from(slot_ctx).unwrap_or(u32::MAX),
            n_embd: 8,
            n_vocab: 258,
            slot_ctx,
            quantization: "F32".into(),
            metadata: Vec::new(),
            template: Arc::new(template),
            tokenizer: None,
        }
    }
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

/// A token with its log-probability (log-softmax of the raw logits).
#[derive(Clone, Debug, PartialEq)]
pub struct TopLogprob {
    /// The token.
    pub token: Token,
    /// The bytes it renders to (maybe part of a UTF-8 character).
    pub bytes: Vec<u8>,
    /// Natural log of its probability.
    pub logprob: f32,
}

/// The log-probability of a sampled token and of the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The sampled token.
    pub sampled: TopLogprob,
    /// The most likely tokens at that position, best first.
    pub top: Vec<TopLogprob>,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DoneReason {
    /// End of generation token or a stop string.
    Stop,
    /// `num_predict` reached or the slot is full.
    Length,
}

impl DoneReason {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            DoneReason::Stop => "stop",
            DoneReason::Length => "length",
        }
    }
}

/// Final statistics of a completion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// Why it ended.
    pub done_reason: DoneReason,
    /// Prompt tokens (after truncation), cached ones included.
    pub prompt_eval_count: usize,
    /// Prompt tokens reused from the slot's KV cache.
    pub prompt_cached_count: usize,
    /// Time from admission to the first sampled token, ns.
    pub prompt_eval_duration_ns: u64,
    /// Tokens sampled.
    pub eval_count: usize,
    /// Time from the first sampled token to the end, ns.
    pub eval_duration_ns: u64,
    /// The prompt was truncated to fit the slot.
    pub truncated: bool,
}

/// The class of an engine-side failure, which decides its HTTP status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineErrorKind {
    /// The request itself is bad (400).
    InvalidRequest,
    /// The prompt does not fit in a slot (400).
    ContextLength,
    /// The engine is stopping (503).
    ShuttingDown,
    /// llama.cpp failed (500).
    Internal,
}

/// A failure reported to one request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct EngineError {
    /// Its class.
    pub kind: EngineErrorKind,
    /// A sentence for the user.
    pub message: String,
}

impl EngineError {
    /// Builds an error.
    pub fn new(kind: EngineErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

/// What the engine streams back to one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The prompt was admitted into a slot and processing started.
    Started,
    /// Generated text (valid UTF-8, never containing a stop string), with the log-probabilities
    /// of the tokens it completes when the request asked for them.
    Text {
        /// The text.
        text: String,
        /// One entry per token whose text this chunk completes (empty unless requested).
        logprobs: Vec<TokenLogprob>,
    },
    /// The sequence finished.
    Done(Completion),
    /// The sequence failed.
    Error(EngineError),
}

/// Capacity of each request's event channel. When a client reads slower than the engine
/// generates, text is coalesced on the engine side rather than blocking the loop.
pub const EVENT_CHANNEL_CAPACITY: usize = 64;

/// What a request asks the engine to process: text, or its tokens when the HTTP side has
/// tokenized it already (off the engine thread, so a long prompt never stalls a decode step).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// Text, tokenized by the engine (BOS added when the model wants it, specials parsed).
    Text(String),
    /// Tokens, as `Backend::tokenize` would make them.
    Tokens(Vec<Token>),
}

impl From<&str> for Input {
    fn from(text: &str) -> Self {
        Input::Text(text.to_string())
    }
}

/// The function behind a `Tokenizer`.
pub type TokenizeFn = dyn Fn(&str) -> Result<Vec<Token>, BackendError> + Send + Sync;

/// Tokenizes text on any thread (llama.cpp's vocabulary is read-only once loaded).
#[derive(Clone)]
pub struct Tokenizer(pub Arc<TokenizeFn>);

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokenizer")
    }
}

/// A completion request as the engine receives it.
#[derive(Debug)]
pub struct Request {
    /// The prompt.
    pub prompt: Input,
    /// Sampling and stopping parameters.
    pub params: SamplingParams,
    /// Where events go; a closed channel means the client left.
    pub events: tokio::sync::mpsc::Sender<Event>,
    /// When the HTTP side received it.
    pub received: Instant,
}

/// An embedding request as the engine receives it.
#[derive(Debug)]
pub struct EmbedRequest {
    /// What to embed.
    pub content: Input,
    /// Cut an input longer than the context instead of failing.
    pub truncate: bool,
    /// Where the answer goes; a closed channel means the client left.
    pub reply: tokio::sync::oneshot::Sender<Result<Embedding, EngineError>>,
}

/// An embedding result.
#[derive(Clone, Debug, PartialEq)]
pub struct Embedding {
    /// The vector (not normalized).
    pub vector: Vec<f32>,
    /// Tokens embedded (after truncation).
    pub prompt_eval_count: usize,
    /// The input was truncated.
    pub truncated: bool,
}

/// A message to the engine thread.
#[derive(Debug)]
pub enum Message {
    /// Serve this request.
    Request(Request),
    /// Embed this text.
    Embed(EmbedRequest),
    /// Wake up (used on shutdown).
    Wake,
}

/// Why a request could not be queued.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    /// The waiting queue is full.
    #[error("the server is busy: too many requests are waiting for a slot")]
    QueueFull,
    /// The engine thread is gone.
    #[error("the engine is not running")]
    Stopped,
}

/// The HTTP side's handle on the engine: cheap to clone, never blocks.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    tx: SyncSender<Message>,
    /// Load state and slot gauges.
    pub health: Arc<Health>,
    shutdown: Arc<AtomicBool>,
}

impl EngineHandle {
    /// Creates the handle and the engine's end of the channel.
    pub fn new(queue: usize) -> (Self, EngineInbox) {
        let (tx, rx) = std::sync::mpsc::sync_channel(queue.max(1));
        let shutdown = Arc::new(AtomicBool::new(false));
        let health = Arc::new(Health::default());
        (
            Self {
                tx,
                health: health.clone(),
                shutdown: shutdown.clone(),
            },
            EngineInbox {
                rx,
                shutdown,
                health,
            },
        )
    }

    /// Queues a request for a slot.
    pub fn submit(&self, request: Request) -> Result<(), SubmitError> {
        self.send(Message::Request(request))
    }

    /// Queues an embedding request.
    pub fn submit_embed(&self, request: EmbedRequest) -> Result<(), SubmitError> {
        self.send(Message::Embed(request))
    }

    fn send(&self, message: Message) -> Result<(), SubmitError> {
        if self.shutdown.load(Ordering::Acquire) {
            return Err(SubmitError::Stopped);
        }
        match self.tx.try_send(message) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(SubmitError::QueueFull),
            Err(TrySendError::Disconnected(_)) => Err(SubmitError::Stopped),
        }
    }

    /// Asks the engine thread to finish: running requests get a shutdown error.
    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::Release);
        // A full queue means the engine is awake anyway and will see the flag.
        let _ = self.tx.try_send(Message::Wake);
    }
}

/// The engine thread's end: requests, the shutdown flag and the health to report into.
#[derive(Debug)]
pub struct EngineInbox {
    /// Incoming messages.
    pub rx: Receiver<Message>,
    /// Set when the engine must stop.
    pub shutdown: Arc<AtomicBool>,
    /// Where load state and gauges are published.
    pub health: Arc<Health>,
}

impl EngineInbox {
    /// Whether shutdown was requested.
    pub fn stopping(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }
}
