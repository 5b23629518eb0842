//! Output and back-pressure as policy: a sequence's text is offered to its client's sink when
//! there is some (for a client that takes the whole text at the end, once a large piece of it
//! has gathered); a client that has no room pauses its sequence (its text gathers in the
//! outbox); a client that left frees the slot. A finished sequence's last events become an
//! `Ending`, which the engine delivers (`engine/delivery.rs`).

use std::collections::VecDeque;
use std::time::Instant;

use super::{Scheduler, OUTBOX_CAP_BYTES, OUTBOX_CAP_LOGPROBS};
use crate::backend::Backend;
use crate::protocol::{nanos, Completion, DoneReason, Ending, Event, Offer, PromptProgress};

/// How much text (bytes, log-probability entries) a sequence whose client takes the whole text
/// at the end gathers before offering it: a quarter of what a paused sequence may hold, so that
/// such a sequence never pauses for text it held on purpose.
pub const WHOLE_TEXT_PIECE: (usize, usize) = (OUTBOX_CAP_BYTES / 4, OUTBOX_CAP_LOGPROBS / 4);

impl<B: Backend> Scheduler<B> {
    /// Sends what the sequence produced, if its channel has room; a closed channel frees the slot.
    /// For a client that takes the whole text at the end (`TextHold`), the text gathers until a
    /// quarter of what may be held (`WHOLE_TEXT_PIECE`), so that its task is woken once per
    /// thousands of tokens instead of once per step; `finish` sends the rest.
    pub(super) fn flush_outbox(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        let Some(seq) = slot.seq.as_mut() else {
            return;
        };
        if seq.outbox.is_empty() {
            return;
        }
        // A client that left is noticed without an offer, every turn (`drop_cancelled`).
        if seq.events.wants_whole_text()
            && seq.outbox.len() < WHOLE_TEXT_PIECE.0
            && seq.outbox_logprobs.len() < WHOLE_TEXT_PIECE.1
        {
            return;
        }
        // Entries go with the text that completes their tokens; a token still held back (a
        // possible stop string) keeps its entry for later.
        let complete = seq
            .text
            .tokens_returned()
            .saturating_sub(seq.logprobs_sent)
            .min(seq.outbox_logprobs.len());
        let event = Event::Text {
            text: std::mem::take(&mut seq.outbox),
            logprobs: seq.outbox_logprobs.drain(..complete).collect(),
        };
        match seq.events.offer(event) {
            Offer::Taken => seq.logprobs_sent += complete,
            Offer::Full(Event::Text { text, logprobs }) => {
                seq.outbox = text;
                seq.outbox_logprobs.splice(..0, logprobs);
            }
            Offer::Full(_) | Offer::Gone => slot.seq = None,
        }
    }

    /// Tells the client of slot `index` how far its prompt's decode is, when it asked
    /// (`return_progress`). A progress report is advisory: one the client has no room for is
    /// dropped (the next one says more), and it never pauses the sequence.
    pub(super) fn offer_progress(&mut self, index: usize) {
        let slot = &self.slots[index];
        let Some(seq) = slot.seq.as_ref() else {
            return;
        };
        if !seq.params.return_progress {
            return;
        }
        let progress = PromptProgress {
            total: seq.n_prompt,
            cache: seq.n_cached,
            processed: slot.cached.len().min(seq.n_prompt),
            time_ms: u64::try_from(seq.admitted.elapsed().as_millis()).unwrap_or(u64::MAX),
        };
        let _ = seq.events.offer(Event::Progress(progress));
    }

    /// Ends the sequence in slot `index`: flushes held text and sends the final statistics.
    pub(super) fn finish(&mut self, index: usize, reason: DoneReason) {
        let Some(mut seq) = self.slots[index].seq.take() else {
            return;
        };
        // A token whose text the sampling thread assembled ends its sequence only in
        // `sample_one`, which takes that text: none is left to reach the output unprocessed.
        debug_assert!(seq.prepushed.is_none(), "a pushed token's text not taken");
        let now = Instant::now();
        let prompt_done = seq.prompt_done.unwrap_or(now);
        seq.outbox.push_str(&seq.text.finish());
        let mut events = VecDeque::new();
        // Tokens of a stop string were not returned: their entries go too.
        let returned = seq.text.tokens_returned().saturating_sub(seq.logprobs_sent);
        seq.outbox_logprobs.truncate(returned);
        // Last tokens that render to nothing (an end of generation under `ignore_eos`) leave
        // no text but still have their entries.
        if !seq.outbox.is_empty() || !seq.outbox_logprobs.is_empty() {
            events.push_back(Event::Text {
                text: std::mem::take(&mut seq.outbox),
                logprobs: std::mem::take(&mut seq.outbox_logprobs),
            });
        }
        events.push_back(Event::Done(Completion {
            done_reason: reason,
            prompt_eval_count: seq.n_prompt,
            prompt_cached_count: seq.n_cached,
            queue_duration_ns: nanos(seq.admitted.saturating_duration_since(seq.received)),
            prompt_eval_duration_ns: nanos(prompt_done - seq.admitted),
            eval_count: seq.n_generated,
            eval_duration_ns: nanos(now - prompt_done),
            truncated: seq.truncated,
            draft_count: seq.spec.drafted,
            draft_accepted_count: seq.spec.accepted,
            stop_string: seq.text.stopped_by().map(str::to_string),
        }));
        self.slots[index].last_used = Some(std::time::SystemTime::now());
        self.turn_log
            .finished
            .push((self.slots[index].id, reason, seq.n_generated));
        self.endings.push(Ending {
            sink: seq.events,
            events,
        });
    }
}
