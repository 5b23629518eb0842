//! Sampling without handing the whole vocabulary to the chain. llama.cpp's `llama_sampler_sample`
//! copies every logit into a candidate array (262,144 of them for Gemma 3: 3 MB) and sorts its
//! way to the top-k at every token of every sequence, on the engine thread, while the other
//! decode threads wait for the next step. A chain whose first cut is a top-k (or greedy, a top
//! one) needs only the k best after the stages before that cut, and those stages (logit bias,
//! repetition penalties) change only known tokens: the biased ones and those in the penalty
//! window. So the `k + m` best raw logits plus those `m` tokens hold every token the cut can
//! keep: at most `m` of the `k + m` best are changed, so at least `k` unchanged ones rank above
//! every token left out. The chain then runs on that shortlist and picks what it would have
//! picked from the whole array (the same candidates, logits and random draw; only the order of
//! exactly equal logits may differ, as between two sorts).

use std::cmp::Ordering;
use std::collections::VecDeque;

/// Most tokens a shortlist holds (`k` plus the tokens earlier stages may change); a chain that
/// would need more sees the whole vocabulary.
pub const MAX_SHORTLIST: usize = 320;

/// What a request's chain needs to see of the vocabulary.
#[derive(Debug, Clone)]
pub struct Shortlist {
    /// The chain's top-k (1 for greedy).
    k: usize,
    /// Tokens with a logit bias (`logit_bias`, `ignore_eos`'s bans), sorted, without repeats.
    biased: Vec<u32>,
    /// The repetition penalties' window: the last `window_len` tokens accepted (as llama.cpp's
    /// penalties sampler keeps them); `window_len` is 0 when penalties are off.
    window: VecDeque<u32>,
    window_len: usize,
}

impl Shortlist {
    /// For a chain that cuts to its `k` best after biasing `biased` and (with `window_len`
    /// Some) penalizing its last `window_len` accepted tokens; None when that needs more than
    /// `MAX_SHORTLIST` tokens or `k` is 0.
    pub fn new(k: usize, biased: &[i32], window_len: Option<usize>) -> Option<Self> {
        let mut fixed: Vec<u32> = biased
            .iter()
            .filter_map(|&t| u32::try_from(t).ok())
            .collect();
        fixed.sort_unstable();
        fixed.dedup();
        let needed = k
            .checked_add(fixed.len())?
            .checked_add(window_len.unwrap_or(0))?;
        if k == 0 || needed > MAX_SHORTLIST {
            return None;
        }
        Some(Self {
            k,
            biased: fixed,
            window: VecDeque::with_capacity(window_len.unwrap_or(0)),
            window_len: window_len.unwrap_or(0),
        })
    }

    /// How many tokens `candidates` lists at most, when that is the `k + m` best by raw logit
    /// alone (no penalty window, whose tokens could be anywhere): what the device can cut
    /// (`--backend-sampling`). None with a penalty window.
    pub fn len_without_window(&self) -> Option<usize> {
        (self.window_len == 0).then_some(self.k + self.biased.len())
    }

    /// Records a token the chain accepted (the penalty window moves on).
    pub fn accept(&mut self, token: i32) {
        let Ok(token) = u32::try_from(token) else {
            return;
        };
        if self.window_len == 0 {
            return;
        }
        if self.window.len() == self.window_len {
            self.window.pop_front();
        }
        self.window.push_back(token);
    }

