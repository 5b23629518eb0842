//! The positions of a sequence state's cells, read from its bytes before llama.cpp reads them
//! (`KvOps::set_seq_state`). llama.cpp takes each cell's position as the state says, and
//! removes cells only by position range (0 up to `i32::MAX`, excluded): a slot file whose
//! checksum holds (anyone who can write the file can make one) could give a cell a position
//! no removal reaches, or -1, which llama.cpp also takes for a free cell. Its range checks
//! see only a sequence's least and greatest position, and of a sliding-window model only the
//! windowed cache's: the bytes are the one place every cell's position shows.
//!
//! The layout, as the vendored llama.cpp writes it (its context's `state_seq_get_data`, then
//! each KV cache's `state_write`; little-endian):
//!
//! ```text
//! magic u32, sequence id i32
//! per cache (one; two for a sliding-window model, the full then the windowed):
//!   n_stream u32
//!   per stream: cell_count u32, then unless it is 0:
//!     per cell: pos i32, n_seq_id u32, [x i32, y i32, tok i32: M-RoPE and PLE models],
//!               n_seq_id x seq_id i32
//!     v_trans u32, n_layer u32, n_rot_k u32, n_rot_v u32
//!     per layer, keys: type i32, row_size u64, cell_count x row_size bytes
//!     per layer, values: type i32, row_size u64, cell_count x row_size bytes
//!                or, v_trans: type i32, el_size u32, n_embd u32, n_embd x cell_count x el_size
//! ```
//!
//! A state that does not walk exactly to its end (a recurrent model's, a layout of another
//! llama.cpp, a model whose layers do not all keep values) gives no positions, and the checks
//! after the restore are all there is.

/// The positions of every cell in `state`, one list per cache, or None when its bytes do not
/// walk as the layout above, with or without the cells' extension, exactly to their end.
pub(super) fn cell_positions(state: &[u8]) -> Option<Vec<Vec<i32>>> {
    [false, true].into_iter().find_map(|ext| {
        walk(
            &mut Reader {
                bytes: state,
                at: 0,
            },
            ext,
        )
    })
}

/// Bytes of a cell's extension (`llama_kv_cell_ext`: x, y, tok).
const CELL_EXT: usize = 12;

/// More streams than any context has (one per sequence at most).
const MAX_STREAMS: u32 = 1 << 16;

fn walk(r: &mut Reader<'_>, ext: bool) -> Option<Vec<Vec<i32>>> {
    r.skip(8)?; // magic, sequence id
    let mut caches = Vec::new();
    // At least one cache.
    while caches.is_empty() || !r.done() {
        caches.push(Vec::new());
        let positions = caches.last_mut()?;
        let streams = r.u32()?;
        if streams == 0 || streams > MAX_STREAMS {
            return None;
        }
        for _ in 0..streams {
            let cells = r.u32()? as usize;
            if cells == 0 {
                continue;
            }
            for _ in 0..cells {
                positions.push(r.i32()?);
                let n_seq = r.u32()? as usize;
                if ext {
                    r.skip(CELL_EXT)?;
                }
                r.skip(n_seq.checked_mul(4)?)?;
            }
            let v_trans = r.u32()?;
            if v_trans > 1 {
                return None;
            }
            let layers = r.u32()?;
            r.skip(8)?; // n_rot_k, n_rot_v
            for _ in 0..layers {
                r.skip(4)?;
                let row = r.u64()?;
                r.skip(usize::try_from(row).ok()?.checked_mul(cells)?)?;
            }
            for _ in 0..layers {
                r.skip(4)?;
                let bytes = if v_trans == 0 {
                    usize::try_from(r.u64()?).ok()?
                } else {
                    (r.u32()? as usize).checked_mul(r.u32()? as usize)?
                };
                r.skip(bytes.checked_mul(cells)?)?;
            }
        }
    }
    Some(caches)
}

