//! The draft model (`--draft-model`): its load and vocabulary check, its context, and its
//! picks (`sched/draft.rs` decides what to draft).

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::DecodeError;

use crate::backend::{BatchToken, Drafting};
use crate::config::RunnerConfig;
use crate::protocol::{BackendError, Token};

use super::logs::llama_result;
use super::text::{piece_bytes, tokenize};
use super::{file_name, LlamaEngine};

/// A draft model's context and batch (`--draft-model`, `sched/draft.rs`).
pub(super) struct DraftEngine<'m> {
    ctx: LlamaContext<'m>,
    batch: LlamaBatch<'static>,
    /// Token ids a draft may use: those both vocabularies have.
    n_vocab: usize,
}

impl<'m> DraftEngine<'m> {
    pub(super) fn new(model: &'m LlamaModel, ctx: LlamaContext<'m>, target_vocab: i32) -> Self {
        let batch = ctx.n_batch().min(ctx.n_ubatch()).max(1) as usize;
        let n_vocab = usize::try_from(model.n_vocab().min(target_vocab)).unwrap_or(0);
        Self {
            ctx,
            batch: LlamaBatch::new(batch, 1),
            n_vocab,
        }
    }
}

/// Loads the draft model for `config.model` and checks that it can draft for it: an
/// attention-only model (as the model must be), of the same vocabulary.
pub(super) fn load_draft_model(
    backend: &LlamaBackend,
    model: &LlamaModel,
    config: &RunnerConfig,
    path: &std::path::Path,
) -> Result<LlamaModel, String> {
    let name = file_name(path);
    if model.is_recurrent() || model.is_hybrid() {
        return Err(format!(
            "--draft-model {name}: {} is a recurrent or hybrid model, whose cache cannot drop \
             rejected drafts; a draft model needs an attention-only model",
            file_name(&config.model)
        ));
    }
    let params = LlamaModelParams::default()
        .with_n_gpu_layers(u32::try_from(config.n_gpu_layers).unwrap_or(u32::MAX))
        .with_main_gpu(config.main_gpu)
        .with_use_mmap(!config.no_mmap)
        .with_use_mlock(config.mlock);
    let draft = llama_result(|| LlamaModel::load_from_file(backend, path, &params))
        .map_err(|why| format!("--draft-model: llama.cpp could not load {name}: {why}"))?;
    if draft.is_recurrent() || draft.is_hybrid() {
        return Err(format!(
            "--draft-model {name}: a recurrent or hybrid model cannot draft (its cache cannot \
             drop rejected drafts)"
        ));
    }
    if let Some(why) = vocabulary_mismatch(model, &draft) {
        return Err(format!(
            "--draft-model {name}: its vocabulary does not match the model's ({why})"
        ));
    }
    tracing::info!(
        draft_model = %path.display(),
        params = draft.n_params(),
        "draft model loaded"
    );
    Ok(draft)
}

/// Vocabulary size difference a draft model may have (llama.cpp's
/// `SPEC_VOCAB_MAX_SIZE_DIFFERENCE`).
pub(super) const DRAFT_VOCAB_MAX_DIFFERENCE: i32 = 128;
/// First token id whose text is compared (llama.cpp's `SPEC_VOCAB_CHECK_START_TOKEN_ID`).
pub(super) const DRAFT_VOCAB_CHECK_FROM: i32 = 5;

