"""Where the CUDA companion's module is found and which CUDA runtime is opened for it
(``llamarunner._gpu_modules``); the module's loading itself is tested on the portable wheel in
test_build.py and test_gpu.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamarunner import _gpu_modules


def test_the_cuda_major_is_read_from_the_runtime_the_module_names(tmp_path: Path) -> None:
    module = tmp_path / "libggml-cuda.so"
    module.write_bytes(b"\x7fELF" + b"\0" * 64 + b"libcublas.so.13\0libcudart.so.13\0tail")
    assert _gpu_modules.cuda_major(module) == 13
    module.write_bytes(b"\x7fELF\0libcudart.so.12\0")
    assert _gpu_modules.cuda_major(module) == 12
    module.write_bytes(b"\x7fELF\0libvulkan.so.1\0")
    assert _gpu_modules.cuda_major(module) is None
    module.write_bytes(b"")
    assert _gpu_modules.cuda_major(module) is None  # mmap refuses an empty file
    assert _gpu_modules.cuda_major(tmp_path / "gone.so") is None


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(_gpu_modules.MODULE_PATH_ENV, raising=False)
    _gpu_modules.prepare.cache_clear()
    yield
    _gpu_modules.prepare.cache_clear()


def site_with_companion(root: Path, module: bytes) -> Path:
    package = root / "llamarunner_cuda13"
    (package / "lib").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "lib" / "libggml-cuda.so").write_bytes(module)
    return package / "lib"


def test_a_companion_is_put_after_the_users_module_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    lib = site_with_companion(tmp_path, b"no runtime named here")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(_gpu_modules.MODULE_PATH_ENV, "/opt/mine")
    assert _gpu_modules.companion_dirs() == [lib]
    assert _gpu_modules.prepare() == ()
    assert os.environ[_gpu_modules.MODULE_PATH_ENV] == os.pathsep.join(["/opt/mine", str(lib)])


def test_no_companion_leaves_everything_as_it_was(
    monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    # Whether or not this machine has the CUDA companion installed.
    monkeypatch.setattr(_gpu_modules, "COMPANIONS", ("llamarunner_companion_not_installed",))
    assert _gpu_modules.companion_dirs() == []
    assert _gpu_modules.prepare() == ()
    assert _gpu_modules.MODULE_PATH_ENV not in os.environ


def test_the_runtime_is_looked_for_in_nvidias_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    """A CUDA 13 module: the CUDA 13 libraries are looked for, in the loader's path and then in
    the `nvidia` packages' lib directories; files that are not libraries are not opened."""
    site_with_companion(tmp_path, b"\x7fELF\0libcudart.so.13\0")
    for component in ("cu13", "cuda_runtime"):
        (tmp_path / "nvidia" / component / "lib").mkdir(parents=True)
    (tmp_path / "nvidia" / "cu13" / "lib" / "libcudart.so.13").write_bytes(b"not a library")
    monkeypatch.syspath_prepend(str(tmp_path))
    dirs = _gpu_modules.nvidia_library_dirs()
    assert tmp_path / "nvidia" / "cu13" / "lib" in dirs
    assert tmp_path / "nvidia" / "cuda_runtime" / "lib" in dirs
    tried: list[str] = []

    def refuse(name: str, mode: int = 0) -> None:
        tried.append(name)
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(_gpu_modules.ctypes, "CDLL", refuse)
    assert _gpu_modules.prepare() == ()
    assert tried[:2] == ["libcudart.so.13", str(tmp_path / "nvidia/cu13/lib/libcudart.so.13")]
    assert "libcublasLt.so.13" in tried and "libcublas.so.13" in tried
    assert not any(".so.12" in t for t in tried)
