//! Sampling a sequence's next token, and what it decides: stop (end of generation, a stop
//! string, the grammar's end), length, or a context shift when the slot is full.

use std::time::Instant;

use super::{Phase, Scheduler};
use crate::backend::Backend;
use crate::kv;
use crate::protocol::DoneReason;

impl<B: Backend> Scheduler<B> {
    /// Samples the next token of the sequence in slot `index` (its logits were decoded at
    /// `now`); returns why it ends, if it does.
    pub(super) fn sample_one(
        &mut self,
        index: usize,
        at: usize,
        now: Instant,
    ) -> Option<DoneReason> {
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
                .observer
                .first_token(now.saturating_duration_since(seq.received)),
            Some(last) => self
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
            self.observer.context_shift();
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
}
