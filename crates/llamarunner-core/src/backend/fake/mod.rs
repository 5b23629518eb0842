//! A deterministic stand-in for llama.cpp, for scheduler and HTTP tests.
//!
//! Tokens are bytes (0..=255), plus `EOS` and `BOS`. The "model" keeps a KV list per sequence
//! and checks every batch position against it, so a scheduler that decodes a token at the wrong
//! position fails loudly. The next token is a hash of the sequence's whole history: the output
//! depends only on that sequence, never on its neighbours in the batch.
//!
//! LoRA is modelled where it matters to the scheduler: a token decoded under a non-base scale
//! set is stored in the KV list with a mark of that set, so the next token depends on the set
//! every cached position was decoded under. A sequence decoded in a batch of another set, or
//! reusing a prefix cached under another set, answers differently than it does alone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::backend::{BatchToken, Decoder, Drafting, Embeddings, Fork, KvOps, Text};
use crate::protocol::vision::is_image_continuation;
use crate::protocol::{BackendError, LoraScales, ModelInfo, TextModel, Token};

mod sampling;
mod vision;
pub use sampling::FakeSampler;
pub use vision::FakeVision;

/// End of sequence.
pub const EOS: Token = 256;
/// Beginning of sequence.
pub const BOS: Token = 257;

/// Settings of the fake model.
#[derive(Clone, Debug)]
pub struct FakeConfig {
    /// Cells per slot.
    pub slot_ctx: usize,
    /// One cache of this many cells that the slots share (`--kv-unified`): a decode or a
    /// restored state that would hold more cells in all is a scheduler bug (it panics).
    pub shared_cells: Option<usize>,
    /// Tokens per decode.
    pub batch_capacity: usize,
    /// Emit EOS once a sequence's history reaches this many tokens.
    pub eos_at: Option<usize>,
    /// Sleep this long in every decode (to make cancellation observable in HTTP tests).
    pub decode_delay: std::time::Duration,
    /// Sleep this long more in `set_lora` when the scales change (as llama.cpp reserves its
    /// graph again in the next decode).
    pub lora_change_delay: std::time::Duration,
    /// Whether the cache supports shifting (recurrent models do not).
    pub can_shift: bool,
    /// Whether part of a sequence can be removed (recurrent models: only all of it).
    pub partial_remove: bool,
    /// Fail this decode call (1-based) with "no KV slot", as llama.cpp does when full.
    pub fail_decode: Option<usize>,
    /// Tokens of an embedding input decoded per step.
    pub embed_piece: usize,
    /// A sliding-window cache (as Gemma's window layers without `--swa-full`): it keeps the
    /// window cells of the last `2 * window` positions a sequence reached, and a cut (or fork)
    /// that leaves fewer than `window` of them before the cut fails, as the llama.cpp backend's
    /// does. A sequence whose window failed so is broken until it is cleared or rewound to a
    /// checkpoint (`rewind_to_checkpoint`): decoding into it panics (the real model would
    /// decode garbage silently).
    pub window: Option<usize>,
    /// The next token depends on the last `n` tokens of the history only (a Markov chain of
    /// order `n`), so that the output falls into loops that prompt-lookup drafts predict;
    /// None: on the whole history.
    pub markov: Option<usize>,
    /// A draft model (`--draft-model`): it predicts as a greedy request of the model would with
    /// this sampler offset (0: the model's greedy choice, so every draft is accepted; another
    /// value: a different model whose drafts are mostly rejected). None: no draft model.
    pub draft: Option<u64>,
    /// The draft model's confidence in every token it picks (`draft_pick`).
    pub draft_p: f32,
    /// Fail this draft decode call (1-based).
    pub fail_draft_decode: Option<usize>,
    /// Leave the text of every pick to the engine thread (`Pick::give_text` not called), as a
    /// backend without it does; by default the fake gives it, as the llama backend's pool does.
    pub text_on_engine: bool,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            slot_ctx: 256,
            shared_cells: None,
            batch_capacity: 32,
            eos_at: None,
            decode_delay: std::time::Duration::ZERO,
            lora_change_delay: std::time::Duration::ZERO,
            can_shift: true,
            partial_remove: true,
            fail_decode: None,
            embed_piece: 16,
            window: None,
            markov: None,
            draft: None,
            draft_p: 0.9,
            fail_draft_decode: None,
            text_on_engine: false,
        }
    }
}

