//! Unit tests of image decoding. Test images are made here, with the `image` crate's encoders
//! or, where an encoder cannot make them (palette PNGs, lying headers), byte by byte.

use std::io::Cursor;

use base64::engine::general_purpose::STANDARD;
use image::codecs::gif::GifEncoder;
use image::{Delay, Frame, ImageBuffer, Luma, Rgb, RgbImage, Rgba, RgbaImage};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

// ---- making test images ----

/// A 7x5 image whose every pixel differs.
fn sample() -> RgbImage {
    ImageBuffer::from_fn(7, 5, |x, y| {
        Rgb([(x * 30) as u8, (y * 50) as u8, (x * y * 5) as u8])
    })
}

fn encode(img: impl Into<DynamicImage>, format: ImageFormat) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    img.into()
        .write_to(&mut out, format)
        .expect("encoding a test image");
    out.into_inner()
}

fn b64(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

/// An animated GIF: a red frame, then a blue one.
fn two_frame_gif(width: u32, height: u32) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut enc = GifEncoder::new(&mut out);
        for colour in [[255, 0, 0, 255], [0, 0, 255, 255]] {
            let frame = Frame::from_parts(
                RgbaImage::from_pixel(width, height, Rgba(colour)),
                0,
                0,
                Delay::from_numer_denom_ms(100, 1),
            );
            enc.encode_frame(frame).expect("encoding a GIF frame");
        }
    }
    out
}

/// One small valid file of each format the server takes.
fn valid_files() -> Vec<(&'static str, Vec<u8>)> {
    let img = ImageBuffer::from_fn(16, 12, |x, y| Rgb([(x * 16) as u8, (y * 20) as u8, 99]));
    vec![
        ("png", encode(img.clone(), ImageFormat::Png)),
        ("jpeg", encode(img.clone(), ImageFormat::Jpeg)),
        ("webp", encode(img, ImageFormat::WebP)),
        ("gif", two_frame_gif(16, 12)),
    ]
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

fn png_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// A zlib stream of stored (uncompressed) deflate blocks.
fn zlib_stored(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = if data.is_empty() {
        vec![&[]]
    } else {
        data.chunks(65535).collect()
    };
    for (i, block) in blocks.iter().enumerate() {
        out.push(u8::from(i + 1 == blocks.len()));
        let len = block.len() as u16;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(block);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &byte in data {
        a = (a + u32::from(byte)) % 65521;
        b = (b + a) % 65521;
    }
    out.extend_from_slice(&((b << 16) | a).to_be_bytes());
    out
}

/// A PNG written byte by byte: `rows` are the filtered scanlines (each starting with its
/// filter byte), whatever the header says.
fn png_by_hand(
    width: u32,
    height: u32,
    depth: u8,
    colour: u8,
    plte: &[u8],
    rows: &[u8],
) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&width.to_be_bytes());
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[depth, colour, 0, 0, 0]);
    png_chunk(&mut out, b"IHDR", &ihdr);
    if !plte.is_empty() {
        png_chunk(&mut out, b"PLTE", plte);
    }
    png_chunk(&mut out, b"IDAT", &zlib_stored(rows));
    png_chunk(&mut out, b"IEND", &[]);
    out
}

/// Offsets of a GIF's logical screen size (6) and of its first image descriptor's size.
fn gif_size_offsets(gif: &[u8]) -> (usize, usize) {
    let flags = gif[10];
    let mut at = 13
        + if flags & 0x80 != 0 {
            3 << ((flags & 7) + 1)
        } else {
            0
        };
    while gif[at] == 0x21 {
        at += 2; // extension introducer and label, then sub-blocks up to an empty one
        while gif[at] != 0 {
            at += usize::from(gif[at]) + 1;
        }
        at += 1;
    }
    assert_eq!(gif[at], 0x2C, "image descriptor expected");
    (6, at + 5)
}

fn patch_gif_size(gif: &mut [u8], width: u16, height: u16) {
    let (screen, frame) = gif_size_offsets(gif);
    for at in [screen, frame] {
        gif[at..at + 2].copy_from_slice(&width.to_le_bytes());
        gif[at + 2..at + 4].copy_from_slice(&height.to_le_bytes());
    }
}

