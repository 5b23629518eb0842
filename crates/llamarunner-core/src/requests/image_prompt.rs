//! Where a request's images go in its prompt, in each dialect, and their checks before the
//! queue. The projector's tokenizer (`protocol::VisionModel`) takes text in which one marker
//! (`protocol::vision::DEFAULT_MARKER`, mtmd's) stands for each image, in order:
//!
//! - native `/completion`: `[img-N]` tags in the prompt name `images[].id` (the seed runner's
//!   format); each tag becomes a marker;
//! - OpenAI chat: an `image_url` content part becomes a marker where the part was;
//! - Ollama: a message's (or `/api/generate`'s) `images` replace its `[img]` tags one by one,
//!   and those left over go before its text, as Ollama places them; `/api/generate` also
//!   takes `[img-N]` tags (N = the image's index).
//!
//! The images themselves are decoded (`requests/images.rs`) on the blocking pool by
//! `decode_images`, after the cheap checks: a server without a projector answers
//! `images_not_supported` before anything is decoded.

use std::sync::Arc;

use serde_json::Value;

use crate::http::error::ApiError;
use crate::protocol::vision::DEFAULT_MARKER;
use crate::protocol::{ImageInput, ModelInfo};
use crate::requests::images::{self, MAX_IMAGES_PER_REQUEST};
use crate::requests::validate;

/// An image as a request gives it, not decoded yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImageSource {
    /// Base64 bytes (native and Ollama `images`).
    Base64(String),
    /// An OpenAI `image_url.url` (a `data:` URL; anything else is refused when decoded).
    Url(String),
}

/// A prompt's text, with one marker per image, and its images in marker order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prompt {
    /// The text.
    pub text: String,
    /// The images, one per marker in `text`.
    pub images: Vec<ImageSource>,
}

impl From<String> for Prompt {
    fn from(text: String) -> Self {
        Self {
            text,
            images: Vec::new(),
        }
    }
}

/// The 400 for an image field or reference that is wrong.
fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::InvalidImage(message.into())
}

/// Refuses images on a server without a projector, and more than a request may carry.
pub fn check_images(info: &ModelInfo, count: usize) -> Result<(), ApiError> {
    if count == 0 {
        return Ok(());
    }
    if info.vision.is_none() {
        return Err(ApiError::ImagesNotSupported(
            "this server has no vision projector: start it with --mmproj FILE to send images"
                .into(),
        ));
    }
    if count > MAX_IMAGES_PER_REQUEST {
        return Err(invalid(format!(
            "at most {MAX_IMAGES_PER_REQUEST} images per request, got {count}"
        )));
    }
    Ok(())
}

/// Pixels the images of one request may have together: four of the largest image allowed
/// (their RGB: 192 MiB). Sixteen of those would hold 768 MiB per request while it is
/// tokenized; this keeps a request's decoded images inside a bound whatever their count.
pub const MAX_PIXELS_PER_REQUEST: u64 = 4 * images::MAX_IMAGE_PIXELS;

pub use crate::http::IMAGES_IN_FLIGHT;

/// Decodes a prompt's images on the blocking pool (after `check_images`), one after another,
/// stopping at the first bad one or once they pass `MAX_PIXELS_PER_REQUEST` together.
pub async fn decode_images(
    info: &Arc<ModelInfo>,
    sources: Vec<ImageSource>,
) -> Result<Vec<ImageInput>, ApiError> {
    check_images(info, sources.len())?;
    if sources.is_empty() {
        return Ok(Vec::new());
    }
    validate::blocking(move || {
        let mut pixels = 0u64;
        let mut out = Vec::with_capacity(sources.len());
        for (i, source) in sources.iter().enumerate() {
            let image = match source {
                ImageSource::Base64(b64) => images::decode_base64_image(b64),
                ImageSource::Url(url) => images::decode_image_url(url),
            }
            .map_err(|e| invalid(format!("image {i}: {e}")))?;
            pixels += u64::from(image.width) * u64::from(image.height);
            if pixels > MAX_PIXELS_PER_REQUEST {
                return Err(invalid(format!(
                    "the images of one request may have at most {MAX_PIXELS_PER_REQUEST} pixels \
                     together; image {i} passes that"
                )));
            }
            out.push(image);
        }
        Ok(out)
    })
    .await?
}

