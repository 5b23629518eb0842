"""The host-memory prompt cache (``--cache-ram``) with real llama.cpp on tiny models: a
conversation pushed out of its slot is restored from RAM for its next turn, and the restored
state gives the greedy tokens a fresh decode gives (by logprobs); on a sliding-window model a
restored conversation serves a prompt that continues it, and one that cuts it back is decoded
in full (a restored state holds only the window's cells before its end)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from llamarunner import Server

from helpers import (
    ServeProcess,
    assert_serve_refuses,
    choice_logprobs,
    complete,
    metric,
    openai_greedy,
    same_or_near_tie,
)
from tinymodel import SPARK_SLIDING_WINDOW, write_spark2_5_model

StartServer = Callable[..., Server]

ALICE = "the cat is the dog and the world of hello " * 6
BOB = "hello world the cat and a dog is of the world " * 6


def n_tokens(url: str, text: str) -> int:
    r = httpx.post(f"{url}/tokenize", json={"content": text}, timeout=30)
    assert r.status_code == 200, r.text
    return len(r.json()["tokens"])


def turns(url: str, follow: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Alice, then Bob in the one slot, then Alice's follow-up: (Bob's final message, the
    follow-up's OpenAI answer)."""
    complete(url, ALICE, temperature=0, num_predict=8, ignore_eos=True)
    _, bob = complete(url, BOB, temperature=0, num_predict=8, ignore_eos=True)
    return bob, openai_greedy(url, follow, 12, ignore_eos=True)


def test_a_conversation_pushed_out_of_its_slot_is_restored_with_the_same_tokens(
    tiny_model: Path, start_server: StartServer
) -> None:
    follow = ALICE + "and then the cat said"
    cached = start_server(tiny_model, parallel=1, ctx_size=1024, cache_ram=64)
    alice = n_tokens(cached.url, ALICE)
    bob, warm = turns(cached.url, follow)
    assert bob["prompt_cached_count"] < 10, bob  # a few bytes in common: Bob is new
    usage = warm["usage"]
    # Alice's prompt came back from RAM (her answer differs from the follow-up's text; the
    # last token or two of her prompt may tokenize otherwise before it).
    assert usage["prompt_tokens_details"]["cached_tokens"] >= alice - 2, (alice, usage)
    assert metric(cached.url, "prompt_cache_restored_tokens_total") >= alice - 10
    assert metric(cached.url, "prompt_cache_entries") >= 1
    assert metric(cached.url, "prompt_cache_bytes") > 0
    # Without the cache the same turns decode the follow-up in full...
    cold_server = start_server(tiny_model, parallel=1, ctx_size=1024, cache_ram=0)
    _, cold = turns(cold_server.url, follow)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] < 10
    # ...and give the same greedy tokens (or part at a near-tie: the cells were computed in
    # batches of other shapes).
    same_or_near_tie(choice_logprobs(cold), choice_logprobs(warm))


def test_on_a_sliding_window_model_a_restored_conversation_continues_but_is_not_cut_back(
    tmp_path: Path, start_server: StartServer
) -> None:
    model = write_spark2_5_model(tmp_path / "swa.gguf")
    srv = start_server(model, parallel=1, ctx_size=2048, batch_size=32, cache_ram=64)
    # ~350 tokens (the tiny vocabulary is mostly bytes), more than the 256-token window and a
    # 32-token batch: the window layer keeps only its last cells.
    long = ALICE
    assert n_tokens(srv.url, long) > SPARK_SLIDING_WINDOW + 32
    # One token: sampled, never decoded, so the slot holds BOS and the prompt.
    complete(srv.url, long, temperature=0, num_predict=1)
    complete(srv.url, BOB, temperature=0, num_predict=8, ignore_eos=True)
    # A prompt that continues Alice's exactly (byte tokens: the prompt's tokens stay a prefix)
    # is restored and decodes only its new tokens...
    _, cont = complete(srv.url, long + "xyz", temperature=0, num_predict=4)
    assert cont["prompt_cached_count"] == 1 + n_tokens(srv.url, long), cont  # BOS + prompt
    assert cont["prompt_cached_count"] > SPARK_SLIDING_WINDOW, cont
    # ...a prompt that cuts it back past the window is decoded in full (the window's cells
    # before the cut are gone).
    complete(srv.url, BOB, temperature=0, num_predict=8, ignore_eos=True)
    cut = ALICE[:120] + "something else"
    _, deep = complete(srv.url, cut, temperature=0, num_predict=4)
    assert deep["prompt_cached_count"] < 10, deep


