//! The decode step's cost by width (`sched/adaptive.rs`'s input, measured at start by
//! `backend::llama::step_times`), kept on disk between starts: measuring takes ~35 decodes,
//! seconds on a CPU, and every engine start paid them before its first request (a model the
//! router loads on demand most of all). The entry is keyed by everything that changes the
//! figures: the model file (path, size, modification time), the settings that shape a step
//! (threads, context, slots, batch, flash attention, the full sliding-window cache), where the
//! layers went (backend, layers offloaded, devices: `DeviceFacts::placement`, in `system`),
//! llama.cpp's CPU features and this build's version. The file is `$LLAMARUNNER_CACHE_DIR/step-costs.json`
//! (else `$XDG_CACHE_HOME/llamarunner/`, else `~/.cache/llamarunner/`); `LLAMARUNNER_CACHE_DIR`
//! set empty turns it off. A file that cannot be read or written only means measuring again.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use crate::config::RunnerConfig;

/// Most entries the file keeps (the oldest written go first).
pub const MAX_ENTRIES: usize = 64;
const FILE: &str = "step-costs.json";

/// The cache file, if there is a place for it.
pub fn cache_file() -> Option<PathBuf> {
    let dir = match std::env::var_os("LLAMARUNNER_CACHE_DIR") {
        Some(d) if d.is_empty() => return None,
        Some(d) => PathBuf::from(d),
        None => match std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
            Some(d) => PathBuf::from(d).join("llamarunner"),
            None => PathBuf::from(std::env::var_os("HOME").filter(|h| !h.is_empty())?)
                .join(".cache")
                .join("llamarunner"),
        },
    };
    Some(dir.join(FILE))
}

/// The key of a measurement of `widths` widths for this configuration on a machine described
/// by `system` (llama.cpp's CPU features and where the layers went); None when the model
/// file's metadata cannot be read.
pub fn key(config: &RunnerConfig, system: &str, widths: usize) -> Option<String> {
    let path = std::fs::canonicalize(&config.model).ok()?;
    let meta = std::fs::metadata(&path).ok()?;
    let modified = meta
        .modified()
        .ok()?
        .duration_since(UNIX_EPOCH)
        .ok()?
        .as_nanos();
    Some(
        json!({
            "model": path.to_string_lossy(),
            "bytes": meta.len(),
            "modified_ns": modified.to_string(),
            "threads": config.threads,
            "cores": std::thread::available_parallelism().map_or(0, usize::from),
            "ctx_size": config.ctx_size,
            "parallel": config.parallel,
            "batch_size": config.batch_size,
            "flash_attn": format!("{:?}", config.effective_flash_attn()),
            "deterministic": config.deterministic,
            "swa_full": config.effective_swa_full(),
            "system": system,
            "version": env!("CARGO_PKG_VERSION"),
            "widths": widths,
        })
        .to_string(),
    )
}

