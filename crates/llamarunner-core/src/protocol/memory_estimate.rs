//! How much memory a model will take once loaded, estimated before loading it, from its
//! GGUF header and the settings it is served with (`--models-memory`).
//!
//! The estimate is the weights (the model file, its projector and draft model files: mapped
//! and read whole), the KV cache of every slot (layers x context x KV heads x (key + value
//! length) x the cache type's bytes), llama.cpp's compute buffers (a micro-batch's
//! activations and the logits of one token per slot), the prompt cache's budget
//! (`--cache-ram`) and the engine process's own (`ENGINE_PROCESS`). Sliding-window layers
//! (Gemma 2 and 3, Cohere 2, gpt-oss) are counted with the cells llama.cpp gives them, the
//! window and a micro-batch per slot, unless `--swa-full`; where the header does not say which
//! layers slide (another architecture with a window), every layer is counted with the whole
//! context, which errs high.
//!
//! That is host memory for a model on the CPU. Once an engine has loaded its model, the
//! router reads where the layers went (`DeviceFacts`, the engine's `/props`) and counts only
//! what stayed in host memory (`Estimate::on_host`); the GPUs' memory is budgeted apart, by
//! each engine's fit before load, which sizes the offload to the memory the devices have free
//! (so what other engines hold on a GPU is already counted there).

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

/// What the header says about the model's shape.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shape {
    /// `general.architecture`.
    pub architecture: String,
    /// Layers (`{arch}.block_count`).
    pub layers: u64,
    /// Embedding width (`{arch}.embedding_length`).
    pub embd: u64,
    /// Attention heads.
    pub heads: u64,
    /// KV heads (the largest, when given per layer); `heads` when absent.
    pub kv_heads: u64,
    /// Key and value widths per head; `embd / heads` when absent.
    pub key_len: u64,
    /// See `key_len`.
    pub value_len: u64,
    /// Tokens in the vocabulary (`tokenizer.ggml.tokens`).
    pub vocab: u64,
    /// Tokens a sliding-window layer attends to (`{arch}.attention.sliding_window`); 0 when
    /// none slides.
    pub window: u64,
    /// How many layers slide, for the architectures of `WINDOW_PERIODS`: from
    /// `{arch}.attention.sliding_window_pattern` (a flag per layer, or a period) or the
    /// architecture's own period, as llama.cpp's `load_swa_pattern` reads them; 0 for any other
    /// (every layer is then counted as a full one, as llama.cpp may size them).
    pub window_layers: u64,
    /// Bytes of the token embedding (`token_embd.weight`), which llama.cpp keeps in host
    /// memory whatever is offloaded; 0 when the header does not list it or its type is not
    /// one this reader sizes.
    pub token_embd_bytes: u64,
}

/// The architectures whose sliding-window layers are counted, with their period where the
/// header gives none (llama.cpp's `load_swa_pattern` defaults): in each period, all layers
/// but the last slide (none of these has the full layer first).
const WINDOW_PERIODS: [(&str, u64); 5] = [
    ("gemma2", 2),
    ("gemma3", 6),
    ("gemma3n", 5),
    ("cohere2", 4),
    ("gpt-oss", 2),
];

/// Layers of `layers` that slide when all but the last of each `period` do (0: all slide).
fn sliding_in_period(layers: u64, period: u64) -> u64 {
    match period {
        0 => layers,
        p => layers / p * (p - 1) + (layers % p).min(p - 1),
    }
}

/// The settings that size a loaded model (a `RunnerConfig`'s).
#[derive(Clone, Debug)]
pub struct Served<'a> {
    /// Tokens per slot (`--ctx-size`).
    pub ctx_size: u64,
    /// Slots (`--parallel`).
    pub parallel: u64,
    /// Tokens per batch (`--batch-size`).
    pub batch_size: u64,
    /// `--kv-cache-type`.
    pub kv_cache_type: &'a str,
    /// The prompt cache's budget in bytes (`--cache-ram`; 0 when off).
    pub cache_ram_bytes: u64,
    /// Files read besides the model: projector, draft model.
    pub extra_files: Vec<&'a Path>,
    /// `--swa-full`: sliding-window layers keep the whole context.
    pub swa_full: bool,
}

