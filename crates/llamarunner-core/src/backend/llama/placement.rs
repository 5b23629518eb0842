//! Where a model's layers go, decided before it loads: the GPUs llama.cpp found, `--main-gpu`,
//! `--split-mode` and `--tensor-split` checked against them, and the fit (llama.cpp's
//! `common_fit_params`, which llama-server runs by default): with `n_gpu_layers` -1 it offloads
//! as many layers as fit each GPU's free memory less `--fit-target` with the weights, the KV
//! cache of every slot and the compute buffers; an explicit `n_gpu_layers` above that is a start
//! error instead of an out-of-memory failure later. The draft model and the vision projector,
//! which load after the model and go where its layers went, and the larger compute graph of
//! `--backend-sampling`, are kept room for on the main GPU (`reservation`). On a machine
//! without a GPU nothing changes.

use std::pin::Pin;

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::model::params::{FitError, LlamaModelParams, LlamaSplitMode};

use crate::config::{RunnerConfig, SplitMode};
use crate::protocol::devices::{Device, Fit};
use crate::protocol::memory_estimate;

const MIB: u64 = 1024 * 1024;

/// Where a model's layers go, as decided before it loads: what its facts
/// (`devices::facts`) report.
pub(super) struct Placement {
    /// The devices found, with their free memory before the model took any.
    pub devices: Vec<Device>,
    /// The layers the model is loaded with on GPUs (-1: all).
    pub n_gpu_layers: i32,
    /// The split mode the model is loaded with.
    pub split_mode: SplitMode,
    /// What the fit chose, if it ran.
    pub fit: Option<Fit>,
}

/// The model parameters that place the layers on `devices` (the caller adds how the file is
/// read), and the placement they make.
pub(super) fn place(
    config: &RunnerConfig,
    devices: Vec<Device>,
    ctx_params: &mut LlamaContextParams,
) -> Result<(LlamaModelParams, Placement), String> {
    let (params, fit) = params_and_fit(config, &devices, ctx_params)?;
    let gpus = devices.iter().any(|d| d.kind.is_gpu());
    let split_mode = match (gpus, config.tensor_split.is_some()) {
        // llama.cpp's default, untouched without a GPU.
        (false, _) => SplitMode::Layer,
        // The one GPU a tensor split chose holds the model.
        (true, true) => SplitMode::None,
        (true, false) => config.split_mode,
    };
    let placement = Placement {
        devices,
        n_gpu_layers: params.n_gpu_layers(),
        split_mode,
        fit,
    };
    Ok((params, placement))
}

