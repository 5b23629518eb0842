//! The engine: the one OS thread that owns a `Backend` and the `Scheduler` and runs the loop
//! (`event_loop.rs`: messages, slot-file actions, embeddings between steps in
//! `embeddings.rs`, the ended requests' last events in `delivery.rs`). The backend is loaded here (llama.cpp, `backend/llama/`), the drafting
//! policy fitted to it (a step's cost by width, measured before any request), and the engine
//! serves the inbox until the runner stops.

mod delivery;
mod embeddings;
mod event_loop;
pub mod step_cost_cache;

pub use delivery::Deliveries;
pub use event_loop::Engine;

#[cfg(feature = "llama")]
use crate::backend::llama;
#[cfg(feature = "llama")]
use crate::config::RunnerConfig;
#[cfg(feature = "llama")]
use crate::protocol::EngineInbox;
#[cfg(feature = "llama")]
use crate::sched::adaptive::{StepCost, MEASURED_WIDTHS};
#[cfg(feature = "llama")]
use crate::sched::speculative::SpecConfig;
#[cfg(feature = "llama")]
use crate::sched::Scheduler;

/// The engine thread's body: load the model, create the context, run the scheduler. A load
/// that fails is logged and shown by `/health`.
#[cfg(feature = "llama")]
pub fn run(config: &RunnerConfig, inbox: EngineInbox) {
    let health = inbox.health.clone();
    let stop = inbox.shutdown.clone();
    let served = llama::load(config, &health, stop, |mut backend, loaded| {
        let speculation = speculation(config, loaded.recurrent, |widths| {
            // Where the layers run is part of what a step costs: a GPU's step is not a CPU's,
            // and the fit's choice depends on the GPUs' free memory at load.
            let placement = health
                .model_info()
                .map(|info| info.devices.placement())
                .unwrap_or_default();
            let system = format!("{} | {placement}", llama::system_info());
            step_cost_cache::cached(config, &system, widths, || {
                llama::step_times(&mut backend, widths)
            })
        });
        let observer = inbox.observer.clone();
        let queue = inbox.queue.clone();
        let sched = Scheduler::new(backend, config.parallel as usize, observer, queue)
            .with_multiuser_cache(config.multiuser_cache)
            .with_prompt_cache(config.cache_ram_bytes())
            .with_checkpoints(
                usize::try_from(config.ctx_checkpoints).unwrap_or(0),
                config.cache_ram_bytes(),
            )
            .with_speculation(speculation);
        Engine::new(sched, inbox).run();
    });
    if let Err(message) = served {
        // The log names the file in full; `/health`, which anyone may read, names only the
        // file (an absolute path tells a client about the server's file system).
        tracing::error!(model = %config.model.display(), "{message}");
        health.set_error(message);
    }
}

/// The drafting settings for this model: off for a recurrent or hybrid one (its state cannot
/// drop the cells of rejected drafts: llama.cpp keeps one state per sequence, so each rejection
/// would decode the whole slot again); otherwise the configured ones with the cost of a step
/// by width, which `sched/adaptive.rs` decides from how much drafting pays (`step_times` gives
/// microseconds for widths 1, 2, ...; None counts positions as free: every draft found is
/// verified, as without the measurement).
#[cfg(feature = "llama")]
fn speculation(
    config: &RunnerConfig,
    recurrent: bool,
    step_times: impl FnOnce(usize) -> Option<Vec<u64>>,
) -> SpecConfig {
    let configured = configured_speculation(config);
    if recurrent {
        if configured.draft_max > 0 {
            tracing::info!(
                "speculative decoding is off: a recurrent model cannot roll back drafts"
            );
        }
        return SpecConfig::OFF;
    }
    if configured.draft_max == 0 {
        return configured;
    }
    let widths = (1 + configured.draft_max).min(MEASURED_WIDTHS);
    let cost = step_times(widths).map_or(StepCost::FREE, |times| StepCost::from_times(&times));
    tracing::info!(
        step_us = ?cost.times(),
        "the decode step's cost by width (how much drafting pays)"
    );
    SpecConfig {
        cost,
        measure: true,
        ..configured
    }
}

/// The drafting settings as configured (`--draft-max`, `--draft-min`, `--spec-ngram`,
/// `--draft-always`), before they are fitted to the model.
pub fn configured_speculation(
    config: &crate::config::RunnerConfig,
) -> crate::sched::speculative::SpecConfig {
    let n = |v: u32| usize::try_from(v).unwrap_or(usize::MAX);
    crate::sched::speculative::SpecConfig {
        draft_max: n(config.draft_max),
        draft_min: n(config.draft_min),
        ngram: n(config.spec_ngram),
        cost: crate::sched::adaptive::StepCost::FREE,
        measure: false,
        always: config.draft_always,
    }
}

#[cfg(test)]
mod tests {
    use crate::config::RunnerConfig;

    #[test]
    fn the_default_drafting_settings() {
        let spec = super::configured_speculation(&RunnerConfig::default());
        assert_eq!((spec.draft_max, spec.draft_min, spec.ngram), (16, 1, 6));
        assert!(!spec.measure && !spec.always);
    }
}
