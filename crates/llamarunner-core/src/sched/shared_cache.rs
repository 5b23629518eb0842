//! One KV cache the slots share (`--kv-unified`, llama-server's flag): a slot owns no share
//! of the cells, so one sequence may grow to the whole cache while the others are short. The
//! cells the slots hold together must then stay within the cache (llama.cpp refuses a decode
//! that finds no free cell), which is kept here, before each batch is built:
//!
//! - cells of idle slots (a finished conversation kept for its prefix) go first, the least
//!   recently used first, to the host-memory prompt cache when it is on (`cache_tiers.rs`);
//! - where the generating sequences' next cells still do not fit (or prompts wait for room
//!   with nothing generating), the sequence admitted last is swapped out: its state goes to
//!   RAM, its cells are freed, and it waits without losing anything (sampler, text, client)
//!   until the others leave room for it and a step's growth, then comes back first, before
//!   any new request is admitted (vLLM's preemption, by swapping rather than recomputing);
//! - the states swapped out hold at most as many cells as the cache itself, so the RAM they
//!   take is bounded by the KV cache's size: past that, or when its state cannot be read, the
//!   sequence ends with 503 `CacheFull` instead (llama-server ends every running request when
//!   its unified cache is full).
//!
//! The batch then places prompt tokens, drafts and images only within the free cells
//! (`batch.rs`). With a cache per slot (the default) nothing here runs.

use super::{leading_image, Scheduler, Sequence};
use crate::backend::Backend;
use crate::protocol::{Ending, EngineError, EngineErrorKind, Token};

/// Steps of growth for every sequence in the cache that must fit, besides a sequence's own
/// cells, before it is swapped back in: with less, the newest sequence (the one coming back)
/// would be swapped out again a step later.
const SWAP_IN_STEPS: usize = 16;

/// A sequence swapped out of the shared cache, waiting for room.
pub(super) struct Swapped {
    /// Its cells as llama.cpp's sequence state.
    state: Vec<u8>,
    /// The tokens those cells hold (the slot's `cached` when it left).
    tokens: Vec<Token>,
    /// When it left (the scheduler's clock): the first out comes back first.
    order: u64,
}

impl<S> Sequence<S> {
    /// It is swapped out of the shared cache (`shared_cache.rs`): it takes no part in steps.
    pub(super) fn swapped_out(&self) -> bool {
        self.swapped.is_some()
    }
}

impl<B: Backend> Scheduler<B> {
    /// Free cells of the shared cache; None when each slot has cells of its own.
    pub(super) fn free_cells(&self) -> Option<usize> {
        let all = self.backend.shared_cells()?;
        let held: usize = self.slots.iter().map(|s| s.cached.len()).sum();
        Some(all.saturating_sub(held))
    }

    /// Whether a sequence waits swapped out (new requests wait behind it).
    pub(super) fn any_swapped(&self) -> bool {
        self.slots
            .iter()
            .any(|s| s.seq.as_ref().is_some_and(Sequence::swapped_out))
    }

    /// Before the batch is built: sequences swapped out come back where there is room, then
    /// sequences are swapped out until the step's next cells fit (see the module's text).
    pub(super) fn share_cells(&mut self) {
        if self.backend.shared_cells().is_none() {
            return;
        }
        self.swap_in();
        loop {
            let resident: Vec<usize> = (0..self.slots.len())
                .filter(|&i| self.slots[i].seq.as_ref().is_some_and(|q| !q.swapped_out()))
                .collect();
            if self.free_idle(self.step_need(), &[]) || resident.len() < 2 {
                // One sequence alone always fits: its slot is the whole cache.
                return;
            }
            // The newest that holds cells (one that holds none frees nothing).
            let victim = resident
                .iter()
                .copied()
                .filter(|&i| !self.slots[i].cached.is_empty() && !self.shift_pending(i))
                .max_by_key(|&i| self.slots[i].seq.as_ref().map(|q| q.admitted));
            let Some(victim) = victim else {
                return;
            };
            self.swap_out(victim);
        }
    }

    /// The cells this step needs at least: one per generating sequence that is not waiting
    /// for its client; when nothing generates, what the prompt that needs least needs to go
    /// on (one token, or its next image whole), so that prompts that filled the cache between
    /// them do not wait for each other for ever.
    fn step_need(&self) -> usize {
        let mut generating = 0;
        let mut prompt: Option<usize> = None;
        for seq in self.slots.iter().filter_map(|s| s.seq.as_ref()) {
            if seq.swapped_out() {
                continue;
            }
            if seq.phase == super::Phase::Decode {
                generating += usize::from(!seq.paused());
            } else if !seq.pending.is_empty() {
                let need = leading_image(&seq.pending).max(1);
                prompt = Some(prompt.map_or(need, |p| p.min(need)));
            }
        }
        if generating > 0 {
            generating
        } else {
            prompt.unwrap_or(0)
        }
    }

