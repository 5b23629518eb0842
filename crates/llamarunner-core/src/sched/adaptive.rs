//! How much a sequence drafts, so that drafts cost nothing where they do not pay.
//!
//! Each drafted position costs decode time, and it saves a step only if it and every drafted
//! token before it are accepted. Each sequence keeps running estimates (`Acceptance`, recent
//! outcomes weigh most) of the chance `f` that a draft's first token is accepted and of the
//! chance `c` that a token after an accepted one is (copied text comes in runs); its `j`-th
//! drafted token is expected to be kept with probability `f * c^(j - 1)`.
//!
//! What a step costs is not a line in its width. On a CPU, llama.cpp's repacked matrix kernels
//! multiply four positions at a time and one at a time for the rest, and other kernels pair
//! columns: on the default model a step of 2 positions costs about 1.8 steps of one, 3 positions
//! 3, 4 positions 2.5, 6 positions 3 (`benches/RESULTS.md`). So the scheduler keeps a table of
//! step times by width (`CostModel`: measured at load for the widths a step with drafts can
//! take, refined from the steps run), and drafts the number of positions, most likely first,
//! that gives the step the most expected tokens per second (`draft_count`); with a draft model
//! its time per drafted token counts too. The more sequences a step already carries, the less a
//! drafted position adds, and the draft budget shrinks as the batch fills.
//!
//! A lookup draft's first token is a guess of the next token; a sequence that does not draft in
//! a step still makes that guess, and checks it against the token it samples. Those free
//! observations keep its estimate current without spending a position on probes, so text that
//! lookups do not predict (sampling at a high temperature) stops drafting after a step or two,
//! and text that turns predictable starts at once. A draft model's drafts cannot be guessed for
//! free: a sequence whose model drafts are rejected outright waits 1, 2, 4, ... 64 steps, then
//! probes with one token.

use super::{Phase, Scheduler};
use crate::backend::Backend;

/// Widths (positions with logits) whose decode time the load-time measurement may give.
pub const MEASURED_WIDTHS: usize = 17;

/// What a decode step costs by its width (positions that have their logits computed, as every
/// position of a step of generating sequences and their drafts has): the times measured at load
/// (microseconds) of steps of 1, 2, ... `len` positions. Measured by the llama.cpp backend at
/// load (`backend/llama/load.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepCost {
    us: [u32; MEASURED_WIDTHS],
    len: u8,
}

impl StepCost {
    /// Positions cost nothing: every draft the lookup finds is verified (the fake backend, and
    /// a backend that was not measured).
    pub const FREE: StepCost = StepCost {
        us: [0; MEASURED_WIDTHS],
        len: 0,
    };

    /// From the times of steps of 1, 2, ... positions (at most `MEASURED_WIDTHS` are kept). A
    /// time of 0 is taken as 1 microsecond.
    pub fn from_times(times: &[u64]) -> StepCost {
        let mut cost = StepCost::FREE;
        for (slot, &t) in cost.us.iter_mut().zip(times) {
            *slot = u32::try_from(t).unwrap_or(u32::MAX).max(1);
            cost.len += 1;
        }
        cost
    }

    /// A step of `w` positions costs `fixed + w * position` microseconds.
    #[cfg(test)]
    pub fn linear(fixed: u32, position: u32) -> StepCost {
        let times: Vec<u64> = (1..=MEASURED_WIDTHS as u64)
            .map(|w| u64::from(fixed) + w * u64::from(position))
            .collect();
        StepCost::from_times(&times)
    }

    /// The measured times, one per width from 1.
    pub fn times(&self) -> &[u32] {
        &self.us[..usize::from(self.len)]
    }
}

/// Each observation of a width moves its entry at least this far towards it (its first ones
/// further: `CostModel::observe`), and the model's scale this far.
const COST_RATE: f64 = 0.2;

