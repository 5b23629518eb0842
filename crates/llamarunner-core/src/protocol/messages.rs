//! What travels between the HTTP side and the engine thread: requests, the events streamed back,
//! final statistics and errors. Wire-neutral: each dialect in `dialects/` renders these its own way.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::protocol::params::SamplingParams;
use crate::protocol::Token;

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
    /// The tokens the request asked about (`SamplingParams::logprobs_of`), in its order.
    pub asked: Vec<TopLogprob>,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DoneReason {
    /// End of generation token or a stop string.
    Stop,
    /// `num_predict` reached or the slot is full.
    Length,
    /// The server's per-request time limit (`--timeout`) ran out.
    Timeout,
}

impl DoneReason {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            DoneReason::Stop => "stop",
            DoneReason::Length => "length",
            DoneReason::Timeout => "timeout",
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
    /// Time from the request's arrival to its admission into a slot, ns.
    pub queue_duration_ns: u64,
    /// Time from admission to the first sampled token, ns.
    pub prompt_eval_duration_ns: u64,
    /// Tokens sampled.
    pub eval_count: usize,
    /// Time from the first sampled token to the end, ns.
    pub eval_duration_ns: u64,
    /// The prompt was truncated to fit the slot.
    pub truncated: bool,
    /// Tokens drafted for it (speculative decoding).
    pub draft_count: usize,
    /// Drafted tokens accepted (each one a decode step saved).
    pub draft_accepted_count: usize,
    /// The stop string that ended it (None when it ended otherwise: end of generation, a
    /// grammar's end, a limit).
    pub stop_string: Option<String>,
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
    /// The request waited longer than the server's time limit (503).
    Timeout,
    /// llama.cpp failed (500).
    Internal,
    /// A slot operation named a slot that does not exist (404).
    SlotNotFound,
    /// A slot operation found the slot serving a request (409).
    SlotBusy,
    /// llama.cpp refused a saved slot state (400).
    InvalidSlotState,
    /// The KV cache had no room for the sequence (the slots share it: `--kv-unified`) and it
    /// could not be swapped out to wait for room, or the whole cache was emptied under it
    /// (a forged slot file's restore): sending it again may succeed (503).
    CacheFull,
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
    Started {
        /// The prompt's tokens found in a cache (not decoded).
        cached: usize,
    },
    /// Generated text (valid UTF-8, never containing a stop string), with the log-probabilities
    /// of the tokens it completes when the request asked for them.
    Text {
        /// The text.
        text: String,
        /// One entry per token whose text this chunk completes (empty unless requested).
        logprobs: Vec<TokenLogprob>,
    },
    /// How far the prompt's decode is (only for a request that asked: `return_progress`):
    /// once at admission, then after each chunk of the prompt.
    Progress(PromptProgress),
    /// The sequence finished.
    Done(Completion),
    /// The sequence failed.
    Error(EngineError),
}

/// How far a prompt's decode is, as llama-server reports it (`prompt_progress`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptProgress {
    /// The prompt's tokens.
    pub total: usize,
    /// Of those, the ones found in a cache (not decoded).
    pub cache: usize,
    /// Of those, the ones in the slot so far (the cached ones included).
    pub processed: usize,
    /// Milliseconds since the sequence was admitted.
    pub time_ms: u64,
}

/// Capacity of each request's event channel. When a client reads slower than the engine
/// generates, text is coalesced on the engine side rather than blocking the loop.
pub const EVENT_CHANNEL_CAPACITY: usize = 64;

/// Where a request's events go, as the engine sees it: a sink that takes an event now, is
/// full (the client reads slower than the engine generates) or is gone (the client left). It
/// never blocks. The HTTP side holds the other end ([`EventSink::channel`]); the scheduler
/// only offers events and reads the answer, so it decides what a full client means (its
/// sequence pauses) without knowing how events travel.
#[derive(Clone, Debug)]
pub struct EventSink {
    tx: tokio::sync::mpsc::Sender<Event>,
    /// The reader takes the text only at the end ([`TextHold`]).
    whole: Arc<AtomicBool>,
}

/// The reader's side of a request's text delivery: a reader that takes the whole text at the
/// end (a response that is not streamed) says so, and the engine then offers the text in large
/// pieces instead of one event per step, which spares it a wake of the reader's task per token
/// (on a GPU that is engine-thread time between two decodes). llama-server likewise sends a
/// request that does not stream its text only at the end.
#[derive(Clone, Debug)]
pub struct TextHold(Arc<AtomicBool>);

