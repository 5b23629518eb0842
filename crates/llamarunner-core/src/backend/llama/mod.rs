//! The llama.cpp backend: the only code that touches `llama-cpp-2`. Everything here lives on the
//! engine thread, which owns the context, batch and samplers (not `Send` up to llama-cpp-2
//! 0.1.154; the context is `Send` but not `Sync` in 0.1.160).

#[cfg(feature = "portable")]
mod cpu_variants;
mod lora;
mod mtmd;

use std::num::NonZeroU32;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

use llama_cpp_2::context::params::{KvCacheType, LlamaContextParams, LlamaPoolingType};
use llama_cpp_2::context::session::LlamaStateSeqFlags;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::{LlamaModel, RopeType};
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::data::LlamaTokenData;
use llama_cpp_2::token::data_array::LlamaTokenDataArray;
use llama_cpp_2::token::logit_bias::LlamaLogitBias;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::token_type::LlamaTokenAttr;
use llama_cpp_2::{DecodeError, LogOptions};

use crate::backend::{Backend, BatchToken, Fork};
use crate::chat::{self, ChatTemplate, Vocabulary};
use crate::config::{FlashAttn, RunnerConfig};
use crate::protocol::params::SamplingParams;
use crate::protocol::{
    BackendError, Health, ModelInfo, TextModel, Token, TokenLogprob, TopLogprob,
};

