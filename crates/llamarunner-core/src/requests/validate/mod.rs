//! One validation layer before the queue: every dialect's generation or embedding request
//! becomes tokens plus parameters here, with every limit checked and every value that
//! llama.cpp would allocate by clamped. A bad request gets its 400 at once, even while every
//! slot is busy; the engine thread only ever sees requests that cannot hurt it.
//!
//! Tokenizing, template rendering and grammar compilation run on tokio's blocking pool, at most
//! `BLOCKING_TASKS` at a time, so a burst of long prompts cannot occupy every thread.

use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::http::error::ApiError;
use crate::kv;
use crate::protocol::params::{SamplingParams, UNCAPPED_SLOT_CONTEXTS};
use crate::protocol::vision::VisionError;
use crate::protocol::{ImageInput, ModelInfo, PromptImage, Token};

/// Most stop strings one request may give (template end-of-turn markers included).
pub const MAX_STOP_STRINGS: usize = 64;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;
/// Most `logit_bias` entries one request may give.
pub const MAX_LOGIT_BIAS: usize = 4096;
/// Most alternatives per token (`top_logprobs`), OpenAI's limit.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most inputs in one embedding request.
pub const MAX_EMBED_INPUTS: usize = 2048;
/// Tokenizations, renderings and grammar compilations running at once.
pub const BLOCKING_TASKS: usize = 4;

static BLOCKING: Semaphore = Semaphore::const_new(BLOCKING_TASKS);

pub use crate::http::Limits;

/// A generation request that passed every check: what the engine gets.
#[derive(Debug)]
pub struct Generation {
    /// The prompt's tokens, at most a slot's worth.
    pub tokens: Vec<Token>,
    /// Checked and clamped parameters.
    pub params: SamplingParams,
    /// The prompt was cut to fit the slot.
    pub truncated: bool,
    /// The images whose positions `tokens` hold (`protocol::vision`).
    pub images: Vec<PromptImage>,
}

/// Runs `f` on the blocking pool, at most `BLOCKING_TASKS` at a time.
pub async fn blocking<T, F>(f: F) -> Result<T, ApiError>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let _permit = BLOCKING
        .acquire()
        .await
        .map_err(|e| ApiError::Internal(format!("blocking pool closed: {e}")))?;
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(format!("blocking task failed: {e}")))
}

/// A sampling option out of its range: which one (its native name under `options`) and what
/// is wrong with it. Each dialect renders it under its own name for the field (`Display` is
/// the native form, `options.top_p must be ...`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptionError {
    /// The option's native name (`top_p`, `stop`).
    pub field: &'static str,
    /// What is wrong, to follow the field's name (` must be >= 0`, `: at most 4 ...`).
    problem: String,
}

impl OptionError {
    fn new(field: &'static str, problem: impl Into<String>) -> Self {
        Self {
            field,
            problem: problem.into(),
        }
    }

    /// The error for a dialect whose options sit at the top level of the request (OpenAI,
    /// Anthropic, Responses), with its names for the fields it names otherwise (`renamed`:
    /// native name, the dialect's).
    pub fn top_level(&self, renamed: &[(&str, &str)]) -> ApiError {
        let name = renamed
            .iter()
            .find(|(native, _)| *native == self.field)
            .map_or(self.field, |(_, theirs)| theirs);
        ApiError::field(name, self.problem.clone())
    }

    /// The error for a dialect whose options sit under `options` (the native API, Ollama's).
    pub fn under_options(&self) -> ApiError {
        ApiError::field(format!("options.{}", self.field), self.problem.clone())
    }
}

impl std::fmt::Display for OptionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "options.{}{}", self.field, self.problem)
    }
}

