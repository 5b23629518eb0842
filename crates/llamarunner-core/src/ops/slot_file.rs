//! Slot files (`POST /slots/{id}?action=save|restore`): which names a client may give, and the
//! file format. Pure: the handlers in `slots.rs` do the I/O.
//!
//! A slot file wraps llama.cpp's sequence state (`Backend::seq_state`) with what is needed to
//! refuse a file before llama.cpp's deserializer sees it: llama.cpp checks layer counts, types
//! and row sizes, but allocates by the cell count it reads before checking it, so a corrupt
//! file (a flipped bit, a truncated copy) could make it allocate without bound. Here a file is
//! read whole, its SHA-256 checked, its model fingerprint compared with the served model's,
//! its token count bounded by the slot and its tokens by the vocabulary; only then does its
//! state reach llama.cpp.
//!
//! Layout (integers little-endian):
//!
//! ```text
//! magic        8 bytes  "LLRSLOT\0"
//! version      u32      1
//! fingerprint  32 bytes SHA-256 of the model's identity (`model_identity`), and of the LoRA
//!                       scales the cache was computed under (`ModelIdentity::with_lora`)
//! desc_len     u16      then desc_len bytes: the model, in words (for error messages)
//! n_tokens     u32      then n_tokens × i32: the slot's cached tokens, by position
//! state_len    u64      then state_len bytes: llama.cpp's sequence state
//! checksum     32 bytes SHA-256 of every byte before it
//! ```

use sha2::{Digest, Sha256};

use crate::protocol::{ModelInfo, Token};

/// Longest slot file name, in bytes.
pub const MAX_FILE_NAME: usize = 128;

const MAGIC: &[u8; 8] = b"LLRSLOT\0";
const VERSION: u32 = 1;
const CHECKSUM_LEN: usize = 32;
/// Longest model description kept in a file.
const MAX_DESCRIPTION: usize = 1024;
/// Bytes of state a slot file may hold per slot token, per layer and per embedding
/// dimension: keys and values of f32 (16), twice over for models whose attention heads are
/// wider than the embedding and for sliding-window caches kept beside the full one.
const STATE_BYTES_PER_TOKEN_LAYER_DIM: u64 = 32;
/// Room for the state's own headers.
const STATE_SLACK: u64 = 16 << 20;

/// Checks a slot file name from a request: a plain file name inside the slot directory, never
/// a path. Allowed: ASCII letters, digits, `.`, `_` and `-`, at most `MAX_FILE_NAME` bytes, not
/// starting with a dot (hidden files, and the temporary files saves write) and without `..`.
pub fn check_file_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("filename must not be empty".into());
    }
    if name.len() > MAX_FILE_NAME {
        return Err(format!(
            "filename must have at most {MAX_FILE_NAME} bytes, got {}",
            name.len()
        ));
    }
    if name.contains(['/', '\\']) {
        return Err("filename must be a file name, not a path (no / or \\)".into());
    }
    if name.contains('\0') {
        return Err("filename must not contain NUL".into());
    }
    if name.contains("..") {
        return Err("filename must not contain ..".into());
    }
    if name.starts_with('.') {
        return Err("filename must not start with a dot".into());
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err("filename may hold only ASCII letters, digits, '.', '_' and '-'".into());
    }
    Ok(())
}

/// What a slot file says about the model it was saved from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    /// SHA-256 of the properties that must match for a state to mean anything.
    pub fingerprint: [u8; 32],
    /// The model, in words.
    pub description: String,
}

/// Bytes at the end of the model file hashed into its identity (weights: two fine-tunes of one
/// base model share every shape and often every metadata value).
const WEIGHTS_SAMPLE: u64 = 64 * 1024;

