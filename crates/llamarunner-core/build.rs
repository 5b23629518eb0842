//! With llama.cpp (the `llama` feature): compiles `cpp/guarded_decode.cpp`, the llama_decode
//! whose C++ exceptions are caught (`backend/llama/guarded_decode.rs`), against the llama.h that
//! llama-cpp-sys-2 installed (`DEP_LLAMA_ROOT`: its CMake build's install prefix).

fn main() {
    println!("cargo:rerun-if-changed=cpp/guarded_decode.cpp");
    println!("cargo:rerun-if-env-changed=DEP_LLAMA_ROOT");
    if std::env::var_os("CARGO_FEATURE_LLAMA").is_none() {
        return;
    }
    let root = std::env::var_os("DEP_LLAMA_ROOT")
        .expect("llama-cpp-sys-2 names its install prefix (DEP_LLAMA_ROOT)");
    let include = std::path::Path::new(&root).join("include");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("cpp/guarded_decode.cpp")
        .include(include)
        .warnings(true)
        .compile("llamarunner_guarded_decode");
}
