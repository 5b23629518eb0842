//! What the three dialects (native, OpenAI, Ollama) share: readiness and model-name checks,
//! chat rendering, submitting a generation and collecting it, embeddings.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Instant, SystemTime};

use futures_util::Stream;
use serde_json::Value;
use tokio::sync::mpsc::Receiver;

use crate::chat::{ChatMessage, RenderExtras};
use crate::http::access::{self, Record};
use crate::http::error::ApiError;
use crate::http::AppState;
use crate::protocol::params::SamplingParams;
use crate::protocol::{
    Completion, EmbedRequest, Embedding, Event, EventSink, Input, LoadState, ModelInfo, Request,
    TextHold, TokenLogprob,
};
use crate::requests::embed_input;
pub use crate::requests::embed_input::EmbedInput;
use crate::requests::image_prompt::{self, ImageSource, Prompt};
use crate::requests::thinking::TemplateArgs;
use crate::requests::validate;

/// Parses a JSON body, naming the offending field in the error.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            ApiError::InvalidJson(e.into_inner().to_string())
        } else {
            ApiError::InvalidJson(format!("{path}: {}", e.into_inner()))
        }
    })
}

/// Fails fast unless the model is ready.
pub fn ensure_ready(state: &AppState) -> Result<(), ApiError> {
    match state.engine.health.state() {
        LoadState::Ready => Ok(()),
        LoadState::Loading => Err(ApiError::Loading),
        LoadState::Error => {
            let why = state.engine.health.error().unwrap_or_default();
            if state.engine.health.engine_stopped() {
                // It was serving, then stopped: not a load failure.
                Err(ApiError::Unavailable(why))
            } else {
                Err(ApiError::LoadFailed(why))
            }
        }
    }
}

/// The loaded model's description (the model must be ready).
pub fn model_info(state: &AppState) -> Result<Arc<ModelInfo>, ApiError> {
    ensure_ready(state)?;
    state.engine.health.model_info().ok_or(ApiError::Loading)
}

/// Whether a client's `model` names the served model: its name, the name with Ollama's
/// `:latest` tag (or without it, for a model served as `name:latest`), or the GGUF file name.
/// Absent or empty means "the model".
pub fn model_matches(state: &AppState, requested: &str) -> bool {
    let name = state.model_name.as_ref();
    requested.is_empty()
        || requested == name
        || requested.strip_suffix(":latest") == Some(name)
        || name.strip_suffix(":latest") == Some(requested)
        || state
            .engine
            .health
            .model_info()
            .and_then(|m| m.path.file_name().map(|f| f.to_string_lossy() == requested))
            .unwrap_or(false)
}

/// Rejects a request for a model this server does not serve: Ollama's routes, whose clients
/// pull a model a server answers 404 for, and `GET /v1/models/{model}`. The routes
/// llama-server serves (OpenAI, Anthropic, Responses, the native ones, rerank) answer any
/// name with the one model, as llama-server does, and name it in the answer: tools that
/// hard-code a model name work unchanged. On a many-model server the router checks the name,
/// since there it chooses the model (docs/endpoints.md, "Model names").
pub fn check_model(state: &AppState, requested: Option<&str>) -> Result<(), ApiError> {
    match requested {
        Some(r) if !model_matches(state, r) => Err(ApiError::ModelNotFound(format!(
            "model '{r}' not found; this server serves '{}'",
            state.model_name
        ))),
        _ => Ok(()),
    }
}

/// The tokens a rendered prompt has, images' positions included: what the count-tokens routes
/// answer (`/v1/messages/count_tokens`, `.../input_tokens`), tokenized as a generation would be.
pub async fn count_prompt_tokens(state: &AppState, prompt: Prompt) -> Result<usize, ApiError> {
    let info = model_info(state)?;
    Ok(if prompt.images.is_empty() {
        validate::tokenize_text(&info, prompt.text, true, "prompt")
            .await?
            .len()
    } else {
        let images = image_prompt::decode_images(&info, prompt.images).await?;
        validate::tokenize_with_images(&info, prompt.text, images)
            .await?
            .0
            .len()
    })
}

