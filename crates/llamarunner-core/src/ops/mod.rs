//! Operator routes: the slot table's actions and slot files (`slots.rs`, `slot_file.rs`), LoRA
//! adapters and their scales (`lora.rs`), Prometheus metrics (`metrics.rs`).

pub mod lora;
pub mod metrics;
pub mod slot_file;
pub mod slots;
