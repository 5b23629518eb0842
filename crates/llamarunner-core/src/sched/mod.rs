//! The batching policy. It owns the slots and the sequences in them; the engine thread
//! (`engine/event_loop.rs`) drives it, and it is generic over `Backend`, so it is unit-tested
//! against the fake backend.
//!
//! Each step: drop requests whose client left (`admission.rs`), admit waiting requests into free
//! slots (reusing the longest cached prefix, from a slot or a lower cache tier:
//! `cache_tiers.rs`), keep the slots within a cache they share (`--kv-unified`:
//! `shared_cache.rs`), build one batch (every generating sequence's next token first, then prompt
//! chunks with the remaining budget, round robin), decode once (`batch.rs`), sample for every
//! sequence whose pending tokens are all decoded (`sampling.rs`, drafts in `speculative.rs`),
//! and stream the text out (`output.rs`). A turn returns a `StepOutcome` (`outcome.rs`): its
//! plan per sequence and what came of it.

pub mod adaptive;
mod admission;
mod batch;
mod cache_tiers;
mod draft;
mod lora;
mod outcome;
mod output;
pub mod payoff;
mod sampling;
mod shared_cache;
mod slot_files;
pub mod speculative;
pub mod text;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{Backend, BatchToken};
use crate::kv;
use crate::kv::checkpoints::Checkpoints;
use crate::kv::prompt_cache::PromptCache;
use crate::protocol::params::SamplingParams;
use crate::protocol::vision::{is_image_continuation, is_image_start, is_image_token};
use crate::protocol::{
    Ending, EngineError, EngineErrorKind, EngineObserver, EventSink, Input, LoraScales,
    PromptImage, QueueGauge, Request, SlotActivity, SlotPhase, Token, TokenLogprob,
};
use adaptive::CostModel;
use payoff::Payoff;
use speculative::{SpecConfig, SpecState};
use text::TextStream;

pub use outcome::{SequenceStep, StepOutcome};

/// Text a sequence may hold for a client that does not read (its event channel is full) before
/// it stops generating until the client catches up.
pub const OUTBOX_CAP_BYTES: usize = 16 * 1024;
/// Log-probability entries a sequence may hold likewise.
pub const OUTBOX_CAP_LOGPROBS: usize = 1024;
/// How long a sequence may stay paused for a client that does not read before its slot is
/// taken back (the client is treated as gone), unless `with_pause_limit` says otherwise.
pub const PAUSE_LIMIT: Duration = Duration::from_secs(30);

/// What a sequence's pending tokens are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The prompt (or what is left of it after the cached prefix), decoded in chunks.
    Prefill,
    /// The last sampled token, decoded with the other generating sequences first.
    Decode,
    /// After a context shift the cache could not do in place: the kept tokens and the last
    /// sampled one, decoded again in chunks like a prompt.
    Redecode,
}

/// A request that holds a slot.
struct Sequence<S> {
    /// The request's id (`X-Request-Id`).
    id: String,
    /// Its log span (`request{request_id=...}`), entered for every log line about it.
    span: tracing::Span,
    phase: Phase,
    events: EventSink,
    params: SamplingParams,
    /// The LoRA scale set it is decoded under.
    lora: LoraScales,
    sampler: S,
    /// Tokens not yet decoded: the rest of the prompt, or the last sampled token.
    pending: Vec<Token>,
    /// How many of `pending` are in the batch being built.
    queued: usize,
    /// The images whose positions its tokens hold (`protocol::vision`).
    images: Vec<PromptImage>,
    /// Positions of the image at the head of `pending` decoded this step (0: none), in a
    /// decode of its own before the batch (`decode_images`).
    image_queued: usize,
    /// Batch index whose logits this sequence samples from after this step.
    logits_at: Option<usize>,
    /// Tokens sampled this step with every other sequence's (`presample`), taken in order by
    /// `sample_one` at its next positions; what is left when the step is done goes.
    presampled: std::collections::VecDeque<Option<Token>>,
    /// The text of the first of those tokens, assembled by the thread that sampled it
    /// (`presample`): the token and what pushing it gave; `sample_one` takes it instead of
    /// pushing the token itself.
    prepushed: Option<(Token, text::Pushed)>,
    n_prompt: usize,
    n_cached: usize,
    n_generated: usize,
    /// The slot's length at which the prompt's next window checkpoint is taken
    /// (`kv/checkpoints.rs`); the prompt's end is checkpointed as well.
    next_checkpoint: usize,
    /// Prompt tokens protected from shifting.
    keep: usize,
    /// The prompt was truncated to fit.
    truncated: bool,
    text: TextStream,
    /// Text produced but not yet accepted by the client's channel.
    outbox: String,
    /// Log-probabilities of the tokens whose text is in `outbox` or still held by `text`.
    outbox_logprobs: Vec<TokenLogprob>,
    /// Log-probability entries already sent.
    logprobs_sent: usize,
    /// When the HTTP side received it.
    received: Instant,
    admitted: Instant,
    /// Set when the prompt is fully decoded.
    prompt_done: Option<Instant>,
    /// When its last token was sampled (for the inter-token latency).
    last_token: Option<Instant>,
    /// When it must end (`--timeout`).
    deadline: Option<Instant>,
    /// Since when it has been paused for a client that does not read.
    paused_since: Option<Instant>,
    /// Its drafts (speculative decoding).
    spec: SpecState,
    /// Its cells, while it waits swapped out of a shared cache (`shared_cache.rs`).
    swapped: Option<shared_cache::Swapped>,
}