/// Checks the values that have no meaning; the error names the option (`OptionError`).
pub fn check_options(p: &SamplingParams) -> Result<(), OptionError> {
    if p.num_predict < -1 {
        return Err(OptionError::new(
            "num_predict",
            format!(" must be -1 (unlimited) or >= 0, got {}", p.num_predict),
        ));
    }
    if p.num_keep < -1 {
        return Err(OptionError::new(
            "num_keep",
            format!(" must be -1 (all) or >= 0, got {}", p.num_keep),
        ));
    }
    let finite = [
        ("temperature", p.temperature),
        ("top_p", p.top_p),
        ("min_p", p.min_p),
        ("typical_p", p.typical_p),
        ("repeat_penalty", p.repeat_penalty),
        ("presence_penalty", p.presence_penalty),
        ("frequency_penalty", p.frequency_penalty),
        ("mirostat_tau", p.mirostat_tau),
        ("mirostat_eta", p.mirostat_eta),
    ];
    for (name, v) in finite {
        if !v.is_finite() {
            return Err(OptionError::new(name, " must be a finite number"));
        }
    }
    if p.temperature < 0.0 {
        return Err(OptionError::new("temperature", " must be >= 0"));
    }
    for (name, v) in [
        ("top_p", p.top_p),
        ("min_p", p.min_p),
        ("typical_p", p.typical_p),
    ] {
        if !(0.0..=1.0).contains(&v) {
            return Err(OptionError::new(
                name,
                format!(" must be between 0 and 1, got {v}"),
            ));
        }
    }
    if p.top_k < 0 {
        return Err(OptionError::new("top_k", " must be >= 0"));
    }
    if !(0..=2).contains(&p.mirostat) {
        return Err(OptionError::new("mirostat", " must be 0, 1 or 2"));
    }
    if p.repeat_last_n < -1 {
        return Err(OptionError::new("repeat_last_n", " must be -1 or >= 0"));
    }
    if p.stop.iter().any(String::is_empty) {
        return Err(OptionError::new("stop", " must not contain empty strings"));
    }
    if p.stop.len() > MAX_STOP_STRINGS {
        return Err(OptionError::new(
            "stop",
            format!(
                ": at most {MAX_STOP_STRINGS} stop strings, got {}",
                p.stop.len()
            ),
        ));
    }
    if p.stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(OptionError::new(
            "stop",
            format!(": a stop string may have at most {MAX_STOP_BYTES} bytes"),
        ));
    }
    check_samplers(&p.samplers)
}

/// Most DRY sequence breakers one request may give (llama.cpp matches each against the whole
/// vocabulary when the sampler is made).
pub const MAX_DRY_BREAKERS: usize = 16;
/// Longest DRY sequence breaker, in bytes (llama.cpp reads at most 40 characters of one).
pub const MAX_DRY_BREAKER_BYTES: usize = 40;

fn check_samplers(s: &crate::protocol::params::ExtraSamplers) -> Result<(), OptionError> {
    for (name, v) in [
        ("dry_multiplier", s.dry_multiplier),
        ("dry_base", s.dry_base),
        ("xtc_probability", s.xtc_probability),
        ("xtc_threshold", s.xtc_threshold),
        ("top_n_sigma", s.top_n_sigma),
        ("dynatemp_range", s.dynatemp_range),
        ("dynatemp_exponent", s.dynatemp_exponent),
    ] {
        if !v.is_finite() {
            return Err(OptionError::new(name, " must be a finite number"));
        }
    }
    for (name, v, max) in [
        ("dry_multiplier", s.dry_multiplier, 100.0),
        ("dry_base", s.dry_base, 100.0),
        ("dynatemp_range", s.dynatemp_range, 10.0),
        ("dynatemp_exponent", s.dynatemp_exponent, 100.0),
        ("top_n_sigma", s.top_n_sigma.max(0.0), 100.0),
    ] {
        if !(0.0..=max).contains(&v) {
            return Err(OptionError::new(
                name,
                format!(" must be between 0 and {max}, got {v}"),
            ));
        }
    }
    for (name, v) in [
        ("xtc_probability", s.xtc_probability),
        ("xtc_threshold", s.xtc_threshold),
    ] {
        if !(0.0..=1.0).contains(&v) {
            return Err(OptionError::new(
                name,
                format!(" must be between 0 and 1, got {v}"),
            ));
        }
    }
    if s.dry_allowed_length < 0 {
        return Err(OptionError::new("dry_allowed_length", " must be >= 0"));
    }
    if s.dry_penalty_last_n < -1 {
        return Err(OptionError::new(
            "dry_penalty_last_n",
            " must be -1 (the slot) or >= 0",
        ));
    }
    let breakers = &s.dry_sequence_breakers;
    if breakers.len() > MAX_DRY_BREAKERS {
        return Err(OptionError::new(
            "dry_sequence_breakers",
            format!(": at most {MAX_DRY_BREAKERS}, got {}", breakers.len()),
        ));
    }
    if breakers
        .iter()
        .any(|b| b.is_empty() || b.len() > MAX_DRY_BREAKER_BYTES || b.contains('\0'))
    {
        return Err(OptionError::new(
            "dry_sequence_breakers",
            format!(
                ": each must have 1 to {MAX_DRY_BREAKER_BYTES} bytes \
             and no NUL"
            ),
        ));
    }
    Ok(())
}

