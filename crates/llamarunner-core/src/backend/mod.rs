//! `Backend`: the narrow surface the scheduler needs from llama.cpp (a model plus a context),
//! implemented by `llama/` (the only code on llama-cpp-2: context, batch, samplers, mtmd, LoRA,
//! CPU variants) and by the deterministic `fake/` (tests and the `--no-default-features`
//! build). Lives on the engine thread only.

pub mod fake;
// Used by the llama backend's deterministic mode; pure, so unit-tested in every build.
#[cfg_attr(not(feature = "llama"), allow(dead_code))]
pub mod invariant_batch;
#[cfg(feature = "llama")]
pub mod llama;
// Used by the llama backend; pure, so unit-tested in every build.
#[cfg_attr(not(feature = "llama"), allow(dead_code))]
pub mod shortlist;

pub use crate::protocol::{BackendError, Token};

use crate::protocol::params::SamplingParams;
use crate::protocol::TokenLogprob;

/// What a fork (`Backend::kv_fork`) left in the destination sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fork {
    /// The first `len` positions, whole.
    Copied,
    /// The first `len` positions of the full-attention layers, without the sliding window
    /// before `len`: a window checkpoint can mend it (`rewind_to_checkpoint`), else the
    /// caller clears it.
    WindowLost,
    /// Nothing: the copy failed and the destination is empty.
    Failed,
}

/// One token placed in a decode batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchToken {
    /// The token.
    pub token: Token,
    /// Its position in its sequence.
    pub pos: u32,
    /// The llama.cpp sequence id (= slot id).
    pub seq: i32,
    /// Whether logits are needed for this position.
    pub logits: bool,
}

/// What the scheduler needs from a model + context, by capability. Implementations live on
/// the engine thread only, so nothing here is `Send`. Every type that has all the
/// capabilities is a `Backend`.
pub trait Backend: Decoder + Text + Sampling + KvOps + Drafting + Embeddings {}

impl<T: Decoder + Text + Sampling + KvOps + Drafting + Embeddings> Backend for T {}

/// The model's context as a decoder: its shape, the batches it decodes (tokens, images) and
/// the LoRA scales they run with.
pub trait Decoder {
    /// Cells of KV cache available to each slot (with a shared cache, all of it).
    fn slot_ctx(&self) -> usize;
    /// The cells of one KV cache all slots share (`--kv-unified`), which the scheduler must
    /// keep the slots' cells within (`sched/shared_cache.rs`); None when each slot has cells
    /// of its own.
    fn shared_cells(&self) -> Option<usize> {
        None
    }
    /// Most tokens one `decode` call may carry.
    fn batch_capacity(&self) -> usize;
    /// Applies these LoRA adapter scales to the decodes that follow (one per `--lora` adapter,
    /// in order); a no-op when they are applied already.
    fn set_lora(&mut self, scales: &crate::protocol::LoraScales) -> Result<(), BackendError>;
    /// Decodes one batch.
    fn decode(&mut self, batch: &[BatchToken]) -> Result<(), BackendError>;
    /// Whether a row's logits are the same whatever else its batch holds and however its
    /// prompt was chunked (`--deterministic`; `invariant_batch`).
    fn batch_invariant(&self) -> bool {
        false
    }
    /// Encodes an image with the projector and decodes its positions `pos..pos + n_tokens`
    /// into sequence `seq`, in a decode call of its own (a llama.cpp batch holds tokens or
    /// embeddings, not both). With `logits` (a prompt that ends with the image), the last
    /// position's logits are kept for `sample` at index `n_tokens - 1`, until the next decode.
    /// The scheduler never asks for an image when the backend has no projector: the HTTP side
    /// refuses images then.
    fn decode_image(
        &mut self,
        seq: i32,
        pos: usize,
        image: &crate::protocol::PromptImage,
        logits: bool,
    ) -> Result<(), BackendError>;
    /// The model's description, for a backend whose loader did not publish one (the fake has
    /// no file to describe); the scheduler publishes it before it says ready.
    fn describe(&self) -> Option<crate::protocol::ModelInfo> {
        None
    }
}

/// The vocabulary: prompts to tokens and tokens to bytes.
pub trait Text {
    /// Tokenizes a prompt, adding BOS when the model wants it and parsing special tokens.
    fn tokenize(&self, text: &str) -> Result<Vec<Token>, BackendError>;
    /// The bytes a token renders to (may be a partial UTF-8 character).
    fn token_bytes(&self, token: Token) -> Vec<u8>;
    /// Whether the token ends generation (EOS, EOT, ...).
    fn is_eog(&self, token: Token) -> bool;
    /// The beginning-of-sequence token, if the tokenizer adds one.
    fn bos(&self) -> Option<Token>;
}

