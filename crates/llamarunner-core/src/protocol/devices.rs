//! Where a model runs: the compute devices llama.cpp found, their memory, and how many of the
//! model's layers (and bytes of weights) went to a GPU. The backend (`backend/llama/devices.rs`)
//! fills it once at load; `/props`, Ollama's `/api/ps` (`size_vram`) and `/metrics` read it.

use serde::{Deserialize, Serialize};

/// What kind of device llama.cpp says it is (named by `as_str` in `/props` and `/metrics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// The host's CPU.
    #[default]
    Cpu,
    /// A discrete GPU.
    Gpu,
    /// A GPU that shares the host's memory.
    IntegratedGpu,
    /// An accelerator that runs beside the CPU (BLAS, AMX, ...).
    Accelerator,
    /// A type this build does not know.
    #[serde(other)]
    Unknown,
}

impl DeviceKind {
    /// Whether model layers are offloaded to it (llama.cpp offloads to GPUs only).
    pub fn is_gpu(self) -> bool {
        matches!(self, Self::Gpu | Self::IntegratedGpu)
    }

    /// Its name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Gpu => "gpu",
            Self::IntegratedGpu => "integrated_gpu",
            Self::Accelerator => "accelerator",
            Self::Unknown => "unknown",
        }
    }
}

/// One compute device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    /// llama.cpp's name for it ("CPU", "CUDA0", "Vulkan0").
    pub name: String,
    /// What it is ("NVIDIA H200", the CPU's model name).
    pub description: String,
    /// The backend that drives it ("CPU", "CUDA", "Vulkan").
    pub backend: String,
    /// Its kind.
    pub kind: DeviceKind,
    /// Free memory in bytes, when the model was loaded.
    pub memory_free: u64,
    /// Total memory in bytes.
    pub memory_total: u64,
}

/// What the fit before load chose (`backend/llama/placement.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fit {
    /// MiB of each GPU's free memory it left unused (`--fit-target`).
    pub margin_mib: u64,
    /// The layers it offloads (-1: all; an explicit `--n-gpu-layers` it checked).
    pub n_gpu_layers: i32,
    /// False when not even one layer fit, and the model runs on the CPU.
    pub fits: bool,
    /// MiB of the main GPU it kept for what loads beside the model there: the draft model
    /// (`--draft-model`: weights, KV cache, compute buffers) and the vision projector
    /// (`--mmproj`); and for what `--backend-sampling`'s cuts add to the compute buffer.
    #[serde(default)]
    pub reserved_mib: u64,
}

impl Fit {
    /// A fit's outcome.
    pub fn new(margin_mib: u64, n_gpu_layers: i32, fits: bool) -> Self {
        Self {
            margin_mib,
            n_gpu_layers,
            fits,
            reserved_mib: 0,
        }
    }

    /// The same, having kept `reserved_mib` of the main GPU (`reserved_mib`).
    pub fn with_reserved(self, reserved_mib: u64) -> Self {
        Self {
            reserved_mib,
            ..self
        }
    }
}

/// The devices of a loaded model and what it placed on them (read back from an engine's
/// `/props` by the many-model router).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DeviceFacts {
    /// The backend that runs the model's offloaded layers; "CPU" when none is offloaded.
    pub backend: String,
    /// Every device llama.cpp found, the CPU included.
    pub devices: Vec<Device>,
    /// Layers placed on GPUs, of `layers_total`.
    pub layers_offloaded: u32,
    /// The model's layers as llama.cpp offloads them: its blocks and the output layer.
    pub layers_total: u32,
    /// How layers are spread over several GPUs (`--split-mode`).
    pub split_mode: String,
    /// What the fit before load chose; None when it did not run (no GPU, or `--no-fit`).
    pub fit: Option<Fit>,
    /// Bytes of the model's weights on GPUs: the weights' size in proportion to the layers
    /// offloaded (llama.cpp does not report it per device through the bindings). An estimate:
    /// it counts the token embedding, which llama.cpp keeps on the CPU, and not the KV cache.
    pub vram_bytes: u64,
}

