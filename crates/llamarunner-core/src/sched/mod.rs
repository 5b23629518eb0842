//! The batching loop. It owns the slots and the sequences in them; it runs on the engine thread
//! and is generic over `Backend`, so it is unit-tested against the fake backend.
//!
//! Each step: take new requests, drop those whose client left, admit waiting requests into free
//! slots (reusing the longest cached prefix), build one batch (every generating sequence's next
//! token first, then prompt chunks with the remaining budget, round robin), decode once, sample
//! for every sequence whose pending tokens are all decoded, and stream the text out.

pub mod adaptive;
pub mod checkpoints;
mod draft;
mod lora;
pub mod payoff;
pub mod prompt_cache;
pub mod speculative;
pub mod text;

use std::collections::VecDeque;
use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::Sender;

use crate::backend::{Backend, BatchToken, Fork};
use crate::kv;
use crate::protocol::nanos;
use crate::protocol::params::SamplingParams;
use crate::protocol::vision::{is_image_continuation, is_image_start, is_image_token};
use crate::protocol::{
    BackendError, Completion, DoneReason, EmbedRequest, Embedding, EngineError, EngineErrorKind,
    EngineInbox, Event, Input, LoraScales, Message, PromptImage, Request, SlotAction, SlotActivity,
    SlotCommand, SlotOutcome, SlotPhase, Token, TokenLogprob,
};
use adaptive::CostModel;
use checkpoints::Checkpoints;
use payoff::Payoff;
use prompt_cache::PromptCache;
use speculative::{SpecConfig, SpecState};
use text::TextStream;

/// Text a sequence may hold for a client that does not read (its event channel is full) before
/// it stops generating until the client catches up.
pub const OUTBOX_CAP_BYTES: usize = 16 * 1024;
/// Log-probability entries a sequence may hold likewise.
pub const OUTBOX_CAP_LOGPROBS: usize = 1024;
/// How long a sequence may stay paused for a client that does not read before its slot is
/// taken back (the client is treated as gone), unless `with_pause_limit` says otherwise.
pub const PAUSE_LIMIT: Duration = Duration::from_secs(30);

/// An embedding input in progress.
struct EmbedJob {
    request: EmbedRequest,
    tokens: Vec<Token>,
    /// Tokens decoded so far.
    done: usize,
    truncated: bool,
}

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
    events: Sender<Event>,
    params: SamplingParams,
    /// The LoRA scale set it is decoded under.
    lora: LoraScales,
    sampler: S,
    /// Tokens not yet decoded: the rest of the prompt, or the last sampled token.
    pending: Vec<Token>,
    /// How many of `pending` are in the batch being built.
    queued: usize,
    /// The images whose positions its tokens hold (`engine::vision`).
    images: Vec<PromptImage>,
    /// Positions of the image at the head of `pending` decoded this step (0: none), in a
    /// decode of its own before the batch (`decode_images`).
    image_queued: usize,
    /// Batch index whose logits this sequence samples from after this step.
    logits_at: Option<usize>,
    n_prompt: usize,
    n_cached: usize,
    n_generated: usize,
    /// The slot's length at which the prompt's next window checkpoint is taken
    /// (`checkpoints.rs`); the prompt's end is checkpointed as well.
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
    inbox: EngineInbox,
    slots: Vec<Slot<B::Sampler>>,
    waiting: VecDeque<Request>,
    /// Embedding requests, served one per step between decodes.
    embeds: VecDeque<EmbedRequest>,
    /// The embedding input being decoded, one piece per step.
    embedding: Option<EmbedJob>,
    /// Events a full channel could not take yet (a slow client whose sequence already ended).
    draining: Vec<(Sender<Event>, VecDeque<Event>)>,
    /// Slot index where prompt chunking starts next step.
    next_prompt: usize,
    /// Slot index where decode tokens start next step (so that with fewer batch places than
    /// generating sequences, none starves).
    next_decode: usize,
    /// Multi-user cache: fork shared prefixes between slots (`--multiuser-cache`).
    multiuser: bool,
    /// Sequences that left their slot, in RAM (`--cache-ram`).
    prompt_cache: PromptCache,
    /// Checkpoints of the sliding-window cells (`checkpoints.rs`).
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
    /// The last step decoded nothing although sequences are running (all paused for their
    /// clients): the next receive waits a moment instead of spinning.
    stalled: bool,
    batch: Vec<BatchToken>,
    /// The LoRA scale set of `batch` (`lora.rs`: one set per batch, the sets take turns).
    batch_lora: Option<LoraScales>,
    /// The LoRA scale set that had the last turn.
    last_lora: Option<LoraScales>,
}

