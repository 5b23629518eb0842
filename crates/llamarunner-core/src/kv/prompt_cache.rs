//! The host-memory prompt cache (`--cache-ram`): KV states of sequences that had to leave
//! their slot, kept in RAM so that a later prompt that starts the same way is restored rather
//! than decoded again.
//!
//! A slot holds one sequence's cells. When a new prompt takes a slot whose cache it does not
//! continue, the slot's tokens past the common prefix would be lost. An agent loop with more
//! conversations than slots loses them on every turn. So before a slot is overwritten, its
//! sequence's state (llama.cpp's per-sequence state, the bytes a slot file holds) is stored
//! here with its tokens and LoRA scale set. Admission then compares the prompt with the entries
//! as it compares it with the slots. An entry that shares a longer prefix than the chosen slot
//! is restored into the slot, and only the rest of the prompt is decoded.
//!
//! - **Keys.** An entry serves only prompts under its LoRA scale set (other adapters give other
//!   cells). Images are in the token lists (each image's positions carry ids derived from its
//!   content), so a prefix with an image matches only the same image.
//! - **Budget.** Entries are held within `budget` bytes and `MAX_ENTRIES`. The least recently
//!   stored go first, and an entry larger than the budget is not stored.
//! - **Stored once.** A new entry supersedes the entries whose tokens are a prefix of its own
//!   (the same conversation's earlier turns, say), since a restore can cut it back to them;
//!   those are dropped.
//! - **Taken out on restore.** A restored entry leaves the cache, because its cells are back in
//!   a slot. When that slot is overwritten in its turn, it is stored again with what it gained
//!   meanwhile.
//!
//! A sliding-window model (Gemma 3 without `--swa-full`) keeps only the window's cells in its
//! windowed layers. A restored state therefore serves prompts that continue it, or cut back
//! less than the window. A deeper cut is refused by the backend's window check (`kv_truncate`),
//! and that prompt is decoded in full, as it would be without the cache.

use super::state_store::{StateStore, Stored};
use crate::protocol::{LoraScales, Token};

/// A stored sequence.
pub type Entry = Stored;

/// The cache's counters since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Sequences stored.
    pub stored: u64,
    /// Entries restored into a slot.
    pub restored: u64,
    /// Prompt tokens that restores saved decoding.
    pub restored_tokens: u64,
    /// Entries dropped for room (least recently used first).
    pub evicted: u64,
    /// Entries dropped because a newer one continues them.
    pub superseded: u64,
}

/// Sequences' states in RAM, within a byte budget.
#[derive(Debug, Default)]
pub struct PromptCache {
    store: StateStore,
    stats: CacheStats,
}

/// A restore must save at least this many prompt tokens beyond what the chosen slot already
/// holds (restoring costs a copy of the whole state).
pub const MIN_RESTORE_GAIN: usize = 16;
/// A slot's sequence is stored only when at least this many of its tokens would be lost.
pub const MIN_STORE: usize = 32;
/// Most entries held, whatever the budget: admission compares the prompt with every entry, so
/// many small states (a small model, short prompts) would make each admission slow. The least
/// recently stored go first past it, as past the budget.
pub const MAX_ENTRIES: usize = 256;

impl PromptCache {
    /// A cache of at most `budget` bytes; 0 turns it off.
    pub fn new(budget: usize) -> Self {
        Self {
            store: StateStore::new(MAX_ENTRIES, budget),
            stats: CacheStats::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.store.enabled()
    }

    /// Bytes held.
    pub fn used(&self) -> usize {
        self.store.bytes()
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.store.len()
    }

    pub fn is_empty(&self) -> bool {
        self.store.is_empty()
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// The entry sharing the longest prefix with `prompt` under `lora`, if it shares more than
    /// `beyond` tokens plus `MIN_RESTORE_GAIN`: its index and the shared length.
    pub fn best(
        &self,
        prompt: &[Token],
        lora: &LoraScales,
        beyond: usize,
    ) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize)> = None;
        for (i, e) in self.store.entries().iter().enumerate() {
            if &e.lora != lora {
                continue;
            }
            let common = crate::kv::common_prefix(&e.tokens, prompt);
            if best.is_none_or(|(_, b)| common > b) {
                best = Some((i, common));
            }
        }
        best.filter(|&(_, common)| common >= beyond + MIN_RESTORE_GAIN)
    }

    /// The tokens entry `index` holds (0 for no such entry).
    pub fn entry_len(&self, index: usize) -> usize {
        self.store
            .entries()
            .get(index)
            .map_or(0, |e| e.tokens.len())
    }

    /// Takes entry `index` out (to restore it); counts `saves` prompt tokens not decoded.
    pub fn take(&mut self, index: usize, saves: usize) -> Entry {
        self.stats.restored += 1;
        self.stats.restored_tokens += saves as u64;
        self.store.take(index)
    }

    /// Whether storing `tokens` under `lora` would add nothing: an entry holds them or a
    /// continuation of them.
    pub fn covers(&self, tokens: &[Token], lora: &LoraScales) -> bool {
        self.store
            .entries()
            .iter()
            .any(|e| &e.lora == lora && e.tokens.starts_with(tokens))
    }