/// The model parameters that place the layers and what the fit chose, if it ran.
fn params_and_fit(
    config: &RunnerConfig,
    devices: &[Device],
    ctx_params: &mut LlamaContextParams,
) -> Result<(LlamaModelParams, Option<Fit>), String> {
    // ggml's device index of each GPU, in the order llama.cpp numbers them for --main-gpu.
    let gpus: Vec<(usize, &Device)> = devices
        .iter()
        .enumerate()
        .filter(|(_, d)| d.kind.is_gpu())
        .collect();
    let names = || {
        gpus.iter()
            .map(|(_, d)| format!("{} ({})", d.name, d.description))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let shares = config.tensor_split_values().map_err(|e| e.to_string())?;
    let main_gpu = usize::try_from(config.main_gpu).unwrap_or(usize::MAX);
    if gpus.is_empty() {
        if config.main_gpu != 0 {
            return Err(format!("--main-gpu {}: no GPU was found", config.main_gpu));
        }
        if shares.is_some() {
            return Err("--tensor-split: no GPU was found".into());
        }
        // As before GPUs were looked for: llama.cpp offloads nothing without one.
        return Ok((
            LlamaModelParams::default().with_n_gpu_layers(layers_param(config.n_gpu_layers)),
            None,
        ));
    }
    if main_gpu >= gpus.len() {
        return Err(format!(
            "--main-gpu {}: the GPUs are numbered from 0 and {} found: {}",
            config.main_gpu,
            gpus.len(),
            names()
        ));
    }
    let split_mode = match config.split_mode {
        SplitMode::None => LlamaSplitMode::None,
        SplitMode::Layer => LlamaSplitMode::Layer,
        SplitMode::Row => LlamaSplitMode::Row,
    };
    let base = || -> Result<LlamaModelParams, String> {
        let params = LlamaModelParams::default()
            .with_main_gpu(config.main_gpu)
            .with_split_mode(split_mode);
        let Some(shares) = &shares else {
            return Ok(params);
        };
        let chosen = tensor_split_device(shares, gpus.len()).map_err(|why| {
            format!(
                "--tensor-split {}: {why} (GPUs found: {})",
                config.tensor_split.as_deref().unwrap_or_default(),
                names()
            )
        })?;
        // The one GPU with a share holds the model: a device list of that GPU alone.
        params
            .with_devices(&[gpus[chosen].0])
            .map(|p| p.with_main_gpu(0).with_split_mode(LlamaSplitMode::None))
            .map_err(|e| format!("--tensor-split: {e}"))
    };
    let params = base()?;
    if !config.fit || config.split_mode == SplitMode::Row {
        // llama.cpp's fit does not move weights of a row split.
        return Ok((
            params.with_n_gpu_layers(layers_param(config.n_gpu_layers)),
            None,
        ));
    }
    let margin = config.fit_target.saturating_mul(MIB);
    let reserved = reservation(config)?;
    let reserved_mib = reserved.div_ceil(MIB);
    // The main GPU's index among the devices the model is given: the one GPU of a tensor
    // split's device list, else --main-gpu.
    let main = if shares.is_some() { 0 } else { main_gpu };
    let fitted = |mut params: LlamaModelParams, ctx_params: &mut LlamaContextParams| {
        fit(config, &mut params, ctx_params, margin, (main, reserved)).map(|fits| (params, fits))
    };
    if config.n_gpu_layers == -1 {
        let (params, fits) = fitted(params, ctx_params)?;
        if !fits {
            tracing::warn!(
                fit_target_mib = config.fit_target,
                reserved_mib,
                gpus = %names(),
                "the model does not fit the GPUs' free memory even with no layers there; \
                 running it on the CPU"
            );
            let params = base()?.with_n_gpu_layers(0);
            let fit = Fit::new(config.fit_target, 0, false).with_reserved(reserved_mib);
            return Ok((params, Some(fit)));
        }
        let layers = params.n_gpu_layers();
        let fit = Fit::new(config.fit_target, layers, true).with_reserved(reserved_mib);
        return Ok((params, Some(fit)));
    }
    // An explicit count: measured on a copy of the parameters (the fit changes only what is
    // left at its default), then honoured or refused.
    let mut probe_ctx = ctx_params.clone();
    let (probe, fits) = fitted(base()?, &mut probe_ctx)?;
    let most = if fits { probe.n_gpu_layers() } else { 0 };
    if most >= 0 && config.n_gpu_layers > most {
        let kept = if reserved_mib > 0 {
            format!(
                " and {reserved_mib} MiB kept for the draft model, the projector and \
                 --backend-sampling"
            )
        } else {
            String::new()
        };
        return Err(format!(
            "--n-gpu-layers {} does not fit: at most {most} layers fit the free memory of {} \
             with {} MiB left free (--fit-target){kept}; give fewer layers, a smaller \
             --fit-target, or --no-fit to load without checking",
            config.n_gpu_layers,
            names(),
            config.fit_target
        ));
    }
    Ok((
        params.with_n_gpu_layers(layers_param(config.n_gpu_layers)),
        Some(Fit::new(config.fit_target, config.n_gpu_layers, true).with_reserved(reserved_mib)),
    ))
}

/// What the draft model, the vision projector and `--backend-sampling`'s cuts will take on the
/// main GPU, in bytes: the first two load after the model, and go to the GPU when its layers
/// do; the cuts enlarge the compute graph at their first attach. The draft model with every
/// layer offloaded (`Estimate::on_device`: its weights less the token embedding, its KV cache
/// for every slot, its compute buffers), estimated from its header; the projector, its file;
/// the cuts, `backend_sampling_room`. Only a fit reads this, so without a GPU the files are not
/// read.
fn reservation(config: &RunnerConfig) -> Result<u64, String> {
    let draft = match &config.draft_model {
        // `draft` keeps the context, slots, batch and cache type, and drops the rest.
        Some(path) => memory_estimate::draft(path, &config.served())
            .map_err(|e| format!("--draft-model: {e}"))?
            .on_device(),
        None => 0,
    };
    let projector = match &config.mmproj {
        Some(path) => std::fs::metadata(path)
            .map_err(|e| format!("--mmproj {}: {e}", path.display()))?
            .len(),
        None => 0,
    };
    let cuts = if config.backend_sampling {
        match crate::protocol::memory_estimate::read_shape(&config.model) {
            Ok(shape) => backend_sampling_room(config, shape.vocab),
            Err(e) => {
                tracing::warn!(error = %e, "--backend-sampling: no room kept for the cuts");
                0
            }
        }
    } else {
        0
    };
    Ok(draft.saturating_add(projector).saturating_add(cuts))
}

/// What the compute buffer grows by once a `--backend-sampling` chain is attached, for a model
/// of `n_vocab` tokens: llama.cpp's worst-case graph (a micro-batch whose every position is an
/// output) then holds a second row of logits per position, `n_ubatch` x `n_vocab` floats, on
/// the output layer's device. Measured on the CPU with Gemma 3 270M (262,144 tokens): 523 to
/// 1,036 MiB with batches of 512, 130 to 259 MiB with batches of 128, whatever `--parallel`.
/// Without that room on a GPU the first attach fails, and the cuts stop
/// (`guarded_decode.rs`).
fn backend_sampling_room(config: &RunnerConfig, n_vocab: u64) -> u64 {
    let cells = u64::from(config.ctx_size).saturating_mul(u64::from(config.parallel.max(1)));
    let positions = u64::from(config.batch_size).min(cells).max(1);
    positions.saturating_mul(n_vocab).saturating_mul(4)
}

/// Runs llama.cpp's fit on `params` (which it changes): true when the layers it chose fit,
/// false when even none do. `margin` is left free on every device, and `reserved.1` bytes
/// more on the device at index `reserved.0`.
fn fit(
    config: &RunnerConfig,
    params: &mut LlamaModelParams,
    ctx_params: &mut LlamaContextParams,
    margin: u64,
    reserved: (usize, u64),
) -> Result<bool, String> {
    let path = std::ffi::CString::new(config.model.as_os_str().as_encoded_bytes())
        .map_err(|_| "the model path contains a NUL byte".to_string())?;
    let mut margins =
        vec![usize::try_from(margin).unwrap_or(usize::MAX); llama_cpp_2::max_devices()];
    if let Some(main) = margins.get_mut(reserved.0) {
        *main = main.saturating_add(usize::try_from(reserved.1).unwrap_or(usize::MAX));
    }
    let n_ctx = ctx_params.n_ctx().map_or(0, std::num::NonZeroU32::get);
    match Pin::new(params).fit_params(
        &path,
        ctx_params,
        &mut margins,
        n_ctx,
        llama_cpp_sys_2::GGML_LOG_LEVEL_INFO,
    ) {
        Ok(_) => Ok(true),
        Err(FitError::Failure) => Ok(false),
        Err(FitError::Error) => Err(format!(
            "llama.cpp could not measure what {} needs on the GPUs (see the log above)",
            super::file_name(&config.model)
        )),
    }
}

/// `n_gpu_layers` as the bindings take it: -1 (all) is the largest count.
fn layers_param(n_gpu_layers: i32) -> u32 {
    u32::try_from(n_gpu_layers).unwrap_or(u32::MAX)
}

/// The GPU a `--tensor-split` puts the model on, of `gpus`: the one share above 0. Several
/// shares above 0 would split the model by proportion, which the bindings (llama-cpp-2
/// 0.1.160 sets no `tensor_split`) do not reach.
pub(super) fn tensor_split_device(shares: &[f32], gpus: usize) -> Result<usize, String> {
    if shares.len() > gpus {
        return Err(format!(
            "{} shares for {gpus} GPU{}",
            shares.len(),
            if gpus == 1 { "" } else { "s" }
        ));
    }
    let used: Vec<usize> = (0..shares.len()).filter(|&i| shares[i] > 0.0).collect();
    match used.as_slice() {
        [one] => Ok(*one),
        [] => Err("no share above 0".into()),
        _ => Err(
            "a split by proportion across several GPUs is not reachable through the \
                  llama-cpp-2 bindings this build uses; give one GPU a share (the model goes \
                  there) or leave --tensor-split out (llama.cpp then splits the layers by the \
                  GPUs' free memory)"
                .into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::{backend_sampling_room, tensor_split_device};
    use crate::config::RunnerConfig;

    #[test]
    fn a_tensor_split_chooses_the_one_gpu_with_a_share() {
        assert_eq!(tensor_split_device(&[1.0], 1), Ok(0));
        assert_eq!(tensor_split_device(&[0.0, 3.0], 2), Ok(1));
        assert!(tensor_split_device(&[1.0, 1.0], 1).is_err());
        assert!(tensor_split_device(&[3.0, 1.0], 2).is_err());
        assert!(tensor_split_device(&[0.0, 0.0], 2).is_err());
    }

    /// The room kept for `--backend-sampling`: a row of logits per position of a micro-batch
    /// (the batch, or the whole context where that is smaller), as measured on the CPU for
    /// Gemma 3 270M (523 to 1,036 MiB with batches of 512, 130 to 259 MiB with 128).
    #[test]
    fn the_cuts_room_is_a_row_of_logits_per_position_of_a_micro_batch() {
        const MIB: u64 = 1 << 20;
        let config = |batch_size: u32, ctx_size: u32, parallel: u32| RunnerConfig {
            batch_size,
            ctx_size,
            parallel,
            backend_sampling: true,
            ..RunnerConfig::default()
        };
        assert_eq!(
            backend_sampling_room(&config(512, 2048, 4), 262_144),
            512 * MIB
        );
        assert_eq!(
            backend_sampling_room(&config(128, 1024, 2), 262_144),
            128 * MIB
        );
        assert_eq!(backend_sampling_room(&config(512, 64, 2), 1000), 128 * 4000);
        assert_eq!(backend_sampling_room(&config(512, 2048, 0), 10), 512 * 40);
    }
}
