//! Fill-in-the-middle prompts (`POST /infill`, and `/v1/completions` with a `suffix`): the code
//! before and after the cursor, marked by the model's FIM tokens, with other files of the
//! project (`input_extra`) as context before them, in the order llama-server builds them
//! (prefix-suffix-middle):
//!
//! ```text
//! [<repo>"myproject\n"] (<file_sep>"NAME\n" TEXT)* [<file_sep>"filename\n"]
//! [BOS] <fim_pre> PREFIX PROMPT <fim_suf> SUFFIX <fim_mid>
//! ```
//!
//! Without a file separator token the extra files are joined by a "--- snippet ---" line.
//! The parts are tokenized apart, as text (a `<|fim_middle|>` written in a file stays text);
//! only `prompt` has its special tokens parsed, as llama-server does.
//!
//! When the parts do not fit the slot (less the tokens to generate), the extra context gets at
//! most half the room, its end (the files nearest the prefix) kept, and that share does not
//! move while the code around the cursor fills the other half, so that the cached prompt
//! survives typing; the prefix keeps its end (the code nearest the cursor) and the suffix its
//! start, 3:1. Text beyond what a slot can hold is cut (oldest extra files first, then the
//! prefix's start and the suffix's end) before it is tokenized: only a `prompt` too long on its
//! own is refused.

use std::sync::Arc;

use serde::Deserialize;

use crate::http::error::ApiError;
use crate::protocol::model::FimTokens;
use crate::protocol::{ModelInfo, Token};
use crate::requests::validate::{blocking, max_text_bytes};

/// Most `input_extra` files one request may give.
pub const MAX_EXTRA_FILES: usize = 256;

/// One file of `input_extra`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(default)]
pub struct ExtraFile {
    /// Its name ("tmp" when absent, as llama-server).
    pub filename: Option<String>,
    /// Its text.
    pub text: String,
}

/// The parts of a fill-in-the-middle request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parts {
    /// The code before the cursor.
    pub prefix: String,
    /// The code after it.
    pub suffix: String,
    /// Text after the prefix (llama-server's `prompt`: what is typed on the cursor's line).
    pub prompt: String,
    /// Other files, as context.
    pub extra: Vec<ExtraFile>,
}

/// The tokens of each part, tokenized apart.
#[derive(Clone, Debug, Default, PartialEq)]
struct Tokenized {
    prefix: Vec<Token>,
    suffix: Vec<Token>,
    prompt: Vec<Token>,
    extra: Vec<Token>,
}

/// The model's FIM tokens, or the 400 of a model without them.
pub fn fim_of(info: &ModelInfo) -> Result<FimTokens, ApiError> {
    info.fim.ok_or_else(|| {
        ApiError::invalid(
            "this model has no fill-in-the-middle tokens (fim_pre, fim_suf, fim_mid): infill \
             and completions with a suffix need a code model trained for it",
        )
    })
}

/// Tokens a prompt of `slot_ctx` cells leaves for generating: `num_predict` when it is set
/// (at most half the slot), else a quarter of the slot.
fn generation_room(slot_ctx: usize, num_predict: i64) -> usize {
    match usize::try_from(num_predict) {
        Ok(n) if n > 0 => n.min(slot_ctx / 2),
        _ => slot_ctx / 4,
    }
}

/// The prompt's tokens, fitted to the slot (see the module's text).
pub async fn tokens(
    info: &Arc<ModelInfo>,
    parts: Parts,
    num_predict: i64,
) -> Result<Vec<Token>, ApiError> {
    let fim = fim_of(info)?;
    if parts.extra.len() > MAX_EXTRA_FILES {
        return Err(ApiError::field(
            "input_extra",
            format!(
                ": at most {MAX_EXTRA_FILES} files, got {}",
                parts.extra.len()
            ),
        ));
    }
    let parts = fit_bytes(parts, max_text_bytes(info), info.slot_ctx)?;
    let model = info.text.clone();
    let tokenized = blocking(move || tokenize_parts(model.as_ref(), &fim, &parts))
        .await?
        .map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
    let room = info
        .slot_ctx
        .saturating_sub(generation_room(info.slot_ctx, num_predict));
    assemble(&fim, info.bos, tokenized, room)
}

/// Bytes of text of all the parts.
fn text_bytes(parts: &Parts) -> usize {
    parts.prefix.len()
        + parts.suffix.len()
        + parts.prompt.len()
        + parts
            .extra
            .iter()
            .map(|f| f.text.len() + f.filename.as_ref().map_or(0, String::len))
            .sum::<usize>()
}

