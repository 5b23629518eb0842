//! LoRA adapters: `--lora PATH[:SCALE]` specs and the scale set a sequence is decoded under.
//!
//! A scale set holds one scale per loaded adapter, in `--lora` order. llama.cpp applies one set
//! to a whole `llama_decode`, and the KV cells a sequence writes depend on it, so the scheduler
//! decodes one set per batch and keys cached prefixes by it (`sched/lora.rs`).

use std::path::PathBuf;
use std::sync::{Arc, RwLock};

/// Largest scale magnitude accepted (on the command line, per request and by
/// `POST /lora-adapters`). Adapters are trained for about 1; far larger scales only push the
/// activations towards infinity.
pub const MAX_LORA_SCALE: f32 = 10.0;

/// Most adapters one server loads.
pub const MAX_LORA_ADAPTERS: usize = 64;

/// Why a scale is refused; `None` when it is usable.
pub fn scale_problem(scale: f32) -> Option<String> {
    if !scale.is_finite() {
        return Some(format!("a LoRA scale must be a finite number, got {scale}"));
    }
    if scale.abs() > MAX_LORA_SCALE {
        return Some(format!(
            "a LoRA scale must be between -{MAX_LORA_SCALE} and {MAX_LORA_SCALE}, got {scale}"
        ));
    }
    None
}

/// One adapter to load: `PATH[:SCALE]`.
///
/// The scale is split off at the last `:` only when what follows parses as a number, so a path
/// with colons (`C:\adapters\a.gguf`, `dir:x/a.gguf`) stays whole; a file whose name ends in
/// `:<number>` is given with an explicit scale (`a:2.gguf` is fine, `odd:2` is `odd:2:1`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct LoraSpec {
    /// The adapter's GGUF file.
    pub path: PathBuf,
    /// Its scale when a request names none (1 unless given).
    pub scale: f32,
}

impl LoraSpec {
    /// Parses `PATH[:SCALE]`; the scale must be finite and within `MAX_LORA_SCALE`.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let (path, scale) = match spec.rsplit_once(':') {
            Some((head, tail)) if !head.is_empty() => match tail.trim().parse::<f32>() {
                Ok(scale) => (head, scale),
                Err(_) => (spec, 1.0),
            },
            _ => (spec, 1.0),
        };
        if path.is_empty() {
            return Err(format!("lora {spec:?}: the adapter path is empty"));
        }
        if let Some(why) = scale_problem(scale) {
            return Err(format!("lora {spec:?}: {why}"));
        }
        Ok(Self {
            path: PathBuf::from(path),
            scale: canonical(scale),
        })
    }
}

impl TryFrom<String> for LoraSpec {
    type Error = String;

    fn try_from(spec: String) -> Result<Self, String> {
        Self::parse(&spec)
    }
}

impl From<LoraSpec> for String {
    fn from(spec: LoraSpec) -> String {
        format!("{}:{}", spec.path.display(), spec.scale)
    }
}

/// -0.0 is 0.0 (same effect, so the same set).
fn canonical(scale: f32) -> f32 {
    if scale == 0.0 {
        0.0
    } else {
        scale
    }
}

/// The scales of every loaded adapter for one sequence (a missing entry is 0: the adapter is
/// off). Kept canonical (no trailing zeros, no -0.0), so two sets that decode alike are equal:
/// `[]`, `[0]` and `[0, -0]` are all the base model.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoraScales(Vec<f32>);

impl Eq for LoraScales {}

impl LoraScales {
    /// The set with these scales, adapter by adapter (callers check them with `scale_problem`).
    pub fn new(mut scales: Vec<f32>) -> Self {
        for s in &mut scales {
            *s = canonical(*s);
        }
        while scales.last() == Some(&0.0) {
            scales.pop();
        }
        Self(scales)
    }

    /// The base model: every adapter off.
    pub fn base() -> Self {
        Self::default()
    }

