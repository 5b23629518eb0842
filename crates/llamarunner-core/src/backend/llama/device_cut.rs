//! `--backend-sampling`: the best logits of a sequence's positions cut on the device. A request
//! whose chain needs only the `k` best raw logits of a position (`ChainSampler::device_cut`: its
//! first cut a top-k or greedy, nothing changed before it but bans, no log-probabilities) has a
//! llama.cpp sampler chain of one top-k attached to its sequence id (`llama_set_sampler`).
//! llama.cpp then computes that top-k in the decode's own graph, on the device of the model's
//! output layer, and copies back its candidates (ids and logits) per position instead of the
//! whole vocabulary's logits (262,144 floats, 1 MiB, per position for Gemma 3: at 64
//! sequences, 64 MiB from the GPU per step). The rest of the chain (its own top-k, temperature,
//! top-p, min-p, the draw) runs on the host on those candidates, as it runs on the shortlist
//! (`backend/shortlist.rs`), so the tokens are those sampled without it.
//!
//! Every attach or detach makes llama.cpp build its scheduler and reserve its graphs again
//! (milliseconds), so both are kept rare:
//! - a chain cuts one of a few widths (`width`: 64, 128, 256 or `MAX_SHORTLIST`, the most any
//!   shortlist holds), at least what its request's shortlist holds: the chain's own top-k then
//!   keeps its `k` of them, and the next request on the slot finds a chain wide enough already
//!   there (a wider one serves too: it cuts more than that request needs);
//! - a slot left without a request keeps its chain for `IDLE_DECODES` decodes (the next request
//!   usually comes sooner) and then loses it: llama.cpp runs every attached chain at every
//!   decode, on a dummy row when its sequence is not in the batch;
//! - a sequence whose positions must come back whole (its request reads every logit, or it
//!   drafts: llama.cpp cuts one position per sequence and decode) has its chain detached before
//!   its decode.
//!
//! A device that cannot run the top-k is not refused by llama.cpp: it copies the whole row as
//! the chain's output, without candidates. The first such row (`row`) stops the cuts: every
//! chain is detached and none attached again, with a warning.

use std::cell::Cell;
use std::collections::HashMap;

use llama_cpp_sys_2 as sys;

use crate::backend::shortlist::MAX_SHORTLIST;

/// The narrowest cut: OpenAI's and llama-server's top-k 40, with room for a few bans.
const NARROWEST: usize = 64;

/// Decodes a slot without a request keeps its chain.
const IDLE_DECODES: u64 = 256;

/// What a slot's next decode needs of its positions' logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Need {
    /// No request holds the slot.
    Idle,
    /// Every logit (log-probabilities, penalties, a grammar, drafts ...).
    Whole,
    /// The best `n` only (`ChainSampler::device_cut`): a cut at least that wide serves.
    Cut(usize),
}

/// The width of the cut that serves a request needing its best `n`: the next of 64, 128, 256
/// and `MAX_SHORTLIST` (no shortlist holds more), and no more than the vocabulary's `n_vocab`.
pub(super) fn width(n: usize, n_vocab: usize) -> usize {
    n.max(NARROWEST)
        .next_power_of_two()
        .min(MAX_SHORTLIST)
        .min(n_vocab)
        .max(1)
}

/// A sequence's attached chain (owned here: llama.cpp only points at it), its width and the
/// decode at which a request last wanted it.
struct Attached {
    chain: *mut sys::llama_sampler,
    width: usize,
    wanted_at: u64,
}

/// The chains attached to a context's sequences.
pub(super) struct DeviceCuts {
    ctx: *mut sys::llama_context,
    n_vocab: usize,
    attached: HashMap<i32, Attached>,
    /// Decodes of the context so far.
    decodes: u64,
    /// No cut is attached again: the device did not cut (`row` found a whole row).
    refused: bool,
    /// Set by `row` when a chain's output was a whole row: the device cannot run the top-k.
    uncut: Cell<bool>,
    /// A chain was attached once (the first is logged).
    attached_once: bool,
}

impl DeviceCuts {
    /// Cuts for the sequences of `ctx` (the engine's main context, which outlives this), of a
    /// model with `n_vocab` tokens.
    pub(super) fn new(ctx: *mut sys::llama_context, n_vocab: i32) -> Self {
        Self {
            ctx,
            n_vocab: usize::try_from(n_vocab).unwrap_or(0),
            attached: HashMap::new(),
            decodes: 0,
            refused: false,
            uncut: Cell::new(false),
            attached_once: false,
        }
    }

    /// A decode of the context is about to run (after the slots were bound).
    pub(super) fn decoding(&mut self) {
        self.decodes += 1;
    }