/// One sequence's share of a step's sampling (`Sampling::sample_many`): its sampler, the batch
/// position of its next token's logits and the drafted tokens that follow it there (each
/// decoded with its logits), and the tokens picked.
pub struct Pick<'a, S> {
    /// The sequence's sampler.
    pub sampler: &'a mut S,
    /// Batch position of the logits its next token is sampled from.
    pub at: usize,
    /// Drafted tokens at positions `at + 1..`, checked while the sampler agrees with them.
    pub draft: &'a [Token],
    /// The request's span, in which the sampler may log.
    pub span: &'a tracing::Span,
    /// What was sampled: at `at`, then at each next position while the previous token equals
    /// the draft's; a `None` (the grammar allows nothing more) is last.
    pub tokens: Vec<Option<Token>>,
    /// What the sequence does with the text of the token picked at `at`, on the thread that
    /// picked it (`give_text`), so that its text is assembled in parallel with the step's other
    /// sequences; None: all of it is left to the engine thread.
    pub text: Option<PickedText<'a>>,
}

/// A sequence's use of the text of the first token a pick gives (`Pick::text`): given the
/// token, the bytes it renders to (`Text::token_bytes`) and whether it ends generation
/// (`Text::is_eog`).
pub type PickedText<'a> = Box<dyn FnMut(Token, &[u8], bool) + Send + 'a>;

impl<S> Pick<'_, S> {
    /// Samples with `sample` (a sampler and a batch position to a token) as `tokens` says.
    pub fn run(&mut self, mut sample: impl FnMut(&mut S, usize) -> Option<Token>) {
        self.tokens.clear();
        for j in 0..=self.draft.len() {
            let sampler = &mut *self.sampler;
            let token = self.span.in_scope(|| sample(sampler, self.at + j));
            self.tokens.push(token);
            match (token, self.draft.get(j)) {
                (Some(t), Some(&d)) if t == d => {}
                _ => break,
            }
        }
    }

    /// Hands the token picked at `at` to `text`, with what `render` says of it: its bytes (as
    /// `Text::token_bytes` gives them) and whether it ends generation (`Text::is_eog`), when
    /// there is such a token and the pick has a `text`. Called by a backend on the thread that
    /// ran the pick, after `run`.
    pub fn give_text(&mut self, render: impl Fn(Token) -> (Vec<u8>, bool)) {
        if let (Some(text), Some(&Some(token))) = (self.text.as_mut(), self.tokens.first()) {
            let (bytes, eog) = render(token);
            text(token, &bytes, eog);
        }
    }
}

/// What a slot's next decode needs of its positions' logits (`Sampling::bind_sampler`).
#[derive(Debug)]
pub enum SlotSampling<'a, S> {
    /// No request holds the slot.
    Idle,
    /// Its sequence reads every position's whole logits whatever its sampler (it drafts).
    Whole,
    /// Its sequence samples with this sampler.
    Sampler(&'a S),
}

/// Per-request samplers over the last decode's logits.
pub trait Sampling {
    /// Per-request sampler state (moved to a pool's thread to sample in parallel).
    type Sampler: Send;

