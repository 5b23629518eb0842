//! The vision projector (`--mmproj`) on llama.cpp's `mtmd`: loaded on the engine thread after
//! the model, shared with the HTTP side for tokenizing (`VisionModel`), and used by the engine
//! to encode an image and decode its embeddings into a sequence (`Projector::decode_image`).
//!
//! llama-cpp-2 wraps `mtmd_tokenize` into `MtmdInputChunks` (`!Send` up to 0.1.154; in 0.1.160
//! it is `Send` and its chunks borrow from it), and offers no per-chunk decode of image
//! embeddings into one sequence of a shared context. So the chunks are handled here through
//! `llama-cpp-sys-2`: a tokenized image is one owned `mtmd_input_chunk`
//! (`mtmd_input_chunk_copy`: its preprocessed pixels as plain float vectors, no pointer into
//! the context or the tokenizer), which may move to the engine thread;
//! there `mtmd_encode_chunk` runs the projector and `mtmd_helper_decode_image_chunk` decodes
//! the embeddings at the sequence's positions (non-causal attention for the image when the
//! model wants it). The context and projector pointers the crate keeps private are read from
//! their `Debug` output once, at load, as `backend/llama/lora.rs` does, and checked.
//!
//! Threads: `mtmd_tokenize` (HTTP side, the blocking pool) preprocesses images with the
//! projector's image preprocessor and reads the vocabulary; `mtmd_encode_chunk` (engine thread)
//! runs the projector's graph on its own compute buffers and writes its output embeddings. The
//! two touch different state, so they may run at the same time; tokenizations are serialized
//! among themselves by a mutex (the preprocessors are not documented as re-entrant).

use std::any::Any;
use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::mtmd::{MtmdContext, MtmdContextParams};
use llama_cpp_sys_2 as sys;

use crate::backend::llama::guarded_decode::Failure;
use crate::backend::llama::private_pointers::debug_pointer;
use crate::backend::{BackendError, Token};
use crate::protocol::vision::{ImageChunk, ImageInput, PromptImage, VisionError, VisionModel};

/// The loaded projector.
pub(super) struct Projector {
    /// Owns the `mtmd_context` (freed on drop, before `_model`: fields drop in order).
    _ctx: MtmdContext,
    /// The text model the projector was made for, kept alive as long as it (the HTTP side's
    /// `ModelInfo` holds the projector and may outlive the engine thread).
    _model: Arc<LlamaModel>,
    /// Its pointer.
    raw: NonNull<sys::mtmd_context>,
    /// The marker that stands for an image in text given to `mtmd_tokenize`.
    marker: String,
    /// Most positions one image may take: one decode's (the context's n_ubatch), since an
    /// image whose tokens attend to each other must be decoded in one micro-batch.
    max_positions: usize,
    /// Serializes tokenizations.
    tokenizing: Mutex<()>,
}

// SAFETY: `MtmdContext` is Send + Sync itself; `raw` is its own pointer, used only for calls
// that are safe from any thread (tokenize, under `tokenizing`) or made on the engine thread
// (encode, decode), as the module documentation explains.
unsafe impl Send for Projector {}
// SAFETY: as for Send.
unsafe impl Sync for Projector {}

impl std::fmt::Debug for Projector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Projector")
            .field("max_positions", &self.max_positions)
            .finish_non_exhaustive()
    }
}

/// Routes mtmd's and clip's log lines to `tracing`, as llama.cpp's are.
unsafe extern "C" fn log_to_tracing(
    level: sys::ggml_log_level,
    text: *const c_char,
    _user: *mut c_void,
) {
    if text.is_null() {
        return;
    }
    // SAFETY: mtmd passes a NUL-terminated string that lives for the call.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    let text = text.trim_end();
    if text.is_empty() {
        return;
    }
    match level {
        sys::GGML_LOG_LEVEL_ERROR => tracing::error!(target: "mtmd", "{text}"),
        sys::GGML_LOG_LEVEL_WARN => tracing::warn!(target: "mtmd", "{text}"),
        sys::GGML_LOG_LEVEL_INFO => tracing::info!(target: "mtmd", "{text}"),
        _ => tracing::debug!(target: "mtmd", "{text}"),
    }
}

