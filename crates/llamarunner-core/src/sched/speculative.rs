//! Speculative decoding by prompt lookup, inside the continuous batching.
//!
//! For a generating sequence, the scheduler looks up its last few tokens earlier in its own
//! prompt and output; when they occurred before, the tokens that followed them then are
//! proposed as a draft of what comes next. The draft goes into the same decode batch as the
//! sequence's next token (and every other sequence's tokens), each drafted position with its
//! own logits. The sampler then samples position after position exactly as it would without a
//! draft, and a drafted token is kept only while it is the token the sampler chose: the output
//! is the output without speculation, token for token, whatever the sampler (for sampling too,
//! as the sampler draws each token from the same distribution). The cells of the rejected
//! positions are removed from the KV cache. Each accepted token is a decode step saved.
//!
//! The draft positions count against the batch budget like any token, after every generating
//! sequence's next token and within the places kept for them, so prompts being prefilled and
//! other sequences are never starved.
//!
//! How much is drafted adapts to what drafting pays (`adaptive.rs`).

use std::time::Instant;

use super::adaptive::{match_class, Acceptance, StepCost};
use super::{Phase, Scheduler};
use crate::backend::Backend;
use crate::protocol::{DoneReason, Token};

/// The server's speculation settings (`--draft-max`, `--draft-min`, `--spec-ngram`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecConfig {
    /// Most tokens drafted per sequence and step; 0 turns speculation off for everyone.
    pub draft_max: usize,
    /// Fewest tokens worth drafting: a shorter proposal is not verified.
    pub draft_min: usize,
    /// Longest lookup: the last `ngram` tokens are searched for first, then shorter tails
    /// down to 2 tokens (1 when `ngram` is 1).
    pub ngram: usize,
    /// What a step costs (measured at load), which decides how much is worth drafting.
    pub cost: StepCost,
    /// Whether the cost is refined from the steps' decode times (`CostModel`); off for the
    /// fake backend, whose steps take no time.
    pub measure: bool,
    /// Verify every draft found, whatever it costs (`--draft-always`): no adaptation.
    pub always: bool,
}

impl SpecConfig {
    /// Speculation off.
    pub const OFF: SpecConfig = SpecConfig {
        draft_max: 0,
        draft_min: 0,
        ngram: 3,
        cost: StepCost::FREE,
        measure: false,
        always: false,
    };

    /// Whether a request with these parameters gets drafts: as it asks (`speculative`), else
    /// for greedy requests only (sampled text repeats its context less, and its drafts are
    /// accepted less often).
    pub fn enabled_for(&self, params: &crate::protocol::params::SamplingParams) -> bool {
        self.draft_max > 0 && params.speculative.unwrap_or_else(|| params.greedy())
    }
}

/// A sequence's speculation: its draft for this step and its counts.
#[derive(Debug)]
pub(super) struct SpecState {
    /// Drafts are made for it.
    pub enabled: bool,
    /// Tokens drafted after its next token in the batch being built.
    pub draft: Vec<Token>,
    /// In a step where it does not draft, its lookup's guess of the token after its next one,
    /// checked when that token is sampled (`Acceptance::guessed`).
    pub guess: Option<Token>,
    /// The match class of this step's lookup (`adaptive::match_class`).
    pub class: usize,
    /// Tokens drafted so far.
    pub drafted: usize,
    /// Drafted tokens the sampler agreed with.
    pub accepted: usize,
    /// How often its drafts are accepted lately (how much it may draft).
    pub adapt: Acceptance,
}

impl SpecState {
    /// The state of a new sequence; `lookup`: its drafts are lookups (else a draft model's).
    pub fn new(enabled: bool, lookup: bool) -> Self {
        Self {
            enabled,
            draft: Vec::new(),
            guess: None,
            class: 0,
            drafted: 0,
            accepted: 0,
            adapt: Acceptance::new(lookup),
        }
    }
}

