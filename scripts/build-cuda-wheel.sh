#!/usr/bin/env bash
# Packs a CUDA module (libggml-cuda.so from build-gpu-backend.sh cuda) into the CUDA companion
# wheel, llamarunner-cuda13 (companions/cuda13), tagged for this platform by the newest glibc
# symbol the module needs. See docs/wheels.md ("CUDA").
#
#   scripts/build-cuda-wheel.sh MODULE OUT_DIR
set -euo pipefail

module=${1:?usage: build-cuda-wheel.sh MODULE OUT_DIR}
out=${2:?usage: build-cuda-wheel.sh MODULE OUT_DIR}
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}

grep -qa 'libcudart\.so\.13' "$module" || {
  echo "$module does not need libcudart.so.13: not a CUDA 13 module" >&2
  exit 1
}
glibc=$(objdump -T "$module" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -1)
tag="manylinux_${glibc%%.*}_${glibc#*.}_$(uname -m)"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$here/companions/cuda13" "$tmp/src"
mkdir -p "$tmp/src/llamarunner_cuda13/lib"
cp "$module" "$tmp/src/llamarunner_cuda13/lib/libggml-cuda.so"
"$python" -m pip wheel -q --no-deps -w "$tmp/dist" "$tmp/src"
"$python" -m pip install -q wheel
"$python" -m wheel tags --remove --platform-tag "$tag" "$tmp/dist"/*.whl >/dev/null
mkdir -p "$out"
cp "$tmp/dist"/*.whl "$out/"
ls "$out"/llamarunner_cuda13-*.whl
