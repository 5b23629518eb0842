//! `--backend-sampling`: the top-k of a sequence's positions cut on the device. A request whose
//! chain needs only the `k` best logits of a position (`ChainSampler::device_k`: its first cut
//! a top-k or greedy, nothing changed before it but bans, no log-probabilities) gets a
//! llama.cpp sampler chain of one top-k attached to its sequence id (`llama_set_sampler`).
//! llama.cpp then computes that top-k in the decode's own graph, on the device of the model's
//! output layer, and copies back `k` candidates (ids and logits) per position instead of the
//! whole vocabulary's logits (262,144 floats, 1 MiB, per position for Gemma 3: at 64
//! sequences, 64 MiB from the GPU per step). The rest of the chain (temperature, top-p, min-p,
//! the draw) runs on the host on those candidates, as it runs on the shortlist
//! (`backend/shortlist.rs`), so the tokens are those sampled without it.
//!
//! A chain is attached when a sequence that wants one is decoded and stays while the slot's
//! requests want the same `k` (attaching changes the graph, which llama.cpp then reserves
//! again); a sequence that does not want one has it detached before its decode, and so does a
//! slot left without a request (llama.cpp runs an attached chain on a dummy row at every
//! decode). A backend that cannot run the top-k (its device lacks the operation) refuses the
//! first one: then none is attached again and every position's logits come back whole.

use std::collections::HashMap;

use llama_cpp_sys_2 as sys;

/// A sequence's attached chain: its `k` and the chain (owned here: llama.cpp only points at
/// it).
struct Attached {
    k: u32,
    chain: *mut sys::llama_sampler,
}

/// The chains attached to a context's sequences.
pub(super) struct DeviceCuts {
    ctx: *mut sys::llama_context,
    attached: HashMap<i32, Attached>,
    /// The device refused a chain once: none is attached again.
    refused: bool,
    /// A chain was attached once (the first is logged).
    attached_once: bool,
}

impl DeviceCuts {
    /// Cuts for the sequences of `ctx` (the engine's main context, which outlives this).
    pub(super) fn new(ctx: *mut sys::llama_context) -> Self {
        Self {
            ctx,
            attached: HashMap::new(),
            refused: false,
            attached_once: false,
        }
    }

    /// Sequence `seq` is decoded next wanting its `k` best logits per position on the device
    /// (None: all of them). Changes nothing when that is what is attached.
    pub(super) fn bind(&mut self, seq: i32, k: Option<u32>) {
        let k = k.filter(|_| !self.refused);
        match (self.attached.get(&seq), k) {
            (Some(a), Some(k)) if a.k == k => return,
            (None, None) => return,
            _ => {}
        }
        if let Some(old) = self.attached.remove(&seq) {
            // SAFETY: `ctx` is live; detaching (a null sampler) makes llama.cpp forget the
            // pointer before the chain it pointed at is freed.
            unsafe {
                sys::llama_set_sampler(self.ctx, seq, std::ptr::null_mut());
                sys::llama_sampler_free(old.chain);
            }
        }
        let Some(k) = k else {
            return;
        };
        let Ok(top) = i32::try_from(k) else {
            return;
        };
        // SAFETY: a new chain owns the top-k added to it; llama_set_sampler keeps the chain's
        // pointer while it is attached (it is freed here only after being detached).
        unsafe {
            let chain = sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params());
            sys::llama_sampler_chain_add(chain, sys::llama_sampler_init_top_k(top));
            if sys::llama_set_sampler(self.ctx, seq, chain) {
                self.attached.insert(seq, Attached { k, chain });
                if !self.attached_once {
                    self.attached_once = true;
                    tracing::info!(
                        k,
                        slot = seq,
                        "--backend-sampling: the first top-k cut is attached; a position of a sequence that needs only its best logits brings back k candidates"
                    );
                }
            } else {
                sys::llama_sampler_free(chain);
                self.refused = true;
                tracing::warn!(
                    "--backend-sampling: the device of the model's output layer cannot run a top-k; every position's logits come back whole"
                );
            }
        }
    }

    /// The candidates the device cut for batch position `index` of the last decode: their ids
    /// and raw logits, `k` of each (fewer when the vocabulary is smaller). None when that
    /// position has none (its sequence has no chain attached).
    pub(super) fn row(&self, index: i32) -> Option<(&[i32], &[f32])> {
        // SAFETY: `ctx` is live and its last decode is done (these calls wait for it); the
        // rows stay until the next decode, which `&self` (borrowed from the engine) keeps
        // from running while they are read. The counts bound what is read of each row.
        unsafe {
            let n = sys::llama_get_sampled_logits_count_ith(self.ctx, index);
            let m = sys::llama_get_sampled_candidates_count_ith(self.ctx, index);
            if n == 0 || m != n {
                return None;
            }
            let logits = sys::llama_get_sampled_logits_ith(self.ctx, index);
            let ids = sys::llama_get_sampled_candidates_ith(self.ctx, index);
            if logits.is_null() || ids.is_null() {
                return None;
            }
            let n = usize::try_from(n).ok()?;
            Some((
                std::slice::from_raw_parts(ids, n),
                std::slice::from_raw_parts(logits, n),
            ))
        }
    }
}

impl Drop for DeviceCuts {
    fn drop(&mut self) {
        // The context is gone by now (the engine drops it first) or will not decode again:
        // only the chains are freed.
        for (_, a) in self.attached.drain() {
            // SAFETY: each chain was made here and is freed once.
            unsafe { sys::llama_sampler_free(a.chain) };
        }
    }
}
