//! The `--lora` adapters on the llama.cpp context: loaded with the model, their scales set
//! before each decode whose set differs from the last (`Backend::set_lora`).
//!
//! llama-cpp-2 (0.1.154, and still 0.1.160) sets one adapter (`LlamaContext::lora_adapter_set`
//! replaces the whole list each call). Several adapters at once need one
//! `llama_set_adapters_lora` call with all of them, which takes the context and adapter pointers
//! the crate keeps private. Its `Debug` output prints both (`LlamaContext { context: 0x… }`,
//! `LlamaLoraAdapter { lora_adapter: 0x… }`); they are read from there once, at load, and the
//! context's is checked against llama.cpp (its model and size must be this context's) before it
//! is used. With one adapter the safe call is used and none of this happens. Since 0.1.160 an
//! adapter is made from `&mut LlamaModel`, so all of them are loaded before the context (which
//! borrows the model) is made (`load_adapters`).

use std::fmt::Debug;

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::model::{LlamaLoraAdapter, LlamaModel};
use llama_cpp_2::LlamaLoraAdapterInitError;

use super::file_name;
use crate::protocol::lora::{LoraScales, LoraSpec};
use crate::protocol::BackendError;

/// The loaded adapters and the scales applied now.
pub(super) struct LoraAdapters {
    adapters: Vec<LlamaLoraAdapter>,
    /// The adapters' llama.cpp pointers, in order (only with several adapters).
    raw: Vec<*mut llama_cpp_sys_2::llama_adapter_lora>,
    /// The context's llama.cpp pointer (only with several adapters).
    raw_ctx: Option<*mut llama_cpp_sys_2::llama_context>,
    /// The scales llama.cpp has now.
    applied: LoraScales,
}

/// The pointer `Debug` prints for `field` (`field: 0x1234`).
pub(super) fn debug_pointer(value: &impl Debug, field: &str) -> Option<usize> {
    let text = format!("{value:?}");
    let (_, rest) = text.split_once(&format!("{field}: 0x"))?;
    let hex: String = rest.chars().take_while(char::is_ascii_hexdigit).collect();
    usize::from_str_radix(&hex, 16).ok().filter(|&p| p != 0)
}

impl LoraAdapters {
    /// No adapters.
    pub(super) fn none() -> Self {
        Self {
            adapters: Vec::new(),
            raw: Vec::new(),
            raw_ctx: None,
            applied: LoraScales::base(),
        }
    }

    /// Takes the adapters `load_adapters` made for `specs` (in their order) and applies the
    /// specs' scales on `ctx`.
    pub(super) fn load(
        model: &LlamaModel,
        ctx: &mut LlamaContext<'_>,
        specs: &[LoraSpec],
        adapters: Vec<LlamaLoraAdapter>,
    ) -> Result<Self, String> {
        let (raw, raw_ctx) = if adapters.len() > 1 {
            let raw = adapters
                .iter()
                .map(|a| {
                    debug_pointer(a, "lora_adapter")
                        .map(|p| p as *mut llama_cpp_sys_2::llama_adapter_lora)
                })
                .collect::<Option<Vec<_>>>()
                .ok_or("cannot apply several LoRA adapters with this llama-cpp-2")?;
            (raw, Some(context_pointer(model, ctx)?))
        } else {
            (Vec::new(), None)
        };
        let mut me = Self {
            adapters,
            raw,
            raw_ctx,
            applied: LoraScales::base(),
        };
        let defaults = LoraScales::new(specs.iter().map(|s| s.scale).collect());
        me.apply(ctx, &defaults)
            .map_err(|e| format!("cannot apply the LoRA adapters: {e}"))?;
        Ok(me)
    }

    /// Sets these scales on the context, unless they are set already.
    pub(super) fn apply(
        &mut self,
        ctx: &mut LlamaContext<'_>,
        scales: &LoraScales,
    ) -> Result<(), BackendError> {
        if *scales == self.applied {
            return Ok(());
        }
        let fail = |code: i32| BackendError::Decode(format!("llama_set_adapters_lora: {code}"));
        match (self.adapters.as_mut_slice(), self.raw_ctx) {
            ([], _) => {}
            ([one], _) => ctx
                .lora_adapter_set(one, scales.get(0))
                .map_err(|e| BackendError::Decode(e.to_string()))?,
            (many, Some(raw_ctx)) => {
                let mut values = scales.to_vec(many.len());
                // SAFETY: `raw_ctx` is this context's pointer (checked at load) and `raw` holds
                // the pointers of adapters of its model, which live as long as the model; the
                // arrays have one entry per adapter. llama.cpp copies what it keeps.
                let code = unsafe {
                    llama_cpp_sys_2::llama_set_adapters_lora(
                        raw_ctx,
                        self.raw.as_mut_ptr(),
                        self.raw.len(),
                        values.as_mut_ptr(),
                    )
                };
                if code != 0 {
                    return Err(fail(code));
                }
            }
            (_, None) => return Err(fail(-1)),
        }
        self.applied = scales.clone();
        Ok(())
    }
}

/// Loads the adapter of every spec, in order (`init` runs one load and says why it failed, from
/// what llama.cpp logged meanwhile if it logged an error).
pub(super) fn load_adapters(
    model: &mut LlamaModel,
    specs: &[LoraSpec],
    init: impl Fn(
        &mut dyn FnMut() -> Result<LlamaLoraAdapter, LlamaLoraAdapterInitError>,
    ) -> Result<LlamaLoraAdapter, String>,
) -> Result<Vec<LlamaLoraAdapter>, String> {
    let mut adapters = Vec::with_capacity(specs.len());
    for spec in specs {
        let path = spec.path.as_path();
        let adapter = init(&mut || model.lora_adapter_init(path))
            .map_err(|why| format!("cannot load LoRA adapter {}: {why}", file_name(path)))?;
        adapters.push(adapter);
    }
    Ok(adapters)
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
    use crate::backend::llama::lora::debug_pointer;

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