/// The served model's identity: its architecture, size, quantization, vocabulary, width,
/// depth, file size, GGUF metadata and the last `WEIGHTS_SAMPLE` bytes of its file (not its
/// file name: a renamed file is the same model). Reads the file: call it off the async
/// threads.
pub fn model_identity(info: &ModelInfo) -> ModelIdentity {
    let mut hash = Sha256::new();
    hash.update(
        format!(
            "arch={};params={};quant={};vocab={};embd={};layers={};bytes={}\n",
            info.architecture,
            info.n_params,
            info.quantization,
            info.n_vocab,
            info.n_embd,
            info.n_layer,
            info.file_size
        )
        .as_bytes(),
    );
    for (key, value) in &info.metadata {
        hash.update(format!("{key}={value}\n").as_bytes());
    }
    // A file that cannot be read now (moved since it was loaded) gives another identity: its
    // slot files are refused rather than trusted.
    hash.update(weights_sample(&info.path).unwrap_or_default());
    let file = info
        .path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    ModelIdentity {
        fingerprint: hash.finalize().into(),
        description: format!(
            "{file} ({}, {}, {} parameters)",
            info.architecture, info.quantization, info.n_params
        ),
    }
}

impl ModelIdentity {
    /// The identity of the model with these LoRA scales applied: a cache computed under other
    /// scales means nothing to it (the base model, every adapter off, is the model's own).
    pub fn with_lora(self, lora: &crate::protocol::LoraScales, n_adapters: usize) -> Self {
        if lora.is_base() {
            return self;
        }
        let scales = lora.to_vec(n_adapters);
        let mut hash = Sha256::new();
        hash.update(self.fingerprint);
        for s in &scales {
            hash.update(s.to_le_bytes());
        }
        let shown: Vec<String> = scales.iter().map(|s| s.to_string()).collect();
        Self {
            fingerprint: hash.finalize().into(),
            description: format!(
                "{} with LoRA scales [{}]",
                self.description,
                shown.join(", ")
            ),
        }
    }
}

/// The last `WEIGHTS_SAMPLE` bytes of a file.
fn weights_sample(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(WEIGHTS_SAMPLE)))?;
    let mut out = Vec::new();
    f.take(WEIGHTS_SAMPLE).read_to_end(&mut out)?;
    Ok(out)
}

/// Most bytes a slot file of this model and slot size may have.
pub fn max_file_bytes(info: &ModelInfo) -> u64 {
    let slot = u64::try_from(info.slot_ctx).unwrap_or(u64::MAX);
    let per_token = u64::from(info.n_layer.max(1))
        .saturating_mul(u64::from(info.n_embd.max(1)))
        .saturating_mul(STATE_BYTES_PER_TOKEN_LAYER_DIM);
    let tokens = slot.saturating_mul(4);
    per_token
        .saturating_mul(slot)
        .saturating_add(tokens)
        .saturating_add(STATE_SLACK)
}

/// Writes a slot file to `out`; returns the bytes written.
pub fn write(
    out: &mut impl std::io::Write,
    model: &ModelIdentity,
    tokens: &[Token],
    state: &[u8],
) -> std::io::Result<u64> {
    let mut w = Hashed {
        out,
        hash: Sha256::new(),
        written: 0,
    };
    let description = crate::http::text::truncated(&model.description, MAX_DESCRIPTION);
    let too_big = |what| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
    w.put(MAGIC)?;
    w.put(&VERSION.to_le_bytes())?;
    w.put(&model.fingerprint)?;
    let desc_len = u16::try_from(description.len()).map_err(|_| too_big("description"))?;
    w.put(&desc_len.to_le_bytes())?;
    w.put(description.as_bytes())?;
    let n = u32::try_from(tokens.len()).map_err(|_| too_big("too many tokens"))?;
    w.put(&n.to_le_bytes())?;
    let token_bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    w.put(&token_bytes)?;
    let state_len = u64::try_from(state.len()).map_err(|_| too_big("state"))?;
    w.put(&state_len.to_le_bytes())?;
    w.put(state)?;
    let checksum: [u8; CHECKSUM_LEN] = w.hash.finalize().into();
    w.out.write_all(&checksum)?;
    Ok(w.written + CHECKSUM_LEN as u64)
}