/// A conversation as a request gives it: its messages, each image replaced in its content by
/// the projector's marker (`image_prompt`), and the images in marker order.
#[derive(Debug, Default)]
pub struct Chat {
    /// The messages.
    pub messages: Vec<ChatMessage>,
    /// The images, in the order their markers appear in the rendered conversation.
    pub images: Vec<ImageSource>,
}

/// Converts chat messages as clients send them: `content` a string, null, or (OpenAI) an array
/// of parts whose text parts are joined and whose `image_url` parts become image markers where
/// they are; a message's `images` (Ollama, base64) are placed as Ollama does
/// (`image_prompt::ollama_place`).
pub fn parse_messages(messages: Vec<Value>) -> Result<Chat, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::field("messages", " must not be empty"));
    }
    let mut images = Vec::new();
    let messages = messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let Value::Object(mut fields) = m else {
                return Err(ApiError::InvalidRequest(format!(
                    "messages[{i}] must be an object with role and content"
                )));
            };
            let role = match fields.remove("role") {
                Some(Value::String(r)) if !r.is_empty() => r,
                _ => {
                    return Err(ApiError::InvalidRequest(format!(
                        "messages[{i}].role is required and must be a string"
                    )))
                }
            };
            let mut parts = Vec::new();
            let mut content = match fields.remove("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s,
                Some(Value::Array(list)) => text_of_parts(i, &list, &mut images, &mut parts)?,
                Some(_) => {
                    return Err(ApiError::InvalidRequest(format!(
                        "messages[{i}].content must be a string or an array of parts"
                    )))
                }
            };
            match fields.remove("images") {
                None | Some(Value::Null) => {}
                Some(Value::Array(list)) => {
                    let list = image_prompt::strings(&format!("messages[{i}].images"), list)?;
                    // Counted before they are placed (the request's total is checked again
                    // with the projector's presence once all messages are read).
                    if images.len() + list.len() > crate::requests::images::MAX_IMAGES_PER_REQUEST {
                        return Err(ApiError::InvalidImage(format!(
                            "at most {} images per request",
                            crate::requests::images::MAX_IMAGES_PER_REQUEST
                        )));
                    }
                    let (placed, order) = image_prompt::ollama_place(&content, list.len());
                    content = placed;
                    images.extend(
                        image_prompt::in_order(&list, &order)
                            .into_iter()
                            .map(ImageSource::Base64),
                    );
                }
                Some(_) => {
                    return Err(ApiError::InvalidImage(format!(
                        "messages[{i}].images must be an array of base64 strings"
                    )))
                }
            }
            // Clients send absent fields as null (`"tool_calls": null`); to a template, absent
            // is what they mean (iterating a null fails, iterating an undefined does not).
            fields.retain(|_, v| !v.is_null());
            Ok(ChatMessage {
                role,
                content,
                extra: fields,
                parts,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Chat { messages, images })
}

/// The text of a content array; each image part becomes a marker there, its URL in `images`.
/// Text parts are joined by a line break, but not beside an image's marker (llama-server's
/// rule; vLLM joins by a line break too). A list of text parts only is also kept, part by
/// part, in `texts`.
fn text_of_parts(
    i: usize,
    parts: &[Value],
    images: &mut Vec<ImageSource>,
    texts: &mut Vec<String>,
) -> Result<String, ApiError> {
    let mut text = String::new();
    let mut after_marker = false;
    let mut images_in = false;
    for part in parts {
        match part.get("type").and_then(Value::as_str) {
            Some("text") => {
                let part = part.get("text").and_then(Value::as_str).unwrap_or("");
                if !text.is_empty() && !after_marker {
                    text.push('\n');
                }
                after_marker = false;
                text.push_str(part);
                texts.push(part.to_string());
            }
            Some("image_url") => {
                // `{"image_url": {"url": ...}}`, or the URL itself as some clients send it.
                let url = match part.get("image_url") {
                    Some(Value::String(url)) => Some(url.as_str()),
                    Some(Value::Object(o)) => o.get("url").and_then(Value::as_str),
                    _ => None,
                }
                .ok_or_else(|| {
                    ApiError::InvalidImage(format!(
                        "messages[{i}].content: an image_url part needs image_url.url"
                    ))
                })?;
                text.push_str(crate::protocol::vision::DEFAULT_MARKER);
                after_marker = true;
                images_in = true;
                images.push(ImageSource::Url(url.to_string()));
            }
            Some("input_image" | "image") => {
                return Err(ApiError::InvalidImage(format!(
                    "messages[{i}].content: give images as image_url parts with a data: URL"
                )))
            }
            other => {
                return Err(ApiError::InvalidRequest(format!(
                    "messages[{i}].content: unsupported part type {}",
                    other.unwrap_or("(none)")
                )))
            }
        }
    }
    if images_in {
        texts.clear();
    }
    Ok(text)
}