/// The fake's tokenizer for the HTTP side (BOS, then one token per byte) and its vocabulary
/// (the 256 bytes, `EOS` and `BOS`).
#[derive(Debug, Default, Clone, Copy)]
pub struct FakeText;

impl TextModel for FakeText {
    fn tokenize_with(&self, text: &str, add_special: bool) -> Result<Vec<Token>, BackendError> {
        let mut out = Vec::with_capacity(text.len() + 1);
        if add_special {
            out.push(BOS);
        }
        out.extend(text.bytes().map(Token::from));
        Ok(out)
    }

    fn piece(&self, token: Token) -> Vec<u8> {
        match token {
            EOS => b"</s>".to_vec(),
            BOS => b"<s>".to_vec(),
            t => u8::try_from(t).map(|b| vec![b]).unwrap_or_default(),
        }
    }

    fn vocabulary(&self) -> crate::constrain::Vocabulary {
        let tokens = (0..=BOS)
            .map(|t| crate::constrain::VocabToken {
                bytes: self.piece(t),
                control: t >= EOS,
                eog: t == EOS,
            })
            .collect();
        crate::constrain::Vocabulary { tokens }
    }
}

/// The fake backend; `log` records every batch it decoded.
#[derive(Debug, Default)]
pub struct FakeBackend {
    config: FakeConfig,
    kv: HashMap<i32, Vec<Token>>,
    decodes: usize,
    /// (seq, position) of each batch index with logits, from the last decode.
    outputs: HashMap<usize, (i32, usize)>,
    /// Every decoded batch, in order.
    pub log: Arc<Mutex<Vec<Vec<BatchToken>>>>,
    /// Every fork (src, dst, len), in order.
    pub forks: Arc<Mutex<Vec<(i32, i32, usize)>>>,
    /// The size of every embedding piece decoded, in order.
    pub embed_log: Arc<Mutex<Vec<usize>>>,
    /// The embedding input decoded so far.
    embedding: Vec<Token>,
    /// The LoRA scale set applied (`set_lora`).
    lora: LoraScales,
    /// The scale set of every decoded batch, in order (parallel to `log`).
    pub lora_log: Arc<Mutex<Vec<LoraScales>>>,
    /// Every image decoded (seq, first position, positions), in order; `log` gets an empty
    /// batch at the same moment, so the two show what ran between which decodes.
    pub image_log: Arc<Mutex<Vec<(i32, usize, usize)>>>,
    /// The draft model's KV lists, by sequence.
    draft_kv: HashMap<i32, Vec<Token>>,
    /// (seq, position) of each batch index with logits, from the last draft decode.
    draft_outputs: HashMap<usize, (i32, usize)>,
    draft_decodes: usize,
    /// Every batch the draft model decoded, in order.
    pub draft_log: Arc<Mutex<Vec<Vec<BatchToken>>>>,
    /// Per sequence, the positions below which its window cells are gone (`window`).
    window_lost: HashMap<i32, usize>,
    /// Sequences whose window a cut or fork lost (`window`).
    broken: std::collections::HashSet<i32>,
    /// Sequences holding a cell no position range removes (a restored state's `STUCK_CELL`):
    /// only `kv_clear_all` empties them, as with llama.cpp.
    stuck: std::collections::HashSet<i32>,
}

/// In a state given to the fake (`set_seq_state`), a cell at a position llama.cpp's range
/// removals never reach (negative, or `i32::MAX`), as a corrupt slot file can hold.
pub const STUCK_CELL: Token = Token::MIN;

