//! Admission: requests leave the queue for a free slot (the one whose cache holds the
//! longest prefix of the prompt, a shared prefix forked into it in multi-user mode), and
//! requests whose client left or whose time ran out leave the queue or their slot.

use std::time::Instant;

use super::speculative::SpecState;
use super::text::TextStream;
use super::{
    input_tokens, lora, prompt_images, too_long, Phase, Scheduler, Sequence, MIN_SHARE_GAIN,
};
use crate::backend::{Backend, Fork};
use crate::kv;
use crate::protocol::{
    DoneReason, Ending, EngineError, EngineErrorKind, Event, LoraScales, Offer, Request, Token,
};

impl<B: Backend> Scheduler<B> {
    /// Frees the slots and queue places of clients that went away, refuses queued requests
    /// whose time ran out and ends running ones ("timeout").
    pub fn drop_cancelled(&mut self) {
        let now = Instant::now();
        let before = self.waiting.len();
        let mut expired = Vec::new();
        self.waiting.retain(|r| {
            if r.events.is_gone() {
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
            self.endings.push(Ending::error(events, err));
        }
        let mut timed_out = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(seq) = slot.seq.as_ref() else {
                continue;
            };
            let stuck = seq
                .paused_since
                .is_some_and(|t| now.duration_since(t) >= self.pause_limit);
            if seq.events.is_gone() {
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

    /// A request left the waiting queue: its place is free for the next one.
    pub(super) fn left_queue(&self) {
        self.queue.release();
    }

    pub(super) fn free_slots(&self) -> usize {
        self.slots.iter().filter(|s| s.seq.is_none()).count()
    }

    pub(super) fn admit(&mut self) {
        // A sequence swapped out of a shared cache comes back before anyone new comes in.
        if self.any_swapped() {
            return;
        }
        while self.free_slots() > 0 {
            let Some(request) = self.waiting.pop_front() else {
                return;
            };
            self.left_queue();
            if let Err(e) = self.admit_one(&request) {
                self.endings.push(Ending::error(request.events, e));
            }
        }
    }

    pub(super) fn admit_one(&mut self, request: &Request) -> Result<(), EngineError> {
        let mut tokens = input_tokens(&self.backend, &request.prompt, "prompt")?;
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
        let mut reusable = common.min(tokens.len() - 1);
        let last_chunk = kv::chunk_start(tokens.len() - 1, self.backend.batch_capacity());
        if common >= tokens.len() - 1
            && reproducible(params)
            && images.is_empty()
            && !self.backend.batch_invariant()
            && self.backend.kv_can_cut(self.slots[index].id, last_chunk)
        {
            // The whole prompt is cached and the request is seeded (the same text each time):
            // the prompt's last chunk is decoded again as a fresh decode chunks it, so that
            // its last row (the first sampled distribution) comes from a batch of the same
            // shape (llama.cpp's kernels sum a row differently by its batch's row count). Not
            // where the cut would cost more than that chunk: a sliding window that would lose
            // cells (a rewind), a recurrent state (a full decode), an image (encoded again).
            reusable = reusable.min(last_chunk);
        }
        let mut reuse = kv::image_boundary_before(&tokens, reusable);
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
        if !matches!(
            request.events.offer(Event::Started { cached: reuse }),
            Offer::Taken
        ) {
            return Ok(()); // the client is gone; the slot stays free
        }
        let admitted = Instant::now();
        let queued = admitted.saturating_duration_since(request.received);
        self.observer
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
            presampled: std::collections::VecDeque::new(),
            prepushed: None,
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
            swapped: None,
        });
        self.turn_log.admitted.push(self.slots[index].id);
        self.offer_progress(index);
        Ok(())
    }

    /// Chooses the slot for a prompt; returns it with the number of prompt tokens its cache
    /// holds (after forking a shared prefix into it, in multi-user mode).
    /// Only a cache computed under the prompt's LoRA scale set counts (`lora.rs`).
    pub(super) fn pick_slot(
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
        // The fork overwrites the slot: its sequence goes to RAM first. A cache the slots
        // share needs room for the source's whole state (it is cut after the copy).
        self.offload(choice.slot, 0);
        self.free_idle(src_len, &[choice.slot, from]);
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
}

/// Whether a request samples with a seed of its own (or the server's `--seed`): it asks for
/// the same text each time it is sent. Greedy requests are not counted: their answers change
/// only where two tokens' logits nearly tie (`--deterministic` covers them too).
fn reproducible(params: &crate::protocol::params::SamplingParams) -> bool {
    params.temperature > 0.0 && params.seed >= 0
}
