//! LoRA scale sets in the batching loop. llama.cpp applies one set of adapter scales to a whole
//! `llama_decode`, so a batch holds the sequences of one set only, and the sets take turns:
//! each step runs the set after the one that ran last (in the order the sets first appear in
//! the slot table), so with two sets busy each gets every other step and none starves. The KV
//! cells a sequence writes depend on its set, so a slot's cache is only reused, or forked from,
//! by a prompt of the set it was computed under.
//!
//! Cost: with k sets busy at once, each decode carries about 1/k of the generating sequences,
//! so each stream runs about k times slower than with one set, and a change of set between two
//! decodes makes llama.cpp rebuild its compute graph.

use crate::protocol::LoraScales;

/// The set to decode this step: the first of `ready` (the sets of sequences that have tokens
/// to decode, in slot order, repeats allowed) after `last`, cycling; `None` when nothing is
/// ready.
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

    #[test]
    fn a_cache_is_reused_only_under_its_own_set() {
        let tokens = [1, 2, 3];
        assert_eq!(reusable(&tokens, &set(1.0), &set(1.0)), &tokens);
        assert!(reusable(&tokens, &set(1.0), &set(0.5)).is_empty());
        assert!(reusable(&tokens, &LoraScales::base(), &set(0.5)).is_empty());
    }
}
