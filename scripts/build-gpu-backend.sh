#!/usr/bin/env bash
# Builds one of llama.cpp's GPU backends as a module that the portable wheel loads at run time
# (`libggml-vulkan.so` or `libggml-cuda.so`, ggml's GGML_BACKEND_DL form), from the llama.cpp
# source that llama-cpp-sys-2 vendors, so that it matches the wheel's libggml-base. See
# docs/wheels.md ("GPU backends").
#
#   scripts/build-gpu-backend.sh vulkan OUT_DIR [LLAMA_CPP_SOURCE]
#   scripts/build-gpu-backend.sh cuda   OUT_DIR [LLAMA_CPP_SOURCE]
#
# LLAMA_CPP_SOURCE defaults to the vendored copy cargo has unpacked (`cargo metadata`); on a
# machine without Rust pass a copy of it. The build directory is kept between runs
# ($LLAMARUNNER_GPU_BUILD_DIR, else ~/.cache/llamarunner/gpu-backend-NAME), so a second run
# only relinks. Vulkan needs glslc, the Vulkan loader and SPIRV-Headers (Debian: glslc
# libvulkan-dev spirv-headers); its C++ headers must be newer than Debian 12's 1.3.239, so the
# headers of Debian 13's libvulkan-dev are fetched (checked by hash) when the system's are too
# old. CUDA needs nvcc ($CUDACXX or on PATH); CMAKE_CUDA_ARCHITECTURES defaults to 90 (H100/H200).
set -euo pipefail

name=${1:?usage: build-gpu-backend.sh vulkan|cuda OUT_DIR [LLAMA_CPP_SOURCE]}
out=${2:?usage: build-gpu-backend.sh vulkan|cuda OUT_DIR [LLAMA_CPP_SOURCE]}
source_dir=${3:-}
cache="${XDG_CACHE_HOME:-$HOME/.cache}/llamarunner"

if [ -z "$source_dir" ]; then
  here=$(cd "$(dirname "$0")/.." && pwd)
  sys_dir=$(cd "$here" && cargo metadata --format-version 1 --locked | python3 -c '
import json, os, sys
meta = json.load(sys.stdin)
print(os.path.dirname(next(p["manifest_path"] for p in meta["packages"] if p["name"] == "llama-cpp-sys-2")))')
  source_dir="$sys_dir/llama.cpp"
fi
[ -f "$source_dir/ggml/src/ggml-backend-reg.cpp" ] || {
  echo "no llama.cpp source at $source_dir" >&2
  exit 1
}

flags=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_CPU=OFF
  -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_CURL=OFF
  -DLLAMA_OPENSSL=OFF
)
case "$name" in
  vulkan)
    flags+=(-DGGML_VULKAN=ON)
    # ggml-vulkan uses VK_EXT_layer_settings' C++ types, which Vulkan-Hpp has since 1.3.26x.
    if ! grep -qs LayerSettingEXT /usr/include/vulkan/vulkan_structs.hpp; then
      headers="$cache/vulkan-headers-1.4.309"
      if [ ! -f "$headers/include/vulkan/vulkan.hpp" ]; then
        deb_url=http://deb.debian.org/debian/pool/main/v/vulkan-loader/libvulkan-dev_1.4.309.0-1_amd64.deb
        deb_sha256=8d329d465e16168afff58b1bd0dd6db46aac2cc3f56054a481b25a04e90b345a
        tmp=$(mktemp -d)
        curl -fsSL -o "$tmp/vulkan-dev.deb" "$deb_url"
        echo "$deb_sha256  $tmp/vulkan-dev.deb" | sha256sum -c --quiet
        dpkg-deb -x "$tmp/vulkan-dev.deb" "$tmp/x"
        mkdir -p "$headers"
        rm -rf "$headers/include"
        cp -r "$tmp/x/usr/include" "$headers/include"
        rm -rf "$tmp"
      fi
      flags+=("-DVulkan_INCLUDE_DIR=$headers/include")
    fi
    ;;
  cuda)
    flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES:-90}")
    ;;
  *)
    echo "unknown backend $name (vulkan or cuda)" >&2
    exit 1
    ;;
esac
command -v ninja >/dev/null && flags+=(-G Ninja)

build="${LLAMARUNNER_GPU_BUILD_DIR:-$cache/gpu-backend-$name}"
started=$SECONDS
# A build directory configured from another source tree is started again.
if [ -f "$build/CMakeCache.txt" ] &&
  ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$source_dir" "$build/CMakeCache.txt"; then
  rm -rf "$build"
fi
cmake -S "$source_dir" -B "$build" "${flags[@]}" >/dev/null
cmake --build "$build" --target "ggml-$name" -j "$(nproc)"
mkdir -p "$out"
cp "$build/bin/libggml-$name.so" "$out/"
echo "built $out/libggml-$name.so in $((SECONDS - started)) s"