fn patch_jpeg_size(jpeg: &mut [u8], width: u16, height: u16) {
    let sof = jpeg
        .windows(2)
        .position(|w| w[0] == 0xFF && matches!(w[1], 0xC0..=0xC2))
        .expect("a SOF marker");
    // marker (2), length (2), precision (1), height (2), width (2); big-endian
    jpeg[sof + 5..sof + 7].copy_from_slice(&height.to_be_bytes());
    jpeg[sof + 7..sof + 9].copy_from_slice(&width.to_be_bytes());
}

/// A lossless WebP's VP8L header (14 bits each of width - 1 and height - 1) rewritten.
fn patch_webp_lossless_size(webp: &mut [u8], width: u32, height: u32) {
    assert_eq!(&webp[12..16], b"VP8L", "a simple lossless WebP");
    assert_eq!(webp[20], 0x2F);
    let bits = u32::from_le_bytes([webp[21], webp[22], webp[23], webp[24]]);
    let bits = (bits & !0x0FFF_FFFF) | (width - 1) | ((height - 1) << 14);
    webp[21..25].copy_from_slice(&bits.to_le_bytes());
}

/// A lossless WebP wrapped in the extended format (a VP8X chunk) declaring another canvas size
/// (24 bits each) than its image has.
fn webp_extended(lossless: &[u8], width: u32, height: u32) -> Vec<u8> {
    assert_eq!(&lossless[12..16], b"VP8L", "a simple lossless WebP");
    let mut body = b"WEBPVP8X".to_vec();
    body.extend_from_slice(&10u32.to_le_bytes());
    body.extend_from_slice(&[0; 4]); // flags, reserved
    body.extend_from_slice(&(width - 1).to_le_bytes()[..3]);
    body.extend_from_slice(&(height - 1).to_le_bytes()[..3]);
    body.extend_from_slice(&lossless[12..]);
    let mut out = b"RIFF".to_vec();
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

fn decoded(bytes: &[u8]) -> ImageInput {
    match decode_base64_image(&b64(bytes)) {
        Ok(img) => img,
        Err(e) => panic!("a valid image was refused: {e}"),
    }
}

fn refused(bytes: &[u8]) -> ImageError {
    match decode_base64_image(&b64(bytes)) {
        Ok(img) => panic!("expected an error, decoded {img:?}"),
        Err(e) => e,
    }
}

fn assert_close(a: &[u8], b: &[u8], tolerance: u8) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(x.abs_diff(*y) <= tolerance, "byte {i}: {x} vs {y}");
    }
}

// ---- formats and pixel conversions ----

#[test]
fn png_decodes_to_its_exact_pixels_and_hash() {
    let img = sample();
    let got = decoded(&encode(img.clone(), ImageFormat::Png));
    assert_eq!((got.width, got.height), (7, 5));
    assert_eq!(&*got.rgb, img.as_raw().as_slice());
    let mut h = Sha256::new();
    h.update(7u32.to_le_bytes());
    h.update(5u32.to_le_bytes());
    h.update(img.as_raw());
    assert_eq!(got.hash, <[u8; 32]>::from(h.finalize()));
}

#[test]
fn webp_lossless_decodes_exactly_and_hashes_like_the_same_png() {
    let img = sample();
    let webp = decoded(&encode(img.clone(), ImageFormat::WebP));
    let png = decoded(&encode(img.clone(), ImageFormat::Png));
    assert_eq!(&*webp.rgb, img.as_raw().as_slice());
    assert_eq!(
        webp.hash, png.hash,
        "equal pixels, equal hash, whatever the format"
    );
}

#[test]
fn jpeg_decodes_to_nearly_its_pixels() {
    let img = RgbImage::from_pixel(16, 16, Rgb([200, 40, 90]));
    let got = decoded(&encode(img.clone(), ImageFormat::Jpeg));
    assert_eq!((got.width, got.height), (16, 16));
    assert_close(&got.rgb, img.as_raw(), 8);
}

