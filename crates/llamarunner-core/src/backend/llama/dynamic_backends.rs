//! Portable builds (`--features portable`, the wheels meant for other machines): llama.cpp's
//! backends are not linked in but loaded at run time from shared libraries. The CPU backend is
//! built once per instruction-set level (`GGML_CPU_ALL_VARIANTS`: SSE4.2, AVX, AVX2, AVX-512,
//! AVX-512 VNNI/BF16, AMX, ...) as `libggml-cpu-<level>.so`; ggml scores each against this CPU
//! and loads the best one. GPU backends (`libggml-vulkan.so`, `libggml-cuda.so`, built by the
//! repository's build-gpu-backend.sh script) are loaded when they are there and their libraries (the
//! Vulkan loader, the CUDA runtime) are found; one that cannot load is skipped, with the
//! loader's reason, and the server runs on what did load.
//!
//! Where: `$LLAMARUNNER_BACKENDS_DIR` if set; else the `lib` directory next to the shared object
//! this code is linked into (`llamarunner/lib/` beside `llamarunner/_core.abi3.so` in a wheel);
//! else the directory the build put them in (a development build run from its target dir).
//! GPU modules are also looked for in the directories of `$LLAMARUNNER_GPU_MODULE_PATH`
//! (separated as `PATH` is): the Python package sets it to the CUDA companion's directory
//! (`llamarunner[cuda]`), and a user may point it at a module built by hand. A module name found
//! twice is taken from the first directory.

use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};

/// Overrides where the backend libraries are looked for.
pub const DIR_ENV: &str = "LLAMARUNNER_BACKENDS_DIR";

/// More directories with GPU backend modules, separated as `PATH` is.
pub const MODULE_PATH_ENV: &str = "LLAMARUNNER_GPU_MODULE_PATH";

/// What loading the backend libraries found.
#[derive(Debug)]
pub struct Loaded {
    /// The file name of the CPU variant chosen.
    pub cpu: String,
    /// Each GPU backend library found (in the backends directory, then in
    /// `$LLAMARUNNER_GPU_MODULE_PATH`), by path, with the number of devices it found or why it
    /// was skipped.
    pub gpu: Vec<(PathBuf, Result<usize, String>)>,
}

/// Loads ggml's backends (the best CPU variant, and every GPU backend that can load); an error
/// says where it looked when no CPU variant fits.
pub fn load() -> Result<Loaded, String> {
    let dir = backends_dir().ok_or_else(|| {
        format!("no llama.cpp backend libraries found: set {DIR_ENV} to their directory")
    })?;
    let Some(text) = dir.to_str() else {
        return Err(format!("{} is not valid UTF-8", dir.display()));
    };
    let text = CString::new(text).map_err(|_| format!("{} contains a NUL byte", dir.display()))?;
    let extra_dirs: Vec<PathBuf> = std::env::var_os(MODULE_PATH_ENV)
        .map(|paths| std::env::split_paths(&paths).collect())
        .unwrap_or_default();
    let modules = gpu_modules(&dir, &extra_dirs);
    // ggml skips a library it cannot open without a word in a release build: open each GPU
    // backend first to keep the loader's reason (a missing libvulkan.so.1 or libcudart.so.13).
    let probed: Vec<(PathBuf, Result<(), String>)> = modules
        .into_iter()
        .map(|module| match module {
            Module::Here(path) | Module::Elsewhere(path) => {
                let opened = open_probe(&path).map_err(|why| with_hint(&why));
                (path, opened)
            }
            Module::Shadowed { path, by } => {
                let why = format!(
                    "{} is loaded from {} instead",
                    super::file_name(&path),
                    by.display()
                );
                (path, Err(why))
            }
        })
        .collect();
    // SAFETY: a valid NUL-terminated path; ggml loads and registers what it finds there.
    unsafe { llama_cpp_sys_2::ggml_backend_load_all_from_path(text.as_ptr()) };
    for (path, opened) in &probed {
        if opened.is_err() || path.parent() == Some(dir.as_path()) {
            continue;
        }
        let Ok(c_path) = CString::new(path.as_os_str().as_encoded_bytes()) else {
            continue;
        };
        // SAFETY: a NUL-terminated path of a library that opened; ggml registers the backend
        // it defines, or returns null (then it is reported as not registered below).
        unsafe { llama_cpp_sys_2::ggml_backend_load(c_path.as_ptr()) };
    }
    // SAFETY: a NUL-terminated name; null when no backend of that name is registered.
    let cpu = unsafe { llama_cpp_sys_2::ggml_backend_reg_by_name(c"CPU".as_ptr()) };
    if cpu.is_null() {
        return Err(format!(
            "no llama.cpp CPU backend in {} supports this processor",
            dir.display()
        ));
    }
    // Any function of the backend's tells which file it came from.
    // SAFETY: `cpu` is a registered backend; the result is a function pointer or null.
    let f = unsafe {
        llama_cpp_sys_2::ggml_backend_reg_get_proc_address(
            cpu,
            c"ggml_backend_get_features".as_ptr(),
        )
    };
    let cpu = library_of(f).unwrap_or_else(|| "CPU backend (file unknown)".into());
    let registered = registered_backends();
    let gpu = probed
        .into_iter()
        .map(|(path, opened)| {
            let outcome = opened.and_then(|()| {
                registered
                    .iter()
                    .find(|(file, _)| file.as_deref() == Some(super::file_name(&path).as_str()))
                    .map(|(_, devices)| *devices)
                    .ok_or_else(|| {
                        "it loaded, but ggml did not register it (it found no support for \
                         this system, or its initialization failed)"
                            .to_string()
                    })
            });
            (path, outcome)
        })
        .collect();
    Ok(Loaded { cpu, gpu })
}

