//! Portable builds (`--features portable`, the wheels meant for other machines): llama.cpp's CPU
//! backend is not linked in but built once per instruction-set level (`GGML_CPU_ALL_VARIANTS`:
//! SSE4.2, AVX, AVX2, AVX-512, AVX-512 VNNI/BF16, AMX, ...) as shared libraries
//! (`libggml-cpu-<level>.so`). ggml scores each against this CPU and loads the best one; this
//! module says where they are and which one was chosen.
//!
//! Where: `$LLAMARUNNER_BACKENDS_DIR` if set; else the `lib` directory next to the shared object
//! this code is linked into (`llamarunner/lib/` beside `llamarunner/_core.abi3.so` in a wheel);
//! else the directory the build put them in (a development build run from its target dir).

use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};

/// Overrides where the backend libraries are looked for.
pub const DIR_ENV: &str = "LLAMARUNNER_BACKENDS_DIR";

/// Loads ggml's backends (the best CPU variant, and any GPU backend built) and returns the file
/// name of the CPU backend chosen; an error says where it looked when none fits.
pub fn load() -> Result<String, String> {
    let dir = backends_dir().ok_or_else(|| {
        format!("no llama.cpp backend libraries found: set {DIR_ENV} to their directory")
    })?;
    let Some(text) = dir.to_str() else {
        return Err(format!("{} is not valid UTF-8", dir.display()));
    };
    let text = CString::new(text).map_err(|_| format!("{} contains a NUL byte", dir.display()))?;
    // SAFETY: a valid NUL-terminated path; ggml loads and registers what it finds there.
    unsafe { llama_cpp_sys_2::ggml_backend_load_all_from_path(text.as_ptr()) };
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
    Ok(library_of(f).unwrap_or_else(|| "CPU backend (file unknown)".into()))
}

fn backends_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os(DIR_ENV) {
        return Some(PathBuf::from(dir));
    }
    let this: fn() -> Result<String, String> = load;
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