/// Renders a conversation with the model's chat template and the request's template
/// switches (`args`), on a blocking thread (a template is a small program, and a conversation
/// can be long).
pub async fn render_chat(
    state: &AppState,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    args: TemplateArgs,
) -> Result<String, ApiError> {
    let info = model_info(state)?;
    let extras = args.extras(state, &info);
    let messages = with_system_prompt(state, messages);
    render(info, messages, add_generation_prompt, extras).await
}

/// `messages` with the server's system prompt (`--system-prompt`) first when they have no
/// system (or developer) message of their own.
pub fn with_system_prompt(state: &AppState, mut messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
    let Some(prompt) = state.system_prompt.as_deref() else {
        return messages;
    };
    if messages
        .iter()
        .any(|m| m.role == "system" || m.role == "developer")
    {
        return messages;
    }
    messages.insert(
        0,
        ChatMessage {
            role: "system".into(),
            content: prompt.to_string(),
            extra: serde_json::Map::new(),
            ..ChatMessage::default()
        },
    );
    messages
}

async fn render(
    info: Arc<ModelInfo>,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    extras: RenderExtras,
) -> Result<String, ApiError> {
    validate::blocking(move || {
        info.template
            .render_with(&messages, add_generation_prompt, &extras)
    })
    .await?
    .map_err(|e| ApiError::InvalidRequest(e.to_string()))
}

/// The prompt for a chat request: the rendered conversation (thinking as the server's
/// `--reasoning` decides), with the template's end-of-turn markers added to the request's
/// stop strings.
pub async fn chat_prompt(
    state: &AppState,
    messages: Vec<ChatMessage>,
    params: &mut SamplingParams,
) -> Result<String, ApiError> {
    let extras = TemplateArgs::default().extras(state, &*model_info(state)?);
    chat_prompt_with(state, messages, params, extras).await
}

/// `chat_prompt` with the template's variables as the request sets them (its tools, thinking
/// switch and kwargs: `requests::thinking`).
pub async fn chat_prompt_with(
    state: &AppState,
    messages: Vec<ChatMessage>,
    params: &mut SamplingParams,
    extras: RenderExtras,
) -> Result<String, ApiError> {
    let info = model_info(state)?;
    for marker in &info.template.stop {
        if !params.stop.contains(marker) {
            params.stop.push(marker.clone());
        }
    }
    let (messages, prefill) = split_prefill(with_system_prompt(state, messages))?;
    let mut prompt = render(info, messages, true, extras).await?;
    if let Some(text) = prefill {
        prompt.push_str(&text);
    }
    Ok(prompt)
}

/// A conversation that ends with an assistant's text (no calls) asks for that text to be
/// continued, as Anthropic's Messages API, Ollama and llama-server do: the conversation before
/// it is rendered with the generation prompt, and the text follows it (the answer is what
/// comes after the text). Returns the messages to render and that text. Two assistant
/// messages at the end are refused, as llama-server refuses them: the one to continue would
/// follow another answer, which templates that alternate roles cannot render.
pub fn split_prefill(
    mut messages: Vec<ChatMessage>,
) -> Result<(Vec<ChatMessage>, Option<String>), ApiError> {
    let prefill = messages.last().is_some_and(|m| {
        m.role == "assistant"
            && !m.content.is_empty()
            && m.extra
                .get("tool_calls")
                .is_none_or(|c| c.is_null() || c.as_array().is_some_and(Vec::is_empty))
    });
    if !prefill {
        return Ok((messages, None));
    }
    // Text parts are continued joined by a blank line (llama-server's `render_content`).
    let last = messages.pop().map(|m| {
        // Only while the text is still the parts' (a rewrite of the content keeps it as is).
        if !m.parts.is_empty() && m.parts.join("\n") == m.content {
            m.parts.join("\n\n")
        } else {
            m.content
        }
    });
    if messages.last().is_some_and(|m| m.role == "assistant") {
        return Err(ApiError::invalid(
            "Cannot have 2 or more assistant messages at the end of the list.",
        ));
    }
    Ok((messages, last))
}