    /// Slot `seq`'s next decode needs `need` of its positions' logits: its chain is attached,
    /// kept or detached accordingly. Changes nothing when the chain there serves.
    pub(super) fn bind(&mut self, seq: i32, need: Need) {
        if self.uncut.get() && !self.refused {
            self.refuse();
        }
        let now = self.decodes;
        let need = match need {
            Need::Cut(n) => Need::Cut(width(n, self.n_vocab)),
            other => other,
        };
        let held = self.attached.get(&seq).map(|a| (a.width, a.wanted_at));
        match decide(held, need, now, self.refused) {
            Action::Keep => {}
            Action::Touch => {
                if let Some(a) = self.attached.get_mut(&seq) {
                    a.wanted_at = now;
                }
            }
            Action::Attach(width) => {
                self.detach(seq);
                self.attach(seq, width);
            }
            Action::Detach => self.detach(seq),
        }
    }

    fn attach(&mut self, seq: i32, width: usize) {
        let Ok(k) = i32::try_from(width) else {
            return;
        };
        // SAFETY: a new chain owns the top-k added to it; llama_set_sampler keeps the chain's
        // pointer while it is attached (it is freed here only after being detached).
        unsafe {
            let chain = sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params());
            sys::llama_sampler_chain_add(chain, sys::llama_sampler_init_top_k(k));
            if !sys::llama_set_sampler(self.ctx, seq, chain) {
                sys::llama_sampler_free(chain);
                self.refuse();
                return;
            }
            self.attached.insert(
                seq,
                Attached {
                    chain,
                    width,
                    wanted_at: self.decodes,
                },
            );
        }
        if !self.attached_once {
            self.attached_once = true;
            tracing::info!(
                k,
                slot = seq,
                "--backend-sampling: the first top-k cut is attached; a position of a sequence that needs only its best logits brings back k candidates"
            );
        }
    }

    fn detach(&mut self, seq: i32) {
        if let Some(old) = self.attached.remove(&seq) {
            // SAFETY: `ctx` is live; detaching (a null sampler) makes llama.cpp forget the
            // pointer (it reserves its graphs again before the next decode) before the chain
            // it pointed at is freed.
            unsafe {
                sys::llama_set_sampler(self.ctx, seq, std::ptr::null_mut());
                sys::llama_sampler_free(old.chain);
            }
        }
    }

    /// No cut again: every chain is detached.
    fn refuse(&mut self) {
        self.stop();
        tracing::warn!(
            "--backend-sampling: the device of the model's output layer does not cut a top-k; every position's logits come back whole"
        );
    }

    fn stop(&mut self) {
        self.refused = true;
        let seqs: Vec<i32> = self.attached.keys().copied().collect();
        for seq in seqs {
            self.detach(seq);
        }
    }

    /// A decode threw (`guarded_decode.rs`: llama.cpp could not reserve its compute graph,
    /// `why`). If chains were attached, they made the graph larger than the one reserved at
    /// load: the cuts stop (every chain detached, none attached again) and this says true (the
    /// batch can be decoded again without them).
    pub(super) fn give_up(&mut self, why: &str) -> bool {
        if self.attached.is_empty() {
            return false;
        }
        self.stop();
        tracing::warn!(
            error = why,
            "--backend-sampling: off; with the top-k cuts attached llama.cpp could not reserve its compute graph (device memory?), so every position's logits come back whole"
        );
        true
    }

    /// The candidates the device cut for batch position `index` of the last decode: their ids
    /// and raw logits. None when that position has none: its sequence has no chain attached,
    /// or the device did not cut (its whole row came back as the chain's output, which the
    /// whole-row read then returns; the next bind stops the cuts).
    pub(super) fn row(&self, index: i32) -> Option<(&[i32], &[f32])> {
        // SAFETY: `ctx` is live and its last decode is done (these calls wait for it); the
        // rows stay until the next decode, which `&self` (borrowed from the engine) keeps
        // from running while they are read. The counts bound what is read of each row: a row
        // holds as many floats as the vocabulary, of which llama.cpp wrote the count.
        unsafe {
            let n = sys::llama_get_sampled_logits_count_ith(self.ctx, index);
            if n == 0 {
                return None;
            }
            let m = sys::llama_get_sampled_candidates_count_ith(self.ctx, index);
            if m != n {
                // A chain ran without cutting (or a decode without chains: then no count is
                // kept and the logits' is the vocabulary's, with no candidates).
                if m == 0 && !self.attached.is_empty() {
                    self.uncut.set(true);
                }
                return None;
            }
            let logits = sys::llama_get_sampled_logits_ith(self.ctx, index);
            let ids = sys::llama_get_sampled_candidates_ith(self.ctx, index);
            if logits.is_null() || ids.is_null() {
                return None;
            }
            let n = usize::try_from(n).ok()?;
            Some((
                std::slice::from_raw_parts(ids, n),
                std::slice::from_raw_parts(logits, n),
            ))
        }
    }
}

/// What `bind` does to a slot's chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Keep,
    /// Keep it, wanted now.
    Touch,
    /// Attach one of this width (in place of a narrower one).
    Attach(usize),
    Detach,
}

