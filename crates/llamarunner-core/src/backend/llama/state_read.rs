//! Reading a sequence's state out of llama.cpp: the prompt cache's saves, window checkpoints
//! and slot forks all go through `LlamaEngine::state_with`.
//!
//! llama.cpp sizes a state by walking the cache's cells (`llama_state_seq_get_size_ext`), then
//! walks them again to write it. The vendored version's `state_write` (llama-kv-cache.cpp) walks
//! every cell of every stream whatever the sequence (256 slots of 768 cells: 196,608 cells per
//! walk, per cache of a sliding-window model), on the engine thread, while the sampling threads
//! wait for the next step: at 256 streams with a free decode (`--null-decode`) these walks were
//! 43 % of the engine thread's time, the sizing walk most of it. A state's size grows with the
//! sequence's cells by a fixed number of bytes per cell, so after one exact sizing a state is
//! read into a buffer sized from the sequence's length (the most bytes per cell seen, an eighth
//! more, and room for the headers), which llama.cpp's writer bounds: one walk. A state that
//! would not fit (the writer stops at the buffer's end and llama.cpp returns 0) is sized and
//! read again, and its size raises the next guess; nothing else changes what is read.
//!
//! The buffer is not zeroed (llama.cpp writes every byte it counts) and is shrunk to what was
//! written, which for a large allocation gives the untouched pages back without a copy.

use std::cell::Cell;

use llama_cpp_2::context::session::LlamaStateSeqFlags;

use crate::backend::llama::LlamaEngine;
use crate::protocol::BackendError;

/// Room for a state's headers beyond its cells' bytes: the magic and sequence id, and per cache
/// the stream count, a cell count per stream, and a type and row size per layer (a few KiB
/// with 256 streams and 100 layers).
const HEADER_ROOM: usize = 64 * 1024;

/// Which part of a sequence's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StatePart {
    /// All of it (a prompt-cache entry, a fork).
    Whole,
    /// The sliding-window cache's part only (a window checkpoint).
    Window,
}

impl StatePart {
    pub(super) fn flags(self) -> LlamaStateSeqFlags {
        match self {
            StatePart::Whole => LlamaStateSeqFlags::empty(),
            StatePart::Window => LlamaStateSeqFlags::PARTIAL_ONLY,
        }
    }

    /// llama.h's `LLAMA_STATE_SEQ_FLAGS_NONE` (0) and `..._PARTIAL_ONLY` (1), for the raw call
    /// (the crate's flags do not show their bits).
    fn raw_flags(self) -> u32 {
        match self {
            StatePart::Whole => 0,
            StatePart::Window => 1,
        }
    }
}

/// What exact sizings of one part taught: the most bytes per cell seen, and the largest state
/// of a sequence without cells (its headers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct SizeGuess {
    per_cell: usize,
    empty: usize,
}

impl SizeGuess {
    /// A buffer size that should hold the state of a sequence of `cells` cells; none before an
    /// exact sizing says how large a cell is (or, for an empty sequence, its headers), or where
    /// the size overflows.
    pub(super) fn bound(self, cells: usize) -> Option<usize> {
        if cells == 0 {
            return (self.empty > 0 || self.per_cell > 0)
                .then(|| self.empty.max(self.per_cell).checked_add(HEADER_ROOM))
                .flatten();
        }
        if self.per_cell == 0 {
            return None;
        }
        let body = self.per_cell.checked_mul(cells)?;
        body.checked_add(body / 8)?
            .checked_add(self.empty)?
            .checked_add(HEADER_ROOM)
    }

    /// The guess after an exact sizing: a state of `size` bytes for `cells` cells.
    pub(super) fn learn(self, cells: usize, size: usize) -> Self {
        if cells == 0 {
            Self {
                empty: self.empty.max(size),
                ..self
            }
        } else {
            Self {
                per_cell: self.per_cell.max(size.div_ceil(cells)),
                ..self
            }
        }
    }
}

/// The engine's state reads: the raw context pointer the bounded read goes through (none where
/// it could not be had, or for a recurrent or hybrid model, whose fixed-size recurrent state
/// would read as bytes per cell and swell every guess: then every read is sized first) and a
/// guess per part.
pub(super) struct StateReads {
    raw: Option<*mut llama_cpp_sys_2::llama_context>,
    whole: Cell<SizeGuess>,
    window: Cell<SizeGuess>,
}

impl StateReads {
    pub(super) fn new(raw: Option<*mut llama_cpp_sys_2::llama_context>) -> Self {
        Self {
            raw,
            whole: Cell::new(SizeGuess::default()),
            window: Cell::new(SizeGuess::default()),
        }
    }

    fn guess(&self, part: StatePart) -> &Cell<SizeGuess> {
        match part {
            StatePart::Whole => &self.whole,
            StatePart::Window => &self.window,
        }
    }

    /// Records an exact size of `part` for a sequence of `cells` cells.
    pub(super) fn learn(&self, part: StatePart, cells: usize, size: usize) {
        let guess = self.guess(part);
        guess.set(guess.get().learn(cells, size));
    }