/// A generation that has its slot: the engine's events for it (text, then a final `Done` or
/// `Error`), as a stream or one by one. The final statistics and errors that pass through are
/// noted in the request's record (`http/access.rs`), which counts the outcome once, whatever
/// the dialect and whether the answer streams.
#[derive(Debug)]
pub struct Generation {
    rx: Receiver<Event>,
    /// Tells the engine when the text is read only at the end (`collect`).
    hold: TextHold,
    record: Option<Arc<Record>>,
    /// An event read ahead (`wait_first`), given out next.
    pending: Option<Event>,
    /// The prompt's positions in the slot (images' included), as queued.
    pub prompt_tokens: usize,
    /// Of those, the ones found in a cache at admission (not decoded).
    pub cached_tokens: usize,
}

impl Generation {
    fn new(
        rx: Receiver<Event>,
        hold: TextHold,
        prompt_tokens: usize,
        cached_tokens: usize,
    ) -> Self {
        let record = access::current();
        if let Some(r) = &record {
            r.generation_started();
        }
        Self {
            rx,
            hold,
            record,
            pending: None,
            prompt_tokens,
            cached_tokens,
        }
    }

    /// Waits for the first event after the slot was taken: the first token (the prompt is in
    /// the slot's cache by then, for another request to fork), or the end. The event is kept
    /// for the next `recv` or poll.
    pub async fn wait_first(&mut self) {
        if self.pending.is_none() {
            self.pending = self.recv().await;
        }
    }

    /// Tells the engine that the text is read only at the end (`collect`), so that it sends it
    /// in large pieces rather than an event per token (`TextHold`). Said as soon as a handler
    /// knows, so that a generation started before others and read after them (`n` choices,
    /// several prompts) does not fill its channel meanwhile.
    pub fn read_whole(&self) {
        self.hold.whole();
    }

    /// The next event; None once the engine has sent the last.
    pub async fn recv(&mut self) -> Option<Event> {
        if let Some(event) = self.pending.take() {
            return Some(event);
        }
        let event = self.rx.recv().await;
        self.note(event.as_ref());
        event
    }

    fn note(&self, event: Option<&Event>) {
        let Some(record) = &self.record else {
            return;
        };
        match event {
            Some(Event::Done(done)) => record.finished(done),
            Some(Event::Error(e)) => {
                let err = ApiError::from(e.clone());
                record.failed(err.status(), err.kind());
            }
            _ => {}
        }
    }
}

impl Stream for Generation {
    type Item = Event;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        let this = self.get_mut();
        if let Some(event) = this.pending.take() {
            return Poll::Ready(Some(event));
        }
        let polled = this.rx.poll_recv(cx);
        if let Poll::Ready(event) = &polled {
            this.note(event.as_ref());
        }
        polled
    }
}

/// Validates a generation (`validate::generation`), queues it and waits until it has a slot,
/// so that everything found wrong before that (a prompt too long, a bad grammar, a full queue)
/// is a proper HTTP error. The generation then yields text and a final `Done` or `Error`.
pub async fn start_generation(
    state: &AppState,
    prompt: impl Into<PromptSource>,
    params: SamplingParams,
) -> Result<Generation, ApiError> {
    let received = Instant::now();
    let info = model_info(state)?;
    let mut params = params;
    if params.seed < 0 {
        params.seed = state.default_seed;
    }
    if params.lora.is_none() {
        params.lora = Some(state.lora.defaults());
    }
    let Prompt { text, images } = match prompt.into() {
        PromptSource::Text(prompt) => prompt,
        PromptSource::Tokens(tokens) => {
            let valid = validate::generation_tokens(&info, &state.limits, tokens, params).await?;
            return submit(state, received, valid).await;
        }
    };
    // Held until the request has a slot (the end of this function): until then its images
    // are held here or in the queue (`image_prompt::IMAGES_IN_FLIGHT`).
    image_prompt::check_images(&info, images.len())?;
    let _images_held = if images.is_empty() {
        None
    } else {
        let n = u32::try_from(images.len()).unwrap_or(u32::MAX);
        Some(
            state
                .images_in_flight
                .clone()
                .try_acquire_many_owned(n)
                .map_err(|_| {
                    ApiError::Overloaded(format!(
                        "the server holds {} images of other requests waiting for a slot; \
                         retry later",
                        image_prompt::IMAGES_IN_FLIGHT
                    ))
                })?,
        )
    };
    let images = image_prompt::decode_images(&info, images).await?;
    let valid = validate::generation(&info, &state.limits, text, images, params).await?;
    submit(state, received, valid).await
}

