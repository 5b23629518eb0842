//! The fake backend's projector (`FakeVision`): an image is a run of synthetic positions,
//! with nothing to encode.

use std::any::Any;
use std::sync::Arc;

use super::FakeText;
use crate::protocol::vision::{
    ImageChunk, ImageInput, PromptImage, VisionError, VisionModel, DEFAULT_MARKER,
};
use crate::protocol::{BackendError, TextModel, Token};

/// The fake backend's projector: each image takes `positions` positions; its text is tokenized
/// by `FakeText`.
#[derive(Clone, Copy, Debug)]
pub struct FakeVision {
    /// Positions per image.
    pub positions: usize,
    /// Most positions one image may take (the batch size).
    pub max_positions: usize,
}

/// The fake projector's chunk: nothing to encode (the fake's KV holds the synthetic ids).
#[derive(Debug)]
struct FakeChunk;

impl ImageChunk for FakeChunk {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl VisionModel for FakeVision {
    fn marker(&self) -> &str {
        DEFAULT_MARKER
    }

    fn tokenize(
        &self,
        text: &str,
        images: &[ImageInput],
    ) -> Result<(Vec<Token>, Vec<PromptImage>), VisionError> {
        let parts: Vec<&str> = text.split(DEFAULT_MARKER).collect();
        if parts.len() != images.len() + 1 {
            return Err(VisionError::InvalidImage(format!(
                "the prompt marks {} images but {} were given",
                parts.len() - 1,
                images.len()
            )));
        }
        if self.positions > self.max_positions {
            return Err(VisionError::InvalidImage(format!(
                "an image takes {} positions, one decode holds {} (raise --batch-size)",
                self.positions, self.max_positions
            )));
        }
        let mut tokens = Vec::new();
        let mut out: Vec<PromptImage> = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            tokens.extend(
                FakeText
                    .tokenize_with(part, i == 0)
                    .map_err(|e: BackendError| VisionError::InvalidPrompt(e.to_string()))?,
            );
            if let Some(image) = images.get(i) {
                let image = PromptImage {
                    key: image.key(),
                    n_tokens: self.positions,
                    chunk: Arc::new(FakeChunk),
                };
                tokens.extend(image.tokens());
                if !out.iter().any(|o| o.key == image.key) {
                    out.push(image);
                }
            }
        }
        Ok((tokens, out))
    }
}