/// The step cost by width, refined from the steps the scheduler runs (only steps that carried
/// only positions with logits: a prompt chunk has positions without logits, which cost less).
///
/// The load-time measurement decodes one sequence into an empty cache. Real steps carry several
/// sequences with long contexts and cost more, by a factor that varies with the load: measured
/// on a 2-core CPU without AVX2 at 4 clients (`benches/RESULTS.md`), steps of 5 to 9 positions
/// took 20-30 % more than the table said and wide ones up to twice. So the model keeps:
///
/// - a **scale**: a running average of observed time / measured time over every step (whatever
///   its width), applied to the widths not yet observed;
/// - an **entry per observed width**: a running mean of that width's steps (the scaled
///   measurement counts as one observation, then at least `COST_RATE` per step, so that it
///   follows a load that changes), each observation clamped to half to twice the entry so that
///   a step slowed by another process moves it little;
/// - past the table, a least-squares line through the wide steps run (recent ones weigh most),
///   once they are enough and spread over enough widths to tell a slope; until then the scaled
///   extrapolation of the measurement (the last entry plus its mean slope over the last four
///   widths, averaging out the kernels' period of four). Wide steps of several sequences cost
///   less a position than the measurement's slope says (bigger matrix products), so the line
///   must take over for drafts at several clients to pay what they can.
#[derive(Clone, Debug)]
pub struct CostModel {
    /// The load-time measurement, step of `w` positions at `w - 1` (microseconds); empty:
    /// positions are free.
    measured: Vec<f64>,
    /// Running mean of each width's observed steps (valid where `seen` is not 0).
    table: Vec<f64>,
    /// Steps observed per width.
    seen: Vec<u32>,
    /// Observed time over measured time, averaged over the steps run.
    scale: f64,
    /// What a position adds past the table, by the measurement.
    slope: f64,
    /// Decayed sums over the steps wider than the table: weight, width, time, width², width ×
    /// time.
    wide: [f64; 5],
    /// The draft model's time per drafted token (a decayed average over draft passes).
    draft_us: f64,
}

/// Each wide step observed multiplies the weight of the earlier ones by this (a memory of about
/// fifty).
const WIDE_DECAY: f64 = 0.98;

impl CostModel {
    /// Starting from `cost`.
    pub fn new(cost: StepCost) -> Self {
        // A step of `w` positions costs at most `w` steps of one (it could be run as those). A
        // measurement above that was slowed by something else on the machine; believing it
        // would keep drafts from ever using that width, and so from ever correcting it.
        let one = cost.times().first().map_or(0.0, |&t| f64::from(t));
        let measured: Vec<f64> = cost
            .times()
            .iter()
            .enumerate()
            .map(|(i, &t)| f64::from(t).min(one * (i + 1) as f64))
            .collect();
        let slope = match measured.len() {
            0 => 0.0,
            1 => measured[0],
            n => {
                let back = (n - 1).min(4);
                ((measured[n - 1] - measured[n - 1 - back]) / back as f64).max(0.0)
            }
        };
        Self {
            table: measured.clone(),
            seen: vec![0; measured.len()],
            measured,
            scale: 1.0,
            slope,
            wide: [0.0; 5],
            draft_us: 0.0,
        }
    }

    /// The measurement's time for a step of `width` (at least 1) positions, extrapolated past
    /// the table.
    fn measured_time(&self, width: usize) -> f64 {
        match (self.measured.get(width - 1), self.measured.last()) {
            (Some(&t), _) => t,
            (None, Some(&last)) => last + self.slope * (width - self.measured.len()) as f64,
            (None, None) => 1.0,
        }
    }

    /// What a step of `width` positions costs (microseconds); 0 for an empty step, 1 for any
    /// other when positions are free.
    pub fn time(&self, width: usize) -> f64 {
        if width == 0 {
            return 0.0;
        }
        let n = self.measured.len();
        if n == 0 {
            return 1.0;
        }
        if width <= n {
            return if self.seen[width - 1] > 0 {
                self.table[width - 1]
            } else {
                self.measured[width - 1] * self.scale
            };
        }
        let last = self.time(n);
        match self.wide_line() {
            Some((a, b)) => (a + b * width as f64).max(last),
            None => last + self.slope * self.scale * (width - n) as f64,
        }
    }

    /// The line `a + b * width` through the wide steps seen, once they are enough and vary
    /// enough in width to tell its slope (never negative).
    fn wide_line(&self) -> Option<(f64, f64)> {
        let [w, n, t, nn, nt] = self.wide;
        if w < 8.0 {
            return None;
        }
        let (mn, mt) = (n / w, t / w);
        let var = nn / w - mn * mn;
        if var < 9.0 {
            return None;
        }
        let b = ((nt / w - mn * mt) / var).max(0.0);
        Some((mt - b * mn, b))
    }