#[test]
fn grayscale_jpeg_becomes_rgb() {
    let img = ImageBuffer::from_pixel(8, 8, Luma([120u8]));
    let got = decoded(&encode(DynamicImage::ImageLuma8(img), ImageFormat::Jpeg));
    assert_eq!(got.rgb.len(), 8 * 8 * 3);
    assert_close(&got.rgb, &[120; 8 * 8 * 3], 3);
}

#[test]
fn gif_decodes_its_first_frame_only() {
    let got = decoded(&two_frame_gif(4, 3));
    assert_eq!((got.width, got.height), (4, 3));
    for px in got.rgb.chunks(3) {
        assert_eq!(px, [255, 0, 0], "the first (red) frame");
    }
}

#[test]
fn alpha_is_dropped_not_composited() {
    let img = RgbaImage::from_fn(3, 2, |x, _| Rgba([10 * x as u8, 20, 30, (x * 100) as u8]));
    let got = decoded(&encode(img, ImageFormat::Png));
    assert_eq!(
        &*got.rgb,
        [0, 20, 30, 10, 20, 30, 20, 20, 30].repeat(2).as_slice()
    );
}

#[test]
fn sixteen_bit_becomes_eight_bit() {
    let img: ImageBuffer<Rgb<u16>, Vec<u16>> = ImageBuffer::from_fn(2, 1, |x, _| {
        if x == 0 {
            Rgb([0xFFFF, 0, 0x8080])
        } else {
            Rgb([0; 3])
        }
    });
    let got = decoded(&encode(DynamicImage::ImageRgb16(img), ImageFormat::Png));
    assert_eq!(&*got.rgb, [255, 0, 128, 0, 0, 0]);
}

#[test]
fn grayscale_alpha_png_becomes_rgb() {
    let img = ImageBuffer::from_pixel(2, 2, image::LumaA([77u8, 3]));
    let got = decoded(&encode(DynamicImage::ImageLumaA8(img), ImageFormat::Png));
    assert_eq!(&*got.rgb, [77; 12]);
}

#[test]
fn palette_png_becomes_rgb() {
    // 2x2, palette [red, green], rows "0 1" and "1 0" (filter byte 0 first).
    let png = png_by_hand(2, 2, 8, 3, &[255, 0, 0, 0, 255, 0], &[0, 0, 1, 0, 1, 0]);
    let got = decoded(&png);
    assert_eq!(&*got.rgb, [255, 0, 0, 0, 255, 0, 0, 255, 0, 255, 0, 0]);
}

#[test]
fn debug_does_not_print_pixels() {
    let got = decoded(&encode(
        RgbImage::from_pixel(64, 64, Rgb([1, 2, 3])),
        ImageFormat::Png,
    ));
    let text = format!("{got:?}");
    assert!(
        text.contains("width: 64") && text.contains("rgb_bytes: 12288"),
        "{text}"
    );
    assert!(text.len() < 200, "{text}");
}

// ---- how the data arrives ----

#[test]
fn data_urls_are_accepted_in_both_functions() {
    let png = encode(sample(), ImageFormat::Png);
    let want = decoded(&png).hash;
    for url in [
        format!("data:image/png;base64,{}", b64(&png)),
        format!("DATA:IMAGE/PNG;BASE64,{}", b64(&png)),
        format!("  data:image/png;name=x.png;base64,{}\n", b64(&png)),
        // The declared type need not match the content.
        format!("data:image/jpeg;base64,{}", b64(&png)),
        format!("data:image/jpg;base64,{}", b64(&png)),
    ] {
        assert_eq!(decode_image_url(&url).expect(&url[..30]).hash, want);
        assert_eq!(decode_base64_image(&url).expect(&url[..30]).hash, want);
    }
}