/// Why `draft` cannot draft for `target`, if it cannot: llama.cpp's
/// `common_speculative_are_compatible`. The same tokenizer type, the same BOS and EOS added
/// (and the same ids), at most 128 tokens more or fewer, and the same text for every token id
/// from 5 on that both have. (llama-cpp-2 does not expose `llama_vocab_get_text`; tokens are
/// compared as they render with special tokens shown, which differs exactly where the texts do
/// for the tokens of a model's vocabulary.)
pub(super) fn vocabulary_mismatch(target: &LlamaModel, draft: &LlamaModel) -> Option<String> {
    let kind = |m: &LlamaModel| m.meta_val_str("tokenizer.ggml.model").unwrap_or_default();
    if kind(target) != kind(draft) {
        return Some(format!(
            "tokenizer {:?}, the model's {:?}",
            kind(draft),
            kind(target)
        ));
    }
    // What an empty text tokenizes to with special tokens added: BOS and EOS if the tokenizer
    // adds them, with their ids.
    let specials = |m: &LlamaModel| tokenize(m, "", true).unwrap_or_default();
    if specials(target) != specials(draft) {
        return Some(format!(
            "it adds the special tokens {:?}, the model {:?}",
            specials(draft),
            specials(target)
        ));
    }
    let (nt, nd) = (target.n_vocab(), draft.n_vocab());
    if (nt - nd).abs() > DRAFT_VOCAB_MAX_DIFFERENCE {
        return Some(format!(
            "{nd} tokens, the model {nt}: more than {DRAFT_VOCAB_MAX_DIFFERENCE} apart"
        ));
    }
    (DRAFT_VOCAB_CHECK_FROM..nt.min(nd)).find_map(|id| {
        let (a, b) = (
            piece_bytes(target, LlamaToken(id), true),
            piece_bytes(draft, LlamaToken(id), true),
        );
        (a != b).then(|| {
            format!(
                "token {id} is {:?}, the model's {:?}",
                String::from_utf8_lossy(&b),
                String::from_utf8_lossy(&a)
            )
        })
    })
}

impl Drafting for LlamaEngine<'_> {
    fn has_draft_model(&self) -> bool {
        self.draft.is_some()
    }

    fn draft_decode(&mut self, batch: &[BatchToken]) -> Result<(), BackendError> {
        let Some(draft) = self.draft.as_mut() else {
            return Err(BackendError::Decode("no draft model is loaded".into()));
        };
        draft.batch.clear();
        for t in batch {
            let pos = i32::try_from(t.pos).map_err(|e| BackendError::Decode(e.to_string()))?;
            draft
                .batch
                .add(LlamaToken(t.token), pos, &[t.seq], t.logits)
                .map_err(|e| BackendError::Decode(e.to_string()))?;
        }
        draft.ctx.decode(&mut draft.batch).map_err(|e| match e {
            DecodeError::NoKvCacheSlot => BackendError::NoKvSlot,
            other => BackendError::Decode(other.to_string()),
        })
    }

    fn draft_pick(&self, index: usize) -> Option<(Token, f32)> {
        let draft = self.draft.as_ref()?;
        let index = i32::try_from(index).ok()?;
        let logits = draft.ctx.get_logits_ith(index);
        let logits = &logits[..draft.n_vocab.min(logits.len())];
        top_k_choice(logits)
    }

    fn draft_truncate(&mut self, seq: i32, from: usize) -> bool {
        let (Some(draft), Ok(from)) = (self.draft.as_mut(), u32::try_from(from)) else {
            return false;
        };
        draft.ctx.kv_cache_seq_rm(seq, Some(from), None).is_ok()
    }
}

/// Candidates `draft_pick` weighs (llama.cpp's drafts sample from the top 10).
pub(super) const DRAFT_TOP_K: usize = 10;

/// The most likely token of `logits` and its probability among the `DRAFT_TOP_K` most likely
/// (softmax over those), as llama.cpp's draft sampler judges `p_min`. None when no logit is
/// finite.
pub(super) fn top_k_choice(logits: &[f32]) -> Option<(Token, f32)> {
    // The k largest, kept sorted descending (k is small: insertion is cheapest).
    let mut top: Vec<(f32, usize)> = Vec::with_capacity(DRAFT_TOP_K + 1);
    for (id, &l) in logits.iter().enumerate() {
        if !l.is_finite() || (top.len() == DRAFT_TOP_K && l <= top[DRAFT_TOP_K - 1].0) {
            continue;
        }
        let at = top.partition_point(|&(v, _)| v >= l);
        top.insert(at, (l, id));
        top.truncate(DRAFT_TOP_K);
    }
    let &(best, id) = top.first()?;
    let sum: f32 = top.iter().map(|&(l, _)| (l - best).exp()).sum();
    Some((Token::try_from(id).ok()?, 1.0 / sum))
}
