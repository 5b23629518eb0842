"""The same request gives the same text (issue #44), on the default model.

``--deterministic``: a request's 64 tokens are the same alone, in a batch of 4 or 8 with other
traffic, with its prompt cached in its slot, restored from the host-memory cache and decoded in
chunks of 8, greedy and seeded. Without the mode: the same seeded request sent twice to an idle
server gives the same text (the second finds its prompt cached and decodes its last chunk
again). A request that asks for the mode where the server has it not is a 400, and one process
cannot run the mode after loading a model without it."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from llamarunner import Server

from helpers import ServeProcess
from tinymodel import write_mamba_model

StartServer = Callable[..., Server]

TOKENS = 64

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Once upon a time",
    "Write a short poem about the sea:",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Q: What is the capital of France?\nA:",
    "List three fruits:\n1.",
    "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands of the "
    "Caribbean, where he",
    "Translate to French: I like apples and oranges very much because they are sweet.",
    "The meaning of life, according to many philosophers who have thought about it for a long "
    "time, is",
]

SAMPLINGS = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 1.0, "seed": 5},
}

NOISE = "Noise: a story about a lighthouse keeper who counted the waves every night and"


def complete(url: str, prompt: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(
        f"{url}/completion",
        json={"prompt": prompt, "n_predict": TOKENS, "ignore_eos": True, **body},
        timeout=600,
    )
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def texts(url: str, sampling: dict[str, Any], **body: Any) -> list[str]:
    return [complete(url, p, **sampling, **body)["content"] for p in PROMPTS]


def in_batches(url: str, width: int) -> dict[str, list[str]]:
    """Each prompt sent greedy and seeded, `width` requests at a time, beside two streams of
    other traffic (unseeded, of other lengths) for as long as they run: the texts by sampling."""
    stop = threading.Event()

    def noise(n: int) -> None:
        while not stop.is_set():
            complete(url, NOISE * n, temperature=0.8, n_predict=3 + 5 * n, cache_prompt=False)

    jobs = [(name, p) for p in PROMPTS for name in SAMPLINGS]
    out: dict[str, list[str]] = {name: [] for name in SAMPLINGS}
    with ThreadPoolExecutor(width + 2) as pool:
        others = [pool.submit(noise, n) for n in (1, 2)]
        try:
            for i in range(0, len(jobs), width):
                batch = [
                    (name, pool.submit(complete, url, p, cache_prompt=False, **SAMPLINGS[name]))
                    for name, p in jobs[i : i + width]
                ]
                for name, f in batch:
                    out[name].append(f.result()["content"])
            return out
        finally:
            stop.set()
            for f in others:
                f.result()


def differing(expected: list[str], got: list[str]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b]


@pytest.fixture(scope="module")
def deterministic_servers(default_model: Path) -> Iterator[tuple[str, str]]:
    """Two deterministic servers, each in a process of its own: one with ten slots, one with one
    slot, chunks of 8 and a host-memory cache."""
    common = [str(default_model), "--port", "0", "--deterministic", "--threads", "2"]
    common += ["--ctx-size", "512"]
    narrow_flags = ("--parallel", "1", "--batch-size", "8", "--cache-ram", "64", "--draft-max", "0")
    with (
        ServeProcess(*common, "--parallel", "10", "--cache-ram", "0") as wide,
        ServeProcess(*common, *narrow_flags) as narrow,
    ):
        yield wide.wait_ready(), narrow.wait_ready()


@pytest.mark.real_model
# 96 requests of 64 tokens at the mode's speed: about three minutes on 2 cores.
@pytest.mark.timeout(1200)
def test_deterministic_mode_gives_one_text_however_the_request_is_served(
    deterministic_servers: tuple[str, str],
) -> None:
    wide, narrow = deterministic_servers
    props = httpx.get(f"{wide}/props", timeout=30).json()
    assert props["deterministic"] is True
    alone: dict[str, list[str]] = {}
    for name, body in SAMPLINGS.items():
        alone[name] = texts(wide, body, cache_prompt=False)
        assert len(set(alone[name])) == len(PROMPTS), alone  # eight different answers
        # The prompt found in its slot: only its last token is decoded again.
        cached = [complete(wide, p, **body) for p in PROMPTS]
        assert all(c["timings"]["prompt_n"] <= 4 for c in cached), [c["timings"] for c in cached]
        assert differing(alone[name], [c["content"] for c in cached]) == [], name
        # One slot, chunks of 8: each prompt decoded in pieces, pushing the one before it out
        # to RAM; then each restored from there (a short prompt pushes out the last one).
        assert differing(alone[name], texts(narrow, body, cache_prompt=False)) == [], name
        complete(narrow, NOISE, n_predict=2, cache_prompt=False)
        restored = [complete(narrow, p, **body) for p in PROMPTS]
        assert all(r["timings"]["cache_n"] > 0 for r in restored), [r["timings"] for r in restored]
        assert differing(alone[name], [r["content"] for r in restored]) == [], name
    for width in (4, 8):
        batched = in_batches(wide, width)
        for name in SAMPLINGS:
            assert differing(alone[name], batched[name]) == [], (name, width)


@pytest.mark.real_model
def test_every_answer_says_it_ran_deterministically(
    deterministic_servers: tuple[str, str],
) -> None:
    wide, _ = deterministic_servers
    for path, body in (
        ("/completion", {"prompt": "Hi", "n_predict": 2, "deterministic": True}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        ),
    ):
        r = httpx.post(f"{wide}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["llamarunner-deterministic"] == "true"


@pytest.mark.real_model
def test_a_seeded_request_sent_twice_gives_the_same_text_without_the_mode(
    default_model: Path, start_server: StartServer
) -> None:
    srv = start_server(default_model, parallel=2, ctx_size=512, threads=2, cache_ram=0)
    body = SAMPLINGS["seeded"]
    for p in PROMPTS:
        first = complete(srv.url, p, **body, cache_prompt=False)
        second = complete(srv.url, p, **body)
        # The second found its prompt and decoded its last chunk again (the whole of these
        # short prompts), as the first decoded it.
        assert second["timings"]["cache_n"] == 0, second["timings"]
        assert first["content"] == second["content"], p
    props = httpx.get(f"{srv.url}/props", timeout=30).json()
    assert props["deterministic"] is False


def test_asking_for_the_mode_where_it_is_not_is_a_400(tiny_server: Server) -> None:
    r = httpx.post(
        f"{tiny_server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "deterministic": True},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "deterministic_unavailable", r.text
    r = httpx.post(
        f"{tiny_server.url}/completion",
        json={"prompt": "x", "n_predict": 1, "deterministic": "yes"},
        timeout=60,
    )
    assert r.status_code == 400, r.text


@pytest.mark.parametrize(
    "flags",
    [
        ("--flash-attn", "on"),
        ("--batch-size", "2"),
        ("--kv-cache-type", "q8_0"),
        ("--n-gpu-layers", "4"),
    ],
)
def test_what_the_mode_does_not_cover_is_a_start_error(
    tiny_model: Path, flags: tuple[str, str]
) -> None:
    r = subprocess.run(
        [
            *(sys.executable, "-m", "llamarunner", "serve", str(tiny_model)),
            *("--port", "0", "--deterministic", *flags),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0, r.stderr
    assert "--deterministic cannot run with" in r.stderr, r.stderr
    assert flags[0] in r.stderr, r.stderr


def test_the_mode_needs_a_process_of_its_own(tiny_model: Path) -> None:
    script = f"""
from llamarunner import Server
with Server({str(tiny_model)!r}, port=0, ctx_size=256):
    pass
s = Server({str(tiny_model)!r}, port=0, ctx_size=256, deterministic=True)
try:
    s.start()
    s.wait_ready(timeout=60)
except Exception as e:
    print("refused:", e)
finally:
    s.stop()
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "refused:" in r.stdout and "process of its own" in r.stdout, (r.stdout, r.stderr)


def test_a_recurrent_model_is_refused_at_load(tmp_path: Path) -> None:
    model = write_mamba_model(tmp_path / "mamba.gguf")
    with ServeProcess(str(model), "--port", "0", "--ctx-size", "256") as plain:
        url = plain.wait_ready()
        r = httpx.post(f"{url}/completion", json={"prompt": "hello", "n_predict": 2}, timeout=60)
        assert r.status_code == 200, r.text  # the model serves without the mode
    with ServeProcess(str(model), "--port", "0", "--ctx-size", "256", "--deterministic") as det:
        assert det.wait(timeout=120) != 0
        assert "--deterministic covers attention models only" in det.log, det.log