/// The images of a native `/completion` request (`[{"id": N, "data": base64}]`) and its
/// prompt with each `[img-N]` tag made a marker; an unknown id, an image no tag names, or a
/// malformed entry is a 400 naming it. Without a projector and without images, tags are
/// plain text (as in the seed runner).
pub fn native_prompt(
    info: &ModelInfo,
    prompt: String,
    images: Option<Vec<Value>>,
) -> Result<Prompt, ApiError> {
    let images = images.unwrap_or_default();
    check_images(info, images.len())?;
    if info.vision.is_none() {
        return Ok(prompt.into());
    }
    let mut entries: Vec<(i64, String)> = Vec::with_capacity(images.len());
    for (i, entry) in images.into_iter().enumerate() {
        let id = entry
            .get("id")
            .and_then(Value::as_i64)
            .ok_or_else(|| invalid(format!("images[{i}].id must be an integer")))?;
        let Some(Value::String(data)) = entry.get("data") else {
            return Err(invalid(format!("images[{i}].data must be a base64 string")));
        };
        if entries.iter().any(|(other, _)| *other == id) {
            return Err(invalid(format!("images[{i}]: id {id} is given twice")));
        }
        entries.push((id, data.clone()));
    }
    let (text, ids) = replace_tags(&prompt)?;
    let mut used = vec![false; entries.len()];
    let mut sources = Vec::with_capacity(ids.len());
    for id in ids {
        let k = entries.iter().position(|(e, _)| *e == id).ok_or_else(|| {
            invalid(format!(
                "the prompt names [img-{id}], but no image has id {id}"
            ))
        })?;
        used[k] = true;
        sources.push(ImageSource::Base64(entries[k].1.clone()));
    }
    if let Some(k) = used.iter().position(|u| !u) {
        return Err(invalid(format!(
            "image id {} is not named in the prompt: put [img-{}] where it goes",
            entries[k].0, entries[k].0
        )));
    }
    Ok(Prompt {
        text,
        images: sources,
    })
}

