#!/usr/bin/env bash
# Makes a CUDA 13 toolkit from NVIDIA's PyPI packages (nvcc, its crt headers and NVVM, the
# runtime, cuBLAS, CCCL) in a virtualenv, laid out as CMake's FindCUDAToolkit and nvcc expect,
# so that build-gpu-backend.sh cuda compiles llama.cpp's CUDA module on a machine with no
# toolkit and no GPU. Prints the toolkit's root; then:
#
#   root=$(scripts/cuda-toolkit-from-pypi.sh ~/.cache/llamarunner/cuda13)
#   CUDACXX=$root/bin/nvcc CUDAToolkit_ROOT=$root scripts/build-gpu-backend.sh cuda OUT_DIR
#
# The versions are pinned to CUDA 13.0, the oldest 13 (a module built with it runs with every
# 13.x runtime and driver). The PyPI packages carry no libcuda.so link stub: one is made here.
set -euo pipefail

venv=${1:?usage: cuda-toolkit-from-pypi.sh VENV_DIR}
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q \
  nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
  nvidia-cuda-runtime==13.0.96 nvidia-cublas==13.0.2.14 nvidia-cuda-cccl==13.0.85 >&2
root=$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
[ -x "$root/bin/nvcc" ] || {
  echo "no nvcc in $root" >&2
  exit 1
}
# nvcc links from lib64; CMake links the unversioned names.
ln -sfn lib "$root/lib64"
for name in cudart cublas cublasLt; do
  ln -sf "lib$name.so.13" "$root/lib/lib$name.so"
done
# The driver's link stub, as the toolkit's lib64/stubs/libcuda.so is: every function cuda.h
# declares (their versioned names, after the preprocessor), defined empty, in a library named
# libcuda.so.1. A module linked against it asks for libcuda.so.1, and the driver's provides
# the functions when it loads.
mkdir -p "$root/lib/stubs"
if [ ! -f "$root/lib/stubs/libcuda.so" ]; then
  printf '#include <cuda.h>\n' | cc -E -I "$root/include" -x c - |
    grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d '( \t' | sort -u |
    sed 's/.*/void &(void) {}/' |
    cc -shared -fPIC -x c - -o "$root/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1
fi
echo "$root"