#[test]
fn base64_whitespace_line_breaks_and_missing_padding_are_tolerated() {
    let png = encode(sample(), ImageFormat::Png);
    let want = decoded(&png).hash;
    let text = b64(&png);
    let wrapped: String = text
        .as_bytes()
        .chunks(76)
        .map(|line| format!("{}\r\n", std::str::from_utf8(line).unwrap_or_default()))
        .collect();
    assert_eq!(decode_base64_image(&wrapped).expect("wrapped").hash, want);
    let spaced = format!(" {} ", text.replace('A', " A\t"));
    assert_eq!(decode_base64_image(&spaced).expect("spaced").hash, want);
    let unpadded = text.trim_end_matches('=');
    assert_eq!(decode_base64_image(unpadded).expect("unpadded").hash, want);
}

#[test]
fn bad_base64_is_refused() {
    for text in ["@@@@", "not base64 at all!", "iVBORw0KGgo=AAAA", "A"] {
        let err = decode_base64_image(text).expect_err(text);
        assert!(matches!(err, ImageError::Base64(_)), "{text}: {err}");
        assert!(err.to_string().contains("base64"), "{err}");
    }
    let err = decode_image_url("data:image/png;base64,%%%").expect_err("bad payload");
    assert!(matches!(err, ImageError::Base64(_)), "{err}");
}

#[test]
fn empty_data_is_refused() {
    for text in [
        "",
        "   ",
        "\n",
        "data:image/png;base64,",
        "data:image/png;base64,  ",
    ] {
        let err = decode_base64_image(text).expect_err(text);
        assert!(matches!(err, ImageError::Empty), "{text:?}: {err}");
    }
}

#[test]
fn wrong_data_url_media_types_are_refused() {
    let data = b64(&encode(sample(), ImageFormat::Png));
    for media in [
        "text/plain",
        "",
        "application/octet-stream",
        "image/svg+xml",
        "image/bmp",
        "video/mp4",
    ] {
        let url = format!("data:{media};base64,{data}");
        let err = decode_image_url(&url).expect_err(media);
        assert!(
            matches!(err, ImageError::MediaType { .. }),
            "{media}: {err}"
        );
        assert!(err.to_string().contains("image/png"), "{err}");
    }
}

#[test]
fn malformed_data_urls_are_refused() {
    let data = b64(&encode(sample(), ImageFormat::Png));
    for url in [
        format!("data:image/png,{data}"),       // not base64
        format!("data:image/png;base64{data}"), // no comma
        "data:".to_string(),
    ] {
        let err = decode_image_url(&url).expect_err(&url[..12.min(url.len())]);
        assert!(
            matches!(
                err,
                ImageError::MalformedDataUrl(_) | ImageError::MediaType { .. }
            ),
            "{err}"
        );
    }
    let err = decode_image_url(&format!("data:image/png,{data}")).expect_err("not base64");
    assert!(err.to_string().contains("base64"), "{err}");
}

#[test]
fn remote_and_other_urls_are_refused_without_fetching() {
    for (url, scheme) in [
        ("http://example.com/cat.png", "http"),
        ("https://example.com/cat.png", "https"),
        ("HTTPS://EXAMPLE.COM/CAT.PNG", "https"),
        ("file:///etc/passwd", "file"),
        ("ftp://example.com/x.gif", "ftp"),
        ("iVBORw0KGgoAAAANSUhEUg", ""), // bare base64 is not a URL
        ("", ""),
    ] {
        match decode_image_url(url) {
            Err(err @ ImageError::RemoteUrl { .. }) => {
                let ImageError::RemoteUrl { scheme: got } = &err else {
                    unreachable!()
                };
                assert_eq!(got, scheme, "{url}");
                let text = err.to_string();
                assert!(
                    text.contains("data: URL") && text.contains("network"),
                    "{text}"
                );
            }
            other => panic!("{url}: {other:?}"),
        }
    }
    // A long scheme is cut in the message.
    let long = format!("{}://x", "a".repeat(500));
    let err = decode_image_url(&long).expect_err("long scheme");
    assert!(err.to_string().len() < 300, "{err}");
}

// ---- limits ----

#[test]
fn oversize_base64_is_refused_before_decoding() {
    // Not valid base64 either ('!' at the end): the size check must come first.
    let mut text = "A".repeat((MAX_IMAGE_BYTES + 3) / 3 * 4 + 4);
    text.push('!');
    let err = decode_base64_image(&text).expect_err("oversize");
    assert!(matches!(err, ImageError::TooLarge { .. }), "{err}");
    let err = decode_image_url(&format!("data:image/png;base64,{text}")).expect_err("oversize");
    assert!(matches!(err, ImageError::TooLarge { .. }), "{err}");
}

