//! Decodes of the main context through `crates/llamarunner-core/cpp/guarded_decode.cpp`:
//! llama_decode with its C++ exceptions caught.
//!
//! llama.cpp reserves its compute graph again at the first decode after the graph changed (a
//! `--backend-sampling` chain attached or detached, another LoRA adapter set), and a failed
//! allocation there throws out of `llama_decode`. With `--backend-sampling` on 32 slots of
//! Gemma 3 the compute buffer grows from 527 MiB to 1,040 MiB at the first attach: on a GPU
//! filled by the model and its cache that allocation fails. Rust cannot catch a foreign
//! exception ("Rust cannot catch foreign exceptions, aborting"), so the whole server went down
//! with every request in it. The exception now comes back as `Failure::Threw` (from the
//! reserve: before the cache took any cell of the batch), and the engine recovers
//! (`LlamaEngine::decode_recovering`).
//!
//! The batch is ours (`TokenBatch`): llama-cpp-2's `LlamaBatch` keeps its raw struct private,
//! and the guarded call takes the raw struct.

use std::ffi::{c_char, CStr};

use llama_cpp_sys_2 as sys;

use super::LlamaEngine;
use crate::protocol::BackendError;

/// Bytes of an exception's message kept.
const MESSAGE_BYTES: usize = 512;

extern "C" {
    fn llamarunner_guarded_decode(
        ctx: *mut sys::llama_context,
        batch: sys::llama_batch,
        what: *mut c_char,
        what_len: usize,
        threw: *mut i32,
    ) -> i32;
}

/// Why a guarded decode did not go through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Failure {
    /// llama.cpp found no room in the cache for the batch (its 1).
    NoKvSlot,
    /// Any other code llama_decode returned.
    Code(i32),
    /// llama_decode threw: the exception's message.
    Threw(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoKvSlot => write!(f, "no KV cache slot for the batch"),
            Self::Code(rc) => write!(f, "llama_decode returned {rc}"),
            Self::Threw(what) => write!(f, "llama.cpp threw: {what}"),
        }
    }
}

impl LlamaEngine<'_> {
    /// Decodes `self.batch` (filled) on the main context (`decode_recovering`).
    pub(super) fn decode_filled(&mut self) -> Result<(), BackendError> {
        self.decode_recovering(
            "the batch",
            // SAFETY: `raw_ctx` is this engine's context, used by this thread only; the batch
            // lives through the call.
            |engine| {
                unsafe { decode(engine.raw_ctx, engine.batch.raw()) }.map_err(Failure::into_backend)
            },
            |engine| engine.batch.starts(),
        )
    }

    /// Runs `attempt`, a decode of `what` on the main context. When llama.cpp throws in it,
    /// llama.cpp is told to reserve its graph again at the next decode, and `attempt` runs once
    /// more if `--backend-sampling` chains were attached (they are given up: without them the
    /// graph is load's, which fit) and every sequence's cells from its first position on
    /// (`starts`: id, first position) could be removed (a throw from the reserve comes before
    /// the cache took any; one from later in the decode may leave some, and a recurrent
    /// model's cache cannot always cut them). Otherwise `what` fails and the server goes on.
    pub(super) fn decode_recovering(
        &mut self,
        what: &str,
        mut attempt: impl FnMut(&mut Self) -> Result<(), BackendError>,
        starts: impl Fn(&Self) -> Vec<(i32, i32)>,
    ) -> Result<(), BackendError> {
        let mut retried = false;
        loop {
            let why = match attempt(self) {
                Err(BackendError::Threw(why)) => why,
                other => return other,
            };
            tracing::error!(error = %why, "llama.cpp threw in a decode");
            // SAFETY: `raw_ctx` is this engine's context, used by this thread only.
            unsafe { reserve_again(self.raw_ctx) };
            let again = !retried
                && self.cuts.as_mut().is_some_and(|c| c.give_up(&why))
                && starts(self).into_iter().all(|(seq, pos)| {
                    u32::try_from(pos)
                        .is_ok_and(|pos| self.ctx.kv_cache_seq_rm(seq, Some(pos), None).is_ok())
                });
            if !again {
                return Err(BackendError::Decode(format!(
                    "llama.cpp could not decode {what}: {why}"
                )));
            }
            retried = true;
        }
    }
}

impl Failure {
    fn into_backend(self) -> BackendError {
        match self {
            Self::NoKvSlot => BackendError::NoKvSlot,
            Self::Threw(what) => BackendError::Threw(what),
            other => BackendError::Decode(other.to_string()),
        }
    }
}

/// Decodes `batch` on `ctx`.
///
/// # Safety
/// `ctx` is a live llama.cpp context, used by no other thread during the call; `batch`'s
/// arrays hold `batch.n_tokens` valid entries (one sequence id each) and live for the call.
pub(super) unsafe fn decode(
    ctx: *mut sys::llama_context,
    batch: sys::llama_batch,
) -> Result<(), Failure> {
    let mut what = [0 as c_char; MESSAGE_BYTES];
    let mut threw = 0i32;
    let rc = llamarunner_guarded_decode(ctx, batch, what.as_mut_ptr(), what.len(), &mut threw);
    if threw != 0 {
        // The C++ side wrote a NUL-terminated message within the buffer.
        let message = CStr::from_ptr(what.as_ptr()).to_string_lossy().into_owned();
        return Err(Failure::Threw(message));
    }
    match rc {
        0 => Ok(()),
        1 => Err(Failure::NoKvSlot),
        rc => Err(Failure::Code(rc)),
    }
}