/// llama.cpp's backend may be initialized once per process; every runner shares it.
fn llama_backend() -> Result<&'static LlamaBackend, String> {
    static BACKEND: OnceLock<Result<LlamaBackend, String>> = OnceLock::new();
    BACKEND
        .get_or_init(|| {
            // llama.cpp and ggml log through `tracing` (target "llama-cpp-2"); the subscriber
            // decides what is shown.
            llama_cpp_2::send_logs_to_tracing(LogOptions::default().with_logs_enabled(true));
            #[cfg(feature = "portable")]
            {
                let cpu = crate::backend::llama::cpu_variants::load()?;
                tracing::info!(cpu_backend = %cpu, "loaded the CPU backend that fits this processor");
            }
            LlamaBackend::init().map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The model file's name without its directories, for messages clients may read.
fn file_name(path: &std::path::Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |f| f.to_string_lossy().into_owned(),
    )
}

/// What the engine needs to know of a loaded model beyond the `Backend` itself.
#[derive(Clone, Copy, Debug)]
pub struct Loaded {
    /// A recurrent or hybrid model: its state cannot drop the cells of rejected drafts.
    pub recurrent: bool,
}

/// Loads the model in `config` (its progress and then its facts published in `health`; a
/// load stops early once `stop` is set), creates its context and hands the backend to `serve`
/// on this thread, which owns it for as long as `serve` runs.
pub fn load<R>(
    config: &RunnerConfig,
    health: &Arc<Health>,
    stop: Arc<AtomicBool>,
    serve: impl FnOnce(LlamaEngine<'_>, Loaded) -> R,
) -> Result<R, String> {
    let backend = llama_backend()?;
    let progress_health = health.clone();
    let n_gpu_layers = u32::try_from(config.n_gpu_layers).unwrap_or(u32::MAX);
    let model_params = LlamaModelParams::default()
        .with_n_gpu_layers(n_gpu_layers)
        .with_main_gpu(config.main_gpu)
        .with_use_mmap(!config.no_mmap && config.lora.is_empty())
        .with_use_mlock(config.mlock)
        .with_progress_callback(move |p| {
            progress_health.set_progress(p * 0.99);
            // Returning false aborts the load (the runner is being stopped).
            !stop.load(std::sync::atomic::Ordering::Acquire)
        });
    // Which CPU kernels this build of llama.cpp runs (AVX2, AVX512, VNNI, ...): the first
    // thing to check when comparing speed with another build.
    tracing::info!(features = %system_info(), "llama.cpp CPU backend");
    let started = std::time::Instant::now();
    let (loaded, llama_errors) =
        with_llama_errors(|| LlamaModel::load_from_file(backend, &config.model, &model_params));
    let mut model = loaded.map_err(|e| {
        let why = if llama_errors.is_empty() {
            e.to_string()
        } else {
            llama_errors.join("; ")
        };
        format!(
            "llama.cpp could not load {}: {why}",
            file_name(&config.model)
        )
    })?;
    tracing::info!(
        model = %config.model.display(),
        params = model.n_params(),
        n_ctx_train = model.n_ctx_train(),
        seconds = started.elapsed().as_secs_f32(),
        "model loaded"
    );
    // The `--lora` adapters, made from the model before anything borrows it (llama-cpp-2
    // 0.1.160 takes the model as `&mut` for that); their scales are set on the context below.
    let adapters = crate::backend::llama::lora::load_adapters(&mut model, &config.lora, |init| {
        let (adapter, llama_errors) = with_llama_errors(init);
        adapter.map_err(|e| {
            if llama_errors.is_empty() {
                e.to_string()
            } else {
                llama_errors.join("; ")
            }
        })
    })?;
    // Shared with the HTTP side, which tokenizes with it (the model is Send + Sync; contexts,
    // batch and samplers stay on this thread).
    let model = std::sync::Arc::new(model);

    let parallel = config.parallel;
    let threads = i32::try_from(config.effective_threads()).unwrap_or(1);
    let kv_type = kv_cache_type(config.effective_kv_cache_type());
    if config.effective_kv_cache_type() != config.kv_cache_type {
        tracing::warn!(
            "a quantized KV cache needs flash attention; --flash-attn is off, so f16 is used"
        );
    }
    let n_ctx = config
        .ctx_size
        .checked_mul(parallel)
        .ok_or("ctx-size * parallel is too large")?;
    let ctx_params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(n_ctx))
        .with_n_batch(config.batch_size)
        .with_n_ubatch(config.batch_size)
        .with_n_seq_max(parallel)
        .with_swa_full(config.swa_full)
        .with_n_threads(threads)
        .with_n_threads_batch(threads)
        .with_flash_attention_policy(ctx_flash_attn(config.flash_attn))
        .with_type_k(kv_type)
        .with_type_v(kv_type);
    let (ctx, llama_errors) = with_llama_errors(|| model.new_context(backend, ctx_params));
    let mut ctx = ctx.map_err(|e| {
        // llama-cpp-2 says only "null reference"; llama.cpp logged why.
        let why = if llama_errors.is_empty() {
            e.to_string()
        } else {
            llama_errors.join("; ")
        };
        format!("llama.cpp could not create a context of {n_ctx} tokens: {why}")
    })?;

    let lora =
        crate::backend::llama::lora::LoraAdapters::load(&model, &mut ctx, &config.lora, adapters)?;

    let vision = match &config.mmproj {
        Some(path) => {
            let projector = crate::backend::llama::mtmd::Projector::load(
                path,
                &model,
                &ctx,
                threads,
                n_gpu_layers > 0,
                |init| {
                    let (loaded, llama_errors) = with_llama_errors(init);
                    loaded.map_err(|e| {
                        if llama_errors.is_empty() {
                            e
                        } else {
                            llama_errors.join("; ")
                        }
                    })
                },
            )?;
            let raw_ctx = crate::backend::llama::lora::context_pointer(&model, &ctx)?;
            tracing::info!(mmproj = %path.display(), "vision projector loaded");
            Some((std::sync::Arc::new(projector), raw_ctx))
        }
        None => None,
    };
    // The draft model (`--draft-model`) and its context: one sequence per slot, each slot's
    // context as the model's.
    let draft_model = match &config.draft_model {
        Some(path) => Some(load_draft_model(backend, &model, config, path)?),
        None => None,
    };
    let draft = match &draft_model {
        Some(draft_model) => {
            let params = LlamaContextParams::default()
                .with_n_ctx(NonZeroU32::new(n_ctx))
                .with_n_batch(config.batch_size)
                .with_n_ubatch(config.batch_size)
                .with_n_seq_max(parallel)
                // Every cell kept, so that cutting back a rejected draft never loses cells a
                // sliding window needs.
                .with_swa_full(true)
                .with_n_threads(threads)
                .with_n_threads_batch(threads)
                .with_flash_attention_policy(ctx_flash_attn(config.flash_attn))
                .with_type_k(kv_type)
                .with_type_v(kv_type);
            let (dctx, llama_errors) =
                with_llama_errors(|| draft_model.new_context(backend, params));
            let dctx = dctx.map_err(|e| {
                let why = if llama_errors.is_empty() {
                    e.to_string()
                } else {
                    llama_errors.join("; ")
                };
                format!("llama.cpp could not create the draft model's context: {why}")
            })?;
            Some(DraftEngine::new(draft_model, dctx, model.n_vocab()))
        }
        None => None,
    };

    let slot_ctx = (ctx.n_ctx() / parallel) as usize;
    // llama.cpp may change the sizes asked for (n_batch is clamped to the requested n_ctx,
    // n_ctx is padded): a batch is never larger than what the context really takes.
    let batch = ctx.n_batch().min(ctx.n_ubatch()).max(1) as usize;
    let mut info = model_info(&model, config, slot_ctx)?;
    info.vision = vision.as_ref().map(|(projector, _)| {
        std::sync::Arc::new(crate::backend::llama::mtmd::LlamaVision(projector.clone()))
            as std::sync::Arc<dyn crate::protocol::VisionModel>
    });
    health.set_model_info(info);
    let model: &LlamaModel = &model;
    let embed_params = EmbedParams {
        threads,
        flash_attn: ctx_flash_attn(config.flash_attn),
        pooled_by_model: model_has_pooling_type(model),
    };
    let engine = LlamaEngine::new(
        model,
        ctx,
        slot_ctx,
        batch,
        backend,
        embed_params,
        config.swa_full,
    )
    .with_lora(lora)
    .with_vision(vision)
    .with_draft(draft);
    tracing::info!(slots = parallel, slot_ctx, batch, threads, "ready");
    let recurrent = model.is_recurrent() || model.is_hybrid();
    Ok(serve(engine, Loaded { recurrent }))
}

/// Times decode steps of 1, 2, ... `widths` positions (each with logits, as a drafted step has)
/// in sequence 0, before any request: what a step costs by its width, in microseconds. The best
/// of two rounds, after a step of the widest that warms up the graphs. None on a failure, or
/// when fewer than two widths fit the batch or the slot.
pub fn step_times(engine: &mut LlamaEngine<'_>, widths: usize) -> Option<Vec<u64>> {
    let n = widths.min(engine.batch_capacity).min(engine.slot_ctx);
    if n < 2 {
        return None;
    }
    let vocab = engine.model.n_vocab().max(1);
    let tokens: Vec<BatchToken> = (0..n)
        .map(|i| BatchToken {
            token: i32::try_from(i).unwrap_or(0) % vocab,
            pos: u32::try_from(i).unwrap_or(0),
            seq: 0,
            logits: true,
        })
        .collect();
    let mut time = |batch: &[BatchToken]| -> Option<u64> {
        let started = std::time::Instant::now();
        let ok = engine.decode(batch).is_ok();
        let spent = started.elapsed();
        engine.kv_truncate(0, 0);
        ok.then(|| u64::try_from(spent.as_micros()).unwrap_or(u64::MAX))
    };
    time(&tokens)?;
    let mut best = vec![u64::MAX; n];
    for _ in 0..2 {
        for (width, b) in best.iter_mut().enumerate() {
            *b = (*b).min(time(&tokens[..=width])?);
        }
    }
    Some(best)
}

/// The attention window of a model with sliding-window layers (the GGUF key
/// `<arch>.attention.sliding_window`, which llama.cpp reads too), if it has one.
fn sliding_window(model: &LlamaModel) -> Option<usize> {
    let arch = model.meta_val_str("general.architecture").ok()?;
    let window = model
        .meta_val_str(&format!("{arch}.attention.sliding_window"))
        .ok()?;
    window.trim().parse::<usize>().ok().filter(|&w| w > 0)
}

/// llama.cpp's description of its compute backends and the CPU features its kernels use.
pub fn system_info() -> String {
    // SAFETY: llama_print_system_info takes no arguments and returns a pointer to a
    // NUL-terminated string in a static buffer of llama.cpp's (or null).
    let p = unsafe { llama_cpp_sys_2::llama_print_system_info() };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null, NUL-terminated, and not freed while we copy it.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .trim()
        .trim_end_matches('|')
        .trim()
        .to_string()
}

/// Tokenizes with special tokens parsed; `add_special` adds BOS (and EOS) when the model
/// wants them, as every prompt is tokenized.
///
/// The vocabulary's `tokenize` takes any bytes; a text it cannot be given as a C string (a NUL
/// in it) or of more bytes than a C int counts is refused here, with the messages the
/// C-string and integer conversions give (as llama-cpp-2 refused them before 0.1.160).
fn tokenize(model: &LlamaModel, text: &str, add_special: bool) -> Result<Vec<Token>, BackendError> {
    tokenize_parsing(model, text, add_special, true)
}

/// `tokenize`, with special tokens written in the text parsed or left as text.
fn tokenize_parsing(
    model: &LlamaModel,
    text: &str,
    add_special: bool,
    parse_special: bool,
) -> Result<Vec<Token>, BackendError> {
    if let Some(at) = text.bytes().position(|b| b == 0) {
        return Err(BackendError::Tokenize(format!(
            "nul byte found in provided data at position: {at}"
        )));
    }
    if let Err(e) = std::ffi::c_int::try_from(text.len()) {
        return Err(BackendError::Tokenize(e.to_string()));
    }
    Ok(model
        .vocab()
        .tokenize(text.as_bytes(), add_special, parse_special)
        .into_iter()
        .map(|t| t.0)
        .collect())
}

/// The vocabulary's fill-in-the-middle tokens; None unless it has all of prefix, suffix and
/// middle (llama.cpp answers -1 for a token the vocabulary lacks).
fn fim_tokens(model: &LlamaModel) -> Option<crate::protocol::model::FimTokens> {
    let vocab = model.vocab();
    let known = |t: llama_cpp_2::token::LlamaToken| {
        Some(t.0).filter(|&t| (0..model.n_vocab()).contains(&t))
    };
    Some(crate::protocol::model::FimTokens {
        pre: known(vocab.fim_pre())?,
        suf: known(vocab.fim_suf())?,
        mid: known(vocab.fim_mid())?,
        rep: known(vocab.fim_rep()),
        sep: known(vocab.fim_sep()),
    })
}

/// Describes the loaded model and picks its chat template.
fn model_info(
    model: &std::sync::Arc<LlamaModel>,
    config: &RunnerConfig,
    slot_ctx: usize,
) -> Result<ModelInfo, String> {
    let file = std::fs::metadata(&config.model).ok();
    let metadata = (0..model.meta_count())
        .filter_map(|i| Some((model.meta_key_by_index(i).ok()?, i)))
        .filter(|(key, _)| {
            !key.starts_with("tokenizer.ggml.") && key.as_str() != "tokenizer.chat_template"
        })
        .filter_map(|(key, i)| Some((key, model.meta_val_str_by_index(i).ok()?)))
        .collect();
    let architecture = model
        .meta_val_str("general.architecture")
        .unwrap_or_default();
    let quantization = model
        .meta_val_str("general.file_type")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .map_or("unknown", crate::protocol::file_type_name)
        .to_string();
    let text: std::sync::Arc<dyn TextModel> = std::sync::Arc::new(LlamaText(model.clone()));
    Ok(ModelInfo {
        path: config.model.clone(),
        file_size: file.as_ref().map_or(0, std::fs::Metadata::len),
        modified: file.and_then(|m| m.modified().ok()),
        template: std::sync::Arc::new(chat_template(model, config, &architecture)?),
        architecture,
        n_params: model.n_params(),
        n_ctx_train: model.n_ctx_train(),
        n_embd: u32::try_from(model.n_embd()).unwrap_or(0),
        n_layer: model.n_layer(),
        n_vocab: u32::try_from(model.n_vocab()).unwrap_or(0),
        slot_ctx,
        quantization,
        metadata,
        bos: tokenize(model, "", true)
            .ok()
            .and_then(|t| t.first().copied())
            .filter(|&t| t == model.vocab().bos().0),
        eos: Some(model.vocab().eos().0).filter(|&t| (0..model.n_vocab()).contains(&t)),
        system_info: system_info(),
        constraints: crate::protocol::model::compiler_for(&text),
        text,
        vision: None,
        fim: fim_tokens(model),
        rerank: rerank_format(model),
    })
}

/// llama.cpp's `LLAMA_POOLING_TYPE_RANK`, as GGUF's `{arch}.pooling_type` writes it.
const POOLING_RANK: &str = "4";

/// How the model pairs a query with a document, when its pooling is rank (a reranker); None
/// for every other model. The markers are llama-server's (`format_prompt_rerank`).
fn rerank_format(model: &LlamaModel) -> Option<crate::protocol::model::RerankFormat> {
    let arch = model.meta_val_str("general.architecture").ok()?;
    let pooling = model.meta_val_str(&format!("{arch}.pooling_type")).ok()?;
    if pooling.trim() != POOLING_RANK {
        return None;
    }
    let vocab = model.vocab();
    let known = |t: llama_cpp_2::token::LlamaToken| {
        Some(t.0).filter(|&t| (0..model.n_vocab()).contains(&t))
    };
    // Read from the GGUF's metadata: llama-cpp-2 0.1.160's `chat_template(Some(name))`
    // drops the name's CString before llama.cpp reads it (the pointer dangles; it found no
    // template here).
    let template = model.meta_val_str("tokenizer.chat_template.rerank").ok();
    Some(crate::protocol::model::RerankFormat {
        template,
        bos: known(vocab.bos()).filter(|_| vocab.should_add_bos()),
        eos: known(vocab.eos())
            .or_else(|| known(vocab.sep()))
            .filter(|_| vocab.should_add_eos()),
        sep: known(vocab.sep()).filter(|_| vocab.should_add_sep()),
    })
}

/// The model's vocabulary for the HTTP side: tokenizing and grammar checks off the engine
/// thread (both only read the vocabulary).
struct LlamaText(std::sync::Arc<LlamaModel>);

impl std::fmt::Debug for LlamaText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LlamaText")
    }
}