impl<B: Backend> Scheduler<B> {
    /// A scheduler with `slots` sequences over `backend`.
    pub fn new(backend: B, inbox: EngineInbox, slots: usize) -> Self {
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
            inbox,
            slots,
            waiting: VecDeque::new(),
            embeds: VecDeque::new(),
            embedding: None,
            draining: Vec::new(),
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
            stalled: false,
            pause_limit: PAUSE_LIMIT,
            batch: Vec::new(),
            batch_lora: None,
            last_lora: None,
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
    /// `checkpoints.rs`), when the model's cache has a window.
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

    /// Runs until shutdown is requested or every handle is dropped.
    pub fn run(mut self) {
        let total = u32::try_from(self.slots.len()).unwrap_or(u32::MAX);
        if self.inbox.health.model_info().is_none() {
            // A backend without a model file (the fake) still gets a description.
            if let Some(info) = self.backend.describe() {
                self.inbox.health.set_model_info(info);
            }
        }
        // The table is there from the first moment the server says ready.
        self.publish_slots();
        self.inbox.health.set_ready(total);
        while self.receive() {
            if self.inbox.stopping() {
                break;
            }
            self.drop_cancelled();
            self.embed_one();
            self.admit();
            self.step();
            self.flush_draining();
            self.publish_slots();
        }
        self.fail_everything();
    }

    fn publish_slots(&self) {
        let table = self
            .slots
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
            .collect();
        self.inbox.health.set_slots(table);
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty()
            && self.embeds.is_empty()
            && self.embedding.is_none()
            && self.slots.iter().all(|s| s.seq.is_none())
    }

    /// Moves every new message into `waiting` (the queue's length is bounded by the handle's
    /// gauge) and new embedding requests into `embeds`; blocks when there is nothing to do.
    /// False = exit.
    fn receive(&mut self) -> bool {
        if self.stalled {
            match self.inbox.rx.recv_timeout(Duration::from_millis(2)) {
                Ok(m) => self.handle(m),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        } else if self.idle() {
            let msg = if self.draining.is_empty() {
                self.inbox
                    .rx
                    .recv()
                    .map_err(|_| RecvTimeoutError::Disconnected)
            } else {
                self.inbox.rx.recv_timeout(Duration::from_millis(5))
            };
            match msg {
                Ok(m) => self.handle(m),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return false,
            }
        }
        while let Ok(e) = self.inbox.embed_rx.try_recv() {
            self.embeds.push_back(e);
        }
        loop {
            match self.inbox.rx.try_recv() {
                Ok(m) => self.handle(m),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return !self.idle(),
            }
        }
    }

    fn free_slots(&self) -> usize {
        self.slots.iter().filter(|s| s.seq.is_none()).count()
    }

    fn handle(&mut self, msg: Message) {
        match msg {
            Message::Request(r) => self.waiting.push_back(*r),
            Message::Slot(command) => {
                let SlotCommand {
                    slot,
                    action,
                    reply,
                } = *command;
                let outcome = self.slot_action(slot, action);
                // `GET /slots` shows the change once the caller has its answer.
                self.publish_slots();
                let _ = reply.send(outcome);
            }
            Message::Wake => {}
        }
    }

    /// Saves, restores or erases the cache of slot `index` (`POST /slots/{id}`). Runs between
    /// steps, so no batch is in flight; a slot serving a request is refused.
    fn slot_action(
        &mut self,
        index: usize,
        action: SlotAction,
    ) -> Result<SlotOutcome, EngineError> {
        let total = self.slots.len();
        let slot = self.slots.get_mut(index).ok_or_else(|| {
            EngineError::new(
                EngineErrorKind::SlotNotFound,
                format!("no slot {index}: this server has slots 0..{total}"),
            )
        })?;
        if slot.seq.is_some() {
            return Err(EngineError::new(
                EngineErrorKind::SlotBusy,
                format!("slot {index} is serving a request; retry when it is idle"),
            ));
        }
        match action {
            SlotAction::Save if slot.cached.iter().any(|&t| is_image_token(t)) => {
                // A slot file records token ids; an image's positions have no id another
                // server could check or decode again.
                Err(EngineError::new(
                    EngineErrorKind::InvalidRequest,
                    format!(
                        "slot {index} holds image positions, which a slot file cannot record; \
                         erase the slot or save one without images"
                    ),
                ))
            }
            SlotAction::Save => {
                let state = self
                    .backend
                    .seq_state(slot.id)
                    .map_err(|e| EngineError::new(EngineErrorKind::Internal, e.to_string()))?;
                Ok(SlotOutcome::Saved {
                    tokens: slot.cached.clone(),
                    state,
                    lora: slot.lora.clone(),
                })
            }
            SlotAction::Restore {
                tokens,
                state,
                lora,
            } => {
                let ctx = self.backend.slot_ctx();
                if tokens.len() > ctx {
                    return Err(EngineError::new(
                        EngineErrorKind::ContextLength,
                        format!(
                            "the saved cache holds {} tokens, a slot {ctx}",
                            tokens.len()
                        ),
                    ));
                }
                let restored = self.backend.set_seq_state(slot.id, &state);
                // The scheduler's record must be exactly what the cache holds: anything else
                // (an error, or a state whose cell count is not its token count) leaves the
                // slot empty.
                let why = match restored {
                    Ok(n) if n == tokens.len() => None,
                    Ok(n) => Some(format!(
                        "the saved state holds {n} positions but names {} tokens",
                        tokens.len()
                    )),
                    Err(e) => Some(e.to_string()),
                };
                slot.cached.clear();
                if let Some(why) = why {
                    self.backend.kv_truncate(slot.id, 0);
                    return Err(EngineError::new(
                        EngineErrorKind::InvalidSlotState,
                        format!("llama.cpp could not restore the slot's cache: {why}"),
                    ));
                }
                slot.cached = tokens;
                slot.lora = lora;
                slot.last_used = Some(std::time::SystemTime::now());
                self.clock += 1;
                slot.last_tick = self.clock;
                Ok(SlotOutcome::Restored(slot.cached.len()))
            }
            SlotAction::Erase => {
                let n = slot.cached.len();
                self.backend.kv_truncate(slot.id, 0);
                slot.cached.clear();
                Ok(SlotOutcome::Erased(n))
            }
        }
    }

    /// A request left the waiting queue: its place is free for the next one.
    fn left_queue(&self) {
        self.inbox.queue.release();
    }

    /// Frees the slots and queue places of clients that went away, refuses queued requests
    /// whose time ran out and ends running ones ("timeout").
    fn drop_cancelled(&mut self) {
        let now = Instant::now();
        let before = self.waiting.len();
        let mut expired = Vec::new();
        self.waiting.retain(|r| {
            if r.events.is_closed() {
                return false;
            }
            if r.deadline.is_some_and(|d| d <= now) {
                expired.push(r.events.clone());
                return false;
            }
            true
        });
        for _ in self.waiting.len()..before {
            self.left_queue();
        }
        for events in expired {
            let err = EngineError::new(
                EngineErrorKind::Timeout,
                "the request waited for a slot longer than the server's time limit (--timeout)",
            );
            let _ = events.try_send(Event::Error(err));
        }
        let mut timed_out = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(seq) = slot.seq.as_ref() else {
                continue;
            };
            let stuck = seq
                .paused_since
                .is_some_and(|t| now.duration_since(t) >= self.pause_limit);
            if seq.events.is_closed() {
                seq.span.in_scope(|| {
                    tracing::debug!(slot = slot.id, "client disconnected; slot freed");
                });
                slot.seq = None;
            } else if stuck {
                seq.span.in_scope(|| {
                    tracing::warn!(
                        slot = slot.id,
                        limit = ?self.pause_limit,
                        "the client has not read its stream; slot freed"
                    );
                });
                slot.seq = None;
            } else if seq.deadline.is_some_and(|d| d <= now) {
                timed_out.push(i);
            }
        }
        for i in timed_out {
            if let Some(seq) = self.slots[i].seq.as_ref() {
                seq.span.in_scope(|| {
                    tracing::info!(slot = self.slots[i].id, "request reached the time limit");
                });
            }
            self.finish(i, DoneReason::Timeout);
        }
    }

    /// Serves the oldest embedding request (one per step, so generating streams keep flowing).
    fn embed_one(&mut self) {
        if self.embedding.is_none() {
            let Some(request) = self.embeds.pop_front() else {
                return;
            };
            if request.reply.is_closed() {
                return;
            }
            match self.embed_tokens(&request) {
                Ok((tokens, truncated)) => {
                    self.embedding = Some(EmbedJob {
                        request,
                        tokens,
                        done: 0,
                        truncated,
                    });
                }
                Err(e) => {
                    let _ = request.reply.send(Err(e));
                    return;
                }
            }
        }
        let Some(mut job) = self.embedding.take() else {
            return;
        };
        if job.request.reply.is_closed() {
            return; // the client left: the rest of its input is not decoded
        }
        let end = (job.done + self.backend.embed_piece().max(1)).min(job.tokens.len());
        let last = end == job.tokens.len();
        match self
            .backend
            .embed(&job.tokens[job.done..end], job.done, last)
        {
            Ok(None) => {
                job.done = end;
                self.embedding = Some(job);
            }
            Ok(Some(vector)) => {
                self.inbox.observer.embedded(job.tokens.len());
                let _ = job.request.reply.send(Ok(Embedding {
                    vector,
                    prompt_eval_count: job.tokens.len(),
                    truncated: job.truncated,
                }));
            }
            Err(e) => {
                let err = EngineError::new(EngineErrorKind::Internal, e.to_string());
                let _ = job.request.reply.send(Err(err));
            }
        }
    }

    /// A request's tokens (tokenizing its text if the HTTP side did not); `what` names it in
    /// the error.
    fn tokenize(&self, input: &Input, what: &str) -> Result<Vec<Token>, EngineError> {
        let tokens = match input {
            Input::Tokens(tokens) => tokens.clone(),
            Input::Text(text) => self
                .backend
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

    /// An embedding request's tokens, fitted into the embedding context; and whether cut.
    fn embed_tokens(&self, request: &EmbedRequest) -> Result<(Vec<Token>, bool), EngineError> {
        let mut tokens = self.tokenize(&request.content, "content")?;
        let cut = kv::fit_input(&mut tokens, request.truncate, self.backend.embed_capacity())
            .map_err(too_long)?;
        Ok((tokens, cut))
    }

    fn admit(&mut self) {
        while self.free_slots() > 0 {
            let Some(request) = self.waiting.pop_front() else {
                return;
            };
            self.left_queue();
            if let Err(e) = self.admit_one(&request) {
                let _ = request.events.try_send(Event::Error(e));
            }
        }
    }

    fn admit_one(&mut self, request: &Request) -> Result<(), EngineError> {
        let mut tokens = self.tokenize(&request.prompt, "prompt")?;
        let params = &request.params;
        let ctx = self.backend.slot_ctx();
        let has_bos = self
            .backend
            .bos()
            .is_some_and(|b| tokens.first() == Some(&b));
        let keep = kv::keep_count(params.num_keep, tokens.len(), has_bos, ctx);
        // Requests from the HTTP side fit already (validated); text tokenized here may not.
        let cut = kv::fit_prompt(
            &mut tokens,
            params.num_keep,
            params.truncate,
            self.backend.bos(),
            ctx,
        )
        .map_err(too_long)?;
        let truncated = request.truncated || cut;
        let images = prompt_images(&tokens, &request.images)?;
        let sampler = if images.is_empty() {
            self.backend.new_sampler(params, &tokens)
        } else {
            // Image positions are no tokens to penalize.
            let text: Vec<Token> = tokens.iter().copied().filter(|&t| t >= 0).collect();
            self.backend.new_sampler(params, &text)
        }
        .map_err(|e| EngineError::new(EngineErrorKind::InvalidRequest, e.to_string()))?;
        let lora = params.lora.clone().unwrap_or_default();
        let (index, common) = self.pick_slot(&tokens, &lora)?;
        // A sequence in RAM that starts like the prompt, beyond what the slot holds; nothing
        // cached when the request asks for none (`cache_prompt: false`).
        let common = if params.cache_prompt {
            self.restore_cached(index, &tokens, &lora, common)
        } else {
            0
        };
        // At least one prompt token is decoded so there are logits to sample from; a prefix
        // that ends inside an image is cut back to the image's start (an image is decoded
        // whole).
        let mut reuse = kv::image_boundary_before(&tokens, common.min(tokens.len() - 1));
        // What the slot holds past the reused prefix is about to go: to RAM first.
        self.offload(index, reuse);
        if !self.backend.kv_truncate(self.slots[index].id, reuse) {
            // Partial removal is impossible (recurrent models), or what is left lacks cells a
            // sliding window needs: back to a window checkpoint, or start the slot afresh.
            reuse = self.rewind(index, &tokens, &lora, reuse);
        }
        let spacing = self.checkpoint_spacing();
        let slot = &mut self.slots[index];
        slot.cached.truncate(reuse);
        slot.lora = lora.clone();
        slot.last_used = Some(std::time::SystemTime::now());
        self.clock += 1;
        slot.last_tick = self.clock;
        if request.events.try_send(Event::Started).is_err() {
            return Ok(()); // the client is gone; the slot stays free
        }
        let admitted = Instant::now();
        let queued = admitted.saturating_duration_since(request.received);
        self.inbox
            .observer
            .admitted(queued, tokens.len(), reuse, truncated);
        let span = tracing::info_span!("request", request_id = %request.id);
        span.in_scope(|| {
            tracing::debug!(
                slot = slot.id,
                prompt = tokens.len(),
                cached = reuse,
                waited_ms = u64::try_from(queued.as_millis()).unwrap_or(u64::MAX),
                "sequence admitted"
            );
        });
        slot.seq = Some(Sequence {
            id: request.id.clone(),
            span,
            received: request.received,
            last_token: None,
            phase: Phase::Prefill,
            deadline: request.deadline,
            paused_since: None,
            events: request.events.clone(),
            params: request.params.clone(),
            lora,
            sampler,
            n_prompt: tokens.len(),
            n_cached: reuse,
            next_checkpoint: reuse.saturating_add(spacing),
            pending: tokens[reuse..].to_vec(),
            queued: 0,
            images,
            image_queued: 0,
            logits_at: None,
            n_generated: 0,
            keep,
            truncated,
            text: TextStream::new(request.params.stop.clone()),
            outbox: String::new(),
            outbox_logprobs: Vec::new(),
            logprobs_sent: 0,
            admitted,
            prompt_done: None,
            spec: SpecState::new(
                self.speculation.enabled_for(&request.params),
                !self.backend.has_draft_model(),
            ),
        });
        Ok(())
    }

    /// Chooses the slot for a prompt; returns it with the number of prompt tokens its cache
    /// holds (after forking a shared prefix into it, in multi-user mode).
    /// Only a cache computed under the prompt's LoRA scale set counts (`lora.rs`).
    fn pick_slot(
        &mut self,
        tokens: &[Token],
        lora: &LoraScales,
    ) -> Result<(usize, usize), EngineError> {
        let no_slot =
            || EngineError::new(EngineErrorKind::Internal, "no free slot (scheduler bug)");
        if !self.multiuser {
            return kv::choose_slot(
                self.slots
                    .iter()
                    .map(|s| (s.seq.is_none(), lora::reusable(&s.cached, &s.lora, lora))),
                tokens,
            )
            .ok_or_else(no_slot);
        }
        let views: Vec<kv::SlotView<'_>> = self
            .slots
            .iter()
            .map(|s| kv::SlotView {
                free: s.seq.is_none(),
                cached: lora::reusable(&s.cached, &s.lora, lora),
                last_used: s.last_tick,
            })
            .collect();
        let mut choice =
            kv::choose_slot_multiuser(&views, tokens, MIN_SHARE_GAIN).ok_or_else(no_slot)?;
        // A shared prefix that ends inside an image is forked up to the image's start.
        choice.reuse = kv::image_boundary_before(tokens, choice.reuse);
        let Some(from) = choice.fork_from else {
            return Ok((choice.slot, choice.reuse));
        };
        let target = &self.slots[choice.slot];
        let own = kv::image_boundary_before(
            tokens,
            kv::common_prefix(lora::reusable(&target.cached, &target.lora, lora), tokens),
        );
        // No fork from a slot whose context shift llama.cpp has not applied yet (it rotates
        // the keys at the next decode; a copy now would hold them unrotated).
        if self.shift_pending(from) {
            return Ok((choice.slot, own));
        }
        // A fork from a slot that moved on past the prefix, and past its window, keeps on a
        // sliding-window model only what a window checkpoint gives back (a state holds the
        // window cells of its source's last `window` positions): when that is not worth the
        // copy, the slot starts from its own prefix.
        let src_len = self.slots[from].cached.len();
        if self
            .backend
            .sliding_window()
            .is_some_and(|w| src_len > choice.reuse.max(w))
        {
            let usable = self
                .checkpoints
                .best(tokens, lora, choice.reuse)
                .map_or(0, |c| c.tokens.len());
            if usable < own.saturating_add(MIN_SHARE_GAIN) {
                return Ok((choice.slot, own));
            }
        }
        let (src, dst) = (self.slots[from].id, self.slots[choice.slot].id);
        let prefix = self.slots[from].cached[..choice.reuse].to_vec();
        // The fork overwrites the slot: its sequence goes to RAM first.
        self.offload(choice.slot, 0);
        match self.backend.kv_fork(src, dst, choice.reuse) {
            Fork::Copied => {
                tracing::debug!(
                    from = src,
                    to = dst,
                    tokens = choice.reuse,
                    "forked a cached prefix"
                );
                self.slots[choice.slot].cached = prefix;
                Ok((choice.slot, choice.reuse))
            }
            Fork::WindowLost => {
                // The full-attention cells are copied, the window before the prefix's end is
                // not: back to a window checkpoint of the prefix, or the slot is emptied and
                // the prompt decoded in full.
                self.slots[choice.slot].cached = prefix;
                let reuse = self.rewind(choice.slot, tokens, lora, choice.reuse);
                if reuse > 0 {
                    tracing::debug!(
                        from = src,
                        to = dst,
                        tokens = reuse,
                        "forked a cached prefix to a checkpoint"
                    );
                }
                Ok((choice.slot, reuse))
            }
            Fork::Failed => {
                // Nothing was copied (the backend emptied the slot): decoded in full.
                self.backend.kv_truncate(dst, 0);
                self.slots[choice.slot].cached.clear();
                Ok((choice.slot, 0))
            }
        }
    }

    /// Whether slot `index` was shifted (`kv_shift`) since the last decode: llama.cpp applies
    /// a shift's key rotation at the next decode, so its cells must not be copied out before.
    fn shift_pending(&self, index: usize) -> bool {
        self.slots[index].shifted_at == Some(self.decodes)
    }

    /// Positions between a prompt's window checkpoints: the window (what a rewind to the
    /// checkpoint before a cut decodes again is at most that); 0 when none are taken.
    fn checkpoint_spacing(&self) -> usize {
        if self.checkpoints.enabled() {
            self.backend.sliding_window().unwrap_or(0).max(1)
        } else {
            0
        }
    }

    /// Slot `index`'s cache, which holds `prompt`'s first `at_most` tokens but not the window
    /// before them, goes back to the longest window checkpoint of `prompt` within them; it is
    /// cleared when there is none or the rewind fails. Returns the prompt tokens it holds.
    fn rewind(
        &mut self,
        index: usize,
        prompt: &[Token],
        lora: &LoraScales,
        at_most: usize,
    ) -> usize {
        let id = self.slots[index].id;
        // A checkpoint is of the prompt's own tokens, and the slot holds them up to `at_most`.
        let held = kv::common_prefix(&self.slots[index].cached, prompt).min(at_most);
        if let Some(c) = self.checkpoints.best(prompt, lora, held) {
            let len = c.tokens.len();
            if self.backend.rewind_to_checkpoint(id, len, &c.state) {
                self.slots[index].cached.truncate(len);
                tracing::debug!(
                    slot = id,
                    tokens = len,
                    wanted = at_most,
                    "rewound to a window checkpoint"
                );
                return len;
            }
            tracing::warn!(
                slot = id,
                tokens = len,
                "a window checkpoint did not restore; decoding the prompt"
            );
        }
        self.backend.kv_truncate(id, 0);
        self.slots[index].cached.clear();
        0
    }

    /// Takes a window checkpoint of slot `index` (whose sequence decodes its prompt) when its
    /// prompt is complete or it passed the next checkpoint's length.
    fn checkpoint(&mut self, index: usize) {
        let spacing = self.checkpoint_spacing();
        let slot = &mut self.slots[index];
        let Some(seq) = slot.seq.as_mut() else {
            return;
        };
        let len = slot.cached.len();
        if spacing == 0
            || seq.phase != Phase::Prefill
            || !(seq.pending.is_empty() || len >= seq.next_checkpoint)
        {
            return;
        }
        seq.next_checkpoint = len.saturating_add(spacing);
        match self.backend.window_checkpoint(slot.id) {
            Ok(state) => {
                let bytes = state.len();
                self.checkpoints
                    .insert(slot.cached.clone(), slot.lora.clone(), state);
                tracing::trace!(
                    slot = slot.id,
                    tokens = len,
                    bytes,
                    held = self.checkpoints.len(),
                    held_bytes = self.checkpoints.bytes(),
                    "window checkpoint"
                );
            }
            Err(e) => tracing::debug!(slot = slot.id, error = %e, "no window checkpoint"),
        }
    }

    /// Stores the sequence cached in slot `index` in the prompt cache when all but its first
    /// `keep` tokens are about to be overwritten, unless little would be lost, the cache holds
    /// it already, or another slot holds it (a fork's copy).
    fn offload(&mut self, index: usize, keep: usize) {
        if !self.prompt_cache.enabled() {
            return;
        }
        let slot = &self.slots[index];
        if slot.cached.len() < keep + prompt_cache::MIN_STORE
            || self.prompt_cache.covers(&slot.cached, &slot.lora)
        {
            return;
        }
        if self.shift_pending(index) {
            tracing::debug!(
                slot = slot.id,
                "not stored: its context shift is not applied yet"
            );
            return;
        }
        let elsewhere = self.slots.iter().enumerate().any(|(j, other)| {
            j != index && other.lora == slot.lora && other.cached.starts_with(&slot.cached)
        });
        if elsewhere {
            return;
        }
        match self.backend.seq_state(slot.id) {
            Ok(state) => {
                let bytes = state.len();
                let stored =
                    self.prompt_cache
                        .insert(slot.cached.clone(), slot.lora.clone(), state);
                tracing::debug!(
                    slot = slot.id,
                    tokens = slot.cached.len(),
                    bytes,
                    stored,
                    cache_bytes = self.prompt_cache.used(),
                    entries = self.prompt_cache.len(),
                    "a slot's sequence to the prompt cache"
                );
                self.report_prompt_cache(0);
            }
            Err(e) => {
                tracing::debug!(slot = slot.id, error = %e, "the slot's state could not be read")
            }
        }
    }

    /// Tells the metrics what the prompt cache holds, and that a restore saved decoding
    /// `restored` prompt tokens (0 after a store).
    fn report_prompt_cache(&self, restored: usize) {
        self.inbox.observer.prompt_cache(
            self.prompt_cache.used(),
            self.prompt_cache.len(),
            restored,
        );
    }

    /// Restores into slot `index` the prompt cache's entry that shares the longest prefix with
    /// `tokens` under `lora`, if it shares more than the `common` tokens the slot holds (by
    /// `MIN_RESTORE_GAIN`); the slot's own sequence is stored first. Returns the prompt
    /// tokens the slot now holds.
    fn restore_cached(
        &mut self,
        index: usize,
        tokens: &[Token],
        lora: &LoraScales,
        common: usize,
    ) -> usize {
        if !self.prompt_cache.enabled() {
            return common;
        }
        let Some((entry, shared)) = self.prompt_cache.best(tokens, lora, common) else {
            return common;
        };
        let entry = self.prompt_cache.take(entry, shared - common);
        self.offload(index, 0);
        let slot = &mut self.slots[index];
        match self.backend.set_seq_state(slot.id, &entry.state) {
            Ok(n) if n == entry.tokens.len() => {
                tracing::debug!(
                    slot = slot.id,
                    tokens = n,
                    shared,
                    bytes = entry.state.len(),
                    "restored a sequence from the prompt cache"
                );
                slot.cached = entry.tokens;
                slot.lora = entry.lora;
                self.report_prompt_cache(shared - common);
                shared
            }
            other => {
                tracing::warn!(
                    slot = slot.id,
                    result = ?other.map_err(|e| e.to_string()),
                    expected = entry.tokens.len(),
                    "a prompt cache entry did not restore; decoding the prompt"
                );
                self.backend.kv_truncate(slot.id, 0);
                slot.cached.clear();
                0
            }
        }
    }

    /// The LoRA scale set whose sequences decode this step (`lora.rs`); remembered as the last
    /// one that ran.
    fn lora_turn(&mut self) -> LoraScales {
        let ready = self.slots.iter().filter_map(|s| {
            s.seq
                .as_ref()
                .filter(|q| {
                    if q.phase == Phase::Decode {
                        !q.paused()
                    } else {
                        !q.pending.is_empty()
                    }
                })
                .map(|q| &q.lora)
        });
        let turn = lora::next_turn(ready, self.last_lora.as_ref()).unwrap_or_default();
        self.last_lora = Some(turn.clone());
        turn
    }

    /// Builds the batch: generating sequences' next tokens first, then prompt chunks round
    /// robin within the remaining budget. Who gets a place rotates (fairness when places are
    /// scarce); the tokens are then laid out in ascending slot order, because with one KV
    /// stream per sequence llama.cpp puts into one micro-batch only sequences whose ids follow
    /// each other in batch order: a rotated order ([2, 3, 0, 1]) would cost two passes over the
    /// weights instead of one.
    fn build_batch(&mut self) {
        self.batch.clear();
        let capacity = self.backend.batch_capacity().max(1);
        let n = self.slots.len();
        let turn = self.lora_turn();
        // When generating sequences outnumber the batch places, one place stays for prompt
        // chunks, so that a waiting prompt is never starved by decode tokens.
        let prompt_waiting = self.slots.iter().any(|s| {
            s.seq.as_ref().is_some_and(|q| {
                q.phase != Phase::Decode && !q.pending.is_empty() && q.lora == turn
            })
        });
        let decode_places = if prompt_waiting {
            capacity - 1
        } else {
            capacity
        };
        // Who gets places, and how many.
        let mut placed = 0;
        let first = self.next_decode;
        for k in 0..n {
            let i = (first + k) % n;
            let Some(seq) = self.slots[i].seq.as_mut() else {
                continue;
            };
            seq.queued = 0;
            seq.image_queued = 0;
            seq.logits_at = None;
            if seq.phase == Phase::Decode
                && !seq.paused()
                && placed < decode_places
                && seq.lora == turn
            {
                // Next step starts after the last sequence that got a place.
                self.next_decode = (i + 1) % n;
                seq.queued = 1;
                placed += 1;
            }
        }
        // Drafts of the sequences placed, within the places kept for decode tokens, unless
        // drafts have not paid lately at this many sequences (`payoff`).
        self.step_placed = placed;
        let budget = if self.drafts_pay(placed) {
            decode_places.saturating_sub(placed)
        } else {
            0
        };
        placed += self.place_drafts(budget, placed);
        let start = self.next_prompt;
        let mut prompt_placed = 0;
        for k in 0..n {
            if placed >= capacity {
                break;
            }
            let i = (start + k) % n;
            let Some(seq) = self.slots[i].seq.as_mut() else {
                continue;
            };
            // Prompt chunks: the prompt, or a shifted slot's tokens being re-decoded.
            if seq.phase == Phase::Decode || seq.pending.is_empty() || seq.lora != turn {
                continue;
            }
            let image = leading_image(&seq.pending);
            if image > 0 {
                // An image is decoded whole, in a call of its own before the batch
                // (`decode_images`), and counts against the budget as a prompt chunk of its
                // size would. It waits for a step with room for it unless it is the step's
                // first prompt chunk, so it is never starved.
                if placed + image > capacity && prompt_placed > 0 {
                    continue;
                }
                seq.image_queued = image;
                placed += image;
                prompt_placed += image;
                self.next_prompt = (i + 1) % n;
                continue;
            }
            // Text up to the next image (a llama.cpp batch holds tokens or embeddings).
            let text = seq
                .pending
                .iter()
                .position(|&t| is_image_token(t))
                .unwrap_or(seq.pending.len());
            seq.queued = (capacity - placed).min(text);
            placed += seq.queued;
            prompt_placed += seq.queued;
            self.next_prompt = (i + 1) % n;
        }
        self.batch_lora = Some(turn);
        // The tokens, in slot order; logits for a decode token and a prompt's last token.
        for slot in &mut self.slots {
            let Some(seq) = slot.seq.as_mut() else {
                continue;
            };
            let base = slot.cached.len();
            for (j, &token) in seq.pending[..seq.queued].iter().enumerate() {
                let logits = seq.phase == Phase::Decode || j + 1 == seq.pending.len();
                if logits {
                    seq.logits_at = Some(self.batch.len());
                }
                self.batch.push(BatchToken {
                    token,
                    pos: pos_of(base + j),
                    seq: slot.id,
                    logits,
                });
            }
            // Drafted tokens follow the sequence's next token, each with its logits.
            for (j, &token) in seq.spec.draft.iter().enumerate() {
                self.batch.push(BatchToken {
                    token,
                    pos: pos_of(base + seq.queued + j),
                    seq: slot.id,
                    logits: true,
                });
            }
        }
    }

    fn step(&mut self) {
        // Output held for slow clients goes first; a client that left frees its slot here.
        let now = Instant::now();
        for index in 0..self.slots.len() {
            self.flush_outbox(index);
            if let Some(seq) = self.slots[index].seq.as_mut() {
                seq.paused_since = match (seq.paused(), seq.paused_since) {
                    (false, _) => None,
                    (true, None) => Some(now),
                    (true, since) => since,
                };
            }
        }
        let step_started = Instant::now();
        self.step_accepted = 0;
        self.build_batch();
        let images = self.decode_images();
        self.stalled =
            self.batch.is_empty() && !images && self.slots.iter().any(|s| s.seq.is_some());
        if self.batch.is_empty() {
            return;
        }
        let started = Instant::now();
        let lora = self.batch_lora.take().unwrap_or_default();
        if let Err(e) = self
            .backend
            .set_lora(&lora)
            .and_then(|()| self.backend.decode(&self.batch))
        {
            tracing::error!(error = %e, tokens = self.batch.len(), "decode failed");
            self.fail_batch(&e.to_string());
            return;
        }
        self.decodes += 1;
        let now = Instant::now();
        let decoded = now - started;
        // For the step's trace line: what the cost model expected, and the drafted positions.
        let expected_us = self.step_cost.time(self.batch.len());
        let drafted: usize = self
            .slots
            .iter()
            .filter_map(|s| s.seq.as_ref())
            .map(|seq| seq.spec.draft.len())
            .sum();
        // Only steps of generating sequences (every position with logits) say what a width
        // costs, and whether drafts paid: a prompt chunk's positions cost less.
        let all_logits = self.batch.iter().all(|t| t.logits);
        if self.speculation.measure && all_logits {
            let us = u64::try_from(decoded.as_micros()).unwrap_or(u64::MAX);
            self.step_cost.observe(self.batch.len(), us);
        }
        for index in 0..self.slots.len() {
            let slot = &mut self.slots[index];
            let Some(seq) = slot.seq.as_mut() else {
                continue;
            };
            let prompt_chunk = seq.phase == Phase::Prefill && seq.queued > 0;
            slot.cached.extend(seq.pending.drain(..seq.queued));
            seq.queued = 0;
            if prompt_chunk {
                self.checkpoint(index);
            }
            let Some(seq) = self.slots[index].seq.as_mut() else {
                continue;
            };
            let Some(at) = seq.logits_at.take() else {
                continue;
            };
            if seq.prompt_done.is_none() {
                seq.prompt_done = Some(now);
            }
            if let Some(reason) = self.sample_drafted(index, at, now) {
                self.finish(index, reason);
            } else {
                self.flush_outbox(index);
            }
        }
        if self.step_judged && !images && all_logits {
            let us = u64::try_from(step_started.elapsed().as_micros()).unwrap_or(u64::MAX);
            let tokens = self.step_placed + self.step_accepted;
            self.payoff.observe(self.step_placed, drafted, tokens, us);
        }
        tracing::trace!(
            tokens = self.batch.len(),
            outputs = self.batch.iter().filter(|t| t.logits).count(),
            drafted,
            decode_us = decoded.as_micros(),
            expected_us = expected_us.round() as u64,
            sample_us = now.elapsed().as_micros(),
            "step"
        );
    }

    /// Decodes the images `build_batch` queued, each in a decode of its own, before the batch
    /// (whose logits are the ones sampled after it). A prompt that ends with an image samples
    /// its first token from the image's last position at once, before the next decode. A
    /// failure ends that sequence only. Returns whether any image was decoded.
    fn decode_images(&mut self) -> bool {
        let mut any = false;
        for index in 0..self.slots.len() {
            let slot = &mut self.slots[index];
            let Some(seq) = slot.seq.as_mut() else {
                continue;
            };
            let n = std::mem::take(&mut seq.image_queued);
            if n == 0 {
                continue;
            }
            let first = seq.pending.first().copied();
            let image = seq
                .images
                .iter()
                .find(|im| Some(im.token(0)) == first && im.n_tokens == n)
                .cloned();
            let lora = seq.lora.clone();
            let (id, pos) = (slot.id, slot.cached.len());
            // The prompt ends with this image: its last position's logits are sampled.
            let logits = seq.pending.len() == n;
            let result = match image {
                Some(image) => {
                    let backend = &mut self.backend;
                    seq.span.in_scope(|| {
                        backend
                            .set_lora(&lora)
                            .and_then(|()| backend.decode_image(id, pos, &image, logits))
                    })
                }
                None => Err(BackendError::Decode(
                    "an image position without its image (scheduler bug)".into(),
                )),
            };
            match result {
                Ok(()) => {
                    any = true;
                    slot.cached.extend(seq.pending.drain(..n));
                    if logits {
                        let now = Instant::now();
                        if seq.prompt_done.is_none() {
                            seq.prompt_done = Some(now);
                        }
                        if let Some(reason) = self.sample_drafted(index, n - 1, now) {
                            self.finish(index, reason);
                        } else {
                            self.flush_outbox(index);
                        }
                    }
                }
                Err(e) => {
                    seq.span.in_scope(|| {
                        tracing::error!(error = %e, slot = id, positions = n, "image decode failed");
                    });
                    let err = EngineError::new(
                        EngineErrorKind::Internal,
                        format!("the image could not be decoded: {e}"),
                    );
                    let _ = seq.events.try_send(Event::Error(err));
                    slot.seq = None;
                    self.backend.kv_truncate(id, 0);
                    slot.cached.clear();
                }
            }
        }
        any
    }

    /// Samples the next token of the sequence in slot `index` (its logits were decoded at
    /// `now`); returns why it ends, if it does.
    fn sample_one(&mut self, index: usize, at: usize, now: Instant) -> Option<DoneReason> {
        let ctx = self.backend.slot_ctx();
        let slot = &mut self.slots[index];
        let seq = slot.seq.as_mut()?;
        if seq.params.num_predict == 0 {
            return Some(DoneReason::Length);
        }
        // In the request's span: the backend may log about it (a grammar that ends it).
        let backend = &mut self.backend;
        let Some(token) = seq.span.in_scope(|| backend.sample(&mut seq.sampler, at)) else {
            // The grammar allows nothing more: the output is complete.
            return Some(DoneReason::Stop);
        };
        seq.n_generated += 1;
        match seq.last_token {
            None => self
                .inbox
                .observer
                .first_token(now.saturating_duration_since(seq.received)),
            Some(last) => self
                .inbox
                .observer
                .next_token(now.saturating_duration_since(last)),
        }
        seq.last_token = Some(now);
        // With a grammar, EOG also means the grammar allows nothing more (the backend's signal),
        // so it ends the sequence even under `ignore_eos`.
        if self.backend.is_eog(token) && (!seq.params.ignore_eos || seq.params.grammar.is_some()) {
            return Some(DoneReason::Stop);
        }
        if let Some(top) = seq.params.logprobs {
            seq.outbox_logprobs
                .push(self.backend.logprobs(at, token, top));
        }
        let pushed = seq.text.push(&self.backend.token_bytes(token));
        seq.outbox.push_str(&pushed.text);
        if pushed.stopped {
            // Keep in the cache only what the client really got, so that a follow-up prompt
            // (this prompt + the returned answer + more) reuses it exactly. The cache ends with
            // every generated token but this last one; those past the returned ones go. (Counted
            // from the end: after a context shift, positions no longer start at the prompt.)
            let unreturned = (seq.n_generated - 1).saturating_sub(seq.text.tokens_returned());
            let keep = slot.cached.len().saturating_sub(unreturned);
            if !self.backend.kv_truncate(slot.id, keep) {
                self.backend.kv_truncate(slot.id, 0);
                slot.cached.clear();
            }
            slot.cached.truncate(keep);
            return Some(DoneReason::Stop);
        }
        // -1 means "until done", bounded (as Ollama's server does) at ten slot contexts so a
        // model stuck in a loop with context shift cannot run forever.
        let limit = match seq.params.num_predict {
            n if n < 0 => crate::protocol::params::UNCAPPED_SLOT_CONTEXTS * ctx,
            n => usize::try_from(n).unwrap_or(usize::MAX),
        };
        if seq.n_generated >= limit {
            return Some(DoneReason::Length);
        }
        if slot.cached.len() >= ctx {
            // No cell left to decode this token into.
            if !seq.params.shift {
                return Some(DoneReason::Length);
            }
            let keep = seq.keep.min(slot.cached.len());
            let discard =
                kv::shift_discard(ctx, keep, slot.cached.len()).min(slot.cached.len() - keep);
            // Whole images only: one the cut would split is discarded with it.
            let (keep, end) = kv::whole_images(&slot.cached, keep, keep + discard);
            let discard = end - keep;
            seq.span.in_scope(|| {
                tracing::debug!(slot = slot.id, keep, discard, "context shift");
            });
            self.inbox.observer.context_shift();
            if self.backend.kv_shift(slot.id, keep, discard) {
                slot.cached.drain(keep..keep + discard);
                slot.shifted_at = Some(self.decodes);
            } else {
                // The cache cannot shift: decode the kept tokens again.
                let mut kept = slot.cached[..keep].to_vec();
                kept.extend_from_slice(&slot.cached[keep + discard..]);
                self.backend.kv_truncate(slot.id, 0);
                slot.cached.clear();
                seq.pending = kept;
                seq.phase = Phase::Redecode;
                seq.pending.push(token);
                return None;
            }
        }
        seq.phase = Phase::Decode;
        seq.pending.push(token);
        None
    }

    /// Sends what the sequence produced, if its channel has room; a closed channel frees the slot.
    fn flush_outbox(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        let Some(seq) = slot.seq.as_mut() else {
            return;
        };
        if seq.outbox.is_empty() {
            return;
        }
        // Entries go with the text that completes their tokens; a token still held back (a
        // possible stop string) keeps its entry for later.
        let complete = seq
            .text
            .tokens_returned()
            .saturating_sub(seq.logprobs_sent)
            .min(seq.outbox_logprobs.len());
        let event = Event::Text {
            text: std::mem::take(&mut seq.outbox),
            logprobs: seq.outbox_logprobs.drain(..complete).collect(),
        };
        match seq.events.try_send(event) {
            Ok(()) => seq.logprobs_sent += complete,
            Err(TrySendError::Full(Event::Text { text, logprobs })) => {
                seq.outbox = text;
                seq.outbox_logprobs.splice(..0, logprobs);
            }
            Err(_) => slot.seq = None,
        }
    }

    /// Ends the sequence in slot `index`: flushes held text and sends the final statistics.
    fn finish(&mut self, index: usize, reason: DoneReason) {
        let Some(mut seq) = self.slots[index].seq.take() else {
            return;
        };
        let now = Instant::now();
        let prompt_done = seq.prompt_done.unwrap_or(now);
        seq.outbox.push_str(&seq.text.finish());
        let mut events = VecDeque::new();
        if !seq.outbox.is_empty() {
            // Tokens of a stop string were not returned: their entries go too.
            let returned = seq.text.tokens_returned().saturating_sub(seq.logprobs_sent);
            seq.outbox_logprobs.truncate(returned);
            events.push_back(Event::Text {
                text: std::mem::take(&mut seq.outbox),
                logprobs: std::mem::take(&mut seq.outbox_logprobs),
            });
        }
        events.push_back(Event::Done(Completion {
            done_reason: reason,
            prompt_eval_count: seq.n_prompt,
            prompt_cached_count: seq.n_cached,
            queue_duration_ns: nanos(seq.admitted.saturating_duration_since(seq.received)),
            prompt_eval_duration_ns: nanos(prompt_done - seq.admitted),
            eval_count: seq.n_generated,
            eval_duration_ns: nanos(now - prompt_done),
            truncated: seq.truncated,
            draft_count: seq.spec.drafted,
            draft_accepted_count: seq.spec.accepted,
            stop_string: seq.text.stopped_by().map(str::to_string),
        }));
        self.slots[index].last_used = Some(std::time::SystemTime::now());
        self.send_all(seq.events, events);
    }

    /// Sends events in order, parking the rest when the channel is full.
    fn send_all(&mut self, tx: Sender<Event>, mut events: VecDeque<Event>) {
        while let Some(ev) = events.pop_front() {
            match tx.try_send(ev) {
                Ok(()) => {}
                Err(TrySendError::Full(ev)) => {
                    events.push_front(ev);
                    self.draining.push((tx, events));
                    return;
                }
                Err(TrySendError::Closed(_)) => return,
            }
        }
    }

    fn flush_draining(&mut self) {
        for (tx, events) in std::mem::take(&mut self.draining) {
            self.send_all(tx, events);
        }
    }

    /// A decode failed: every sequence in the batch gets the error and its slot is cleared.
    fn fail_batch(&mut self, message: &str) {
        let in_batch: Vec<i32> = self.batch.iter().map(|t| t.seq).collect();
        for slot in &mut self.slots {
            if !in_batch.contains(&slot.id) {
                continue;
            }
            if let Some(seq) = slot.seq.take() {
                let err = EngineError::new(EngineErrorKind::Internal, message);
                let _ = seq.events.try_send(Event::Error(err));
            }
            self.backend.kv_truncate(slot.id, 0);
            slot.cached.clear();
        }
    }

    fn fail_everything(&mut self) {
        let err = EngineError::new(EngineErrorKind::ShuttingDown, "the server is shutting down");
        while let Ok(m) = self.inbox.rx.try_recv() {
            self.handle(m);
        }
        if let Some(job) = self.embedding.take() {
            let _ = job.request.reply.send(Err(err.clone()));
        }
        for r in self.embeds.drain(..) {
            let _ = r.reply.send(Err(err.clone()));
        }
        for r in std::mem::take(&mut self.waiting) {
            self.left_queue();
            let _ = r.events.try_send(Event::Error(err.clone()));
        }
        while let Ok(r) = self.inbox.embed_rx.try_recv() {
            let _ = r.reply.send(Err(err.clone()));
        }
        for slot in &mut self.slots {
            if let Some(seq) = slot.seq.take() {
                let _ = seq.events.try_send(Event::Error(err.clone()));
            }
        }
        self.publish_slots();
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

/// The 400 for an input that does not fit and may not be truncated.
fn too_long(e: kv::TooLong) -> EngineError {
    EngineError::new(EngineErrorKind::ContextLength, e.to_string())
}

fn pos_of(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests;
