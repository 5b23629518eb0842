//! The llama.cpp backend: the only code that touches `llama-cpp-2`. Everything here lives on the
//! engine thread, which owns the context, batch and samplers (not `Send` up to llama-cpp-2
//! 0.1.154; the context is `Send` but not `Sync` in 0.1.160). One file per capability of the
//! `Backend` traits: `load.rs` (model, context, facts), `text.rs`, `sampler.rs`, `kv_ops.rs`,
//! `state_read.rs` (a sequence's state read out in one walk of the cache), `draft.rs`,
//! `embeddings.rs`, `devices.rs` (where the model's layers live), `gguf_metadata.rs` (a file's
//! metadata, without loading it) and `null_decode.rs` (decodes that compute nothing, for
//! benchmarks); decoding is here, with the engine itself.

mod device_cut;
mod devices;
mod draft;
#[cfg(feature = "portable")]
mod dynamic_backends;
mod embeddings;
mod gguf_metadata;
mod guarded_decode;
mod invariant_decode;
mod kv_ops;
mod load;
mod logs;
mod lora;
mod mtmd;
mod null_decode;
mod placement;
mod private_pointers;
mod sampler;
mod state_positions;
mod state_read;
mod text;

pub use gguf_metadata::gguf_metadata;
pub use load::{list_devices, load, step_times, system_info, Loaded};
pub use sampler::ChainSampler;

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::model::{LlamaModel, RopeType};
use llama_cpp_2::token::logit_bias::LlamaLogitBias;
use llama_cpp_2::token::LlamaToken;

use crate::backend::{BatchToken, Decoder};
use crate::protocol::BackendError;

use draft::DraftEngine;
use embeddings::EmbedParams;
use guarded_decode::TokenBatch;
use load::sliding_window;
use text::tokenize;

/// The model file's name without its directories, for messages clients may read.
fn file_name(path: &std::path::Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |f| f.to_string_lossy().into_owned(),
    )
}

/// One model + context + batch, as a `Backend`.
pub struct LlamaEngine<'m> {
    model: &'m LlamaModel,
    ctx: LlamaContext<'m>,
    /// `ctx`'s llama.cpp pointer, which its decodes go through (`guarded_decode.rs`).
    raw_ctx: *mut llama_cpp_sys_2::llama_context,
    batch: TokenBatch,
    slot_ctx: usize,
    /// The cells of the cache the slots share (`--kv-unified`).
    shared_cells: Option<usize>,
    /// Most tokens of one embedding input (a slot's cells, or its share of a shared cache).
    embed_cells: usize,
    batch_capacity: usize,
    /// Biases that forbid every end-of-generation token (for `ignore_eos`).
    eog_bans: Vec<LlamaLogitBias>,
    /// Whether positions in the cache can be shifted (no for recurrent, hybrid, M-RoPE models).
    can_shift: bool,
    /// The attention window of a sliding-window model whose window layers keep only the
    /// window's cells (`--swa-full` off): a sequence cut back far enough has lost cells those
    /// layers need, and must be decoded again.
    swa_window: Option<usize>,
    /// Whether window checkpoints (`window_checkpoint`) can rewind this model's cache: not for
    /// llama4's chunked window, nor deepseek4's (llama.cpp's `llama_model_n_swa` is 0 for it:
    /// its window cannot roll back), and found false at the first checkpoint when llama.cpp
    /// keeps every cell anyway (phi3 declares a window that llama.cpp does not use: a partial
    /// state would be the whole state).
    window_checkpoints: std::cell::Cell<bool>,
    /// Whether the first checkpoint found the window's state smaller than the whole (then the
    /// next ones skip that check: each size llama.cpp gives walks every cell of the cache).
    window_state_apart: std::cell::Cell<bool>,
    /// How sequences' states are read (`state_read.rs`): the raw context and the size guesses.
    state_reads: state_read::StateReads,
    /// Whether the tokenizer starts prompts with BOS.
    add_bos: bool,
    backend: &'static LlamaBackend,
    embed_params: EmbedParams,
    /// A second context with embeddings on, made at the first embedding request. The main
    /// context keeps embeddings off: with them on, llama.cpp outputs logits for every token of
    /// every batch, which would make prompt processing far slower.
    embed_ctx: Option<LlamaContext<'m>>,
    /// The sum of the per-token embeddings of the input being embedded in pieces.
    embed_sum: Vec<f64>,
    /// The `--lora` adapters on `ctx` (the embedding context has none).
    lora: crate::backend::llama::lora::LoraAdapters,
    /// The batch index whose logits an image decode kept (`decode_image` with logits); the
    /// crate does not know of that decode, so they are read through the raw context.
    raw_logits: Option<i32>,
    /// The `--mmproj` projector; its decodes go through `raw_ctx`.
    vision: Option<std::sync::Arc<crate::backend::llama::mtmd::Projector>>,
    /// The draft model's context (`--draft-model`).
    draft: Option<DraftEngine<'m>>,
    /// The threads a step's sequences are sampled on (`--sampling-threads`); none with one.
    sampling_pool: Option<rayon::ThreadPool>,
    /// `--null-decode` (benchmarks): decodes compute nothing and give synthetic logits.
    null: Option<null_decode::NullLogits>,
    /// `--deterministic`: batches decoded on the same kernel paths whatever their shape
    /// (`invariant_decode.rs`), with the logits the scheduler asked for kept here.
    invariant: Option<invariant_decode::KeptLogits>,
    /// `--backend-sampling`: the top-k cuts attached to the sequences (`device_cut.rs`).
    /// Declared after `ctx`, so dropped after it: the context never reads an attached chain
    /// once its decodes are over.
    cuts: Option<device_cut::DeviceCuts>,
}