impl FakeBackend {
    /// The slots' cells are within the shared cache, when there is one: llama.cpp would have
    /// refused the decode (`NoKvSlot`), which the scheduler must never let happen.
    fn assert_within_shared_cells(&self) {
        if let Some(all) = self.config.shared_cells {
            let held = self.held_cells();
            assert!(
                held <= all,
                "the slots hold {held} cells of a shared cache of {all} (scheduler bug)"
            );
        }
    }

    /// The cells every sequence holds, together.
    fn held_cells(&self) -> usize {
        self.kv.values().map(Vec::len).sum()
    }

    /// A fake with the given settings.
    pub fn new(config: FakeConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// The token the fake produces after `history`, with a sampler offset.
    pub fn next_token(history: &[Token], offset: u64) -> Token {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ offset;
        for &t in history {
            h = (h ^ t as u64).wrapping_mul(0x100_0000_01b3);
        }
        // Printable ASCII only, so text assertions are readable.
        b'a' as Token + (h % 26) as Token
    }

    /// The mark a token decoded under `scales` carries in the fake's KV list (0 for the base
    /// model, so base histories are plain tokens): bits above the vocabulary.
    pub fn lora_mark(scales: &LoraScales) -> Token {
        if scales.is_base() {
            return 0;
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for i in 0..MARKED_ADAPTERS {
            h = (h ^ u64::from(scales.get(i).to_bits())).wrapping_mul(0x100_0000_01b3);
        }
        (1 + (h % 0x3fff) as Token) << 9
    }
}

/// Adapters whose scales the fake's mark tells apart.
const MARKED_ADAPTERS: usize = 8;

impl Decoder for FakeBackend {
    fn slot_ctx(&self) -> usize {
        self.config.slot_ctx
    }

    fn shared_cells(&self) -> Option<usize> {
        self.config.shared_cells
    }

    fn batch_capacity(&self) -> usize {
        self.config.batch_capacity
    }

    fn set_lora(&mut self, scales: &LoraScales) -> Result<(), BackendError> {
        if self.lora != *scales && !self.config.lora_change_delay.is_zero() {
            std::thread::sleep(self.config.lora_change_delay);
        }
        self.lora = scales.clone();
        Ok(())
    }

    fn decode(&mut self, batch: &[BatchToken]) -> Result<(), BackendError> {
        if batch.is_empty() {
            return Err(BackendError::Decode("empty batch".into()));
        }
        assert!(
            batch.len() <= self.config.batch_capacity,
            "a batch of {} tokens, the context takes {} (scheduler bug)",
            batch.len(),
            self.config.batch_capacity
        );
        self.decodes += 1;
        if self.config.fail_decode == Some(self.decodes) {
            return Err(BackendError::NoKvSlot);
        }
        if !self.config.decode_delay.is_zero() {
            std::thread::sleep(self.config.decode_delay);
        }
        self.outputs.clear();
        let mark = Self::lora_mark(&self.lora);
        for (i, t) in batch.iter().enumerate() {
            assert!(
                !self.broken.contains(&t.seq),
                "seq {} decoded after its window was lost (scheduler bug)",
                t.seq
            );
            assert!(
                !self.stuck.contains(&t.seq),
                "seq {} decoded while it holds a cell no range removes (scheduler bug)",
                t.seq
            );
            let kv = self.kv.entry(t.seq).or_default();
            let pos = t.pos as usize;
            assert_eq!(
                pos,
                kv.len(),
                "seq {} decoded at {pos} but holds {}",
                t.seq,
                kv.len()
            );
            assert!(
                pos < self.config.slot_ctx,
                "seq {} overflows its slot",
                t.seq
            );
            kv.push(t.token | mark);
            if let Some(w) = self.config.window {
                let lost = self.window_lost.entry(t.seq).or_default();
                *lost = (*lost).max((pos + 1).saturating_sub(2 * w));
            }
            if t.logits {
                self.outputs.insert(i, (t.seq, pos));
            }
        }
        self.assert_within_shared_cells();
        if let Ok(mut log) = self.log.lock() {
            log.push(batch.to_vec());
        }
        if let Ok(mut log) = self.lora_log.lock() {
            log.push(self.lora.clone());
        }
        Ok(())
    }

    /// An image's positions hold its synthetic ids (derived from its hash), so the next token
    /// depends on the image as on text.
    fn decode_image(
        &mut self,
        seq: i32,
        pos: usize,
        image: &crate::protocol::PromptImage,
        logits: bool,
    ) -> Result<(), BackendError> {
        self.decodes += 1;
        if self.config.fail_decode == Some(self.decodes) {
            return Err(BackendError::NoKvSlot);
        }
        if !self.config.decode_delay.is_zero() {
            std::thread::sleep(self.config.decode_delay);
        }
        let kv = self.kv.entry(seq).or_default();
        assert_eq!(
            pos,
            kv.len(),
            "image of seq {seq} decoded at {pos} but it holds {}",
            kv.len()
        );
        assert!(
            pos + image.n_tokens <= self.config.slot_ctx,
            "seq {seq} overflows its slot with an image"
        );
        assert!(
            image.n_tokens <= self.config.batch_capacity,
            "an image larger than a decode (the HTTP side refuses those)"
        );
        kv.extend(image.tokens());
        // Whatever was sampled from before is gone; the last position's logits with `logits`.
        self.outputs.clear();
        if logits {
            let last = image.n_tokens - 1;
            self.outputs.insert(last, (seq, pos + last));
        }
        self.assert_within_shared_cells();
        if let Ok(mut log) = self.image_log.lock() {
            log.push((seq, pos, image.n_tokens));
        }
        if let Ok(mut log) = self.log.lock() {
            log.push(Vec::new());
        }
        if let Ok(mut log) = self.lora_log.lock() {
            log.push(self.lora.clone());
        }
        Ok(())
    }

    fn describe(&self) -> Option<ModelInfo> {
        let mut info = model_info(self.slot_ctx());
        info.shared_cells = self.config.shared_cells;
        Some(info)
    }
}

impl Text for FakeBackend {
    fn tokenize(&self, text: &str) -> Result<Vec<Token>, BackendError> {
        FakeText.tokenize(text)
    }

    fn token_bytes(&self, token: Token) -> Vec<u8> {
        u8::try_from(token).map(|b| vec![b]).unwrap_or_default()
    }

    fn is_eog(&self, token: Token) -> bool {
        token == EOS
    }

    fn bos(&self) -> Option<Token> {
        Some(BOS)
    }
}

impl KvOps for FakeBackend {
    fn kv_can_cut(&self, seq: i32, from: usize) -> bool {
        let len = self.kv.get(&seq).map_or(0, Vec::len);
        let partial = from == 0 || from >= len || self.config.partial_remove;
        let window = self.config.window.is_none_or(|w| {
            from == 0 || self.window_lost.get(&seq).copied().unwrap_or(0) <= from.saturating_sub(w)
        });
        partial && window
    }

    fn kv_truncate(&mut self, seq: i32, from: usize) -> bool {
        let kv = self.kv.entry(seq).or_default();
        assert!(
            !kv.get(from).is_some_and(|&t| is_image_continuation(t)),
            "seq {seq} cut at {from}, inside an image"
        );
        if from > 0 && from < kv.len() && !self.config.partial_remove {
            return false;
        }
        kv.truncate(from);
        self.window_check(seq, from)
    }

    fn kv_clear(&mut self, seq: i32) -> bool {
        self.kv_truncate(seq, 0) && !self.stuck.contains(&seq)
    }

    fn kv_clear_all(&mut self) {
        self.kv.clear();
        self.window_lost.clear();
        self.broken.clear();
        self.stuck.clear();
    }

    fn kv_shift(&mut self, seq: i32, keep: usize, discard: usize) -> bool {
        if !self.config.can_shift {
            return false;
        }
        let kv = self.kv.entry(seq).or_default();
        let end = (keep + discard).min(kv.len());
        for at in [keep, end] {
            assert!(
                !kv.get(at).is_some_and(|&t| is_image_continuation(t)),
                "seq {seq} shifted at {at}, inside an image"
            );
        }
        kv.drain(keep.min(end)..end);
        true
    }

    fn kv_fork(&mut self, src: i32, dst: i32, len: usize) -> Fork {
        assert!(
            !self
                .kv
                .get(&src)
                .and_then(|kv| kv.get(len))
                .is_some_and(|&t| is_image_continuation(t)),
            "seq {src} forked at {len}, inside an image"
        );
        let copied: Vec<Token> = self
            .kv
            .get(&src)
            .map(|kv| kv[..len.min(kv.len())].to_vec())
            .unwrap_or_default();
        if copied.len() != len {
            self.kv.remove(&dst);
            self.window_lost.remove(&dst);
            self.broken.remove(&dst);
            return Fork::Failed;
        }
        // As llama.cpp's state copy: the full-attention cells are all there, the window cells
        // only those of the source's last `window` positions; a checkpoint can put the window
        // before `len` back (`rewind_to_checkpoint`).
        let src_len = self.kv.get(&src).map_or(0, Vec::len);
        self.kv.insert(dst, copied);
        let lost = self.config.window.map_or(0, |w| src_len.saturating_sub(w));
        self.window_lost.insert(dst, lost);
        self.broken.remove(&dst);
        if !self.window_check(dst, len) {
            return Fork::WindowLost;
        }
        if let Ok(mut forks) = self.forks.lock() {
            forks.push((src, dst, len));
        }
        Fork::Copied
    }

    fn sliding_window(&self) -> Option<usize> {
        self.config.window
    }

    /// The fake's checkpoint: the positions it was taken at (4 bytes), then the last
    /// `2 * window` tokens before them, 4 bytes each: a rewind checks that the sequence holds
    /// those tokens there.
    fn window_checkpoint(&self, seq: i32) -> Result<Vec<u8>, BackendError> {
        let Some(w) = self.config.window else {
            return Err(BackendError::State(
                "the cache has no sliding window".into(),
            ));
        };
        if self.broken.contains(&seq) {
            return Err(BackendError::State(format!("seq {seq}'s window is lost")));
        }
        let kv = self.kv.get(&seq).map_or(&[][..], Vec::as_slice);
        let len = u32::try_from(kv.len()).map_err(|e| BackendError::State(e.to_string()))?;
        let tail = &kv[kv.len().saturating_sub(2 * w)..];
        Ok(len
            .to_le_bytes()
            .into_iter()
            .chain(tail.iter().flat_map(|t| t.to_le_bytes()))
            .collect())
    }

    fn rewind_to_checkpoint(&mut self, seq: i32, len: usize, state: &[u8]) -> bool {
        let Some(w) = self.config.window else {
            return false;
        };
        let words: Vec<u32> = state
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let Some((&at, tail)) = words.split_first() else {
            return false;
        };
        let kv = self.kv.entry(seq).or_default();
        let matches = at as usize == len
            && kv.len() >= len
            && kv[len.saturating_sub(2 * w)..len]
                .iter()
                .map(|&t| t as u32)
                .eq(tail.iter().copied());
        assert!(
            matches,
            "seq {seq} rewound to {len} with a checkpoint of other tokens (scheduler bug)"
        );
        kv.truncate(len);
        self.window_lost.insert(seq, len.saturating_sub(2 * w));
        self.broken.remove(&seq);
        true
    }

    /// The fake's state is its KV list, 4 little-endian bytes per token.
    fn seq_state(&self, seq: i32) -> Result<Vec<u8>, BackendError> {
        Ok(self
            .kv
            .get(&seq)
            .map(|kv| kv.iter().flat_map(|t| t.to_le_bytes()).collect())
            .unwrap_or_default())
    }

    fn set_seq_state(&mut self, seq: i32, state: &[u8]) -> Result<usize, BackendError> {
        // As llama.cpp does, the sequence is cleared before the state is read.
        self.kv.remove(&seq);
        self.broken.remove(&seq);
        self.window_lost.remove(&seq);
        if !state.len().is_multiple_of(4) {
            return Err(BackendError::State(format!(
                "the state has {} bytes, not a whole number of tokens",
                state.len()
            )));
        }
        let kv: Vec<Token> = state
            .chunks_exact(4)
            .map(|b| Token::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if kv.len() > self.config.slot_ctx {
            return Err(BackendError::State(format!(
                "the state holds {} cells, a slot {}",
                kv.len(),
                self.config.slot_ctx
            )));
        }
        if kv.contains(&STUCK_CELL) {
            self.stuck.insert(seq);
        }
        let n = kv.len();
        if let Some(all) = self.config.shared_cells {
            let others = self.held_cells();
            if others + n > all {
                return Err(BackendError::State(format!(
                    "no room for {n} cells in the shared cache ({others} of {all} held)"
                )));
            }
        }
        self.kv.insert(seq, kv);
        // A whole state holds the window cells that were there: those of its last positions.
        if let Some(w) = self.config.window {
            self.window_lost.insert(seq, n.saturating_sub(2 * w));
        }
        Ok(n)
    }
}

impl Drafting for FakeBackend {
    fn has_draft_model(&self) -> bool {
        self.config.draft.is_some()
    }

    fn draft_decode(&mut self, batch: &[BatchToken]) -> Result<(), BackendError> {
        assert!(
            self.config.draft.is_some(),
            "draft decode without a draft model"
        );
        assert!(
            !batch.is_empty() && batch.len() <= self.config.batch_capacity,
            "draft batch of {} tokens",
            batch.len()
        );
        self.draft_decodes += 1;
        if self.config.fail_draft_decode == Some(self.draft_decodes) {
            return Err(BackendError::NoKvSlot);
        }
        self.draft_outputs.clear();
        for (i, t) in batch.iter().enumerate() {
            let kv = self.draft_kv.entry(t.seq).or_default();
            let pos = t.pos as usize;
            assert_eq!(
                pos,
                kv.len(),
                "draft seq {} decoded at {pos} but holds {}",
                t.seq,
                kv.len()
            );
            assert!(
                pos < self.config.slot_ctx,
                "draft seq {} overflows its slot",
                t.seq
            );
            kv.push(t.token);
            if t.logits {
                self.draft_outputs.insert(i, (t.seq, pos));
            }
        }
        if let Ok(mut log) = self.draft_log.lock() {
            log.push(batch.to_vec());
        }
        Ok(())
    }

    fn draft_pick(&self, index: usize) -> Option<(Token, f32)> {
        let offset = self.config.draft?;
        let &(seq, pos) = self
            .draft_outputs
            .get(&index)
            .expect("picked a draft batch index without logits (scheduler bug)");
        let history = &self.draft_kv[&seq][..=pos];
        let context = match self.config.markov {
            Some(n) => &history[history.len().saturating_sub(n)..],
            None => history,
        };
        Some((Self::next_token(context, offset), self.config.draft_p))
    }

    fn draft_truncate(&mut self, seq: i32, from: usize) -> bool {
        self.draft_kv.entry(seq).or_default().truncate(from);
        true
    }
}

impl Embeddings for FakeBackend {
    fn embed_capacity(&self) -> usize {
        self.config.slot_ctx
    }

    fn embed_piece(&self) -> usize {
        self.config.embed_piece.max(1)
    }

    fn embed(
        &mut self,
        tokens: &[Token],
        start: usize,
        last: bool,
    ) -> Result<Option<Vec<f32>>, BackendError> {
        if start == 0 {
            self.embedding.clear();
        }
        assert_eq!(start, self.embedding.len(), "embedding pieces out of order");
        self.embedding.extend_from_slice(tokens);
        if let Ok(mut log) = self.embed_log.lock() {
            log.push(tokens.len());
        }
        if !last {
            return Ok(None);
        }
        // A mean-pooled one-hot-ish embedding over 8 dimensions: deterministic, input-only.
        let mut v = vec![0.0f32; 8];
        for &t in &self.embedding {
            v[(t as usize) % 8] += 1.0;
        }
        let n = self.embedding.len().max(1) as f32;
        Ok(Some(v.into_iter().map(|x| x / n).collect()))
    }
}

impl FakeBackend {
    /// Whether sequence `seq`, cut to `cut` positions, still has the window before the cut;
    /// marks it broken when not (and mends it when it is empty).
    fn window_check(&mut self, seq: i32, cut: usize) -> bool {
        let Some(w) = self.config.window else {
            return true;
        };
        if cut == 0 {
            self.window_lost.remove(&seq);
            self.broken.remove(&seq);
            return true;
        }
        let lost = self.window_lost.get(&seq).copied().unwrap_or(0);
        let intact = lost <= cut.saturating_sub(w);
        if !intact {
            self.broken.insert(seq);
        }
        intact
    }
}
/// A description of the fake model (it has no file), with a ChatML template and the fake's
/// byte tokenizer: what `FakeBackend::describe` publishes.
pub fn model_info(slot_ctx: usize) -> ModelInfo {
    let template = crate::chat::builtin("chatml")
        .and_then(|t| crate::chat::ChatTemplate::new("chatml", t, "", "").ok())
        .expect("the built-in ChatML template compiles");
    ModelInfo {
        path: "fake.gguf".into(),
        file_size: 0,
        modified: None,
        architecture: "fake".into(),
        n_params: 0,
        n_ctx_train: u32::try_from(slot_ctx).unwrap_or(u32::MAX),
        n_embd: 8,
        n_layer: 1,
        n_vocab: 258,
        slot_ctx,
        shared_cells: None,
        embed_ctx: slot_ctx,
        quantization: "F32".into(),
        metadata: Vec::new(),
        template: Arc::new(template),
        bos: Some(BOS),
        eos: Some(EOS),
        system_info: "fake backend".into(),
        text: Arc::new(FakeText),
        constraints: crate::protocol::model::compiler_for(
            &(Arc::new(FakeText) as Arc<dyn TextModel>),
        ),
        vision: None,
        fim: None,
        rerank: None,
        // One block and the output layer, on the CPU.
        devices: crate::protocol::devices::DeviceFacts::cpu_only(2),
        deterministic: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::vision::{is_image_start, ImageInput, VisionModel};

    #[test]
    fn the_fake_projector_places_images_at_their_markers() {
        let vision = FakeVision {
            positions: 4,
            max_positions: 32,
        };
        let image = |b: u8| ImageInput {
            width: 1,
            height: 1,
            rgb: Arc::from(vec![b; 3]),
            hash: [b; 32],
        };
        let (tokens, images) = vision
            .tokenize("a<__media__>b<__media__>", &[image(1), image(1)])
            .unwrap();
        assert_eq!(images.len(), 1, "the same image twice is one image");
        assert_eq!(tokens.len(), 1 + 1 + 4 + 1 + 4);
        assert!(is_image_start(tokens[2]) && is_image_start(tokens[7]));
        assert_eq!(tokens[2..6], tokens[7..11]);
        assert!(vision.tokenize("a<__media__>", &[]).is_err());
        let too_big = FakeVision {
            positions: 40,
            max_positions: 32,
        };
        assert!(too_big.tokenize("<__media__>", &[image(1)]).is_err());
    }
}
