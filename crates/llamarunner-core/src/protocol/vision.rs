//! Images through a vision projector (`--mmproj`), as the engine and the HTTP side share them.
//!
//! The HTTP side decodes each image to RGB (`requests/images.rs`), then the projector's
//! `VisionModel` tokenizes the prompt: text tokens, and for each image the positions it takes,
//! with the projector's preprocessed input (`ImageChunk`) the engine encodes later. An image
//! position is held in the token lists the scheduler and `kv/` work on (slot caches, prefix
//! matching, truncation, context shift) as a synthetic token id (`image_token`): negative, so
//! never a vocabulary id, derived from the image's hash and the position's index, with a mark on
//! the image's first position. Two prompts with the same image at the same place share those
//! ids, so the prefix cache reuses the image's KV cells as it does text; and every rule over
//! token lists can tell where an image starts and ends (`is_image_start`,
//! `is_image_continuation`) without looking anything up, so none cuts an image in half.

use std::any::Any;
use std::sync::Arc;

use crate::protocol::Token;

/// One decoded image, ready for the projector (made by `requests/images.rs`).
#[derive(Clone, PartialEq, Eq)]
pub struct ImageInput {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// `width * height * 3` bytes, RGB8, row by row.
    pub rgb: Arc<[u8]>,
    /// SHA-256 over `width` and `height` (little-endian u32) and `rgb`: equal pixels, equal
    /// hash, whatever file format or encoding they came in; the image's identity in the prefix
    /// cache.
    pub hash: [u8; 32],
}

impl std::fmt::Debug for ImageInput {
    // Never the pixels: a log line must stay a line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hash: String = self.hash[..8].iter().map(|b| format!("{b:02x}")).collect();
        f.debug_struct("ImageInput")
            .field("width", &self.width)
            .field("height", &self.height)
            .field("rgb_bytes", &self.rgb.len())
            .field("hash", &format_args!("{hash}…"))
            .finish()
    }
}

impl ImageInput {
    /// The 64 bits of the hash the image's position ids are derived from.
    pub fn key(&self) -> u64 {
        let mut head = [0u8; 8];
        head.copy_from_slice(&self.hash[..8]);
        u64::from_le_bytes(head)
    }
}

/// The projector's input for one image (preprocessed pixels), made by the `VisionModel` that
/// tokenized the prompt and encoded by the backend of the same projector; opaque to the
/// scheduler.
pub trait ImageChunk: Send + Sync + std::fmt::Debug {
    /// For the backend to find its own type.
    fn as_any(&self) -> &dyn Any;
}

/// An image in a tokenized prompt.
#[derive(Clone, Debug)]
pub struct PromptImage {
    /// From the image's hash (`ImageInput::key`).
    pub key: u64,
    /// Positions it takes in the sequence.
    pub n_tokens: usize,
    /// What the backend encodes.
    pub chunk: Arc<dyn ImageChunk>,
}

impl PromptImage {
    /// The synthetic id of its position `i`.
    pub fn token(&self, i: usize) -> Token {
        image_token(self.key, i)
    }

    /// The synthetic ids of all its positions, in order.
    pub fn tokens(&self) -> impl Iterator<Item = Token> + '_ {
        (0..self.n_tokens).map(|i| self.token(i))
    }
}

/// The mark of an image's first position.
const IMAGE_START: Token = 0x4000_0000;

/// The synthetic token id of position `i` of the image with key `key`: negative (never a
/// vocabulary id), marked when `i == 0`, its other 30 bits a mix of the key and `i`.
pub fn image_token(key: u64, i: usize) -> Token {
    let mut h = key
        ^ (i as u64)
            .wrapping_add(1)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    let low = (h & 0x3fff_ffff) as Token;
    let start = if i == 0 { IMAGE_START } else { 0 };
    Token::MIN | start | low
}

/// Whether a token stands for an image position.
pub fn is_image_token(t: Token) -> bool {
    t < 0
}

/// Whether a token is the first position of an image.
pub fn is_image_start(t: Token) -> bool {
    t < 0 && t & IMAGE_START != 0
}

/// Whether a token is an image position other than the first.
pub fn is_image_continuation(t: Token) -> bool {
    t < 0 && t & IMAGE_START == 0
}

/// Why a prompt with images could not be tokenized.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VisionError {
    /// An image the projector cannot take (a 400 `invalid_image`).
    #[error("{0}")]
    InvalidImage(String),
    /// The prompt around the images is unusable (a 400 `invalid_request`).
    #[error("{0}")]
    InvalidPrompt(String),
}

/// What the HTTP side may do with the projector off the engine thread: tokenize a prompt whose
/// images are marked in its text. Implementations are safe to call from several threads.
pub trait VisionModel: Send + Sync + std::fmt::Debug {
    /// The text that stands for one image in a prompt given to `tokenize`.
    fn marker(&self) -> &str;
    /// Tokenizes `text` (BOS added when the model wants it, specials parsed), whose markers
    /// stand for `images` in order (one marker per image): the tokens, image positions as
    /// `image_token` ids, and the images (each once). An image the projector cannot take, or
    /// one that needs more positions than one decode holds, is an error.
    fn tokenize(
        &self,
        text: &str,
        images: &[ImageInput],
    ) -> Result<(Vec<Token>, Vec<PromptImage>), VisionError>;
}

/// The marker llama.cpp's mtmd uses by default.
pub const DEFAULT_MARKER: &str = "<__media__>";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_tokens_are_negative_and_mark_the_first_position() {
        for key in [0u64, 1, u64::MAX, 0x5adb_61d3_1933_a946] {
            for i in 0..300 {
                let t = image_token(key, i);
                assert!(is_image_token(t), "{key} {i}");
                assert_eq!(is_image_start(t), i == 0, "{key} {i}");
                assert_eq!(is_image_continuation(t), i != 0, "{key} {i}");
            }
        }
        for t in [0, 1, 255, 262_143, i32::MAX] {
            assert!(!is_image_token(t));
            assert!(!is_image_start(t) && !is_image_continuation(t));
        }
        // Different images differ position by position.
        let a: Vec<Token> = (0..64).map(|i| image_token(1, i)).collect();
        let b: Vec<Token> = (0..64).map(|i| image_token(2, i)).collect();
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
    }
}
