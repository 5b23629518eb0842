//! What the HTTP side and the engine thread say to each other, with no llama.cpp and no HTTP:
//!
//! - `messages.rs`: requests, events, results and errors;
//! - `params.rs`: a generation's checked sampling parameters;
//! - `handle.rs`: `EngineHandle` (HTTP side) and `EngineInbox` (engine side);
//! - `model.rs`: the model's facts, load state and slot table (`Health`), `TextModel`;
//! - `lora.rs`: `--lora` specs, the loaded adapters' table, a sequence's LoRA scale set;
//! - `observer.rs`: `EngineObserver`, what the loop reports to the metrics;
//! - `vision.rs`: images as prompts and token lists hold them, `VisionModel`;
//! - `devices.rs`: the devices a model runs on and the layers it placed there (`DeviceFacts`);
//! - `memory_estimate.rs`: what a model will take once loaded, from its GGUF header (the
//!   router's `--models-memory`, and what a draft model reserves in the fit before a load).

pub mod devices;
pub mod handle;
pub mod lora;
pub mod memory_estimate;
pub mod messages;
pub mod model;
pub mod observer;
pub mod params;
pub mod vision;

/// The `llama-cpp-2` crate this build is pinned to (`=` in the workspace's Cargo.toml; a
/// test keeps the two equal), for `GET /props`.
pub const LLAMA_CPP_2_VERSION: &str = "0.1.160";

/// A vocabulary token id.
pub type Token = i32;

/// Failures of the llama.cpp layer.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum BackendError {
    /// The text could not be tokenized.
    #[error("tokenization failed: {0}")]
    Tokenize(String),
    /// The sampler could not be built from the request's parameters.
    #[error("{0}")]
    Sampler(String),
    /// llama.cpp found no room in the KV cache for the batch.
    #[error("no KV cache slot available for the batch")]
    NoKvSlot,
    /// Any other decode failure.
    #[error("llama_decode failed: {0}")]
    Decode(String),
    /// llama.cpp threw a C++ exception out of a decode (caught: `backend/llama/guarded_decode.rs`).
    #[error("llama.cpp threw in a decode: {0}")]
    Threw(String),
    /// A sequence's state could not be copied out or in.
    #[error("{0}")]
    State(String),
}

/// A duration in nanoseconds (saturating), as the wire formats report durations.
pub fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

pub use handle::{EngineHandle, EngineInbox, QueueGauge, SubmitError};
pub use lora::{LoraScales, LoraSpec};
pub use messages::*;
pub use model::{
    file_type_name, Health, LoadState, ModelInfo, SlotActivity, SlotInfo, SlotPhase, TextModel,
};
pub use observer::{EngineObserver, NoObserver};
pub use vision::{ImageInput, PromptImage, VisionModel};

#[cfg(test)]
mod tests {
    #[test]
    fn the_llama_cpp_2_version_is_the_pinned_one() {
        let manifest = include_str!("../../../../Cargo.toml");
        let pin = format!(
            "llama-cpp-2 = {{ version = \"={}\"",
            super::LLAMA_CPP_2_VERSION
        );
        assert!(manifest.contains(&pin), "Cargo.toml does not pin {pin}");
    }
}