    /// Stores a sequence's `state`: the entries it continues are dropped, then the least
    /// recently used ones until it fits. Returns whether it was stored (not when it is larger
    /// than the whole budget, or empty).
    pub fn insert(&mut self, tokens: Vec<Token>, lora: LoraScales, state: Vec<u8>) -> bool {
        if !self.store.takes(&tokens, state.len()) {
            return false;
        }
        let superseded = self
            .store
            .remove_where(|e| e.lora == lora && tokens.starts_with(&e.tokens));
        self.stats.superseded += superseded as u64;
        self.stats.evicted += self.store.push(tokens, lora, state) as u64;
        self.stats.stored += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(r: std::ops::Range<i32>) -> Vec<Token> {
        r.collect()
    }

    fn base() -> LoraScales {
        LoraScales::base()
    }

    #[test]
    fn the_longest_shared_prefix_under_the_same_lora_set_is_chosen() {
        let mut c = PromptCache::new(1 << 20);
        assert!(c.insert(toks(0..100), base(), vec![1; 400]));
        let mut other = toks(0..50);
        other.extend(200..300);
        assert!(c.insert(other.clone(), base(), vec![2; 400]));
        let mut prompt = toks(0..80);
        prompt.push(7);
        assert_eq!(c.best(&prompt, &base(), 0), Some((0, 80)));
        // A slot that already holds 70 of them: 80 is not worth a restore (MIN_RESTORE_GAIN).
        assert_eq!(c.best(&prompt, &base(), 70), None);
        assert_eq!(c.best(&prompt, &base(), 64), Some((0, 80)));
        // Under another LoRA scale set nothing matches.
        let lora = LoraScales::new(vec![0.5]);
        assert_eq!(c.best(&prompt, &lora, 0), None);
        assert!(c.insert(toks(0..100), lora.clone(), vec![3; 400]));
        assert_eq!(c.best(&prompt, &lora, 0), Some((2, 80)));
    }

    #[test]
    fn the_least_recently_stored_go_first_within_the_budget() {
        let mut c = PromptCache::new(1000);
        for k in 0..3 {
            assert!(c.insert(toks(k * 1000..k * 1000 + 50), base(), vec![0; 300]));
        }
        assert_eq!((c.len(), c.used()), (3, 900));
        // A fourth needs room: the first goes.
        assert!(c.insert(toks(5000..5050), base(), vec![0; 300]));
        assert_eq!((c.len(), c.used()), (3, 900));
        assert_eq!(c.best(&toks(0..50), &base(), 0), None);
        assert!(c.best(&toks(1000..1050), &base(), 0).is_some());
        assert_eq!(c.stats().evicted, 1);
        // One larger than the whole budget is not stored, and evicts nothing.
        assert!(!c.insert(toks(9000..9050), base(), vec![0; 1001]));
        assert_eq!(c.len(), 3);
        // One that needs two entries' room takes the two oldest.
        assert!(c.insert(toks(7000..7050), base(), vec![0; 700]));
        assert_eq!((c.len(), c.used()), (2, 1000));
        assert!(c.best(&toks(5000..5050), &base(), 0).is_some());
        assert_eq!(c.stats().evicted, 3);
    }

    #[test]
    fn a_continuation_supersedes_the_entries_it_extends() {
        let mut c = PromptCache::new(1 << 20);
        // A conversation's turns: each stored state continues the last.
        assert!(c.insert(toks(0..100), base(), vec![0; 100]));
        assert!(c.insert(toks(0..150), base(), vec![0; 150]));
        assert!(c.insert(toks(0..220), base(), vec![0; 220]));
        assert_eq!((c.len(), c.used()), (1, 220));
        assert_eq!(c.stats().superseded, 2);
        // Stored once: the shorter ones are served by the longest (a restore cuts it back).
        assert_eq!(c.best(&toks(0..120), &base(), 0), Some((0, 120)));
        assert!(c.covers(&toks(0..150), &base()));
        assert!(!c.covers(&toks(0..221), &base()));
        // Another conversation with the same start is a sibling, not a continuation.
        let mut sibling = toks(0..100);
        sibling.extend(500..600);
        assert!(c.insert(sibling, base(), vec![0; 200]));
        assert_eq!(c.len(), 2);
        // Under another LoRA set the same tokens supersede nothing.
        assert!(c.insert(toks(0..300), LoraScales::new(vec![1.0]), vec![0; 300]));
        assert_eq!(c.len(), 3);
    }

    #[test]
    fn a_restored_entry_leaves_the_cache() {
        let mut c = PromptCache::new(1 << 20);
        assert!(c.insert(toks(0..100), base(), vec![9; 400]));
        let (i, common) = c.best(&toks(0..100), &base(), 0).expect("a match");
        let e = c.take(i, common - 1);
        assert_eq!((e.tokens.len(), e.state.len()), (100, 400));
        assert_eq!((c.len(), c.used()), (0, 0));
        assert_eq!((c.stats().restored, c.stats().restored_tokens), (1, 99));
    }

    #[test]
    fn at_most_max_entries_are_held_whatever_the_budget() {
        let mut c = PromptCache::new(1 << 30);
        for k in 0..MAX_ENTRIES as i32 + 10 {
            assert!(c.insert(toks(k * 100..k * 100 + 40), base(), vec![0; 8]));
        }
        assert_eq!(c.len(), MAX_ENTRIES);
        assert_eq!(c.used(), 8 * MAX_ENTRIES);
        // The first ten went.
        assert_eq!(c.best(&toks(0..40), &base(), 0), None);
        assert!(c.best(&toks(1000..1040), &base(), 0).is_some());
        assert_eq!(c.stats().evicted, 10);
    }

    #[test]
    fn off_stores_nothing() {
        let mut c = PromptCache::new(0);
        assert!(!c.enabled());
        assert!(!c.insert(toks(0..100), base(), vec![1; 4]));
        assert_eq!(c.len(), 0);
    }
}
