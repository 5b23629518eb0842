//! The KV cache's sequences: cuts, shifts, forks, sliding-window checkpoints and whole
//! states (slot files, the host-memory prompt cache).

use llama_cpp_2::context::session::LlamaStateSeqFlags;

use crate::backend::{Fork, KvOps};
use crate::protocol::BackendError;

use super::state_read::StatePart;
use super::LlamaEngine;

impl KvOps for LlamaEngine<'_> {
    fn kv_truncate(&mut self, seq: i32, from: usize) -> bool {
        let Ok(from) = u32::try_from(from) else {
            return false;
        };
        self.ctx.kv_cache_seq_rm(seq, Some(from), None).is_ok()
            && self.window_intact(seq, from as usize)
    }

    fn kv_clear(&mut self, seq: i32) -> bool {
        // An empty sequence has neither a first nor a last position (-1 for both).
        self.ctx.kv_cache_seq_rm(seq, None, None).is_ok()
            && self.ctx.kv_cache_seq_pos_max(seq) == -1
            && self.ctx.kv_cache_seq_pos_min(seq) == -1
    }

    fn kv_clear_all(&mut self) {
        self.ctx.clear_kv_cache();
    }

    fn kv_can_cut(&self, seq: i32, from: usize) -> bool {
        !self.model.is_recurrent() && !self.model.is_hybrid() && self.window_intact(seq, from)
    }

    fn kv_shift(&mut self, seq: i32, keep: usize, discard: usize) -> bool {
        if !self.can_shift {
            return false;
        }
        let (Ok(keep), Ok(end), Ok(delta)) = (
            u32::try_from(keep),
            u32::try_from(keep + discard),
            i32::try_from(discard),
        ) else {
            return false;
        };
        self.ctx.kv_cache_seq_rm(seq, Some(keep), Some(end)).is_ok()
            && self
                .ctx
                .kv_cache_seq_add(seq, Some(end), None, -delta)
                .is_ok()
    }

    fn kv_fork(&mut self, src: i32, dst: i32, len: usize) -> Fork {
        let Ok(cut) = u32::try_from(len) else {
            return Fork::Failed;
        };
        // The copy goes through the sequence's state, not `seq_cp`. With one KV stream per
        // sequence (kv_unified off), llama.cpp's `seq_cp` copies only whole sequences between
        // streams (a partial range aborts the process), and it only queues the copy of the
        // whole stream buffer for the next decode: whatever is written into the destination
        // before that decode (a prompt-cache restore, a window checkpoint) would be overwritten
        // by the source's cells. A state read and write is done when it returns.
        let copied = match self.state_with(src, StatePart::Whole) {
            Ok(state) => {
                // SAFETY: the state was just written by this context for one of its sequences,
                // so its layers, types and cell counts are this cache's; llama.cpp's reader
                // checks every read against the buffer's length.
                let set = unsafe {
                    self.ctx
                        .state_seq_set_data_ext(&state, dst, LlamaStateSeqFlags::empty())
                };
                set && self.ctx.kv_cache_seq_rm(dst, Some(cut), None).is_ok()
            }
            Err(e) => {
                tracing::debug!(src, dst, error = %e, "the sequence to fork could not be read");
                false
            }
        };
        if !copied {
            // Nothing half-copied stays behind: the slot starts empty.
            let _ = self.ctx.kv_cache_seq_rm(dst, None, None);
            return Fork::Failed;
        }
        // A state holds only the window cells of its source's last positions: a copy cut back
        // before them stays for a checkpoint to mend (the caller clears it otherwise).
        if self.window_intact(dst, len) {
            Fork::Copied
        } else {
            Fork::WindowLost
        }
    }

    fn sliding_window(&self) -> Option<usize> {
        self.swa_window.filter(|_| self.window_checkpoints.get())
    }

    fn window_checkpoint(&self, seq: i32) -> Result<Vec<u8>, BackendError> {
        if self.sliding_window().is_none() {
            return Err(BackendError::State(
                "the cache has no sliding window that checkpoints can rewind".into(),
            ));
        }
        if self.window_state_apart.get() {
            return self.state_with(seq, StatePart::Window);
        }
        let partial = self
            .ctx
            .state_seq_get_size_ext(seq, LlamaStateSeqFlags::PARTIAL_ONLY);
        let whole = self
            .ctx
            .state_seq_get_size_ext(seq, LlamaStateSeqFlags::empty());
        // Both sizes teach the state reads' guesses (`state_read.rs`).
        let cells = self.seq_cells(seq);
        if partial > 0 && whole > 0 {
            self.state_reads.learn(StatePart::Window, cells, partial);
            self.state_reads.learn(StatePart::Whole, cells, whole);
        }
        if partial >= whole {
            // No separate window cache: llama.cpp keeps every cell of this model.
            self.window_checkpoints.set(false);
            tracing::info!(
                "llama.cpp keeps every cell of this model's window layers: no window checkpoints"
            );
            return Err(BackendError::State(
                "the cache keeps every cell: nothing to checkpoint".into(),
            ));
        }
        // A property of the context (whether llama.cpp keeps the window's cells in a cache of
        // their own), not of the sequence: known once.
        self.window_state_apart.set(true);
        self.state_with(seq, StatePart::Window)
    }

    fn rewind_to_checkpoint(&mut self, seq: i32, len: usize, state: &[u8]) -> bool {
        let Ok(from) = u32::try_from(len) else {
            return false;
        };
        if self.sliding_window().is_none()
            || self.ctx.kv_cache_seq_rm(seq, Some(from), None).is_err()
        {
            return false;
        }
        // SAFETY: `state` is one `window_checkpoint` wrote in this process from this context
        // (the scheduler keeps checkpoints in memory only), so its layers, types and cell
        // counts are this cache's; llama.cpp's reader checks every read against its length.
        // With PARTIAL_ONLY only the sliding-window cache reads it: it clears the sequence's
        // windowed cells and puts the checkpoint's back; the full-attention cells cut above
        // stay.
        let ok = unsafe {
            self.ctx
                .state_seq_set_data_ext(state, seq, LlamaStateSeqFlags::PARTIAL_ONLY)
        };
        ok && self.ctx.kv_cache_seq_pos_max(seq).saturating_add(1)
            == i32::try_from(from).unwrap_or(-1)
            && self.window_intact(seq, len)
    }

    fn seq_state(&self, seq: i32) -> Result<Vec<u8>, BackendError> {
        self.state_with(seq, StatePart::Whole)
    }

    fn set_seq_state(&mut self, seq: i32, state: &[u8]) -> Result<usize, BackendError> {
        // Every cell's position, checked before llama.cpp takes it (`state_positions.rs`): in
        // the cache, and once in each of its caches (a position twice makes llama.cpp refuse
        // the sequence's next decode). A recurrent state's layout is another.
        if !(self.model.is_recurrent() || self.model.is_hybrid()) {
            let limit = i64::from(self.ctx.n_ctx());
            let caches = super::state_positions::cell_positions(state).unwrap_or_default();
            for mut positions in caches {
                if let Some(p) = positions.iter().find(|&&p| p < 0 || i64::from(p) >= limit) {
                    return Err(BackendError::State(format!(
                        "the state holds a cell at position {p}, outside the cache's 0..{limit}"
                    )));
                }
                positions.sort_unstable();
                if let Some(w) = positions.windows(2).find(|w| w[0] == w[1]) {
                    return Err(BackendError::State(format!(
                        "the state holds two cells at position {}",
                        w[0]
                    )));
                }
            }
        }
        // SAFETY: llama.cpp reads `state` within its length (its reader checks every read
        // against the buffer's end) and checks the layer count, tensor types and row sizes
        // against this context; the HTTP side only passes states whose checksum and model
        // fingerprint match what `seq_state` wrote for this model (`ops::slot_file`), so
        // the cell counts it allocates by are a slot's.
        let ok = unsafe {
            self.ctx
                .state_seq_set_data_ext(state, seq, LlamaStateSeqFlags::empty())
        };
        if !ok {
            return Err(BackendError::State(
                "the state does not fit this model and context (llama.cpp logged why)".into(),
            ));
        }
        // Positions go from 0: a corrupt state's negative one would make a cell that no
        // range removes, and whose sequence no decode continues (the caller clears it).
        let (min, max) = (
            self.ctx.kv_cache_seq_pos_min(seq),
            self.ctx.kv_cache_seq_pos_max(seq),
        );
        if min < 0 && max >= 0 {
            return Err(BackendError::State(format!(
                "the state holds position {min}; positions start at 0"
            )));
        }
        Ok(usize::try_from(max.saturating_add(1)).unwrap_or(0))
    }
}

impl LlamaEngine<'_> {
    /// Whether sequence `seq`, holding positions `0..len`, still has every cell the next
    /// position attends to. Sliding-window layers (without `--swa-full`) drop cells that fall
    /// out of the window as a sequence grows; cut back to an earlier position, it lacks the
    /// window before that position (llama-server checks the same before reusing a prompt).
    fn window_intact(&self, seq: i32, len: usize) -> bool {
        let Some(window) = self.swa_window else {
            return true;
        };
        if len == 0 {
            return true;
        }
        let pos_min = self.ctx.kv_cache_seq_pos_min(seq);
        usize::try_from(pos_min).is_ok_and(|p| p <= len.saturating_sub(window))
    }
}
