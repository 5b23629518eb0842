"""Every generation control of /completion changes the output the way it should (tiny model)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from llamarunner import Server

from helpers import Neighbour, complete, parse_ndjson

N = 40


def greedy(srv: Server, prompt: str = "the cat is", **options: Any) -> str:
    return complete(srv.url, prompt, temperature=0, num_predict=N, **options)[0]


def sampled(srv: Server, prompt: str = "the cat is", **options: Any) -> str:
    options = {"temperature": 1.0, "seed": 1234, "num_predict": N, **options}
    return complete(srv.url, prompt, **options)[0]


def test_top_k_1_is_greedy(tiny_server: Server) -> None:
    assert sampled(tiny_server, top_k=1) == greedy(tiny_server)


def test_top_p_tiny_is_greedy(tiny_server: Server) -> None:
    assert sampled(tiny_server, top_k=0, top_p=0.0001) == greedy(tiny_server)


def test_min_p_1_is_greedy(tiny_server: Server) -> None:
    assert sampled(tiny_server, top_k=0, top_p=1.0, min_p=1.0) == greedy(tiny_server)


def test_typical_p_changes_sampling(tiny_server: Server) -> None:
    base = sampled(tiny_server, top_k=0, top_p=1.0)
    assert sampled(tiny_server, top_k=0, top_p=1.0, typical_p=0.05) != base


def test_temperature_changes_sampling(tiny_server: Server) -> None:
    assert sampled(tiny_server, temperature=0.3) != sampled(tiny_server, temperature=3.0)


def test_seed_changes_and_fixes_sampling(tiny_server: Server) -> None:
    a = sampled(tiny_server, seed=1)
    assert sampled(tiny_server, seed=1) == a
    assert sampled(tiny_server, seed=2) != a


def test_seed_above_2_to_the_32_is_accepted_and_wraps(tiny_server: Server) -> None:
    # llama.cpp's samplers take a 32-bit seed; larger ones wrap, as Ollama's uint32(seed).
    big = sampled(tiny_server, seed=2**32 + 1234)
    assert sampled(tiny_server, seed=2**32 + 1234) == big
    assert big == sampled(tiny_server, seed=1234)
    assert big != sampled(tiny_server, seed=1235)
    assert sampled(tiny_server, seed=2**40 + 77) == sampled(tiny_server, seed=77)


@pytest.mark.parametrize("seed", [2**32 - 1, 2**63 - 1])
def test_every_explicit_seed_is_repeatable(tiny_server: Server, seed: int) -> None:
    # Both wrap to 0xFFFFFFFF, which llama.cpp's samplers take for "pick a random seed"
    # (LLAMA_DEFAULT_SEED); an explicit seed must still give the same text every time.
    assert sampled(tiny_server, seed=seed) == sampled(tiny_server, seed=seed)


def test_same_seed_same_text_with_neighbours(tiny_server: Server) -> None:
    alone = sampled(tiny_server, "a dog and", seed=99)
    # A second sequence generates in the same batches for the whole request.
    with Neighbour(tiny_server.url, "the world of", seed=5, temperature=1.0) as neighbour:
        together = sampled(tiny_server, "a dog and", seed=99)
        neighbour.still_running()
    assert together == alone


@pytest.mark.parametrize(
    "penalty",
    [
        {"repeat_penalty": 3.0},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
    ],
)
def test_penalties_change_greedy_output(tiny_server: Server, penalty: dict[str, float]) -> None:
    plain = greedy(tiny_server, repeat_penalty=1.0)
    assert greedy(tiny_server, **{"repeat_penalty": 1.0, **penalty}) != plain


def test_repeat_last_n_zero_disables_the_penalty(tiny_server: Server) -> None:
    plain = greedy(tiny_server, repeat_penalty=1.0)
    assert greedy(tiny_server, repeat_penalty=3.0, repeat_last_n=0) == plain


@pytest.mark.parametrize("mode", [1, 2])
def test_mirostat_generates(tiny_server: Server, mode: int) -> None:
    _, final = complete(tiny_server.url, "hello", mirostat=mode, seed=3, num_predict=N)
    assert final["eval_count"] == N
    assert sampled(tiny_server, mirostat=mode) != sampled(tiny_server)


@pytest.mark.parametrize("mode", [1, 2])
def test_mirostat_tau_and_eta_take_effect(tiny_server: Server, mode: int) -> None:
    def text(**options: Any) -> str:
        return sampled(tiny_server, mirostat=mode, ignore_eos=True, **options)

    base = text(mirostat_tau=5.0, mirostat_eta=0.1)
    assert text(mirostat_tau=5.0, mirostat_eta=0.1) == base
    # A target surprise near zero keeps only the likeliest tokens: greedy.
    assert text(mirostat_tau=0.01, mirostat_eta=0.1) != base
    assert text(mirostat_tau=5.0, mirostat_eta=1.0) != base


def test_stop_string_is_never_returned(tiny_server: Server) -> None:
    full = greedy(tiny_server)
    stop = full[15:18]
    text, final = complete(tiny_server.url, "the cat is", temperature=0, num_predict=N, stop=[stop])
    assert final["done_reason"] == "stop"
    assert stop not in text
    assert full.startswith(text)
    assert text == full[: full.index(stop)]


def test_grammar_constrains_output(tiny_server: Server) -> None:
    for seed in range(5):
        r = httpx.post(
            f"{tiny_server.url}/completion",
            json={
                "prompt": "answer:",
                "grammar": 'root ::= "yes" | "no"',
                "options": {"seed": seed, "num_predict": 20, "temperature": 1.0},
            },
        )
        assert r.status_code == 200, r.text
        lines = parse_ndjson(r.text)
        out = "".join(line.get("content", "") for line in lines)
        assert out in ("yes", "no")
        assert lines[-1]["done_reason"] == "stop"


def test_invalid_grammar_is_400_with_the_parser_message(tiny_server: Server) -> None:
    r = httpx.post(
        f"{tiny_server.url}/completion", json={"prompt": "x", "grammar": 'root ::= "yes'}
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request"
    assert "invalid grammar: unterminated string at line 1, column 10" in err["message"]


def test_format_json_schema_output_validates(tiny_server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"],
    }
    r = httpx.post(
        f"{tiny_server.url}/completion",
        json={"prompt": "json:", "format": schema, "options": {"num_predict": 60, "seed": 1}},
    )
    assert r.status_code == 200, r.text
    lines = parse_ndjson(r.text)
    out = json.loads("".join(line.get("content", "") for line in lines))
    assert isinstance(out["ok"], bool)
    assert isinstance(out["n"], int)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"format": "xml"}, "invalid format"),
        ({"format": 5}, "invalid format"),
        ({"options": {"top_p": 2}}, "top_p"),
        ({"options": {"top_k": -5}}, "top_k"),
        ({"options": {"mirostat": 7}}, "mirostat"),
        ({"options": {"stop": [1]}}, "stop"),
        ({"options": {"stop": [""]}}, "stop"),
        ({"options": {"temperature": -1}}, "temperature"),
        ({"options": {"min_p": 1.5}}, "min_p"),
        ({"options": {"repeat_last_n": -2}}, "repeat_last_n"),
    ],
)
def test_bad_values_name_the_option(
    tiny_server: Server, body: dict[str, Any], fragment: str
) -> None:
    r = httpx.post(f"{tiny_server.url}/completion", json={"prompt": "x", **body})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
