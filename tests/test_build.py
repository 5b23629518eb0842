"""The installed build's llama.cpp: a portable wheel carries the CPU backend in every
instruction-set variant and loads the one that fits; a build from source has llama.cpp linked
in, compiled for this machine. Each test checks whichever of the two is installed (CI runs the
suite against both); ``LLAMARUNNER_EXPECT_WHEEL=1`` says which one it must be."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import llamarunner
from llamarunner import _gpu_modules

from helpers import ServeProcess

PACKAGE = Path(llamarunner.__file__).parent
LIB = PACKAGE / "lib"


def core_library() -> Path:
    found = sorted(PACKAGE.glob("_core*.so"))
    assert found, f"no _core extension in {PACKAGE}"
    return found[0]


def ldd(path: Path) -> str:
    return subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=True).stdout


def portable() -> bool:
    """Whether the installed `_core` is a portable build (llama.cpp linked as libraries)."""
    linked = "libllama.so" in ldd(core_library())
    if os.environ.get("LLAMARUNNER_EXPECT_WHEEL") == "1":
        assert linked, "the portable wheel was expected, but _core has llama.cpp linked in"
        assert LIB.is_dir(), f"the portable wheel was expected, but {LIB} does not exist"
    return linked


def mapped_files(pid: int) -> set[str]:
    return {
        line.split()[-1]
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
        if line.endswith(".so") or ".so." in line
    }


def test_the_package_finds_every_library_it_links() -> None:
    linked = ldd(core_library())
    assert "not found" not in linked, linked
    llama_libs = re.findall(r"^\s*(lib(?:llama|ggml)\S*) => (\S+)", linked, re.MULTILINE)
    if portable():
        names = {name for name, _ in llama_libs}
        assert {"libllama.so", "libggml.so", "libggml-base.so"} <= {
            re.sub(r"\.so\..*", ".so", n) for n in names
        }, linked
        for name, path in llama_libs:
            assert Path(path).resolve().parent == LIB.resolve(), f"{name} from {path}"
        variants = sorted(p.name for p in LIB.glob("libggml-cpu-*.so"))
        # x86-64 has a dozen levels; fewer means GGML_CPU_ALL_VARIANTS was not on.
        assert len(variants) >= 4, variants
    else:
        assert llama_libs == [], f"a source build links llama.cpp statically: {linked}"


def test_the_server_loads_and_names_a_cpu_backend(tiny_model: Path) -> None:
    with ServeProcess(str(tiny_model), "--port", "0") as serve:
        serve.wait_ready()
        maps = mapped_files(serve.proc.pid)
        variants_mapped = sorted(Path(p).name for p in maps if "libggml-cpu" in Path(p).name)
        if portable():
            chosen = serve.wait_for(r"cpu_backend=(libggml-cpu-\S+?\.so)").group(1)
            assert (LIB / chosen).is_file(), chosen
            # Exactly the one named is in use: ggml unloads the variants it scored and dropped.
            assert variants_mapped == [chosen], variants_mapped
        else:
            assert "cpu_backend=" not in serve.log
            assert variants_mapped == []
        # Either way llama.cpp reports the vector units its kernels use.
        features = serve.wait_for(r"llama\.cpp CPU backend.*features=(.*SSE3.*)").group(1)
        # ... and never AMX: its kernel segfaults on Q4_K models (ggml-org/llama.cpp#20824), so
        # every build leaves it out (.cargo/config.toml). A build configured before that was
        # added (a cached CMakeCache.txt) would still have it; .ci/run removes such caches.
        assert "AMX_INT8 = 1" not in features, features


def test_a_backends_dir_without_a_usable_cpu_backend(tiny_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "LLAMARUNNER_BACKENDS_DIR": str(tmp_path)}
    with ServeProcess(str(tiny_model), "--port", "0", env=env) as serve:
        if portable():
            # One clear line and a failed start, not a crash at the first decode.
            code = serve.wait(timeout=120)
            assert code != 0
            assert "no llama.cpp CPU backend" in serve.log, serve.log
            assert str(tmp_path) in serve.log
        else:
            # Nothing is loaded at run time from a source build: the variable is ignored.
            serve.wait_ready()


def test_a_gpu_backend_that_cannot_load_is_skipped_with_the_reason(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A GPU module whose libraries are missing (here: not a library at all, as a module built
    for another CUDA is to the loader) costs one warning naming it and the loader's reason; the
    server runs on the CPU."""
    if not portable():
        pytest.skip("a source build loads no backend modules")
    backends = tmp_path / "lib"
    shutil.copytree(LIB, backends)
    (backends / "libggml-cuda.so").write_bytes(b"\x7fELF not a library")
    env = {**os.environ, "LLAMARUNNER_BACKENDS_DIR": str(backends)}
    env.pop("GGML_VK_VISIBLE_DEVICES", None)
    with ServeProcess(str(tiny_model), "--port", "0", "--draft-max", "0", env=env) as serve:
        serve.wait_ready()
        line = serve.wait_for(r"skipped a GPU backend that cannot load here.*").group(0)
        assert "libggml-cuda.so" in line, line
        assert "reason=" in line and "libggml-cuda.so" in line.split("reason=")[1], line
        # The run path: every other library still loads, and the server answers.
        assert "cpu_backend=libggml-cpu" in serve.log


