#!/usr/bin/env bash
# The GPU benchmark, on a machine with nvcc, CMake, ninja, 16 cores and Python 3.12 but no
# Rust and no network (issue #42), run from the repository root with benches/gpu/carry made
# by prepare.sh. Every step appends to $OUT (the device tool brings it back), so a run cut
# short by its time limit still returns what it measured:
#
#   $OUT/run.log              each step with its time
#   $OUT/devices.txt          llamarunner serve --list-devices
#   $OUT/load-gemma.md        ours vs llama-server, the default model's shape (262k vocabulary)
#   $OUT/ceiling.md           the server's own ceiling (--null-decode), 1 and 16 sampling threads
#   $OUT/batched-bench.txt    llama-batched-bench at the same widths (the kernels' ceiling)
#   $OUT/load-gemma-device-sampling.md  both with --backend-sampling (llama-server's chain on
#                             the device; ours: the top-k cut there, the rest on the host) at 8
#                             and 64 clients
#   $OUT/load-gemma-ours-device-sampling.md  ours with --backend-sampling against ours
#                             without, paired, at 64 clients (which is faster: the default)
#   $OUT/lora-gemma.md        ours with one random adapter (benches.lora): one, two and four
#                             scale sets among 4 clients, and what the step trace says of the
#                             turns and of what a change of set costs on the GPU
#   $OUT/load-llama8b.md      ours vs llama-server, a llama 8B shape in Q4_K
#
# A GPU module in the carry (prepare.sh's GPU_MODULE) is given to both servers, and llama.cpp is
# then built for the CPU only. Settings (environment): GGML_CUDA=OFF for a dry run on a CPU
# machine (with no carried module: the CPU only); GPU_WORK (build and
# models, default /tmp/gpu-work; a second run reuses the build); CLIENTS (default
# single,parallel8,parallel32,parallel64); LLAMA_LAYERS (fewer layers for a dry run);
# CEILING_STREAMS (default 64,256) and CEILING_SECONDS (default 8); DEVSAMPLING_CLIENTS (default
# parallel8,parallel64);
# STEPS (default build,install,models,load,ceiling,batched,devsampling,lora,llama8b).
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
carry="$repo/benches/gpu/carry"
out=${OUT:-/tmp/gpu-out}
work=${GPU_WORK:-/tmp/gpu-work}
cuda=${GGML_CUDA:-ON}
clients=${CLIENTS:-single,parallel8,parallel32,parallel64}
steps=${STEPS:-build,install,models,load,ceiling,batched,devsampling,lora,llama8b}
mkdir -p "$out" "$work"
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$out/run.log"; }
want() { [[ ",$steps," == *",$1,"* ]]; }
[ -f "$carry/llama.cpp.tar.xz" ] || {
  echo "no $carry: run benches/gpu/prepare.sh first and carry it" >&2
  exit 1
}

# The CUDA runtime and cuBLAS, from the toolkit or from the nvidia-* Python packages.
if command -v nvcc >/dev/null; then
  export LD_LIBRARY_PATH="$(dirname "$(command -v nvcc)")/../lib64:${LD_LIBRARY_PATH:-}"
fi
for d in $(python3 -c 'import glob, site; print(" ".join(glob.glob(p + "/nvidia/*/lib") for p in site.getsitepackages()))' 2>/dev/null | tr ' ' '\n'); do
  export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
done
log "machine: $(nproc) cores; $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo no nvidia-smi); nvcc $(nvcc --version 2>/dev/null | tail -1 || echo none)"

# A GPU module prepare.sh carried (GPU_MODULE there): both servers load it, and only the CPU
# parts are built here.
carried=$(ls "$carry"/modules/libggml-*.so.xz 2>/dev/null | head -n 1 || true)
modules="$work/modules"
if [ -n "$carried" ]; then
  cuda=OFF
  mkdir -p "$modules"
  module="$modules/$(basename "$carried" .xz)"
  [ -f "$module" ] || xz -dc "$carried" >"$module"
  log "module: $(basename "$module") carried ($(du -m "$module" | cut -f1) MB)"
fi
gpu=$([ "$cuda" = ON ] || [ -n "$carried" ] && echo ON || echo OFF)

build="$work/build"
if want build; then
  # One build for both: the CUDA module our wheel loads (unless carried) and llama-server,
  # which loads the same modules (GGML_BACKEND_DL; its CPU backend at the AVX2 level:
  # GGML_NATIVE cannot go with modules, and the CPU does little beside a GPU).
  log "build: llama.cpp (CUDA $cuda) from the vendored source"
  [ -d "$work/llama.cpp" ] || tar -C "$work" -xJf "$carry/llama.cpp.tar.xz"
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S "$work/llama.cpp" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_CUDA="$cuda" \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CMAKE_CUDA_ARCHITECTURES:-90}" -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >"$out/cmake.log" 2>&1
  targets=(llama-server llama-batched-bench ggml-cpu)
  [ "$cuda" = ON ] && targets+=(ggml-cuda)
  cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" >"$out/build.log" 2>&1
  # llama-server looks for backend modules beside its executable.
  if [ -n "$carried" ]; then cp "$module" "$build/bin/"; fi
  log "build: done ($(ls "$build"/bin | tr '\n' ' '))"