impl<'m> LlamaEngine<'m> {
    fn new(
        model: &'m LlamaModel,
        ctx: LlamaContext<'m>,
        slot_ctx: usize,
        batch: usize,
        backend: &'static LlamaBackend,
        embed_params: EmbedParams,
        swa_full: bool,
    ) -> Result<Self, String> {
        // Every decode goes through the raw context (`guarded_decode.rs`).
        let raw = crate::backend::llama::private_pointers::context_pointer(model, &ctx)?;
        let vocab = model.vocab();
        let eog_bans = (0..model.n_vocab())
            .map(LlamaToken)
            .filter(|&t| vocab.is_eog(t))
            .map(|t| LlamaLogitBias::new(t, f32::NEG_INFINITY))
            .collect();
        let can_shift = !(model.is_recurrent()
            || model.is_hybrid()
            || matches!(model.rope_type(), Some(RopeType::MRope | RopeType::IMRope)));
        let add_bos = tokenize(model, "", true).is_ok_and(|t| t.first() == Some(&vocab.bos().0));
        let swa_window = sliding_window(model).filter(|_| !swa_full);
        let arch = model
            .meta_val_str("general.architecture")
            .unwrap_or_default();
        let window_checkpoints = std::cell::Cell::new(
            swa_window.is_some() && !matches!(arch.as_str(), "llama4" | "deepseek4"),
        );
        let raw_ctx = (!(model.is_recurrent() || model.is_hybrid())).then_some(raw);
        Ok(Self {
            model,
            ctx,
            raw_ctx: raw,
            batch: TokenBatch::new(batch),
            slot_ctx,
            shared_cells: None,
            embed_cells: slot_ctx,
            batch_capacity: batch,
            eog_bans,
            can_shift,
            swa_window,
            window_checkpoints,
            window_state_apart: std::cell::Cell::new(false),
            state_reads: state_read::StateReads::new(raw_ctx),
            add_bos,
            backend,
            embed_params,
            embed_ctx: None,
            embed_sum: Vec::new(),
            lora: crate::backend::llama::lora::LoraAdapters::none(),
            raw_logits: None,
            vision: None,
            draft: None,
            sampling_pool: None,
            null: None,
            invariant: None,
            cuts: None,
        })
    }

    /// The logits of batch position `index` of the last decode: the crate's, or those an
    /// image decode kept.
    fn logits_ith(&self, index: i32) -> &[f32] {
        if let Some(null) = &self.null {
            return null.logits(usize::try_from(index).unwrap_or(usize::MAX));
        }
        if let Some(kept) = &self.invariant {
            match kept.row(usize::try_from(index).unwrap_or(usize::MAX)) {
                Ok(row) => return row,
                Err(j) => return self.ctx.get_logits_ith(j),
            }
        }
        if let Some(at) = self.raw_logits {
            if at == index {
                let n = usize::try_from(self.model.n_vocab()).unwrap_or(0);
                // SAFETY: the last decode on this context was the image's, with logits at
                // `index`; llama.cpp keeps n_vocab floats there until the next decode, and
                // `&self` keeps this engine (and so its decodes) from running meanwhile.
                unsafe {
                    let p = llama_cpp_sys_2::llama_get_logits_ith(self.raw_ctx, index);
                    if !p.is_null() {
                        return std::slice::from_raw_parts(p, n);
                    }
                }
            }
        }
        self.ctx.get_logits_ith(index)
    }

    /// The same engine with this projector (loaded for its context).
    fn with_vision(
        mut self,
        vision: Option<std::sync::Arc<crate::backend::llama::mtmd::Projector>>,
    ) -> Self {
        self.vision = vision;
        self
    }