/// Makes llama.cpp reserve its compute graph again before the next decode of `ctx`: after a
/// reserve threw, its scheduler is left without the buffers the graph needs, and nothing else
/// tells it to try again. Clearing the (never used) control vector is the one call that only
/// does that.
///
/// # Safety
/// `ctx` is a live llama.cpp context, used by no other thread during the call.
pub(super) unsafe fn reserve_again(ctx: *mut sys::llama_context) {
    sys::llama_set_adapter_cvec(ctx, std::ptr::null(), 0, 0, -1, -1);
}

/// A batch of tokens, one sequence id each, in llama.cpp's own struct (allocated by
/// `llama_batch_init`, freed on drop).
pub(super) struct TokenBatch {
    raw: sys::llama_batch,
    capacity: usize,
}

impl TokenBatch {
    /// Room for `capacity` tokens (at least one).
    pub(super) fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        let n = i32::try_from(capacity).unwrap_or(i32::MAX);
        // SAFETY: llama_batch_init allocates `n` entries of each array (tokens, not
        // embeddings) and one sequence id per entry; they are freed once, on drop.
        let raw = unsafe { sys::llama_batch_init(n, 0, 1) };
        Self {
            raw,
            capacity: usize::try_from(n).unwrap_or(0),
        }
    }

    /// Empties it.
    pub(super) fn clear(&mut self) {
        self.raw.n_tokens = 0;
    }

    /// Tokens in it.
    pub(super) fn len(&self) -> usize {
        usize::try_from(self.raw.n_tokens).unwrap_or(0)
    }

    /// Adds `token` at `pos` of sequence `seq`, its logits wanted or not.
    pub(super) fn add(
        &mut self,
        token: i32,
        pos: u32,
        seq: i32,
        logits: bool,
    ) -> Result<(), String> {
        let i = self.len();
        if i >= self.capacity {
            return Err(format!("the batch holds {} tokens at most", self.capacity));
        }
        let pos = i32::try_from(pos).map_err(|e| format!("position {pos}: {e}"))?;
        // SAFETY: `i` is below the capacity the arrays were allocated with, and entry `i`'s
        // sequence-id array holds one id.
        unsafe {
            *self.raw.token.add(i) = token;
            *self.raw.pos.add(i) = pos;
            *self.raw.n_seq_id.add(i) = 1;
            **self.raw.seq_id.add(i) = seq;
            *self.raw.logits.add(i) = i8::from(logits);
        }
        self.raw.n_tokens += 1;
        Ok(())
    }

    /// Each sequence in it with its first position in it.
    pub(super) fn starts(&self) -> Vec<(i32, i32)> {
        let mut starts: Vec<(i32, i32)> = Vec::new();
        for i in 0..self.len() {
            // SAFETY: entries below `len` were written by `add`.
            let (seq, pos) = unsafe { (**self.raw.seq_id.add(i), *self.raw.pos.add(i)) };
            match starts.iter_mut().find(|(s, _)| *s == seq) {
                Some((_, p)) => *p = (*p).min(pos),
                None => starts.push((seq, pos)),
            }
        }
        starts
    }

    /// The raw struct, for a decode while `self` lives.
    pub(super) fn raw(&self) -> sys::llama_batch {
        self.raw
    }
}

impl Drop for TokenBatch {
    fn drop(&mut self) {
        // SAFETY: made by llama_batch_init, freed once; n_tokens does not matter to the free.
        unsafe { sys::llama_batch_free(self.raw) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch fills to its capacity and no further; clearing it empties it; what was added
    /// is in llama.cpp's arrays.
    #[test]
    fn a_token_batch_holds_what_was_added_up_to_its_capacity() {
        let mut b = TokenBatch::new(2);
        b.add(7, 0, 3, false).unwrap();
        b.add(8, 1, 3, true).unwrap();
        assert!(b.add(9, 2, 3, true).is_err());
        assert_eq!(b.len(), 2);
        let raw = b.raw();
        // SAFETY: two entries were written.
        unsafe {
            assert_eq!(*raw.token.add(1), 8);
            assert_eq!(*raw.pos.add(1), 1);
            assert_eq!(**raw.seq_id.add(1), 3);
            assert_eq!(*raw.logits, 0);
            assert_eq!(*raw.logits.add(1), 1);
        }
        b.clear();
        assert_eq!(b.len(), 0);
        assert!(b.add(1, u32::MAX, 0, true).is_err());
        b.add(1, 0, 0, true).unwrap();
        assert_eq!(b.len(), 1);
        assert_eq!(b.starts(), vec![(0, 0)]);
    }
}
