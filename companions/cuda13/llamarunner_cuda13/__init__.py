"""llama.cpp's CUDA backend for llamarunner, as a module its core loads at run time.

Nothing here is imported: llamarunner finds this package's ``lib/`` directory, opens the CUDA
runtime of NVIDIA's packages, and loads ``lib/libggml-cuda.so`` (see llamarunner's
``_gpu_modules``).
"""
