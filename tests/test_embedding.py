"""POST /embedding and Client.embed, on the tiny model and the default model."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import pytest

from llamarunner import BadRequestError, Server

from helpers import Neighbour
from tinymodel import N_EMBD, byte_tokens, hidden_states, model_tensors, write_tiny_model


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


@pytest.fixture(scope="module")
def small_batch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = write_tiny_model(tmp_path_factory.mktemp("emb") / "tiny.gguf")
    # Flash attention on: the arithmetic the numpy reference reproduces (see hidden_states).
    # `max_tokens`: the `Neighbour` generation must outlast the test beside it (without it, a
    # request stops at ten 256-token slot contexts, a second on the tiny model).
    srv = Server(
        str(model),
        port=0,
        parallel=2,
        ctx_size=256,
        batch_size=32,
        threads=2,
        flash_attn="on",
        max_tokens=10**9,
    )
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


def random_text(n: int, seed: int) -> str:
    """``n`` letters, no spaces, not starting with "a": one byte token each (`byte_tokens`)."""
    rng = random.Random(seed)
    return "x" + "".join(rng.choice("bcdefghijklmnopqrstuvwxyz") for _ in range(n - 1))


def reference_embedding(text: str, tensors: dict[str, np.ndarray]) -> np.ndarray:
    """Mean pooling of the numpy forward pass over the whole input in one piece."""
    return hidden_states(byte_tokens(text), tensors).mean(axis=0)


def assert_agrees(got: list[float], want: np.ndarray) -> None:
    # Leaving out one token of 100 (BOS, say) moves the mean by about 1e-2; the reference
    # agrees to about 3e-5 (float16 keys and values included).
    assert cosine(got, list(want)) > 1 - 1e-7
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=3e-4)


def test_longer_than_the_batch_size(small_batch: Server) -> None:
    """About 200 tokens through a server whose batch is 32: the mean of the per-token
    embeddings of the whole input, as a forward pass over all of it at once gives it."""
    text = random_text(200, seed=1)
    r = httpx.post(f"{small_batch.url}/embedding", json={"content": text}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_eval_count"] == len(byte_tokens(text)) > 32
    assert_agrees(r.json()["embedding"], reference_embedding(text, model_tensors()))


def test_pieces_of_a_large_vocabulary_agree_with_one_piece(
    tmp_path: Path, start_server: Callable[..., Server]
) -> None:
    """A generative model's embedding is mean-pooled piece by piece, 64 MiB of logits at a
    time: with 70,000 tokens in the vocabulary a piece is 239 tokens, so 600 tokens take three
    pieces through the causal KV cache. The result is the mean over the whole input."""
    extra = 70_000 - 269
    model = write_tiny_model(tmp_path / "big-vocab.gguf", extra_tokens=extra)
    srv = start_server(model, ctx_size=1024, flash_attn="on")
    tensors = model_tensors(extra_tokens=extra)
    for n in (100, 600):
        text = random_text(n, seed=n)
        r = httpx.post(f"{srv.url}/embedding", json={"content": text}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["prompt_eval_count"] == len(byte_tokens(text))
        assert_agrees(r.json()["embedding"], reference_embedding(text, tensors))


BIG_VOCAB_EXTRA = 70_000 - 269


@pytest.fixture(scope="module")
def big_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 70,000-token vocabulary: a generative model's embedding input is
    decoded in pieces of 32 MiB of logits, 119 tokens here."""
    path = tmp_path_factory.mktemp("pooling") / "big-vocab.gguf"
    return write_tiny_model(path, extra_tokens=BIG_VOCAB_EXTRA)


@pytest.mark.parametrize("pooling", ["none", "cls", "last", "mean"])
def test_pooling_chooses_how_the_tokens_outputs_pool(
    big_vocab_model: Path, start_server: Callable[..., Server], pooling: str
) -> None:
    """``--pooling`` over an input of three pieces: every token's output in order (none), the
    first token's (cls), the last's (last), their mean (mean), as a forward pass over the
    whole input gives them. With none, the routes whose clients read one vector per input
    refuse."""
    srv = start_server(big_vocab_model, ctx_size=1024, flash_attn="on", pooling=pooling)
    text = random_text(300, seed=3)
    tokens = byte_tokens(text)
    rows = hidden_states(tokens, model_tensors(extra_tokens=BIG_VOCAB_EXTRA))
    r = httpx.post(f"{srv.url}/embedding", json={"content": text}, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()["embedding"]
    if pooling != "none":
        want = {"cls": rows[0], "last": rows[-1], "mean": rows.mean(axis=0)}[pooling]
        assert_agrees(got, want)
        return
    assert len(got) == len(tokens) and all(len(row) == N_EMBD for row in got)
    # One token's output, unlike a mean, keeps its rounding (float16 keys and values): 1e-3.
    np.testing.assert_allclose(np.array(got), rows, rtol=0, atol=1e-3)
    for path, body in [
        ("/v1/embeddings", {"input": text}),
        ("/api/embed", {"model": "big-vocab", "input": text}),
    ]:
        r = httpx.post(f"{srv.url}{path}", json=body, timeout=30)
        assert r.status_code == 400 and "--pooling none" in r.text, (path, r.text)


def test_independent_of_concurrent_work(small_batch: Server) -> None:
    client = small_batch.client()
    alone = client.embed("hello world")
    # A generation runs in the main context for the whole time the embeddings are computed:
    # it was generating before they were sent, and once they came back it had made progress,
    # was still decoding and had never paused (nothing reads its stream, so a pause would
    # have lasted): each step that computed an embedding (one a step) decoded it too.
    with Neighbour(small_batch.url) as neighbour, ThreadPoolExecutor(4) as pool:
        before = neighbour.generated()
        beside = [pool.submit(client.embed, "hello world") for _ in range(4)]
        for f in beside:
            assert f.result() == alone  # a context of its own: bit for bit
        neighbour.assert_generating(since=before)
        neighbour.still_running()


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


@pytest.mark.parametrize(
    ("body", "kind", "fragment"),
    [
        ({}, "invalid_request", "content"),
        ({"content": ""}, "invalid_request", "content"),
        ({"content": 3}, "invalid_json", "content"),
        ({"content": "x", "truncate": "yes"}, "invalid_json", "truncate"),
    ],
)
def test_bad_embedding_requests(
    small_batch: Server, body: dict[str, object], kind: str, fragment: str
) -> None:
    r = httpx.post(f"{small_batch.url}/embedding", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == kind, err
    assert fragment in err["message"], err
    r = httpx.post(f"{small_batch.url}/embedding", content=b"{")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_json"


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
