//! llamarunner's core: a single-model LLM runner over llama.cpp with continuous batching, KV
//! cache slots and an HTTP API. No Python here; `llamarunner-py` wraps `Runner`.
//!
//! The layout (docs/architecture.md; `tests/layout.rs` enforces its import rules):
//! `protocol/` what HTTP and the engine say to each other; `engine/` the engine thread;
//! `sched/` the batching loop; `kv/` slot bookkeeping; `backend/` llama.cpp and the fake;
//! `constrain/` grammars; `chat/` templates and tool-call formats; `http/` plumbing;
//! `dialects/` wire formats; `requests/` validation; `ops/` operator routes; `routes.rs` the
//! route table; `runner.rs` puts them together.

pub mod backend;
pub mod chat;
pub mod config;
pub mod constrain;
pub mod dialects;
pub mod engine;
pub mod http;
pub mod kv;
pub mod ops;
pub mod protocol;
pub mod requests;
pub mod router;
pub mod routes;
pub mod runner;
pub mod sched;

pub use config::RunnerConfig;
pub use runner::{Runner, StartError};
