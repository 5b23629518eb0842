//! The store under every host-memory cache tier: sequences' states (llama.cpp's bytes for a
//! sequence's cells) keyed by the tokens they hold and the LoRA scale set they were computed
//! under, within a byte budget and a count, the least recently used out first. The prompt
//! cache (`prompt_cache.rs`) and the window checkpoints (`checkpoints.rs`) are policies over
//! it; a new tier (disk, another device) is another.

use crate::protocol::{LoraScales, Token};

/// One stored state: the cells of a sequence that held exactly `tokens` under `lora`.
#[derive(Debug)]
pub struct Stored {
    pub tokens: Vec<Token>,
    pub lora: LoraScales,
    /// The backend's state (`KvOps::seq_state` or `KvOps::window_checkpoint`).
    pub state: Vec<u8>,
    /// Last store or use, by the store's clock (smaller is older).
    tick: u64,
}

/// States within `budget` bytes and `max` entries.
#[derive(Debug, Default)]
pub struct StateStore {
    entries: Vec<Stored>,
    max: usize,
    budget: usize,
    bytes: usize,
    clock: u64,
}

impl StateStore {
    /// At most `max` states and `budget` bytes of them (either 0: nothing is stored).
    pub fn new(max: usize, budget: usize) -> Self {
        Self {
            max,
            budget,
            ..Self::default()
        }
    }

    /// Whether anything can be stored.
    pub fn enabled(&self) -> bool {
        self.max > 0 && self.budget > 0
    }

    /// States held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of state held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The states, in no particular order (indexes are valid until the next change).
    pub fn entries(&self) -> &[Stored] {
        &self.entries
    }

    /// Whether a state for `tokens` of `state_len` bytes may be stored: something to store,
    /// and no larger than the whole budget.
    pub fn takes(&self, tokens: &[Token], state_len: usize) -> bool {
        self.enabled() && !tokens.is_empty() && state_len > 0 && state_len <= self.budget
    }

    /// Drops the states `drop` picks; returns how many went.
    pub fn remove_where(&mut self, drop: impl Fn(&Stored) -> bool) -> usize {
        let before = self.entries.len();
        let mut freed = 0;
        self.entries.retain(|e| {
            let gone = drop(e);
            if gone {
                freed += e.state.len();
            }
            !gone
        });
        self.bytes -= freed;
        before - self.entries.len()
    }

    /// Stores a state (call `takes` first), after dropping the least recently used ones until
    /// it fits the budget and the count; returns how many were dropped for it.
    pub fn push(&mut self, tokens: Vec<Token>, lora: LoraScales, state: Vec<u8>) -> usize {
        let mut evicted = 0;
        while self.entries.len() >= self.max || self.bytes + state.len() > self.budget {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.tick)
                .map(|(i, _)| i)
            else {
                break;
            };
            let gone = self.entries.swap_remove(oldest);
            self.bytes -= gone.state.len();
            evicted += 1;
        }
        self.clock += 1;
        self.bytes += state.len();
        self.entries.push(Stored {
            tokens,
            lora,
            state,
            tick: self.clock,
        });
        evicted
    }

    /// State `index`, counted as used now.
    pub fn touch(&mut self, index: usize) -> &Stored {
        self.clock += 1;
        let entry = &mut self.entries[index];
        entry.tick = self.clock;
        entry
    }

    /// Takes state `index` out.
    pub fn take(&mut self, index: usize) -> Stored {
        let entry = self.entries.swap_remove(index);
        self.bytes -= entry.state.len();
        entry
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// One operation on a store.
    #[derive(Clone, Debug)]
    enum Op {
        Push {
            first: i32,
            len: usize,
            bytes: usize,
        },
        Touch(usize),
        Take(usize),
        RemoveLonger(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..8i32, 1..6usize, 0..40usize).prop_map(|(first, len, bytes)| Op::Push {
                first,
                len,
                bytes
            }),
            (0..16usize).prop_map(Op::Touch),
            (0..16usize).prop_map(Op::Take),
            (0..6usize).prop_map(Op::RemoveLonger),
        ]
    }

    proptest! {
        // Seeded: the same cases on every run and machine (a failure reproduces as it is).
        #![proptest_config(ProptestConfig {
            cases: 256,
            rng_seed: proptest::test_runner::RngSeed::Fixed(39),
            ..ProptestConfig::default()
        })]

        /// Whatever happens, the bytes counted are the states' sum, within the budget, the
        /// count within the maximum, and what `takes` accepts is stored.
        #[test]
        fn the_budget_and_the_count_always_hold(
            max in 0..5usize,
            budget in 0..100usize,
            ops in proptest::collection::vec(op(), 0..64),
        ) {
            let mut store = StateStore::new(max, budget);
            for op in ops {
                match op {
                    Op::Push { first, len, bytes } => {
                        let tokens: Vec<Token> = (first..first + len as i32).collect();
                        if store.takes(&tokens, bytes) {
                            store.push(tokens.clone(), LoraScales::base(), vec![0; bytes]);
                            prop_assert!(store.entries().iter().any(|e| e.tokens == tokens
                                && e.state.len() == bytes));
                        } else {
                            prop_assert!(max == 0 || budget == 0 || bytes == 0 || bytes > budget);
                        }
                    }
                    Op::Touch(i) if i < store.len() => {
                        store.touch(i);
                    }
                    Op::Take(i) if i < store.len() => {
                        let n = store.len();
                        store.take(i);
                        prop_assert_eq!(store.len(), n - 1);
                    }
                    Op::RemoveLonger(n) => {
                        store.remove_where(|e| e.tokens.len() > n);
                        prop_assert!(store.entries().iter().all(|e| e.tokens.len() <= n));
                    }
                    _ => {}
                }
                let sum: usize = store.entries().iter().map(|e| e.state.len()).sum();
                prop_assert_eq!(store.bytes(), sum);
                prop_assert!(store.bytes() <= budget);
                prop_assert!(store.len() <= max);
            }
        }

        /// The least recently used state is the one a full store drops.
        #[test]
        fn a_full_store_drops_the_least_recently_used(
            max in 1..6usize,
            touches in proptest::collection::vec(0..6usize, 0..10),
        ) {
            let mut store = StateStore::new(max, usize::MAX);
            for k in 0..max as i32 {
                store.push(vec![k], LoraScales::base(), vec![1]);
            }
            let mut order: Vec<Token> = (0..max as i32).collect();
            for t in touches {
                if t < store.len() {
                    let token = store.touch(t).tokens[0];
                    order.retain(|&x| x != token);
                    order.push(token);
                }
            }
            prop_assert_eq!(store.push(vec![99], LoraScales::base(), vec![1]), 1);
            prop_assert!(store.entries().iter().all(|e| e.tokens != vec![order[0]]));
        }
    }
}
