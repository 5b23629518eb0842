"""GPU backends (docs/wheels.md, "GPU backends"): the portable wheel's Vulkan module on whatever
Vulkan device the machine has. In CI that is Mesa's software device, lavapipe, which ggml uses
only when ``GGML_VK_VISIBLE_DEVICES`` names it (it skips CPU-type devices otherwise): the tests
set it to 0 unless it is set already, so on a machine with a real GPU they run there.

The tests marked ``gpu`` are skipped, with the reason, where the package has no GPU backend
library or no Vulkan device is found, unless ``LLAMARUNNER_TESTS_REQUIRE_GPU`` is set (CI's run
of the portable wheel sets it): then a skip is a failure. The servers run as subprocesses,
since ggml reads the variable once per process. The checks of the flags' values need no GPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import ServeProcess
from tinymodel import write_tiny_model

REQUIRE_GPU_ENV = "LLAMARUNNER_TESTS_REQUIRE_GPU"
MIB = 1024 * 1024


def gpu_required() -> bool:
    return os.environ.get(REQUIRE_GPU_ENV, "") not in ("", "0")


def gpu_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
    return env


def list_devices(env: dict[str, str]) -> list[dict[str, Any]]:
    """The devices as `llamarunner serve --list-devices` finds them, read from the native
    module in a subprocess (so that ``env`` applies)."""
    code = "import json, llamarunner._core as c; print(c.list_devices())"
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    devices: list[dict[str, Any]] = json.loads(r.stdout)
    return devices


@pytest.fixture(scope="module")
def gpu() -> dict[str, Any]:
    """The first GPU (its `--list-devices` entry); skips (fails, when required) without one."""
    devices = list_devices(gpu_env())
    gpus = [d for d in devices if d["kind"] in ("gpu", "integrated_gpu")]
    if not gpus:
        lib = Path(__import__("llamarunner").__file__).parent / "lib"
        modules = sorted(p.name for p in lib.glob("libggml-*.so") if "cpu" not in p.name)
        why = (
            f"no GPU found (GPU backend libraries in the package: {modules or 'none'}; "
            "build one with scripts/build-gpu-backend.sh, and install a Vulkan driver: "
            "mesa-vulkan-drivers gives lavapipe)"
        )
        if gpu_required():
            pytest.fail(f"{REQUIRE_GPU_ENV} is set but {why}")
        pytest.skip(why)
    return gpus[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("gpu") / "tiny.gguf")


@pytest.fixture(scope="module")
def offloaded(model: Path, gpu: dict[str, Any]) -> Iterator[str]:
    """The tiny model with every layer on the GPU (the default: as many as fit)."""
    with serve(model) as srv:
        yield srv.wait_ready(timeout=600)


def serve(model: Path, *flags: str, env: dict[str, str] | None = None) -> ServeProcess:
    """``llamarunner serve`` of ``model`` on the GPU's environment. Without drafting, whose
    measurement at start (decode steps of 1 to 17 positions) makes a software Vulkan device
    compile a pipeline per width: minutes on lavapipe."""
    return ServeProcess(str(model), *SERVE_FLAGS, *flags, env=gpu_env() if env is None else env)


# Any port; a small context; no drafting (see `serve`).
SERVE_FLAGS = ("--port", "0", "--ctx-size", "512", "--draft-max", "0")


def props(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/props", timeout=30)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def greedy_tokens(url: str, n: int = 8) -> list[int]:
    r = httpx.post(
        f"{url}/completion",
        json={"prompt": "hello world the cat", "n_predict": n, "temperature": 0, "n_probs": 1},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return [p["id"] for p in r.json()["completion_probabilities"]]


@pytest.mark.gpu
def test_list_devices_numbers_the_gpus(gpu: dict[str, Any]) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "llamarunner", "serve", "--list-devices"],
        env=gpu_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"0: {gpu['name']} ({gpu['description']}), {gpu['backend']}" in r.stdout, r.stdout
    assert "MiB free of" in r.stdout


@pytest.mark.gpu
def test_a_fully_offloaded_model_serves_every_dialect(
    offloaded: str, gpu: dict[str, Any], model: Path
) -> None:
    devices = props(offloaded)["devices"]
    assert devices["backend"] == gpu["backend"]
    assert devices["layers_offloaded"] == devices["layers_total"] > 1
    assert devices["fit"] == {
        "margin_mib": 1024,
        "n_gpu_layers": devices["fit"]["n_gpu_layers"],
        "fits": True,
        "reserved_mib": 0,
    }
    assert any(d["name"] == gpu["name"] for d in devices["devices"])
    chat = httpx.post(
        f"{offloaded}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=300,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] > 0
    generate = httpx.post(
        f"{offloaded}/api/generate",
        json={"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 4}},
        timeout=300,
    )
    assert generate.status_code == 200, generate.text
    ps = httpx.get(f"{offloaded}/api/ps", timeout=30).json()["models"]
    assert ps[0]["size_vram"] > 0
    metrics = httpx.get(f"{offloaded}/metrics", timeout=30).text
    assert gpu["name"] in metrics


def first_top(url: str, n: int = 2) -> list[int]:
    """The ``n`` likeliest first tokens of the greedy prompt."""
    r = httpx.post(
        f"{url}/completion",
        json={"prompt": "hello world the cat", "n_predict": 1, "temperature": 0, "n_probs": n},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["completion_probabilities"][0]["top_logprobs"]]


@pytest.mark.gpu
def test_the_gpu_gives_the_cpu_runs_opening_tokens(
    offloaded: str, model: Path, gpu: dict[str, Any]
) -> None:
    """ggml-vulkan computes in f16 where the device has it; the tiny model's random weights
    make activations large enough that f16 rounding moves its logits by tenths (its two
    likeliest first tokens swap places), so the token-for-token comparison runs with f16 off
    (``GGML_VK_DISABLE_F16``, Vulkan's switch), and the default path must agree on the
    likeliest two. Another backend (CUDA) has no such switch: only the likeliest two."""
    with serve(model, "--n-gpu-layers", "0") as cpu:
        url = cpu.wait_ready(timeout=600)
        assert props(url)["devices"]["layers_offloaded"] == 0
        on_cpu = greedy_tokens(url)
        cpu_top = first_top(url)
    if gpu["backend"] == "Vulkan":
        with serve(model, env={**gpu_env(), "GGML_VK_DISABLE_F16": "1"}) as f32:
            f32_url = f32.wait_ready(timeout=600)
            assert props(f32_url)["devices"]["layers_offloaded"] > 0
            assert greedy_tokens(f32_url)[:4] == on_cpu[:4]
    assert sorted(first_top(offloaded)) == sorted(cpu_top)


@pytest.mark.gpu
def test_the_device_cuts_the_top_k_and_samples_as_the_whole_rows(
    offloaded: str, model: Path, gpu: dict[str, Any]
) -> None:
    """``--backend-sampling`` with the output layer on the GPU: the top-k is cut there (the
    first cut is attached and the device does not hand back whole rows instead), and the same
    requests, one at a time, give the texts the GPU gives with its whole rows. The fit kept
    room on the GPU for what the cut adds to the compute graph: a row of logits per position
    of a micro-batch (512 here: the context's 512 cells)."""
    from test_backend_sampling import CUT, WHOLE, texts

    with serve(model, "--backend-sampling", "--parallel", "1") as srv:
        url = srv.wait_ready(timeout=600)
        info = props(url)
        assert info["devices"]["layers_offloaded"] > 0
        room = 512 * info["model"]["n_vocab"] * 4
        assert info["devices"]["fit"]["reserved_mib"] == -(-room // MIB), info["devices"]
        got = texts(url, CUT + WHOLE)
        srv.wait_for("the first top-k cut is attached", timeout=5)
        assert "does not cut a top-k" not in srv.log
    with serve(model, "--parallel", "1") as srv:
        want = texts(srv.wait_ready(timeout=600), CUT + WHOLE)
    assert got == want


@pytest.mark.gpu
def test_a_partial_offload_serves(model: Path, gpu: dict[str, Any]) -> None:
    with serve(model, "--n-gpu-layers", "1") as srv:
        url = srv.wait_ready(timeout=600)
        devices = props(url)["devices"]
        assert devices["layers_offloaded"] == 1 < devices["layers_total"]
        assert len(greedy_tokens(url, 4)) == 4


@pytest.mark.gpu
def test_a_fit_under_a_memory_cap_offloads_fewer_layers(
    model: Path, gpu: dict[str, Any], tmp_path: Path
) -> None:
    # Leave the fit 1 MiB of the device: less than the model's KV cache and compute buffers.
    margin = gpu["memory_free"] // MIB - 1
    with serve(model, f"--fit-target={margin}") as srv:
        url = srv.wait_ready(timeout=600)
        devices = props(url)["devices"]
        assert devices["layers_offloaded"] < devices["layers_total"], devices
        assert devices["fit"]["margin_mib"] == margin
        assert len(greedy_tokens(url, 4)) == 4


@pytest.mark.gpu
def test_n_gpu_layers_that_cannot_fit_is_refused_at_start(model: Path, gpu: dict[str, Any]) -> None:
    margin = gpu["memory_free"] // MIB
    with serve(model, "--n-gpu-layers", "3", f"--fit-target={margin}") as srv:
        assert srv.wait(timeout=300) != 0
        assert "--n-gpu-layers 3 does not fit" in srv.log, srv.log


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--tensor-split", "1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1"), "shares for"),
        (("--main-gpu", "15"), "--main-gpu 15: the GPUs are numbered from 0"),
    ],
)
def test_placement_beyond_the_gpus_is_refused_at_start(
    model: Path, gpu: dict[str, Any], flags: tuple[str, str], message: str
) -> None:
    with serve(model, *flags) as srv:
        assert srv.wait(timeout=300) != 0
        assert message in srv.log, srv.log


@pytest.mark.gpu
def test_a_tensor_split_with_one_share_puts_the_model_on_that_gpu(
    model: Path, gpu: dict[str, Any]
) -> None:
    with serve(model, "--tensor-split", "1") as srv:
        url = srv.wait_ready(timeout=600)
        devices = props(url)["devices"]
        assert devices["split_mode"] == "none"
        assert devices["layers_offloaded"] == devices["layers_total"]


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("tensor-split", "-1"),
        ("tensor-split", "nan"),
        ("tensor-split", "inf"),
        ("tensor-split", "1,x"),
        ("tensor-split", "0,0"),
        ("tensor-split", ",".join(["1"] * 17)),
        ("main-gpu", "-1"),
        ("main-gpu", "16"),
        ("fit-target", "-5"),
        ("fit-target", str(2**21)),
        ("n-gpu-layers", "-2"),
        ("split-mode", "diagonal"),
    ],
)
def test_placement_flags_out_of_range_are_refused(model: Path, flag: str, value: str) -> None:
    """No GPU needed: the values are checked before anything loads."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "llamarunner",
            "serve",
            str(model),
            "--port",
            "0",
            f"--{flag}={value}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert flag in r.stderr, r.stderr


def test_main_gpu_without_a_gpu_is_a_start_error(model: Path) -> None:
    env = dict(os.environ)
    env.pop("GGML_VK_VISIBLE_DEVICES", None)
    if any(d["kind"] in ("gpu", "integrated_gpu") for d in list_devices(env)):
        pytest.skip("this machine has a GPU")
    with serve(model, "--main-gpu", "1", env=env) as srv:
        assert srv.wait(timeout=120) != 0
        assert "--main-gpu 1: no GPU was found" in srv.log, srv.log


@pytest.mark.gpu
def test_the_routers_memory_budget_counts_only_what_stays_in_host_memory(
    model: Path, gpu: dict[str, Any], tmp_path: Path
) -> None:
    """`--models-memory` budgets host memory: once an engine says (its `/props`) that its
    layers went to the GPU, the router counts the model without the weights and KV cache that
    left (`memory_estimate_bytes`), where a CPU-only load counts them all."""
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(model, models / "tiny.gguf")
    taken: dict[str, tuple[int, int]] = {}
    for layers in ("0", "-1"):
        with ServeProcess(
            "--models-dir",
            str(models),
            *SERVE_FLAGS,
            "--n-gpu-layers",
            layers,
            "--models-memory",
            "4096",
            env=gpu_env(),
        ) as srv:
            url = srv.wait_ready(timeout=600)
            body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
            assert r.status_code == 200, r.text
            listed = httpx.get(f"{url}/models", timeout=30).json()["data"]
            status = next(m["status"] for m in listed if m["id"] == "tiny")
            ps = httpx.get(f"{url}/api/ps", timeout=30).json()["models"]
            taken[layers] = (status["memory_estimate_bytes"], ps[0]["size_vram"])
    (on_cpu, cpu_vram), (offloaded, vram) = taken["0"], taken["-1"]
    assert cpu_vram == 0 and vram > 0, taken
    # The weights of the layers on the GPU leave (the token embedding stays), and the KV
    # cache of those layers (the tiny model's, at 512 cells, is well under 1 MiB).
    assert 0 < on_cpu - offloaded <= model.stat().st_size + MIB, taken


@pytest.mark.gpu
def test_the_fit_keeps_room_for_the_draft_model(
    model: Path, gpu: dict[str, Any], tmp_path: Path
) -> None:
    """The draft model loads after the model and goes to the GPU too: the fit keeps the draft's
    estimate (weights, KV cache and compute buffers of a 65,536-token context: over 500 MiB,
    most of it the attention scores an unfused kernel would need) free on the GPU, as
    `devices.fit.reserved_mib`. With a margin that leaves half of that for the model (which
    takes under 100 MiB with flash attention), the model alone offloads every layer; beside
    the draft it stays on the CPU, and the draft with it. Both serve. (lavapipe's free memory
    is the host's, which moves by tens of MiB between starts: hence the wide gap.)"""
    draft = write_tiny_model(tmp_path / "draft.gguf", seed=1)
    flags = ("--ctx-size", "65536", "--flash-attn", "on")
    with serve(model, *flags, "--draft-model", str(draft), "--fit-target", "0") as srv:
        url = srv.wait_ready(timeout=600)
        fit = props(url)["devices"]["fit"]
        reserved = fit["reserved_mib"]
        assert reserved > 500, fit
        assert len(greedy_tokens(url, 4)) == 4
    with serve(model, *flags, "--fit-target", "0") as srv:
        assert props(srv.wait_ready(timeout=600))["devices"]["fit"]["reserved_mib"] == 0
    free = next(d for d in list_devices(gpu_env()) if d["name"] == gpu["name"])["memory_free"]
    margin = free // MIB - reserved // 2
    with serve(model, *flags, f"--fit-target={margin}") as srv:
        devices = props(srv.wait_ready(timeout=600))["devices"]
        assert devices["layers_offloaded"] == devices["layers_total"], devices
    draft_flags = ("--draft-model", str(draft), f"--fit-target={margin}", "--verbose")
    with serve(model, *flags, *draft_flags) as srv:
        url = srv.wait_ready(timeout=600)
        devices = props(url)["devices"]
        assert devices["layers_offloaded"] == 0, devices
        # llama.cpp's line for each load (the fit's trial loads first, the draft model last).
        loads = re.findall(r"offloaded (\d+)/\d+ layers to GPU", srv.log)
        assert loads and loads[-1] == "0", loads
        assert len(greedy_tokens(url, 4)) == 4
