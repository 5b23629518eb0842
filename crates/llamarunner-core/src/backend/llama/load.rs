//! Loading: llama.cpp's backend, the model and its context (with the LoRA adapters, the
//! projector and the draft model), what the model is (`ModelInfo`), and the step timing
//! measured before any request.

use std::num::NonZeroU32;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

use llama_cpp_2::context::params::{KvCacheType, LlamaContextParams};
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::LogOptions;

use crate::backend::{BatchToken, Decoder, KvOps};
use crate::config::{FlashAttn, RunnerConfig};
use crate::protocol::{Health, ModelInfo, TextModel};

use super::draft::{load_draft_model, DraftEngine};
use super::embeddings::EmbedParams;
use super::logs::llama_result;
use super::text::{chat_template, tokenize, LlamaText};
use super::{file_name, LlamaEngine};

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
                let loaded = crate::backend::llama::dynamic_backends::load()?;
                tracing::info!(cpu_backend = %loaded.cpu, "loaded the CPU backend that fits this processor");
                for (library, outcome) in &loaded.gpu {
                    match outcome {
                        Ok(0) => tracing::info!(
                            library = %library.display(),
                            "loaded a GPU backend that found no device (a CPU-type Vulkan device such as lavapipe is used only when GGML_VK_VISIBLE_DEVICES names it)"
                        ),
                        Ok(devices) => {
                            tracing::info!(library = %library.display(), devices, "loaded a GPU backend")
                        }
                        Err(why) => tracing::warn!(
                            library = %library.display(),
                            reason = %why,
                            "skipped a GPU backend that cannot load here"
                        ),
                    }
                }
            }
            LlamaBackend::init().map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Chooses, once per process, the CPU kernels deterministic mode needs: ggml reads
/// `GGML_CPU_TILED_MM` at its first matrix product and keeps it, so it is set (off) before any
/// model here decodes. A deterministic load after a load without the mode is refused: that
/// process's kernels are chosen already.
fn choose_kernels(deterministic: bool) -> Result<(), String> {
    static DETERMINISTIC: OnceLock<bool> = OnceLock::new();
    let chosen = *DETERMINISTIC.get_or_init(|| {
        if deterministic {
            // Before llama.cpp runs anything (this is the first load of the process).
            std::env::set_var("GGML_CPU_TILED_MM", "0");
        }
        deterministic
    });
    if deterministic && !chosen {
        return Err("--deterministic needs a process of its own: this one already loaded a model with llama.cpp's batch-shaped kernels".into());
    }
    Ok(())
}

