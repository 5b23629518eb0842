"""Fill-in-the-middle: llama-server's ``POST /infill`` and ``/v1/completions`` with a
``suffix``, on tiny models whose vocabularies name FIM tokens (``<x0>`` = fim_pre, ``<x1>`` =
fim_suf, ``<x2>`` = fim_mid, ``<x3>`` = fim_rep, ``<x4>`` = fim_sep)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llamarunner import Server

from helpers import complete, token_ids, wait_idle
from tinymodel import write_tiny_model

GREEDY = {"temperature": 0, "n_predict": 12, "ignore_eos": True}
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Prefix, suffix and middle tokens only (PSM without repository tokens)."""
    model = write_tiny_model(
        tmp_path_factory.mktemp("fim") / "coder.gguf", fim=("pre", "suf", "mid")
    )
    with Server(str(model), port=0, parallel=1, ctx_size=256, threads=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def repo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """All five FIM tokens: extra files go in with the repository and file separators."""
    model = write_tiny_model(
        tmp_path_factory.mktemp("fim-repo") / "repo-coder.gguf",
        fim=("pre", "suf", "mid", "rep", "sep"),
    )
    with Server(str(model), port=0, parallel=1, ctx_size=512, threads=2) as srv:
        yield srv


def infill(url: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/infill", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_the_prompt_is_prefix_suffix_middle(fim_server: Server) -> None:
    """The answer is the one a plain completion gives for the same tokens written out:
    BOS, fim_pre, the prefix, fim_suf, the suffix, fim_mid (control tokens are parsed)."""
    got = infill(fim_server.url, input_prefix=PREFIX, input_suffix=SUFFIX, **GREEDY)
    written = f"<x0>{PREFIX}<x1>{SUFFIX}<x2>"
    expected_tokens = token_ids(fim_server.url, written, add_special=True)
    assert got["tokens_evaluated"] == len(expected_tokens)
    # Greedy, and without the native route's default repetition penalty (infill has
    # llama-server's defaults: none).
    options = {"temperature": 0, "num_predict": 12, "ignore_eos": True, "repeat_penalty": 1.0}
    text, _ = complete(fim_server.url, written, **options)
    assert got["content"] == text
    assert got["stop"] is True and got["stop_type"] == "limit"
    assert got["tokens_predicted"] == 12
    assert got["timings"]["predicted_n"] == 12
    # The order matters: suffix before prefix is another prompt, another answer.
    swapped, _ = complete(fim_server.url, f"<x0>{SUFFIX}<x1>{PREFIX}<x2>", **options)
    assert swapped != got["content"]


def test_the_prompt_field_follows_the_prefix(fim_server: Server) -> None:
    got = infill(
        fim_server.url, input_prefix=PREFIX, input_suffix=SUFFIX, prompt="return", **GREEDY
    )
    text, _ = complete(
        fim_server.url,
        f"<x0>{PREFIX}return<x1>{SUFFIX}<x2>",
        temperature=0,
        num_predict=12,
        ignore_eos=True,
    )
    # "return" is tokenized on its own (with SentencePiece's space before it), as llama-server
    # does; the written-out text joins it to the prefix. The counts say which layout it was.
    expected = (
        1
        + 3
        + len(token_ids(fim_server.url, PREFIX))
        + len(token_ids(fim_server.url, "return"))
        + len(token_ids(fim_server.url, SUFFIX))
    )
    assert got["tokens_evaluated"] == expected
    assert isinstance(text, str)


def test_a_stream_sends_the_same_text_and_ends_with_the_counts(fim_server: Server) -> None:
    whole = infill(fim_server.url, input_prefix=PREFIX, input_suffix=SUFFIX, **GREEDY)
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "stream": True, **GREEDY}
    events = []
    with httpx.stream("POST", f"{fim_server.url}/infill", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    assert [e["stop"] for e in events].count(True) == 1 and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_predicted"] == 12


def test_openai_completions_with_a_suffix_take_the_same_path(fim_server: Server) -> None:
    got = infill(fim_server.url, input_prefix=PREFIX, input_suffix=SUFFIX, **GREEDY)
    r = httpx.post(
        f"{fim_server.url}/v1/completions",
        json={
            "prompt": PREFIX,
            "suffix": SUFFIX,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == got["content"]
    assert r.json()["usage"]["prompt_tokens"] == got["tokens_evaluated"]


def test_code_too_long_for_the_slot_keeps_what_is_nearest_the_cursor(
    fim_server: Server,
) -> None:
    """A 256-token slot with 32 tokens to generate: the prefix keeps its end and the suffix
    its start, and the request is served (not refused, not cut at the front)."""
    long_prefix = "x = 1\n" * 200
    long_suffix = "y = 2\n" * 200
    got = infill(
        fim_server.url,
        input_prefix=long_prefix + "END",
        input_suffix="START" + long_suffix,
        temperature=0,
        n_predict=32,
        ignore_eos=True,
    )
    assert got["tokens_evaluated"] <= 256 - 32
    assert got["tokens_evaluated"] >= 256 - 32 - 4
    assert got["tokens_predicted"] == 32
    assert got["truncated"] is False
    # What was kept: the tokens of the prefix's end and the suffix's start, whose bytes are
    # distinct ("END", "START") in the tiny byte vocabulary.
    wait_idle(fim_server.url)


def test_a_prompt_that_leaves_no_room_is_a_400(fim_server: Server) -> None:
    r = httpx.post(
        f"{fim_server.url}/infill",
        json={"input_prefix": "a", "prompt": "z" * 400, "n_predict": 8},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "body",
    [
        {"input_prefix": 5},
        {"input_extra": "text"},
        {"input_extra": [{"text": 5}]},
        {"input_extra": [{"filename": "a.py", "text": "x"}] * 257},
        {"input_extra": [{}] * 100_000},
        {"n_predict": "many"},
        {"temperature": -1},
        {"grammar": "root ::= ("},
    ],
)
def test_bad_bodies_are_400s(fim_server: Server, body: dict[str, Any]) -> None:
    r = httpx.post(f"{fim_server.url}/infill", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] in ("invalid_request", "invalid_json", "invalid_grammar")


def test_extra_files_go_before_the_prefix_with_their_separators(repo_server: Server) -> None:
    url = repo_server.url
    files = [{"filename": "util.py", "text": "def one():\n    return 1\n"}, {"text": "z = 3"}]
    got = infill(url, input_prefix=PREFIX, input_suffix=SUFFIX, input_extra=files, **GREEDY)
    # rep "myproject\n", sep "util.py\n" TEXT, sep "tmp\n" TEXT, sep "filename\n", then BOS
    # pre PREFIX suf SUFFIX mid: seven markers and BOS.
    pieces = [
        "myproject\n",
        "util.py\n",
        files[0]["text"],
        "tmp\n",
        "z = 3",
        "filename\n",
        PREFIX,
        SUFFIX,
    ]
    expected = 8 + sum(len(token_ids(url, p)) for p in pieces)
    assert got["tokens_evaluated"] == expected
    without = infill(url, input_prefix=PREFIX, input_suffix=SUFFIX, **GREEDY)
    assert without["content"] != got["content"]


def test_a_model_without_fim_tokens_is_a_400(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "plain.gguf")
    with Server(str(model), port=0, parallel=1, ctx_size=256, threads=2) as srv:
        r = httpx.post(f"{srv.url}/infill", json={"input_prefix": "a"}, timeout=60)
        assert r.status_code == 400
        assert "fill-in-the-middle" in r.json()["error"]["message"]
        r = httpx.post(
            f"{srv.url}/v1/completions",
            json={"prompt": "a", "suffix": "b", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "invalid_request_error"
        # Without a suffix the same model completes as before.
        r = httpx.post(
            f"{srv.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200


def test_special_tokens_written_in_the_code_stay_text(fim_server: Server) -> None:
    """``<x2>`` is fim_mid's text: written in a file it is text (four bytes), not the marker,
    so the prompt is as long as with any other four characters there."""
    counts = [
        infill(fim_server.url, input_prefix=f"a{mark}b", input_suffix=mark, **GREEDY)[
            "tokens_evaluated"
        ]
        for mark in ("<x2>", "<y2>")
    ]
    assert counts[0] == counts[1]


def test_text_beyond_what_a_slot_reads_is_cut_not_refused(fim_server: Server) -> None:
    """A slot of 256 tokens reads at most 64 KiB of text: 200 KB of code around the cursor and
    a long ring of extra files (as llama.vim keeps) are cut, and served."""
    files = [{"filename": f"f{i}.py", "text": "z = 1\n" * 2000} for i in range(20)]
    got = infill(
        fim_server.url,
        input_prefix="x = 1\n" * 20000,
        input_suffix="y = 2\n" * 20000,
        input_extra=files,
        n_predict=4,
        temperature=0,
    )
    assert 0 < got["tokens_evaluated"] <= 256 - 4
    assert got["tokens_predicted"] == 4