def compile_library(path: Path, source: str, *link: str) -> None:
    """A shared library from C source, named by its file name (its soname)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler (cc): the build needs one, so the tests may too")
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-o",
            str(path),
            f"-Wl,-soname,{path.name}",
            "-x",
            "c",
            "-",
            *link,
        ],
        input=source,
        text=True,
        check=True,
    )


def test_the_cuda_companion_brings_its_module_and_the_pypi_runtime(
    tiny_model: Path, tmp_path: Path
) -> None:
    """`pip install 'llamarunner[cuda]'`'s path, with stand-ins compiled here: the companion
    package `llamarunner_cuda13` whose `lib/libggml-cuda.so` needs `libcudart.so.13`, and NVIDIA's
    runtime package (`nvidia/cu13/lib/libcudart.so.13`) in another site directory. Without the
    runtime the module is skipped with the loader's reason and what to install; with it the
    package's runtime is opened before the module, which then opens (the stand-in defines no
    backend, so ggml's own check is all that is left). The server serves both times."""
    if not portable():
        pytest.skip("a source build loads no backend modules")
    if any((d / "libcudart.so.13").is_file() for d in _gpu_modules.nvidia_library_dirs()):
        pytest.skip(
            "NVIDIA's runtime packages are installed here, so a run without them cannot be staged"
        )
    companion_site, runtime_site = tmp_path / "companion", tmp_path / "runtime"
    runtime = runtime_site / "nvidia" / "cu13" / "lib" / "libcudart.so.13"
    compile_library(runtime, "int cudart_stand_in(void) { return 13; }\n")
    package = companion_site / "llamarunner_cuda13"
    module = package / "lib" / "libggml-cuda.so"
    compile_library(
        module,
        "int cudart_stand_in(void);\nint module_stand_in(void) { return cudart_stand_in(); }\n",
        f"-L{runtime.parent}",
        "-Wl,--no-as-needed",
        "-l:libcudart.so.13",
    )
    (package / "__init__.py").write_text("")
    base = {k: v for k, v in os.environ.items() if k not in ("GGML_VK_VISIBLE_DEVICES",)}
    base.pop("LLAMARUNNER_GPU_MODULE_PATH", None)

    without = {**base, "PYTHONPATH": str(companion_site)}
    with ServeProcess(str(tiny_model), "--port", "0", "--draft-max", "0", env=without) as serve:
        serve.wait_ready()
        line = serve.wait_for(r"skipped a GPU backend that cannot load here.*").group(0)
        assert str(module) in line, line
        reason = line.split("reason=")[1]
        assert "libcudart.so.13" in reason and "pip install 'llamarunner[cuda]'" in reason, line

    both = {**base, "PYTHONPATH": os.pathsep.join([str(companion_site), str(runtime_site)])}
    with ServeProcess(str(tiny_model), "--port", "0", "--draft-max", "0", env=both) as serve:
        serve.wait_ready()
        line = serve.wait_for(r"skipped a GPU backend that cannot load here.*").group(0)
        assert str(module) in line, line
        assert "cannot open" not in line and "ggml did not register it" in line, line
