//! Sampling a sequence's next token, and what it decides: stop (end of generation, a stop
//! string, the grammar's end), length, or a context shift when the slot is full. Every
//! sequence of a step is sampled at once first (`presample`, parallel in the backend), and the
//! text of each one's next token assembled there too; what the tokens decide is then worked
//! out sequence by sequence, in slot order.

use std::time::Instant;

use super::{Phase, Scheduler};
use crate::backend::{Backend, Pick, PickedText};
use crate::kv;
use crate::protocol::params::SamplingParams;
use crate::protocol::{DoneReason, Token};

impl<B: Backend> Scheduler<B> {
    /// Samples, in one call to the backend (in parallel where it has a sampling pool), every
    /// sequence whose logits the step's batch decoded: its next token, then each drafted
    /// position while the sampler agrees with the draft, exactly as `sample_drafted` would one
    /// sequence after the other. Only positions that `sample_drafted` would certainly reach
    /// are sampled ahead: a draft is checked no further than the slot's last cell, past which
    /// a context shift could end the check (positions left are sampled there, in turn). A
    /// sequence that ends within its picks drops the rest with its sampler. Called once the
    /// batch is decoded, before its sequences are handled (`step`).
    pub(super) fn presample(&mut self) {
        let ctx = self.backend.slot_ctx();
        let mut owners = Vec::new();
        let mut picks = Vec::new();
        for (index, slot) in self.slots.iter_mut().enumerate() {
            let Some(seq) = slot.seq.as_mut() else {
                continue;
            };
            let Some(at) = seq.logits_at else {
                continue;
            };
            if seq.params.num_predict == 0 {
                continue;
            }
            // The slot's length once this step's tokens are in: the check of draft position
            // `j + 1` is certain only while `j` sampled tokens leave the slot short of full
            // (drafts are placed within the slot, `adaptive.rs`, so that holds for the whole
            // draft; the bound keeps it so should placement change).
            let base = slot.cached.len() + seq.queued;
            let checked = seq.spec.draft.len().min(ctx.saturating_sub(base));
            // The first token's text is assembled where it was sampled, as `sample_one` would
            // (a token that ends the sequence before its text is pushed is not).
            let ends_on_eog = eog_ends(&seq.params);
            let (text, prepushed) = (&mut seq.text, &mut seq.prepushed);
            *prepushed = None;
            let text: PickedText<'_> = Box::new(move |token, bytes: &[u8], eog: bool| {
                if !(eog && ends_on_eog) {
                    *prepushed = Some((token, text.push(bytes)));
                }
            });
            owners.push(index);
            picks.push(Pick {
                sampler: &mut seq.sampler,
                at,
                draft: &seq.spec.draft[..checked],
                span: &seq.span,
                tokens: Vec::new(),
                text: Some(text),
            });
        }
        if picks.is_empty() {
            return;
        }
        self.backend.sample_many(&mut picks);
        let tokens: Vec<Vec<Option<Token>>> = picks.into_iter().map(|pick| pick.tokens).collect();
        for (index, tokens) in owners.into_iter().zip(tokens) {
            if let Some(seq) = self.slots[index].seq.as_mut() {
                seq.presampled = tokens.into();
            }
        }
    }

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
        // Sampled with the step's other sequences (`presample`), else here, in the request's
        // span: the backend may log about it (a grammar that ends it).
        let backend = &mut self.backend;
        let picked = match seq.presampled.pop_front() {
            Some(picked) => picked,
            None => seq.span.in_scope(|| backend.sample(&mut seq.sampler, at)),
        };
        let Some(token) = picked else {
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
        if self.backend.is_eog(token) && eog_ends(&seq.params) {
            return Some(DoneReason::Stop);
        }
        if let Some(top) = seq.params.logprobs {
            let after_chain = if seq.params.post_sampling_probs {
                self.backend
                    .post_sampling_logprobs(&mut seq.sampler, token, top)
            } else {
                None
            };
            let logprob = after_chain.unwrap_or_else(|| {
                self.backend
                    .logprobs(at, token, top, &seq.params.logprobs_of)
            });
            seq.outbox_logprobs.push(logprob);
        }
        // Pushed on the sampling thread (`presample`) for a step's first token, else here.
        let pushed = match seq.prepushed.take() {
            Some((pushed_token, pushed)) => {
                debug_assert_eq!(
                    pushed_token, token,
                    "a pushed token's text taken for another"
                );
                pushed
            }
            None => seq.text.push(&self.backend.token_bytes(token)),
        };
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

/// Whether an end-of-generation token ends a request with `params`: unless it ignores EOS,
/// and always with a grammar (the backend's signal that the grammar allows nothing more).
fn eog_ends(params: &SamplingParams) -> bool {
    !params.ignore_eos || params.grammar.is_some()
}
