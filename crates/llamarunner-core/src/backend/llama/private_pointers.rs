//! The llama.cpp pointers llama-cpp-2 keeps private: the context's (every decode goes through
//! it, `guarded_decode.rs`), the LoRA adapters' (`lora.rs`) and the projector's (`mtmd.rs`).
//!
//! The crate's `Debug` output prints them (`LlamaContext { context: 0x… }`,
//! `LlamaLoraAdapter { lora_adapter: 0x… }`); they are read from there once, at load. The
//! context's is checked against llama.cpp (its model and size must be this context's) before
//! anything uses it, and read once per context (`context_pointer`).

use std::fmt::Debug;

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::model::LlamaModel;

/// The pointer `Debug` prints for `field` (`field: 0x1234`).
pub(super) fn debug_pointer(value: &impl Debug, field: &str) -> Option<usize> {
    let text = format!("{value:?}");
    let (_, rest) = text.split_once(&format!("{field}: 0x"))?;
    let hex: String = rest.chars().take_while(char::is_ascii_hexdigit).collect();
    usize::from_str_radix(&hex, 16).ok().filter(|&p| p != 0)
}

/// The context's llama.cpp pointer, read from its `Debug` output and checked: llama.cpp must
/// say that it is a context of `model`, of this context's size.
pub(super) fn context_pointer(
    model: &LlamaModel,
    ctx: &LlamaContext<'_>,
) -> Result<*mut llama_cpp_sys_2::llama_context, String> {
    let unavailable = || "this llama-cpp-2 does not show its llama.cpp context".to_string();
    let ctx_ptr = debug_pointer(ctx, "context").ok_or_else(unavailable)?;
    let model_ptr = debug_pointer(model, "model").ok_or_else(unavailable)?;
    let raw = ctx_ptr as *mut llama_cpp_sys_2::llama_context;
    // SAFETY: `ctx_ptr` is the address `LlamaContext`'s own Debug printed for its context
    // pointer, so it is a live llama_context; llama_get_model and llama_n_ctx only read it.
    let (owner, n_ctx) = unsafe {
        (
            llama_cpp_sys_2::llama_get_model(raw) as usize,
            llama_cpp_sys_2::llama_n_ctx(raw),
        )
    };
    if owner != model_ptr || n_ctx != ctx.n_ctx() {
        return Err(unavailable());
    }
    Ok(raw)
}

#[cfg(test)]
mod tests {
    use crate::backend::llama::private_pointers::debug_pointer;

    #[derive(Debug)]
    struct Probe {
        #[allow(dead_code)]
        context: std::ptr::NonNull<u8>,
    }

    #[test]
    fn pointers_are_read_from_debug_output() {
        let mut byte = 0u8;
        let probe = Probe {
            context: std::ptr::NonNull::from(&mut byte),
        };
        assert_eq!(
            debug_pointer(&probe, "context"),
            Some(std::ptr::addr_of!(byte) as usize)
        );
        assert_eq!(debug_pointer(&probe, "model"), None);
    }
}