/// What a generation starts from: text (with images), or tokens built by the handler (the
/// fill-in-the-middle prompt, `requests/infill.rs`).
#[derive(Clone, Debug)]
pub enum PromptSource {
    /// Text, tokenized here.
    Text(Prompt),
    /// Tokens, checked against the slot here.
    Tokens(Vec<crate::protocol::Token>),
}

impl From<Prompt> for PromptSource {
    fn from(prompt: Prompt) -> Self {
        Self::Text(prompt)
    }
}

impl From<String> for PromptSource {
    fn from(text: String) -> Self {
        Self::Text(text.into())
    }
}

/// Queues a validated request; returns its stream once the engine has taken it.
async fn submit(
    state: &AppState,
    received: Instant,
    valid: validate::Generation,
) -> Result<Generation, ApiError> {
    let (tx, mut rx) = EventSink::channel();
    let hold = tx.text_hold();
    let prompt_tokens = valid.tokens.len();
    state.engine.submit(Request {
        id: access::current_id(),
        prompt: Input::Tokens(valid.tokens),
        params: valid.params,
        truncated: valid.truncated,
        events: tx,
        received,
        deadline: state.limits.timeout.map(|t| received + t),
        images: valid.images,
    })?;
    match rx.recv().await {
        Some(Event::Started { cached }) => Ok(Generation::new(rx, hold, prompt_tokens, cached)),
        Some(Event::Error(e)) => Err(e.into()),
        Some(other) => Err(ApiError::Internal(format!(
            "unexpected first event {other:?}"
        ))),
        None => Err(ApiError::Unavailable("the engine stopped".into())),
    }
}

/// A whole generation.
#[derive(Debug)]
pub struct Collected {
    /// All the text.
    pub text: String,
    /// Per-token log-probabilities, when requested.
    pub logprobs: Vec<TokenLogprob>,
    /// Final statistics.
    pub done: Completion,
}

/// Reads a generation to its end. The engine is told that the text is read only at the end, so
/// it sends it in large pieces rather than one event per token.
pub async fn collect(mut rx: Generation) -> Result<Collected, ApiError> {
    rx.read_whole();
    let mut text = String::new();
    let mut logprobs = Vec::new();
    while let Some(event) = rx.recv().await {
        match event {
            Event::Started { .. } | Event::Progress(_) => {}
            Event::Text {
                text: t,
                logprobs: l,
            } => {
                text.push_str(&t);
                logprobs.extend(l);
            }
            Event::Done(done) => {
                return Ok(Collected {
                    text,
                    logprobs,
                    done,
                })
            }
            Event::Error(e) => return Err(e.into()),
        }
    }
    Err(ApiError::Unavailable(
        "the engine stopped before the generation ended".into(),
    ))
}

/// Embeds each input, one after another: the engine embeds one input per step anyway, and
/// queueing a long list at once could fill the embedding queue (429) for everyone. Every input
/// is validated (tokenized, fitted) before the first is queued.
pub async fn embed_all(
    state: &AppState,
    inputs: Vec<String>,
    truncate: bool,
) -> Result<Vec<Embedding>, ApiError> {
    embed_inputs(
        state,
        inputs.into_iter().map(EmbedInput::Text).collect(),
        truncate,
    )
    .await
}

