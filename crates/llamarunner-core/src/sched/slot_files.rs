//! `POST /slots/{id}`: a slot's cache saved to, restored from or erased for a slot file,
//! between steps.

use super::Scheduler;
use crate::backend::Backend;
use crate::protocol::vision::is_image_token;
use crate::protocol::{Ending, EngineError, EngineErrorKind, SlotAction, SlotOutcome};

impl<B: Backend> Scheduler<B> {
    /// Saves, restores or erases the cache of slot `index` (`POST /slots/{id}`). Runs between
    /// steps, so no batch is in flight; a slot serving a request is refused.
    pub fn slot_action(
        &mut self,
        index: usize,
        action: SlotAction,
    ) -> Result<SlotOutcome, EngineError> {
        let total = self.slots.len();
        let slot = self.slots.get_mut(index).ok_or_else(|| {
            EngineError::new(
                EngineErrorKind::SlotNotFound,
                format!("no slot {index}: this server has slots 0..{total}"),
            )
        })?;
        if slot.seq.is_some() {
            return Err(EngineError::new(
                EngineErrorKind::SlotBusy,
                format!("slot {index} is serving a request; retry when it is idle"),
            ));
        }
        match action {
            SlotAction::Save if slot.cached.iter().any(|&t| is_image_token(t)) => {
                // A slot file records token ids; an image's positions have no id another
                // server could check or decode again.
                Err(EngineError::new(
                    EngineErrorKind::InvalidRequest,
                    format!(
                        "slot {index} holds image positions, which a slot file cannot record; \
                         erase the slot or save one without images"
                    ),
                ))
            }
            SlotAction::Save => {
                let state = self
                    .backend
                    .seq_state(slot.id)
                    .map_err(|e| EngineError::new(EngineErrorKind::Internal, e.to_string()))?;
                Ok(SlotOutcome::Saved {
                    tokens: slot.cached.clone(),
                    state,
                    lora: slot.lora.clone(),
                })
            }
            SlotAction::Restore {
                tokens,
                state,
                lora,
            } => {
                let ctx = self.backend.slot_ctx();
                if tokens.len() > ctx {
                    return Err(EngineError::new(
                        EngineErrorKind::ContextLength,
                        format!(
                            "the saved cache holds {} tokens, a slot {ctx}",
                            tokens.len()
                        ),
                    ));
                }
                // Room for it in a cache the slots share.
                self.free_idle(tokens.len(), &[index]);
                let slot = &mut self.slots[index];
                let restored = self.backend.set_seq_state(slot.id, &state);
                // The scheduler's record must be exactly what the cache holds: anything else
                // (an error, or a state whose cell count is not its token count) leaves the
                // slot empty.
                let why = match restored {
                    Ok(n) if n == tokens.len() => None,
                    Ok(n) => Some(format!(
                        "the saved state holds {n} positions but names {} tokens",
                        tokens.len()
                    )),
                    Err(e) => Some(e.to_string()),
                };
                slot.cached.clear();
                if let Some(why) = why {
                    let id = slot.id;
                    if !self.backend.kv_clear(id) {
                        self.clear_every_cache(index);
                    }
                    return Err(EngineError::new(
                        EngineErrorKind::InvalidSlotState,
                        format!("llama.cpp could not restore the slot's cache: {why}"),
                    ));
                }
                slot.cached = tokens;
                slot.lora = lora;
                slot.last_used = Some(std::time::SystemTime::now());
                self.clock += 1;
                slot.last_tick = self.clock;
                Ok(SlotOutcome::Restored(slot.cached.len()))
            }
            SlotAction::Erase => {
                let n = slot.cached.len();
                self.backend.kv_truncate(slot.id, 0);
                slot.cached.clear();
                Ok(SlotOutcome::Erased(n))
            }
        }
    }

    /// A restore into slot `index` left cells that no removal by position reaches (a slot
    /// file whose checksum holds but whose state gives a cell a position outside every range:
    /// written by hand, or by another llama.cpp). Only emptying the whole cache removes them,
    /// or the slot would fail every later decode. Every slot's cache goes, and a request
    /// another slot is serving ends with a 503 to send it again (its cells go too; one
    /// swapped out of a shared cache keeps its cells in RAM and goes on).
    fn clear_every_cache(&mut self, index: usize) {
        tracing::warn!(
            slot = index,
            "a restored slot file left cells no removal by position reaches: the whole KV cache is cleared"
        );
        self.backend.kv_clear_all();
        for slot in &mut self.slots {
            if slot.seq.as_ref().is_some_and(|s| s.swapped.is_none()) {
                let Some(seq) = slot.seq.take() else {
                    continue;
                };
                let err = EngineError::new(
                    EngineErrorKind::CacheFull,
                    format!(
                        "the KV cache was cleared: a slot file restored into slot {index} held \
                         cells llama.cpp cannot remove one by one; send the request again"
                    ),
                );
                self.endings.push(Ending::error(seq.events, err));
            }
            slot.cached.clear();
        }
    }
}
