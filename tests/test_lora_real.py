"""LoRA adapters on the real default model (Gemma 3 270M): two random adapters generated at
test time from the model's own tensor shapes (``tinylora.adapter_for_model``), small enough to
leave the model coherent. Greedy output: scale 0 is the base model, each adapter changes it,
and the two together differ from either alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llamarunner import Server

from helpers import complete
from tinylora import adapter_for_model

pytestmark = pytest.mark.real_model

PROMPTS = ("Q: What is the capital of France?\nA:", "The three primary colors are")
GREEDY: dict[str, Any] = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def servers(
    default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    root = tmp_path_factory.mktemp("gemma-lora")
    first = adapter_for_model(default_model, root / "first.gguf", seed=1)
    second = adapter_for_model(default_model, root / "second.gguf", seed=2, layers=9)
    # No drafting: each server adapts how far it drafts to its own step times, so the same
    # request could be verified in batches of other widths on the two (the kernels are not
    # batch-invariant, and this model has near-ties within 16 tokens).
    settings: dict[str, Any] = {
        "port": 0,
        "threads": 2,
        "parallel": 2,
        "ctx_size": 1024,
        "draft_max": 0,
    }
    with (
        Server(str(default_model), lora=[f"{first}:0", f"{second}:0"], **settings) as adapted,
        Server(str(default_model), **settings) as plain,
    ):
        yield adapted, plain


def texts(url: str, lora: list[dict[str, Any]] | None = None) -> list[str]:
    body = {} if lora is None else {"lora": lora}
    return [complete(url, p, body, **GREEDY)[0] for p in PROMPTS]


def test_generated_adapters_scale_and_compose(servers: tuple[Server, Server]) -> None:
    adapted, plain = servers
    # Both servers get the same requests in the same order, so their positions are decoded in
    # batches of the same shapes: a first request decodes its whole prompt, the same prompt
    # again only its last token (the rest is cached). Kernels are not batch-invariant (helpers,
    # NEAR_TIE; " Paris" and " The" are 0.011 nats apart on a machine without AVX2), so a text
    # is compared with the base text of a request that was decoded as it was.
    base = texts(plain.url)
    base_cached = texts(plain.url)
    assert texts(adapted.url) == base
    # The same scale set as the default one (both 0): the prompts' caches are used.
    assert texts(adapted.url, [{"id": 0, "scale": 0}, {"id": 1, "scale": 0}]) == base_cached
    first = texts(adapted.url, [{"id": 0, "scale": 1}])
    second = texts(adapted.url, [{"id": 1, "scale": 1}])
    both = texts(adapted.url, [{"id": 0, "scale": 1}, {"id": 1, "scale": 1}])
    assert first != base and second != base
    assert both != first and both != second
