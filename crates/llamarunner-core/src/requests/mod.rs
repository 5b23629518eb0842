//! The one validation layer: every limit is checked here, before a request reaches the queue.
//!
//! - `validate/`: sampling options, prompts fitted into a slot, grammars compiled, the bounded
//!   blocking pool;
//! - `options.rs`: Ollama's `options` object; `format.rs`: `format` / `response_format`;
//! - `images.rs`, `image_prompt.rs`: images decoded, counted and placed in prompts;
//! - `lora.rs`: a request's LoRA scales;
//! - `rerank.rs`: a reranker's query-document pairs; `embed_input.rs`: inputs to embed given
//!   as token ids;
//! - `keyed.rs`: a request's prompt as its dialect reads it (for its routing key);
//! - `tool_calls.rs`: tool definitions, their call grammars and the calls read from output;
//! - `common.rs`: what every dialect's handler does (readiness, the model name, chat prompts,
//!   starting and collecting a generation, embeddings).

pub mod common;
pub mod embed_input;
pub mod format;
pub mod image_prompt;
pub mod images;
pub mod infill;
pub mod keyed;
pub mod lora;
pub mod options;
pub mod rerank;
pub mod thinking;
pub mod tool_calls;
pub mod validate;
