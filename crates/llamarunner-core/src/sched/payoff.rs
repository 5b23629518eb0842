//! Whether drafting pays, judged from the steps actually run rather than from the model of what
//! they should cost.
//!
//! `adaptive` decides how much to draft from estimates: each position's chance of being kept,
//! and a table of step times by width. Estimates can be wrong in ways the table does not see.
//! Whole-step costs beside the decode (the sampler over a 262,144-token vocabulary at every
//! drafted position, the draft model's passes, the lookup) are outside it. The batch holds other
//! sequences' contexts. The CPU's kernels change cost with the width in their own way (AVX-512's
//! repacked kernels differ from AVX2's, and a CPU without AVX2 has neither). An estimate that is
//! a little off on every step loses a little on every step.
//!
//! So the scheduler also keeps, per number of generating sequences in a step (`placed`), what
//! the steps really delivered: tokens per second of whole steps (drafting, decode and sampling)
//! with drafts, and of steps without. Without drafts, a step of `placed` sequences gives
//! `placed` tokens; with them, `placed` plus the accepted drafts. As soon as the drafted steps
//! deliver less than the plain ones (judged every `JUDGE` drafted steps, or after `EARLY` when
//! they deliver less than `CLEAR_LOSS` of the plain rate), drafting stops at that number of
//! sequences, and at every larger number that is drafting now (a wider batch only makes drafts
//! dearer: its step already does more work per position). After `backoff` steps there it tries
//! again, with fresh counts. The back-off doubles with each failed try (up to `MAX_BACKOFF`
//! steps) and halves with each try that pays. While drafting is on, one step in `AUDIT` at that
//! number goes without drafts, so the plain rate it is judged against stays current. The cost of
//! an audit is at most one step's gain in `AUDIT`. The rule only removes drafts; how many to
//! draft stays `adaptive`'s choice.
//!
//! What a try costs decides whether the default loses on a busy server: at 8 clients asking for
//! ~100 tokens each, every number of sequences from 1 to 8 is met within a few hundred steps,
//! so `JUDGE` slow steps at each, retried after `MIN_BACKOFF`, came to 5-10 % of the run. A clear
//! loss is stopped after `EARLY` steps, and a loss at n stops the counts above n unseen.
//!
//! And where drafts usually lose, they start off. On CPUs (AVX-512 here; a CPU without AVX2 in
//! the figures) a decode step's cost grows about linearly with its width once several
//! sequences share it, so drafts at 4 and 8 clients lost 5-25 % (RESULTS.md, issue #28), while
//! at one or two they gain 2-3x. From `WIDE` sequences on, a step drafts only after a first try
//! `MAX_BACKOFF` steps in (about two minutes of such steps) has paid: a GPU, whose wide steps
//! cost little more than narrow ones, finds that out and drafts on; a CPU pays for one try
//! (`EARLY` steps) every two minutes or more.

/// Drafted steps between judgements (a judgement needs plain steps too: `MIN_PLAIN`).
pub const JUDGE: u32 = 8;
/// Drafted steps after which a clear loss is judged without waiting for `JUDGE`.
pub const EARLY: u32 = 3;
/// A clear loss: the drafted steps delivered less than this share of the plain rate.
pub const CLEAR_LOSS: f64 = 0.85;
/// Plain steps a judgement needs at the least (their rate is the baseline), as a decayed count:
/// two steps make 1.9.
pub const MIN_PLAIN: f64 = 1.5;
/// With drafting on, a step without drafts is run after this many drafted ones in a row.
pub const AUDIT: u32 = 16;
/// Steps without drafts after the first failed try.
pub const MIN_BACKOFF: u32 = 64;
/// The longest wait between tries: 4,096 steps, about two minutes at 30 steps a second. A
/// failed try costs at most `JUDGE` slower steps in that time.
pub const MAX_BACKOFF: u32 = 4096;
/// The number of generating sequences from which drafting starts off (and first tries after
/// `MAX_BACKOFF` steps there).
pub const WIDE: usize = 3;
/// Each observation multiplies the weight of the earlier ones of its kind by this (a memory of
/// about ten steps: the plain rate follows the contexts as they grow).
const DECAY: f64 = 0.9;

/// Decayed sums of tokens delivered and microseconds spent over steps of one kind.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Rate {
    tokens: f64,
    us: f64,
    /// Decayed count of the steps.
    steps: f64,
}

impl Rate {
    fn add(&mut self, tokens: usize, us: u64) {
        self.tokens = self.tokens * DECAY + tokens as f64;
        self.us = self.us * DECAY + us.max(1) as f64;
        self.steps = self.steps * DECAY + 1.0;
    }

    /// Tokens per microsecond.
    fn per_us(&self) -> f64 {
        if self.us > 0.0 {
            self.tokens / self.us
        } else {
            0.0
        }
    }
}

