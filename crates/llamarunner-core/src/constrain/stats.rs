//! What the constraint engine has done in this process, for `GET /metrics`: every compile's
//! time (grammars, JSON schemas, tool-call grammars alike) and every constrained sequence's
//! token checks and masks. Process-wide, as the compiler and the guides have no handle on a
//! runner's metrics; a process that runs several in-process servers exports their sum.

use std::sync::OnceLock;
use std::time::Duration;

use prometheus::{Counter, Histogram, HistogramOpts, IntCounter, Registry};

/// The constraint engine's counters.
pub struct Stats {
    compile_seconds: Histogram,
    compile_failures: IntCounter,
    sequences: IntCounter,
    token_checks: IntCounter,
    masks: IntCounter,
    mask_seconds: Counter,
}

/// Compile-time buckets, in seconds: a small schema compiles in tens of microseconds, a large
/// grammar can take a second.
const COMPILE_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0,
];

/// The process's counters.
pub fn stats() -> &'static Stats {
    static STATS: OnceLock<Stats> = OnceLock::new();
    STATS.get_or_init(|| Stats::new().expect("valid metric definitions"))
}

impl Stats {
    fn new() -> Result<Self, prometheus::Error> {
        let name = |n: &str| format!("llamarunner:grammar_{n}");
        Ok(Self {
            compile_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    name("compile_seconds"),
                    "Time to compile a request's grammar, JSON schema or tool-call grammar \
                     (failed compiles included), in this process.",
                )
                .buckets(COMPILE_BUCKETS.to_vec()),
            )?,
            compile_failures: IntCounter::new(
                name("compile_failures_total"),
                "Grammars and schemas refused by the compiler (each a 400), in this process.",
            )?,
            sequences: IntCounter::new(
                name("sequences_total"),
                "Finished sequences that were decoded under a grammar, in this process.",
            )?,
            token_checks: IntCounter::new(
                name("token_checks_total"),
                "Sampled tokens checked against their sequence's grammar, in this process.",
            )?,
            masks: IntCounter::new(
                name("masks_total"),
                "Token masks computed because the grammar refused the sampled token, in this \
                 process.",
            )?,
            mask_seconds: Counter::new(
                name("mask_seconds_total"),
                "Time spent computing token masks, in this process.",
            )?,
        })
    }

    /// Adds the counters to `registry` (they may be in several).
    pub fn register(&self, registry: &Registry) -> Result<(), prometheus::Error> {
        registry.register(Box::new(self.compile_seconds.clone()))?;
        registry.register(Box::new(self.compile_failures.clone()))?;
        registry.register(Box::new(self.sequences.clone()))?;
        registry.register(Box::new(self.token_checks.clone()))?;
        registry.register(Box::new(self.masks.clone()))?;
        registry.register(Box::new(self.mask_seconds.clone()))
    }

    pub(crate) fn compiled(&self, took: Duration, ok: bool) {
        self.compile_seconds.observe(took.as_secs_f64());
        if !ok {
            self.compile_failures.inc();
        }
    }

    pub(crate) fn sequence(&self, checks: u64, masks: u64, mask_time: Duration) {
        self.sequences.inc();
        self.token_checks.inc_by(checks);
        self.masks.inc_by(masks);
        self.mask_seconds.inc_by(mask_time.as_secs_f64());
    }
}