    /// Whether positions cost nothing (every draft is worth verifying).
    pub fn free(&self) -> bool {
        self.table.is_empty()
    }

    /// The draft model's time per drafted token (0 until a draft pass was timed).
    pub fn draft_us(&self) -> f64 {
        self.draft_us
    }

    /// A draft pass drafted `tokens` tokens (at least one) in `us` microseconds.
    pub fn observe_draft(&mut self, tokens: usize, us: u64) {
        let per = us as f64 / tokens.max(1) as f64;
        self.draft_us = if self.draft_us == 0.0 {
            per
        } else {
            0.8 * self.draft_us + 0.2 * per
        };
    }

    /// A step of `width` positions (all with logits) took `us` microseconds.
    pub fn observe(&mut self, width: usize, us: u64) {
        let Some(&one) = self.measured.first() else {
            return;
        };
        if width == 0 {
            return;
        }
        // At most what as many one-position steps would cost, times the scale.
        let us = (us as f64).min(one * width as f64 * self.scale.max(1.0));
        let ratio = (us / self.measured_time(width)).clamp(0.5, 2.0);
        self.scale += COST_RATE * (ratio - self.scale);
        if width <= self.table.len() {
            let i = width - 1;
            if self.seen[i] == 0 {
                self.table[i] = self.measured[i] * self.scale;
            }
            let entry = self.table[i];
            let rate = (1.0 / (f64::from(self.seen[i]) + 2.0)).max(COST_RATE);
            self.table[i] += rate * (us.clamp(entry / 2.0, entry * 2.0) - entry);
            self.seen[i] = self.seen[i].saturating_add(1);
        } else {
            let (x, y) = (width as f64, us);
            let d = &mut self.wide;
            for (sum, v) in d.iter_mut().zip([1.0, x, y, x * x, x * y]) {
                *sum = *sum * WIDE_DECAY + v;
            }
        }
    }
}

/// Expected tokens per second a step with drafts must promise, as a multiple of the same step
/// without them.
pub const MIN_GAIN: f64 = 1.05;

/// How many drafted positions to add to a step that carries `placed` generating sequences (one
/// token each): of the candidates (the chance that a drafted position is kept, and its
/// sequence), most likely first, the number (at most `budget`) that gives the most expected
/// tokens per second, with `draft_us` to draft each (the draft model's time per token; 0 for
/// lookups), if it beats not drafting by `MIN_GAIN`. A count that leaves a sequence with fewer
/// than `min` drafted positions (but some) is not taken: such a draft would be dropped. Fewer
/// wins a tie.
pub fn draft_count(
    cost: &CostModel,
    draft_us: f64,
    placed: usize,
    candidates: &[(f32, usize)],
    budget: usize,
    min: usize,
) -> usize {
    if placed == 0 {
        return 0;
    }
    let free = cost.free();
    let rate = |k: usize, tokens: f64| tokens / (cost.time(placed + k) + draft_us * k as f64);
    let mut tokens = placed as f64;
    // Drafting must promise `MIN_GAIN` over not drafting: the chances and step times are
    // estimates, and a draft that only breaks even on paper loses when they are a little off.
    let (mut best, mut best_rate) = (0, rate(0, tokens) * MIN_GAIN);
    // Positions per sequence so far, and how many sequences have some but fewer than `min`.
    let mut per = vec![0usize; candidates.iter().map(|c| c.1 + 1).max().unwrap_or(0)];
    let mut short = 0usize;
    for (k, &(q, seq)) in candidates.iter().take(budget).enumerate() {
        if q <= 0.0 {
            break;
        }
        tokens += f64::from(q);
        let n = &mut per[seq];
        *n += 1;
        if *n == 1 && min > 1 {
            short += 1;
        }
        if *n == min && min > 1 {
            short -= 1;
        }
        if short > 0 {
            continue;
        }
        if free {
            best = k + 1;
            continue;
        }
        let r = rate(k + 1, tokens);
        if r > best_rate * (1.0 + 1e-9) {
            (best, best_rate) = (k + 1, r);
        }
    }
    best
}