/// What steps of one number of generating sequences delivered, and whether they draft.
#[derive(Clone, Debug, Default)]
struct Bucket {
    plain: Rate,
    drafted: Rate,
    /// Drafted steps since the last judgement.
    since_judged: u32,
    /// Drafted steps since the last plain one.
    since_plain: u32,
    /// Steps still to go without drafts (0: drafting is on).
    off_for: u32,
    /// The wait after the next failed try.
    backoff: u32,
    /// Tries that paid and that did not, for the log and the tests.
    paid: u32,
    lost: u32,
}

/// The decision for one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Drafts may be placed (as many as `adaptive` says pay).
    Draft,
    /// No drafts in this step: they did not pay at this number of sequences lately.
    Off,
    /// No drafts in this step, to measure the plain rate.
    Audit,
}

/// Per number of generating sequences in a step, what drafted and plain steps delivered.
#[derive(Clone, Debug, Default)]
pub struct Payoff {
    buckets: Vec<Bucket>,
    /// From this many sequences on, drafting starts off (`WIDE`); None: it starts on at every
    /// count.
    wide: Option<usize>,
}

impl Payoff {
    /// The server's rule: drafting starts off from `WIDE` sequences on.
    pub fn new() -> Self {
        Self {
            buckets: Vec::new(),
            wide: Some(WIDE),
        }
    }

    fn bucket(&mut self, placed: usize) -> &mut Bucket {
        while self.buckets.len() < placed + 1 {
            // A count first met while a smaller one is off starts off for as long (a loss at
            // n stands for the wider steps too).
            let inherited = self.buckets.iter().map(|b| b.off_for).max().unwrap_or(0);
            // From WIDE sequences on, drafting starts off and tries only after MAX_BACKOFF
            // steps: measured on CPUs, it lost there (see the module's text).
            let (off_for, backoff) = if self.wide.is_some_and(|w| self.buckets.len() >= w) {
                (inherited.max(MAX_BACKOFF), MAX_BACKOFF)
            } else {
                (inherited, MIN_BACKOFF)
            };
            self.buckets.push(Bucket {
                backoff,
                off_for,
                ..Bucket::default()
            });
        }
        &mut self.buckets[placed]
    }

    /// Whether a step of `placed` generating sequences may draft. Call once per step that could
    /// draft. It counts down an off period, and on a first draft or a retry it starts with
    /// fresh counts.
    pub fn verdict(&mut self, placed: usize) -> Verdict {
        if placed == 0 {
            return Verdict::Off;
        }
        let b = self.bucket(placed);
        if b.off_for > 0 {
            b.off_for -= 1;
            if b.off_for == 0 {
                // A new try: judged on its own steps only.
                b.drafted = Rate::default();
                b.since_judged = 0;
            }
            return Verdict::Off;
        }
        // Plain steps to judge by: after AUDIT drafted ones in a row, and while there are too
        // few, every other step.
        if b.since_plain >= AUDIT || (b.plain.steps < MIN_PLAIN && b.since_plain > 0) {
            return Verdict::Audit;
        }
        Verdict::Draft
    }

    /// A step of `placed` generating sequences (and no prompt positions), `drafted` positions
    /// among them, delivered `tokens` tokens in `us` microseconds (the whole step).
    pub fn observe(&mut self, placed: usize, drafted: usize, tokens: usize, us: u64) {
        if placed == 0 {
            return;
        }
        let b = self.bucket(placed);
        if drafted == 0 {
            b.plain.add(tokens, us);
            b.since_plain = 0;
            return;
        }
        b.drafted.add(tokens, us);
        b.since_plain = b.since_plain.saturating_add(1);
        b.since_judged += 1;
        if b.plain.steps < MIN_PLAIN {
            return;
        }
        let (drafted, plain) = (b.drafted.per_us(), b.plain.per_us());
        let clear_loss = b.since_judged >= EARLY && drafted < plain * CLEAR_LOSS;
        if b.since_judged < JUDGE && !clear_loss {
            return;
        }
        b.since_judged = 0;
        if drafted >= plain {
            b.paid += 1;
            b.backoff = (b.backoff / 2).max(MIN_BACKOFF);
            return;
        }
        b.lost += 1;
        b.off_for = b.backoff;
        let off_for = b.off_for;
        tracing::debug!(
            placed,
            drafted_tokens_per_s = drafted * 1e6,
            plain_tokens_per_s = plain * 1e6,
            off_steps = off_for,
            "drafts did not pay; off for a while"
        );
        b.backoff = b.backoff.saturating_mul(2).min(MAX_BACKOFF);
        // Wider steps, drafting now, stop as well (each tries again on its own after the same
        // wait; its own back-off is unchanged).
        for wider in self.buckets.iter_mut().skip(placed + 1) {
            if wider.off_for == 0 {
                wider.off_for = off_for;
            }
        }
    }