    /// Builds a sampler for a request; `history` seeds the repetition penalties.
    fn new_sampler(
        &self,
        params: &SamplingParams,
        history: &[Token],
    ) -> Result<Self::Sampler, BackendError>;
    /// Samples (and accepts) the next token from the logits of batch position `index`.
    /// `None` when the request's grammar allows nothing more (complete, or at a dead end):
    /// the sequence ends there.
    fn sample(&mut self, sampler: &mut Self::Sampler, index: usize) -> Option<Token>;
    /// Samples every sequence of a step (`Pick`), with the tokens `sample` would give if called
    /// for each in turn: each sampler reads only its own rows of logits. A backend with a
    /// sampling pool runs the picks in parallel.
    fn sample_many(&mut self, picks: &mut [Pick<'_, Self::Sampler>]) {
        for pick in picks {
            pick.run(|sampler, index| self.sample(sampler, index));
        }
    }
    /// Log-probabilities at batch position `index` (raw logits, before any sampler): the
    /// sampled `token`'s, the `top` most likely ones and the `asked` ones.
    fn logprobs(&self, index: usize, token: Token, top: usize, asked: &[Token]) -> TokenLogprob;
    /// Log-probabilities after the sampler chain at `sampler`'s oldest pick not yet reported
    /// (`SamplingParams::post_sampling_probs`; each pick is reported once, in order): the
    /// sampled `token`'s and its `top` most probable survivors', zero-probability tokens left
    /// out. None when the sampler kept none (it was not asked to).
    fn post_sampling_logprobs(
        &self,
        sampler: &mut Self::Sampler,
        token: Token,
        top: usize,
    ) -> Option<TokenLogprob>;

    /// Before each decode, for every slot: what its sequence's positions need (`SlotSampling`).
    /// A backend that cuts a position's logits on the device for samplers that need only the
    /// best few (`--backend-sampling`) attaches, keeps or detaches that cut here; others do
    /// nothing.
    fn bind_sampler(&mut self, seq: i32, use_: SlotSampling<'_, Self::Sampler>) {
        let _ = (seq, use_);
    }
}

/// The KV cache's sequences: cut, shift, fork, sliding-window checkpoints, whole states.
pub trait KvOps {
    /// Removes positions `from..` of a sequence from the KV cache; false when the cache cannot
    /// remove part of a sequence (the caller then clears all of it).
    fn kv_truncate(&mut self, seq: i32, from: usize) -> bool;
    /// Empties sequence `seq`; false when cells of it stay. llama.cpp removes cells by
    /// position range, and a corrupt state (a slot file) can give a cell a position outside
    /// every range (negative, or `i32::MAX`): only `kv_clear_all` removes that one.
    fn kv_clear(&mut self, seq: i32) -> bool {
        self.kv_truncate(seq, 0)
    }
    /// Empties every sequence.
    fn kv_clear_all(&mut self);
    /// Whether `kv_truncate(seq, from)` would keep what is left usable (it removes part of a
    /// sequence, and no sliding window loses cells it needs): asked before a cut that is a
    /// choice, not a need.
    fn kv_can_cut(&self, seq: i32, from: usize) -> bool {
        let _ = (seq, from);
        true
    }
    /// Context shift: removes positions `keep..keep + discard` and moves the rest down by
    /// `discard`. False when the model's cache cannot shift (the caller then re-decodes).
    fn kv_shift(&mut self, seq: i32, keep: usize, discard: usize) -> bool;
    /// Makes sequence `dst` hold the first `len` cached tokens of sequence `src` (a fork for
    /// multi-user prefix sharing).
    fn kv_fork(&mut self, src: i32, dst: i32, len: usize) -> Fork;
    /// The sliding window, in positions, when the cache drops the windowed layers' cells that
    /// fall out of it (Gemma-style models without `--swa-full`); None when every cell stays.
    /// A cut or fork then keeps a sequence only when its window before the cut is still
    /// there, or when a checkpoint puts it back (`window_checkpoint`).
    fn sliding_window(&self) -> Option<usize> {
        None
    }
    /// A checkpoint of sequence `seq`'s windowed cells as they are now (llama.cpp's partial
    /// state: the sliding-window layers only, a window's worth of positions), to rewind it
    /// to this length later with `rewind_to_checkpoint`. An error when the cache has no
    /// window.
    fn window_checkpoint(&self, _seq: i32) -> Result<Vec<u8>, BackendError> {
        Err(BackendError::State(
            "the cache has no sliding window".into(),
        ))
    }
    /// Cuts sequence `seq` to its first `len` positions and puts back the windowed cells of a
    /// checkpoint taken when a sequence with the same first `len` tokens held exactly `len`
    /// positions. False when that fails (the caller clears the sequence).
    fn rewind_to_checkpoint(&mut self, _seq: i32, _len: usize, _state: &[u8]) -> bool {
        false
    }
    /// llama.cpp's state of sequence `seq` (its KV cells), for a slot file.
    fn seq_state(&self, seq: i32) -> Result<Vec<u8>, BackendError>;
    /// Replaces sequence `seq` with a state `seq_state` made (of this model and context
    /// shape); returns how many positions the sequence then holds. On an error the sequence
    /// may be partly cleared: the caller clears it.
    fn set_seq_state(&mut self, seq: i32, state: &[u8]) -> Result<usize, BackendError>;
}

/// A draft model's context (`--draft-model`), beside the model's (`sched/draft.rs`).
pub trait Drafting {
    /// Whether a draft model is loaded (`--draft-model`): drafts come from it, not from
    /// prompt lookup (`sched/draft.rs`).
    fn has_draft_model(&self) -> bool {
        false
    }
    /// Decodes a batch on the draft model's context (its KV cache holds one sequence per slot,
    /// like the model's).
    fn draft_decode(&mut self, _batch: &[BatchToken]) -> Result<(), BackendError> {
        Err(BackendError::Decode("no draft model is loaded".into()))
    }
    /// The draft model's most likely token at batch position `index` of its last decode, and
    /// its probability among its ten most likely (as llama.cpp's drafts judge `p_min`).
    fn draft_pick(&self, _index: usize) -> Option<(Token, f32)> {
        None
    }
    /// Removes positions `from..` of a sequence from the draft model's cache; false when it
    /// cannot (the caller then clears all of it).
    fn draft_truncate(&mut self, _seq: i32, _from: usize) -> bool {
        false
    }
}

/// Embeddings, decoded piece by piece on a context of their own.
pub trait Embeddings {
    /// Most tokens one embedding input may have.
    fn embed_capacity(&self) -> usize;
    /// Most tokens of one embedding input decoded in one step (an input is embedded piece by
    /// piece, one piece per scheduler step, so generating sequences keep flowing).
    fn embed_piece(&self) -> usize;
    /// Decodes `tokens` as positions `start..` of the current embedding input (`start == 0`
    /// begins a new input); with `last`, returns the input's embedding: pooled by the model's
    /// pooling type (mean when it has none), or the last token's when the model does not pool.
    /// Not normalized.
    fn embed(
        &mut self,
        tokens: &[Token],
        start: usize,
        last: bool,
    ) -> Result<Option<Vec<f32>>, BackendError>;
}