/// How many of a sequence's latest tokens a draft lookup searches.
pub const LOOKBACK: usize = 4096;

/// How far back a lookup's match is followed to tell how much context it shares.
pub const MATCH_CAP: usize = 16;

/// Proposes up to `max` tokens to follow `history ++ [last]`: the tokens that followed the most
/// recent earlier occurrence of its last `n` tokens (`n` from `ngram` down to 2, or 1 when
/// `ngram` is 1; the longest that matches wins). A match whose continuation runs into the end
/// of the history (a loop) is continued periodically. Appends to `out`. Returns how many tokens
/// before the proposal the occurrence shares with the end of the history (`n`, extended back as
/// far as they agree, up to `MATCH_CAP`): a long shared context (copied text) is a surer draft
/// than a common pair of tokens. 0 when nothing is proposed.
///
/// One backward pass over the history finds every length at once: each earlier `last` is an
/// occurrence of as many tail tokens as agree before it, and the first (latest) position to
/// reach a length is the one that length proposes. The pass looks for `last` eight tokens at a
/// time: a full window with no match costs well under a microsecond, forty times less or more
/// than a search per length did (benches/RESULTS.md, session 33), and the lookups run on the
/// engine thread between two decodes, for every drafting sequence.
/// `proposes_what_a_search_per_length_does` checks it against that search.
pub fn propose(
    history: &[Token],
    last: Token,
    ngram: usize,
    max: usize,
    out: &mut Vec<Token>,
) -> usize {
    // Only the latest LOOKBACK tokens are searched, so that the scan does not grow with the
    // context.
    let history = &history[history.len().saturating_sub(LOOKBACK)..];
    if max == 0 || ngram == 0 || history.is_empty() {
        return 0;
    }
    let shortest = if ngram == 1 { 1 } else { 2 };
    let longest = ngram.min(history.len());
    // The tail is `history[h - (n - 1)..] ++ [last]`, with `h` the history's length; an
    // occurrence of it ends at `end <= h - 1` (it may overlap the tail).
    let h = history.len();
    // (length, end) of the longest occurrence, the latest among equally long ones.
    let mut best = (0, 0);
    let mut before = h;
    while let Some(end) = rfind(&history[..before], last) {
        before = end;
        let mut n = 1;
        while n < longest && n <= end && history[end - n] == history[h - n] {
            n += 1;
        }
        if n > best.0 {
            best = (n, end);
            if n == longest {
                break;
            }
        }
    }
    let (n, end) = best;
    if n < shortest {
        return 0;
    }
    // The sequence `history ++ [last]`, `len` long; the proposal copies what followed the
    // occurrence, then itself where that runs past the end.
    let len = h + 1;
    let at = |i: usize| -> Token {
        if i < h {
            history[i]
        } else {
            last
        }
    };
    let s = end + 1 - n;
    let start = out.len();
    for i in 0..max {
        let src = s + n + i;
        let token = if src < len {
            at(src)
        } else {
            out[start + src - len]
        };
        out.push(token);
    }
    // The occurrence ends at `s + n - 1`, the history at `len - 1`: extend back while the
    // tokens before them agree.
    let mut shared = n;
    while shared < MATCH_CAP.max(n)
        && shared < s + n
        && at(s + n - 1 - shared) == at(len - 1 - shared)
    {
        shared += 1;
    }
    shared
}

/// The index of the last `token` in `tokens`. Eight tokens are compared at a time without an
/// early exit, which the compiler turns into vector compares (a plain `rposition` compares one
/// token per iteration).
fn rfind(tokens: &[Token], token: Token) -> Option<usize> {
    let mut end = tokens.len();
    while end >= 8 {
        let chunk = &tokens[end - 8..end];
        if chunk.iter().fold(false, |any, &t| any | (t == token)) {
            return chunk.iter().rposition(|&t| t == token).map(|k| end - 8 + k);
        }
        end -= 8;
    }
    tokens[..end].iter().rposition(|&t| t == token)
}

