"""Every generation control of /completion changes the output the way it should (tiny model)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from llamarunner import Server

from helpers import complete

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


def test_same_seed_same_text_with_neighbours(tiny_server: Server) -> None:
    alone = sampled(tiny_server, "a dog and", seed=99)
    with ThreadPoolExecutor(2) as pool:
        beside = pool.submit(sampled, tiny_server, "the world of", seed=5)
        together = pool.submit(sampled, tiny_server, "a dog and", seed=99)
        assert together.result() == alone
        beside.result()


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
        lines = [json.loads(line) for line in r.text.splitlines()]
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
    lines = [json.loads(line) for line in r.text.splitlines()]
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
