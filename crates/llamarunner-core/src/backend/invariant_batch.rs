//! Decodes whose rows compute the same whatever shares their batch (`--deterministic`).
//!
//! llama.cpp's CPU kernels pick their path by the number of rows a matrix product has: one row
//! goes through `vec_dot`, two or more through llamafile's tiled `sgemm` (for F32, F16, BF16,
//! Q8_0, Q4_0, Q5_0 and IQ4_NL weights), eight or more K-quant rows through the tiled K-quant
//! kernel, and weights repacked for the CPU (Q4_0, Q4_K, IQ4_NL... in the `CPU_REPACK` buffer)
//! through a 4-row `gemm` for the first rows in fours and a 1-row `gemv` for the rest. Each
//! path sums a dot product in its own order, so a row's logits depend on how many rows its
//! batch had. Within one path, though, every output element is summed the same way whatever
//! the rows around it (sgemm's and the repacked gemm's tiles alike accumulate one element over
//! the shared dimension in a fixed order). The engine in deterministic mode turns the tiled
//! K-quant kernel and flash attention off (`backend::llama::load`), and decodes every batch as
//! this plan says, so that every product takes the same path every time:
//!
//! - every sequence brings a multiple of four rows (`ROW_QUANTUM`): pad rows at the positions
//!   after its last, removed from the cache after the decode. The attention's products, which
//!   llama.cpp computes per sequence (one cache stream each), and the weights' products then
//!   always have four rows or a multiple of four: sgemm, never `vec_dot`; the repacked `gemm`,
//!   never `gemv`;
//! - a sequence that wants logits wants them for a multiple of four rows (pads' or its own
//!   rows' logits are asked too and thrown away): the last layer, which computes only the rows
//!   with outputs, and the output projection keep that rule too;
//! - the sequences of one decode call all bring the same number of rows and fit one
//!   micro-batch, so that llama.cpp's equal split never cuts a sequence's rows.
//!
//! The KV cells of a sequence stay at the same indices as its positions (its own stream, every
//! pad removed, `swa_full`), so the attention sums its cells in the same order too: cells
//! masked out add exact zeros. Pure, so unit-tested in every build.

use std::collections::BTreeMap;

use crate::backend::{BatchToken, Token};

/// One row of a decode call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    /// The token.
    pub token: Token,
    /// Its position in its sequence.
    pub pos: u32,
    /// The llama.cpp sequence id.
    pub seq: i32,
    /// Whether llama.cpp outputs logits for it.
    pub logits: bool,
    /// The index in the scheduler's batch whose logits these are; none for a pad row, or for a
    /// row whose logits are asked only to give the output projection two rows.
    pub from: Option<usize>,
}

/// One `llama_decode` call: its rows, and the pad rows to remove from the cache after it
/// (each a sequence and the first position to remove).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Call {
    /// The rows, each sequence's together and in order, the sequences by id.
    pub rows: Vec<Row>,
    /// `(seq, pos)`: cells from `pos` on are a pad's.
    pub pads: Vec<(i32, u32)>,
}

/// A sequence's rows, with its pad's `(seq, pos)` if it has one.
type Padded = (Vec<Row>, Option<(i32, u32)>);

/// Every sequence's rows in a call, and its outputs if any, are a multiple of this: the row
/// group of the CPU's repacked `gemm`.
pub const ROW_QUANTUM: usize = 4;

/// The cells a slot keeps free past its last position for pad rows.
pub const PAD_CELLS: usize = ROW_QUANTUM - 1;

/// The most rows the scheduler may put in one batch when llama.cpp takes `n_batch`: a
/// multiple of `ROW_QUANTUM`, so that a sequence's rows padded still fit.
pub fn capacity(n_batch: usize) -> usize {
    (n_batch / ROW_QUANTUM * ROW_QUANTUM).max(ROW_QUANTUM)
}

