//! The cache tiers below a slot's cells: a sequence that gives way is stored in host memory
//! (`kv/prompt_cache.rs`) and restored for a prompt that starts like it; a sliding-window slot
//! cut back is rewound to a window checkpoint (`kv/checkpoints.rs`).

use super::{Phase, Scheduler};
use crate::backend::Backend;
use crate::kv;
use crate::protocol::{LoraScales, Token};

impl<B: Backend> Scheduler<B> {
    /// Whether slot `index` was shifted (`kv_shift`) since the last decode: llama.cpp applies
    /// a shift's key rotation at the next decode, so its cells must not be copied out before.
    pub(super) fn shift_pending(&self, index: usize) -> bool {
        self.slots[index].shifted_at == Some(self.decodes)
    }

    /// Positions between a prompt's window checkpoints: the window (what a rewind to the
    /// checkpoint before a cut decodes again is at most that); 0 when none are taken.
    pub(super) fn checkpoint_spacing(&self) -> usize {
        if self.checkpoints.enabled() {
            self.backend.sliding_window().unwrap_or(0).max(1)
        } else {
            0
        }
    }

    /// Slot `index`'s cache, which holds `prompt`'s first `at_most` tokens but not the window
    /// before them, goes back to the longest window checkpoint of `prompt` within them; it is
    /// cleared when there is none or the rewind fails. Returns the prompt tokens it holds.
    pub(super) fn rewind(
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
    pub(super) fn checkpoint(&mut self, index: usize) {
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
    pub(super) fn offload(&mut self, index: usize, keep: usize) {
        if !self.prompt_cache.enabled() {
            return;
        }
        let slot = &self.slots[index];
        if slot.cached.len() < keep + crate::kv::prompt_cache::MIN_STORE
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
    pub(super) fn report_prompt_cache(&self, restored: usize) {
        self.observer
            .prompt_cache(self.prompt_cache.used(), self.prompt_cache.len(), restored);
    }

    /// Restores into slot `index` the prompt cache's entry that shares the longest prefix with
    /// `tokens` under `lora`, if it shares more than the `common` tokens the slot holds (by
    /// `MIN_RESTORE_GAIN`); the slot's own sequence is stored first. Returns the prompt
    /// tokens the slot now holds.
    pub(super) fn restore_cached(
        &mut self,
        index: usize,
        tokens: &[Token],
        lora: &LoraScales,
        common: usize,
    ) -> usize {
        if !self.prompt_cache.enabled() {
            return common;
        }
        let Some((mut entry, mut shared)) = self.prompt_cache.best(tokens, lora, common) else {
            return common;
        };
        // Room for it in a cache the slots share (a full one refuses the state); the entry
        // stays cached when there is none. Freeing idle slots may store their sequences in
        // this cache: the best entry is looked up again.
        if self.free_cells().is_some() {
            if !self.free_idle(self.prompt_cache.entry_len(entry), &[index]) {
                return common;
            }
            match self.prompt_cache.best(tokens, lora, common) {
                Some(again) => (entry, shared) = again,
                None => return common,
            }
        }
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
}