/// Every device llama.cpp's backends found (loading the backend libraries first, in a portable
/// build), with its memory now: `llamarunner serve --list-devices`.
pub fn list_devices() -> Result<Vec<crate::protocol::devices::Device>, String> {
    llama_backend()?;
    Ok(super::devices::devices())
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
    choose_kernels(config.deterministic)?;
    let backend = llama_backend()?;
    let parallel = config.parallel;
    let threads = i32::try_from(config.effective_threads()).unwrap_or(1);
    let kv_type = kv_cache_type(config.effective_kv_cache_type());
    if config.effective_kv_cache_type() != config.kv_cache_type {
        tracing::warn!(
            "a quantized KV cache needs flash attention; --flash-attn is off, so f16 is used"
        );
    }
    // Deterministic mode keeps cells per slot for the pad rows after a sequence's last.
    let pad_cells = if config.deterministic {
        crate::backend::invariant_batch::PAD_CELLS
    } else {
        0
    };
    let n_ctx = (config.ctx_size + pad_cells as u32)
        .checked_mul(parallel)
        .ok_or("ctx-size * parallel is too large")?;
    // Deterministic mode: every cell at its position's index (no window cells reused).
    let mut ctx_params =
        context_params(config, n_ctx, threads, kv_type).with_swa_full(config.effective_swa_full());
    // The devices and their free memory before the model takes any; where its layers go
    // (nothing on a GPU in deterministic mode, which covers the CPU's kernels only).
    let cpu_only;
    let place_config = if config.deterministic {
        cpu_only = RunnerConfig {
            n_gpu_layers: 0,
            fit: false,
            ..config.clone()
        };
        &cpu_only
    } else {
        config
    };
    let (placed, placement) =
        super::placement::place(place_config, super::devices::devices(), &mut ctx_params)?;
    if let Some(fit) = placement.fit {
        tracing::info!(
            n_gpu_layers = fit.n_gpu_layers,
            fit_target_mib = fit.margin_mib,
            reserved_mib = fit.reserved_mib,
            fits = fit.fits,
            "fit the model to the GPUs' free memory"
        );
    }
    let progress_health = health.clone();
    let model_params = placed
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
    let mut model =
        llama_result(|| LlamaModel::load_from_file(backend, &config.model, &model_params))
            .map_err(|why| {
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
        llama_result(init)
    })?;
    // Shared with the HTTP side, which tokenizes with it (the model is Send + Sync; contexts,
    // batch and samplers stay on this thread).
    let model = std::sync::Arc::new(model);
    if config.deterministic && (model.is_recurrent() || model.is_hybrid()) {
        return Err(format!(
            "--deterministic covers attention models only: {} keeps a recurrent state, which the mode's pad rows would advance and cannot take back",
            file_name(&config.model)
        ));
    }

    let ctx = llama_result(|| model.new_context(backend, ctx_params))
        .map_err(|why| format!("llama.cpp could not create a context of {n_ctx} tokens: {why}"))?;

    let vision = match &config.mmproj {
        Some(path) => {
            let projector = crate::backend::llama::mtmd::Projector::load(
                path,
                &model,
                &ctx,
                threads,
                placement.n_gpu_layers != 0,
                |init| llama_result(init),
            )?;
            tracing::info!(mmproj = %path.display(), "vision projector loaded");
            Some(std::sync::Arc::new(projector))
        }
        None => None,
    };
    // The draft model (`--draft-model`) and its context: one sequence per slot, each slot's
    // context as the model's.
    // Where the model's layers went, the draft's go: on the CPU when the fit left the model
    // there.
    let draft_on_cpu;
    let draft_config = if placement.n_gpu_layers == 0 && place_config.n_gpu_layers != 0 {
        draft_on_cpu = RunnerConfig {
            n_gpu_layers: 0,
            ..place_config.clone()
        };
        &draft_on_cpu
    } else {
        place_config
    };
    let draft_model = match &config.draft_model {
        Some(path) => Some(load_draft_model(backend, &model, draft_config, path)?),
        None => None,
    };
    let draft = match &draft_model {
        Some(draft_model) => {
            // Every cell kept, so that cutting back a rejected draft never loses cells a
            // sliding window needs.
            let params = context_params(config, n_ctx, threads, kv_type).with_swa_full(true);
            let dctx =
                llama_result(|| draft_model.new_context(backend, params)).map_err(|why| {
                    format!("llama.cpp could not create the draft model's context: {why}")
                })?;
            Some(DraftEngine::new(draft_model, dctx, model.n_vocab()))
        }
        None => None,
    };

    let cells = (ctx.n_ctx() / parallel) as usize;
    // With `--kv-unified` a sequence may take the whole cache, which the slots share.
    let shared_cells = config.kv_unified.then_some(ctx.n_ctx() as usize);
    // llama.cpp pads a slot's cells (to 256); in deterministic mode the slot is `--ctx-size`
    // and the pads take cells past it.
    let slot_ctx = if let Some(all) = shared_cells {
        all
    } else if config.deterministic {
        cells
            .saturating_sub(pad_cells)
            .min(config.ctx_size as usize)
    } else {
        cells
    };
    // llama.cpp may change the sizes asked for (n_batch is clamped to the requested n_ctx,
    // n_ctx is padded): a batch is never larger than what the context really takes.
    let batch = ctx.n_batch().min(ctx.n_ubatch()).max(1) as usize;
    let mut info = model_info(&model, config, slot_ctx, placement)?;
    info.shared_cells = shared_cells;
    // An embedding input's context is a slot's: its share of a shared cache.
    let embed_cells = if shared_cells.is_some() {
        cells
    } else {
        slot_ctx
    };
    info.embed_ctx = embed_cells;
    info.vision = vision.as_ref().map(|projector| {
        std::sync::Arc::new(crate::backend::llama::mtmd::LlamaVision(projector.clone()))
            as std::sync::Arc<dyn crate::protocol::VisionModel>
    });
    for device in &info.devices.devices {
        tracing::info!(
            device = %device.name,
            description = %device.description,
            backend = %device.backend,
            kind = ?device.kind,
            memory_free = device.memory_free,
            memory_total = device.memory_total,
            "device"
        );
    }
    tracing::info!(
        backend = %info.devices.backend,
        layers_offloaded = info.devices.layers_offloaded,
        layers_total = info.devices.layers_total,
        vram_bytes = info.devices.vram_bytes,
        "model placement"
    );
    let model: &LlamaModel = &model;
    let embed_params = EmbedParams {
        threads,
        flash_attn: ctx_flash_attn(config.effective_flash_attn()),
        pooled_by_model: model_has_pooling_type(model),
        pooling: config.pooling,
    };
    let sampling_threads = config.effective_sampling_threads();
    let engine = LlamaEngine::new(
        model,
        ctx,
        slot_ctx,
        batch,
        backend,
        embed_params,
        config.effective_swa_full(),
    )?
    .with_lora(&config.lora, adapters)?
    .with_vision(vision)
    .with_draft(draft)
    .with_sampling_threads(sampling_threads as usize)
    .with_null_decode(config.null_decode)
    .with_backend_sampling(config.backend_sampling)
    .with_deterministic(config.deterministic)
    .with_shared_cells(shared_cells, embed_cells);
    // Only a model that loaded whole (its adapters applied) is shown.
    health.set_model_info(info);
    if let Some(cells) = shared_cells {
        tracing::info!(
            cells,
            "--kv-unified: the slots share one KV cache; a sequence may take all of it"
        );
    }
    if config.deterministic {
        tracing::info!(
            "--deterministic: CPU only, no flash attention, no tiled K-quant products, every sequence decoded in rows of four (backend/invariant_batch.rs)"
        );
    }
    if config.null_decode {
        tracing::warn!("--null-decode: the model computes nothing; its outputs are synthetic");
    }
    tracing::info!(
        slots = parallel,
        slot_ctx,
        batch,
        sampling_threads,
        threads,
        "ready"
    );
    let recurrent = model.is_recurrent() || model.is_hybrid();
    Ok(serve(engine, Loaded { recurrent }))
}