/// Checks what depends on the model and the server's limits, and clamps what llama.cpp would
/// allocate by: `num_predict` to `--max-tokens`, `repeat_last_n` and `dry_penalty_last_n` to the
/// slot (their rings are allocated and zeroed at that size), `logit_bias` ids inside the
/// vocabulary.
pub fn check_for_model(
    p: &mut SamplingParams,
    info: &ModelInfo,
    limits: &Limits,
) -> Result<(), ApiError> {
    check_options(p).map_err(|e| e.under_options())?;
    if p.deterministic && !info.deterministic {
        return Err(ApiError::DeterministicUnavailable(
            "deterministic: this server was not started with --deterministic (the mode is chosen when the model loads: CPU kernels whose rows compute the same in any batch), so its output may depend on other requests and on its caches".into(),
        ));
    }
    if limits.max_tokens > 0 {
        let cap = i64::from(limits.max_tokens);
        if p.num_predict < 0 || p.num_predict > cap {
            p.num_predict = cap;
        }
    } else {
        // Without `--max-tokens`, ten slot contexts, as for -1 (`sched`): a request for 2^31
        // tokens with `ignore_eos` would otherwise hold its slot for good.
        let cap =
            i64::try_from(info.slot_ctx.saturating_mul(UNCAPPED_SLOT_CONTEXTS)).unwrap_or(i64::MAX);
        p.num_predict = p.num_predict.min(cap);
    }
    let slot = i32::try_from(info.slot_ctx).unwrap_or(i32::MAX);
    if p.repeat_last_n < 0 || p.repeat_last_n > slot {
        p.repeat_last_n = slot;
    }
    // DRY allocates its ring of recent tokens at this size, as the penalties do.
    let dry = &mut p.samplers.dry_penalty_last_n;
    if *dry < 0 || *dry > slot {
        *dry = slot;
    }
    p.samplers.dry_allowed_length = p.samplers.dry_allowed_length.min(slot);
    if p.logit_bias.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::field(
            "logit_bias",
            format!(
                ": at most {MAX_LOGIT_BIAS} entries, got {}",
                p.logit_bias.len()
            ),
        ));
    }
    let n_vocab = i32::try_from(info.n_vocab).unwrap_or(i32::MAX);
    for &(token, bias) in &p.logit_bias {
        if !(0..n_vocab).contains(&token) {
            return Err(ApiError::field(
                "logit_bias",
                format!(": token {token} is not in the vocabulary (0..{n_vocab})"),
            ));
        }
        if bias.is_nan() {
            return Err(ApiError::field("logit_bias", ": a bias must be a number"));
        }
    }
    if p.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        return Err(ApiError::field(
            "top_logprobs",
            format!(" must be between 0 and {MAX_TOP_LOGPROBS}"),
        ));
    }
    if let Some(g) = p.grammar.as_ref().and_then(crate::constrain::Grammar::gbnf) {
        crate::constrain::gbnf::check_size(g).map_err(ApiError::InvalidRequest)?;
    }
    Ok(())
}

/// Fits a prompt into a slot (`kv::fit_prompt`), or a `context_length_exceeded` when
/// truncation is off. Returns whether it was cut.
pub fn fit_prompt(
    tokens: &mut Vec<Token>,
    p: &SamplingParams,
    info: &ModelInfo,
) -> Result<bool, ApiError> {
    Ok(kv::fit_prompt(
        tokens,
        p.num_keep,
        p.truncate,
        info.bos,
        info.slot_ctx,
    )?)
}

