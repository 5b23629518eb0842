//! Operator routes: the slot table, its actions and slot files (`slots.rs`, `slot_file.rs`),
//! LoRA adapters and their scales (`lora.rs`), Prometheus metrics (`metrics.rs`), health and
//! props (`props.rs`), the tokenizer and chat template (`tokenizer.rs`).

pub mod lora;
pub mod metrics;
pub mod props;
pub mod slot_file;
pub mod slots;
pub mod tokenizer;
