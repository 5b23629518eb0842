//! The engine: the one OS thread that owns llama.cpp, and the handle the HTTP side uses to reach
//! it. `Backend` is the narrow surface the scheduler needs from llama.cpp, so that `sched/` can
//! be tested against `fake::FakeBackend`. Only `llama.rs` touches `llama-cpp-2`.
//!
//! - `backend.rs`: the `Backend` trait and its token/batch types;
//! - `protocol.rs`: requests, events, results and errors exchanged with the HTTP side;
//! - `model.rs`: the model description, load state and slot table (`Health`);
//! - `handle.rs`: `EngineHandle` (HTTP side) and `EngineInbox` (engine side);
//! - `cpu_backends.rs` (portable builds only): finds and loads the CPU variant that fits;
//! - `lora.rs`: `--lora` specs and the LoRA scale set a sequence is decoded under;
//! - `observer.rs`: `EngineObserver`, what the loop reports to the metrics;
//! - `vision.rs`: images through a vision projector (`--mmproj`), as token lists hold them;
//! - `mtmd_llama.rs`: the projector on llama.cpp's `mtmd`.

pub mod backend;
#[cfg(feature = "portable")]
mod cpu_backends;
pub mod fake;
pub mod handle;
#[cfg(feature = "llama")]
pub mod llama;
pub mod lora;
#[cfg(feature = "llama")]
mod lora_llama;
pub mod model;
#[cfg(feature = "llama")]
mod mtmd_llama;
pub mod observer;
pub mod protocol;
pub mod vision;

/// The `llama-cpp-2` crate this build is pinned to (`=` in the workspace's Cargo.toml; a
/// test keeps the two equal), for `GET /props`.
pub const LLAMA_CPP_2_VERSION: &str = "0.1.154";

pub use backend::{Backend, BackendError, BatchToken, Token};
pub use handle::{EngineHandle, EngineInbox, SubmitError};
pub use lora::{LoraScales, LoraSpec};
pub use model::{
    file_type_name, Health, LoadState, ModelInfo, SlotActivity, SlotInfo, SlotPhase, TextModel,
};
pub use observer::{EngineObserver, NoObserver};
pub use protocol::*;
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
