"""Per-request limits end to end: `--max-tokens` caps generation in every dialect, `--timeout`
ends a running request ("timeout") and refuses one still queued (503 `timeout`)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from llamarunner import Server

ENDLESS = {"num_predict": -1, "ignore_eos": True, "temperature": 0}


def ndjson_last(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    last: dict[str, Any] = json.loads(r.text.strip().split("\n")[-1])
    return last


def test_max_tokens_caps_every_dialect(
    tiny_model: Path, start_server: Callable[..., Server]
) -> None:
    srv = start_server(tiny_model, ctx_size=256, max_tokens=5)
    url = srv.url
    for options in [ENDLESS, {**ENDLESS, "num_predict": 1000}]:
        last = ndjson_last(url, "/completion", {"prompt": "hi", "options": options})
        assert (last["eval_count"], last["done_reason"]) == (5, "length"), last
    # Below the cap, the request's own limit holds.
    last = ndjson_last(
        url, "/completion", {"prompt": "hi", "options": {**ENDLESS, "num_predict": 3}}
    )
    assert last["eval_count"] == 3
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert r.json()["choices"][0]["finish_reason"] == "length"
    last = ndjson_last(
        url, "/api/generate", {"model": "tiny", "prompt": "hi", "stream": False, "options": ENDLESS}
    )
    assert last["eval_count"] == 5


def test_timeout_ends_a_running_request_and_refuses_a_queued_one(
    tiny_model: Path, start_server: Callable[..., Server]
) -> None:
    # One slot whose generation cannot end by itself within the limit (ten slot contexts of
    # tokens, with context shifts), so only the time limit can stop it.
    srv = start_server(tiny_model, ctx_size=4096, parallel=1, timeout=1.5)
    url = srv.url
    results: dict[str, Any] = {}

    def running() -> None:
        started = time.monotonic()
        results["running"] = ndjson_last(url, "/completion", {"prompt": "hi", "options": ENDLESS})
        results["running_s"] = time.monotonic() - started

    t = threading.Thread(target=running)
    t.start()
    # Wait until the slot is taken, then queue a second request behind it.
    deadline = time.monotonic() + 10
    while not any(s["busy"] for s in httpx.get(f"{url}/slots").json()):
        assert time.monotonic() < deadline, "the first request never took the slot"
        time.sleep(0.01)
    queued = httpx.post(
        f"{url}/completion", json={"prompt": "next", "options": ENDLESS}, timeout=60
    )
    t.join(timeout=60)
    last = results["running"]
    assert last["done"] is True and last["done_reason"] == "timeout", last
    assert last["eval_count"] > 0
    assert 1.0 < results["running_s"] < 60, results["running_s"]
    # The queued one waited past its own limit behind the running one: refused, or (admitted
    # in the very step the first one ended) ended by the limit at once.
    if queued.status_code == 503:
        assert queued.json()["error"]["type"] == "timeout", queued.text
    else:
        assert queued.status_code == 200, queued.text
        assert json.loads(queued.text.strip().split("\n")[-1])["done_reason"] == "timeout"
    # OpenAI's clients know "stop" and "length": a request cut by the limit reads as "length".
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 100000, "ignore_eos": True, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    # The server is idle and answers normally afterwards.
    last = ndjson_last(url, "/completion", {"prompt": "hi", "options": {"num_predict": 2}})
    assert last["done_reason"] in ("length", "stop")


def test_bad_limit_values_are_a_one_line_error_and_exit_2(tiny_model: Path) -> None:
    import subprocess
    import sys

    for flags in (
        ["--max-tokens", "-1"],
        ["--max-tokens", str(2**40)],
        ["--max-tokens", "many"],
        ["--timeout", "-1"],
        ["--timeout", "nan"],
        ["--timeout", "inf"],
        ["--timeout", "1e9"],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "llamarunner", "serve", str(tiny_model), "--port", "0", *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2, (flags, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("llamarunner: error:") or "usage:" in r.stderr, (flags, r.stderr)
