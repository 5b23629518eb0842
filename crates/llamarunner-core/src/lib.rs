//! llamarunner's core: a single-model LLM runner over llama.cpp with continuous batching, KV
//! cache slots and an HTTP API. No Python here; `llamarunner-py` wraps `Runner`.

pub mod chat;
pub mod config;
pub mod constrain;
pub mod engine;
pub mod kv;
pub mod runner;
pub mod sched;
pub mod server;

pub use config::RunnerConfig;
pub use runner::{Runner, StartError};