    /// The state read in one walk into a buffer of the guessed size; none where there is no
    /// guess yet or the state did not fit (llama.cpp's ERROR line for that is not shown).
    /// Another llama.cpp failure returns 0 as well, and the exact read after it reports it.
    fn read_guessed(&self, seq: i32, part: StatePart, cells: usize) -> Option<Vec<u8>> {
        let raw = self.raw?;
        let bound = self.guess(part).get().bound(cells)?;
        let mut state: Vec<u8> = Vec::new();
        state.try_reserve_exact(bound).ok()?;
        // SAFETY: `raw` is this engine's context (checked against its model and size when
        // the engine was made, and alive as long as the engine), used on the engine thread
        // that owns it; `state` has room for `bound` bytes and llama.cpp's writer checks every
        // write against `bound`, returning the bytes written, or 0 when they would not fit.
        let written = super::logs::without_short_buffer_error(|| unsafe {
            llama_cpp_sys_2::llama_state_seq_get_data_ext(
                raw,
                state.as_mut_ptr(),
                bound,
                seq,
                part.raw_flags(),
            )
        });
        if written == 0 || written > bound {
            tracing::debug!(seq, ?part, cells, bound, "the state is larger than guessed");
            return None;
        }
        // SAFETY: llama.cpp wrote the first `written` bytes (within the capacity, checked).
        unsafe { state.set_len(written) };
        state.shrink_to_fit();
        Some(state)
    }
}

impl LlamaEngine<'_> {
    /// The cells sequence `seq` holds, as a state's size counts them: positions 0..=max, a
    /// cell each for a text sequence (an image's tokens may share positions: then a guess
    /// falls short once and learns).
    pub(super) fn seq_cells(&self, seq: i32) -> usize {
        usize::try_from(self.ctx.kv_cache_seq_pos_max(seq).saturating_add(1)).unwrap_or(0)
    }

    /// Sequence `seq`'s state (all of it, or the sliding-window part): read in one walk where
    /// the guess holds, else sized and read.
    pub(super) fn state_with(&self, seq: i32, part: StatePart) -> Result<Vec<u8>, BackendError> {
        let cells = self.seq_cells(seq);
        if let Some(state) = self.state_reads.read_guessed(seq, part, cells) {
            return Ok(state);
        }
        let flags = part.flags();
        let size = self.ctx.state_seq_get_size_ext(seq, flags);
        if size == 0 {
            return Err(BackendError::State(
                "llama.cpp could not size the sequence's state".into(),
            ));
        }
        self.state_reads.learn(part, cells, size);
        let mut state: Vec<u8> = Vec::new();
        state
            .try_reserve_exact(size)
            .map_err(|e| BackendError::State(format!("no memory for the state: {e}")))?;
        // SAFETY: `state` has room for the `size` bytes llama.cpp said this sequence's state
        // takes with these flags, and nothing changes the cache between the two calls (this
        // thread owns the context and holds `&self`).
        let written = unsafe {
            self.ctx
                .state_seq_get_data_ext(state.as_mut_ptr(), seq, flags)
        };
        if written != size {
            return Err(BackendError::State(format!(
                "llama.cpp wrote {written} bytes of state, {size} expected"
            )));
        }
        // SAFETY: llama.cpp wrote all `size` bytes (checked above), within the capacity.
        unsafe { state.set_len(size) };
        Ok(state)
    }
}

#[cfg(test)]
mod tests {
    use super::{SizeGuess, HEADER_ROOM};

    /// A state as llama.cpp lays it out: headers, then a fixed number of bytes per cell.
    fn state_size(headers: usize, per_cell: usize, cells: usize) -> usize {
        headers + per_cell * cells
    }

    #[test]
    fn nothing_is_guessed_before_an_exact_size() {
        assert_eq!(SizeGuess::default().bound(0), None);
        assert_eq!(SizeGuess::default().bound(100), None);
        // Headers alone say nothing of a cell's bytes.
        assert_eq!(SizeGuess::default().learn(0, 2048).bound(1), None);
        assert_eq!(
            SizeGuess::default().learn(0, 2048).bound(0),
            Some(2048 + HEADER_ROOM)
        );
    }

    #[test]
    fn a_guess_holds_every_length_of_the_layout_it_learned() {
        // Headers of 3 KiB and 18 KiB per cell (Gemma 3 270M's f16 cache), learned from one
        // sequence of any length, bound every other length.
        for learned in [1, 7, 100, 512, 4096] {
            let guess = SizeGuess::default().learn(learned, state_size(3072, 18_432, learned));
            for cells in [0, 1, 2, 50, 511, 512, 513, 4096, 32_768] {
                let bound = guess.bound(cells).unwrap_or(0);
                assert!(
                    bound >= state_size(3072, 18_432, cells),
                    "learned at {learned}, {cells} cells: {bound}"
                );
                // and not far above it: an eighth more, and a short sequence's headers
                // counted as cells.
                assert!(
                    bound
                        <= (state_size(3072, 18_432, cells) + 3072 + 18_432) * 3 / 2 + HEADER_ROOM,
                    "learned at {learned}, {cells} cells: {bound}"
                );
            }
        }
    }

    #[test]
    fn a_guess_that_fell_short_rises_to_the_size_it_missed() {
        // A sliding-window cache: past the window (512) its cells stop growing, so a long
        // sequence teaches fewer bytes per cell than a short one needs.
        let window_state = |cells: usize| 3072 + 3072 * cells + 15_360 * cells.min(512);
        let guess = SizeGuess::default().learn(4096, window_state(4096));
        assert!(guess.bound(100).unwrap_or(0) < window_state(100));
        let guess = guess.learn(100, window_state(100));
        for cells in [1, 100, 300, 512, 1000, 4096] {
            assert!(
                guess.bound(cells).unwrap_or(0) >= window_state(cells),
                "{cells}"
            );
        }
        // It never falls.
        assert_eq!(guess.learn(4096, window_state(4096)), guess);
    }

    #[test]
    fn an_overflowing_size_is_no_guess() {
        let guess = SizeGuess::default().learn(1, usize::MAX / 2);
        assert_eq!(guess.bound(3), None);
    }
}