    /// Adapter `i`'s scale (0 past the last one given).
    pub fn get(&self, i: usize) -> f32 {
        self.0.get(i).copied().unwrap_or(0.0)
    }

    /// Whether every adapter is off.
    pub fn is_base(&self) -> bool {
        self.0.is_empty()
    }

    /// The scales of `n` adapters, zeros included.
    pub fn to_vec(&self, n: usize) -> Vec<f32> {
        (0..n).map(|i| self.get(i)).collect()
    }
}

/// The adapters this server loaded (`--lora`), by id, and their current default scales.
#[derive(Debug, Default)]
pub struct LoraTable {
    /// Each adapter's file name (not its directories: a client learns nothing of the file
    /// system), by id.
    pub(crate) names: Vec<String>,
    /// The scales of requests that name none.
    pub(crate) defaults: RwLock<Vec<f32>>,
}

impl LoraTable {
    /// The table for these `--lora` specs.
    pub fn new(specs: &[LoraSpec]) -> Arc<Self> {
        let names = specs
            .iter()
            .map(|s| {
                s.path.file_name().map_or_else(
                    || s.path.display().to_string(),
                    |f| f.to_string_lossy().into_owned(),
                )
            })
            .collect();
        Arc::new(Self {
            names,
            defaults: RwLock::new(specs.iter().map(|s| s.scale).collect()),
        })
    }

    /// How many adapters are loaded.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The scales of requests that name none.
    pub fn defaults(&self) -> LoraScales {
        LoraScales::new(self.default_scales())
    }

    /// The current default scales, by adapter id.
    pub fn default_scales(&self) -> Vec<f32> {
        self.defaults
            .read()
            .map_or_else(|e| e.into_inner().clone(), |d| d.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_split_the_scale_only_when_it_is_a_number() {
        let cases: &[(&str, &str, f32)] = &[
            ("a.gguf", "a.gguf", 1.0),
            ("a.gguf:0.5", "a.gguf", 0.5),
            ("a.gguf:-1", "a.gguf", -1.0),
            ("a.gguf:0", "a.gguf", 0.0),
            (r"C:\ad\a.gguf", r"C:\ad\a.gguf", 1.0),
            (r"C:\ad\a.gguf:2", r"C:\ad\a.gguf", 2.0),
            ("dir:x/a.gguf", "dir:x/a.gguf", 1.0),
            ("odd:2:1", "odd:2", 1.0),
            (":5", ":5", 1.0),
        ];
        for &(spec, path, scale) in cases {
            let parsed = LoraSpec::parse(spec).unwrap();
            assert_eq!(parsed.path, PathBuf::from(path), "{spec}");
            assert_eq!(parsed.scale, scale, "{spec}");
        }
    }

    #[test]
    fn bad_specs_are_refused() {
        for spec in [
            "",
            "a.gguf:nan",
            "a.gguf:inf",
            "a.gguf:-inf",
            "a.gguf:11",
            "a:-1e9",
        ] {
            assert!(LoraSpec::parse(spec).is_err(), "{spec:?} was accepted");
        }
    }

    #[test]
    fn a_spec_round_trips_through_its_string() {
        let spec = LoraSpec::parse("x:y.gguf:0.25").unwrap();
        let back = LoraSpec::parse(&String::from(spec.clone())).unwrap();
        assert_eq!(back, spec);
    }

    #[test]
    fn sets_that_decode_alike_are_equal() {
        assert_eq!(LoraScales::new(vec![]), LoraScales::new(vec![0.0, -0.0]));
        assert_eq!(LoraScales::new(vec![1.0, 0.0]), LoraScales::new(vec![1.0]));
        assert_ne!(LoraScales::new(vec![1.0]), LoraScales::new(vec![0.0, 1.0]));
        assert!(LoraScales::new(vec![0.0]).is_base());
        assert_eq!(LoraScales::new(vec![0.5]).to_vec(3), vec![0.5, 0.0, 0.0]);
    }
}
