#!/usr/bin/env bash
# Prepares benches/gpu/carry/ (ignored by git, under the device tool's 64 MiB) for run.sh on a
# GPU machine that has nvcc, CMake, ninja and Python but no Rust and no network:
#
#   benches/gpu/prepare.sh            # here, in the repository, with the venv active
#   # then, through the device tool, from the repository root with carry benches/gpu/carry:
#   bash benches/gpu/run.sh           # writes its tables under $OUT
#
# It holds: this commit's portable wheel (CPU variants only), the wheels of httpx and its
# dependencies for CPython 3.12 and of gguf (the version installed here), the peer's llama.cpp source (its ggml the vendored one; xz,
# without vocabulary files, docs, tests, media, the web UI's sources (llama-server builds without
# its UI there: no npm) and the other GPU backends' sources), and the
# default model's header (make_model.py). The 64 MiB is the whole working tree that travels:
# the repository's tracked files (about 4 MB) and the carry.
#
# GPU_MODULE=PATH carries a GPU module built here (scripts/build-gpu-backend.sh cuda, from the
# vendored ggml: docs/wheels.md "CUDA"), xz-compressed, instead of ggml-cuda's source: run.sh
# then builds llama-server for the CPU only (about a minute on 16 cores, where the CUDA module
# takes several of the device's 15) and gives both servers that module. Without it, run.sh
# builds the CUDA module there from the source.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
carry="$repo/benches/gpu/carry"
rm -rf "$carry"
mkdir -p "$carry/wheelhouse"
started=$SECONDS

# The portable wheel of this commit, without GPU modules (LLAMARUNNER_GPU_BACKENDS unset).
(
  cd "$repo"
  env -u LLAMARUNNER_GPU_BACKENDS \
    CARGO_TARGET_DIR="${PORTABLE_TARGET_DIR:-$HOME/.cache/llamarunner/target-portable}" \
    RUSTFLAGS="-C target-cpu=x86-64" \
    maturin build --release --features portable --auditwheel warn --out "$carry/wheelhouse"
)

# What the server and the benchmarks need of the wheel's dependencies, for the GPU machine's
# Python (3.12 unless told): httpx. Not huggingface_hub (with hf_xet, 5 MB): only a model
# named by its Hugging Face repository needs it, and run.sh serves files.
py=${GPU_PYTHON_VERSION:-3.12}
python -m pip download -q --only-binary=:all: --python-version "$py" \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any -d "$carry/wheelhouse" "httpx>=0.27"
# And gguf, without its dependencies (numpy, PyYAML, requests and tqdm are on that machine):
# benches.lora writes its random adapter with it (tests/tinylora.py).
python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
  --implementation cp --platform any -d "$carry/wheelhouse" "gguf==$(python -c '
from importlib.metadata import version; print(version("gguf"))')"

# llama.cpp's source: the peer's (docs/upgrading-llama-cpp.md, step 5: a llama.cpp checkout
# whose ggml/ is the one llama-cpp-sys-2 vendors; the vendored copy has no tools/ sources), so
# that the CUDA module fits the wheel's libggml-base and llama-server runs the same kernels.
src=${LLAMA_CPP_SOURCE:-/work/peer/src}
vendored=$(cd "$repo" && cargo metadata --format-version 1 --locked | python3 -c '
import json, os, sys
meta = json.load(sys.stdin)
print(os.path.dirname(next(p["manifest_path"] for p in meta["packages"] if p["name"] == "llama-cpp-sys-2")))')
[ -f "$src/tools/server/server.cpp" ] || {
  echo "no llama.cpp checkout with tools/server at $src (set LLAMA_CPP_SOURCE)" >&2
  exit 1
}
if ! diff -rq "$src/ggml" "$vendored/llama.cpp/ggml" >/dev/null; then
  echo "$src/ggml is not the vendored ggml of $vendored" >&2
  exit 1
fi
top=$(basename "$src")
# The GPU backends run.sh never builds (ggml adds a backend's directory only when it is on).
skip=()
for backend in vulkan sycl metal cann opencl musa hip webgpu zdnn zendnn hexagon blas rpc et \
  virtgpu openvino; do
  skip+=(--exclude="$top/ggml/src/ggml-$backend")
done
if [ -n "${GPU_MODULE:-}" ]; then
  [ -f "$GPU_MODULE" ] || {
    echo "GPU_MODULE=$GPU_MODULE: no such file" >&2
    exit 1
  }
  mkdir -p "$carry/modules"
  xz -9 -T0 -c "$GPU_MODULE" >"$carry/modules/$(basename "$GPU_MODULE").xz"
  skip+=(--exclude="$top/ggml/src/ggml-cuda")
fi
tar -C "$(dirname "$src")" -cf - --anchored --exclude="$top/models" --exclude="$top/docs" \
  --exclude="$top/media" --exclude="$top/gguf-py" --exclude="$top/benches" \
  --exclude="$top/tests" --exclude="$top/tools/server/tests" --exclude="$top/examples" \
  --exclude="$top/tools/ui/tests" --exclude="$top/tools/ui/src" --exclude="$top/tools/ui/static" \
  --exclude="$top/tools/ui/package.json" --exclude="$top/tools/ui/package-lock.json" \
  --exclude="$top/.github" "${skip[@]}" \
  --no-anchored --exclude='*.gguf' --exclude='*.mp4' \
  --transform "s,^$top,llama.cpp," "$top" |
  xz -6 -T0 >"$carry/llama.cpp.tar.xz"

# The default model's metadata and tensor list (its vocabulary), for models of its shape.
model=$(python -c 'from llamarunner import default_model_path; print(default_model_path())')
python "$repo/benches/gpu/make_model.py" header "$model" "$carry/header.bin"
xz -9 "$carry/header.bin"

du -ah "$carry" | sort -h | tail -8
tracked=$(cd "$repo" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
carried=$(du -sb "$carry" | cut -f1)
total=$(((tracked + carried) / 1048576))
if [ "$total" -ge 63 ]; then
  # Room for the tree to grow: the GPU machine's image has httpx (the device tool's KINDS.md),
  # so its wheels are the first thing left behind.
  echo "leaving httpx's wheels behind (the GPU machine has httpx)"
  find "$carry/wheelhouse" -name '*.whl' ! -name 'llamarunner-*' ! -name 'gguf-*' -delete
  carried=$(du -sb "$carry" | cut -f1)
  total=$(((tracked + carried) / 1048576))
fi
echo "carry: $((carried / 1048576)) MiB, with the tracked files ${total} MiB, in $((SECONDS - started)) s"
if [ "$total" -ge 64 ]; then
  echo "over the device tool's 64 MiB" >&2
  exit 1
fi