/// A context's settings, the model's and the draft model's alike: `n_ctx` cells for the
/// slots (`--kv-unified`: one cache they share, so a sequence may grow as far in both), a batch
/// of `--batch-size`, `threads`, the flash-attention policy and the KV cache's type. Each
/// sets its own sliding-window rule.
fn context_params(
    config: &RunnerConfig,
    n_ctx: u32,
    threads: i32,
    kv_type: KvCacheType,
) -> LlamaContextParams {
    LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(n_ctx))
        .with_n_batch(config.batch_size)
        .with_n_ubatch(config.batch_size)
        .with_n_seq_max(config.parallel)
        .with_kv_unified(config.kv_unified)
        .with_n_threads(threads)
        .with_n_threads_batch(threads)
        .with_flash_attention_policy(ctx_flash_attn(config.effective_flash_attn()))
        // Deterministic mode: no large batch's products sent to a GPU.
        .with_op_offload(!config.deterministic)
        .with_type_k(kv_type)
        .with_type_v(kv_type)
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
pub(super) fn sliding_window(model: &LlamaModel) -> Option<usize> {
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

/// The vocabulary's fill-in-the-middle tokens; None unless it has all of prefix, suffix and
/// middle (llama.cpp answers -1 for a token the vocabulary lacks).
pub(super) fn fim_tokens(model: &LlamaModel) -> Option<crate::protocol::model::FimTokens> {
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
pub(super) fn model_info(
    model: &std::sync::Arc<LlamaModel>,
    config: &RunnerConfig,
    slot_ctx: usize,
    placement: super::placement::Placement,
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
        shared_cells: None,
        embed_ctx: slot_ctx,
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
        devices: super::devices::facts(model, placement),
        deterministic: config.deterministic,
    })
}

/// llama.cpp's `LLAMA_POOLING_TYPE_RANK`, as GGUF's `{arch}.pooling_type` writes it.
pub(super) const POOLING_RANK: &str = "4";

/// How the model pairs a query with a document, when its pooling is rank (a reranker); None
/// for every other model. The markers are llama-server's (`format_prompt_rerank`).
pub(super) fn rerank_format(model: &LlamaModel) -> Option<crate::protocol::model::RerankFormat> {
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

pub(super) fn ctx_flash_attn(policy: FlashAttn) -> llama_cpp_sys_2::llama_flash_attn_type {
    match policy {
        FlashAttn::Auto => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_AUTO,
        FlashAttn::On => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_ENABLED,
        FlashAttn::Off => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED,
    }
}

/// Whether the GGUF names a pooling type (embedding models do; generative ones do not).
pub(super) fn model_has_pooling_type(model: &LlamaModel) -> bool {
    model
        .meta_val_str("general.architecture")
        .is_ok_and(|arch| model.meta_val_str(&format!("{arch}.pooling_type")).is_ok())
}

pub(super) fn kv_cache_type(name: &str) -> KvCacheType {
    match name {
        "q8_0" => KvCacheType::Q8_0,
        "q4_0" => KvCacheType::Q4_0,
        _ => KvCacheType::F16,
    }
}