/// Replaces every `[img-N]` tag with the marker; returns the text and the ids in order. More
/// than `MAX_IMAGES_PER_REQUEST` tags is a 400: each tag places (and copies) its image.
fn replace_tags(prompt: &str) -> Result<(String, Vec<i64>), ApiError> {
    let mut text = String::with_capacity(prompt.len());
    let mut ids = Vec::new();
    let mut rest = prompt;
    while let Some(at) = rest.find("[img-") {
        let after = &rest[at + 5..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || after.as_bytes().get(digits) != Some(&b']') {
            text.push_str(&rest[..at + 5]);
            rest = after;
            continue;
        }
        let id: i64 = after[..digits]
            .parse()
            .map_err(|_| invalid(format!("[img-{}]: the id is too large", &after[..digits])))?;
        if ids.len() == MAX_IMAGES_PER_REQUEST {
            return Err(invalid(format!(
                "at most {MAX_IMAGES_PER_REQUEST} images per request: the prompt has more \
                 [img-N] tags"
            )));
        }
        text.push_str(&rest[..at]);
        text.push_str(DEFAULT_MARKER);
        ids.push(id);
        rest = &after[digits + 1..];
    }
    text.push_str(rest);
    Ok((text, ids))
}

/// Ollama's placement of a message's images: each replaces the next `[img]` tag of the text,
/// and those left over go before the text, in order. Returns the text and the order in which
/// the images' markers appear in it (indices into the message's images): the leftovers, put
/// before the text, come first.
pub fn ollama_place(content: &str, n: usize) -> (String, Vec<usize>) {
    // One pass over the text: each of the first `n` tags is replaced where it stands.
    let mut text = String::with_capacity(content.len() + n * DEFAULT_MARKER.len());
    let mut tagged = 0;
    let mut from = 0;
    for (at, tag) in content.match_indices("[img]").take(n) {
        text.push_str(&content[from..at]);
        text.push_str(DEFAULT_MARKER);
        from = at + tag.len();
        tagged += 1;
    }
    text.push_str(&content[from..]);
    let order = (tagged..n).chain(0..tagged).collect();
    (DEFAULT_MARKER.repeat(n - tagged) + &text, order)
}

/// `items` in `order` (a permutation of their indices, from `ollama_place`).
pub fn in_order<T: Clone>(items: &[T], order: &[usize]) -> Vec<T> {
    order
        .iter()
        .filter_map(|&i| items.get(i).cloned())
        .collect()
}

/// Ollama `/api/generate`'s `images` (base64 strings) and its prompt: `[img-N]` tags name
/// them by index, as in the native format; without tags they are placed as in a message
/// (`ollama_place`).
pub fn ollama_generate(
    info: &ModelInfo,
    prompt: String,
    images: Option<Vec<Value>>,
) -> Result<Prompt, ApiError> {
    let images = strings("images", images.unwrap_or_default())?;
    check_images(info, images.len())?;
    if images.is_empty() {
        return Ok(prompt.into());
    }
    let (_, ids) = replace_tags(&prompt)?;
    if ids.is_empty() {
        let (text, order) = ollama_place(&prompt, images.len());
        return Ok(Prompt {
            text,
            images: in_order(&images, &order)
                .into_iter()
                .map(ImageSource::Base64)
                .collect(),
        });
    }
    let entries = images
        .into_iter()
        .enumerate()
        .map(|(i, data)| serde_json::json!({"id": i, "data": data}))
        .collect();
    native_prompt(info, prompt, Some(entries))
}

/// A list of base64 strings (`images`), or a 400 naming the entry that is not one.
pub fn strings(field: &str, values: Vec<Value>) -> Result<Vec<String>, ApiError> {
    values
        .into_iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s),
            _ => Err(invalid(format!("{field}[{i}] must be a base64 string"))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fake::FakeVision;

    fn vision_info() -> ModelInfo {
        let mut info = crate::backend::fake::model_info(64);
        info.vision = Some(Arc::new(FakeVision {
            positions: 4,
            max_positions: 32,
        }));
        info
    }

    fn kind(r: Result<Prompt, ApiError>) -> String {
        match r {
            Ok(p) => format!("ok {p:?}"),
            Err(e) => format!("{} {e}", e.kind()),
        }
    }

    #[test]
    fn native_tags_become_markers_in_order_and_every_id_is_checked() {
        let info = vision_info();
        let images = |ids: &[i64]| {
            Some(
                ids.iter()
                    .map(|&id| serde_json::json!({"id": id, "data": format!("d{id}")}))
                    .collect(),
            )
        };
        let p = native_prompt(
            &info,
            "a [img-7] b [img-3] c [img-7]".into(),
            images(&[3, 7]),
        )
        .unwrap();
        assert_eq!(p.text, "a <__media__> b <__media__> c <__media__>");
        assert_eq!(
            p.images,
            ["d7", "d3", "d7"].map(|d| ImageSource::Base64(d.into()))
        );
        // Not tags: left as they are.
        let p = native_prompt(&info, "[img-] [img-x] [img-1".into(), None).unwrap();
        assert_eq!(p.text, "[img-] [img-x] [img-1");
        let unknown = kind(native_prompt(&info, "[img-5]".into(), images(&[1])));
        assert!(
            unknown.starts_with("invalid_image") && unknown.contains("5"),
            "{unknown}"
        );
        let unused = kind(native_prompt(&info, "[img-1]".into(), images(&[1, 2])));
        assert!(
            unused.starts_with("invalid_image") && unused.contains("id 2"),
            "{unused}"
        );
        let twice = kind(native_prompt(&info, "[img-1]".into(), images(&[1, 1])));
        assert!(twice.starts_with("invalid_image"), "{twice}");
        for bad in [
            serde_json::json!({"id": "1", "data": "x"}),
            serde_json::json!({"data": "x"}),
            serde_json::json!({"id": 1, "data": 5}),
            serde_json::json!("x"),
        ] {
            let r = kind(native_prompt(&info, "[img-1]".into(), Some(vec![bad])));
            assert!(r.starts_with("invalid_image"), "{r}");
        }
        let many = kind(native_prompt(
            &info,
            String::new(),
            images(&(0..=MAX_IMAGES_PER_REQUEST as i64).collect::<Vec<_>>()),
        ));
        assert!(many.starts_with("invalid_image"), "{many}");
        let huge = kind(native_prompt(
            &info,
            "[img-99999999999999999999]".into(),
            images(&[1]),
        ));
        assert!(huge.starts_with("invalid_image"), "{huge}");
        // One image named by more tags than a request may place: refused before any copy.
        let tags = "[img-1]".repeat(MAX_IMAGES_PER_REQUEST + 1);
        let copies = kind(native_prompt(&info, tags, images(&[1])));
        assert!(copies.contains("tags"), "{copies}");
        let fine = native_prompt(
            &info,
            "[img-1]".repeat(MAX_IMAGES_PER_REQUEST),
            images(&[1]),
        );
        assert_eq!(fine.unwrap().images.len(), MAX_IMAGES_PER_REQUEST);
    }

    #[test]
    fn without_a_projector_images_are_refused_and_tags_are_text() {
        let info = crate::backend::fake::model_info(64);
        let p = native_prompt(&info, "[img-0]".into(), None).unwrap();
        assert_eq!(p.text, "[img-0]");
        let r = kind(native_prompt(
            &info,
            "[img-0]".into(),
            Some(vec![serde_json::json!({"id": 0, "data": "x"})]),
        ));
        assert!(
            r.starts_with("images_not_supported") && r.contains("--mmproj"),
            "{r}"
        );
        let r = kind(ollama_generate(&info, "x".into(), Some(vec!["x".into()])));
        assert!(r.starts_with("images_not_supported"), "{r}");
    }

    #[test]
    fn ollama_images_replace_img_tags_then_go_before_the_text() {
        let m = DEFAULT_MARKER;
        assert_eq!(ollama_place("hi", 2), (format!("{m}{m}hi"), vec![0, 1]));
        // The first image takes the tag, the second goes before the text: in the text the
        // second comes first.
        assert_eq!(
            ollama_place("a [img] b", 2),
            (format!("{m}a {m} b"), vec![1, 0])
        );
        assert_eq!(
            ollama_place("[img][img] [img]", 4),
            (format!("{m}{m}{m} {m}"), vec![3, 0, 1, 2])
        );
        assert_eq!(ollama_place("x", 0), ("x".to_string(), vec![]));
        // Only the first `n` tags are placed, in one pass, however many the text has.
        let many = "[img]".repeat(200_000);
        let (placed, order) = ollama_place(&many, 3);
        assert_eq!(order, vec![0, 1, 2]);
        assert!(placed.starts_with(&m.repeat(3)));
        assert_eq!(placed.matches("[img]").count(), 200_000 - 3);
        assert_eq!(in_order(&["a", "b", "c"], &[2, 0, 1]), vec!["c", "a", "b"]);
        let info = vision_info();
        let p = ollama_generate(
            &info,
            "see [img-1] and [img-0]".into(),
            Some(vec!["a".into(), "b".into()]),
        )
        .unwrap();
        assert_eq!(p.text, "see <__media__> and <__media__>");
        assert_eq!(p.images, ["b", "a"].map(|d| ImageSource::Base64(d.into())));
        let p = ollama_generate(&info, "what".into(), Some(vec!["a".into()])).unwrap();
        assert_eq!(p.text, "<__media__>what");
        let r = kind(ollama_generate(
            &info,
            "x".into(),
            Some(vec![serde_json::json!(1)]),
        ));
        assert!(r.starts_with("invalid_image"), "{r}");
    }
}
