//! Portable builds (feature `portable`, for wheels that install on other machines): llama.cpp is
//! a set of shared libraries there (libllama, libggml, libggml-base, one libggml-cpu-<level> per
//! instruction-set level, and the OpenMP runtime they use). This script copies them into
//! `python/llamarunner/lib/`, which maturin packs into the wheel beside `_core.abi3.so`, and
//! gives `_core` the run path `$ORIGIN/lib` so that the dynamic loader finds them there.
//! Default (native) builds link llama.cpp statically and do nothing here.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_PORTABLE").is_none() {
        return;
    }
    // Set by llama-cpp-sys-2 (`links = "llama"`) for the crates that depend on it directly.
    let backends = PathBuf::from(
        std::env::var("DEP_LLAMA_BACKENDS_DIR")
            .expect("llama-cpp-sys-2 built without dynamic-backends"),
    );
    println!("cargo:rerun-if-changed={}", backends.display());
    let out = backends.parent().expect("the backends dir has a parent");
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let dest = manifest.join("../../python/llamarunner/lib");
    // Start clean: a library left from another build must not be packed.
    let _ = std::fs::remove_dir_all(&dest);
    std::fs::create_dir_all(&dest).expect("create python/llamarunner/lib");

    let mut copied = 0;
    for dir in [out.join("lib"), out.join("lib64"), backends.clone()] {
        copied += copy_shared_libraries(&dir, &dest);
    }
    assert!(
        copied > 0,
        "no llama.cpp shared libraries under {}",
        out.display()
    );
    copied_gpu_backends(&dest);
    if let Some(gomp) = compiler_file("libgomp.so.1") {
        copy(&gomp, &dest.join("libgomp.so.1"));
    }
    // DT_RPATH, not DT_RUNPATH: it also applies to the libraries' own dependencies (libllama
    // needs libggml, which needs libggml-base), which carry no run path of their own.
    println!("cargo:rustc-link-arg-cdylib=-Wl,--disable-new-dtags,-rpath,$ORIGIN/lib");
}

/// The GPU backend modules (`libggml-vulkan.so`, `libggml-cuda.so`: built apart by
/// `scripts/build-gpu-backend.sh`) in `$LLAMARUNNER_GPU_BACKENDS`, copied beside the CPU
/// variants: the wheel loads each at run time where its driver is found.
fn copied_gpu_backends(dest: &Path) {
    println!("cargo:rerun-if-env-changed=LLAMARUNNER_GPU_BACKENDS");
    let Some(dir) = std::env::var_os("LLAMARUNNER_GPU_BACKENDS").filter(|d| !d.is_empty()) else {
        return;
    };
    let dir = PathBuf::from(dir);
    println!("cargo:rerun-if-changed={}", dir.display());
    let entries = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("LLAMARUNNER_GPU_BACKENDS={}: {e}", dir.display()));
    let mut found = 0;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let module = name
            .strip_prefix("libggml-")
            .and_then(|n| n.strip_suffix(".so"))
            .is_some_and(|n| !n.starts_with("cpu") && n != "base" && !n.contains('.'));
        if module {
            println!("cargo:rerun-if-changed={}", entry.path().display());
            copy(&entry.path(), &dest.join(&name));
            found += 1;
        }
    }
    assert!(
        found > 0,
        "LLAMARUNNER_GPU_BACKENDS={} holds no libggml-<backend>.so",
        dir.display()
    );
}

/// Copies the shared libraries in `dir` under the names the dynamic loader asks for: of
/// `libggml-base.so` -> `libggml-base.so.0` -> `libggml-base.so.0.18.0` only the middle one
/// (the soname; symbolic links are copied as the file they point to), and plain `lib*.so` files
/// that have no versioned name (the CPU variants, which ggml opens by file name). Returns how
/// many.
fn copy_shared_libraries(dir: &Path, dest: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with("lib") && n.contains(".so"))
        .collect();
    let mut n = 0;
    for name in &names {
        if loader_name(name, &names) {
            copy(&dir.join(name), &dest.join(name));
            n += 1;
        }
    }
    n
}

/// Whether `name` is the one of its library's names that the loader asks for.
fn loader_name(name: &str, all: &[String]) -> bool {
    match name.split_once(".so") {
        // `libx.so`: only when there is no `libx.so.N`.
        Some((_, "")) => !all.iter().any(|o| o.starts_with(&format!("{name}."))),
        // `libx.so.N` (one version number), not `libx.so.N.M.P`.
        Some((_, version)) => version.strip_prefix('.').is_some_and(|v| !v.contains('.')),
        None => false,
    }
}

fn copy(from: &Path, to: &Path) {
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("copy {} to {}: {e}", from.display(), to.display()));
}

/// A runtime library of the C compiler's (`cc -print-file-name`), if it has one.
fn compiler_file(name: &str) -> Option<PathBuf> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(cc)
        .arg(format!("-print-file-name={name}"))
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    // Without it the compiler prints the bare name back.
    (path.is_absolute() && path.is_file()).then_some(path)
}
