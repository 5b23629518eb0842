"""KV-cache reuse and context shift on the real default model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from llamarunner import Server

from helpers import complete, ndjson, slots_processing, wait_until

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def small_ctx(default_model: Path) -> Iterator[Server]:
    with Server(str(default_model), port=0, parallel=2, ctx_size=256, threads=2) as srv:
        yield srv


def test_identical_request_decodes_one_prompt_token(small_ctx: Server) -> None:
    prompt = "The history of the printing press begins"
    _, first = complete(small_ctx.url, prompt, temperature=0, num_predict=4)
    _, second = complete(small_ctx.url, prompt, temperature=0, num_predict=4)
    assert second["prompt_cached_count"] == second["prompt_eval_count"] - 1
    assert first["prompt_eval_count"] == second["prompt_eval_count"]


def test_chat_follow_up_reuses_everything_before_the_new_text(small_ctx: Server) -> None:
    prompt = "Q: Name a large animal that lives in the sea.\nA:"
    answer, first = complete(small_ctx.url, prompt, temperature=0, num_predict=12, stop=["\n"])
    follow = prompt + answer + "\nQ: And a small one?\nA:"
    _, second = complete(small_ctx.url, follow, temperature=0, num_predict=4)
    # Everything up to the end of the returned answer is reused (token boundaries may merge
    # at the seam, so allow the last token of the answer to be decoded again).
    reused_at_least = first["prompt_eval_count"] + first["eval_count"] - 2
    assert second["prompt_cached_count"] >= reused_at_least, (first, second)


@pytest.mark.timeout(600)  # 1000 tokens on two threads: the slowest test of the suite
def test_context_shift_generates_past_the_slot(small_ctx: Server) -> None:
    text, final = complete(
        small_ctx.url,
        "Write a long story about a lighthouse keeper.",
        temperature=0.7,
        seed=1,
        num_predict=1000,
        ignore_eos=True,
    )
    assert final["eval_count"] == 1000
    assert final["done_reason"] == "length"
    # Coherent: mostly words, not a degenerate stream of one token.
    words = text.split()
    assert len(words) > 300
    assert len(set(words)) > 50


def test_without_shift_it_ends_with_length_before_overflowing(small_ctx: Server) -> None:
    _, final = complete(
        small_ctx.url,
        "Write a long story about a lighthouse keeper.",
        {"shift": False},
        num_predict=1000,
        ignore_eos=True,
    )
    assert final["done_reason"] == "length"
    assert final["prompt_eval_count"] + final["eval_count"] <= 256 + 1


def test_multiuser_cache_forks_a_shared_system_prompt(
    default_model: Path, start_server: Callable[..., Server]
) -> None:
    srv = start_server(default_model, parallel=2, ctx_size=1024, multiuser_cache=True)
    system = (
        "You are the assistant of a small public library. You answer questions about opening "
        "hours, borrowing rules, late fees, events for children and the reading room. Answer "
        "in one short sentence, politely, and never invent a rule you were not told. "
    ) * 3
    # User A holds slot 0 (busy, generating) with the system prompt in its cache.
    with httpx.stream(
        "POST",
        f"{srv.url}/completion",
        json={
            "prompt": system + "User: When do you open?\nAssistant:",
            "options": {"num_predict": 300, "ignore_eos": True},
        },
        timeout=300,
    ) as a:
        a_lines = ndjson(a)  # kept: a dropped iterator closes the connection
        next(a_lines)
        text, final = complete(
            srv.url, system + "User: Can I renew a book?\nAssistant:", temperature=0, num_predict=8
        )
        # A was still generating when B ended: B could not have found A's slot free (and
        # extended it); its prefix came by a fork.
        wait_until(lambda: slots_processing(srv.url) <= 1, "B to leave its slot")
        assert slots_processing(srv.url) == 1, "user A ended before user B did"
    # User B's slot got the shared prefix by a fork instead of recomputing it.
    assert final["prompt_cached_count"] >= final["prompt_eval_count"] - 12, final
    assert text.strip(), "a real answer after the fork"
