//! One step: the batch is built (generating sequences' next tokens first, then prompt chunks
//! round robin within the remaining budget, one LoRA scale set per batch), images decoded,
//! the batch decoded, and every sequence whose logits came out sampled.

use std::time::Instant;

use super::{leading_image, pos_of, Phase, Scheduler, StepOutcome};
use crate::backend::{Backend, BatchToken};
use crate::protocol::vision::is_image_token;
use crate::protocol::{BackendError, Ending, EngineError, EngineErrorKind, LoraScales};

impl<B: Backend> Scheduler<B> {
    /// The LoRA scale set whose sequences decode this step (`lora.rs`: the sets take turns,
    /// each as long as changing set is worth).
    pub(super) fn lora_turn(&mut self) -> LoraScales {
        let ready = self.slots.iter().filter_map(|s| {
            s.seq
                .as_ref()
                .filter(|q| {
                    if q.swapped_out() {
                        false
                    } else if q.phase == Phase::Decode {
                        !q.paused()
                    } else {
                        !q.pending.is_empty()
                    }
                })
                .map(|q| &q.lora)
        });
        self.lora_turns
            .turn(ready, Instant::now())
            .unwrap_or_default()
    }

    /// Builds the batch: generating sequences' next tokens first, then prompt chunks round
    /// robin within the remaining budget. Who gets a place rotates (fairness when places are
    /// scarce); the tokens are then laid out in ascending slot order, because with one KV
    /// stream per sequence llama.cpp puts into one micro-batch only sequences whose ids follow
    /// each other in batch order: a rotated order ([2, 3, 0, 1]) would cost two passes over the
    /// weights instead of one.
    pub(super) fn build_batch(&mut self) {
        self.batch.clear();
        let capacity = self.backend.batch_capacity().max(1);
        let n = self.slots.len();
        let turn = self.lora_turn();
        // When generating sequences outnumber the batch places, one place stays for prompt
        // chunks, so that a waiting prompt is never starved by decode tokens.
        let prompt_waiting = self.slots.iter().any(|s| {
            s.seq.as_ref().is_some_and(|q| {
                q.phase != Phase::Decode
                    && !q.pending.is_empty()
                    && q.lora == turn
                    && !q.swapped_out()
            })
        });
        // Free cells of a cache the slots share (`shared_cache.rs` made room for the decode
        // tokens); unbounded when each slot has its own.
        let mut room = self.free_cells().unwrap_or(usize::MAX);
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
                && !seq.swapped_out()
                && placed < decode_places
                && seq.lora == turn
                && room > 0
            {
                // Next step starts after the last sequence that got a place.
                self.next_decode = (i + 1) % n;
                seq.queued = 1;
                placed += 1;
                room -= 1;
            }
        }
        // Drafts of the sequences placed, within the places kept for decode tokens, unless
        // drafts have not paid lately at this many sequences (`payoff`).
        self.step_placed = placed;
        let budget = if self.drafts_pay(placed) {
            decode_places.saturating_sub(placed).min(room)
        } else {
            0
        };
        let drafted = self.place_drafts(budget, placed);
        placed += drafted;
        room = room.saturating_sub(drafted);
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
            if seq.phase == Phase::Decode
                || seq.pending.is_empty()
                || seq.lora != turn
                || seq.swapped_out()
                || room == 0
            {
                continue;
            }
            let image = leading_image(&seq.pending);
            if image > 0 {
                // An image is decoded whole, in a call of its own before the batch
                // (`decode_images`), and counts against the budget as a prompt chunk of its
                // size would. It waits for a step with room for it unless it is the step's
                // first prompt chunk, so it is never starved.
                if placed + image > capacity && prompt_placed > 0 || image > room {
                    continue;
                }
                seq.image_queued = image;
                placed += image;
                room -= image;
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
            seq.queued = (capacity - placed).min(text).min(room);
            placed += seq.queued;
            room -= seq.queued;
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

    pub(super) fn step(&mut self) -> StepOutcome {
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
        self.share_cells();
        self.build_batch();
        let plan = self.step_plan();
        // Only the ends of this step tell how its sequences ended (a slot whose request ended
        // before the step may hold a new one).
        let ends_before = self.turn_log.finished.len();
        let mut outcome = self.decode_step(step_started);
        outcome.sequences = self.step_results(plan, ends_before);
        outcome
    }

    /// Decodes the batch built (images first) and samples every sequence whose logits came
    /// out.
    fn decode_step(&mut self, step_started: Instant) -> StepOutcome {
        self.bind_samplers();
        let images = self.decode_images();
        let mut outcome = StepOutcome {
            images,
            stalled: self.batch.is_empty() && !images && self.slots.iter().any(|s| s.seq.is_some()),
            ..StepOutcome::default()
        };
        if self.batch.is_empty() {
            if !images {
                // Nothing of the set whose turn it is could be placed: another set's turn.
                self.lora_turns.end_turn();
            }
            return outcome;
        }
        let started = Instant::now();
        let lora = self.batch_lora.take().unwrap_or_default();
        let lora_changed = self.lora_turns.changes(&lora);
        let applied = self.backend.set_lora(&lora);
        self.lora_turns.applied(applied.is_ok().then_some(&lora));
        if let Err(e) = applied.and_then(|()| self.backend.decode(&self.batch)) {
            tracing::error!(error = %e, tokens = self.batch.len(), "decode failed");
            self.fail_batch(&e.to_string());
            outcome.failed = true;
            return outcome;
        }
        self.decodes += 1;
        let sequences = self
            .batch
            .iter()
            .map(|t| t.seq)
            .collect::<std::collections::BTreeSet<i32>>()
            .len();
        self.observer.decoded(sequences);
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
        // A decode that changed the LoRA set also reserved llama.cpp's graph again: what that
        // costs decides how long the sets' turns last. It still counts for drafting: where
        // the sets alternate, every step pays it.
        self.lora_turns.decoded(
            lora_changed,
            self.batch.len(),
            all_logits,
            decoded.as_secs_f64() * 1e6,
        );
        if self.speculation.measure && all_logits {
            let us = u64::try_from(decoded.as_micros()).unwrap_or(u64::MAX);
            self.step_cost.observe(self.batch.len(), us);
        }
        self.presample();
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
                self.offer_progress(index);
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
                if let Some(seq) = self.slots[index].seq.as_mut() {
                    // Picks past the first rejected draft or the end (none, by construction).
                    seq.presampled.clear();
                    debug_assert!(seq.prepushed.is_none(), "a pushed token's text not taken");
                }
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
            lora_changed = lora_changed.unwrap_or(false),
            lora_change_us = self.lora_turns.switch_us().map(|us| us.round() as i64),
            "step"
        );
        outcome.batch_tokens = self.batch.len();
        outcome.outputs = self.batch.iter().filter(|t| t.logits).count();
        outcome.drafted = drafted;
        outcome
    }

