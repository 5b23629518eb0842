"""KV-cache reuse and context shift on the real default model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llamarunner import Server

from helpers import complete

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