/// A GPU module found, and whether ggml's own directory scan loads it.
#[derive(Debug, PartialEq)]
enum Module {
    /// In the backends directory: `ggml_backend_load_all_from_path` loads it.
    Here(PathBuf),
    /// In a directory of `$LLAMARUNNER_GPU_MODULE_PATH`: loaded by its path.
    Elsewhere(PathBuf),
    /// A second module of a name already found; not loaded.
    Shadowed { path: PathBuf, by: PathBuf },
}

/// The GPU modules of the backends directory, then those of each further directory, in order;
/// a name seen before is shadowed by the first.
fn gpu_modules(dir: &Path, extra_dirs: &[PathBuf]) -> Vec<Module> {
    let mut found: Vec<Module> = gpu_libraries(dir)
        .into_iter()
        .map(|name| Module::Here(dir.join(name)))
        .collect();
    for extra in extra_dirs.iter().filter(|d| d.as_path() != dir) {
        for name in gpu_libraries(extra) {
            let first = found.iter().find_map(|m| match m {
                Module::Here(p) | Module::Elsewhere(p) if super::file_name(p) == name => {
                    p.parent().map(Path::to_path_buf)
                }
                _ => None,
            });
            let path = extra.join(&name);
            found.push(match first {
                Some(by) => Module::Shadowed { path, by },
                None => Module::Elsewhere(path),
            });
        }
    }
    found
}

/// The loader's reason, with what a user does about the libraries GPU modules usually miss.
fn with_hint(why: &str) -> String {
    let hint = if why.contains("libcuda.so") {
        "no NVIDIA driver is installed (libcuda.so.1 comes with it)"
    } else if why.contains("libcudart.so") || why.contains("libcublas") {
        "the CUDA runtime is missing: pip install 'llamarunner[cuda]', or install the CUDA \
         toolkit the module was built with"
    } else if why.contains("libvulkan.so") {
        "no Vulkan loader: install libvulkan1 and the GPU's Vulkan driver"
    } else {
        return why.to_string();
    };
    format!("{why} ({hint})")
}

/// The GPU (non-CPU) backend libraries in `dir`: `libggml-<name>.so`, other than the CPU
/// variants and ggml's own libraries, sorted by name.
fn gpu_libraries(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| is_gpu_library(n))
        .collect();
    names.sort();
    names
}

/// Whether a file name is a GPU backend's library (`libggml-vulkan.so`, `libggml-cuda.so`).
fn is_gpu_library(name: &str) -> bool {
    name.strip_prefix("libggml-")
        .and_then(|n| n.strip_suffix(".so"))
        .is_some_and(|n| !n.is_empty() && !n.starts_with("cpu") && n != "base" && !n.contains('.'))
}

