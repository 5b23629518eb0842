//! The `--lora` adapters on the llama.cpp context: loaded with the model, their scales set
//! before each decode whose set differs from the last (`Backend::set_lora`).
//!
//! llama-cpp-2 (0.1.154, and still 0.1.160) sets one adapter (`LlamaContext::lora_adapter_set`
//! replaces the whole list each call). Several adapters at once need one
//! `llama_set_adapters_lora` call with all of them, on the context's and the adapters' llama.cpp
//! pointers, which the crate keeps private (`private_pointers.rs`). With one adapter the safe
//! call is used. Since 0.1.160 an adapter is made from `&mut LlamaModel`, so all of them are
//! loaded before the context (which borrows the model) is made (`load_adapters`).

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::model::{LlamaLoraAdapter, LlamaModel};
use llama_cpp_2::LlamaLoraAdapterInitError;

use super::file_name;
use super::private_pointers::debug_pointer;
use crate::protocol::lora::{LoraScales, LoraSpec};
use crate::protocol::BackendError;

/// The loaded adapters and the scales applied now.
pub(super) struct LoraAdapters {
    adapters: Vec<LlamaLoraAdapter>,
    /// The adapters' llama.cpp pointers, in order (only with several adapters).
    raw: Vec<*mut llama_cpp_sys_2::llama_adapter_lora>,
    /// The scales llama.cpp has now.
    applied: LoraScales,
}

impl LoraAdapters {
    /// No adapters.
    pub(super) fn none() -> Self {
        Self {
            adapters: Vec::new(),
            raw: Vec::new(),
            applied: LoraScales::base(),
        }
    }

    /// Takes the adapters `load_adapters` made for `specs` (in their order) and applies the
    /// specs' scales on `ctx`, whose llama.cpp pointer is `raw_ctx`.
    pub(super) fn load(
        ctx: &mut LlamaContext<'_>,
        raw_ctx: *mut llama_cpp_sys_2::llama_context,
        specs: &[LoraSpec],
        adapters: Vec<LlamaLoraAdapter>,
    ) -> Result<Self, String> {
        let raw = if adapters.len() > 1 {
            adapters
                .iter()
                .map(|a| {
                    debug_pointer(a, "lora_adapter")
                        .map(|p| p as *mut llama_cpp_sys_2::llama_adapter_lora)
                })
                .collect::<Option<Vec<_>>>()
                .ok_or("cannot apply several LoRA adapters with this llama-cpp-2")?
        } else {
            Vec::new()
        };
        let mut me = Self {
            adapters,
            raw,
            applied: LoraScales::base(),
        };
        let defaults = LoraScales::new(specs.iter().map(|s| s.scale).collect());
        me.apply(ctx, raw_ctx, &defaults)
            .map_err(|e| format!("cannot apply the LoRA adapters: {e}"))?;
        Ok(me)
    }

    /// Sets these scales on the context `ctx`, whose llama.cpp pointer is `raw_ctx` (checked
    /// by `private_pointers::context_pointer`), unless they are set already.
    pub(super) fn apply(
        &mut self,
        ctx: &mut LlamaContext<'_>,
        raw_ctx: *mut llama_cpp_sys_2::llama_context,
        scales: &LoraScales,
    ) -> Result<(), BackendError> {
        if *scales == self.applied {
            return Ok(());
        }
        let fail = |code: i32| BackendError::Decode(format!("llama_set_adapters_lora: {code}"));
        match self.adapters.as_mut_slice() {
            [] => {}
            [one] => ctx
                .lora_adapter_set(one, scales.get(0))
                .map_err(|e| BackendError::Decode(e.to_string()))?,
            many => {
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
