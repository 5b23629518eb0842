"""Speculative decoding with a draft model (``--draft-model``) end to end on real llama.cpp:
the tiny model drafted for by a copy of itself (every draft accepted) and by a model of other
weights (most rejected). The output with drafts is the output without them, single and with
four concurrent requests, through ``num_predict``, stop strings, EOG, a grammar and logprobs
(each with drafts made: the counts say so);
the metrics count drafted and accepted tokens; a draft model of another vocabulary fails the
load with one line naming it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llamarunner import ModelLoadError, Server, ServerConfig

from helpers import assert_all_busy, complete, run_together, wait_idle
from tinymodel import model_tensors, write_chain_model, write_tiny_model

PROMPTS = [
    "one two three one two three one two",
    "abc abc abc abc",
    "the cat sat on the mat " * 3,
    "1 2 3 1 2 3 1 2 3",
]


def peaked(path: Path, seed: int) -> Path:
    """A tiny model whose layers add nothing (zero output projections): the next token is a
    function of the last one, with a peaked distribution, so a copy of it drafts with
    confidence (the random model's flat distributions would mostly stay under p_min)."""
    tensors = model_tensors(seed=seed)
    for name in tensors:
        if name.endswith(("attn_output.weight", "ffn_down.weight")):
            tensors[name] = tensors[name] * 0
        if name == "output.weight":
            tensors[name] = tensors[name] * 8
    return write_tiny_model(path, tensors=tensors)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("draft")
    return {
        "target": peaked(d / "target.gguf", 0),
        "same": peaked(d / "same.gguf", 0),
        "other": peaked(d / "other.gguf", 1),
    }


# The servers below verify every draft (`draft_always`): on a model this small a draft model
# costs about what the model does, and by default drafting would stop (what
# `test_drafts_that_do_not_pay_stop_by_default` checks).


@pytest.fixture(scope="module")
def same(models: dict[str, Path]) -> Iterator[Server]:
    """Drafted for by a copy of itself: every confident draft is accepted."""
    with Server(
        str(models["target"]),
        port=0,
        parallel=4,
        ctx_size=512,
        threads=2,
        draft_model=str(models["same"]),
        draft_always=True,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def other(models: dict[str, Path]) -> Iterator[Server]:
    """Drafted for by a model of other weights: drafts are mostly rejected."""
    with Server(
        str(models["target"]),
        port=0,
        parallel=4,
        ctx_size=512,
        threads=2,
        draft_model=str(models["other"]),
        draft_always=True,
    ) as srv:
        yield srv


ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A model that writes `ALPHABET` after "hello", then EOS (`write_chain_model`), drafted
    for by a copy of itself: its drafts are right up to EOS, and nothing machine-dependent
    moves where its text ends."""
    d = tmp_path_factory.mktemp("chain")
    with Server(
        str(write_chain_model(d / "chain.gguf", ALPHABET)),
        port=0,
        parallel=2,
        ctx_size=512,
        threads=2,
        draft_model=str(write_chain_model(d / "chain-draft.gguf", ALPHABET)),
        draft_always=True,
    ) as srv:
        yield srv


def run(url: str, prompt: str, speculative: bool, **options: Any) -> tuple[str, dict[str, Any]]:
    options.setdefault("temperature", 0)
    options.setdefault("ignore_eos", True)
    options.setdefault("repeat_penalty", 1.0)
    return complete(url, prompt, {"speculative": speculative}, **options)


def test_a_draft_of_the_same_weights_is_accepted_and_the_output_is_unchanged(
    same: Server,
) -> None:
    for prompt in PROMPTS:
        plain, plain_final = run(same.url, prompt, False, num_predict=120)
        drafted, final = run(same.url, prompt, True, num_predict=120)
        assert drafted == plain, prompt
        assert final["eval_count"] == plain_final["eval_count"] == 120
        assert plain_final["draft_count"] == 0
        assert final["draft_count"] > 40, final
        # The same weights agree on (nearly) every token: a near-tie between the batched
        # verification and the draft's one-token decode may flip one now and then.
        assert final["draft_accepted_count"] >= 0.9 * final["draft_count"], final


def test_a_draft_of_other_weights_is_mostly_rejected_and_the_output_is_unchanged(
    other: Server,
) -> None:
    for prompt in PROMPTS:
        plain, _ = run(other.url, prompt, False, num_predict=100)
        drafted, final = run(other.url, prompt, True, num_predict=100)
        assert drafted == plain, prompt
        assert final["eval_count"] == 100
        assert final["draft_count"] > 0, final
        assert final["draft_accepted_count"] * 2 < final["draft_count"], final


@pytest.mark.parametrize("model", ["same", "other"])
def test_four_concurrent_requests_with_model_drafts_match_their_plain_output(
    model: str, request: pytest.FixtureRequest
) -> None:
    srv: Server = request.getfixturevalue(model)
    plain = [run(srv.url, p, False, num_predict=200)[0] for p in PROMPTS]
    wait_idle(srv.url)
    options = {"temperature": 0, "num_predict": 200, "ignore_eos": True, "repeat_penalty": 1.0}
    together, slots = run_together(
        srv.url, [{"prompt": p, "options": options, "speculative": True} for p in PROMPTS]
    )
    # All four were generating at once: their drafts were verified in shared batches.
    assert_all_busy(slots, 4)
    assert [t for t, _ in together] == plain
    assert all(f["eval_count"] == 200 for _, f in together), together
    assert all(f["draft_count"] > 0 for _, f in together), together
    if model == "same":
        assert all(f["draft_accepted_count"] > 0 for _, f in together), together


def test_num_predict_stops_eog_grammar_and_logprobs_are_unchanged(
    same: Server, chain: Server
) -> None:
    prompt = PROMPTS[0]
    full, _ = run(same.url, prompt, False, num_predict=80)
    for n in (1, 2, 3, 9, 17):
        a = run(same.url, prompt, False, num_predict=n)
        b = run(same.url, prompt, True, num_predict=n)
        assert a[0] == b[0] and b[1]["eval_count"] == n
        if n >= 9:  # the limit falls inside accepted drafts
            assert b[1]["draft_accepted_count"] > 0, (n, b[1])
    # A stop string inside the output, after drafts were accepted.
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    a = run(same.url, prompt, False, num_predict=80, stop=[stop])
    b = run(same.url, prompt, True, num_predict=80, stop=[stop])
    assert a[0] == b[0] == full[: full.find(stop)]
    assert b[1]["done_reason"] == "stop"
    assert b[1]["draft_accepted_count"] > 0, b[1]
    # EOG as without drafts, reached inside accepted drafts: the alphabet and EOS (counted),
    # well before `num_predict`; the drafts past EOS are cut.
    a = run(chain.url, "hello", False, num_predict=80, ignore_eos=False)
    b = run(chain.url, "hello", True, num_predict=80, ignore_eos=False)
    for text, final in (a, b):
        assert (text, final["done_reason"], final["eval_count"]) == (ALPHABET, "stop", 27)
    assert 0 < b[1]["draft_accepted_count"] < b[1]["draft_count"], b[1]
    # A grammar: drafts it rejects are cut, the ones it allows are kept. It allows the
    # model's own "ABCDEFGH" (drafted and accepted), then only "cd"s, where the draft model
    # (which knows no grammar) drafts the rest of the alphabet, then "AB..." after each byte.
    grammar = 'root ::= "ABCDEFGH" ("cd")+'
    a = complete(
        chain.url,
        "hello",
        {"speculative": False, "grammar": grammar},
        temperature=0,
        num_predict=40,
        ignore_eos=True,
    )
    b = complete(
        chain.url,
        "hello",
        {"speculative": True, "grammar": grammar},
        temperature=0,
        num_predict=40,
        ignore_eos=True,
    )
    assert a[0] == b[0] == "ABCDEFGH" + "cd" * 16
    assert a[1]["draft_count"] == 0
    assert 0 < b[1]["draft_accepted_count"] < b[1]["draft_count"], b[1]
    # Logprobs through the OpenAI dialect: the same entries, one per token.
    outs = []
    for spec in (False, True):
        r = httpx.post(
            f"{same.url}/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 30,
                "temperature": 0,
                "logprobs": 2,
                "ignore_eos": True,
                "speculative": spec,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        outs.append(r.json()["choices"][0]["logprobs"])
        details = r.json()["usage"]["completion_tokens_details"]
        assert (details["accepted_prediction_tokens"] > 0) == spec, details
    assert outs[0]["tokens"] == outs[1]["tokens"] and len(outs[1]["tokens"]) == 30
    assert outs[0]["token_logprobs"] == pytest.approx(outs[1]["token_logprobs"], abs=1e-3)


def test_drafts_that_do_not_pay_stop_by_default(models: dict[str, Path], other: Server) -> None:
    """Without `draft_always`, a draft model whose drafts are rejected (and which costs about
    what the model does) soon stops drafting; the output is the same."""
    with Server(
        str(models["target"]),
        port=0,
        threads=2,
        ctx_size=512,
        draft_model=str(models["other"]),
    ) as srv:
        for prompt in PROMPTS[:2]:
            always, a = run(other.url, prompt, True, num_predict=100)
            adaptive, b = run(srv.url, prompt, True, num_predict=100)
            assert adaptive == always
            assert a["draft_count"] > 100, a
            assert b["draft_count"] * 4 < a["draft_count"], (a, b)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_the_metrics_count_drafted_and_accepted_tokens(same: Server) -> None:
    names = ("llamarunner:spec_decode_num_draft_tokens_total",)
    text = httpx.get(f"{same.url}/metrics", timeout=10).text
    prefix = next(
        (ln.split("spec_decode")[0] for ln in text.splitlines() if "spec_decode_num_draft" in ln),
        None,
    )
    assert prefix is not None, names
    prefix = prefix.removeprefix("# HELP ").removeprefix("# TYPE ")
    drafted0 = metric(same.url, prefix + "spec_decode_num_draft_tokens_total")
    accepted0 = metric(same.url, prefix + "spec_decode_num_accepted_tokens_total")
    _, final = run(same.url, PROMPTS[2], True, num_predict=60)
    drafted = metric(same.url, prefix + "spec_decode_num_draft_tokens_total") - drafted0
    accepted = metric(same.url, prefix + "spec_decode_num_accepted_tokens_total") - accepted0
    assert drafted == final["draft_count"] > 0
    assert accepted == final["draft_accepted_count"] > 0


def load_error(model: Path, draft: Path) -> str:
    srv = Server(str(model), port=0, threads=2, draft_model=str(draft)).start()
    try:
        with pytest.raises(ModelLoadError) as e:
            srv.wait_ready(timeout=60)
        return str(e.value)
    finally:
        srv.stop()


def test_a_draft_model_of_another_vocabulary_fails_the_load(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m.gguf")
    # 200 more tokens: more than llama.cpp's 128 apart.
    bigger = write_tiny_model(tmp_path / "bigger.gguf", extra_tokens=200)
    message = load_error(model, bigger)
    assert "--draft-model bigger.gguf" in message and "vocabulary" in message, message
    assert "\n" not in message
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\0" * 60)
    message = load_error(model, garbage)
    assert "garbage.gguf" in message and "\n" not in message, message
    # A few tokens more is what llama.cpp accepts too.
    close = write_tiny_model(tmp_path / "close.gguf", extra_tokens=4)
    with Server(str(model), port=0, threads=2, draft_model=str(close)) as srv:
        text, _ = run(srv.url, "abc", True, num_predict=10)
        assert len(text) > 0


def test_flag_environment_and_help(tmp_path: Path) -> None:
    cfg = ServerConfig.resolve({}, env={"LLAMARUNNER_DRAFT_MODEL": str(tmp_path / "d.gguf")})
    assert cfg.draft_model == str(tmp_path / "d.gguf")
    out = subprocess.run(
        [sys.executable, "-m", "llamarunner", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "--draft-model" in out