PROSE = (
    "The old lighthouse keeper climbed the spiral stairs each evening, counting the steps "
    "as his father had, and lit the lamp that warned the fishing boats away from the rocks. "
)


@pytest.mark.real_model
def test_states_read_in_one_walk_fall_back_to_an_exact_size_without_an_error(
    default_model: Path,
) -> None:
    """A sequence's state is read into a buffer sized from the most bytes per cell seen
    (backend/llama/state_read.rs). On Gemma 3 (a 512-token window on 15 of its 18 layers) a
    long prompt decoded in one batch (its first checkpoint, the first exact sizing, at its
    end) teaches fewer bytes per cell than a short one takes, so the short one's reads fall
    short once: they are sized and read again, llama.cpp's error for the short buffer is not
    logged, and the states restore as before."""
    env = {**os.environ, "LLAMARUNNER_LOG": "info,llamarunner_core::backend::llama=debug"}
    args = ["--port", "0", "--parallel", "1", "--ctx-size", "4096", "--batch-size", "2048"]
    args += ["--cache-ram", "256"]
    with ServeProcess(str(default_model), *args, env=env) as serve:
        url = serve.wait_ready()
        long = PROSE * 50
        short = "A note about the weather: it rained all morning and cleared by noon. " * 12
        assert n_tokens(url, long) > 1500
        assert 100 < n_tokens(url, short) < 400
        # The long prompt's checkpoint is the first exact sizing of both parts.
        complete(url, long, temperature=0, num_predict=1)
        # The short one's checkpoint (the window part), then the long one's state saved
        # to RAM as the short takes the slot; then the short one's state saved likewise.
        complete(url, short, temperature=0, num_predict=4, ignore_eos=True)
        complete(url, long, temperature=0, num_predict=1)
        follow = short + " In the afternoon"
        warm = openai_greedy(url, follow, 8, ignore_eos=True)
        restored = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert restored >= n_tokens(url, short) - 2, warm["usage"]
        cold = openai_greedy(url, follow, 8, ignore_eos=True, cache_prompt=False)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] < 10
        same_or_near_tie(choice_logprobs(cold), choice_logprobs(warm))
        log = serve.log
    assert "the state is larger than guessed" in log, log[-4000:]
    assert "error saving state" not in log, log[-4000:]


def test_cache_prompt_false_decodes_the_whole_prompt_on_every_route(
    tiny_model: Path, start_server: StartServer
) -> None:
    srv = start_server(tiny_model, parallel=1, ctx_size=1024)
    complete(srv.url, ALICE, temperature=0, num_predict=2)
    _, native = complete(srv.url, ALICE, {"cache_prompt": False}, temperature=0, num_predict=2)
    assert native["prompt_cached_count"] == 0, native
    _, reused = complete(srv.url, ALICE, temperature=0, num_predict=2)
    assert reused["prompt_cached_count"] > 0, reused
    body = {"prompt": ALICE, "max_tokens": 2, "temperature": 0}
    for cache_prompt, cached in ((False, 0), (True, None)):
        r = httpx.post(
            f"{srv.url}/v1/completions", json={**body, "cache_prompt": cache_prompt}, timeout=60
        )
        assert r.status_code == 200, r.text
        got = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert got == cached if cached is not None else got > 0, r.json()["usage"]
    for bad in ("no", 1):
        r = httpx.post(f"{srv.url}/v1/completions", json={**body, "cache_prompt": bad}, timeout=60)
        assert r.status_code == 400, r.text
        r = httpx.post(
            f"{srv.url}/completion", json={"prompt": ALICE, "cache_prompt": bad}, timeout=60
        )
        assert r.status_code == 400, r.text


@pytest.mark.parametrize("value", [-2, -(1 << 62), (16 << 20) + 1, 1 << 62])
def test_an_out_of_range_cache_ram_is_refused(tiny_model: Path, value: int) -> None:
    with pytest.raises(ValueError, match="cache-ram"):
        Server(str(tiny_model), port=0, cache_ram=value).start()


@pytest.mark.parametrize("value", ["-5", "lots", "1.5"])
def test_the_cli_refuses_a_bad_cache_ram_with_exit_2(tiny_model: Path, value: str) -> None:
    assert_serve_refuses(tiny_model, "cache-ram", value)