impl<B: Backend> Scheduler<B> {
    /// Whether this step's `placed` generating sequences may draft: always where step costs
    /// are not measured (the fake backend) or drafts are verified whatever they cost
    /// (`--draft-always`), else as `payoff` judges from the steps run. Asked once per step in
    /// which some placed sequence could draft (`step_judged`), so that only such steps count.
    pub(super) fn drafts_pay(&mut self, placed: usize) -> bool {
        self.step_judged = false;
        let cfg = self.speculation;
        if !cfg.measure || cfg.always || cfg.draft_max == 0 || placed == 0 {
            return true;
        }
        let could_draft = self
            .slots
            .iter()
            .filter_map(|s| s.seq.as_ref())
            .any(|seq| seq.spec.enabled && seq.phase == Phase::Decode && seq.queued == 1);
        if !could_draft {
            return true;
        }
        self.step_judged = true;
        self.payoff.verdict(placed) == super::payoff::Verdict::Draft
    }

    /// Drafts for the generating sequences that got a place in this step's batch (`placed` of
    /// them), within `budget` batch places; returns the places used. With a draft model the
    /// drafts are its (`draft.rs`); else each sequence's lookup proposes what it can, and
    /// drafted positions are kept, most likely first, as many as pay best (`draft_count`). A
    /// sequence that proposed but drafts nothing keeps its proposal's first token as a guess.
    pub(super) fn place_drafts(&mut self, budget: usize, placed: usize) -> usize {
        if self.backend.has_draft_model() {
            return self.place_model_drafts(budget, placed);
        }
        let ngram = self.speculation.ngram;
        let lengths = self.draft_lengths(budget, placed, true, |i, max, s| {
            let slot = &mut s.slots[i];
            let Some(seq) = slot.seq.as_mut() else {
                return (0, 0);
            };
            let Some(&last) = seq.pending.first() else {
                return (0, 0);
            };
            let shared = propose(&slot.cached, last, ngram, max, &mut seq.spec.draft);
            // Image positions (`protocol::vision`) are no tokens to draft.
            if let Some(cut) = seq.spec.draft.iter().position(|&t| t < 0) {
                seq.spec.draft.truncate(cut);
            }
            (seq.spec.draft.len(), match_class(shared))
        });
        let mut keep = vec![0usize; self.slots.len()];
        for (i, n) in lengths {
            keep[i] = n;
        }
        let mut used = 0;
        for (slot, &n) in self.slots.iter_mut().zip(&keep) {
            if let Some(seq) = slot.seq.as_mut() {
                if n == 0 {
                    seq.spec.guess = seq.spec.draft.first().copied();
                }
                seq.spec.draft.truncate(n);
                used += seq.spec.draft.len();
            }
        }
        used
    }

