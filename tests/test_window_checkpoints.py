"""Window checkpoints (``--ctx-checkpoints``) with real llama.cpp on a tiny sliding-window
model: a prompt that cuts a cached sequence back past its window, or forks another slot's
prefix, goes back to the last checkpoint before the cut (llama.cpp's partial sequence state)
instead of decoding the whole prompt, and gives the greedy tokens a fresh decode gives (by
logprobs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from llamarunner import Server

from helpers import assert_serve_refuses, choice_logprobs, complete, openai_greedy, same_or_near_tie
from tinymodel import SPARK_SLIDING_WINDOW, write_spark2_5_model

StartServer = Callable[..., Server]

# ~475 tokens: more than the 256-token window and the 32-token batch.
LONG = "the cat is the dog and the world of hello " * 8
BATCH = 32
# Generated after it: llama.cpp keeps more window cells than the window (its window cache is
# sized for the window and a batch, padded), so the slot must move well past it.
MOVE_ON = 600


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_spark2_5_model(tmp_path_factory.mktemp("swa") / "swa.gguf")


def n_tokens(url: str, text: str) -> int:
    r = httpx.post(f"{url}/tokenize", json={"content": text}, timeout=30)
    assert r.status_code == 200, r.text
    return len(r.json()["tokens"])


def greedy(url: str, prompt: str, n: int) -> tuple[dict[str, Any], int]:
    """A greedy OpenAI completion with the top 2 logprobs: (its logprobs, cached prompt tokens)."""
    answer = openai_greedy(url, prompt, n, ignore_eos=True)
    return choice_logprobs(answer), answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def serve(start_server: StartServer, model: Path, **kw: Any) -> Server:
    # Checkpoints are held within the --cache-ram budget.
    return start_server(model, ctx_size=2048, batch_size=BATCH, cache_ram=64, **kw)


def test_a_cut_back_past_the_window_goes_back_to_a_checkpoint(
    swa_model: Path, start_server: StartServer
) -> None:
    srv = serve(start_server, swa_model, parallel=1)
    assert n_tokens(srv.url, LONG) > SPARK_SLIDING_WINDOW + BATCH
    complete(srv.url, LONG, temperature=0, num_predict=MOVE_ON, ignore_eos=True)
    # The next prompt shares ~425 tokens: a cut ~650 tokens back from the slot's end, past its
    # window. Checkpoints are taken every 256 positions and at the prompt's end: it goes back to
    # the one at 256.
    cut = LONG[:300] + " something else entirely"
    shared = n_tokens(srv.url, LONG[:300])
    warm, cached = greedy(srv.url, cut, 12)
    assert SPARK_SLIDING_WINDOW <= cached < shared, (cached, shared)
    # Without checkpoints the same turns decode the whole prompt, to the same greedy tokens.
    plain = serve(start_server, swa_model, parallel=1, ctx_checkpoints=0)
    complete(plain.url, LONG, temperature=0, num_predict=MOVE_ON, ignore_eos=True)
    cold, cold_cached = greedy(plain.url, cut, 12)
    assert cold_cached < 10, cold_cached
    same_or_near_tie(cold, warm)


def test_a_fork_of_a_shared_prefix_goes_back_to_a_checkpoint_inside_it(
    swa_model: Path, start_server: StartServer
) -> None:
    srv = serve(start_server, swa_model, parallel=2, multiuser_cache=True)
    a = LONG + "question one"
    complete(srv.url, a, temperature=0, num_predict=MOVE_ON, ignore_eos=True)
    # B shares LONG with A's slot, which moved far past A's prompt: the fork goes back to the
    # checkpoint at 256, inside LONG.
    b = LONG + "another question"
    warm, cached = greedy(srv.url, b, 12)
    assert SPARK_SLIDING_WINDOW <= cached < n_tokens(srv.url, LONG), cached
    plain = serve(start_server, swa_model, parallel=1)
    cold, _ = greedy(plain.url, b, 12)
    same_or_near_tie(cold, warm)


@pytest.mark.parametrize("value", [-1, 65, -(1 << 62), 1 << 62])
def test_an_out_of_range_ctx_checkpoints_is_refused(tiny_model: Path, value: int) -> None:
    with pytest.raises(ValueError, match="ctx-checkpoints"):
        Server(str(tiny_model), port=0, ctx_checkpoints=value).start()


@pytest.mark.parametrize("value", ["-5", "65", "lots", "1.5"])
def test_the_cli_refuses_a_bad_ctx_checkpoints_with_exit_2(tiny_model: Path, value: str) -> None:
    assert_serve_refuses(tiny_model, "ctx-checkpoints", value)