    /// Tries that paid and that did not, at `placed` sequences.
    #[cfg(test)]
    pub fn record(&self, placed: usize) -> (u32, u32) {
        self.buckets
            .get(placed)
            .map_or((0, 0), |b| (b.paid, b.lost))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` steps of `placed` sequences: a plain step costs `plain_us` and gives
    /// `placed` tokens, a drafted one costs `drafted_us` and gives `drafted_tokens`. Returns
    /// how many were drafted.
    fn run(
        p: &mut Payoff,
        placed: usize,
        steps: u32,
        plain_us: u64,
        drafted_us: u64,
        drafted_tokens: usize,
    ) -> u32 {
        let v = verdicts(p, placed, steps, plain_us, drafted_us, drafted_tokens);
        u32::try_from(v.matches('D').count()).unwrap_or(u32::MAX)
    }

    /// The verdicts of `steps` steps, as a string: D drafted, O off, A audit.
    fn verdicts(
        p: &mut Payoff,
        placed: usize,
        steps: u32,
        plain_us: u64,
        drafted_us: u64,
        drafted_tokens: usize,
    ) -> String {
        (0..steps)
            .map(|_| match p.verdict(placed) {
                Verdict::Draft => {
                    p.observe(placed, 4, drafted_tokens, drafted_us);
                    'D'
                }
                v => {
                    p.observe(placed, 0, placed, plain_us);
                    if v == Verdict::Off {
                        'O'
                    } else {
                        'A'
                    }
                }
            })
            .collect()
    }

    #[test]
    fn drafts_that_deliver_fewer_tokens_per_second_stop_at_the_first_judgement() {
        let mut p = Payoff::default();
        // 8 sequences: a plain step 60 ms for 8 tokens (133/s); a drafted one 80 ms for 10
        // tokens (125/s): slower, although it gives more tokens per step.
        let (j, off) = (JUDGE as usize, MIN_BACKOFF as usize);
        let first = verdicts(&mut p, 8, 10 + MIN_BACKOFF, 60_000, 80_000, 10);
        // Drafted and plain steps alternate until two plain ones give a baseline; the eighth
        // drafted step is judged, and drafting is off for MIN_BACKOFF steps.
        assert_eq!(
            first,
            format!("DADA{}{}", "D".repeat(j - 2), "O".repeat(off))
        );
        assert_eq!(p.record(8), (0, 1));
        // A try with fresh counts: JUDGE drafted steps, judged again, off twice as long.
        let second = verdicts(&mut p, 8, JUDGE + 2 * MIN_BACKOFF, 60_000, 80_000, 10);
        assert_eq!(second, format!("{}{}", "D".repeat(j), "O".repeat(2 * off)));
        assert_eq!(p.record(8), (0, 2));
        // The wait stops doubling at MAX_BACKOFF.
        for _ in 0..10 {
            verdicts(&mut p, 8, JUDGE + MAX_BACKOFF, 60_000, 80_000, 10);
        }
        let last = verdicts(&mut p, 8, JUDGE + MAX_BACKOFF, 60_000, 80_000, 10);
        assert_eq!(last.matches('D').count(), j, "{last}");
    }

    #[test]
    fn drafts_that_pay_go_on_with_one_audit_step_in_audit() {
        let mut p = Payoff::default();
        // One sequence: plain 20 ms for 1 token; drafted 24 ms for 2.5 tokens.
        let steps = 10 * AUDIT;
        let drafted = run(&mut p, 1, steps, 20_000, 24_000, 2);
        let (paid, lost) = p.record(1);
        assert_eq!(lost, 0);
        assert!(paid >= 10, "{paid}");
        // One plain step after AUDIT drafted ones (and two at the start, for a baseline).
        assert!(
            drafted >= steps * AUDIT / (AUDIT + 1) - 2,
            "{drafted} of {steps}"
        );
    }

    #[test]
    fn the_number_of_sequences_is_judged_separately() {
        let mut p = Payoff::default();
        // Drafts lose at 8 sequences and pay at 1 in the same run.
        for _ in 0..10 {
            run(&mut p, 8, 20, 60_000, 80_000, 10);
            run(&mut p, 1, 20, 20_000, 24_000, 2);
        }
        assert!(
            p.record(8).1 >= 1 && p.record(8).0 == 0,
            "{:?}",
            p.record(8)
        );
        assert!(
            p.record(1).0 >= 1 && p.record(1).1 == 0,
            "{:?}",
            p.record(1)
        );
    }

    #[test]
    fn a_try_that_pays_halves_the_back_off() {
        let mut p = Payoff::default();
        run(&mut p, 4, 2, 40_000, 60_000, 5);
        run(&mut p, 4, JUDGE, 40_000, 60_000, 5);
        assert_eq!(p.record(4), (0, 1));
        // The text turned predictable: after the back-off, the try pays and drafting stays on.
        let drafted = run(&mut p, 4, MIN_BACKOFF + 100, 40_000, 45_000, 8);
        assert!(drafted >= 90, "{drafted}");
        assert!(p.record(4).0 >= 1, "{:?}", p.record(4));
    }

    #[test]
    fn no_judgement_without_a_plain_baseline() {
        let mut p = Payoff::default();
        // Drafted steps only (the plain steps the audit rule asks for are never run): nothing
        // is judged, however slow the drafted steps, and every step asks for an audit.
        assert_eq!(p.verdict(2), Verdict::Draft);
        for _ in 0..3 * JUDGE {
            p.observe(2, 4, 2, 1_000_000);
        }
        assert_eq!(p.record(2), (0, 0));
        assert_eq!(p.verdict(2), Verdict::Audit);
        // Natural plain steps (the cost model chose no drafts) count as the baseline.
        p.observe(2, 0, 2, 10_000);
        p.observe(2, 0, 2, 10_000);
        assert_eq!(p.verdict(2), Verdict::Draft);
        for _ in 0..EARLY {
            p.observe(2, 4, 2, 1_000_000);
        }
        assert_eq!(p.record(2), (0, 1));
        assert_eq!(p.verdict(2), Verdict::Off);
    }

    #[test]
    fn from_wide_sequences_on_drafting_starts_off_and_tries_after_the_longest_wait() {
        let mut p = Payoff::new();
        // One and two sequences draft at once.
        assert_eq!(p.verdict(1), Verdict::Draft);
        assert_eq!(p.verdict(WIDE - 1), Verdict::Draft);
        // WIDE and more: off for MAX_BACKOFF steps, then a try; drafts that pay stay on.
        let wide = verdicts(&mut p, WIDE + 1, MAX_BACKOFF + 40, 60_000, 50_000, 12);
        let off = MAX_BACKOFF as usize;
        assert!(wide[..off].chars().all(|c| c == 'O'), "{}", &wide[..off]);
        // (The off steps were plain ones: a baseline, so no audits are needed.)
        assert_eq!(&wide[off..off + 4], "DDDD");
        assert!(wide[off..].matches('D').count() >= 30, "{}", &wide[off..]);
        // Drafts that lose there stop after EARLY steps, and wait the longest again.
        let mut q = Payoff::new();
        let lost = verdicts(&mut q, WIDE, MAX_BACKOFF + 10, 60_000, 120_000, 4);
        assert_eq!(
            &lost[off..],
            format!(
                "{}{}",
                "D".repeat(EARLY as usize),
                "O".repeat(10 - EARLY as usize)
            ),
            "{}",
            &lost[off..]
        );
        assert_eq!(q.record(WIDE), (0, 1));
    }

    #[test]
    fn a_clear_loss_is_stopped_after_early_steps() {
        let mut p = Payoff::default();
        // 8 sequences: plain 60 ms for 8 tokens (133/s); drafted 100 ms for 9 (90/s), under
        // CLEAR_LOSS of the plain rate.
        let first = verdicts(&mut p, 8, EARLY + 2 + MIN_BACKOFF, 60_000, 100_000, 9);
        let early = EARLY as usize;
        assert_eq!(
            first,
            format!(
                "DADA{}{}",
                "D".repeat(early - 2),
                "O".repeat(MIN_BACKOFF as usize)
            )
        );
        assert_eq!(p.record(8), (0, 1));
    }

    #[test]
    fn a_loss_at_n_sequences_stops_the_wider_steps_too() {
        let mut p = Payoff::default();
        // 6 sequences drafted and paid; then 4 lose.
        run(&mut p, 6, 20, 60_000, 50_000, 8);
        assert_eq!(p.record(6), (2, 0));
        run(&mut p, 4, 4 + JUDGE, 40_000, 80_000, 5);
        assert_eq!(p.record(4), (0, 1));
        // 6 (seen, drafting) and 8 (never seen) are off as long as 4; 2 and 1 are not.
        for placed in [6, 8] {
            assert_eq!(p.verdict(placed), Verdict::Off, "{placed}");
        }
        assert_eq!(p.verdict(2), Verdict::Draft);
        assert_eq!(p.verdict(1), Verdict::Draft);
        // After the wait, 8 tries on its own: it drafts again.
        let later = verdicts(&mut p, 8, MIN_BACKOFF, 60_000, 50_000, 12);
        assert!(later.ends_with('D'), "{later}");
    }
}