/// llama.cpp pads cache sizes to this many cells.
const CELL_PAD: u64 = 256;

fn pad_cells(n: u64) -> u64 {
    n.div_ceil(CELL_PAD).saturating_mul(CELL_PAD)
}

/// What an engine process takes before any model: the interpreter and llama.cpp's libraries
/// (about 45 MiB measured for a tiny model's engine).
pub const ENGINE_PROCESS: u64 = 64 << 20;

/// The longest header read: past it the file is not a model we can size.
const MAX_HEADER: u64 = 256 << 20;
/// The longest string or array in a header.
const MAX_ITEMS: u64 = 16 << 20;

/// Reads the shape from a GGUF file's header. Errors say why the file cannot be sized.
pub fn read_shape(path: &Path) -> Result<Shape, String> {
    let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut r = Header {
        inner: BufReader::new(file).take(MAX_HEADER),
    };
    parse(&mut r).map_err(|e| format!("{}: not a GGUF model header ({e})", path.display()))
}

/// An estimate with the parts of it that may go to a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Estimate {
    /// Everything, as if the model ran on the CPU alone.
    pub total: u64,
    /// The model file's weights.
    pub weights: u64,
    /// The KV cache of every slot.
    pub kv: u64,
    /// Of the weights, those llama.cpp keeps in host memory whatever is offloaded (the token
    /// embedding).
    pub host_weights: u64,
    /// The compute buffers: a micro-batch's activations and the logits.
    pub compute: u64,
}

impl Estimate {
    /// What the model takes on a GPU that holds all its layers: the weights less the token
    /// embedding, the KV cache and the compute buffers (a draft model's share of a GPU,
    /// which the fit of the model it drafts for leaves free).
    pub fn on_device(&self) -> u64 {
        self.weights
            .saturating_sub(self.host_weights)
            .saturating_add(self.kv)
            .saturating_add(self.compute)
    }

    /// What stays in host memory once the engine has placed the model (`DeviceFacts`, from
    /// its `/props`): the share of the weights on the layers it put on discrete GPUs leaves
    /// (the token embedding stays), and the KV cache of those layers (llama.cpp keeps a
    /// layer's cache beside its weights). The compute buffers and the rest stay counted, which
    /// errs high. A GPU that shares the host's memory (integrated) frees none of it.
    pub fn on_host(&self, facts: &crate::protocol::devices::DeviceFacts) -> u64 {
        use crate::protocol::devices::DeviceKind;
        let mut gpus = facts
            .devices
            .iter()
            .filter(|d| d.backend == facts.backend && d.kind.is_gpu())
            .peekable();
        let discrete = gpus.peek().is_some() && gpus.all(|d| d.kind == DeviceKind::Gpu);
        if !discrete || facts.layers_offloaded == 0 || facts.layers_total == 0 {
            return self.total;
        }
        let offloaded = u128::from(facts.layers_offloaded.min(facts.layers_total));
        let share = |bytes: u64| {
            let part = u128::from(bytes) * offloaded / u128::from(facts.layers_total);
            u64::try_from(part).unwrap_or(bytes)
        };
        let layer_weights = self.weights.saturating_sub(self.host_weights);
        self.total
            .saturating_sub(share(layer_weights))
            .saturating_sub(share(self.kv))
    }
}

