//! Deterministic mode's decodes (`--deterministic`): a batch decoded as
//! `backend::invariant_batch::plan` says (pad rows, extra outputs, one call per row count), the
//! logits the scheduler asked for kept from each call, the pads' cells removed.

use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::DecodeError;

use crate::backend::invariant_batch::plan;
use crate::backend::BatchToken;
use crate::protocol::BackendError;

use super::LlamaEngine;

/// The logits of the last deterministic decode, by the scheduler's batch index: llama.cpp keeps
/// only its last call's, and a batch may take several calls.
#[derive(Default)]
pub(super) struct KeptLogits {
    /// `n_vocab` floats per kept row.
    values: Vec<f32>,
    /// For each index of the scheduler's batch, where its row starts in `values`.
    at: Vec<Option<usize>>,
    n_vocab: usize,
}

impl KeptLogits {
    pub(super) fn new(n_vocab: usize) -> Self {
        Self {
            n_vocab,
            ..Self::default()
        }
    }

    /// The kept logits of batch index `index` (empty if none were asked for it).
    pub(super) fn row(&self, index: usize) -> &[f32] {
        match self.at.get(index).copied().flatten() {
            Some(start) => &self.values[start..start + self.n_vocab],
            None => &[],
        }
    }
}

impl LlamaEngine<'_> {
    /// Decodes `batch` with every row on the kernel paths a batch of any shape takes.
    pub(super) fn decode_invariant(&mut self, batch: &[BatchToken]) -> Result<(), BackendError> {
        let Some(mut kept) = self.invariant.take() else {
            return Err(BackendError::Decode("not in deterministic mode".into()));
        };
        kept.values.clear();
        kept.at.clear();
        kept.at.resize(batch.len(), None);
        let result = self.decode_calls(batch, &mut kept);
        self.invariant = Some(kept);
        result
    }

    fn decode_calls(
        &mut self,
        batch: &[BatchToken],
        kept: &mut KeptLogits,
    ) -> Result<(), BackendError> {
        for call in plan(batch, self.batch_capacity) {
            self.batch.clear();
            for row in &call.rows {
                let pos =
                    i32::try_from(row.pos).map_err(|e| BackendError::Decode(e.to_string()))?;
                self.batch
                    .add(LlamaToken(row.token), pos, &[row.seq], row.logits)
                    .map_err(|e| BackendError::Decode(e.to_string()))?;
            }
            let decoded = self.ctx.decode(&mut self.batch).map_err(|e| match e {
                DecodeError::NoKvCacheSlot => BackendError::NoKvSlot,
                other => BackendError::Decode(other.to_string()),
            });
            if decoded.is_ok() {
                for (j, row) in call.rows.iter().enumerate() {
                    if let (Some(i), Ok(j)) = (row.from, i32::try_from(j)) {
                        kept.at[i] = Some(kept.values.len());
                        kept.values.extend_from_slice(self.ctx.get_logits_ith(j));
                    }
                }
            }
            // The pads' cells go whether or not the decode went through: the next token of
            // each sequence takes the cell its pad had.
            let mut removed = true;
            for &(seq, pos) in &call.pads {
                removed &= self.ctx.kv_cache_seq_rm(seq, Some(pos), None).is_ok();
            }
            decoded?;
            if !removed {
                return Err(BackendError::Decode(
                    "llama.cpp could not remove a deterministic decode's pad cell".into(),
                ));
            }
        }
        Ok(())
    }
}