impl TextModel for LlamaText {
    fn tokenize_with(&self, text: &str, add_special: bool) -> Result<Vec<Token>, BackendError> {
        tokenize(&self.0, text, add_special)
    }

    fn tokenize_literal(&self, text: &str) -> Result<Vec<Token>, BackendError> {
        tokenize_parsing(&self.0, text, false, false)
    }

    fn piece(&self, token: Token) -> Vec<u8> {
        piece_bytes(&self.0, LlamaToken(token), true)
    }

    fn vocabulary(&self) -> crate::constrain::Vocabulary {
        let model = &self.0;
        let vocab = model.vocab();
        let tokens = (0..model.n_vocab())
            .map(|id| {
                let token = LlamaToken(id);
                // llama-cpp-2 panics on an attribute bit it does not know; such a token is
                // treated as a control token.
                let control = std::panic::catch_unwind(|| vocab.attr(token)).map_or(true, |a| {
                    a.intersects(
                        LlamaTokenAttr::Control | LlamaTokenAttr::Unused | LlamaTokenAttr::Unknown,
                    )
                });
                crate::constrain::VocabToken {
                    bytes: piece_bytes(model, token, true),
                    control,
                    eog: vocab.is_eog(token),
                }
            })
            .collect();
        crate::constrain::Vocabulary { tokens }
    }
}

/// The chat template: `--chat-template` (a built-in name or a file), else the GGUF's own, else
/// the built-in template of the model's family.
fn chat_template(
    model: &LlamaModel,
    config: &RunnerConfig,
    architecture: &str,
) -> Result<ChatTemplate, String> {
    let special_text = |token: LlamaToken| {
        if token.0 < 0 {
            return String::new();
        }
        let mut piece = model.vocab().token_to_piece(token, true, None);
        // A text of more than 64 bytes is none, as before 0.1.160 (a 64-byte buffer, no retry).
        if piece.len() > SPECIAL_TEXT_MAX {
            return String::new();
        }
        truncate_at_nul(&mut piece);
        String::from_utf8_lossy(&piece).into_owned()
    };
    let bos = special_text(model.vocab().bos());
    let eos = special_text(model.vocab().eos());
    if let Some(choice) = &config.chat_template {
        let source = match chat::builtin(choice) {
            Some(source) => source.to_string(),
            None => std::fs::read_to_string(choice)
                .map_err(|e| format!("cannot read the chat template {choice}: {e}"))?,
        };
        let template =
            ChatTemplate::new(choice.clone(), source, bos, eos).map_err(|e| e.to_string())?;
        tracing::info!(template = %choice, "chat template from --chat-template");
        return Ok(template);
    }
    if let Some(source) = model
        .chat_template(None)
        .ok()
        .and_then(|t| t.to_string().ok())
    {
        match ChatTemplate::new("gguf", source, bos.clone(), eos.clone()) {
            Ok(template) => {
                tracing::info!("chat template from the GGUF (tokenizer.chat_template)");
                return Ok(template);
            }
            Err(e) => tracing::warn!("{e}; using the family's built-in template instead"),
        }
    }
    let one_token = |text: &str| tokenize(model, text, false).is_ok_and(|t| t.len() == 1);
    let vocab = Vocabulary {
        architecture: architecture.to_string(),
        start_of_turn: one_token("<start_of_turn>"),
        start_header_id: one_token("<|start_header_id|>"),
        im_start: one_token("<|im_start|>"),
        phi_turns: one_token("<|assistant|>") && one_token("<|end|>"),
        inst: one_token("[INST]"),
    };
    let name = chat::family_template(&vocab);
    tracing::info!(
        template = name,
        architecture = %vocab.architecture,
        "the model has no chat template; using the built-in one of its family"
    );
    let source = chat::builtin(name).unwrap_or_default();
    ChatTemplate::new(name, source, bos, eos).map_err(|e| e.to_string())
}