/// Opens and closes a library, returning the dynamic loader's message when it cannot be opened.
fn open_probe(path: &Path) -> Result<(), String> {
    let text = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{} contains a NUL byte", path.display()))?;
    // SAFETY: a NUL-terminated path. Opening runs the library's initializers, as ggml's own
    // opening right after does.
    let handle = unsafe { libc::dlopen(text.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns the last error of this thread as a NUL-terminated string
        // owned by the loader, or null.
        let why = unsafe { libc::dlerror() };
        return Err(if why.is_null() {
            "the dynamic loader could not open it".into()
        } else {
            // SAFETY: non-null and NUL-terminated, copied before another dl call.
            unsafe { CStr::from_ptr(why) }
                .to_string_lossy()
                .into_owned()
        });
    }
    // SAFETY: a handle dlopen returned, closed once (ggml holds its own).
    unsafe { libc::dlclose(handle) };
    Ok(())
}

/// Every registered backend: the file its registration lives in (None for one linked into
/// the process) and how many devices it has.
fn registered_backends() -> Vec<(Option<String>, usize)> {
    // SAFETY: plain reads of ggml's registry, after loading finished on this thread.
    let count = unsafe { llama_cpp_sys_2::ggml_backend_reg_count() };
    (0..count)
        .map(|i| {
            // SAFETY: `i` is below the count just read.
            let reg = unsafe { llama_cpp_sys_2::ggml_backend_reg_get(i) };
            // SAFETY: a registered backend.
            let devices = unsafe { llama_cpp_sys_2::ggml_backend_reg_dev_count(reg) };
            // A backend's registration is a static object of the library that defines it.
            (library_of(reg.cast::<c_void>()), devices)
        })
        .collect()
}

fn backends_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os(DIR_ENV) {
        return Some(PathBuf::from(dir));
    }
    let this: fn() -> Result<Loaded, String> = load;
    let beside = library_path(this as *const c_void)
        .and_then(|p| p.parent().map(|d| d.join("lib")))
        .filter(|d| has_cpu_backend(d));
    beside.or_else(|| {
        llama_cpp_sys_2::BACKENDS_DIR
            .map(PathBuf::from)
            .filter(|d| has_cpu_backend(d))
    })
}

fn has_cpu_backend(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with("libggml-cpu"))
        })
    })
}

/// The file name of the shared object that holds `address`.
fn library_of(address: *mut c_void) -> Option<String> {
    let path = library_path(address)?;
    Some(path.file_name()?.to_string_lossy().into_owned())
}

/// The path of the shared object (or executable) that holds `address`.
fn library_path(address: *const c_void) -> Option<PathBuf> {
    if address.is_null() {
        return None;
    }
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only reads `address` (any value is allowed) and fills `info`.
    let found = unsafe { libc::dladdr(address, info.as_mut_ptr()) };
    // SAFETY: zero-initialized, and filled by dladdr when it returns non-zero.
    let info = unsafe { info.assume_init() };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr set a NUL-terminated string owned by the dynamic loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(name.to_string_lossy().into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_libraries_are_the_backends_other_than_the_cpu_and_ggml_itself() {
        assert!(is_gpu_library("libggml-vulkan.so"));
        assert!(is_gpu_library("libggml-cuda.so"));
        for other in [
            "libggml-cpu-haswell.so",
            "libggml-cpu.so",
            "libggml-base.so",
            "libggml-base.so.0",
            "libggml.so.0",
            "libggml-.so",
            "libllama.so.0",
            "libggml-vulkan.so.1",
        ] {
            assert!(!is_gpu_library(other), "{other}");
        }
    }

    fn touch(dir: &Path, names: &[&str]) {
        std::fs::create_dir_all(dir).unwrap();
        for name in names {
            std::fs::write(dir.join(name), b"").unwrap();
        }
    }

    #[test]
    fn modules_come_from_the_backends_dir_then_the_module_path_first_name_wins() {
        let root = std::env::temp_dir().join(format!("lr-modules-{}", std::process::id()));
        let (lib, companion, other) = (root.join("lib"), root.join("cuda"), root.join("mine"));
        touch(
            &lib,
            &[
                "libggml-cpu-haswell.so",
                "libggml-base.so",
                "libggml-vulkan.so",
            ],
        );
        touch(
            &companion,
            &["libggml-cuda.so", "libcudart.so.13", "README"],
        );
        touch(&other, &["libggml-cuda.so", "libggml-vulkan.so"]);
        let found = gpu_modules(&lib, &[companion.clone(), lib.clone(), other.clone()]);
        assert_eq!(
            found,
            vec![
                Module::Here(lib.join("libggml-vulkan.so")),
                Module::Elsewhere(companion.join("libggml-cuda.so")),
                Module::Shadowed {
                    path: other.join("libggml-cuda.so"),
                    by: companion.clone()
                },
                Module::Shadowed {
                    path: other.join("libggml-vulkan.so"),
                    by: lib.clone()
                },
            ]
        );
        // A directory that does not exist adds nothing.
        assert_eq!(
            gpu_modules(&lib, &[root.join("gone")]),
            vec![Module::Here(lib.join("libggml-vulkan.so"))]
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_missing_library_names_what_to_install() {
        let runtime =
            with_hint("libcudart.so.13: cannot open shared object file: No such file or directory");
        assert!(
            runtime.starts_with("libcudart.so.13: cannot open"),
            "{runtime}"
        );
        assert!(
            runtime.contains("pip install 'llamarunner[cuda]'"),
            "{runtime}"
        );
        let driver = with_hint("libcuda.so.1: cannot open shared object file");
        assert!(driver.contains("no NVIDIA driver"), "{driver}");
        assert!(with_hint("libvulkan.so.1: cannot open").contains("Vulkan loader"));
        let other = "undefined symbol: ggml_something";
        assert_eq!(with_hint(other), other);
    }
}
