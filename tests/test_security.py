"""API keys, browser-origin refusals, the body limit and graceful shutdown, end to end through
the built package: `Server`, `Client`, `AsyncClient` and the `llamarunner serve` command."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from llamarunner import (
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    PayloadTooLargeError,
    PermissionDeniedError,
    Server,
    ServerConfig,
)
from llamarunner.cli import build_parser

from helpers import ndjson

KEY = "test-key-1"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny model behind two API keys, one from a file, with a 4 KiB body limit."""
    from tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("keyed") / "tiny.gguf")
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# the second key\n\nfile-key-2\n")
    with Server(
        str(model),
        port=0,
        threads=2,
        ctx_size=256,
        api_key=KEY,
        api_key_file=str(key_file),
        max_body=4096,
    ) as srv:
        yield srv


def test_server_client_sends_the_key(keyed_server: Server) -> None:
    answer = keyed_server.client().complete("hello", num_predict=3, temperature=0)
    assert answer.eval_count == 3


@pytest.mark.parametrize("key", [None, "", "wrong"])
def test_missing_or_wrong_key_is_authentication_error(
    keyed_server: Server, key: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLAMARUNNER_API_KEY", raising=False)
    with Client(keyed_server.url, api_key=key) as client:
        # /health stays open: probes and wait_ready need no key.
        assert client.wait_ready(timeout=5).status == "ready"
        with pytest.raises(AuthenticationError) as e:
            client.complete("hello", num_predict=1)
    assert e.value.status_code == 401
    assert e.value.type == "unauthorized"


def test_either_key_works_in_either_header(keyed_server: Server) -> None:
    with Client(keyed_server.url, api_key="file-key-2") as client:
        assert client.complete("hi", num_predict=2).eval_count == 2
    r = httpx.get(f"{keyed_server.url}/v1/models", headers={"X-Api-Key": KEY})
    assert r.status_code == 200
    r = httpx.get(f"{keyed_server.url}/v1/models")
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(f"{keyed_server.url}/api/tags")
    assert r.status_code == 401
    assert isinstance(r.json()["error"], str)


def test_the_official_clients_authenticate(keyed_server: Server) -> None:
    import ollama
    import openai

    good = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY)
    assert [m.id for m in good.models.list()] == ["tiny"]
    bad = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    client = ollama.Client(host=keyed_server.url, headers={"Authorization": f"Bearer {KEY}"})
    assert client.list().models