/// Runs `f` and returns, besides its result, the ERROR messages llama.cpp logged meanwhile on
/// this thread, so that a failed model load can say why. Every event still reaches the
/// process's subscriber as usual.
fn with_llama_errors<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
    use std::sync::{Arc, Mutex};
    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing::subscriber::Interest;
    use tracing::{Event, Level, Metadata};

    struct Tee {
        inner: tracing::Dispatch,
        errors: Arc<Mutex<Vec<String>>>,
    }
    struct Message(String);
    impl Visit for Message {
        fn record_str(&mut self, field: &Field, value: &str) {
            if field.name() == "message" {
                self.0 = value.trim().to_string();
            }
        }
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" && self.0.is_empty() {
                self.0 = format!("{value:?}").trim().to_string();
            }
        }
    }
    impl tracing::Subscriber for Tee {
        fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
            self.inner.register_callsite(metadata);
            Interest::sometimes()
        }
        fn enabled(&self, metadata: &Metadata<'_>) -> bool {
            *metadata.level() == Level::ERROR || self.inner.enabled(metadata)
        }
        fn new_span(&self, span: &Attributes<'_>) -> Id {
            self.inner.new_span(span)
        }
        fn record(&self, span: &Id, values: &Record<'_>) {
            self.inner.record(span, values);
        }
        fn record_follows_from(&self, span: &Id, follows: &Id) {
            self.inner.record_follows_from(span, follows);
        }
        fn event(&self, event: &Event<'_>) {
            if *event.metadata().level() == Level::ERROR {
                let mut message = Message(String::new());
                event.record(&mut message);
                if !message.0.is_empty() {
                    if let Ok(mut errors) = self.errors.lock() {
                        errors.push(message.0);
                    }
                }
            }
            if self.inner.enabled(event.metadata()) {
                self.inner.event(event);
            }
        }
        fn enter(&self, span: &Id) {
            self.inner.enter(span);
        }
        fn exit(&self, span: &Id) {
            self.inner.exit(span);
        }
        fn clone_span(&self, id: &Id) -> Id {
            self.inner.clone_span(id)
        }
        fn try_close(&self, id: Id) -> bool {
            self.inner.try_close(id)
        }
    }

    let errors = Arc::new(Mutex::new(Vec::new()));
    let tee = Tee {
        inner: tracing::dispatcher::get_default(Clone::clone),
        errors: errors.clone(),
    };
    let out = tracing::subscriber::with_default(tee, f);
    let errors = errors.lock().map(|e| e.clone()).unwrap_or_default();
    (out, errors)
}

fn ctx_flash_attn(policy: FlashAttn) -> llama_cpp_sys_2::llama_flash_attn_type {
    match policy {
        FlashAttn::Auto => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_AUTO,
        FlashAttn::On => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_ENABLED,
        FlashAttn::Off => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED,
    }
}

/// Whether the GGUF names a pooling type (embedding models do; generative ones do not).
fn model_has_pooling_type(model: &LlamaModel) -> bool {
    model
        .meta_val_str("general.architecture")
        .is_ok_and(|arch| model.meta_val_str(&format!("{arch}.pooling_type")).is_ok())
}

/// How the embedding context is made.
struct EmbedParams {
    threads: i32,
    flash_attn: llama_cpp_sys_2::llama_flash_attn_type,
    /// Use the model's own pooling type; otherwise mean pooling.
    pooled_by_model: bool,
}

fn kv_cache_type(name: &str) -> KvCacheType {
    match name {
        "q8_0" => KvCacheType::Q8_0,
        "q4_0" => KvCacheType::Q4_0,
        _ => KvCacheType::F16,
    }
}

/// One model + context + batch, as a `Backend`.
pub struct LlamaEngine<'m> {
    model: &'m LlamaModel,
    ctx: LlamaContext<'m>,
    batch: LlamaBatch<'static>,
    slot_ctx: usize,
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
    /// The `--mmproj` projector, with `ctx`'s raw pointer its decodes go through.
    vision: Option<(
        std::sync::Arc<crate::backend::llama::mtmd::Projector>,
        *mut llama_cpp_sys_2::llama_context,
    )>,
    /// The draft model's context (`--draft-model`).
    draft: Option<DraftEngine<'m>>,
}

/// A draft model's context and batch (`--draft-model`, `sched/draft.rs`).
struct DraftEngine<'m> {
    ctx: LlamaContext<'m>,
    batch: LlamaBatch<'static>,
    /// Token ids a draft may use: those both vocabularies have.
    n_vocab: usize,
}

