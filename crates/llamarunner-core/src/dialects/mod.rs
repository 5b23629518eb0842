//! The wire formats: each dialect turns its requests into checked engine requests (through
//! `requests/`) and the engine's events into its responses, and nothing else.
//!
//! - `native.rs`: the runner's own (`/completion`, `/embedding`);
//! - `infill.rs`: llama-server's fill-in-the-middle route for editors (`/infill`);
//! - `openai/`: OpenAI's chat completions, completions, embeddings and models;
//! - `ollama/`: Ollama's `/api/*` (generate, chat, embeddings, the model listings);
//! - `anthropic/`: Anthropic's Messages API (`/v1/messages`, its token count);
//! - `responses/`: OpenAI's Responses API (`/v1/responses`; the responses it keeps for
//!   `previous_response_id` are in `http/response_store.rs`, beside the other shared state);
//! - `rerank.rs`: reranking documents against a query (`/v1/rerank`, Jina's, Cohere's and
//!   TEI's shapes) for reranker models;
//! - `stream_json.rs`: the JSON of streamed lines, safe for every line reader;
//! - `routing_key.rs`: a request's routing key for a router of many servers (Ray's), from
//!   each dialect's own reading of its body.

pub mod anthropic;
pub mod blocks;
mod floats;
pub mod infill;
pub mod llama_server;
pub mod native;
pub mod ollama;
pub mod openai;
pub mod rerank;
pub mod responses;
pub mod routing_key;
pub mod stream_json;
