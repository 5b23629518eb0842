//! LoRA scale sets in the batching loop. llama.cpp applies one set of adapter scales to a whole
//! `llama_decode`, so a batch holds the sequences of one set only, and the sets take turns
//! (`Turns`): when a turn ends, the next goes to the set after the one that ran (in the order
//! the sets first appear in the slot table), so none starves. The KV cells a sequence writes
//! depend on its set, so a slot's cache is only reused, or forked from, by a prompt of the set
//! it was computed under.
//!
//! How long a turn lasts. Every change of set makes llama.cpp build its scheduler and reserve
//! its compute graphs again (its context's `set_adapters_lora` sets `sched_need_reserve`, even
//! for a change of scale only), inside the next decode: about 4 ms on the default model on a
//! 2-core CPU (`benches/RESULTS.md`). On a GPU the compute buffers are freed and allocated
//! again too: llama.cpp's pull request 27268 reports about 85 ms more per request that changes
//! the scales (Gemma 4 12B, RTX 5090), where a decode step takes milliseconds. Changing set at
//! every step would leave the GPU waiting most of the time. So the loop measures what a change
//! costs (a decode that changed set, against the running mean of the decodes of the same width
//! that did not), and a set keeps its turn while it has work and its turn (the change
//! included) has lasted less than that cost over `SWITCH_SHARE`, and at most `MAX_TURN`:
//! changes then take about `SWITCH_SHARE` of the time, or less. Where a change costs little
//! against a step, turns are one step and the sets alternate step by step; until
//! `FIRST_SAMPLES` changes have been measured (their median is the first cost), a turn lasts
//! `UNMEASURED_STEPS` steps (a decode that kept the set is the comparison a change needs). A
//! step that places nothing of the set whose turn it is (its work cannot be placed yet) ends
//! that turn.
//!
//! Cost: with k sets busy at once, each decode carries about 1/k of the generating sequences,
//! so each stream runs about k times slower than with one set, and its tokens come in bursts
//! of a turn's length.

use std::time::{Duration, Instant};

use crate::protocol::LoraScales;

/// The largest share of the time that changes of set may take, where turns can be made long
/// enough for it. Not less: a longer turn makes the other sets' streams wait longer (their
/// tokens come in bursts), and where a change costs 4 ms against steps of 30 ms (the default
/// model on a 2-core CPU) a tenth made turns of two steps, which gained 3-13 % in tokens/s
/// (within those rounds' noise) and raised the p90 inter-token latency by about 40 % with four
/// sets (`benches/RESULTS.md`).
const SWITCH_SHARE: f64 = 0.2;

/// The longest turn while another set waits: how long a stream of another set may be held.
const MAX_TURN: Duration = Duration::from_millis(500);

/// Steps a turn lasts until what a change of set costs has been measured.
const UNMEASURED_STEPS: u32 = 2;

/// Changes measured before their median is taken as the cost (one slowed by something else on
/// the machine does not set it alone).
const FIRST_SAMPLES: usize = 3;

/// Widths (positions in a batch) whose decode time without a change of set is kept (llama.cpp's
/// largest batch is `--batch-size`, 2,048 by default).
const PLAIN_WIDTHS: usize = 4096;

/// Weight of the newest observation in the running means.
const RATE: f64 = 0.25;

/// Whose turn it is, how long it has lasted, and what a change of set costs.
#[derive(Debug, Default)]
pub(super) struct Turns {
    /// The set that has the turn, since when and for how many decoded steps, and whether it
    /// was ended early (a step that placed nothing of it).
    current: Option<LoraScales>,
    began: Option<Instant>,
    steps: u32,
    ended: bool,
    /// The set llama.cpp has (the last `set_lora` that succeeded); None before the first, or
    /// where a failure left it unknown.
    applied: Option<LoraScales>,
    /// What a change of set adds to a decode (microseconds), a running mean (below 0 where
    /// noise made the changes look faster); None until `FIRST_SAMPLES` changes were measured.
    switch_us: Option<f64>,
    /// The first changes measured.
    first: Vec<f64>,
    /// Running mean decode time (microseconds) of steps of width `i + 1` (every position with
    /// logits) that kept the set; 0 where none was seen.
    plain_us: Vec<f64>,
}

