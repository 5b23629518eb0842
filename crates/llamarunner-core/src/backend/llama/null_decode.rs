//! `--null-decode`, for benchmarks: the model is loaded and its context made as usual, but a
//! decode computes nothing and every position asked for logits gets one of a few synthetic
//! rows of the real vocabulary's size. What the server does around a decode (batching,
//! sampling over the whole vocabulary, grammars, text, streaming) then runs at its own
//! ceiling, which a fast GPU's step would otherwise hide behind (`benches/sampling_ceiling.py`).
//! The KV cache stays empty: the cache operations run on empty cells.

use crate::backend::BatchToken;

/// How many different rows of logits the positions take turns with.
const ROWS: usize = 16;

/// The synthetic logits and which row each output position of the last decode got.
pub(super) struct NullLogits {
    rows: Vec<Vec<f32>>,
    /// For each batch index of the last decode with logits, its row.
    outputs: Vec<(usize, usize)>,
}

impl NullLogits {
    /// Rows shaped like a language model's: a few likely tokens and a long tail (a logit that
    /// falls with the log of a token's rank, each row with its own random ranking), with the
    /// end-of-generation tokens (`eog`) least likely, so that a request runs to its length.
    pub(super) fn new(n_vocab: usize, eog: &[i32]) -> Self {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            // xorshift64*: the same rows in every run.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            state.wrapping_mul(0x2545_f491_4f6c_dd1d)
        };
        let rows = (0..ROWS)
            .map(|_| {
                let mut ranks: Vec<u32> = (0..u32::try_from(n_vocab).unwrap_or(u32::MAX)).collect();
                for i in (1..ranks.len()).rev() {
                    let j = usize::try_from(next() % (i as u64 + 1)).unwrap_or(0);
                    ranks.swap(i, j);
                }
                let mut row: Vec<f32> = ranks
                    .iter()
                    .map(|&rank| 12.0 - 1.5 * (1.0 + rank as f32).ln())
                    .collect();
                for &t in eog {
                    if let Some(l) = usize::try_from(t).ok().and_then(|t| row.get_mut(t)) {
                        *l = -30.0;
                    }
                }
                row
            })
            .collect();
        Self {
            rows,
            outputs: Vec::new(),
        }
    }

    /// A decode: each position with logits gets the row of its position (not of its slot or
    /// batch: a request's output depends on the request alone, as with a batch-invariant
    /// model).
    pub(super) fn decode(&mut self, batch: &[BatchToken]) {
        self.outputs.clear();
        for (index, t) in batch.iter().enumerate() {
            if t.logits {
                self.outputs.push((index, t.pos as usize % ROWS));
            }
        }
    }

    /// The logits of batch index `index` of the last decode (a row of `n_vocab`); the first
    /// row for an index without logits (llama.cpp would refuse it; the scheduler never asks).
    pub(super) fn logits(&self, index: usize) -> &[f32] {
        let row = self
            .outputs
            .binary_search_by_key(&index, |&(i, _)| i)
            .map_or(0, |k| self.outputs[k].1);
        &self.rows[row]
    }
}