    /// Tells the backend, for every slot, what its next decode needs of its positions'
    /// logits: a sampler that needs only a position's best few may have them cut on the device
    /// (`--backend-sampling`), except while its sequence drafts (llama.cpp cuts one position
    /// per sequence and decode, where a draft's verification reads several).
    fn bind_samplers(&mut self) {
        use crate::backend::SlotSampling;
        for slot in &self.slots {
            let need = match slot.seq.as_ref() {
                None => SlotSampling::Idle,
                Some(q) if q.spec.enabled => SlotSampling::Whole,
                Some(q) => SlotSampling::Sampler(&q.sampler),
            };
            self.backend.bind_sampler(slot.id, need);
        }
    }

    /// Decodes the images `build_batch` queued, each in a decode of its own, before the batch
    /// (whose logits are the ones sampled after it). A prompt that ends with an image samples
    /// its first token from the image's last position at once, before the next decode. A
    /// failure ends that sequence only. Returns whether any image was decoded.
    pub(super) fn decode_images(&mut self) -> bool {
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
                    let turns = &mut self.lora_turns;
                    seq.span.in_scope(|| {
                        let applied = backend.set_lora(&lora);
                        // The graph a change reserves again is reserved in the image's decode.
                        turns.applied(applied.is_ok().then_some(&lora));
                        applied.and_then(|()| backend.decode_image(id, pos, &image, logits))
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
                    if let Some(seq) = slot.seq.take() {
                        self.endings.push(Ending::error(seq.events, err));
                    }
                    self.backend.kv_truncate(id, 0);
                    slot.cached.clear();
                }
            }
        }
        any
    }

    /// A decode failed: every sequence in the batch gets the error and its slot is cleared.
    pub(super) fn fail_batch(&mut self, message: &str) {
        let in_batch: Vec<i32> = self.batch.iter().map(|t| t.seq).collect();
        for slot in &mut self.slots {
            if !in_batch.contains(&slot.id) {
                continue;
            }
            if let Some(seq) = slot.seq.take() {
                let err = EngineError::new(EngineErrorKind::Internal, message);
                self.endings.push(Ending::error(seq.events, err));
            }
            self.backend.kv_truncate(slot.id, 0);
            slot.cached.clear();
        }
    }
}
