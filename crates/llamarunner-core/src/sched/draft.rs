//! Drafts from a draft model (`--draft-model`): a smaller model of the same vocabulary, in a
//! second llama.cpp context with one sequence per slot, drafts greedily for every generating
//! sequence that speculates, all of them in one batched pass per step.
//!
//! The draft model's cache of a slot (`Slot::draft_cached`) follows the slot's tokens lazily:
//! before drafting, the longest common prefix of what it holds and what the slot holds (plus the
//! sequence's next token) is kept, the rest removed, and what is missing decoded (the prompt the
//! first time, afterwards the token just sampled and the drafted tokens the model accepted). So
//! rejected drafts, context shifts, a cache cut after a stop, forks and restored slot files need
//! nothing of their own: the next draft pass re-syncs. Then up to `--draft-max` draft decodes
//! follow, each carrying the latest drafted token of every sequence still drafting; a sequence
//! stops at its draft length (chosen as for lookup drafts, `speculative.rs`) or when the draft
//! model's best token is less likely than `P_MIN`. The drafts are verified as lookup drafts are:
//! in the model's decode step, position by position with the request's own sampler.
//!
//! A failed draft decode costs only the drafts of that step: the step goes on without them,
//! and the draft caches of the sequences in it are cleared (one warning per server).

use super::Scheduler;
use crate::backend::{Backend, BatchToken};
use crate::protocol::Token;

/// A drafted token whose probability (among the draft model's ten likeliest) is below this
/// ends the draft (llama.cpp's `p_min`; llama-server's default is 0 now, 0.75 in earlier
/// releases, which is kept here: an unsure token is rarely accepted).
pub const P_MIN: f32 = 0.75;

/// A sequence drafting in this pass.
struct Job {
    /// Slot index.
    slot: usize,
    /// Most tokens it may draft.
    max: usize,
    /// Batch index of its logits in the latest draft decode.
    at: usize,
}

/// Length of the common prefix of two token lists.
fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<B: Backend> Scheduler<B> {
    /// Drafts with the draft model for the generating sequences placed in this step's batch
    /// (`placed` of them), within `budget` batch places; returns the places used.
    pub(super) fn place_model_drafts(&mut self, budget: usize, placed: usize) -> usize {
        // A slot holding image positions (`protocol::vision`) does not draft: the draft model
        // has no projector to decode them with.
        let lengths = self.draft_lengths(budget, placed, false, |i, max, s| {
            if s.slots[i].cached.iter().any(|&t| t < 0) {
                (0, 0)
            } else {
                (max, 0)
            }
        });
        let capacity = self.backend.batch_capacity().max(1);
        let mut batch: Vec<BatchToken> = Vec::new();
        let mut jobs: Vec<Job> = Vec::new();
        let mut added: Vec<(usize, Vec<Token>)> = Vec::new();
        for (i, max) in lengths {
            let slot = &mut self.slots[i];
            let Some(seq) = slot.seq.as_ref() else {
                continue;
            };
            let Some(&last) = seq.pending.first() else {
                continue;
            };
            // What the draft model must have decoded: the slot's tokens and the next one (whose
            // logits give the first draft).
            let mut history = Vec::with_capacity(slot.cached.len() + 1);
            history.extend_from_slice(&slot.cached);
            history.push(last);
            let mut common = common_prefix(&slot.draft_cached, &history).min(history.len() - 1);
            if common < slot.draft_cached.len() && !self.backend.draft_truncate(slot.id, common) {
                self.backend.draft_truncate(slot.id, 0);
                common = 0;
            }
            slot.draft_cached.truncate(common);
            let missing = &history[common..];
            let room = capacity.saturating_sub(batch.len());
            if room == 0 {
                continue;
            }
            // A long catch-up (a new prompt) is decoded in pieces over several steps; the
            // sequence drafts once all of it is in.
            let take = missing.len().min(room);
            let whole = take == missing.len();
            for (j, &token) in missing[..take].iter().enumerate() {
                batch.push(BatchToken {
                    token,
                    pos: super::pos_of(common + j),
                    seq: slot.id,
                    logits: whole && j + 1 == take,
                });
            }
            added.push((i, missing[..take].to_vec()));
            if whole {
                jobs.push(Job {
                    slot: i,
                    max,
                    at: batch.len() - 1,
                });
            }
        }
        if batch.is_empty() {
            return 0;
        }
        let started = std::time::Instant::now();
        if !self.draft_decode(&batch, &added) {
            return 0;
        }
        // Greedy drafting, one decode per drafted position, all sequences together.
        loop {
            batch.clear();
            added.clear();
            let mut next = Vec::new();
            for job in jobs.drain(..) {
                let Some((token, p)) = self.backend.draft_pick(job.at) else {
                    continue;
                };
                if p < P_MIN {
                    continue;
                }
                let slot = &mut self.slots[job.slot];
                let Some(seq) = slot.seq.as_mut() else {
                    continue;
                };
                seq.spec.draft.push(token);
                if seq.spec.draft.len() >= job.max {
                    continue;
                }
                batch.push(BatchToken {
                    token,
                    pos: super::pos_of(slot.draft_cached.len()),
                    seq: slot.id,
                    logits: true,
                });
                added.push((job.slot, vec![token]));
                next.push(Job {
                    at: batch.len() - 1,
                    ..job
                });
            }
            if batch.is_empty() {
                break;
            }
            if !self.draft_decode(&batch, &added) {
                return 0;
            }
            jobs = next;
        }
        let min = self.speculation.draft_min.max(1);
        let (mut drafted, mut used) = (0, 0);
        for slot in &mut self.slots {
            if let Some(seq) = slot.seq.as_mut() {
                drafted += seq.spec.draft.len();
                if seq.spec.draft.len() < min {
                    seq.spec.draft.clear();
                }
                used += seq.spec.draft.len();
            }
        }
        if drafted > 0 && self.speculation.measure {
            let us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.step_cost.observe_draft(drafted, us);
        }
        used
    }

    /// Decodes `batch` on the draft model and records in each slot's `draft_cached` the tokens
    /// `added` to it. On a failure no sequence drafts this step, and the draft caches of the
    /// slots in the batch are cleared (what they hold is unknown); false.
    fn draft_decode(&mut self, batch: &[BatchToken], added: &[(usize, Vec<Token>)]) -> bool {
        match self.backend.draft_decode(batch) {
            Ok(()) => {
                for (i, tokens) in added {
                    self.slots[*i].draft_cached.extend_from_slice(tokens);
                }
                true
            }
            Err(e) => {
                if !self.draft_failed {
                    self.draft_failed = true;
                    tracing::warn!(
                        error = %e,
                        "a draft model decode failed; that step goes on without drafts \
                         (logged once)"
                    );
                }
                for (i, _) in added {
                    let slot = &mut self.slots[*i];
                    self.backend.draft_truncate(slot.id, 0);
                    slot.draft_cached.clear();
                }
                for slot in &mut self.slots {
                    if let Some(seq) = slot.seq.as_mut() {
                        seq.spec.draft.clear();
                    }
                }
                false
            }
        }
    }
}