/// A writer that hashes what it writes.
struct Hashed<'a, W: std::io::Write> {
    out: &'a mut W,
    hash: Sha256,
    written: u64,
}

impl<W: std::io::Write> Hashed<'_, W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.out.write_all(bytes)?;
        self.hash.update(bytes);
        self.written += bytes.len() as u64;
        Ok(())
    }
}

/// Why a slot file was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SlotFileError {
    /// Not a slot file at all.
    #[error("not a llamarunner slot file")]
    NotASlotFile,
    /// A slot file of another format version.
    #[error("slot file format version {0}; this server reads version {VERSION}")]
    Version(u32),
    /// Shorter than its headers say, or longer.
    #[error("the slot file is truncated or has trailing bytes")]
    Truncated,
    /// Its bytes are not those that were written.
    #[error("the slot file is corrupt (its checksum does not match)")]
    Checksum,
    /// Saved from another model.
    #[error("the slot file was saved from another model ({saved}); this server serves {serving}")]
    WrongModel {
        /// The model it was saved from.
        saved: String,
        /// The model served.
        serving: String,
    },
    /// More tokens than a slot holds.
    #[error("the slot file holds {tokens} tokens, a slot of this server holds {capacity}")]
    TooManyTokens {
        /// Tokens in the file.
        tokens: usize,
        /// What a slot holds.
        capacity: usize,
    },
    /// A token outside the vocabulary.
    #[error("the slot file holds token {0}, which is not in this model's vocabulary")]
    BadToken(Token),
    /// Larger than any state of this model's slots.
    #[error("the slot file has {size} bytes, more than a slot's state can ({max})")]
    TooLarge {
        /// Its size.
        size: u64,
        /// The most a slot file may have here.
        max: u64,
    },
}

/// A slot file read and checked.
#[derive(Debug, PartialEq, Eq)]
pub struct SlotFile {
    /// The cached tokens, by position.
    pub tokens: Vec<Token>,
    /// llama.cpp's sequence state.
    pub state: Vec<u8>,
}

/// Reads a slot file, checking it against the served model: checksum, fingerprint, at most
/// `capacity` tokens, each inside `0..n_vocab`. Takes the file's bytes to reuse their buffer
/// for the state.
pub fn read(
    mut bytes: Vec<u8>,
    model: &ModelIdentity,
    capacity: usize,
    n_vocab: u32,
) -> Result<SlotFile, SlotFileError> {
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err(SlotFileError::NotASlotFile);
    }
    let mut r = Reader {
        bytes: &bytes,
        at: MAGIC.len(),
    };
    let version = u32::from_le_bytes(r.array()?);
    if version != VERSION {
        return Err(SlotFileError::Version(version));
    }
    let body_len = bytes
        .len()
        .checked_sub(CHECKSUM_LEN)
        .ok_or(SlotFileError::Truncated)?;
    let checksum: [u8; CHECKSUM_LEN] = Sha256::digest(&bytes[..body_len]).into();
    if checksum[..] != bytes[body_len..] {
        return Err(SlotFileError::Checksum);
    }
    let fingerprint: [u8; 32] = r.array()?;
    let desc_len = usize::from(u16::from_le_bytes(r.array()?));
    let saved = String::from_utf8_lossy(r.take(desc_len)?).into_owned();
    if fingerprint != model.fingerprint {
        return Err(SlotFileError::WrongModel {
            saved,
            serving: model.description.clone(),
        });
    }
    let n = usize::try_from(u32::from_le_bytes(r.array()?)).unwrap_or(usize::MAX);
    if n > capacity {
        return Err(SlotFileError::TooManyTokens {
            tokens: n,
            capacity,
        });
    }
    let tokens: Vec<Token> = r
        .take(n.checked_mul(4).ok_or(SlotFileError::Truncated)?)?
        .chunks_exact(4)
        .map(|b| Token::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let vocab = i32::try_from(n_vocab).unwrap_or(i32::MAX);
    if let Some(&bad) = tokens.iter().find(|t| !(0..vocab).contains(*t)) {
        return Err(SlotFileError::BadToken(bad));
    }
    let state_len =
        usize::try_from(u64::from_le_bytes(r.array()?)).map_err(|_| SlotFileError::Truncated)?;
    let start = r.at;
    if start.checked_add(state_len) != Some(body_len) {
        return Err(SlotFileError::Truncated);
    }
    bytes.truncate(body_len);
    bytes.drain(..start);
    Ok(SlotFile {
        tokens,
        state: bytes,
    })
}