impl<S> Sequence<S> {
    /// Its client is not reading and it holds as much unsent output as it may: it waits.
    fn paused(&self) -> bool {
        self.outbox.len() >= OUTBOX_CAP_BYTES || self.outbox_logprobs.len() >= OUTBOX_CAP_LOGPROBS
    }

    /// What it is doing, for `GET /slots`.
    fn activity(&self) -> SlotActivity {
        let (phase, processed) = match self.phase {
            Phase::Prefill => (
                SlotPhase::Prefill,
                self.n_prompt.saturating_sub(self.pending.len()),
            ),
            Phase::Decode => (SlotPhase::Decode, self.n_prompt),
            Phase::Redecode => (SlotPhase::Reprocess, self.n_prompt),
        };
        SlotActivity {
            phase,
            prompt_tokens: self.n_prompt,
            prompt_cached_tokens: self.n_cached,
            prompt_processed_tokens: processed,
            generated_tokens: self.n_generated,
            paused: self.paused(),
        }
    }
}

/// One llama.cpp sequence id and what its KV cache holds.
struct Slot<S> {
    id: i32,
    /// Tokens whose KV entries are in the cache, by position.
    cached: Vec<Token>,
    /// Tokens whose KV entries are in the draft model's cache (`draft.rs`), by position.
    draft_cached: Vec<Token>,
    /// The LoRA scale set `cached` was computed under.
    lora: LoraScales,
    seq: Option<Sequence<S>>,
    /// When a request last took or released it.
    last_used: Option<std::time::SystemTime>,
    /// The scheduler's clock at that moment (LRU order; 0 = never used).
    last_tick: u64,
    /// `Scheduler::decodes` when its cache was last shifted (`shift_pending`).
    shifted_at: Option<u64>,
}

/// Tokens a multi-user fork, or cutting back another conversation's slot, must save: fewer
/// than that (a chat template's opening) are not worth another conversation's cached history,
/// and a fork copies a whole KV stream.
pub const MIN_SHARE_GAIN: usize = 32;