/// Prior of the chance that a lookup sequence's first drafted token is accepted, as
/// pseudo-counts of accepted and rejected tokens: a mean of 0.5, worth two observations. Low: a
/// lookup sequence's free guesses (`Acceptance::guessed`) tell within a step or two whether its
/// text is predictable, so it need not spend drafted positions on finding out. Whether a new
/// sequence drafts before its first right guess depends on the step costs: on the default
/// model's, a sequence alone in a step drafts 3 tokens once (a step of 4 positions is cheap).
const LOOKUP_FIRST_PRIOR: Beta = Beta {
    hits: 1.0,
    misses: 1.0,
};
/// Prior of the chance that a draft model's first drafted token is accepted: a mean of 0.85,
/// worth two observations. High: a draft model's drafts cannot be checked without drafting.
const MODEL_FIRST_PRIOR: Beta = Beta {
    hits: 1.7,
    misses: 0.3,
};
/// Prior of the chance that a drafted token after an accepted one is accepted too: a mean of
/// 0.85, worth two observations. Copied text comes in runs: once a draft's first token is right,
/// the next ones mostly are.
const CONTINUE_PRIOR: Beta = Beta {
    hits: 1.7,
    misses: 0.3,
};
/// Recent outcomes weigh most: counts are multiplied by this before each observation that adds
/// to them (a lookup sequence), or in each step (a draft-model sequence, so that one that
/// stopped drafting drifts back to the prior and probes again; a lookup sequence needs no
/// drift, its guesses go on).
const DECAY: f32 = 0.9;

/// Classes of lookup matches by the context they share with the end of the history
/// (`match_class`), each with its own estimate of a first drafted token's acceptance.
pub const MATCH_CLASSES: usize = 3;

/// The class of a lookup match that shares `shared` tokens of context (`speculative::propose`):
/// a pair or a few tokens (common phrases recur in any text) or a long stretch (copied text).
pub fn match_class(shared: usize) -> usize {
    match shared {
        0..=2 => 0,
        3..=7 => 1,
        _ => 2,
    }
}

/// Decayed counts of accepted and rejected drafted tokens (a Beta distribution's parameters
/// when a prior is added).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Beta {
    hits: f32,
    misses: f32,
}

impl Beta {
    fn decay(&mut self) {
        self.hits *= DECAY;
        self.misses *= DECAY;
    }

    /// The mean, with `prior`'s pseudo-counts added.
    fn mean(&self, prior: Beta) -> f32 {
        (self.hits + prior.hits) / (self.hits + self.misses + prior.hits + prior.misses)
    }
}

/// A sequence's recent drafting outcomes, as two estimates: the chance that a draft's first
/// token is accepted (is the text predictable now?), and the chance that a token after an
/// accepted one is (how long do its runs last?). The `j`-th drafted token is kept with
/// probability `first * next^(j - 1)`.
#[derive(Debug)]
pub struct Acceptance {
    /// Its drafts are lookups, whose first token it guesses for free in steps without a draft
    /// (`guessed`); else a draft model's.
    guesses: bool,
    /// Outcomes of first drafted tokens (and guesses), by how much context the lookup's match
    /// shared (`match_class`; a draft model's all count in class 0).
    first: [Beta; MATCH_CLASSES],
    /// Outcomes of drafted tokens after an accepted one.
    next: Beta,
    /// Draft model: steps to wait after a draft of which nothing was accepted before drafting
    /// again; it doubles with each such draft in a row (up to `MAX_BACKOFF`) and halves with
    /// each draft that had a token accepted.
    backoff: u32,
    /// Steps still to wait.
    wait: u32,
}

/// Longest wait between probes of a sequence whose drafts are never accepted: a probe of one
/// position every 64 steps costs about 1.5 % of a position per step.
const MAX_BACKOFF: u32 = 64;

impl Acceptance {
    /// The state of a new sequence drafting by lookup (`guesses`) or with a draft model.
    pub fn new(guesses: bool) -> Self {
        Self {
            guesses,
            first: [Beta::default(); MATCH_CLASSES],
            next: Beta::default(),
            backoff: 0,
            wait: 0,
        }
    }