fi

venv="$work/venv"
py="$venv/bin/python"
if want install; then
  log "install: our wheel and its dependencies (no network)"
  python3 -m venv --system-site-packages "$venv"
  "$py" -m pip install -q --no-index --find-links "$carry/wheelhouse" --no-deps llamarunner
  "$py" -c 'import httpx' 2>/dev/null ||
    "$py" -m pip install -q --no-index --find-links "$carry/wheelhouse" httpx
  "$py" -c 'import gguf' 2>/dev/null ||
    "$py" -m pip install -q --no-index --no-deps --find-links "$carry/wheelhouse" gguf
  if [ "$gpu" = ON ]; then
    lib=$("$py" -c 'import llamarunner, os; print(os.path.join(os.path.dirname(llamarunner.__file__), "lib"))')
    if [ -n "$carried" ]; then cp "$module" "$lib/"; else cp "$build/bin/libggml-cuda.so" "$lib/"; fi
  fi
  "$py" -m llamarunner serve --list-devices | tee "$out/devices.txt"
  log "install: done"
fi

gemma="$work/gemma-shape.gguf"
llama8b="$work/llama8b-q4_k.gguf"
if want models; then
  log "models: random weights, the default model's shape and a llama 8B (Q4_K)"
  [ -f "$work/header.bin" ] || xz -dc "$carry/header.bin.xz" >"$work/header.bin"
  python3 "$repo/benches/gpu/make_model.py" like "$work/header.bin" "$gemma"
  if want llama8b; then
    python3 "$repo/benches/gpu/make_model.py" llama "$work/header.bin" "$llama8b" --type q4_k \
      ${LLAMA_LAYERS:+--layers "$LLAMA_LAYERS"}
  fi
  log "models: done"
fi

cd "$repo"
server="$build/bin/llama-server"
threads=$(($(nproc) < 8 ? $(nproc) : 8))
load() { # MODEL NAME [SCENARIOS [LLAMA-SERVER FLAGS [OUR FLAGS]]]
  log "load: $2 at ${3:-$clients} clients, ours ${5:-} vs llama-server ${4:-}"
  "$py" -m benches.load --model "$1" --dialect openai --llama-server "$server" \
    --peer-flags="${4:-}" --ours-flags="${5:-}" --scenarios "${3:-$clients}" --requests 2 \
    --no-baseline \
    --threads "$threads" --json "$out/load-$2.json" >"$out/load-$2.md" 2>"$out/load-$2.err" ||
    log "load: $2 failed"
  log "load: $2 done"
}
want load && load "$gemma" gemma

if want ceiling; then
  log "ceiling: --null-decode, ${CEILING_STREAMS:-64,256} streams"
  "$py" -m benches.sampling_ceiling --model "$gemma" --streams "${CEILING_STREAMS:-64,256}" \
    --presets openai,ollama,full --threads "1,$(nproc)" --seconds "${CEILING_SECONDS:-8}" \
    --out "$out/ceiling.md" 2>"$out/ceiling.err" ||
    log "ceiling: failed"
  log "ceiling: done"
fi

if want batched; then
  log "batched-bench: the kernels' ceiling at the same widths"
  ngl=$([ "$gpu" = ON ] && echo 99 || echo 0)
  "$build/bin/llama-batched-bench" -m "$gemma" -c 32768 -b 2048 -ub 512 -npp 200 -ntg 64 \
    -npl 1,8,32,64 -ngl "$ngl" -fa on >"$out/batched-bench.txt" 2>"$out/batched-bench.err" ||
    log "batched-bench: failed"
  log "batched-bench: done"
fi

# Sampling on the device (#42: measure it, take whichever is faster). llama-server's
# --backend-sampling runs its sampler chain in the decode's graph and only the token comes back;
# ours cuts each position's top-k there and brings back k candidates (the rest of the chain on
# the host), where without it every sequence's 262,144 logits come back to the host.
if want devsampling; then
  load "$gemma" gemma-device-sampling "${DEVSAMPLING_CLIENTS:-parallel8,parallel64}" \
    --backend-sampling --backend-sampling
  log "load: ours with --backend-sampling against ours without, paired"
  "$py" -m benches.load --model "$gemma" --dialect openai --base-python "$py" \
    --ours-flags=--backend-sampling --scenarios parallel64 --requests 2 --repeat 2 --together \
    --no-baseline --threads "$threads" --json "$out/load-gemma-ours-device-sampling.json" \
    >"$out/load-gemma-ours-device-sampling.md" 2>"$out/load-gemma-ours-device-sampling.err" ||
    log "load: ours-device-sampling failed"
  log "load: ours-device-sampling done"
fi

# What a change of LoRA scale set costs where llama.cpp allocates its compute buffers again at
# each (sched/lora.rs sizes the turns by it): one random adapter on the default model's shape.
if want lora; then
  log "lora: one, two and four scale sets among 4 clients"
  "$py" -m benches.lora --model "$gemma" --threads "$threads" --scenarios one,two,four \
    --tokens 128 --requests 2 >"$out/lora-gemma.md" 2>"$out/lora-gemma.err" ||
    log "lora: failed"
  log "lora: done"
fi

want llama8b && load "$llama8b" llama8b
log "all done"