fn read(file: &Path) -> Map<String, Value> {
    std::fs::read(file)
        .ok()
        .and_then(|bytes| serde_json::from_slice::<Value>(&bytes).ok())
        .and_then(|v| match v.get("entries") {
            Some(Value::Object(m)) => Some(m.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

/// The step times kept under `key` (`widths` of them), if any.
pub fn lookup(file: &Path, key: &str, widths: usize) -> Option<Vec<u64>> {
    let times: Vec<u64> = read(file)
        .get(key)?
        .get("us")?
        .as_array()?
        .iter()
        .map(Value::as_u64)
        .collect::<Option<_>>()?;
    (times.len() == widths && times.iter().all(|&t| t > 0)).then_some(times)
}

/// Keeps `times` under `key`, the oldest entries out past `MAX_ENTRIES`; written to a
/// temporary file and renamed, so that a reader never sees half a file. Failures are logged.
pub fn store(file: &Path, key: &str, times: &[u64]) {
    let mut entries = read(file);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    entries.insert(key.to_string(), json!({"us": times, "at": now}));
    while entries.len() > MAX_ENTRIES {
        let oldest = entries
            .iter()
            .min_by_key(|(_, v)| v.get("at").and_then(Value::as_u64).unwrap_or(0))
            .map(|(k, _)| k.clone());
        match oldest {
            Some(k) => {
                entries.remove(&k);
            }
            None => break,
        }
    }
    let body = json!({"version": 1, "entries": entries}).to_string();
    let write = || -> std::io::Result<()> {
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = file.with_extension(format!("json.{}.tmp", std::process::id()));
        std::fs::write(&tmp, body)?;
        std::fs::rename(&tmp, file)
    };
    if let Err(e) = write() {
        tracing::debug!(file = %file.display(), error = %e, "could not keep the step costs");
    }
}

/// The step times for `widths` widths: kept ones when the key matches, else `measure()`'s
/// (then kept). Whether they were kept is logged.
pub fn cached(
    config: &RunnerConfig,
    system: &str,
    widths: usize,
    measure: impl FnOnce() -> Option<Vec<u64>>,
) -> Option<Vec<u64>> {
    let place = cache_file().zip(key(config, system, widths));
    if let Some((file, key)) = &place {
        if let Some(times) = lookup(file, key, widths) {
            tracing::info!(file = %file.display(), "the decode step's cost was measured at an earlier start with these settings");
            return Some(times);
        }
    }
    let times = measure()?;
    if let Some((file, key)) = &place {
        store(file, key, &times);
    }
    Some(times)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh scratch folder for one test.
    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "llamarunner-step-costs-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn config(dir: &Path) -> RunnerConfig {
        let model = dir.join("m.gguf");
        std::fs::write(&model, b"GGUF").unwrap();
        RunnerConfig {
            model,
            ..RunnerConfig::default()
        }
    }

    #[test]
    fn a_kept_measurement_is_found_by_its_key_only() {
        let dir = scratch("kept");
        let file = dir.join("cache").join(FILE);
        let c = config(&dir);
        let k = key(&c, "AVX2 = 1", 3).unwrap();
        assert_eq!(lookup(&file, &k, 3), None);
        store(&file, &k, &[10, 12, 15]);
        assert_eq!(lookup(&file, &k, 3), Some(vec![10, 12, 15]));
        // Another CPU, other settings, another width count: another key.
        assert_ne!(key(&c, "AVX512 = 1", 3).unwrap(), k);
        let more_threads = RunnerConfig {
            threads: c.threads + 1,
            ..c.clone()
        };
        assert_ne!(key(&more_threads, "AVX2 = 1", 3).unwrap(), k);
        // Layers on a GPU, or fewer of them, or other devices: another key.
        let on_gpu = "AVX2 = 1 | Vulkan 19/19 layers, split layer, on Vulkan0 (llvmpipe)";
        let fewer = "AVX2 = 1 | Vulkan 7/19 layers, split layer, on Vulkan0 (llvmpipe)";
        assert_ne!(key(&c, on_gpu, 3).unwrap(), k);
        assert_ne!(key(&c, fewer, 3).unwrap(), key(&c, on_gpu, 3).unwrap());
        assert_eq!(lookup(&file, &k, 4), None);
        // A rewritten model file is another key.
        std::thread::sleep(std::time::Duration::from_millis(5));
        std::fs::write(&c.model, b"GGUF2").unwrap();
        assert_ne!(key(&c, "AVX2 = 1", 3).unwrap(), k);
    }

    #[test]
    fn cached_measures_once_and_bad_files_mean_measuring_again() {
        let dir = scratch("bad");
        let file = dir.join(FILE);
        std::fs::write(&file, b"{not json").unwrap();
        let c = config(&dir);
        let k = key(&c, "s", 2).unwrap();
        assert_eq!(lookup(&file, &k, 2), None);
        store(&file, &k, &[5, 6]);
        assert_eq!(lookup(&file, &k, 2), Some(vec![5, 6]));
        std::fs::write(&file, br#"{"entries": {"x": {"us": [0, -1]}}}"#).unwrap();
        assert_eq!(lookup(&file, "x", 2), None);
    }

    #[test]
    fn the_file_keeps_at_most_max_entries() {
        let dir = scratch("max");
        let file = dir.join(FILE);
        for i in 0..MAX_ENTRIES + 5 {
            store(&file, &format!("k{i}"), &[1]);
        }
        assert_eq!(read(&file).len(), MAX_ENTRIES);
    }
}
