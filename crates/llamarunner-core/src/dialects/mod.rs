//! The wire formats: each dialect turns its requests into checked engine requests (through
//! `requests/`) and the engine's events into its responses, and nothing else.
//!
//! - `native.rs`: the runner's own (`/completion`, `/embedding`);
//! - `openai.rs`: OpenAI's chat completions, completions, embeddings and models;
//! - `ollama.rs`: Ollama's `/api/*`;
//! - `anthropic.rs`: Anthropic's Messages API (`/v1/messages`, its token count);
//! - `stream_json.rs`: the JSON of streamed lines, safe for every line reader.

pub mod anthropic;
pub mod native;
pub mod ollama;
pub mod openai;
pub mod stream_json;