/// Reads fields in order, refusing to read past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], SlotFileError> {
        let end = self.at.checked_add(n).ok_or(SlotFileError::Truncated)?;
        let out = self
            .bytes
            .get(self.at..end)
            .ok_or(SlotFileError::Truncated)?;
        self.at = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], SlotFileError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_file_names_are_refused() {
        for name in [
            "",
            "/etc/passwd",
            "../x.bin",
            "a/b.bin",
            "a\\b.bin",
            "..",
            ".",
            "a..b",
            ".hidden",
            ".x.bin.tmp",
            "x\0.bin",
            "spaces are.bin",
            "new\nline.bin",
            "caf\u{e9}.bin",
            "C:x.bin",
            "%2e%2e",
            &"x".repeat(MAX_FILE_NAME + 1),
        ] {
            assert!(check_file_name(name).is_err(), "{name:?} was accepted");
        }
        for name in [
            "slot0.bin",
            "system-prompt_v2.bin",
            "a.b.c",
            "X",
            &"x".repeat(MAX_FILE_NAME),
        ] {
            assert_eq!(check_file_name(name), Ok(()), "{name:?}");
        }
    }

    fn identity() -> ModelIdentity {
        model_identity(&crate::backend::fake::model_info(64))
    }

    #[test]
    fn lora_scales_are_part_of_the_identity() {
        use crate::protocol::LoraScales;
        let base = identity();
        let off = identity().with_lora(&LoraScales::new(vec![0.0, 0.0]), 2);
        assert_eq!(
            off.fingerprint, base.fingerprint,
            "every adapter off is the base model"
        );
        let a = identity().with_lora(&LoraScales::new(vec![1.5]), 2);
        let b = identity().with_lora(&LoraScales::new(vec![0.0, 1.5]), 2);
        let a_again = identity().with_lora(&LoraScales::new(vec![1.5, 0.0]), 2);
        assert_ne!(a.fingerprint, base.fingerprint);
        assert_ne!(a.fingerprint, b.fingerprint);
        assert_eq!(a.fingerprint, a_again.fingerprint);
        assert!(
            a.description.ends_with("with LoRA scales [1.5, 0]"),
            "{}",
            a.description
        );
        // A file saved under one set is refused where the defaults are another.
        let bytes = {
            let mut out = Vec::new();
            write(&mut out, &a, &[1, 2, 3], b"state").expect("write");
            out
        };
        assert!(matches!(
            read(bytes.clone(), &b, 64, 64),
            Err(SlotFileError::WrongModel { .. })
        ));
        assert!(read(bytes, &a_again, 64, 64).is_ok());
    }

    fn file(tokens: &[Token], state: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let n = write(&mut out, &identity(), tokens, state).unwrap();
        assert_eq!(n, out.len() as u64);
        out
    }

    #[test]
    fn a_written_file_reads_back() {
        let bytes = file(&[257, 104, 105], b"state bytes");
        let got = read(bytes, &identity(), 64, 258).unwrap();
        assert_eq!(got.tokens, [257, 104, 105]);
        assert_eq!(got.state, b"state bytes");
        let empty = read(file(&[], b""), &identity(), 64, 258).unwrap();
        assert!(empty.tokens.is_empty() && empty.state.is_empty());
    }

    #[test]
    fn corrupt_foreign_and_oversized_files_are_refused() {
        let good = file(&[1, 2, 3], b"state");
        let id = identity();
        let read_as = |bytes: Vec<u8>| read(bytes, &id, 64, 258);
        assert_eq!(
            read_as(b"garbage".to_vec()),
            Err(SlotFileError::NotASlotFile)
        );
        assert_eq!(read_as(Vec::new()), Err(SlotFileError::NotASlotFile));
        // Every single flipped bit past the magic and version is caught.
        for i in 12..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x10;
            assert!(read_as(bad).is_err(), "a flip at byte {i} went unnoticed");
        }
        for cut in 0..good.len() {
            assert!(read_as(good[..cut].to_vec()).is_err(), "cut at {cut}");
        }
        let mut longer = good.clone();
        longer.push(0);
        assert!(read_as(longer).is_err());
        let mut v2 = good.clone();
        v2[8] = 2;
        assert_eq!(read_as(v2), Err(SlotFileError::Version(2)));

        let other = ModelIdentity {
            fingerprint: [7; 32],
            description: "other.gguf".into(),
        };
        let mut foreign = Vec::new();
        write(&mut foreign, &other, &[1], b"s").unwrap();
        let err = read_as(foreign).unwrap_err();
        assert!(
            matches!(&err, SlotFileError::WrongModel { saved, .. } if saved == "other.gguf"),
            "{err}"
        );

        let many: Vec<Token> = vec![5; 65];
        assert_eq!(
            read_as(file(&many, b"")),
            Err(SlotFileError::TooManyTokens {
                tokens: 65,
                capacity: 64
            })
        );
        assert_eq!(
            read_as(file(&[258], b"")),
            Err(SlotFileError::BadToken(258))
        );
        assert_eq!(read_as(file(&[-1], b"")), Err(SlotFileError::BadToken(-1)));
    }

    #[test]
    fn the_identity_follows_the_metadata_and_the_weights_not_the_name() {
        let base = crate::backend::fake::model_info(64);
        let mut renamed = crate::backend::fake::model_info(64);
        renamed.path = "elsewhere/renamed.gguf".into();
        assert_eq!(
            model_identity(&base).fingerprint,
            model_identity(&renamed).fingerprint
        );
        let mut tuned = crate::backend::fake::model_info(64);
        tuned.metadata = vec![("general.name".into(), "a fine-tune".into())];
        assert_ne!(
            model_identity(&base).fingerprint,
            model_identity(&tuned).fingerprint
        );
        let dir = std::env::temp_dir();
        let (a, b) = (
            dir.join(format!("llamarunner-id-a-{}.gguf", std::process::id())),
            dir.join(format!("llamarunner-id-b-{}.gguf", std::process::id())),
        );
        std::fs::write(&a, [1u8; 100]).unwrap();
        std::fs::write(&b, [2u8; 100]).unwrap();
        let (mut one, mut two) = (
            crate::backend::fake::model_info(64),
            crate::backend::fake::model_info(64),
        );
        one.path = a.clone();
        two.path = b.clone();
        assert_ne!(
            model_identity(&one).fingerprint,
            model_identity(&two).fingerprint
        );
        std::fs::remove_file(a).unwrap();
        std::fs::remove_file(b).unwrap();
    }

    #[test]
    fn the_size_cap_allows_a_full_slot() {
        let info = crate::backend::fake::model_info(64);
        // The fake's state: 4 bytes a token.
        let full = file(&vec![1; 64], &vec![0; 64 * 4]);
        assert!((full.len() as u64) < max_file_bytes(&info));
        assert!(max_file_bytes(&info) < 64 << 20);
    }
}