/// Bytes of text per slot token a prompt or input may have before it is tokenized: far more
/// than any text needs (English is about 4 bytes a token), and a bound on tokenizing time
/// (llama.cpp's tokenizers slow down more than linearly on huge inputs, and a blocking task
/// cannot be cancelled when its client leaves).
pub const MAX_TEXT_BYTES_PER_TOKEN: usize = 32;

/// Most bytes of text one prompt or embedding input may have.
pub fn max_text_bytes(info: &ModelInfo) -> usize {
    info.slot_ctx
        .saturating_mul(MAX_TEXT_BYTES_PER_TOKEN)
        .max(64 * 1024)
}

/// Tokenizes text on the blocking pool; `what` names it in errors.
pub async fn tokenize(
    info: &Arc<ModelInfo>,
    text: String,
    what: &str,
) -> Result<Vec<Token>, ApiError> {
    let tokens = tokenize_text(info, text, true, what).await?;
    if tokens.is_empty() {
        return Err(ApiError::invalid(format!("the {what} has no tokens")));
    }
    Ok(tokens)
}

/// Tokenizes text of at most `max_text_bytes` on the blocking pool, special tokens parsed,
/// BOS (and EOS) added when `add_special` and the model wants them; `what` names it in errors.
/// No tokens is not an error here (`POST /tokenize` of "").
pub async fn tokenize_text(
    info: &Arc<ModelInfo>,
    text: String,
    add_special: bool,
    what: &str,
) -> Result<Vec<Token>, ApiError> {
    let max = max_text_bytes(info);
    if text.len() > max {
        return Err(ApiError::ContextLength(format!(
            "the input length exceeds the context length: the {what} has {} bytes of text, at \
             most {max} are read for a slot of {} tokens (raise --ctx-size)",
            text.len(),
            info.slot_ctx
        )));
    }
    let model = info.text.clone();
    blocking(move || model.tokenize_with(&text, add_special))
        .await?
        .map_err(|e| ApiError::InvalidRequest(e.to_string()))
}

/// Fewest token ids `POST /detokenize` takes at once, whatever the slot size.
pub const MIN_DETOKENIZE_TOKENS: usize = 65_536;

/// Most token ids one `POST /detokenize` may give: a slot's worth, at least
/// `MIN_DETOKENIZE_TOKENS`.
pub fn max_detokenize_tokens(info: &ModelInfo) -> usize {
    info.slot_ctx.max(MIN_DETOKENIZE_TOKENS)
}

/// Checks token ids to detokenize: at most `max_detokenize_tokens`, each inside the
/// vocabulary (llama.cpp indexes its vocabulary by them without a check).
pub fn check_token_ids(ids: &[i64], info: &ModelInfo) -> Result<Vec<Token>, ApiError> {
    let max = max_detokenize_tokens(info);
    if ids.len() > max {
        return Err(ApiError::ContextLength(format!(
            "at most {max} tokens may be detokenized at once, got {}",
            ids.len()
        )));
    }
    let n_vocab = i64::from(info.n_vocab);
    ids.iter()
        .enumerate()
        .map(|(i, &id)| {
            if (0..n_vocab).contains(&id) {
                Token::try_from(id).map_err(|_| ApiError::invalid("token id out of range"))
            } else {
                Err(ApiError::invalid(format!(
                    "tokens[{i}]: {id} is not in the vocabulary (0..{n_vocab})"
                )))
            }
        })
        .collect()
}

/// Tokenizes a prompt with images (one marker per image in `text`) with the projector, on the
/// blocking pool: text tokens and image positions (`protocol::vision`). An image the projector
/// cannot take, or one larger than a decode, is a 400 `invalid_image`.
pub async fn tokenize_with_images(
    info: &Arc<ModelInfo>,
    text: String,
    images: Vec<ImageInput>,
) -> Result<(Vec<Token>, Vec<PromptImage>), ApiError> {
    let Some(vision) = info.vision.clone() else {
        return Err(ApiError::ImagesNotSupported(
            "this server has no vision projector: start it with --mmproj FILE to send images"
                .into(),
        ));
    };
    let max = max_text_bytes(info);
    if text.len() > max {
        return Err(ApiError::ContextLength(format!(
            "the input length exceeds the context length: the prompt has {} bytes of text, at \
             most {max} are read for a slot of {} tokens (raise --ctx-size)",
            text.len(),
            info.slot_ctx
        )));
    }
    let (tokens, images) = blocking(move || vision.tokenize(&text, &images))
        .await?
        .map_err(|e| match e {
            VisionError::InvalidImage(m) => ApiError::InvalidImage(m),
            VisionError::InvalidPrompt(m) => ApiError::InvalidRequest(m),
        })?;
    Ok((tokens, images))
}