impl<'m> DraftEngine<'m> {
    fn new(model: &'m LlamaModel, ctx: LlamaContext<'m>, target_vocab: i32) -> Self {
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
fn load_draft_model(
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
    let (loaded, llama_errors) =
        with_llama_errors(|| LlamaModel::load_from_file(backend, path, &params));
    let draft = loaded.map_err(|e| {
        let why = if llama_errors.is_empty() {
            e.to_string()
        } else {
            llama_errors.join("; ")
        };
        format!("--draft-model: llama.cpp could not load {name}: {why}")
    })?;
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
const DRAFT_VOCAB_MAX_DIFFERENCE: i32 = 128;
/// First token id whose text is compared (llama.cpp's `SPEC_VOCAB_CHECK_START_TOKEN_ID`).
const DRAFT_VOCAB_CHECK_FROM: i32 = 5;

/// Why `draft` cannot draft for `target`, if it cannot: llama.cpp's
/// `common_speculative_are_compatible`. The same tokenizer type, the same BOS and EOS added
/// (and the same ids), at most 128 tokens more or fewer, and the same text for every token id
/// from 5 on that both have. (llama-cpp-2 does not expose `llama_vocab_get_text`; tokens are
/// compared as they render with special tokens shown, which differs exactly where the texts do
/// for the tokens of a model's vocabulary.)
fn vocabulary_mismatch(target: &LlamaModel, draft: &LlamaModel) -> Option<String> {
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

impl<'m> LlamaEngine<'m> {
    fn new(
        model: &'m LlamaModel,
        ctx: LlamaContext<'m>,
        slot_ctx: usize,
        batch: usize,
        backend: &'static LlamaBackend,
        embed_params: EmbedParams,
        swa_full: bool,
    ) -> Self {
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
        Self {
            model,
            ctx,
            batch: LlamaBatch::new(batch, 1),
            slot_ctx,
            batch_capacity: batch,
            eog_bans,
            can_shift,
            swa_window,
            window_checkpoints,
            add_bos,
            backend,
            embed_params,
            embed_ctx: None,
            embed_sum: Vec::new(),
            lora: crate::backend::llama::lora::LoraAdapters::none(),
            raw_logits: None,
            vision: None,
            draft: None,
        }
    }

    /// The logits of batch position `index` of the last decode: the crate's, or those an
    /// image decode kept.
    fn logits_ith(&self, index: i32) -> &[f32] {
        if let (Some(at), Some((_, raw_ctx))) = (self.raw_logits, self.vision.as_ref()) {
            if at == index {
                let n = usize::try_from(self.model.n_vocab()).unwrap_or(0);
                // SAFETY: the last decode on this context was the image's, with logits at
                // `index`; llama.cpp keeps n_vocab floats there until the next decode, and
                // `&self` keeps this engine (and so its decodes) from running meanwhile.
                unsafe {
                    let p = llama_cpp_sys_2::llama_get_logits_ith(*raw_ctx, index);
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
        vision: Option<(
            std::sync::Arc<crate::backend::llama::mtmd::Projector>,
            *mut llama_cpp_sys_2::llama_context,
        )>,
    ) -> Self {
        self.vision = vision;
        self
    }

    /// The same engine drafting with this draft model context (`--draft-model`).
    fn with_draft(mut self, draft: Option<DraftEngine<'m>>) -> Self {
        self.draft = draft;
        self
    }

    /// The same engine with these adapters on its context (loaded for it).
    fn with_lora(mut self, lora: crate::backend::llama::lora::LoraAdapters) -> Self {
        self.lora = lora;
        self
    }

    /// Tokens per decode call when a generative model's embedding is computed in pieces:
    /// llama.cpp outputs logits for every token of an embedding batch, so the piece is sized
    /// to keep that buffer under `EMBED_LOGITS_BYTES`.
    fn embed_chunk(&self) -> usize {
        let per_token = usize::try_from(self.model.n_vocab()).unwrap_or(1).max(1) * 4;
        (EMBED_LOGITS_BYTES / per_token).clamp(1, self.slot_ctx.max(1))
    }

    /// Whether sequence `seq`, holding positions `0..len`, still has every cell the next
    /// position attends to. Sliding-window layers (without `--swa-full`) drop cells that fall
    /// out of the window as a sequence grows; cut back to an earlier position, it lacks the
    /// window before that position (llama-server checks the same before reusing a prompt).
    fn window_intact(&self, seq: i32, len: usize) -> bool {
        let Some(window) = self.swa_window else {
            return true;
        };
        if len == 0 {
            return true;
        }
        let pos_min = self.ctx.kv_cache_seq_pos_min(seq);
        usize::try_from(pos_min).is_ok_and(|p| p <= len.saturating_sub(window))
    }

    fn embedding_context(&mut self) -> Result<&mut LlamaContext<'m>, BackendError> {
        if self.embed_ctx.is_none() {
            let n = u32::try_from(self.slot_ctx).unwrap_or(u32::MAX);
            // A model that names its pooling (an embedding model, often non-causal) needs the
            // whole input in one micro-batch: n_ubatch = n_batch = n_ctx. A generative model
            // is mean-pooled here, piece by piece through its causal KV cache, from per-token
            // embeddings (pooling none), so only a piece's logits are ever allocated.
            let (pooling, batch) = if self.embed_params.pooled_by_model {
                (LlamaPoolingType::Unspecified, n)
            } else {
                let chunk = u32::try_from(self.embed_chunk()).unwrap_or(n);
                (LlamaPoolingType::None, chunk)
            };
            let params = LlamaContextParams::default()
                .with_n_ctx(NonZeroU32::new(n))
                .with_n_batch(batch)
                .with_n_ubatch(batch)
                .with_n_seq_max(1)
                .with_n_threads(self.embed_params.threads)
                .with_n_threads_batch(self.embed_params.threads)
                .with_flash_attention_policy(self.embed_params.flash_attn)
                .with_embeddings(true)
                .with_pooling_type(pooling);
            let ctx = self.model.new_context(self.backend, params).map_err(|e| {
                BackendError::Decode(format!("cannot create the embedding context: {e}"))
            })?;
            tracing::info!(
                n_ctx = n,
                n_batch = batch,
                ?pooling,
                "embedding context created"
            );
            self.embed_ctx = Some(ctx);
        }
        self.embed_ctx
            .as_mut()
            .ok_or_else(|| BackendError::Decode("no embedding context".into()))
    }
}

/// A request's samplers: the chain (penalties, truncation, temperature, selection) and the
/// grammar's guide (`constrain::Guide`), which checks the chain's pick and masks only when
/// the pick is not allowed.
pub struct ChainSampler {
    chain: LlamaSampler,
    guide: Option<crate::constrain::Guide>,
    /// The tokens the chain is handed instead of the whole vocabulary, when its first cut is
    /// a top-k or greedy (`backend/shortlist.rs`).
    shortlist: Option<crate::backend::shortlist::Shortlist>,
}

impl Backend for LlamaEngine<'_> {
    type Sampler = ChainSampler;

    fn slot_ctx(&self) -> usize {
        self.slot_ctx
    }

    fn batch_capacity(&self) -> usize {
        self.batch_capacity
    }

    fn tokenize(&self, text: &str) -> Result<Vec<Token>, BackendError> {
        tokenize(self.model, text, true)
    }

    fn logprobs(&self, index: usize, token: Token, top: usize) -> TokenLogprob {
        let logits = self.logits_ith(i32::try_from(index).unwrap_or(i32::MAX));
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
        let log_norm = max + sum.ln() as f32;
        let entry = |t: Token| TopLogprob {
            token: t,
            bytes: self.token_bytes(t),
            logprob: usize::try_from(t)
                .ok()
                .and_then(|i| logits.get(i))
                .map_or(f32::NEG_INFINITY, |&l| l - log_norm),
        };
        // The index list over the whole vocabulary is only made when alternatives are asked
        // for (`logprobs: true` alone needs just the sampled token's).
        let mut best: Vec<usize> = if top == 0 {
            Vec::new()
        } else {
            (0..logits.len()).collect()
        };
        let top = top.min(best.len());
        if top > 0 && top < best.len() {
            best.select_nth_unstable_by(top - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
        }
        best.truncate(top);
        best.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        TokenLogprob {
            sampled: entry(token),
            top: best
                .into_iter()
                .filter_map(|i| Token::try_from(i).ok())
                .map(entry)
                .collect(),
        }
    }

    fn token_bytes(&self, token: Token) -> Vec<u8> {
        piece_bytes(self.model, LlamaToken(token), false)
    }

    fn is_eog(&self, token: Token) -> bool {
        self.model.vocab().is_eog(LlamaToken(token))
    }

    fn new_sampler(
        &self,
        p: &SamplingParams,
        history: &[Token],
    ) -> Result<ChainSampler, BackendError> {
        let n_vocab = self.model.n_vocab();
        let mut stages = Vec::new();
        let mut biases = Vec::with_capacity(p.logit_bias.len());
        for &(token, bias) in &p.logit_bias {
            // llama.cpp indexes its logits by token id without a bounds check.
            if !(0..n_vocab).contains(&token) {
                return Err(BackendError::Sampler(format!(
                    "logit_bias: token {token} is not in the vocabulary (0..{n_vocab})"
                )));
            }
            biases.push(LlamaLogitBias::new(LlamaToken(token), bias));
        }
        if p.ignore_eos {
            biases.extend_from_slice(&self.eog_bans);
        }
        if !biases.is_empty() {
            stages.push(LlamaSampler::logit_bias(n_vocab, &biases));
        }
        let penalize = p.repeat_last_n != 0
            && (p.repeat_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0);
        let last_n = if p.repeat_last_n < 0 {
            i32::try_from(self.slot_ctx).unwrap_or(i32::MAX)
        } else {
            p.repeat_last_n
        };
        if penalize {
            stages.push(LlamaSampler::penalties(
                n_vocab,
                last_n,
                p.repeat_penalty,
                p.frequency_penalty,
                p.presence_penalty,
            ));
        }
        let extra = &p.samplers;
        // DRY acts on greedy requests too, as the penalties do (llama-server's order:
        // penalties, DRY, then the truncations and the temperature).
        let dry_window = if extra.dry() {
            let window = extra
                .dry_penalty_last_n
                .clamp(0, i32::try_from(self.slot_ctx).unwrap_or(i32::MAX));
            stages.push(LlamaSampler::dry(
                self.model,
                extra.dry_multiplier,
                extra.dry_base,
                extra.dry_allowed_length,
                window,
                // NUL-free: `requests::validate` refuses breakers with one (this panics on one).
                extra.dry_sequence_breakers.iter().map(String::as_bytes),
            ));
            window
        } else {
            0
        };
        let seed = p.effective_seed();
        if p.greedy() {
            stages.push(LlamaSampler::greedy());
        } else if p.mirostat == 1 {
            stages.push(LlamaSampler::temp(p.temperature));
            stages.push(LlamaSampler::mirostat(
                n_vocab,
                seed,
                p.mirostat_tau,
                p.mirostat_eta,
                100,
            ));
        } else if p.mirostat == 2 {
            stages.push(LlamaSampler::temp(p.temperature));
            stages.push(LlamaSampler::mirostat_v2(
                seed,
                p.mirostat_tau,
                p.mirostat_eta,
            ));
        } else {
            if extra.top_n_sigma > 0.0 {
                stages.push(LlamaSampler::top_n_sigma(extra.top_n_sigma));
            }
            if p.top_k > 0 {
                stages.push(LlamaSampler::top_k(p.top_k));
            }
            if p.typical_p < 1.0 {
                stages.push(LlamaSampler::typical(p.typical_p, 1));
            }
            if p.top_p < 1.0 {
                stages.push(LlamaSampler::top_p(p.top_p, 1));
            }
            if p.min_p > 0.0 {
                stages.push(LlamaSampler::min_p(p.min_p, 1));
            }
            if extra.xtc_probability > 0.0 {
                stages.push(LlamaSampler::xtc(
                    extra.xtc_probability,
                    extra.xtc_threshold,
                    1,
                    seed,
                ));
            }
            if extra.dynatemp_range > 0.0 {
                stages.push(LlamaSampler::temp_ext(
                    p.temperature,
                    extra.dynatemp_range,
                    extra.dynatemp_exponent,
                ));
            } else {
                stages.push(LlamaSampler::temp(p.temperature));
            }
            stages.push(LlamaSampler::dist(seed));
        }
        let guide = crate::constrain::Guide::for_request(p.grammar.as_ref())
            .map_err(BackendError::Sampler)?;
        // The chain's first cut, when the stages before it change only known tokens (biases
        // and the penalty window; DRY may change any token of the history, top-n-sigma and
        // mirostat read them all): it then sees a shortlist instead of every token. A guide
        // picks from what the grammar allows, which a shortlist cannot know.
        let cut = if p.greedy() {
            Some(1)
        } else if p.mirostat == 0 && extra.top_n_sigma <= 0.0 {
            usize::try_from(p.top_k).ok().filter(|&k| k > 0)
        } else {
            None
        };
        let shortlist = match cut {
            Some(k) if guide.is_none() && dry_window == 0 => {
                let biased: Vec<i32> = biases.iter().map(|b| b.token().0).collect();
                let window = penalize.then(|| usize::try_from(last_n).unwrap_or(usize::MAX));
                crate::backend::shortlist::Shortlist::new(k, &biased, window)
            }
            _ => None,
        };
        let mut chain = LlamaSampler::chain_simple(stages);
        let mut shortlist = shortlist;
        if penalize || dry_window > 0 {
            // The prompt seeds the penalty and DRY windows, as in llama.cpp's common sampler
            // (and the shortlist's copy of the penalty window; it has none with DRY).
            let last_n = if penalize {
                last_n.max(dry_window)
            } else {
                dry_window
            };
            let window = usize::try_from(last_n).unwrap_or(0).min(history.len());
            let seed = &history[history.len() - window..];
            chain.accept_many(seed.iter().map(|&t| LlamaToken(t)));
            if let Some(list) = shortlist.as_mut() {
                seed.iter().for_each(|&t| list.accept(t));
            }
        }
        Ok(ChainSampler {
            chain,
            guide,
            shortlist,
        })
    }

    fn set_lora(&mut self, scales: &crate::protocol::LoraScales) -> Result<(), BackendError> {
        self.lora.apply(&mut self.ctx, scales)
    }

    fn decode(&mut self, batch: &[BatchToken]) -> Result<(), BackendError> {
        self.raw_logits = None;
        self.batch.clear();
        for t in batch {
            let pos = i32::try_from(t.pos).map_err(|e| BackendError::Decode(e.to_string()))?;
            self.batch
                .add(LlamaToken(t.token), pos, &[t.seq], t.logits)
                .map_err(|e| BackendError::Decode(e.to_string()))?;
        }
        self.ctx.decode(&mut self.batch).map_err(|e| match e {
            DecodeError::NoKvCacheSlot => BackendError::NoKvSlot,
            other => BackendError::Decode(other.to_string()),
        })
    }

    fn decode_image(
        &mut self,
        seq: i32,
        pos: usize,
        image: &crate::protocol::PromptImage,
        logits: bool,
    ) -> Result<(), BackendError> {
        let (projector, raw_ctx) = self
            .vision
            .as_ref()
            .ok_or_else(|| BackendError::Decode("no vision projector is loaded".into()))?;
        self.raw_logits = None;
        projector.decode_image(*raw_ctx, seq, pos, image, logits)?;
        if logits {
            self.raw_logits = i32::try_from(image.n_tokens - 1).ok();
        }
        Ok(())
    }

    fn sample(&mut self, sampler: &mut ChainSampler, index: usize) -> Option<Token> {
        let index = i32::try_from(index).unwrap_or(i32::MAX);
        let Some(guide) = sampler.guide.as_mut() else {
            if let Some(list) = sampler.shortlist.as_mut() {
                // What llama_sampler_sample does, on the shortlist instead of every token.
                let logits = self.logits_ith(index);
                let listed = list
                    .candidates(logits)
                    .into_iter()
                    .filter_map(|t| Some((t, *logits.get(usize::try_from(t).ok()?)?)));
                let token = apply_chain(&mut sampler.chain, listed)?.id();
                sampler.chain.accept(token);
                list.accept(token.0);
                return Some(token.0);
            }
            // `sample` also accepts the token into the chain (penalty history); no second accept.
            return Some(sampler.chain.sample(&self.ctx, index).0);
        };
        // The chain picks from all logits; only when the guide refuses that pick does it pick
        // again among the tokens the grammar allows (the distribution is the masked one's:
        // a refused pick is redrawn). The chain and the guide are each told the choice once.
        let logits = self.logits_ith(index);
        let chain = &mut sampler.chain;
        let pick = |mask: Option<&llguidance::toktrie::SimpleVob>| {
            let allowed = (0u32..).zip(logits.iter().copied());
            let picked = match mask {
                None => apply_chain(chain, allowed),
                Some(m) => apply_chain(chain, allowed.filter(|&(t, _)| m.is_allowed(t))),
            };
            // A pick the chain banned (`ignore_eos` bans end-of-generation tokens) is none.
            picked
                .filter(|d| d.logit().is_finite())
                .and_then(|d| u32::try_from(d.id().0).ok())
        };
        let token = guide.choose(pick)?;
        let token = LlamaToken(i32::try_from(token).ok()?);
        sampler.chain.accept(token);
        guide.accept(token.0 as u32, &piece_bytes(self.model, token, true));
        Some(token.0)
    }

    fn kv_truncate(&mut self, seq: i32, from: usize) -> bool {
        let Ok(from) = u32::try_from(from) else {
            return false;
        };
        self.ctx.kv_cache_seq_rm(seq, Some(from), None).is_ok()
            && self.window_intact(seq, from as usize)
    }

    fn kv_shift(&mut self, seq: i32, keep: usize, discard: usize) -> bool {
        if !self.can_shift {
            return false;
        }
        let (Ok(keep), Ok(end), Ok(delta)) = (
            u32::try_from(keep),
            u32::try_from(keep + discard),
            i32::try_from(discard),
        ) else {
            return false;
        };
        self.ctx.kv_cache_seq_rm(seq, Some(keep), Some(end)).is_ok()
            && self
                .ctx
                .kv_cache_seq_add(seq, Some(end), None, -delta)
                .is_ok()
    }

    fn kv_fork(&mut self, src: i32, dst: i32, len: usize) -> Fork {
        let Ok(cut) = u32::try_from(len) else {
            return Fork::Failed;
        };
        // The copy goes through the sequence's state, not `seq_cp`. With one KV stream per
        // sequence (kv_unified off), llama.cpp's `seq_cp` copies only whole sequences between
        // streams (a partial range aborts the process), and it only queues the copy of the
        // whole stream buffer for the next decode: whatever is written into the destination
        // before that decode (a prompt-cache restore, a window checkpoint) would be overwritten
        // by the source's cells. A state read and write is done when it returns.
        let copied = match self.state_with(src, LlamaStateSeqFlags::empty()) {
            Ok(state) => {
                // SAFETY: the state was just written by this context for one of its sequences,
                // so its layers, types and cell counts are this cache's; llama.cpp's reader
                // checks every read against the buffer's length.
                let set = unsafe {
                    self.ctx
                        .state_seq_set_data_ext(&state, dst, LlamaStateSeqFlags::empty())
                };
                set && self.ctx.kv_cache_seq_rm(dst, Some(cut), None).is_ok()
            }
            Err(e) => {
                tracing::debug!(src, dst, error = %e, "the sequence to fork could not be read");
                false
            }
        };
        if !copied {
            // Nothing half-copied stays behind: the slot starts empty.
            let _ = self.ctx.kv_cache_seq_rm(dst, None, None);
            return Fork::Failed;
        }
        // A state holds only the window cells of its source's last positions: a copy cut back
        // before them stays for a checkpoint to mend (the caller clears it otherwise).
        if self.window_intact(dst, len) {
            Fork::Copied
        } else {
            Fork::WindowLost
        }
    }

    fn sliding_window(&self) -> Option<usize> {
        self.swa_window.filter(|_| self.window_checkpoints.get())
    }

    fn window_checkpoint(&self, seq: i32) -> Result<Vec<u8>, BackendError> {
        if self.sliding_window().is_none() {
            return Err(BackendError::State(
                "the cache has no sliding window that checkpoints can rewind".into(),
            ));
        }
        let partial = self
            .ctx
            .state_seq_get_size_ext(seq, LlamaStateSeqFlags::PARTIAL_ONLY);
        let whole = self
            .ctx
            .state_seq_get_size_ext(seq, LlamaStateSeqFlags::empty());
        if partial >= whole {
            // No separate window cache: llama.cpp keeps every cell of this model.
            self.window_checkpoints.set(false);
            tracing::info!(
                "llama.cpp keeps every cell of this model's window layers: no window checkpoints"
            );
            return Err(BackendError::State(
                "the cache keeps every cell: nothing to checkpoint".into(),
            ));
        }
        self.state_with(seq, LlamaStateSeqFlags::PARTIAL_ONLY)
    }

    fn rewind_to_checkpoint(&mut self, seq: i32, len: usize, state: &[u8]) -> bool {
        let Ok(from) = u32::try_from(len) else {
            return false;
        };
        if self.sliding_window().is_none()
            || self.ctx.kv_cache_seq_rm(seq, Some(from), None).is_err()
        {
            return false;
        }
        // SAFETY: `state` is one `window_checkpoint` wrote in this process from this context
        // (the scheduler keeps checkpoints in memory only), so its layers, types and cell
        // counts are this cache's; llama.cpp's reader checks every read against its length.
        // With PARTIAL_ONLY only the sliding-window cache reads it: it clears the sequence's
        // windowed cells and puts the checkpoint's back; the full-attention cells cut above
        // stay.
        let ok = unsafe {
            self.ctx
                .state_seq_set_data_ext(state, seq, LlamaStateSeqFlags::PARTIAL_ONLY)
        };
        ok && self.ctx.kv_cache_seq_pos_max(seq).saturating_add(1)
            == i32::try_from(from).unwrap_or(-1)
            && self.window_intact(seq, len)
    }

    fn seq_state(&self, seq: i32) -> Result<Vec<u8>, BackendError> {
        self.state_with(seq, LlamaStateSeqFlags::empty())
    }

    fn set_seq_state(&mut self, seq: i32, state: &[u8]) -> Result<usize, BackendError> {
        // SAFETY: llama.cpp reads `state` within its length (its reader checks every read
        // against the buffer's end) and checks the layer count, tensor types and row sizes
        // against this context; the HTTP side only passes states whose checksum and model
        // fingerprint match what `seq_state` wrote for this model (`server::slot_file`), so
        // the cell counts it allocates by are a slot's.
        let ok = unsafe {
            self.ctx
                .state_seq_set_data_ext(state, seq, LlamaStateSeqFlags::empty())
        };
        if !ok {
            return Err(BackendError::State(
                "the state does not fit this model and context (llama.cpp logged why)".into(),
            ));
        }
        let max = self.ctx.kv_cache_seq_pos_max(seq);
        Ok(usize::try_from(max.saturating_add(1)).unwrap_or(0))
    }

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

    fn bos(&self) -> Option<Token> {
        self.add_bos.then(|| self.model.vocab().bos().0)
    }

    fn embed_capacity(&self) -> usize {
        self.slot_ctx
    }

    fn embed_piece(&self) -> usize {
        if self.embed_params.pooled_by_model {
            // Its pooling needs the whole input in one batch.
            self.slot_ctx
        } else {
            self.embed_chunk()
        }
    }

    fn embed(
        &mut self,
        tokens: &[Token],
        start: usize,
        last: bool,
    ) -> Result<Option<Vec<f32>>, BackendError> {
        if self.embed_params.pooled_by_model {
            return self.embed_pooled(tokens).map(Some);
        }
        self.embed_mean_piece(tokens, start, last)
    }
}

impl LlamaEngine<'_> {
    /// Sequence `seq`'s state with `flags` (all of it, or the sliding-window part).
    fn state_with(&self, seq: i32, flags: LlamaStateSeqFlags) -> Result<Vec<u8>, BackendError> {
        let size = self.ctx.state_seq_get_size_ext(seq, flags);
        if size == 0 {
            return Err(BackendError::State(
                "llama.cpp could not size the sequence's state".into(),
            ));
        }
        let mut state = vec![0u8; size];
        // SAFETY: `state` holds the `size` bytes llama.cpp said this sequence's state takes
        // with these flags, and nothing changes the cache between the two calls (this thread
        // owns the context and holds `&self`).
        let written = unsafe {
            self.ctx
                .state_seq_get_data_ext(state.as_mut_ptr(), seq, flags)
        };
        if written != size {
            return Err(BackendError::State(format!(
                "llama.cpp wrote {written} bytes of state, {size} expected"
            )));
        }
        Ok(state)
    }

    /// One piece of a generative model's embedding: the mean of its per-token output
    /// embeddings, decoded `embed_chunk` tokens at a time, one piece per scheduler step, through
    /// its causal KV cache (the same values llama.cpp's mean pooling gives over one batch,
    /// without its n_tokens × n_vocab logits buffer or a long stall of the other sequences).
    fn embed_mean_piece(
        &mut self,
        tokens: &[Token],
        start: usize,
        last: bool,
    ) -> Result<Option<Vec<f32>>, BackendError> {
        let mut sum = std::mem::take(&mut self.embed_sum);
        let ctx = self.embedding_context()?;
        if start == 0 {
            ctx.clear_kv_cache();
            sum.clear();
        }
        let result = decode_piece(ctx, tokens, start).and_then(|()| {
            for j in 0..tokens.len() {
                let row = ctx
                    .embeddings_ith(i32::try_from(j).unwrap_or(i32::MAX))
                    .map_err(|e| BackendError::Decode(e.to_string()))?;
                if sum.is_empty() {
                    sum = vec![0.0; row.len()];
                }
                for (s, &x) in sum.iter_mut().zip(row) {
                    *s += f64::from(x);
                }
            }
            Ok(())
        });
        if result.is_err() || last {
            ctx.clear_kv_cache();
        }
        result?;
        if !last {
            self.embed_sum = sum;
            return Ok(None);
        }
        let n = (start + tokens.len()).max(1) as f64;
        Ok(Some(sum.into_iter().map(|s| (s / n) as f32).collect()))
    }

    /// An embedding model's own pooling over the whole input in one batch. Its logits buffer
    /// (n_tokens × n_vocab floats) stays allocated with the context, so a context that needed
    /// more than `EMBED_LOGITS_BYTES` is freed after the request.
    fn embed_pooled(&mut self, tokens: &[Token]) -> Result<Vec<f32>, BackendError> {
        let n_vocab = usize::try_from(self.model.n_vocab()).unwrap_or(0);
        let ctx = self.embedding_context()?;
        ctx.clear_kv_cache();
        // No pooled embedding (the context has embeddings on, so the pooling is none): the
        // last token's.
        let result = decode_piece(ctx, tokens, 0).and_then(|()| match ctx.embeddings_seq_ith(0) {
            Ok(v) => Ok(v.to_vec()),
            Err(_) => {
                let last = i32::try_from(tokens.len().saturating_sub(1)).unwrap_or(0);
                ctx.embeddings_ith(last)
                    .map(<[f32]>::to_vec)
                    .map_err(|e| BackendError::Decode(e.to_string()))
            }
        });
        ctx.clear_kv_cache();
        if tokens.len().saturating_mul(n_vocab).saturating_mul(4) > EMBED_LOGITS_BYTES {
            tracing::debug!(
                tokens = tokens.len(),
                "embedding context freed (large logits buffer)"
            );
            self.embed_ctx = None;
        }
        result
    }
}

/// Candidates `draft_pick` weighs (llama.cpp's drafts sample from the top 10).
const DRAFT_TOP_K: usize = 10;

/// Runs `chain` on the `candidates` (token, logit) as `llama_sampler_sample` runs it on every
/// token's logit, without accepting the pick: the entry it selected, None when there were no
/// candidates or it selected none.
fn apply_chain(
    chain: &mut LlamaSampler,
    candidates: impl Iterator<Item = (u32, f32)>,
) -> Option<LlamaTokenData> {
    let data: Vec<LlamaTokenData> = candidates
        .filter_map(|(t, logit)| {
            Some(LlamaTokenData::new(
                LlamaToken(i32::try_from(t).ok()?),
                logit,
                0.0,
            ))
        })
        .collect();
    if data.is_empty() {
        return None;
    }
    let mut array = LlamaTokenDataArray::new(data, false);
    array.apply_sampler(chain);
    array.selected.and_then(|i| array.data.get(i)).copied()
}

/// The most likely token of `logits` and its probability among the `DRAFT_TOP_K` most likely
/// (softmax over those), as llama.cpp's draft sampler judges `p_min`. None when no logit is
/// finite.
fn top_k_choice(logits: &[f32]) -> Option<(Token, f32)> {
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

/// The bytes a token renders to (`special`: control tokens as their text), up to the first NUL
/// byte; empty for a token with no text.
fn piece_bytes(model: &LlamaModel, token: LlamaToken, special: bool) -> Vec<u8> {
    let mut piece = model.vocab().token_to_piece(token, special, None);
    truncate_at_nul(&mut piece);
    piece
}

/// Cuts a piece at its first NUL byte. llama-cpp-2 up to 0.1.154 read pieces back through a C
/// string, which ended them there (the byte token `<0x00>` rendered as nothing); 0.1.160 returns
/// the bytes llama.cpp wrote. Kept as before: generated text never holds a NUL, which a prompt
/// may not hold either (`tokenize`), so a conversation can always be sent back.
fn truncate_at_nul(piece: &mut Vec<u8>) {
    if let Some(nul) = piece.iter().position(|&b| b == 0) {
        piece.truncate(nul);
    }
}

/// Most bytes of BOS's or EOS's text the chat template is given.
const SPECIAL_TEXT_MAX: usize = 64;

/// Most bytes of logits an embedding context may keep between requests.
const EMBED_LOGITS_BYTES: usize = 32 << 20;

/// Decodes `tokens` as positions `start..` of sequence 0, every token an output.
fn decode_piece(
    ctx: &mut LlamaContext<'_>,
    tokens: &[Token],
    start: usize,
) -> Result<(), BackendError> {
    let mut batch = LlamaBatch::new(tokens.len().max(1), 1);
    for (i, &t) in tokens.iter().enumerate() {
        let pos = i32::try_from(start + i).map_err(|e| BackendError::Decode(e.to_string()))?;
        batch
            .add(LlamaToken(t), pos, &[0], true)
            .map_err(|e| BackendError::Decode(e.to_string()))?;
    }
    ctx.decode(&mut batch)
        .map_err(|e| BackendError::Decode(e.to_string()))
}
