"""GPU modules from companion packages, and the CUDA runtime they need.

The portable wheel's core loads llama.cpp's GPU backends as modules at run time
(docs/wheels.md, "GPU backends"). The CUDA module ships apart, in the companion wheel
``llamarunner-cuda13`` (``pip install 'llamarunner[cuda]'``), and needs the CUDA runtime and
cuBLAS, which come from NVIDIA's PyPI packages (``nvidia-cuda-runtime``, ``nvidia-cublas``), as
PyTorch's do. The dynamic loader reads ``LD_LIBRARY_PATH`` only when a process starts, so
:func:`prepare` opens those libraries by path, globally, before the core loads the module: the
module's needs are then met by libraries already in the process. A CUDA runtime the system's
loader finds (an installed toolkit) is taken first. Nothing here fails: a library that is
nowhere is left for the core, which skips the module with the loader's reason.
"""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
import os
import re
from functools import cache
from pathlib import Path

#: Where the core looks for GPU modules besides its own directory (separated as PATH is).
MODULE_PATH_ENV = "LLAMARUNNER_GPU_MODULE_PATH"

#: The companion packages' import names; each keeps its modules in ``lib/``.
COMPANIONS = ("llamarunner_cuda13",)

#: The CUDA libraries a CUDA module needs, in the order they depend on each other.
_CUDA_LIBRARIES = ("libcudart.so.{major}", "libcublasLt.so.{major}", "libcublas.so.{major}")


def companion_dirs() -> list[Path]:
    """The ``lib`` directories of the companion packages installed."""
    found = []
    for name in COMPANIONS:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            lib = Path(location) / "lib"
            if lib.is_dir():
                found.append(lib)
    return found


def cuda_major(module: Path) -> int | None:
    """The CUDA major version a module was linked against (from the runtime it names)."""
    try:
        with module.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            found = re.search(rb"libcudart\.so\.(\d+)\x00", m)
            # Read before the map closes: the match points into it.
            return int(found.group(1)) if found else None
    except (OSError, ValueError):
        return None


def nvidia_library_dirs() -> list[Path]:
    """The library directories of NVIDIA's PyPI packages (``nvidia/cu13/lib`` for CUDA 13,
    ``nvidia/<component>/lib`` for CUDA 12)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    dirs: list[Path] = []
    for root in map(Path, spec.submodule_search_locations):
        dirs.extend(sorted(p for p in root.glob("*/lib") if p.is_dir()))
    return dirs


def open_cuda_runtime(major: int, search: list[Path]) -> list[str]:
    """Opens the CUDA runtime and cuBLAS of ``major`` globally: from the system's loader path
    when it has them, else from ``search``. Returns what was opened, by path or name."""
    opened = []
    for pattern in _CUDA_LIBRARIES:
        name = pattern.format(major=major)
        candidates = [name] + [str(d / name) for d in search if (d / name).is_file()]
        for candidate in candidates:
            try:
                ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            opened.append(candidate)
            break
    return opened


@cache
def prepare() -> tuple[str, ...]:
    """Makes the installed companions' modules visible to the core and opens the CUDA runtime
    a CUDA module needs. Once per process, before the core loads its backends; returns the
    runtime libraries opened."""
    extra = companion_dirs()
    if extra:
        given = os.environ.get(MODULE_PATH_ENV)
        # A directory the user names comes first: its modules win over the companion's.
        os.environ[MODULE_PATH_ENV] = os.pathsep.join(
            ([given] if given else []) + [str(d) for d in extra]
        )
    module_dirs = [Path(__file__).parent / "lib"] + [
        Path(p) for p in os.environ.get(MODULE_PATH_ENV, "").split(os.pathsep) if p
    ]
    majors = {
        major
        for d in module_dirs
        if (d / "libggml-cuda.so").is_file()
        for major in [cuda_major(d / "libggml-cuda.so")]
        if major is not None
    }
    if not majors:
        return ()
    search = nvidia_library_dirs()
    return tuple(lib for major in sorted(majors) for lib in open_cuda_runtime(major, search))