/// `embed_all` for inputs of text or token ids.
pub async fn embed_inputs(
    state: &AppState,
    inputs: Vec<EmbedInput>,
    truncate: bool,
) -> Result<Vec<Embedding>, ApiError> {
    let info = model_info(state)?;
    if inputs.len() > validate::MAX_EMBED_INPUTS {
        return Err(ApiError::invalid(format!(
            "at most {} inputs per request, got {}",
            validate::MAX_EMBED_INPUTS,
            inputs.len()
        )));
    }
    check_embedder(&info)?;
    if state.pooling == crate::config::Pooling::None {
        return Err(ApiError::invalid(
            "this server embeds with --pooling none: one vector per token, which only POST \
             /embedding serves (this API's clients read one vector per input)",
        ));
    }
    let mut valid = Vec::with_capacity(inputs.len());
    for input in inputs {
        valid.push(match input {
            EmbedInput::Text(text) => validate::embedding_input(&info, text, truncate).await?,
            EmbedInput::Tokens(ids) => embed_input::token_input(&info, &ids, truncate)?,
        });
    }
    embed_tokens(state, valid).await
}

/// A 400 for a reranker, whose pooled output is a score, not an embedding.
pub fn check_embedder(info: &ModelInfo) -> Result<(), ApiError> {
    if info.rerank.is_some() {
        return Err(ApiError::invalid(
            "this model is a reranker (its pooling is rank): its pooled output is a relevance \
             score, not an embedding; rank documents with POST /v1/rerank",
        ));
    }
    Ok(())
}

/// Most values (tokens × dimensions) of one input's per-token embeddings (`--pooling none`):
/// 8 Mi floats, 32 MiB as numbers and about ten times that as JSON text.
pub const MAX_UNPOOLED_VALUES: usize = 8 << 20;

/// Embeds inputs already tokenized and fitted (`(tokens, whether cut)`), one after another
/// (see `embed_all`), and records the tokens embedded on the access line.
pub async fn embed_tokens(
    state: &AppState,
    valid: Vec<(Vec<crate::protocol::Token>, bool)>,
) -> Result<Vec<Embedding>, ApiError> {
    let mut out = Vec::with_capacity(valid.len());
    for (tokens, truncated) in valid {
        let (reply, answer) = tokio::sync::oneshot::channel();
        state.engine.submit_embed(EmbedRequest {
            content: Input::Tokens(tokens),
            truncate: false,
            reply,
        })?;
        let mut embedding = answer
            .await
            .map_err(|_| ApiError::Unavailable("the engine stopped".into()))??;
        embedding.truncated |= truncated;
        out.push(embedding);
    }
    if let Some(record) = access::current() {
        record.embedded(out.iter().map(|e| e.prompt_eval_count).sum());
    }
    Ok(out)
}

/// Embedding `dimensions` can only be the model's own (no truncation of vectors here).
pub fn check_dimensions(info: &ModelInfo, dimensions: Option<u32>) -> Result<(), ApiError> {
    match dimensions {
        Some(d) if d != info.n_embd => Err(ApiError::field(
            "dimensions",
            format!(": this model's embeddings have {} dimensions", info.n_embd),
        )),
        _ => Ok(()),
    }
}

