//! The devices llama.cpp found (the CPU, and the GPUs of whatever backends it loaded) and what
//! a loaded model placed on them, as `DeviceFacts`.

use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::{list_llama_ggml_backend_devices, LlamaBackendDeviceType};

use crate::protocol::devices::{Device, DeviceFacts, DeviceKind};

use super::placement::Placement;

/// Every device of every loaded backend, with its memory now.
pub(super) fn devices() -> Vec<Device> {
    list_llama_ggml_backend_devices()
        .into_iter()
        .map(|d| Device {
            name: d.name,
            description: d.description,
            backend: d.backend,
            kind: match d.device_type {
                LlamaBackendDeviceType::Cpu => DeviceKind::Cpu,
                LlamaBackendDeviceType::Gpu => DeviceKind::Gpu,
                LlamaBackendDeviceType::IntegratedGpu => DeviceKind::IntegratedGpu,
                LlamaBackendDeviceType::Accelerator => DeviceKind::Accelerator,
                LlamaBackendDeviceType::Unknown => DeviceKind::Unknown,
            },
            memory_free: u64::try_from(d.memory_free).unwrap_or(u64::MAX),
            memory_total: u64::try_from(d.memory_total).unwrap_or(u64::MAX),
        })
        .collect()
}

/// What a model loaded with `placement` put on its devices (as listed before it loaded: their
/// free memory then).
pub(super) fn facts(model: &LlamaModel, placement: Placement) -> DeviceFacts {
    let Placement {
        devices,
        n_gpu_layers,
        split_mode,
        fit,
    } = placement;
    let gpus: Vec<&Device> = devices.iter().filter(|d| d.kind.is_gpu()).collect();
    // llama.cpp offloads the blocks and then the output layer. The blocks are all of the
    // GGUF's (`{arch}.block_count`), multi-token-prediction ones included, which
    // `llama_model_n_layer` leaves out.
    let blocks = model
        .meta_val_str("general.architecture")
        .ok()
        .and_then(|arch| model.meta_val_str(&format!("{arch}.block_count")).ok())
        .and_then(|n| n.trim().parse::<u32>().ok())
        .unwrap_or_else(|| model.n_layer());
    let layers_total = blocks.saturating_add(1);
    let layers_offloaded = DeviceFacts::offloaded(n_gpu_layers, gpus.len(), layers_total);
    let backend = match gpus.first() {
        Some(gpu) if layers_offloaded > 0 => gpu.backend.clone(),
        _ => "CPU".to_string(),
    };
    DeviceFacts {
        backend,
        vram_bytes: DeviceFacts::share(model.size(), layers_offloaded, layers_total),
        devices,
        layers_offloaded,
        layers_total,
        split_mode: split_mode.as_str().to_string(),
        fit,
    }
}