    /// Frees idle slots' cells but those of `keep`, the least recently used first (to RAM
    /// first when the prompt cache is on), until `need` cells are free; whether they are.
    /// Always true without a shared cache. Called before a step, and before a state is written
    /// into a slot (a prompt-cache restore, a fork, a slot file: llama.cpp refuses one that
    /// finds no room).
    pub(super) fn free_idle(&mut self, need: usize, keep: &[usize]) -> bool {
        loop {
            if self.free_cells().is_none_or(|free| free >= need) {
                return true;
            }
            let idle = (0..self.slots.len())
                .filter(|&i| {
                    self.slots[i].seq.is_none()
                        && !self.slots[i].cached.is_empty()
                        && !keep.contains(&i)
                })
                .min_by_key(|&i| self.slots[i].last_tick);
            let Some(i) = idle else {
                return false;
            };
            self.offload(i, 0);
            self.clear_cells(i);
            tracing::debug!(
                slot = self.slots[i].id,
                "idle slot's cells freed for others"
            );
        }
    }

    /// Removes slot `index`'s cells from both caches (the model's and the draft model's).
    fn clear_cells(&mut self, index: usize) {
        let id = self.slots[index].id;
        self.backend.kv_truncate(id, 0);
        self.backend.draft_truncate(id, 0);
        self.slots[index].cached.clear();
        self.slots[index].draft_cached.clear();
    }

    /// Swaps the sequence in slot `index` out to RAM, or ends it with `CacheFull` where its
    /// state cannot be kept.
    fn swap_out(&mut self, index: usize) {
        let all = self.backend.shared_cells().unwrap_or(0);
        let waiting: usize = self
            .slots
            .iter()
            .filter_map(|s| s.seq.as_ref()?.swapped.as_ref())
            .map(|w| w.tokens.len())
            .sum();
        let cells = self.slots[index].cached.len();
        let state = if waiting + cells <= all {
            self.backend.seq_state(self.slots[index].id).ok()
        } else {
            None
        };
        let tokens = std::mem::take(&mut self.slots[index].cached);
        self.clear_cells(index);
        self.clock += 1;
        let order = self.clock;
        let slot = &mut self.slots[index];
        let Some(seq) = slot.seq.as_mut() else {
            return;
        };
        match state {
            Some(state) => {
                seq.span.in_scope(|| {
                    tracing::info!(
                        slot = slot.id,
                        cells,
                        bytes = state.len(),
                        "the shared KV cache is full: sequence swapped out to RAM until there is room"
                    );
                });
                seq.swapped = Some(Swapped {
                    state,
                    tokens,
                    order,
                });
                self.turn_log.swapped_out.push(slot.id);
                self.observer.swapped_out();
            }
            None => {
                let seq = slot.seq.take();
                if let Some(seq) = seq {
                    seq.span.in_scope(|| {
                        tracing::warn!(
                            slot = slot.id,
                            cells,
                            "the shared KV cache is full and the sequence cannot wait in RAM: ended"
                        );
                    });
                    let err = EngineError::new(
                        EngineErrorKind::CacheFull,
                        "the KV cache the slots share (--kv-unified) is full: the request was ended to make room for the others; send it again",
                    );
                    self.endings.push(Ending::error(seq.events, err));
                }
            }
        }
    }

    /// Brings sequences swapped out back, the first out first, while there is room for each
    /// and for `SWAP_IN_STEPS` steps of every sequence in the cache (at least one, at most
    /// what the cache holds).
    fn swap_in(&mut self) {
        loop {
            let next = (0..self.slots.len())
                .filter_map(|i| {
                    let swapped = self.slots[i].seq.as_ref()?.swapped.as_ref()?;
                    Some((swapped.order, i, swapped.tokens.len()))
                })
                .min();
            let Some((_, index, cells)) = next else {
                return;
            };
            let resident = self
                .slots
                .iter()
                .filter(|s| s.seq.as_ref().is_some_and(|q| !q.swapped_out()))
                .count();
            // Room for it and a step of everyone at least, and for some steps where the cache
            // has them.
            let all = self.backend.shared_cells().unwrap_or(0);
            let least = cells + resident + 1;
            let need = (cells + (resident + 1) * SWAP_IN_STEPS).min(all).max(least);
            if !self.free_idle(need, &[]) {
                return;
            }
            let Some(swapped) = self.slots[index]
                .seq
                .as_mut()
                .and_then(|q| q.swapped.take())
            else {
                return;
            };
            let id = self.slots[index].id;
            // The slot holds nothing (its cells went when it left, and only its sequence uses it).
            match self.backend.set_seq_state(id, &swapped.state) {
                Ok(n) if n == swapped.tokens.len() => {
                    self.slots[index].cached = swapped.tokens;
                    if let Some(seq) = self.slots[index].seq.as_ref() {
                        seq.span.in_scope(|| {
                            tracing::debug!(slot = id, cells = n, "sequence swapped back in");
                        });
                    }
                }
                result => {
                    self.clear_cells(index);
                    if let Some(seq) = self.slots[index].seq.take() {
                        let why = match result {
                            Ok(n) => format!("{n} cells of {}", swapped.tokens.len()),
                            Err(e) => e.to_string(),
                        };
                        seq.span.in_scope(|| {
                            tracing::error!(slot = id, error = %why, "a swapped-out sequence could not come back");
                        });
                        let err = EngineError::new(
                            EngineErrorKind::Internal,
                            format!("the sequence could not be restored to the KV cache: {why}"),
                        );
                        self.endings.push(Ending::error(seq.events, err));
                    }
                }
            }
        }
    }
}
