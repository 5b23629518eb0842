"""A step's sequences sampled in parallel (``--sampling-threads``) give the text each request
gives alone, and ``--null-decode`` (the benchmarks' server without a model's computation)
answers as a server does. With ``--null-decode`` a position's logits depend on the position
only, so a seeded request's text depends on the request alone, whatever shares its batch or
which slot it gets: the texts of eight requests run at once on a pool of four threads must be
those of the same requests run one at a time on the engine thread."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from llamarunner import Server

# Requests of every kind of sampler chain: OpenAI's defaults (top-k 40 shortlist), the whole
# vocabulary, Ollama's penalties, presence/frequency penalties, greedy (which drafts by
# prompt lookup), a logit bias, min-p with a typical cut, a JSON-schema constraint, and stop
# strings (found by the text the sampling thread assembles).
BODIES: list[dict[str, Any]] = [
    {"seed": 1},
    {"seed": 2, "top_k": 0},
    {"seed": 3, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1},
    {"seed": 4, "top_k": 0, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    {"temperature": 0},
    {"seed": 6, "logit_bias": {"5": 3.0, "7": -100}},
    {"seed": 7, "min_p": 0.05, "typical_p": 0.9},
    {"seed": 8, "json_schema": {"type": "array", "items": {"type": "integer"}}},
    {"seed": 9, "stop": ["e", "\n"], "ignore_eos": True},
]


def complete(srv: Server, i: int, body: dict[str, Any]) -> str:
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"prompt": f"request {i}: " + "a b " * i, "max_tokens": 48, **body},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert isinstance(text, str)
    return text


def test_a_pool_samples_each_request_as_it_would_be_sampled_alone(
    start_server: Callable[..., Server], tiny_model: Path
) -> None:
    alone = start_server(tiny_model, null_decode=True, parallel=1, sampling_threads=1)
    want = [complete(alone, i, body) for i, body in enumerate(BODIES)]
    assert len(set(want)) > 4, want  # the requests differ, so a mix-up would show
    pooled = start_server(tiny_model, null_decode=True, parallel=8, sampling_threads=4)
    for _ in range(3):
        with ThreadPoolExecutor(len(BODIES)) as pool:
            got = list(pool.map(lambda ib: complete(pooled, *ib), enumerate(BODIES)))
        assert got == want


def test_null_decode_serves_every_route_like_a_server(
    start_server: Callable[..., Server], tiny_model: Path
) -> None:
    srv = start_server(tiny_model, null_decode=True, parallel=2)
    chat = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "seed": 1},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 8
    # ignore_eos is not needed: the synthetic logits make end-of-generation least likely.
    native = httpx.post(
        srv.url + "/completion",
        json={"prompt": "x", "n_predict": 16, "temperature": 0},
        timeout=60,
    )
    assert native.status_code == 200, native.text
    assert native.json()["tokens_predicted"] == 16


@pytest.mark.parametrize("value", ["-1", "x"])
def test_a_bad_sampling_thread_count_is_refused_at_start(tiny_model: Path, value: str) -> None:
    serve = [sys.executable, "-m", "llamarunner", "serve", str(tiny_model), "--port", "0"]
    proc = subprocess.run(
        [*serve, "--sampling-threads", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--sampling-threads" in proc.stderr