/// The parts cut to at most `max` bytes of text (more than a slot of `slot_ctx` tokens can
/// hold): the oldest extra files out first, then the prefix's start and the suffix's end,
/// 3:1; a 400 only for a `prompt` over `max` on its own.
fn fit_bytes(mut parts: Parts, max: usize, slot_ctx: usize) -> Result<Parts, ApiError> {
    if parts.prompt.len() > max {
        return Err(ApiError::ContextLength(format!(
            "the input length exceeds the context length: the infill prompt has {} bytes of \
             text, at most {max} are read for a slot of {slot_ctx} tokens (raise --ctx-size)",
            parts.prompt.len()
        )));
    }
    // At most MAX_EXTRA_FILES files: this loop is short.
    while text_bytes(&parts) > max && !parts.extra.is_empty() {
        parts.extra.remove(0);
    }
    let budget = max.saturating_sub(text_bytes(&Parts {
        prompt: parts.prompt.clone(),
        extra: parts.extra.clone(),
        ..Parts::default()
    }));
    if parts.prefix.len() + parts.suffix.len() > budget {
        let (prefix_take, suffix_take) = share(parts.prefix.len(), parts.suffix.len(), budget);
        let mut start = parts.prefix.len() - prefix_take;
        while !parts.prefix.is_char_boundary(start) {
            start += 1;
        }
        parts.prefix.drain(..start);
        let mut end = suffix_take;
        while !parts.suffix.is_char_boundary(end) {
            end -= 1;
        }
        parts.suffix.truncate(end);
    }
    Ok(parts)
}

/// How much of a (kept from its end) and b (from its start) fit in `free`: b gets a quarter,
/// a the rest, and what one does not use goes to the other.
fn share(a: usize, b: usize, free: usize) -> (usize, usize) {
    let a_take = a.min(free - b.min(free / 4));
    (a_take, b.min(free - a_take))
}

/// Tokenizes each part without BOS, the extra files with their separators.
fn tokenize_parts(
    model: &dyn crate::protocol::TextModel,
    fim: &FimTokens,
    parts: &Parts,
) -> Result<Tokenized, crate::protocol::BackendError> {
    let plain = |text: &str| model.tokenize_literal(text);
    let mut extra = Vec::new();
    if let Some(rep) = fim.rep {
        extra.push(rep);
        extra.extend(plain("myproject\n")?);
    }
    for file in &parts.extra {
        let name = file.filename.as_deref().unwrap_or("tmp");
        match fim.sep {
            Some(sep) => {
                extra.push(sep);
                extra.extend(plain(&format!("{name}\n"))?);
            }
            None => extra.extend(plain("\n\n--- snippet ---\n\n")?),
        }
        extra.extend(plain(&file.text)?);
    }
    if let Some(sep) = fim.sep {
        extra.push(sep);
        extra.extend(plain("filename\n")?);
    }
    Ok(Tokenized {
        prefix: plain(&parts.prefix)?,
        suffix: plain(&parts.suffix)?,
        prompt: model.tokenize_with(&parts.prompt, false)?,
        extra,
    })
}