    /// The estimated chances that its next draft's first token is accepted (the draft of a
    /// match of `class`), and that a token after an accepted one is.
    pub fn acceptance(&self, class: usize) -> (f32, f32) {
        let prior = if self.guesses {
            LOOKUP_FIRST_PRIOR
        } else {
            MODEL_FIRST_PRIOR
        };
        let first = self.first[class.min(MATCH_CLASSES - 1)];
        (first.mean(prior), self.next.mean(CONTINUE_PRIOR))
    }

    /// A step passed: a draft-model sequence's older outcomes weigh less.
    pub fn step(&mut self) {
        if !self.guesses {
            self.first.iter_mut().for_each(Beta::decay);
            self.next.decay();
        }
    }

    /// A lookup's guess of the next token (from a match of `class`), made in a step without a
    /// draft, was `right` (the sampled token) or not: the outcome its first drafted token would
    /// have had.
    pub fn guessed(&mut self, class: usize, right: bool) {
        let first = &mut self.first[class.min(MATCH_CLASSES - 1)];
        first.decay();
        if right {
            first.hits += 1.0;
        } else {
            first.misses += 1.0;
        }
    }

    /// A draft of `drafted` tokens (from a match of `class`) had its first `accepted` accepted.
    pub fn record(&mut self, class: usize, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let first = &mut self.first[class.min(MATCH_CLASSES - 1)];
        if self.guesses {
            first.decay();
        }
        if accepted == 0 {
            first.misses += 1.0;
        } else {
            first.hits += 1.0;
            if drafted > 1 {
                if self.guesses {
                    self.next.decay();
                }
                self.next.hits += (accepted - 1) as f32;
                if accepted < drafted {
                    self.next.misses += 1.0;
                }
            }
        }
        if self.guesses {
            // Guesses, not probes, tell a lookup sequence when to draft again.
        } else if accepted == 0 {
            self.backoff = (self.backoff * 2).clamp(1, MAX_BACKOFF);
            self.wait = self.backoff;
        } else {
            // One accepted probe does not make a text predictable: the back-off halves, and
            // full drafts resume once probes keep being accepted.
            self.backoff /= 2;
        }
    }

    /// Most tokens it may draft this step, of `max`: none while it waits after drafts that
    /// were rejected outright, then `probe` (a probe: the fewest worth drafting, at least one)
    /// until a drafted token is accepted again.
    pub fn allowed(&mut self, max: usize, probe: usize) -> usize {
        if self.wait > 0 {
            self.wait -= 1;
            return 0;
        }
        if self.backoff > 0 {
            max.min(probe.max(1))
        } else {
            max
        }
    }
}

