//! Images sent with a request, decoded to RGB8 for the vision projector.
//!
//! Pure functions, CPU-bound: the dialects call them on tokio's blocking pool
//! (`requests::validate::blocking`) before a request is queued, so the engine thread only ever
//! sees pixels. Every failure is an [`ImageError`], which the dialects answer with a 400 of type
//! `invalid_image`.
//!
//! What is accepted:
//! - formats: PNG, JPEG, WebP and GIF (its first frame), recognised by their content (magic
//!   bytes), not by a declared media type. Anything else (BMP, TIFF, AVIF, SVG, ...) is refused
//!   with an error naming the format, when it is one the `image` crate recognises.
//! - pixels: grayscale, alpha, 16-bit and palette images become RGB8. Alpha is dropped, not
//!   composited over a background, as llama.cpp's own loader (stb_image asked for 3 channels)
//!   does, so the same file gives the projector the same pixels here and there.
//! - [`decode_image_url`] (OpenAI `image_url.url`): `data:` URLs only, with a base64 payload and
//!   an image media type (`image/png`, `image/jpeg`, `image/jpg`, `image/webp`, `image/gif`;
//!   the declared type need not match the content, clients often get it wrong). An `http(s):`
//!   or any other URL is refused: the server never fetches anything over the network.
//! - [`decode_base64_image`] (Ollama `images`, native `image_data`): plain base64; a `data:` URL
//!   is accepted too (some clients send one where base64 is expected).
//! - base64 (both functions): the standard alphabet, padding optional, ASCII whitespace and line
//!   breaks ignored (what `base64` and PEM-style wrappers emit).
//!
//! Limits: at most [`MAX_IMAGE_BYTES`] encoded bytes (checked on the base64 text's length,
//! before anything is decoded) and [`MAX_IMAGE_PIXELS`] pixels, checked on the dimensions the
//! file's header declares, before the pixel buffer is allocated: a small file claiming a huge
//! image (a decompression bomb) costs nothing. A request carries at most
//! [`MAX_IMAGES_PER_REQUEST`] images (the dialects count them).

use std::io::Cursor;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
use base64::engine::DecodePaddingMode;
use base64::{alphabet, Engine};
use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits};
use sha2::{Digest, Sha256};

/// Images one request may carry, all messages together.
pub const MAX_IMAGES_PER_REQUEST: usize = 16;

/// The largest encoded image (the file's bytes, not its base64 text): 20 MiB.
pub const MAX_IMAGE_BYTES: usize = 20 * 1024 * 1024;

/// The most pixels (width × height) an image may declare: 4096 × 4096. The projector resizes
/// every image to its own small input size, so more pixels only cost memory and time.
pub const MAX_IMAGE_PIXELS: u64 = 4096 * 4096;
/// Most one side of an image may be longer than the other (as Qwen's and OpenAI's limits): the
/// projectors' preprocessors scale an image to their size keeping its shape, and some assert
/// that no side rounds to zero pixels (llama.cpp aborts the process there: a 4096x1 image sent
/// to a DeepSeek-OCR projector would).
pub const MAX_ASPECT_RATIO: u64 = 200;

/// What the decoder itself may allocate at once: a 16-bit RGBA buffer of the largest image
/// allowed (8 bytes a pixel), so the limit is the pixel count, not this.
const MAX_DECODER_ALLOC: u64 = MAX_IMAGE_PIXELS * 8;

/// The media types a `data:` URL may declare.
const IMAGE_MEDIA_TYPES: [&str; 5] = [
    "image/png",
    "image/jpeg",
    "image/jpg",
    "image/webp",
    "image/gif",
];

/// Standard alphabet, padding optional, non-zero trailing bits tolerated.
const BASE64: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new()
        .with_decode_padding_mode(DecodePaddingMode::Indifferent)
        .with_decode_allow_trailing_bits(true),
);

/// One decoded image, ready for the projector: the engine's type (`protocol/vision.rs`), since
/// the engine must not depend on `requests/`.
pub use crate::protocol::ImageInput;