/// Scales a vector to unit length (a zero vector stays zero).
pub fn l2_normalize(mut v: Vec<f32>) -> Vec<f32> {
    let norm = v
        .iter()
        .map(|x| f64::from(*x) * f64::from(*x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        for x in &mut v {
            *x = (f64::from(*x) / norm) as f32;
        }
    }
    v
}

/// Seconds since the Unix epoch.
pub fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// RFC 3339 UTC timestamp with nanoseconds, as Ollama writes `created_at`.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (y, m, day) = crate::chat::civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60,
        d.subsec_nanos()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_last_assistant_text_is_continued() {
        let msg = |role: &str, content: &str, extra: serde_json::Value| ChatMessage {
            role: role.into(),
            content: content.into(),
            extra: extra.as_object().cloned().unwrap_or_default(),
            ..ChatMessage::default()
        };
        let user = msg("user", "hi", serde_json::json!({}));
        let (rest, prefill) = split_prefill(vec![
            user.clone(),
            msg("assistant", "The answer is", serde_json::json!({})),
        ])
        .unwrap();
        assert_eq!((rest.len(), prefill.as_deref()), (1, Some("The answer is")));
        for last in [
            msg("user", "more", serde_json::json!({})),
            msg("assistant", "", serde_json::json!({})),
            msg(
                "assistant",
                "Checking.",
                serde_json::json!({"tool_calls": [{"id": "c"}]}),
            ),
            msg("tool", "42", serde_json::json!({})),
        ] {
            let (rest, prefill) = split_prefill(vec![user.clone(), last.clone()]).unwrap();
            assert_eq!((rest.len(), prefill), (2, None), "{last:?}");
        }
        // Calls given as null or none are no calls.
        let (_, prefill) = split_prefill(vec![
            user.clone(),
            msg("assistant", "So", serde_json::json!({"tool_calls": null})),
        ])
        .unwrap();
        assert_eq!(prefill.as_deref(), Some("So"));
        // An answer given as text parts is continued with its parts a blank line apart.
        let parts = parse_messages(vec![serde_json::json!({"role": "assistant", "content": [
            {"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]})])
        .unwrap()
        .messages;
        let (_, prefill) = split_prefill([vec![user.clone()], parts].concat()).unwrap();
        assert_eq!(prefill.as_deref(), Some("Wh\n\nill"));
        // An answer to continue after another answer: refused, as llama-server does.
        let two = split_prefill(vec![
            user,
            msg("assistant", "One.", serde_json::json!({})),
            msg("assistant", "Two", serde_json::json!({})),
        ]);
        assert!(two.is_err());
    }

    #[test]
    fn normalize_gives_unit_length() {
        let v = l2_normalize(vec![3.0, 4.0]);
        assert_eq!(v, vec![0.6, 0.8]);
        assert_eq!(l2_normalize(vec![0.0, 0.0]), vec![0.0, 0.0]);
    }

    #[test]
    fn timestamps() {
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::new(1_795_980_200, 5);
        assert_eq!(rfc3339(t), "2026-11-29T19:23:20.000000005Z");
    }

    #[test]
    fn messages_accept_strings_and_text_and_image_parts() {
        let m = parse_messages(vec![
            serde_json::json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
            serde_json::json!({"role": "assistant", "content": null, "name": "x"}),
        ])
        .unwrap()
        .messages;
        assert_eq!(m[0].content, "a\nb");
        assert_eq!(m[0].parts, ["a", "b"]);
        assert_eq!(m[1].content, "");
        assert_eq!(m[1].extra["name"], "x");
        let m = parse_messages(vec![
            serde_json::json!({"role": "user", "content": "x", "tool_calls": null, "images": null}),
        ])
        .unwrap()
        .messages;
        assert!(m[0].extra.is_empty());
        // An image part is a marker where it was; a message's images go before its text.
        let chat = parse_messages(vec![
            serde_json::json!({"role": "user", "content": [
                {"type": "text", "text": "a "},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": " b"},
            ]}),
            serde_json::json!({"role": "user", "content": "c", "images": ["QUJD"]}),
        ])
        .unwrap();
        assert_eq!(chat.messages[0].content, "a <__media__> b");
        assert!(chat.messages[0].parts.is_empty());
        assert_eq!(chat.messages[1].content, "<__media__>c");
        assert!(!chat.messages[1].extra.contains_key("images"));
        assert_eq!(
            chat.images,
            vec![
                ImageSource::Url("data:image/png;base64,AAAA".into()),
                ImageSource::Base64("QUJD".into())
            ]
        );
        for bad in [
            serde_json::json!({"role": "user", "content": [{"type": "image_url"}]}),
            serde_json::json!({"role": "user", "content": [{"type": "image_url", "image_url": 5}]}),
            serde_json::json!({"role": "user", "content": "x", "images": "QUJD"}),
            serde_json::json!({"role": "user", "content": "x", "images": [1]}),
        ] {
            let e = parse_messages(vec![bad.clone()]).unwrap_err();
            assert_eq!(e.kind(), "invalid_image", "{bad}: {e}");
        }
        assert!(parse_messages(vec![serde_json::json!({"content": "x"})]).is_err());
        assert!(parse_messages(vec![]).is_err());
    }
}
