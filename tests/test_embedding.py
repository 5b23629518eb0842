"""POST /embedding and Client.embed, on the tiny model and the default model."""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import httpx
import pytest

from llamarunner import BadRequestError, Server

from helpers import complete
from tinymodel import N_EMBD


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


@pytest.fixture(scope="module")
def small_batch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("emb") / "tiny.gguf")
    srv = Server(str(model), port=0, parallel=2, ctx_size=256, batch_size=32, threads=2)
    srv.start().wait_ready(60)
    yield srv
    srv.stop()


def test_embedding_shape_and_determinism(small_batch: Server) -> None:
    r = httpx.post(f"{small_batch.url}/embedding", json={"content": "the cat and the dog"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["embedding"]) == N_EMBD
    assert body["prompt_eval_count"] >= 5
    again = httpx.post(f"{small_batch.url}/embedding", json={"content": "the cat and the dog"})
    assert again.json()["embedding"] == body["embedding"]
    norm = math.sqrt(sum(x * x for x in body["embedding"]))
    assert abs(norm - 1.0) > 1e-3, "the native endpoint does not normalize"


def test_longer_than_the_batch_size(small_batch: Server) -> None:
    text = "the cat and the dog " * 5  # ~130 tokens, batch size 32
    v = small_batch.client().embed(text)
    assert len(v) == N_EMBD


def test_independent_of_concurrent_work(small_batch: Server) -> None:
    client = small_batch.client()
    alone = client.embed("hello world")
    with ThreadPoolExecutor(3) as pool:
        gen = pool.submit(complete, small_batch.url, "the world", num_predict=100)
        beside = [pool.submit(client.embed, "hello world") for _ in range(4)]
        for f in beside:
            assert cosine(f.result(), alone) > 0.9999
        gen.result()


def test_too_long_is_400_or_truncated(small_batch: Server) -> None:
    client = small_batch.client()
    text = "the cat " * 400
    with pytest.raises(BadRequestError) as e:
        client.embed(text)
    assert e.value.type == "context_length_exceeded"
    assert "exceeds the context length" in e.value.message
    assert len(client.embed(text, truncate=True)) == N_EMBD
    # The slot survived.
    assert len(client.embed("ok")) == N_EMBD


@pytest.mark.parametrize("body", [{}, {"content": ""}, {"content": 3}])
def test_bad_embedding_requests(small_batch: Server, body: dict[str, object]) -> None:
    r = httpx.post(f"{small_batch.url}/embedding", json=body)
    assert r.status_code == 400


def test_async_embed(small_batch: Server) -> None:
    import asyncio

    from llamarunner import AsyncClient

    async def main() -> list[float]:
        async with AsyncClient(small_batch.url) as c:
            return await c.embed("hello world")

    assert asyncio.run(main()) == small_batch.client().embed("hello world")


@pytest.mark.real_model
def test_default_model_embeddings_are_meaningful(
    default_model: Path, start_server: Callable[..., Server]
) -> None:
    srv = start_server(default_model, ctx_size=512)
    client = srv.client()
    cat = client.embed("The cat sat on the mat.")
    kitten = client.embed("A kitten was sitting on the rug.")
    finance = client.embed("Quarterly revenue grew by four percent.")
    assert len(cat) == 640
    assert cosine(cat, kitten) > cosine(cat, finance)