impl Projector {
    /// Loads the projector `path` for `model` (`init` wraps the call in llama.cpp's error
    /// capture, so that a wrong file says why). Errors are one line naming the file.
    pub(super) fn load(
        path: &std::path::Path,
        model: &Arc<LlamaModel>,
        ctx: &LlamaContext<'_>,
        threads: i32,
        use_gpu: bool,
        init: impl FnOnce(&dyn Fn() -> Result<MtmdContext, String>) -> Result<MtmdContext, String>,
    ) -> Result<Self, String> {
        static LOGS: std::sync::Once = std::sync::Once::new();
        // SAFETY: the callback is a plain function that lives for the whole process.
        LOGS.call_once(|| unsafe {
            sys::mtmd_log_set(Some(log_to_tracing), std::ptr::null_mut());
            sys::mtmd_helper_log_set(Some(log_to_tracing), std::ptr::null_mut());
        });
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |f| f.to_string_lossy().into_owned(),
        );
        if !path.is_file() {
            return Err(format!(
                "cannot load the vision projector {name}: no such file"
            ));
        }
        let text = path
            .to_str()
            .ok_or_else(|| format!("--mmproj {name}: the path is not valid UTF-8"))?;
        let params = MtmdContextParams {
            use_gpu,
            print_timings: false,
            n_threads: threads,
            ..MtmdContextParams::default()
        };
        let mtmd =
            init(&|| MtmdContext::init_from_file(text, model, &params).map_err(|e| e.to_string()))
                .map_err(|why| {
                    // One line, naming the file only (`/health` shows it to any client).
                    let why = why.replace(text, &name).replace('\n', " ");
                    format!("cannot load the vision projector {name}: {why}")
                })?;
        let raw = debug_pointer(&mtmd, "context")
            .and_then(|p| NonNull::new(p as *mut sys::mtmd_context))
            .ok_or("cannot reach the projector through this llama-cpp-2")?;
        if !mtmd.support_vision() {
            return Err(format!(
                "the projector {name} takes no images (an audio projector?)"
            ));
        }
        if mtmd.decode_use_mrope() {
            // M-RoPE models (the Qwen2-VL family) give image positions in 2-D and use fewer
            // positions than tokens; the slot bookkeeping counts one position per token.
            return Err(format!(
                "the projector {name} is for an M-RoPE model (Qwen2-VL family), which this \
                 runner does not support"
            ));
        }
        // SAFETY: `mtmd_default_marker` returns a static NUL-terminated string.
        let marker = unsafe { CStr::from_ptr(sys::mtmd_default_marker()) }
            .to_string_lossy()
            .into_owned();
        Ok(Self {
            _ctx: mtmd,
            _model: model.clone(),
            raw,
            marker,
            max_positions: ctx.n_ubatch().min(ctx.n_batch()).max(1) as usize,
            tokenizing: Mutex::new(()),
        })
    }

    /// Encodes `image` and decodes its embeddings as positions `pos..` of sequence `seq` of
    /// the context `raw_ctx`, in one decode (one micro-batch: the tokenizer refused images
    /// larger than that), with non-causal attention among the image's positions when the
    /// model wants it. With `logits`, the last position's logits are kept (batch index
    /// `n_tokens - 1`): the prompt ends with this image.
    pub(super) fn decode_image(
        &self,
        raw_ctx: *mut sys::llama_context,
        seq: i32,
        pos: usize,
        image: &PromptImage,
        logits: bool,
    ) -> Result<(), BackendError> {
        let fail = |m: String| BackendError::Decode(m);
        let chunk = image
            .chunk
            .as_any()
            .downcast_ref::<OwnedChunk>()
            .ok_or_else(|| fail("an image of another projector".into()))?;
        let pos = i32::try_from(pos).map_err(|e| fail(e.to_string()))?;
        let n = image.n_tokens;
        let n_i32 = i32::try_from(n).map_err(|e| fail(e.to_string()))?;
        if n == 0 || n > self.max_positions {
            return Err(fail(format!("an image of {n} positions")));
        }
        // SAFETY: `self.raw` is the live projector and `chunk.0` an image chunk it tokenized
        // (owned by `chunk`, alive for the call); `raw_ctx` is the live context of the
        // projector's model. This runs on the engine thread, the only one that encodes or
        // decodes. The batch is allocated for `n` positions of `n_embd` floats each and
        // filled within those bounds; `embd` holds `n * n_embd` floats (mtmd's output for
        // this chunk: `n_tokens` embeddings of the text model's input width).
        let started = std::time::Instant::now();
        unsafe {
            if sys::mtmd_encode_chunk(self.raw.as_ptr(), chunk.0.as_ptr()) != 0 {
                return Err(fail("the projector could not encode the image".into()));
            }
            let embd = sys::mtmd_get_output_embd(self.raw.as_ptr());
            if embd.is_null() {
                return Err(fail("the projector gave no embeddings".into()));
            }
            let n_embd = sys::llama_model_n_embd_inp(sys::llama_get_model(raw_ctx));
            let width = usize::try_from(n_embd).map_err(|e| fail(e.to_string()))?;
            let batch = EmbdBatch(sys::llama_batch_init(n_i32, n_embd, 1));
            let b = batch.0;
            std::ptr::copy_nonoverlapping(embd, b.embd, n * width);
            for i in 0..n {
                *b.pos.add(i) = pos + i as i32;
                *b.n_seq_id.add(i) = 1;
                **b.seq_id.add(i) = seq;
                *b.logits.add(i) = i8::from(logits && i + 1 == n);
            }
            let mut view = b;
            view.n_tokens = n_i32;
            let non_causal = sys::mtmd_decode_use_non_causal(self.raw.as_ptr(), chunk.0.as_ptr());
            if non_causal {
                sys::llama_set_causal_attn(raw_ctx, false);
            }
            let encoded = started.elapsed();
            let decoded = crate::backend::llama::guarded_decode::decode(raw_ctx, view);
            if non_causal {
                sys::llama_set_causal_attn(raw_ctx, true);
            }
            tracing::debug!(
                positions = n,
                encode_ms = encoded.as_secs_f64() * 1e3,
                decode_ms = (started.elapsed() - encoded).as_secs_f64() * 1e3,
                non_causal,
                "image encoded and decoded"
            );
            match decoded {
                Ok(()) => Ok(()),
                Err(Failure::NoKvSlot) => Err(BackendError::NoKvSlot),
                // The engine recovers (`LlamaEngine::decode_image`).
                Err(Failure::Threw(what)) => Err(BackendError::Threw(what)),
                Err(other) => Err(fail(format!("the image's decode: {other}"))),
            }
        }
    }
}