    /// The same engine sampling a step's sequences on `threads` threads (one: on the engine
    /// thread, in turn).
    fn with_sampling_threads(mut self, threads: usize) -> Self {
        self.sampling_pool = (threads > 1)
            .then(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("sampling-{i}"))
                    .build()
                    .map_err(|e| {
                        tracing::warn!(error = %e, "no sampling pool; sampling on the engine thread")
                    })
                    .ok()
            })
            .flatten();
        self
    }

    /// The same engine computing nothing in its decodes, which give synthetic logits
    /// (`--null-decode`, for benchmarks of the server's own work).
    fn with_null_decode(mut self, on: bool) -> Self {
        self.null = on.then(|| {
            // The end-of-generation tokens are those `ignore_eos` bans.
            let eog: Vec<i32> = self.eog_bans.iter().map(|b| b.token().0).collect();
            let n_vocab = usize::try_from(self.model.n_vocab()).unwrap_or(0);
            null_decode::NullLogits::new(n_vocab, &eog)
        });
        self
    }

    /// The same engine with the top-k of samplers that need only that cut on the device
    /// (`--backend-sampling`), where it has the context's pointer (not with `--null-decode`,
    /// whose decodes compute nothing).
    fn with_backend_sampling(mut self, on: bool) -> Self {
        if !on || self.null.is_some() {
            return self;
        }
        self.cuts = Some(device_cut::DeviceCuts::new(
            self.raw_ctx,
            self.model.n_vocab(),
        ));
        self
    }

    /// What the sampler of batch position `index` of the last decode reads: the candidates
    /// the device cut there, or every token's logit.
    fn row(&self, index: i32) -> sampler::Row<'_> {
        match self.cuts.as_ref().and_then(|c| c.row(index)) {
            Some((ids, logits)) => sampler::Row::Cut(ids, logits),
            None => sampler::Row::Whole(self.logits_ith(index)),
        }
    }

    /// The same engine decoding on the same kernel paths whatever a batch's shape
    /// (`--deterministic`).
    fn with_deterministic(mut self, on: bool) -> Self {
        if on {
            self.batch_capacity = crate::backend::invariant_batch::capacity(self.batch_capacity);
        }
        self.invariant = on.then(|| {
            invariant_decode::KeptLogits::new(usize::try_from(self.model.n_vocab()).unwrap_or(0))
        });
        self
    }

    /// The same engine over a KV cache of `cells` the slots share (`--kv-unified`); an
    /// embedding input still gets a slot's share (`per_slot`) of cells.
    fn with_shared_cells(mut self, cells: Option<usize>, per_slot: usize) -> Self {
        self.shared_cells = cells;
        self.embed_cells = per_slot;
        self
    }

    /// The same engine drafting with this draft model context (`--draft-model`).
    fn with_draft(mut self, draft: Option<DraftEngine<'m>>) -> Self {
        self.draft = draft;
        self
    }

    /// The same engine with these adapters (`load_adapters` made them for `specs`, in order)
    /// on its context, at the specs' scales.
    fn with_lora(
        mut self,
        specs: &[crate::protocol::lora::LoraSpec],
        adapters: Vec<llama_cpp_2::model::LlamaLoraAdapter>,
    ) -> Result<Self, String> {
        self.lora = crate::backend::llama::lora::LoraAdapters::load(
            &mut self.ctx,
            self.raw_ctx,
            specs,
            adapters,
        )?;
        Ok(self)
    }
}

impl Decoder for LlamaEngine<'_> {
    fn slot_ctx(&self) -> usize {
        self.slot_ctx
    }

    fn shared_cells(&self) -> Option<usize> {
        self.shared_cells
    }

    fn batch_capacity(&self) -> usize {
        self.batch_capacity
    }

    fn set_lora(&mut self, scales: &crate::protocol::LoraScales) -> Result<(), BackendError> {
        self.lora.apply(&mut self.ctx, self.raw_ctx, scales)
    }

    fn batch_invariant(&self) -> bool {
        self.invariant.is_some()
    }

    fn decode(&mut self, batch: &[BatchToken]) -> Result<(), BackendError> {
        self.raw_logits = None;
        if let Some(null) = self.null.as_mut() {
            null.decode(batch);
            return Ok(());
        }
        if self.invariant.is_some() {
            return self.decode_invariant(batch);
        }
        if let Some(cuts) = self.cuts.as_mut() {
            cuts.decoding();
        }
        self.batch.clear();
        for t in batch {
            self.batch
                .add(t.token, t.pos, t.seq, t.logits)
                .map_err(BackendError::Decode)?;
        }
        self.decode_filled()
    }

    fn decode_image(
        &mut self,
        seq: i32,
        pos: usize,
        image: &crate::protocol::PromptImage,
        logits: bool,
    ) -> Result<(), BackendError> {
        let projector = self
            .vision
            .clone()
            .ok_or_else(|| BackendError::Decode("no vision projector is loaded".into()))?;
        self.raw_logits = None;
        // The projector's decodes go through this context: an attached cut cuts the image's
        // last position too, and `row` reads it there.
        if let Some(cuts) = self.cuts.as_mut() {
            cuts.decoding();
        }
        let start = i32::try_from(pos).unwrap_or(i32::MAX);
        self.decode_recovering(
            "the image",
            |engine| projector.decode_image(engine.raw_ctx, seq, pos, image, logits),
            |_| vec![(seq, start)],
        )?;
        if logits {
            self.raw_logits = i32::try_from(image.n_tokens - 1).ok();
        }
        Ok(())
    }
}