impl<B: Backend> Scheduler<B> {
    /// The draft length of each generating sequence placed in this step that speculates
    /// (slot index, length), at most `budget` in all: each sequence may propose up to the
    /// tokens left to it (`propose(slot index, max, scheduler)` returns how many it proposes,
    /// at most `max`, and its match class, `match_class`; 0 for a draft model), and of all the proposed positions, most likely first, as many are kept as
    /// give the step the most expected tokens per second (`draft_count`). `guesses`: the
    /// proposals are lookups, whose first token a sequence checks for free when it does not
    /// draft (`SpecState::guess`), so no sequence waits or probes after rejections.
    pub(super) fn draft_lengths(
        &mut self,
        budget: usize,
        placed: usize,
        guesses: bool,
        mut propose: impl FnMut(usize, usize, &mut Self) -> (usize, usize),
    ) -> Vec<(usize, usize)> {
        let cfg = self.speculation;
        let ctx = self.backend.slot_ctx();
        // (chance of being kept, slot index) of every proposed position.
        let mut candidates: Vec<(f32, usize)> = Vec::new();
        for i in 0..self.slots.len() {
            let slot = &mut self.slots[i];
            let Some(seq) = slot.seq.as_mut() else {
                continue;
            };
            seq.spec.draft.clear();
            seq.spec.guess = None;
            if !seq.spec.enabled
                || seq.phase != Phase::Decode
                || seq.queued != 1
                || seq.pending.is_empty()
            {
                continue;
            }
            seq.spec.adapt.step();
            // The next token goes at `cached.len()`; drafts after it, all inside the slot (so
            // that no context shift can happen before the last drafted position is sampled).
            let room = ctx.saturating_sub(slot.cached.len() + 1);
            let limit = match seq.params.num_predict {
                p if p < 0 => crate::protocol::params::UNCAPPED_SLOT_CONTEXTS * ctx,
                p => usize::try_from(p).unwrap_or(usize::MAX),
            };
            // The next token's logits give one more token; each accepted draft one more.
            let left = limit.saturating_sub(seq.n_generated + 1);
            let max = cfg.draft_max.min(room).min(left).min(budget);
            if max == 0 || max < cfg.draft_min {
                continue;
            }
            // A draft model's sequence whose drafts were rejected outright waits, then probes.
            let max = if cfg.always || guesses {
                max
            } else {
                seq.spec.adapt.allowed(max, cfg.draft_min)
            };
            if max == 0 || max < cfg.draft_min {
                continue;
            }
            let (n, class) = propose(i, max, self);
            let Some(seq) = self.slots[i].seq.as_mut() else {
                continue;
            };
            seq.spec.class = class;
            let (first, next) = seq.spec.adapt.acceptance(class);
            let mut q = first;
            for _ in 0..n {
                candidates.push((q, i));
                q *= next;
            }
        }
        // Stable: a sequence's positions stay in order among equal chances.
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0));
        let count = if cfg.always {
            candidates.len().min(budget)
        } else {
            let draft_us = if self.backend.has_draft_model() {
                self.step_cost.draft_us()
            } else {
                0.0
            };
            draft_count(
                &self.step_cost,
                draft_us,
                placed,
                &candidates,
                budget,
                cfg.draft_min,
            )
        };
        let mut keep = vec![0usize; self.slots.len()];
        for &(_, i) in &candidates[..count] {
            keep[i] += 1;
        }
        keep.into_iter()
            .enumerate()
            .filter(|&(_, n)| n >= cfg.draft_min.max(1))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_draft_model_estimate_follows_recent_outcomes_and_returns_to_the_prior() {
        let mut s = Acceptance::new(false);
        let prior = s.acceptance(0);
        assert!((prior.0 - 0.85).abs() < 1e-6 && (prior.1 - 0.85).abs() < 1e-6);
        s.record(0, 4, 4);
        assert!(s.acceptance(0).0 > prior.0 && s.acceptance(0).1 > prior.1);
        let mut s = Acceptance::new(false);
        s.record(0, 3, 0);
        s.record(0, 1, 0);
        let low = s.acceptance(0).0;
        assert!(low < 0.5, "{low}");
        // Nothing was learnt about runs: no draft had a token accepted.
        assert_eq!(s.acceptance(0).1, prior.1);
        for _ in 0..20 {
            s.step();
        }
        assert!(s.acceptance(0).0 > low + 0.2, "{:?}", s.acceptance(0));
    }

    #[test]
    fn draft_model_drafts_rejected_outright_back_off_exponentially_and_probe_with_one_token() {
        let mut s = Acceptance::new(false);
        assert_eq!(s.allowed(8, 1), 8);
        // Each draft of which nothing is accepted doubles the wait: 1, 2, 4, ... 64 steps.
        for wait in [1, 2, 4, 8, 16, 32, 64, 64] {
            s.record(0, 1, 0);
            for _ in 0..wait {
                assert_eq!(s.allowed(8, 1), 0);
            }
            // Then a probe of one token.
            assert_eq!(s.allowed(8, 1), 1);
        }
        // Accepted probes halve the back-off, one-token probes go on without waiting until it
        // is gone: 64 -> 32 -> ... -> 1 -> 0.
        for _ in 0..6 {
            s.record(0, 1, 1);
            assert_eq!(s.allowed(8, 1), 1);
        }
        s.record(0, 1, 1);
        assert_eq!(s.allowed(8, 1), 8);
        // A draft cut after some accepted tokens does not back off.
        s.record(0, 5, 2);
        assert_eq!(s.allowed(8, 1), 8);
    }

    #[test]
    fn a_lookup_estimate_follows_its_guesses_and_drafts_without_drifting() {
        let mut s = Acceptance::new(true);
        assert!((s.acceptance(0).0 - 0.5).abs() < 1e-6);
        for _ in 0..5 {
            s.guessed(0, false);
        }
        let low = s.acceptance(0);
        assert!(low.0 < 0.2, "{low:?}");
        // Steps without observations change nothing: no drift back to the prior, no probes.
        for _ in 0..100 {
            s.step();
        }
        assert_eq!(s.acceptance(0), low);
        for _ in 0..10 {
            s.guessed(0, true);
        }
        assert!(s.acceptance(0).0 > 0.7, "{:?}", s.acceptance(0));
        // Drafts count as guesses do, and their tokens after the first tell how long runs last:
        // drafts of 8 whose first 7 are accepted.
        for _ in 0..10 {
            s.record(0, 8, 7);
        }
        let (first, next) = s.acceptance(0);
        assert!(first > 0.85, "{first}");
        assert!((0.8..0.9).contains(&next), "{next}");
        // A draft rejected at its first token says nothing about runs.
        s.record(0, 8, 0);
        assert_eq!(s.acceptance(0).1, next);
        // Guesses never make a sequence wait.
        assert_eq!(s.allowed(8, 1), 8);
    }

    #[test]
    fn matches_that_share_more_context_keep_their_own_estimate() {
        let mut s = Acceptance::new(true);
        // Pairs of tokens that recur anywhere guess wrong; long copied stretches guess right.
        for _ in 0..6 {
            s.guessed(match_class(2), false);
            s.guessed(match_class(12), true);
        }
        assert!(s.acceptance(match_class(2)).0 < 0.2);
        assert!(s.acceptance(match_class(12)).0 > 0.8);
        // A class with no outcomes yet is at the prior.
        assert_eq!(s.acceptance(match_class(5)).0, 0.5);
        assert_eq!(
            [0, 1, 2, 3, 7, 8, 16].map(match_class),
            [0, 0, 0, 1, 1, 2, 2]
        );
    }

    #[test]
    fn the_cost_table_starts_from_the_measurement_and_extrapolates_past_it() {
        // 1..=5 positions measured: 10, 18, 26, 20, 28 ms (a kernel that multiplies four
        // positions at a time makes 4 cheaper than 3).
        let cost = StepCost::from_times(&[10_000, 18_000, 26_000, 20_000, 28_000]);
        let m = CostModel::new(cost);
        assert_eq!(m.time(0), 0.0);
        assert_eq!(m.time(3), 26_000.0);
        assert_eq!(m.time(4), 20_000.0);
        // Past the table: the slope of the last four widths, (28 - 10) / 4 per position.
        assert_eq!(m.time(6), 28_000.0 + 4_500.0);
        assert_eq!(m.time(9), 28_000.0 + 4.0 * 4_500.0);
        assert!(m.time(200) > m.time(100));
        // A width measured above that many one-position steps (a busy machine) is capped.
        let m = CostModel::new(StepCost::from_times(&[10_000, 90_000, 25_000]));
        assert_eq!((m.time(2), m.time(3)), (20_000.0, 25_000.0));
        // Nothing measured: positions are free.
        let free = CostModel::new(StepCost::FREE);
        assert!(free.free());
        assert_eq!((free.time(1), free.time(9)), (1.0, 1.0));
    }

    #[test]
    fn the_cost_table_follows_the_steps_it_sees_and_shrugs_off_outliers() {
        // Measured: 5 ms + 5 ms a position, widths 1..=17.
        let mut m = CostModel::new(StepCost::linear(5_000, 5_000));
        assert_eq!(m.time(2), 15_000.0);
        for _ in 0..40 {
            m.observe(2, 12_000);
        }
        assert!((m.time(2) - 12_000.0).abs() < 10.0, "{}", m.time(2));
        // Steps ran at 0.8 times the measurement: widths not seen yet follow that scale, also
        // past the table (its last width, then the measured slope, both scaled).
        assert!((m.time(3) - 16_000.0).abs() < 10.0, "{}", m.time(3));
        assert!((m.time(27) - 0.8 * (90_000.0 + 10.0 * 5_000.0)).abs() < 50.0);
        // One step slowed a hundredfold by another process counts as three steps of one at
        // most, and moves its width's entry halfway there (a width's first steps weigh most);
        // the steps after it bring the entry back.
        m.observe(3, 2_000_000);
        assert!(m.time(3) <= 25_000.0, "{}", m.time(3));
        for _ in 0..10 {
            m.observe(3, 16_000);
        }
        assert!(m.time(3) < 17_000.0, "{}", m.time(3));
        // Empty steps are ignored.
        m.observe(0, 1);

        // Past the table, a line through the wider steps run takes over once they are spread
        // over enough widths: here 40 ms + 2 ms a position (wide products are cheaper a
        // position than the measured slope of 5 ms).
        let mut m = CostModel::new(StepCost::linear(5_000, 5_000));
        for i in 0..60 {
            let w = 20 + i % 20;
            m.observe(w, 40_000 + 2_000 * w as u64);
        }
        let line = |w: f64| 40_000.0 + 2_000.0 * w;
        for w in [27, 60] {
            let t = m.time(w);
            assert!((t - line(w as f64)).abs() < 200.0, "{w}: {t}");
        }
        // Steps all of one width tell no slope: the measurement's extrapolation, scaled (by
        // twice at most), stands.
        let mut m = CostModel::new(StepCost::linear(5_000, 5_000));
        for _ in 0..60 {
            m.observe(30, 500_000);
        }
        assert!((m.time(27) - 2.0 * (90_000.0 + 10.0 * 5_000.0)).abs() < 500.0);
    }

    #[test]
    fn the_draft_count_maximizes_expected_tokens_per_second() {
        // The default model on the 2-core CPU, 300 tokens in the cache (ms): 2 positions cost 1.8
        // steps of one, 3 cost 2.6, 4 cost 2.2, 6 cost 2.8.
        let shape = [17.5, 30.6, 45.8, 37.7, 57.9, 48.0, 73.0, 69.3, 89.0];
        let times: Vec<u64> = shape.iter().map(|ms| (ms * 1000.0) as u64).collect();
        let m = CostModel::new(StepCost::from_times(&times));
        // One sequence, drafts kept 90 % of the time: a draft of 5 (a step of 6) beats 1 or
        // 2, which cost almost what they save.
        let one =
            |chances: &[f32]| -> Vec<(f32, usize)> { chances.iter().map(|&q| (q, 0)).collect() };
        let sure = one(&(1..=8).map(|j| 0.9f32.powi(j)).collect::<Vec<_>>());
        assert_eq!(draft_count(&m, 0.0, 1, &sure, 8, 1), 5);
        // Within a budget of 2, neither 1 nor 2 pays more than it costs at 60 %.
        let unsure = one(&(1..=8).map(|j| 0.6f32.powi(j)).collect::<Vec<_>>());
        assert_eq!(draft_count(&m, 0.0, 1, &unsure, 2, 1), 0);
        // Drafts that are never kept are never drafted.
        assert_eq!(draft_count(&m, 0.0, 1, &one(&[0.0; 8]), 8, 1), 0);
        // Nothing placed: nothing to draft for.
        assert_eq!(draft_count(&m, 0.0, 0, &sure, 8, 1), 0);
        // A draft model as slow per drafted token as a step: nothing pays.
        assert_eq!(draft_count(&m, 17_500.0, 1, &sure, 8, 1), 0);
        // Free positions: everything with a chance, within the budget.
        let free = CostModel::new(StepCost::FREE);
        assert_eq!(draft_count(&free, 0.0, 1, &unsure, 3, 1), 3);
        assert_eq!(draft_count(&free, 0.0, 1, &one(&[0.5, 0.0]), 8, 1), 1);
        // `--draft-min 6`: 5 is best but would be dropped; the best count that gives the
        // sequence 6 or more, or none, is taken instead.
        assert_eq!(draft_count(&m, 0.0, 1, &sure, 8, 6), 7);
        // Two sequences, a minimum of 2: a count leaving either with one is skipped (counts
        // are taken in order of chance, so within a budget of 3 none is left).
        let two = [(0.9, 0), (0.9, 1), (0.8, 0), (0.1, 1)];
        assert_eq!(draft_count(&free, 0.0, 2, &two, 3, 2), 0);
        assert_eq!(draft_count(&free, 0.0, 2, &two, 4, 2), 4);
    }
}
