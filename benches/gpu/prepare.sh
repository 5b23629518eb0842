#!/usr/bin/env bash
# Prepares benches/gpu/carry/ (ignored by git, under the device tool's 64 MiB) for run.sh on a
# GPU machine that has nvcc, CMake, ninja and Python but no Rust and no network:
#
#   benches/gpu/prepare.sh            # here, in the repository, with the venv active
#   # then, through the device tool, from the repository root with carry benches/gpu/carry:
#   bash benches/gpu/run.sh           # writes its tables under $OUT
#
# It holds: this commit's portable wheel (CPU variants only: the CUDA module is built there,
# from the same llama.cpp), the wheels our package needs for CPython 3.12 (httpx,
# huggingface_hub and theirs), llama.cpp's source as llama-cpp-sys-2 vendors it (xz, without
# its vocabulary files and docs), and the default model's header (make_model.py).
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

# What the wheel depends on, for the GPU machine's Python (3.12 unless told).
py=${GPU_PYTHON_VERSION:-3.12}
python -m pip download -q --only-binary=:all: --python-version "$py" \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any -d "$carry/wheelhouse" \
  "httpx>=0.27" "huggingface_hub>=0.26"

# llama.cpp's source, as the Rust build compiled it.
src=$(cd "$repo" && cargo metadata --format-version 1 --locked | python3 -c '
import json, os, sys
meta = json.load(sys.stdin)
print(os.path.dirname(next(p["manifest_path"] for p in meta["packages"] if p["name"] == "llama-cpp-sys-2")))')
tar -C "$src" -cf - --exclude=llama.cpp/models --exclude=llama.cpp/docs \
  --exclude=llama.cpp/media --exclude=llama.cpp/gguf-py --exclude='*.gguf' llama.cpp |
  xz -6 -T0 >"$carry/llama.cpp.tar.xz"

# The default model's metadata and tensor list (its vocabulary), for models of its shape.
model=$(python -c 'from llamarunner import default_model_path; print(default_model_path())')
python "$repo/benches/gpu/make_model.py" header "$model" "$carry/header.bin"
xz -9 "$carry/header.bin"

du -ah "$carry" | sort -h | tail -8
total=$(du -sm "$carry" | cut -f1)
echo "carry: ${total} MiB in $((SECONDS - started)) s"
if [ "$total" -ge 64 ]; then
  echo "over the device tool's 64 MiB" >&2
  exit 1
fi