/// Lays the parts out in `room` tokens: 400 when even the markers and the prompt do not fit.
fn assemble(
    fim: &FimTokens,
    bos: Option<Token>,
    mut t: Tokenized,
    room: usize,
) -> Result<Vec<Token>, ApiError> {
    let fixed = 3 + usize::from(bos.is_some()) + t.prompt.len();
    let Some(free) = room.checked_sub(fixed).filter(|&f| f > 0) else {
        return Err(ApiError::ContextLength(format!(
            "the input length exceeds the context length: the infill prompt and its markers \
             take {fixed} tokens, and a slot of {room} tokens (after the room kept for \
             generating) leaves none for the code around the cursor"
        )));
    };
    // The extra context's share stays put while the code around the cursor fills half the
    // room; prefix and suffix share the rest 3:1.
    let cursor = (t.prefix.len() + t.suffix.len()).min(free / 2);
    let extra_take = t.extra.len().min(free - cursor);
    let (prefix_take, suffix_take) = share(t.prefix.len(), t.suffix.len(), free - extra_take);
    t.prefix.drain(..t.prefix.len() - prefix_take);
    t.suffix.truncate(suffix_take);
    let extra = &t.extra[t.extra.len() - extra_take..];
    let mut out = Vec::with_capacity(fixed + prefix_take + suffix_take + extra_take);
    out.extend_from_slice(extra);
    out.extend(bos);
    out.push(fim.pre);
    out.extend(t.prefix);
    out.extend(t.prompt);
    out.push(fim.suf);
    out.extend(t.suffix);
    out.push(fim.mid);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIM: FimTokens = FimTokens {
        pre: 900,
        suf: 901,
        mid: 902,
        rep: None,
        sep: None,
    };

    fn parts(prefix: usize, suffix: usize, prompt: usize, extra: usize) -> Tokenized {
        Tokenized {
            prefix: (0..prefix as i32).map(|i| 100 + i).collect(),
            suffix: (0..suffix as i32).map(|i| 300 + i).collect(),
            prompt: (0..prompt as i32).map(|i| 500 + i).collect(),
            extra: (0..extra as i32).map(|i| 700 + i).collect(),
        }
    }

    #[test]
    fn the_parts_are_laid_out_prefix_suffix_middle() {
        let out = assemble(&FIM, Some(1), parts(2, 2, 1, 2), 100).unwrap();
        assert_eq!(out, [700, 701, 1, 900, 100, 101, 500, 901, 300, 301, 902]);
        let out = assemble(&FIM, None, parts(1, 0, 0, 0), 100).unwrap();
        assert_eq!(out, [900, 100, 901, 902]);
    }

    #[test]
    fn a_long_prefix_keeps_its_end_and_a_long_suffix_its_start() {
        // 40 tokens of room: 3 markers, 37 free; no extra context: the suffix's share is 9.
        let out = assemble(&FIM, None, parts(100, 100, 0, 0), 40).unwrap();
        assert_eq!(out.len(), 40);
        assert_eq!(out[0], 900);
        assert_eq!(out[1], 100 + 100 - 28, "the prefix's last 28 tokens");
        let suf = out.iter().position(|&t| t == 901).unwrap();
        assert_eq!(
            &out[suf + 1..suf + 3],
            [300, 301],
            "the suffix's first tokens"
        );
        assert_eq!(out.len() - suf - 2, 9);
    }

    #[test]
    fn the_extra_context_keeps_half_the_room_whatever_the_cursor_code() {
        // 37 free: the code around the cursor fills 18, the extra context's end the other 19,
        // for every prefix long enough; a short prefix and suffix leave the extra more.
        let count = |out: &[Token], r: std::ops::Range<i32>| {
            out.iter().filter(|&&t| r.contains(&t)).count()
        };
        for prefix in [18, 50, 100, 200] {
            let out = assemble(&FIM, None, parts(prefix, 100, 0, 50), 40).unwrap();
            assert_eq!(out.len(), 40);
            assert_eq!(&out[..19], (731..750).collect::<Vec<_>>(), "{prefix}");
            assert_eq!(count(&out, 100..300), 14, "{prefix}");
            assert_eq!(count(&out, 300..400), 4, "{prefix}");
        }
        let out = assemble(&FIM, None, parts(5, 5, 0, 50), 40).unwrap();
        assert_eq!(out.len(), 40);
        assert_eq!(out[0], 700 + 50 - 27, "the extra context's last 27 tokens");
    }

    #[test]
    fn room_one_part_leaves_goes_to_the_other() {
        let out = assemble(&FIM, None, parts(100, 2, 0, 0), 40).unwrap();
        assert_eq!(out.iter().filter(|&&t| (300..400).contains(&t)).count(), 2);
        assert_eq!(out.iter().filter(|&&t| (100..200).contains(&t)).count(), 35);
    }

    #[test]
    fn text_beyond_a_slot_is_cut_before_tokenizing() {
        let file = |name: &str, n: usize| ExtraFile {
            filename: Some(name.into()),
            text: "x".repeat(n),
        };
        let parts = Parts {
            prefix: "é".repeat(300),
            suffix: "s".repeat(300),
            prompt: "p".repeat(10),
            extra: vec![file("old", 500), file("new", 100)],
        };
        // The old file goes, and the rest fits.
        let fit = fit_bytes(parts.clone(), 1100, 64).unwrap();
        assert_eq!(fit.extra.len(), 1);
        assert_eq!(fit.extra[0].filename.as_deref(), Some("new"));
        assert_eq!((fit.prefix.len(), fit.suffix.len()), (600, 300));
        // With less room both files go; then the prefix keeps its end and the suffix its
        // start, whole characters (é is 2 bytes).
        let fit = fit_bytes(parts.clone(), 800, 64).unwrap();
        assert!(fit.extra.is_empty());
        assert!(text_bytes(&fit) <= 800, "{}", text_bytes(&fit));
        assert!(fit.prefix.chars().all(|c| c == 'é') && fit.prefix.len() > 500);
        assert!(fit.suffix.starts_with('s') && fit.suffix.len() < 300);
        assert_eq!(fit.prompt, parts.prompt);
        // What fits is left alone.
        assert_eq!(fit_bytes(parts.clone(), 10_000, 64).unwrap(), parts);
        // A prompt too long on its own is refused.
        let e = fit_bytes(parts, 9, 64).unwrap_err();
        assert_eq!(e.kind(), "context_length_exceeded");
    }

    #[test]
    fn a_prompt_that_leaves_no_room_is_refused() {
        for room in [0, 3, 13] {
            let e = assemble(&FIM, Some(1), parts(1, 1, 10, 0), room).unwrap_err();
            assert_eq!(e.kind(), "context_length_exceeded", "{room}");
        }
        assert!(assemble(&FIM, Some(1), parts(1, 1, 10, 0), 15).is_ok());
    }

    #[test]
    fn generation_keeps_its_room() {
        assert_eq!(generation_room(1024, -1), 256);
        assert_eq!(generation_room(1024, 0), 256);
        assert_eq!(generation_room(1024, 100), 100);
        assert_eq!(generation_room(1024, 1 << 40), 512);
    }

    #[test]
    fn a_model_without_fim_tokens_is_a_400() {
        let info = crate::backend::fake::model_info(64);
        assert_eq!(fim_of(&info).unwrap_err().kind(), "invalid_request");
    }
}
