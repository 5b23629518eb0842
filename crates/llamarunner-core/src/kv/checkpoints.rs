//! Checkpoints of the sliding-window cells, so that a Gemma-style model keeps its cache when a
//! sequence is cut back or a shared prefix is forked.
//!
//! A model with sliding-window layers (and no `--swa-full`) keeps, in those layers, the cells
//! of about one window before a sequence's end: the rest fell out of the window and was freed.
//! Cut back to an earlier length, the sequence lacks the window before the cut, and the backend
//! refuses the cut (`Backend::kv_truncate`). Without checkpoints the whole prompt is decoded
//! again: every follow-up turn whose prefix ends a few tokens before the slot's end (a chat
//! template that renders the last answer differently, a stop string cut away), and every fork of
//! a system prompt that other conversations share (`--multiuser-cache`).
//!
//! A checkpoint is llama.cpp's partial state of a sequence (the windowed layers' cells only,
//! about a window's worth) taken while the prompt is decoded: once every `spacing` positions
//! (the window) and when the prompt is complete. To cut a sequence back to `len`, the
//! full-attention cells are cut at the longest checkpoint at most `len` long whose tokens are the
//! prompt's, and the checkpoint's windowed cells put back: what is lost is the tokens between the
//! checkpoint and `len`, at most one window, instead of the whole prompt (llama-server's context
//! checkpoints do the same).
//!
//! Checkpoints are kept apart from the slots, keyed by the tokens before them and the LoRA
//! scale set: one taken in one slot mends a fork into another, or a sequence that the prompt
//! cache restored into another slot. The oldest unused one goes first beyond `max`.

use super::state_store::{StateStore, Stored};
use crate::protocol::{LoraScales, Token};

/// One checkpoint: the windowed cells of a sequence that held exactly `tokens`.
pub type Checkpoint = Stored;

/// The checkpoints held, least recently used out first beyond `max` or the byte budget.
#[derive(Debug, Default)]
pub struct Checkpoints {
    store: StateStore,
}

impl Checkpoints {
    /// At most `max` checkpoints and `budget` bytes of them (either 0: none are taken).
    pub fn new(max: usize, budget: usize) -> Self {
        Self {
            store: StateStore::new(max, budget),
        }
    }

    pub fn enabled(&self) -> bool {
        self.store.enabled()
    }

    pub fn len(&self) -> usize {
        self.store.len()
    }

    pub fn is_empty(&self) -> bool {
        self.store.is_empty()
    }

    /// Bytes of state held.
    pub fn bytes(&self) -> usize {
        self.store.bytes()
    }

    /// Keeps a checkpoint of a sequence holding `tokens` under `lora`. One with the same
    /// tokens and set is replaced (its cells are the same).
    pub fn insert(&mut self, tokens: Vec<Token>, lora: LoraScales, state: Vec<u8>) {
        if !self.store.takes(&tokens, state.len()) {
            return;
        }
        self.store
            .remove_where(|c| c.lora == lora && c.tokens == tokens);
        self.store.push(tokens, lora, state);
    }

    /// The longest checkpoint, at most `at_most` tokens long, of a sequence that began as
    /// `prompt` does, under `lora`; it counts as used.
    pub fn best(
        &mut self,
        prompt: &[Token],
        lora: &LoraScales,
        at_most: usize,
    ) -> Option<&Checkpoint> {
        let limit = at_most.min(prompt.len());
        let i = self
            .store
            .entries()
            .iter()
            .enumerate()
            .filter(|(_, c)| {
                c.tokens.len() <= limit && &c.lora == lora && prompt.starts_with(&c.tokens)
            })
            .max_by_key(|(_, c)| c.tokens.len())
            .map(|(i, _)| i)?;
        Some(self.store.touch(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> LoraScales {
        LoraScales::default()
    }

    #[test]
    fn the_longest_checkpoint_within_the_limit_and_the_prompt_is_chosen() {
        let mut c = Checkpoints::new(8, 1 << 20);
        c.insert(vec![1, 2], base(), vec![0; 10]);
        c.insert(vec![1, 2, 3, 4], base(), vec![0; 20]);
        c.insert(vec![1, 2, 3, 4, 5, 6], base(), vec![0; 30]);
        c.insert(vec![1, 9, 9, 9], base(), vec![0; 40]);
        assert_eq!(c.bytes(), 100);
        let prompt = [1, 2, 3, 4, 5, 6, 7];
        assert_eq!(c.best(&prompt, &base(), 5).map(|k| k.tokens.len()), Some(4));
        assert_eq!(c.best(&prompt, &base(), 6).map(|k| k.tokens.len()), Some(6));
        assert_eq!(c.best(&prompt, &base(), 1).map(|k| k.tokens.len()), None);
        // Another prompt: only the checkpoints of its own tokens.
        assert_eq!(
            c.best(&[1, 9, 9, 9, 9], &base(), 9).map(|k| k.tokens.len()),
            Some(4)
        );
        assert_eq!(
            c.best(&[1, 2, 7], &base(), 9).map(|k| k.tokens.len()),
            Some(2)
        );
    }

    #[test]
    fn a_checkpoint_under_another_lora_set_is_not_used() {
        let mut c = Checkpoints::new(8, 1 << 20);
        let scaled = LoraScales::new(vec![0.5]);
        c.insert(vec![1, 2, 3], scaled.clone(), vec![0; 10]);
        assert!(c.best(&[1, 2, 3, 4], &base(), 9).is_none());
        assert!(c.best(&[1, 2, 3, 4], &scaled, 9).is_some());
    }

    #[test]
    fn the_least_recently_used_goes_first_and_a_repeat_replaces() {
        let mut c = Checkpoints::new(2, 1 << 20);
        c.insert(vec![1], base(), vec![0; 1]);
        c.insert(vec![2], base(), vec![0; 2]);
        // Using [1] makes [2] the oldest.
        assert!(c.best(&[1, 5], &base(), 9).is_some());
        c.insert(vec![3], base(), vec![0; 4]);
        assert_eq!(c.len(), 2);
        assert_eq!(c.bytes(), 5);
        assert!(c.best(&[2, 5], &base(), 9).is_none());
        // The same tokens again: replaced, not added.
        c.insert(vec![3], base(), vec![0; 8]);
        assert_eq!((c.len(), c.bytes()), (2, 9));
        // A byte budget: the oldest go until the new one fits; one larger than it is refused.
        let mut small = Checkpoints::new(8, 10);
        small.insert(vec![1], base(), vec![0; 4]);
        small.insert(vec![2], base(), vec![0; 4]);
        small.insert(vec![3], base(), vec![0; 4]);
        assert_eq!((small.len(), small.bytes()), (2, 8));
        assert!(small.best(&[1, 5], &base(), 9).is_none());
        small.insert(vec![4], base(), vec![0; 11]);
        assert_eq!((small.len(), small.bytes()), (2, 8));
        // Off: nothing is kept.
        let mut off = Checkpoints::new(0, 1 << 20);
        off.insert(vec![1], base(), vec![0; 1]);
        assert_eq!(off.len(), 0);
    }
}