/// Why an image was refused. Every variant is the client's fault (a 400 `invalid_image`).
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{}", remote_url_message(.scheme))]
    RemoteUrl { scheme: String },
    #[error("malformed data: URL: {0}")]
    MalformedDataUrl(&'static str),
    #[error("data: URL media type {media_type:?} is not an image type this server decodes (image/png, image/jpeg, image/webp, image/gif)")]
    MediaType { media_type: String },
    #[error("image data is not valid base64: {0}")]
    Base64(#[from] base64::DecodeError),
    #[error("image data is empty")]
    Empty,
    #[error("image is {bytes} bytes, more than the limit of {MAX_IMAGE_BYTES} bytes")]
    TooLarge { bytes: usize },
    #[error("image data is not a PNG, JPEG, WebP or GIF image")]
    UnknownFormat,
    #[error("{format} images are not supported: send PNG, JPEG, WebP or GIF")]
    UnsupportedFormat { format: String },
    #[error("image is {width}x{height} pixels, more than the limit of {MAX_IMAGE_PIXELS} pixels")]
    TooManyPixels { width: u32, height: u32 },
    #[error("image is {width}x{height} pixels: it has no pixels")]
    ZeroSize { width: u32, height: u32 },
    #[error(
        "image is {width}x{height} pixels: one side may be at most {MAX_ASPECT_RATIO} times the other"
    )]
    AspectRatio { width: u32, height: u32 },
    #[error("{format} image could not be decoded: {source}")]
    Decode {
        format: &'static str,
        source: image::ImageError,
    },
    /// A decoder bug (it panicked on this input); caught so one bad file cannot take a
    /// blocking-pool thread and its request down with a 500.
    #[error("{format} image could not be decoded (the decoder failed on it)")]
    DecoderPanicked { format: &'static str },
}

fn remote_url_message(scheme: &str) -> String {
    let what = if scheme.is_empty() {
        "image URL is not a data: URL".to_string()
    } else {
        format!("{scheme}: image URLs are not supported")
    };
    format!(
        "{what}: the server does not fetch images over the network; send the image inline as a \
         data: URL (data:image/png;base64,...)"
    )
}

/// Decodes an OpenAI `image_url.url`: a `data:` URL with a base64 image; any other URL is
/// [`ImageError::RemoteUrl`].
pub fn decode_image_url(url: &str) -> Result<ImageInput, ImageError> {
    let url = url.trim();
    match strip_prefix_ignore_case(url, "data:") {
        Some(rest) => decode_data_url(rest),
        None => Err(ImageError::RemoteUrl {
            scheme: url_scheme(url),
        }),
    }
}

/// Decodes base64 image data (Ollama's `images`, the native API's `data`); a `data:` URL is
/// accepted as well.
pub fn decode_base64_image(b64: &str) -> Result<ImageInput, ImageError> {
    let b64 = b64.trim();
    match strip_prefix_ignore_case(b64, "data:") {
        Some(rest) => decode_data_url(rest),
        None => decode_bytes(&decode_base64(b64)?),
    }
}

fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

/// The URL's scheme, lowercased and at most 32 characters, or "" when it has none (so an error
/// message never echoes a long URL).
fn url_scheme(url: &str) -> String {
    let Some((scheme, _)) = url.split_once(':') else {
        return String::new();
    };
    let valid = scheme
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    if valid {
        scheme
            .chars()
            .take(32)
            .collect::<String>()
            .to_ascii_lowercase()
    } else {
        String::new()
    }
}

/// `rest`: what follows "data:", i.e. `<media type>[;param]*;base64,<payload>`.
fn decode_data_url(rest: &str) -> Result<ImageInput, ImageError> {
    let (meta, payload) = rest
        .split_once(',')
        .ok_or(ImageError::MalformedDataUrl("no ',' before the data"))?;
    let mut params = meta.split(';');
    let media_type = params.next().unwrap_or("").trim().to_ascii_lowercase();
    let is_base64 = params.any(|p| p.trim().eq_ignore_ascii_case("base64"));
    if !IMAGE_MEDIA_TYPES.contains(&media_type.as_str()) {
        return Err(ImageError::MediaType {
            media_type: media_type.chars().take(64).collect(),
        });
    }
    if !is_base64 {
        return Err(ImageError::MalformedDataUrl(
            "the data must be base64 (data:image/png;base64,...)",
        ));
    }
    decode_bytes(&decode_base64(payload)?)
}

