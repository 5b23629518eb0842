//! The vocabulary: tokenizing, token pieces, the chat template, and the `TextModel` the HTTP
//! side tokenizes with off the engine thread.

use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::token_type::LlamaTokenAttr;

use crate::backend::Text;
use crate::chat::{self, ChatTemplate, Vocabulary};
use crate::config::RunnerConfig;
use crate::protocol::{BackendError, TextModel, Token};

use super::LlamaEngine;

/// Tokenizes with special tokens parsed; `add_special` adds BOS (and EOS) when the model
/// wants them, as every prompt is tokenized.
///
/// The vocabulary's `tokenize` takes any bytes; a text it cannot be given as a C string (a NUL
/// in it) or of more bytes than a C int counts is refused here, with the messages the
/// C-string and integer conversions give (as llama-cpp-2 refused them before 0.1.160).
pub(super) fn tokenize(
    model: &LlamaModel,
    text: &str,
    add_special: bool,
) -> Result<Vec<Token>, BackendError> {
    tokenize_parsing(model, text, add_special, true)
}

/// `tokenize`, with special tokens written in the text parsed or left as text.
pub(super) fn tokenize_parsing(
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

/// The model's vocabulary for the HTTP side: tokenizing and grammar checks off the engine
/// thread (both only read the vocabulary).
pub(super) struct LlamaText(pub(super) std::sync::Arc<LlamaModel>);

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
pub(super) fn chat_template(
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

/// The bytes a token renders to (`special`: control tokens as their text), up to the first NUL
/// byte; empty for a token with no text.
pub(super) fn piece_bytes(model: &LlamaModel, token: LlamaToken, special: bool) -> Vec<u8> {
    let mut piece = model.vocab().token_to_piece(token, special, None);
    truncate_at_nul(&mut piece);
    piece
}

/// Cuts a piece at its first NUL byte. llama-cpp-2 up to 0.1.154 read pieces back through a C
/// string, which ended them there (the byte token `<0x00>` rendered as nothing); 0.1.160 returns
/// the bytes llama.cpp wrote. Kept as before: generated text never holds a NUL, which a prompt
/// may not hold either (`tokenize`), so a conversation can always be sent back.
pub(super) fn truncate_at_nul(piece: &mut Vec<u8>) {
    if let Some(nul) = piece.iter().position(|&b| b == 0) {
        piece.truncate(nul);
    }
}

/// The bytes a generated token's text adds (control tokens add none), from any thread:
/// `Text::token_bytes` on the engine thread and the sampling pool's `Pick::give_text` both read
/// it here, so that a token's text is the same wherever it is assembled.
pub(super) fn text_bytes(model: &LlamaModel, token: Token) -> Vec<u8> {
    piece_bytes(model, LlamaToken(token), false)
}

/// Whether a token ends generation, from any thread (`Text::is_eog`, `Pick::give_text`).
pub(super) fn ends_generation(model: &LlamaModel, token: Token) -> bool {
    model.vocab().is_eog(LlamaToken(token))
}

/// Most bytes of BOS's or EOS's text the chat template is given.
pub(super) const SPECIAL_TEXT_MAX: usize = 64;

impl Text for LlamaEngine<'_> {
    fn tokenize(&self, text: &str) -> Result<Vec<Token>, BackendError> {
        tokenize(self.model, text, true)
    }

    fn token_bytes(&self, token: Token) -> Vec<u8> {
        text_bytes(self.model, token)
    }

    fn is_eog(&self, token: Token) -> bool {
        ends_generation(self.model, token)
    }

    fn bos(&self) -> Option<Token> {
        self.add_bos.then(|| self.model.vocab().bos().0)
    }
}