#[test]
fn oversize_bytes_are_refused() {
    let mut bytes = encode(sample(), ImageFormat::Png);
    bytes.resize(MAX_IMAGE_BYTES + 1, 0);
    let err = decode_bytes(&bytes).expect_err("oversize");
    assert!(
        matches!(err, ImageError::TooLarge { bytes } if bytes == MAX_IMAGE_BYTES + 1),
        "{err}"
    );
    // At the limit the size is fine (this one then fails as a PNG with trailing junk, or not).
    let _ = decode_bytes(&bytes[..MAX_IMAGE_BYTES]);
}

#[test]
fn decompression_bombs_are_refused_from_their_headers() {
    // Each file is tiny but declares billions of pixels; TooManyPixels is only returned before
    // `DynamicImage::from_decoder`, the first allocation of pixels.
    let png = png_by_hand(100_000, 100_000, 8, 2, &[], &[0; 64]);
    let mut jpeg = encode(sample(), ImageFormat::Jpeg);
    patch_jpeg_size(&mut jpeg, 65_000, 65_000);
    let mut gif = two_frame_gif(4, 4);
    patch_gif_size(&mut gif, 65_535, 65_535);
    let mut webp = encode(sample(), ImageFormat::WebP);
    let webp_extended = webp_extended(&webp, 100_000, 100_000);
    patch_webp_lossless_size(&mut webp, 16_000, 16_000);
    for (name, bytes) in [("png", png), ("jpeg", jpeg), ("gif", gif), ("webp", webp)] {
        let err = refused(&bytes);
        assert!(
            matches!(err, ImageError::TooManyPixels { .. }),
            "{name}: {err}"
        );
        assert!(err.to_string().contains("pixels"), "{err}");
    }
    // The WebP decoder refuses a canvas over 16384 pixels a side itself, while reading headers.
    let err = refused(&webp_extended);
    assert!(
        matches!(&err, ImageError::Decode { format: "WebP", .. })
            && err.to_string().contains("too large"),
        "{err}"
    );
}

#[test]
fn just_over_the_pixel_limit_is_refused() {
    let png = png_by_hand(4097, 4096, 8, 2, &[], &[0; 64]);
    let err = refused(&png);
    assert!(
        matches!(
            err,
            ImageError::TooManyPixels {
                width: 4097,
                height: 4096
            }
        ),
        "{err}"
    );
    assert!(check_dimensions(4096, 4096).is_ok());
    assert!(check_dimensions(20, 4000).is_ok());
    assert!(check_dimensions(1, 200).is_ok());
    for (w, h) in [(1, 201), (201, 1), (1, 4096 * 4096), (10, 2001)] {
        assert!(
            matches!(check_dimensions(w, h), Err(ImageError::AspectRatio { .. })),
            "{w}x{h}"
        );
    }
    let thin = encode(RgbImage::new(1, 300), ImageFormat::Png);
    assert!(matches!(refused(&thin), ImageError::AspectRatio { .. }));
    assert!(check_dimensions(u32::MAX, u32::MAX).is_err());
}

#[test]
fn zero_size_images_are_refused() {
    let png = png_by_hand(0, 5, 8, 2, &[], &[0]);
    let mut gif = two_frame_gif(4, 4);
    patch_gif_size(&mut gif, 0, 0);
    let mut jpeg = encode(sample(), ImageFormat::Jpeg);
    patch_jpeg_size(&mut jpeg, 0, 5);
    for (name, bytes) in [("png", png), ("gif", gif), ("jpeg", jpeg)] {
        let err = refused(&bytes);
        assert!(
            matches!(err, ImageError::ZeroSize { .. } | ImageError::Decode { .. }),
            "{name}: {err}"
        );
    }
    assert!(matches!(
        check_dimensions(0, 0),
        Err(ImageError::ZeroSize { .. })
    ));
}

