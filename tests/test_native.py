"""The native API end to end, on tiny random-weight models with real llama.cpp."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from llamarunner import Server

from helpers import complete

GREEDY: dict[str, Any] = {"temperature": 0, "num_predict": 16}


def test_health_reports_ready(tiny_server: Server) -> None:
    r = httpx.get(f"{tiny_server.url}/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ready"
    assert body["progress"] == 1.0
    assert body["slots_idle"] == 2
    assert body["slots_processing"] == 0


def test_stream_format(tiny_server: Server) -> None:
    with httpx.stream(
        "POST",
        f"{tiny_server.url}/completion",
        json={"prompt": "hello world", "options": {"num_predict": 8, "temperature": 0}},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    *chunks, final = lines
    assert chunks, "at least one text chunk"
    for c in chunks:
        assert c["done"] is False
        assert isinstance(c["content"], str)
    assert final["done"] is True
    assert final["done_reason"] == "length"
    assert final["eval_count"] == 8
    assert final["prompt_eval_count"] >= 3  # BOS + tokens of "hello world"
    for key in ("prompt_eval_duration", "eval_duration", "prompt_cached_count"):
        assert isinstance(final[key], int) and final[key] >= 0


def test_greedy_is_deterministic(tiny_server: Server) -> None:
    a, _ = complete(tiny_server.url, "the cat is", **GREEDY)
    b, _ = complete(tiny_server.url, "the cat is", **GREEDY)
    assert a == b
    assert a, "random weights still produce text"


def test_same_seed_same_text(tiny_server: Server) -> None:
    opts = {"temperature": 1.0, "seed": 42, "num_predict": 24}
    a, _ = complete(tiny_server.url, "a dog and", **opts)
    b, _ = complete(tiny_server.url, "a dog and", **opts)
    assert a == b


@pytest.mark.parametrize("n", [1, 5, 33])
def test_num_predict_is_exact(tiny_server: Server, n: int) -> None:
    _, final = complete(
        tiny_server.url, "to the world", temperature=0.7, num_predict=n, ignore_eos=True
    )
    assert final["eval_count"] == n
    assert final["done_reason"] == "length"


def test_num_predict_zero_generates_nothing(tiny_server: Server) -> None:
    text, final = complete(tiny_server.url, "hello", num_predict=0)
    assert text == ""
    assert final["eval_count"] == 0
    assert final["done_reason"] == "length"


def test_second_identical_prompt_reuses_the_cache(tiny_server: Server) -> None:
    prompt = "the cat and the dog and the world " * 4
    complete(tiny_server.url, prompt, **GREEDY)
    _, final = complete(tiny_server.url, prompt, **GREEDY)
    assert final["prompt_cached_count"] == final["prompt_eval_count"] - 1


def test_eog_ends_with_stop(eos_model: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(eos_model)
    text, final = complete(srv.url, "hello", temperature=0, num_predict=50)
    assert final["done_reason"] == "stop"
    assert final["eval_count"] == 1
    assert text == ""


def test_ignore_eos_generates_to_the_limit(
    eos_model: Path, start_server: Callable[..., Server]
) -> None:
    srv = start_server(eos_model)
    _, final = complete(srv.url, "hello", temperature=0, num_predict=20, ignore_eos=True)
    assert final["done_reason"] == "length"
    assert final["eval_count"] == 20


def test_full_slot_ends_with_length(tiny_model: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(tiny_model, ctx_size=256)
    _, final = complete(srv.url, "hello", {"shift": False}, temperature=0, ignore_eos=True)
    assert final["done_reason"] == "length"
    # Every cell holds a decoded token; the last sampled token is returned but never decoded.
    assert final["prompt_eval_count"] + final["eval_count"] == 256 + 1


def test_parallel_requests_match_sequential(
    tiny_model: Path, start_server: Callable[..., Server]
) -> None:
    srv = start_server(tiny_model, parallel=4, ctx_size=256)
    prompts = [f"the {w} is a" for w in ("cat", "dog", "world", "hello", "and", "of")]
    sequential = [complete(srv.url, p, temperature=0, num_predict=24)[0] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        parallel = list(
            pool.map(lambda p: complete(srv.url, p, temperature=0, num_predict=24)[0], prompts)
        )
    assert parallel == sequential


def test_disconnect_frees_the_slot(tiny_model: Path, start_server: Callable[..., Server]) -> None:
    # One slot and a context so large that a leaked sequence would hold it for a long time.
    srv = start_server(tiny_model, parallel=1, ctx_size=60000)
    with httpx.stream(
        "POST",
        f"{srv.url}/completion",
        json={"prompt": "hello", "options": {"temperature": 1, "ignore_eos": True}},
    ) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    wait_idle(srv.url)
    _, final = complete(srv.url, "next", num_predict=3, ignore_eos=True)
    assert final["eval_count"] == 3


def test_utf8_chunks_are_always_valid(tiny_server: Server) -> None:
    # Random weights emit arbitrary bytes; the JSON lines must still be valid UTF-8.
    with httpx.stream(
        "POST",
        f"{tiny_server.url}/completion",
        json={"prompt": "\u00e9t\u00e9 \U0001f4b7", "options": {"num_predict": 200, "seed": 7}},
    ) as r:
        for raw in r.iter_bytes():
            raw.decode("utf-8")


# --- bad input -------------------------------------------------------------------------------


def wait_idle(url: str, timeout: float = 10) -> None:
    """Waits until no slot is busy (the slot table is published just after each step)."""
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health").json()["slots_processing"] != 0:
        assert time.monotonic() < deadline, "a slot stayed busy"
        time.sleep(0.01)


def post(url: str, body: bytes | dict[str, Any]) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{url}/completion", content=body)
    return httpx.post(f"{url}/completion", json=body)


@pytest.mark.parametrize(
    ("body", "kind", "fragment"),
    [
        (b"{not json", "invalid_json", ""),
        (b"", "invalid_json", ""),
        ({"options": {}}, "invalid_request", "prompt"),
        ({"prompt": ""}, "invalid_request", "prompt"),
        ({"prompt": "x", "options": {"top_k": "many"}}, "invalid_json", "options.top_k"),
        ({"prompt": "x", "options": {"temperature": [1]}}, "invalid_json", "options.temperature"),
        ({"prompt": "x", "options": {"num_predict": -2}}, "invalid_request", "num_predict"),
        ({"prompt": "x", "options": {"top_p": 3}}, "invalid_request", "top_p"),
        ({"prompt": 5}, "invalid_json", "prompt"),
        ({"prompt": "x", "grammar": "root ::= [a"}, "invalid_request", "grammar"),
        ({"prompt": "x", "format": "yaml"}, "invalid_request", "format"),
    ],
)
def test_bad_requests_are_400(
    tiny_server: Server, body: bytes | dict[str, Any], kind: str, fragment: str
) -> None:
    r = post(tiny_server.url, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == kind
    assert fragment in err["message"]


def test_unknown_fields_are_ignored(tiny_server: Server) -> None:
    r = post(
        tiny_server.url,
        {
            "prompt": "x",
            "whatever": 1,
            "options": {"num_predict": 2, "ignore_eos": True, "nonsense": True},
        },
    )
    assert r.status_code == 200
    assert json.loads(r.text.splitlines()[-1])["eval_count"] == 2


def test_ollama_capitalized_keys(tiny_server: Server) -> None:
    r = post(tiny_server.url, {"Prompt": "x", "Options": {"num_predict": 3, "ignore_eos": True}})
    assert r.status_code == 200
    assert json.loads(r.text.splitlines()[-1])["eval_count"] == 3


def test_prompt_longer_than_the_slot_is_400_without_truncate(tiny_server: Server) -> None:
    r = post(tiny_server.url, {"prompt": "the cat " * 600, "truncate": False})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "context_length_exceeded"
    assert "exceeds the context length" in err["message"]
    # The slot is not lost.
    _, final = complete(tiny_server.url, "ok", num_predict=2, ignore_eos=True)
    assert final["eval_count"] == 2


def test_unknown_route_is_404(tiny_server: Server) -> None:
    r = httpx.get(f"{tiny_server.url}/nope")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found"


def test_engine_survives_a_burst_of_bad_and_good_requests(tiny_server: Server) -> None:
    bodies: list[bytes | dict[str, Any]] = [
        b"{",
        {"prompt": "the cat " * 600, "truncate": False},
        {"prompt": "ok", "options": {"num_predict": 4}},
    ] * 5
    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda b: post(tiny_server.url, b).status_code, bodies))
    assert codes == [400, 400, 200] * 5
    wait_idle(tiny_server.url)


def test_prompt_longer_than_the_slot_is_truncated_by_default(tiny_server: Server) -> None:
    _, final = complete(tiny_server.url, "the cat " * 600, num_predict=4, ignore_eos=True)
    assert final["truncated"] is True
    assert final["prompt_eval_count"] < 512
    assert final["eval_count"] == 4


def test_slots_lists_every_slot(tiny_server: Server) -> None:
    complete(tiny_server.url, "hello slots", num_predict=2)
    wait_idle(tiny_server.url)
    slots = httpx.get(f"{tiny_server.url}/slots").json()["slots"]
    assert [s["id"] for s in slots] == [0, 1]
    assert all(s["busy"] is False for s in slots)
    assert any(s["cached_tokens"] > 0 and s["last_used_ms"] > 0 for s in slots)