/// Compiles the request's grammar (if any, and not compiled yet) against the vocabulary, on
/// the blocking pool: the engine thread receives a ready matcher.
pub async fn compile_grammar(
    info: &ModelInfo,
    params: &mut SamplingParams,
) -> Result<(), ApiError> {
    let Some(mut grammar) = params.grammar.take() else {
        return Ok(());
    };
    if grammar.compiled.is_none() {
        let compiler = info.constraints.clone();
        grammar = blocking(move || compiler.compile_into(&mut grammar).map(|()| grammar))
            .await?
            .map_err(ApiError::InvalidRequest)?;
    }
    params.grammar = Some(grammar);
    Ok(())
}

/// Validates a whole generation request: parameters, grammar (compiled against the
/// vocabulary), and the prompt's tokens (with its images' positions) fitted into a slot; an
/// image the cut would split goes whole.
pub async fn generation(
    info: &Arc<ModelInfo>,
    limits: &Limits,
    prompt: String,
    images: Vec<ImageInput>,
    mut params: SamplingParams,
) -> Result<Generation, ApiError> {
    check_for_model(&mut params, info, limits)?;
    compile_grammar(info, &mut params).await?;
    let (mut tokens, mut images) = if images.is_empty() {
        (tokenize(info, prompt, "prompt").await?, Vec::new())
    } else {
        tokenize_with_images(info, prompt, images).await?
    };
    let truncated = fit_prompt(&mut tokens, &params, info)?;
    if truncated {
        // Images the cut dropped (whole) are not sent.
        images.retain(|im| tokens.contains(&im.token(0)));
    }
    Ok(Generation {
        tokens,
        params,
        truncated,
        images,
    })
}

/// Validates a request whose prompt the handler tokenized (`requests/infill.rs`): its options,
/// grammar, and the prompt against the slot, as `generation` does for text.
pub async fn generation_tokens(
    info: &Arc<ModelInfo>,
    limits: &Limits,
    mut tokens: Vec<Token>,
    mut params: SamplingParams,
) -> Result<Generation, ApiError> {
    check_for_model(&mut params, info, limits)?;
    compile_grammar(info, &mut params).await?;
    // The ids may be a client's (llama-server's `prompt` of token ids): a bad one is its error.
    if tokens.is_empty() {
        return Err(ApiError::invalid("the prompt must not be empty"));
    }
    let n_vocab = i32::try_from(info.n_vocab).unwrap_or(i32::MAX);
    if let Some((i, id)) = tokens
        .iter()
        .enumerate()
        .find(|(_, t)| !(0..n_vocab).contains(*t))
    {
        return Err(ApiError::field(
            "prompt",
            format!(" token {i}: {id} is not in the vocabulary (0..{n_vocab})"),
        ));
    }
    let truncated = fit_prompt(&mut tokens, &params, info)?;
    Ok(Generation {
        tokens,
        params,
        truncated,
        images: Vec::new(),
    })
}

/// Validates one embedding input: its tokens, fitted into the embedding context (cut when
/// `truncate`, else a `context_length_exceeded`). Returns the tokens and whether they were cut.
pub async fn embedding_input(
    info: &Arc<ModelInfo>,
    text: String,
    truncate: bool,
) -> Result<(Vec<Token>, bool), ApiError> {
    if text.is_empty() {
        return Err(ApiError::invalid("an input to embed must not be empty"));
    }
    let mut tokens = tokenize(info, text, "input").await?;
    let cut = kv::fit_input(&mut tokens, truncate, info.embed_ctx)?;
    Ok((tokens, cut))
}

#[cfg(test)]
mod tests;