/// The engine's loop state.
pub struct Scheduler<B: Backend> {
    backend: B,
    /// Where it reports what it does (the metrics).
    observer: Arc<dyn EngineObserver>,
    /// The waiting queue's places, given back as requests leave it.
    queue: Arc<QueueGauge>,
    slots: Vec<Slot<B::Sampler>>,
    waiting: VecDeque<Request>,
    /// Requests that ended since the engine last took them (`take_endings`): their last
    /// events, which the engine delivers.
    endings: Vec<Ending>,
    /// Slot index where prompt chunking starts next step.
    next_prompt: usize,
    /// Slot index where decode tokens start next step (so that with fewer batch places than
    /// generating sequences, none starves).
    next_decode: usize,
    /// Multi-user cache: fork shared prefixes between slots (`--multiuser-cache`).
    multiuser: bool,
    /// Sequences that left their slot, in RAM (`--cache-ram`).
    prompt_cache: PromptCache,
    /// Checkpoints of the sliding-window cells (`kv/checkpoints.rs`).
    checkpoints: Checkpoints,
    /// Batches decoded (`shift_pending`).
    decodes: u64,
    /// Prompt-lookup drafts (`--draft-max` ...).
    speculation: SpecConfig,
    /// What a decode step costs, refined from the steps run (how much drafting pays).
    step_cost: CostModel,
    /// What drafted and plain steps really delivered (drafting stops where it does not pay).
    payoff: Payoff,
    /// This step's generating sequences, and whether `payoff` was asked about them (some of
    /// them could draft).
    step_placed: usize,
    step_judged: bool,
    /// Drafted tokens accepted in this step.
    step_accepted: usize,
    /// A draft model decode failed once already (it is logged once).
    draft_failed: bool,
    /// Counter standing for "when" a slot was last used (LRU order).
    clock: u64,
    /// How long a sequence may wait for a client that does not read.
    pause_limit: Duration,
    batch: Vec<BatchToken>,
    /// The LoRA scale set of `batch` (`lora.rs`: one set per batch, the sets take turns).
    batch_lora: Option<LoraScales>,
    /// Whose turn it is among the LoRA scale sets, and what a change of set costs.
    lora_turns: lora::Turns,
    /// What happened since the last turn's outcome (admissions, swap-outs, ends).
    turn_log: outcome::TurnLog,
}

impl<B: Backend> Scheduler<B> {
    /// A scheduler with `slots` sequences over `backend`, reporting to `observer` and giving
    /// `queue` its places back.
    pub fn new(
        backend: B,
        slots: usize,
        observer: Arc<dyn EngineObserver>,
        queue: Arc<QueueGauge>,
    ) -> Self {
        let slots = (0..slots)
            .map(|i| Slot {
                id: i32::try_from(i).unwrap_or(i32::MAX),
                cached: Vec::new(),
                draft_cached: Vec::new(),
                lora: LoraScales::base(),
                seq: None,
                last_used: None,
                last_tick: 0,
                shifted_at: None,
            })
            .collect();
        Self {
            backend,
            observer,
            queue,
            slots,
            waiting: VecDeque::new(),
            endings: Vec::new(),
            next_prompt: 0,
            next_decode: 0,
            multiuser: false,
            prompt_cache: PromptCache::new(0),
            checkpoints: Checkpoints::new(0, 0),
            decodes: 0,
            speculation: SpecConfig::OFF,
            step_cost: CostModel::new(SpecConfig::OFF.cost),
            payoff: Payoff::new(),
            step_placed: 0,
            step_judged: false,
            step_accepted: 0,
            draft_failed: false,
            clock: 0,
            pause_limit: PAUSE_LIMIT,
            batch: Vec::new(),
            batch_lora: None,
            lora_turns: lora::Turns::default(),
            turn_log: outcome::TurnLog::default(),
        }
    }

    /// How long a sequence may stay paused for a client that does not read its stream before
    /// its slot is taken back.
    pub fn with_pause_limit(mut self, limit: Duration) -> Self {
        self.pause_limit = limit;
        self
    }

    /// Shares cached prefixes between slots by forking (`--multiuser-cache`).
    pub fn with_multiuser_cache(mut self, on: bool) -> Self {
        self.multiuser = on;
        self
    }

    /// Keeps the states of sequences that leave their slot in RAM, within `bytes`
    /// (`--cache-ram`; 0 = off), and restores them for prompts that start like them.
    pub fn with_prompt_cache(mut self, bytes: usize) -> Self {
        self.prompt_cache = PromptCache::new(bytes);
        self
    }

    /// Keeps up to `per_slot` checkpoints of the sliding-window cells per slot, and at most
    /// `bytes` of them (`--ctx-checkpoints`, within the `--cache-ram` budget;
    /// `kv/checkpoints.rs`), when the model's cache has a window.
    pub fn with_checkpoints(mut self, per_slot: usize, bytes: usize) -> Self {
        let max = if self.backend.sliding_window().is_some() {
            per_slot.saturating_mul(self.slots.len())
        } else {
            0
        };
        self.checkpoints = Checkpoints::new(max, bytes);
        self
    }

    /// Drafts tokens by prompt lookup for the requests that want it (`--draft-max` ...).
    pub fn with_speculation(mut self, config: SpecConfig) -> Self {
        self.speculation = config;
        self.step_cost = CostModel::new(config.cost);
        self
    }