/// The estimate for the draft model at `path`, served beside a model served with `served` (the
/// same context, slots and micro-batch; its context keeps every cell, and it has no prompt
/// cache or files of its own). Errors say why its header cannot be sized.
pub fn draft(path: &Path, served: &Served<'_>) -> Result<Estimate, String> {
    let shape = read_shape(path)?;
    let bytes = std::fs::metadata(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    let served = Served {
        cache_ram_bytes: 0,
        extra_files: Vec::new(),
        swa_full: true,
        ..served.clone()
    };
    Ok(breakdown(&shape, bytes, &served))
}

/// The estimate for a model of this shape and file size served with `served`, in parts.
pub fn breakdown(shape: &Shape, model_bytes: u64, served: &Served<'_>) -> Estimate {
    let extra: u64 = served
        .extra_files
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    let parallel = served.parallel.max(1);
    let cells = served.ctx_size.saturating_mul(parallel);
    // Each slot has its own stream of cells (llama.cpp's non-unified cache): the context,
    // padded, for a full layer; the window and a micro-batch, padded, for a sliding one.
    let slot_cells = pad_cells(served.ctx_size);
    let window_layers = if served.swa_full || shape.window == 0 {
        0
    } else {
        shape.window_layers.min(shape.layers)
    };
    let window_cells = pad_cells(shape.window.saturating_add(served.batch_size)).min(slot_cells);
    let layer_cells = (shape.layers - window_layers)
        .saturating_mul(slot_cells)
        .saturating_add(window_layers.saturating_mul(window_cells))
        .saturating_mul(parallel);
    let per_layer_cell = shape
        .kv_heads
        .saturating_mul(shape.key_len.saturating_add(shape.value_len));
    // Bytes per element, in 32nds (q8_0: 34 bytes per 32, q4_0: 18 per 32).
    let elem_32ths: u64 = match served.kv_cache_type {
        "f32" => 128,
        "q8_0" => 34,
        "q4_0" | "q4_1" | "iq4_nl" => 18,
        "q5_0" | "q5_1" => 22,
        _ => 64, // f16, bf16
    };
    let kv = layer_cells
        .saturating_mul(per_layer_cell)
        .saturating_mul(elem_32ths)
        / 32;
    let ubatch = served.batch_size.clamp(1, 512).min(cells.max(1));
    // Activations of a micro-batch (a few embedding-wide f32 tensors per token, and the
    // attention scores of a token against the context) and one row of logits per slot.
    let activations = ubatch.saturating_mul(
        shape.embd.saturating_mul(4 * 16).saturating_add(
            served
                .ctx_size
                .saturating_mul(shape.heads)
                .saturating_mul(4),
        ),
    );
    let logits = shape
        .vocab
        .saturating_mul(4)
        .saturating_mul(served.parallel.max(1).max(ubatch.min(8)));
    let total = ENGINE_PROCESS
        .saturating_add(model_bytes)
        .saturating_add(extra)
        .saturating_add(kv)
        .saturating_add(activations)
        .saturating_add(logits)
        .saturating_add(served.cache_ram_bytes);
    Estimate {
        total,
        weights: model_bytes,
        kv,
        host_weights: shape.token_embd_bytes.min(model_bytes),
        compute: activations.saturating_add(logits),
    }
}

struct Header<R: Read> {
    inner: std::io::Take<R>,
}

#[derive(Debug)]
enum Value {
    Int(u64),
    Str(String),
    /// An array: its length, its largest integer and how many of its integers are not 0.
    Array {
        count: u64,
        max: Option<u64>,
        nonzero: u64,
    },
    Other,
}

impl<R: Read> Header<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut b = [0u8; N];
        self.inner
            .read_exact(&mut b)
            .map_err(|_| "it ends early".to_string())?;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    fn skip(&mut self, n: u64) -> Result<(), String> {
        let copied = std::io::copy(&mut (&mut self.inner).take(n), &mut std::io::sink())
            .map_err(|e| e.to_string())?;
        if copied == n {
            Ok(())
        } else {
            Err("it ends early".into())
        }
    }
    fn string(&mut self) -> Result<String, String> {
        let len = self.u64()?;
        if len > MAX_ITEMS {
            return Err(format!("a string of {len} bytes"));
        }
        let mut buf = Vec::new();
        (&mut self.inner)
            .take(len)
            .read_to_end(&mut buf)
            .map_err(|e| e.to_string())?;
        if buf.len() as u64 != len {
            return Err("it ends early".into());
        }
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
    /// One value of type `kind`; integers as u64 (negative ones as 0).
    fn value(&mut self, kind: u32) -> Result<Value, String> {
        Ok(match kind {
            0 => Value::Int(u64::from(self.bytes::<1>()?[0])),
            1 => Value::Int(u64::try_from(i8::from_le_bytes(self.bytes()?)).unwrap_or(0)),
            2 => Value::Int(u64::from(u16::from_le_bytes(self.bytes()?))),
            3 => Value::Int(u64::try_from(i16::from_le_bytes(self.bytes()?)).unwrap_or(0)),
            4 => Value::Int(u64::from(self.u32()?)),
            5 => Value::Int(u64::try_from(i32::from_le_bytes(self.bytes()?)).unwrap_or(0)),
            6 => {
                self.skip(4)?;
                Value::Other
            }
            7 => Value::Int(u64::from(self.bytes::<1>()?[0] != 0)),
            8 => Value::Str(self.string()?),
            9 => {
                let item = self.u32()?;
                if item == 9 {
                    return Err("nested arrays".into());
                }
                let count = self.u64()?;
                if count > MAX_ITEMS {
                    return Err(format!("an array of {count} items"));
                }
                let mut max = None;
                let mut nonzero = 0;
                for _ in 0..count {
                    if let Value::Int(v) = self.value(item)? {
                        max = Some(max.map_or(v, |m: u64| m.max(v)));
                        nonzero += u64::from(v != 0);
                    }
                }
                Value::Array {
                    count,
                    max,
                    nonzero,
                }
            }
            10 => Value::Int(self.u64()?),
            11 => Value::Int(u64::try_from(i64::from_le_bytes(self.bytes()?)).unwrap_or(0)),
            12 => {
                self.skip(8)?;
                Value::Other
            }
            other => return Err(format!("a value of unknown type {other}")),
        })
    }
}

fn parse<R: Read>(r: &mut Header<R>) -> Result<Shape, String> {
    if &r.bytes::<4>()? != b"GGUF" {
        return Err("no GGUF magic".into());
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(format!("version {version}"));
    }
    let tensors = r.u64()?;
    let kvs = r.u64()?;
    if kvs > MAX_ITEMS {
        return Err(format!("{kvs} metadata entries"));
    }
    let mut values = std::collections::HashMap::new();
    for _ in 0..kvs {
        let key = r.string()?;
        let kind = r.u32()?;
        let value = r.value(kind)?;
        values.insert(key, value);
    }
    let arch = match values.get("general.architecture") {
        Some(Value::Str(a)) => a.clone(),
        _ => return Err("no general.architecture".into()),
    };
    let int = |name: &str| match values.get(&format!("{arch}.{name}")) {
        Some(Value::Int(v)) => Some(*v),
        Some(Value::Array { max, .. }) => *max,
        _ => None,
    };
    let layers = int("block_count").ok_or("no block_count")?;
    let embd = int("embedding_length").ok_or("no embedding_length")?;
    let heads = int("attention.head_count").unwrap_or(1).max(1);
    let kv_heads = int("attention.head_count_kv").unwrap_or(heads);
    let key_len = int("attention.key_length").unwrap_or(embd / heads);
    let value_len = int("attention.value_length").unwrap_or(embd / heads);
    let vocab = match values.get("tokenizer.ggml.tokens") {
        Some(Value::Array { count, .. }) => *count,
        _ => int("vocab_size").unwrap_or(0),
    };
    // Gemma 2 slides over 4,096 tokens when its header does not say.
    let window = int("attention.sliding_window")
        .or((arch == "gemma2").then_some(4096))
        .unwrap_or(0);
    let known = WINDOW_PERIODS.iter().find(|(a, _)| *a == arch);
    let window_layers = match (
        known,
        values.get(&format!("{arch}.attention.sliding_window_pattern")),
    ) {
        (None, _) => 0,
        (Some(_), Some(Value::Array { nonzero, .. })) => *nonzero,
        (Some(_), Some(Value::Int(period))) => sliding_in_period(layers, *period),
        (Some((_, period)), _) => sliding_in_period(layers, *period),
    };
    let token_embd_bytes = token_embd_bytes(r, tensors)?;
    Ok(Shape {
        token_embd_bytes,
        architecture: arch,
        layers,
        embd,
        heads,
        kv_heads,
        key_len,
        value_len,
        vocab,
        window,
        window_layers,
    })
}

/// The token embedding's bytes, from the tensor infos that follow the metadata (each: its
/// name, dimensions, ggml type and offset); read up to that tensor (llama.cpp's writers put it
/// first). 0 when it is not there or its type is not in `ggml_type_size`.
fn token_embd_bytes<R: Read>(r: &mut Header<R>, tensors: u64) -> Result<u64, String> {
    if tensors > MAX_ITEMS {
        return Err(format!("{tensors} tensors"));
    }
    for _ in 0..tensors {
        let name = r.string()?;
        let dims = r.u32()?;
        if dims > 8 {
            return Err(format!("a tensor of {dims} dimensions"));
        }
        let mut elements: u64 = 1;
        for _ in 0..dims {
            elements = elements.saturating_mul(r.u64()?);
        }
        let kind = r.u32()?;
        let _offset = r.u64()?;
        if name == "token_embd.weight" {
            return Ok(ggml_type_size(kind).map_or(0, |(bytes, block)| {
                u64::try_from(u128::from(elements) * u128::from(bytes) / u128::from(block))
                    .unwrap_or(u64::MAX)
            }));
        }
    }
    Ok(0)
}

/// A ggml type's bytes per block and elements per block (ggml.h's `ggml_type` numbering).
fn ggml_type_size(kind: u32) -> Option<(u64, u64)> {
    Some(match kind {
        0 => (4, 1),           // F32
        1 | 30 | 25 => (2, 1), // F16, BF16, I16
        2 | 20 => (18, 32),    // Q4_0, IQ4_NL
        3 => (20, 32),         // Q4_1
        6 => (22, 32),         // Q5_0
        7 => (24, 32),         // Q5_1
        8 => (34, 32),         // Q8_0
        9 => (36, 32),         // Q8_1
        10 => (84, 256),       // Q2_K
        11 | 21 => (110, 256), // Q3_K, IQ3_S
        12 => (144, 256),      // Q4_K
        13 => (176, 256),      // Q5_K
        14 => (210, 256),      // Q6_K
        15 => (292, 256),      // Q8_K
        16 | 35 => (66, 256),  // IQ2_XXS, TQ2_0
        17 => (74, 256),       // IQ2_XS
        18 => (98, 256),       // IQ3_XXS
        19 => (50, 256),       // IQ1_S
        22 => (82, 256),       // IQ2_S
        23 => (136, 256),      // IQ4_XS
        24 => (1, 1),          // I8
        26 => (4, 1),          // I32
        27 | 28 => (8, 1),     // I64, F64
        29 => (56, 256),       // IQ1_M
        34 => (54, 256),       // TQ1_0
        39 => (17, 32),        // MXFP4
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole estimate in bytes.
    fn estimate(shape: &Shape, model_bytes: u64, served: &Served<'_>) -> u64 {
        breakdown(shape, model_bytes, served).total
    }

    fn kv_str(out: &mut Vec<u8>, key: &str, value: &str) {
        out.extend((key.len() as u64).to_le_bytes());
        out.extend(key.as_bytes());
        out.extend(8u32.to_le_bytes());
        out.extend((value.len() as u64).to_le_bytes());
        out.extend(value.as_bytes());
    }

    fn kv_u32(out: &mut Vec<u8>, key: &str, value: u32) {
        out.extend((key.len() as u64).to_le_bytes());
        out.extend(key.as_bytes());
        out.extend(4u32.to_le_bytes());
        out.extend(value.to_le_bytes());
    }

    fn header() -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(0u64.to_le_bytes());
        out.extend(6u64.to_le_bytes());
        kv_str(&mut out, "general.architecture", "llama");
        kv_u32(&mut out, "llama.block_count", 4);
        kv_u32(&mut out, "llama.embedding_length", 64);
        kv_u32(&mut out, "llama.attention.head_count", 4);
        kv_u32(&mut out, "llama.attention.head_count_kv", 2);
        // tokenizer.ggml.tokens: an array of 3 strings.
        let key = "tokenizer.ggml.tokens";
        out.extend((key.len() as u64).to_le_bytes());
        out.extend(key.as_bytes());
        out.extend(9u32.to_le_bytes());
        out.extend(8u32.to_le_bytes());
        out.extend(3u64.to_le_bytes());
        for t in ["a", "bb", "c"] {
            out.extend((t.len() as u64).to_le_bytes());
            out.extend(t.as_bytes());
        }
        out
    }

    /// `header()` followed by two tensor infos: a layer's F32 weight, then the token
    /// embedding in Q8_0 (64 x 3 values).
    fn header_with_tensors() -> Vec<u8> {
        let mut out = header();
        out[8..16].copy_from_slice(&2u64.to_le_bytes());
        for (name, dims, kind) in [
            ("blk.0.attn_q.weight", [64u64, 64], 0u32),
            ("token_embd.weight", [64, 3], 8),
        ] {
            out.extend((name.len() as u64).to_le_bytes());
            out.extend(name.as_bytes());
            out.extend(2u32.to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(kind.to_le_bytes());
            out.extend(0u64.to_le_bytes());
        }
        out
    }

    fn shape_of(bytes: &[u8]) -> Result<Shape, String> {
        parse(&mut Header {
            inner: bytes.take(MAX_HEADER),
        })
    }

    #[test]
    fn the_shape_comes_from_the_header() {
        let shape = shape_of(&header()).expect("a header");
        assert_eq!(
            shape,
            Shape {
                architecture: "llama".into(),
                layers: 4,
                embd: 64,
                heads: 4,
                kv_heads: 2,
                key_len: 16,
                value_len: 16,
                vocab: 3,
                window: 0,
                window_layers: 0,
                token_embd_bytes: 0,
            }
        );
        let served = Served {
            ctx_size: 100,
            parallel: 2,
            batch_size: 512,
            kv_cache_type: "f16",
            cache_ram_bytes: 1000,
            extra_files: vec![],
            swa_full: false,
        };
        // KV: 2 slots x 256 cells (100, padded) x 4 layers x 2 heads x 32 x 2 bytes.
        let kv = 2 * 256 * 4 * 2 * 32 * 2;
        let rest = estimate(&shape, 0, &served) - kv - 1000 - ENGINE_PROCESS;
        assert!(rest > 0 && rest < 10 << 20, "{rest}");
        // What stays in host memory: all of it on the CPU; without the share of the weights
        // (all but the token embedding) and of the KV cache of the layers on a discrete GPU
        // (5 layers: 4 blocks and the output).
        use crate::protocol::devices::{Device, DeviceFacts, DeviceKind};
        let parts = Estimate {
            host_weights: 1_000_000,
            ..breakdown(&shape, 5_000_000, &served)
        };
        assert_eq!((parts.weights, parts.kv), (5_000_000, kv));
        // On a GPU holding every layer: the weights but the token embedding, the KV cache,
        // the compute buffers (everything but the process, the files and the prompt cache).
        assert_eq!(parts.compute, rest);
        assert_eq!(parts.on_device(), 4_000_000 + kv + rest);
        let cpu = DeviceFacts::cpu_only(5);
        assert_eq!(parts.on_host(&cpu), parts.total);
        let on = |kind: DeviceKind, layers: u32| DeviceFacts {
            backend: "CUDA".into(),
            devices: vec![
                Device {
                    name: "CUDA0".into(),
                    backend: "CUDA".into(),
                    kind,
                    ..Device::default()
                },
                cpu.devices[0].clone(),
            ],
            layers_offloaded: layers,
            vram_bytes: 1,
            ..cpu.clone()
        };
        assert_eq!(
            parts.on_host(&on(DeviceKind::Gpu, 5)),
            parts.total - 4_000_000 - kv
        );
        assert_eq!(
            parts.on_host(&on(DeviceKind::Gpu, 2)),
            parts.total - 4_000_000 * 2 / 5 - kv * 2 / 5
        );
        // A GPU that shares the host's memory frees none of it.
        assert_eq!(
            parts.on_host(&on(DeviceKind::IntegratedGpu, 5)),
            parts.total
        );
        // A hostile or mistaken report cannot make it lower than all of it offloaded.
        assert_eq!(
            parts.on_host(&on(DeviceKind::Gpu, 99)),
            parts.total - 4_000_000 - kv
        );
        // The token embedding's size comes from the tensor infos after the metadata.
        let with_tensors = header_with_tensors();
        // Q8_0: 34 bytes per 32 values.
        let sized = shape_of(&with_tensors).expect("a header with tensors");
        assert_eq!(sized.token_embd_bytes, 64 * 3 / 32 * 34);
        assert_eq!(breakdown(&sized, 10_000, &served).host_weights, 204);
        let q8 = Served {
            kv_cache_type: "q8_0",
            ..served.clone()
        };
        assert!(estimate(&shape, 0, &q8) < estimate(&shape, 0, &served));
    }

    /// A header of `arch` with 12 layers, 1 KV head of 256 + 256, and `extra` entries.
    fn windowed(arch: &str, extra: &[(&str, u32)], pattern: Option<&[bool]>) -> Shape {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(0u64.to_le_bytes());
        let n = 7 + extra.len() + usize::from(pattern.is_some());
        out.extend((n as u64).to_le_bytes());
        kv_str(&mut out, "general.architecture", arch);
        for (key, value) in [
            ("block_count", 12),
            ("embedding_length", 640),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 1),
            ("attention.key_length", 256),
            ("attention.value_length", 256),
        ] {
            kv_u32(&mut out, &format!("{arch}.{key}"), value);
        }
        for (key, value) in extra {
            kv_u32(&mut out, &format!("{arch}.{key}"), *value);
        }
        if let Some(flags) = pattern {
            let key = format!("{arch}.attention.sliding_window_pattern");
            out.extend((key.len() as u64).to_le_bytes());
            out.extend(key.as_bytes());
            out.extend(9u32.to_le_bytes());
            out.extend(7u32.to_le_bytes());
            out.extend((flags.len() as u64).to_le_bytes());
            out.extend(flags.iter().map(|f| u8::from(*f)));
        }
        shape_of(&out).expect("a header")
    }

    #[test]
    fn sliding_window_layers_are_counted_with_their_window() {
        let gemma3 = windowed("gemma3", &[("attention.sliding_window", 512)], None);
        // Five of each six layers slide (llama.cpp's period for Gemma 3).
        assert_eq!((gemma3.window, gemma3.window_layers), (512, 10));
        let served = Served {
            ctx_size: 8192,
            parallel: 4,
            batch_size: 512,
            kv_cache_type: "f16",
            cache_ram_bytes: 0,
            extra_files: vec![],
            swa_full: false,
        };
        // Per layer and cell: 1 head x (256 + 256) x 2 bytes. Full layers: 4 slots x 8192
        // cells; sliding ones: 4 slots x (512 + 512) cells, as llama.cpp sizes them.
        let cell = 512 * 2;
        let kv = (2 * 4 * 8192 + 10 * 4 * 1024) * cell;
        let full_kv = 12 * 4 * 8192 * cell;
        let windowed_total = estimate(&gemma3, 0, &served);
        let full = Served {
            swa_full: true,
            ..served.clone()
        };
        assert_eq!(estimate(&gemma3, 0, &full) - windowed_total, full_kv - kv);
        // A window wider than the context is the context.
        let short = Served {
            ctx_size: 300,
            ..served.clone()
        };
        let no_window = Shape {
            window: 0,
            ..gemma3.clone()
        };
        assert_eq!(
            estimate(&gemma3, 0, &short),
            estimate(&no_window, 0, &short)
        );

        // Gemma 3 without a window has none; Gemma 2 has 4,096 by default, every other
        // layer.
        let plain = windowed("gemma3", &[], None);
        assert_eq!((plain.window, plain.window_layers), (0, 10));
        assert_eq!(estimate(&plain, 0, &served), estimate(&gemma3, 0, &full));
        let gemma2 = windowed("gemma2", &[], None);
        assert_eq!((gemma2.window, gemma2.window_layers), (4096, 6));
        // The header's pattern wins: a flag per layer, or a period.
        let flags = [
            true, false, true, true, false, false, true, true, true, true, true, false,
        ];
        let flagged = windowed("gemma3", &[("attention.sliding_window", 512)], Some(&flags));
        assert_eq!(flagged.window_layers, 8);
        let period = windowed(
            "gemma3",
            &[
                ("attention.sliding_window", 512),
                ("attention.sliding_window_pattern", 4),
            ],
            None,
        );
        assert_eq!(period.window_layers, 9);
        // An architecture whose pattern we do not know: every layer counts as full, even
        // with a pattern in its header (llama.cpp may not read it).
        let other = windowed("mistral", &[("attention.sliding_window", 4096)], None);
        assert_eq!((other.window, other.window_layers), (4096, 0));
        let patterned = windowed(
            "mistral",
            &[
                ("attention.sliding_window", 4096),
                ("attention.sliding_window_pattern", 4),
            ],
            None,
        );
        assert_eq!(patterned.window_layers, 0);
        let mistral_full = Shape {
            window: 0,
            ..other.clone()
        };
        assert_eq!(
            estimate(&other, 0, &served),
            estimate(&mistral_full, 0, &served)
        );
    }

    #[test]
    fn periods_count_all_but_the_last_layer_of_each() {
        assert_eq!(sliding_in_period(12, 6), 10);
        assert_eq!(sliding_in_period(18, 6), 15);
        assert_eq!(sliding_in_period(26, 6), 22); // 4 full periods and 2 sliding layers
        assert_eq!(sliding_in_period(5, 2), 3);
        assert_eq!(sliding_in_period(5, 1), 0);
        assert_eq!(sliding_in_period(5, 0), 5);
    }

    #[test]
    fn a_draft_model_is_sized_as_a_model_with_every_cell_and_nothing_else() {
        let path = std::env::temp_dir().join(format!("lr-draft-{}.gguf", std::process::id()));
        std::fs::write(&path, header_with_tensors()).unwrap();
        let bytes = std::fs::metadata(&path).unwrap().len();
        let served = Served {
            ctx_size: 4096,
            parallel: 2,
            batch_size: 512,
            kv_cache_type: "f16",
            cache_ram_bytes: 1 << 30,
            extra_files: vec![Path::new("/nonexistent")],
            swa_full: false,
        };
        let draft = draft(&path, &served).unwrap();
        let alone = Served {
            cache_ram_bytes: 0,
            extra_files: vec![],
            swa_full: true,
            ..served.clone()
        };
        assert_eq!(draft, breakdown(&read_shape(&path).unwrap(), bytes, &alone));
        assert!(draft.kv > 0 && draft.compute > 0 && draft.weights == bytes);
        assert!(draft.on_device() < draft.total);
        std::fs::remove_file(&path).unwrap();
        assert!(super::draft(&path, &served).is_err());
    }

    #[test]
    fn a_cut_or_hostile_header_is_an_error_not_a_panic() {
        let full = header();
        for end in 0..full.len() {
            assert!(shape_of(&full[..end]).is_err(), "cut at {end}");
        }
        // An array of arrays of arrays ...: refused at the first nesting, not recursed into.
        let mut nested = full[..24].to_vec();
        nested.extend(b"\x01\0\0\0\0\0\0\0k\x09\0\0\0");
        for _ in 0..100_000 {
            nested.extend(b"\x09\0\0\0\x01\0\0\0\0\0\0\0");
        }
        assert!(shape_of(&nested).is_err());
        let mut huge = full.clone();
        // The first key's length: 2^60 bytes.
        huge[24..32].copy_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(shape_of(&huge).is_err());
        // Tensor infos cut anywhere, a tensor count of 2^60, a tensor of 2^32 - 1 dimensions
        // or of dimensions whose product overflows: errors or a size, never a panic.
        let tensors = header_with_tensors();
        for end in full.len()..tensors.len() {
            assert!(shape_of(&tensors[..end]).is_err(), "cut at {end}");
        }
        let mut many = tensors.clone();
        many[8..16].copy_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(shape_of(&many).is_err());
        let dims_at = full.len() + 8 + "blk.0.attn_q.weight".len();
        let mut deep = tensors.clone();
        deep[dims_at..dims_at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(shape_of(&deep).is_err());
        let embd_dims = tensors.len() - 8 - 4 - 16;
        let mut wide = tensors.clone();
        wide[embd_dims..embd_dims + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        wide[embd_dims + 8..embd_dims + 16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(shape_of(&wide).map(|s| s.token_embd_bytes), Ok(u64::MAX));
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for round in 0..4000 {
            let mut bytes = if round % 2 == 0 {
                full.clone()
            } else {
                tensors.clone()
            };
            for _ in 0..4 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let i = (x as usize) % bytes.len();
                bytes[i] = (x >> 32) as u8;
            }
            let _ = shape_of(&bytes);
        }
    }
}