/// Base64 to bytes, refusing an over-long text before decoding (or copying) any of it.
fn decode_base64(text: &str) -> Result<Vec<u8>, ImageError> {
    let is_space = |b: &u8| matches!(b, b' ' | b'\t' | b'\r' | b'\n');
    let symbols = text.bytes().filter(|b| !is_space(b)).count();
    // 4 symbols carry 3 bytes; this over-counts padding, by 2 bytes at most.
    let bytes = symbols / 4 * 3 + (symbols % 4 * 3).div_ceil(4);
    if bytes > MAX_IMAGE_BYTES + 2 {
        return Err(ImageError::TooLarge { bytes });
    }
    if symbols == text.len() {
        Ok(BASE64.decode(text)?)
    } else {
        let compact: Vec<u8> = text.bytes().filter(|b| !is_space(b)).collect();
        Ok(BASE64.decode(compact)?)
    }
}

/// Decodes an encoded image file (PNG, JPEG, WebP, GIF) to RGB8.
fn decode_bytes(bytes: &[u8]) -> Result<ImageInput, ImageError> {
    if bytes.is_empty() {
        return Err(ImageError::Empty);
    }
    if bytes.len() > MAX_IMAGE_BYTES {
        return Err(ImageError::TooLarge { bytes: bytes.len() });
    }
    let format = image::guess_format(bytes).map_err(|_| ImageError::UnknownFormat)?;
    let name = match format {
        ImageFormat::Png => "PNG",
        ImageFormat::Jpeg => "JPEG",
        ImageFormat::WebP => "WebP",
        ImageFormat::Gif => "GIF",
        other => {
            return Err(ImageError::UnsupportedFormat {
                format: other
                    .extensions_str()
                    .first()
                    .map_or_else(|| format!("{other:?}"), |e| e.to_ascii_uppercase()),
            })
        }
    };
    match catch_unwind(AssertUnwindSafe(|| decode_known(bytes, format, name))) {
        Ok(result) => result,
        Err(_) => Err(ImageError::DecoderPanicked { format: name }),
    }
}

fn decode_known(
    bytes: &[u8],
    format: ImageFormat,
    name: &'static str,
) -> Result<ImageInput, ImageError> {
    let decode_error = |source| ImageError::Decode {
        format: name,
        source,
    };
    let mut limits = Limits::default();
    limits.max_alloc = Some(MAX_DECODER_ALLOC);
    let mut reader = ImageReader::with_format(Cursor::new(bytes), format);
    reader.limits(limits);
    // The decoder has read the header only: check what it declares before any pixel buffer.
    let decoder = reader.into_decoder().map_err(decode_error)?;
    let (width, height) = decoder.dimensions();
    check_dimensions(width, height)?;
    let rgb = DynamicImage::from_decoder(decoder)
        .map_err(decode_error)?
        .into_rgb8();
    let (width, height) = rgb.dimensions();
    check_dimensions(width, height)?;
    let rgb: Arc<[u8]> = rgb.into_raw().into();
    let hash = pixel_hash(width, height, &rgb);
    Ok(ImageInput {
        width,
        height,
        rgb,
        hash,
    })
}

fn check_dimensions(width: u32, height: u32) -> Result<(), ImageError> {
    if width == 0 || height == 0 {
        return Err(ImageError::ZeroSize { width, height });
    }
    if u64::from(width) * u64::from(height) > MAX_IMAGE_PIXELS {
        return Err(ImageError::TooManyPixels { width, height });
    }
    let (long, short) = (width.max(height), width.min(height));
    if u64::from(long) > u64::from(short) * MAX_ASPECT_RATIO {
        return Err(ImageError::AspectRatio { width, height });
    }
    Ok(())
}

fn pixel_hash(width: u32, height: u32, rgb: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(width.to_le_bytes());
    h.update(height.to_le_bytes());
    h.update(rgb);
    h.finalize().into()
}

#[cfg(test)]
mod tests;