impl Turns {
    /// The set to decode at `now`: the current one while it is `ready` (the sets of sequences
    /// that have tokens to decode, in slot order, repeats allowed) and its turn lasts, else the
    /// next ready one after it (`next_turn`); `None` when nothing is ready.
    pub(super) fn turn<'a>(
        &mut self,
        ready: impl Iterator<Item = &'a LoraScales>,
        now: Instant,
    ) -> Option<LoraScales> {
        let ready: Vec<&LoraScales> = ready.collect();
        if let Some(current) = self.current.as_ref() {
            if self.lasts(now) && ready.contains(&current) {
                return Some(current.clone());
            }
        }
        let next = next_turn(ready.into_iter(), self.current.as_ref())?;
        if self.current.as_ref() != Some(&next) {
            self.current = Some(next.clone());
            self.began = Some(now);
            self.steps = 0;
            self.ended = false;
        }
        Some(next)
    }

    /// Whether the current turn goes on at `now`.
    fn lasts(&self, now: Instant) -> bool {
        if self.ended {
            return false;
        }
        match self.switch_us {
            None => self.steps < UNMEASURED_STEPS,
            Some(switch) => {
                let turn = (switch.max(0.0) / SWITCH_SHARE).min(MAX_TURN.as_secs_f64() * 1e6);
                let lasted = self.began.map_or(0.0, |b| {
                    now.saturating_duration_since(b).as_secs_f64() * 1e6
                });
                lasted < turn
            }
        }
    }

    /// The step placed nothing of the current set (its ready work could not be placed: an
    /// image or a prompt chunk without room): its turn ends, so that another set's work is
    /// not held behind it.
    pub(super) fn end_turn(&mut self) {
        self.ended = true;
    }

    /// Whether decoding under `set` changes the set llama.cpp has (asked before `set_lora`);
    /// None where that set is not known (before the first decode, whose graph llama.cpp
    /// reserves anyway, and after a failure).
    pub(super) fn changes(&self, set: &LoraScales) -> Option<bool> {
        self.applied.as_ref().map(|a| a != set)
    }

    /// `set_lora(set)` succeeded (`Some`), or failed where llama.cpp's set is not known
    /// (`None`; the next decode then measures nothing).
    pub(super) fn applied(&mut self, set: Option<&LoraScales>) {
        self.applied = set.cloned();
    }

    /// A batch of `width` positions was decoded in `us` microseconds (`changed`: what
    /// `changes` said of its set: if it changed, that decode also reserved llama.cpp's graph
    /// again; `all_logits`: every position had its logits, as steps of generating sequences
    /// do). A change is measured against the steps of its width that kept the set; while the
    /// sets alternate those grow stale as contexts lengthen, the change looks dearer, a turn
    /// lasts two steps and its second step brings them up to date.
    pub(super) fn decoded(
        &mut self,
        changed: Option<bool>,
        width: usize,
        all_logits: bool,
        us: f64,
    ) {
        self.steps = self.steps.saturating_add(1);
        let Some(changed) = changed else {
            return;
        };
        if !all_logits || width == 0 || width > PLAIN_WIDTHS {
            return;
        }
        if self.plain_us.len() < width {
            self.plain_us.resize(width, 0.0);
        }
        let plain = &mut self.plain_us[width - 1];
        if !changed {
            *plain = if *plain == 0.0 {
                us
            } else {
                *plain + RATE * (us - *plain)
            };
            return;
        }
        if *plain == 0.0 {
            return;
        }
        // Not clamped at 0: where a change costs nothing, the noise in decode times averages
        // out instead of adding up. Clamped above, so that one step slowed by something else
        // moves a measured cost by at most about its own size.
        let sample = us - *plain;
        match self.switch_us {
            Some(s) => {
                let sample = sample.min(4.0 * s.max(0.0) + *plain);
                self.switch_us = Some(s + RATE * (sample - s));
            }
            None => {
                self.first.push(sample);
                if self.first.len() == FIRST_SAMPLES {
                    self.first.sort_by(f64::total_cmp);
                    self.switch_us = Some(self.first[FIRST_SAMPLES / 2]);
                }
            }
        }
    }

    /// What a change of set costs a decode, as measured (microseconds).
    pub(super) fn switch_us(&self) -> Option<f64> {
        self.switch_us
    }
}

/// The set after `last` among `ready` (the sets of sequences that have tokens to decode, in
/// slot order, repeats allowed), cycling; the first when `last` is not ready; `None` when
/// nothing is ready.
pub(super) fn next_turn<'a>(
    ready: impl Iterator<Item = &'a LoraScales>,
    last: Option<&LoraScales>,
) -> Option<LoraScales> {
    let mut sets: Vec<&LoraScales> = Vec::new();
    for set in ready {
        if !sets.contains(&set) {
            sets.push(set);
        }
    }
    let after_last = last
        .and_then(|l| sets.iter().position(|s| *s == l))
        .map_or(0, |i| (i + 1) % sets.len().max(1));
    sets.get(after_last).map(|s| (*s).clone())
}

/// The lengths of the runs of one set in `log` (a log of the sets decoded, step by step): the
/// turns' lengths.
#[cfg(test)]
pub(super) fn run_lengths(log: &[LoraScales]) -> Vec<usize> {
    let mut lengths: Vec<usize> = vec![];
    for (i, s) in log.iter().enumerate() {
        match lengths.last_mut() {
            Some(n) if log[i - 1] == *s => *n += 1,
            _ => lengths.push(1),
        }
    }
    lengths
}

