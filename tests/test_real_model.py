"""End to end on the real default model (Gemma 3 270M Q4_K_M): text quality and batching."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import complete
from llamarunner import Server

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def gemma(default_model: Path) -> Iterator[Server]:
    with Server(str(default_model), port=0, parallel=4, ctx_size=1024, threads=2) as srv:
        yield srv


def test_answers_a_factual_prompt(gemma: Server) -> None:
    text, final = complete(gemma.url, "The capital of France is", temperature=0, num_predict=8)
    assert "Paris" in text
    assert final["done_reason"] == "length"
    seconds = final["eval_duration"] / 1e9
    print(f"\nsingle stream: {final['eval_count'] / max(seconds, 1e-9):.1f} tokens/s")


def test_four_parallel_requests_equal_their_sequential_outputs(gemma: Server) -> None:
    prompts = [
        "Write one sentence about the sea.",
        "List three colours:",
        "The opposite of hot is",
        "Once upon a time, in a small village,",
    ]
    sequential = [complete(gemma.url, p, temperature=0, num_predict=32)[0] for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(
            pool.map(lambda p: complete(gemma.url, p, temperature=0, num_predict=32)[0], prompts)
        )
    for p, s, q in zip(prompts, sequential, parallel):
        assert s == q, f"{p!r}: sequential {s!r} != parallel {q!r}"
        assert len(s) > 10