    /// Samples the sequence in slot `index` at batch index `at` (its next token's logits), then
    /// at each drafted position while the sampler agrees with the draft; removes the rejected
    /// positions from the cache. Returns why the sequence ends, if it does.
    pub(super) fn sample_drafted(
        &mut self,
        index: usize,
        at: usize,
        now: Instant,
    ) -> Option<DoneReason> {
        let draft = match self.slots[index].seq.as_mut() {
            Some(seq) => std::mem::take(&mut seq.spec.draft),
            None => return None,
        };
        if draft.is_empty() {
            let reason = self.sample_one(index, at, now);
            if let Some(seq) = self.slots[index].seq.as_mut() {
                // The sampled token is the last pending one (after a context shift that
                // could not be done in place, the kept tokens come before it).
                if let Some(guess) = seq.spec.guess.take() {
                    let class = seq.spec.class;
                    seq.spec
                        .adapt
                        .guessed(class, seq.pending.last() == Some(&guess));
                }
            }
            return reason;
        }
        let mut accepted = 0;
        let mut reason = None;
        for j in 0..=draft.len() {
            reason = self.sample_one(index, at + j, now);
            if reason.is_some() {
                break;
            }
            let slot = &mut self.slots[index];
            let Some(seq) = slot.seq.as_mut() else {
                break;
            };
            match draft.get(j) {
                // The sampled token is the drafted one, already decoded at the next position.
                Some(&d) if seq.phase == Phase::Decode && seq.pending == [d] => {
                    seq.pending.clear();
                    slot.cached.push(d);
                    accepted += 1;
                }
                _ => break,
            }
        }
        let slot = &mut self.slots[index];
        if let Some(seq) = slot.seq.as_mut() {
            seq.spec.drafted += draft.len();
            seq.spec.accepted += accepted;
            self.step_accepted += accepted;
            seq.spec.adapt.record(seq.spec.class, draft.len(), accepted);
            self.observer.speculated(draft.len(), accepted);
            if accepted < draft.len() && !self.backend.kv_truncate(slot.id, slot.cached.len()) {
                // The cache lost cells the next position needs (a sliding window): decode
                // what the slot held again, as after a context shift that cannot be done in
                // place.
                seq.span.in_scope(|| {
                    tracing::debug!(
                        slot = slot.id,
                        "a draft's cut lost the window; decoding again"
                    );
                });
                self.backend.kv_truncate(slot.id, 0);
                if reason.is_none() {
                    let mut all = std::mem::take(&mut slot.cached);
                    all.append(&mut seq.pending);
                    seq.pending = all;
                    seq.phase = Phase::Redecode;
                }
                slot.cached.clear();
            }
        }
        reason
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(history: &[Token], last: Token, ngram: usize, max: usize) -> Vec<Token> {
        let mut out = Vec::new();
        propose(history, last, ngram, max, &mut out);
        out
    }

    #[test]
    fn the_latest_longest_match_gives_what_followed_it() {
        // "a b c d | x b c e | ... b c" : the tail "b c" last occurred before "e".
        let h = [1, 2, 3, 4, 9, 2, 3, 5, 7, 7, 2];
        assert_eq!(lookup(&h, 3, 3, 4), vec![5, 7, 7, 2]);
        // A longer tail that matches wins over a later shorter one: "1 2 3" -> 4.
        let h = [1, 2, 3, 4, 8, 2, 3, 6, 1, 2];
        assert_eq!(lookup(&h, 3, 3, 2), vec![4, 8]);
        // Capped at `max`.
        assert_eq!(lookup(&h, 3, 3, 1), vec![4]);
    }

    #[test]
    fn a_match_reports_the_context_it_shares() {
        let shared = |history: &[Token], last: Token| propose(history, last, 3, 2, &mut Vec::new());
        // "9 1 2 3 4 ... 9 1 2" + 3: the tail "1 2 3" and the "9" before it agree: 4.
        assert_eq!(shared(&[9, 1, 2, 3, 4, 5, 9, 1, 2], 3), 4);
        // Only the pair "2 3" agrees (a 3-gram "1 2 3" did not occur): 2.
        assert_eq!(shared(&[7, 2, 3, 4, 5, 1, 2], 3), 2);
        // A long copied stretch stops at MATCH_CAP.
        let mut h: Vec<Token> = (0..40).collect();
        h.extend(0..39);
        assert_eq!(shared(&h, 39), MATCH_CAP);
        // No match: 0.
        assert_eq!(shared(&[1, 2, 3], 4), 0);
    }

    #[test]
    fn a_loop_is_continued_past_the_end_of_the_history() {
        // Period 3: "1 2 3 1 2 3 1 2" + 3 -> 1 2 3 1 2 ...
        let h = [1, 2, 3, 1, 2, 3, 1, 2];
        assert_eq!(lookup(&h, 3, 3, 7), vec![1, 2, 3, 1, 2, 3, 1]);
        // A single repeated token.
        assert_eq!(lookup(&[5, 5], 5, 2, 4), vec![5, 5, 5, 5]);
    }

    #[test]
    fn no_match_or_nothing_asked_drafts_nothing() {
        assert!(lookup(&[1, 2, 3, 4], 5, 3, 8).is_empty());
        assert!(lookup(&[], 5, 3, 8).is_empty());
        assert!(lookup(&[1, 2, 1], 2, 3, 0).is_empty());
        assert!(lookup(&[1, 2, 1], 2, 0, 4).is_empty());
        // Single tokens are matched only when asked for (`ngram` 1).
        assert!(lookup(&[7, 1, 8], 7, 3, 2).is_empty());
        assert_eq!(lookup(&[7, 1, 8], 7, 1, 2), vec![1, 8]);
    }

    /// The search this module did before `propose`'s single pass: for each length from the
    /// longest, the latest start whose tokens equal the tail's.
    fn propose_per_length(
        history: &[Token],
        last: Token,
        ngram: usize,
        max: usize,
        out: &mut Vec<Token>,
    ) -> usize {
        let history = &history[history.len().saturating_sub(LOOKBACK)..];
        let len = history.len() + 1;
        let at = |i: usize| if i < history.len() { history[i] } else { last };
        if max == 0 || ngram == 0 {
            return 0;
        }
        let shortest = if ngram == 1 { 1 } else { 2 };
        for n in (shortest..=ngram.min(len - 1)).rev() {
            let tail = len - n;
            let Some(s) = (0..tail)
                .rev()
                .find(|&s| (0..n).all(|k| at(s + k) == at(tail + k)))
            else {
                continue;
            };
            let start = out.len();
            for i in 0..max {
                let src = s + n + i;
                out.push(if src < len {
                    at(src)
                } else {
                    out[start + src - len]
                });
            }
            let mut shared = n;
            while shared < MATCH_CAP.max(n)
                && shared < s + n
                && at(s + n - 1 - shared) == at(len - 1 - shared)
            {
                shared += 1;
            }
            return shared;
        }
        0
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(4000))]
        /// Small vocabularies repeat n-grams often, and long histories cross LOOKBACK.
        #[test]
        fn proposes_what_a_search_per_length_does(
            vocab in 1i32..8,
            seed in proptest::collection::vec(0i32..1000, 0..60),
            long in proptest::bool::weighted(0.05),
            last in 0i32..8,
            ngram in 0usize..6,
            max in 0usize..10,
        ) {
            let mut history: Vec<Token> = seed.iter().map(|t| t % vocab).collect();
            if long {
                // Past LOOKBACK: a match only before the window must not be found.
                let mut far = history.clone();
                far.extend(std::iter::repeat_n(vocab + 1, LOOKBACK));
                far.extend_from_slice(&history);
                history = far;
            }
            let last = last % vocab;
            let (mut fast, mut slow) = (vec![-1], vec![-1]);
            let a = propose(&history, last, ngram, max, &mut fast);
            let b = propose_per_length(&history, last, ngram, max, &mut slow);
            proptest::prop_assert_eq!((a, fast), (b, slow));
        }

        #[test]
        fn rfind_finds_the_last_occurrence(
            tokens in proptest::collection::vec(0i32..4, 0..40),
            token in 0i32..5,
        ) {
            proptest::prop_assert_eq!(
                rfind(&tokens, token),
                tokens.iter().rposition(|&t| t == token)
            );
        }
    }

    #[test]
    fn only_the_latest_lookback_tokens_are_searched() {
        // "1 2 3", fillers, then the tail "1 2": with LOOKBACK + 1 tokens of history the
        // first "1" has left the window.
        let mut h = vec![1, 2, 3];
        h.extend(std::iter::repeat_n(9, LOOKBACK - 3));
        h.push(1);
        assert_eq!(h.len(), LOOKBACK + 1);
        assert!(lookup(&h, 2, 3, 2).is_empty());
        // One filler fewer and it is inside the window.
        h.remove(3);
        assert_eq!(lookup(&h, 2, 3, 2), vec![3, 9]);
    }
}