def test_key_from_the_environment(keyed_server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first comma-separated key is the one clients send.
    monkeypatch.setenv("LLAMARUNNER_API_KEY", f"{KEY},other")
    with Client(keyed_server.url) as client:
        assert client.complete("hi", num_predict=1).eval_count == 1
    monkeypatch.setenv("LLAMARUNNER_API_KEY", f"wrong,{KEY}")
    with Client(keyed_server.url) as client, pytest.raises(AuthenticationError):
        client.complete("hi", num_predict=1)


def test_async_client_sends_the_key(keyed_server: Server) -> None:
    async def run(key: str) -> int:
        async with AsyncClient(keyed_server.url, api_key=key) as client:
            return (await client.complete("hello", num_predict=2)).eval_count

    assert asyncio.run(run(KEY)) == 2
    with pytest.raises(AuthenticationError):
        asyncio.run(run("wrong"))


def test_foreign_origin_is_permission_denied(keyed_server: Server) -> None:
    http = httpx.Client(headers={"Origin": "https://evil.example"})
    client = Client(keyed_server.url, api_key=KEY, http_client=http)
    with client, pytest.raises(PermissionDeniedError) as e:
        client.complete("hello", num_predict=1)
    assert e.value.status_code == 403
    assert e.value.type == "forbidden"
    # A rebinding page: its own name in Host, on a loopback server.
    r = httpx.get(f"{keyed_server.url}/health", headers={"Host": "evil.example"})
    assert r.status_code == 403


def test_a_page_on_localhost_gets_cors(keyed_server: Server) -> None:
    origin = "http://localhost:5173"
    r = httpx.options(
        f"{keyed_server.url}/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == origin
    headers = {"Origin": origin, "Authorization": f"Bearer {KEY}"}
    r = httpx.get(f"{keyed_server.url}/v1/models", headers=headers)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == origin


def test_a_body_over_max_body_is_413(keyed_server: Server) -> None:
    with keyed_server.client() as client, pytest.raises(PayloadTooLargeError) as e:
        client.complete("word " * 2000, num_predict=1)
    assert e.value.status_code == 413
    assert e.value.type == "payload_too_large"
    r = httpx.post(
        f"{keyed_server.url}/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "tiny", "prompt": "word " * 2000},
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "payload_too_large"


def test_truncate_false_reaches_the_server(keyed_server: Server) -> None:
    prompt = "hello " * 100  # more than the 256-token slot
    with keyed_server.client() as client:
        # By default the prompt is cut to fit ...
        assert client.complete(prompt, num_predict=1).prompt_eval_count <= 256
        # ... truncate=False refuses it: the flag is a top-level field, not an option.
        with pytest.raises(BadRequestError) as e:
            client.complete(prompt, num_predict=1, truncate=False)
        assert e.value.type == "context_length_exceeded"
        # shift=False ends generation when the slot is full instead of shifting.
        answer = client.complete("hello", num_predict=400, shift=False, ignore_eos=True)
        assert answer.done_reason == "length"
        assert answer.eval_count < 400


def test_api_key_settings_resolve_from_env_flags_and_kwargs(tmp_path: Path) -> None:
    cfg = ServerConfig.resolve(
        env={
            "LLAMARUNNER_API_KEY": "key-alpha, key-beta",
            "LLAMARUNNER_ALLOW_ORIGIN": "https://x.example,https://y.example",
            "LLAMARUNNER_HEADER_TIMEOUT": "2.5",
            "LLAMARUNNER_MAX_BODY": "1024",
        }
    )
    assert cfg.api_key == ["key-alpha", "key-beta"]
    assert cfg.allow_origin == ["https://x.example", "https://y.example"]
    assert (cfg.header_timeout, cfg.max_body) == (2.5, 1024)
    assert "key-alpha" not in repr(cfg)  # keys stay out of logs
    assert ServerConfig.resolve({"api_key": "k1,k2"}, env={}).api_key == ["k1", "k2"]
    srv = Server("m.gguf", config=ServerConfig(), api_key="k3")  # not started
    assert srv.config.api_key == ["k3"]
    assert srv.config.first_api_key() == "k3"
    keys = tmp_path / "keys"
    keys.write_text("# comment\n\n  from-file \n")
    assert ServerConfig.resolve({"api_key_file": keys}, env={}).first_api_key() == "from-file"
    defaults = ServerConfig.resolve(env={})
    assert defaults.first_api_key() is None
    assert (defaults.max_body, defaults.max_connections) == (8 * 1024 * 1024, 1024)
    assert (defaults.header_timeout, defaults.idle_timeout, defaults.shutdown_timeout) == (
        10.0,
        60.0,
        10.0,
    )
    assert (defaults.max_tokens, defaults.timeout) == (0, 0.0)

    flags = (
        "serve --api-key a --api-key b --allow-origin * --max-body 99 --max-connections 5 "
        "--header-timeout 1.5 --idle-timeout 7 --shutdown-timeout 0 --max-tokens 100 --timeout 30"
    )
    args = build_parser().parse_args(flags.split())
    assert args.api_key == ["a", "b"] and args.allow_origin == ["*"]
    assert (args.max_body, args.max_connections, args.max_tokens) == (99, 5, 100)
    assert (args.header_timeout, args.idle_timeout, args.shutdown_timeout) == (1.5, 7.0, 0.0)
    assert args.timeout == 30.0


def test_bad_security_settings_are_value_errors(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="api-key-file"):
        Server(str(tiny_model), port=0, api_key_file=str(tmp_path / "missing")).start()
    empty = tmp_path / "empty"
    empty.write_text("# no keys yet\n")
    with pytest.raises(ValueError, match="no key"):
        Server(str(tiny_model), port=0, api_key_file=str(empty)).start()
    with pytest.raises(ValueError, match="header-timeout"):
        Server(str(tiny_model), port=0, header_timeout=0).start()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llamarunner", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_lists_the_security_flags_and_refuses_a_missing_key_file(tiny_model: Path) -> None:
    r = run_cli("serve", "--help")
    for flag in (
        "--api-key",
        "--api-key-file",
        "--allow-origin",
        "--max-body",
        "--max-connections",
        "--header-timeout",
        "--idle-timeout",
        "--shutdown-timeout",
        "--max-tokens",
        "--timeout",
    ):
        assert flag in r.stdout
    r = run_cli("serve", str(tiny_model), "--port", "0", "--api-key-file", "/no/such/keys")
    assert r.returncode == 2
    assert "api-key-file /no/such/keys: cannot read" in r.stderr


def _serve(model: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    """Starts ``llamarunner serve``; returns the process and its URL once it is ready."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "llamarunner", "serve", str(model), "--port", "0", *flags],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        m = re.search(r"ready on (http://\S+)", line)
        if m:
            return proc, m.group(1)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("llamarunner serve did not get ready")


def _stream_lines(url: str, body: dict[str, Any], on_first: Callable[[], None]) -> list[Any]:
    lines = []
    with httpx.stream("POST", f"{url}/completion", json=body, timeout=60) as r:
        assert r.status_code == 200
        for msg in ndjson(r):
            lines.append(msg)
            if len(lines) == 1:
                on_first()
    return lines


def test_sigterm_lets_a_running_stream_finish_then_exits_0(tiny_model: Path) -> None:
    flags = ("--threads", "2", "--ctx-size", "256", "--shutdown-timeout", "60")
    proc, url = _serve(tiny_model, *flags)
    try:
        signalled: list[float] = []

        def terminate() -> None:
            proc.send_signal(signal.SIGTERM)
            signalled.append(time.monotonic())

        body = {"prompt": "hello", "options": {"num_predict": 2000, "ignore_eos": True}}
        lines = _stream_lines(url, body, terminate)
        assert signalled, "the stream never started"
        final = lines[-1]
        assert final["done"] is True and "error" not in final, final
        assert final["eval_count"] == 2000
        assert proc.wait(timeout=60) == 0
        assert proc.stderr is not None
        assert "shutting down" in proc.stderr.read()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
