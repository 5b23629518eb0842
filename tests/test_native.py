"""The native API end to end, on tiny random-weight models with real llama.cpp."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from llamarunner import Server

from helpers import (
    assert_all_busy,
    complete,
    ndjson,
    parse_ndjson,
    run_together,
    stream_lines,
    wait_idle,
)
from tinymodel import write_chain_model, write_cycle_model

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
        lines = list(ndjson(r))
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
    opts = {"temperature": 1.0, "num_predict": 24, "ignore_eos": True}
    a, _ = complete(tiny_server.url, "a dog and", seed=42, **opts)
    b, _ = complete(tiny_server.url, "a dog and", seed=42, **opts)
    assert a == b
    # The seed is what fixes it: another seed samples another text.
    c, _ = complete(tiny_server.url, "a dog and", seed=43, **opts)
    assert c != a


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


def test_eog_ends_with_stop(
    eos_model: Path, tmp_path: Path, start_server: Callable[..., Server]
) -> None:
    """EOG ends a generation with "stop" well before ``num_predict``, at once (the EOS model)
    or after text (a model that writes the alphabet, then EOS): what came before it is the
    whole text, EOG is counted and not written; ignoring EOS, the same request runs on to
    ``num_predict``, so EOG, and nothing else, ended it."""
    srv = start_server(eos_model)
    text, final = complete(srv.url, "hello", temperature=0, num_predict=50)
    assert final["done_reason"] == "stop"
    assert final["eval_count"] == 1
    assert text == ""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    chain = start_server(write_chain_model(tmp_path / "chain.gguf", alphabet))
    text, final = complete(chain.url, "hello", temperature=0, num_predict=50)
    assert (text, final["done_reason"], final["eval_count"]) == (alphabet, "stop", 27)
    _, final = complete(chain.url, "hello", temperature=0, num_predict=50, ignore_eos=True)
    assert (final["done_reason"], final["eval_count"]) == ("length", 50)


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
    """Four greedy streams decoded together give the text each gives alone. The slot table
    read once all four have started shows them all busy: they really shared batches (each was
    then a few dozen tokens into its answer). Not much longer: llama.cpp's kernels are not
    batch-invariant (see test_real_model.py), and one of these answers parts from its
    sequential self at about 390 tokens."""
    n = 256
    srv = start_server(tiny_model, parallel=4, ctx_size=512)
    prompts = [f"the {w} is a" for w in ("cat", "dog", "world", "hello")]
    options = {"temperature": 0, "num_predict": n, "ignore_eos": True}
    # Without drafts: they change the batches' shapes (and make the answers finish sooner
    # than the slot table is read); speculation has its own equality tests.
    plain = {"speculative": False}
    sequential = [complete(srv.url, p, plain, **options)[0] for p in prompts]
    results, slots = run_together(
        srv.url, [{"prompt": p, "options": options, **plain} for p in prompts]
    )
    assert_all_busy(slots, 4)
    assert [final["eval_count"] for _, final in results] == [n] * 4
    assert [text for text, _ in results] == sequential


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


def test_multibyte_characters_are_never_split_between_chunks(
    tmp_path: Path, start_server: Callable[..., Server]
) -> None:
    """A model that writes "日é💷" over and over, one byte token at a time (the tiny vocabulary
    has only byte tokens for these characters): two to four tokens each. Every JSON line must
    carry whole characters; a piece cut inside one would decode to U+FFFD."""
    srv = start_server(write_cycle_model(tmp_path / "cycle.gguf", "\u65e5\u00e9\U0001f4b7"))
    for n in (9 * 20, 9 * 20 + 5):  # 20 rounds, then 20 rounds and 日 and é
        lines = list(
            stream_lines(
                srv.url, {"prompt": "hello", "options": {"num_predict": n, "temperature": 0}}
            )
        )
        *chunks, final = lines
        assert final["done"] is True and "error" not in final, final
        assert final["eval_count"] == n
        assert chunks and all(c["done"] is False for c in chunks)
        for c in chunks:
            assert c["content"] and "\ufffd" not in c["content"], c
        text = "".join(c["content"] for c in chunks)
        assert text == "\u65e5\u00e9\U0001f4b7" * 20 + ("\u65e5\u00e9" if n % 9 else "")


def test_arbitrary_bytes_still_give_valid_json_lines(tiny_server: Server) -> None:
    # Random weights emit arbitrary bytes (invalid UTF-8 becomes U+FFFD): each line is whole
    # JSON, and the stream ends with its final message.
    lines = list(
        stream_lines(
            tiny_server.url,
            {"prompt": "\u00e9t\u00e9 \U0001f4b7", "options": {"num_predict": 200, "seed": 7}},
        )
    )
    assert lines[-1]["done"] is True and "error" not in lines[-1], lines[-1]
    assert all(line["done"] is False for line in lines[:-1])
    assert sum(len(line.get("content", "")) for line in lines) > 0


SEPARATORS = "a\u2028b\u2029c\u0085d"


@pytest.mark.parametrize("route", ["/completion", "/v1/completions"])
def test_line_separators_in_the_output_are_escaped_on_the_wire(
    tiny_server: Server, route: str
) -> None:
    """U+2028, U+2029 and U+0085 in generated text go out as JSON escapes, so that readers
    that end lines where str.splitlines does (httpx's iter_lines, the official ollama client)
    still see one chunk per line."""
    grammar = 'root ::= "' + SEPARATORS + '"'
    body: dict[str, Any] = {"prompt": "x", "grammar": grammar, "stream": True}
    if route == "/completion":
        body["options"] = {"num_predict": 32, "seed": 1}
    else:
        body.update(model="tiny", max_tokens=32, seed=1)
    r = httpx.post(tiny_server.url + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    for raw in ("\u2028", "\u2029", "\u0085"):
        assert raw.encode() not in r.content, r.content
    if route == "/completion":
        text = "".join(line.get("content", "") for line in parse_ndjson(r.text))
    else:
        events = [ln[len("data: ") :] for ln in r.text.splitlines() if ln.startswith("data: ")]
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        text = "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
    assert text == SEPARATORS


def test_format_json_output_parses(tiny_server: Server) -> None:
    for seed in range(3):
        lines = list(
            stream_lines(
                tiny_server.url,
                {
                    "prompt": "json:",
                    "format": "json",
                    "options": {"num_predict": 300, "seed": seed, "temperature": 0.5},
                },
            )
        )
        text = "".join(line.get("content", "") for line in lines)
        assert lines[-1]["done_reason"] == "stop", (lines[-1], text)
        assert isinstance(json.loads(text), dict), text


def test_prompt_longer_than_the_batch_size(
    tiny_model: Path, start_server: Callable[..., Server], tiny_server: Server
) -> None:
    """A prompt of about 430 tokens through a batch of 32 is decoded in 14 chunks; the answer
    is the one a batch that takes it whole gives."""
    srv = start_server(tiny_model, batch_size=32, ctx_size=512)
    prompt = "the cat sat on the mat; " * 12
    options = {"temperature": 0, "num_predict": 16, "ignore_eos": True}
    chunked, chunked_final = complete(srv.url, prompt, **options)
    whole, whole_final = complete(tiny_server.url, prompt, **options)
    assert chunked_final["prompt_eval_count"] == whole_final["prompt_eval_count"] > 32 * 9
    assert chunked_final["truncated"] is False
    assert chunked == whole


def test_num_keep_keeps_the_head_of_a_truncated_prompt(
    tiny_model: Path, start_server: Callable[..., Server]
) -> None:
    """A prompt twice as long as the slot, cut keeping ``num_keep`` tokens: its answer is the
    answer to the kept head and tail sent as they are. Every character here is one byte token
    (the tiny vocabulary has no pieces for them) after BOS and the three byte tokens of the
    leading "\u2581"."""
    srv = start_server(tiny_model, ctx_size=256)
    rng = random.Random(5)
    prompt = "x" + "".join(rng.choice("bcdfghjkmnpqrstvwxyz") for _ in range(399))
    options = {"temperature": 0, "num_predict": 8, "ignore_eos": True}
    counts = {}
    for num_keep in (40, 100):
        text, final = complete(srv.url, prompt, num_keep=num_keep, **options)
        assert final["truncated"] is True
        kept = final["prompt_eval_count"]
        counts[num_keep] = kept
        head = prompt[: num_keep - 3]  # num_keep counts the three tokens of "\u2581"
        tail = prompt[len(prompt) - (kept - 1 - num_keep) :]
        direct, direct_final = complete(srv.url, head + tail, **options)
        assert direct_final["truncated"] is False
        assert direct_final["prompt_eval_count"] == kept
        assert text == direct, num_keep
    # Keeping more of the head leaves more of the prompt: the cut frees half of the unkept part.
    assert counts[100] > counts[40]


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


def test_any_model_name_is_the_served_one(tiny_server: Server) -> None:
    """The native request's optional `model`: on a server of one model any name is that
    model, as on llama-server (tools hard-code names); Ollama's routes keep their 404."""
    for name in ("tiny", "other"):
        r = post(tiny_server.url, {"model": name, "prompt": "x", "options": {"num_predict": 1}})
        assert r.status_code == 200, r.text
    e = httpx.post(f"{tiny_server.url}/embedding", json={"model": "other", "content": "x"})
    assert e.status_code == 200, e.text
    o = httpx.post(f"{tiny_server.url}/api/generate", json={"model": "other", "prompt": "x"})
    assert o.status_code == 404, o.text


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
    assert parse_ndjson(r.text)[-1]["eval_count"] == 2


def test_ollama_capitalized_keys(tiny_server: Server) -> None:
    r = post(tiny_server.url, {"Prompt": "x", "Options": {"num_predict": 3, "ignore_eos": True}})
    assert r.status_code == 200
    assert parse_ndjson(r.text)[-1]["eval_count"] == 3


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
    slots = httpx.get(f"{tiny_server.url}/slots").json()
    assert [s["id"] for s in slots] == [0, 1]
    assert all(s["busy"] is False for s in slots)
    assert any(s["cached_tokens"] > 0 and s["last_used_ms"] > 0 for s in slots)
