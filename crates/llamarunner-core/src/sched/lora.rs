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
//! against a step, turns are one step and the sets alternate step by step; until a change has
//! been measured, a turn lasts `UNMEASURED_STEPS` steps (a decode that kept the set is the
//! comparison a change needs).
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

/// Widths (positions in a batch) whose decode time without a change of set is kept.
const PLAIN_WIDTHS: usize = 64;

/// Weight of the newest observation in the running means.
const RATE: f64 = 0.25;

/// Whose turn it is, how long it has lasted, and what a change of set costs.
#[derive(Debug, Default)]
pub(super) struct Turns {
    /// The set that has the turn, since when and for how many decoded steps.
    current: Option<LoraScales>,
    began: Option<Instant>,
    steps: u32,
    /// The set llama.cpp decoded the last batch under (None before the first decode).
    applied: Option<LoraScales>,
    /// What a change of set adds to a decode (microseconds), a running mean (below 0 where
    /// noise made the changes look faster); None until measured.
    switch_us: Option<f64>,
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
        }
        Some(next)
    }

    /// Whether the current turn goes on at `now`.
    fn lasts(&self, now: Instant) -> bool {
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

    /// A batch of `width` positions was decoded under `set` in `us` microseconds (`all_logits`:
    /// every position had its logits, as steps of generating sequences do). Says whether the
    /// set changed for it (that decode also reserved llama.cpp's graph again). A change is
    /// measured against the steps of its width that kept the set; while the sets alternate
    /// those grow stale as contexts lengthen, the change looks dearer, a turn lasts two steps
    /// and its second step brings them up to date.
    pub(super) fn decoded(
        &mut self,
        set: &LoraScales,
        width: usize,
        all_logits: bool,
        us: f64,
    ) -> bool {
        let changed = self.applied.as_ref().is_some_and(|a| a != set);
        let first = self.applied.is_none();
        self.applied = Some(set.clone());
        if self.current.as_ref() == Some(set) {
            self.steps = self.steps.saturating_add(1);
        }
        if first || !all_logits || width == 0 || width > PLAIN_WIDTHS {
            return changed;
        }
        if self.plain_us.len() < width {
            self.plain_us.resize(width, 0.0);
        }
        let plain = &mut self.plain_us[width - 1];
        if changed {
            if *plain > 0.0 {
                // Not clamped at 0: where a change costs nothing, the noise in decode times
                // averages out instead of adding up.
                let sample = us - *plain;
                self.switch_us = Some(match self.switch_us {
                    None => sample,
                    Some(s) => s + RATE * (sample - s),
                });
            }
        } else if *plain == 0.0 {
            *plain = us;
        } else {
            *plain += RATE * (us - *plain);
        }
        changed
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
            let changed = turns.applied.as_ref().is_some_and(|l| *l != set);
            let us = plain_us + if changed { switch_us } else { 0 };
            assert_eq!(turns.decoded(&set, 1, true, us as f64), changed);
            now += Duration::from_micros(us);
            ran.push(set);
        }
        (ran, now)
    }

    /// The lengths of the runs of one set in `ran`.
    fn runs(ran: &[LoraScales]) -> Vec<usize> {
        let mut lengths = vec![];
        for (i, s) in ran.iter().enumerate() {
            if i > 0 && ran[i - 1] == *s {
                *lengths.last_mut().unwrap() += 1;
            } else {
                lengths.push(1);
            }
        }
        lengths
    }

    #[test]
    fn where_a_change_costs_nothing_the_sets_alternate_after_the_first_turns() {
        let (a, b) = (set(0.0), set(1.0));
        let mut turns = Turns::default();
        let (ran, _) = run(&mut turns, &[a, b], Instant::now(), 40, 20_000, 0);
        let lengths = runs(&ran);
        // The first turn lasts two steps (a change cannot be measured yet); the first change
        // measures one, and from then on each turn is one step.
        assert_eq!(lengths[0], 2, "{lengths:?}");
        assert!(lengths[1..].iter().all(|&n| n == 1), "{lengths:?}");
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
        let lengths = runs(&ran);
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
        // A change of 400 ms would ask for turns of 4 s: they stop at MAX_TURN.
        let (ran, _) = run(&mut turns, &[a, b], Instant::now(), 600, 10_000, 400_000);
        let lengths = runs(&ran);
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
        assert!(turns.switch_us().is_some());
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
    fn steps_with_prompt_chunks_or_of_unseen_widths_do_not_measure_a_change() {
        let (a, b) = (set(0.0), set(1.0));
        let mut turns = Turns::default();
        assert!(!turns.decoded(&a, 1, true, 1_000.0));
        assert!(!turns.decoded(&a, 1, true, 1_000.0));
        // A change on a prompt chunk, and one of a width never seen without a change.
        assert!(turns.decoded(&b, 1, false, 9_000.0));
        assert!(turns.decoded(&a, 3, true, 9_000.0));
        assert_eq!(turns.switch_us(), None);
        // A change at a seen width measures it; one that looked faster than a plain step
        // counts as costing nothing.
        assert!(turns.decoded(&b, 1, true, 500.0));
        assert_eq!(turns.switch_us(), Some(-500.0));
        let t0 = Instant::now();
        let ready = [a.clone(), b.clone()];
        assert_eq!(turns.turn(ready.iter(), t0), Some(a.clone()));
        assert!(turns.decoded(&a, 1, true, 1_000.0));
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