/// A cursor over a state's bytes; every read fails past their end.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn done(&self) -> bool {
        self.at == self.bytes.len()
    }

    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let end = self.at.checked_add(N)?;
        let bytes = self.bytes.get(self.at..end)?.try_into().ok()?;
        self.at = end;
        Some(bytes)
    }

    fn skip(&mut self, n: usize) -> Option<()> {
        let end = self.at.checked_add(n)?;
        (end <= self.bytes.len()).then(|| self.at = end)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }

    fn i32(&mut self) -> Option<i32> {
        self.take().map(i32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::cell_positions;

    /// One cache's bytes: `streams` streams, the first holding cells at `positions`, with
    /// `layers` layers of keys and values (transposed or not), and each cell's extension.
    fn cache(positions: &[i32], streams: u32, layers: u32, v_trans: bool, ext: bool) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(streams.to_le_bytes());
        let cells = positions.len();
        b.extend((cells as u32).to_le_bytes());
        for &p in positions {
            b.extend(p.to_le_bytes());
            b.extend(1u32.to_le_bytes());
            if ext {
                b.extend([7u8; 12]);
            }
            b.extend(3i32.to_le_bytes());
        }
        for v in [u32::from(v_trans), layers, 64, 64] {
            b.extend(v.to_le_bytes());
        }
        for _ in 0..layers {
            b.extend(1i32.to_le_bytes());
            b.extend(6u64.to_le_bytes());
            b.extend(vec![0xAB; 6 * cells]);
        }
        for _ in 0..layers {
            b.extend(1i32.to_le_bytes());
            if v_trans {
                b.extend(2u32.to_le_bytes());
                b.extend(5u32.to_le_bytes());
                b.extend(vec![0xCD; 2 * 5 * cells]);
            } else {
                b.extend(10u64.to_le_bytes());
                b.extend(vec![0xCD; 10 * cells]);
            }
        }
        // The other streams hold nothing of this sequence.
        for _ in 1..streams {
            b.extend(0u32.to_le_bytes());
        }
        b
    }

    fn state(caches: &[Vec<u8>]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(0xAB_CD_EF_01u32.to_le_bytes());
        b.extend(3i32.to_le_bytes());
        for c in caches {
            b.extend(c);
        }
        b
    }

    #[test]
    fn every_cells_position_is_read_in_every_layout() {
        for (v_trans, ext, streams) in [
            (false, false, 1),
            (true, false, 4),
            (false, true, 2),
            (true, true, 1),
        ] {
            let positions = [0, 1, 2, -1, i32::MAX];
            let one = state(&[cache(&positions, streams, 3, v_trans, ext)]);
            assert_eq!(cell_positions(&one), Some(vec![positions.to_vec()]));
            // A sliding-window model: the full cache, then the windowed one.
            let two = state(&[
                cache(&positions, streams, 3, v_trans, ext),
                cache(&[-7, 2], streams, 2, v_trans, ext),
            ]);
            assert_eq!(
                cell_positions(&two),
                Some(vec![positions.to_vec(), vec![-7, 2]])
            );
        }
        // A sequence without cells.
        assert_eq!(
            cell_positions(&state(&[1u32
                .to_le_bytes()
                .into_iter()
                .chain(0u32.to_le_bytes())
                .collect()])),
            Some(vec![vec![]])
        );
    }

    #[test]
    fn bytes_that_do_not_walk_to_their_end_give_nothing() {
        let good = state(&[cache(&[0, 1, 2], 2, 3, false, false)]);
        assert!(cell_positions(&good).is_some());
        // Cut anywhere, or followed by anything: not the layout.
        for cut in 0..good.len() {
            assert_eq!(cell_positions(&good[..cut]), None, "cut at {cut}");
        }
        let mut longer = good.clone();
        longer.push(0);
        assert_eq!(cell_positions(&longer), None);
        // Sizes that overflow, a v_trans that is not 0 or 1, no streams.
        let mut huge = state(&[cache(&[0], 1, 1, false, false)]);
        let row = 8 + 4 + 4 + 12 + 16 + 4;
        huge[row..row + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(cell_positions(&huge), None);
        let mut trans = good.clone();
        let at = 8 + 4 + 4 + 3 * 12;
        trans[at..at + 4].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(cell_positions(&trans), None);
        assert_eq!(cell_positions(&state(&[0u32.to_le_bytes().to_vec()])), None);
    }
}
