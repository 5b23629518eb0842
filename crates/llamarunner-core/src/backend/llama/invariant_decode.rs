//! Deterministic mode's decodes (`--deterministic`): a batch decoded as
//! `backend::invariant_batch::plan` says (pad rows, extra outputs, one call per row count), the
//! logits the scheduler asked for copied from each call before the last (the last call's are
//! read where llama.cpp keeps them), the pads' cells removed.

use crate::backend::invariant_batch::plan;
use crate::backend::BatchToken;
use crate::protocol::BackendError;

use super::LlamaEngine;

/// Where the logits of one index of the scheduler's batch are.
#[derive(Clone, Copy)]
enum Source {
    /// Copied into `KeptLogits::values` from this offset (a call before the last).
    Kept(usize),
    /// Row `j` of the last call, still in llama.cpp's buffer.
    LastCall(i32),
}

/// The logits of the last deterministic decode, by the scheduler's batch index: llama.cpp keeps
/// only its last call's, and a batch may take several calls, so the rows asked of the calls
/// before the last are copied here.
#[derive(Default)]
pub(super) struct KeptLogits {
    /// `n_vocab` floats per copied row.
    values: Vec<f32>,
    /// For each index of the scheduler's batch, where its row is.
    at: Vec<Option<Source>>,
    n_vocab: usize,
}

impl KeptLogits {
    pub(super) fn new(n_vocab: usize) -> Self {
        Self {
            n_vocab,
            ..Self::default()
        }
    }

    /// Where the logits of batch index `index` are: copied (`Ok`), or row `j` of the last
    /// call (`Err(j)`, read from the context); an empty slice where none were asked for it.
    pub(super) fn row(&self, index: usize) -> Result<&[f32], i32> {
        match self.at.get(index).copied().flatten() {
            Some(Source::Kept(start)) => Ok(&self.values[start..start + self.n_vocab]),
            Some(Source::LastCall(j)) => Err(j),
            None => Ok(&[]),
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
        let calls = plan(batch, self.batch_capacity);
        for (c, call) in calls.iter().enumerate() {
            self.batch.clear();
            for row in &call.rows {
                self.batch
                    .add(row.token, row.pos, row.seq, row.logits)
                    .map_err(BackendError::Decode)?;
            }
            let decoded = self.decode_filled();
            if decoded.is_ok() {
                let last = c + 1 == calls.len();
                for (j, row) in call.rows.iter().enumerate() {
                    if let (Some(i), Ok(j)) = (row.from, i32::try_from(j)) {
                        kept.at[i] = Some(if last {
                            Source::LastCall(j)
                        } else {
                            let start = kept.values.len();
                            kept.values.extend_from_slice(self.ctx.get_logits_ith(j));
                            Source::Kept(start)
                        });
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