impl TextHold {
    /// From now on the text may be held and sent in large pieces.
    pub fn whole(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// What became of an event offered to an [`EventSink`].
#[derive(Debug)]
pub enum Offer {
    /// The client's side holds it.
    Taken,
    /// No room now: the event comes back, to be offered again later.
    Full(Event),
    /// The client left; nothing will be read again.
    Gone,
}

impl EventSink {
    /// A sink and the receiver the HTTP side reads, with room for
    /// [`EVENT_CHANNEL_CAPACITY`] events.
    pub fn channel() -> (Self, tokio::sync::mpsc::Receiver<Event>) {
        let (tx, rx) = tokio::sync::mpsc::channel(EVENT_CHANNEL_CAPACITY);
        let whole = Arc::new(AtomicBool::new(false));
        (Self { tx, whole }, rx)
    }

    /// The switch by which the reader says it takes the text only at the end.
    pub fn text_hold(&self) -> TextHold {
        TextHold(self.whole.clone())
    }

    /// The reader takes the text only at the end (`TextHold::whole`).
    pub fn wants_whole_text(&self) -> bool {
        self.whole.load(Ordering::Relaxed)
    }

    /// Offers `event` without waiting.
    pub fn offer(&self, event: Event) -> Offer {
        use tokio::sync::mpsc::error::TrySendError;
        match self.tx.try_send(event) {
            Ok(()) => Offer::Taken,
            Err(TrySendError::Full(event)) => Offer::Full(event),
            Err(TrySendError::Closed(_)) => Offer::Gone,
        }
    }

    /// The client left.
    pub fn is_gone(&self) -> bool {
        self.tx.is_closed()
    }
}

/// A request's last events (its final text and statistics, or its error), handed by the
/// scheduler to the engine, which delivers them as the client makes room.
#[derive(Debug)]
pub struct Ending {
    /// Where they go.
    pub sink: EventSink,
    /// In order.
    pub events: std::collections::VecDeque<Event>,
}

impl Ending {
    /// A request ended by `error`.
    pub fn error(sink: EventSink, error: EngineError) -> Self {
        Self {
            sink,
            events: [Event::Error(error)].into(),
        }
    }
}

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

/// A completion request as the engine receives it.
#[derive(Debug)]
pub struct Request {
    /// The request's id (`X-Request-Id`), for the engine's log lines and `GET /slots`.
    pub id: String,
    /// The prompt.
    pub prompt: Input,
    /// Sampling and stopping parameters.
    pub params: SamplingParams,
    /// Where its events go.
    pub events: EventSink,
    /// The HTTP side cut the prompt to fit the slot.
    pub truncated: bool,
    /// When the HTTP side received it.
    pub received: Instant,
    /// When it must end (`--timeout`): a queued request is refused, a running one ends with
    /// "timeout".
    pub deadline: Option<Instant>,
    /// The images whose positions the prompt's tokens hold (`vision::image_token`), each
    /// once, in any order; empty for a text prompt.
    pub images: Vec<crate::protocol::vision::PromptImage>,
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

/// What to do with one slot's KV cache (`POST /slots/{id}?action=...`). Only a free slot is
/// touched; the file I/O happens on the HTTP side, the engine only copies state in and out.
#[derive(Debug)]
pub enum SlotAction {
    /// Copy out the slot's cached tokens and llama.cpp's state of its sequence.
    Save,
    /// Replace the slot's cache with a saved state holding these tokens.
    Restore {
        /// The tokens the state holds, by position.
        tokens: Vec<Token>,
        /// llama.cpp's sequence state, as `Save` returned it.
        state: Vec<u8>,
        /// The LoRA scale set the state is taken as computed under (a slot file does not
        /// record one: the server's default scales at restore time).
        lora: super::LoraScales,
    },
    /// Empty the slot's cache.
    Erase,
}

/// What a slot operation did.
#[derive(Debug, PartialEq, Eq)]
pub enum SlotOutcome {
    /// The slot's cache, copied out.
    Saved {
        /// Its tokens, by position.
        tokens: Vec<Token>,
        /// llama.cpp's state of its sequence.
        state: Vec<u8>,
        /// The LoRA scale set the cache was computed under.
        lora: crate::protocol::LoraScales,
    },
    /// This many tokens are now cached in the slot.
    Restored(usize),
    /// This many cached tokens were dropped.
    Erased(usize),
}

/// A slot operation as the engine receives it.
#[derive(Debug)]
pub struct SlotCommand {
    /// The slot id.
    pub slot: usize,
    /// What to do.
    pub action: SlotAction,
    /// Where the answer goes.
    pub reply: tokio::sync::oneshot::Sender<Result<SlotOutcome, EngineError>>,
}

/// A message to the engine thread.
#[derive(Debug)]
pub enum Message {
    /// Serve this request (boxed: a request is large beside a wake-up).
    Request(Box<Request>),
    /// Save, restore or erase a slot's cache, between two steps.
    Slot(Box<SlotCommand>),
    /// Wake up (an embedding request arrived, or shutdown).
    Wake,
}