impl DeviceFacts {
    /// A model on the CPU alone (the fake backend's, and a build without GPU backends).
    pub fn cpu_only(layers_total: u32) -> Self {
        Self {
            backend: "CPU".into(),
            devices: vec![Device {
                name: "CPU".into(),
                backend: "CPU".into(),
                ..Device::default()
            }],
            layers_offloaded: 0,
            layers_total,
            split_mode: "layer".into(),
            fit: None,
            vram_bytes: 0,
        }
    }

    /// Layers a load with `n_gpu_layers` (-1: all) puts on GPUs, with `gpus` GPU devices and
    /// `layers_total` layers (llama.cpp's rule: none without a GPU, else at most every layer).
    pub fn offloaded(n_gpu_layers: i32, gpus: usize, layers_total: u32) -> u32 {
        if gpus == 0 {
            return 0;
        }
        u32::try_from(n_gpu_layers).map_or(layers_total, |n| n.min(layers_total))
    }

    /// Where the layers run, as text that changes with what a decode step costs: the backend,
    /// the layers offloaded, the split and each device's name (not its free memory).
    pub fn placement(&self) -> String {
        let devices: Vec<String> = self
            .devices
            .iter()
            .map(|d| format!("{} ({})", d.name, d.description))
            .collect();
        format!(
            "{} {}/{} layers, split {}, on {}",
            self.backend,
            self.layers_offloaded,
            self.layers_total,
            self.split_mode,
            devices.join(", ")
        )
    }

    /// The GPU share of `model_bytes` with `offloaded` of `total` layers there.
    pub fn share(model_bytes: u64, offloaded: u32, total: u32) -> u64 {
        if total == 0 {
            return 0;
        }
        let bytes = u128::from(model_bytes) * u128::from(offloaded) / u128::from(total);
        u64::try_from(bytes).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::{Device, DeviceFacts, DeviceKind, Fit};

    #[test]
    fn facts_read_back_as_props_wrote_them() {
        let facts = DeviceFacts {
            backend: "Vulkan".into(),
            devices: vec![
                Device {
                    name: "Vulkan0".into(),
                    description: "llvmpipe".into(),
                    backend: "Vulkan".into(),
                    kind: DeviceKind::IntegratedGpu,
                    memory_free: 1 << 30,
                    memory_total: 2 << 30,
                },
                DeviceFacts::cpu_only(1).devices.remove(0),
            ],
            layers_offloaded: 3,
            layers_total: 5,
            split_mode: "layer".into(),
            fit: Some(Fit::new(1024, 3, true)),
            vram_bytes: 12345,
        };
        let json = serde_json::to_value(&facts).expect("serializes");
        assert_eq!(json["devices"][0]["kind"], "integrated_gpu");
        let back: DeviceFacts = serde_json::from_value(json).expect("reads back");
        assert_eq!(back, facts);
        // A kind of a newer engine, and fields left out, still read.
        let newer: DeviceFacts = serde_json::from_value(serde_json::json!({
            "devices": [{"name": "X0", "description": "", "backend": "X", "kind": "npu",
                         "memory_free": 0, "memory_total": 0}],
            "vram_bytes": 7,
        }))
        .expect("reads");
        assert_eq!(newer.devices[0].kind, DeviceKind::Unknown);
        assert_eq!((newer.vram_bytes, newer.layers_offloaded), (7, 0));
    }

    #[test]
    fn no_gpu_offloads_nothing_and_all_means_every_layer() {
        assert_eq!(DeviceFacts::offloaded(-1, 0, 19), 0);
        assert_eq!(DeviceFacts::offloaded(99, 0, 19), 0);
        assert_eq!(DeviceFacts::offloaded(-1, 1, 19), 19);
        assert_eq!(DeviceFacts::offloaded(99, 2, 19), 19);
        assert_eq!(DeviceFacts::offloaded(7, 1, 19), 7);
        assert_eq!(DeviceFacts::offloaded(0, 1, 19), 0);
    }

    #[test]
    fn the_gpu_share_is_proportional_to_the_layers() {
        assert_eq!(DeviceFacts::share(1000, 0, 10), 0);
        assert_eq!(DeviceFacts::share(1000, 10, 10), 1000);
        assert_eq!(DeviceFacts::share(1000, 5, 10), 500);
        assert_eq!(DeviceFacts::share(u64::MAX, 3, 3), u64::MAX);
        assert_eq!(DeviceFacts::share(1000, 1, 0), 0);
    }
}
