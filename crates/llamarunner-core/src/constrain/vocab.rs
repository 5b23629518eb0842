//! The model's vocabulary as llguidance sees it: every token's bytes, control tokens behind
//! llguidance's special-token marker (0xFF, a byte no UTF-8 text has) so that no grammar
//! literal matches them, and the end-of-generation tokens, which the guide allows exactly when
//! the grammar is complete.

use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

/// One token of the vocabulary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VocabToken {
    /// The text it renders to (special tokens as their text, `<eos>`); may be part of a
    /// UTF-8 character.
    pub bytes: Vec<u8>,
    /// A control token (BOS, EOS, turn markers, ...): never matched by grammar text.
    pub control: bool,
    /// It ends generation.
    pub eog: bool,
}

/// A tokenizer's vocabulary, token id = index.
#[derive(Clone, Debug, Default)]
pub struct Vocabulary {
    /// Every token, by id.
    pub tokens: Vec<VocabToken>,
}

impl Vocabulary {
    /// The ids of the end-of-generation tokens.
    pub fn eog(&self) -> Vec<u32> {
        self.tokens
            .iter()
            .enumerate()
            .filter(|(_, t)| t.eog)
            .filter_map(|(i, _)| u32::try_from(i).ok())
            .collect()
    }

    /// llguidance's view: a token trie (tokenizing by greedy longest match, which llguidance
    /// needs only for text the server feeds it, never for sampling).
    pub fn tok_env(&self) -> Result<TokEnv, String> {
        let n = u32::try_from(self.tokens.len()).map_err(|_| "vocabulary too large")?;
        if n == 0 {
            return Err("the vocabulary is empty".into());
        }
        let eog = self.eog();
        // llguidance wants one EOS id; a vocabulary without one gets id 0 as a stand-in. The
        // guide decides about end-of-generation tokens itself, from `eog`, and sets or clears
        // their mask bits.
        let eos = eog.first().copied().unwrap_or(0);
        let words: Vec<Vec<u8>> = self
            .tokens
            .iter()
            .enumerate()
            .map(|(id, t)| {
                if t.control || t.eog {
                    let mut w = Vec::with_capacity(t.bytes.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    if t.bytes.is_empty() {
                        w.extend_from_slice(format!("<token-{id}>").as_bytes());
                    } else {
                        w.extend_from_slice(&t.bytes);
                    }
                    w
                } else {
                    t.bytes.clone()
                }
            })
            .collect();
        let trie = TokTrie::from(&TokRxInfo::new(n, eos), &words);
        let trie = if eog.len() > 1 {
            trie.with_eos_tokens(&eog)
        } else {
            trie
        };
        Ok(std::sync::Arc::new(ApproximateTokEnv::new(trie)))
    }
}