/// What of a slot's cache a prompt of set `lora` may reuse: all of it when it was computed
/// under that set, nothing otherwise.
pub(super) fn reusable<'a>(
    cached: &'a [crate::protocol::Token],
    cached_under: &LoraScales,
    lora: &LoraScales,
) -> &'a [crate::protocol::Token] {
    if cached_under == lora {
        cached
    } else {
        &[]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(scale: f32) -> LoraScales {
        LoraScales::new(vec![scale])
    }

    #[test]
    fn the_sets_take_turns_in_slot_order() {
        let (a, b, c) = (set(0.0), set(1.0), set(0.5));
        let ready = [b.clone(), a.clone(), b.clone(), c.clone()];
        assert_eq!(next_turn(ready.iter(), None), Some(b.clone()));
        assert_eq!(next_turn(ready.iter(), Some(&b)), Some(a.clone()));
        assert_eq!(next_turn(ready.iter(), Some(&a)), Some(c.clone()));
        assert_eq!(next_turn(ready.iter(), Some(&c)), Some(b.clone()));
        // The last set is no longer ready: start over.
        assert_eq!(next_turn([a.clone()].iter(), Some(&c)), Some(a.clone()));
        assert_eq!(next_turn([].iter(), Some(&c)), None);
    }

    /// Runs `steps` steps of one position each from `t0`: each step's turn among `ready`, its
    /// decode taking `plain_us`, plus `switch_us` when the set changed. The sets in turn order,
    /// and the time it ended.
    fn run(
        turns: &mut Turns,
        ready: &[LoraScales],
        t0: Instant,
        steps: usize,
        plain_us: u64,
        switch_us: u64,
    ) -> (Vec<LoraScales>, Instant) {
        let mut now = t0;
        let mut ran = Vec::new();
        for _ in 0..steps {
            let set = turns.turn(ready.iter(), now).unwrap();
            let changed = turns.changes(&set);
            turns.applied(Some(&set));
            let us = plain_us + if changed == Some(true) { switch_us } else { 0 };
            turns.decoded(changed, 1, true, us as f64);
            now += Duration::from_micros(us);
            ran.push(set);
        }
        (ran, now)
    }

    #[test]
    fn where_a_change_costs_nothing_the_sets_alternate_after_the_first_turns() {
        let (a, b) = (set(0.0), set(1.0));
        let mut turns = Turns::default();
        let (ran, _) = run(&mut turns, &[a, b], Instant::now(), 40, 20_000, 0);
        let lengths = run_lengths(&ran);
        // Turns of two steps until three changes are measured (the third at the first step of
        // the fourth turn); then one step each.
        assert_eq!(&lengths[..3], &[2, 2, 2], "{lengths:?}");
        assert!(lengths[3..].iter().all(|&n| n == 1), "{lengths:?}");
        assert_eq!(turns.switch_us(), Some(0.0));
    }

    #[test]
    fn a_costly_change_makes_turns_long_enough_to_pay_for_it() {
        let (a, b) = (set(0.0), set(1.0));
        let mut turns = Turns::default();
        // Steps of 2 ms, a change 5 ms: a turn lasts 25 ms (the change's step counts in it),
        // 10 steps, so changes take about a fifth of the time.
        let t0 = Instant::now();
        let (ran, end) = run(&mut turns, &[a.clone(), b.clone()], t0, 400, 2_000, 5_000);
        let lengths = run_lengths(&ran);
        assert!(
            (5_000.0 - turns.switch_us().unwrap()).abs() < 1.0,
            "{:?}",
            turns.switch_us()
        );
        for &n in &lengths[3..lengths.len() - 1] {
            assert!((9..=11).contains(&n), "{lengths:?}");
        }
        // Both sets keep getting turns.
        let n_a = ran.iter().filter(|s| **s == a).count();
        assert!((150..=250).contains(&n_a), "{n_a} of 400 steps for A");
        // Changes took about SWITCH_SHARE of the time.
        let changes = (lengths.len() - 1) as f64;
        let share = changes * 5_000.0 / end.duration_since(t0).as_micros() as f64;
        assert!((0.18..=0.22).contains(&share), "{share}: {lengths:?}");
    }

    #[test]
    fn no_turn_lasts_longer_than_max_turn_while_another_set_waits() {
        let (a, b) = (set(0.0), set(1.0));
        let mut turns = Turns::default();
        // A change of 400 ms would ask for turns of 2 s: they stop at MAX_TURN.
        let (ran, _) = run(&mut turns, &[a, b], Instant::now(), 600, 10_000, 400_000);
        let lengths = run_lengths(&ran);
        let most = ((MAX_TURN.as_micros() - 400_000) / 10_000) as usize + 2;
        for &n in &lengths[3..] {
            assert!(n <= most, "{lengths:?}");
        }
        assert!(lengths.len() > 4, "{lengths:?}");
    }

    #[test]
    fn a_set_alone_keeps_the_turn_and_one_that_arrives_gets_it_at_once_after_a_long_turn() {
        let (a, b) = (set(0.0), set(1.0));
        let mut turns = Turns::default();
        let t0 = Instant::now();
        // A measured change of 1 ms (turns of 5 ms) ...
        let (_, now) = run(&mut turns, &[a.clone(), b.clone()], t0, 10, 1_000, 1_000);
        assert_eq!(turns.switch_us(), Some(1_000.0));
        // ... then A alone for 50 ms.
        let (ran, now) = run(&mut turns, std::slice::from_ref(&a), now, 50, 1_000, 1_000);
        assert!(ran.iter().all(|s| *s == a));
        // B arrives: A's turn is long over.
        assert_eq!(
            turns.turn([a.clone(), b.clone()].iter(), now),
            Some(b.clone())
        );
        // Nothing ready: no turn.
        assert_eq!(turns.turn([].iter(), now), None);
    }

    #[test]
    fn a_turn_that_places_nothing_ends() {
        let (a, b) = (set(0.0), set(1.0));
        let mut turns = Turns::default();
        let t0 = Instant::now();
        // Changes of 50 ms: turns of 250 ms.
        let (ran, now) = run(&mut turns, &[a.clone(), b.clone()], t0, 12, 1_000, 50_000);
        assert_eq!(turns.switch_us(), Some(50_000.0));
        let held = turns.turn([a.clone(), b.clone()].iter(), now).unwrap();
        assert_eq!(held, *ran.last().unwrap(), "the turn goes on");
        turns.end_turn();
        let other = if held == a { b.clone() } else { a.clone() };
        assert_eq!(
            turns.turn([a.clone(), b.clone()].iter(), now),
            Some(other.clone())
        );
        // The new turn is whole.
        assert_eq!(turns.turn([a, b].iter(), now), Some(other));
    }

    #[test]
    fn changes_are_measured_against_steps_of_their_width_that_kept_the_set() {
        let (a, b) = (set(0.0), set(1.0));
        let mut turns = Turns::default();
        // The first decode: llama.cpp's set is not known yet, nothing is measured.
        assert_eq!(turns.changes(&a), None);
        turns.applied(Some(&a));
        turns.decoded(None, 1, true, 50_000.0);
        assert_eq!(turns.changes(&a), Some(false));
        turns.decoded(Some(false), 1, true, 1_000.0);
        // A change on a prompt chunk, and one of a width never seen without a change.
        turns.decoded(Some(true), 1, false, 9_000.0);
        turns.decoded(Some(true), 3, true, 9_000.0);
        assert_eq!(turns.switch_us(), None);
        // Three changes at a seen width: their median is the cost (one that looked faster
        // than a plain step counts as below 0; one slowed by something else is outvoted).
        for us in [500.0, 1_500.0, 90_000.0] {
            turns.decoded(Some(true), 1, true, us);
        }
        assert_eq!(turns.switch_us(), Some(500.0));
        // Then a change slowed by something else moves the cost by a bounded step: the sample
        // is clamped to 4 x 500 + 1,000 us.
        turns.decoded(Some(true), 1, true, 100_000.0);
        assert_eq!(turns.switch_us(), Some(500.0 + 0.25 * (3_000.0 - 500.0)));
        // A failure leaves llama.cpp's set unknown.
        turns.applied(None);
        assert_eq!(turns.changes(&b), None);
    }

    #[test]
    fn where_changes_look_faster_than_steps_turns_are_one_step() {
        let (a, b) = (set(0.0), set(1.0));
        let mut turns = Turns::default();
        turns.applied(Some(&a));
        turns.decoded(Some(false), 1, true, 1_000.0);
        for _ in 0..3 {
            turns.decoded(Some(true), 1, true, 500.0);
        }
        assert_eq!(turns.switch_us(), Some(-500.0));
        let t0 = Instant::now();
        let ready = [a.clone(), b.clone()];
        assert_eq!(turns.turn(ready.iter(), t0), Some(a.clone()));
        turns.decoded(Some(false), 1, true, 1_000.0);
        assert_eq!(turns.turn(ready.iter(), t0), Some(b));
    }

    #[test]
    fn a_cache_is_reused_only_under_its_own_set() {
        let tokens = [1, 2, 3];
        assert_eq!(reusable(&tokens, &set(1.0), &set(1.0)), &tokens);
        assert!(reusable(&tokens, &set(1.0), &set(0.5)).is_empty());
        assert!(reusable(&tokens, &LoraScales::base(), &set(0.5)).is_empty());
    }
}
