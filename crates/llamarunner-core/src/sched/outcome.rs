//! What a turn of the scheduler did, as plain data (vLLM v1's `SchedulerOutput` is the model):
//! the requests admitted, each sequence's share of the step's batch and what came of it, the
//! sequences swapped out of a shared cache and the requests that ended. The engine reads it to
//! know how to wait; tests assert on it instead of watching event channels.

use super::{Phase, Scheduler};
use crate::backend::Backend;
use crate::protocol::DoneReason;

/// What one turn did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepOutcome {
    /// Tokens in the decoded batch (prompt chunks, next tokens and drafts); 0 when nothing
    /// was decoded.
    pub batch_tokens: usize,
    /// Of those, positions whose logits were computed.
    pub outputs: usize,
    /// Drafted positions in the batch.
    pub drafted: usize,
    /// Images decoded before the batch.
    pub images: bool,
    /// The batch failed to decode (its sequences got the error).
    pub failed: bool,
    /// Nothing was decoded although sequences are running (all paused for their clients):
    /// the next receive waits a moment instead of spinning.
    pub stalled: bool,
    /// The slots that took a waiting request this turn, in the order they took them.
    pub admitted: Vec<i32>,
    /// The step's plan and what came of it: one entry per sequence that had work in it, in
    /// slot order.
    pub sequences: Vec<SequenceStep>,
    /// The slots whose sequence was swapped out of the shared cache (`--kv-unified`) to RAM.
    pub swapped_out: Vec<i32>,
    /// The requests that ended since the last turn (finished, stopped, cut or timed out):
    /// their slot and why. Errors are not here; they are in the engine's endings.
    pub finished: Vec<(i32, DoneReason)>,
}

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SequenceStep {
    /// Its slot.
    pub slot: i32,
    /// Prompt tokens in the batch (or, after a context shift that could not be done in
    /// place, kept tokens decoded again).
    pub prompt_tokens: usize,
    /// Its next token in the batch: 1 for a generating sequence that got a place, else 0.
    pub decode_tokens: usize,
    /// Drafted tokens in the batch after its next token (speculative decoding).
    pub drafted: usize,
    /// Positions of an image decoded before the batch.
    pub image_positions: usize,
    /// Tokens it generated in this step (a draft accepted gives several).
    pub generated: usize,
    /// Why it ended in this step, if it did.
    pub finished: Option<DoneReason>,
}

/// What happened between two outcomes that the outcome reports: kept by the scheduler as it
/// happens, taken by `turn`.
#[derive(Debug, Default)]
pub(super) struct TurnLog {
    pub(super) admitted: Vec<i32>,
    pub(super) swapped_out: Vec<i32>,
    /// Slot, reason and the tokens it had generated when it ended.
    pub(super) finished: Vec<(i32, DoneReason, usize)>,
}

impl<B: Backend> Scheduler<B> {
    /// The step's plan, once the batch is built: each sequence with work in it, with the
    /// tokens it had generated before the step (to count what the step gave it).
    pub(super) fn step_plan(&self) -> Vec<(SequenceStep, usize)> {
        self.slots
            .iter()
            .filter_map(|slot| {
                let seq = slot.seq.as_ref()?;
                let drafted = seq.spec.draft.len();
                if seq.queued + seq.image_queued + drafted == 0 {
                    return None;
                }
                let (prompt_tokens, decode_tokens) = if seq.phase == Phase::Decode {
                    (0, seq.queued)
                } else {
                    (seq.queued, 0)
                };
                let step = SequenceStep {
                    slot: slot.id,
                    prompt_tokens,
                    decode_tokens,
                    drafted,
                    image_positions: seq.image_queued,
                    ..SequenceStep::default()
                };
                Some((step, seq.n_generated))
            })
            .collect()
    }

    /// The plan with what came of it: the tokens each sequence generated, and whether it
    /// ended (by the ends logged in the step, from `ends_before` on).
    pub(super) fn step_results(
        &self,
        plan: Vec<(SequenceStep, usize)>,
        ends_before: usize,
    ) -> Vec<SequenceStep> {
        let ends = self
            .turn_log
            .finished
            .get(ends_before..)
            .unwrap_or_default();
        plan.into_iter()
            .map(|(mut step, before)| {
                let index = usize::try_from(step.slot).unwrap_or(usize::MAX);
                let now = match self.slots.get(index).and_then(|s| s.seq.as_ref()) {
                    Some(seq) => Some(seq.n_generated),
                    None => ends
                        .iter()
                        .rev()
                        .find(|(slot, _, _)| *slot == step.slot)
                        .map(|&(_, reason, generated)| {
                            step.finished = Some(reason);
                            generated
                        }),
                };
                step.generated = now.unwrap_or(before).saturating_sub(before);
                step
            })
            .collect()
    }

    /// Moves what the turn log holds into `outcome`.
    pub(super) fn take_turn_log(&mut self, outcome: &mut StepOutcome) {
        let log = std::mem::take(&mut self.turn_log);
        outcome.admitted = log.admitted;
        outcome.swapped_out = log.swapped_out;
        outcome.finished = log
            .finished
            .into_iter()
            .map(|(slot, reason, _)| (slot, reason))
            .collect();
    }
}