/// What `bind` does for a slot whose chain has width `held.0` and was last wanted at decode
/// `held.1` (None: it has none) when its next decode (`now`) needs `need` (a cut's width
/// already chosen): a chain is attached for a cut (unless the cuts were refused) and kept for
/// any cut no wider, replaced by a wider one only for a wider cut; kept while its slot has been
/// idle for at most `IDLE_DECODES` decodes; detached for a sequence that needs its whole rows
/// or once that idle time is over.
fn decide(held: Option<(usize, u64)>, need: Need, now: u64, refused: bool) -> Action {
    match (held, need) {
        (Some((width, _)), Need::Cut(n)) if n <= width => Action::Touch,
        (_, Need::Cut(n)) if !refused => Action::Attach(n),
        (Some((_, at)), Need::Idle) if now.saturating_sub(at) <= IDLE_DECODES => Action::Keep,
        (Some(_), _) => Action::Detach,
        (None, _) => Action::Keep,
    }
}

impl Drop for DeviceCuts {
    fn drop(&mut self) {
        // The context is gone by now (the engine declares it first, so drops it first) and
        // never reads its samplers when freed: only the chains are freed.
        for (_, a) in self.attached.drain() {
            // SAFETY: each chain was made here and is freed once.
            unsafe { sys::llama_sampler_free(a.chain) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plays `needs` (decode, need) on a slot whose chain is `held` (width, last wanted): the
    /// attaches and detaches made.
    fn play(
        needs: &[(u64, Need)],
        refused: bool,
        held: &mut Option<(usize, u64)>,
    ) -> Vec<(u64, Action)> {
        let mut changes = Vec::new();
        for &(now, need) in needs {
            let action = decide(*held, need, now, refused);
            match action {
                Action::Attach(width) => *held = Some((width, now)),
                Action::Touch => *held = held.map(|(w, _)| (w, now)),
                Action::Detach => *held = None,
                Action::Keep => {}
            }
            if !matches!(action, Action::Keep | Action::Touch) {
                changes.push((now, action));
            }
        }
        changes
    }

    /// A slot's chain over a run of requests: attached once for the first request that wants
    /// a cut, kept through the gaps between requests and for the next request whose cut is no
    /// wider, widened for a wider one, detached for a request that reads every logit or after
    /// `IDLE_DECODES` idle decodes, never attached once refused.
    #[test]
    fn a_chain_is_attached_and_detached_rarely() {
        let mut held = None;
        // Two requests that want a 64-wide cut, two idle decodes between them: one attach;
        // a narrower need is served by it; a wider one widens it, and the narrower after
        // keeps the wide one.
        let mut changes = play(
            &[
                (1, Need::Cut(64)),
                (2, Need::Cut(64)),
                (3, Need::Idle),
                (4, Need::Idle),
                (5, Need::Cut(64)),
                (6, Need::Cut(1)),
                (7, Need::Cut(128)),
                (8, Need::Cut(64)),
            ],
            false,
            &mut held,
        );
        // A request that reads every logit: detached, then attached again for the next cut.
        changes.extend(play(
            &[(9, Need::Whole), (10, Need::Whole), (11, Need::Cut(64))],
            false,
            &mut held,
        ));
        // Idle for IDLE_DECODES decodes: kept; one more: detached; idle after: nothing.
        changes.extend(play(
            &[
                (11 + IDLE_DECODES, Need::Idle),
                (12 + IDLE_DECODES, Need::Idle),
                (13 + IDLE_DECODES, Need::Idle),
            ],
            false,
            &mut held,
        ));
        assert_eq!(
            changes,
            vec![
                (1, Action::Attach(64)),
                (7, Action::Attach(128)),
                (9, Action::Detach),
                (11, Action::Attach(64)),
                (12 + IDLE_DECODES, Action::Detach),
            ]
        );
        // Refused: a cut is never attached.
        let mut none = None;
        assert!(play(&[(1, Need::Cut(64)), (2, Need::Cut(64))], true, &mut none).is_empty());
        assert_eq!(decide(None, Need::Whole, 5, false), Action::Keep);
    }

    /// Widths: the next of 64, 128, 256, 320, never more than the vocabulary, at least the
    /// need (a shortlist holds at most 320).
    #[test]
    fn a_cut_is_one_of_a_few_widths_at_least_the_need() {
        assert_eq!(width(1, 262_144), 64);
        assert_eq!(width(43, 262_144), 64);
        assert_eq!(width(65, 262_144), 128);
        assert_eq!(width(200, 262_144), 256);
        assert_eq!(width(300, 262_144), 320);
        assert_eq!(width(320, 262_144), 320);
        assert_eq!(width(43, 50), 50);
        for n in 1..=MAX_SHORTLIST {
            assert!(width(n, 262_144) >= n);
        }
    }
}