    /// The backend, for the engine's own work between steps (embeddings, the model's
    /// description).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Slots.
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// A request joins the waiting queue (its place is already counted by the queue's gauge).
    pub fn enqueue(&mut self, request: Request) {
        self.waiting.push_back(request);
    }

    /// Nothing waits and no slot is serving.
    pub fn idle(&self) -> bool {
        self.waiting.is_empty() && self.slots.iter().all(|s| s.seq.is_none())
    }

    /// The last events of the requests that ended (finished, failed, refused or timed out)
    /// since the last call, for the engine to deliver.
    pub fn take_endings(&mut self) -> Vec<Ending> {
        std::mem::take(&mut self.endings)
    }

    /// The slot table, for `GET /slots`.
    pub fn slot_table(&self) -> Vec<crate::protocol::SlotInfo> {
        self.slots
            .iter()
            .map(|s| crate::protocol::SlotInfo {
                id: s.id,
                busy: s.seq.is_some(),
                cached_tokens: s.cached.len(),
                last_used_ms: s
                    .last_used
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                request_id: s.seq.as_ref().map(|q| q.id.clone()),
                activity: s
                    .seq
                    .as_ref()
                    .map_or_else(SlotActivity::default, Sequence::activity),
            })
            .collect()
    }

    /// One turn of the policy between two receives (after `drop_cancelled`): waiting requests
    /// are admitted, one batch is decoded and sampled.
    pub fn turn(&mut self) -> StepOutcome {
        self.admit();
        let mut outcome = self.step();
        self.take_turn_log(&mut outcome);
        outcome
    }

    /// Ends every waiting and running request with `err` (the server stops).
    pub fn fail_all(&mut self, err: &EngineError) {
        for r in std::mem::take(&mut self.waiting) {
            self.left_queue();
            self.endings.push(Ending::error(r.events, err.clone()));
        }
        for slot in &mut self.slots {
            if let Some(seq) = slot.seq.take() {
                self.endings.push(Ending::error(seq.events, err.clone()));
            }
        }
    }
}

/// Positions of the image at the head of `tokens` (0 when it starts with text).
fn leading_image(tokens: &[Token]) -> usize {
    match tokens.first() {
        Some(&t) if is_image_token(t) => {
            1 + tokens[1..]
                .iter()
                .take_while(|&&t| is_image_continuation(t))
                .count()
        }
        _ => 0,
    }
}

/// The images a prompt's tokens hold, checked: every image in it has its `PromptImage` with
/// all its positions.
fn prompt_images(tokens: &[Token], given: &[PromptImage]) -> Result<Vec<PromptImage>, EngineError> {
    let invalid = |m: String| EngineError::new(EngineErrorKind::InvalidRequest, m);
    let mut used: Vec<PromptImage> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        if !is_image_token(tokens[i]) {
            i += 1;
            continue;
        }
        let n = leading_image(&tokens[i..]);
        let image = given
            .iter()
            .find(|im| is_image_start(tokens[i]) && im.token(0) == tokens[i] && im.n_tokens == n)
            .filter(|im| im.tokens().eq(tokens[i..i + n].iter().copied()))
            .ok_or_else(|| invalid(format!("image positions at {i} have no image")))?;
        if !used.iter().any(|u| u.key == image.key) {
            used.push(image.clone());
        }
        i += n;
    }
    Ok(used)
}

/// A request's tokens (tokenizing its text if the HTTP side did not); `what` names it in the
/// error.
pub fn input_tokens(
    backend: &impl crate::backend::Text,
    input: &Input,
    what: &str,
) -> Result<Vec<Token>, EngineError> {
    let tokens = match input {
        Input::Tokens(tokens) => tokens.clone(),
        Input::Text(text) => backend
            .tokenize(text)
            .map_err(|e| EngineError::new(EngineErrorKind::InvalidRequest, e.to_string()))?,
    };
    if tokens.is_empty() {
        return Err(EngineError::new(
            EngineErrorKind::InvalidRequest,
            format!("the {what} has no tokens"),
        ));
    }
    Ok(tokens)
}

/// The 400 for an input that does not fit and may not be truncated.
pub fn too_long(e: kv::TooLong) -> EngineError {
    EngineError::new(EngineErrorKind::ContextLength, e.to_string())
}

fn pos_of(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests;