    /// The tokens to hand the chain for these logits: the `k + m` best by raw logit and the
    /// `m` tokens the stages before the cut may change, without repeats.
    pub fn candidates(&self, logits: &[f32]) -> Vec<u32> {
        let n_vocab = u32::try_from(logits.len()).unwrap_or(u32::MAX);
        let mut changed: Vec<u32> = self
            .biased
            .iter()
            .copied()
            .chain(self.window.iter().copied())
            .filter(|&t| t < n_vocab)
            .collect();
        changed.sort_unstable();
        changed.dedup();
        let mut out = top_n(logits, self.k + changed.len());
        out.extend(changed);
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// Logits per block: the first pass keeps each block's largest.
const BLOCK: usize = 64;
/// Running maxima kept side by side while a block is scanned: independent lanes, which the
/// compiler turns into vector max instructions (one chain of scalar maxima would not be).
const LANES: usize = 16;

/// The largest logit of a block, NaN ignored (minus infinity for a block of NaN). The lanes
/// see whole chunks only (the remainder has a maximum of its own): a remainder folded into
/// them made LLVM keep the sixteen lanes as scalars and pack them into vectors again at every
/// chunk in one build (a third slower per token at `--null-decode`), where another build of the
/// same code, the function inlined, kept four vector registers.
#[inline]
fn block_max(block: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = block.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            // Not `f32::max`: a comparison keeps NaN out and maps onto one instruction.
            *lane = if v > *lane { v } else { *lane };
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    lanes
        .into_iter()
        .fold(tail, |m, v| if v > m { v } else { m })
}

/// Ranks a logit and its token: the larger logit first, then the lower id (as a sort of the
/// whole vocabulary by logit then id ranks them, so that greedy, the first best, picks the same
/// token from the list).
fn by_rank(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// The tokens of the `n` largest logits (NaN never among them; among equal logits the lowest
/// ids), in no particular order. Two passes: the largest logit of each block of 64 (a
/// vectorized scan, all the work that reads the whole row), whose `n`-th largest is a floor
/// under the `n`-th largest logit (`n` blocks each hold a logit at least that large); then only
/// the blocks that reach the floor are read again, and the logits at or above it ranked.
pub fn top_n(logits: &[f32], n: usize) -> Vec<u32> {
    if n == 0 {
        return Vec::new();
    }
    let maxima: Vec<f32> = logits.chunks(BLOCK).map(block_max).collect();
    let floor = if maxima.len() > n {
        let mut scratch = maxima.clone();
        *scratch
            .select_nth_unstable_by(n - 1, |a, b| b.total_cmp(a))
            .1
    } else {
        f32::NEG_INFINITY
    };
    let mut listed: Vec<(f32, u32)> = Vec::with_capacity(2 * n);
    for (b, _) in maxima.iter().enumerate().filter(|(_, &m)| m >= floor) {
        let start = b * BLOCK;
        let block = &logits[start..logits.len().min(start + BLOCK)];
        for (j, &v) in block.iter().enumerate() {
            // NaN compares false: never listed.
            if v >= floor {
                if let Ok(token) = u32::try_from(start + j) {
                    listed.push((v, token));
                }
            }
        }
    }
    if listed.len() > n {
        listed.select_nth_unstable_by(n - 1, by_rank);
        listed.truncate(n);
    }
    listed.into_iter().map(|(_, token)| token).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The chain's cut on the whole vocabulary: the `k` best after `adjust` (a change to some
    /// tokens' logits), as a set.
    fn cut_full(logits: &[f32], adjust: &[(u32, f32)], k: usize) -> Vec<u32> {
        cut(logits, (0..logits.len() as u32).collect(), adjust, k)
    }

    fn cut(logits: &[f32], tokens: Vec<u32>, adjust: &[(u32, f32)], k: usize) -> Vec<u32> {
        let mut scored: Vec<(f32, u32)> = tokens
            .into_iter()
            .map(|t| {
                let change = adjust
                    .iter()
                    .find(|(a, _)| *a == t)
                    .map_or(0.0, |&(_, d)| d);
                (logits[t as usize] + change, t)
            })
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut kept: Vec<u32> = scored.into_iter().take(k).map(|(_, t)| t).collect();
        kept.sort_unstable();
        kept
    }

    #[test]
    fn top_n_finds_the_largest() {
        let logits = [0.5, -1.0, 3.0, 2.0, f32::NAN, 2.5, -7.0];
        let mut got = top_n(&logits, 3);
        got.sort_unstable();
        assert_eq!(got, vec![2, 3, 5]);
        assert_eq!(top_n(&logits, 0), Vec::<u32>::new());
        let mut all = top_n(&logits, 10);
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3, 5, 6], "NaN is never chosen");
    }

    #[test]
    fn ties_keep_the_lowest_ids() {
        // Greedy with a bias on token 9 (k = 1, one changed token): tokens 5 and 7 tie below
        // 9; the whole vocabulary's first best after a ban of 9 is 5, so 5 must be kept.
        let mut logits = vec![0.0_f32; 12];
        logits[5] = 3.0;
        logits[7] = 3.0;
        logits[9] = 4.0;
        let mut got = top_n(&logits, 2);
        got.sort_unstable();
        assert_eq!(got, vec![5, 9]);
        let mut flat = top_n(&[1.0; 200], 3);
        flat.sort_unstable();
        assert_eq!(flat, vec![0, 1, 2]);
    }

    #[test]
    fn too_many_changed_tokens_means_no_shortlist() {
        assert!(Shortlist::new(40, &[1, 2], Some(64)).is_some());
        assert!(Shortlist::new(0, &[], None).is_none());
        assert!(Shortlist::new(40, &[], Some(MAX_SHORTLIST)).is_none());
        assert!(Shortlist::new(MAX_SHORTLIST + 1, &[], None).is_none());
    }

    #[test]
    fn the_window_keeps_the_last_tokens_accepted() {
        let mut s = Shortlist::new(1, &[], Some(2)).expect("fits");
        for t in [5, 6, 7] {
            s.accept(t);
        }
        let logits = vec![0.0_f32; 10];
        let c = s.candidates(&logits);
        assert!(c.contains(&6) && c.contains(&7), "{c:?}");
        // k + 2 changed = 3 best raw (all equal here) plus the window: at most 5.
        assert!(c.len() <= 5, "{c:?}");
    }

    proptest! {
        /// Whatever the stages before the cut do to the biased and windowed tokens (raise them,
        /// lower them, ban them), the cut over the shortlist keeps what the cut over the whole
        /// vocabulary keeps, token for token. Logits are drawn from a coarse grid so that ties
        /// happen; both cuts rank equal logits by id, as greedy's first best does.
        #[test]
        fn the_shortlist_holds_the_chains_cut(
            logits in prop::collection::vec((-40i32..40).prop_map(|x| x as f32 / 4.0), 1..600),
            k in 1usize..50,
            biased in prop::collection::vec(0u32..700, 0..6),
            window in prop::collection::vec(0u32..700, 0..40),
            window_len in 0usize..40,
            changes in prop::collection::vec(prop_oneof![
                (-20i32..20).prop_map(|x| x as f32 / 2.0),
                Just(f32::NEG_INFINITY),
            ], 46),
        ) {
            let n = logits.len() as u32;
            let biased: Vec<i32> = biased.into_iter().map(|t| t as i32).collect();
            let mut s = Shortlist::new(k, &biased, Some(window_len)).expect("small");
            for &t in &window {
                s.accept(t as i32);
            }
            let in_window: Vec<u32> = window[window.len().saturating_sub(window_len)..].to_vec();
            // The tokens the earlier stages may change, each with a change.
            let mut touched: Vec<u32> = biased.iter().map(|&t| t as u32).chain(in_window).filter(|&t| t < n).collect();
            touched.sort_unstable();
            touched.dedup();
            let adjust: Vec<(u32, f32)> = touched.iter().zip(changes.iter().cycle()).map(|(&t, &d)| (t, d)).collect();
            let short = s.candidates(&logits);
            prop_assert!(short.len() <= k + 2 * touched.len());
            prop_assert!(short.iter().all(|&t| t < n));
            // The same tokens, ties included (both cuts rank equal logits by id).
            let full = cut_full(&logits, &adjust, k);
            let listed = cut(&logits, short, &adjust, k);
            prop_assert_eq!(full, listed);
        }

        /// Rows of a real vocabulary's length: ties (a coarse grid), NaN and minus infinity,
        /// and the same tokens as a sort by logit then id, whatever `n`.
        #[test]
        fn top_n_takes_the_sorts_first_tokens_on_long_rows(
            grid in prop::collection::vec(prop_oneof![
                8 => (-64i32..64).prop_map(|x| x as f32 / 8.0),
                1 => Just(f32::NAN),
                1 => Just(f32::NEG_INFINITY),
            ], 1..5000),
            n in 1usize..400,
        ) {
            let mut got = top_n(&grid, n);
            got.sort_unstable();
            let mut ranked: Vec<(f32, u32)> = grid
                .iter()
                .enumerate()
                .filter(|(_, v)| !v.is_nan())
                .map(|(i, &v)| (v, i as u32))
                .collect();
            ranked.sort_by(by_rank);
            let mut want: Vec<u32> = ranked.into_iter().take(n).map(|(_, t)| t).collect();
            want.sort_unstable();
            prop_assert_eq!(got, want);
        }

        #[test]
        fn top_n_matches_a_sort(
            logits in prop::collection::vec(-1000.0f32..1000.0, 0..700),
            n in 0usize..80,
        ) {
            let mut got: Vec<f32> = top_n(&logits, n).into_iter().map(|t| logits[t as usize]).collect();
            got.sort_by(|a, b| b.total_cmp(a));
            let mut want = logits.clone();
            want.sort_by(|a, b| b.total_cmp(a));
            want.truncate(n);
            prop_assert_eq!(got, want);
        }
    }
}