// ---- broken files ----

#[test]
fn unsupported_formats_are_named() {
    let mut bmp = b"BM".to_vec();
    bmp.resize(64, 0);
    let err = refused(&bmp);
    assert!(
        matches!(&err, ImageError::UnsupportedFormat { format } if format == "BMP"),
        "{err}"
    );
    assert!(
        err.to_string().contains("BMP images are not supported"),
        "{err}"
    );
    let mut tiff = b"II*\0".to_vec();
    tiff.resize(64, 0);
    assert!(matches!(
        refused(&tiff),
        ImageError::UnsupportedFormat { .. }
    ));
}

#[test]
fn unknown_bytes_are_refused() {
    for bytes in [
        &b"hello, world"[..],
        &[0u8; 100],
        b"<svg xmlns='http://www.w3.org/2000/svg'/>",
    ] {
        let err = refused(bytes);
        assert!(matches!(err, ImageError::UnknownFormat), "{err}");
    }
}

#[test]
fn corrupt_files_are_refused() {
    for (name, mut bytes) in valid_files() {
        // Keep the magic bytes (so the format is recognised), garble everything after them.
        for b in bytes.iter_mut().skip(16) {
            *b = b.wrapping_mul(31).wrapping_add(7);
        }
        let err = refused(&bytes);
        assert!(matches!(err, ImageError::Decode { .. }), "{name}: {err}");
    }
}

#[test]
fn truncated_files_are_refused() {
    for (name, bytes) in valid_files() {
        for len in [4, 12, 20, 30, bytes.len() / 2] {
            let err = refused(&bytes[..len]);
            assert!(
                matches!(err, ImageError::Decode { .. } | ImageError::UnknownFormat),
                "{name} cut to {len}: {err}"
            );
        }
    }
}

#[test]
fn seeded_random_mutations_never_panic() {
    let mut rng = StdRng::seed_from_u64(0x1a9e5);
    let files = valid_files();
    let (mut ok, mut err) = (0, 0);
    for round in 0..2000 {
        let (name, original) = &files[round % files.len()];
        let mut bytes = original.clone();
        match rng.random_range(0..4) {
            0 => {
                for _ in 0..rng.random_range(1..8) {
                    let at = rng.random_range(0..bytes.len());
                    bytes[at] = rng.random();
                }
            }
            1 => bytes.truncate(rng.random_range(0..bytes.len())),
            2 => {
                let at = rng.random_range(0..bytes.len());
                let len = rng.random_range(1..64);
                let junk: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                bytes.splice(at..at, junk);
            }
            _ => {
                // A header field set to an extreme value.
                let at = rng.random_range(0..bytes.len().min(40));
                bytes[at] = if rng.random() { 0xFF } else { 0 };
            }
        }
        match decode_bytes(&bytes) {
            Ok(img) => {
                ok += 1;
                assert_eq!(
                    img.rgb.len() as u64,
                    u64::from(img.width) * u64::from(img.height) * 3
                );
                assert!(u64::from(img.width) * u64::from(img.height) <= MAX_IMAGE_PIXELS);
            }
            Err(ImageError::DecoderPanicked { format }) => {
                panic!("round {round}: the {format} decoder panicked on a mutated {name}")
            }
            Err(_) => err += 1,
        }
    }
    assert!(
        ok > 0 && err > 0,
        "ok {ok}, err {err}: the mutations should hit both"
    );
}

#[test]
fn random_text_never_panics() {
    let mut rng = StdRng::seed_from_u64(7);
    let alphabet =
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_ \n:;,.%data";
    for _ in 0..2000 {
        let len = rng.random_range(0..200);
        let text: String = (0..len)
            .map(|_| char::from(alphabet[rng.random_range(0..alphabet.len())]))
            .collect();
        for result in [
            decode_base64_image(&text),
            decode_image_url(&text),
            decode_image_url(&format!("data:image/png;base64,{text}")),
        ] {
            assert!(
                !matches!(result, Err(ImageError::DecoderPanicked { .. })),
                "{text:?}"
            );
        }
    }
}