/// An embedding batch, freed on drop.
struct EmbdBatch(sys::llama_batch);

impl Drop for EmbdBatch {
    fn drop(&mut self) {
        // SAFETY: made by `llama_batch_init`, freed only here.
        unsafe { sys::llama_batch_free(self.0) }
    }
}

/// An image chunk `mtmd_tokenize` made, copied out of its chunk list and owned here.
struct OwnedChunk(NonNull<sys::mtmd_input_chunk>);

// SAFETY: a copied chunk owns its data (the image's preprocessed pixels as plain vectors, its
// token counts and id), with no pointer into the tokenizer or another thread's state; it is
// only read after it is made, and freed once, on drop.
unsafe impl Send for OwnedChunk {}
// SAFETY: as for Send: shared references only read it.
unsafe impl Sync for OwnedChunk {}

impl Drop for OwnedChunk {
    fn drop(&mut self) {
        // SAFETY: made by `mtmd_input_chunk_copy`, freed only here.
        unsafe { sys::mtmd_input_chunk_free(self.0.as_ptr()) }
    }
}

impl std::fmt::Debug for OwnedChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OwnedChunk")
    }
}

impl ImageChunk for OwnedChunk {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A bitmap handed to `mtmd_tokenize`, freed on drop.
struct Bitmap(NonNull<sys::mtmd_bitmap>);

impl Drop for Bitmap {
    fn drop(&mut self) {
        // SAFETY: made by `mtmd_bitmap_init`, freed only here.
        unsafe { sys::mtmd_bitmap_free(self.0.as_ptr()) }
    }
}

/// A chunk list, freed on drop.
struct Chunks(NonNull<sys::mtmd_input_chunks>);

impl Drop for Chunks {
    fn drop(&mut self) {
        // SAFETY: made by `mtmd_input_chunks_init`, freed only here (the chunks we keep are
        // copies).
        unsafe { sys::mtmd_input_chunks_free(self.0.as_ptr()) }
    }
}

/// The key of the `sub`-th chunk of an image (a projector may cut one image into several
/// chunks: an overview and slices).
fn chunk_key(image: u64, sub: usize) -> u64 {
    if sub == 0 {
        image
    } else {
        (image ^ (sub as u64)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }
}

/// The projector as the HTTP side uses it.
#[derive(Debug, Clone)]
pub(super) struct LlamaVision(pub(super) Arc<Projector>);

impl VisionModel for LlamaVision {
    fn marker(&self) -> &str {
        &self.0.marker
    }

    fn tokenize(
        &self,
        text: &str,
        images: &[ImageInput],
    ) -> Result<(Vec<Token>, Vec<PromptImage>), VisionError> {
        let projector = &self.0;
        let mut bitmaps = Vec::with_capacity(images.len());
        for (i, image) in images.iter().enumerate() {
            let want = u64::from(image.width) * u64::from(image.height) * 3;
            if image.width == 0 || image.height == 0 || image.rgb.len() as u64 != want {
                return Err(VisionError::InvalidImage(format!(
                    "image {i}: {} bytes of RGB for {}x{} pixels",
                    image.rgb.len(),
                    image.width,
                    image.height
                )));
            }
            // SAFETY: `rgb` holds width * height * 3 bytes (checked); mtmd copies them.
            let raw =
                unsafe { sys::mtmd_bitmap_init(image.width, image.height, image.rgb.as_ptr()) };
            let bitmap = Bitmap(
                NonNull::new(raw)
                    .ok_or_else(|| VisionError::InvalidImage(format!("image {i}: no bitmap")))?,
            );
            let id = CString::new(i.to_string()).unwrap_or_default();
            // SAFETY: a live bitmap and a NUL-terminated id, which mtmd copies.
            unsafe { sys::mtmd_bitmap_set_id(bitmap.0.as_ptr(), id.as_ptr()) };
            bitmaps.push(bitmap);
        }
        let text_c = CString::new(text).map_err(|_| {
            VisionError::InvalidPrompt("the prompt contains a NUL character".into())
        })?;
        let input = sys::mtmd_input_text {
            text: text_c.as_ptr(),
            text_len: text_c.as_bytes().len(),
            add_special: true,
            parse_special: true,
        };
        // SAFETY: plain allocation of an empty list.
        let chunks = Chunks(
            NonNull::new(unsafe { sys::mtmd_input_chunks_init() })
                .ok_or_else(|| VisionError::InvalidPrompt("no chunk list".into()))?,
        );
        let mut pointers: Vec<*const sys::mtmd_bitmap> =
            bitmaps.iter().map(|b| b.0.as_ptr().cast_const()).collect();
        let rc = {
            let _one_at_a_time = projector
                .tokenizing
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            // SAFETY: live projector, list, text and bitmaps; one pointer per bitmap.
            unsafe {
                sys::mtmd_tokenize(
                    projector.raw.as_ptr(),
                    chunks.0.as_ptr(),
                    &raw const input,
                    pointers.as_mut_ptr(),
                    pointers.len(),
                )
            }
        };
        match rc {
            0 => {}
            1 => {
                return Err(VisionError::InvalidImage(format!(
                    "the prompt has {} image markers but {} images were given",
                    text.matches(projector.marker.as_str()).count(),
                    images.len()
                )))
            }
            2 => {
                return Err(VisionError::InvalidImage(
                    "the projector could not preprocess the image".into(),
                ))
            }
            rc => {
                return Err(VisionError::InvalidImage(format!(
                    "the projector could not tokenize the prompt ({rc})"
                )))
            }
        }
        let mut tokens: Vec<Token> = Vec::new();
        let mut out: Vec<PromptImage> = Vec::new();
        let mut subs = vec![0usize; images.len()];
        // SAFETY: the list is alive; every chunk pointer it gives lives as long as it does,
        // and what we keep of one is a copy.
        unsafe {
            let n = sys::mtmd_input_chunks_size(chunks.0.as_ptr());
            for i in 0..n {
                let chunk = sys::mtmd_input_chunks_get(chunks.0.as_ptr(), i);
                if chunk.is_null() {
                    continue;
                }
                match sys::mtmd_input_chunk_get_type(chunk) {
                    sys::MTMD_INPUT_CHUNK_TYPE_TEXT => {
                        let mut len = 0usize;
                        let p = sys::mtmd_input_chunk_get_tokens_text(chunk, &raw mut len);
                        if !p.is_null() && len > 0 {
                            tokens.extend_from_slice(std::slice::from_raw_parts(p, len));
                        }
                    }
                    sys::MTMD_INPUT_CHUNK_TYPE_IMAGE => {
                        let n_tokens = sys::mtmd_input_chunk_get_n_tokens(chunk);
                        let n_pos = sys::mtmd_input_chunk_get_n_pos(chunk);
                        if usize::try_from(n_pos).ok() != Some(n_tokens) {
                            return Err(VisionError::InvalidImage(
                                "the projector gives an image fewer positions than tokens \
                                 (M-RoPE), which this runner does not support"
                                    .into(),
                            ));
                        }
                        if n_tokens > projector.max_positions {
                            return Err(VisionError::InvalidImage(format!(
                                "an image takes {n_tokens} positions, one decode holds {} \
                                 (raise --batch-size)",
                                projector.max_positions
                            )));
                        }
                        let id = sys::mtmd_input_chunk_get_id(chunk);
                        let index = if id.is_null() {
                            None
                        } else {
                            CStr::from_ptr(id)
                                .to_str()
                                .ok()
                                .and_then(|s| s.parse::<usize>().ok())
                        }
                        .filter(|&k| k < images.len())
                        .ok_or_else(|| {
                            VisionError::InvalidImage("an image chunk of no given image".into())
                        })?;
                        let copy =
                            NonNull::new(sys::mtmd_input_chunk_copy(chunk)).ok_or_else(|| {
                                VisionError::InvalidImage("cannot copy an image chunk".into())
                            })?;
                        let key = chunk_key(images[index].key(), subs[index]);
                        subs[index] += 1;
                        let image = PromptImage {
                            key,
                            n_tokens,
                            chunk: Arc::new(OwnedChunk(copy)),
                        };
                        tokens.extend(image.tokens());
                        if !out.iter().any(|o| o.key == image.key) {
                            out.push(image);
                        }
                    }
                    _ => {
                        return Err(VisionError::InvalidImage(
                            "audio input is not supported".into(),
                        ))
                    }
                }
            }
        }
        Ok((tokens, out))
    }
}