/// The decode calls that compute `batch` with every row on the same kernel paths, none over
/// `capacity` rows (a multiple of `ROW_QUANTUM`, which no sequence's rows exceed). A
/// sequence's rows must be consecutive positions, as the scheduler makes them.
pub fn plan(batch: &[BatchToken], capacity: usize) -> Vec<Call> {
    // Each sequence's rows, in batch order, by sequence id.
    let mut by_seq: BTreeMap<i32, Vec<Row>> = BTreeMap::new();
    for (i, t) in batch.iter().enumerate() {
        by_seq.entry(t.seq).or_default().push(Row {
            token: t.token,
            pos: t.pos,
            seq: t.seq,
            logits: t.logits,
            from: t.logits.then_some(i),
        });
    }
    // Padded, then gathered by row count (sequence ids ascending within each count).
    let mut by_len: BTreeMap<usize, Vec<Padded>> = BTreeMap::new();
    for (seq, mut rows) in by_seq {
        let Some(&last) = rows.last() else {
            continue;
        };
        let n = rows.len();
        let mut pad = None;
        for k in 1..=(n.div_ceil(ROW_QUANTUM) * ROW_QUANTUM - n) {
            let pos = last
                .pos
                .saturating_add(u32::try_from(k).unwrap_or(u32::MAX));
            rows.push(Row {
                pos,
                logits: false,
                from: None,
                ..last
            });
            pad = pad.or(Some((seq, pos)));
        }
        let outputs = rows.iter().filter(|r| r.logits).count();
        let mut missing = outputs.div_ceil(ROW_QUANTUM) * ROW_QUANTUM - outputs;
        // The pads first, then the sequence's own rows from its last back.
        for row in rows.iter_mut().rev() {
            if missing == 0 {
                break;
            }
            if !row.logits {
                row.logits = true;
                missing -= 1;
            }
        }
        by_len.entry(rows.len()).or_default().push((rows, pad));
    }
    let capacity = capacity.max(ROW_QUANTUM);
    let mut calls = Vec::new();
    for (len, seqs) in by_len {
        let per_call = (capacity / len).max(1);
        for chunk in seqs.chunks(per_call) {
            let mut call = Call::default();
            for (rows, pad) in chunk {
                call.rows.extend_from_slice(rows);
                call.pads.extend(*pad);
            }
            calls.push(call);
        }
    }
    // The call with the most logits asked last: llama.cpp keeps only the last call's, and the
    // engine copies the others'.
    calls.sort_by_key(|c| c.rows.iter().filter(|r| r.from.is_some()).count());
    calls
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tok(seq: i32, pos: u32, logits: bool) -> BatchToken {
        BatchToken {
            token: 7,
            pos,
            seq,
            logits,
        }
    }

    #[test]
    fn a_lone_decode_row_gets_three_pads_all_output() {
        let calls = plan(&[tok(3, 10, true)], 512);
        assert_eq!(calls.len(), 1);
        let rows: Vec<_> = calls[0]
            .rows
            .iter()
            .map(|r| (r.pos, r.logits, r.from))
            .collect();
        assert_eq!(
            rows,
            vec![
                (10, true, Some(0)),
                (11, true, None),
                (12, true, None),
                (13, true, None)
            ]
        );
        assert_eq!(calls[0].pads, vec![(3, 11)]);
    }

    #[test]
    fn a_prompt_chunk_with_one_output_outputs_its_pads_and_the_rows_before() {
        let batch: Vec<_> = (0..6).map(|p| tok(0, p, p == 5)).collect();
        let calls = plan(&batch, 512);
        assert_eq!(calls.len(), 1);
        let outputs: Vec<_> = calls[0]
            .rows
            .iter()
            .map(|r| (r.pos, r.logits, r.from))
            .collect();
        assert_eq!(
            outputs,
            vec![
                (0, false, None),
                (1, false, None),
                (2, false, None),
                (3, false, None),
                (4, true, None),
                (5, true, Some(5)),
                (6, true, None),
                (7, true, None)
            ]
        );
        assert_eq!(calls[0].pads, vec![(0, 6)]);
    }

    #[test]
    fn decodes_and_prompt_chunks_go_in_calls_of_their_own() {
        // Two sequences decoding, one prompt chunk between them.
        let mut batch = vec![tok(0, 20, true)];
        batch.extend((0..6).map(|p| tok(1, p, false)));
        batch.push(tok(2, 30, true));
        let calls = plan(&batch, 512);
        assert_eq!(calls.len(), 2);
        let seqs = |c: &Call| c.rows.iter().map(|r| r.seq).collect::<Vec<_>>();
        // The decode tokens' call, whose logits are asked, last.
        assert_eq!(seqs(&calls[0]), vec![1; 8]);
        assert_eq!(seqs(&calls[1]), vec![0, 0, 0, 0, 2, 2, 2, 2]);
        assert_eq!(calls[0].pads, vec![(1, 6)]);
        assert_eq!(calls[1].pads, vec![(0, 21), (2, 31)]);
    }

    #[test]
    fn the_capacity_is_a_multiple_of_the_quantum() {
        assert_eq!(capacity(512), 512);
        assert_eq!(capacity(50), 48);
        assert_eq!(capacity(2), 4);
    }

    fn batches() -> impl Strategy<Value = (Vec<BatchToken>, usize)> {
        // Up to 8 sequences, each 1 to 12 consecutive rows, outputs anywhere.
        (
            proptest::collection::vec((1usize..12, 0u32..100, any::<u16>()), 1..8),
            1usize..16,
        )
            .prop_map(|(seqs, quanta)| {
                let capacity = quanta * ROW_QUANTUM;
                let mut batch = Vec::new();
                for (seq, (len, start, outputs)) in seqs.into_iter().enumerate() {
                    let len = len.min(capacity);
                    for r in 0..len {
                        batch.push(BatchToken {
                            token: i32::try_from(r).unwrap_or(0),
                            pos: start + u32::try_from(r).unwrap_or(0),
                            seq: i32::try_from(seq).unwrap_or(0),
                            logits: outputs & (1 << (r % 16)) != 0,
                        });
                    }
                }
                (batch, capacity)
            })
    }

    /// Whether `row` is at or past its sequence's first pad in some call.
    fn c_is_pad(calls: &[Call], row: &Row) -> bool {
        calls
            .iter()
            .flat_map(|c| &c.pads)
            .any(|&(seq, pos)| seq == row.seq && row.pos >= pos)
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(44),
            ..ProptestConfig::default()
        })]

        #[test]
        fn every_call_keeps_the_rules((batch, capacity) in batches()) {
            let calls = plan(&batch, capacity);
            let mut seen = vec![0usize; batch.len()];
            for call in &calls {
                prop_assert!(call.rows.len() <= capacity);
                let mut per_seq: BTreeMap<i32, (usize, usize)> = BTreeMap::new();
                for r in &call.rows {
                    let e = per_seq.entry(r.seq).or_default();
                    e.0 += 1;
                    e.1 += usize::from(r.logits);
                    if let Some(i) = r.from {
                        seen[i] += 1;
                        let t = batch[i];
                        prop_assert_eq!((t.token, t.pos, t.seq, t.logits), (r.token, r.pos, r.seq, true));
                    }
                }
                let counts: Vec<usize> = per_seq.values().map(|c| c.0).collect();
                // Every sequence of a call brings the same number of rows, a multiple of the
                // quantum, and none or a multiple of the quantum outputs.
                prop_assert!(counts.iter().all(|&c| c == counts[0] && c % ROW_QUANTUM == 0 && c > 0));
                prop_assert!(per_seq.values().all(|c| c.1 % ROW_QUANTUM == 0));
                // Pads follow their sequence's last row, at the next positions.
                for &(seq, pos) in &call.pads {
                    let rows: Vec<&Row> = call.rows.iter().filter(|r| r.seq == seq).collect();
                    let real = rows.iter().filter(|r| r.pos < pos).count();
                    prop_assert!(real >= 1 && real < rows.len());
                    prop_assert_eq!(rows[real - 1].pos + 1, pos);
                    for (k, r) in rows[real..].iter().enumerate() {
                        prop_assert_eq!(r.pos, pos + u32::try_from(k).unwrap_or(0));
                        prop_assert!(r.from.is_none());
                    }
                }
                // Sequence ids ascend within a call.
                let ids: Vec<i32> = call.rows.iter().map(|r| r.seq).collect();
                prop_assert!(ids.windows(2).all(|w| w[0] <= w[1]));
            }
            // Every row the scheduler wants logits of is computed exactly once.
            for (i, t) in batch.iter().enumerate() {
                prop_assert_eq!(seen[i], usize::from(t.logits));
            }
            let real: usize = calls
                .iter()
                .flat_map(|c| &c.rows)
                .filter(|r| !c_is_pad(&calls, r))
                .count();
            prop_assert_eq!(real, batch.len());
        }
    }
}
